"""``ckptcache bench``: what checkpointing costs on this node, as deployed.

Every figure is measured against the running daemon, next to its physical limit measured in
the same run (memcpy for saves and private loads; a raw write + fsync, or a raw upload, of the
same bytes for persistence; a raw TCP socket for the backup copy and a peer load when the
daemon is one node of a cluster) and next to ``torch.save``/``torch.load``. The demo and
``benchmarks/save_load`` call the same functions, so every published figure is taken one way.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ckptcache._units import format_bytes
from ckptcache.cli.benchmarking import (
    best_of,
    make_state,
    memcpy_seconds,
    raw_socket_seconds,
    torch_save_fast,
)
from ckptcache.client import Client
from ckptcache.errors import CheckpointNotFound, ConfigError, PathNotAllowed, ReplicationError
from ckptcache.wire.states import PersistState

__all__ = [
    "Measure",
    "Progress",
    "cluster_rows",
    "format_measures",
    "load_stalls",
    "measure_size",
    "persist_seconds",
    "preflight",
    "raw_write_seconds",
    "run_bench",
    "save_stalls",
]


@dataclass(frozen=True)
class Measure:
    """One operation on ``nbytes``, and the limit (by name and seconds) it is compared to."""

    what: str
    nbytes: int
    seconds: float
    limit: str = ""
    limit_seconds: float = 0.0

    @property
    def gbps(self) -> float:
        """Throughput in GB/s (10^9 bytes per second)."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")

    @property
    def vs_limit(self) -> float | None:
        """Speed as a fraction of the limit's (1.0: as fast as the limit)."""
        return self.limit_seconds / self.seconds if self.limit and self.seconds > 0 else None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready, with the derived figures."""
        return {**asdict(self), "gbps": self.gbps, "vs_limit": self.vs_limit}


class Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total: int, *, enabled: bool = True, width: int = 30):
        self.total, self.done, self.width, self.enabled = max(total, 1), 0, width, enabled

    def step(self, label: str) -> None:
        """Count one step done and redraw."""
        self.done += 1
        if self.enabled:
            filled = self.width * self.done // self.total
            bar = "#" * filled + "." * (self.width - filled)
            sys.stderr.write(f"\r[{bar}] {self.done}/{self.total} {label:<40.40}")
            sys.stderr.flush()

    def close(self) -> None:
        """End the bar's line."""
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


def wait_idle(client: Client, path: str, timeout: float = 60.0) -> None:
    """Wait until the daemon's background digest of ``path`` is done: training saves minutes
    apart, so charging that work to the next save's stall would misstate it."""
    deadline = time.monotonic() + timeout
    while not client.status(path).digests_valid and time.monotonic() < deadline:
        time.sleep(0.01)


def save_stalls(
    client: Client, state: Any, path: str, repeats: int, *, durability: str = "local"
) -> tuple[float, float]:
    """(first, repeated): the stall of the first save of a new ``path``, then the best of
    ``repeats`` saves of it (each once the daemon is idle again), each with ``durability``.

    The first save is timed as a trainer's next checkpoint (a new directory) meets it: the
    daemon's spare pool is sized from the saves it has seen, so an untimed save of the same
    state under a sibling path comes first (the trainer's first checkpoint; memory only,
    dropped afterwards), and the spare it leads to is mapped before the timed save."""
    sizing = path + ".sizing"
    client.save(state, sizing, durability="memory")
    try:
        _wait_for_spare(client, client.status(sizing).size)
        client.warmup(wait=True)
        t0 = time.perf_counter()
        client.save(state, path, durability=durability)
        first = time.perf_counter() - t0
    finally:
        with contextlib.suppress(Exception):
            client.delete(sizing)
    repeated = float("inf")
    for _ in range(repeats):
        wait_idle(client, path)
        t0 = time.perf_counter()
        client.save(state, path, durability=durability)
        repeated = min(repeated, time.perf_counter() - t0)
    return first, repeated


