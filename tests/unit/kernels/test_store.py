"""store_kv against an expected pool built row by row here, bit for bit.

The pool is a strided layer view of a NaN-poisoned arena, so a write to the wrong layer, block,
offset or head, or a write of a skipped row, shows up as a changed element.
"""

import pytest
import torch

import kernels
from kernels.store import PAD_SLOT

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn


def make_pool(num_blocks, tpb, num_kv_heads, head_dim, dtype, layers=3, layer=1):
    """A poisoned arena [blocks, L, 2, tpb, NKV, D] and the K and V views of one layer."""
    arena = torch.full((num_blocks, layers, 2, tpb, num_kv_heads, head_dim), float("nan"), device=DEVICE)
    arena = arena.to(dtype)
    return arena, arena[:, layer, 0], arena[:, layer, 1]


def to_cache(rows, dtype, scale):
    if dtype == FP8:
        return (rows.float() / float(scale or 1.0)).clamp(-448, 448).to(FP8)
    return rows.to(dtype)


def bits(t):
    """Compare storage bits (NaN == NaN, -0 != +0)."""
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16 if t.element_size() == 2
                                                                     else torch.int32)


@pytest.mark.parametrize(
    ("row_dtype", "cache_dtype", "slot_dtype"),
    [
        (torch.float32, torch.float32, torch.int32),
        (torch.float32, torch.bfloat16, torch.int64),
        (torch.float16, torch.float16, torch.int32),
        (torch.bfloat16, FP8, torch.int64),
    ],
)
def test_store_writes_exactly_the_named_slots(row_dtype, cache_dtype, slot_dtype):
    gen = torch.Generator().manual_seed(row_dtype.itemsize * 10 + cache_dtype.itemsize)
    num_blocks, tpb, num_kv, head_dim, num_rows = 7, 16, 3, 32, 21
    scales = {"k_scale": 0.25, "v_scale": torch.tensor(3.0, device=DEVICE)} if cache_dtype == FP8 else {}
    arena, k_cache, v_cache = make_pool(num_blocks, tpb, num_kv, head_dim, cache_dtype)
    expected = arena.clone()
    k = (torch.randn(num_rows, num_kv, head_dim, generator=gen) * 40).to(row_dtype).to(DEVICE)
    v = (torch.randn(num_rows, num_kv, head_dim, generator=gen) * 40).to(row_dtype).to(DEVICE)
    slots = torch.randperm(num_blocks * tpb, generator=gen)[:num_rows].to(slot_dtype)
    slots[[2, 11, 20]] = PAD_SLOT  # masked rows past an accepted count
    for i, slot in enumerate(slots.tolist()):
        if slot != PAD_SLOT:
            expected[slot // tpb, 1, 0, slot % tpb] = to_cache(k[i], cache_dtype, scales.get("k_scale"))
            expected[slot // tpb, 1, 1, slot % tpb] = to_cache(v[i], cache_dtype, scales.get("v_scale"))
    kernels.store_kv(k, v, k_cache, v_cache, slots.to(DEVICE), backend="triton", **scales)
    assert torch.equal(bits(arena), bits(expected))
    reference_arena, ref_k, ref_v = make_pool(num_blocks, tpb, num_kv, head_dim, cache_dtype)
    kernels.reference.store_kv(k, v, ref_k, ref_v, slots.to(DEVICE), **scales)
    assert torch.equal(bits(reference_arena), bits(expected))


def test_fp8_store_saturates_and_rounds_to_nearest_even():
    # k_scale 0.5 doubles: 0.125 exact, 2e4 saturates to 448, 2.125 halfway 2.0 | 2.25 -> 2.0 (even)
    k = torch.tensor([0.0625, 1e4, -1e4, 1.0625, 1.1875], device=DEVICE).reshape(5, 1, 1).expand(5, 1, 16)
    _, k_cache, v_cache = make_pool(1, 16, 1, 16, FP8, layers=1, layer=0)
    kernels.store_kv(k.contiguous(), k.contiguous(), k_cache, v_cache,
                     torch.arange(5, dtype=torch.int32, device=DEVICE), k_scale=0.5, backend="triton")
    got = k_cache[0, :5, 0, 0].float().cpu()
    assert got.tolist() == [0.125, 448.0, -448.0, 2.0, 2.5]  # 2.375: halfway 2.25 | 2.5 -> even
    assert v_cache[0, :5, 0, 0].float().cpu().tolist() == [0.0625, 448.0, -448.0, 1.0, 1.25]


def test_empty_store_is_a_no_op():
    arena, k_cache, v_cache = make_pool(2, 16, 1, 16, torch.float32)
    empty = torch.empty(0, 1, 16, device=DEVICE)
    kernels.store_kv(empty, empty, k_cache, v_cache, torch.empty(0, dtype=torch.int32, device=DEVICE),
                     backend="triton")
    assert arena.isnan().all()


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"k": torch.randn(4, 2, 16)}, "k must be"),
        ({"v": torch.randn(4, 2, 32).long()}, "v must be bf16"),
        ({"slot_mapping": torch.zeros(4, dtype=torch.int16)}, "slot_mapping must be int32 or int64"),
        ({"slot_mapping": torch.zeros(3, dtype=torch.int32)}, "slot_mapping must be"),
        ({"k_cache": torch.zeros(2, 12, 2, 32)}, "tokens_per_block"),
        ({"k_scale": -1.0}, "k_scale must be positive"),
        ({"v_scale": torch.ones(2)}, "v_scale must be"),
        ({"k": torch.randn(4, 2, 32, device="meta")}, "on meta"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_store_rejects_bad_input(change, match):
    args = {"k": torch.randn(4, 2, 32), "v": torch.randn(4, 2, 32), "k_cache": torch.zeros(2, 16, 2, 32),
            "v_cache": torch.zeros(2, 16, 2, 32), "slot_mapping": torch.zeros(4, dtype=torch.int32)}
    args = {name: t.to(DEVICE) for name, t in args.items()}
    scales = {name: change.pop(name) for name in ("k_scale", "v_scale") if name in change}
    args.update({name: t if t.device.type == "meta" else t.to(DEVICE) for name, t in change.items()})
    if "k_cache" in change:
        args["v_cache"] = args["k_cache"].clone()
    for backend in ("triton", "torch"):
        with pytest.raises(ValueError, match=match):
            kernels.store_kv(**args, **scales, backend=backend)


@pytest.mark.gpu
def test_gpu_store_replays_in_a_graph_with_other_slots():
    gen = torch.Generator().manual_seed(4)
    num_blocks, tpb, num_kv, head_dim, num_rows = 64, 32, 8, 128, 17
    arena, k_cache, v_cache = make_pool(num_blocks, tpb, num_kv, head_dim, FP8)
    k = torch.empty(num_rows, num_kv, head_dim, device=DEVICE, dtype=torch.bfloat16)
    v = torch.empty_like(k)
    slots = torch.full((num_rows,), PAD_SLOT, dtype=torch.int32, device=DEVICE)
    k_scale = torch.tensor(0.5, device=DEVICE)
    kernels.store_kv(k, v, k_cache, v_cache, slots, k_scale=k_scale, v_scale=2.0)  # compile first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernels.store_kv(k, v, k_cache, v_cache, slots, k_scale=k_scale, v_scale=2.0)
    for accepted in (3, num_rows, 0):
        arena.fill_(float("nan"))
        expected = arena.clone()
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
        chosen = torch.randperm(num_blocks * tpb, generator=gen)[:num_rows].int()
        chosen[accepted:] = PAD_SLOT
        slots.copy_(chosen)
        graph.replay()
        for i, slot in enumerate(chosen.tolist()[:accepted]):
            expected[slot // tpb, 1, 0, slot % tpb] = to_cache(k[i], FP8, 0.5)
            expected[slot // tpb, 1, 1, slot % tpb] = to_cache(v[i], FP8, 2.0)
        assert torch.equal(bits(arena), bits(expected))
