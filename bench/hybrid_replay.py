"""The hybrid proposer's choices replayed on recorded outcomes: deterministic, under any step-cost model.

    python -m bench.hybrid_replay [--drafter-cost 0.75] [--max-tokens 64] [--seed 1] [--record FILE]

Why: greedy outputs do not depend on who drafted, so neither does what each proposer would have had
accepted at each position. Recorded once per prompt (the demo pair, the prompts of
`bench.proposer_prompts`), they let the real `HybridProposer` choose step by step against them:
the steps, drafter runs and modelled time of ngram, DFlash and hybrid come out exact and the same on
every run, where timing the engine on these cores moves by +-5% between runs (more than a change to
the choice is worth). A step's cost is the model's: 1 without the drafter, 1 + `--drafter-cost`
with it (at any batch size; on 2 CPU cores the demo drafter costs ~0.75 of a lookup-only step at
batch 1; on an H100, host-bound, ~0.4). The hybrid's clock is handed those costs.

Recorded per prompt: the target's greedy output (the engine, plain decoding, float32 on the CPU), and
DFlash's proposal at every decode position, from the dense training forward of the drafter over
the whole sequence's taps (`training.dense_drafter`, every position an anchor; the serving drafter's
math, so its proposals equal the engine's up to rounding). The lookup's proposals are the
proposer's own, made live from the tokens. Prefills and the context stores are not modelled.
"""

from __future__ import annotations

import argparse
import glob
import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file

from bench.proposer_prompts import prompt_classes
from drafter_service.checkpoint import open_drafter_checkpoint
from target_service.assembly.demo import demo_drafter_path, demo_target_path
from target_service.engine.sampling_params import SamplingParams
from target_service.llm import LLM
from target_service.proposers.hybrid import HybridProposer
from target_service.proposers.ngram import NgramLookups
from target_service.runner.checkpoint import open_target_checkpoint
from training.anchors import build_blocks
from training.dense_drafter import DenseDFlashDrafter
from training.dense_target import DenseQwen3

METHODS = ("ngram", "dflash", "hybrid")


@dataclass
class Recorded:
    """One prompt: its tokens and output (greedy), and DFlash's K-token proposal at each decode
    position p (the sequence is tokens[:p + 1]; its bonus token is at p)."""

    prompt: list[int]
    output: list[int]
    dflash: dict[int, list[int]]

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


def _state(directory: Path) -> dict[str, torch.Tensor]:
    state = {}
    for shard in sorted(glob.glob(str(directory / "*.safetensors"))):
        state.update({name: tensor.float() for name, tensor in load_file(shard).items()})
    return state


@torch.inference_mode()
def record(classes: dict[str, list[list[int]]], max_tokens: int, target_dir: Path | None = None,
           drafter_dir: Path | None = None) -> dict[str, list[Recorded]]:
    """Each prompt's greedy output and DFlash's proposals (the demo pair unless the checkpoint
    directories are given)."""
    target_dir, drafter_dir = Path(target_dir or demo_target_path()), Path(drafter_dir or demo_drafter_path())
    checkpoint = open_target_checkpoint(target_dir)
    drafter_config, _ = open_drafter_checkpoint(drafter_dir, checkpoint.config)
    target, drafter = DenseQwen3(checkpoint.config), DenseDFlashDrafter(drafter_config)
    target.load_state_dict(_state(target_dir))
    drafter.load_state_dict(_state(drafter_dir))
    block = drafter_config.block_size
    plain = LLM(str(target_dir), "none", device="cpu", dtype="float32", max_num_seqs=1, max_model_len=512,
                kv_cache_memory="256MiB")
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    recorded = {}
    try:
        for name, prompts in classes.items():
            recorded[name] = []
            for prompt in prompts:
                output = list(plain.generate([prompt], params)[0].outputs[0].token_ids)
                ids = torch.tensor([prompt + output])
                _, taps = target.hidden(ids, drafter_config.target_layer_ids)
                anchors = torch.arange(len(prompt), ids.shape[1] - 1)[None]  # every decode position
                every = torch.ones_like(ids, dtype=torch.bool)
                blocks = build_blocks(ids, torch.tensor([ids.shape[1]]), every, anchors,
                                      torch.ones_like(anchors, dtype=torch.bool), block_size=block,
                                      mask_token_id=drafter_config.mask_token_id, gamma=7.0)
                logits = drafter(taps, blocks, target.model.embed_tokens.weight, target.lm_head_weight)
                drafts = logits.argmax(-1)[0].tolist()  # [n, block - 1]
                recorded[name].append(Recorded(prompt, output, dict(zip(anchors[0].tolist(), drafts))))
    finally:
        plain.close()
    return recorded


