"""What the service split costs: the step through three Ray actors vs the in-process engine.

    python -m bench.bench_services_split [--geometry qwen3-8b|tiny] [--batch-sizes 1 32]
        [--context 2048] [--steps 16] [--rounds 3] [--simulate-acceptance 6.5]
        [--kv-cache-memory 16GiB] [--name services_split_h200]

Both engines are built over one random-weight checkpoint pair (`dflash_cli.bench.random_pair`) and live
side by side: the in-process `LLM` in this process, and the three services (`RayServices`: pool,
drafter, target actors; the target reaches the pool over gRPC with leasing and the drafter over the
shared-memory step channel). For every batch size, rounds alternate between the two; a round
prefills B prompts of C tokens, warms up, then times `--steps` DFlash steps one by one (each between
two device synchronisations) with `--simulate-acceptance` (this benchmark only, as in
dflash_cli.bench.step: inside the target's process). The split's steps are timed in the target actor
(`SplitBenchTarget`, defined here, so nothing in the package can turn the simulation on), which stops
its request thread (`AsyncEngine.shutdown`) before it steps the engine itself.

Also counted over the split's timed steps: blocking and asynchronous control RPCs per step and the
bytes they carried (from the lease's traffic counters), and every `bytes` field of the control
plane's protos (tensor bytes could only travel in one; there are none).
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

from dflash_cli.bench.random_pair import add_pair_arguments, device_name, random_pair_for
from dflash_cli.bench.simulated_acceptance import SimulatedAcceptance
from dflash_cli.bench.step_timing import abort_all, prefill, timed_steps
from target_service.assembly.service import TargetService

RESULTS = Path(__file__).resolve().parent / "results"
logger = logging.getLogger("bench_services_split")


def step_case(engine, device: torch.device, vocab: int, batch: int, context: int, steps: int, seed: int,
              counters=None) -> dict:
    """Prefill B random prompts of C tokens, one warm-up step, then `steps` timed steps; abort them.

    counters: a callable returning a dict of counters, read just before and just after the timed
    steps; their difference per step is `counters_per_step` (the prefill's opens and reserves are
    not the steady state's traffic)."""
    from target_service.engine.sampling_params import SamplingParams

    k = engine.num_speculative_tokens
    generator = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=(steps + 2) * (k + 1) + 8, temperature=0.0, ignore_eos=True)
    ids = [f"split-{seed}-{i}" for i in range(batch)]
    prompts = [torch.randint(3, vocab - 2, (context,), generator=generator).tolist() for _ in ids]
    seqs = [engine.add_request(request_id, prompt, params) for request_id, prompt in zip(ids, prompts)]
    try:
        prefill(engine, seqs)
        before = {}

        def read_counters():
            before.update(counters() if counters else {})

        times, tokens = timed_steps(engine, seqs, device, steps, on_start=read_counters)
        after = counters() if counters else {}
    finally:
        abort_all(engine, ids)
    return {"step_s": statistics.median(times), "steps_s": times, "tokens": tokens,
            "tokens_per_s": tokens / sum(times), "counters_per_step": _per_step(before, after, steps)}


class SplitBenchTarget(TargetService):
    """The target service with the step loop left to the benchmark: its request thread is stopped
    before the first case (nothing else calls the engine afterwards)."""

    def step_case(self, batch: int, context: int, steps: int, seed: int, acceptance: float) -> dict:
        self.async_engine.shutdown()  # idle, so it stops at once; the engine is the benchmark's now
        device, vocab = torch.device(self.plan.device), self.plan.target_config.vocab_size
        with SimulatedAcceptance(acceptance, seed):
            result = step_case(self.engine, device, vocab, batch, context, steps, seed, self.flushed_stats)
        result["control_per_step"] = result.pop("counters_per_step")
        ordering = getattr(self.channel, "ordering", None)
        result["channel_ordering"] = type(ordering).__name__ if ordering is not None else "none"
        return result

    def flushed_stats(self) -> dict:
        """The control plane's counters once the queued commits are sent (outside the timing)."""
        self.control.flush()
        return self.control_stats()


def _per_step(before: dict, after: dict, steps: int) -> dict:
    """Counter deltas over the timed steps, per step."""
    out = {}
    for key, value in after.items():
        if isinstance(value, (int, float)) and isinstance(before.get(key), (int, float)):
            digits = 6 if key.endswith("_s") else 3  # seconds to the microsecond
            out[key] = round((value - before[key]) / steps, digits)
    return out


