"""Cost of verifying, by default, the bytes that cross a tier: loads from storage and from a
peer's memory with verification on and off, in one run, as ratios.

    python benchmarks/verify/bench.py --size 256MiB --rounds 5

Three scenarios, each round running every variant once, interleaved (medians of the rounds,
after one untimed round that warms imports, threads and the page cache):

* **storage, read by the trainer**: a file this node's daemon does not hold (one daemon, no
  cluster), loaded through the client: ``verify=False`` (the structure only, then
  ``torch.load``: what the default did before) against the default (every record checked as
  it is read into memory), next to ``torch.load`` of the same file. For a file the daemon
  persisted (digest record: xxh3) and for a plain ``torch.save`` file (zip CRC-32s).
* **storage, read by the daemon for its group** (and by ``prefetch``): that read always
  verified; its checks are isolated here in process, the reader with its checks
  (:func:`ckptcache.format.archive_read.read_archive`) against the same parallel ranged
  reads into the same kind of buffer without them.
* **peer memory**: a copy pulled from a peer is verified by the receiving daemon, tensor by
  tensor, as the bytes land. End to end on two daemons (one etcd), next to a raw loopback
  socket moving the same bytes; the receive's hashing isolated in process: the daemon's
  receive (:func:`ckptcache.server.cluster.transfer.receive_object`, each tensor hashed record by
  record as the records are reported in place: on the data plane by the thread that checks
  their tags, here by the receiving thread) against the same receive without it, over
  loopback.

Needs etcd-server for the peer scenario (``--no-peer`` skips it).
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import os
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ckptcache._units import parse_bytes
from ckptcache.cli.benchmarking import (
    EtcdServer,
    make_state,
    raw_socket_seconds,
    running_cluster,
    running_daemon,
)
from ckptcache.client import Client
from ckptcache.codec.flatten import flatten
from ckptcache.codec.objectio import plan_object, write_object
from ckptcache.errors import CheckpointNotFound
from ckptcache.format.archive_read import read_archive
from ckptcache.format.layout import HEADER_SIZE
from ckptcache.format.manifest import compute_digests, pack_digests
from ckptcache.server.cluster.transfer import receive_object
from ckptcache.storage import backend_for

Timed = dict[str, list[float]]


def timed(into: Timed, name: str, fn: Callable[[], object]) -> None:
    t0 = time.perf_counter()
    fn()
    into.setdefault(name, []).append(time.perf_counter() - t0)


def median(into: Timed, name: str) -> float:
    return statistics.median(into[name])


def table(rows: list[tuple[str, float, str]], nbytes: int) -> str:
    lines = ["| operation | time (s) | GB/s | ratio |", "|---|---:|---:|---:|"]
    for what, seconds, ratio in rows:
        lines.append(f"| {what} | {seconds:.4f} | {nbytes / seconds / 1e9:.2f} | {ratio} |")
    return "\n".join(lines)


# ------------------------------------------------------------------ storage, read by the trainer


def trainer_reads(nbytes: int, rounds: int, work: Path) -> str:
    """Loads of files the daemon does not hold, verification off and on, next to torch.load."""
    state = make_state(nbytes)
    root = work / "ckpt"
    root.mkdir()
    persisted, plain = root / "persisted.pt", root / "plain.pt"
    daemon = running_daemon("--persist-root", str(root), "--memory-limit", str(3 * nbytes))
    with daemon as h, Client(h.socket, fallback="raise") as c:
        c.save(state, persisted, durability="persisted")
        c.delete(persisted)  # only storage holds it now: the client reads the file
        torch.save(state, plain)
        return "\n".join([
            _trainer_rows(c, persisted, "persisted by ckptcache (xxh3 digest record)", rounds),
            _trainer_rows(c, plain, "plain torch.save (zip CRC-32s)", rounds),
        ])  # fmt: skip


def _trainer_rows(c: Client, path: Path, kind: str, rounds: int) -> str:
    nbytes = path.stat().st_size
    t: Timed = {}
    for r in range(rounds + 1):
        into: Timed = t if r else {}  # round 0 warms up
        timed(into, "torch", lambda: torch.load(path, mmap=False))
        timed(into, "off", lambda: c.load(path, verify=False))
        timed(into, "on", lambda: c.load(path))
        assert "local" not in c.status(path).stages  # never cached by these loads
    off, on, plain_load = median(t, "off"), median(t, "on"), median(t, "torch")
    return f"\n{kind}, {nbytes >> 20} MiB:\n\n" + table([
        ("`torch.load(mmap=False)` of the file", plain_load, "-"),
        ("`ckptcache.load(verify=False)`: structure only (the old default)", off,
         f"{off / plain_load:.2f}x torch.load"),
        ("`ckptcache.load()`: verified while read (the default)", on,
         f"**{on / off:.2f}x off**, {on / plain_load:.2f}x torch.load"),
    ], nbytes)  # fmt: skip


# ------------------------------------------------------------------ storage, read by the daemon


def _buffer(size: int) -> mmap.mmap:
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def _plain_ranged_read(path: str, view: memoryview, concurrency: int, chunk: int) -> None:
    """The reader's parallel ranged reads, without any check (the "off" side)."""
    backend = backend_for(path)
    ranges = [(off, min(chunk, len(view) - off)) for off in range(0, len(view), chunk)]
    with ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(backend.read_into, path, off, view[off : off + n])
                  for off, n in ranges]:  # fmt: skip
            f.result()


