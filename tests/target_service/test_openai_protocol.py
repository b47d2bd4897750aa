"""The OpenAI protocol models, checked against the `openai` package as an independent oracle.

Requests are the JSON bodies the real openai client sends (captured from a mock transport); responses
and errors are served to the real client, which must parse them, and validated against its types.
"""

import json
import time

import pytest
from pydantic import ValidationError

from target_service.api_errors import ApiError
from target_service.openai_protocol import (
    SSE_DONE,
    AssistantMessage,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamChunk,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChunk,
    DeltaMessage,
    ModelCard,
    ModelList,
    UsageInfo,
    sse_event,
)
from target_service.sampling_params import SamplingParams

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


# ---- requests as the openai client sends them ---------------------------------------------------


def test_a_completion_request_from_the_openai_client_becomes_the_sampling_params_it_asked_for():
    body = client_body("completions", empty_completion, model="demo", prompt="def f(x):", max_tokens=5,
                       temperature=0.5, top_p=0.9, seed=7, stop=["\n\n", "```"], user="alice",
                       extra_body={"top_k": 40, "ignore_eos": True, "stop_token_ids": [3]})
    request = CompletionRequest.from_body(body)
    assert request.model == "demo" and request.prompts() == ["def f(x):"] and not request.stream
    assert request.to_sampling_params(num_prompt_tokens=4, max_model_len=64) == [SamplingParams(
        max_tokens=5, temperature=0.5, top_p=0.9, top_k=40, seed=7, stop=["\n\n", "```"],
        stop_token_ids=[3], ignore_eos=True)]


@pytest.mark.parametrize(("prompt", "batch"), [
    ("x = 1", ["x = 1"]),
    ([5, 6, 7], [[5, 6, 7]]),
    (["a", "b"], ["a", "b"]),
    ([[5], [6, 7]], [[5], [6, 7]]),
])
def test_every_prompt_shape_the_client_sends_is_a_batch(prompt, batch):
    body = client_body("completions", empty_completion, model="demo", prompt=prompt)
    assert CompletionRequest.from_body(body).prompts() == batch


def test_defaults_are_openais_for_completions():
    request = CompletionRequest.from_body(client_body("completions", empty_completion, model="m", prompt="x"))
    assert request.to_sampling_params(1, 100) == [SamplingParams(max_tokens=16, temperature=1.0, top_p=1.0,
                                                                 top_k=-1)]


def test_a_streamed_request_with_usage_asks_for_the_usage_chunk():
    body = client_body("completions", sse_reply([]), model="m", prompt="x", stream=True,
                       stream_options={"include_usage": True})
    assert CompletionRequest.from_body(body).include_usage
    body = client_body("chat", sse_reply([]), model="m", messages=CHAT, stream=True)
    assert not ChatCompletionRequest.from_body(body).include_usage


def test_a_chat_request_from_the_openai_client_keeps_its_messages_and_settings():
    body = client_body("chat", empty_chat, model="demo", messages=CHAT, max_completion_tokens=12,
                       temperature=0.0, n=2, seed=1, stop="END", extra_body={"add_generation_prompt": False})
    request = ChatCompletionRequest.from_body(body)
    assert [message.model_dump() for message in request.messages] == CHAT
    assert request.add_generation_prompt is False
    params = request.to_sampling_params(num_prompt_tokens=30, max_model_len=64)
    assert params == [SamplingParams(max_tokens=12, temperature=0.0, seed=1, stop=["END"]),
                      SamplingParams(max_tokens=12, temperature=0.0, seed=2, stop=["END"])]


def test_chat_text_parts_are_joined_by_newlines_like_vllm():
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    body = client_body("chat", empty_chat, model="m", messages=[{"role": "user", "content": parts}])
    assert ChatCompletionRequest.from_body(body).messages[0].content == "first\nsecond"


def test_chat_without_max_tokens_generates_what_fits_and_max_completion_tokens_wins():
    request = ChatCompletionRequest.from_body({"messages": CHAT})
    assert request.to_sampling_params(num_prompt_tokens=40, max_model_len=64)[0].max_tokens == 24
    both = ChatCompletionRequest.from_body({"messages": CHAT, "max_tokens": 9, "max_completion_tokens": 9})
    assert both.to_sampling_params(40, 64)[0].max_tokens == 9
    assert ChatCompletionRequest.from_body({"messages": CHAT, "max_tokens": 5}).to_sampling_params(1, 64)[
        0].max_tokens == 5


def test_n_choices_without_a_seed_share_one_params_and_with_a_seed_count_up_from_it():
    unseeded = CompletionRequest.from_body({"prompt": "x", "n": 3}).to_sampling_params(1, 64)
    assert len(unseeded) == 3 and all(p.seed is None for p in unseeded)
    seeded = CompletionRequest.from_body({"prompt": "x", "n": 3, "seed": 10}).to_sampling_params(1, 64)
    assert [p.seed for p in seeded] == [10, 11, 12]


