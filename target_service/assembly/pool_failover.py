"""PoolFailover: an engine whose pool may restart under it (the pool service's process died).

A step that fails because the pool went away (the transport finds no server, or the restarted server
refuses the old epoch) does not fail the requests: `recover` moves the engine onto the new pool and
every running sequence is recomputed into it (preempt-and-recompute), so requests complete with the
same tokens. Anything else, and a failure with the pool still at its epoch, propagates.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvpool_service.errors import StaleEpoch, TransportError

logger = logging.getLogger(__name__)

POOL_GONE = (TransportError, StaleEpoch)


class PoolFailover:
    """Stands in for the `LLMEngine` it wraps (attributes pass through); only `step` differs."""

    def __init__(self, engine, recover: Callable[[Exception], None]):
        """recover(error): move the engine onto the restarted pool, or re-raise `error` if there is none."""
        self.engine = engine
        self.recover = recover
        self.num_recoveries = 0

    def step(self) -> list:
        try:
            return self.engine.step()
        except POOL_GONE as error:
            logger.warning("the pool went away mid-step (%s); recovering into the restarted pool", error)
            self.recover(error)
            self.num_recoveries += 1
            return []

    def __getattr__(self, name: str):
        return getattr(self.engine, name)
