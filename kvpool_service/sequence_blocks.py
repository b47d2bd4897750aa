"""The pool's record of one open sequence, and the checks of the plain values requests carry.

Split from `kvpool_service.block_manager` so the BlockManager file holds only the bookkeeping; every check
raises `InvalidRequest` naming the field (and the sequence), and builds its message only on failure.
"""

from __future__ import annotations

import operator
from array import array
from dataclasses import dataclass

from kvpool_service.errors import InvalidRequest
from kvpool_service.prefix_cache import BlockHash

TOKEN_TYPECODE = "I"  # token ids are stored as unsigned 32-bit ints
assert array(TOKEN_TYPECODE).itemsize == 4
MAX_SEQ_ID = 2**64 - 1


@dataclass(slots=True)
class SequenceBlocks:
    """The pool's record of one open sequence. Callers read it; only the BlockManager writes it.

    | field                        | set at | updated by       | meaning                                 |
    | ---------------------------- | ------ | ---------------- | --------------------------------------- |
    | seq_id, seq_index            | open   | -                | caller's id; row in the block tables    |
    | block_table                  | open   | reserve (append) | block ids; position p in block p // tpb |
    | num_cached_tokens            | open   | -                | prefix-cache hit, skipped by prefill    |
    | num_tokens, num_context      | open   | commit           | target K/V written; draft context kept  |
    | token_ids                    | open   | commit (append)  | known ids: prompt, then committed ones  |
    | num_hashed_blocks, last_hash | open   | commit           | prefix of the hash chain computed       |
    """

    seq_id: int
    seq_index: int
    block_table: list[int]
    num_cached_tokens: int
    num_tokens: int
    num_context: int
    token_ids: array
    num_hashed_blocks: int
    last_hash: BlockHash | None


def check_index(value, name: str, seq_id: int | None = None) -> int:
    """`value` as an int >= 0; the error names the field (and the sequence), built only on failure."""
    if type(value) is int and value >= 0:  # the hot path: plain ints from the scheduler or the proto
        return value
    what = name if seq_id is None else f"{name} of sequence {seq_id}"
    try:
        value = operator.index(value)
    except TypeError:
        raise InvalidRequest(f"{what} must be an integer, got {value!r}") from None
    if value < 0:
        raise InvalidRequest(f"{what} must be >= 0, got {value}")
    return value


def token_array(values, name: str, seq_id: int) -> array:
    """`values` as compact uint32 token ids; the error names the field and the sequence."""
    try:
        return array(TOKEN_TYPECODE, values)
    except (TypeError, OverflowError, ValueError):
        raise InvalidRequest(f"{name} of sequence {seq_id} must be a sequence of token ids in [0, 2**32)"
                             ) from None


def check_unique(seq_ids: list[int]) -> None:
    """A batch names each sequence at most once."""
    if len(set(seq_ids)) == len(seq_ids):
        return
    seen = set()
    for seq_id in seq_ids:
        if seq_id in seen:
            raise InvalidRequest(f"sequence {seq_id} appears more than once in one batch")
        seen.add(seq_id)
