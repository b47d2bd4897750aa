"""paged_context_attention against a float64 computation written here (and the torch reference).

On CPU the Triton kernel runs under the interpreter (tests/conftest.py); the same tests run
compiled on a GPU, where the `gpu` tests add bf16 / fp8 at realistic sizes and CUDA graphs.
"""

import pytest
import torch

import kernels
from kernels import context_attention as ca
from kernels import context_attention_kernel, operands

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn
# relative Frobenius error allowed, by the dtype of q (fp32 is computed in fp32 end to end)
REL_TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def make_case(lens, num_q, group, num_kv_heads, head_dim, tpb, dtype, cache_dtype=None, *, seed,
              k_scale=None, v_scale=None, device=DEVICE):
    """Random q / noise and a NaN-poisoned pool holding each request's context in shuffled pages."""
    gen = torch.Generator().manual_seed(seed)
    cache_dtype = cache_dtype or dtype
    batch = len(lens)
    pages = [-(-n // tpb) for n in lens]
    max_blocks = max([*pages, 1]) + 1
    num_blocks = sum(pages) + 3
    ids = torch.randperm(num_blocks, generator=gen)
    # unused table entries point far outside the pool: reading one would fault or raise
    block_table = torch.full((batch, max_blocks), 10**6, dtype=torch.int32)
    k_cache = torch.full((num_blocks, tpb, num_kv_heads, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    used = 0
    for b, n in enumerate(lens):
        block_table[b, : pages[b]] = ids[used : used + pages[b]].int()
        used += pages[b]
        for pos in range(n):
            blk, off = block_table[b, pos // tpb], pos % tpb
            k_cache[blk, off] = torch.randn(num_kv_heads, head_dim, generator=gen) * 2
            v_cache[blk, off] = torch.randn(num_kv_heads, head_dim, generator=gen)
    if cache_dtype == FP8:  # stored = value / scale, as store_kv writes it
        k_cache = (k_cache / (k_scale or 1.0)).clamp(-448, 448).to(FP8)
        v_cache = (v_cache / float(v_scale or 1.0)).clamp(-448, 448).to(FP8)
    else:
        k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    q = torch.randn(batch, num_q, num_kv_heads * group, head_dim, generator=gen).to(dtype)
    k_noise = (torch.randn(batch, num_q, num_kv_heads, head_dim, generator=gen) * 2).to(dtype)
    v_noise = torch.randn(batch, num_q, num_kv_heads, head_dim, generator=gen).to(dtype)
    ctx_lens = torch.tensor(lens, dtype=torch.int32)
    case = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_table": block_table,
            "ctx_lens": ctx_lens, "k_noise": k_noise, "v_noise": v_noise}
    return {name: t.to(device) for name, t in case.items()}


def oracle(case, scale=None, k_scale=None, v_scale=None):
    """float64: gather each position p from (block_table[b, p // tpb], p % tpb), concat noise, softmax."""
    q = case["q"].cpu().double()
    batch, num_q, num_heads, head_dim = q.shape
    k_cache, v_cache = case["k_cache"].cpu().double(), case["v_cache"].cpu().double()
    tpb, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    out = torch.empty(batch, num_q, num_heads, head_dim, dtype=torch.float64)
    for b, n in enumerate(case["ctx_lens"].tolist()):
        table = case["block_table"][b].cpu().long()
        pos = torch.arange(n)
        keys = k_cache[table[pos // tpb], pos % tpb] * float(k_scale or 1.0)  # [n, NKV, D]
        values = v_cache[table[pos // tpb], pos % tpb] * float(v_scale or 1.0)
        keys = torch.cat([keys, case["k_noise"][b].cpu().double()])
        values = torch.cat([values, case["v_noise"][b].cpu().double()])
        for h in range(num_heads):
            scores = q[b, :, h] @ keys[:, h // group].T * scale  # [Q, n + Q]
            out[b, :, h] = scores.softmax(dim=-1) @ values[:, h // group]
    return out


def run_kernel(case, **kwargs):
    out = torch.full_like(case["q"], float("nan"))  # poisoned: every element must be written
    got = kernels.paged_context_attention(**case, out=out, backend="triton", **kwargs)
    assert got is out
    return out


def assert_matches(got, want, dtype):
    got = got.cpu().double()
    assert not got.isnan().any(), "unwritten or NaN output"
    rel = (got - want).norm() / want.norm()
    assert rel < REL_TOL[dtype], f"relative error {rel:.2e} over {REL_TOL[dtype]:.0e}"


@pytest.mark.parametrize(
    ("num_q", "group", "head_dim", "tpb", "dtype"),
    [
        (1, 4, 64, 16, torch.float32),
        (6, 4, 64, 32, torch.float16),
        (5, 5, 64, 16, torch.float32),
        (16, 4, 128, 32, torch.float16),
    ],
)
def test_matches_float64_over_odd_lengths(num_q, group, head_dim, tpb, dtype):
    # empty context, one token, mid-page ends, one page exactly, very different lengths
    lens = [0, 1, tpb + 5, tpb, 7 * tpb - 3]
    case = make_case(lens, num_q, group, 2, head_dim, tpb, dtype, seed=num_q * 100 + group)
    want = oracle(case)
    assert_matches(run_kernel(case), want, dtype)
    assert_matches(kernels.reference.paged_context_attention(**case), want, dtype)


@pytest.mark.parametrize("num_splits", [2, 3, 8])
def test_forced_splits_with_empty_splits(num_splits):
    # 8 splits over 0..3 tiles: most splits are empty, and ctx 0 has only the noise suffix
    case = make_case([0, 20, 45, 100], 2, 4, 2, 32, 16, torch.float32, seed=40 + num_splits)
    assert_matches(run_kernel(case, num_splits=num_splits), oracle(case), torch.float32)


def test_default_plan_splits_a_long_context():
    # one request x 2 KV heads is under the SM count: the default plan splits it on the device;
    # 20 rows pad to 32: two merge tiles of 16 rows
    case = make_case([700], 5, 4, 2, 32, 32, torch.float32, seed=7)
    num_items = 1 * 2
    assert kernels.split_kv.plan_max_splits(num_items, case["q"].device) > 1
    assert_matches(run_kernel(case), oracle(case), torch.float32)


def test_one_split_requests_finish_in_split_zero():
    # contexts under two splits' worth of keys take one split: split 0 writes the output itself, next
    # to a request that splits; the merge kernel must leave those outputs alone
    case = make_case([3, 700, 0], 3, 4, 1, 32, 16, torch.float32, seed=8)
    max_splits = kernels.split_kv.plan_max_splits(3, case["q"].device)
    min_tokens = kernels.split_kv.min_tokens_per_split(16)
    assert max_splits > 1 and 700 // min_tokens > 1
    assert_matches(run_kernel(case), oracle(case), torch.float32)


def test_fp8_context_with_scales():
    k_scale, v_scale = 0.37, torch.tensor(1.9, device=DEVICE)  # a float and a 0-d tensor
    case = make_case([0, 33, 70], 6, 4, 2, 64, 16, torch.float32, FP8, seed=3, k_scale=k_scale,
                     v_scale=v_scale)
    want = oracle(case, k_scale=k_scale, v_scale=v_scale)
    for num_splits in (1, 4):
        got = run_kernel(case, k_scale=k_scale, v_scale=v_scale, num_splits=num_splits)
        assert_matches(got, want, torch.float32)
    # the scales matter: without them the answer is different
    unscaled = run_kernel(case, num_splits=1).cpu().double()
    assert (unscaled - want).norm() / want.norm() > 0.05


def test_custom_scale():
    case = make_case([19], 3, 2, 2, 32, 16, torch.float32, seed=8)
    assert_matches(run_kernel(case, scale=0.05), oracle(case, scale=0.05), torch.float32)


def test_store_then_attend_round_trip():
    gen = torch.Generator().manual_seed(21)
    lens, num_kv, head_dim, tpb, group, num_q = [9, 40], 2, 32, 16, 2, 3
    empty = make_case([0, 0], num_q, group, num_kv, head_dim, tpb, torch.float32, seed=22)
    num_blocks = 8
    k_cache = torch.full((num_blocks, tpb, num_kv, head_dim), float("nan"), device=DEVICE)
    v_cache = torch.full_like(k_cache, float("nan"))
    ids = torch.randperm(num_blocks, generator=gen).int()
    block_table = torch.stack([ids[:4], ids[4:]]).to(DEVICE)
    for b, n in enumerate(lens):
        pos = torch.arange(n, device=DEVICE)
        slots = block_table[b, pos // tpb].long() * tpb + pos % tpb
        rows_k = torch.randn(n, num_kv, head_dim, generator=gen).to(DEVICE)
        rows_v = torch.randn(n, num_kv, head_dim, generator=gen).to(DEVICE)
        kernels.store_kv(rows_k, rows_v, k_cache, v_cache, slots.int(), backend="triton")
    case = {**empty, "k_cache": k_cache, "v_cache": v_cache, "block_table": block_table,
            "ctx_lens": torch.tensor(lens, dtype=torch.int32, device=DEVICE)}
    assert_matches(run_kernel(case), oracle(case), torch.float32)


def test_cpu_auto_runs_the_reference():
    case = make_case([5, 30], 2, 2, 1, 16, 16, torch.float32, seed=9, device="cpu")
    got = kernels.paged_context_attention(**case)  # auto on CPU tensors: the torch path
    assert_matches(got, oracle(case), torch.float32)


def _bad_inputs():
    def case(**overrides):
        base = make_case([3, 17], 2, 2, 2, 16, 16, torch.float32, seed=1)
        base.update(overrides)
        return base
    good = case()
    meta = {name: t.to("meta") for name, t in good.items()}
    yield "head dim D", case(q=good["q"][..., :8], k_cache=good["k_cache"][..., :8],
                             v_cache=good["v_cache"][..., :8], k_noise=good["k_noise"][..., :8],
                             v_noise=good["v_noise"][..., :8])
    yield "tokens_per_block", case(k_cache=good["k_cache"][:, :12], v_cache=good["v_cache"][:, :12])
    yield "multiple of KV heads", case(q=torch.randn(2, 2, 3, 16, device=DEVICE))
    yield "block_table must be int32", case(block_table=good["block_table"].long())
    yield "ctx_lens must be", case(ctx_lens=good["ctx_lens"][:1])
    yield "k_noise must be", case(k_noise=good["k_noise"][:, :1])
    yield "v_noise must be", case(v_noise=good["v_noise"].half())
    yield "q must be", case(q=good["q"][0])
    yield "cache dtype", case(k_cache=good["k_cache"].half(), v_cache=good["v_cache"].half())
    yield "differ in dtype", case(v_cache=good["v_cache"].half())
    yield "is on meta", case(ctx_lens=meta["ctx_lens"])


@pytest.mark.parametrize(("match", "case"), list(_bad_inputs()),
                         ids=lambda v: v if isinstance(v, str) else "")
def test_rejects_bad_input(match, case):
    with pytest.raises(ValueError, match=match):
        kernels.paged_context_attention(**case, backend="triton")
    with pytest.raises(ValueError, match=match):  # the torch path checks the same way
        kernels.paged_context_attention(**case, backend="torch")


def test_rejects_bad_options():
    case = make_case([3], 1, 2, 1, 16, 16, torch.float32, seed=2)
    for kwargs, match in [({"num_splits": 0}, "num_splits"), ({"k_scale": "2"}, "k_scale"),
                          ({"scale": -1.0}, "scale"), ({"backend": "cuda"}, "backend"),
                          ({"out": torch.empty(1, device=DEVICE)}, "out must be")]:
        with pytest.raises(ValueError, match=match):
            kernels.paged_context_attention(**case, **kwargs)


# ---- compiled on a GPU: bf16 / fp8 at realistic sizes, graphs, no recompiles ----


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8])
@pytest.mark.parametrize("num_splits", [None, 1, 16])
def test_gpu_realistic_bf16(cache_dtype, num_splits):
    scales = {"k_scale": 0.8, "v_scale": torch.tensor(1.3, device="cuda")} if cache_dtype == FP8 else {}
    lens = [0, 1000, 4133, 64]
    case = make_case(lens, 16, 4, 4, 128, 32, torch.bfloat16, cache_dtype, seed=77, **scales)
    got = run_kernel(case, num_splits=num_splits, **scales)
    assert_matches(got, oracle(case, **scales), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("q_scale", [1.0, 2e5])
def test_gpu_fp8_context_with_queries_beyond_fp16_range(q_scale):
    # fp8 context tiles run fp16 MMAs: q (bf16) is shifted into fp16's range; the noise keeps bf16
    case = make_case([900, 37], 16, 4, 4, 128, 32, torch.bfloat16, FP8, seed=11, k_scale=0.5, v_scale=2.0)
    case["q"] = (case["q"].float() * (q_scale / case["q"].float().abs().amax())).bfloat16()
    scale = 1e-5 if q_scale > 1 else None
    got = run_kernel(case, scale=scale, k_scale=0.5, v_scale=2.0)
    assert_matches(got, oracle(case, scale=scale, k_scale=0.5, v_scale=2.0), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize(("q_scale", "num_splits"), [(1.0, None), (1.0, 1), (2e5, 8)])
def test_gpu_e4m3_context_scores_keep_the_accuracy_of_fp16_scores(q_scale, num_splits, monkeypatch):
    # 64-row tiles over an fp8 context scored in e4m3, q in two e4m3 terms: as close to float64 as
    # the fp16 scores (q alone in e4m3 would be ~10x off); the noise keys stay in q's dtype; the
    # fp16 scores are those a GPU other than Hopper takes, here on this one
    case = make_case([900, 2100, 37], 16, 4, 4, 128, 32, torch.bfloat16, FP8, seed=23, k_scale=0.5,
                     v_scale=2.0)
    case["q"] = (case["q"].float() * q_scale).bfloat16()
    kwargs = dict(scale=128**-0.5 / q_scale, k_scale=0.5, v_scale=2.0)
    want = oracle(case, **kwargs)
    errors = {}
    for hopper in (True, False):
        monkeypatch.setattr(operands, "_is_hopper", lambda index, hopper=hopper: hopper)
        assert operands.quantizes_q(FP8, case["q"].device, 64, 128) == hopper
        got = run_kernel(case, num_splits=num_splits, **kwargs).cpu().double()
        assert not got.isnan().any()
        errors[hopper] = ((got - want).norm() / want.norm()).item()
    assert errors[True] < 5e-3 and errors[True] < 1.5 * errors[False] + 1e-3, errors


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [16, 32])
def test_gpu_fp8_context_at_small_head_dims(head_dim):
    # 64-row tiles: D 16 keeps the fp16 score dot (the e4m3 MMA steps over 32), D 32 takes the e4m3 one
    case = make_case([700, 33], 16, 4, 2, head_dim, 16, torch.bfloat16, FP8, seed=3, k_scale=0.7, v_scale=1.5)
    got = run_kernel(case, k_scale=0.7, v_scale=1.5)
    assert_matches(got, oracle(case, k_scale=0.7, v_scale=1.5), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8])
def test_gpu_head_dim_256_takes_tiles_that_fit_shared_memory(cache_dtype):
    # the 5 stages a bf16 context takes at D <= 128 would not fit three D 256 buffers
    scales = {"k_scale": 0.8, "v_scale": 1.3} if cache_dtype == FP8 else {}
    for lens, num_splits in (([700, 33], 1), ([5000], None)):  # the single pass; a split request
        case = make_case(lens, 16, 4, 2, 256, 16, torch.bfloat16, cache_dtype, seed=len(lens), **scales)
        got = run_kernel(case, num_splits=num_splits, **scales)
        assert_matches(got, oracle(case, **scales), torch.bfloat16)


@pytest.mark.gpu
def test_gpu_graph_replays_at_other_lengths():
    case = make_case([3000, 3000, 3000], 16, 4, 4, 128, 32, torch.bfloat16, seed=5)  # full tables
    ctx_lens = case["ctx_lens"]
    ctx_lens.copy_(torch.tensor([3000, 100, 0], dtype=torch.int32))  # the lengths at capture
    out = torch.empty_like(case["q"])
    kernels.paged_context_attention(**case, out=out)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernels.paged_context_attention(**case, out=out)
    for lens in ([2999, 1, 2500], [0, 3000, 31], [1500, 1500, 1500]):
        ctx_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        assert_matches(out, oracle(case), torch.bfloat16)


@pytest.mark.gpu
def test_gpu_batch_size_change_does_not_recompile():
    jitted = (context_attention_kernel._context_attention_kernel,
              context_attention_kernel._context_merge_kernel)
    counts = []
    for batch in (1, 2, 3, 5):
        case = make_case([200 + 37 * b for b in range(batch)], 16, 4, 4, 128, 32, torch.bfloat16, seed=batch)
        run_kernel(case, num_splits=4 + batch)
        counts.append(sum(len(c[0]) for kernel in jitted for c in kernel.device_caches.values()))
    assert counts[0] == counts[-1], counts



def test_gpu_launch_config_double_buffers_a_16_bit_context():
    # measured on an H200: 5 stages (two K/V buffers behind the page-id loads) for a bf16 context on
    # both paths; an fp8 context measured slower with them and keeps 3, as does a head dim above 128
    cuda = torch.device("cuda")
    bf16 = ca.default_config(64, torch.bfloat16, cuda)
    assert (bf16.block_n, bf16.num_warps, bf16.num_stages) == (64, 4, 5)
    assert ca.default_config(64, torch.float8_e4m3fn, cuda).num_stages == 3
    assert ca.default_config(64, torch.bfloat16, cuda, head_dim=256).num_stages == 3  # shared memory
    assert ca.default_config(128, torch.bfloat16, cuda).num_warps == 8  # 128 rows: 8 warps' registers
    assert ca.default_config(64, torch.bfloat16, torch.device("cpu")).num_stages == 1  # the interpreter