class _Seq:
    """What a proposer reads of a sequence: its tokens so far (the newest, the bonus, not yet run)."""

    def __init__(self, seq_id: int, index: int, tokens: list[int]):
        self.seq_id, self.tokens = seq_id, list(tokens)
        self.index = index  # its prompt's, in the batch being decoded

    @property
    def num_computed(self) -> int:
        return len(self.tokens) - 1

    def token_slice(self, start: int, end: int) -> list[int]:
        return self.tokens[start:end]


def _accepted(proposal: list[int], truth: list[int]) -> int:
    parted = (i for i, (proposed, actual) in enumerate(zip(proposal, truth)) if proposed != actual)
    return next(parted, min(len(proposal), len(truth)))


class Replayer:
    """One engine of `method`, kept across requests (the hybrid's scores and clock carry over, as in
    a served engine): `decode` decodes prompts in one batch (one prompt: batch 1) against the
    recordings and returns steps, drafter runs, accepted drafts and modelled time (a lookup-only step
    costs 1)."""

    def __init__(self, method: str, drafter_cost: float, num_draft: int, max_batch: int):
        self.method, self.drafter_cost, self.num_draft = method, drafter_cost, num_draft
        self.buffers = SimpleNamespace(
            draft_tokens=torch.zeros(max_batch, num_draft, dtype=torch.int64), taps=torch.zeros(1, 1),
            layout=SimpleNamespace(max_context_rows=1 << 20))
        self._running: list[_Seq] = []
        self._prompts: list[Recorded] = []
        drafter = SimpleNamespace(block_size=num_draft + 1, propose=self._dflash_propose, settle=lambda: None,
                                  store_context=lambda num_rows: None)
        self.hybrid = HybridProposer(drafter, self.buffers) if method == "hybrid" else None
        if self.hybrid is not None:  # the recorded drafter reads the recordings, not the buffers
            self.hybrid.stage_propose_side = lambda num_seqs: 1
        self.lookups = NgramLookups(min_ngram=1, max_ngram=3)
        self._next_id = 0
        self.match_lengths: list[int] = []  # ngram: each row's match length in the last step
        self.by_match: dict[int, list[int]] = {}  # ngram: accepted drafts per step, by match length

    def _dflash_propose(self, num_seqs: int, width: int, columns: int) -> None:
        for row, seq in enumerate(self._running[:num_seqs]):
            drafts = self._prompts[seq.index].dflash[seq.num_computed][:width]
            self.buffers.draft_tokens[row, :width] = torch.tensor(drafts)

    def _proposals(self, running: list[_Seq]) -> tuple[bool, list[list[int]]]:
        count = len(running)
        if self.method == "hybrid":
            self.hybrid.stage_sequences(running)
            self.hybrid.propose(count, self.num_draft, 1)
            return self.hybrid.ran_drafter, self.buffers.draft_tokens[:count].tolist()
        if self.method == "dflash":
            self._dflash_propose(count, self.num_draft, 1)
            return True, self.buffers.draft_tokens[:count].tolist()
        matches = self.lookups.propose(running, self.num_draft)
        self.match_lengths = [match.ngram for match in matches]
        return False, [match.tokens for match in matches]

    def decode(self, prompts: list[Recorded]) -> dict:
        self._prompts = prompts
        first_id, self._next_id = self._next_id, self._next_id + len(prompts)
        seqs = [_Seq(first_id + index, index, recorded.prompt + recorded.output[:1])  # the prefill's token
                for index, recorded in enumerate(prompts)]
        steps = drafter_runs = accepted = drafts = 0
        time = 0.0
        while True:
            self._running = [seq for seq in seqs if len(seq.tokens) < len(prompts[seq.index].tokens)]
            if not self._running:
                break
            # A row may draft up to its tokens left but one (the last is the target's own, as the
            # engine's draft budget has it); a step where no row may draft decodes plainly.
            budgets = [len(prompts[seq.index].tokens) - len(seq.tokens) - 1 for seq in self._running]
            ran, proposals = False, [[] for _ in self._running]
            if max(budgets) > 0:
                ran, proposals = self._proposals(self._running)
            cost = 1.0 + (self.drafter_cost if ran else 0.0)
            for row, (seq, proposal, budget) in enumerate(zip(self._running, proposals, budgets)):
                truth = prompts[seq.index].tokens[len(seq.tokens):]
                count = _accepted(proposal[:budget], truth)
                seq.tokens += truth[: count + 1]
                accepted, drafts = accepted + count, drafts + (budget > 0)
                if self.method == "ngram" and budget > 0:
                    self.by_match.setdefault(self.match_lengths[row], []).append(count)
            if self.hybrid is not None and max(budgets) > 0:
                self.hybrid.step_took(len(self._running), cost)
            steps, drafter_runs, time = steps + 1, drafter_runs + ran, time + cost
        return {"steps": steps, "drafts": drafts, "drafter_runs": drafter_runs, "accepted": accepted,
                "time": time}


