"""Prometheus metrics of one serving replica, named after vLLM's under the `dflash:` prefix.

Two kinds: what the HTTP layer observes per request (time to first token, time per output token,
end-to-end latency, finished requests by reason) lives in histograms and counters it updates; what
the engine knows (speculative-decoding counters, running and waiting requests, the pool's blocks) is
read at scrape time by a collector, so it is never stale and costs nothing between scrapes. Every
series carries `model_name` and `replica`. One registry per replica: replicas never share series.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kernels.compile_watch import WATCH

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                 0.2, 0.3, 0.4, 0.5, 1.0, 2.5)


class _EngineCollector:
    """Reads the engine's counters and the pool's usage when Prometheus scrapes."""

    def __init__(self, async_engine, labels: dict[str, str], groups: list[str]):
        self.async_engine, self.labels, self.groups = async_engine, labels, groups

    def _family(self, kind, name: str, documentation: str, extra: tuple[str, ...] = ()):
        return kind(name, documentation, labels=[*self.labels, *extra])

    def collect(self):
        values = list(self.labels.values())
        snapshot = self.async_engine.snapshot()
        stats = snapshot.stats
        for name, doc, value in (
            ("dflash:spec_decode_num_drafts", "Speculative steps that drafted", stats.num_drafts),
            ("dflash:spec_decode_num_draft_tokens", "Draft tokens proposed", stats.num_draft_tokens),
            ("dflash:spec_decode_num_accepted_tokens", "Draft tokens accepted",
             stats.num_accepted_tokens),
            ("dflash:engine_steps", "Engine steps", snapshot.num_steps),
            ("dflash:engine_steps_ahead", "Engine steps queued before the step before them was read (async "
             "scheduling)", snapshot.num_steps_ahead),
        ):
            family = self._family(CounterMetricFamily, name, doc)
            family.add_metric(values, value)
            yield family
        per_position = self._family(CounterMetricFamily, "dflash:spec_decode_num_accepted_tokens_per_pos",
                                    "Drafts whose first k+1 tokens were accepted, by position k",
                                    ("position",))
        for position, count in enumerate(list(stats.accepted_per_position)):
            per_position.add_metric([*values, str(position)], count)
        yield per_position
        for name, doc, value in (
            ("dflash:num_requests_running", "Requests prefilling or decoding", snapshot.num_running),
            ("dflash:num_requests_waiting", "Requests waiting to be admitted", snapshot.num_waiting),
        ):
            family = self._family(GaugeMetricFamily, name, doc)
            family.add_metric(values, value)
            yield family
        yield from self._pool(snapshot.pool, values)
        yield self._compilations(values)

    def _compilations(self, values):
        """Triton kernel specialisations built in this process, before and after the engine was
        ready: any after ready stalled every stream of the replica while it compiled (the aim: 0)."""
        family = self._family(CounterMetricFamily, "dflash:kernel_compilations",
                              "Triton kernels compiled (or loaded from the on-disk cache) in this process, "
                              "at start-up or while serving", ("phase",))
        built = WATCH.compilations
        serving = sum(1 for item in built if item.after_ready)
        family.add_metric([*values, "startup"], len(built) - serving)
        family.add_metric([*values, "serving"], serving)
        return family

    def _pool(self, usage, values):
        # block ids are position-aligned across the groups: the counts are the pool's, per group alike
        for name, doc, value in (
            ("dflash:kv_blocks_used", "Pool blocks held by live sequences", usage.num_used_blocks),
            ("dflash:kv_blocks_free", "Pool blocks free or evictable from the prefix cache",
             usage.num_free_blocks + usage.num_cached_blocks),
        ):
            family = self._family(GaugeMetricFamily, name, doc, ("group",))
            for group in self.groups:
                family.add_metric([*values, group], value)
            yield family
        family = self._family(GaugeMetricFamily, "dflash:prefix_cache_hit_rate",
                              "Prompt tokens restored from the prefix cache over tokens looked up")
        family.add_metric(values, usage.prefix_cache_hit_rate)
        yield family


class ServerMetrics:
    def __init__(self, async_engine, *, model_name: str, replica: str = "0", groups: list[str] = ("target",)):
        self.registry = CollectorRegistry()
        self.labels = {"model_name": model_name, "replica": replica}
        names = list(self.labels)
        self.ttft = Histogram("dflash:time_to_first_token_seconds", "Time to first token", names,
                              registry=self.registry, buckets=LATENCY_BUCKETS)
        self.tpot = Histogram("dflash:time_per_output_token_seconds", "Time per output token after the first",
                              names, registry=self.registry, buckets=TOKEN_BUCKETS)
        self.e2e = Histogram("dflash:e2e_request_latency_seconds", "End-to-end request latency", names,
                             registry=self.registry, buckets=LATENCY_BUCKETS)
        self.finished = Counter("dflash:request_success", "Finished requests by finish reason",
                                [*names, "finished_reason"], registry=self.registry)
        self.registry.register(_EngineCollector(async_engine, self.labels, list(groups)))

    def observe(self, *, first_token_s: float, total_s: float, num_output_tokens: int,
                finish_reason: str | None) -> None:
        """One finished request: latencies from its arrival, and its finish reason."""
        labels = self.labels.values()
        self.ttft.labels(*labels).observe(first_token_s)
        self.e2e.labels(*labels).observe(total_s)
        if num_output_tokens > 1:
            self.tpot.labels(*labels).observe((total_s - first_token_s) / (num_output_tokens - 1))
        self.finished.labels(*labels, finish_reason or "abort").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
