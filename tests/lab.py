"""A cluster in a box: real daemons, each in its own Linux network namespace, with real limits.

Layout (every piece is a namespace this module creates; nothing touches the host's network)::

    <lab>-hub      a bridge ``br0``; one veth per member plugs into it
    <lab>-etcd     etcd on 10.213.0.2:2379 (the coordinator); with ``etcd_members=3`` two more
                   members, <lab>-etcd1 on 10.213.0.4 and <lab>-etcd2 on 10.213.0.5, and each
                   node reaches them through an ``etcd gateway`` in its own namespace
                   (127.0.0.1:23790, the next member when one refuses), as a host would
    <lab>-s3       moto's S3 server on 10.213.0.3:5000 (the shared storage; ranged GETs
                   served by seek and read: tests/lab_s3.py)
    <lab>-n0 ...   one daemon per node on 10.213.0.(11 + i):7070

Bandwidth is shaped with ``tbf`` on both ends of each veth: a node's NIC is ``node_mbit`` in
each direction, and the storage NIC (``storage_mbit``) is shared by every node that reads or
writes storage at once. Partitions are nftables drop rules in a node's namespace (the kernel
here has no ``netem``, so delay is not emulated; a drop rule is the harsh case: a silent
peer, no reset). Packet loss is a drop rule on a random share of packets (``numgen random mod
100 < N``, :meth:`Lab.lose`); a peer that fails fast is a reject rule answering with a TCP
reset (:meth:`Lab.refuse_coordinator`). Trainers talk to their daemon over its Unix socket, which works from
any network namespace, so a test drives every node from its own process.

Every namespace name starts with ``ckl-<owner pid>-<random>-``; :func:`sweep` removes those
of owners that are gone (a test run killed with SIGKILL), so nothing accumulates, and
:meth:`Lab.stop` removes its own, also when a test fails. Daemons get ``PR_SET_PDEATHSIG``
so they die with the process that started them.

By hand (as root)::

    python -m tests.lab --nodes 4 --node-mbit 400 --storage-mbit 800

prints how to reach each node and tears everything down on Ctrl-C. ``python -m tests.lab
--sweep`` removes leftovers of killed runs.

The module lives under ``tests/`` rather than in the installed package: it is test and
benchmark equipment (it needs root, ``ip``, ``tc``, ``nft``, etcd and moto), not something a
user of the cache deploys. ``benchmarks/cluster/`` imports it with the repository root on
``sys.path``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from tests.helpers import DaemonProc, wait_for_socket

__all__ = ["Lab", "LabNode", "lab_available", "sweep"]

T = TypeVar("T")

SUBNET = "10.213.0"
ETCD_IP = f"{SUBNET}.2"
#: Every etcd member's address (the lab runs the first one, or all three).
ETCD_IPS = (ETCD_IP, f"{SUBNET}.4", f"{SUBNET}.5")
#: Where a node's etcd gateway listens, inside the node's namespace (three members).
GATEWAY_PORT = 23790
S3_IP = f"{SUBNET}.3"
ETCD_PORT = 2379
S3_PORT = 5000
DATA_PORT = 7070
#: Traffic a shaped link queues before it drops (seconds): see _shape.
LINK_QUEUE = 0.01
PREFIX = "ckl"
#: The repository root (``python -m tests.lab_s3`` runs from it).
REPO = Path(__file__).resolve().parents[1]
BUCKET = "lab"
_NAME = re.compile(rf"^{PREFIX}-(\d+)-([0-9a-f]+)-")
_CLONE_NEWNET = 0x40000000
_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "lab",
    "AWS_SECRET_ACCESS_KEY": "lab",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def lab_available() -> str:
    """Why a lab cannot run here ("" when it can): root, ``ip``, ``tc``, ``nft``, etcd."""
    if os.geteuid() != 0:
        return "the lab needs root (network namespaces)"
    for tool in ("ip", "tc", "nft", "etcd"):
        if shutil.which(tool) is None:
            return f"{tool} not installed (scripts/setup.sh test installs it)"
    return ""


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a networking command; its stderr is part of the error when it fails."""
    out = subprocess.run(argv, capture_output=True, text=True)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {out.stderr.strip()}")
    return out


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the starting thread dies (killed test runs)."""
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def in_netns(ns: str, fn: Callable[[], T]) -> T:
    """Call ``fn`` in a fresh thread that has entered network namespace ``ns``.

    Network namespaces are per thread, so this process can reach an address inside the lab
    (etcd, the S3 server) without leaving its own namespace; sockets opened inside ``fn``
    belong to ``ns``. Returns what ``fn`` returns, re-raises what it raises.
    """
    box: dict[str, Any] = {}

    def enter_and_call() -> None:
        try:
            fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
            try:
                if _libc.setns(fd, _CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns into {ns}")
            finally:
                os.close(fd)
            box["value"] = fn()
        except BaseException as e:
            box["error"] = e

    thread = threading.Thread(target=enter_and_call, name=f"netns-{ns}")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace(ns: str) -> None:
    """SIGKILL every process left in ``ns`` (all started by a lab), then delete it; deleting a
    namespace destroys its veths (and their peers), bridge, qdiscs and nftables rules."""
    pids = _run("ip", "netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    for pid in pids:  # a process keeps its namespace alive until it is reaped
        deadline = time.monotonic() + 5
        while _pid_alive(int(pid)) and time.monotonic() < deadline:
            time.sleep(0.02)
    _run("ip", "netns", "del", ns, check=False)


def sweep(*, everything_of: str | None = None) -> list[str]:
    """Remove namespaces and shm roots of labs whose owner process is gone (or, with
    ``everything_of``, of that lab id). Returns the namespaces removed."""
    removed = []
    for line in _run("ip", "netns", "list", check=False).stdout.splitlines():
        ns = line.split()[0] if line.strip() else ""
        m = _NAME.match(ns)
        if not m:
            continue
        lab_id = f"{m[1]}-{m[2]}"
        if lab_id == everything_of or (everything_of is None and not _pid_alive(int(m[1]))):
            _kill_namespace(ns)
            removed.append(ns)
    for entry in Path("/dev/shm").glob(f"{PREFIX}-*"):
        m = _NAME.match(entry.name + "-")
        if m and (f"{m[1]}-{m[2]}" == everything_of or not _pid_alive(int(m[1]))):
            shutil.rmtree(entry, ignore_errors=True)
    return removed


class LabDaemon(DaemonProc):
    """A node's daemon, started inside the node's namespace; dies with the starting thread."""

    def start(self) -> LabDaemon:
        self.spawn()
        self.wait_ready()
        return self

    def spawn(self) -> None:
        """Start the process without waiting for it (:meth:`wait_ready`): a lab starts its
        daemons together, each importing and joining on its own core time."""
        cmd = [*self.wrapper, sys.executable, "-m", "ckptcache.cli", "daemon",
               "--socket", self.socket, "--shm-dir", self.shm_dir, *self.args]  # fmt: skip
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(
            cmd, stdout=log, stderr=log, env={**os.environ, **self.env},
            preexec_fn=_die_with_parent,
        )  # fmt: skip
        log.close()

    def wait_ready(self) -> None:
        """Until the daemon answers on its socket (raises if it exits first)."""
        assert self.proc is not None
        wait_for_socket(self.socket, self.proc)

    def terminate(self) -> None:
        """Send SIGTERM without waiting (:meth:`kill` then reaps it): a lab stops its daemons
        together."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the daemon and reap it; a SIGTERM that is not obeyed in 10 s becomes a
        SIGKILL (a partitioned daemon may be stuck in a long network timeout)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def cleanup(self) -> None:
        self.kill(signal.SIGTERM)
        shutil.rmtree(self.shm_dir, ignore_errors=True)


