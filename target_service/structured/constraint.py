"""TokenConstraint: one sequence's grammar state, advanced by what it emits, asked about a verify block.

A speculative step verifies a block: the bonus token's row, then one row per draft. The token chosen
at row j is emitted only if drafts 1..j were all accepted, so row j's mask is the grammar's state
after drafts 1..j (`masks`): the target then chooses at every row exactly what constrained decoding
would choose after that prefix, and the step stays lossless with respect to constrained decoding.
A draft the grammar does not allow can never be accepted (the masked target never chooses it), so
the rows after it need no mask.

Before the verify, `repair` replaces each draft the grammar rejects by the token the grammar forces
there, when it forces one (a schema's keys and punctuation): a draft that would certainly be
rejected becomes one the target accepts whenever constrained decoding would emit it. Both walk the
matcher forward and roll it back, so the state is always that of the emitted tokens alone.
"""

from __future__ import annotations

import torch

BITS = torch.arange(8, dtype=torch.uint8)


class TokenConstraint:
    def __init__(self, matcher, vocab_size: int, eos_tokens: list[int]):
        """matcher: an llguidance LLMatcher at the start of the grammar; vocab_size: the model's;
        eos_tokens: what a dead end allows, so that the request ends."""
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_tokens = [token for token in eos_tokens if token < vocab_size]

    # ---- the emitted tokens ---------------------------------------------------------------------

    def advance(self, token: int) -> bool:
        """Take an emitted token; False when the grammar does not allow it (it cannot go on)."""
        return self.matcher.consume_token(token)

    @property
    def finished(self) -> bool:
        """The grammar is complete: nothing but end-of-sequence may follow."""
        return self.matcher.is_stopped()

    # ---- a verify block ---------------------------------------------------------------------------

    def repair(self, drafts: list[int]) -> list[int]:
        """The drafts, each one the grammar rejects replaced by the token it forces there; from the
        first rejected draft where nothing is forced on, the rest are left as they were (they will
        be rejected)."""
        repaired, consumed = list(drafts), 0
        for position, draft in enumerate(drafts):
            if self.matcher.validate_tokens([draft]) != 1:
                forced = self.matcher.compute_ff_tokens()
                if not forced:
                    break
                repaired[position] = forced[0]
            if not self.matcher.consume_token(repaired[position]):
                break
            consumed += 1
        self.matcher.rollback(consumed)
        return repaired

    def masks(self, drafts: list[int]) -> torch.Tensor:
        """[len(drafts) + 1, vocab_size] bool: the tokens allowed at each row of a block that verifies
        `drafts`; rows past the first draft the grammar rejects allow everything (nothing there is
        emitted). Where nothing at all is allowed (a dead end), the end-of-sequence tokens are, so
        the request ends instead of choosing from nothing."""
        rows = torch.ones(len(drafts) + 1, self.vocab_size, dtype=torch.bool)
        consumed = 0
        for row in range(len(drafts) + 1):
            rows[row] = self._allowed()
            if row == len(drafts):
                break
            draft = drafts[row]
            if not rows[row, draft] or not self.matcher.consume_token(draft):
                break
            consumed += 1
        self.matcher.rollback(consumed)
        return rows

    def _allowed(self) -> torch.Tensor:
        packed = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.uint8)
        bits = ((packed.unsqueeze(-1) >> BITS) & 1).reshape(-1).bool()
        allowed = torch.zeros(self.vocab_size, dtype=torch.bool)
        width = min(self.vocab_size, bits.numel())
        allowed[:width] = bits[:width]
        if not allowed.any():
            allowed[self.eos_tokens] = True
        return allowed
