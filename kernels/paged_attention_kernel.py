"""Triton kernel of the target's causal attention over paged K/V (launched by `kernels.paged_attention`).

One kernel serves prefill chunks, verify blocks and decode, mixed in one launch. Its grid is
``(q_tiles, NKV, max_splits)``:

* axis 0 walks query tiles of BLOCK_Q consecutive query positions of ONE sequence. Sequence b owns
  the tile ids ``qsl[b] // BLOCK_Q + b .. qsl[b + 1] // BLOCK_Q + b`` (qsl = query_start_loc), enough
  for its ``cdiv(q_len, BLOCK_Q)`` tiles; a program finds its sequence by binary search and exits
  when its tile is past the sequence's queries. ``T // BLOCK_Q + B`` tiles cover any batch, so the
  grid depends on shapes only (CUDA-graph safe).
* axis 1 is the KV head: the tile packs its BLOCK_Q positions x GROUP query heads into BLOCK_M rows
  (row r = position r // GROUP, head r % GROUP), so each K/V tile is read once for the whole group.
* axis 2 is the split of the keys (`kernels.split_kv`): one split writes the output directly;
  several write partial states, folded either by the last split of the (tile, head) to finish
  (FUSED_MERGE: few rows, so one program reads all partials quickly; no second launch) or by
  `split_kv.merge_partials`.

Programs map to (tile, head) with the heads fastest in launch order (the first two axes read as
one index): the heads of a query tile run side by side and read the same pages, whose token rows
interleave the heads (bf16 decode at B 128-256 2% faster than tiles fastest,
kernel_variants_21_head_order, in git history); query tiles run last first.

Query i of sequence b sits at ``seq_lens[b] - q_len + i`` and sees keys at positions <= its own.
Key tiles entirely below the tile's first query position need no mask and take the fast loop;
the few tiles on the diagonal take the masked one.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels import operands, pdl
from kernels.split_kv import arrive_last, finalize_state, merge_partial_chunks, num_splits_for, split_bounds

# Small tables a step builds as views at any offset of its staging buffers (block tables, query start
# locations, lengths, split counters, a layer's scale): Triton would compile one kernel per 16-byte
# alignment class of each (seen on an H200: a new kernel for a block table or a scale at another
# offset, seconds inside the step loop). Their loads are scalar or tiny, so the hint buys nothing.
RUN_TIME_POINTERS = ["SplitLens", "Counters", "BlockTable", "SeqLens", "QueryStartLoc", "KScale", "VScale"]
# Integers that change from step to step within one launch plan: Triton specialises an int on being 1
# and on its divisibility by 16. The block table's width is the batch's longest sequence in pages (1 for
# short ones: seen on an H200, a kernel compiled for each width class while serving), the partial
# lse's row stride is the split count.
RUN_TIME_INTEGERS = ["num_seqs", "max_splits", "min_tokens_per_split", "stride_bt", "stride_lse_row"]


@triton.jit
def _find_seq(QueryStartLoc, num_seqs, tile_id, BLOCK_Q: tl.constexpr, SEARCH: tl.constexpr):
    """The sequence owning query tile `tile_id`: the last b with qsl[b] // BLOCK_Q + b <= tile_id.

    SEARCH > 1: those b form a prefix (first tiles never decrease), so count them, SEARCH entries
    of query_start_loc per load: one round trip for B < SEARCH, and the loads of larger batches
    do not depend on each other. SEARCH == 1: a binary search, one dependent load per halving.
    """
    if SEARCH > 1:
        count = num_seqs * 0
        for first in range(0, num_seqs, SEARCH):
            b = first + tl.arange(0, SEARCH)
            live = b < num_seqs
            starts = tl.load(QueryStartLoc + b, mask=live, other=0)
            count += tl.sum((live & (starts // BLOCK_Q + b <= tile_id)).to(tl.int32), 0)
        return count - 1
    else:
        lo = num_seqs * 0
        hi = num_seqs
        while lo < hi:
            mid = (lo + hi) // 2
            first_tile = tl.load(QueryStartLoc + mid) // BLOCK_Q + mid
            below = first_tile <= tile_id
            lo = tl.where(below, mid + 1, lo)
            hi = tl.where(below, hi, mid)
        return lo - 1


@triton.jit
def _key_rows(block_row, n, n_ok, kv_head, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
              TOKENS_PER_BLOCK: tl.constexpr, MASKED: tl.constexpr):
    """Element offsets of keys n (any shape) in K and V: the page of each key, then its row there.

    Keys of one tile may span several pages. MASKED reads no table entry for keys past n_ok.
    """
    if MASKED:
        page = tl.load(block_row + n // TOKENS_PER_BLOCK, mask=n_ok, other=0).to(tl.int64)
    else:
        page = tl.load(block_row + n // TOKENS_PER_BLOCK).to(tl.int64)
    in_page = (n % TOKENS_PER_BLOCK).to(tl.int64)
    return (page * stride_kb + in_page * stride_kt + kv_head * stride_kh,
            page * stride_vb + in_page * stride_vt + kv_head * stride_vh)


@triton.jit
def _softmax_step(s, v, acc, m_i, l_i, qk_scale, MASKED: tl.constexpr, DOT_DTYPE: tl.constexpr,
                  FP8_CVT_ASM: tl.constexpr):
    """Fold raw scores s [..., M, N] (masked keys at -inf) and values v [..., N, D] into the state.

    acc [..., M, D], m_i / l_i [..., M]; qk_scale broadcasts against m_i. The running max is kept in
    scaled (log2) units while the raw scores are scaled inside the exponent (one FMA per score,
    qk_scale > 0 keeps the max), and P V accumulates into the dot. Leading axes (key lanes) batch.
    """
    KEYS_AXIS: tl.constexpr = len(s.shape) - 1
    m_new = tl.maximum(m_i, tl.max(s, KEYS_AXIS) * qk_scale)
    if MASKED:  # a row may see no key of a diagonal tile yet (or of this split): keep 2**(-inf - -inf) out
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new
    p = tl.exp2(s * tl.expand_dims(qk_scale, KEYS_AXIS) - tl.expand_dims(m_ref, KEYS_AXIS))
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, KEYS_AXIS)
    acc = tl.dot(p.to(DOT_DTYPE), operands.widen_values(v, DOT_DTYPE, FP8_CVT_ASM),
                 acc * tl.expand_dims(alpha, KEYS_AXIS))
    return acc, m_new, l_i


@triton.jit
def _attend_key_tile(
    acc, m_i, l_i, q, q_lo, K, V, block_row, start, end, q_pos, kv_head, qk_scale,  #
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,  #
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,  #
    TOKENS_PER_BLOCK: tl.constexpr, MASKED: tl.constexpr, DOT_DTYPE: tl.constexpr,
    FP8_CVT_ASM: tl.constexpr, FP8_Q: tl.constexpr,
):
    """One online-softmax step over keys start..start+BLOCK_N-1 (base 2, fp32 state).

    acc [BLOCK_M, D_PAD], m_i / l_i / qk_scale [BLOCK_M]; q [BLOCK_M, D_PAD] in DOT_DTYPE, or with
    FP8_Q q and q_lo, its two e4m3 terms (`operands.quantize_rows_e4m3`, row scales inside
    qk_scale), dotted with the fp8 keys as stored.
    MASKED applies causality (key <= q_pos) and the range end; unmasked tiles lie wholly below
    every row. The state update is `_softmax_step`.
    """
    n = start + tl.arange(0, BLOCK_N)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    n_ok = n < end
    k_rows, v_rows = _key_rows(block_row, n, n_ok, kv_head, stride_kb, stride_kt, stride_kh,  # [BLOCK_N]
                               stride_vb, stride_vt, stride_vh, TOKENS_PER_BLOCK, MASKED)
    if MASKED or D_PAD != HEAD_DIM:
        k = tl.load(K + k_rows[None, :] + d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(V + v_rows[:, None] + d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    else:
        k = tl.load(K + k_rows[None, :] + d[:, None])  # K^T tile [D_PAD, BLOCK_N]
        v = tl.load(V + v_rows[:, None] + d[None, :])  # [BLOCK_N, D_PAD]
    if FP8_Q:
        s = tl.dot(q_lo, k, tl.dot(q, k))  # [BLOCK_M, BLOCK_N] raw scores
    else:
        s = tl.dot(q, k.to(DOT_DTYPE))
    if MASKED:
        s = tl.where((n[None, :] <= q_pos[:, None]) & n_ok[None, :], s, float("-inf"))
    return _softmax_step(s, v, acc, m_i, l_i, qk_scale, MASKED, DOT_DTYPE, FP8_CVT_ASM)


@triton.jit
def _attend_key_tile_lanes(
    acc, m_i, l_i, q, K, V, block_row, start, end, q_pos, kv_head, qk_scale,  #
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,  #
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, LANES: tl.constexpr,  #
    TOKENS_PER_BLOCK: tl.constexpr, MASKED: tl.constexpr, DOT_DTYPE: tl.constexpr,
    FP8_CVT_ASM: tl.constexpr,
):
    """`_attend_key_tile` with the tile's keys dealt to LANES independent softmax states.

    acc [LANES, BLOCK_M, D_PAD], m_i / l_i [LANES, BLOCK_M]; q [LANES, BLOCK_M, D_PAD] (q repeated);
    lane j takes keys start + j * BLOCK_N / LANES onwards. The dots are batched over the lanes, which
    Triton lays out one per warp, so every row max and row sum stays inside a warp (a 16-row tile
    whose keys are split over warps reduces each through shared memory, with CTA barriers); the
    lanes are merged once, after the last tile (`merge_lanes`).
    """
    KEYS: tl.constexpr = BLOCK_N // LANES
    n = start + tl.arange(0, LANES)[:, None] * KEYS + tl.arange(0, KEYS)[None, :]  # [LANES, KEYS]
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    n_ok = n < end
    k_rows, v_rows = _key_rows(block_row, n, n_ok, kv_head, stride_kb, stride_kt, stride_kh,  # [LANES, KEYS]
                               stride_vb, stride_vt, stride_vh, TOKENS_PER_BLOCK, MASKED)
    if MASKED or D_PAD != HEAD_DIM:
        k = tl.load(K + k_rows[:, None, :] + d[None, :, None],
                    mask=n_ok[:, None, :] & d_ok[None, :, None], other=0.0)  # [LANES, D_PAD, KEYS]
        v = tl.load(V + v_rows[:, :, None] + d[None, None, :],
                    mask=n_ok[:, :, None] & d_ok[None, None, :], other=0.0)  # [LANES, KEYS, D_PAD]
    else:
        k = tl.load(K + k_rows[:, None, :] + d[None, :, None])
        v = tl.load(V + v_rows[:, :, None] + d[None, None, :])
    s = tl.dot(q, k.to(DOT_DTYPE))  # [LANES, BLOCK_M, KEYS] raw scores
    if MASKED:
        s = tl.where((n[:, None, :] <= q_pos[None, :, None]) & n_ok[:, None, :], s, float("-inf"))
    return _softmax_step(s, v, acc, m_i, l_i, qk_scale[None, :], MASKED, DOT_DTYPE, FP8_CVT_ASM)


@triton.jit
def merge_lanes(acc, m_i, l_i):
    """Fold the lanes' states [LANES, M, D] / [LANES, M] into one (acc [M, D], m_i [M], l_i [M])."""
    m = tl.max(m_i, 0)
    m_ref = tl.where(m == float("-inf"), 0.0, m)  # a row no lane saw: every weight 2**-inf = 0
    w = tl.exp2(m_i - m_ref[None, :])
    return tl.sum(acc * w[:, :, None], 0), m, tl.sum(l_i * w, 0)


