"""Limits checked before any work: n, the batch, stop strings, body size and JSON depth each have a
bound, and a request past one is refused (400 naming the field, or 413) before anything is
tokenized, expanded, checked or queued; a request that can never succeed is a 400, never a 429,
while a full queue stays a 429 with Retry-After. Strict types: a string or a bool is no integer, 0 is
no bool, and an integral JSON number is an integer."""

import json
import random
import time

import pytest
from fake_engine import MAX_MODEL_LEN, FakeEngine, assert_openai_error, call, fake_app
from hypothesis import given, settings
from hypothesis import strategies as st

from target_service.assembly.demo import demo_target_path
from target_service.runner.checkpoint import open_target_checkpoint
from target_service.serving.api_errors import ApiError
from target_service.serving.chat_request import ChatCompletionRequest
from target_service.serving.openai_protocol import (
    MAX_N,
    MAX_PROMPTS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    CompletionRequest,
)
from target_service.serving.prompt_chars import max_prompt_chars
from target_service.serving.request_body import MAX_BODY_BYTES, MAX_JSON_DEPTH

DEMO_TOKENIZER = open_target_checkpoint(demo_target_path()).tokenizer

CHAT = [{"role": "user", "content": "hi"}]


def post(app, body, path="/v1/completions", **request):
    return call(app, "POST", path, content=body if isinstance(body, bytes) else json.dumps(body), **request)


# ---- n and the batch ----------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_n_past_its_bound_is_refused_at_once_naming_n_and_nothing_is_expanded(path):
    rng = random.Random()
    huge = [10**7, 10**18, 10**30, float(10**18), MAX_N + 1, rng.randrange(MAX_N + 1, 10**12)]
    for n in huge:
        app, engine = fake_app()
        started = time.perf_counter()
        body = {"prompt": "x"} if path == "/v1/completions" else {"messages": CHAT}
        response = post(app, {**body, "n": n, "max_tokens": 1}, path)
        assert time.perf_counter() - started < 5  # before the limit: ~11 s of expansion for 10**7
        error = assert_openai_error(response, 400, "n")
        assert str(MAX_N) in error["message"]
        assert not engine.touched


def test_n_at_its_bound_is_served_one_engine_request_per_choice():
    app, engine = fake_app()
    response = post(app, {"prompt": [5, 6], "n": MAX_N, "max_tokens": 1, "seed": 3})
    assert response.status_code == 200 and len(response.json()["choices"]) == MAX_N
    assert len(engine.generated) == MAX_N and len(engine.checked) == 1  # one check per prompt
    assert sorted(params.seed for _, params in engine.generated) == list(range(3, 3 + MAX_N))


def test_choices_past_the_waiting_queue_can_never_be_admitted_and_are_a_400_not_a_429():
    rng = random.Random()
    max_waiting = rng.randrange(2, 40)
    app, engine = fake_app(FakeEngine(max_waiting=max_waiting))
    prompts = rng.randrange(2, min(8, max_waiting + 1))  # more prompts than the queue is the prompt's fault
    n = max_waiting // prompts + 1  # prompts x n > max_waiting, each under its own bound
    error = assert_openai_error(post(app, {"prompt": ["a"] * prompts, "n": n, "max_tokens": 1}), 400, "n")
    assert f"{prompts * n} choices" in error["message"] and str(max_waiting) in error["message"]
    batch = [[7]] * (max_waiting + 1)
    assert_openai_error(post(app, {"prompt": batch, "max_tokens": 1}), 400, "prompt")
    assert_openai_error(post(app, {"messages": CHAT, "n": max_waiting + 1}, "/v1/chat/completions"), 400, "n")
    assert not engine.touched
    exactly = post(app, {"prompt": [[7]] * max_waiting, "max_tokens": 1})
    assert exactly.status_code == 200 and len(engine.generated) == max_waiting


def test_a_full_queue_is_a_429_with_retry_after_for_a_request_that_fits():
    engine = FakeEngine(max_waiting=8, num_waiting=7)
    app, _ = fake_app(engine)
    assert post(app, {"prompt": "x", "max_tokens": 1}).status_code == 200
    busy = post(app, {"prompt": "x", "n": 2, "max_tokens": 1})
    assert_openai_error(busy, 429, code="rate_limit_exceeded")
    assert busy.headers["retry-after"] == "1"


