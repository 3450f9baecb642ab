"""The article's failure sequence across pods: three consumer processes,
each with its OWN dedupd sidecar (own port, own data directory, own local
tier), all on one shared store — PostgreSQL, then Redis, then a Redis Cluster
(three primaries with a replica each, `--store-replicas 1`) — fed by
RabbitMQ.
Consumers are SIGKILLed between the business write and Commit and between
Commit and the ack, one sidecar is SIGKILLed and restarted mid-run, and the
shared store itself is restarted once (PostgreSQL with pg_ctlcluster; Redis,
a server of the test's own with `appendfsync always`, SIGKILLed and started
again on its append-only file; on the cluster, the primary holding the
first event's record SIGKILLed, its replica promoted, and the old primary
started again as the new one's replica). Every redelivery that crosses pods is
answered DUPLICATE or `recovered`, each event has exactly one
credit_transfers row, and no acknowledged commit is lost.
"""

import json
import os
import pathlib
import socket
import subprocess
import tempfile
import time
import uuid

import pytest

from test_failure_sequence import PG, Rabbit, consume, payment, rows, tables  # noqa: F401

ROOT = pathlib.Path(__file__).resolve().parents[3]
BINARY = os.environ.get("DEDUPD_BIN", str(ROOT / "target" / "debug" / "dedupd"))
STORE_URL = os.environ.get("DEDUPD_TEST_STORE_URL", "postgres://postgres@127.0.0.1:5432/test")


_HANDED_OUT = set()


def free_port():
    """A port free on 127.0.0.1 now and never handed out before by this
    process: the kernel hands a port that was probed and closed out again,
    and two nodes of one cluster given the same port made the second exit
    while the first answered for both (`--cluster create` then took the
    address twice and the cluster never knew six nodes: a CI run failed so)."""
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def is_ours(port, process):
    """Whether the redis-server answering on `port` is `process` (another
    process may have taken the port between the probe and the bind)."""
    assert process.poll() is None, f"redis-server for port {port} exited with {process.returncode}"
    server = redis_cli(port, "info", "server")
    return f"process_id:{process.pid}\r" in server or f"process_id:{process.pid}\n" in server


class OwnRedis:
    """A redis-server of the test's own, durable as the README asks
    (`appendonly yes`, `appendfsync always`), so it can be killed and
    restarted without touching the machine's."""

    def __init__(self, workdir):
        self.port, self.dir = free_port(), pathlib.Path(workdir) / "redis"
        self.dir.mkdir()
        self.process = None
        self.start()

    @property
    def url(self):
        return f"redis://127.0.0.1:{self.port}"

    def start(self):
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes", "--appendfsync", "always", "--dir", str(self.dir)],
            stdout=open(self.dir / "redis.log", "ab"),
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as connection:
                    connection.sendall(b"PING\r\n")
                    if connection.recv(64).startswith(b"+PONG"):
                        assert is_ours(self.port, self.process), f"port {self.port} is another process's"
                        return
            except OSError:
                pass
            assert self.process.poll() is None, "redis-server exited"
            assert time.monotonic() < deadline, "redis-server did not answer within 20 s"
            time.sleep(0.05)

    def kill_9_and_restart(self):
        self.process.kill()
        self.process.wait()
        self.start()

    def stop(self):
        self.process.kill()
        self.process.wait()


def redis_cli(port, *args):
    done = subprocess.run(["redis-cli", "-h", "127.0.0.1", "-p", str(port), *map(str, args)],
                          capture_output=True, text=True, timeout=30)
    return done.stdout if done.returncode == 0 else ""


def until(predicate, seconds, what):
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not within {seconds} s"
        time.sleep(0.1)


