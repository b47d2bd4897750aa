"""No Triton kernel compiles after start-up in any of the three Ray services (issue 31), and each
service's own count reaches `/metrics`.

Each service counts what its process built (`kernels.compile_watch`, installed in every actor): a
compile in the drafter's or the target's process stalls every stream of the replica as surely as one
in an in-process engine does, but only that process sees it. On a GPU a randomised workload (prompts
of every length, repeats and shared prefixes, concurrent streaming clients arriving during decodes,
clients that go away, greedy and sampled, both cache dtypes) runs through a fresh trio; the failure
names each kernel built and the argument class that made it new. On the CPU (the interpreter
compiles nothing) the same workload checks that the counts and the clients' outcomes are read back
from all three processes and exported under their service's name.
"""

from __future__ import annotations

import random

import pytest
import torch
from engine_helpers import make_pair
from test_ray_services import assert_pool_drains, start_trio

from dflash_cli.bench.varied_workload import drive_streams, varied_requests
from foundation.checkpoint_config import load_target_config

pytest.importorskip("ray", reason="the Ray services need Ray (on the H200: carry .devray)")
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray"), pytest.mark.usefixtures("ray_machine")]
SERVICES = {"kvpool", "drafter", "target"}
GPU = dict(device="cuda", dtype="bfloat16", kv_cache_memory="64MiB", tokens_per_block=16, max_num_seqs=8,
           max_model_len=512, max_num_batched_tokens=256)
CPU = dict(device="cpu", dtype="float32", kv_cache_memory="2MiB", tokens_per_block=16, max_num_seqs=6,
           max_model_len=256)


def run_varied(services, vocab_size: int, count: int, max_prompt: int, max_tokens: int):
    seed = int(torch.randint(0, 2**31, ()).item())
    rng = random.Random(seed)
    requests = varied_requests(rng, count, vocab_size=vocab_size, max_prompt=max_prompt,
                               max_tokens=max_tokens)
    outcome = drive_streams(services, requests, rng)
    assert not outcome.failed, f"seed {seed}: " + "; ".join(outcome.failed)
    assert outcome.finished + outcome.aborted == len(requests), seed
    return seed


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", ["auto", "fp8"])
def test_a_varied_workload_compiles_nothing_in_any_ray_service(ray_local, tmp_path, cache_dtype):
    target, drafter = make_pair(tmp_path)
    services = start_trio(target, drafter, kv_cache_dtype=cache_dtype, **GPU)
    try:
        at_ready = services.compilations()
        assert set(at_ready) == SERVICES
        assert at_ready["target"].startup > 0 and at_ready["drafter"].startup > 0  # the watch saw them
        seed = run_varied(services, load_target_config(target).vocab_size, 40, max_prompt=420, max_tokens=48)
        built = {name: counts.serving for name, counts in services.compilations().items() if counts.serving}
        assert not built, f"seed {seed}: compiled after ready:\n" + "\n".join(
            f"{name}: {why}" for name, whys in built.items() for why in whys)
        assert_pool_drains(services)
    finally:
        services.close()


def test_each_service_reports_its_own_count_and_the_metrics_name_it(ray_local, tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    from target_service.assembly.remote_engine import RemoteEngine
    from target_service.serving.metrics import ServerMetrics

    target, drafter = make_pair(tmp_path)
    services = start_trio(target, drafter, **CPU)
    try:
        pids = services.pids()
        run_varied(services, load_target_config(target).vocab_size, 12, max_prompt=120, max_tokens=16)
        counts = services.compilations()
        assert set(counts) == SERVICES and all(not c.serving for c in counts.values())
        remote = RemoteEngine(services, max_num_seqs=CPU["max_num_seqs"])
        metrics = ServerMetrics(remote, services.counters, model_name="demo",
                                max_model_len=CPU["max_model_len"])
        series = {(sample.labels["service"], sample.labels["phase"]): sample.value
                  for family in text_string_to_metric_families(metrics.render().decode())
                  for sample in family.samples if sample.name == "dflash:kernel_compilations_total"}
        assert series == {(name, phase): (counts[name].startup if phase == "startup" else 0)
                          for name in SERVICES for phase in ("startup", "serving")}
        assert_pool_drains(services)
        assert services.pids() == pids  # no client's abort cost a service its process
    finally:
        services.close()
