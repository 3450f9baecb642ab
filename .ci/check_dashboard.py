#!/usr/bin/env python3
"""Every query of the Grafana dashboard (helm/dedupd/files/dashboard.json)
returns data from a real Prometheus that scraped real sidecars under load.

    .ci/check_dashboard.py DEDUPD_BINARY REDIS_URL

Starts, on loopback: a stub upstream service; sidecar A on the embedded
sled store with the HTTP idempotency proxy in front of the stub; sidecar B
on Redis (behind its local tier); a Prometheus (Debian's `prometheus`)
scraping both every second. Drives claims, commits, duplicates and keyed
HTTP requests through them for a while (every answer checked: a load that
fails ends the check), then evaluates each panel's query (and the pod
variable's) through Prometheus's HTTP API: each must return at least one
series with a finite value above 0. Stops everything it started.
"""

import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LOAD_SECONDS = 20
DASHBOARD = "helm/dedupd/files/dashboard.json"


class Stub(BaseHTTPRequestHandler):
    """The service behind the proxy: answers every request 201."""

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = b'{"created":true}'
        self.send_response(201)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_):
        pass


def wait_for(path, what, within=30):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if os.path.exists(path) and os.path.getsize(path) > 0:
            with open(path) as f:
                return json.load(f)
        time.sleep(0.05)
    raise SystemExit(f"{what} did not start within {within} s")


def sidecar(binary, work, name, extra, processes):
    """Starts a sidecar (noted in `processes` first, so it is stopped even
    if it never gets ready): what its ready file says."""
    directory = os.path.join(work, name)
    os.makedirs(directory)
    ready = os.path.join(directory, "ready")
    log = open(os.path.join(directory, "log"), "w")
    processes.append(subprocess.Popen(
        [binary, "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
         "--data-dir", os.path.join(directory, "data"), "--ready-file", ready, *extra],
        stdout=log, stderr=subprocess.STDOUT))
    return wait_for(ready, f"sidecar {name}")


def cli(binary, address, expected_exit, *args):
    """One `dedupd` client command; its JSON answer. Any exit code but the
    expected one (README: 0 CLAIMED, 10 DUPLICATE) is an error."""
    done = subprocess.run([binary, *args[:1], "--addr", f"http://{address}", "--json", *args[1:]],
                          capture_output=True, text=True, timeout=10)
    if done.returncode != expected_exit:
        raise RuntimeError(f"dedupd {' '.join(args)} exited {done.returncode} "
                           f"(expected {expected_exit}): {done.stdout}{done.stderr}")
    return json.loads(done.stdout)


def drive(binary, address, stop, tag):
    """Claims, commits and claims again (a DUPLICATE), in two namespaces;
    every answer checked."""
    n = 0
    while not stop.is_set():
        n += 1
        namespace = random.choice(["orders", "payments"])
        key = f"{tag}-{n}"
        claimed = cli(binary, address, 0, "claim", "-n", namespace, key)
        if claimed["outcome"] != "CLAIMED":
            raise RuntimeError(f"a fresh key was not CLAIMED: {claimed}")
        committed = cli(binary, address, 0, "commit", "-n", namespace, "--lease-token",
                        claimed["lease_token"], "--response", "done", "--retention", "2m", key)
        if committed["outcome"] != "COMMITTED":
            raise RuntimeError(f"the commit was not COMMITTED: {committed}")
        again = cli(binary, address, 10, "claim", "-n", namespace, key)
        if again["outcome"] != "DUPLICATE":
            raise RuntimeError(f"the redelivery was not DUPLICATE: {again}")


def keyed_requests(proxy, stop):
    """POSTs with an Idempotency-Key through the proxy, each sent twice: the
    first answered by the stub (201), the second replayed."""
    n = 0
    while not stop.is_set():
        n += 1
        for attempt in range(2):
            request = urllib.request.Request(
                f"http://{proxy}/orders", data=b'{"amount":1}', method="POST",
                headers={"Idempotency-Key": f"dash-{n}", "Content-Type": "application/json",
                         "Authorization": "Bearer dashboard"})
            with urllib.request.urlopen(request, timeout=10) as answer:
                answer.read()
                replayed = answer.headers.get("Idempotent-Replayed") == "true"
                if answer.status != 201 or replayed != (attempt == 1):
                    raise RuntimeError(f"dash-{n}, attempt {attempt + 1}: {answer.status}, "
                                       f"Idempotent-Replayed: {answer.headers.get('Idempotent-Replayed')}")
        time.sleep(0.02)


def load_thread(target, args, failures):
    """A thread running `target(*args)`; an exception it raises is kept in
    `failures` (and ends the check), never lost with the thread."""
    def run():
        try:
            target(*args)
        except BaseException as error:  # noqa: BLE001 - re-raised by the main thread
            failures.append(f"{target.__name__}: {error!r}")
    return threading.Thread(target=run, daemon=True)


def hpack_literal(name, value):
    """One header as HPACK's literal without indexing, no Huffman coding
    (every length here is under 127)."""
    name, value = name.encode(), value.encode()
    return bytes([0, len(name)]) + name + bytes([len(value)]) + value


