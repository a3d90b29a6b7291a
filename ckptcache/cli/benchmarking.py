"""Measurement helpers shared by the demo and ``benchmarks/``: every figure is taken in one run
next to its physical limit (memcpy) and next to what users would otherwise do (torch.save/load).
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "DaemonHandle",
    "EtcdServer",
    "Row",
    "best_of",
    "copy_limit_label",
    "copy_limit_seconds",
    "format_table",
    "free_port",
    "make_state",
    "memcpy_seconds",
    "mixed_state",
    "raw_socket_seconds",
    "running_cluster",
    "running_daemon",
    "running_s3",
    "torch_baselines",
    "torch_save_fast",
    "wait_for_socket",
]

#: Where benchmark daemons make their shm roots (default ``/dev/shm``).
ENV_SHM_BASE = "CKPTCACHE_BENCH_SHM_BASE"


@dataclass(frozen=True)
class Row:
    """One measured operation: seconds for ``nbytes``; GB/s and ratios are derived."""

    what: str
    nbytes: int
    seconds: float
    #: False for an operation that moves no bytes (a zero-copy load maps them): a ratio to a
    #: copy's limit would read as beating it, so none is shown.
    copies: bool = True

    @property
    def gbps(self) -> float:
        """Throughput in GB/s (10^9 bytes per second)."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def make_state(nbytes: int, *, seed: int = 0, n_tensors: int = 16) -> dict[str, torch.Tensor]:
    """A state dict of ``n_tensors`` float32 tensors totalling about ``nbytes``."""
    g = torch.Generator().manual_seed(seed)
    per = max(1, nbytes // 4 // n_tensors)
    return {f"layer{i:02d}.weight": torch.randn(per, generator=g) for i in range(n_tensors)}


def mixed_state(
    nbytes: int, *, big: int = 16 << 20, small: int = 64 << 10
) -> dict[str, torch.Tensor]:
    """A state dict shaped like a real one: 75% of ``nbytes`` in float32 tensors of ``big``
    bytes, the rest in tensors of ``small`` bytes (2,072 tensors at 512 MiB, 8,288 at 2 GiB)."""
    n_big = int(nbytes * 0.75) // big
    sizes = [big] * n_big + [small] * ((nbytes - n_big * big) // small)
    state = {}
    for i, size in enumerate(sizes):
        t = torch.empty(size // 4)
        t.fill_(float(i % 251))  # distinct, cheap to make, every page touched
        state[f"layers.{i}.{'weight' if size == big else 'bias'}"] = t
    return state


def best_of(n: int, fn: Callable[[], object]) -> float:
    """Fastest of ``n`` timed calls of ``fn`` (seconds)."""
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def memcpy_seconds(state: dict[str, torch.Tensor], repeats: int = 3) -> float:
    """The physical limit of a save's copy: the bytes of every tensor of ``state`` moved into
    already-faulted memory (as a reused segment is), the faster of one ``copy_`` per tensor
    and the save's own copy spread over every core (``copy_storages_into``: streaming stores
    where the copy extension is built, ``memmove`` otherwise; outside the GIL). A single
    threaded copy is not the limit where several cores share the memory bandwidth, nor a copy
    with ordinary stores where the save streams: a save would beat either."""
    from ckptcache.codec.shm import copy_storages_into

    dst = {k: torch.empty_like(v) for k, v in state.items()}
    offsets, total = [], 0
    for v in state.values():
        offsets.append(total)
        total += v.untyped_storage().nbytes()
    flat = torch.ones(max(total, 1), dtype=torch.uint8)  # touched: every page faulted in
    runs = [(o, v.untyped_storage()) for o, v in zip(offsets, state.values(), strict=True)]

    def per_tensor() -> None:
        for k, v in state.items():
            dst[k].copy_(v)

    per_tensor()  # fault the destination pages in first, as a reused segment is
    return min(
        best_of(repeats, per_tensor), best_of(repeats, lambda: copy_storages_into(flat, runs))
    )


def copy_limit_seconds(state: dict[str, torch.Tensor], repeats: int = 3) -> float:
    """The limit a save's copy can reach: every storage of ``state`` copied by the save's own
    copy engine (:func:`~ckptcache.codec.shm.copy_storages_into`: streaming stores where the
    copy extension is built, :func:`~ckptcache.codec.shm.copy_threads` threads taking
    shares) into a shared tmpfs mapping whose every page was touched first, as a spare's or a
    reused segment's are; each storage at a 64-byte aligned offset, as in a segment. Best of
    ``repeats``.

    A save copies the same bytes the same way plus its own work (the plan, two round trips),
    so it cannot beat this limit, while a limit measured with another copy (one ``copy_`` per
    tensor, ``memmove``, one thread) can be beaten by the save's streaming stores."""
    from ckptcache.codec.shm import copy_storages_into, map_shared

    runs: list[tuple[int, torch.UntypedStorage]] = []
    seen: set[int] = set()
    end = _SEGMENT_ALIGNMENT  # the segment's header comes first
    for tensor in state.values():
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            continue  # a storage shared by several tensors is saved once
        seen.add(storage.data_ptr())
        runs.append((end, storage))
        end += -(-storage.nbytes() // _SEGMENT_ALIGNMENT) * _SEGMENT_ALIGNMENT
    base = os.environ.get(ENV_SHM_BASE) or "/dev/shm"
    with tempfile.NamedTemporaryFile(dir=base, prefix="ckptcache-limit-") as file:
        os.posix_fallocate(file.fileno(), 0, end)
        mapping = map_shared(file.name, end)
        try:
            dst = torch.frombuffer(mapping, dtype=torch.uint8)
            dst.fill_(1)  # every page written once: allocated and mapped, as a reused segment's
            copy = functools.partial(copy_storages_into, dst, runs)
            seconds = best_of(repeats, copy)
            del copy, dst  # the mapping closes only once no tensor exports it
        finally:
            mapping.close()
    return seconds


#: Where a segment places its storages (a multiple of it), as ``torch.save``'s archive does.
_SEGMENT_ALIGNMENT = 64


def copy_limit_label(nbytes: int) -> str:
    """The name of :func:`copy_limit_seconds`'s row: the copy it measures, as it runs here."""
    from ckptcache.codec.shm import copy_threads
    from ckptcache.format.fastcopy import COPY_IMPLEMENTATION

    threads = copy_threads(nbytes)
    return (f"copy limit (the save's own copy: {COPY_IMPLEMENTATION}, {threads} "
            f"thread{'s' if threads > 1 else ''}, into touched memory)")  # fmt: skip


def raw_socket_seconds(nbytes: int) -> float:
    """The network limit on loopback: ``sendfile`` from a tmpfs file into ``recv_into`` of a
    pre-faulted buffer over TCP (no framing, no authentication, no digest)."""
    import mmap
    import socket
    import threading

    with tempfile.NamedTemporaryFile(dir="/dev/shm") as src:
        os.posix_fallocate(src.fileno(), 0, nbytes)
        dst = mmap.mmap(-1, nbytes)
        for off in range(0, nbytes, mmap.PAGESIZE):  # faulted in, as a reused segment is
            dst[off] = 0
        server = socket.create_server(("127.0.0.1", 0))

        def receive() -> None:
            conn, _ = server.accept()
            with conn, memoryview(dst) as whole:
                view = whole
                while view:
                    got = conn.recv_into(view)
                    if not got:
                        break
                    view = view[got:]
                conn.sendall(b"k")

        thread = threading.Thread(target=receive, daemon=True)
        thread.start()
        try:
            with socket.create_connection(server.getsockname()) as s:
                t0 = time.perf_counter()
                off = 0
                while off < nbytes:
                    off += os.sendfile(s.fileno(), src.fileno(), off, nbytes - off)
                s.recv(1)
                seconds = time.perf_counter() - t0
            thread.join()
        finally:
            server.close()
        dst.close()
        return seconds


def torch_save_fast(obj: object, path: str) -> None:
    """``torch.save`` with CRC32 off (about 2x faster, still loadable): the fairest baseline."""
    from torch.utils.serialization import config

    old = config.save.compute_crc32
    config.save.compute_crc32 = False
    try:
        torch.save(obj, path)
    finally:
        config.save.compute_crc32 = old


def format_table(rows: list[Row], *, limit: Row | None = None, limit_name: str = "limit") -> str:
    """A markdown table with GB/s and, when ``limit`` is given, the ratio to it."""
    head = "| operation | size | time (s) | GB/s |" + (f" vs {limit_name} |" if limit else "")
    sep = "|---|---:|---:|---:|" + ("---:|" if limit else "")
    lines = [head, sep]
    for r in rows:
        line = f"| {r.what} | {r.nbytes / 2**20:.0f} MiB | {r.seconds:.4f} | {r.gbps:.2f} |"
        if limit:
            if not r.copies:
                line += " - (no copy) |"
            else:
                line += f" {limit.seconds / r.seconds:.2f}x |" if r.seconds > 0 else " - |"
        lines.append(line)
    return "\n".join(lines)


def wait_for_socket(
    path: str, proc: subprocess.Popen[bytes] | None = None, timeout: float = 90
) -> None:
    """Block until something accepts connections on Unix socket ``path``."""
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"daemon exited early with {proc.returncode}")
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect(path)
            return
        except OSError:
            time.sleep(0.05)
        finally:
            s.close()
    raise TimeoutError(f"nothing listening on {path}")


def torch_baselines(state: object, nbytes: int, directories: dict[str, str]) -> list[Row]:
    """torch.save (CRC off) and torch.load of ``state`` in each directory, best of two."""
    rows = []
    for where, directory in directories.items():
        target = os.path.join(directory, f"ckptcache-bench-{os.getpid()}.pt")
        try:
            save = best_of(2, functools.partial(torch_save_fast, state, target))
            rows.append(Row(f"torch.save to {where}", nbytes, save))
            load = best_of(2, functools.partial(torch.load, target))
            rows.append(Row(f"torch.load from {where}", nbytes, load))
        finally:
            if os.path.exists(target):
                os.unlink(target)
    return rows


@contextlib.contextmanager
def running_cluster(n: int, etcd_url: str, *args: str) -> Iterator[list[DaemonHandle]]:
    """``n`` daemons on one etcd, each its own node and host, all with ``args``."""
    name = f"bench{os.getpid()}{time.monotonic_ns() % 10**6}"
    with contextlib.ExitStack() as stack:
        handles = []
        for i in range(n):
            node = ("--node-id", f"n{i}", "--host", f"h{i}")
            cluster = ("--coordinator", etcd_url, "--cluster", name, "--listen", "127.0.0.1:0")
            handles.append(stack.enter_context(running_daemon(*cluster, *node, *args)))
        from ckptcache.client import Client

        with Client(handles[0].socket) as probe:
            deadline = time.monotonic() + 30
            while len(probe.daemon_status().cluster_nodes) < n:
                if time.monotonic() > deadline:
                    raise RuntimeError("the cluster did not form")
                time.sleep(0.1)
        yield handles


@contextlib.contextmanager
def running_s3(bucket: str) -> Iterator[tuple[str, Any]]:
    """moto's S3 server on loopback with ``bucket`` created; yields (endpoint, boto3 client)."""
    import boto3
    from moto.server import ThreadedMotoServer

    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ.setdefault(key, "bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        client = boto3.client("s3", endpoint_url=endpoint)
        client.create_bucket(Bucket=bucket)
        yield endpoint, client
    finally:
        server.stop()


@dataclass
class DaemonHandle:
    """A daemon subprocess started for a demo or benchmark."""

    socket: str
    shm_dir: str
    proc: subprocess.Popen[bytes]


@contextlib.contextmanager
def running_daemon(*args: str) -> Iterator[DaemonHandle]:
    """Start ``ckptcache daemon`` on a private socket and shm root; stop and clean up after.

    The shm root is made under ``$CKPTCACHE_BENCH_SHM_BASE`` (default ``/dev/shm``; point it
    at a ``huge=within_size`` tmpfs to measure with huge pages).
    """
    workdir = tempfile.mkdtemp(prefix="ckptcache-")
    base = os.environ.get(ENV_SHM_BASE) or "/dev/shm"
    shm_dir = tempfile.mkdtemp(prefix="ckptcache-", dir=base)
    sock = os.path.join(workdir, "daemon.sock")
    log = open(os.path.join(workdir, "daemon.log"), "wb")  # noqa: SIM115 - child owns it
    cmd = [sys.executable, "-m", "ckptcache.cli", "daemon", "--socket", sock, "--shm-dir", shm_dir]
    proc = subprocess.Popen([*cmd, *memory_tier(args)], stdout=log, stderr=log)
    log.close()
    try:
        wait_for_socket(sock, proc)
        yield DaemonHandle(sock, shm_dir, proc)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(shm_dir, ignore_errors=True)
        shutil.rmtree(workdir, ignore_errors=True)


def memory_tier(args: tuple[str, ...] | list[str]) -> list[str]:
    """Daemon arguments for a run that measures the memory tier: saves under no storage root
    are kept in memory only, chosen explicitly (``--memory-only allow``), unless the run
    configures persistence itself."""
    chosen = any(a in ("--persist-root", "--memory-only") for a in args)
    return list(args) if chosen else [*args, "--memory-only", "allow"]


def free_port() -> int:
    """A TCP port free on loopback right now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EtcdServer:
    """A real etcd (Debian's etcd-server) on loopback with its own data directory (tests and
    benchmarks start one; nothing here is meant for production)."""

    def __init__(self, data_dir: Path):
        self.data_dir = data_dir
        self.client_port = free_port()
        self.peer_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"etcd://127.0.0.1:{self.client_port}"

    def start(self) -> EtcdServer:
        client = f"http://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        cmd = ["etcd", "--data-dir", str(self.data_dir), "--name", "test",
               "--listen-client-urls", client, "--advertise-client-urls", client,
               "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
               "--initial-cluster", f"test={peer}"]  # fmt: skip
        log = open(self.data_dir.parent / "etcd.log", "ab")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=log)
        log.close()
        deadline = time.monotonic() + 30
        import urllib.request

        while True:
            try:
                urllib.request.urlopen(f"{client}/health", timeout=1).read()
                return self
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("etcd did not start") from None
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
