"""CPU per byte of every path that moves a checkpoint between nodes, against the kernel's own.

    python benchmarks/replication/cpu.py --size 256MiB --rounds 3

One run on loopback; for each path the wall time and the CPU-seconds per GiB each end spent,
from the processes' own counters (``getrusage(RUSAGE_SELF)`` in the benchmark's worker
processes, ``/proc/<pid>/stat`` utime + stime of the daemons):

* raw ``sendfile -> recv_into`` between two processes (the kernel's TCP path: the limit);
* the same transfer through the data plane's authenticated :class:`Channel`, and again with the
  receiver digesting what it receives (in the tag check's pass, as the daemons do);
* one core's xxh3 (the digest every hop checks) and Poly1305 (the record tag) over the same
  bytes, no transfer (what a single pass over the bytes costs), both in one pass (the record
  extension), and the kernel's first touch of a new segment's pages (what a receive into
  memory the node has not used pays);
* a backup push: ``save(durability="backup")`` on a daemon with a backup node, less
  ``save(durability="local")`` on a daemon without one (both daemons' CPU), on one connection
  and split across ``--streams`` connections (``data_plane_streams``);
* a peer fetch: a load on a node that does not hold the object (both daemons' CPU);
* a relayed group read: two nodes load one file at once (one reads storage and relays it to
  the other), less one node loading a file alone (both daemons' CPU), on one connection and
  split across ``--streams`` connections (a striped relay); each round says whether the
  second node took the bytes by relay (the relaying daemon's log) or as a committed copy;
* checkpointless recovery's transfer over gloo: a raw ``dist.broadcast`` and
  ``PeerRecovery.recover`` (checksum digest) of the same state size, two ranks.

Medians over ``--rounds``. "vs raw + digests" is a path's CPU against the issue's bound: the raw
transfer plus one xxh3 pass on each end. Which code tags records (the record extension, or
Python where it is hidden, see ``python_tags/sitecustomize.py``) is printed with the table.
Needs Debian's etcd-server. The client's own CPU (a zero-copy load
maps the segment; a save's copy is the same with and without a backup) is not counted.
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import multiprocessing
import os
import resource
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import torch
import xxhash

from ckptcache._units import parse_bytes
from ckptcache.cli.benchmarking import DaemonHandle, EtcdServer, make_state, running_cluster
from ckptcache.client import Client
from ckptcache.server.cluster.dataplane import RECORD_SIZE, TAG_IMPLEMENTATION, Channel, Span, Xxh3
from ckptcache.server.cluster.dataplane._tagging import tag_and_hash
from ckptcache.server.cluster.transfer import RELAY_RECORD

GiB = float(1 << 30)
SECRET = "bench-secret"
#: Line rates a GPU node's front-end NIC carries, in GiB/s (100 and 400 Gbit/s).
LINES = {"100 Gbit/s": 100e9 / 8 / GiB, "400 Gbit/s": 400e9 / 8 / GiB}


def cpu_self() -> float:
    """CPU seconds this process (every thread of it) has used."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def cpu_pid(pid: int) -> float:
    """utime + stime of process ``pid`` (every thread of it), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Sample:
    """One transfer: wall seconds and each end's CPU seconds."""

    seconds: float
    send_cpu: float
    recv_cpu: float

    def __sub__(self, other: Sample) -> Sample:
        return Sample(
            self.seconds - other.seconds,
            self.send_cpu - other.send_cpu,
            self.recv_cpu - other.recv_cpu,
        )


