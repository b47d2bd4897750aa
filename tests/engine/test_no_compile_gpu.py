"""No Triton kernel compiles after the engine is ready (issue 31): a compile inside the step loop
stalls every stream of a replica for seconds. A randomised workload (prompts of every length,
repeats and shared prefixes, arrivals during decode, aborts, greedy and sampled) runs after start-up
while `kernels.compile_watch` records every specialisation built; the failure names each kernel and
the argument class that made it new."""

import random

import pytest
import torch
from engine_helpers import make_pair

from dflash_cli.bench.varied_workload import drive, varied_requests
from kernels.compile_watch import WATCH
from target_service.llm import LLM

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("with_drafter", [False, True])
def test_a_varied_workload_compiles_nothing_after_start_up(tmp_path, with_drafter, cache_dtype):
    target, drafter = make_pair(tmp_path)
    WATCH.install().mark_starting()
    llm = LLM(target, drafter if with_drafter else "none", device="cuda", dtype="bfloat16",
              kv_cache_dtype=cache_dtype, max_num_seqs=8, kv_cache_memory="64MiB", tokens_per_block=16,
              max_model_len=512, max_num_batched_tokens=256)
    try:
        WATCH.mark_ready()
        before = len(WATCH.compilations)  # the watch is the process's: earlier tests' builds are in it
        seed = int(torch.randint(0, 2**31, ()).item())
        rng = random.Random(seed)
        requests = varied_requests(rng, 40, vocab_size=llm.engine.vocab_size, max_prompt=420, max_tokens=48)
        result = drive(llm.engine, requests, rng)
        built = WATCH.compilations[before:]
        assert not built, f"seed {seed}: compiled after ready:\n" + "\n".join(map(WATCH.explain, built))
        assert result.finished + result.aborted == len(requests)
        assert llm.engine.pool_usage().num_used_blocks == 0
    finally:
        WATCH.mark_starting()
        llm.close()
