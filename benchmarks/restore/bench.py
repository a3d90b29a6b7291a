"""Restore at scale: N nodes loading one object from storage, with and without broadcast.

    python benchmarks/restore/bench.py --size 1GiB --nodes 1 2 4

"broadcast": N daemons on one etcd; the first to ask reads storage, the others pull from the
nodes that already hold it. "each reads storage": N concurrent torch.load calls of the file
(its pages are in the page cache: the most favourable case for the baseline). Also:
local-memory and peer-memory loads vs torch.load of the same file. Needs etcd-server.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from ckptcache._units import parse_bytes
from ckptcache.cli.benchmarking import (
    DaemonHandle,
    EtcdServer,
    Row,
    format_table,
    make_state,
    running_cluster,
    running_s3,
)
from ckptcache.client import Client

ROUND_TRIPS: dict[str, list[str]] = {}  # scenario -> "source:count" of each node's remote load


def round_trips(handles: list[DaemonHandle]) -> list[str]:
    """Each daemon's logged remote loads: ``source:coordinator round trips``."""
    found = []
    for h in handles:
        text = (Path(h.socket).parent / "daemon.log").read_text(errors="replace")
        found += [f"{m[1]}:{m[2]}" for m in re.finditer(
            r"remote load of \S+: (\w+), (\d+) coordinator round trips", text)]  # fmt: skip
    return sorted(found)


@contextlib.contextmanager
def cluster(
    n: int, etcd: EtcdServer, root: Path, budget: int
) -> Iterator[tuple[list[Client], list[DaemonHandle]]]:
    args = ("--persist-root", str(root), "--memory-limit", str(budget))
    with contextlib.ExitStack() as stack:
        handles = stack.enter_context(running_cluster(n, etcd.url, *args))
        yield [stack.enter_context(Client(h.socket, fallback="raise")) for h in handles], handles


