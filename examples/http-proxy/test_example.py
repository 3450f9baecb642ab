"""The example against the real `dedupd http-proxy` in front of the toy
service: a client whose first attempt times out retries with the same key
and gets the one order the service created."""

import json
import os
import pathlib
import subprocess
import tempfile
import time

import httpx
import pytest

from client import KeyReused, OutcomeUnknown, create_order
from orders_service import serve

# The caller's credentials: the proxy refuses a keyed request that names no
# caller (400 caller-unidentified), so one caller never gets another's answer.
CALLER = {"Authorization": "Bearer example-client"}

ROOT = pathlib.Path(__file__).resolve().parents[2]
BINARY = os.environ.get("DEDUPD_BIN", str(ROOT / "target" / "debug" / "dedupd"))


@pytest.fixture()
def service():
    server, orders = serve(0, seconds_per_order=1.0)
    yield server.server_address[1], orders
    server.shutdown()


@pytest.fixture()
def proxy(service):
    yield from start_proxy(service)


@pytest.fixture()
def impatient_proxy(service):
    """A proxy that waits 0.5 s for the 1 s service."""
    yield from start_proxy(service, "--upstream-timeout", "500ms")


def start_proxy(service, *flags):
    port, _ = service
    data = tempfile.TemporaryDirectory()
    ready_file = pathlib.Path(data.name) / "ready.json"
    process = subprocess.Popen(
        [BINARY, "http-proxy", "--listen", "127.0.0.1:0", "--upstream", f"http://127.0.0.1:{port}",
         "--metrics-listen", "off", "--data-dir", str(pathlib.Path(data.name) / "data"),
         "--ready-file", str(ready_file), *flags],
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 20
    while not ready_file.exists():
        assert process.poll() is None, f"dedupd exited with {process.returncode}"
        assert time.monotonic() < deadline, "dedupd was not ready within 20 s"
        time.sleep(0.01)
    ready = json.loads(ready_file.read_text())
    assert ready["grpc"] == [], "dedupd http-proxy serves no gRPC unless asked"
    yield f"http://{ready['http_proxy']}"
    process.terminate()
    assert process.wait(timeout=30) == 0
    data.cleanup()


def test_a_timed_out_attempt_is_retried_and_the_order_is_created_once(service, proxy):
    _, orders = service
    # The client gives up after 0.3 s; the service takes 1 s per order.
    with httpx.Client(base_url=proxy, timeout=0.3, headers=CALLER) as impatient:
        answer = create_order(impatient, {"sku": "A1", "qty": 2}, key="order-7f3a")
    assert answer.status_code == 201
    assert answer.headers["idempotent-replayed"] == "true"
    assert answer.json() == {"order": 1, "received": {"sku": "A1", "qty": 2}}
    assert len(orders.created) == 1

    # Later retries, JSON keys in another order: the same answer, no new order.
    with httpx.Client(base_url=proxy, timeout=5, headers=CALLER) as client:
        again = create_order(client, {"qty": 2, "sku": "A1"}, key="order-7f3a")
    assert again.json() == answer.json()
    assert "idempotency-key-expires" in again.headers
    assert len(orders.created) == 1


def test_a_key_reused_for_another_order_is_refused(service, proxy):
    _, orders = service
    with httpx.Client(base_url=proxy, timeout=5, headers=CALLER) as client:
        first = create_order(client, {"sku": "B2", "qty": 1}, key="order-9b21")
        assert first.status_code == 201
        assert "idempotent-replayed" not in first.headers
        with pytest.raises(KeyReused, match="different request"):
            create_order(client, {"sku": "B2", "qty": 5}, key="order-9b21")
        # HTTP/2 (prior knowledge) gets the same replay.
    with httpx.Client(base_url=proxy, timeout=5, http1=False, http2=True, headers=CALLER) as h2:
        replay = create_order(h2, {"sku": "B2", "qty": 1}, key="order-9b21")
        assert replay.http_version == "HTTP/2"
        assert replay.json() == first.json()
    assert len(orders.created) == 1


def test_an_unknown_outcome_is_reported_not_sent_again(service, impatient_proxy):
    _, orders = service
    with httpx.Client(base_url=impatient_proxy, timeout=10, headers=CALLER) as client:
        with pytest.raises(OutcomeUnknown):
            create_order(client, {"sku": "C3", "qty": 1}, key="order-slow")
        time.sleep(1.2)  # the service finishes the one order it got
        # The caller reconciles: the order exists, so it is not created again.
        with pytest.raises(OutcomeUnknown):
            create_order(client, {"sku": "C3", "qty": 1}, key="order-slow")
    assert len(orders.created) == 1
