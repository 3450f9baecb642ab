"""The real dedupd binary, started by the tests: on TCP, on a Unix socket,
and with TLS (a CA of the test's own, mTLS) and a bearer token.

DEDUPD_BIN names the binary (default: the repository's target/debug/dedupd).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import Iterator, List

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]
BINARY = os.environ.get("DEDUPD_BIN", str(ROOT / "target" / "debug" / "dedupd"))
TOKEN = "a-bearer-token-of-32-characters!"


@dataclass
class Sidecar:
    address: str
    process: subprocess.Popen[bytes]
    directory: pathlib.Path
    args: List[str]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            assert self.process.wait(timeout=30) == 0, "dedupd exits 0 on SIGTERM"


def start(directory: pathlib.Path, listen: str, *extra: str) -> Sidecar:
    ready_file = directory / "ready.json"
    ready_file.unlink(missing_ok=True)
    args = [BINARY, "--listen", listen, "--metrics-listen", "off", "--log-format", "json",
            "--data-dir", str(directory / "data"), "--ready-file", str(ready_file), *extra]
    process = subprocess.Popen(args, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while not ready_file.exists():
        assert process.poll() is None, f"dedupd exited with {process.returncode}"
        assert time.monotonic() < deadline, "dedupd was not ready within 20 s"
        time.sleep(0.01)
    address = json.loads(ready_file.read_text())["grpc"][0]
    return Sidecar(address, process, directory, args)


@pytest.fixture()
def workdir() -> Iterator[pathlib.Path]:
    with tempfile.TemporaryDirectory() as name:
        yield pathlib.Path(name)


@pytest.fixture()
def sidecar(workdir: pathlib.Path) -> Iterator[Sidecar]:
    running = start(workdir, "127.0.0.1:0")
    yield running
    running.stop()


@pytest.fixture()
def unix_sidecar(workdir: pathlib.Path) -> Iterator[Sidecar]:
    running = start(workdir, f"unix://{workdir / 'dedupd.sock'}")
    yield running
    running.stop()


@dataclass
class Certificates:
    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.fixture()
def certificates(workdir: pathlib.Path) -> Certificates:
    """A CA, a server certificate for localhost/127.0.0.1 and a client
    certificate it signed (openssl, EC P-256)."""
    d = workdir
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", f"{d}/ca.key", "-out", f"{d}/ca.pem",
             "-subj", "/CN=dedupd test CA", "-days", "1")
    for name, usage, san in [("server", "serverAuth", "DNS:localhost,IP:127.0.0.1"),
                             ("client", "clientAuth", "DNS:client")]:
        _openssl("req", *ec, "-keyout", f"{d}/{name}.key", "-out", f"{d}/{name}.csr", "-subj", f"/CN={name}")
        (d / f"{name}.ext").write_text(
            f"basicConstraints=CA:FALSE\nextendedKeyUsage={usage}\nsubjectAltName={san}\n")
        _openssl("x509", "-req", "-in", f"{d}/{name}.csr", "-CA", f"{d}/ca.pem", "-CAkey", f"{d}/ca.key",
                 "-CAcreateserial", "-out", f"{d}/{name}.pem", "-days", "1", "-extfile", f"{d}/{name}.ext")
    return Certificates(f"{d}/ca.pem", f"{d}/server.pem", f"{d}/server.key", f"{d}/client.pem", f"{d}/client.key")


@pytest.fixture()
def secured_sidecar(workdir: pathlib.Path, certificates: Certificates) -> Iterator[Sidecar]:
    """TLS with client certificates required, and a bearer token."""
    token_file = workdir / "token"
    token_file.write_text(TOKEN)
    running = start(workdir, "127.0.0.1:0",
                    "--tls-cert", certificates.server_cert, "--tls-key", certificates.server_key,
                    "--tls-client-ca", certificates.ca, "--auth-token-file", str(token_file))
    yield running
    running.stop()


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port

