"""The request body, read and parsed before anything else looks at it, within documented limits.

| limit                   | value                  | past it                                          |
| body size               | MAX_BODY_BYTES (8 MiB) | 413, from Content-Length before reading, or once |
|                         |                        | the bytes read pass it (chunked bodies)          |
| JSON nesting depth      | MAX_JSON_DEPTH (64)    | 400; the deepest real request nests 5 levels     |
| NaN, Infinity           | not JSON numbers       | 400                                              |
| a number past a double  | +-1.8e308              | 400 (RFC 8259's interoperable range)             |
| a lone surrogate        | not Unicode text       | 400 naming the field ("\\ud800" cannot be        |
|                         |                        | tokenized or echoed)                             |

8 MiB holds a 128k-token prompt several times over, as text or as token ids. The field limits (n,
the batch, the stop strings) are the request models' (`openai_protocol.py`).
"""

from __future__ import annotations

import json
import math
import re
import sys

from fastapi import Request

from target_service.serving.api_errors import ApiError, param_path

MAX_BODY_BYTES = 8 * 2**20
MAX_JSON_DEPTH = 64
_SURROGATE = re.compile("[\ud800-\udfff]")


async def read_json(request: Request):
    """The body as JSON, within the limits above: 400 for anything JSON parsing refuses or lets
    through that nothing downstream can take."""
    try:
        body = json.loads(await request.body(), parse_constant=_no_constant, parse_float=_double,
                          parse_int=_integer)
    except RecursionError:  # nested past Python's own limit: far past ours
        raise _too_deep() from None
    except ValueError as error:
        raise ApiError.bad_request(f"the request body is not valid JSON: {error}") from None
    check_json(body)
    return body


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _double(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"the number {text[:24]} is past the range of a double")
    return value


def _integer(text: str) -> int:
    value = int(text)  # past 4300 digits Python refuses it (ValueError) before any arithmetic
    if abs(value) > sys.float_info.max:
        raise ValueError(f"the number {text[:24]}... is past the range of a double")
    return value


def _too_deep() -> ApiError:
    return ApiError.bad_request(
        f"the request body nests deeper than {MAX_JSON_DEPTH} levels of arrays and objects")


def check_json(body) -> None:
    """Refuse (400) a parsed body nested deeper than MAX_JSON_DEPTH, or holding a lone surrogate in
    any string or key, named by its path ("messages[0].content"). Iterative: no depth can overflow
    the stack here; a path is spelled only for the refusal."""
    if not isinstance(body, dict | list):
        return
    stack = [(body, None, 1)]  # (container, its path as (parent path, key) links, depth)
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise _too_deep()
        for key, child in value.items() if isinstance(value, dict) else enumerate(value):
            if isinstance(key, str) and not key.isascii() and _SURROGATE.search(key):
                raise _surrogate(path)
            if isinstance(child, str):
                if not child.isascii() and _SURROGATE.search(child):
                    raise _surrogate((path, key))
            elif isinstance(child, dict | list):
                stack.append((child, (path, key), depth + 1))


def _surrogate(path) -> ApiError:
    parts = []
    while path is not None:
        path, key = path
        parts.append(key)
    param = param_path(parts[::-1])
    where = param or "the request body"
    return ApiError.bad_request(f"{where}: the text holds a lone surrogate (U+D800..U+DFFF), which is not "
                                "Unicode text; send valid UTF-8 (or surrogate pairs)", param)
