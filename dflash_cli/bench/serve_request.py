"""One request to an OpenAI-compatible server as its client sees it: where it goes (`Endpoint`), the
completion body, the POST timed from the SSE stream (`send_request` -> `RequestResult`), and the
scrapes of /metrics beside it.

Every chunk with text is stamped with time.perf_counter() on arrival, so TTFT, the gaps between chunks
(ITL) and where each gap fell in the run's wall time all come from one record. Failures are recorded,
never raised: a load generator must see every refusal. httpx is imported inside the functions, so
`dflash --help` does not load it.
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import httpx


@dataclass(frozen=True)
class Endpoint:
    """Where requests go: `url` is the API root (`http://host:port/v1`); /metrics sits beside /v1."""

    url: str
    model: str = ""
    api_key: str | None = None
    metrics_url: str | None = None  # None: the server root's /metrics

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def metrics(self) -> str:
        return self.metrics_url or self.url.rstrip("/").removesuffix("/v1") + "/metrics"


@dataclass
class RequestResult:
    """One request as the client saw it. `sent_at` and `chunk_at` are time.perf_counter() readings (so
    requests of a run share one clock, for the plot of gaps over time); `e2e` is a duration."""

    ok: bool = False
    error: str | None = None  # the HTTP status ("503"), a stream error or an exception's name
    sent_at: float | None = None
    chunk_at: list[float] = field(default_factory=list)  # each chunk with text (none without a stream)
    e2e: float = 0.0
    output_tokens: int = 0  # usage.completion_tokens, or chunks with text when the server sent no usage
    prompt_tokens: int | None = None  # usage.prompt_tokens (None: no usage): splits TTFT by prompt length
    usage_reported: bool = False
    replica: str | None = None  # X-Dflash-Replica, where the server names one

    @property
    def ttft(self) -> float | None:
        """To the first chunk with text (None without a stream)."""
        if not self.chunk_at or self.sent_at is None:
            return None
        return self.chunk_at[0] - self.sent_at

    @property
    def itl(self) -> list[float]:
        """The gaps between chunks with text (one chunk carries every token one step accepted)."""
        return [after - before for before, after in itertools.pairwise(self.chunk_at)]

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def request_body(model: str, prompt: list[int], output_len: int, stream: bool) -> dict:
    """Exactly `output_len` greedy tokens: ignore_eos makes every request the same amount of work."""
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def send_request(client: httpx.AsyncClient, endpoint: Endpoint, body: dict) -> RequestResult:
    """POST one completion and time it; every failure is recorded, none raised."""
    import httpx

    started = time.perf_counter()
    result = RequestResult(sent_at=started)
    try:
        url = endpoint.url.rstrip("/") + "/completions"
        async with client.stream("POST", url, json=body, headers=endpoint.headers) as response:
            result.replica = response.headers.get("x-dflash-replica")
            if response.status_code != 200:
                await response.aread()
                result.error = str(response.status_code)
            elif body.get("stream"):
                await _read_stream(response, result, started)
            else:
                usage = json.loads(await response.aread()).get("usage") or {}
                result.output_tokens = usage.get("completion_tokens", 0)
                result.prompt_tokens = usage.get("prompt_tokens")
                result.usage_reported = result.ok = "completion_tokens" in usage
                result.error = None if result.ok else "no usage"
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        result.error = type(error).__name__
    if not result.e2e:
        result.e2e = time.perf_counter() - started
    return result


async def _read_stream(response: httpx.Response, result: RequestResult, started: float) -> None:
    """Parse SSE `data:` lines up to [DONE]: text chunks give TTFT and ITL, the usage chunk the tokens."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            result.e2e = time.perf_counter() - started
            result.ok = True
            break
        event = json.loads(data)
        if "error" in event:  # a refusal after the stream began
            result.error = f"stream {event['error'].get('code') or event['error'].get('type')}"
            return
        if event.get("usage"):
            result.output_tokens = event["usage"]["completion_tokens"]
            result.prompt_tokens = event["usage"].get("prompt_tokens")
            result.usage_reported = True
        if any(choice.get("text") for choice in event.get("choices") or ()):
            result.chunk_at.append(time.perf_counter())
    if not result.ok:
        result.error = "stream ended before [DONE]"
    elif not result.usage_reported:
        result.output_tokens = len(result.chunk_at)


async def scrape(client: httpx.AsyncClient, endpoint: Endpoint, times: int) -> list[str]:
    """`times` scrapes of /metrics (a load balancer sends each to one replica); failed ones are dropped."""
    import httpx

    texts = []
    for _ in range(times):
        try:
            response = await client.get(endpoint.metrics, headers=endpoint.headers)
        except httpx.HTTPError:
            continue
        if response.status_code == 200:
            texts.append(response.text)
    return texts
