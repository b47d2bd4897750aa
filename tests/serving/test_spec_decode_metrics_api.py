"""Per-request speculative-decoding stats over HTTP (vLLM's --per-request-spec-decode-metrics), on the
demo pair served in process: the numbers are checked against what the tokens imply by hand (each
step's verified drafts replayed from the draft budget, the completion's length from the accepted
counts), a summary is the detailed response less its per-step arrays, a stream's usage chunk carries
what the whole response does, and where there are none (the flag off, more than one choice, plain
decoding) the response has no `metrics` key at all."""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter

import httpx
import pytest
from fake_engine import call, fake_app

from target_service.serving.api import ServerHolder, create_app
from target_service.serving.openai_server import OpenAIServer
from target_service.serving.replica import Replica
from target_service.serving.serve_args import ServeArgs

SETTINGS = dict(admin_port=None, device="cpu", dtype="float32", max_model_len=256, kv_cache_memory="16MiB",
                max_num_seqs=8)
CODE = ["def {name}(items):\n    result = ", "class {Name}:\n    def __init__(self):\n        self.",
        "import os\n\n\ndef {name}(path):\n    ", "for {name} in range(10):\n    print("]
WHOLE_KEYS = {"id", "object", "created", "model", "choices", "usage"}


def app_over(server) -> object:
    holder = ServerHolder()
    holder.install(server)
    return create_app(holder)


def server_like(replica: Replica, level: str | None) -> OpenAIServer:
    """Another server over the replica's engine, at another level."""
    base = replica.server
    return OpenAIServer(base.engine, base.tokenizer, model_name=base.model_name,
                        max_model_len=base.max_model_len, target_dir=base.target_dir,
                        spec_decode_metrics=level)


@pytest.fixture(scope="module")
def served():
    replica = Replica(ServeArgs(per_request_spec_decode_metrics="detailed", **SETTINGS))
    plain = Replica(ServeArgs(drafter="none", per_request_spec_decode_metrics="detailed", **SETTINGS))
    apps = {"detailed": app_over(replica.server), "summary": app_over(server_like(replica, "summary")),
            "off": app_over(server_like(replica, None)), "plain": app_over(plain.server)}
    yield replica, apps
    plain.close()
    replica.close()


@pytest.fixture
def rng():
    seed = random.randrange(2**31)
    print(f"seed {seed}")
    return random.Random(seed)


def code_prompt(rng: random.Random) -> str:
    name = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 9)))
    return rng.choice(CODE).format(name=name, Name=name.capitalize())


def post(app, path: str, body: dict) -> dict:
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            response = await http.post(path, json=body)
            assert response.status_code == 200, response.text
            return response.json()
    return asyncio.run(main())


def streamed(app, path: str, body: dict) -> list[dict]:
    """Every chunk of a stream, [DONE] left off."""
    async def main():
        transport = httpx.ASGITransport(app=app)
        async with (httpx.AsyncClient(transport=transport, base_url="http://t") as http,
                    http.stream("POST", path, json={**body, "stream": True}) as response):
            assert response.status_code == 200
            lines = [line async for line in response.aiter_lines()]
            return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    events = asyncio.run(main())
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


def with_usage(body: dict) -> dict:
    return {**body, "stream_options": {"include_usage": True}}


def greedy(rng: random.Random, **fields) -> dict:
    return {"prompt": code_prompt(rng), "max_tokens": rng.randint(12, 48), "temperature": 0,
            "ignore_eos": True, **fields}


def replayed_drafts(per_step_accepted: list[int], k: int, max_tokens: int) -> tuple[list[int], int]:
    """(drafts each step verified, output tokens the spec steps leave unemitted), by hand: the prefill
    gives the first token; a step verifies min(K, tokens left - 1) drafts (max_model_len far) and
    emits the accepted ones and one more. What is left is 0, or 1: the last token alone, a plain
    step, which is no spec step."""
    drafted, left = [], max_tokens - 1
    for accepted in per_step_accepted:
        drafted.append(min(k, left - 1))
        left -= accepted + 1
    return drafted, left