def daemon_reads(nbytes: int, rounds: int, work: Path) -> str:
    """The group reader's checks on and off, in process (the daemon never turns them off)."""
    state = make_state(nbytes)
    plain, persisted = work / "daemon-plain.pt", work / "daemon-persisted.pt"
    torch.save(state, plain)
    daemon = running_daemon("--persist-root", str(work), "--memory-limit", str(3 * nbytes))
    with daemon as h, Client(h.socket, fallback="raise") as c:
        c.save(state, persisted, durability="persisted")
    return "\n".join([
        _daemon_rows(persisted, "persisted by ckptcache", rounds),
        _daemon_rows(plain, "plain torch.save", rounds),
    ])  # fmt: skip


def _daemon_rows(path: Path, kind: str, rounds: int) -> str:
    size = path.stat().st_size
    backend = backend_for(str(path))

    def off(view: memoryview) -> None:
        _plain_ranged_read(str(path), view, 4, 8 << 20)

    def on(view: memoryview) -> None:
        read_archive(backend, str(path), view, concurrency=4, advance=lambda n: None)

    t: Timed = {}
    for r in range(rounds + 1):
        for name, read in (("off", off), ("on", on)):
            buf = _buffer(size)
            view = memoryview(buf)
            for offset in range(0, size, mmap.PAGESIZE):  # faulted in, as a pool segment is
                view[offset] = 0
            timed(t if r else {}, name, lambda: read(view))  # noqa: B023 - called at once
            view.release()
            buf.close()
    t_off, t_on = median(t, "off"), median(t, "on")
    return f"\n{kind}, {size >> 20} MiB (4 reader threads, 8 MiB ranges):\n\n" + table([
        ("parallel ranged reads into a faulted buffer, no check", t_off, "-"),
        ("the same reads, every record checked as it lands", t_on, f"**{t_on / t_off:.2f}x**"),
    ], size)  # fmt: skip


# ------------------------------------------------------------------ peer memory


class _Socket:
    """A loopback socket with the data plane channel's ``recv_into(view, progress)``."""

    def __init__(self, sock: socket.socket):
        self.sock = sock

    def recv_into(self, view: memoryview, progress: Callable[[int], None] | None = None) -> None:
        got = 0
        while got < len(view):
            n = self.sock.recv_into(view[got:], min(len(view) - got, 4 << 20))
            if n == 0:
                raise EOFError("the sender went away")
            got += n
            if progress is not None:
                progress(got)


def _segment(nbytes: int) -> tuple[bytes, object, int]:
    """A segment's body as a peer sends it (payload + manifest, then the digest table)."""
    flat = flatten(make_state(nbytes, seed=3))
    plan = plan_object(flat, "/bench/peer.pt", "default")
    seg = mmap.mmap(-1, plan.layout.nbytes)
    write_object(seg, plan, flat)
    view = memoryview(seg)
    table = pack_digests(compute_digests(view, plan.manifest))
    body = bytes(view[HEADER_SIZE : plan.layout.digest_offset]) + table
    view.release()
    return body, plan.manifest, plan.layout.digest_offset


def _receive(body: bytes, into: Callable[[_Socket, memoryview], None]) -> float:
    server = socket.create_server(("127.0.0.1", 0))
    buf = _buffer(HEADER_SIZE + len(body))
    view = memoryview(buf)
    for off in range(0, len(view), mmap.PAGESIZE):  # a reused segment is faulted in
        view[off] = 0

    def send() -> None:
        with socket.create_connection(server.getsockname()) as s:
            s.sendall(body)
            s.recv(1)

    sender = threading.Thread(target=send)
    sender.start()
    conn, _ = server.accept()
    with conn:
        t0 = time.perf_counter()
        into(_Socket(conn), view[HEADER_SIZE:])
        seconds = time.perf_counter() - t0
        conn.sendall(b"k")
    sender.join()
    server.close()
    view.release()
    buf.close()
    return seconds