def _wait_for_spare(client: Client, nbytes: int, timeout: float = 60.0) -> None:
    """Wait until the daemon's pool is done growing and holds a spare of ``nbytes`` or more,
    at most ``timeout``; or until it has not started growing within 2 s (a daemon without a
    pool, ``--pool-bytes 0``, or with no budget left for it)."""
    t0 = time.monotonic()
    seen_growing = False
    while (waited := time.monotonic() - t0) < timeout:
        reply = client.pool()
        if not reply.growing and any(c >= nbytes for c in reply.capacities):
            return
        seen_growing = seen_growing or reply.growing
        if not seen_growing and waited > 2.0:
            return
        time.sleep(0.01)


def load_stalls(
    client: Client,
    path: str,
    expected: dict[str, torch.Tensor],
    repeats: int,
    *,
    key: str | None = None,
) -> tuple[float, float, bool]:
    """(zero-copy, private copy, matched): load times and whether the bytes equal ``expected``
    (the loaded object itself, or its entry ``key``)."""
    t0 = time.perf_counter()
    loaded = client.load(path)
    zero_copy = time.perf_counter() - t0
    if key is not None:
        loaded = loaded[key]
    matched = set(loaded) == set(expected) and all(
        torch.equal(loaded[k], v) for k, v in expected.items()
    )
    del loaded
    private = best_of(repeats, lambda: client.load(path, mmap=False))
    return zero_copy, private, matched


def _flat_bytes(state: dict[str, torch.Tensor]) -> bytes:
    return b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in state.values())


def raw_write_seconds(state: dict[str, torch.Tensor], target: str) -> float:
    """The storage limit: one write + fsync (or one upload) of the state's bytes to ``target``."""
    from ckptcache.storage import backend_for

    data = _flat_bytes(state)
    backend = backend_for(target)
    t0 = time.perf_counter()
    backend.write_bytes(target, data)
    seconds = time.perf_counter() - t0
    backend.delete(target)
    return seconds


def persist_seconds(client: Client, state: Any, path: str) -> float:
    """Seconds from a save's return until the daemon reports ``path`` persisted."""
    client.save(state, path)
    t0 = time.perf_counter()
    client.wait(path)
    return time.perf_counter() - t0


#: Copies of one state the bench holds at once: the first timed save next to the untimed
#: sizing save, a repeated save next to the generation it replaces, the non-blocking save
#: next to the saved path.
BENCH_COPIES = 2


def preflight(client: Client, sizes: list[int], root: str | None) -> None:
    """Refuse at once what the bench could only fail at after minutes: a size whose copies do
    not fit the daemon's budget, or a ``root`` the daemon would never persist to (the
    persist row would be missing). Raises :class:`ConfigError` saying what to change."""
    status = client.daemon_status()
    room = status.memory_limit - status.memory_used + status.memory_free_pool
    for nbytes in sizes:
        need = BENCH_COPIES * _segment_bytes(nbytes)
        if need > room:
            raise ConfigError(
                f"--sizes {format_bytes(nbytes)}: the bench holds {BENCH_COPIES} copies of a "
                f"state at once ({format_bytes(need)}), more than the daemon has room for "
                f"({format_bytes(room)} of its {format_bytes(status.memory_limit)} budget); "
                f"pick a size of at most {format_bytes(room // BENCH_COPIES)}, or start the "
                f"daemon with a larger --memory-limit"
            )
    if root is not None:
        _check_root(client, root, status.persist_roots)


def _segment_bytes(nbytes: int) -> int:
    """Bytes of the segment a state of ``nbytes`` takes (payload rounded up, header)."""
    from ckptcache.format.layout import HEADER_SIZE, SEGMENT_GRANULE, align

    return align(nbytes + HEADER_SIZE, SEGMENT_GRANULE)


