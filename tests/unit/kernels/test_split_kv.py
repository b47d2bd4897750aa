"""Split-KV planning and merge, against float64 softmax computed here.

On CPU the kernels run under the Triton interpreter (tests/conftest.py sets it up).
"""

import math

import pytest
import torch
import triton
import triton.language as tl

from kernels import split_kv
from kernels.split_kv import num_splits_for, split_bounds

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LOG2E = math.log2(math.e)


@triton.jit
def _bounds_probe_kernel(lens_ptr, out_ptr, max_splits, min_tokens, TILE: tl.constexpr):
    # one program per (length, split): writes (count, start, end)
    item = tl.program_id(0)
    split = tl.program_id(1)
    length = tl.load(lens_ptr + item)
    count = num_splits_for(length, max_splits, min_tokens)
    start, end = split_bounds(length, split, count, TILE)
    base = out_ptr + (item * max_splits + split) * 3
    tl.store(base, count)
    tl.store(base + 1, start)
    tl.store(base + 2, end)


def _probe_bounds(lengths, max_splits, min_tokens, tile):
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    out = torch.full((len(lengths), max_splits, 3), -7, dtype=torch.int32, device=DEVICE)
    _bounds_probe_kernel[(len(lengths), max_splits)](lens, out, max_splits, min_tokens, TILE=tile)
    return out.cpu().tolist()


