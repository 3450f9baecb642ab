"""Shared fixtures: the real dedupd binary on an ephemeral port."""

import json
import os
import pathlib
import subprocess
import tempfile
import threading
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BINARY = os.environ.get("DEDUPD_BIN", str(ROOT / "target" / "debug" / "dedupd"))


@pytest.fixture()
def sidecar():
    data = tempfile.TemporaryDirectory()
    process = subprocess.Popen(
        [BINARY, "--listen", "127.0.0.1:0", "--metrics-listen", "off", "--log-format", "json",
         "--data-dir", data.name],
        stderr=subprocess.PIPE,
        text=True,
    )
    address = None
    deadline = time.monotonic() + 20
    while address is None and time.monotonic() < deadline:
        line = process.stderr.readline()
        if not line:
            break
        event = json.loads(line)
        if event.get("message") == "dedupd serving":
            address = event["address"]
    assert address, "dedupd did not start"
    # Keep draining its logs so it never blocks on a full pipe.
    threading.Thread(target=process.stderr.read, daemon=True).start()
    yield address
    process.terminate()
    assert process.wait(timeout=30) == 0, "dedupd exits 0 on SIGTERM"
    data.cleanup()