@dataclass
class Path_:
    """A path's median sample over the rounds, and what it moved per round."""

    what: str
    nbytes: int
    samples: list[Sample]
    note: str = ""

    def _med(self, f: Callable[[Sample], float]) -> float:
        return statistics.median(f(s) for s in self.samples)

    @property
    def seconds(self) -> float:
        return self._med(lambda s: s.seconds)

    @property
    def send(self) -> float:
        """Sending end's CPU-seconds per GiB."""
        return self._med(lambda s: s.send_cpu) / (self.nbytes / GiB)

    @property
    def recv(self) -> float:
        return self._med(lambda s: s.recv_cpu) / (self.nbytes / GiB)

    @property
    def total(self) -> float:
        return self._med(lambda s: s.send_cpu + s.recv_cpu) / (self.nbytes / GiB)


# ---------------------------------------------------------------- socket pairs


def _faulted(nbytes: int) -> mmap.mmap:
    dst = mmap.mmap(-1, nbytes)
    for off in range(0, nbytes, 4096):  # as a reused segment is
        dst[off] = 0
    return dst


def _source(nbytes: int) -> tuple[str, mmap.mmap]:
    """A tmpfs file of ``nbytes`` and a faulted-in mapping of it (as a daemon's segment)."""
    fd, name = tempfile.mkstemp(dir="/dev/shm", prefix="ckptcache-cpu-")
    os.posix_fallocate(fd, 0, nbytes)
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    mapping = mmap.mmap(fd, 0, flags=flags, prot=mmap.PROT_READ)
    os.close(fd)
    return name, mapping


def _raw_recv(port: int, nbytes: int, out: Connection) -> None:
    dst = _faulted(nbytes)
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"r")
    cpu0 = cpu_self()
    view = memoryview(dst)
    while view:
        view = view[sock.recv_into(view) :]
    out.send(cpu_self() - cpu0)
    sock.sendall(b"k")
    sock.close()


def _raw_send(port_out: Connection, name: str, nbytes: int, out: Connection) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port_out.send(server.getsockname()[1])
    sock, _ = server.accept()
    sock.recv(1)
    with open(name, "rb") as f:
        t0, cpu0 = time.perf_counter(), cpu_self()
        off = 0
        while off < nbytes:
            off += os.sendfile(sock.fileno(), f.fileno(), off, nbytes - off)
        cpu = cpu_self() - cpu0
        sock.recv(1)
        out.send((time.perf_counter() - t0, cpu))


class Storages:
    """A receiver's digests of ``nbytes`` as storages of ``size`` bytes each (the transfer's
    hasher, without a manifest)."""

    def __init__(self, nbytes: int, size: int = 16 << 20):
        self.bounds = [(lo, min(lo + size, nbytes)) for lo in range(0, nbytes, size)]
        self.planned, self.state = 0, Xxh3()
        self.digests: list[int] = []

    def spans(self, start: int, end: int) -> list[Span]:
        out: list[Span] = []
        while self.planned < len(self.bounds):
            lo, hi = self.bounds[self.planned]
            if lo >= end:
                break
            out.append((max(lo, start) - start, min(hi, end) - start, hi <= end))
            if hi > end:
                break
            self.planned += 1
        return out

    def hashed(self, digests: list[int]) -> None:
        self.digests.extend(digests)


def _chan_recv(port: int, nbytes: int, out: Connection, digest: bool = False) -> None:
    dst = _faulted(nbytes)
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    chan = Channel(sock, b"r" * 32, b"k" * 32)
    chan.send_bytes(b"ready")
    hasher = Storages(nbytes) if digest else None
    cpu0 = cpu_self()
    with memoryview(dst) as view:
        chan.recv_into(view, None, hasher)
    out.send(cpu_self() - cpu0)
    if hasher is not None:
        assert len(hasher.digests) == len(hasher.bounds)
    chan.send_bytes(b"k")
    chan.close()


def _chan_recv_digest(port: int, nbytes: int, out: Connection) -> None:
    _chan_recv(port, nbytes, out, digest=True)


