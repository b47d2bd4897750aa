"""Where a step's host time goes: the engine's functions under cProfile, beside the GPU's busy time.

    python -m bench.bench_step_host [--geometry qwen3-8b|tiny] [--batch 1] [--context 2048]
        [--steps 40] [--out bench/results] [--name step_host_h200]

A graphed step leaves the GPU idle while the host runs Python between the launches; this names
the functions that Python time is spent in. The engine is the step bench's (random pair, simulated
acceptance 6.5). Two passes over the same sequences: plain timing (ms per step, median), then
cProfile (which slows Python, so its times rank the functions rather than measure them). Time
inside `HostReadback.tolist` is the host waiting for the GPU, not host work. Writes a markdown
table of the engine's functions by cumulative and by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from pathlib import Path

import torch

from bench.bench_e2e_checkpoints import add_pair_arguments, device_name, random_pair_for
from bench.simulated_acceptance import SimulatedAcceptance
from bench.step_timing import sync

RESULTS = Path(__file__).resolve().parent / "results"
PROJECT_DIRS = ("target_service", "drafter_service", "kvpool_service", "kernels", "foundation")


def _stats_table(profile: cProfile.Profile, steps: int, sort: str, limit: int) -> list[str]:
    stats = pstats.Stats(profile, stream=io.StringIO())
    rows = []
    for (path, line, name), (_, calls, own, cumulative, _) in stats.stats.items():
        if any(f"/{d}/" in path for d in PROJECT_DIRS) or name.startswith(("<built-in", "<method")):
            where = path.split("/work/")[-1] if "/" in path else path
            label = f"{Path(where).parent.name}/{Path(where).name}:{line} {name}" if line else name
            rows.append((label, calls / steps, own / steps * 1e3, cumulative / steps * 1e3))
    key = 3 if sort == "cumulative" else 2
    rows.sort(key=lambda row: -row[key])
    lines = ["| function | calls/step | own ms/step | cumulative ms/step |", "| --- | ---: | ---: | ---: |"]
    lines += [f"| `{label}` | {calls:.1f} | {own:.3f} | {cum:.3f} |"
              for label, calls, own, cum in rows[:limit]]
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_arguments(parser)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--kv-cache-memory", default=None)
    parser.add_argument("--name", default="step_host")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    from target_service.engine.sampling_params import SamplingParams
    from target_service.llm import LLM

    device, dtype, target, drafter = random_pair_for(args)
    llm = LLM(str(target), str(drafter), device=str(device), dtype=dtype, enable_prefix_caching=False,
              max_num_seqs=max(args.batch, 1), max_model_len=args.context + 4 * args.steps * 16 + 256,
              kv_cache_memory=args.kv_cache_memory, max_num_batched_tokens=8192, seed=args.seed)
    engine = llm.engine
    vocab = engine.target.config.vocab_size
    generator = torch.Generator().manual_seed(args.seed)
    params = SamplingParams(max_tokens=3 * args.steps * 16 + 64, temperature=0.0, ignore_eos=True)
    for i in range(args.batch):
        prompt = torch.randint(3, vocab - 2, (args.context,), generator=generator).tolist()
        engine.add_request(f"h{i}", prompt, params)
    with SimulatedAcceptance(6.5, args.seed):
        while any(not seq.output_token_ids for seq in engine.sequences.values()):
            engine.step()
        for _ in range(3):
            engine.step()
        times = []
        for _ in range(args.steps):
            sync(device)
            started = time.perf_counter()
            engine.step()
            sync(device)
            times.append(time.perf_counter() - started)
        profile = cProfile.Profile()
        sync(device)
        started = time.perf_counter()
        profile.enable()
        for _ in range(args.steps):
            engine.step()
        sync(device)
        profile.disable()
        profiled_s = time.perf_counter() - started
    llm.close()
    lines = [f"# Host time of a step: {args.name}", "",
             f"- device {device_name(device)}, torch {torch.__version__}, "
             f"geometry {args.geometry} ({dtype}), "
             f"B {args.batch}, context {args.context}, K {engine.scheduler.num_speculative_tokens}, "
             f"simulated acceptance 6.5, graphs {'on' if engine.graphs is not None else 'off'}",
             f"- ms per step: median {statistics.median(times) * 1e3:.2f} (min {min(times) * 1e3:.2f}, "
             f"max {max(times) * 1e3:.2f}) over {args.steps} steps; under cProfile "
             f"{profiled_s / args.steps * 1e3:.2f}",
             "", "## By cumulative time", "", *_stats_table(profile, args.steps, "cumulative", 45),
             "", "## By own time", "", *_stats_table(profile, args.steps, "own", 30), ""]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
