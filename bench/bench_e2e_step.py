"""The speculative step end to end, as a user feels it: ms per step and tokens/s through the engine.

    python -m bench.bench_e2e_step [--geometry qwen3-8b|tiny] [--batch-sizes 1 8 32 64]
        [--contexts 2048 8192 32768] [--steps 16] [--rounds 3] [--simulate-acceptance 6.5] [--no-hf]
        [--kv-cache-memory 60GiB] [--limits-max-num-seqs 32 64 256] [--limits-kv-cache-memory 16GiB]
        [--name e2e_step_h200]

Writes a random-weight checkpoint pair of the geometry (default Qwen3-8B and its 5-layer DFlash-b16
drafter, `bench_e2e_checkpoints`), then for every batch size B and context C that fit the pool:
B random prompts of C tokens are prefilled (timed), then `--steps` steps are timed one by one, with
no synchronisation between them (what serving sees), on an engine without a drafter (plain decode)
and on one with the drafter (the DFlash step, K = block_size - 1), one engine at a time. Each case
is timed from CUDA graphs with async scheduling ("graphs") and without ("graphs_sync") over
`--rounds` rounds that alternate the two (in turn first, so a drift of the device's clocks over the
case falls on both), and eagerly once. HF transformers eager over the same checkpoint is timed in
the same run (one decode step of B sequences after a C-token prefill, and a K+1-token verify),
where its dense cache fits.

A random drafter is almost never accepted, so `--simulate-acceptance MEAN` (this benchmark only:
it replaces the engine's accepted-lengths function inside this process, and nothing in the package can turn
it on) draws each step's accepted count from a Poisson around MEAN - 1, capped at K, so the step's
variable-length paths run at a realistic acceptance and tokens/s is measured, not extrapolated.

Also recorded: kernel launches and busy GPU time of one step (torch profiler), and with the
`--limits-*` flags the DFlash step against max_num_seqs and the pool's size (`bench.step_limits`).
Results: JSON, markdown and a PNG (tokens/s vs batch: this engine, HF, the goal lines) in bench/results/.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import logging
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.bench_e2e_checkpoints import write_random_pair
from bench.bench_e2e_report import markdown, plot
from bench.step_limits import limit_configs, limits_sweep
from foundation.host_transfer import to_device

RESULTS = Path(__file__).resolve().parent / "results"
logger = logging.getLogger("bench_e2e_step")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class SimulatedAcceptance:
    """Replaces `target_service.verify.accepted_lengths` in this process: accepted ~ Poisson(MEAN - 1),
    capped at each sequence's draft count (drawn on the host, one small copy to the device)."""

    def __init__(self, mean: float, seed: int):
        import target_service.verify as verify_module

        self.module, self.original = verify_module, verify_module.accepted_lengths
        self.rate = max(mean - 1.0, 0.0)
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, drafts, targets, owners, columns, num_drafts: torch.Tensor) -> torch.Tensor:
        rates = torch.full((num_drafts.shape[0],), self.rate)
        drawn = torch.poisson(rates, generator=self.generator).to(torch.int64).tolist()
        return torch.minimum(to_device(drawn, torch.int64, num_drafts.device), num_drafts)

    def __enter__(self):
        self.module.accepted_lengths = self
        return self

    def __exit__(self, *exc):
        self.module.accepted_lengths = self.original


