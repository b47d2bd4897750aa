"""Training sequences for a drafter: the target's own continuations of corpus prefixes, plus raw corpus.

A drafter is judged on predicting what the TARGET will say, so most of its training text should be
the target's (the DFlash recipe regenerates every response with the target). Continuations come
from the frozen dense target with a KV cache (`dense_generate`: the served weights and math, many
times faster than scheduler steps), greedy by default as acceptance is measured; the loss covers
only the continuation. Raw corpus windows, loss on every token, keep the drafter honest on text
the target did not write. Every row is padded to `seq_len`; `lengths` says where the real tokens end.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from training.corpus import sample_windows
from training.dense_generate import generate_continuations
from training.dense_target import DenseQwen3

logger = logging.getLogger(__name__)


@dataclass
class SequenceSet:
    """ids [N, S] int64 (padded with pad_id), lengths [N], loss_mask [N, S] bool."""

    ids: torch.Tensor
    lengths: torch.Tensor
    loss_mask: torch.Tensor

    def __len__(self) -> int:
        return self.ids.shape[0]

    def rows(self, index: torch.Tensor) -> SequenceSet:
        return SequenceSet(self.ids[index], self.lengths[index], self.loss_mask[index])

    @staticmethod
    def cat(parts: list[SequenceSet]) -> SequenceSet:
        parts = [part for part in parts if len(part)]
        return SequenceSet(*(torch.cat([getattr(p, name) for p in parts])
                             for name in ("ids", "lengths", "loss_mask")))

    def to(self, device) -> SequenceSet:
        return SequenceSet(self.ids.to(device), self.lengths.to(device), self.loss_mask.to(device))

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"ids": self.ids, "lengths": self.lengths, "loss_mask": self.loss_mask}, path)

    @staticmethod
    def load(path: Path) -> SequenceSet:
        data = torch.load(path, map_location="cpu")
        return SequenceSet(data["ids"], data["lengths"], data["loss_mask"])


def pad_sequences(prompts: list[list[int]], continuations: list[list[int]], seq_len: int, pad_id: int
                  ) -> SequenceSet:
    """Rows prompt + continuation, padded to seq_len; loss only on the continuation."""
    count = len(prompts)
    ids = torch.full((count, seq_len), pad_id, dtype=torch.long)
    loss_mask = torch.zeros(count, seq_len, dtype=torch.bool)
    lengths = torch.zeros(count, dtype=torch.long)
    for row, (prompt, continuation) in enumerate(zip(prompts, continuations)):
        tokens = (prompt + continuation)[:seq_len]
        if len(prompt) >= seq_len:
            raise ValueError(f"a prompt of {len(prompt)} tokens leaves no room in seq_len {seq_len}")
        ids[row, : len(tokens)] = torch.tensor(tokens)
        loss_mask[row, len(prompt): len(tokens)] = True
        lengths[row] = len(tokens)
    return SequenceSet(ids, lengths, loss_mask)


def raw_windows(stream: torch.Tensor, count: int, seq_len: int, generator: torch.Generator) -> SequenceSet:
    """Corpus windows with the loss on every token."""
    ids = sample_windows(stream, count, seq_len, generator)
    return SequenceSet(ids, torch.full((count,), seq_len), torch.ones(count, seq_len, dtype=torch.bool))


def build_generated_set(target: DenseQwen3, stream: torch.Tensor, *, count: int, prompt_len: int,
                        gen_tokens: int, seq_len: int, pad_id: int, eos_id: int | None, temperature: float,
                        seed: int, batch: int) -> SequenceSet:
    """`count` rows: a random corpus prefix of prompt_len tokens and the target's continuation."""
    generator = torch.Generator().manual_seed(seed)
    prompts = sample_windows(stream, count, prompt_len, generator).tolist()
    continuations = []
    step = batch * 8  # a progress line every 8 batches
    for first in range(0, count, step):
        continuations += generate_continuations(target, prompts[first: first + step], max_tokens=gen_tokens,
                                                temperature=temperature, eos_id=eos_id, seed=seed + first,
                                                batch=batch)
        logger.info("target continuations: %d/%d", len(continuations), count)
    return pad_sequences(prompts, continuations, seq_len, pad_id)
