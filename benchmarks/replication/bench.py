"""Backup-copy throughput vs a raw socket, and one persist per group vs N torch.save calls.

    python benchmarks/replication/bench.py --size 512MiB --replicas 1 2 4
    python benchmarks/replication/bench.py --size 256MiB --replicas   # backup copy only

The backup-copy table also isolates what authenticating every data-plane record costs: the
same loopback transfer through an authenticated :class:`Channel` (Poly1305 tag per 4 MiB
record, checked one record behind the receive position), the same framing with the tags left
out (a benchmark-only subclass: what the records and their helper threads cost without the
MAC), and the one-core speed of the tag and of the other MACs it was chosen against.

Needs Debian's etcd-server (the daemons coordinate through a real etcd on loopback).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import hmac
import mmap
import multiprocessing
import os
import shutil
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from ckptcache._units import parse_bytes
from ckptcache.cli.benchmarking import (
    EtcdServer,
    Row,
    format_table,
    make_state,
    running_cluster,
    torch_save_fast,
)
from ckptcache.client import Client
from ckptcache.server.cluster.dataplane import RECORD_SIZE, Channel

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


class _Untagged(Channel):
    """The data plane's framing and helper threads with an all-zero tag: benchmark only, to
    separate what the MAC costs from what the records cost."""

    @staticmethod
    def _tag(key: bytes, seq: int, head: bytes, payload: object) -> bytes:
        return bytes(16)


def _channel_receiver(nbytes: int, port: int, tagged: bool) -> None:
    """The receiving end of :func:`channel_seconds`, in its own process (as on a peer)."""
    dst = mmap.mmap(-1, nbytes)
    for off in range(0, nbytes, 4096):
        dst[off] = 0
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as the data plane's
    receiver = (Channel if tagged else _Untagged)(sock, b"r" * 32, b"k" * 32)
    receiver.send_bytes(b"ready")
    with memoryview(dst) as view:
        receiver.recv_into(view)
    receiver.send_bytes(b"k")
    receiver.close()


def channel_seconds(nbytes: int, *, tagged: bool = True) -> float:
    """As :func:`raw_socket_seconds`, through an authenticated channel (the data plane's),
    the receiver in another process so that each end has its own interpreter lock.

    The sender passes its mapping of the source, faulted in before the clock starts, as the
    daemon passes a segment's mapping (a fresh mapping would charge populating every page
    table entry of the file to the transfer)."""
    with contextlib.ExitStack() as stack:
        src = stack.enter_context(tempfile.NamedTemporaryFile(dir="/dev/shm"))
        os.posix_fallocate(src.fileno(), 0, nbytes)
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mapping = stack.enter_context(mmap.mmap(src.fileno(), 0, flags=flags, prot=mmap.PROT_READ))
        server = socket.create_server(("127.0.0.1", 0))
        child = multiprocessing.get_context("fork").Process(
            target=_channel_receiver, args=(nbytes, server.getsockname()[1], tagged)
        )
        child.start()
        sock, _ = server.accept()
        server.close()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sender = (Channel if tagged else _Untagged)(sock, b"k" * 32, b"r" * 32)
        sender.recv_bytes()  # the receiver's mapping is faulted in
        t0 = time.perf_counter()
        sender.send_file(src.name, 0, nbytes, mapping)
        sender.recv_bytes()
        seconds = time.perf_counter() - t0
        sender.close()
        child.join()
        return seconds


def _hmac_sha256(key: bytes, seq: int, head: bytes, payload: object) -> bytes:
    mac = hmac.new(key, seq.to_bytes(8, "big") + head, hashlib.sha256)
    mac.update(payload)  # type: ignore[arg-type]
    return mac.digest()[:16]


def _blake2b(key: bytes, seq: int, head: bytes, payload: object) -> bytes:
    mac = hashlib.blake2b(seq.to_bytes(8, "big") + head, key=key, digest_size=16)
    mac.update(payload)  # type: ignore[arg-type]
    return mac.digest()


#: The MACs the data plane's tag was chosen among, each over the same records.
MACS: dict[str, Callable[[bytes, int, bytes, object], bytes]] = {
    "Poly1305 (the data plane's tag)": Channel._tag,
    "HMAC-SHA256 (OpenSSL)": _hmac_sha256,
    "keyed BLAKE2b": _blake2b,
}


def mac_seconds(
    nbytes: int, tag: Callable[[bytes, int, bytes, object], bytes] = Channel._tag
) -> float:
    """One core tagging ``nbytes`` of (faulted-in, not cache-hot) memory in data-plane records:
    the authentication's own limit."""
    buf = mmap.mmap(-1, nbytes)
    for off in range(0, nbytes, 4096):
        buf[off] = 1
    head = b"\0\0\0\0"
    t0 = time.perf_counter()
    with memoryview(buf) as view:
        for seq, start in enumerate(range(0, nbytes, RECORD_SIZE)):
            with view[start : start + RECORD_SIZE] as part:
                tag(b"k" * 32, seq, head, part)
    seconds = time.perf_counter() - t0
    buf.close()
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
    raw, chan, bare, local, backup = [], [], [], [], []
    macs: dict[str, list[float]] = {name: [] for name in MACS}
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
            chan.append(channel_seconds(nbytes))
            bare.append(channel_seconds(nbytes, tagged=False))
            for name, tag in MACS.items():
                macs[name].append(mac_seconds(nbytes, tag))
            local.append(timed_save("local"))
            backup.append(timed_save("backup"))
    med = statistics.median
    return [
        Row("raw socket: sendfile -> recv_into (limit)", nbytes, med(raw)),
        Row("authenticated channel: same transfer, tag per record", nbytes, med(chan)),
        Row("same framing, tags left out (benchmark only)", nbytes, med(bare)),
        *(Row(f"{name}, one core (no transfer)", nbytes, med(t)) for name, t in macs.items()),
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
    p.add_argument("--replicas", nargs="*", type=int, default=[1, 2, 4],
                   help="group sizes for the persist table (none: skip it)")  # fmt: skip
    args = p.parse_args()
    nbytes = parse_bytes(args.size)
    work = Path(tempfile.mkdtemp(prefix="ckptcache-repl-", dir="/var/tmp"))
    os.environ.setdefault("CKPTCACHE_CLUSTER_SECRET", SECRET)
    etcd = EtcdServer(work / "etcd").start()
    try:
        rows = bench_backup(nbytes, etcd)
        print(f"\n### backup copy ({args.size}, loopback)\n")
        print(format_table(rows, limit=rows[0]))
        if args.replicas:
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