def _check_root(client: Client, root: str, roots: tuple[str, ...]) -> None:
    """Ask the daemon itself whether it persists under ``root`` (a tiny probe save it either
    queues for storage, keeps in memory only, or refuses), then remove the probe."""
    from ckptcache.storage import backend_for

    probe = f"{root.rstrip('/')}/ckptcache-bench-probe-{os.getpid()}.pt"
    hint = (
        f"--root {root}: the daemon does not persist there (its persist roots: "
        f"{', '.join(roots) or 'none'}), so the persist figure could not be measured; pass a "
        "directory under one of its roots, or start the daemon with --persist-root covering it"
    )
    try:
        client.save({"probe": torch.zeros(1)}, probe)
    except PathNotAllowed as e:
        raise ConfigError(hint) from e
    try:
        if client.status(probe).persist_state == PersistState.MEMORY_ONLY:
            raise ConfigError(hint)
        client.wait(probe)
    finally:
        with contextlib.suppress(Exception):
            client.delete(probe)
        with contextlib.suppress(Exception):
            backend_for(probe).delete(probe)


def measure_size(
    client: Client,
    nbytes: int,
    workdir: str,
    *,
    repeats: int = 3,
    root: str | None = None,
    progress: Progress | None = None,
    cluster: bool = False,
) -> dict[str, Any]:
    """Every figure for one size; ``workdir`` holds the cache paths and torch.save files;
    ``cluster``: the daemon has peers, also measure the backup copy and a peer load."""
    tick = progress.step if progress is not None else (lambda label: None)
    state = make_state(nbytes)
    size = sum(t.nbytes for t in state.values())
    memcpy = memcpy_seconds(state, repeats)
    tick("memcpy")
    path = os.path.join(workdir, f"bench-{size}", "model.pt")
    # Memory only, chosen explicitly: the stall is the same copy, and no persist of the
    # bench's own saves competes with what it measures.
    first, repeated = save_stalls(client, state, path, repeats, durability="memory")
    tick("ckptcache.save")
    handle_t0 = time.perf_counter()
    handle = client.save(state, path + ".async", durability="memory", blocking=False)
    submit = time.perf_counter() - handle_t0
    if handle is not None:
        handle.wait()
    tick("ckptcache.save, non-blocking")
    zero_copy, private, matched = load_stalls(client, path, state, repeats)
    tick("ckptcache.load")
    file = os.path.join(workdir, f"torch-{size}.pt")
    t_save = best_of(repeats, lambda: torch_save_fast(state, file))
    t_load = best_of(repeats, lambda: torch.load(file))
    os.unlink(file)
    tick("torch.save / torch.load")
    lim = ("memcpy", memcpy)
    rows = [
        Measure("memcpy (limit)", size, memcpy),
        Measure("ckptcache.save, first (new path)", size, first, *lim),
        Measure("ckptcache.save, repeated", size, repeated, *lim),
        # The time save() takes to return; the copy runs after it: no copy's limit applies.
        Measure("ckptcache.save, non-blocking (returns)", size, submit),
        # Maps the segment and copies nothing: no copy's limit applies to it.
        Measure("ckptcache.load, zero-copy", size, zero_copy),
        Measure("ckptcache.load, private copy", size, private, *lim),
        Measure("torch.save (local file, CRC off)", size, t_save, *lim),
        Measure("torch.load (local file)", size, t_load, *lim),
    ]
    if root is not None:
        rows += _persist_rows(client, state, size, root)
        tick("persist")
    if cluster:
        rows += cluster_rows(client, state, size, path + ".cluster", repeats)
        tick("backup copy, peer load")
    for p in (path, path + ".async", path + ".cluster"):
        with contextlib.suppress(Exception):
            client.delete(p)
    return {"nbytes": size, "matched": matched, "rows": [r.as_dict() for r in rows]}


def _persist_rows(client: Client, state: Any, size: int, root: str) -> list[Measure]:
    base = f"{root.rstrip('/')}/ckptcache-bench-{os.getpid()}-{size}"
    raw = raw_write_seconds(state, base + "-raw.bin")
    limit = ("raw write + fsync" if "://" not in root else "raw upload", raw)
    rows = [Measure(f"{limit[0]} (limit)", size, raw)]
    target = base + ".pt"  # under a root the daemon persists to: checked by preflight
    rows.append(Measure("ckptcache persist (after save returns)", size,
                        persist_seconds(client, state, target), *limit))  # fmt: skip
    from ckptcache.storage import backend_for

    with contextlib.suppress(Exception):
        client.delete(target)
        backend_for(target).delete(target)
    return rows


