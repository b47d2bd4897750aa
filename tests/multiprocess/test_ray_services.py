"""The three services as Ray actors (`LLM(services="ray")`): equal to the in-process engine, in three
processes mapping one pool, and surviving the death of each.

One local Ray (loopback) for the module; every test starts its own trio under its own replica index
(actor names are per replica) and kills it at the end. References come from the in-process engine
over the same checkpoints, in this process.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from engine_helpers import random_prompts

from target_service.engine.sampling_params import SamplingParams
from target_service.llm import LLM

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray"), pytest.mark.usefixtures("ray_machine")]
VOCAB = 160
SETTINGS = dict(device="cpu", dtype="float32", kv_cache_memory="2MiB", tokens_per_block=16, max_num_seqs=6,
                max_model_len=256)
WAIT_S = 120


_replicas = iter(range(100))


def start_trio(target, drafter, **settings):
    from target_service.assembly.engine_args import EngineArgs
    from target_service.assembly.ray_services import RayServices

    args = EngineArgs(target=str(target), drafter=None if drafter is None else str(drafter), **settings)
    return RayServices(args, replica=next(_replicas)).start()


def reference(target, drafter, prompts, params, **settings) -> list[list[int]]:
    return reference_with_stats(target, drafter, prompts, params, **settings)[0]


def reference_with_stats(target, drafter, prompts, params, **settings):
    """The in-process engine's outputs and its speculative counters, over the same checkpoints."""
    llm = LLM(None if target is None else str(target), None if drafter is None else str(drafter), **settings)
    try:
        return [out.outputs[0].token_ids for out in llm.generate(prompts, params)], llm.stats.copy()
    finally:
        llm.close()


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def wait_for(condition, what: str, timeout: float = WAIT_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def assert_pool_drains(services) -> None:
    """Every page is free once the pool has the target's closes: they are sent behind the step (a
    result can reach the caller before its close reaches the pool), so the pool is polled briefly."""
    wait_for(lambda: services.pool_stats().num_used_blocks == 0, "the pool to receive every close", 10)
    assert services.pool_stats().num_seqs == 0


@pytest.mark.parametrize("storage,k,cache", [("paged", 7, "auto"), ("dense", 1, "auto"), ("paged", 3, "fp8")])
def test_ray_services_equal_the_in_process_engine_token_for_token(ray_local, storage, k, cache):
    """The demo pair (a trained drafter, so drafts are accepted): outputs AND the speculative counters
    must equal the in-process engine's, so the drafter actor read the same context the in-process
    drafter would have (greedy outputs alone are lossless whatever the drafts). With an fp8 target
    cache the target actor maps fp8 pages the pool actor sized."""
    from target_service.assembly.demo import resolve_pair

    target, drafter = resolve_pair(None, None)
    settings = dict(SETTINGS, context_storage=storage, num_speculative_tokens=k, kv_cache_memory="16MiB",
                    max_model_len=512, kv_cache_dtype=cache)
    text = ["def parse_args(argv):\n    parser = ", "class Stack:\n    def __init__(self):",
            "import os\nimport sys\n\n\ndef main():", "for i in range(10):", "# Read the file\nwith open("]
    shared = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:"
    batches = [text[:1], text, [shared], [shared + "\n        return n"]]  # the last: a prefix hit
    llm = LLM(target, drafter, services="ray", **settings)
    try:
        assert llm.engine is None and llm.services == "ray"
        for prompts in batches:
            outputs = llm.generate(prompts, greedy(32))
            expected, expected_stats = reference_with_stats(target, drafter, prompts, greedy(32), **settings)
            assert [out.outputs[0].token_ids for out in outputs] == expected
            assert [sum(out.spec_decode.num_accepted_tokens for out in outputs)] == [
                expected_stats.num_accepted_tokens]
        stats = llm.stats
        assert 2 * stats.num_accepted_tokens > stats.num_drafts  # a trained drafter: its drafts are accepted
        assert_pool_drains(llm.assembly)
        usage = llm.assembly.pool_stats()
        assert usage.num_used_blocks == 0 and usage.num_seqs == 0
        if storage == "paged":
            assert usage.prefix_cache_hits > 0
        lease = llm.assembly.describe()["lease"]
        assert lease["reserves_answered_locally"] > 0  # leasing kept steps off the control plane
    finally:
        llm.close()


def test_preemption_under_a_small_pool_stays_equal(ray_local, pair):
    target, drafter = pair
    settings = dict(SETTINGS, kv_cache_memory="400KiB", num_speculative_tokens=7)
    prompts = random_prompts(6, VOCAB, low=30, high=60)
    expected = reference(target, drafter, prompts, greedy(40), **settings)
    services = start_trio(target, drafter, **settings)
    try:
        results = services.generate(prompts, [greedy(40)] * len(prompts))
        assert [r.token_ids for r in results] == expected
        assert services.describe()["preemptions"] > 0
        assert_pool_drains(services)
    finally:
        services.close()


def test_logprobs_cross_the_ray_trio_as_the_in_process_engine_computes_them(ray_local, pair):
    """Whole results and streamed deltas (RemoteEngine, as a served replica reads them) carry the same
    logprobs, the prompt's included, as the in-process engine over the same checkpoints."""
    import asyncio

    from target_service.assembly.remote_engine import RemoteEngine

    target, drafter = pair
    prompts = random_prompts(2, VOCAB, low=5, high=30)
    params = [greedy(12).model_copy(update=dict(logprobs=3, prompt_logprobs=2))] * len(prompts)
    llm = LLM(str(target), str(drafter), **SETTINGS)
    expected = llm.generate(prompts, params)
    llm.close()
    services = start_trio(target, drafter, **SETTINGS)

    async def streamed(engine, prompt):
        deltas = [delta async for delta in engine.generate(prompt, params[0])]
        return [entry for delta in deltas for entry in delta.logprobs], deltas[0].prompt_logprobs

    try:
        results = services.generate(prompts, params)
        remote = RemoteEngine(services, max_num_seqs=SETTINGS["max_num_seqs"])
        deltas = asyncio.run(streamed(remote, prompts[0]))
    finally:
        services.close()
    for result, out in zip(results, expected):
        assert result.token_ids == out.outputs[0].token_ids
        for got, want in zip(result.logprobs + result.prompt_logprobs[1:],
                             out.outputs[0].logprobs + out.prompt_logprobs[1:]):
            assert got.token_id == want.token_id and got.top_token_ids == want.top_token_ids
            assert got.logprob == pytest.approx(want.logprob, abs=1e-5)
    assert [entry.token_id for entry in deltas[0]] == expected[0].outputs[0].token_ids
    assert len(deltas[1]) == len(prompts[0]) and deltas[1][0] is None


def test_three_processes_map_one_pool(ray_local, pair):
    target, drafter = pair
    services = start_trio(target, drafter, **SETTINGS)
    try:
        pids = services.pids()
        assert len({*pids.values(), os.getpid()}) == 4, pids
        shm_path = services.pool_info().handle.shm_path
        assert shm_path and Path(shm_path).exists()
        for name, pid in pids.items():  # the pool's /dev/shm file is mapped in each of the three
            maps = Path(f"/proc/{pid}/maps").read_text()
            assert shm_path in maps, f"{name} (pid {pid}) does not map {shm_path}"
    finally:
        services.close()


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def _running(services) -> bool:
    return services.describe()["running"] > 0


def kill_mid_generation(services, prompts, max_tokens: int, which: str) -> list:
    """Submit `prompts`, wait until they run, SIGKILL the `which` service; returns the requests' refs."""
    refs = [services.submit(p, greedy(max_tokens)) for p in prompts]
    wait_for(lambda: _running(services), "requests to run")
    _kill(services.pids()[which])
    return refs


@contextlib.contextmanager
def k7_trio_and_reference(pair, num_prompts: int, max_tokens: int):
    """A K 7 trio, `num_prompts` random prompts and the in-process engine's greedy outputs for them."""
    target, drafter = pair
    settings = dict(SETTINGS, num_speculative_tokens=7)
    prompts = random_prompts(num_prompts, VOCAB)
    expected = reference(target, drafter, prompts, greedy(max_tokens), **settings)
    services = start_trio(target, drafter, **settings)
    try:
        yield services, prompts, expected
    finally:
        services.close()


def test_drafter_death_keeps_requests_lossless_and_speculation_resumes(ray_local, pair):
    with k7_trio_and_reference(pair, 4, 120) as (services, prompts, expected):
        refs = kill_mid_generation(services, prompts, 120, "drafter")
        results = services._get(refs, timeout=WAIT_S)
        assert [r.token_ids for r in results] == expected
        state = services.describe()
        assert state["drafter_failures"] >= 1
        before = services.stats().num_drafts
        more = random_prompts(2, VOCAB)
        wait_for(lambda: services.generate(more, [greedy(16)] * 2) and services.stats().num_drafts > before,
                 "speculation to resume")
        assert services.describe()["drafter_reattached"] >= 1
        assert_pool_drains(services)


def test_pool_death_recomputes_into_the_restarted_pool(ray_local, pair):
    with k7_trio_and_reference(pair, 4, 120) as (services, prompts, expected):
        epoch = services.pool_info().epoch
        refs = kill_mid_generation(services, prompts, 120, "kvpool")
        results = services._get(refs, timeout=WAIT_S)
        assert [r.token_ids for r in results] == expected
        state = services.describe()
        assert state["pool_recoveries"] >= 1 and state["pool_epoch"] != epoch
        assert services.pool_info().epoch == state["pool_epoch"]
        assert_pool_drains(services)


def test_target_death_fails_its_requests_clearly_and_the_restart_serves(ray_local, pair):
    from target_service.assembly.ray_services import ServiceFailed

    with k7_trio_and_reference(pair, 3, 16) as (services, prompts, expected):
        refs = kill_mid_generation(services, random_prompts(4, VOCAB), 200, "target")
        with pytest.raises(ServiceFailed, match=r"target service of replica \d+ died"):
            services._get(refs, timeout=WAIT_S)
        results = services.generate(prompts, [greedy(16)] * len(prompts))  # the restarted target
        assert [r.token_ids for r in results] == expected
        assert_pool_drains(services)  # the dead target's sequences were released


def test_cancelled_requests_leave_no_page_in_use(ray_local, pair):
    import ray

    target, drafter = pair
    services = start_trio(target, drafter, **SETTINGS)
    try:
        refs = [services.submit(p, greedy(150)) for p in random_prompts(12, VOCAB)]
        wait_for(lambda: _running(services), "requests to run")
        cancelled = refs[::2]
        for ref in cancelled:
            ray.cancel(ref)
        for ref in refs[1::2]:
            assert len(services._get(ref, timeout=WAIT_S).token_ids) == 150
        wait_for(lambda: services.describe()["running"] == 0, "the engine to go idle")
        assert_pool_drains(services)
    finally:
        services.close()


def test_admin_stats_and_health_answer_on_the_pool_actors_port(ray_local, pair, capsys):
    from dflash_cli.main import main

    target, _ = pair
    services = start_trio(target, None, **SETTINGS)
    try:
        services.generate([random_prompts(1, VOCAB)[0]], [greedy(4)])
        assert_pool_drains(services)
        address = services.pool_info().address
        assert main(["admin", "stats", "--address", address, "--json"]) == 0
        stats = json.loads(capsys.readouterr().out)
        usage = services.pool_stats()
        assert stats["epoch"] == services.pool_info().epoch
        assert sum(g["num_blocks"] for g in stats["groups"]) >= usage.num_blocks
        assert stats["num_seqs"] == usage.num_seqs == 0
        assert main(["admin", "health", "--address", address]) == 0
        assert "SERVING" in capsys.readouterr().out
    finally:
        services.close()


def test_ray_services_refuse_bad_input_with_one_line_errors(ray_local, pair, tmp_path):
    target, drafter = pair
    with pytest.raises(ValueError, match="services must be 'inprocess' or 'ray'"):
        LLM(str(target), str(drafter), services="grpc", **SETTINGS)

    from target_service.assembly.engine_args import EngineArgs
    from target_service.assembly.ray_services import RayServices, ServiceStartError

    with pytest.raises(ValueError, match=r"holds 0 blocks.*give more kv_cache_memory"):
        start_trio(target, drafter, **dict(SETTINGS, kv_cache_memory="4KiB"))
    bad = tmp_path / "not-a-drafter"
    bad.mkdir()
    args = EngineArgs(target=str(target), drafter=str(bad), **SETTINGS)
    gpu_args = EngineArgs(target=str(target), drafter=str(drafter), **dict(SETTINGS, device="cuda"))
    with pytest.raises(ServiceStartError, match=r"no node had room for the services .* 'GPU': 0.33"):
        RayServices(gpu_args, replica=next(_replicas)).start(timeout_s=2)  # this Ray has no GPU
    with pytest.raises(ValueError, match=r"not-a-drafter/config\.json: no such config file"):
        RayServices(args, replica=next(_replicas)).start()  # refused by the plan: no actor starts
    services = start_trio(target, drafter, **SETTINGS)
    try:
        with pytest.raises(ValueError, match="outside the vocabulary"):
            services.generate([[VOCAB + 5]], [greedy(4)])
        assert services.describe()["running"] == 0  # nothing was admitted
        prompt = torch.randint(3, VOCAB, (20,)).tolist()
        assert len(services.generate([prompt], [greedy(5)])[0].token_ids) == 5
    finally:
        services.close()
