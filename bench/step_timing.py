"""Timing engine steps as serving runs them: one case of B sequences of C tokens, per mode.

`engine_case` prefills the prompts, then times steps from CUDA graphs with async scheduling on and off
(alternating over rounds) and eagerly, each with the kernels and busy GPU time of one step (torch
profiler). The step benches share the pieces: `timed_steps` (no synchronisation between steps),
`kernel_profile`, `spread`, `sync`.
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


def timed_steps(engine, device: torch.device, steps: int, on_start=None) -> tuple[list[float], int]:
    """Seconds of each of `steps` engine steps, and the tokens they emitted.

    No synchronisation between steps: `engine.step()` returns once it has read its step's tokens, so
    the returns are paced by the device, and a step queued ahead of that read (async scheduling)
    overlaps the host's work as in serving. One untimed step first puts that pipeline in its steady
    state; a step's time is from the return of the one before to its own return. `on_start` is
    called after that step, before the timing starts.
    """
    engine.step()
    if on_start is not None:
        on_start()
    before = sum(len(seq.output_token_ids) for seq in engine.sequences.values())
    times, last = [], time.perf_counter()
    for _ in range(steps):
        engine.step()
        now = time.perf_counter()
        times.append(now - last)
        last = now
    after = sum(len(seq.output_token_ids) for seq in engine.sequences.values())
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


def graphs_on(engine, on: bool, saved: tuple) -> None:
    """Switch both CUDA graph runners (the target's, the drafter's) on or off on a live engine."""
    target_graphs, draft_graphs = saved
    engine.graphs = target_graphs if on else None
    if engine.drafter is not None:
        engine.drafter.graphs = draft_graphs if on else None


# (label, CUDA graphs on, async scheduling on): the first two alternate over the rounds; eager runs once
GRAPH_MODES = (("graphs", True, True), ("graphs_sync", True, False))
EAGER_MODE = ("eager", False, True)


def steps_per_case(steps: int, rounds: int) -> int:
    """Engine steps one case runs after its prefill: each timing of `steps` (two graph modes per round,
    eager once) adds a warm-up and an untimed step, and each mode one profiled step."""
    timings = len(GRAPH_MODES) * rounds + 1
    return timings * (steps + 2) + len(GRAPH_MODES) + 1


def engine_case(llm, batch: int, context: int, steps: int, k: int, vocab: int, seed: int,
                rounds: int = 1) -> dict:
    """Prefill B prompts of C tokens, then time `steps` steps per mode and round side by side on the
    same engine and sequences: from CUDA graphs with and without async scheduling, alternating over
    `rounds`, then eagerly once. Each mode's spread pools its rounds; `round_medians` keeps each."""
    from target_service.engine.sampling_params import SamplingParams

    engine, device = llm.engine, llm.engine.device
    generator = torch.Generator().manual_seed(seed)
    # As many new tokens as the model allows: with a token budget below B x C the prompts prefill a
    # few per step while the first ones already decode, and a smaller max_tokens let those finish
    # before the timed steps (B 64 ctx 8192 once measured 3.8 "acceptance" over a shrunken batch).
    params = SamplingParams(max_tokens=engine.scheduler.max_model_len - context - 1, temperature=0.0,
                            ignore_eos=True)
    ids = [f"b{batch}-c{context}-{i}" for i in range(batch)]
    for request_id in ids:
        prompt = torch.randint(3, vocab - 2, (context,), generator=generator).tolist()
        engine.add_request(request_id, prompt, params)
    saved = (engine.graphs, getattr(engine.drafter, "graphs", None))
    result = {"batch": batch, "context": context}
    try:
        sync(device)
        started = time.perf_counter()
        while any(not seq.output_token_ids for seq in engine.sequences.values()):
            engine.step()
        sync(device)
        result["prefill_s"] = round(time.perf_counter() - started, 4)
        graph_modes = GRAPH_MODES if saved[0] is not None else ()  # none on CPU, or with enforce_eager
        schedule = [mode for r in range(rounds) for mode in (graph_modes[::-1] if r % 2 else graph_modes)]
        timings: dict[str, dict] = {}
        for label, on, overlapped in [*schedule, EAGER_MODE]:
            graphs_on(engine, on, saved)
            engine.async_scheduling = overlapped
            engine.step()  # warm-up of this mode
            timing = timings.setdefault(label, {"times": [], "tokens": 0, "round_medians": [],
                                                "running_at_start": None, "preemptions": 0})
            preemptions = engine.scheduler.num_preemptions
            running = sum(not seq.is_finished for seq in engine.sequences.values())
            times, tokens = timed_steps(engine, device, steps)
            timing["times"] += times
            timing["tokens"] += tokens
            timing["round_medians"].append(round(statistics.median(times), 6))
            timing["preemptions"] += engine.scheduler.num_preemptions - preemptions
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
        graphs_on(engine, True, saved)
        engine.async_scheduling = True
        for request_id in ids:
            if request_id in engine.sequences:
                engine.abort(request_id)
    return result
