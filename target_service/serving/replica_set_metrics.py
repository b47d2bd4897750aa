"""ReplicaSetMetrics: one scrape of /metrics answers for every replica of the Ray Serve application.

The replica a scrape reaches asks every replica, itself included, for its series through a Serve
handle broadcast (`DFlashReplica.metrics_families`) and answers one exposition of them all. Each
series keeps its `replica` label, so a PromQL sum over `replica` adds the deployment up: the
acceptance of the whole deployment is `sum(rate(vllm:spec_decode_num_accepted_tokens_total[5m])) /
sum(rate(vllm:spec_decode_num_drafts_total[5m]))`, plus one.

Bounded: each replica answers within `ENGINE_READ_S` (past it without its engine's numbers:
`ServerMetrics.families_within`), and the broadcast gets `timeout_s` in all. A broadcast that fails or
runs out of time (a replica that died, one whose event loop is stuck) still answers, with the series
of the replicas that did answer, or this replica's own, and says so in the log.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from target_service.serving.metrics import ServerMetrics, merge, render, replica_of

logger = logging.getLogger(__name__)

PEERS_S = 5.0  # the broadcast's bound: under Prometheus's default scrape timeout (10 s)
METHOD = "metrics_families"  # what each replica answers the broadcast with


class ReplicaSetMetrics:
    def __init__(self, local: ServerMetrics, handle: Callable[[], object], *, timeout_s: float = PEERS_S):
        """local: this replica's metrics; handle: makes the Serve handle of this application's replicas
        (called at the first scrape: a replica cannot get one while it is being constructed)."""
        self.local = local
        self.make_handle = handle
        self.timeout_s = timeout_s
        self._handle = None

    async def exposition(self) -> bytes:
        replicas = await self._replicas()
        if self.local.labels["replica"] not in {replica_of(families) for families in replicas}:
            replicas.insert(0, await self.local.families_within())
        return render(merge(replicas))

    async def _replicas(self) -> list[list]:
        """Every replica's families that came back within the bound."""
        try:
            if self._handle is None:
                self._handle = self.make_handle()
            answers = await self._handle.broadcast(METHOD).results_async(timeout_s=self.timeout_s,
                                                                         return_exceptions=True)
        except Exception as error:  # TimeoutError, no replica running, Serve going away
            logger.warning("metrics: the other replicas did not answer within %g s (%s); this scrape has "
                           "this replica's series only", self.timeout_s, error or type(error).__name__)
            return []
        failed = [answer for answer in answers if isinstance(answer, BaseException)]
        if failed:
            logger.warning("metrics: %d of %d replicas failed to answer (%s)", len(failed), len(answers),
                           failed[0])
        return [answer for answer in answers if not isinstance(answer, BaseException)]