@pytest.mark.parametrize(("body", "expected"), [
    ({"top_k": 0}, -1), ({"top_k": None}, -1), ({"top_k": -1}, -1), ({"top_k": 5}, 5)])
def test_top_k_zero_or_null_is_off_as_in_vllm(body, expected):
    request = CompletionRequest.from_body({"prompt": "x", **body})
    assert request.to_sampling_params(1, 64)[0].top_k == expected


@pytest.mark.parametrize("no_op", [
    {"echo": False}, {"best_of": 1}, {"logprobs": None}, {"suffix": ""}, {"frequency_penalty": 0},
    {"presence_penalty": 0.0}, {"logit_bias": {}}, {"user": "anyone"}, {"temperature": None},
])
def test_fields_set_to_their_no_op_value_are_accepted(no_op):
    request = CompletionRequest.from_body({"prompt": "x", **no_op})
    assert request.to_sampling_params(1, 64) == [SamplingParams(max_tokens=16)]


# ---- bad input: a 400 naming the field ----------------------------------------------------------

COMPLETION_REFUSALS = [
    ({"n": 0}, "n"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 2}, "top_p"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"seed": 2**64}, "seed"),
    ({"stop": 5}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"echo": True}, "echo"),
    ({"logprobs": 0}, "logprobs"),
    ({"logprobs": 5}, "logprobs"),
    ({"best_of": 3}, "best_of"),
    ({"suffix": "return x"}, "suffix"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"logit_bias": {"50256": -100}}, "logit_bias"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": {"continuous": True}}, "stream_options.continuous"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": 3}, "prompt"),
]

CHAT_REFUSALS = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"messages": [*CHAT, {"role": "user"}]}, "messages[4].content"),
    ({"messages": [{"role": "user", "content": {"text": "x"}}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x", "name": "bob"}]}, "messages[0].name"),
    ({"messages": CHAT, "max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens"),
    ({"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": CHAT, "logprobs": True}, "logprobs"),
    ({"messages": CHAT, "tools": [{"type": "function"}]}, "tools"),
    ({"messages": CHAT, "n": 0}, "n"),
]


def assert_names(error: ApiError, param: str):
    assert error.status == 400 and error.type == "invalid_request_error"
    assert error.param == param
    assert param in error.message and "\n" not in error.message


@pytest.mark.parametrize(("fields", "param"), COMPLETION_REFUSALS)
def test_a_bad_completion_field_is_a_400_naming_it(fields, param):
    with pytest.raises(ApiError) as caught:
        CompletionRequest.from_body({"model": "m", "prompt": "x", **fields})
    assert_names(caught.value, param)


@pytest.mark.parametrize(("fields", "param"), CHAT_REFUSALS)
def test_a_bad_chat_field_is_a_400_naming_it(fields, param):
    with pytest.raises(ApiError) as caught:
        ChatCompletionRequest.from_body({"model": "m", **fields})
    assert_names(caught.value, param)


def test_a_missing_field_and_a_body_that_is_no_object_are_400s():
    with pytest.raises(ApiError) as caught:
        CompletionRequest.from_body({"model": "m"})
    assert_names(caught.value, "prompt")
    assert caught.value.message == "prompt is required"
    with pytest.raises(ApiError) as caught:
        ChatCompletionRequest.from_body(["not", "an", "object"])
    assert caught.value.status == 400 and caught.value.param is None
    assert caught.value.message == "the request body must be a JSON object"


def test_the_context_length_is_checked_per_prompt():
    request = CompletionRequest.from_body({"prompt": "x", "max_tokens": 20})
    assert request.to_sampling_params(num_prompt_tokens=44, max_model_len=64)[0].max_tokens == 20
    with pytest.raises(ApiError) as caught:
        request.to_sampling_params(num_prompt_tokens=45, max_model_len=64)
    assert_names(caught.value, "max_tokens")
    assert "at most 19" in caught.value.message
    with pytest.raises(ApiError) as caught:
        ChatCompletionRequest.from_body({"messages": CHAT}).to_sampling_params(64, 64)
    assert_names(caught.value, "messages")
    chat = ChatCompletionRequest.from_body({"messages": CHAT, "max_completion_tokens": 30})
    with pytest.raises(ApiError) as caught:
        chat.to_sampling_params(40, 64)
    assert_names(caught.value, "max_completion_tokens")


def test_a_request_built_directly_is_checked_when_it_becomes_sampling_params():
    request = CompletionRequest(prompt="x", temperature=-1)  # bypasses from_body
    with pytest.raises(ApiError) as caught:
        request.to_sampling_params(1, 64)
    assert_names(caught.value, "temperature")


def test_from_validation_renames_and_spells_paths_as_openai_does():
    with pytest.raises(ValidationError) as caught:
        SamplingParams(max_tokens=0)
    error = ApiError.from_validation(caught.value, rename={"max_tokens": "max_completion_tokens"})
    assert error.param == "max_completion_tokens"
    assert error.message == "max_completion_tokens: input should be greater than or equal to 1 (got 0)"


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