@triton.jit(do_not_specialize=RUN_TIME_INTEGERS, do_not_specialize_on_alignment=RUN_TIME_POINTERS)
def _paged_attention_kernel(
    Q, K, V, Out, PartAcc, PartLse, SplitLens, Counters,  #
    BlockTable, SeqLens, QueryStartLoc, KScale, VScale,  #
    sm_scale, k_scale, v_scale, num_seqs, max_splits, min_tokens_per_split,  #
    stride_qt, stride_qh,  #
    stride_kb, stride_kt, stride_kh,  #
    stride_vb, stride_vt, stride_vh,  #
    stride_ot, stride_oh,  #
    stride_acc_row, stride_acc_split, stride_lse_row, stride_lse_split,  #
    stride_bt,  #
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,  #
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,  #
    TOKENS_PER_BLOCK: tl.constexpr, SCALES_ON_DEVICE: tl.constexpr, SPLIT: tl.constexpr,  #
    FUSED_MERGE: tl.constexpr, MERGE_CHUNK: tl.constexpr, DOT_DTYPE: tl.constexpr,
    USE_PDL: tl.constexpr, SEQ_SEARCH: tl.constexpr, NARROW_Q: tl.constexpr, FP8_CVT_ASM: tl.constexpr,
    FP8_Q: tl.constexpr, KEY_LANES: tl.constexpr,
):
    # KV heads fastest in launch order (a page row holds every head's K/V of a token); last tiles
    # first: a causal chunk's later tiles see more keys, so they should not be the tail.
    launch_index = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    kv_head = launch_index % tl.num_programs(1)
    tile_id = tl.num_programs(0) - 1 - launch_index // tl.num_programs(1)
    split_id = tl.program_id(2)
    pdl.wait_for_previous_grid(USE_PDL)
    seq = _find_seq(QueryStartLoc, num_seqs, tile_id, BLOCK_Q, SEQ_SEARCH)
    q_start = tl.load(QueryStartLoc + seq)
    q_len = tl.load(QueryStartLoc + seq + 1) - q_start
    tile_q0 = (tile_id - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # first query of the tile, in seq
    if tile_q0 >= q_len:
        return
    ctx_len = tl.load(SeqLens + seq) - q_len  # keys stored before this step's queries
    tile_q1 = tl.minimum(tile_q0 + BLOCK_Q, q_len)
    kv_end = ctx_len + tile_q1  # keys the tile's last query sees

    lo = kv_end * 0
    hi = kv_end
    if SPLIT:
        num_splits = num_splits_for(kv_end, max_splits, min_tokens_per_split)
        if split_id >= num_splits:
            return
        lo, hi = split_bounds(kv_end, split_id, num_splits, BLOCK_N)
        if not FUSED_MERGE:  # noqa: SIM102 (a constexpr test, pruned at compile time)
            if (kv_head == 0) & (split_id == 0):
                # The merge kernel recomputes each row's split count from the same length.
                tq = tl.arange(0, BLOCK_Q)
                tl.store(SplitLens + q_start + tile_q0 + tq, kv_end + tq * 0, mask=tile_q0 + tq < q_len)

    rows = tl.arange(0, BLOCK_M)
    q_off = tile_q0 + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_off < q_len)
    q_pos = ctx_len + q_off
    token = (q_start + q_off).to(tl.int64)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    io_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=io_mask, other=0.0).to(tl.float32)
    if SCALES_ON_DEVICE:
        k_scale = tl.load(KScale).to(tl.float32)
        v_scale = tl.load(VScale).to(tl.float32)
    # per row: the fp8 dequant folded in, log2(e) for exp2, then q's own scale (e4m3 terms, fp16 shift)
    qk_scale = tl.full([BLOCK_M], 1.4426950408889634, tl.float32) * (sm_scale * k_scale)
    q, q_lo, qk_scale = operands.score_operands(q, qk_scale, DOT_DTYPE, NARROW_Q, FP8_Q)
    block_row = BlockTable + seq.to(tl.int64) * stride_bt

    # Keys below ctx_len + tile_q0 + 1 are visible to every row of the tile: no mask needed.
    full_end = tl.maximum(tl.minimum(hi, ctx_len + tile_q0 + 1), lo)
    full_end = lo + (full_end - lo) // BLOCK_N * BLOCK_N
    if KEY_LANES > 1:
        tl.static_assert(not FP8_Q, "key lanes take one q term (tiles of <= 32 rows keep fp16 scores)")
        q3 = tl.broadcast_to(q[None, :, :], (KEY_LANES, BLOCK_M, D_PAD))
        acc3 = tl.zeros([KEY_LANES, BLOCK_M, D_PAD], dtype=tl.float32)
        m3 = tl.full([KEY_LANES, BLOCK_M], float("-inf"), dtype=tl.float32)
        l3 = tl.zeros([KEY_LANES, BLOCK_M], dtype=tl.float32)
        for start in range(lo, full_end, BLOCK_N):
            acc3, m3, l3 = _attend_key_tile_lanes(
                acc3, m3, l3, q3, K, V, block_row, start, hi, q_pos, kv_head, qk_scale,
                stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                HEAD_DIM, D_PAD, BLOCK_N, KEY_LANES, TOKENS_PER_BLOCK, False, DOT_DTYPE, FP8_CVT_ASM)
        for start in range(full_end, hi, BLOCK_N):
            acc3, m3, l3 = _attend_key_tile_lanes(
                acc3, m3, l3, q3, K, V, block_row, start, hi, q_pos, kv_head, qk_scale,
                stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                HEAD_DIM, D_PAD, BLOCK_N, KEY_LANES, TOKENS_PER_BLOCK, True, DOT_DTYPE, FP8_CVT_ASM)
        acc, m_i, l_i = merge_lanes(acc3, m3, l3)
    else:
        acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        for start in range(lo, full_end, BLOCK_N):
            acc, m_i, l_i = _attend_key_tile(
                acc, m_i, l_i, q, q_lo, K, V, block_row, start, hi, q_pos, kv_head, qk_scale,
                stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                HEAD_DIM, D_PAD, BLOCK_N, TOKENS_PER_BLOCK, False, DOT_DTYPE, FP8_CVT_ASM, FP8_Q)
        for start in range(full_end, hi, BLOCK_N):
            acc, m_i, l_i = _attend_key_tile(
                acc, m_i, l_i, q, q_lo, K, V, block_row, start, hi, q_pos, kv_head, qk_scale,
                stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                HEAD_DIM, D_PAD, BLOCK_N, TOKENS_PER_BLOCK, True, DOT_DTYPE, FP8_CVT_ASM, FP8_Q)

    pdl.allow_next_grid(USE_PDL)  # the keys are read: the merge may be scheduled
    out, lse = finalize_state(acc, m_i, l_i)
    out = out * v_scale  # V's fp8 dequant is uniform over keys: apply it once, after the sum
    if SPLIT:
        prow = token * NUM_HEADS + head  # partial row = (token, head), as the merge's out[T * NH, D]
        tl.store(PartAcc + prow[:, None] * stride_acc_row + split_id * stride_acc_split + d[None, :],
                 out, mask=io_mask)
        tl.store(PartLse + prow * stride_lse_row + split_id * stride_lse_split, lse, mask=row_ok)
        if FUSED_MERGE:  # noqa: SIM102 (a constexpr test: no counter traffic without it)
            if arrive_last(Counters + tile_id * tl.num_programs(1) + kv_head, num_splits):
                acc, m_i, l_i = merge_partial_chunks(
                    PartAcc, PartLse, prow, row_ok, d, d_ok, stride_acc_row, stride_acc_split,
                    stride_lse_row, stride_lse_split, num_splits, MERGE_CHUNK)
                out, _ = finalize_state(acc, m_i, l_i)
                tl.store(Out + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                         out.to(Out.dtype.element_ty), mask=io_mask)
    else:
        tl.store(Out + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(Out.dtype.element_ty), mask=io_mask)


def launch_grid(num_tokens: int, num_seqs: int, num_kv_heads: int, max_splits: int, block_q: int):
    """Grid covering every query tile of any batch with these shapes (see the module docstring)."""
    return (num_tokens // block_q + num_seqs, num_kv_heads, max_splits)