def _chan_send(
    port_out: Connection, name: str, nbytes: int, out: Connection, record: int = RECORD_SIZE
) -> None:
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    with open(name, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, flags=flags, prot=mmap.PROT_READ)
    server = socket.create_server(("127.0.0.1", 0))
    port_out.send(server.getsockname()[1])
    sock, _ = server.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    chan = Channel(sock, b"k" * 32, b"r" * 32)
    chan.recv_bytes()
    t0, cpu0 = time.perf_counter(), cpu_self()
    chan.send_file(name, 0, nbytes, mapping, record=record)
    cpu = cpu_self() - cpu0
    chan.recv_bytes()
    out.send((time.perf_counter() - t0, cpu))
    chan.close()


def _chan_send_relay(port_out: Connection, name: str, nbytes: int, out: Connection) -> None:
    _chan_send(port_out, name, nbytes, out, record=RELAY_RECORD)


def pair(sender: Callable[..., None], receiver: Callable[..., None], nbytes: int) -> Sample:
    """One transfer of ``nbytes`` between two fresh processes (each its own interpreter)."""
    ctx = multiprocessing.get_context("fork")
    name, mapping = _source(nbytes)
    try:
        port_r, port_w = ctx.Pipe(duplex=False)
        send_r, send_w = ctx.Pipe(duplex=False)
        recv_r, recv_w = ctx.Pipe(duplex=False)
        s = ctx.Process(target=sender, args=(port_w, name, nbytes, send_w))
        s.start()
        port = port_r.recv()
        r = ctx.Process(target=receiver, args=(port, nbytes, recv_w))
        r.start()
        seconds, send_cpu = send_r.recv()
        recv_cpu = recv_r.recv()
        s.join()
        r.join()
        return Sample(seconds, send_cpu, recv_cpu)
    finally:
        mapping.close()
        os.unlink(name)


def one_core(nbytes: int, fn: Callable[[memoryview], object]) -> Sample:
    """``fn`` over ``nbytes`` of faulted-in memory in records, on this thread: its CPU."""
    buf = _faulted(nbytes)
    t0, cpu0 = time.perf_counter(), time.thread_time()
    with memoryview(buf) as view:
        for start in range(0, nbytes, RECORD_SIZE):
            with view[start : start + RECORD_SIZE] as part:
                fn(part)
    cpu = time.thread_time() - cpu0
    seconds = time.perf_counter() - t0
    buf.close()
    return Sample(seconds, cpu, 0.0)


def first_touch(nbytes: int) -> Sample:
    """A new segment as the daemon makes one: ``fallocate`` of a tmpfs file (the kernel
    allocates and zeroes each page) and a mapping populated up front. What a receive into
    memory the node has not used before pays on top of the transfer."""
    fd, name = tempfile.mkstemp(dir="/dev/shm", prefix="ckptcache-cpu-")
    try:
        t0, cpu0 = time.perf_counter(), time.thread_time()
        os.posix_fallocate(fd, 0, nbytes)
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        buf = mmap.mmap(fd, nbytes, flags=flags)
        cpu = time.thread_time() - cpu0
        seconds = time.perf_counter() - t0
        buf.close()
    finally:
        os.close(fd)
        os.unlink(name)
    return Sample(seconds, 0.0, cpu)


def poly(part: memoryview) -> object:
    return Channel._tag(b"k" * 32, 0, b"\0\0\0\0", part)


_STATE = Xxh3()


def poly_xxh3(part: memoryview) -> object:
    return tag_and_hash(b"k" * 32, b"\0\0\0\0", part, [(0, len(part), True)], _STATE)


# ---------------------------------------------------------------- daemons


class Daemons:
    """CPU of a set of daemon processes over a window."""

    def __init__(self, pids: list[int]):
        self.pids = pids

    @contextlib.contextmanager
    def window(self) -> Iterator[list[float]]:
        """Yields a list that holds, after the block, each daemon's CPU seconds in it."""
        before = [cpu_pid(p) for p in self.pids]
        spent: list[float] = []
        yield spent
        spent.extend(cpu_pid(p) - b for p, b in zip(self.pids, before, strict=True))


