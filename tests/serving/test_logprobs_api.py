"""Logprobs over HTTP, driven by the openai client against a replica of a tiny pair served in process:
completions' `logprobs` (tokens, token_logprobs, top_logprobs with the token itself, text_offset),
`echo` with the prompt's logprobs (the first null) and `max_tokens` 0 as lm-evaluation-harness sends
it, chat's `logprobs`/`top_logprobs` in `choices[].logprobs.content`; the values are the offline
engine's, a stream's chunks join to the whole response, and a bad value is a 400 naming its field
before anything is queued."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch
from asgi_openai import client, words
from engine_helpers import make_pair

from target_service.engine.sampling_params import SamplingParams
from target_service.llm import LLM
from target_service.serving.api import ServerHolder, create_app
from target_service.serving.replica import Replica
from target_service.serving.serve_args import ServeArgs

SETTINGS = dict(device="cpu", dtype="float32", kv_cache_memory="4MiB", max_model_len=128, max_num_seqs=8)
TEMPLATE = "{% for message in messages %}{{ message['content'] }} {% endfor %}"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    seed = int(torch.randint(0, 2**31, ()).item())
    torch.manual_seed(seed)
    print(f"seed {seed}")
    target, drafter = make_pair(tmp_path_factory.mktemp("pair"), tokenizer=True)
    (target / "chat_template.jinja").write_text(TEMPLATE)
    replica = Replica(ServeArgs(target=str(target), drafter=str(drafter), admin_port=None, **SETTINGS))
    holder = ServerHolder()
    holder.install(replica.server)
    offline = LLM(str(target), str(drafter), **SETTINGS)
    yield replica, create_app(holder), offline
    offline.close()
    replica.close()


def token_texts(offline: LLM, ids: list[int]) -> list[str]:
    return [offline.tokenizer.decode([i], skip_special_tokens=False) for i in ids]


def text_of(offline: LLM):
    return lambda token_id: token_texts(offline, [token_id])[0]


def greedy(max_tokens: int, **fields) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, **fields)


def offsets(tokens: list[str]) -> list[int]:
    out, at = [], 0
    for token in tokens:
        out.append(at)
        at += len(token)
    return out


def assert_same_entries(got: list, expected: list, texts) -> None:
    """OpenAI's token_logprobs and top_logprobs against the engine's TokenLogprobs."""
    logprobs, tops = got
    assert len(logprobs) == len(tops) == len(expected)
    for value, top, entry in zip(logprobs, tops, expected):
        if entry is None:
            assert value is None and top is None
            continue
        assert value == pytest.approx(entry.logprob, abs=1e-5)
        wanted = dict(zip(map(texts, entry.top_token_ids), entry.top_logprobs))
        wanted.setdefault(texts(entry.token_id), entry.logprob)  # the token itself: up to N + 1
        assert top.keys() == wanted.keys()
        assert list(top.values()) == pytest.approx(list(wanted.values()), abs=1e-5)


def test_completion_logprobs_are_the_engines_in_openais_shape(served):
    replica, app, offline = served
    prompt = words(6)
    expected = offline.generate([prompt], greedy(8, ignore_eos=True, logprobs=3))[0]
    fields = dict(max_tokens=8, temperature=0, logprobs=3, extra_body={"ignore_eos": True})
    reply = asyncio.run(client(app).completions.create(model="target", prompt=prompt, **fields))
    choice, out, texts = reply.choices[0], expected.outputs[0], text_of(offline)
    assert choice.text == out.text
    assert choice.logprobs.tokens == token_texts(offline, out.token_ids)
    assert choice.logprobs.text_offset == offsets(choice.logprobs.tokens)
    assert_same_entries((choice.logprobs.token_logprobs, choice.logprobs.top_logprobs), out.logprobs, texts)
    assert all(3 <= len(top) <= 4 for top in choice.logprobs.top_logprobs)
    assert replica.assembly.engine.num_requests == 0


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_returns_the_prompts_logprobs_as_lm_eval_asks_for_them(served, max_tokens):
    """lm-evaluation-harness's loglikelihood request: token ids, echo, logprobs 1, max_tokens 0 (or 1,
    whose last token it drops); it sums token_logprobs[ctxlen:] and calls a continuation greedy when each
    token's logprob is its top_logprobs' largest."""
    _, app, offline = served
    ids = torch.randint(3, 160, (9,)).tolist()
    expected = offline.generate([ids], greedy(1, logprobs=1, prompt_logprobs=1))[0]
    reply = asyncio.run(client(app).completions.create(
        model="target", prompt=ids, max_tokens=max_tokens, echo=True, logprobs=1, temperature=0))
    choice, texts = reply.choices[0], text_of(offline)
    generated = expected.outputs[0].token_ids[:max_tokens]
    assert choice.text == offline.tokenizer.decode(ids, skip_special_tokens=False) + (
        expected.outputs[0].text if max_tokens else "")
    assert choice.logprobs.tokens == token_texts(offline, ids + generated)
    entries = expected.prompt_logprobs + expected.outputs[0].logprobs[:max_tokens]
    assert_same_entries((choice.logprobs.token_logprobs, choice.logprobs.top_logprobs), entries, texts)
    assert choice.logprobs.text_offset == offsets(choice.logprobs.tokens)
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == max_tokens
    if max_tokens:  # greedy, as lm-eval tells it
        assert choice.logprobs.token_logprobs[-1] == max(choice.logprobs.top_logprobs[-1].values())


def stream_choices(chunks) -> dict[int, dict]:
    """Each choice's streamed text and logprobs, chunk after chunk joined."""
    joined = {}
    for chunk in chunks:
        for choice in chunk.choices:
            into = joined.setdefault(choice.index, {"text": "", "tokens": [], "token_logprobs": [],
                                                     "top_logprobs": [], "text_offset": []})
            into["text"] += choice.text
            if choice.logprobs is not None:
                for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    into[name] += getattr(choice.logprobs, name)
    return joined


