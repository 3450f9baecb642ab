"""Client for the dedupd deduplication sidecar.

    import dedupd

    client = dedupd.Client(namespace="payments", owner=os.environ["HOSTNAME"])
    result = client.process(event.correlation_id, handle, event_type="PaymentReceived")

`dedupd.Client` is synchronous; `dedupd.aio.Client` has the same shape for
asyncio. Errors derive from `dedupd.DedupError`.
"""

from dedupd._connection import TLS, Retry
from dedupd._protocol import (
    Claim,
    ClaimFields,
    DedupError,
    FingerprintMismatch,
    InProgress,
    LeaseLost,
    ResponseErased,
    Result,
    Stale,
    Unavailable,
)
from dedupd.client import Client

__all__ = [
    "TLS",
    "Claim",
    "ClaimFields",
    "Client",
    "DedupError",
    "FingerprintMismatch",
    "InProgress",
    "LeaseLost",
    "ResponseErased",
    "Result",
    "Retry",
    "Stale",
    "Unavailable",
]
__version__ = "0.1.0"
