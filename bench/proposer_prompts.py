"""The three kinds of prompt `bench.bench_proposers` compares the proposers on, from held-out files of
this Python's standard library (the split the demo pair was trained with), tokenized by the target's
tokenizer: held-out code, a group of lines said again and again (the lookup's ground), and a function
given and then begun again (an edit that copies).
"""

from __future__ import annotations

import ast
import random
import textwrap

from target_service.runner.checkpoint import open_target_checkpoint
from training.corpus import held_out_prompts, load_documents, split_documents

AGAIN = "\n# the same, again:\n"


def repeat_prompts(tokenizer, documents, count: int, rng: random.Random) -> list[list[int]]:
    """A group of consecutive non-blank lines of 12-24 tokens, three times, then half of it again."""
    prompts = []
    for doc in rng.sample(documents, len(documents)):
        lines = doc.text.splitlines(keepends=True)
        for start in rng.sample(range(len(lines)), min(len(lines), 20)):
            group, length = "", 0  # a group that starts on a blank line is empty
            for line in lines[start:start + 6]:
                if not line.strip():
                    break
                group += line
                length = len(tokenizer.encode(group).ids)
                if length >= 12:
                    break
            if 12 <= length <= 24 and group.endswith("\n"):
                head = len(tokenizer.encode(group * 3).ids)
                prompts.append(tokenizer.encode(group * 4).ids[: head + length // 2])
                break
        if len(prompts) == count:
            return prompts
    raise ValueError(f"found {len(prompts)} repeat prompts of {count}")


def _functions(text: str) -> list[str]:
    """Dedented sources of the functions in a file (none when it does not parse)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines(keepends=True)
    return [textwrap.dedent("".join(lines[node.lineno - 1:node.end_lineno]))
            for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def edit_prompts(tokenizer, documents, count: int, rng: random.Random) -> list[list[int]]:
    """A function of 40-160 tokens, then AGAIN and its first line: the target should copy it."""
    prompts = []
    for doc in rng.sample(documents, len(documents)):
        sources = [s for s in _functions(doc.text) if 40 <= len(tokenizer.encode(s).ids) <= 160]
        if sources:
            source = rng.choice(sources)
            prompts.append(tokenizer.encode(source + AGAIN + source.splitlines(keepends=True)[0]).ids)
        if len(prompts) == count:
            return prompts
    raise ValueError(f"found {len(prompts)} edit prompts of {count}")


def prompt_classes(target: str, count: int, seed: int) -> dict[str, list[list[int]]]:
    tokenizer = open_target_checkpoint(target).tokenizer
    _, held = split_documents(load_documents(None), 5.0)
    rng = random.Random(seed)
    return {"code": held_out_prompts(tokenizer, held, count, 48, seed=seed),
            "repeats": repeat_prompts(tokenizer, held, count, rng),
            "edits": edit_prompts(tokenizer, held, count, rng)}
