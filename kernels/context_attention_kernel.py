"""Triton kernels of the DFlash draft cross-attention (launched by `kernels.paged_context_attention`).

Per request b and KV head h, the Q noise queries of the group's heads (R = Q x group rows, padded
to a power of two >= 16) attend, with ONE softmax and no mask, over the ctx_lens[b] context keys
in the pool's pages and the Q noise keys. `_context_attention_kernel` runs on a grid
(NKV, B, max_splits): without SPLIT one program per (head, request) folds its context and the
noise and writes the output. With SPLIT each program takes its share of a length-aware split count
decided on the device (`kernels.split_kv`); split 0 also folds the noise keys. A request whose
context takes one split is finished by split 0 alone, like the single pass (B 1, ctx 0 / 128:
5.8 / 8.6 -> 3.7 / 6.7 us, context_versions_noise_in_merge (git history)); otherwise every
split writes a partial state and `_context_merge_kernel` folds them into the output. Tried and
not kept (same results directory): the merge in the split kernel's own last programs, waiting for
the other splits (1-22% slower, context_latency_fused_merge in git history), and the noise keys
folded by the merge kernel before its PDL wait (4-15% slower at B 4-16,
context_versions_noise_in_merge in git history).

Scores live in log2 units (scale * log2(e) folded into one multiplier) so the softmax uses exp2.
fp8 context: k_scale joins the score multiplier of the context keys, v_scale multiplies the
probabilities of the context values (the noise keys and values are not scaled).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels import operands, pdl
from kernels.split_kv import finalize_state, merge_partial_chunks, num_splits_for, split_bounds


@triton.jit
def _attend_tile(q, q_lo, k, v, valid, acc, m_i, l_i, score_scale, log2_v_scale,
                 MASKED: tl.constexpr, HAS_V_SCALE: tl.constexpr, COMPUTE: tl.constexpr,
                 PRECISION: tl.constexpr, FP8_Q: tl.constexpr):
    """One online-softmax step over a K/V tile; q [ROWS, D], k / v [N, D] in COMPUTE.

    FP8_Q: q and q_lo are q's two e4m3 terms and k is e4m3 (`kernels.operands.quantize_rows_e4m3`,
    the row scales inside score_scale [ROWS]). Scores in log2 units are ``q.k * score_scale``: the
    running max is kept scaled while the raw scores are scaled inside the exponent (one FMA per
    score; score_scale > 0 keeps the max).
    MASKED drops keys where ``valid`` [N] is false (a full tile skips the select). A V scale
    (dequantised values: sum_j p_j (v_scale v_j)) enters as ``2**log2_v_scale`` in the exponent,
    and l_i takes the unscaled sum, so no extra multiply per score.
    """
    if FP8_Q:
        s = tl.dot(q_lo, tl.trans(k), tl.dot(q, tl.trans(k)))
    else:
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if MASKED:
        s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * score_scale)  # finite: every tile holds a valid key
    alpha = tl.exp2(m_i - m_new)
    if HAS_V_SCALE:
        p = tl.exp2(s * score_scale[:, None] - (m_new - log2_v_scale)[:, None])
        l_i = l_i * alpha + tl.sum(p, 1) * tl.exp2(-log2_v_scale)
    else:
        p = tl.exp2(s * score_scale[:, None] - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(COMPUTE), v, acc * alpha[:, None], input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _context_tile(q, q_lo, acc, m_i, l_i, table, k_head, v_head, n0, end,
                  stride_kb, stride_kt, stride_vb, stride_vt, score_scale, log2_v_scale,
                  TOKENS_PER_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                  HAS_V_SCALE: tl.constexpr, COMPUTE: tl.constexpr, PRECISION: tl.constexpr,
                  FP8_CVT_ASM: tl.constexpr, FP8_Q: tl.constexpr):
    """Context keys n0..n0+BLOCK_N-1 through the block table, folded into the running state.

    MASKED drops keys at or past `end` (loads and scores); a whole tile skips both.
    """
    keys = n0 + tl.arange(0, BLOCK_N)
    valid = keys < end
    if MASKED:
        page = tl.load(table + keys // TOKENS_PER_BLOCK, mask=valid, other=0).to(tl.int64)
    else:
        page = tl.load(table + keys // TOKENS_PER_BLOCK).to(tl.int64)
    slot = keys % TOKENS_PER_BLOCK
    k_ptrs = k_head + (page * stride_kb + slot * stride_kt)[:, None]
    v_ptrs = v_head + (page * stride_vb + slot * stride_vt)[:, None]
    if MASKED:
        k = tl.load(k_ptrs, mask=valid[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=valid[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    v = operands.widen_values(v, COMPUTE, FP8_CVT_ASM)
    return _attend_tile(q, q_lo, k.to(q.dtype), v, valid, acc, m_i, l_i, score_scale, log2_v_scale, MASKED,
                        HAS_V_SCALE, COMPUTE, PRECISION, FP8_Q)


@triton.jit
def _load_rows(q_ptr, b64, kvh, rows, row_mask, num_q, stride_qb, stride_qq, stride_qh, stride_qd,
               GROUP: tl.constexpr, HEAD_DIM: tl.constexpr):
    """q of tile rows `rows` [R] x all D (row r: query position r // GROUP, head kvh * GROUP + r % GROUP)."""
    dims = tl.arange(0, HEAD_DIM)
    heads = kvh * GROUP + rows % GROUP
    offs = (b64 * stride_qb + (rows // GROUP)[:, None] * stride_qq + heads[:, None] * stride_qh
            + dims[None, :] * stride_qd)
    return tl.load(q_ptr + offs, mask=row_mask[:, None], other=0.0)


@triton.jit
def _store_rows(out_ptr, state, b64, kvh, rows, row_mask, cols, stride_ob, stride_oq, stride_oh, stride_od,
                GROUP: tl.constexpr):
    heads = kvh * GROUP + rows % GROUP
    offs = (b64 * stride_ob + (rows // GROUP)[:, None] * stride_oq + heads[:, None] * stride_oh
            + cols[None, :] * stride_od)
    tl.store(out_ptr + offs, state.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


@triton.jit
def _fold_noise(acc, m_i, l_i, q, q_ptr, k_noise_ptr, v_noise_ptr, b64, kvh, rows, row_mask, num_q,
                noise_scale, stride_qb, stride_qq, stride_qh, stride_qd,
                stride_nkb, stride_nkq, stride_nkh, stride_nkd,
                stride_nvb, stride_nvq, stride_nvh, stride_nvd,
                GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, NOISE_PAD: tl.constexpr,
                NOISE_COMPUTE: tl.constexpr, NARROW_Q: tl.constexpr, FP8_Q: tl.constexpr,
                PRECISION: tl.constexpr):
    """Fold all Q dense noise keys (q's dtype, unscaled) into the program's running state; q as the
    context tiles took it."""
    if NARROW_Q or FP8_Q:  # q was shifted or split into e4m3 terms for the context: q again
        qn = _load_rows(q_ptr, b64, kvh, rows, row_mask, num_q, stride_qb, stride_qq, stride_qh, stride_qd,
                        GROUP, HEAD_DIM).to(NOISE_COMPUTE)
    else:
        qn = q
    dims = tl.arange(0, HEAD_DIM)
    js = tl.arange(0, NOISE_PAD)
    j_mask = js < num_q
    kn = tl.load(k_noise_ptr + b64 * stride_nkb + js[:, None] * stride_nkq + kvh * stride_nkh
                 + dims[None, :] * stride_nkd, mask=j_mask[:, None], other=0.0)
    vn = tl.load(v_noise_ptr + b64 * stride_nvb + js[:, None] * stride_nvq + kvh * stride_nvh
                 + dims[None, :] * stride_nvd, mask=j_mask[:, None], other=0.0)
    return _attend_tile(qn, qn, kn.to(NOISE_COMPUTE), vn.to(NOISE_COMPUTE), j_mask, acc, m_i, l_i,
                        noise_scale, 0.0, True, False, NOISE_COMPUTE, PRECISION, False)


@triton.jit(do_not_specialize=["max_splits", "stride_bt", "stride_lr"],  # widths that vary step to step
            do_not_specialize_on_alignment=["block_table_ptr", "ctx_lens_ptr"])
def _context_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, ctx_lens_ptr, k_noise_ptr, v_noise_ptr,
    out_ptr, part_acc_ptr, part_lse_ptr, k_scale, v_scale, sm_scale_log2,
    num_q, max_splits, min_tokens_per_split,
    stride_qb, stride_qq, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_bt,
    stride_nkb, stride_nkq, stride_nkh, stride_nkd,
    stride_nvb, stride_nvq, stride_nvh, stride_nvd,
    stride_ob, stride_oq, stride_oh, stride_od,
    stride_pr, stride_ps, stride_lr, stride_ls,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, TOKENS_PER_BLOCK: tl.constexpr,
    ROWS: tl.constexpr, NOISE_PAD: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    K_SCALE_MODE: tl.constexpr, V_SCALE_MODE: tl.constexpr,
    COMPUTE: tl.constexpr, NOISE_COMPUTE: tl.constexpr, NARROW_Q: tl.constexpr, PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr, FP8_CVT_ASM: tl.constexpr, FP8_Q: tl.constexpr,
):
    kvh = tl.program_id(0)
    b = tl.program_id(1)
    split = tl.program_id(2)
    pdl.wait_for_previous_grid(USE_PDL)
    # row r of the tile is query position r // GROUP of head kvh * GROUP + r % GROUP
    rows = tl.arange(0, ROWS)
    dims = tl.arange(0, HEAD_DIM)
    row_mask = rows < num_q * GROUP
    ctx_len = tl.load(ctx_lens_ptr + b)
    if SPLIT:
        count = num_splits_for(ctx_len, max_splits, min_tokens_per_split)
        if count == 1 and split > 0:  # split 0 finishes a one-split request alone
            return
        # a split past the count gets start >= ctx_len (an empty range); it reads and writes nothing
        start, end = split_bounds(ctx_len, split, count, BLOCK_N)
        active = (tl.zeros([ROWS], dtype=tl.int32) + split) < count  # [ROWS], one value
    else:
        count = 1
        start = 0
        end = ctx_len
        active = rows >= 0

    b64 = b.to(tl.int64)
    q = _load_rows(q_ptr, b64, kvh, rows, row_mask & active, num_q, stride_qb, stride_qq, stride_qh,
                   stride_qd, GROUP, HEAD_DIM).to(tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)

    noise_scale = tl.zeros([ROWS], dtype=tl.float32) + sm_scale_log2  # per row, as the context's
    if K_SCALE_MODE == 2:
        ctx_scale = noise_scale * tl.load(k_scale).to(tl.float32)
    else:
        ctx_scale = noise_scale * k_scale
    q, q_lo, ctx_scale = operands.score_operands(q, ctx_scale, COMPUTE, NARROW_Q, FP8_Q)
    if V_SCALE_MODE == 2:
        log2_v_scale = tl.log2(tl.load(v_scale).to(tl.float32))
    else:
        log2_v_scale = tl.log2(v_scale + 0.0)

    # context: keys [start, end) through the block table; k_cache [blocks, TOKENS_PER_BLOCK, NKV, D].
    # The single pass takes whole tiles first (no masks on loads or scores), then the partial one;
    # a split's few tiles take one loop (two loops measured 4-11% slower at B 1). With the FMA step of
    # `_attend_tile`, bf16 at B >= 64 got 11-13% faster (kernel_variants_1_fma,
    # git history).
    table = block_table_ptr + b64 * stride_bt
    k_head = k_cache_ptr + kvh * stride_kh + dims[None, :] * stride_kd
    v_head = v_cache_ptr + kvh * stride_vh + dims[None, :] * stride_vd
    full_end = start
    if not SPLIT:
        full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
    for n0 in range(start, full_end, BLOCK_N):
        acc, m_i, l_i = _context_tile(
            q, q_lo, acc, m_i, l_i, table, k_head, v_head, n0, end, stride_kb, stride_kt, stride_vb,
            stride_vt, ctx_scale, log2_v_scale, TOKENS_PER_BLOCK, BLOCK_N, False, V_SCALE_MODE != 0, COMPUTE,
            PRECISION, FP8_CVT_ASM, FP8_Q)
    for n0 in range(full_end, end, BLOCK_N):
        acc, m_i, l_i = _context_tile(
            q, q_lo, acc, m_i, l_i, table, k_head, v_head, n0, end, stride_kb, stride_kt, stride_vb,
            stride_vt, ctx_scale, log2_v_scale, TOKENS_PER_BLOCK, BLOCK_N, True, V_SCALE_MODE != 0, COMPUTE,
            PRECISION, FP8_CVT_ASM, FP8_Q)

    pdl.allow_next_grid(USE_PDL)  # the context is read: the next kernel may be scheduled
    if split == 0:  # the noise suffix: all Q dense keys, once per request and head
        acc, m_i, l_i = _fold_noise(
            acc, m_i, l_i, q, q_ptr, k_noise_ptr, v_noise_ptr, b64, kvh, rows, row_mask, num_q, noise_scale,
            stride_qb, stride_qq, stride_qh, stride_qd, stride_nkb, stride_nkq, stride_nkh, stride_nkd,
            stride_nvb, stride_nvq, stride_nvh, stride_nvd, GROUP, HEAD_DIM, NOISE_PAD, NOISE_COMPUTE,
            NARROW_Q, FP8_Q, PRECISION)
    if count == 1:  # the whole context and the noise are in this program: write the output
        _store_rows(out_ptr, acc / l_i[:, None], b64, kvh, rows, row_mask, dims,  # l_i >= 1: noise keys
                    stride_ob, stride_oq, stride_oh, stride_od, GROUP)
    elif SPLIT:
        state, lse = finalize_state(acc, m_i, l_i)
        prow = (b64 * tl.num_programs(0) + kvh) * ROWS + rows
        tl.store(part_acc_ptr + prow[:, None] * stride_pr + split * stride_ps + dims[None, :], state,
                 mask=active[:, None])
        tl.store(part_lse_ptr + prow * stride_lr + split * stride_ls, lse, mask=active)


@triton.jit(do_not_specialize=["max_splits", "stride_lr"], do_not_specialize_on_alignment=["ctx_lens_ptr"])
def _context_merge_kernel(
    part_acc_ptr, part_lse_ptr, ctx_lens_ptr, out_ptr,
    num_q, max_splits, min_tokens_per_split,
    stride_pr, stride_ps, stride_lr, stride_ls,
    stride_ob, stride_oq, stride_oh, stride_od,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr,
    MERGE_ROWS: tl.constexpr, MERGE_COLS: tl.constexpr, MERGE_CHUNK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # grid: (ROWS / MERGE_ROWS * HEAD_DIM / MERGE_COLS, NKV, B): a [MERGE_ROWS, MERGE_COLS] tile each
    col_blocks: tl.constexpr = HEAD_DIM // MERGE_COLS
    kvh = tl.program_id(1)
    b = tl.program_id(2)
    rows = (tl.program_id(0) // col_blocks) * MERGE_ROWS + tl.arange(0, MERGE_ROWS)
    cols = (tl.program_id(0) % col_blocks) * MERGE_COLS + tl.arange(0, MERGE_COLS)
    row_mask = rows < num_q * GROUP
    pdl.wait_for_previous_grid(USE_PDL)  # the split kernel's partials (and its end, for what follows)
    pdl.allow_next_grid(USE_PDL)
    count = num_splits_for(tl.load(ctx_lens_ptr + b), max_splits, min_tokens_per_split)
    if count > 1:  # one split: the split kernel wrote the output itself
        prow = (b.to(tl.int64) * tl.num_programs(1) + kvh) * ROWS + rows
        acc, m_i, l_i = merge_partial_chunks(part_acc_ptr, part_lse_ptr, prow, row_mask, cols,
                                             cols < HEAD_DIM, stride_pr, stride_ps, stride_lr, stride_ls,
                                             count, MERGE_CHUNK)
        out, _ = finalize_state(acc, m_i, l_i)
        _store_rows(out_ptr, out, b.to(tl.int64), kvh, rows, row_mask, cols, stride_ob, stride_oq, stride_oh,
                    stride_od, GROUP)