class OwnRedisCluster:
    """A Redis Cluster of the test's own: three primaries and a replica of
    each (`redis-cli --cluster create --cluster-replicas 1`), every node
    durable (`appendfsync always`) and failed over 5 s after it stops
    answering (less, and a node starved of CPU on a loaded machine is
    failed over when no test asked for it)."""

    def __init__(self, workdir):
        self.dir = pathlib.Path(workdir) / "cluster"
        self.ports = [free_port() for _ in range(6)]
        self.buses = [free_port() for _ in range(6)]
        self.processes = {}
        for port in self.ports:
            self.start(port)
        created = subprocess.run(
            ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
             "--cluster-replicas", "1", "--cluster-yes"], capture_output=True, text=True, timeout=60)
        assert created.returncode == 0, created.stdout + created.stderr
        self.settle()

    @property
    def url(self):
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def start(self, port):
        node = self.dir / str(port)
        node.mkdir(parents=True, exist_ok=True)
        bus = self.buses[self.ports.index(port)]
        self.processes[port] = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--cluster-enabled", "yes", "--cluster-port", str(bus), "--cluster-config-file", "nodes.conf",
             "--cluster-node-timeout", "5000", "--appendonly", "yes", "--appendfsync", "always",
             "--dir", str(node)],
            stdout=open(node / "redis.log", "ab"),
        )
        until(lambda: redis_cli(port, "ping").strip() == "PONG", 20, f"redis-server on {port}")
        assert is_ours(port, self.processes[port]), f"port {port} is another process's"

    def settle(self):
        """Every node says cluster_state:ok, knows all six, and every
        replica's link to its primary is up."""
        unsettled = []

        def settled():
            unsettled.clear()
            for port in self.ports:
                info = redis_cli(port, "cluster", "info")
                if "cluster_state:ok" not in info or "cluster_known_nodes:6" not in info:
                    unsettled.append(f"{port}: {info.split()[:3]}")
                    return False
                replication = redis_cli(port, "info", "replication")
                if "role:slave" in replication and "master_link_status:up" not in replication:
                    unsettled.append(f"{port}: replica, link down")
                    return False
            return True
        try:
            until(settled, 60, "the cluster settled")
        except AssertionError as error:
            logs = {port: (self.dir / str(port) / "redis.log").read_text()[-2000:] for port in self.ports}
            raise AssertionError(f"{error}: {unsettled}; the nodes' last log lines: {logs}") from None

    def answering(self):
        """A node that answers (the one killed may be the first)."""
        for port in self.ports:
            if redis_cli(port, "ping").strip() == "PONG":
                return port
        raise AssertionError("no node of the cluster answers")

    def primaries(self):
        """{port: set of slots} of every primary that holds slots and is
        not failed."""
        owners = {}
        for line in redis_cli(self.answering(), "cluster", "nodes").splitlines():
            fields = line.split()
            if "master" not in fields[2] or "fail" in fields[2]:
                continue
            slots = owners.setdefault(int(fields[1].split(":")[1].split("@")[0]), set())
            for owned in fields[8:]:
                low, _, high = owned.partition("-")
                if low.isdigit():
                    slots.update(range(int(low), int(high or low) + 1))
        return owners

    def slots_of(self, port):
        """The slots the primary on `port` holds."""
        return self.primaries().get(port, set())

    def primary_of(self, key):
        """The port of the primary holding `key`'s slot."""
        slot = int(redis_cli(self.answering(), "cluster", "keyslot", key).strip())
        for port, slots in self.primaries().items():
            if slot in slots:
                return port
        raise AssertionError(f"no primary holds slot {slot}")

    def fail_over(self, key):
        """SIGKILLs the primary of `key`, waits until its replica is promoted
        and serves the slot, and starts the old primary again: it rejoins as
        the new primary's replica."""
        killed = self.primary_of(key)
        self.processes[killed].kill()
        self.processes[killed].wait()
        until(lambda: self.primary_of_or_none(key) not in (None, killed), 30, "a replica promoted")
        self.start(killed)
        self.settle()
        assert self.primary_of(key) != killed, "the old primary came back as a replica"
        return killed

    def primary_of_or_none(self, key):
        try:
            return self.primary_of(key)
        except (AssertionError, ValueError):
            return None

    def stop(self):
        for process in self.processes.values():
            process.kill()
            process.wait()


class Pod:
    """One dedupd sidecar on the shared store."""

    def __init__(self, name, store, url, schema, workdir, flags=()):
        self.name, self.schema, self.workdir = name, schema, pathlib.Path(workdir)
        self.store, self.url, self.flags = store, url, list(flags)
        self.process = None
        self.start()

    def start(self):
        ready = self.workdir / f"{self.name}.ready"
        ready.unlink(missing_ok=True)  # a killed sidecar leaves its old one
        self.process = subprocess.Popen(
            [BINARY, "--store", self.store, "--store-url", self.url, "--store-schema", self.schema,
             "--listen", "127.0.0.1:0", "--metrics-listen", "off", "--log-format", "json",
             "--data-dir", str(self.workdir / self.name), "--ready-file", str(ready), *self.flags],
            stderr=open(self.workdir / f"{self.name}.log", "ab"),
        )
        deadline = time.monotonic() + 20
        while not ready.exists():
            assert self.process.poll() is None, f"{self.name} exited with {self.process.returncode}"
            assert time.monotonic() < deadline, f"{self.name} was not ready within 20 s"
            time.sleep(0.01)
        self.address = json.loads(ready.read_text())["grpc"][0]
        self.until_serving()

    def until_serving(self, seconds=30):
        deadline = time.monotonic() + seconds
        while subprocess.run([BINARY, "health", "--addr", self.address], capture_output=True,
                             timeout=10).returncode != 0:
            assert time.monotonic() < deadline, f"{self.name} not SERVING within {seconds} s"
            time.sleep(0.1)

    def kill_9(self):
        self.process.kill()
        self.process.wait()

    def stop(self):
        self.process.terminate()
        assert self.process.wait(timeout=30) == 0, f"{self.name} exits 0 on SIGTERM"

    def lookup(self, correlation_id):
        done = subprocess.run([BINARY, "lookup", correlation_id, "-n", "payments", "--addr", self.address,
                               "--json"], capture_output=True, text=True, timeout=30)
        return json.loads(done.stdout)


