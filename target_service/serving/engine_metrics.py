"""What the engine and its pool know, as Prometheus series read when Prometheus scrapes.

vLLM's: running and waiting requests, KV-cache usage (blocks held by live sequences over the pool's
blocks, 0..1), the prefix cache's queried and hit tokens (counters, so a rate() windows them),
preemptions, the tokens of each engine step (`iteration_tokens_total`, a histogram built from the
engine's count of steps by tokens), and the four speculative-decoding counters (accepted tokens by
draft `position`, every position of K present from the start). Only dflash-serve's, under `dflash:`:
engine steps and those queued ahead (async scheduling), steps that kept streams waiting over 250
ms, pool restarts the engine moved onto, each layer group's blocks, the Triton kernels each of its
processes compiled before and after it was ready, and the speculative counters split by the
`proposer` that drafted (`dflash`, `ngram`: a hybrid's share).
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)  # vLLM's


class EngineCollector:
    """A Prometheus collector over one engine: `snapshot()` of its `EngineClient` and `counters()`."""

    def __init__(self, engine, counters, labels: dict[str, str], groups: list[str],
                 num_speculative_tokens: int):
        self.engine, self.counters = engine, counters
        self.labels, self.groups, self.num_speculative_tokens = labels, groups, num_speculative_tokens

    def _family(self, kind, name: str, documentation: str, extra: tuple[str, ...] = ()):
        return kind(name, documentation, labels=[*self.labels, *extra])

    def _one(self, kind, name: str, documentation: str, value: float):
        family = self._family(kind, name, documentation)
        family.add_metric(list(self.labels.values()), value)
        return family

    def collect(self):
        snapshot, counters = self.engine.snapshot(), self.counters()
        stats, pool = snapshot.stats, snapshot.pool
        yield self._one(GaugeMetricFamily, "vllm:num_requests_running",
                        "Number of requests in model execution batches.", snapshot.num_running)
        yield self._one(GaugeMetricFamily, "vllm:num_requests_waiting",
                        "Number of requests waiting to be processed.", snapshot.num_waiting)
        yield self._one(GaugeMetricFamily, "vllm:kv_cache_usage_perc",
                        "KV-cache usage. 1 means 100 percent usage.",
                        pool.num_used_blocks / pool.num_blocks if pool.num_blocks else 0.0)
        for name, documentation, value in (
            ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
             pool.prefix_cache_queries),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
             pool.prefix_cache_hits),
            ("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
             counters.num_preemptions),
            ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", stats.num_drafts),
            ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", stats.num_draft_tokens),
            ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", stats.num_accepted_tokens),
            ("dflash:engine_steps", "Engine steps", snapshot.num_steps),
            ("dflash:engine_steps_ahead", "Engine steps queued before the step before them was read (async "
             "scheduling)", snapshot.num_steps_ahead),
            ("dflash:pool_recoveries", "Steps that found the pool gone and moved onto its restarted process",
             counters.num_pool_recoveries),
            ("dflash:engine_slow_steps", "Steps that kept running streams waiting over the slow-step "
             "threshold (250 ms unless DFLASH_SLOW_STEP_MS sets it; each is logged with what it held)",
             counters.num_slow_steps),
        ):
            yield self._one(CounterMetricFamily, name, documentation, value)
        yield self._accepted_per_position(stats.accepted_per_position)
        yield from self._by_proposer(stats.by_proposer)
        yield self._iteration_tokens(counters.iteration_tokens)
        yield self._decode_steps(counters.decode_steps_by_drafts)
        yield from self._pool_blocks(pool)
        yield self._compilations(snapshot)

    def _accepted_per_position(self, accepted: list[int]):
        """Drafts whose token at `position` (and so every one before it) was accepted."""
        family = self._family(CounterMetricFamily, "vllm:spec_decode_num_accepted_tokens_per_pos",
                              "Accepted tokens per draft position.", ("position",))
        values = list(self.labels.values())
        for position in range(max(self.num_speculative_tokens, len(accepted))):
            family.add_metric([*values, str(position)], accepted[position] if position < len(accepted) else 0)
        return family

    def _by_proposer(self, by_proposer: dict):
        """vLLM's four speculative counters again, per proposer: they add up to the totals."""
        values = list(self.labels.values())
        for counter, documentation in (("num_drafts", "Spec decoding drafts, by proposer"),
                                       ("num_draft_tokens", "Draft tokens, by proposer"),
                                       ("num_accepted_tokens", "Accepted tokens, by proposer")):
            name = f"dflash:spec_decode_proposer_{counter}"
            family = self._family(CounterMetricFamily, name, documentation, ("proposer",))
            for proposer, counts in sorted(by_proposer.items()):
                family.add_metric([*values, proposer], getattr(counts, counter))
            yield family
        family = self._family(CounterMetricFamily, "dflash:spec_decode_proposer_num_accepted_tokens_per_pos",
                              "Accepted tokens per draft position, by proposer", ("proposer", "position"))
        for proposer, counts in sorted(by_proposer.items()):
            for position, accepted in enumerate(counts.accepted_per_position):
                family.add_metric([*values, proposer, str(position)], accepted)
        yield family

    def _decode_steps(self, steps_by_drafts: dict[int, int]):
        """Decode-only steps by the drafts each sequence verified: where adaptive speculation chose."""
        family = self._family(CounterMetricFamily, "dflash:decode_steps_by_drafts",
                              "Decode-only engine steps, by the drafts each sequence verified", ("drafts",))
        values = list(self.labels.values())
        for drafts, steps in sorted(steps_by_drafts.items()):
            family.add_metric([*values, str(drafts)], steps)
        return family

    def _iteration_tokens(self, steps_by_tokens: dict[int, int]):
        family = self._family(HistogramMetricFamily, "vllm:iteration_tokens_total",
                              "Histogram of number of tokens per engine_step.")
        buckets = [(str(float(bound)), sum(n for tokens, n in steps_by_tokens.items() if tokens <= bound))
                   for bound in ITERATION_TOKEN_BUCKETS]
        buckets.append(("+Inf", sum(steps_by_tokens.values())))
        family.add_metric(list(self.labels.values()), buckets,
                          sum_value=sum(tokens * n for tokens, n in steps_by_tokens.items()))
        return family

    def _pool_blocks(self, usage):
        # block ids are position-aligned across the groups: the counts are the pool's, per group alike
        values = list(self.labels.values())
        for name, documentation, value in (
            ("dflash:kv_blocks_used", "Pool blocks held by live sequences", usage.num_used_blocks),
            ("dflash:kv_blocks_free", "Pool blocks free or evictable from the prefix cache",
             usage.num_free_blocks + usage.num_cached_blocks),
        ):
            family = self._family(GaugeMetricFamily, name, documentation, ("group",))
            for group in self.groups:
                family.add_metric([*values, group], value)
            yield family

    def _compilations(self, snapshot):
        """Triton kernel specialisations each process of the engine built, before and after it was
        ready (`service`: "in_process", or the Ray service that built them): any after ready stalled
        every stream of the replica while it compiled (the aim: 0)."""
        family = self._family(CounterMetricFamily, "dflash:kernel_compilations",
                              "Triton kernels compiled (or loaded from the on-disk cache) by a process of "
                              "the engine, at start-up or while serving", ("service", "phase"))
        values = list(self.labels.values())
        for service, counts in sorted(snapshot.compilations.items()):
            family.add_metric([*values, service, "startup"], counts.startup)
            family.add_metric([*values, service, "serving"], len(counts.serving))
        return family
