"""The `openai` client against a mock transport: what it sends, and what it makes of our replies.

Shared by the protocol tests: the real client is the independent oracle for both directions.
"""

import json

import pytest

from target_service.serving.openai_responses import (
    SSE_DONE,
    ChatCompletionResponse,
    CompletionResponse,
    UsageInfo,
    sse_event,
)

openai = pytest.importorskip("openai")
try:  # the openai client's own HTTP library (httpx2 in recent releases, httpx before)
    import httpx2 as http
except ImportError:
    import httpx as http

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Sort a list."}]


def openai_client(handler, **options):
    transport = http.MockTransport(handler)
    return openai.OpenAI(api_key="sk-test", base_url="http://dflash.test/v1",
                         http_client=http.Client(transport=transport), max_retries=0, **options)


def json_reply(model, status=200, headers=None):
    return lambda request: http.Response(status, json=model.model_dump(), headers=headers)


def sse_reply(chunks):
    body = "".join(sse_event(chunk) for chunk in chunks) + SSE_DONE
    return lambda request: http.Response(200, text=body, headers={"content-type": "text/event-stream"})


def empty_completion(request):
    response = CompletionResponse(model="m", choices=[], usage=UsageInfo())
    return http.Response(200, json=response.model_dump())


def empty_chat(request):
    response = ChatCompletionResponse(model="m", choices=[], usage=UsageInfo())
    return http.Response(200, json=response.model_dump())


def client_body(endpoint, handler, **arguments) -> dict:
    bodies = []

    def recording(request):
        bodies.append(json.loads(request.content))
        return handler(request)

    client = openai_client(recording)
    target = client.completions if endpoint == "completions" else client.chat.completions
    target.create(**arguments)
    return bodies[0]