def parallel(fns: list) -> float:
    t0 = time.perf_counter()
    threads = [threading.Thread(target=f) for f in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def each_reads_storage(n: int, path: Path) -> float:
    """N readers of the same file at once (threads: torch.load releases the GIL in its copies)."""
    return parallel([lambda: torch.load(path, mmap=False) for _ in range(n)])


def single_node_rows(nbytes: int, etcd: EtcdServer, root: Path, rounds: int) -> list[Row]:
    """Item 1 on its own: one node loads an object it has never seen, next to ``torch.load``
    of the same file, interleaved round by round (fresh files each round: the daemon has no
    copy; their pages are in the page cache for both sides); medians."""
    state = make_state(nbytes)
    direct, private, mapped = [], [], []
    with cluster(1, etcd, root, 4 * nbytes) as ((client,), _):
        for r in range(rounds):
            files = [root / "single" / f"r{r}-{k}.pt" for k in range(2)]
            files[0].parent.mkdir(exist_ok=True)
            for f in files:
                torch.save(state, f)
            t0 = time.perf_counter()
            torch.load(files[0], mmap=False)
            direct.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            client.load(files[0], mmap=False)
            private.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            client.load(files[1])
            mapped.append(time.perf_counter() - t0)
            for f in files:
                client.delete(f)
                f.unlink()
    med = statistics.median
    return [
        Row("torch.load of the file (private copy, page cache warm)", nbytes, med(direct)),
        Row("1 node, uncached, private copy (mmap=False)", nbytes, med(private)),
        Row("1 node, uncached, zero-copy load (maps the segment)", nbytes, med(mapped)),
    ]


def s3_rows(nbytes: int, nodes: list[int], etcd: EtcdServer, work: Path) -> list[Row]:
    """The same race with S3 (moto's server on loopback) as the storage all nodes share."""
    import io
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's per-request lines
    server = contextlib.ExitStack()
    endpoint, s3 = server.enter_context(running_s3("restore"))
    buf = io.BytesIO()
    torch.save(make_state(nbytes), buf)
    rows = []
    try:
        for n in nodes:
            key = f"n{n}/model.pt"
            s3.put_object(Bucket="restore", Key=key, Body=buf.getvalue())
            url = f"s3://restore/{key}"
            args = ("--persist-root", "s3://restore/", "--s3-endpoint-url", endpoint,
                    "--memory-limit", str(3 * nbytes))  # fmt: skip
            with contextlib.ExitStack() as stack:
                handles = stack.enter_context(running_cluster(n, etcd.url, *args))
                clients = [stack.enter_context(Client(h.socket, fallback="raise")) for h in handles]
                secs = parallel([lambda c=c, u=url: c.load(u, mmap=False) for c in clients])
                ROUND_TRIPS[f"S3, N = {n}"] = round_trips(handles)
            rows.append(Row(f"S3: {n} node(s), broadcast", nbytes, secs))

            def read_s3(k: str = key) -> None:
                body = s3.get_object(Bucket="restore", Key=k)["Body"].read()
                torch.load(io.BytesIO(body))

            rows.append(Row(f"S3: {n} node(s), each reads S3", nbytes, parallel([read_s3] * n)))
    finally:
        server.close()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="1GiB")
    p.add_argument("--nodes", nargs="+", type=int, default=[1, 2, 4])
    p.add_argument("--s3-size", default="128MiB", help="object size for the S3 race (0: skip)")
    p.add_argument("--single-rounds", type=int, default=5,
                   help="rounds of the single-node uncached load (0: skip)")  # fmt: skip
    args = p.parse_args()
    nbytes = parse_bytes(args.size)
    work = Path(tempfile.mkdtemp(prefix="ckptcache-restore-", dir="/var/tmp"))
    os.environ.setdefault("CKPTCACHE_CLUSTER_SECRET", "bench-secret")
    etcd = EtcdServer(work / "etcd").start()
    state = make_state(nbytes)
    rows: list[Row] = []
    try:
        root = work / "ckpt"
        root.mkdir()
        for n in args.nodes:
            path = root / f"n{n}" / "model.pt"
            path.parent.mkdir()
            torch.save(state, path)
            with cluster(n, etcd, root, 3 * nbytes) as (clients, handles):
                secs = parallel([lambda c=c, p=path: c.load(p, mmap=False) for c in clients])
                tiers = sorted(c.status(path).last_load_tier for c in clients)
                ROUND_TRIPS[f"file system, N = {n}"] = round_trips(handles)
                if n == 1:  # the same uncached load, the trainer mapping the segment
                    fresh = root / "n1" / "fresh.pt"
                    torch.save(state, fresh)
                    t0 = time.perf_counter()
                    clients[0].load(fresh)
                    mapped = time.perf_counter() - t0
            rows.append(Row(f"{n} node(s), broadcast ({'/'.join(tiers)})", nbytes, secs))
            if n == 1:
                rows.append(Row("1 node, uncached, zero-copy load (maps the segment)", nbytes,
                                mapped))  # fmt: skip
            rows.append(Row(f"{n} node(s), each torch.load from storage", nbytes,
                            each_reads_storage(n, path)))  # fmt: skip
        path = root / "tiers.pt"
        torch.save(state, path)
        with cluster(2, etcd, root, 3 * nbytes) as ((a, b), _):
            a.load(path)  # into a's memory (from storage)
            t0 = time.perf_counter()
            b.load(path, mmap=False)
            peer = time.perf_counter() - t0
            t0 = time.perf_counter()
            a.load(path, mmap=False)
            local = time.perf_counter() - t0
        t0 = time.perf_counter()
        torch.load(path, mmap=False)
        plain = time.perf_counter() - t0
        rows.append(Row("torch.load of the file (page cache warm)", nbytes, plain))
        rows.append(Row("ckptcache.load from local memory (private copy)", nbytes, local))
        rows.append(Row("ckptcache.load from a peer's memory (private copy)", nbytes, peer))
        print(f"\n### restore, {args.size}, file system storage\n")
        print(format_table(rows))
        if args.single_rounds:
            single = single_node_rows(nbytes, etcd, root, args.single_rounds)
            print(f"\n### one node, uncached, {args.size} (medians of {args.single_rounds} "
                  "interleaved rounds)\n")  # fmt: skip
            print(format_table(single, limit=single[0], limit_name="torch.load"))
        if parse_bytes(args.s3_size):
            print(f"\n### restore, {args.s3_size}, S3 storage (moto server on loopback)\n")
            print(format_table(s3_rows(parse_bytes(args.s3_size), args.nodes, etcd, work)))
        print("\n### coordinator round trips per remote load (source:count, one per node)\n")
        for scenario, counts in ROUND_TRIPS.items():
            print(f"* {scenario}: {' '.join(counts)}")
    finally:
        etcd.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
