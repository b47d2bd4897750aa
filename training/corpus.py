"""The default corpus (the running Python's standard library), its split, and the tokenizer.

Every machine that runs us has the standard library's sources, so a pair can be trained with no
download. Files are split into train / held-out by a hash of their path relative to the library
root: stable across runs and machines of one Python version, and a whole file is on one side
(no leakage of a file's head into held-out). The tokenizer is a byte-level BPE trained with
`tokenizers`, so every byte string round-trips and no text is <unk>.
"""

from __future__ import annotations

import logging
import random
import sysconfig
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

logger = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"  # the drafter's MASK: a reserved row the target never sees in training
SPECIAL_TOKENS = (EOS_TOKEN, MASK_TOKEN)
_SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


class CorpusError(ValueError):
    """A corpus that cannot be used (no files, unreadable paths, too little text)."""


@dataclass(frozen=True)
class Document:
    name: str  # path relative to its corpus root, '/'-separated (what the split hashes)
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(name: str, held_out_percent: float) -> bool:
    """The split: crc32 of the relative path, in hundredths; whole files go to one side."""
    return zlib.crc32(name.encode()) % 10000 < held_out_percent * 100


def _python_files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise CorpusError(f"corpus path {root} is neither a file nor a directory")
    return sorted(p for p in root.rglob("*.py") if not _SKIPPED_DIRS & set(p.relative_to(root).parts))


def load_documents(paths: Iterable[str | Path] | None = None) -> list[Document]:
    """Every .py file under `paths` (default: the standard library), decoded as UTF-8.

    A file that is not UTF-8 (the library's tests keep a few on purpose) is skipped, not mangled.
    """
    roots = [stdlib_root()] if not paths else [Path(p) for p in paths]
    documents, skipped = [], 0
    for root in roots:
        for file in _python_files(root):
            name = file.name if root.is_file() else file.relative_to(root).as_posix()
            try:
                text = file.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                skipped += 1
                continue
            if text.strip():
                documents.append(Document(name, text))
    if not documents:
        raise CorpusError(f"no readable .py files under {', '.join(map(str, roots))}")
    logger.info("corpus: %d files (%.1f MB) from %s; %d unreadable skipped", len(documents),
                sum(len(d.text) for d in documents) / 1e6, ", ".join(map(str, roots)), skipped)
    return documents


def split_documents(documents: list[Document], held_out_percent: float) -> tuple[list[Document],
                                                                              list[Document]]:
    """(train, held_out) by `is_held_out`; both sides must be non-empty."""
    if not 0 < held_out_percent < 100:
        raise CorpusError(f"held_out_percent must be in (0, 100), got {held_out_percent}")
    held = [d for d in documents if is_held_out(d.name, held_out_percent)]
    train = [d for d in documents if not is_held_out(d.name, held_out_percent)]
    if not held or not train:
        raise CorpusError(f"the {held_out_percent}% split of {len(documents)} files left one side empty; "
                          "give more files or another held_out_percent")
    return train, held


def train_tokenizer(documents: list[Document], vocab_size: int, *, sample_bytes: int = 8_000_000,
                    seed: int = 0) -> Tokenizer:
    """A byte-level BPE over (a seeded sample of) the documents; ids 0, 1 are EOS and MASK."""
    if vocab_size < 300:
        raise CorpusError(f"vocab_size must be at least 300 (256 bytes, specials, merges), got {vocab_size}")
    shuffled = random.Random(seed).sample(documents, len(documents))
    sample, total = [], 0
    for document in shuffled:
        if total >= sample_bytes:
            break
        sample.append(document.text)
        total += len(document.text)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(sample, trainer=trainer)
    logger.info("tokenizer: byte-level BPE, %d tokens, trained on %.1f MB", tokenizer.get_vocab_size(),
                total / 1e6)
    return tokenizer


def special_ids(tokenizer: Tokenizer) -> tuple[int, int]:
    """(eos_id, mask_id) of a tokenizer made by `train_tokenizer` (or one with the same specials)."""
    ids = [tokenizer.token_to_id(token) for token in SPECIAL_TOKENS]
    if None in ids:
        raise CorpusError(f"the tokenizer lacks the special tokens {list(SPECIAL_TOKENS)}")
    return ids[0], ids[1]


def encode_documents(tokenizer: Tokenizer, documents: list[Document]) -> list[list[int]]:
    """Token ids per document (batch-encoded: the Rust side uses every core)."""
    return [encoding.ids for encoding in tokenizer.encode_batch([d.text for d in documents])]


def token_stream(encoded: list[list[int]], eos_id: int) -> torch.Tensor:
    """All documents back to back, each followed by EOS: [N] int64."""
    pieces = []
    for ids in encoded:
        pieces.append(torch.tensor(ids, dtype=torch.long))
        pieces.append(torch.tensor([eos_id], dtype=torch.long))
    return torch.cat(pieces)


def sample_windows(stream: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator
                   ) -> torch.Tensor:
    """[batch_size, seq_len] windows at uniform random offsets of `stream`."""
    if stream.numel() <= seq_len:
        raise CorpusError(f"the corpus has {stream.numel()} tokens, fewer than one window of {seq_len}")
    starts = torch.randint(0, stream.numel() - seq_len, (batch_size,), generator=generator)
    return stream[starts[:, None] + torch.arange(seq_len)]


def held_out_prompts(tokenizer: Tokenizer, documents: list[Document], count: int, prompt_len: int,
                     seed: int = 0) -> list[list[int]]:
    """`count` prompts of prompt_len tokens at seeded random offsets, from as many files as possible.

    Files too short for a prompt plus some continuation are skipped; files are cycled when there
    are fewer usable files than prompts (each visit picks a new offset).
    """
    rng = random.Random(seed)
    encoded = [ids for ids in encode_documents(tokenizer, documents) if len(ids) >= 2 * prompt_len]
    if not encoded:
        raise CorpusError(f"no held-out file has {2 * prompt_len} tokens (two prompt lengths)")
    rng.shuffle(encoded)
    prompts = []
    for index in range(count):
        ids = encoded[index % len(encoded)]
        start = rng.randrange(0, len(ids) - 2 * prompt_len + 1)
        prompts.append(ids[start: start + prompt_len])
    return prompts