def test_a_stream_carries_each_chunks_logprobs_and_joins_to_the_whole_response(served):
    replica, app, _ = served
    fields = dict(model="target", prompt=words(5), max_tokens=7, temperature=0, echo=True, logprobs=2, n=2,
                  stop=["w7"])

    async def main():
        api = client(app)
        whole = await api.completions.create(**fields)
        return whole, [chunk async for chunk in await api.completions.create(stream=True, **fields)]

    whole, chunks = asyncio.run(main())
    streamed = stream_choices(chunks)
    assert sorted(streamed) == [0, 1]
    for choice in whole.choices:
        got = streamed[choice.index]
        assert got["text"] == choice.text
        assert got["tokens"] == choice.logprobs.tokens and got["text_offset"] == choice.logprobs.text_offset
        assert got["token_logprobs"][1:] == pytest.approx(choice.logprobs.token_logprobs[1:], abs=1e-5)
        assert [list(top or ()) for top in got["top_logprobs"]] == [
            list(top or ()) for top in choice.logprobs.top_logprobs]
    assert replica.assembly.engine.num_requests == 0


def test_chat_logprobs_are_openais_content_entries_and_a_stream_joins_to_them(served):
    _, app, _ = served
    fields = dict(model="target", messages=[{"role": "user", "content": words(4)}], max_tokens=6,
                  temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})

    async def main():
        api = client(app)
        whole = await api.chat.completions.create(**fields)
        return whole, [chunk async for chunk in await api.chat.completions.create(stream=True, **fields)]

    whole, chunks = asyncio.run(main())
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == 6
    assert " ".join(entry.token for entry in content) == whole.choices[0].message.content
    for entry in content:
        assert entry.bytes == list(entry.token.encode()) and len(entry.top_logprobs) == 2
        values = [top.logprob for top in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and values[0] == entry.logprob  # greedy: the top one
    streamed = [entry for chunk in chunks for choice in chunk.choices if choice.logprobs is not None
                for entry in choice.logprobs.content]
    assert [entry.token for entry in streamed] == [entry.token for entry in content]
    expected = [entry.logprob for entry in content]
    assert [entry.logprob for entry in streamed] == pytest.approx(expected, abs=1e-5)


def test_processed_greedy_logprobs_are_one_hot_and_minus_infinity_is_sent_as_minus_9999(served):
    _, app, _ = served
    reply = asyncio.run(client(app).completions.create(
        model="target", prompt=words(3), max_tokens=4, temperature=0, logprobs=2,
        extra_body={"logprobs_mode": "processed", "ignore_eos": True}))
    logprobs = reply.choices[0].logprobs
    assert logprobs.token_logprobs == [0.0] * 4
    assert all(sorted(top.values()) == [-9999.0, 0.0] for top in logprobs.top_logprobs)


CHAT = [{"role": "user", "content": "w5"}]
BAD = [
    ("/v1/completions", {"prompt": "w5", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "w5", "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"prompt": "w5", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "w5", "max_tokens": 0, "echo": False, "logprobs": 1}, "max_tokens"),
    ("/v1/completions", {"prompt": "w5", "logprobs": 1, "logprobs_mode": "logits"}, "logprobs_mode"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD)
def test_a_bad_logprob_field_is_a_400_naming_it_before_anything_is_queued(served, path, body, param):
    replica, app, _ = served
    engine = replica.assembly.engine
    steps = engine.counters().num_steps

    async def post():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            return await http.post(path, content=json.dumps(body))

    response = asyncio.run(post())
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and param in error["message"] and "\n" not in error["message"]
    assert engine.counters().num_steps == steps and engine.num_requests == 0
