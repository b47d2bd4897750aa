"""The soak's clients: each sends one request after another until the soak's deadline, and checks
every answer against what the server promises.

A client has one role, fixed by its index, so every run has the same mix:

| role       | share           | what it does                                                          |
| disconnect | index % 3 == 0  | streams, then leaves at a random point: before the first byte (a       |
|            |                 | cancelled send) or after a random number of events                    |
| timeout    | index % 6 == 1  | streams with a short deadline for the whole request (SoakLoad.        |
|            |                 | timeout_s): it completes within it, or leaves when it passes          |
| complete   | the rest        | streams to the end; with probability SoakLoad.poison_rate it sends a  |
|            |                 | poison instead, not streamed: the next of bench.soak_poisons' list,   |
|            |                 | which the clients share, so every poison is sent as often as the rest |

A quarter of the streamed requests go to /v1/chat/completions, the rest to /v1/completions. Every
one asks for ignore_eos, so a completed stream has exactly max_tokens tokens and finish_reason
"length": that, its well-formed events and its closing [DONE] are the oracle of a completion.
Latency, from the stream as serve_load measures it: TTFT is the first event with text, ITL the gaps
between events with text (one event carries every token a speculative step accepted).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.soak_poisons import Poison, check_answer


@dataclass(frozen=True)
class SoakLoad:
    """What each request asks for; the defaults are the committed run's."""

    model: str = "dflash-demo"
    max_tokens: tuple[int, int] = (8, 96)  # each request asks for a uniform count in this range
    poison_rate: float = 0.1  # of a complete-role client's requests
    timeout_s: tuple[float, float] = (1.0, 12.0)  # a timeout-role request's deadline: some pass it queued
    request_timeout_s: float = 300.0  # everyone else's: longer than any queue the soak builds
    chat_share: float = 0.25


@dataclass
class Record:
    """One request as its client saw it; times in seconds, `started_s` from the soak's start."""

    client: int
    kind: str  # "complete" | "disconnect" | "timeout" | "poison"
    started_s: float
    route: str = "completions"
    outcome: str = ""  # "completed" | "disconnected" | "timed_out" | "answered" (a poison) | "fault"
    fault: str | None = None  # what was wrong, when outcome is "fault"
    poison: str | None = None
    status: int | None = None
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    tokens: int = 0
    e2e_s: float = 0.0


def role_of(index: int) -> str:
    return "disconnect" if index % 3 == 0 else "timeout" if index % 6 == 1 else "complete"


def prompt_texts(count: int, seed: int) -> list[str]:
    """Windows of 40-400 characters of a stdlib source file: code, what the demo pair was trained
    on; some repeat, so the prefix cache is hit too."""
    source = (Path(json.__file__).parent / "decoder.py").read_text()
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        length = rng.randint(40, 400)
        start = rng.randrange(len(source) - length)
        texts.append(source[start:start + length])
    return texts


