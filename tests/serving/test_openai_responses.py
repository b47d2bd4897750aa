"""The OpenAI response and error models, served to the real openai client, which must parse them and
raise the exception each error status means."""

import time

import pytest
from openai_mock import (
    CHAT,
    http,
    json_reply,
    openai,
    openai_client,
    sse_reply,
)

from target_service.serving.api_errors import ApiError
from target_service.serving.openai_responses import (
    AssistantMessage,
    ChatCompletionChoice,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamChunk,
    CompletionChoice,
    CompletionResponse,
    CompletionStreamChunk,
    DeltaMessage,
    ModelCard,
    ModelList,
    UsageInfo,
)

# ---- responses, parsed by the openai client -----------------------------------------------------


def test_a_completion_response_is_what_the_openai_client_parses():
    ours = CompletionResponse(model="demo", choices=[
        CompletionChoice(index=0, text="return x", finish_reason="stop"),
        CompletionChoice(index=1, text="pass", finish_reason="length")],
        usage=UsageInfo(prompt_tokens=4, completion_tokens=6))
    strict = openai_client(json_reply(ours), _strict_response_validation=True)
    parsed = strict.completions.create(model="demo", prompt="def f(x):", n=2)
    assert parsed.id == ours.id and parsed.id.startswith("cmpl-") and parsed.object == "text_completion"
    assert [(c.index, c.text, c.finish_reason) for c in parsed.choices] == [
        (0, "return x", "stop"), (1, "pass", "length")]
    usage = parsed.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (4, 6, 10)
    assert abs(parsed.created - time.time()) < 60
    assert openai.types.Completion.model_validate(ours.model_dump()).model_dump(
        include={"id", "model", "created"}) == ours.model_dump(include={"id", "model", "created"})


def test_a_chat_response_is_what_the_openai_client_parses():
    ours = ChatCompletionResponse(model="demo", choices=[ChatCompletionChoice(
        index=0, message=AssistantMessage(content="sorted(xs)"), finish_reason="stop")],
        usage=UsageInfo(prompt_tokens=30, completion_tokens=3))
    parsed = openai_client(json_reply(ours), _strict_response_validation=True).chat.completions.create(
        model="demo", messages=CHAT)
    assert parsed.id.startswith("chatcmpl-") and parsed.object == "chat.completion"
    choice = parsed.choices[0]
    assert (choice.message.role, choice.message.content, choice.finish_reason) == ("assistant", "sorted(xs)",
                                                                                   "stop")
    assert parsed.usage.total_tokens == 33
    openai.types.chat.ChatCompletion.model_validate(ours.model_dump())


def test_an_aborted_choice_reaches_the_default_openai_client_as_abort():
    """"abort" is vLLM's finish reason, not OpenAI's: the client, unvalidated by default, keeps it."""
    ours = ChatCompletionResponse(model="demo", choices=[ChatCompletionChoice(
        index=0, message=AssistantMessage(content="sor"), finish_reason="abort")], usage=UsageInfo())
    parsed = openai_client(json_reply(ours)).chat.completions.create(model="demo", messages=CHAT)
    assert parsed.choices[0].finish_reason == "abort"


def test_a_completion_stream_reads_back_through_the_openai_client():
    common = {"id": "cmpl-1", "created": 1700000000, "model": "demo"}
    chunks = [CompletionStreamChunk(**common, choices=[CompletionChoice(index=0, text="ret")]),
              CompletionStreamChunk(**common, choices=[CompletionChoice(index=0, text="urn x",
                                                                        finish_reason="stop")]),
              CompletionStreamChunk(**common, choices=[],
                                    usage=UsageInfo(prompt_tokens=4, completion_tokens=2))]
    # the openai types require a finish_reason, so only the last text chunk validates strictly; the
    # client (like OpenAI's own stream, whose middle chunks carry null) constructs the others unchecked
    openai.types.Completion.model_validate(chunks[1].model_dump())
    received = list(openai_client(sse_reply(chunks)).completions.create(
        model="demo", prompt="x", stream=True, stream_options={"include_usage": True}))
    assert "".join(c.text for chunk in received for c in chunk.choices) == "return x"
    assert [c.finish_reason for chunk in received for c in chunk.choices] == [None, "stop"]
    assert received[-1].choices == [] and received[-1].usage.total_tokens == 6
    assert {chunk.id for chunk in received} == {"cmpl-1"}


