"""Who should draft: DFlash, prompt lookup (ngram), or the hybrid that picks one per sequence and step,
on the demo pair, over three kinds of prompt.

    python -m bench.bench_proposers [--prompts-per-class 4] [--rounds 2] [--max-tokens 128]
        [--device cpu] [--dtype float32] [--seed 1] [--out bench/results/proposers_cpu.md]

Why: the trained drafter wins on code like its training data, the lookup where the target copies (its
prompt, or itself); the hybrid exists to follow the better of the two on every prompt at almost no
cost. This measures whether it does, against the goals of its issue (hybrid acceptance >= 0.95 of the
per-prompt better one's, tok/s within 3% of the better method's on each class, and >= 0.90 of the
winner's acceptance where one proposer wins by 1.5x), computed and printed whether they pass or not.

Prompt classes (built by `bench.proposer_prompts`; the goals and the report are `bench.proposer_report`),
each from held-out files of this Python's standard library (the split the demo pair was trained with),
tokenized by the demo target's tokenizer:
- code: held-out code, 48-token prompts (`training.corpus.held_out_prompts`);
- repeats: a group of lines of 12-24 tokens said three times, then cut half-way through a fourth;
- edits: a function's source, then "# the same, again:" and its first line.

Greedy (temperature 0, ignore_eos), K = block_size - 1 (15 for the demo pair), through `LLM`. Each
method runs every prompt alone (batch 1) and the whole class in one batch; each of `--rounds` timing
rounds (after one warm-up round) runs DFlash, ngram and hybrid back to back on each prompt and on the
batch, in an order that rotates by round; tok/s is the median over rounds with min-max. Plain decoding
runs in the warm-up round (the oracle) and is timed in the first round only (it is the slowest). On a
CPU speeds are per second of this process's CPU time (`time.process_time`: other work on the host
disturbs it less than the wall clock), on a GPU of wall time. Every output is compared with plain
greedy decoding of the same prompts at the same batch. The hybrid's cost of choosing is the time
inside `HybridProposer.propose` minus the time inside its DFlash drafter's `propose`, per step,
measured in one more round of the hybrid alone with its calls wrapped (`ChoiceMeter`); the timed
rounds run it unwrapped, as ngram and DFlash run. Its ngram share is the fraction of drafted rows the
lookup drafted (in the warm-up round, wrapped too). Writes one markdown file, with the
raw record as a JSON block at its end.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from bench.proposer_prompts import prompt_classes
from bench.proposer_report import METHODS, MODES, goal_checks, report
from dflash_cli.bench.serve_report import client_machine
from drafter_service.checkpoint import open_drafter_checkpoint
from target_service.assembly.demo import demo_drafter_path, demo_target_path
from target_service.engine.sampling_params import SamplingParams
from target_service.llm import LLM
from target_service.proposers.hybrid import HybridProposer
from target_service.proposers.token_proposer import NGRAM
from target_service.runner.checkpoint import open_target_checkpoint

RESULTS = Path(__file__).resolve().parent / "results"


# ---- measuring ----------------------------------------------------------------------------------

class ChoiceMeter:
    """Wraps a hybrid engine's proposer and its runner's context store, per step:
    - `hybrid_s`: time inside the proposer's propose; `dflash_s`: inside its DFlash drafter's calls made
      from there (its propose, and the store of context deferred from lookup-only steps just before it);
    - `lookup_s`: inside the lookup's proposal and the write of its tokens, work the ngram proposer does
      too; `staging_s`: staging the rows held from lookup-only steps into the step buffers before a
      drafter run (on a GPU their rows are picked there); what is left of propose (hybrid - dflash -
      lookup - staging) is deciding;
    - `context_s`: inside the runner's `_store_context` at steps that decode (the step's context rows
      selected, then held or stored; `context_steps` of them), less `context_dflash_s`, the drafter's
      stores made from there; a prefill-only step's are not counted; ngram keeps no context;
    and who drafted each row per request."""

    def __init__(self, llm: LLM, clock):
        runner = llm.assembly.runner
        proposer = runner.drafter
        if not isinstance(proposer, HybridProposer):
            raise TypeError(f"not a hybrid engine: its proposer is {type(proposer).__name__}")
        self.clock = clock
        self.reset()
        propose, dflash = proposer.propose, proposer.dflash
        where = [None]  # "propose" or "context": the drafter's calls from there are the drafter's time

        def timed_dflash(call):
            def timed_call(*args):
                started = clock()
                call(*args)
                if where[0] == "propose":
                    self.dflash_s += clock() - started
                elif where[0] == "context":
                    self.context_dflash_s += clock() - started
            return timed_call

        def timed_lookup(call):
            def timed_call(*args):
                started = clock()
                try:
                    return call(*args)
                finally:
                    self.lookup_s += clock() - started
            return timed_call

        def timed(*args):
            started, where[0] = clock(), "propose"
            try:
                propose(*args)
            finally:
                where[0] = None
            self.hybrid_s += clock() - started
            self.steps += 1
            for seq, source in zip(proposer.staged, proposer.sources):
                rows = self.rows.setdefault(seq.request_id, [0, 0])  # [ngram rows, all rows]
                rows[0] += source == NGRAM
                rows[1] += 1

        stage = proposer.deferred.stage

        def timed_stage(buffers):
            started = clock()
            try:
                return stage(buffers)
            finally:
                if where[0] == "propose":
                    self.staging_s += clock() - started

        store_context = runner._store_context

        def timed_context(batch, taps, plan, *rest):
            if not plan.decodes:  # a prefill-only step: not a decode step's cost
                return store_context(batch, taps, plan, *rest)
            started, outer, where[0] = clock(), where[0], "context"
            try:
                store_context(batch, taps, plan, *rest)
            finally:
                where[0] = outer
            self.context_s += clock() - started
            self.context_steps += 1

        self._wrapped = [(dflash, name, timed_dflash(getattr(dflash, name)))
                         for name in ("propose", "store_context", "settle")]
        self._wrapped += [(proposer.lookups, "propose", timed_lookup(proposer.lookups.propose)),
                          (proposer, "_write", timed_lookup(proposer._write)), (proposer, "propose", timed),
                          (proposer.deferred, "stage", timed_stage),
                          (runner, "_store_context", timed_context)]

    @contextmanager
    def attached(self):
        """The wrappers in place for the block, the engine's own methods again after it: the timed
        rounds run the hybrid unwrapped (a wrapper's clock reads and bookkeeping, a few µs a step, are
        host time that ngram and DFlash do not pay)."""
        own = [(owner, name, vars(owner).get(name)) for owner, name, _ in self._wrapped]
        for owner, name, wrapper in self._wrapped:
            setattr(owner, name, wrapper)
        try:
            yield self
        finally:
            for owner, name, original in own:
                if original is None:
                    delattr(owner, name)  # the class's method shows through again
                else:
                    setattr(owner, name, original)

    def reset(self) -> None:
        self.hybrid_s = self.dflash_s = self.lookup_s = self.staging_s = self.context_s = 0.0
        self.context_dflash_s = 0.0
        self.steps = self.context_steps = 0
        self.rows: dict[str, list[int]] = {}


def open_engines(target: str, drafter: str, *, num_speculative_tokens: int, batch: int, max_model_len: int,
                 device: str, dtype: str, methods=("plain", "dflash", "ngram", "hybrid")) -> dict[str, LLM]:
    settings = dict(device=device, dtype=dtype, max_num_seqs=batch, max_model_len=max_model_len,
                    kv_cache_memory="256MiB" if device == "cpu" else "4GiB")
    spec = dict(num_speculative_tokens=num_speculative_tokens)
    engines = {}
    for method in methods:
        if method == "plain":
            engines[method] = LLM(target, "none", **settings)
        else:
            engines[method] = LLM(target, None if method == "ngram" else drafter, speculative_method=method,
                                  **spec, **settings)
    return engines


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_once(llm: LLM, prompts, params, clock, meter: ChoiceMeter | None) -> dict:
    """One generate call: seconds of `clock`, the outputs, and per request its counters (and, metered,
    the hybrid's split and rows)."""
    if meter is not None:
        meter.reset()
    with meter.attached() if meter is not None else nullcontext():
        _sync()
        started = clock()
        outputs = llm.generate(prompts, params)
        _sync()
        seconds = clock() - started
    run = {"seconds": seconds, "tokens": [out.outputs[0].token_ids for out in outputs],
           "drafts": [out.spec_decode.num_drafts for out in outputs],
           "accepted": [out.spec_decode.num_accepted_tokens for out in outputs]}
    if meter is not None:
        run.update(hybrid_s=meter.hybrid_s, dflash_s=meter.dflash_s, lookup_s=meter.lookup_s,
                   staging_s=meter.staging_s,
                   context_s=meter.context_s, context_dflash_s=meter.context_dflash_s, steps=meter.steps,
                   context_steps=meter.context_steps,
                   rows=[meter.rows.get(out.request_id, [0, 0]) for out in outputs])
    return run


def _acceptance(drafts: int, accepted: int) -> float:
    return 1.0 + accepted / drafts if drafts else 1.0


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _us_per_step(runs: list[dict], key: str, steps: int) -> float:
    return 1e6 * sum(run[key] for run in runs) / max(1, steps)


def _flat(runs: list[dict]) -> list[list[int]]:
    """The outputs of one round's runs, in prompt order (batch-1 runs are made in prompt order)."""
    return [tokens for run in runs for tokens in run["tokens"]]


def summarize(runs: dict[str, list[list[dict]]], mode: str, split: list[dict]) -> dict:
    """runs[method][round] = the round's runs (one per prompt at batch 1, one at batch); round 0 warms up.
    Per method, against plain greedy at the same batch: per-prompt acceptance, tok/s (per prompt at
    batch 1, and the whole class), lossless count; the hybrid's ngram share (round 0's) and choosing
    cost (from `split`: the hybrid's metered runs of one more round)."""
    expected = _flat(runs["plain"][0])  # plain greedy decoding, the oracle of every output
    out = {}
    for method, rounds in runs.items():
        first = rounds[0]
        tokens = [t for run in first for t in run["tokens"]]
        drafts = [d for run in first for d in run["drafts"]]
        accepted = [a for run in first for a in run["accepted"]]
        counted = [len(t) for t in tokens]
        timed = rounds[1:] or rounds
        speeds = [sum(counted) / sum(run["seconds"] for run in rnd) for rnd in timed]
        row = {"acceptance": [_acceptance(d, a) for d, a in zip(drafts, accepted)],
               "num_drafts": drafts, "num_accepted_tokens": accepted,
               "tokens_per_s": _spread(speeds),
               "lossless": sum(t == e for rnd in rounds for t, e in zip(_flat(rnd), expected)),
               "outputs": sum(len(run["tokens"]) for rnd in rounds for run in rnd)}
        if mode == "batch1":
            row["prompt_tokens_per_s"] = [
                statistics.median(len(rnd[i]["tokens"][0]) / rnd[i]["seconds"] for rnd in timed)
                for i in range(len(first))]
        if method == "hybrid":
            rows = [r for run in first for r in run["rows"]]
            row["rows_per_prompt"] = rows  # [rows the lookup drafted, rows drafted]
            row["ngram_share_per_prompt"] = [n / total if total else 0.0 for n, total in rows]
            row["ngram_share"] = sum(n for n, _ in rows) / max(1, sum(t for _, t in rows))
            every = split
            steps = sum(run["steps"] for run in every)
            row["dflash_us_per_step"] = _us_per_step(every, "dflash_s", steps)
            row["choose_us_per_step"] = _us_per_step(every, "hybrid_s", steps) - row["dflash_us_per_step"]
            row["lookup_us_per_step"] = _us_per_step(every, "lookup_s", steps)
            row["staging_us_per_step"] = _us_per_step(every, "staging_s", steps)
            row["deciding_us_per_step"] = (row["choose_us_per_step"] - row["lookup_us_per_step"]
                                           - row["staging_us_per_step"])
            context_steps = sum(run["context_steps"] for run in every)
            row["context_dflash_us_per_step"] = _us_per_step(every, "context_dflash_s", context_steps)
            row["context_us_per_step"] = (_us_per_step(every, "context_s", context_steps)
                                          - row["context_dflash_us_per_step"])
            row["steps_timed"] = steps
        out[method] = row
    return out


def measure(target: str, drafter: str, classes: dict[str, list[list[int]]], *, max_tokens: int, rounds: int,
            device: str, dtype: str, num_speculative_tokens: int | None = None) -> dict:
    """Per class and mode (batch1, batch), `summarize` of every method's runs, and the goal checks."""
    clock = time.process_time if device == "cpu" else time.perf_counter
    if num_speculative_tokens is None:
        config = open_target_checkpoint(target).config
        num_speculative_tokens = open_drafter_checkpoint(drafter, config)[0].block_size - 1
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    longest = max(len(p) for prompts in classes.values() for p in prompts)
    batch = max(len(prompts) for prompts in classes.values())
    engines = open_engines(target, drafter, num_speculative_tokens=num_speculative_tokens, batch=batch,
                           max_model_len=longest + max_tokens + num_speculative_tokens + 16,
                           device=device, dtype=dtype)
    meter = ChoiceMeter(engines["hybrid"], clock)
    started = time.perf_counter()
    record = {"num_speculative_tokens": num_speculative_tokens, "max_tokens": max_tokens, "rounds": rounds,
              "clock": clock.__name__, "classes": {}}
    try:
        for name, prompts in classes.items():
            runs = {mode: {method: [] for method in ("plain", *METHODS)} for mode in MODES}
            for round_ in range(rounds + 1):  # round 0 warms up (and is the one acceptance is read from)
                turn = list(METHODS[round_ % len(METHODS):] + METHODS[:round_ % len(METHODS)])
                if round_ < 2:  # plain decoding: the oracle (round 0) and one timed round, the slowest method
                    turn.insert(0, "plain")
                for method in turn:
                    runs["batch1"][method].append([])
                    runs["batch"][method].append([])
                for prompt in prompts:
                    for method in turn:
                        probe = meter if method == "hybrid" and round_ == 0 else None  # its rows
                        run = run_once(engines[method], [prompt], params, clock, probe)
                        runs["batch1"][method][-1].append(run)
                for method in turn:
                    probe = meter if method == "hybrid" and round_ == 0 else None
                    runs["batch"][method][-1].append(run_once(engines[method], prompts, params, clock, probe))
            hybrid = engines["hybrid"]
            split = {"batch1": [run_once(hybrid, [prompt], params, clock, meter) for prompt in prompts],
                     "batch": [run_once(hybrid, prompts, params, clock, meter)]}
            print(f"{name}: {len(prompts)} prompts, {time.perf_counter() - started:.0f} s", file=sys.stderr,
                  flush=True)
            record["classes"][name] = {"prompt_lens": [len(p) for p in prompts], "batch_size": len(prompts),
                                       **{mode: summarize(runs[mode], mode, split[mode]) for mode in MODES}}
    finally:
        for llm in engines.values():
            llm.close()
    record["goals"] = goal_checks(record)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts-per-class", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default=str(RESULTS / "proposers_cpu.md"))
    args = parser.parse_args()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("float32" if device == "cpu" else "bfloat16")
    target, drafter = str(demo_target_path()), str(demo_drafter_path())
    started = time.perf_counter()
    classes = prompt_classes(target, args.prompts_per_class, args.seed)
    record = measure(target, drafter, classes, max_tokens=args.max_tokens, rounds=args.rounds,
                     device=device, dtype=dtype)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None)
    where = (f"{torch.get_num_threads()} threads on {client_machine()}" if device == "cpu"
             else torch.cuda.get_device_name())
    record.update(command=f"python -m bench.bench_proposers {flags}", device=where,
                  commit=commit.stdout.strip(),
                  date=datetime.date.today().isoformat(), torch=torch.__version__,
                  threads=torch.get_num_threads(), dtype=dtype, wall_s=time.perf_counter() - started)
    Path(args.out).write_text(report(record))
    print(report(record).split("## Raw record")[0])


if __name__ == "__main__":
    main()
