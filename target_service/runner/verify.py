"""Verification on the device: the drafts go into the target's inputs and the accepted lengths come
out beside the logits, with no value read by the host in between.

The host knows every index of a step before any kernel runs: which forward row each draft is the
input of, which logits row it must match, whose draft it is. It plans those (`DraftIndex`, plain
ints) and moves them in one copy; the values (drafts, target tokens, accepted lengths) stay on the
device, feed the context store, and reach the host in one read after the step is queued. Before,
the host read the drafts to pack the forward and the target's tokens to decide the acceptance, and
the GPU idled through both waits.

The accept rule is `sampling.accept_drafts` for the whole batch: per sequence, the longest prefix
of its drafts equal to the target's tokens (each draft d_m against the target's choice after the
tokens before it, logits row m of the sequence's verify block).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from foundation.host_transfer import to_device


@dataclass
class DraftIndex:
    """Where the D drafts of one step go, in packed order, and how many each decode verifies.

    Per draft: `input_rows` (the forward row whose input token it is), `sources` (its flat index in
    the step buffers' draft_tokens [S, W]), `logit_rows` (the logits row whose target token it must
    equal), `owners` (its decode's index in the step) and `columns` (its place in that decode's
    drafts). Per decode: `num_drafts` (verified) and `max_accepted` (how many of them may count:
    fewer near the request's max_tokens, `DecodeWork`).
    """

    input_rows: list[int] = field(default_factory=list)
    sources: list[int] = field(default_factory=list)
    logit_rows: list[int] = field(default_factory=list)
    owners: list[int] = field(default_factory=list)
    columns: list[int] = field(default_factory=list)
    num_drafts: list[int] = field(default_factory=list)
    max_accepted: list[int] = field(default_factory=list)

    def add_decode(self, num_draft: int, *, source_row: int, width: int, input_row: int,
                   logit_row: int, max_accepted: int | None = None) -> None:
        """A decode verifying `num_draft` drafts (row `source_row` of draft_tokens, `width` columns
        wide), its bonus at forward row `input_row` and its first logits row at `logit_row`; at most
        `max_accepted` of them (default all) may be accepted."""
        owner = len(self.num_drafts)
        self.num_drafts.append(num_draft)
        self.max_accepted.append(num_draft if max_accepted is None else max_accepted)
        for column in range(num_draft):
            self.input_rows.append(input_row + 1 + column)
            self.sources.append(source_row * width + column)
            self.logit_rows.append(logit_row + column)
            self.owners.append(owner)
            self.columns.append(column)

    @property
    def num_draft_tokens(self) -> int:
        return len(self.sources)

    def to_device(self, device: torch.device | str) -> DeviceDraftIndex:
        per_draft = [self.input_rows, self.sources, self.logit_rows, self.owners, self.columns]
        per_decode = [self.num_drafts, self.max_accepted]
        values = [value for field_ in per_draft + per_decode for value in field_]
        flat = to_device(values, torch.int64, device)
        count, decodes = self.num_draft_tokens, len(self.num_drafts)
        return DeviceDraftIndex(*flat.split([count] * len(per_draft) + [decodes] * len(per_decode)))


@dataclass(frozen=True)
class DeviceDraftIndex:
    """A `DraftIndex` on the device (int64 tensors of the same names)."""

    input_rows: torch.Tensor
    sources: torch.Tensor
    logit_rows: torch.Tensor
    owners: torch.Tensor
    columns: torch.Tensor
    num_drafts: torch.Tensor
    max_accepted: torch.Tensor

    def place_drafts(self, draft_tokens: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Gather the step's drafts from draft_tokens [S, W] into the forward's `input_ids` (in
        place); returns them [D] in packed order."""
        drafts = draft_tokens.reshape(-1)[self.sources]
        input_ids[self.input_rows] = drafts
        return drafts

    def accepted_lengths(self, drafts: torch.Tensor, target_tokens: torch.Tensor) -> torch.Tensor:
        """Accepted drafts per decode [num decodes] given the target's token of every logits row."""
        accepted = accepted_lengths(drafts, target_tokens[self.logit_rows], self.owners, self.columns,
                                    self.num_drafts)
        return torch.minimum(accepted, self.max_accepted)


def accepted_lengths(drafts: torch.Tensor, targets: torch.Tensor, owners: torch.Tensor, columns: torch.Tensor,
                     num_drafts: torch.Tensor) -> torch.Tensor:
    """Per decode, the index of its first draft that differs from the target (all its drafts when
    none does): the minimum, over its drafts, of `column` where mismatched else `num_draft`."""
    first_miss = torch.where(drafts != targets, columns, num_drafts[owners])
    return num_drafts.scatter_reduce(0, owners, first_miss, reduce="amin", include_self=True)
