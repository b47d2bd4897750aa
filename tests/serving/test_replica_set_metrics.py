"""One scrape answers for every replica, within its bound: the peers' families merged with this
replica's, a replica that failed left out, a broadcast that hangs (or an engine that does) costing at
most its bound and leaving what this replica knows. Serve's handle is faked by its public shape
(`broadcast(method).results_async(timeout_s=, return_exceptions=)`); test_serve.py runs the real one."""

import asyncio
import time

from prometheus_client.parser import text_string_to_metric_families

from kvpool_service.control import PoolUsage
from target_service.engine.engine_client import EngineSnapshot
from target_service.engine.outputs import SpecDecodeStats
from target_service.engine.step_record import EngineCounters
from target_service.serving.metrics import ServerMetrics
from target_service.serving.replica_set_metrics import METHOD, ReplicaSetMetrics


class Engine:
    """An engine's snapshot: `drafts` speculative steps; `stall_s` before it answers."""

    def __init__(self, drafts: int, stall_s: float = 0.0):
        self.drafts, self.stall_s = drafts, stall_s

    def snapshot(self) -> EngineSnapshot:
        time.sleep(self.stall_s)
        pool = PoolUsage(num_blocks=10, num_free_blocks=6, num_cached_blocks=1, num_used_blocks=3, num_seqs=1,
                         prefix_cache_queries=40, prefix_cache_hits=16)
        return EngineSnapshot(SpecDecodeStats(self.drafts, 3 * self.drafts, self.drafts), 1, 0, pool)

    @staticmethod
    def counters() -> EngineCounters:
        return EngineCounters(5, 2, 0, 1, 0, {7: 2, 40: 3})


def replica(rank: int, drafts: int, stall_s: float = 0.0) -> ServerMetrics:
    engine = Engine(drafts, stall_s)
    return ServerMetrics(engine, engine.counters, model_name="demo", replica=str(rank), max_model_len=64)


class Handle:
    """Serve's handle, as the scrape uses it: every replica's answer, or Serve's TimeoutError."""

    def __init__(self, answers, delay_s: float = 0.0):
        self.answers, self.delay_s, self.calls = answers, delay_s, []

    def broadcast(self, method):
        self.calls.append(method)
        return self

    async def results_async(self, *, timeout_s, return_exceptions):
        assert return_exceptions
        if self.delay_s > timeout_s:
            await asyncio.sleep(timeout_s)
            raise TimeoutError("Timed out waiting for broadcast results.")
        return [await answer if asyncio.iscoroutine(answer) else answer for answer in self.answers]


def drafts_by_replica(text: bytes) -> dict[str, float]:
    return {s.labels["replica"]: s.value for family in text_string_to_metric_families(text.decode())
            for s in family.samples if s.name == "vllm:spec_decode_num_drafts_total"}


def test_the_answer_holds_every_replica_that_answered_and_leaves_out_the_one_that_failed():
    local, peer = replica(0, drafts=4), replica(1, drafts=9)
    handle = Handle([local.families_within(), peer.families_within(), RuntimeError("replica 2 died")])
    text = asyncio.run(ReplicaSetMetrics(local, lambda: handle).exposition())
    assert handle.calls == [METHOD]
    assert drafts_by_replica(text) == {"0": 4, "1": 9}  # a PromQL sum over replica: 13


def test_a_broadcast_past_its_bound_answers_in_time_with_this_replicas_series():
    local = replica(0, drafts=4)
    metrics = ReplicaSetMetrics(local, lambda: Handle([], delay_s=60), timeout_s=0.3)
    started = time.monotonic()
    text = asyncio.run(metrics.exposition())
    assert time.monotonic() - started < 0.3 + 2.0
    assert drafts_by_replica(text) == {"0": 4}


def test_an_engine_that_does_not_answer_leaves_the_request_series_within_the_bound():
    stuck = replica(0, drafts=4, stall_s=1.5)

    async def scrape():  # timed inside the loop: closing it waits for the stuck thread
        started = time.monotonic()
        return await stuck.families_within(timeout_s=0.2), time.monotonic() - started

    families, took_s = asyncio.run(scrape())
    assert took_s < 1.0
    names = {family.name for family in families}
    assert "vllm:request_success" in names and "vllm:spec_decode_num_drafts" not in names


def test_the_engine_series_read_the_snapshot_and_the_counters_as_vllm_means_them():
    text = asyncio.run(replica(0, drafts=4).exposition()).decode()
    table = {(s.name, s.labels.get("le")): s.value for family in text_string_to_metric_families(text)
             for s in family.samples}
    assert table[("vllm:kv_cache_usage_perc", None)] == 0.3  # 3 blocks held of 10 (cached ones are free)
    assert table[("vllm:prefix_cache_queries_total", None)] == 40
    assert table[("vllm:prefix_cache_hits_total", None)] == 16
    assert table[("vllm:num_preemptions_total", None)] == 1
    # two steps of 7 tokens and three of 40: buckets 1, 8, 16, 32, 64, ...
    bounds = ("1.0", "8.0", "32.0", "64.0", "+Inf")
    assert [table[("vllm:iteration_tokens_total_bucket", le)] for le in bounds] == [0, 2, 2, 5, 5]
    assert table[("vllm:iteration_tokens_total_sum", None)] == 2 * 7 + 3 * 40