def proto_bytes_fields() -> list[str]:
    """Every `bytes` field of the control plane's messages: where tensor bytes could travel."""
    from kvpool_service.metered_client import tensor_fields

    return tensor_fields()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_arguments(parser)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--simulate-acceptance", type=float, default=6.5)
    parser.add_argument("--kv-cache-memory", default="16GiB")
    parser.add_argument("--name", default="services_split")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logger.setLevel(logging.INFO)
    import ray

    from target_service.assembly.engine_args import EngineArgs
    from target_service.assembly.ray_services import RayServices
    from target_service.llm import LLM

    device, dtype, target, drafter = random_pair_for(args)
    max_model_len = args.context + 4 * (args.steps + 2) * 16 + 64
    settings = dict(device=str(device), dtype=dtype, enable_prefix_caching=False,
                    max_num_seqs=max(args.batch_sizes), max_model_len=max_model_len,
                    kv_cache_memory=args.kv_cache_memory, max_num_batched_tokens=8192, seed=args.seed)
    result = {
        "name": args.name,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True).stdout.strip(),
        "command": "python -m bench.bench_services_split " + " ".join(argv or sys.argv[1:]),
        "device": device_name(device), "torch": torch.__version__, "geometry": args.geometry,
        "dtype": dtype, "context": args.context, "steps": args.steps, "rounds": args.rounds,
        "simulate_acceptance": args.simulate_acceptance, "proto_bytes_fields": proto_bytes_fields(),
        "cases": [],
    }
    started = time.perf_counter()
    local = LLM(str(target), str(drafter), **settings)
    vocab = local.assembly.runner.vocab_size
    logger.info("in-process engine up in %.1f s", time.perf_counter() - started)
    started = time.perf_counter()
    split = RayServices(EngineArgs(target=str(target), drafter=str(drafter), **settings),
                        target_class=SplitBenchTarget).start()
    logger.info("three services up in %.1f s: %s", time.perf_counter() - started, split.pids())
    try:
        for batch in args.batch_sizes:
            rounds = {"inprocess": [], "ray": []}
            for index in range(args.rounds):
                seed = args.seed + 1000 * batch + index
                with SimulatedAcceptance(args.simulate_acceptance, seed):
                    rounds["inprocess"].append(step_case(local.engine, device, vocab, batch, args.context,
                                                         args.steps, seed))
                rounds["ray"].append(ray.get(split.target.step_case.remote(
                    batch, args.context, args.steps, seed, args.simulate_acceptance)))
            case = {"batch": batch}
            for mode, runs in rounds.items():
                steps = [s for run in runs for s in run["steps_s"]]
                case[mode] = {
                    "step_ms_median": round(1000 * statistics.median(steps), 3),
                    "step_ms_p10": round(1000 * sorted(steps)[len(steps) // 10], 3),
                    "step_ms_p90": round(1000 * sorted(steps)[(len(steps) * 9) // 10], 3),
                    "tokens_per_s_rounds": [round(run["tokens_per_s"], 1) for run in runs],
                    "tokens_per_s_median": round(statistics.median(run["tokens_per_s"] for run in runs), 1),
                }
            case["ray"]["control_per_step"] = rounds["ray"][-1]["control_per_step"]
            case["ray"]["channel_ordering"] = rounds["ray"][-1]["channel_ordering"]
            case["ray_vs_inprocess"] = round(case["ray"]["tokens_per_s_median"]
                                             / case["inprocess"]["tokens_per_s_median"], 4)
            result["cases"].append(case)
            logger.info("%s", json.dumps(case))
            _save(result, Path(args.out))
    finally:
        split.close()
        local.close()
        gc.collect()
    print(_markdown(result))


def _markdown(result: dict) -> str:
    lines = [f"# {result['name']}: the step through three Ray actors vs in process", "",
             f"device {result['device']}, torch {result['torch']}, geometry {result['geometry']} "
             f"({result['dtype']}), context {result['context']}, {result['steps']} steps x "
             f"{result['rounds']} rounds, simulated acceptance {result['simulate_acceptance']}; "
             f"commit {result['commit']}, {result['date']}", "",
             f"command: `{result['command']}`", "",
             "The split's step channel orders the two processes' GPU work with "
             f"{', '.join(sorted({c['ray']['channel_ordering'] for c in result['cases']})) or '-'} "
             "(foundation.step_channel).", "",
             "| B | in-process ms/step (p10-p90) | split ms/step (p10-p90) | in-process tok/s | split tok/s "
             "| split / in-process | blocking RPCs/step | async RPCs/step | control bytes/step "
             "| target waits on the drafter, ms/step | drafter in handlers, ms/step |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for case in result["cases"]:
        a, b, c = case["inprocess"], case["ray"], case["ray"]["control_per_step"]
        lines.append(
            f"| {case['batch']} | {a['step_ms_median']} ({a['step_ms_p10']}-{a['step_ms_p90']}) "
            f"| {b['step_ms_median']} ({b['step_ms_p10']}-{b['step_ms_p90']}) | {a['tokens_per_s_median']} "
            f"| {b['tokens_per_s_median']} | {case['ray_vs_inprocess']:.3f} | {c.get('blocking_rpcs', '?')} "
            f"| {c.get('async_rpcs', '?')} | {c.get('request_bytes', 0) + c.get('response_bytes', 0)} "
            f"| {_ms_per_step(c.get('drafter_wait_s'))} | {_ms_per_step(c.get('drafter_busy_s'))} |")
    lines += ["", f"`bytes` fields in the control plane's protos: {result['proto_bytes_fields'] or 'none'} "
              "(no tensor can travel over gRPC)."]
    return "\n".join(lines) + "\n"


def _ms_per_step(seconds: float | None) -> str:
    return "?" if seconds is None else f"{seconds * 1e3:.3f}"


def _save(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{result['name']}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"{result['name']}.md").write_text(_markdown(result))


if __name__ == "__main__":
    main()