def test_a_chat_stream_validates_strictly_and_reads_back():
    common = {"id": "chatcmpl-1", "created": 1700000000, "model": "demo"}
    chunks = [
        ChatCompletionStreamChunk(**common, choices=[ChatCompletionStreamChoice(
            index=0, delta=DeltaMessage(role="assistant", content=""))]),
        ChatCompletionStreamChunk(**common, choices=[ChatCompletionStreamChoice(
            index=0, delta=DeltaMessage(content="sorted"))]),
        ChatCompletionStreamChunk(**common, choices=[ChatCompletionStreamChoice(
            index=0, delta=DeltaMessage(content="(xs)"), finish_reason="length")]),
        ChatCompletionStreamChunk(**common, choices=[],
                                  usage=UsageInfo(prompt_tokens=30, completion_tokens=2)),
    ]
    for chunk in chunks:
        openai.types.chat.ChatCompletionChunk.model_validate(chunk.model_dump())
    strict = openai_client(sse_reply(chunks), _strict_response_validation=True)
    received = list(strict.chat.completions.create(model="demo", messages=CHAT, stream=True,
                                                   stream_options={"include_usage": True}))
    deltas = [c.delta for chunk in received for c in chunk.choices]
    assert deltas[0].role == "assistant" and "".join(d.content for d in deltas) == "sorted(xs)"
    assert received[2].choices[0].finish_reason == "length" and received[-1].usage.total_tokens == 32


def test_the_model_list_is_what_the_openai_client_lists():
    ours = ModelList(data=[ModelCard(id="demo", max_model_len=4096)])
    models = list(openai_client(json_reply(ours), _strict_response_validation=True).models.list())
    assert [(m.id, m.object, m.owned_by) for m in models] == [("demo", "model", "dflash-serve")]
    assert models[0].max_model_len == 4096  # an extra field: the client keeps it
    openai.types.Model.model_validate(ours.data[0].model_dump())


# ---- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("error", "status", "type_", "code", "exception"), [
    (ApiError.bad_request("n: too small", "n"), 400, "invalid_request_error", None, "BadRequestError"),
    (ApiError.unauthorized(), 401, "invalid_request_error", "invalid_api_key", "AuthenticationError"),
    (ApiError.model_not_found("gpt-9", served="demo"), 404, "invalid_request_error", "model_not_found",
     "NotFoundError"),
    (ApiError.overloaded(2.0), 429, "rate_limit_error", "rate_limit_exceeded", "RateLimitError"),
    (ApiError.internal("the engine stopped"), 500, "server_error", None, "InternalServerError"),
    (ApiError.unavailable(5), 503, "server_error", "service_unavailable", "InternalServerError"),
])
def test_each_error_reaches_the_openai_client_as_its_exception(error, status, type_, code, exception):
    assert (error.status, error.type, error.code) == (status, type_, code)
    client = openai_client(json_reply(error.to_response(), status, error.headers))
    with pytest.raises(getattr(openai, exception)) as caught:
        client.completions.create(model="demo", prompt="x")
    assert caught.value.status_code == status
    assert caught.value.body == {"message": error.message, "type": type_, "param": error.param, "code": code}
    assert (caught.value.code, caught.value.param, caught.value.type) == (code, error.param, type_)


def test_retry_after_is_whole_seconds_rounded_up_and_only_when_given():
    assert ApiError.overloaded(0.2).headers == {"Retry-After": "1"}
    assert ApiError.unavailable(2.5).headers == {"Retry-After": "3"}
    assert ApiError.bad_request("x").headers == {}
    assert ApiError.model_not_found("gpt-9").param == "model"


def test_the_openai_client_waits_retry_after_before_retrying_a_429():
    answers = [ApiError.overloaded(1.0), None]
    calls = []
    ok = CompletionResponse(model="demo", choices=[CompletionChoice(index=0, text="x", finish_reason="stop")],
                            usage=UsageInfo())

    def handler(request):
        calls.append(time.monotonic())
        error = answers.pop(0)
        if error is None:
            return json_reply(ok)(request)
        return json_reply(error.to_response(), error.status, error.headers)(request)

    client = openai.OpenAI(api_key="k", base_url="http://dflash.test/v1", max_retries=1,
                           http_client=http.Client(transport=http.MockTransport(handler)))
    assert client.completions.create(model="demo", prompt="x").choices[0].text == "x"
    assert len(calls) == 2 and calls[1] - calls[0] >= 0.9