def test_a_batch_past_max_prompts_is_a_400_naming_prompt():
    app, engine = fake_app(FakeEngine(max_waiting=10**6))
    for batch in (["x"] * (MAX_PROMPTS + 1), [[1]] * (MAX_PROMPTS + random.randrange(1, 100))):
        error = assert_openai_error(post(app, {"prompt": batch, "max_tokens": 1}), 400, "prompt")
        assert str(MAX_PROMPTS) in error["message"]
    assert not engine.touched
    assert post(app, {"prompt": [[1]] * MAX_PROMPTS, "max_tokens": 1}).status_code == 200


# ---- stop strings and stop token ids ------------------------------------------------------------


@pytest.mark.parametrize("stop", [
    ["s"] * (MAX_STOP_STRINGS + 1),
    "x" * (MAX_STOP_CHARS + 1),
    ["ok", "y" * (MAX_STOP_CHARS + 1)],
    [""],
    "",
])
def test_stop_strings_past_their_bounds_are_a_400_naming_stop(stop):
    app, engine = fake_app()
    assert_openai_error(post(app, {"prompt": "x", "stop": stop}), 400, "stop")
    assert_openai_error(post(app, {"messages": CHAT, "stop": stop}, "/v1/chat/completions"), 400, "stop")
    assert not engine.touched


def test_stop_strings_at_their_bounds_are_served():
    app, engine = fake_app()
    rng = random.Random()
    stop = ["".join(rng.choice("abc\n ") for _ in range(MAX_STOP_CHARS)) for _ in range(MAX_STOP_STRINGS)]
    assert post(app, {"prompt": "x", "max_tokens": 1, "stop": stop}).status_code == 200
    assert engine.generated[0][1].stop == stop


def test_stop_token_ids_past_their_bound_are_a_400_naming_them():
    app, engine = fake_app()
    too_many = list(range(MAX_STOP_TOKEN_IDS + 1))
    assert_openai_error(post(app, {"prompt": "x", "stop_token_ids": too_many}), 400, "stop_token_ids")
    assert_openai_error(post(app, {"prompt": "x", "stop_token_ids": [1, -1]}), 400, "stop_token_ids[1]")
    assert not engine.touched


# ---- body size ----------------------------------------------------------------------------------


def test_a_declared_body_past_the_limit_is_a_413_before_any_byte_is_read():
    app, engine = fake_app()
    reads = []

    async def receive():
        reads.append(1)
        return {"type": "http.request", "body": b"{}", "more_body": False}

    sent = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
             "root_path": "", "server": ("t", 80), "client": ("c", 1),
             "headers": [(b"content-length", str(MAX_BODY_BYTES + 1).encode()),
                         (b"content-type", b"application/json")]}
    import asyncio

    asyncio.run(app(scope, receive, send))
    assert sent[0]["status"] == 413 and not reads and not engine.touched
    error = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))["error"]
    assert error["code"] == "request_too_large" and str(MAX_BODY_BYTES) in error["message"]


def test_a_chunked_body_past_the_limit_is_a_413_once_its_bytes_pass_it():
    app, engine = fake_app()
    chunk = b" " * (1 << 20)

    async def chunks():  # no Content-Length: the transport sends it chunked
        yield b'{"prompt": "x",'
        for _ in range(MAX_BODY_BYTES // len(chunk) + 1):
            yield chunk
        yield b'"max_tokens": 1}'

    response = call(app, "POST", "/v1/completions", content=chunks())
    assert_openai_error(response, 413, code="request_too_large")
    assert not engine.touched


def test_a_body_of_exactly_the_limit_is_served():
    app, _ = fake_app()
    body = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    body = body[:-1] + b" " * (MAX_BODY_BYTES - len(body)) + b"}"
    assert len(body) == MAX_BODY_BYTES
    assert post(app, body).status_code == 200


def test_a_content_length_that_is_no_number_is_a_400():
    app, _ = fake_app()
    response = call(app, "POST", "/v1/completions", content=b"{}", headers={"content-length": "lots"})
    assert_openai_error(response, 400)


# ---- JSON: depth, constants, surrogates ---------------------------------------------------------


def nested(depth: int) -> str:
    """A body `depth` levels deep: the object, then arrays down to a 1, in a field."""
    return '{"logit_bias": ' + "[" * (depth - 1) + "1" + "]" * (depth - 1) + "}"


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 5_000, 100_000, "random"])
def test_json_nested_past_the_limit_is_a_400_and_never_a_recursion_error(depth):
    depth = random.randrange(MAX_JSON_DEPTH + 2, 3_000) if depth == "random" else depth  # drawn per run
    app, engine = fake_app()
    for path in ("/v1/completions", "/v1/chat/completions"):
        error = assert_openai_error(post(app, nested(depth).encode(), path), 400)
        assert f"deeper than {MAX_JSON_DEPTH}" in error["message"]
    arrays = ("[" * depth + "]" * depth).encode()  # the bare array nest of the issue
    assert_openai_error(post(app, arrays), 400)
    assert not engine.touched