def _spread(values: list[float]) -> dict:
    ordered = sorted(values)
    return {
        "median": statistics.median(ordered),
        "p10": ordered[len(ordered) // 10],
        "p90": ordered[(len(ordered) * 9) // 10],
        "n": len(ordered),
    }


def _timed_steps(engine, device: torch.device, steps: int, on_start=None) -> tuple[list[float], int]:
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
    _sync(device)
    return times, after - before


def _kernel_profile(engine, device: torch.device) -> dict:
    """Kernel launches and busy GPU time of one step."""
    if device.type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile

    _sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.step()
        _sync(device)
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


def _graphs_on(engine, on: bool, saved: tuple) -> None:
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
    from target_service.sampling_params import SamplingParams

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
        _sync(device)
        started = time.perf_counter()
        while any(not seq.output_token_ids for seq in engine.sequences.values()):
            engine.step()
        _sync(device)
        result["prefill_s"] = round(time.perf_counter() - started, 4)
        graph_modes = GRAPH_MODES if saved[0] is not None else ()  # none on CPU, or with enforce_eager
        schedule = [mode for r in range(rounds) for mode in (graph_modes[::-1] if r % 2 else graph_modes)]
        timings: dict[str, dict] = {}
        for label, on, overlapped in [*schedule, EAGER_MODE]:
            _graphs_on(engine, on, saved)
            engine.async_scheduling = overlapped
            engine.step()  # warm-up of this mode
            timing = timings.setdefault(label, {"times": [], "tokens": 0, "round_medians": [],
                                                "running_at_start": None, "preemptions": 0})
            preemptions = engine.scheduler.num_preemptions
            running = sum(not seq.is_finished for seq in engine.sequences.values())
            times, tokens = _timed_steps(engine, device, steps)
            timing["times"] += times
            timing["tokens"] += tokens
            timing["round_medians"].append(round(statistics.median(times), 6))
            timing["preemptions"] += engine.scheduler.num_preemptions - preemptions
            if timing["running_at_start"] is None:  # < batch: sequences finished before the timing
                timing["running_at_start"] = running
                timing["profile"] = _kernel_profile(engine, device)
        for label, timing in timings.items():
            times = timing["times"]
            result[label] = {
                **_spread(times),
                "round_medians": timing["round_medians"],
                "tokens_per_s": timing["tokens"] / sum(times),
                "mean_acceptance_length": timing["tokens"] / (batch * len(times)),
                "running_at_start": timing["running_at_start"],
                "preemptions": timing["preemptions"],
                **timing["profile"],
            }
    finally:
        _graphs_on(engine, True, saved)
        engine.async_scheduling = True
        for request_id in ids:
            if request_id in engine.sequences:
                engine.abort(request_id)
    return result


@torch.inference_mode()
def hf_case(model, batch: int, context: int, k: int, vocab: int, steps: int, seed: int) -> dict:
    """HF eager: one decode step of B sequences after a C-token prefill, and a verify of K+1 tokens."""
    from transformers import DynamicCache

    device = model.device
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, vocab - 2, (batch, context), generator=generator).to(device)
    cache = DynamicCache()
    model(prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
    decode, verify = [], []
    token = torch.randint(3, vocab - 2, (batch, 1), generator=generator).to(device)
    block = torch.randint(3, vocab - 2, (batch, k + 1), generator=generator).to(device)
    for _ in range(steps + 1):  # the first of each is a warm-up; the cache is cropped back each time
        for ids, times in ((token, decode), (block, verify)):
            _sync(device)
            started = time.perf_counter()
            model(ids, past_key_values=cache, use_cache=True)
            _sync(device)
            times.append(time.perf_counter() - started)
            cache.crop(-ids.shape[1])
    del cache
    return {"decode": _spread(decode[1:]), "verify": _spread(verify[1:])}


def add_pair_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags `random_pair_for` reads: --geometry, --checkpoints, --dtype, --device, --seed."""
    parser.add_argument("--geometry", default="qwen3-8b", choices=["qwen3-8b", "tiny"])
    parser.add_argument(
        "--checkpoints", default="/tmp/dflash-e2e-pair", help="where the random pair is written"
    )
    parser.add_argument("--dtype", default=None, help="compute dtype (default: bfloat16 on a GPU)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--seed", type=int, default=0)


def random_pair_for(args) -> tuple[torch.device, str, Path, Path]:
    """The device (--device, else cuda when there is one), the dtype (--dtype, else bf16 on a GPU
    and fp32 on CPU) and the random pair of --geometry written (once) under --checkpoints."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    started = time.perf_counter()
    target, drafter = write_random_pair(Path(args.checkpoints), args.geometry, dtype=dtype, seed=args.seed)
    logger.info("checkpoints ready in %.1f s", time.perf_counter() - started)
    return device, dtype, target, drafter


def _fits(batch: int, context: int, steps: int, rounds: int, k: int, limits) -> bool:
    """Whether B sequences of C tokens and the steps' new tokens fit the pool without preemption.
    The first prompts may decode while the last ones prefill (a token budget below B x C), so a
    sequence may reach max_model_len; that is what is counted."""
    tokens_per_seq = max(context + steps_per_case(steps, rounds) * (k + 1) + 8, limits.max_model_len)
    need = batch * limits.blocks_for(tokens_per_seq)
    return batch <= limits.max_num_seqs and need <= limits.max_blocks_per_seq


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_arguments(parser)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3, help="rounds alternating graphs and graphs_sync")
    parser.add_argument("--simulate-acceptance", type=float, default=6.5)
    parser.add_argument("--kv-cache-memory", default=None, help="pool budget (default: the engine's)")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                        help="the target's K/V pages (fp8: float8 e4m3, half the attention's bytes)")
    parser.add_argument("--limits-max-num-seqs", type=int, nargs="*", default=[],
                        help="also time the DFlash step on engines started with each of these max_num_seqs")
    parser.add_argument("--limits-kv-cache-memory", nargs="*", default=[],
                        help="... and with each of these pool sizes (e.g. 16GiB)")
    parser.add_argument("--limits-batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--limits-context", type=int, default=2048)
    parser.add_argument("--hf", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--hf-max-tokens", type=int, default=2**18, help="largest B x C HF is run at")
    parser.add_argument("--name", default="e2e_step")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logger.setLevel(logging.INFO)
    from target_service.llm import LLM

    device, dtype, target, drafter = random_pair_for(args)
    max_context = max(args.contexts)
    result = {
        "name": args.name,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "command": "python -m bench.bench_e2e_step " + " ".join(argv or sys.argv[1:]),
        "device": _device_name(device),
        "torch": torch.__version__,
        "geometry": args.geometry,
        "dtype": dtype,
        "simulate_acceptance": args.simulate_acceptance,
        "kv_cache_dtype": args.kv_cache_dtype,
        "steps": args.steps,
        "rounds": args.rounds,
        "plain": [],
        "dflash": [],
        "hf": [],
        "skipped": [],
    }
    out = Path(args.out)
    def make_llm(mode: str, max_num_seqs: int, kv_cache_memory: str | None):
        return LLM(
            str(target),
            str(drafter) if mode == "dflash" else "none",
            device=str(device),
            dtype=dtype,
            enable_prefix_caching=False,
            max_num_seqs=max_num_seqs,
            max_model_len=max(max_context, args.limits_context)
            + steps_per_case(args.steps, args.rounds) * 16 + 64,
            kv_cache_memory=kv_cache_memory,
            kv_cache_dtype=args.kv_cache_dtype,
            max_num_batched_tokens=8192,
            seed=args.seed,
        )

    for mode in ("plain", "dflash"):  # one engine at a time: each gets the whole device
        llm = make_llm(mode, max(args.batch_sizes), args.kv_cache_memory)
        engine = llm.engine
        k, vocab = engine.scheduler.num_speculative_tokens, engine.target.config.vocab_size
        if mode == "dflash":
            result["num_speculative_tokens"] = k
        result[f"{mode}_pool_blocks"] = engine.limits.num_blocks
        with SimulatedAcceptance(args.simulate_acceptance, args.seed):
            for context in args.contexts:
                for batch in args.batch_sizes:
                    if not _fits(batch, context, args.steps, args.rounds, max(k, 15), engine.limits):
                        result["skipped"].append(
                            {"mode": mode, "batch": batch, "context": context, "why": "pool too small"}
                        )
                        continue
                    result[mode].append(engine_case(llm, batch, context, args.steps, k, vocab, args.seed,
                                                    args.rounds))
                    logger.info("%s %s", mode, json.dumps(result[mode][-1]))
                    _save(result, out, plot_too=False)  # a run cut short keeps what it measured
        llm.close()
        del llm, engine
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    configs = limit_configs(args.limits_max_num_seqs, args.limits_kv_cache_memory,
                            default_seqs=max(args.batch_sizes), default_memory=args.kv_cache_memory)
    if configs:
        def case(llm, batch, context):
            engine = llm.engine
            return engine_case(llm, batch, context, args.steps, engine.scheduler.num_speculative_tokens,
                               engine.target.config.vocab_size, args.seed, args.rounds)

        with SimulatedAcceptance(args.simulate_acceptance, args.seed):
            result["limits"] = limits_sweep(lambda seqs, memory: make_llm("dflash", seqs, memory), case,
                                            configs, args.limits_batch_sizes, args.limits_context)
        _save(result, out, plot_too=False)
    if args.hf:
        from transformers import AutoModelForCausalLM

        model = (
            AutoModelForCausalLM.from_pretrained(str(target), dtype=getattr(torch, dtype)).to(device).eval()
        )
        k = result.get("num_speculative_tokens", 15)
        for case in result["dflash"]:
            if case["batch"] * case["context"] > args.hf_max_tokens:
                continue
            result["hf"].append(
                {
                    "batch": case["batch"],
                    "context": case["context"],
                    **hf_case(model, case["batch"], case["context"], k, vocab, args.steps, args.seed),
                }
            )
            logger.info("hf %s", json.dumps(result["hf"][-1]))
            _save(result, out, plot_too=False)
        del model
    _save(result, out, plot_too=True)
    print((out / f"{args.name}.md").read_text())


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"


def _save(result: dict, out: Path, *, plot_too: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    name = result["name"]
    (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"{name}.md").write_text(markdown(result))
    if plot_too:
        plot(result, out / f"{name}.png")


if __name__ == "__main__":
    main()
