"""A randomised workload driven straight through an `LLMEngine`, shaped like what a server meets:
prompts of every length, exact repeats and shared prefixes (prefix-cache hits at every offset),
requests arriving while others decode, aborts mid-flight, greedy and sampled requests, outputs of
every length. The step benchmark measures one shape at a time; a kernel that compiles on a shape
class it never saw, or a step that stalls on a long prefill, shows up here.

`varied_requests` draws the requests (seeded); `drive` runs them, adding and aborting between
steps, and times every step; `drive_streams` runs them through the Ray services as concurrent
streaming clients.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import random
import time

from target_service.engine.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class VariedRequest:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    abort_after_steps: int | None  # steps after its arrival; None: runs to its end


@dataclasses.dataclass
class DriveResult:
    step_seconds: list[float] = dataclasses.field(default_factory=list)
    decode_step_seconds: list[float] = dataclasses.field(default_factory=list)  # steps a stream waited on
    finished: int = 0
    aborted: int = 0

    @property
    def longest_step(self) -> float:
        return max(self.step_seconds, default=0.0)


def varied_requests(rng: random.Random, count: int, *, vocab_size: int, max_prompt: int, max_tokens: int,
                    min_prompt: int = 1, abort_share: float = 0.1) -> list[VariedRequest]:
    """`count` requests: a quarter repeat an earlier prompt, a quarter extend an earlier prompt's
    prefix (cut anywhere) with fresh tokens, the rest are fresh, min_prompt..max_prompt tokens;
    half greedy, half sampled (temperature, top_p, top_k, seeded or not); abort_share of them are
    aborted a few steps after they arrive."""
    fresh = lambda length: [rng.randrange(3, vocab_size) for _ in range(length)]
    prompts: list[list[int]] = []
    requests = []
    for index in range(count):
        kind = rng.random()
        if prompts and kind < 0.25:
            prompt = list(rng.choice(prompts))
        elif prompts and kind < 0.5:
            base = rng.choice(prompts)
            cut = rng.randint(1, len(base))
            prompt = base[:cut] + fresh(rng.randint(1, max(1, min(300, max_prompt - cut))))
        else:
            prompt = fresh(rng.randint(min_prompt, max_prompt))
        prompt = prompt[:max_prompt]
        prompts.append(prompt)
        requests.append(VariedRequest(f"varied-{index}", prompt, _params(rng, max_tokens),
                                      rng.randint(1, 12) if rng.random() < abort_share else None))
    return requests


def _params(rng: random.Random, max_tokens: int) -> SamplingParams:
    tokens = rng.randint(1, max_tokens)
    if rng.random() < 0.5:
        return SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    return SamplingParams(max_tokens=tokens, temperature=rng.choice([0.6, 1.0, 1.3]),
                          top_p=rng.choice([1.0, 0.9, 0.5]), top_k=rng.choice([-1, 1, 20]),
                          seed=rng.choice([None, rng.randrange(2**31)]), ignore_eos=rng.random() < 0.8)


def drive(engine, requests: list[VariedRequest], rng: random.Random, *, arrival_chance: float = 0.35,
          max_steps: int = 100_000) -> DriveResult:
    """Run every request through `engine` (an LLMEngine): each step, while requests are left, one
    more arrives with `arrival_chance` (always when the engine is idle), so arrivals land during
    prefills and decodes alike; due aborts happen between steps; finished requests are released."""
    pending = list(requests)
    due: dict[str, int] = {}  # request id -> the step it is aborted at
    result, step = DriveResult(), 0
    while pending or engine.has_unfinished:
        while pending and (not engine.has_unfinished or rng.random() < arrival_chance):
            request = pending.pop(0)
            engine.add_request(request.request_id, request.prompt, request.params)
            if request.abort_after_steps is not None:
                due[request.request_id] = step + request.abort_after_steps
            if rng.random() >= arrival_chance:
                break
        for request_id in [rid for rid, at in due.items() if at <= step]:
            del due[request_id]
            if engine.has_request(request_id):
                seq = engine.abort(request_id)
                result.aborted += seq.finish_reason == "abort"
        if not engine.has_unfinished:
            continue
        streaming = any(not seq.is_prefilling for seq in engine.running_sequences())
        started = time.perf_counter()
        finished = engine.step()
        result.step_seconds.append(time.perf_counter() - started)
        if streaming:
            result.decode_step_seconds.append(result.step_seconds[-1])
        for seq in finished:
            due.pop(seq.request_id, None)
            if engine.has_request(seq.request_id):
                engine.release(seq.request_id)
                result.finished += 1
        step += 1
        if step > max_steps:
            raise RuntimeError(f"the workload did not end within {max_steps} steps")
    return result


@dataclasses.dataclass
class StreamResult:
    finished: int = 0
    aborted: int = 0
    failed: list[str] = dataclasses.field(default_factory=list)  # "request id: error", one per failure


def drive_streams(services, requests: list[VariedRequest], rng: random.Random, *,
                  mean_gap_s: float = 0.02, timeout_s: float = 300.0) -> StreamResult:
    """Run every request through `services` (a started `RayServices`) by the replica's own path (a
    `RemoteEngine`), as a server's clients would: each streams concurrently, arriving `mean_gap_s`
    apart on average (exponential gaps, so arrivals land during others' prefills and decodes); a
    request with `abort_after_steps` closes its stream after that many deltas (a client that went
    away)."""
    from target_service.assembly.remote_engine import RemoteEngine

    engine = RemoteEngine(services, max_num_seqs=services.plan.args.max_num_seqs, max_waiting=len(requests))
    result = StreamResult()
    arrivals = list(itertools.accumulate(rng.expovariate(1 / mean_gap_s) for _ in requests))

    async def client(request: VariedRequest, at: float) -> None:
        await asyncio.sleep(at)
        outcome, deltas = "aborted", 0
        try:
            stream = engine.generate(request.prompt, request.params, request.request_id)
            async with contextlib.aclosing(stream):
                async for delta in stream:
                    deltas += 1
                    if delta.finished:
                        outcome = "finished"
                        break
                    if request.abort_after_steps is not None and deltas >= request.abort_after_steps:
                        break
        except Exception as error:  # every failure is reported; none stops the other clients
            outcome = f"{request.request_id}: {error!r}"
        if outcome == "finished":
            result.finished += 1
        elif outcome == "aborted":
            result.aborted += 1
        else:
            result.failed.append(outcome)

    async def main() -> None:
        try:
            await asyncio.wait_for(asyncio.gather(*(client(r, at) for r, at in zip(requests, arrivals))),
                                   timeout_s)
        except TimeoutError:
            raise RuntimeError(f"the workload did not end within {timeout_s:g} s") from None
        finally:
            await engine.router.stop()

    asyncio.run(main())
    return result
