"""Prompt lookup searched from scratch: the reference the incremental index and the engine's
lookup steps are held to."""

from __future__ import annotations


def search_from_scratch(tokens: list[int], num_draft: int, max_ngram: int, min_ngram: int
                        ) -> tuple[list[int], int]:
    """Every earlier start, latest first, for n from max_ngram down; the K tokens after the match,
    copied forward through the proposal; (proposal, n), n 0 (the last token repeated) on no match."""
    length = len(tokens)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        pattern = tokens[length - n:]
        for start in range(length - n - 1, -1, -1):
            if tokens[start:start + n] == pattern:
                extended = list(tokens)
                for j in range(num_draft):
                    extended.append(extended[start + n + j])
                return extended[length:], n
    return [tokens[-1]] * num_draft, 0


def common_prefix(proposal: list[int], actual: list[int]) -> int:
    count = 0
    for proposed, token in zip(proposal, actual):
        if proposed != token:
            break
        count += 1
    return count