class Client:
    """One client of the soak: its role, its seeded choices, and the records of what it sent."""

    def __init__(self, index: int, http: httpx.AsyncClient, load: SoakLoad, prompts: list[str], seed: int,
                 poisons: itertools.cycle[Poison]):
        self.index, self.http, self.load, self.prompts, self.poisons = index, http, load, prompts, poisons
        self.role = role_of(index)
        self.rng = random.Random(seed * 1_000_003 + index)
        self.records: list[Record] = []

    async def run(self, t0: float, deadline: float, *, poisons_first: int = 0) -> None:
        """Requests back to back until `deadline` (perf_counter); the last one runs to its end.
        poisons_first: that many poisons before anything else, so a whole round of them is sent
        however slowly the server answers (a loaded machine sent 6 of 9 in a 45 s soak)."""
        while time.perf_counter() < deadline:
            poisoned = self.role == "complete" and self.rng.random() < self.load.poison_rate
            poisoned = poisoned or len(self.records) < poisons_first
            record = Record(self.index, "poison" if poisoned else self.role, time.perf_counter() - t0)
            if poisoned:
                await self._poison(record)
            else:
                await self._stream(record)
            self.records.append(record)

    async def _poison(self, record: Record) -> None:
        poison = next(self.poisons)
        record.poison = poison.name
        started = time.perf_counter()
        try:
            response = await self.http.post("/v1/completions", content=poison.encode(self.load.model),
                                            headers={"Content-Type": "application/json"},
                                            timeout=self.load.request_timeout_s)
        except httpx.HTTPError as error:
            record.outcome, record.fault = "fault", f"{poison.name}: {type(error).__name__} {error}"
            return
        record.e2e_s, record.status = time.perf_counter() - started, response.status_code
        wrong = check_answer(poison, response.status_code, response.text)
        record.outcome, record.fault = ("fault", f"{poison.name}: {wrong}") if wrong else ("answered", None)

    async def _stream(self, record: Record) -> None:
        chat = self.rng.random() < self.load.chat_share
        record.route = "chat" if chat else "completions"
        max_tokens = self.rng.randint(*self.load.max_tokens)
        body = self._body(chat, max_tokens)
        stop_after = leave_after_s = None
        if record.kind == "timeout":
            leave_after_s = self.rng.uniform(*self.load.timeout_s)
        elif record.kind == "disconnect" and self.rng.random() < 0.25:
            leave_after_s = self.rng.uniform(0.0, 1.0)  # likely still queued or prefilling
        elif record.kind == "disconnect":
            stop_after = self.rng.randint(1, max(1, max_tokens // 2))  # events, not tokens
        path = "/v1/chat/completions" if chat else "/v1/completions"
        check = StreamCheck(record, max_tokens, stop_after)
        send = check.send(self.http, path, body, self.load.request_timeout_s)
        if leave_after_s is None:
            await send
            return
        try:
            await asyncio.wait_for(send, leave_after_s)  # on time: cancelled, the connection closed
        except asyncio.TimeoutError:
            record.outcome = "timed_out" if record.kind == "timeout" else "disconnected"
            record.e2e_s = time.perf_counter() - check.started

    def _body(self, chat: bool, max_tokens: int) -> dict:
        prompt = self.rng.choice(self.prompts)
        body = {"model": self.load.model, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}, "temperature": self.rng.choice((0.0, 0.8))}
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        return body


class StreamCheck:
    """Reads one SSE stream into its Record and checks it: every event a JSON chunk of the route's
    object, one finish_reason ("length"), a usage chunk with max_tokens tokens, then [DONE]."""

    def __init__(self, record: Record, max_tokens: int, stop_after: int | None):
        self.record, self.max_tokens, self.stop_after = record, max_tokens, stop_after
        self.finish_reasons: list[str] = []
        self.usage_tokens: int | None = None
        self.events = 0
        self.last_text: float | None = None
        self.started = time.perf_counter()

    async def send(self, http: httpx.AsyncClient, path: str, body: dict, timeout: float) -> None:
        record = self.record
        try:
            async with http.stream("POST", path, json=body, timeout=timeout) as response:
                record.status = response.status_code
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    record.outcome, record.fault = "fault", f"status {response.status_code}: {text[:200]}"
                    return
                await self._read(response)
        except httpx.TimeoutException:
            record.outcome = "timed_out"
        except (httpx.HTTPError, ValueError) as error:
            record.outcome, record.fault = "fault", f"{type(error).__name__}: {error}"
        record.e2e_s = time.perf_counter() - self.started

    async def _read(self, response: httpx.Response) -> None:
        record = self.record
        lines = response.aiter_lines()
        async for line in lines:
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                rest = [extra async for extra in lines if extra.strip()]
                wrong = self._verdict(rest)
                record.outcome, record.fault = ("fault", wrong) if wrong else ("completed", None)
                return
            self._event(json.loads(data))
            if self.record.outcome == "fault":
                return
            if self.stop_after is not None and self.events >= self.stop_after:
                record.outcome = "disconnected"  # leaving the `with` closes the connection
                return
        record.outcome, record.fault = "fault", f"the stream ended before [DONE] after {self.events} events"

    def _event(self, event: dict) -> None:
        record = self.record
        self.events += 1
        expected = "chat.completion.chunk" if record.route == "chat" else "text_completion"
        if "error" in event or event.get("object") != expected or not isinstance(event.get("choices"), list):
            record.outcome, record.fault = "fault", f"a malformed or error event: {json.dumps(event)[:200]}"
            return
        if event.get("usage"):
            self.usage_tokens = event["usage"].get("completion_tokens")
        for choice in event["choices"]:
            text = choice.get("delta", {}).get("content") if record.route == "chat" else choice.get("text")
            if text:
                now = time.perf_counter()
                if self.last_text is None:
                    record.ttft_s = now - self.started
                else:
                    record.itl_s.append(now - self.last_text)
                self.last_text = now
            if choice.get("finish_reason"):
                self.finish_reasons.append(choice["finish_reason"])

    def _verdict(self, after_done: list[str]) -> str | None:
        self.record.tokens = self.usage_tokens or 0
        if after_done:
            return f"lines after [DONE]: {after_done[:3]}"
        if self.finish_reasons != ["length"]:
            return f"finish reasons {self.finish_reasons}, expected ['length'] (ignore_eos)"
        if self.usage_tokens != self.max_tokens:
            return f"usage says {self.usage_tokens} tokens, {self.max_tokens} were asked (ignore_eos)"
        if self.record.ttft_s is None:
            return "no event carried text"
        return None