@dataclass
class LabNode:
    """One emulated node: its namespace, address, NIC rate and daemon."""

    index: int
    ns: str
    ip: str
    mbit: float
    daemon: LabDaemon
    #: The hub-side end of this node's veth (shaped: traffic towards the node).
    hub_port: str = ""

    @property
    def node_id(self) -> str:
        return f"node{self.index}"

    @property
    def socket(self) -> str:
        return self.daemon.socket

    def exec_argv(self, *argv: str) -> list[str]:
        """``argv`` as a command run inside this node's namespace."""
        return ["ip", "netns", "exec", self.ns, *argv]


@dataclass
class Lab:
    """N nodes, etcd and an S3 endpoint, each in its own network namespace.

    Call order: :meth:`start` (or use as a context manager), then any verbs
    (:meth:`partition`, :meth:`lose`, :meth:`refuse_coordinator`, :meth:`heal`, :meth:`kill`,
    :meth:`restart`, :meth:`throttle`, :meth:`throttle_storage`, and for etcd's members
    :meth:`kill_etcd_member`, :meth:`restart_etcd_member`, :meth:`isolate_etcd_member`), then
    :meth:`stop`, which always removes everything.
    """

    n_nodes: int
    node_mbit: float = 400.0
    storage_mbit: float = 800.0
    workdir: Path | None = None
    lease_ttl: float = 2.0
    #: The daemons' ``dead_peer_timeout`` (seconds; the daemon's default is 10).
    dead_peer_timeout: float = 10.0
    #: Extra YAML for every daemon's config file.
    config: str = ""
    #: Extra daemon arguments (e.g. ``("--backup", "none")``).
    daemon_args: tuple[str, ...] = ()
    memory_limit: str = "512MiB"
    #: etcd members: 1 (no gateway) or 3 (a gateway on every node).
    etcd_members: int = 1
    lab_id: str = field(default_factory=lambda: f"{os.getpid()}-{uuid.uuid4().hex[:6]}")
    nodes: list[LabNode] = field(default_factory=list)
    _procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _etcd: list[subprocess.Popen[bytes] | None] = field(default_factory=list)
    _s3_proc: subprocess.Popen[bytes] | None = None
    _namespaces: list[str] = field(default_factory=list)
    _own_workdir: bool = False
    _s3_client: Any = None

    # ---- names and addresses -------------------------------------------------------------

    def ns(self, role: str) -> str:
        """The namespace name of ``role`` ("hub", "etcd", "s3", "n0", ...)."""
        return f"{PREFIX}-{self.lab_id}-{role}"

    @property
    def etcd_url(self) -> str:
        """What the daemons are given: etcd itself, or (three members) their gateway."""
        if self.etcd_members > 1:
            return f"etcd://127.0.0.1:{GATEWAY_PORT}"
        return f"etcd://{ETCD_IP}:{ETCD_PORT}"

    @property
    def etcd_ips(self) -> tuple[str, ...]:
        return ETCD_IPS[: self.etcd_members]

    def etcd_role(self, member: int) -> str:
        """The namespace role of etcd member ``member`` ("etcd", "etcd1", "etcd2")."""
        return "etcd" if member == 0 else f"etcd{member}"

    @property
    def s3_endpoint(self) -> str:
        return f"http://{S3_IP}:{S3_PORT}"

    @property
    def persist_root(self) -> str:
        return f"s3://{BUCKET}/run"

    # ---- bring up and tear down ----------------------------------------------------------

    def __enter__(self) -> Lab:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> Lab:
        """Namespaces, links, etcd, S3 (bucket ``lab``, versioned) and every node's daemon."""
        why = lab_available()
        if why:
            raise RuntimeError(why)
        if self.etcd_members not in (1, 3):
            raise ValueError(f"etcd_members must be 1 or 3, not {self.etcd_members}")
        sweep()  # leftovers of killed runs
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix=f"{PREFIX}-{self.lab_id}-"))
            self._own_workdir = True
        self.workdir.mkdir(parents=True, exist_ok=True)  # a --workdir that does not exist yet
        try:
            self._make_hub()
            # The processes start together and are waited for afterwards: most of a start is
            # Python importing (moto, the daemons), which the cores do side by side. Daemons
            # join etcd as they start, so they follow it; storage they reach only when asked.
            for member in range(self.etcd_members):
                self._start_etcd(member)
            self._start_s3()
            for member in range(self.etcd_members):
                self.wait_etcd(member)
            for i in range(self.n_nodes):
                self._start_node(i)
            assert self._s3_proc is not None
            self._wait_http("s3", f"{self.s3_endpoint}/moto-api/", self._s3_proc)
            self._make_bucket()
            for node in self.nodes:
                node.daemon.wait_ready()
            self.wait_formed()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop every process, delete every namespace (with its links, qdiscs and rules)."""
        for node in self.nodes:  # all at once: each daemon's shutdown takes its own time
            with contextlib.suppress(Exception):
                node.daemon.terminate()
        for node in self.nodes:
            with contextlib.suppress(Exception):
                node.daemon.cleanup()
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
                # A process in uninterruptible IO (the S3 server writing an object on a
                # loaded machine) dies later: its namespace's teardown below waits for it.
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10)
        for ns in reversed(self._namespaces):
            _kill_namespace(ns)
        self._namespaces.clear()
        sweep(everything_of=self.lab_id)
        if self._own_workdir and self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _add_ns(self, role: str) -> str:
        ns = self.ns(role)
        _run("ip", "netns", "add", ns)
        self._namespaces.append(ns)
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        return ns

    def _make_hub(self) -> None:
        hub = self._add_ns("hub")
        _run("ip", "-n", hub, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", hub, "link", "set", "br0", "up")

    def _plug(self, role: str, ip: str, mbit: float | None) -> str:
        """A namespace for ``role`` with ``eth0`` at ``ip`` wired into the hub's bridge,
        shaped to ``mbit`` both ways (None: unshaped). Returns the namespace."""
        ns = self._add_ns(role)
        hub = self.ns("hub")
        port = f"p-{role}"
        _run("ip", "-n", hub, "link", "add", port, "type", "veth", "peer", "name", "eth0",
             "netns", ns)  # fmt: skip
        _run("ip", "-n", hub, "link", "set", port, "master", "br0", "up")
        _run("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        if mbit is not None:
            _shape(ns, "eth0", mbit, "add")
            _shape(hub, port, mbit, "add")
        return ns

    def _etcd_name(self, member: int) -> str:
        return "lab" if member == 0 else f"lab{member}"

    def _start_etcd(self, member: int) -> None:
        """Member ``member``'s namespace (the first call) and process (every call: a restart
        after :meth:`kill_etcd_member` keeps its data, as a rebooted host does)."""
        assert self.workdir is not None
        role, ip = self.etcd_role(member), ETCD_IPS[member]
        ns = self.ns(role)
        if ns not in self._namespaces:
            self._plug(role, ip, None)
        client, peer = f"http://{ip}:{ETCD_PORT}", f"http://{ip}:2380"
        cluster = ",".join(
            f"{self._etcd_name(m)}=http://{ETCD_IPS[m]}:2380" for m in range(self.etcd_members)
        )
        # Its data on tmpfs: etcd fsyncs every write, and on this shared VM's disk an fsync
        # can take tens of milliseconds, a cost of the lab's disk that every election and
        # in-flight announcement of a restore paid. (Removed by stop() and sweep().)
        data = Path(f"/dev/shm/{PREFIX}-{self.lab_id}-{role}")
        cmd = ["ip", "netns", "exec", ns, "etcd", "--data-dir", str(data),
               "--name", self._etcd_name(member),
               "--listen-client-urls", client, "--advertise-client-urls", client,
               "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
               "--initial-cluster", cluster, "--initial-cluster-token", self.lab_id]  # fmt: skip
        log = self.workdir / ("etcd.log" if member == 0 else f"{role}.log")
        proc = self._spawn(cmd, log)
        while len(self._etcd) <= member:
            self._etcd.append(None)
        self._etcd[member] = proc

    def wait_etcd(self, member: int) -> None:
        """Until member ``member`` answers (its /health: a member of a cluster that has a
        leader)."""
        proc = self._etcd[member]
        assert proc is not None
        ip = ETCD_IPS[member]
        self._wait_http(self.etcd_role(member), f"http://{ip}:{ETCD_PORT}/health", proc)

    def _start_s3(self) -> None:
        assert self.workdir is not None
        ns = self._plug("s3", S3_IP, self.storage_mbit)
        # moto's server, serving ranged GETs by seek and read (tests/lab_s3.py): stock moto
        # reads the whole object for every range, a cost real storage does not have.
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "tests.lab_s3",
               "-H", S3_IP, "-p", str(S3_PORT)]  # fmt: skip
        self._s3_proc = self._spawn(cmd, self.workdir / "s3.log", cwd=REPO)

    def _wait_http(self, role: str, url: str, proc: subprocess.Popen[bytes]) -> None:
        _wait_http(self.ns(role), url, proc)

    def _make_bucket(self) -> None:
        def make_bucket() -> None:
            s3 = self._boto3()
            s3.create_bucket(Bucket=BUCKET)
            s3.put_bucket_versioning(
                Bucket=BUCKET, VersioningConfiguration={"Status": "Enabled"}
            )  # every write of an object is a version: the tests count them

        in_netns(self.ns("s3"), make_bucket)

    def _spawn(
        self, cmd: list[str], log_path: Path, cwd: Path | None = None
    ) -> subprocess.Popen[bytes]:
        log = open(log_path, "ab")  # noqa: SIM115 - owned by the child
        env = {**os.environ, **S3_ENV}
        proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=env, cwd=cwd,
                                preexec_fn=_die_with_parent)  # fmt: skip
        log.close()
        self._procs.append(proc)
        return proc

    def _config_file(self) -> Path:
        assert self.workdir is not None
        cfg = self.workdir / "cluster.yaml"
        if not cfg.exists():
            cfg.write_text(
                f"lease_ttl: {self.lease_ttl}\ndead_peer_timeout: {self.dead_peer_timeout}\n"
                f"persist_retries: 1000\npersist_backoff: 0.2\n"
                f"persist_backoff_max: 0.5\nsecret: lab-secret\n{self.config}"
            )
        return cfg

    def _start_node(self, i: int) -> None:
        assert self.workdir is not None
        ip = f"{SUBNET}.{11 + i}"
        ns = self._plug(f"n{i}", ip, self.node_mbit)
        workdir = self.workdir / f"node{i}"
        workdir.mkdir(exist_ok=True)
        if self.etcd_members > 1:
            # The node's own gateway: a TCP proxy that moves to the next member when one
            # refuses or is gone (not when one is cut off from its peers: that member still
            # answers, with errors or not at all, until the request times out).
            endpoints = ",".join(f"{m}:{ETCD_PORT}" for m in self.etcd_ips)
            self._spawn(["ip", "netns", "exec", ns, "etcd", "gateway", "start",
                         "--endpoints", endpoints, "--retry-delay", "1s",
                         "--listen-addr", f"127.0.0.1:{GATEWAY_PORT}"],
                        workdir / "gateway.log")  # fmt: skip
        args = ["--config", str(self._config_file()), "--coordinator", self.etcd_url,
                "--cluster", "lab", "--listen", f"{ip}:{DATA_PORT}", "--node-id", f"node{i}",
                "--host", f"host{i}", "--backup", "auto", "--memory-limit", self.memory_limit,
                "--persist-root", self.persist_root, "--s3-endpoint-url", self.s3_endpoint,
                *self.daemon_args]  # fmt: skip
        daemon = LabDaemon(
            workdir, f"/dev/shm/{PREFIX}-{self.lab_id}-n{i}", args, dict(S3_ENV),
            wrapper=["ip", "netns", "exec", ns],
        )  # fmt: skip
        node = LabNode(i, ns, ip, self.node_mbit, daemon, hub_port=f"p-n{i}")
        self.nodes.append(node)
        daemon.spawn()  # Lab.start waits for it, once every process is on its way

    def wait_formed(self, timeout: float = 60.0) -> None:
        """Until every live node sees every live node in its membership."""
        live = [n for n in self.nodes if n.daemon.proc and n.daemon.proc.poll() is None]
        deadline = time.monotonic() + timeout
        while True:
            try:
                if all(len(n.daemon.status().cluster_nodes) == len(live) for n in live):
                    return
            except Exception:
                pass  # a daemon still starting
            if time.monotonic() > deadline:
                raise TimeoutError("the lab's cluster did not form")
            time.sleep(0.1)

    # ---- verbs ---------------------------------------------------------------------------

    def partition(
        self, node: LabNode, *, direction: str = "both", peers: Iterable[Any] | None = None
    ) -> None:
        """Drop ``node``'s traffic: ``direction`` "both", "in" (it hears nothing) or "out"
        (nothing it sends arrives); ``peers`` limits it to those members (LabNodes, or
        "etcd" / "s3"), default everyone. Rules add up until :meth:`heal`."""
        if direction not in ("both", "in", "out"):
            raise ValueError(f"direction must be both, in or out, not {direction!r}")
        ips = None if peers is None else [ip for p in peers for ip in self._ips_of(p)]
        _ensure_table(node.ns)
        if direction in ("both", "in"):
            match = f"ip saddr {{ {', '.join(ips)} }}" if ips else 'iifname "eth0"'
            _nft(node.ns, f"add rule inet lab in {match} drop")
        if direction in ("both", "out"):
            match = f"ip daddr {{ {', '.join(ips)} }}" if ips else 'oifname "eth0"'
            _nft(node.ns, f"add rule inet lab out {match} drop")

    def partition_coordinator(self, nodes: Iterable[LabNode]) -> None:
        """Cut etcd off from ``nodes`` (both ways); they still reach each other and S3."""
        for node in nodes:
            self.partition(node, peers=["etcd"])

    def lose(self, node: LabNode, percent: int) -> None:
        """Drop ``percent`` % of the packets ``node`` sends and of those it receives, each
        packet drawn at random (both ways: data and its ACKs). Until :meth:`heal`."""
        if not 0 < percent < 100:
            raise ValueError(f"percent must be in 1..99, not {percent}")
        _ensure_table(node.ns)
        for chain, match in (("in", 'iifname "eth0"'), ("out", 'oifname "eth0"')):
            _nft(node.ns, f"add rule inet lab {chain} {match} numgen random mod 100 < "
                          f"{percent} drop")  # fmt: skip

    def refuse_coordinator(self, node: LabNode) -> None:
        """etcd refuses ``node`` at once: every connection it opens to etcd (or to its
        gateway) and every packet of one already open is answered with a TCP reset, as
        from a host whose etcd is down. Until :meth:`heal`."""
        _ensure_table(node.ns)
        _nft(node.ns, f"add rule inet lab out tcp dport {{ {ETCD_PORT}, {GATEWAY_PORT} }} "
                      "reject with tcp reset")  # fmt: skip

    def heal(self, node: LabNode | None = None) -> None:
        """Remove the rules of ``node`` (default: of every node and every etcd member)."""
        for n in [node] if node is not None else self.nodes:
            _nft(n.ns, "flush table inet lab", check=False)
        if node is None:
            for member in range(self.etcd_members):
                _nft(self.ns(self.etcd_role(member)), "flush table inet lab", check=False)

    # ---- etcd members ----------------------------------------------------------------------

    def etcd_leader(self, timeout: float = 30.0) -> int:
        """The index of the member that leads etcd now (asked of every live member until
        one names a leader it can see)."""
        import json
        import urllib.request

        deadline = time.monotonic() + timeout
        while True:
            ids: dict[int, int] = {}
            leader = 0
            for member, ip in enumerate(self.etcd_ips):
                proc = self._etcd[member]
                if proc is None or proc.poll() is not None:
                    continue

                def status(ip: str = ip) -> Any:
                    req = urllib.request.Request(
                        f"http://{ip}:{ETCD_PORT}/v3/maintenance/status", data=b"{}",
                        method="POST",
                    )  # fmt: skip
                    return json.loads(urllib.request.urlopen(req, timeout=2).read())

                try:
                    out = in_netns(self.ns(self.etcd_role(member)), status)
                except OSError:
                    continue
                ids[int(out["header"]["member_id"])] = member
                leader = leader or int(out.get("leader", 0))
            if leader in ids:
                return ids[leader]
            if time.monotonic() > deadline:
                raise TimeoutError("no etcd member names a leader")
            time.sleep(0.2)

    def kill_etcd_member(self, member: int) -> None:
        """kill -9 etcd member ``member`` (its data stays: :meth:`restart_etcd_member`)."""
        proc = self._etcd[member]
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)

    def restart_etcd_member(self, member: int) -> None:
        """Start member ``member`` again on its data and wait until it answers."""
        self.kill_etcd_member(member)
        self._start_etcd(member)
        self.wait_etcd(member)

    def etcd_member_alive(self, member: int) -> bool:
        proc = self._etcd[member]
        return proc is not None and proc.poll() is None

    def isolate_etcd_member(self, member: int) -> None:
        """Cut member ``member`` off from the other members (both ways); the nodes still
        reach it. Until :meth:`heal`."""
        ns = self.ns(self.etcd_role(member))
        others = ", ".join(ip for m, ip in enumerate(self.etcd_ips) if m != member)
        _ensure_table(ns)
        _nft(ns, f"add rule inet lab in ip saddr {{ {others} }} drop")
        _nft(ns, f"add rule inet lab out ip daddr {{ {others} }} drop")

    def kill(self, node: LabNode) -> None:
        """kill -9 the node's daemon (its segments stay in shared memory, as on a host)."""
        node.daemon.kill(signal.SIGKILL)

    def restart(self, node: LabNode) -> None:
        """Start the node's daemon again (after :meth:`kill`); it re-joins the cluster."""
        node.daemon.kill(signal.SIGKILL)
        node.daemon.start()

    def throttle(self, node: LabNode, mbit: float) -> None:
        """Change the node's NIC rate (both ways) now, also in the middle of a transfer."""
        _shape(node.ns, "eth0", mbit, "change")
        _shape(self.ns("hub"), node.hub_port, mbit, "change")
        node.mbit = mbit

    def throttle_storage(self, mbit: float) -> None:
        """Change the shared storage NIC rate now."""
        _shape(self.ns("s3"), "eth0", mbit, "change")
        _shape(self.ns("hub"), "p-s3", mbit, "change")
        self.storage_mbit = mbit

    # ---- access from the test process -------------------------------------------------

    def _ips_of(self, peer: Any) -> list[str]:
        if isinstance(peer, LabNode):
            return [peer.ip]
        return {"etcd": list(self.etcd_ips), "s3": [S3_IP]}[peer]

    def _boto3(self) -> Any:
        """One boto3 client for the test process (thread-safe; building one costs tens of
        milliseconds of CPU, which a test polling storage would pay on every poll). Its
        connections are opened by the threads that call it, and those run in the storage
        namespace (:meth:`s3`), so every connection belongs to that namespace."""
        if self._s3_client is None:
            import boto3

            self._s3_client = boto3.client(
                "s3", endpoint_url=self.s3_endpoint, region_name="us-east-1",
                aws_access_key_id="lab", aws_secret_access_key="lab",
            )  # fmt: skip
        return self._s3_client

    def s3(self, fn: Callable[[Any], T]) -> T:
        """``fn(boto3 client)`` run from inside the storage namespace (not shaped: it talks to
        the server over that namespace's own address)."""
        return in_netns(self.ns("s3"), lambda: fn(self._boto3()))

    def key_of(self, url: str) -> str:
        """The S3 key of ``s3://lab/<key>``."""
        return url.removeprefix(f"s3://{BUCKET}/")

    def versions(self, url: str) -> int:
        """How many times ``url`` was written to storage (the bucket is versioned)."""
        key = self.key_of(url)
        out = self.s3(lambda s3: s3.list_object_versions(Bucket=BUCKET, Prefix=key))
        return sum(1 for v in out.get("Versions", []) if v["Key"] == key)

    def get(self, url: str) -> bytes:
        """The newest stored bytes of ``url``."""
        key = self.key_of(url)
        return self.s3(lambda s3: s3.get_object(Bucket=BUCKET, Key=key)["Body"].read())

    def put(self, url: str, data: bytes) -> None:
        """Store ``data`` at ``url`` directly (a checkpoint written without any daemon)."""
        key = self.key_of(url)
        self.s3(lambda s3: s3.put_object(Bucket=BUCKET, Key=key, Body=data))

    def describe(self) -> str:
        """How to reach each node by hand."""
        lines = [
            f"lab {self.lab_id}: {self.n_nodes} nodes at {self.node_mbit:g} Mbit/s, "
            f"storage {self.storage_mbit:g} Mbit/s shared",
            f"  etcd   {self.etcd_url}  (namespace {self.ns('etcd')})",
            f"  s3     {self.s3_endpoint}  bucket {BUCKET}  (namespace {self.ns('s3')}, "
            f"credentials lab/lab)",
        ]
        for n in self.nodes:
            lines.append(
                f"  {n.node_id}  {n.ip}  ip netns exec {n.ns} "
                f"env CKPTCACHE_SOCKET={n.socket} {sys.executable} -m ckptcache.cli status"
            )
        return "\n".join(lines)


