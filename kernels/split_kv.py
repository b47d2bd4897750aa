"""Split-KV for paged attention kernels: device-side, length-aware split planning and the merge.

A small batch leaves most of the GPU idle when one program walks a whole context, so the keys of
each work item (a request and KV head) are cut into splits that run in parallel. Each split
writes a *partial state* for each of its query rows; a merge folds the partials back into one
softmax. This module holds the parts any paged kernel shares (`kernels.context_attention` and
`kernels.paged_attention` both use it). It imports only torch and triton.

Partial state (the FlashInfer "attention state", in base 2)
    For one query row over one key range, ``acc`` [D] fp32 is the softmax-weighted mean of the
    values over that range (already normalised), and ``lse`` fp32 is the base-2 log-sum-exp of
    the range's scores, the scores measured in log2 units (``q . k * scale * log2(e)``). An empty
    range has ``lse = -inf`` and ``acc = 0``. States merge associatively:
    ``lse = log2(sum_s 2**lse_s)``, ``acc = sum_s 2**(lse_s - lse) * acc_s``.

Buffers
    ``partial_acc`` [num_rows, max_splits, D] fp32 and ``partial_lse`` [num_rows, max_splits]
    fp32, indexed by (row, split); kernels take their strides. `alloc_partials` makes them.

Graph-safe planning (plan on the host, decide per request on the device)
    The host picks the grid's split dimension ``max_splits`` from the number of work items only
    (`plan_max_splits`; never from lengths, which live on the device), so a CUDA graph captured
    once replays for any lengths. ``max_splits`` is a runtime kernel argument (not constexpr), so
    a new batch size does not recompile. On the device each work item takes
    ``num_splits_for(length, max_splits, min_tokens_per_split)`` splits: enough to use the grid,
    never fewer than ``min_tokens_per_split`` keys each (but the last), a floor that grows with
    the padded row count (`min_tokens_per_split`) so the partials (``rows * (D + 1) * 4`` bytes
    per split) never outweigh the context bytes a split reads. `split_bounds` gives a split's
    [start, end), tile aligned; splits past the work item's count, or past its keys, are empty
    and harmless. The merge recomputes the same count from the same length, so nothing else
    crosses between kernels.

Device helpers (``@triton.jit``, call them from your kernels)
    ``num_splits_for(length, max_splits, min_tokens_per_split) -> int``
    ``split_bounds(length, split_id, num_splits, TILE) -> (start, end)``
    ``finalize_state(acc, m_i, l_i) -> (acc / l_i, m_i + log2(l_i))``, guarded for empty states
    ``merge_partial_tile(acc_ptr, lse_ptr, rows, row_mask, cols, col_mask, stride_acc_row,
    stride_acc_split, stride_lse_row, stride_lse_split, num_splits) -> (acc, m_i, l_i)``, an
    unnormalised running state (output ``acc / l_i``, lse ``m_i + log2(l_i)``); it loads 16
    splits a step; ``merge_partial_chunks(..., num_splits, SPLIT_CHUNK)`` picks the step
    ``fold_state(acc, m_i, l_i, acc_x, lse_x) -> (acc, m_i, l_i)``: fold one more normalised dense state
    ``arrive_last(counter_ptr, count) -> bool``: after storing its partials, True in the last of
    the work item's `count` splits to finish, which may then merge them in the same kernel

A split kernel, in outline (grid: work items x max_splits)::

    count = num_splits_for(length, max_splits, min_tokens_per_split)
    start, end = split_bounds(length, split_id, count, BLOCK_N)
    ... online softmax over keys [start, end) (empty if split_id >= count: mask its stores) ...
    acc, lse = finalize_state(acc, m_i, l_i)
    store acc at partial_acc[row, split_id, :] and lse at partial_lse[row, split_id] if split_id < count

Host API
    `min_tokens_per_split`, `plan_max_splits`, `alloc_partials`, `arrival_counters` (the zeroed
    per-device counters `arrive_last` counts on), and `merge_partials`: a generic
    merge launcher for rows laid out as ``out`` [num_rows, D] that also folds one optional extra
    dense state (``extra_acc`` [num_rows, D], ``extra_lse`` [num_rows]), for example a suffix
    attended densely elsewhere.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels import pdl

# Never fewer tokens per split than this, whatever the row count (FlashInfer's floor).
MIN_TOKENS_PER_SPLIT = 128
# Per padded query row, this many tokens per split: partial bytes / context bytes <= 1/2 (bf16),
# and the partials of a small batch stay in L2, written and read back within microseconds.
TOKENS_PER_ROW = 2
# Cap on the grid's split dimension: more partials than this only add merge work.
MAX_SPLITS = 64
# Programs the split grid fills at most, in multiples of the SM count (two waves hide the tail; four
# measured slower on an H200 for B 4..16: more partials and more waves of programs).
WAVES = 2
# The "SM count" the planner assumes on CPU (the interpreter), so small CPU batches still split.
CPU_SMS = 4


@triton.jit
def num_splits_for(length, max_splits, min_tokens_per_split):
    """Splits one work item of `length` keys takes: floor(length / min_tokens), in [1, max_splits].

    Floor, so every split but the last holds at least min_tokens_per_split keys.
    """
    wanted = length // min_tokens_per_split
    return tl.maximum(tl.minimum(wanted, max_splits), 1)


@triton.jit
def split_bounds(length, split_id, num_splits, TILE: tl.constexpr):
    """[start, end) of split `split_id` of `num_splits` over `length` keys, starts TILE aligned.

    Empty (start >= end) for splits past the keys; the caller still writes an empty state for a
    split_id < num_splits, since the merge reads every split below the count.
    """
    tiles_per_split = tl.cdiv(tl.cdiv(length, TILE), num_splits)
    start = split_id * tiles_per_split * TILE
    end = tl.minimum(start + tiles_per_split * TILE, length)
    return start, end


@triton.jit
def finalize_state(acc, m_i, l_i):
    """Running state (acc [R, D] unnormalised, m_i [R] max, l_i [R] sum, base 2) -> (acc / l_i, lse).

    Rows that saw no key (l_i == 0) give acc = 0 and lse = -inf, the empty state.
    """
    seen = l_i > 0.0
    safe_l = tl.where(seen, l_i, 1.0)
    out = tl.where(seen[:, None], acc / safe_l[:, None], 0.0)
    lse = tl.where(seen, m_i + tl.log2(safe_l), float("-inf"))
    return out, lse


@triton.jit
def fold_state(acc, m_i, l_i, acc_x, lse_x):
    """Fold a normalised state (acc_x [R, D], lse_x [R]) into a running state (acc, m_i, l_i).

    Both may be empty (m_i or lse_x = -inf); the -inf guard keeps 2**(-inf - -inf) out.
    """
    m_new = tl.maximum(m_i, lse_x)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    weight = tl.exp2(lse_x - m_safe)
    acc = acc * alpha[:, None] + acc_x * weight[:, None]
    l_i = l_i * alpha + weight
    return acc, m_new, l_i


@triton.jit
def merge_partial_chunks(acc_ptr, lse_ptr, rows, row_mask, cols, col_mask, stride_acc_row,
                         stride_acc_split, stride_lse_row, stride_lse_split, num_splits,
                         SPLIT_CHUNK: tl.constexpr):
    """Fold splits 0..num_splits-1 of rows `rows` [R] and columns `cols` [C], SPLIT_CHUNK at a time.

    Each step loads a [R, SPLIT_CHUNK, C] block of partials at once, so the loads of many splits
    are in flight together (a split-by-split loop waits one L2 round trip per split). The loads
    bypass L1 (".cg"): other programs wrote the partials, and an SM's L1 is not coherent with them.
    Returns the unnormalised running state (acc [R, C], m_i [R], l_i [R]).
    """
    rows64 = rows.to(tl.int64)
    acc = tl.zeros([rows.shape[0], cols.shape[0]], dtype=tl.float32)
    m_i = tl.full([rows.shape[0]], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([rows.shape[0]], dtype=tl.float32)
    chunk = tl.arange(0, SPLIT_CHUNK)
    for first in range(0, num_splits, SPLIT_CHUNK):
        splits = first + chunk
        live = row_mask[:, None] & (splits < num_splits)[None, :]  # [R, S]
        lse = tl.load(lse_ptr + rows64[:, None] * stride_lse_row + splits[None, :] * stride_lse_split,
                      mask=live, other=float("-inf"), cache_modifier=".cg")
        part = tl.load(acc_ptr + rows64[:, None, None] * stride_acc_row
                       + splits[None, :, None] * stride_acc_split + cols[None, None, :],
                       mask=live[:, :, None] & col_mask[None, None, :], other=0.0,
                       cache_modifier=".cg")  # [R, S, C]
        m_new = tl.maximum(m_i, tl.max(lse, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no keys yet
        alpha = tl.exp2(m_i - m_safe)
        weight = tl.exp2(lse - m_safe[:, None])  # [R, S]; empty splits weigh 0
        acc = acc * alpha[:, None] + tl.sum(part * weight[:, :, None], 1)
        l_i = l_i * alpha + tl.sum(weight, 1)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def arrive_last(counter_ptr, count):
    """Count this program in at its work item's counter; True for the last of `count` arrivals.

    Call it after the program's partial stores. The barrier orders every thread's stores before
    the (single-thread) release; the acquire makes the other splits' partials visible to the last
    one, which merges them in the same kernel (no merge launch) and resets the counter to 0 for
    the next call, so the counters stay zero between calls without a memset.
    """
    tl.debug_barrier()
    ticket = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    last = ticket == count - 1
    if last:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
    return last


@triton.jit
def merge_partial_tile(acc_ptr, lse_ptr, rows, row_mask, cols, col_mask,
                       stride_acc_row, stride_acc_split, stride_lse_row, stride_lse_split, num_splits):
    """`merge_partial_chunks` with 16 splits a step; returns (acc [R, C], m_i [R], l_i [R])."""
    return merge_partial_chunks(acc_ptr, lse_ptr, rows, row_mask, cols, col_mask, stride_acc_row,
                                stride_acc_split, stride_lse_row, stride_lse_split, num_splits, 16)


@triton.jit(do_not_specialize=["max_splits", "min_tokens_per_split", "num_rows", "stride_lse_row"],
            do_not_specialize_on_alignment=["lens_ptr"])
def _merge_partials_kernel(
    acc_ptr, lse_ptr, lens_ptr, out_ptr, out_lse_ptr, extra_acc_ptr, extra_lse_ptr,
    num_rows, rows_per_length, max_splits, min_tokens_per_split,
    stride_acc_row, stride_acc_split, stride_lse_row, stride_lse_split, stride_out_row,
    stride_extra_row,
    HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_EXTRA: tl.constexpr, HAS_OUT_LSE: tl.constexpr, USE_PDL: tl.constexpr,
):
    # grid: (cdiv(num_rows, BLOCK_ROWS), HEAD_DIM // BLOCK_D); a block never straddles two lengths
    # because BLOCK_ROWS divides rows_per_length (checked by the launcher).
    row0 = tl.program_id(0) * BLOCK_ROWS
    rows = row0 + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_mask = rows < num_rows
    col_mask = cols < HEAD_DIM
    pdl.wait_for_previous_grid(USE_PDL)  # the split kernel's partials and lengths
    pdl.allow_next_grid(USE_PDL)
    length = tl.load(lens_ptr + row0 // rows_per_length)
    num_splits = num_splits_for(length, max_splits, min_tokens_per_split)
    acc, m_i, l_i = merge_partial_tile(acc_ptr, lse_ptr, rows, row_mask, cols, col_mask, stride_acc_row,
                                   stride_acc_split, stride_lse_row, stride_lse_split, num_splits)
    rows64 = rows.to(tl.int64)
    tile_mask = row_mask[:, None] & col_mask[None, :]
    if HAS_EXTRA:
        acc_x = tl.load(extra_acc_ptr + rows64[:, None] * stride_extra_row + cols[None, :],
                        mask=tile_mask, other=0.0).to(tl.float32)
        lse_x = tl.load(extra_lse_ptr + rows64, mask=row_mask, other=float("-inf")).to(tl.float32)
        acc, m_i, l_i = fold_state(acc, m_i, l_i, acc_x, lse_x)
    out, lse = finalize_state(acc, m_i, l_i)
    tl.store(out_ptr + rows64[:, None] * stride_out_row + cols[None, :],
             out.to(out_ptr.dtype.element_ty), mask=tile_mask)
    if HAS_OUT_LSE:  # every column block stores the same lse: identical writes, no race
        tl.store(out_lse_ptr + rows64, lse, mask=row_mask)


def min_tokens_per_split(rows_pad: int) -> int:
    """Least keys one split may take for `rows_pad` padded query rows per work item.

    A split writes rows_pad * (D + 1) fp32 and reads tokens * 2 * D * itemsize of K/V, so
    TOKENS_PER_ROW * rows_pad tokens keep the partials at most half the 16-bit context.
    """
    if rows_pad < 1:
        raise ValueError(f"rows_pad must be >= 1, got {rows_pad}")
    return max(MIN_TOKENS_PER_SPLIT, TOKENS_PER_ROW * rows_pad)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (CPU_SMS on CPU, where the interpreter runs)."""
    if device.type != "cuda":
        return CPU_SMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _sm_count(index)