class Shared:
    """The shared store under test, and how to restart it."""

    def __init__(self, kind, workdir):
        self.kind, self.schema = kind, f"dedupd_pods_{uuid.uuid4().hex[:12]}"
        self.redis = OwnRedis(workdir) if kind == "redis" else None
        self.cluster = OwnRedisCluster(workdir) if kind == "redis-cluster" else None
        self.url = self.redis.url if self.redis else self.cluster.url if self.cluster else STORE_URL
        # On the cluster every answer waits for a replica of its key's
        # primary: what makes the failover below lose nothing acknowledged.
        self.flags = ["--store-replicas", "1"] if self.cluster else []
        self.store = "redis" if kind == "redis-cluster" else kind

    def restart(self, correlation_id):
        """Restarts the store; on the cluster, fails over the primary of
        `correlation_id`'s record."""
        if self.redis:
            self.redis.kill_9_and_restart()
        elif self.cluster:
            self.cluster.fail_over(f"{self.schema}:r:payments/{correlation_id}")
        else:
            restart_postgres()

    def close(self):
        if self.redis:
            self.redis.stop()
            return
        if self.cluster:
            self.cluster.stop()
            return
        import psycopg

        with psycopg.connect(PG, autocommit=True) as db:
            db.execute(f"DROP SCHEMA IF EXISTS {self.schema} CASCADE")


@pytest.fixture(params=["postgres", "redis", "redis-cluster"])
def shared_store(request):
    with tempfile.TemporaryDirectory() as workdir:
        store = Shared(request.param, workdir)
        yield store, workdir
        store.close()


@pytest.fixture()
def pods(shared_store):
    store, workdir = shared_store
    started = [Pod(f"pod-{i}", store.store, store.url, store.schema, workdir, store.flags) for i in range(3)]
    yield started
    for pod in started:
        pod.stop()


def restart_postgres():
    version = sorted(os.listdir("/etc/postgresql"))[-1]
    subprocess.run(["pg_ctlcluster", "--skip-systemctl-redirect", version, "main", "restart"],
                   check=True, timeout=120)


def events_of(events, kind):
    return [e for e in events if e["event"] == kind]


def test_redeliveries_across_pods_never_double_process(shared_store, pods):
    store, _ = shared_store
    broker = Rabbit()
    try:
        ids = [f"pay-{uuid.uuid4().hex}" for _ in range(6)]
        for correlation_id in ids:
            broker.publish(payment(correlation_id))

        # Pod 0's consumer writes the first event and dies before Commit.
        code, events, _ = consume(pods[0].address, broker, crash="after-write")
        assert code == -9, events
        first = ids[0]
        assert rows(first) == 1

        # The broker redelivers it to pod 1's consumer: IN_PROGRESS until the
        # dead holder's lease ends, then CLAIMED recovered (attempt 2) on
        # another pod; the consumer finds its row, commits, and dies before
        # the ack.
        code, events, _ = consume(pods[1].address, broker, crash="after-commit")
        assert code == -9, events
        claimed = events_of(events, "claimed")
        assert claimed and claimed[-1]["correlation_id"] == first, events
        assert claimed[-1]["recovered"] is True and claimed[-1]["attempt"] == 2, events
        assert events_of(events, "already_written"), events
        assert rows(first) == 1

        # Pod 2's sidecar is killed and started again; the shared store
        # restarts (on the cluster: the first event's primary fails over).
        pods[2].kill_9()
        pods[2].start()
        store.restart(first)
        for pod in pods:
            pod.until_serving()

        # The rest drains through pods 2 and 0: the first event (committed on
        # pod 1, never acked) is DUPLICATE on pod 2; the others are written once.
        code, events, stderr = consume(pods[2].address, broker, max_messages=3)
        assert code == 0, stderr
        assert events_of(events, "duplicate")[0]["correlation_id"] == first, events
        code, events, stderr = consume(pods[0].address, broker, max_messages=3)
        assert code == 0, stderr

        for correlation_id in ids:
            assert rows(correlation_id) == 1, correlation_id
            # No acknowledged commit lost, whichever pod is asked.
            for pod in pods:
                record = pod.lookup(correlation_id)
                assert record["found"] is True and record["record"]["state"] == "COMMITTED", record
    finally:
        broker.close()