def peer_loads(nbytes: int, rounds: int, work: Path) -> str:
    body, manifest, digest_offset = _segment(nbytes)
    table_len = len(body) - (digest_offset - HEADER_SIZE)

    def plain(chan: _Socket, view: memoryview) -> None:
        chan.recv_into(view[: len(body) - table_len])
        chan.recv_into(view[len(body) - table_len : len(body)])

    def hashed(chan: _Socket, view: memoryview) -> None:
        receive_object(chan, view, manifest, digest_offset, lambda n: None)  # type: ignore[arg-type]

    t: Timed = {}
    for r in range(rounds + 1):
        into: Timed = t if r else {}  # round 0 warms up
        into.setdefault("off", []).append(_receive(body, plain))
        into.setdefault("on", []).append(_receive(body, hashed))
        into.setdefault("raw", []).append(raw_socket_seconds(len(body)))
    etcd = EtcdServer(work / "etcd").start()
    root = work / "peer"
    root.mkdir()
    path = root / "model.pt"
    try:
        args = ("--memory-limit", str(3 * nbytes), "--backup", "none", "--memory-only", "allow")
        with contextlib.ExitStack() as stack:
            a, b = stack.enter_context(running_cluster(2, etcd.url, *args))
            ca = stack.enter_context(Client(a.socket, fallback="raise"))
            cb = stack.enter_context(Client(b.socket, fallback="raise"))
            ca.save(make_state(nbytes, seed=4), path)
            _until_findable(lambda: cb.prefetch(path), lambda: cb.delete(path))
            for r in range(rounds + 1):
                into: Timed = t if r else {}  # round 0 warms up
                timed(into, "peer", lambda: cb.load(path))
                assert cb.status(path).last_load_tier == "peer"
                cb.delete(path)
                timed(into, "peer+local", lambda: cb.load(path, verify=True))
                cb.delete(path)
    finally:
        etcd.stop()
    off, on, raw = median(t, "off"), median(t, "on"), median(t, "raw")
    peer, both = median(t, "peer"), median(t, "peer+local")
    return "\n".join([
        f"\nreceive of a {nbytes >> 20} MiB segment over loopback, in process:\n",
        table([
            ("raw socket (`sendfile` -> `recv_into`), the limit", raw, "-"),
            ("receive, no check", off, f"{off / raw:.2f}x raw"),
            ("receive, every tensor hashed as it lands (the daemon's)", on,
             f"**{on / off:.2f}x no check**"),
        ], nbytes),
        f"\nload from a peer's memory, two daemons on one etcd, {nbytes >> 20} MiB:\n",
        table([
            ("`ckptcache.load()` from a peer (verified by the daemon as it lands)", peer,
             f"{peer / raw:.2f}x raw socket"),
            ("`ckptcache.load(verify=True)`: this node's copy checked again", both,
             f"{both / peer:.2f}x the default"),
        ], nbytes),
    ])  # fmt: skip


def _until_findable(fetch: Callable[[], object], undo: Callable[[], object]) -> None:
    """Wait (bounded) until the peer's copy is announced to the coordinator: a save returns
    before its holding is published; then drop the copy the probe brought in."""
    deadline = time.monotonic() + 60
    while True:
        try:
            fetch()
            break
        except CheckpointNotFound:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    undo()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="256MiB")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--no-peer", action="store_true", help="skip the peer scenario (no etcd)")
    args = p.parse_args()
    nbytes = parse_bytes(args.size)
    os.environ.setdefault("CKPTCACHE_CLUSTER_SECRET", "bench-secret")
    with tempfile.TemporaryDirectory(prefix="ckptcache-verify-", dir="/var/tmp") as tmp:
        work = Path(tmp)
        print(f"## verification on vs off, {args.size}, medians of {args.rounds} rounds")
        print(f"load average at start: {os.getloadavg()[0]:.1f}")
        print("\n### storage, read by the trainer (the daemon does not hold the file)")
        print(trainer_reads(nbytes, args.rounds, work))
        print("\n### storage, read by the daemon (group reads, prefetch)")
        print(daemon_reads(nbytes, args.rounds, work))
        if not args.no_peer:
            print("\n### peer memory")
            print(peer_loads(nbytes, args.rounds, work))
        print(f"\nload average at end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