def replay_all(recorded: dict[str, list[Recorded]], drafter_cost: float, num_draft: int) -> dict:
    """Per class and method, one engine as `bench.bench_proposer_times` drives it: the class in one
    batch (warm-up), then each prompt alone (b1, summed), then the class in one batch again (batch).
    Also per class, the ngram engine's accepted drafts per step by its match's length (b1)."""
    out = {}
    for name, prompts in recorded.items():
        for method in METHODS:
            engine = Replayer(method, drafter_cost, num_draft, len(prompts))
            engine.decode(prompts)
            engine.by_match = {}
            runs = [engine.decode([prompt]) for prompt in prompts]
            out[f"{name}/b1/{method}"] = {key: sum(run[key] for run in runs) for key in runs[0]}
            if method == "ngram":
                by_match = sorted(engine.by_match.items())
                out[f"{name}/lookup by match length"] = {n: list(counts) for n, counts in by_match}
            out[f"{name}/batch/{method}"] = engine.decode(prompts)
    return out


def table(results: dict, drafter_cost: float) -> str:
    lines = [f"drafter cost {drafter_cost} of a lookup-only step; time in lookup-only steps:", "",
             "| class / batch | ngram steps | DFlash steps | hybrid steps (drafter runs) "
             "| hybrid time / best |",
             "| --- | --- | --- | --- | --- |"]
    cases = sorted({key.rsplit("/", 1)[0] for key in results if "/b1/" in key or "/batch/" in key})
    for key in cases:
        ngram, dflash, hybrid = (results[f"{key}/{method}"] for method in METHODS)
        best = min(ngram["time"], dflash["time"])
        lines.append(f"| {key} | {ngram['steps']} | {dflash['steps']} | {hybrid['steps']} "
                     f"({hybrid['drafter_runs']}) | {hybrid['time'] / best:.3f} |")
    return "\n".join(lines)


def match_table(results: dict) -> str:
    """ngram at batch 1: steps and mean accepted drafts by its match's length."""
    lines = ["ngram at batch 1, accepted drafts per step by the length of its match (0: none):", "",
             "| class | " + " | ".join(f"n = {n}: steps, mean accepted" for n in range(4)) + " |",
             "| --- | --- | --- | --- | --- |"]
    for key in sorted(key for key in results if key.endswith("by match length")):
        by_match = results[key]
        cells = [f"{len(by_match[n])}, {sum(by_match[n]) / len(by_match[n]):.2f}" if by_match.get(n) else "-"
                 for n in range(4)]
        lines.append(f"| {key.split('/')[0]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter-cost", type=float, nargs="+", default=[0.75, 0.4])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--record", default=None, help="a file to keep the recordings in (read if present)")
    args = parser.parse_args()
    path = Path(args.record) if args.record else None
    if path is not None and path.exists():
        kept = json.loads(path.read_text())
        recorded = {name: [Recorded(p["prompt"], p["output"], {int(k): v for k, v in p["dflash"].items()})
                           for p in prompts] for name, prompts in kept.items()}
    else:
        recorded = record(prompt_classes(str(demo_target_path()), 4, args.seed), args.max_tokens)
        if path is not None:
            path.write_text(json.dumps({name: [vars(p) for p in prompts]
                                        for name, prompts in recorded.items()}))
    num_draft = len(next(iter(next(iter(recorded.values()))[0].dflash.values())))
    for cost in args.drafter_cost:
        results = replay_all(recorded, cost, num_draft)
        print(table(results, cost), end="\n\n")
    print(match_table(results))


if __name__ == "__main__":
    main()
