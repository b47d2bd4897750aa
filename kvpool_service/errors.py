"""Typed errors of the KV pool's control plane.

Every refusal of the BlockManager is one of these, raised before anything changes, so a caller
(the in-process engine, or the gRPC server on its behalf) can tell "wait or preempt" from "fix the
request". The gRPC server maps each class to one status code (`STATUS_NAMES`); the client maps the
code back to the same class, so the engine handles both pools with one `except`.
"""

from __future__ import annotations


class PoolError(Exception):
    """Base of every refusal; the message is one sentence naming what is wrong."""


class PoolExhausted(PoolError):
    """Not enough free blocks (or sequence indices) now; the scheduler may preempt or wait and retry.

    `resource` says what ran out, "blocks" or "sequences"; `needed` and `available` count it, and
    `shortfall` is how many the caller must release before the same request can succeed.
    """

    def __init__(self, message: str, *, needed: int = 0, available: int = 0, resource: str = "blocks"):
        super().__init__(message)
        self.needed = needed
        self.available = available
        self.resource = resource

    @property
    def shortfall(self) -> int:
        return max(0, self.needed - self.available)


class UnknownSequence(PoolError):
    """The sequence id is not open (never opened, or already closed)."""

    def __init__(self, message: str, *, seq_id: int | None = None):
        super().__init__(message)
        self.seq_id = seq_id


class InvalidRequest(PoolError, ValueError):
    """A malformed request: wrong types, negative lengths, shrinking lengths, duplicate ids."""


class LimitExceeded(PoolError, ValueError):
    """A well-formed request beyond a configured limit (max_model_len, max_num_seqs, pool size)."""


class StaleEpoch(PoolError):
    """The caller's epoch belongs to another incarnation of the pool; it must fetch the layout again."""


# Trailing metadata of RESOURCE_EXHAUSTED, so a remote caller gets PoolExhausted's fields back.
RESOURCE_KEY, NEEDED_KEY, AVAILABLE_KEY = "dflash-resource", "dflash-needed", "dflash-available"

# gRPC status code names (grpc.StatusCode.<name>) of each error; server and client share this table.
class ReadOnly(PoolError):
    """A call that would change the pool, on a server that only reports (an engine owns the pool)."""


STATUS_NAMES: dict[type[PoolError], str] = {
    PoolExhausted: "RESOURCE_EXHAUSTED",
    UnknownSequence: "NOT_FOUND",
    InvalidRequest: "INVALID_ARGUMENT",
    LimitExceeded: "OUT_OF_RANGE",
    StaleEpoch: "FAILED_PRECONDITION",
    ReadOnly: "PERMISSION_DENIED",
}


class TransportError(PoolError):
    """A remote call reached no decision of the pool: unreachable, deadline exceeded, unauthenticated.

    `code` is the gRPC status code name. The pool's state is unknown to the caller after a mutation
    fails this way (it may or may not have been applied).
    """

    def __init__(self, message: str, *, code: str):
        super().__init__(message)
        self.code = code
