"""The poisoned requests of the soak (issue 30, items 1-3) and the answer each must get.

Each is sent as raw JSON text, so what no JSON encoder would write (a lone surrogate's escape, 5,000
levels of nesting, a body past the size limit) reaches the server as a client could send it. The
two top_p extremes are valid requests: SamplingParams computes them safely (the most likely token
is kept), so their answer is a 200 completion, and what they must not do is hurt the other clients
(before the fix they made torch.multinomial raise and took the replica down). Every other poison is
refused with an OpenAI-shaped error naming what is wrong.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

MAX_BODY_BYTES = 8 * 2**20  # target_service.serving.request_body's limit, restated: the soak is a client


@dataclass(frozen=True)
class Poison:
    name: str
    body: str  # the JSON text, as sent
    status: int  # the answer it must get
    param: str | None = None  # the field a 400 / 404 must name
    code: str | None = None  # the OpenAI error code it must carry

    def encode(self, model: str) -> bytes:
        return self.body.replace("$MODEL", model).encode("utf-8")


def _body(**fields) -> str:
    return json.dumps({"model": "$MODEL", "prompt": "def f(x):", "max_tokens": 8, **fields})


POISONS = (
    Poison("top_p 1e-46", _body(top_p=1e-46), 200),
    Poison("top_p 5e-324", _body(top_p=5e-324), 200),
    Poison("n 10**7", _body(n=10**7), 400, param="n"),
    Poison("n 10**18", _body(n=10**18), 400, param="n"),
    Poison("lone surrogate", _body(prompt="@").replace("@", "\\ud800"), 400, param="prompt"),
    Poison("JSON nested 5000 deep", _body()[:-1] + ', "x": ' + "[" * 5000 + "]" * 5000 + "}", 400),
    Poison("body over 8 MiB", _body(prompt="a" * (MAX_BODY_BYTES + 2**20)), 413, code="request_too_large"),
    Poison("max_tokens a string", _body(max_tokens="5"), 400, param="max_tokens"),
    Poison("unknown model", _body().replace("$MODEL", "no-such-model"), 404, param="model",
           code="model_not_found"),
)


def check_answer(poison: Poison, status: int, text: str) -> str | None:
    """None when the answer is the one `poison` must get; else what is wrong with it, in one line."""
    if status != poison.status:
        return f"status {status}, expected {poison.status}: {text[:200]}"
    try:
        body = json.loads(text)
    except ValueError:
        return f"the body is not JSON: {text[:200]}"
    if status == 200:
        choices = body.get("choices") if isinstance(body, dict) else None
        ok = isinstance(choices, list) and choices and all(c.get("finish_reason") for c in choices)
        return None if ok else f"not a completion: {text[:200]}"
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or not isinstance(error.get("message"), str) or "type" not in error:
        return f"not an OpenAI error body: {text[:200]}"
    if poison.param is not None and error.get("param") != poison.param:
        return f"param {error.get('param')!r}, expected {poison.param!r}"
    if poison.code is not None and error.get("code") != poison.code:
        return f"code {error.get('code')!r}, expected {poison.code!r}"
    return None
