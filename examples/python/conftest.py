"""Shared fixtures: the real dedupd binary on an ephemeral port."""

import json
import os
import pathlib
import subprocess
import tempfile
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BINARY = os.environ.get("DEDUPD_BIN", str(ROOT / "target" / "debug" / "dedupd"))


@pytest.fixture()
def sidecar():
    data = tempfile.TemporaryDirectory()
    ready_file = pathlib.Path(data.name) / "ready.json"
    process = subprocess.Popen(
        [BINARY, "--listen", "127.0.0.1:0", "--metrics-listen", "off", "--log-format", "json",
         "--data-dir", str(pathlib.Path(data.name) / "data"), "--ready-file", str(ready_file)],
        stderr=subprocess.DEVNULL,
    )
    # dedupd writes the ready file (whole, by rename) once it serves; it
    # names the port it bound.
    deadline = time.monotonic() + 20
    while not ready_file.exists():
        assert process.poll() is None, f"dedupd exited with {process.returncode}"
        assert time.monotonic() < deadline, "dedupd was not ready within 20 s"
        time.sleep(0.01)
    address = json.loads(ready_file.read_text())["grpc"][0]
    yield address
    process.terminate()
    assert process.wait(timeout=30) == 0, "dedupd exits 0 on SIGTERM"
    assert not ready_file.exists(), "dedupd removes its ready file on exit"
    data.cleanup()
