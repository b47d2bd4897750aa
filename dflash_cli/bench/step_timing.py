"""Timing engine steps as serving runs them: one case of B sequences of C tokens, per mode.

`engine_case` prefills the prompts, then times steps from CUDA graphs (over rounds) and eagerly once,
each with the kernels and busy GPU time of one step (torch profiler), with the scheduling the engine
was started with (async or not: `LLM(async_scheduling=...)`). The step benches share the pieces:
`timed_steps` (no synchronisation between steps), `kernel_profile`, `spread`, `sync`.

Only the engine's public surface is used: the sequences `add_request` returned are the bench's own
to read (their output tokens, whether they finished), `counters()` gives the preemptions, and the
graphs are switched on the runner (`llm.assembly.runner`) and its in-process drafter.
"""

from __future__ import annotations

import statistics
import time

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def spread(values: list[float]) -> dict:
    ordered = sorted(values)
    return {
        "median": statistics.median(ordered),
        "p10": ordered[len(ordered) // 10],
        "p90": ordered[(len(ordered) * 9) // 10],
        "n": len(ordered),
    }


def emitted(seqs) -> int:
    """Output tokens of these sequences so far (the ones `add_request` returned)."""
    return sum(len(seq.output_token_ids) for seq in seqs)


def prefill(engine, seqs) -> None:
    """Step until every one of `seqs` has its first token (its prompt is in the pool)."""
    while any(not seq.output_token_ids for seq in seqs):
        engine.step()


def abort_all(engine, request_ids) -> None:
    """Forget the bench's requests, finished or not (their pages are freed)."""
    for request_id in request_ids:
        if engine.has_request(request_id):
            engine.abort(request_id)


def timed_steps(engine, seqs, device: torch.device, steps: int, on_start=None) -> tuple[list[float], int]:
    """Seconds of each of `steps` engine steps, and the tokens they emitted to `seqs`.

    No synchronisation between steps: `engine.step()` returns once it has read its step's tokens, so
    the returns are paced by the device, and a step queued ahead of that read (async scheduling)
    overlaps the host's work as in serving. One untimed step first puts that pipeline in its steady
    state; a step's time is from the return of the one before to its own return. `on_start` is
    called after that step, before the timing starts.
    """
    engine.step()
    if on_start is not None:
        on_start()
    before = emitted(seqs)
    times, last = [], time.perf_counter()
    for _ in range(steps):
        engine.step()
        now = time.perf_counter()
        times.append(now - last)
        last = now
    after = emitted(seqs)
    sync(device)
    return times, after - before


def kernel_profile(engine, device: torch.device) -> dict:
    """Kernel launches and busy GPU time of one step."""
    if device.type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.step()
        sync(device)
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    by_name: dict[str, list[float]] = {}
    for event in kernels:
        by_name.setdefault(event.name[:80], []).append(event.device_time_total)
    top = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:12]
    return {
        "kernel_launches": len(kernels),
        "gpu_busy_ms": round(sum(e.device_time_total for e in kernels) / 1000, 3),
        # where the busy time goes: the kernels that took most of it, with their launch counts
        "top_kernels": [{"name": name, "ms": round(sum(times) / 1000, 3), "launches": len(times)}
                        for name, times in top],
    }


class Graphs:
    """The CUDA graphs of a live in-process engine, the target's (`ModelRunner.graphs`) and the
    drafter's (`DraftWorker.graphs`), switched off for an eager timing and back on after it."""

    def __init__(self, runner):
        self.runner = runner
        self.target = runner.graphs
        self.drafter = getattr(runner.drafter, "graphs", None)

    @property
    def captured(self) -> bool:
        return self.target is not None  # none on CPU, or with enforce_eager

    def use(self, on: bool) -> None:
        self.runner.graphs = self.target if on else None
        if self.runner.drafter is not None and self.drafter is not None:
            self.runner.drafter.graphs = self.drafter if on else None


def steps_per_case(steps: int, rounds: int) -> int:
    """Engine steps one case runs after its prefill: each timing of `steps` (graphs each round,
    eager once) adds a warm-up and an untimed step, and graphs and eager one profiled step each."""
    timings = rounds + 1
    return timings * (steps + 2) + 2


def engine_case(llm, batch: int, context: int, steps: int, seed: int, rounds: int = 1) -> dict:
    """Prefill B prompts of C tokens, then time `steps` steps from CUDA graphs in each of `rounds`
    rounds, then eagerly once, on the same engine and sequences. The graphs' spread pools its rounds;
    `round_medians` keeps each."""
    from target_service.engine.sampling_params import SamplingParams

    engine, device = llm.engine, torch.device(llm.assembly.plan.device)
    vocab = llm.assembly.runner.vocab_size
    generator = torch.Generator().manual_seed(seed)
    # As many new tokens as the model allows: with a token budget below B x C the prompts prefill a
    # few per step while the first ones already decode, and a smaller max_tokens let those finish
    # before the timed steps (B 64 ctx 8192 once measured 3.8 "acceptance" over a shrunken batch).
    params = SamplingParams(max_tokens=engine.max_model_len - context - 1, temperature=0.0, ignore_eos=True)
    ids = [f"b{batch}-c{context}-{i}" for i in range(batch)]
    prompts = [torch.randint(3, vocab - 2, (context,), generator=generator).tolist() for _ in ids]
    seqs = [engine.add_request(request_id, prompt, params) for request_id, prompt in zip(ids, prompts)]
    graphs = Graphs(llm.assembly.runner)
    result = {"batch": batch, "context": context}
    try:
        sync(device)
        started = time.perf_counter()
        prefill(engine, seqs)
        sync(device)
        result["prefill_s"] = round(time.perf_counter() - started, 4)
        schedule = [("graphs", True)] * rounds if graphs.captured else []
        timings: dict[str, dict] = {}
        for label, on in [*schedule, ("eager", False)]:
            graphs.use(on)
            engine.step()  # warm-up of this mode
            timing = timings.setdefault(label, {"times": [], "tokens": 0, "round_medians": [],
                                                "running_at_start": None, "preemptions": 0})
            preemptions = engine.counters().num_preemptions
            running = sum(not seq.is_finished for seq in seqs)
            times, tokens = timed_steps(engine, seqs, device, steps)
            timing["times"] += times
            timing["tokens"] += tokens
            timing["round_medians"].append(round(statistics.median(times), 6))
            timing["preemptions"] += engine.counters().num_preemptions - preemptions
            if timing["running_at_start"] is None:  # < batch: sequences finished before the timing
                timing["running_at_start"] = running
                timing["profile"] = kernel_profile(engine, device)
        for label, timing in timings.items():
            times = timing["times"]
            result[label] = {
                **spread(times),
                "round_medians": timing["round_medians"],
                "tokens_per_s": timing["tokens"] / sum(times),
                "mean_acceptance_length": timing["tokens"] / (batch * len(times)),
                "running_at_start": timing["running_at_start"],
                "preemptions": timing["preemptions"],
                **timing["profile"],
            }
    finally:
        graphs.use(True)
        abort_all(engine, ids)
    return result