def test_detailed_stats_are_what_the_tokens_imply(served, rng):
    replica, apps = served
    k = replica.async_engine.engine.num_speculative_tokens
    accepted_anywhere = 0
    for _ in range(3):
        body = greedy(rng)
        response = post(apps["detailed"], "/v1/completions", body)
        stats = response["metrics"]["speculative_decoding"]
        steps = stats["per_step_accepted"]
        drafted, left = replayed_drafts(steps, k, body["max_tokens"])
        assert stats["per_step_drafted"] == drafted and min(drafted) >= 1
        assert response["usage"]["completion_tokens"] == body["max_tokens"]
        assert left in (0, 1)  # accepted = output tokens - 1 (the prefill's) - spec steps - plain steps
        by_accepted = Counter(steps)
        assert stats["acceptance_histogram"] == [by_accepted[j] for j in range(k + 1)]
        assert stats["num_spec_tokens"] == k and stats["num_spec_steps"] == len(steps) > 0
        assert stats["num_accepted_draft_tokens"] == sum(steps)
        assert stats["num_draft_tokens"] == sum(drafted)
        assert stats["mean_acceptance_length"] == pytest.approx(1 + sum(steps) / len(steps))
        assert stats["draft_acceptance_rate"] == pytest.approx(sum(steps) / sum(drafted))
        assert stats["per_position_acceptance_rates"] == pytest.approx(
            [sum(a > i for a in steps) / len(steps) for i in range(k)])
        dflash_steps = {"num_spec_steps": len(steps), "num_draft_tokens": sum(drafted),
                        "num_accepted_draft_tokens": sum(steps),
                        "mean_acceptance_length": stats["mean_acceptance_length"]}
        assert stats["per_proposer"] == {"dflash": dflash_steps}  # the DFlash drafter drafted every step
        accepted_anywhere += sum(steps)
    assert accepted_anywhere > 0  # the demo drafter does predict code: the histogram has more than bin 0


def test_a_summary_is_the_detailed_stats_less_the_steps(served, rng):
    _, apps = served
    body = greedy(rng)
    detailed = post(apps["detailed"], "/v1/completions", body)["metrics"]["speculative_decoding"]
    summary = post(apps["summary"], "/v1/completions", body)["metrics"]["speculative_decoding"]
    assert "per_step_accepted" not in summary and "per_step_drafted" not in summary
    assert summary == {name: value for name, value in detailed.items() if not name.startswith("per_step_")}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_streams_usage_chunk_carries_the_whole_responses_metrics(served, rng, path):
    _, apps = served
    body = greedy(rng)
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": body.pop("prompt")}]
    whole = post(apps["detailed"], path, body)
    chunks = streamed(apps["detailed"], path, with_usage(body))
    *tokens, usage = chunks
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    assert usage["metrics"] == whole["metrics"] and list(whole)[-1] == "metrics"  # last, as vLLM's
    assert all("metrics" not in chunk for chunk in tokens)
    without_usage = streamed(apps["detailed"], path, body)
    assert all("metrics" not in chunk for chunk in without_usage)  # no usage chunk: nowhere to put it


def test_off_by_default_a_response_is_unchanged(served, rng):
    _, apps = served
    assert ServeArgs.model_fields["per_request_spec_decode_metrics"].default is None
    body = greedy(rng)
    off = post(apps["off"], "/v1/completions", body)
    on = post(apps["detailed"], "/v1/completions", body)
    assert set(off) == WHOLE_KEYS and set(on) == WHOLE_KEYS | {"metrics"}
    assert off["choices"] == on["choices"] and off["usage"] == on["usage"]
    chunks = streamed(apps["off"], "/v1/completions", with_usage(body))
    assert all("metrics" not in chunk for chunk in chunks) and chunks[-1]["choices"] == []


