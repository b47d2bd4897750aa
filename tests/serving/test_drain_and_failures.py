"""What a client reads when its request fails alone or the server stops under it (issue 30, items 1
and 5), in process over the demo pair: a request the engine failed is a 500, or in a stream an error
event and [DONE], while the others complete with the offline engine's tokens; a drain lets requests
that finish in time finish, answers new ones 503, and when its time is up ends what still runs with
a 503 (a stream: an error event and [DONE]), every page back in the pool. Tokenizing runs off the
event loop."""

from __future__ import annotations

import asyncio
import json
import random
import threading

import httpx
import pytest

from target_service.engine.sampling_params import SamplingParams
from target_service.llm import LLM
from target_service.runner import model_runner
from target_service.serving.api import ServerHolder, create_app
from target_service.serving.openai_jobs import FAILED_ALONE
from target_service.serving.replica import Replica
from target_service.serving.serve_args import ServeArgs

ARGS = dict(device="cpu", dtype="float32", kv_cache_memory="16MiB", max_model_len=512, max_num_seqs=4,
            admin_port=None)
PROMPTS = ["def parse_args(argv):\n    parser = ", "class Stack:\n    def __init__(self):\n",
           "import os\n\ndef walk(root):\n"]
POISON_SEED = 7_777_777
LONG = {"max_tokens": 400, "temperature": 1.0, "ignore_eos": True}  # runs well past any drain here


@pytest.fixture
def replica():
    replica = Replica(ServeArgs(**ARGS))
    yield replica
    replica.close(0.0)


def app_of(replica: Replica):
    holder = ServerHolder()
    holder.install(replica.server)
    return create_app(holder)


def http(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://dflash.test",
                             timeout=120)


def events_of(response: httpx.Response) -> list:
    """A stream's events, parsed ([DONE] kept as the string)."""
    assert response.status_code == 200, response.text[:300]
    datas = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line.strip()]
    return [data if data == "[DONE]" else json.loads(data) for data in datas]


def offline_greedy(prompts: list[str], max_tokens: int) -> list[str]:
    llm = LLM(**{key: value for key, value in ARGS.items() if key != "admin_port"})
    try:
        outputs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0))
        return [output.outputs[0].text for output in outputs]
    finally:
        llm.close()


def poison_sampling(monkeypatch, after: int) -> None:
    """The POISON_SEED request's sampling raises from its (after + 1)-th call on."""
    real, calls = model_runner.choose_tokens, {"n": 0}

    def choose_tokens(logits, params, generator=None):
        if params.seed == POISON_SEED:
            calls["n"] += 1
            if calls["n"] > after:
                raise RuntimeError("poisoned sampling")
        return real(logits, params, generator)

    monkeypatch.setattr(model_runner, "choose_tokens", choose_tokens)


def assert_pool_empty(replica: Replica) -> None:
    engine = replica.assembly.engine
    usage = engine.pool_usage()
    assert usage.num_used_blocks == 0 and usage.num_seqs == 0 and engine.num_requests == 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_request_the_engine_fails_alone_is_an_error_to_it_alone(replica, monkeypatch, stream):
    expected = offline_greedy(PROMPTS, 24)
    poison_sampling(monkeypatch, after=random.randint(1, 4))
    app = app_of(replica)
    poisoned = {"prompt": "x = ", "max_tokens": 40, "temperature": 1.0, "seed": POISON_SEED,
                "ignore_eos": True, "stream": stream}

    async def main():
        async with http(app) as client:
            greedy = [client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 24,
                                                           "temperature": 0}) for prompt in PROMPTS]
            return await asyncio.gather(client.post("/v1/completions", json=poisoned), *greedy)

    failed, *answers = asyncio.run(main())
    assert [answer.json()["choices"][0]["text"] for answer in answers] == expected
    if stream:
        events = events_of(failed)
        assert events[-1] == "[DONE]" and events[-2]["error"]["message"] == FAILED_ALONE
        assert events[-2]["error"]["type"] == "server_error"
        assert all(event["choices"][0]["finish_reason"] is None for event in events[:-2])
    else:
        assert failed.status_code == 500 and failed.json()["error"]["message"] == FAILED_ALONE
    assert_pool_empty(replica)
    assert replica.server.is_healthy


def test_a_drain_lets_short_requests_finish_and_stops_the_rest_with_an_answer(replica):
    expected = offline_greedy(PROMPTS[:1], 8)
    app, server = app_of(replica), replica.server
    timeout_s = random.uniform(0.5, 1.5)

    async def main():
        async with http(app) as client:
            stream = asyncio.ensure_future(client.post("/v1/completions", json={
                "prompt": PROMPTS[1], "stream": True, **LONG}))
            whole = asyncio.ensure_future(client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": PROMPTS[2]}], **LONG}))
            short = asyncio.ensure_future(client.post("/v1/completions", json={
                "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}))
            while server.num_in_flight < 3:
                await asyncio.sleep(0.01)
            drained = asyncio.ensure_future(asyncio.to_thread(server.drain, timeout_s))
            while not server.draining:
                await asyncio.sleep(0.01)
            refused = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            health = await client.get("/health")
            return await drained, await stream, await whole, await short, refused, health

    stopped, stream, whole, short, refused, health = asyncio.run(main())
    assert stopped == 2
    assert short.json()["choices"][0]["text"] == expected[0]  # it finished within the drain
    events = events_of(stream)
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "service_unavailable"
    assert "drain time" in events[-2]["error"]["message"] and len(events) > 3
    assert whole.status_code == 503 and whole.headers["retry-after"] == "1"
    assert whole.json()["error"]["code"] == "service_unavailable"
    assert refused.status_code == 503 and refused.json()["error"]["message"] == "the server is shutting down"
    assert health.status_code == 503
    assert_pool_empty(replica)


def test_a_drain_with_nothing_left_stops_nothing(replica):
    expected = offline_greedy(PROMPTS[:2], 12)
    app, server = app_of(replica), replica.server

    async def main():
        async with http(app) as client:
            answers = [asyncio.ensure_future(client.post("/v1/completions", json={
                "prompt": prompt, "max_tokens": 12, "temperature": 0})) for prompt in PROMPTS[:2]]
            while server.num_in_flight < 2:
                await asyncio.sleep(0.01)
            stopped = await asyncio.to_thread(server.drain, 60.0)
            return stopped, await asyncio.gather(*answers)

    stopped, answers = asyncio.run(main())
    assert stopped == 0 and [a.json()["choices"][0]["text"] for a in answers] == expected
    assert_pool_empty(replica)


def test_prompts_are_tokenized_off_the_event_loop(replica):
    tokenizer, threads = replica.server.tokenizer, []

    class Recording:
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def encode_batch(self, texts, **options):
            threads.append(threading.current_thread())
            return tokenizer.encode_batch(texts, **options)

    replica.server.tokenizer = Recording()

    async def main():
        async with http(app_of(replica)) as client:
            loop_thread = threading.current_thread()
            answer = await client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 4,
                                                                "temperature": 0})
            chat = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
            return loop_thread, answer, chat

    loop_thread, answer, chat = asyncio.run(main())
    assert answer.status_code == 200 and chat.status_code == 200
    assert len(threads) == 2 and loop_thread not in threads