def settle(*ready: tuple[Client, str], seconds: float = 0.3) -> None:
    """Let background work of the previous step finish: each ``(client, path)``'s save-time
    digests (hashed after a save returns), then announcements and spare refills."""
    for client, path in ready:
        while not client.status(path).digests_valid:
            time.sleep(0.01)
    time.sleep(seconds)


def daemon_paths(
    nbytes: int, rounds: int, etcd: EtcdServer, root: Path, streams: int
) -> list[Path_]:
    state = make_state(nbytes)
    budget = str(8 * nbytes + (256 << 20))
    local, backup, striped, fetch, fetch_n = [], [], [], [], []
    solo: list[Sample] = []
    group: list[Sample] = []
    solo_n: list[Sample] = []
    group_n: list[Sample] = []
    files = root / "files"
    files.mkdir(parents=True)
    for i in range(2 * rounds):
        torch.save(state, files / f"f{i}.pt")
    plain = (
        "--memory-limit",
        budget,
        "--keep",
        "1",
        "--persist-root",
        str(root),
        "--memory-only",
        "allow",
    )
    with contextlib.ExitStack() as stack:
        two = stack.enter_context(running_cluster(2, etcd.url, "--data-plane-streams", "1", *plain))
        streams_n = ("--data-plane-streams", str(streams))
        two_n = stack.enter_context(running_cluster(2, etcd.url, *streams_n, *plain))
        one = ("--backup", "auto", "--data-plane-streams", "1")
        paired = stack.enter_context(running_cluster(2, etcd.url, *one, *plain))
        many = ("--backup", "auto", "--data-plane-streams", str(streams))
        paired_n = stack.enter_context(running_cluster(2, etcd.url, *many, *plain))
        a, b = (stack.enter_context(Client(h.socket, fallback="raise", timeout=600)) for h in two)
        pa, _ = (
            stack.enter_context(Client(h.socket, fallback="raise", timeout=600)) for h in paired
        )
        pn, _ = (
            stack.enter_context(Client(h.socket, fallback="raise", timeout=600)) for h in paired_n
        )
        an, bn = (stack.enter_context(Client(h.socket, fallback="raise", timeout=600))
                  for h in two_n)  # fmt: skip
        d_two = Daemons([h.proc.pid for h in two])
        d_two_n = Daemons([h.proc.pid for h in two_n])
        d_paired = Daemons([h.proc.pid for h in paired])
        d_paired_n = Daemons([h.proc.pid for h in paired_n])
        for c in (a, pa, pn):  # warm both rotations of segments
            for _ in range(2):
                c.save(state, "/bench/model.pt", durability="local")
        for r in range(rounds):
            settle((a, "/bench/model.pt"), (pa, "/bench/model.pt"))
            with d_two.window() as cpu:
                t0 = time.perf_counter()
                a.save(state, "/bench/model.pt", durability="local")
                seconds = time.perf_counter() - t0
            local.append(Sample(seconds, cpu[0], cpu[1]))
            settle((a, "/bench/model.pt"), (pa, "/bench/model.pt"))
            with d_paired.window() as cpu:
                t0 = time.perf_counter()
                pa.save(state, "/bench/model.pt", durability="backup")
                seconds = time.perf_counter() - t0
            backup.append(Sample(seconds, cpu[0], cpu[1]))
            settle((a, "/bench/model.pt"), (pn, "/bench/model.pt"))
            with d_paired_n.window() as cpu:
                t0 = time.perf_counter()
                pn.save(state, "/bench/model.pt", durability="backup")
                seconds = time.perf_counter() - t0
            striped.append(Sample(seconds, cpu[0], cpu[1]))
            # Peer fetch: b loads what only a holds.
            path = f"/bench/fetch-{r}.pt"
            a.save(state, path, durability="local")
            settle((a, path))
            with d_two.window() as cpu:
                t0 = time.perf_counter()
                got = b.load(path)
                seconds = time.perf_counter() - t0
            print(
                f"  round {r}: peer fetch tier {b.status(path).last_load_tier}",
                file=sys.stderr,
                flush=True,
            )
            del got
            fetch.append(Sample(seconds, cpu[0], cpu[1]))
            for c in (a, b):
                with contextlib.suppress(Exception):
                    c.delete(path)
            # The same, split across ``streams`` connections.
            an.save(state, path, durability="local")
            settle((an, path))
            with d_two_n.window() as cpu:
                t0 = time.perf_counter()
                got = bn.load(path)
                seconds = time.perf_counter() - t0
            del got
            fetch_n.append(Sample(seconds, cpu[0], cpu[1]))
            for c in (an, bn):
                with contextlib.suppress(Exception):
                    c.delete(path)
            # Relayed group read: one node reads storage alone, then two read another file;
            # on one connection, then in ``streams`` stripes (the same files, other daemons).
            f_solo, f_group = files / f"f{2 * r}.pt", files / f"f{2 * r + 1}.pt"
            for pair_, daemons, handles, solos, groups in (
                ((a, b), d_two, two, solo, group),
                ((an, bn), d_two_n, two_n, solo_n, group_n),
            ):
                solos_, groups_ = group_read(pair_, daemons, handles, f_solo, f_group, r)
                solos.append(solos_)
                groups.append(groups_)
    relay = [
        Sample(g.seconds - s.seconds, g.send_cpu - (s.send_cpu + s.recv_cpu), g.recv_cpu)
        for g, s in zip(group, solo, strict=True)
    ]
    relay_n = [
        Sample(g.seconds - s.seconds, g.send_cpu - (s.send_cpu + s.recv_cpu), g.recv_cpu)
        for g, s in zip(group_n, solo_n, strict=True)
    ]
    return [
        Path_(
            "backup push (save durability=backup - local; pusher -> backup node)",
            nbytes,
            [bk - lc for bk, lc in zip(backup, local, strict=True)],
        ),
        Path_(
            f"backup push, data_plane_streams {streams} (same, striped)",
            nbytes,
            [bk - lc for bk, lc in zip(striped, local, strict=True)],
        ),
        Path_(
            f"peer fetch, data_plane_streams {streams} (same, striped)",
            nbytes,
            fetch_n,
            "includes the loader's digest check and commit",
        ),
        Path_(
            "peer fetch (load on a node that does not hold it; holder -> loader)",
            nbytes,
            fetch,
            "includes the loader's digest check and commit",
        ),
        Path_(
            "relayed group read (2 nodes load one file - 1 node alone; reader -> relayed)",
            nbytes,
            relay,
            "the storage read itself subtracted",
        ),
        Path_(
            f"relayed group read, data_plane_streams {streams} (same, striped relay)",
            nbytes,
            relay_n,
            "the storage read itself subtracted",
        ),
        Path_(
            "(one node reads a torch.save file from storage, for reference)",
            nbytes,
            [Sample(s.seconds, s.send_cpu + s.recv_cpu, 0.0) for s in solo],
        ),
    ]