def _ensure_table(ns: str) -> None:
    """An ``inet lab`` table with input and output filter chains in ``ns`` (idempotent)."""
    _nft(ns, "add table inet lab")
    _nft(ns, "add chain inet lab in { type filter hook input priority 0 ; policy accept ; }")
    _nft(ns, "add chain inet lab out { type filter hook output priority 0 ; policy accept ; }")


def _nft(ns: str, rule: str, check: bool = True) -> None:
    _run("ip", "netns", "exec", ns, "nft", *rule.split(), check=check)


def _shape(ns: str, dev: str, mbit: float, verb: str) -> None:
    """tbf at ``mbit`` on egress of ``dev`` in ``ns``. The bucket holds ~4 ms of traffic and at
    least 64 KiB: a veth hands tbf whole 64 KiB GSO packets, and a bucket smaller than one
    would make tbf split (or drop) them.

    The queue holds ``LINK_QUEUE`` of traffic, at least two such packets. A Linux host's own
    queue (fq_codel, which this kernel lacks) keeps each flow's delay near 5 ms and ACKs out
    of bulk data's way; one deep FIFO would hold a node's ACKs behind its own upload, so a
    node that relays while it receives would receive well below its link rate.
    """
    rate_bytes = mbit * 1e6 / 8
    burst = max(64 << 10, int(rate_bytes * 0.004))
    limit = max(2 * burst, int(rate_bytes * LINK_QUEUE))
    _run("tc", "-n", ns, "qdisc", verb, "dev", dev, "root", "tbf", "rate", f"{mbit:g}mbit",
         "burst", str(burst), "limit", str(limit))  # fmt: skip