def test_json_at_the_depth_limit_passes_the_depth_check():
    app, _ = fake_app()
    error = assert_openai_error(post(app, nested(MAX_JSON_DEPTH).encode()), 400, "logit_bias")
    assert "deeper" not in error["message"]  # refused for what it says, not for its depth


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_are_not_json_numbers(constant):
    app, engine = fake_app()
    body = f'{{"prompt": "x", "temperature": {constant}}}'.encode()
    assert constant in assert_openai_error(post(app, body), 400)["message"]
    assert not engine.touched


def test_a_body_that_is_not_utf8_or_not_json_is_a_400():
    app, _ = fake_app()
    for body in (b'{"prompt": "\xff\xfe"}', b"{not json", b"", b'{"prompt": ' + b"9" * 5000 + b"}"):
        assert_openai_error(post(app, body), 400)


SURROGATE_PLACES = [
    ('{"prompt": "a\\ud800b"}', "prompt"),
    ('{"prompt": ["ok", "\\udfff"]}', "prompt[1]"),
    ('{"prompt": "x", "stop": ["ok", "\\ud83d"]}', "stop[1]"),
    ('{"prompt": "x", "user": "\\ude00"}', "user"),
    ('{"prompt": "x", "model": "\\ud800"}', "model"),
    ('{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
    ('{"messages": [{"role": "user", "content": [{"type": "text", "text": "ok"}, '
     '{"type": "text", "text": "\\udbff"}]}]}', "messages[0].content[1].text"),
]


@pytest.mark.parametrize(("body", "param"), SURROGATE_PLACES)
def test_a_lone_surrogate_is_a_400_naming_its_field(body, param):
    app, engine = fake_app()
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    error = assert_openai_error(post(app, body.encode(), path), 400, param)
    assert "surrogate" in error["message"]
    assert not engine.touched


def test_a_surrogate_pair_is_one_character_and_served():
    app, engine = fake_app()
    response = post(app, b'{"prompt": "\\ud83d\\ude00", "max_tokens": 1}')  # U+1F600
    assert response.status_code == 200
    assert engine.generated[0][0] == [0x1F600 % 256]


# ---- strict types: the one integer rule ---------------------------------------------------------

INTEGER_FIELDS = {  # field -> a valid value, for both endpoints unless named
    "max_tokens": 3, "n": 2, "seed": 11, "top_k": 5,
}


@pytest.mark.parametrize("field", sorted(INTEGER_FIELDS))
def test_every_integer_field_takes_an_integral_number_and_refuses_bools_strings_and_fractions(field):
    value = INTEGER_FIELDS[field]
    for model, base in ((CompletionRequest, {"prompt": "x"}), (ChatCompletionRequest, {"messages": CHAT})):
        parsed = model.from_body({**base, field: float(value)})
        assert getattr(parsed, field) == value and type(getattr(parsed, field)) is int
        for bad in (str(value), True, value + 0.5, [value]):
            with pytest.raises(ApiError) as caught:
                model.from_body({**base, field: bad})
            assert caught.value.status == 400 and caught.value.param == field, bad


def test_the_issue_s_loose_types_are_refused_and_a_float_token_id_is_an_int():
    app, engine = fake_app()
    for body, param in (({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
                        ({"prompt": "x", "max_tokens": True}, "max_tokens"),
                        ({"prompt": "x", "echo": 0}, "echo"),
                        ({"prompt": "x", "stream": 1}, "stream"),
                        ({"prompt": "x", "temperature": "0.5"}, "temperature"),
                        ({"prompt": "x", "ignore_eos": "true"}, "ignore_eos"),
                        ({"prompt": [87.5]}, "prompt"),
                        ({"prompt": [True]}, "prompt")):
        assert_openai_error(post(app, body), 400, param)
    assert not engine.touched
    response = post(app, {"prompt": [87.0, 3], "max_tokens": 2.0, "stop_token_ids": [4.0]})
    assert response.status_code == 200
    ids, params = engine.generated[0]
    assert ids == [87, 3] and all(type(t) is int for t in ids)
    assert params.max_tokens == 2 and params.stop_token_ids == [4]
    batch = CompletionRequest.from_body({"prompt": [[1.0, 2], [3.0]]})
    assert batch.prompts() == [[1, 2], [3]] and all(type(t) is int for p in batch.prompts() for t in p)


def test_a_float_stands_for_an_int_in_a_float_field_but_nothing_else_does():
    request = CompletionRequest.from_body({"prompt": "x", "temperature": 1, "top_p": 1})
    assert request.temperature == 1 and request.top_p == 1
    for bad in ({"temperature": True}, {"top_p": "1"}, {"stop": ["a", 1]}, {"messages": CHAT}):
        with pytest.raises(ApiError):
            CompletionRequest.from_body({"prompt": "x", **bad})


def test_a_huge_integral_number_is_an_int_refused_by_its_range():
    for field, value in (("n", 1e300), ("seed", 1e19), ("prompt", [1e300])):
        with pytest.raises(ApiError) as caught:
            CompletionRequest.from_body({"prompt": "x", field: value})
        assert caught.value.param == field


# ---- text that cannot fit is not tokenized ------------------------------------------------------


class CountingTokenizer:
    """The demo checkpoint's tokenizer, counting its encodes."""

    def __init__(self):
        self.inner, self.calls = open_target_checkpoint(demo_target_path()).tokenizer, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def encode_batch(self, texts, add_special_tokens=True):
        self.calls += len(texts)
        return self.inner.encode_batch(texts, add_special_tokens=add_special_tokens)


def test_a_text_longer_than_the_context_could_hold_is_refused_before_it_is_tokenized():
    tokenizer = CountingTokenizer()
    app, engine = fake_app(tokenizer=tokenizer)
    bound = max_prompt_chars(tokenizer.inner, MAX_MODEL_LEN)
    assert bound is not None and bound < MAX_BODY_BYTES // 2
    long = "".join(random.choices("ab \n", k=bound + 1))
    started = time.perf_counter()
    for path, body, param in (("/v1/completions", {"prompt": long}, "prompt"),
                              ("/v1/completions", {"prompt": ["ok", long]}, "prompt"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": long}]},
                               "messages")):
        assert "characters" in assert_openai_error(post(app, body, path), 400, param)["message"]
    assert time.perf_counter() - started < 5
    assert tokenizer.calls == 1 and not engine.touched  # only the batch's short "ok"


@given(st.text(st.characters(codec="utf-8"), min_size=1, max_size=400))
@settings(deadline=None, database=None, max_examples=300)
def test_the_character_bound_never_refuses_a_text_that_fits(text):
    tokenizer = DEMO_TOKENIZER
    num_tokens = len(tokenizer.encode(text, add_special_tokens=False).ids)
    assert num_tokens == 0 or len(text) <= max_prompt_chars(tokenizer, num_tokens)


def test_no_character_bound_where_one_token_can_cover_any_text():
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    strips = Tokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[]))
    strips.pre_tokenizer = pre_tokenizers.ByteLevel()
    assert max_prompt_chars(strips, 10) == 10
    strips.normalizer = normalizers.Replace("  ", "")  # drops characters: no bound
    assert max_prompt_chars(strips, 10) is None
    strips.normalizer, strips.pre_tokenizer = None, pre_tokenizers.Whitespace()
    assert max_prompt_chars(strips, 10) is None
    assert max_prompt_chars(None, 10) is None


@pytest.mark.parametrize("prompt", ["", ["ok", ""], [], [[]], [[1], []]])
def test_an_empty_prompt_is_a_400_naming_prompt_before_tokenizing(prompt):
    app, engine = fake_app()
    assert_openai_error(post(app, {"prompt": prompt}), 400, "prompt")
    assert not engine.touched


def test_the_context_length_is_still_checked_after_the_limits():
    app, _ = fake_app()
    assert_openai_error(post(app, {"prompt": [1] * MAX_MODEL_LEN, "max_tokens": 1}), 400, "prompt")