def group_read(
    clients: tuple[Client, Client],
    daemons: Daemons,
    handles: list[DaemonHandle],
    f_solo: Path,
    f_group: Path,
    r: int,
) -> tuple[Sample, Sample]:
    """One node loads ``f_solo`` alone, then both load ``f_group`` at once (one reads storage,
    the other takes it from the reader, by relay while it lands if it asks in time); the two
    samples (the group's: the reader's end sends, the other receives)."""
    a, b = clients
    settle()
    with daemons.window() as cpu:
        t0 = time.perf_counter()
        got = a.load(f_solo)
        seconds = time.perf_counter() - t0
    del got
    solo = Sample(seconds, cpu[0], cpu[1])
    settle()
    results: dict[str, float] = {}

    def load(c: Client, key: str) -> None:
        t0 = time.perf_counter()
        c.load(f_group)
        results[key] = time.perf_counter() - t0

    logs = [Path(h.socket).parent / "daemon.log" for h in handles]
    relayed_before = sum(_relays(log, f_group) for log in logs)
    with daemons.window() as cpu:
        threads = [threading.Thread(target=load, args=(c, k)) for c, k in ((a, "a"), (b, "b"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    tiers = sorted(c.status(f_group).last_load_tier for c in (a, b))
    reader = 0 if a.status(f_group).last_load_tier == "storage" else 1
    relayed = sum(_relays(log, f_group) for log in logs) > relayed_before
    striped = any(f"relaying {f_group} to a peer while it arrives (on" in log.read_text()
                  for log in logs)  # fmt: skip
    how = ("by striped relay" if striped else "by relay") if relayed else "committed"
    print(f"  round {r}: group read tiers {tiers} ({how})", file=sys.stderr, flush=True)
    for c in (a, b):
        for f in (f_solo, f_group):
            with contextlib.suppress(Exception):
                c.delete(f)
    return solo, Sample(max(results.values()), cpu[reader], cpu[1 - reader])


def _relays(log: Path, path: Path) -> int:
    """How many relays of ``path`` the daemon's log names."""
    try:
        return log.read_text(errors="replace").count(f"relaying {path} to a peer")
    except OSError:
        return 0


# ---------------------------------------------------------------- gloo


def _gloo_worker(rank: int, port: int, nbytes: int, rounds: int, out: str) -> None:
    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "p2p_recovery"))
    from bench import build  # type: ignore[import-not-found,attr-defined]

    from ckptcache.recovery import PeerRecovery

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    healthy = rank == 0
    raw, rec = [], []
    model, optimizer = build(nbytes // 3, trained=healthy)
    for _ in range(rounds):
        flat = torch.empty(nbytes, dtype=torch.uint8)
        flat.fill_(1)
        dist.barrier()
        t0, cpu0 = time.perf_counter(), cpu_self()
        dist.broadcast(flat, src=0)
        raw.append((time.perf_counter() - t0, cpu_self() - cpu0))
        del flat
        if not healthy:
            model, optimizer = build(nbytes // 3, trained=False)
        recovery = PeerRecovery(digest="checksum")
        dist.barrier()
        t0, cpu0 = time.perf_counter(), cpu_self()
        result = recovery.recover(
            model, optimizer, step=0 if healthy else None, recovering=not healthy
        )
        rec.append((time.perf_counter() - t0, cpu_self() - cpu0))
        assert result.source == "peer", result.reason
    torch.save({"raw": raw, "rec": rec}, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def gloo_paths(nbytes: int, rounds: int, work: Path) -> list[Path_]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_gloo_worker, args=(port, nbytes, rounds, str(work)), nprocs=2)
    src, dst = (torch.load(work / f"rank{r}.pt") for r in range(2))

    def samples(key: str) -> list[Sample]:
        return [
            Sample(max(a[0], b[0]), a[1], b[1]) for a, b in zip(src[key], dst[key], strict=True)
        ]

    return [
        Path_(
            "gloo: raw dist.broadcast, one contiguous tensor (recovery's limit)",
            nbytes,
            samples("raw"),
        ),
        Path_(
            "gloo: PeerRecovery.recover (checksum digest; source -> recovering rank)",
            nbytes,
            samples("rec"),
            "model + Adam state, receiver's memory new each time",
        ),
    ]


# ---------------------------------------------------------------- table


def table(paths: list[Path_], limit: Path_, digest: float) -> str:
    """The table; ``digest``: one xxh3 pass's CPU-s/GiB (the bound is raw + one per end)."""
    bound = limit.total + 2 * digest
    lines = [
        "| path | GB/s | CPU-s/GiB sender | CPU-s/GiB receiver | CPU-s/GiB both | "
        "vs raw (both) | vs raw + digests | cores at 100 / 400 Gbit/s (busier end) | note |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for p in paths:
        gbps = p.nbytes / p.seconds / 1e9 if p.seconds > 0 else float("nan")
        busier = max(p.send, p.recv)
        cores = " / ".join(f"{rate * busier:.1f}" for rate in LINES.values())
        ratio = f"{p.total / limit.total:.2f}x" if p.recv and p.send else "-"
        vs_bound = f"{p.total / bound:.2f}x" if p.recv and p.send else "-"
        lines.append(
            f"| {p.what} | {gbps:.2f} | {p.send:.3f} | "
            f"{p.recv:.3f} | {p.total:.3f} | {ratio} | {vs_bound} | {cores} | {p.note} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="256MiB")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--streams", type=int, default=4, help="data_plane_streams of the striped row")
    p.add_argument("--skip", nargs="*", default=[], choices=["daemons", "gloo"])
    args = p.parse_args()
    nbytes = parse_bytes(args.size)
    rounds = args.rounds
    work = Path(tempfile.mkdtemp(prefix="ckptcache-cpu-", dir="/var/tmp"))
    os.environ.setdefault("CKPTCACHE_CLUSTER_SECRET", SECRET)
    paths: list[Path_] = []
    try:
        raw = [pair(_raw_send, _raw_recv, nbytes) for _ in range(rounds)]
        chan, chan_digest, chan_relay = [], [], []
        for _ in range(rounds):  # interleaved: all see the same moments of a shared machine
            chan.append(pair(_chan_send, _chan_recv, nbytes))
            chan_digest.append(pair(_chan_send, _chan_recv_digest, nbytes))
            chan_relay.append(pair(_chan_send_relay, _chan_recv_digest, nbytes))
        limit = Path_("raw socket: sendfile -> recv_into (the limit)", nbytes, raw)
        xxh3 = Path_(
            "xxh3 digest, one core, no transfer (per pass)",
            nbytes,
            [one_core(nbytes, xxhash.xxh3_64_intdigest) for _ in range(rounds)],
        )
        paths += [
            limit,
            Path_(
                "authenticated channel: same transfer, Poly1305 tag per 4 MiB record", nbytes, chan
            ),
            Path_(
                "authenticated channel + receiver's digest (16 MiB storages)", nbytes, chan_digest
            ),
            Path_("the same in the relay's 1 MiB records (RELAY_RECORD)", nbytes, chan_relay),
            xxh3,
            Path_(
                "Poly1305 tag, one core, no transfer (per pass)",
                nbytes,
                [one_core(nbytes, poly) for _ in range(rounds)],
            ),
            Path_(
                "Poly1305 tag + xxh3 digest, one core, no transfer (the receiver's pass)",
                nbytes,
                [one_core(nbytes, poly_xxh3) for _ in range(rounds)],
            ),
            Path_(
                "first touch of new tmpfs memory (page allocated and zeroed)",
                nbytes,
                [first_touch(nbytes) for _ in range(rounds)],
            ),
        ]
        print(f"record tags and digests: {TAG_IMPLEMENTATION}", flush=True)
        print(table(paths, limit, xxh3.send), flush=True)
        if "daemons" not in args.skip:
            etcd = EtcdServer(work / "etcd").start()
            try:
                paths += daemon_paths(nbytes, rounds, etcd, work / "ckpt", args.streams)
            finally:
                etcd.stop()
        if "gloo" not in args.skip:
            paths += gloo_paths(nbytes, rounds, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"\n### CPU per byte per path ({args.size}, loopback, medians of {rounds}, "
        f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}, record tags and "
        f"digests: {TAG_IMPLEMENTATION})\n"
    )
    print(table(paths, limit, xxh3.send))


if __name__ == "__main__":
    main()
