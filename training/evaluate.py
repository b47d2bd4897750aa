"""Acceptance and speed of a target + drafter pair, measured through the real engine.

On held-out prompts, greedy: DFlash at K drafts per step, prompt lookup (the free baseline) on the
same prompts, and plain decoding as the reference. It reports the mean acceptance length
(1 + accepted / drafts, over all requests), per position acceptance, whether every speculative
output equals the plain one token for token (lossless), split into ordinary code and table-like
text (data tables are where n-gram lookup shines, so it is reported apart), and the batch-1
wall-clock tokens/s of each, measured side by side in rounds (median and spread; a speed-up is a
ratio taken within each round, since a shared host's speed swings between runs).
"""

from __future__ import annotations

import logging
import re
import statistics
import time

import torch

from target_service.engine.outputs import SpecDecodeStats
from target_service.engine.sampling_params import SamplingParams
from target_service.llm import LLM

logger = logging.getLogger(__name__)

KV_CACHE_MEMORY = "768MiB"  # each of the three engines; explicit, so none claims the whole GPU

# a comment, a string, a hex or decimal number, or punctuation: what a line of a data table is made of
_LITERALS = re.compile(
    r"""#.*$|'(?:\\.|[^'\\])*'|"(?:\\.|[^"\\])*"|0[xX][0-9a-fA-F]+|[0-9.eE+-]+|[\s,:()\[\]{}]""")


