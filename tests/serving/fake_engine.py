"""The HTTP app over a fake engine: what the routes and the server refuse, and when, with no model.

`FakeEngine` satisfies `EngineClient` and records every call, so a test can tell that a refused
request never reached it (nothing expanded, checked or queued). `FakeTokenizer` maps each character
to one token id, and raises on the text `EXPLODE` (an unexpected fault inside the server).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import httpx

from target_service.assembly.demo import demo_target_path
from target_service.engine.engine_client import RequestDelta
from target_service.engine.outputs import TokenLogprob
from target_service.serving.api import ServerHolder, create_app
from target_service.serving.openai_server import OpenAIServer

VOCAB = 256
MAX_MODEL_LEN = 64
EXPLODE = "explode, please"


class FakeTokenizer:
    @dataclass
    class Encoding:
        ids: list[int]

    def encode(self, text: str, add_special_tokens: bool = True) -> Encoding:
        if text == EXPLODE:
            raise RuntimeError("the tokenizer fell over")
        return self.Encoding([ord(c) % VOCAB for c in text])

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[Encoding]:
        return [self.encode(text, add_special_tokens) for text in texts]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


@dataclass
class FakeEngine:
    max_waiting: int = 256
    num_waiting: int = 0
    num_running: int = 0
    is_healthy: bool = True
    check_blocks: bool = False
    fail_with: Exception | None = None  # generate raises it before its first delta
    checked: list = field(default_factory=list)  # (prompt ids, params) per check
    generated: list = field(default_factory=list)  # (prompt ids, params) per request

    def check(self, prompt_token_ids, params) -> None:
        self.checked.append((list(prompt_token_ids), params))
        if not prompt_token_ids:
            raise ValueError("the prompt is empty; at least one token is needed")
        if any(not 0 <= t < VOCAB for t in prompt_token_ids):
            raise ValueError(f"prompt token ids are outside the vocabulary 0..{VOCAB - 1}")

    def snapshot(self):
        raise NotImplementedError

    async def generate(self, prompt_token_ids, params, request_id=None):
        self.generated.append((list(prompt_token_ids), params))
        if self.fail_with is not None:
            raise self.fail_with
        await asyncio.sleep(0)
        yield RequestDelta(request_id or "r", [1], "ok", finished=True, finish_reason="length",
                           num_prompt_tokens=len(prompt_token_ids), num_output_tokens=1,
                           logprobs=None if params.logprobs is None else [fake_logprob(1, params.logprobs)],
                           prompt_logprobs=None if params.prompt_logprobs is None else
                           [None] + [fake_logprob(t, params.prompt_logprobs) for t in prompt_token_ids[1:]])

    def shutdown(self, timeout: float = 30.0) -> None:
        pass

    @property
    def touched(self) -> bool:
        return bool(self.checked or self.generated)


def fake_logprob(token_id: int, num_top: int) -> TokenLogprob:
    """A made-up logprob of `token_id` with `num_top` made-up most likely tokens."""
    return TokenLogprob(token_id, -1.5, tuple(range(num_top)), tuple(-0.5 - i for i in range(num_top)))


def fake_app(engine: FakeEngine | None = None, server_type=OpenAIServer, tokenizer=None, **options):
    """(app, engine): the real routes over an OpenAIServer (or `server_type`) over `engine`, with
    `tokenizer` (default: a FakeTokenizer); `options` go to the server (api_key)."""
    engine = engine or FakeEngine()
    server = server_type(engine, tokenizer or FakeTokenizer(), model_name="fake", max_model_len=MAX_MODEL_LEN,
                         target_dir=demo_target_path(), **options)
    holder = ServerHolder()
    holder.install(server)
    return create_app(holder), engine


def call(app, method: str, path: str, **request) -> httpx.Response:
    """One request through the app in process. Exceptions the app lets escape are raised (a 500 the
    server failed to shape would fail the test here)."""

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://dflash.test") as client:
            return await client.request(method, path, **request)

    return asyncio.run(main())


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None, *,
                        code: str | None = None) -> dict:
    """The response is OpenAI's error shape with this status (and param, code); returns its error."""
    assert response.status_code == status, (response.status_code, response.text[:300])
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"] and "\n" not in error["message"]
    assert error["type"] == ("server_error" if status >= 500 else
                             "rate_limit_error" if status == 429 else "invalid_request_error")
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error
