"""The OpenAI-compatible HTTP API in process (ASGI, no sockets), driven by the `openai` client: greedy
completions and chats equal the offline LLM, a stream concatenates to the same text, every error is
OpenAI-shaped with its status, and a refused request changes nothing in the engine."""

import asyncio
import json

import httpx
import openai
import pytest

from target_service.assembly.demo import demo_target_path
from target_service.engine.sampling_params import SamplingParams
from target_service.llm import LLM
from target_service.serving.api import ServerHolder, create_app
from target_service.serving.chat_template import load_chat_template
from target_service.serving.replica import Replica
from target_service.serving.serve_args import ServeArgs

ARGS = dict(
    device="cpu", dtype="float32", kv_cache_memory="16MiB", max_model_len=256, max_num_seqs=4, admin_port=None
)
PROMPTS = ["def parse_args(argv):\n    parser = ", "class Stack:\n    def __init__(self):\n"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    key_file = tmp_path_factory.mktemp("key") / "api_key"
    key_file.write_text("secret-key\n")
    replica = Replica(ServeArgs(api_key_file=str(key_file), **ARGS))
    holder = ServerHolder()
    holder.install(replica.server, replica.metrics)
    yield replica, create_app(holder)
    replica.close()


def client(app, key="secret-key") -> openai.AsyncOpenAI:
    transport = httpx.ASGITransport(app=app)
    return openai.AsyncOpenAI(
        base_url="http://dflash.test/v1",
        api_key=key,
        max_retries=0,
        http_client=httpx.AsyncClient(transport=transport, base_url="http://dflash.test"),
    )


def offline(prompts, max_tokens=24):
    llm = LLM(**{k: v for k, v in ARGS.items() if k != "admin_port"})
    outputs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0))
    llm.close()
    return outputs


def test_completions_and_their_stream_equal_the_offline_llm(served):
    replica, app = served
    expected = offline(PROMPTS)

    async def main():
        api = client(app)
        whole = await api.completions.create(
            model="dflash-demo", prompt=PROMPTS, max_tokens=24, temperature=0
        )
        stream = await api.completions.create(
            model="dflash-demo",
            prompt=PROMPTS[0],
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        return whole, chunks

    whole, chunks = asyncio.run(main())
    assert [choice.text for choice in whole.choices] == [out.outputs[0].text for out in expected]
    assert whole.usage.completion_tokens == sum(len(out.outputs[0].token_ids) for out in expected)
    assert whole.usage.prompt_tokens == sum(len(out.prompt_token_ids) for out in expected)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected[0].outputs[0].text
    assert (
        chunks[-1].usage.completion_tokens == len(expected[0].outputs[0].token_ids) and not chunks[-1].choices
    )
    assert replica.assembly.engine.num_requests == 0


def test_chat_equals_the_offline_llm_on_the_rendered_template(served):
    replica, app = served
    messages = [{"role": "user", "content": "Write a function that adds two numbers."}]
    prompt = load_chat_template(demo_target_path()).render(messages, True)
    tokenizer = replica.assembly.tokenizer
    expected = offline([tokenizer.encode(prompt, add_special_tokens=False).ids])[0].outputs[0]

    async def main():
        api = client(app)
        reply = await api.chat.completions.create(
            model="dflash-demo", messages=messages, max_tokens=24, temperature=0
        )
        stream = await api.chat.completions.create(
            model="dflash-demo", messages=messages, max_tokens=24, temperature=0, stream=True
        )
        return reply, [chunk async for chunk in stream]

    reply, chunks = asyncio.run(main())
    assert reply.choices[0].message.content == expected.text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text


def test_every_refusal_is_openai_shaped_and_changes_nothing(served):
    replica, app = served
    engine = replica.assembly.engine

    async def main():
        api = client(app)
        with pytest.raises(openai.BadRequestError) as bad:
            await api.completions.create(model="dflash-demo", prompt="x", n=0)
        assert bad.value.body["param"] == "n"
        with pytest.raises(openai.BadRequestError, match="maximum context length"):
            await api.completions.create(model="dflash-demo", prompt="x " * 400, max_tokens=4)
        with pytest.raises(openai.AuthenticationError):
            await client(app, key="wrong").completions.create(model="dflash-demo", prompt="x")
        with pytest.raises(openai.NotFoundError):
            await api.completions.create(model="gpt-4", prompt="x")
        queue = type(replica.async_engine)
        full = property(lambda engine: engine.max_waiting)  # the queue, as if every place were taken
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(queue, "num_waiting", full)
            with pytest.raises(openai.RateLimitError) as busy:
                await api.completions.create(model="dflash-demo", prompt="x", max_tokens=2)
        assert busy.value.response.headers["retry-after"] == "1"
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as raw:
            garbled = await raw.post(
                "/v1/completions", content=b"{not json", headers={"authorization": "Bearer secret-key"}
            )
            assert garbled.status_code == 400 and garbled.json()["error"]["type"] == "invalid_request_error"

    asyncio.run(main())
    assert engine.num_requests == 0 and not engine.has_unfinished
    assert engine.pool_usage().num_used_blocks == 0


def test_models_health_and_metrics(served):
    _, app = served

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as raw:
            health = await raw.get("/health")
            metrics = await raw.get("/metrics")  # no key needed for probes and scrapers
        models = await client(app).models.list()
        return health, metrics, models

    health, metrics, models = asyncio.run(main())
    assert health.status_code == 200 and json.loads(health.text) == {"status": "ok"}
    assert "vllm:spec_decode_num_drafts_total" in metrics.text and "dflash:engine_steps_total" in metrics.text
    assert [m.id for m in models.data] == ["dflash-demo"]


def test_a_draining_server_answers_503_with_retry_after_and_fails_its_health_probe(served):
    replica, app = served

    async def main():
        replica.server.draining = True
        try:
            with pytest.raises(openai.InternalServerError) as unavailable:
                await client(app).completions.create(model="dflash-demo", prompt="x", max_tokens=2)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as raw:
                health = await raw.get("/health")
        finally:
            replica.server.draining = False
        return unavailable.value, health

    error, health = asyncio.run(main())
    assert error.status_code == 503 and error.response.headers["retry-after"] == "1"
    assert error.body["code"] == "service_unavailable" and health.status_code == 503


def test_an_empty_holder_answers_503_loading_then_shut_down_once_cleared():
    holder = ServerHolder()
    app = create_app(holder)

    async def completion_error():
        with pytest.raises(openai.InternalServerError) as unavailable:
            await client(app).completions.create(model="dflash-demo", prompt="x", max_tokens=2)
        return unavailable.value

    loading = asyncio.run(completion_error())
    assert loading.status_code == 503 and "still loading" in loading.body["message"]
    holder.install(object())  # what the routes would call is never reached: the holder is cleared first
    holder.clear()
    closed = asyncio.run(completion_error())
    assert closed.status_code == 503 and "shut down" in closed.body["message"]