@pytest.mark.parametrize("fields", [{"n": 2}, {"prompt": ["def f(x):\n    ", "class A:\n    "]}])
def test_more_than_one_choice_has_no_metrics(served, rng, fields):
    _, apps = served
    body = greedy(rng, **fields)
    response = post(apps["detailed"], "/v1/completions", body)
    assert len(response["choices"]) == 2 and set(response) == WHOLE_KEYS
    chunks = streamed(apps["detailed"], "/v1/completions", with_usage(body))
    assert chunks[-1]["choices"] == [] and all("metrics" not in chunk for chunk in chunks)


def test_plain_decoding_has_no_metrics(served, rng):
    _, apps = served
    body = greedy(rng)
    assert set(post(apps["plain"], "/v1/completions", body)) == WHOLE_KEYS
    chunks = streamed(apps["plain"], "/v1/completions", with_usage(body))
    assert all("metrics" not in chunk for chunk in chunks)


def test_the_openapi_schema_describes_metrics_as_optional_and_the_steps_as_detailed_only():
    schemas = create_app(ServerHolder()).openapi()["components"]["schemas"]
    for response in ("CompletionResponse", "ChatCompletionResponse"):
        assert "metrics" in schemas[response]["properties"]
        assert "metrics" not in schemas[response].get("required", [])
    stats = schemas["SpeculativeDecodingMetrics"]
    optional = {"per_step_accepted", "per_step_drafted", "per_proposer"}
    assert set(stats["properties"]) - set(stats["required"]) == optional


@pytest.mark.parametrize("level, body, per_step", [
    ("detailed", {"prompt": "ab"}, [True]),
    ("detailed", {"prompt": "ab", "n": 3}, [False] * 3),  # suppressed anyway: the steps are not kept
    ("detailed", {"prompt": ["ab", "cd"]}, [False] * 2),
    ("summary", {"prompt": "ab"}, [False]),
    (None, {"prompt": "ab"}, [False]),
])
def test_the_engine_keeps_the_steps_only_for_a_detailed_one_choice_request(level, body, per_step):
    app, engine = fake_app(spec_decode_metrics=level)
    assert call(app, "POST", "/v1/completions", json={**body, "max_tokens": 4}).status_code == 200
    assert [params.spec_decode_per_step for _, params in engine.generated] == per_step


def test_a_requests_own_num_speculative_tokens_caps_its_drafts_and_changes_no_token(served, rng):
    """The extension field: at most that many drafts count per step (replayed by hand as above, with
    K the request's), 0 none at all; the text is the one without it; a bad value is a 400 naming it."""
    replica, apps = served
    k = replica.async_engine.engine.num_speculative_tokens
    body = greedy(rng, max_tokens=rng.randint(24, 48))
    free = post(apps["detailed"], "/v1/completions", body)
    own = rng.randint(1, k - 1)
    capped = post(apps["detailed"], "/v1/completions", {**body, "num_speculative_tokens": own})
    assert capped["choices"][0]["text"] == free["choices"][0]["text"]
    stats = capped["metrics"]["speculative_decoding"]
    drafted, _ = replayed_drafts(stats["per_step_accepted"], own, body["max_tokens"])
    assert stats["per_step_drafted"] == drafted and max(drafted) <= own
    none = post(apps["detailed"], "/v1/completions", {**body, "num_speculative_tokens": 0})
    assert none["choices"][0]["text"] == free["choices"][0]["text"]
    assert "metrics" not in none or none["metrics"]["speculative_decoding"]["num_spec_steps"] == 0

    async def refused():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=apps["detailed"]),
                                     base_url="http://t") as http:
            return await http.post("/v1/completions", json={**body, "num_speculative_tokens": -1})
    response = asyncio.run(refused())
    assert response.status_code == 400
    assert "num_speculative_tokens" in response.json()["error"]["message"]