def plan_max_splits(num_items: int, device: torch.device, num_splits: int | None = None) -> int:
    """The grid's split dimension for `num_items` work items (requests x KV heads) on `device`.

    1 means one pass (the items already fill the GPU). Otherwise the most splits that keep the
    grid within WAVES full waves of programs (rounded down: a last wave of a few programs costs a
    whole wave's time, e.g. 64 items x 5 splits = 2.4 waves of 132 SMs ran slower than x 4 on an
    H200), capped at MAX_SPLITS; each item then takes at most this many, fewer when short.
    Depends on the item count only, so it is fixed for a captured batch size. `num_splits`
    forces the value (tests, tuning).
    """
    if num_items < 1:
        raise ValueError(f"num_items must be >= 1, got {num_items}")
    if num_splits is not None:
        if not isinstance(num_splits, int) or num_splits < 1:
            raise ValueError(f"num_splits must be a positive int or None, got {num_splits!r}")
        return num_splits
    sms = num_sms(device)
    if num_items >= sms:
        return 1
    return max(1, min(MAX_SPLITS, WAVES * sms // num_items))


def alloc_partials(num_rows: int, max_splits: int, head_dim: int, device: torch.device):
    """Uninitialised fp32 partial buffers: acc [num_rows, max_splits, D], lse [num_rows, max_splits].

    Every split below a work item's count writes its slot (empty splits write the empty state),
    and the merge reads no other slot, so no initialisation is needed.
    """
    acc = torch.empty(num_rows, max_splits, head_dim, dtype=torch.float32, device=device)
    lse = torch.empty(num_rows, max_splits, dtype=torch.float32, device=device)
    return acc, lse


# Per device: the arrival counters of fused merges (see `arrival_counters`), and the buffers they
# outgrew, kept alive because captured graphs may still point at them.
_COUNTERS: dict[torch.device, torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []


def _device_key(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def arrival_counters(num_items: int, device: torch.device) -> torch.Tensor:
    """Int32 counters, one per work item, all zero, for kernels that merge in their last split.

    Every kernel that counts arrivals (`arrive_last`) leaves its counters at zero again, so one
    buffer per device serves every call without a memset: a CUDA graph captured after a first
    (warm-up) call replays with no extra node. Calls on one device must therefore run in stream
    order (one stream, or streams joined by events), as the engine's do. A buffer that has to grow
    during graph capture cannot be zeroed then, so that call gets its own zero-filled buffer,
    captured with it (one memset node per replay).
    """
    if num_items < 1:
        raise ValueError(f"num_items must be >= 1, got {num_items}")
    key = _device_key(device)
    counters = _COUNTERS.get(key)
    if counters is not None and counters.numel() >= num_items:
        return counters
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(num_items, dtype=torch.int32, device=device)
    if counters is not None:
        _OUTGROWN.append(counters)
    size = max(num_items, 2 * counters.numel() if counters is not None else 1024)
    _COUNTERS[key] = torch.zeros(size, dtype=torch.int32, device=device)
    return _COUNTERS[key]


def _check_merge_args(acc, lse, lengths, out, rows_per_length, extra_acc, extra_lse, out_lse):
    if acc.dim() != 3 or acc.dtype != torch.float32 or acc.stride(2) != 1:
        raise ValueError(f"partial_acc must be fp32 [rows, splits, D] with unit last stride, got "
                         f"{acc.dtype} {tuple(acc.shape)}")
    num_rows, max_splits, head_dim = acc.shape
    if lse.shape != (num_rows, max_splits) or lse.dtype != torch.float32:
        raise ValueError(f"partial_lse must be fp32 {(num_rows, max_splits)}, got {lse.dtype} "
                         f"{tuple(lse.shape)}")
    if out.shape != (num_rows, head_dim) or out.stride(1) != 1:
        raise ValueError(f"out must be [{num_rows}, {head_dim}] with unit last stride, got "
                         f"{tuple(out.shape)}")
    if rows_per_length < 1 or num_rows % rows_per_length:
        raise ValueError(f"rows_per_length ({rows_per_length}) must divide num_rows ({num_rows})")
    if lengths.dim() != 1 or lengths.numel() != num_rows // rows_per_length or lengths.dtype != torch.int32:
        raise ValueError(f"lengths must be int32 [{num_rows // rows_per_length}], got {lengths.dtype} "
                         f"{tuple(lengths.shape)}")
    if (extra_acc is None) != (extra_lse is None):
        raise ValueError("extra_acc and extra_lse come together")
    if extra_acc is not None and (extra_acc.shape != (num_rows, head_dim) or extra_acc.stride(1) != 1
                                  or extra_lse.shape != (num_rows,)):
        raise ValueError(f"extra_acc must be [{num_rows}, {head_dim}] (unit last stride) and "
                         f"extra_lse [{num_rows}]")
    if out_lse is not None and (out_lse.shape != (num_rows,) or out_lse.dtype != torch.float32):
        raise ValueError(f"out_lse must be fp32 [{num_rows}]")
    tensors = [t for t in (acc, lse, lengths, out, extra_acc, extra_lse, out_lse) if t is not None]
    if any(t.device != acc.device for t in tensors):
        raise ValueError("all merge tensors must be on one device")


def merge_partials(partial_acc, partial_lse, lengths, out, *, rows_per_length, max_splits,
                          min_tokens_per_split, extra_acc=None, extra_lse=None, out_lse=None):
    """Merge the partial states of every row into ``out`` (and ``out_lse``, base 2, if given).

    Parameters
    ----------
    partial_acc : Tensor [num_rows, max_splits_alloc, D] fp32, partial_lse : [num_rows, max_splits_alloc] fp32
        The split kernel's states; only splits below each row's count are read.
    lengths : Tensor [num_rows // rows_per_length] int32
        Key count of each work item; rows r belongs to item r // rows_per_length.
    out : Tensor [num_rows, D], any float dtype, unit last stride
    rows_per_length : int
        Rows per work item, a multiple of 16 (the merge tile) or a divisor of it never crossing items.
    max_splits, min_tokens_per_split : int
        The plan the split kernel ran with (the device recomputes each item's split count).
    extra_acc : Tensor [num_rows, D], extra_lse : Tensor [num_rows], optional
        One more normalised state per row folded in (for example a densely attended suffix).
    """
    _check_merge_args(partial_acc, partial_lse, lengths, out, rows_per_length, extra_acc, extra_lse,
                      out_lse)
    num_rows, _, head_dim = partial_acc.shape
    block_rows = 16 if rows_per_length % 16 == 0 else rows_per_length
    if block_rows & (block_rows - 1):
        raise ValueError(f"rows_per_length must be a multiple of 16 or a power of two, got {rows_per_length}")
    block_d = min(head_dim, 32)  # a [16, 16 splits, 32] fp32 block per step: 32 registers a thread
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"D must be a power of two >= 16, got {head_dim}")
    has_extra = extra_acc is not None
    use_pdl = pdl.use_pdl(partial_acc.device)
    grid = (triton.cdiv(num_rows, block_rows), head_dim // block_d)
    _merge_partials_kernel[grid](
        partial_acc, partial_lse, lengths, out, out_lse if out_lse is not None else partial_lse,
        extra_acc if has_extra else partial_acc, extra_lse if has_extra else partial_lse,
        num_rows, rows_per_length, max_splits, min_tokens_per_split,
        partial_acc.stride(0), partial_acc.stride(1), partial_lse.stride(0), partial_lse.stride(1),
        out.stride(0), extra_acc.stride(0) if has_extra else 0,
        HEAD_DIM=head_dim, BLOCK_ROWS=block_rows, BLOCK_D=block_d,
        HAS_EXTRA=has_extra, HAS_OUT_LSE=out_lse is not None, USE_PDL=use_pdl, launch_pdl=use_pdl,
    )
    return out