def stalled_call(address):
    """An HTTP/2 gRPC call whose message never comes: the sidecar refuses it
    after --request-read-timeout (counted as refusals{reason="read_timeout"})."""
    import socket
    host, port = address.rsplit(":", 1)
    headers = b"".join(hpack_literal(name, value) for name, value in [
        (":method", "POST"), (":scheme", "http"), (":authority", address),
        (":path", "/dedup.v1.ClaimAndCommit/Claim"),
        ("content-type", "application/grpc"), ("te", "trailers")])
    frame = len(headers).to_bytes(3, "big") + bytes([0x1, 0x4]) + (1).to_bytes(4, "big") + headers
    with socket.create_connection((host, int(port)), timeout=10) as connection:
        connection.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]) + frame)
        # The refusal comes after the read timeout (its bytes are HPACK's:
        # the metrics tell that it was counted).
        time.sleep(1)


def query(prometheus, expr):
    url = f"http://{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as answer:
        body = json.load(answer)
    if body.get("status") != "success":
        raise SystemExit(f"Prometheus refused {expr}: {body}")
    return body["data"]["result"]


def main():
    binary, redis_url = sys.argv[1], sys.argv[2]
    prometheus_binary = shutil.which("prometheus")
    if not prometheus_binary:
        raise SystemExit("no prometheus binary (Debian: apt install prometheus)")
    with open(DASHBOARD) as f:
        dashboard = json.load(f)
    work = tempfile.mkdtemp(prefix="dedupd-dashboard-")
    processes = []
    stop = threading.Event()
    stub = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    threading.Thread(target=stub.serve_forever, daemon=True).start()
    try:
        ready_a = sidecar(binary, work, "a", [
            "--request-read-timeout", "300ms",
            "--http-proxy-listen", "127.0.0.1:0",
            "--http-proxy-upstream", f"http://127.0.0.1:{stub.server_address[1]}"], processes)
        prefix = f"dashboard_{random.getrandbits(48):012x}"
        ready_b = sidecar(binary, work, "b", [
            "--store", "redis", "--store-url", redis_url, "--store-schema", prefix], processes)
        targets = [ready_a["metrics"], ready_b["metrics"]]
        config = os.path.join(work, "prometheus.yml")
        with open(config, "w") as f:
            f.write("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                    "scrape_configs:\n  - job_name: dedupd\n    static_configs:\n"
                    f"      - targets: {json.dumps(targets)}\n")
        prometheus = f"127.0.0.1:{free_port()}"
        processes.append(subprocess.Popen(
            [prometheus_binary, f"--config.file={config}",
             f"--storage.tsdb.path={os.path.join(work, 'tsdb')}",
             f"--web.listen-address={prometheus}"],
            stdout=open(os.path.join(work, "prometheus.log"), "w"), stderr=subprocess.STDOUT))

        failures = []
        load = [
            load_thread(drive, (binary, ready_a["grpc"][0], stop, "a"), failures),
            load_thread(drive, (binary, ready_b["grpc"][0], stop, "b"), failures),
            load_thread(keyed_requests, (ready_a["http_proxy"], stop), failures),
        ]
        for thread in load:
            thread.start()
        # The refusals are made once Prometheus scrapes both sidecars, so the
        # counter's rise falls inside what it saw (a rate needs two samples).
        scraping = time.monotonic() + 30
        while True:
            try:
                if len(query(prometheus, 'up{job="dedupd"} == 1')) == 2:
                    break
            except OSError:  # Prometheus not listening yet
                pass
            if time.monotonic() > scraping:
                raise SystemExit("Prometheus did not scrape both sidecars within 30 s")
            time.sleep(0.2)
        time.sleep(1.5)
        for _ in range(3):
            stalled_call(ready_a["grpc"][0])
        deadline = time.monotonic() + LOAD_SECONDS
        while time.monotonic() < deadline and not failures:
            time.sleep(0.2)
        stop.set()
        for thread in load:
            thread.join()
        if failures:
            raise SystemExit("the load failed: " + "; ".join(failures))
        time.sleep(2)  # the last scrapes

        up = query(prometheus, 'up{job="dedupd"} == 1')
        if len(up) != 2:
            raise SystemExit(f"Prometheus scrapes {len(up)} of the 2 sidecars: {up}")
        substitutions = {"$__rate_interval": "1m", "$instance": ".*"}
        checked = 0
        for panel in dashboard["panels"]:
            for target in panel["targets"]:
                expr = target["expr"]
                for variable, value in substitutions.items():
                    expr = expr.replace(variable, value)
                # Every panel is driven by the load above: a query whose
                # every series is 0 (or NaN) shows nothing happened.
                result = query(prometheus, expr)
                driven = [series for series in result
                          if math.isfinite(float(series["value"][1])) and float(series["value"][1]) > 0]
                if not driven:
                    raise SystemExit(f'panel "{panel["title"]}": {expr} returned no value above 0: {result}')
                checked += 1
                print(f'ok  {panel["title"]} [{target["refId"]}]: {len(driven)} series above 0')
        # Series that exist from the start at 0 (the refusal reasons) pass
        # the test above by themselves: the stalled calls must have counted.
        if not query(prometheus, 'dedupd_refusals_total{reason="read_timeout"} > 0'):
            raise SystemExit("the stalled calls were not counted as read_timeout refusals")
        for variable in dashboard["templating"]["list"]:
            if variable["type"] != "query":
                continue
            metric, label = "dedupd_serving", "instance"
            assert variable["query"]["query"] == f"label_values({metric}, {label})", variable
            values = query(prometheus, f"count by ({label}) ({metric})")
            if len(values) != 2:
                raise SystemExit(f"variable {variable['name']}: {len(values)} pods, expected 2")
            print(f"ok  variable ${variable['name']}: {len(values)} pods")
        print(f"{checked} dashboard queries return data from a live Prometheus")
    finally:
        stop.set()
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
        stub.shutdown()
        shutil.rmtree(work, ignore_errors=True)


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