def cluster_rows(client: Client, state: Any, size: int, path: str, repeats: int) -> list[Measure]:
    """The backup copy and a load from a peer, next to a raw TCP socket moving the same bytes.

    * backup copy: ``save(durability="backup")`` returns once a peer holds a verified copy;
      its cost is that save's stall minus a local save's (each the best of ``repeats``);
    * peer load: this node's copy is dropped (``delete`` is local; the peer keeps its backup)
      and ``load`` fetches it from the peer, checks its digests and maps it.

    Without backup nodes (``--backup none``) only the socket limit is reported.
    """
    raw = min(raw_socket_seconds(size) for _ in range(repeats))
    limit = ("raw socket", raw)
    rows = [Measure("raw socket, loopback TCP (limit)", size, raw)]
    local = backup = float("inf")
    for _ in range(repeats):
        for durability in ("local", "backup"):
            with contextlib.suppress(CheckpointNotFound):  # the first save
                wait_idle(client, path)
            t0 = time.perf_counter()
            try:
                client.save(state, path, durability=durability)
            except ReplicationError:
                return rows  # no backup nodes configured: nothing more to measure
            took = time.perf_counter() - t0
            if durability == "local":
                local = min(local, took)
            else:
                backup = min(backup, took)
    peer = float("inf")
    for _ in range(repeats):
        client.delete(path)
        t0 = time.perf_counter()
        loaded = client.load(path)
        peer = min(peer, time.perf_counter() - t0)
        del loaded
    tier = client.status(path).last_load_tier
    load = "ckptcache.load from a peer" + ("" if tier == "peer" else f" (served from {tier})")
    copy = max(backup - local, 1e-9)
    return [
        *rows,
        Measure("ckptcache.save, durability=backup", size, backup, *limit),
        Measure("backup copy (backup save - local save)", size, copy, *limit),
        Measure(load, size, peer, *limit),
    ]


def format_measures(results: dict[str, Any]) -> str:
    """Markdown tables, one per size."""
    out = [f"node {results['node']}: segments on a tmpfs with huge={results['shm_huge_pages']} "
           "(docs/tuning.md, Huge pages)"]  # fmt: skip
    for entry in results["sizes"]:
        out.append(f"\n### {entry['nbytes'] / 2**20:.0f} MiB (reloaded bytes matched: "
                   f"{entry['matched']})\n")  # fmt: skip
        out.append("| operation | time (s) | GB/s | vs limit |")
        out.append("|---|---:|---:|---:|")
        for r in entry["rows"]:
            vs = f"{r['vs_limit']:.2f}x {r['limit']}" if r["vs_limit"] is not None else "-"
            out.append(f"| {r['what']} | {r['seconds']:.4f} | {r['gbps']:.2f} | {vs} |")
    return "\n".join(out)


@contextlib.contextmanager
def _workdir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="ckptcache-bench-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def run_bench(
    client: Client,
    sizes: list[int],
    *,
    repeats: int = 3,
    root: str | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Measure every size against ``client``'s daemon; returns the JSON-ready results.

    Raises :class:`ConfigError` at once for a size or a ``root`` the bench cannot measure
    (see :func:`preflight`)."""
    preflight(client, sizes, root)
    status = client.daemon_status()
    cluster = len(status.cluster_nodes) > 1
    bar = Progress(len(sizes) * (5 + bool(root) + cluster), enabled=progress)
    results: dict[str, Any] = {
        "node": status.node_id, "socket": client.socket_path, "repeats": repeats,
        "root": root, "torch": torch.__version__, "cluster_nodes": list(status.cluster_nodes),
        "shm_huge_pages": status.shm_huge_pages, "sizes": [],
    }  # fmt: skip
    try:
        with _workdir() as workdir:
            client.warmup(wait=True)  # as a trainer would at start: spares mapped
            for nbytes in sizes:
                entry = measure_size(
                    client, nbytes, workdir, repeats=repeats, root=root, progress=bar,
                    cluster=cluster,
                )  # fmt: skip
                results["sizes"].append(entry)
    finally:
        bar.close()
    return results
