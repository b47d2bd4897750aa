"""An oracle for greedy equality on a GPU, where two correct engines may still part at a near-tie.

A 16-row verify GEMM and a 1-row decode GEMM sum in different orders, so when the target's two best
logits at some position are closer than that rounding, target-only greedy decoding and a verifying
engine can each pick one of the two, both correctly, and the texts part there. The oracle lets two
outputs part only at such a position: it recomputes the target's logits there in float64 with HF
transformers (an independent implementation) and requires the two chosen tokens to be the top two,
within `tolerance` of each other. Anything else is a real mismatch.
"""

from __future__ import annotations

import torch

# Compiled fp32 Triton dots (the attention kernels) run in tf32, 10 mantissa bits: a decode and a
# verify tile the same sums differently, and the logits of a tiny random model then part by up to
# ~1e-3 (0.00095 seen on an H200). Exact fp32 (the CPU interpreter) keeps to the default.
TF32_TIE = 2e-3
# A log-probability is a logit less the row's logsumexp, and the rounding of each need not cancel as
# it does between two logits of one row: against HF's exact fp32 an H200 showed 2.0e-3, 4.2e-3 and
# 5.4e-3 in three runs on fresh random models. A wrong row, position or temperature is off by 1e-1 or more.
TF32_LOGPROB = 1e-2


def first_difference(a: list[int], b: list[int]) -> int | None:
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


def assert_equal_up_to_a_near_tie(target_dir, prompt: list[int], got: list[int], expected: list[int],
                                  tolerance: float = 1e-4) -> None:
    index = first_difference(got, expected)
    if index is None:
        return
    assert index < min(len(got), len(expected)), f"outputs of different lengths: {got} vs {expected}"
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float64).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + expected[:index]])).logits[0, -1]
    top2 = logits.topk(2)
    chosen = {got[index], expected[index]}
    gap = float(top2.values[0] - top2.values[1])
    assert chosen == set(top2.indices.tolist()) and gap <= tolerance, (
        f"outputs part at token {index} ({got[index]} vs {expected[index]}), where the target's top two are "
        f"{top2.indices.tolist()} {gap:.3g} apart: not a near-tie"
    )