def _wait_http(ns: str, url: str, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    """Until ``url`` answers from inside ``ns``."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        try:
            in_netns(ns, lambda: urllib.request.urlopen(url, timeout=1).read())
            return
        except urllib.error.HTTPError:
            return  # it answered
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"{url} did not come up in {ns}") from None
            time.sleep(0.1)


@contextlib.contextmanager
def running_lab(n_nodes: int, **kwargs: Any) -> Iterator[Lab]:
    """A started :class:`Lab`, always stopped afterwards."""
    lab = Lab(n_nodes, **kwargs).start()
    try:
        yield lab
    finally:
        lab.stop()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """Bring up a lab by hand; print how to reach it; tear it down on Ctrl-C or SIGTERM."""
    parser = argparse.ArgumentParser(prog="python -m tests.lab", description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--node-mbit", type=float, default=400.0)
    parser.add_argument("--storage-mbit", type=float, default=800.0)
    parser.add_argument("--lease-ttl", type=float, default=2.0)
    parser.add_argument("--dead-peer-timeout", type=float, default=10.0)
    parser.add_argument("--etcd-members", type=int, default=1, choices=(1, 3))
    parser.add_argument("--sweep", action="store_true", help="only remove leftovers, then exit")
    args = parser.parse_args(argv)
    if args.sweep:
        print("\n".join(sweep()) or "nothing left over")
        return 0
    signal.signal(signal.SIGTERM, _interrupt)  # unwinds like Ctrl-C: the teardown runs
    with running_lab(args.nodes, node_mbit=args.node_mbit, storage_mbit=args.storage_mbit,
                     lease_ttl=args.lease_ttl,
                     dead_peer_timeout=args.dead_peer_timeout,
                     etcd_members=args.etcd_members) as lab:  # fmt: skip
        print(lab.describe(), flush=True)
        print("Ctrl-C tears it down.", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)
    print("removed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
