"""Calling a service behind `dedupd http-proxy` with httpx: one
Idempotency-Key per business operation, the same key on every retry.

The client retries what is safe to retry *because* of the key: a timeout or
a dropped connection (the first attempt may or may not have run: the proxy
knows), the proxy's own 502 upstream-failed and 503 store-unavailable or
overloaded (nothing was sent; a 500 the service answered comes back
replayed, never run again, so retrying it is harmless but useless), and a
409 "still in progress" (after Retry-After). It
never retries a 422 (that key was used for another request, a bug in the
caller) nor a 502 "outcome-unknown": the order may or may not exist, the
proxy will not send it again under this key, and only the caller can find
out (look the order up; if it is not there, create it with a new key).

    python3 client.py http://127.0.0.1:8080
"""

from __future__ import annotations

import sys
import time
import uuid

import httpx

IN_PROGRESS = "https://dedupd.dev/problems/request-in-progress"
OUTCOME_UNKNOWN = "https://dedupd.dev/problems/outcome-unknown"


class KeyReused(Exception):
    """The proxy answered 422: this key already belongs to another request."""


class OutcomeUnknown(Exception):
    """The proxy answered 502 outcome-unknown: the request may have reached
    the service, and will not be sent again with this key. Reconcile."""


def create_order(
    client: httpx.Client,
    order: dict,
    *,
    key: str | None = None,
    attempts: int = 6,
    backoff: float = 0.2,
) -> httpx.Response:
    """POSTs the order once, whatever the network does; returns the answer
    (a replay carries `Idempotent-Replayed: true`)."""
    key = key or str(uuid.uuid4())
    # Bare, as Stripe's SDKs send it; the draft's quoted form ("...") is
    # the same key to the proxy.
    headers = {"Idempotency-Key": key}
    for attempt in range(attempts):
        last = attempt == attempts - 1
        try:
            response = client.post("/orders", json=order, headers=headers)
        except httpx.TransportError:
            if last:
                raise
            time.sleep(backoff * 2**attempt)
            continue
        if response.status_code == 422:
            raise KeyReused(response.json()["detail"])
        if response.status_code == 502 and response.json().get("type") == OUTCOME_UNKNOWN:
            raise OutcomeUnknown(response.json()["detail"])
        if response.status_code == 409 and response.json().get("type") == IN_PROGRESS and not last:
            time.sleep(float(response.headers.get("Retry-After", "1")))
            continue
        if response.status_code >= 500 and not last:
            time.sleep(backoff * 2**attempt)
            continue
        return response
    raise AssertionError("unreachable: the last attempt returns or raises")


if __name__ == "__main__":
    base_url = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8080"
    # The caller's credentials: the proxy gives a stored answer only to the
    # caller that sent the request (and refuses a keyed request with none).
    caller = {"Authorization": "Bearer demo-token"}
    with httpx.Client(base_url=base_url, timeout=10, headers=caller) as client:
        key = str(uuid.uuid4())
        for _ in range(2):
            answer = create_order(client, {"sku": "A1", "qty": 2}, key=key)
            print(answer.status_code, answer.headers.get("idempotent-replayed", "false"), answer.text)
