"""The OpenAI request models against the bodies the real openai client sends (captured from a mock
transport): the sampling params they become, and every bad field a 400 naming it."""


import pytest
from openai_mock import CHAT, client_body, empty_chat, empty_completion, sse_reply
from pydantic import ValidationError

from target_service.engine.sampling_params import SamplingParams
from target_service.serving.api_errors import ApiError
from target_service.serving.chat_request import ChatCompletionRequest
from target_service.serving.openai_protocol import CompletionRequest

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
    assert [message.model_dump(exclude_none=True) for message in request.messages] == CHAT
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
    {"presence_penalty": 0.0}, {"repetition_penalty": 1.0}, {"repetition_penalty": None}, {"logit_bias": {}},
    {"user": "anyone"}, {"temperature": None},
])
def test_fields_set_to_their_no_op_value_are_accepted(no_op):
    request = CompletionRequest.from_body({"prompt": "x", **no_op})
    assert request.to_sampling_params(1, 64) == [SamplingParams(max_tokens=16)]


@pytest.mark.parametrize(("fields", "logprobs", "prompt_logprobs", "max_tokens"), [
    ({"logprobs": 0}, 0, None, 16),
    ({"logprobs": 20, "echo": True}, 20, 20, 16),
    ({"echo": True}, None, None, 16),  # the prompt's text, no logprobs
    ({"echo": True, "max_tokens": 0, "logprobs": 1}, 1, 1, 1),  # lm-eval: the engine makes one token, dropped
])
def test_completion_logprobs_and_echo_become_the_engines_logprobs_and_prompt_logprobs(
        fields, logprobs, prompt_logprobs, max_tokens):
    request = CompletionRequest.from_body({"prompt": "x", **fields})
    params = request.to_sampling_params(1, 64)[0]
    assert params.logprobs == logprobs and params.prompt_logprobs == prompt_logprobs
    assert params.max_tokens == max_tokens
    assert request.echo_only == (fields.get("max_tokens") == 0) and params.logprobs_mode == "raw"


@pytest.mark.parametrize(("fields", "logprobs"), [
    ({"logprobs": True}, 0), ({"logprobs": True, "top_logprobs": 20}, 20), ({"logprobs": False}, None),
    ({"top_logprobs": 0}, None),  # vLLM's rule: 0 without logprobs asks for nothing
])
def test_chat_logprobs_and_top_logprobs_become_the_engines_logprobs(fields, logprobs):
    request = ChatCompletionRequest.from_body({"messages": CHAT, "logprobs_mode": "processed", **fields})
    params = request.to_sampling_params(1, 64)[0]
    assert (params.logprobs, params.prompt_logprobs, params.logprobs_mode) == (logprobs, None, "processed")


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
    ({"echo": "yes"}, "echo"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"max_tokens": 0, "echo": False}, "max_tokens"),
    ({"max_tokens": 0, "logprobs": 1}, "max_tokens"),
    ({"logprobs_mode": "raw_logits"}, "logprobs_mode"),
    ({"best_of": 3}, "best_of"),
    ({"suffix": "return x"}, "suffix"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"repetition_penalty": 1.2}, "repetition_penalty"),
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
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [*CHAT, {"role": "user"}]}, "messages[4].content"),
    ({"messages": [{"role": "user", "content": {"text": "x"}}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x", "name": 5}]}, "messages[0].name"),
    ({"messages": [{"role": "user", "content": "x", "speaker": "bob"}]}, "messages[0].speaker"),
    ({"messages": CHAT, "max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens"),
    ({"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": CHAT, "logprobs": 1}, "logprobs"),
    ({"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": CHAT, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": CHAT, "logprobs": False, "top_logprobs": 1}, "top_logprobs"),
    ({"messages": CHAT, "tools": [{"type": "function"}]}, "tools[0].function"),
    ({"messages": CHAT, "tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
    ({"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f", "strict": 1}}]},
     "tools[0].function.strict"),  # strict types in the tools too: 1 is no bool
    ({"messages": CHAT, "response_format": {"type": "json_schema",
                                            "json_schema": {"schema": {}, "strict": 0}}}, "response_format"),
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
    request = CompletionRequest.model_construct(prompt="x", temperature=-1)  # bypasses validation
    with pytest.raises(ApiError) as caught:
        request.to_sampling_params(1, 64)
    assert_names(caught.value, "temperature")


def test_from_validation_renames_and_spells_paths_as_openai_does():
    with pytest.raises(ValidationError) as caught:
        SamplingParams(max_tokens=0)
    error = ApiError.from_validation(caught.value, rename={"max_tokens": "max_completion_tokens"})
    assert error.param == "max_completion_tokens"
    assert error.message == "max_completion_tokens: input should be greater than or equal to 1 (got 0)"