@pytest.mark.parametrize(("max_splits", "min_tokens", "tile"), [(8, 256, 64), (5, 1, 16), (64, 128, 32)])
def test_split_bounds_tile_the_keys_exactly_once(max_splits, min_tokens, tile):
    gen = torch.Generator().manual_seed(max_splits * 1000 + min_tokens)
    lengths = [0, 1, tile - 1, tile, tile + 1, 3 * tile, min_tokens, 5 * min_tokens + 3]
    lengths += torch.randint(0, 40 * tile, (6,), generator=gen).tolist()
    table = _probe_bounds(lengths, max_splits, min_tokens, tile)
    for length, rows in zip(lengths, table):
        count = rows[0][0]
        # hand rule: floor(length / min_tokens), clamped to [1, max_splits]
        assert count == max(1, min(max_splits, length // min_tokens)), (length, rows)
        covered = []
        for split, (_, start, end) in enumerate(rows[:count]):
            assert start % tile == 0
            covered.extend(range(start, max(start, end)))
            if end > start and split + 1 < count and rows[split + 1][2] > rows[split + 1][1]:
                # every non-final split is at least min_tokens long (tile rounding only adds)
                assert end - start >= min(min_tokens, length), (length, rows)
        assert covered == list(range(length)), (length, rows[:count])


def test_plan_max_splits_depends_on_item_count_only():
    device = torch.device(DEVICE)
    sms = split_kv.num_sms(device)
    assert split_kv.plan_max_splits(sms, device) == 1
    assert split_kv.plan_max_splits(10 * sms, device) == 1
    small = split_kv.plan_max_splits(1, device)
    assert 1 < small <= split_kv.MAX_SPLITS
    assert small == min(split_kv.MAX_SPLITS, split_kv.WAVES * sms)
    for items in range(1, sms):  # never a partly filled wave beyond WAVES full ones
        assert items * split_kv.plan_max_splits(items, device) <= split_kv.WAVES * sms
    assert split_kv.plan_max_splits(3, device, num_splits=7) == 7
    with pytest.raises(ValueError, match="num_splits"):
        split_kv.plan_max_splits(3, device, num_splits=0)
    with pytest.raises(ValueError, match="num_items"):
        split_kv.plan_max_splits(0, device)


def test_min_tokens_per_split_grows_with_rows():
    assert split_kv.min_tokens_per_split(16) == split_kv.MIN_TOKENS_PER_SPLIT
    assert split_kv.min_tokens_per_split(128) == split_kv.TOKENS_PER_ROW * 128
    with pytest.raises(ValueError, match="rows_pad"):
        split_kv.min_tokens_per_split(0)


def _states_from_scores(scores, values, ranges):
    """float64 partial states (acc [rows, S, D], lse2 [rows, S]) of `scores` over key `ranges`."""
    rows, dim = scores.shape[0], values.shape[-1]
    acc = torch.zeros(rows, len(ranges), dim, dtype=torch.float64)
    lse = torch.full((rows, len(ranges)), -math.inf, dtype=torch.float64)
    for s, (lo, hi) in enumerate(ranges):
        if hi > lo:
            part = scores[:, lo:hi]
            lse[:, s] = torch.logsumexp(part, dim=1) * LOG2E
            acc[:, s] = torch.einsum("rk,rkd->rd", part.softmax(dim=1), values[:, lo:hi])
    return acc, lse


@pytest.mark.parametrize("with_extra", [False, True])
def test_merge_partials_equals_one_softmax(with_extra):
    gen = torch.Generator().manual_seed(11 + with_extra)
    rows_per_item, dim, max_splits, min_tokens = 16, 32, 4, 8
    lengths = [0, 5, 8, 29]  # item 0 has no keys at all; item 1 has one split
    num_rows = rows_per_item * len(lengths)
    acc = torch.full((num_rows, max_splits, dim), float("nan"), dtype=torch.float32)  # poison
    lse = torch.full((num_rows, max_splits), float("nan"), dtype=torch.float32)
    expected = torch.zeros(num_rows, dim, dtype=torch.float64)
    extra_acc = torch.randn(num_rows, dim, generator=gen, dtype=torch.float64)
    extra_lse = torch.randn(num_rows, generator=gen, dtype=torch.float64) * 3
    for item, length in enumerate(lengths):
        rows = slice(item * rows_per_item, (item + 1) * rows_per_item)
        scores = torch.randn(rows_per_item, length, generator=gen, dtype=torch.float64) * 4
        values = torch.randn(rows_per_item, length, dim, generator=gen, dtype=torch.float64)
        count = max(1, min(max_splits, length // min_tokens))
        per = -(-length // count) if length else 0
        ranges = [(s * per, min((s + 1) * per, length)) for s in range(count)]
        part_acc, part_lse = _states_from_scores(scores, values, ranges)
        acc[rows, :count] = part_acc.float()
        lse[rows, :count] = part_lse.float()
        # oracle: one softmax over all keys (plus the extra state as a pseudo-key block)
        full_lse2 = torch.logsumexp(scores, dim=1) * LOG2E  # -inf rows when there are no keys
        full = torch.einsum("rk,rkd->rd", scores.softmax(dim=1).nan_to_num(), values)
        if with_extra:
            total = torch.logaddexp2(full_lse2, extra_lse[rows])
            full = full * torch.exp2(full_lse2 - total)[:, None] + extra_acc[rows] * torch.exp2(
                extra_lse[rows] - total)[:, None]
            full = torch.nan_to_num(full)
        expected[rows] = full
    out = torch.full((num_rows, dim), float("nan"), dtype=torch.float32, device=DEVICE)
    extra = {"extra_acc": extra_acc.float().to(DEVICE), "extra_lse": extra_lse.float().to(DEVICE)}
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    split_kv.merge_partials(acc.to(DEVICE), lse.to(DEVICE), lens, out, rows_per_length=rows_per_item,
                            max_splits=max_splits, min_tokens_per_split=min_tokens,
                            **(extra if with_extra else {}))
    out = out.cpu().double()
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    if not with_extra:
        assert out[:rows_per_item].abs().max() == 0  # an item with no keys merges to the empty state


def test_merge_partials_writes_lse_over_many_chunks():
    # 37 splits: three 16-split merge steps, the last one partly masked; empties scattered
    gen = torch.Generator().manual_seed(5)
    num_rows, dim, max_splits = 16, 16, 37
    acc = torch.randn(num_rows, max_splits, dim, generator=gen)
    lse = torch.randn(num_rows, max_splits, generator=gen) * 5
    empty = torch.rand(num_rows, max_splits, generator=gen) < 0.3
    empty[:, 0] = False
    lse[empty] = -math.inf
    acc[empty] = 0
    out = torch.empty(num_rows, dim, device=DEVICE)
    out_lse = torch.full((num_rows,), float("nan"), device=DEVICE)
    lens = torch.tensor([10_000], dtype=torch.int32, device=DEVICE)
    split_kv.merge_partials(acc.to(DEVICE), lse.to(DEVICE), lens, out, rows_per_length=num_rows,
                            max_splits=max_splits, min_tokens_per_split=1, out_lse=out_lse)
    lse64 = lse.double()
    total = torch.logsumexp(lse64 / LOG2E, dim=1) * LOG2E
    weights = torch.exp2(lse64 - total[:, None])
    torch.testing.assert_close(out_lse.cpu().double(), total, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.cpu().double(), torch.einsum("rs,rsd->rd", weights, acc.double()),
                               rtol=1e-5, atol=1e-5)


def test_merge_partials_rejects_bad_input():
    acc, lse = split_kv.alloc_partials(32, 2, 16, torch.device(DEVICE))
    lens = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    out = torch.empty(32, 16, device=DEVICE)
    common = {"max_splits": 2, "min_tokens_per_split": 1}
    with pytest.raises(ValueError, match="rows_per_length"):
        split_kv.merge_partials(acc, lse, lens, out, rows_per_length=12, **common)
    with pytest.raises(ValueError, match="lengths"):
        split_kv.merge_partials(acc, lse, lens.long(), out, rows_per_length=16, **common)
    with pytest.raises(ValueError, match="out must be"):
        split_kv.merge_partials(acc, lse, lens, out[:, :8], rows_per_length=16, **common)
    with pytest.raises(ValueError, match="partial_lse"):
        split_kv.merge_partials(acc, lse[:, :1], lens, out, rows_per_length=16, **common)
    with pytest.raises(ValueError, match="come together"):
        split_kv.merge_partials(acc, lse, lens, out, rows_per_length=16, extra_acc=out, **common)


@triton.jit
def _arrival_probe_kernel(counts_ptr, values_ptr, counters_ptr, sums_ptr, lasts_ptr, max_splits,
                          BLOCK: tl.constexpr):
    # program (item, split): splits below the item's count publish a value; the last one sums them
    item = tl.program_id(0)
    split = tl.program_id(1)
    count = tl.load(counts_ptr + item)
    if split < count:
        lanes = tl.arange(0, BLOCK)
        tl.store(values_ptr + (item * max_splits + split) * BLOCK + lanes, (split + 1) * (lanes + 1))
        if split_kv.arrive_last(counters_ptr + item, count):
            rows = tl.arange(0, 16)
            published = tl.load(values_ptr + (item * max_splits + rows[:, None]) * BLOCK + lanes[None, :],
                                mask=(rows < count)[:, None], other=0, cache_modifier=".cg")
            tl.store(sums_ptr + item * BLOCK + lanes, tl.sum(published, 0))
            tl.atomic_add(lasts_ptr + item, 1)


def test_arrive_last_picks_one_merger_per_item_after_every_publish():
    counts = torch.randint(1, 17, (6,), dtype=torch.int32).tolist()
    counts[0] = 1  # an item that does not split
    max_splits, block = 16, 16
    device = torch.device(DEVICE)
    counters = split_kv.arrival_counters(len(counts), device)
    values = torch.zeros(len(counts), max_splits, block, dtype=torch.int32, device=DEVICE)
    sums = torch.full((len(counts), block), -1, dtype=torch.int32, device=DEVICE)
    lasts = torch.zeros(len(counts), dtype=torch.int32, device=DEVICE)
    counts_t = torch.tensor(counts, dtype=torch.int32, device=DEVICE)
    for _ in range(2):  # the counters are back at zero for a second call
        sums.fill_(-1)
        _arrival_probe_kernel[(len(counts), max_splits)](counts_t, values, counters, sums, lasts, max_splits,
                                                         BLOCK=block)
        lanes = torch.arange(1, block + 1)
        expected = torch.stack([lanes * (n * (n + 1) // 2) for n in counts]).int()
        assert torch.equal(sums.cpu(), expected)
        assert int(counters[: len(counts)].abs().sum()) == 0
    assert lasts.tolist() == [2] * len(counts)


def test_arrival_counters_are_zero_shared_and_grow_without_freeing():
    device = torch.device(DEVICE)
    first = split_kv.arrival_counters(3, device)
    assert first.dtype == torch.int32 and int(first.abs().sum()) == 0 and first.numel() >= 3
    assert split_kv.arrival_counters(2, device).data_ptr() == first.data_ptr()
    grown = split_kv.arrival_counters(first.numel() + 1, device)
    assert grown.numel() > first.numel() and int(grown.abs().sum()) == 0
    assert any(old.data_ptr() == first.data_ptr() for old in split_kv._OUTGROWN)  # kept alive
    with pytest.raises(ValueError, match="num_items"):
        split_kv.arrival_counters(0, device)
