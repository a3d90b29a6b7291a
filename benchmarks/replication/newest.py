"""What "one truth across nodes" costs a save and a load: the cluster's newest-save record.

A cluster node (here one, on a real etcd) reads the record when a save begins, advances it
at the commit (a read and a compare-and-swap) and reads it at every load of the newest
generation. This times small saves and loads from this node's memory on that node next to
the same calls on a daemon without a cluster, interleaved, medians; and counts the
coordinator requests per call from the daemon's own counter.

    python benchmarks/replication/newest.py --size 4MiB --calls 200

Needs Debian's etcd-server.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import socket
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

from ckptcache._units import parse_bytes
from ckptcache.cli.benchmarking import EtcdServer, make_state, running_cluster, running_daemon
from ckptcache.client import Client

PATH = "/bench/newest.pt"


def _requests(metrics_url: str) -> int:
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    pattern = r"^ckptcache_coordinator_requests_total\{[^}]*\} (\S+)"
    return sum(int(float(v)) for v in re.findall(pattern, text, re.M))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _timed(fn, calls: int) -> list[float]:  # type: ignore[no-untyped-def]
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="4MiB")
    p.add_argument("--calls", type=int, default=200)
    args = p.parse_args()
    state = make_state(parse_bytes(args.size))
    work = Path(tempfile.mkdtemp(prefix="ckptcache-newest-", dir="/var/tmp"))
    os.environ.setdefault("CKPTCACHE_CLUSTER_SECRET", "bench-secret")
    etcd = EtcdServer(work / "etcd").start()
    times: dict[str, list[float]] = {}
    per_call: dict[str, float] = {}
    try:
        with contextlib.ExitStack() as stack:
            port = _free_port()  # the node's Prometheus counters
            (node,) = stack.enter_context(running_cluster(1, etcd.url, "--backup", "none",
                                                          "--metrics-port", str(port)))  # fmt: skip
            alone = stack.enter_context(running_daemon())
            clients = {
                "cluster node": stack.enter_context(Client(node.socket, fallback="raise")),
                "daemon without a cluster": stack.enter_context(
                    Client(alone.socket, fallback="raise")
                ),
            }
            metrics = f"http://127.0.0.1:{port}/metrics"
            for c in clients.values():
                c.save(state, "/bench/newest.pt", durability="memory")
                c.load("/bench/newest.pt")
            for _ in range(4):  # interleaved rounds
                for name, c in clients.items():
                    before = _requests(metrics) if name == "cluster node" else 0
                    save = lambda c=c: c.save(state, PATH, durability="memory")  # noqa: E731
                    saves = _timed(save, args.calls // 4)
                    mid = _requests(metrics) if name == "cluster node" else 0
                    loads = _timed(lambda c=c: c.load(PATH), args.calls // 4)
                    after = _requests(metrics) if name == "cluster node" else 0
                    times.setdefault(f"save, {name}", []).extend(saves)
                    times.setdefault(f"load, {name}", []).extend(loads)
                    if name == "cluster node":
                        per_call["save"] = (mid - before) / len(saves)
                        per_call["load"] = (after - mid) / len(loads)
    finally:
        etcd.stop()
    print(f"\n### newest-save record ({args.size}, {args.calls} calls each, medians)\n")
    print("| call | median (ms) | coordinator requests per call |")
    print("|---|---:|---:|")
    for what, ts in times.items():
        kind = what.split(",")[0]
        requests = f"{per_call[kind]:.2f}" if "cluster node" in what else "0"
        print(f"| {what} | {statistics.median(ts) * 1e3:.2f} | {requests} |")


if __name__ == "__main__":
    main()
