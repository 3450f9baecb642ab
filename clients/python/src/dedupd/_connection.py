"""How a client reaches the sidecar: the address (DEDUPD_ADDR), TLS, the
bearer token and the caller's trace context, and the retry policy for
UNAVAILABLE."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from types import ModuleType
from typing import Dict, Optional, Tuple

import grpc

DEFAULT_ADDRESS = "127.0.0.1:50051"


@dataclass(frozen=True)
class TLS:
    """TLS to the sidecar: `ca` verifies its certificate (PEM file; the
    system's roots when unset); `cert` and `key` are this client's own, for
    mTLS; `server_name` overrides the name checked in its certificate."""

    ca: Optional[str] = None
    cert: Optional[str] = None
    key: Optional[str] = None
    server_name: Optional[str] = None

    @staticmethod
    def from_env() -> Optional["TLS"]:
        """DEDUPD_TLS_CA, DEDUPD_TLS_CLIENT_CERT, DEDUPD_TLS_CLIENT_KEY (the
        names `dedupd`'s own client commands read), if any is set."""
        ca = os.environ.get("DEDUPD_TLS_CA")
        cert = os.environ.get("DEDUPD_TLS_CLIENT_CERT")
        key = os.environ.get("DEDUPD_TLS_CLIENT_KEY")
        if not (ca or cert or key):
            return None
        return TLS(ca=ca, cert=cert, key=key)

    def credentials(self) -> grpc.ChannelCredentials:
        if (self.cert is None) != (self.key is None):
            raise ValueError("TLS: cert and key go together (mTLS needs both)")
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca),
            private_key=_read(self.key),
            certificate_chain=_read(self.cert),
        )


def _read(path: Optional[str]) -> Optional[bytes]:
    if path is None:
        return None
    with open(path, "rb") as file:
        return file.read()


@dataclass(frozen=True)
class Retry:
    """Retries of a call answered UNAVAILABLE (the sidecar restarting, its
    store away for a moment). Every dedupd call is safe to repeat: a Claim
    carries a request ID (a repeat whose first answer was lost gets the same
    claim), a repeated Commit answers ALREADY_COMMITTED, a repeated Release
    ALREADY_RELEASED, Renew and Lookup change nothing twice."""

    attempts: int = 5
    first_delay: float = 0.05
    max_delay: float = 2.0

    def delay(self, attempt: int) -> float:
        """The wait before retry `attempt` (0-based): exponential with equal
        jitter — at least half the delay, so `attempts` and the delays
        promise a least time the retries ride out (a sidecar restart); with
        full jitter every wait could be close to nothing and the retries end
        before the sidecar is back."""
        delay: float = min(self.max_delay, self.first_delay * 2**attempt)
        return delay / 2 + random.uniform(0, delay / 2)


def target(address: Optional[str], tls: Optional[TLS]) -> Tuple[str, Optional[TLS]]:
    """The gRPC target and TLS for an address: `host:port`,
    `http://host:port`, `https://host:port` (TLS), or `unix:///path.sock`;
    unset: DEDUPD_ADDR, then 127.0.0.1:50051."""
    address = address or os.environ.get("DEDUPD_ADDR") or DEFAULT_ADDRESS
    if address.startswith("unix:"):
        if tls is not None:
            raise ValueError(f"{address}: TLS is not used on a Unix socket")
        return address, None
    if address.startswith("https://"):
        return address[len("https://") :].rstrip("/"), tls or TLS()
    if address.startswith("http://"):
        return address[len("http://") :].rstrip("/"), tls
    if "://" in address:
        raise ValueError(f"{address!r}: use host:port, http://, https:// or unix:///path.sock")
    return address, tls


def channel_options(grpc_target: str, tls: Optional[TLS]) -> list[tuple[str, object]]:
    options: list[tuple[str, object]] = [
        # A reconnect soon after the sidecar restarts, not after gRPC's
        # default backoff of up to two minutes.
        ("grpc.max_reconnect_backoff_ms", 2000),
        ("grpc.initial_reconnect_backoff_ms", 100),
    ]
    if grpc_target.startswith("unix:"):
        # gRPC's C core sends the escaped socket path as :authority
        # ("tmp%2Fdedupd.sock"), which the sidecar's HTTP/2 server refuses
        # as malformed (PROTOCOL_ERROR): name the host instead.
        options.append(("grpc.default_authority", "localhost"))
    if tls is not None and tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return options


def metadata(token: Optional[str]) -> Optional[Tuple[Tuple[str, str], ...]]:
    token = token if token is not None else os.environ.get("DEDUPD_TOKEN")
    return (("authorization", f"Bearer {token}"),) if token else None


def call_metadata(base: Optional[Tuple[Tuple[str, str], ...]]) -> Optional[Tuple[Tuple[str, str], ...]]:
    """`base` plus the application's current trace context (W3C
    `traceparent`, `tracestate`, `baggage`, or whatever propagators it
    configured) when OpenTelemetry is installed, so the sidecar's span
    joins the caller's trace. Without OpenTelemetry: `base`."""
    if _propagate is None:
        return base
    carrier: Dict[str, str] = {}
    _propagate.inject(carrier)
    if not carrier:
        return base
    # gRPC metadata keys are lowercase (grpcio refuses others); a
    # propagator may write e.g. X-Amzn-Trace-Id.
    return (base or ()) + tuple((key.lower(), value) for key, value in carrier.items())


_propagate: Optional[ModuleType]
try:  # OpenTelemetry is optional: the application's, if it has it.
    from opentelemetry import propagate as _propagate
except ImportError:  # pragma: no cover - exercised where it is not installed
    _propagate = None
