"""AsyncEngine: requests streamed from asyncio equal the offline LLM; cancellation frees pages at once,
and so does a request whose event loop closed under it, with the thread serving on; a full queue
refuses without queueing; a bad prompt is refused before anything is queued."""

import asyncio
import time

import pytest
from engine_helpers import make_pair, random_prompts

from target_service.engine.async_engine import AsyncEngine, QueueFull
from target_service.engine.sampling_params import SamplingParams
from target_service.llm import LLM

SETTINGS = dict(num_speculative_tokens=3, kv_cache_memory="4MiB", tokens_per_block=16, max_num_seqs=8,
                max_model_len=128)


def greedy(**fields):
    return SamplingParams(**{"max_tokens": 20, "temperature": 0, "ignore_eos": True, **fields})


@pytest.fixture
def pair(tmp_path):
    return make_pair(tmp_path, tokenizer=True)


async def collect(engine, prompt, params):
    deltas = [delta async for delta in engine.generate(prompt, params)]
    return deltas


def test_concurrent_streams_equal_the_offline_llm_token_for_token(pair):
    target, drafter = pair
    prompts = random_prompts(5, 160)
    offline = LLM(target, drafter, **SETTINGS)
    expected = offline.generate(prompts, greedy())
    offline.close()
    llm = LLM(target, drafter, **SETTINGS)
    engine = AsyncEngine(llm.engine)

    async def main():
        return await asyncio.gather(*(collect(engine, prompt, greedy()) for prompt in prompts))

    streams = asyncio.run(main())
    for deltas, want in zip(streams, expected):
        completion = want.outputs[0]
        assert [t for d in deltas for t in d.token_ids] == completion.token_ids
        assert "".join(d.text for d in deltas) == completion.text
        last = deltas[-1]
        assert last.finished and last.finish_reason == completion.finish_reason == "length"
        assert (last.num_prompt_tokens, last.num_output_tokens) == (len(want.prompt_token_ids), 20)
        assert not any(d.finished for d in deltas[:-1])
    assert llm.engine.num_requests == 0 and llm.engine.pool_usage().num_used_blocks == 0
    engine.shutdown()
    llm.close()


def test_a_stream_cut_by_a_stop_string_never_sent_what_was_cut(pair):
    target, drafter = pair
    prompt = random_prompts(1, 160, low=10, high=20)[0]
    offline = LLM(target, drafter, **SETTINGS)
    text = offline.generate([prompt], greedy(max_tokens=30))[0].outputs[0].text
    words = text.split()
    if len(words) < 4:
        pytest.skip("the random model wrote too few words for a stop string")
    stop = " ".join(words[2:4])
    want = offline.generate([prompt], greedy(max_tokens=30, stop=[stop]))[0].outputs[0]
    offline.close()
    llm = LLM(target, drafter, **SETTINGS)
    engine = AsyncEngine(llm.engine)
    deltas = asyncio.run(collect(engine, prompt, greedy(max_tokens=30, stop=[stop])))
    assert "".join(d.text for d in deltas) == want.text and want.finish_reason == "stop"
    assert stop not in "".join(d.text for d in deltas)
    engine.shutdown()
    llm.close()


def test_closing_a_stream_aborts_the_request_and_frees_its_pages(pair):
    target, drafter = pair
    llm = LLM(target, drafter, **SETTINGS)
    engine = AsyncEngine(llm.engine)

    async def main():
        stream = engine.generate(random_prompts(1, 160, low=30, high=40)[0], greedy(max_tokens=100))
        first = await stream.__anext__()
        assert not first.finished
        used = llm.engine.pool_usage().num_used_blocks
        await stream.aclose()  # the client went away
        for _ in range(200):
            if llm.engine.pool_usage().num_used_blocks == 0 and llm.engine.num_requests == 0:
                return used
            await asyncio.sleep(0.01)
        raise AssertionError("the aborted request still holds pages")

    assert asyncio.run(main()) > 0
    engine.shutdown()
    llm.close()


def test_a_request_whose_event_loop_closed_is_aborted_and_the_thread_serves_on(pair):
    target, drafter = pair
    llm = LLM(target, drafter, **SETTINGS)
    prompts = random_prompts(2, 160, low=30, high=40)
    expected = llm.generate([prompts[1]], greedy())[0].outputs[0].token_ids
    engine = AsyncEngine(llm.engine)
    loop = asyncio.new_event_loop()
    orphan = engine.generate(prompts[0], greedy(max_tokens=100))
    assert not loop.run_until_complete(orphan.__anext__()).finished
    loop.close()  # its consumer never closes the stream: the loop is simply gone
    for _ in range(500):
        if llm.engine.num_requests == 0:
            break
        time.sleep(0.01)
    assert engine.is_healthy and llm.engine.pool_usage().num_used_blocks == 0 and llm.engine.num_requests == 0
    deltas = asyncio.run(collect(engine, prompts[1], greedy()))
    assert [token for delta in deltas for token in delta.token_ids] == list(expected)
    engine.shutdown()
    llm.close()
    del orphan


def test_a_full_queue_and_a_bad_prompt_are_refused_before_anything_is_queued(pair):
    target, drafter = pair
    llm = LLM(target, drafter, **SETTINGS)
    engine = AsyncEngine(llm.engine, max_waiting=0)

    async def first(prompt):
        return await engine.generate(prompt, greedy()).__anext__()

    with pytest.raises(QueueFull, match="requests are already waiting"):
        asyncio.run(first([5, 6, 7]))
    engine.max_waiting = 8
    with pytest.raises(ValueError, match="the prompt is empty"):
        asyncio.run(first([]))
    assert llm.engine.num_requests == 0 and not llm.engine.has_unfinished
    assert asyncio.run(collect(engine, [5, 6, 7], greedy(max_tokens=3)))[-1].num_output_tokens == 3
    engine.shutdown()
    with pytest.raises(RuntimeError, match="shutting down"):
        asyncio.run(first([5, 6, 7]))
    llm.close()
