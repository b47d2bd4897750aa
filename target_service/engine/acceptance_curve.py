"""AcceptanceCurve: per draft position, how often a draft there is accepted once those before it were.

Adaptive speculation weighs what one more draft would bring: with conditional rates p_1..p_K (p_i:
the chance draft i is accepted given drafts 1..i-1 were), verifying k drafts accepts on average
E[k] = p_1 + p_1 p_2 + ... + p_1 ... p_k. A mean acceptance length alone cannot give E[k] for a k
other than the one measured; the per-position rates can, and they are what a drafter's quality
looks like (DFlash's fall slowly along its block, prompt lookup's sharply).

Counts are exponentially forgotten (`half_life`, in observations), so a request that moves from
prose into code, or a server whose traffic changes, is followed. A position with few trials leans
on `prior` (the server's curve, for one request's), weighted as `prior_weight` trials.

A step that verified k drafts of which `countable` could count (the draft budget) and accepted a
says: positions 1..a accepted, position a + 1 rejected when a < countable, nothing of the rest.
"""

from __future__ import annotations

from collections.abc import Sequence

DEFAULT_RATE = 0.7  # a prior for a server that has observed nothing: a middling drafter


class AcceptanceCurve:
    def __init__(self, num_positions: int, *, half_life: float, prior_weight: float = 2.0):
        if num_positions < 0 or half_life <= 0 or prior_weight <= 0:
            raise ValueError("an acceptance curve needs num_positions >= 0, half_life > 0 and "
                             "prior_weight > 0")
        self.num_positions = num_positions
        self.prior_weight = prior_weight
        self._decay = 0.5 ** (1.0 / half_life)
        self._tried = [0.0] * num_positions
        self._accepted = [0.0] * num_positions
        self.num_observations = 0

    def observe(self, countable: int, accepted: int) -> None:
        """One verify: `countable` drafts could count, the first `accepted` did."""
        countable = min(countable, self.num_positions)
        if countable <= 0:
            return
        if not 0 <= accepted <= countable:
            raise ValueError(f"accepted {accepted} drafts of {countable} that could count")
        decay = self._decay
        self._tried = [tried * decay for tried in self._tried]
        self._accepted = [count * decay for count in self._accepted]
        for position in range(accepted):
            self._tried[position] += 1.0
            self._accepted[position] += 1.0
        if accepted < countable:
            self._tried[accepted] += 1.0
        self.num_observations += 1

    def rates(self, prior: Sequence[float] | None = None) -> list[float]:
        """p_1..p_K: the counts, each position pulled toward `prior`'s rate there (default
        DEFAULT_RATE) by prior_weight trials."""
        weight = self.prior_weight
        prior = prior if prior is not None else [DEFAULT_RATE] * self.num_positions
        return [(accepted + weight * base) / (tried + weight)
                for tried, accepted, base in zip(self._tried, self._accepted, prior)]

    def expected_accepted(self, prior: Sequence[float] | None = None) -> list[float]:
        """E[k] for k = 0..K: the drafts accepted on average when k are verified."""
        return expected_from_rates(self.rates(prior))


def expected_from_rates(rates: Sequence[float]) -> list[float]:
    """E[0..K] of conditional rates p_1..p_K: E[k] = sum over j <= k of p_1 ... p_j."""
    expected, survive = [0.0], 1.0
    for rate in rates:
        survive *= rate
        expected.append(expected[-1] + survive)
    return expected
