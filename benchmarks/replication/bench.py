"""Backup-copy throughput vs a raw socket, and one persist per group vs N torch.save calls.

    python benchmarks/replication/bench.py --size 512MiB --replicas 1 2 4

Needs Debian's etcd-server (the daemons coordinate through a real etcd on loopback).
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import os
import shutil
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from ckptcache._units import parse_bytes
from ckptcache.benchmarking import (
    EtcdServer,
    Row,
    format_table,
    make_state,
    running_cluster,
    torch_save_fast,
)
from ckptcache.client import Client

SECRET = "bench-secret"


def raw_socket_seconds(nbytes: int) -> float:
    """sendfile from a tmpfs file into recv_into of a pre-faulted mapping: the limit."""
    with tempfile.NamedTemporaryFile(dir="/dev/shm") as src:
        os.posix_fallocate(src.fileno(), 0, nbytes)
        dst = mmap.mmap(-1, nbytes)
        for off in range(0, nbytes, 4096):  # fault the pages in, as a reused segment is
            dst[off] = 0
        server = socket.create_server(("127.0.0.1", 0))
        port = server.getsockname()[1]

        def receive() -> None:
            conn, _ = server.accept()
            view = memoryview(dst)
            while view:
                view = view[conn.recv_into(view) :]
            conn.sendall(b"k")
            conn.close()

        t = threading.Thread(target=receive)
        t.start()
        with socket.create_connection(("127.0.0.1", port)) as s:
            t0 = time.perf_counter()
            off = 0
            while off < nbytes:
                off += os.sendfile(s.fileno(), src.fileno(), off, nbytes - off)
            s.recv(1)
            seconds = time.perf_counter() - t0
        t.join()
        server.close()
        return seconds


@contextlib.contextmanager
def nodes(n: int, etcd: EtcdServer, *extra: str) -> Iterator[list[Client]]:
    with contextlib.ExitStack() as stack:
        handles = stack.enter_context(running_cluster(n, etcd.url, *extra))
        yield [stack.enter_context(Client(h.socket, fallback="raise")) for h in handles]


def bench_backup(nbytes: int, etcd: EtcdServer, rounds: int = 5) -> list[Row]:
    """Raw socket, local save and backup save interleaved round by round (loopback speed drifts
    between runs on this VM); medians. Each save starts with both daemons idle."""
    state = make_state(nbytes)
    budget = str(4 * nbytes + (64 << 20))
    raw, local, backup = [], [], []
    with nodes(2, etcd, "--backup", "auto", "--memory-limit", budget, "--keep", "1") as (a, _):
        path = "/bench/model.pt"

        def timed_save(durability: str) -> float:
            while not a.status(path).digests_valid:
                time.sleep(0.01)
            t0 = time.perf_counter()
            a.save(state, path, durability=durability)
            return time.perf_counter() - t0

        for durability in ("local", "backup"):  # warm both rotations of segments
            a.save(state, path, durability=durability)
            a.save(state, path, durability=durability)
        for _ in range(rounds):
            raw.append(raw_socket_seconds(nbytes))
            local.append(timed_save("local"))
            backup.append(timed_save("backup"))
    med = statistics.median
    return [
        Row("raw socket: sendfile -> recv_into (limit)", nbytes, med(raw)),
        Row("backup copy (save durability=backup - local)", nbytes, med(backup) - med(local)),
        Row("save, durability=local", nbytes, med(local)),
        Row("save, durability=backup", nbytes, med(backup)),
    ]


def bench_group(nbytes: int, n: int, etcd: EtcdServer, root: Path) -> list[Row]:
    state = make_state(nbytes)
    target = root / f"group{n}" / "model.pt"
    extra = ("--persist-root", str(root), "--memory-limit", str(2 * nbytes + (64 << 20)))
    with nodes(n, etcd, *extra) as clients:
        t0 = time.perf_counter()
        for c in clients:
            c.save(state, target)
        for c in clients:
            c.wait(target, timeout=600)
        group = time.perf_counter() - t0
        writers = sum(1 for c in clients if c.status(target).persist_seconds > 0)
    solo = root / f"solo{n}"
    solo.mkdir()
    t0 = time.perf_counter()
    for i in range(n):
        torch_save_fast(state, str(solo / f"replica{i}.pt"))
    independent = time.perf_counter() - t0
    print(f"  group of {n}: {writers} storage write(s) vs {n} for independent torch.save")
    return [
        Row(f"group of {n}: save on all + wait persisted ({writers} write)", nbytes, group),
        Row(f"{n} independent torch.save ({n} writes)", nbytes * n, independent),
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="512MiB")
    p.add_argument("--replicas", nargs="+", type=int, default=[1, 2, 4])
    args = p.parse_args()
    nbytes = parse_bytes(args.size)
    work = Path(tempfile.mkdtemp(prefix="ckptcache-repl-", dir="/var/tmp"))
    os.environ.setdefault("CKPTCACHE_CLUSTER_SECRET", SECRET)
    etcd = EtcdServer(work / "etcd").start()
    try:
        rows = bench_backup(nbytes, etcd)
        print(f"\n### backup copy ({args.size}, loopback)\n")
        print(format_table(rows, limit=rows[0]))
        print(f"\n### one persist per redundancy group ({args.size})\n")
        group_rows: list[Row] = []
        for n in args.replicas:
            group_rows += bench_group(nbytes, n, etcd, work / "ckpt")
        print(format_table(group_rows))
    finally:
        etcd.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
