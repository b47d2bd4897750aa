"""Prometheus metrics of one serving replica: every series of vLLM's this engine can compute, under
vLLM's names, types, labels and meanings (so vLLM's dashboards, alert rules and `vllm bench serve`
read them unchanged), and what only dflash-serve has under `dflash:`.

Two sources. What each request does (its tokens, its phases, how it finished) is observed by
`MeteredEngine` as the request's deltas pass through it, into the histograms and counters of this
replica's registry. What the engine and the pool know (queues, KV-cache use, prefix-cache lookups,
preemptions, tokens per step, the speculative counters) is read when Prometheus scrapes
(`engine_metrics.EngineCollector`), so it is never stale and costs nothing between scrapes.

Every series carries `model_name`, `engine` (vLLM's engine index: here the replica's rank) and
`replica`. `families()` is one replica's series as data; `merge` and `render` make one exposition of
several replicas' (`replica_set_metrics.ReplicaSetMetrics`), which a PromQL `sum` over `replica`
adds up.

Where a meaning departs from vLLM's, it is said here:
- a request's moments are taken where its deltas pass (the server's side of the engine), on one
  monotonic clock; its queue time runs from its arrival there to the first step that schedules it
  (vLLM's from the engine core's queue, a hop later);
- `inter_token_latency_seconds` has one observation per token after the first: a delta of n tokens
  adds n observations of its gap / n (vLLM observes each gap once, whatever a speculative step
  gave), so its sum is the decode time and its count the tokens after the first;
- a phase a request never reached (aborted while queued, or before its first token) is not
  observed (vLLM observes it as 0 or less);
- prefix-cache queries and hits count every lookup of the pool, a preempted request's again too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.metrics_core import Metric

from target_service.serving.engine_metrics import EngineCollector

logger = logging.getLogger(__name__)

LABELS = ("model_name", "engine", "replica")
FINISH_REASONS = ("stop", "length", "abort", "error")  # vLLM's, less "repetition" (never ours)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                         10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
PHASES = {  # vLLM's request phases: name -> its help text
    "queue": "Histogram of time spent in WAITING phase for request.",
    "prefill": "Histogram of time spent in PREFILL phase for request.",
    "decode": "Histogram of time spent in DECODE phase for request.",
    "inference": "Histogram of time spent in RUNNING phase for request.",
}
ENGINE_READ_S = 2.0  # how long a scrape waits for the engine's numbers before answering without them


def one_two_five(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `limit`: vLLM's buckets for token counts (limit: max_model_len)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > limit:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


@dataclass
class RequestTimes:
    """One request's moments, on `time.monotonic()`, and its token counts.

    | field                                          | writer                                        |
    | ---------------------------------------------- | --------------------------------------------- |
    | arrival, num_prompt_tokens, max_tokens         | MeteredEngine, when the request is submitted  |
    | scheduled                                      | the engine's on_scheduled hook (its first call) |
    | first_token, last_token, num_generation_tokens | MeteredEngine, as the deltas arrive           |
    """

    arrival: float
    num_prompt_tokens: int
    max_tokens: int
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    num_generation_tokens: int = 0

    def phases(self) -> dict[str, float]:
        """vLLM's phases this request reached, in seconds: queue (arrival to first scheduled), prefill
        (to the first token), decode (first to last token), inference (scheduled to last token)."""
        scheduled, first, last = self.scheduled, self.first_token, self.last_token
        phases = {}
        if scheduled is not None:
            phases["queue"] = scheduled - self.arrival
        if first is not None:
            phases["decode"] = last - first
            if scheduled is not None:
                phases["prefill"] = first - scheduled
                phases["inference"] = last - scheduled
        return phases

    @property
    def time_per_output_token(self) -> float:
        """The decode time over the tokens after the first (vLLM's per-request mean; 0 for fewer than two)."""
        if self.num_generation_tokens < 2:
            return 0.0
        return (self.last_token - self.first_token) / (self.num_generation_tokens - 1)


class ServerMetrics:
    def __init__(self, engine, counters: Callable[[], object], *, model_name: str, max_model_len: int,
                 replica: str = "0", groups: list[str] = ("target",), num_speculative_tokens: int = 0):
        """engine: the replica's `EngineClient` (its snapshot); counters: its `LLMEngine.counters`, or
        that of the engine in the target actor; max_model_len: the top of the token-count buckets;
        groups: the pool's layer groups; num_speculative_tokens: K, the draft positions counted."""
        self.labels = dict(zip(LABELS, (model_name, replica, replica)))
        self.registry = CollectorRegistry()
        names, values = list(self.labels), list(self.labels.values())

        def counter(name: str, documentation: str):
            return Counter(name, documentation, names, registry=self.registry).labels(*values)

        def histogram(name: str, documentation: str, buckets):
            family = Histogram(name, documentation, names, registry=self.registry, buckets=buckets)
            return family.labels(*values)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self._success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                [*names, "finished_reason"], registry=self.registry)
        for reason in FINISH_REASONS:  # every reason's series from the start, as vLLM's
            self._success.labels(*values, reason)
        tokens = one_two_five(max_model_len)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens",
                                               "Number of prefill tokens processed.", tokens)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.", tokens)
        self.request_max_tokens = histogram("vllm:request_params_max_tokens",
                                            "Histogram of the max_tokens request parameter.", tokens)
        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", TOKEN_LATENCY_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.",
                              TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS)
        self.phases = {phase: histogram(f"vllm:request_{phase}_time_seconds", documentation,
                                        REQUEST_LATENCY_BUCKETS) for phase, documentation in PHASES.items()}
        self.engine_collector = EngineCollector(engine, counters, self.labels, list(groups),
                                                num_speculative_tokens)

    # ---- what MeteredEngine observes --------------------------------------------------------------

    def first_token(self, times: RequestTimes) -> None:
        """A request's first token came: its time to it, and its prompt into the prompt tokens."""
        self.ttft.observe(times.first_token - times.arrival)
        self.prompt_tokens.inc(times.num_prompt_tokens)

    def tokens(self, count: int, gap_s: float | None) -> None:
        """`count` tokens of one request came together, `gap_s` after its previous ones (None: they
        begin the request)."""
        self.generation_tokens.inc(count)
        if gap_s is not None:
            for _ in range(count):
                self.itl.observe(gap_s / count)

    def finished(self, times: RequestTimes, finish_reason: str, now: float) -> None:
        """A request ended (finish_reason "abort": it was cancelled): its latency, phases and sizes."""
        self._success.labels(*self.labels.values(), finish_reason).inc()
        self.e2e.observe(now - times.arrival)
        for phase, seconds in times.phases().items():
            self.phases[phase].observe(seconds)
        self.request_prompt_tokens.observe(times.num_prompt_tokens)
        self.request_generation_tokens.observe(times.num_generation_tokens)
        self.request_max_tokens.observe(times.max_tokens)
        self.tpot.observe(times.time_per_output_token)

    # ---- reading ----------------------------------------------------------------------------------

    def families(self) -> list[Metric]:
        """This replica's series now: the requests', then the engine's (which may block on the engine)."""
        return [*self.registry.collect(), *self.engine_collector.collect()]

    async def families_within(self, timeout_s: float = ENGINE_READ_S) -> list[Metric]:
        """`families()` off the event loop; should the engine not answer within `timeout_s` (a target
        actor restarting) or fail, the request series alone, said in the log."""
        try:
            return await asyncio.wait_for(asyncio.to_thread(self.families), timeout_s)
        except Exception as error:  # the engine's numbers are missing from this scrape, not the rest
            logger.warning("replica %s: no engine metrics in this scrape (%s)", self.labels["replica"],
                           type(error).__name__ if isinstance(error, TimeoutError) else error)
            return list(self.registry.collect())

    async def exposition(self) -> bytes:
        """The Prometheus text of this replica alone."""
        return render(await self.families_within())

    def render(self) -> bytes:
        return render(self.families())


def merge(replicas: list[list[Metric]]) -> list[Metric]:
    """One family per name holding every replica's samples (their `replica` labels keep them apart);
    a replica whose label an earlier one already had is left out (two answers for one rank would
    make duplicate series)."""
    merged: dict[str, Metric] = {}
    seen: set[str | None] = set()
    for families in replicas:
        label = replica_of(families)
        if label in seen:
            continue
        seen.add(label)
        for family in families:
            into = merged.get(family.name)
            if into is None:
                into = Metric(family.name, family.documentation, family.type, family.unit)
                merged[family.name] = into
            into.samples.extend(family.samples)
    return list(merged.values())


def replica_of(families: list[Metric]) -> str | None:
    """The `replica` label of one replica's families (None: they hold no sample)."""
    return next((sample.labels.get("replica") for family in families for sample in family.samples), None)


class _Families:
    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self):
        return self.families


def render(families: list[Metric]) -> bytes:
    """The Prometheus text exposition of `families`."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return generate_latest(registry)
