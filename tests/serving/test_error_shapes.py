"""Every error the HTTP API answers is OpenAI's shape ({"error": {message, type, param, code}}), the
ones FastAPI makes itself included (404, 405, 422), and so is a fault nobody foresaw: a 500 with a
JSON body before the response starts, an error event and [DONE] after. Every answer names its
replica."""

import json
import random
import string

import pytest
from fake_engine import (
    EXPLODE,
    MAX_MODEL_LEN,
    FakeEngine,
    FakeTokenizer,
    assert_openai_error,
    call,
    demo_target_path,
    fake_app,
)

from target_service.serving.api import ServerHolder, create_app
from target_service.serving.api_errors import ApiError
from target_service.serving.openai_server import OpenAIServer


def random_path() -> str:
    return "/" + "".join(random.choices(string.ascii_lowercase + "/-_", k=random.randrange(1, 30)))


def test_an_unknown_route_is_an_openai_404_naming_it():
    app, _ = fake_app()
    for method in ("GET", "POST", "DELETE"):
        path = "/v1/" + random_path().lstrip("/") + "x"
        error = assert_openai_error(call(app, method, path), 404, code="unknown_url")
        assert f"{method} {path}" in error["message"]


@pytest.mark.parametrize(("method", "path", "allow"), [
    ("GET", "/v1/completions", "POST"), ("PUT", "/v1/chat/completions", "POST"),
    ("POST", "/v1/models", "GET"), ("DELETE", "/health", "GET")])
def test_a_wrong_method_is_an_openai_405_with_allow(method, path, allow):
    app, _ = fake_app()
    response = call(app, method, path)
    error = assert_openai_error(response, 405, code="method_not_allowed")
    assert response.headers["allow"] == allow and allow in error["message"]


def test_fastapi_s_own_validation_is_an_openai_400_naming_the_field():
    app, _ = fake_app()

    @app.get("/probe")
    async def probe(count: int):  # the only kind of route that makes FastAPI validate: none of ours
        return {"count": count}

    app.openapi_schema = None
    assert_openai_error(call(app, "GET", "/probe?count=many"), 400, "query.count")
    assert_openai_error(call(app, "GET", "/probe"), 400, "query.count")


def test_a_fault_before_the_first_byte_is_a_logged_openai_500_and_the_server_serves_on(caplog):
    app, engine = fake_app()
    for stream in (False, True):  # the tokenizer fails while the request is prepared
        response = call(app, "POST", "/v1/completions", json={"prompt": EXPLODE, "stream": stream})
        error = assert_openai_error(response, 500)
        assert error["type"] == "server_error" and "RuntimeError" in error["message"]
    engine.fail_with = KeyError("not one of the engine's errors")  # the engine fails unforeseen
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    error = assert_openai_error(call(app, "POST", "/v1/chat/completions", json=chat), 500)
    assert "KeyError" in error["message"]
    assert caplog.text.count("failed") >= 3 and "the tokenizer fell over" in caplog.text
    engine.fail_with = None
    assert call(app, "POST", "/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


class BreaksMidStream(OpenAIServer):
    async def completion_stream(self, request):
        async def events():
            yield "data: {}\n\n"
            raise RuntimeError("a bug, mid-stream")

        return events()


def test_a_fault_mid_stream_ends_it_with_an_openai_error_event_and_done():
    app, _ = fake_app(server_type=BreaksMidStream)
    response = call(app, "POST", "/v1/completions", json={"prompt": "x", "stream": True})
    assert response.status_code == 200
    events = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]
    assert events[0] == "{}" and events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "server_error"
    assert "RuntimeError" in error["message"]


def test_every_answer_names_its_replica_errors_and_faults_included():
    holder = ServerHolder()
    holder.install(OpenAIServer(FakeEngine(), FakeTokenizer(), model_name="fake", max_model_len=MAX_MODEL_LEN,
                                target_dir=demo_target_path()))
    holder.rank = 3
    app = create_app(holder)
    answers = [call(app, "GET", "/health"), call(app, "GET", "/nowhere"),
               call(app, "POST", "/v1/completions", json={"prompt": EXPLODE}),
               call(app, "POST", "/v1/completions", content=b"x" * (9 << 20))]
    assert [a.status_code for a in answers] == [200, 404, 500, 413]
    assert all(a.headers["x-dflash-replica"] == "3" for a in answers)


def test_an_api_error_keeps_its_headers_and_retry_after():
    error = ApiError.method_not_allowed("GET", "/x", "POST")
    assert error.headers == {"Allow": "POST"}
    assert ApiError.overloaded(0.2).headers == {"Retry-After": "1"}
