"""The most characters a prompt that fits the context can have, so a longer text is refused unread.

Tokenizing holds the event loop (about 1.3 s a MiB); a bound from the tokenizer's own vocabulary lets
`OpenAIServer` refuse a text that could never fit before it spends that time.
"""

from __future__ import annotations

import re

from tokenizers import normalizers


def max_prompt_chars(tokenizer, max_model_len: int) -> int | None:
    """The most characters a text of max_model_len tokens can have, or None where no bound is known.

    Under a byte-level pre-tokenizer every byte of the text becomes one character of some token's
    vocabulary string (a character is at least one byte), so a token covers at most as many
    characters as its longest vocabulary string; Unicode normalization composes at most 4 code
    points into one. Anything else (a normalizer that replaces or strips, a pre-tokenizer that drops
    characters, unknown tokens fused into one) can make one token cover any number: no bound then.
    """
    get_vocab = getattr(tokenizer, "get_vocab", None)
    normalizer = getattr(tokenizer, "normalizer", None)
    if get_vocab is None or getattr(getattr(tokenizer, "model", None), "fuse_unk", False):
        return None
    if not _keeps_every_byte(getattr(tokenizer, "pre_tokenizer", None)):
        return None
    unicode_forms = (normalizers.NFC, normalizers.NFD, normalizers.NFKC, normalizers.NFKD)
    if normalizer is not None and not isinstance(normalizer, unicode_forms):
        return None
    longest = max(map(len, get_vocab(with_added_tokens=True)), default=0)
    return max_model_len * longest * (1 if normalizer is None else 4) if longest else None


def _keeps_every_byte(pre_tokenizer) -> bool:
    """A ByteLevel pre-tokenizer, alone or after Splits that keep what they split on (Qwen's, GPT's)."""
    spelled = repr(pre_tokenizer)
    kinds = set(re.findall(r"([A-Za-z]+)\(", spelled))
    known = {"ByteLevel", "Sequence", "Split", "Regex", "String"}
    return "ByteLevel" in kinds and kinds <= known and "Removed" not in spelled