def is_table_like(text: str) -> bool:
    """True when most non-blank lines hold only literals (numbers, strings) and punctuation."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return False
    data = sum(1 for line in lines if not _LITERALS.sub("", line).strip())
    return data >= 0.5 * len(lines)


def _aggregate(outputs) -> dict:
    total = SpecDecodeStats()
    for output in outputs:
        total.merge(output.spec_decode)
    return {"num_drafts": total.num_drafts, "num_draft_tokens": total.num_draft_tokens,
            "num_accepted_tokens": total.num_accepted_tokens,
            "accepted_per_position": total.accepted_per_position,
            "mean_acceptance_length": round(total.mean_acceptance_length, 4)}


def _by_category(outputs, tables: list[bool]) -> dict:
    result = {"all": _aggregate(outputs)}
    for name, want in (("ordinary", False), ("table", True)):
        chosen = [o for o, table in zip(outputs, tables) if table == want]
        result[name] = {**_aggregate(chosen), "prompts": len(chosen)}
    return result


def timed_side_by_side(runners: dict, prompts: list[list[int]], rounds: int) -> dict:
    """Batch-1 tokens/s of every runner, measured side by side: each round runs every prompt through
    every runner back to back (the order rotating), so a noisy, shared host slows all of them alike.

    runners: name -> generate(prompt) -> number of tokens. Returns, per runner, the median tokens/s
    over rounds with its min and max, and per non-"plain" runner the median, min and max of its
    per-round speedup over "plain" (each round's ratio is taken within the round).
    """
    names = list(runners)
    for name in names:
        runners[name](prompts[0])  # warm-up: kernel compilation, allocator
    per_round = {name: [] for name in names}
    for index in range(rounds):
        tokens, seconds = dict.fromkeys(names, 0), dict.fromkeys(names, 0.0)
        for offset, prompt in enumerate(prompts):
            shift = (index + offset) % len(names)
            for name in names[shift:] + names[:shift]:
                started = time.perf_counter()
                tokens[name] += runners[name](prompt)
                seconds[name] += time.perf_counter() - started
        for name in names:
            per_round[name].append(tokens[name] / seconds[name])
    result = {}
    for name, rates in per_round.items():
        result[name] = {"tokens_per_second": round(statistics.median(rates), 2),
                        "min": round(min(rates), 2), "max": round(max(rates), 2)}
        if name != "plain":
            ratios = [rate / plain for rate, plain in zip(rates, per_round["plain"])]
            result[name].update(speedup=round(statistics.median(ratios), 3),
                                speedup_min=round(min(ratios), 3), speedup_max=round(max(ratios), 3))
    return {"rounds": rounds, **result}


def evaluate_pair(target: str, drafter: str, prompts: list[list[int]], *, num_speculative_tokens: int,
                  max_tokens: int, device: str | None = None, dtype: str | None = None,
                  timing_prompts: int = 8, timing_rounds: int = 5, tokenizer=None) -> dict:
    """The numbers for one pair (see the module docstring); prompts are token-id lists."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    max_model_len = max(len(p) for p in prompts) + max_tokens + num_speculative_tokens + 2
    common = dict(device=device, dtype=dtype, max_model_len=max_model_len, max_num_seqs=len(prompts),
                  max_num_batched_tokens=8192, enable_prefix_caching=False, kv_cache_memory=KV_CACHE_MEMORY)
    plain = LLM(target, **common)
    spec = LLM(target, drafter, num_speculative_tokens=num_speculative_tokens, **common)
    # prompt lookup as the server runs it (speculative_method "ngram": no drafter, step by step)
    lookup_llm = LLM(target, speculative_method="ngram", num_speculative_tokens=num_speculative_tokens,
                     **common)
    try:
        reference = plain.generate(prompts, params)
        texts = [_text(tokenizer, p, r.outputs[0].token_ids) for p, r in zip(prompts, reference)]
        tables = [is_table_like(text) for text in texts]
        dflash = spec.generate(prompts, params)
        per_position = {"dflash": spec.stats.accepted_per_position}
        lookup = lookup_llm.generate(prompts, params)
        per_position["prompt_lookup"] = lookup_llm.stats.accepted_per_position
        lossless = [d.outputs[0].token_ids == r.outputs[0].token_ids for d, r in zip(dflash, reference)]
        lookup_lossless = [x.outputs[0].token_ids == r.outputs[0].token_ids
                           for x, r in zip(lookup, reference)]
        timed = prompts[:timing_prompts]

        def run(llm: LLM):
            def generate(prompt: list[int]) -> int:
                return len(llm.generate([prompt], params)[0].outputs[0].token_ids)
            return generate

        timing = timed_side_by_side({"plain": run(plain), "dflash": run(spec),
                                     "prompt_lookup": run(lookup_llm)}, timed, timing_rounds)
    finally:
        plain.close()
        spec.close()
        lookup_llm.close()
    result = {
        "num_prompts": len(prompts), "num_speculative_tokens": num_speculative_tokens,
        "max_tokens": max_tokens,
        "dflash": _by_category(dflash, tables), "prompt_lookup": _by_category(lookup, tables),
        "accepted_per_position": per_position,
        "lossless_dflash": f"{sum(lossless)}/{len(lossless)}",
        "lossless_prompt_lookup": f"{sum(lookup_lossless)}/{len(lookup_lossless)}",
        "generated_tokens": sum(len(r.outputs[0].token_ids) for r in reference),
        "timing_batch1": {"prompts": len(timed), **timing},
        "device": _device(device),
    }
    logger.info("acceptance at K=%d: dflash %.3f (ordinary %.3f), prompt lookup %.3f (ordinary %.3f); "
                "lossless %s; batch-1 speedup %.2fx", num_speculative_tokens,
                result["dflash"]["all"]["mean_acceptance_length"],
                result["dflash"]["ordinary"]["mean_acceptance_length"],
                result["prompt_lookup"]["all"]["mean_acceptance_length"],
                result["prompt_lookup"]["ordinary"]["mean_acceptance_length"],
                result["lossless_dflash"], timing["dflash"]["speedup"])
    return result


def _text(tokenizer, prompt: list[int], output: list[int]) -> str:
    if tokenizer is None:
        return ""
    return tokenizer.decode(prompt + output)


def _device(device: str | None) -> str:
    if (device is None and torch.cuda.is_available()) or (device or "").startswith("cuda"):
        return torch.cuda.get_device_name()
    return f"cpu ({torch.get_num_threads()} threads)"
