"""Restart-proof data loading: time to first batch after a restart, and host memory per reader.

Run from the repository root::

    python benchmarks/data_cache/bench.py

Part 1 kills a training process (SIGKILL) that reads a slow dataset through
``CachedDataLoader``, restarts it, and measures the time from constructing the loader to the
first batch (and to the 30th); the baseline is a plain ``torch.utils.data.DataLoader`` with
two worker processes restarted at the same step (its sampler starts there, so it pays no
fast-forward cost: the best case for the baseline). The dataset simulates remote storage:
``OPEN_S`` to open it, ``WORKER_INIT_S`` per worker to connect, ``ITEM_S`` per sample.

Part 2 has N processes (N = 1, 2, 4; think tensor-parallel peers) hold the same ``HOLD``
batches and measures the sum of their proportional set sizes of data pages (``Pss_Anon`` +
``Pss_Shmem`` in ``/proc/<pid>/smaps_rollup``, after minus before creating the loader):
with the cache one rank loads and the others map the same shared-memory files; without,
every rank builds its own copy.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

OPEN_S = 1.0  # opening the dataset (listing a bucket, reading an index)
WORKER_INIT_S = 0.5  # each worker connects to the store
ITEM_S = 0.02  # fetching one sample
BATCH = 8  # one batch = 8 x 20 ms / 2 workers = 80 ms of loading
STEP_S = 0.2  # a training step: the loader keeps up, so prefetching can get ahead
SAMPLES = 8 * 200
RESTART_STEP = 12
REPEATS = 3
HOLD = 8  # part 2: batches every process holds
HOLD_SHAPE = (4, 1, 512, 512)  # 4 MiB of float32 per batch


class SlowDataset(Dataset[torch.Tensor]):
    """Deterministic samples behind simulated remote latency."""

    def __init__(self, open_s: float = OPEN_S, item_s: float = ITEM_S):
        time.sleep(open_s)
        self.item_s = item_s

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(self.item_s)
        return torch.randn(3, 64, 64, generator=torch.Generator().manual_seed(i))


class StartAt(Sampler[int]):
    """Sequential indices from ``start`` (a resumable sampler)."""

    def __init__(self, start: int = 0):
        self.start = start

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, SAMPLES))

    def __len__(self) -> int:
        return SAMPLES - self.start


def _worker_init(_: int) -> None:
    time.sleep(WORKER_INIT_S)


def plain_loader(start_step: int = 0) -> DataLoader[torch.Tensor]:
    """What users run today: a DataLoader with 2 worker processes."""
    return DataLoader(
        SlowDataset(), batch_size=BATCH, num_workers=2, sampler=StartAt(start_step * BATCH),
        worker_init_fn=_worker_init, persistent_workers=False,
    )  # fmt: skip


class ResumableLoader:
    """The plain loader plus the ``skip(n)`` hook: the cache's prefetcher fast-forwards it
    by moving the sampler instead of loading and discarding ``n`` batches."""

    def __init__(self) -> None:
        self.start = 0

    def skip(self, n: int) -> None:
        self.start = n

    def __len__(self) -> int:
        return SAMPLES // BATCH

    def __iter__(self) -> Iterator[torch.Tensor]:
        start, self.start = self.start, 0
        return iter(plain_loader(start))


# ---------------------------------------------------------------------- roles (subprocesses)


def role_train(cfg: dict[str, Any]) -> None:
    """First incarnation: train with the cache, checkpointing the position every step."""
    from ckptcache.data import CachedDataLoader

    dl = CachedDataLoader(ResumableLoader, cache_dir=cfg["cache_dir"], run_id="bench")
    for _ in dl:
        time.sleep(STEP_S)  # the training step
        with open(cfg["state"] + ".tmp", "w") as f:
            json.dump(dl.state_dict(), f)
        os.replace(cfg["state"] + ".tmp", cfg["state"])
    # (killed long before the epoch ends)


def _first_batches(it: Iterator[Any], t0: float) -> dict[str, float]:
    next(it)
    first = time.perf_counter() - t0
    for _ in range(29):
        next(it)
    return {"first": first, "thirtieth": time.perf_counter() - t0}


def role_resume_cached(cfg: dict[str, Any]) -> None:
    """Second incarnation with the cache."""
    from ckptcache.data import CachedDataLoader

    with open(cfg["state"]) as f:
        state = json.load(f)
    t0 = time.perf_counter()
    dl = CachedDataLoader(ResumableLoader, cache_dir=cfg["cache_dir"], run_id="bench")
    dl.load_state_dict(state)
    result = _first_batches(iter(dl), t0)
    print(json.dumps(result), flush=True)
    dl.close()


def role_resume_plain(cfg: dict[str, Any]) -> None:
    """Second incarnation without the cache."""
    t0 = time.perf_counter()
    it = iter(plain_loader(cfg["step"]))
    print(json.dumps(_first_batches(it, t0)), flush=True)
    del it  # joins the worker processes before exit


def _pss() -> int:
    """Pss of anonymous and shared-memory pages: the data this process holds.

    Library pages (``Pss_File``) are left out: their share moves as other processes start,
    which would drown the data in noise.
    """
    total = 0
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith(("Pss_Anon:", "Pss_Shmem:")):
                total += int(line.split()[1]) * 1024
    return total


class HoldDataset(Dataset[torch.Tensor]):
    """Fast deterministic 1 MiB samples for the memory comparison."""

    def __len__(self) -> int:
        return 1000

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.randn(HOLD_SHAPE[1:], generator=torch.Generator().manual_seed(i))


def _hold_loader() -> DataLoader[torch.Tensor]:
    return DataLoader(HoldDataset(), batch_size=HOLD_SHAPE[0], num_workers=0)


def role_hold(cfg: dict[str, Any]) -> None:
    """Hold ``HOLD`` batches, report the Pss they cost, wait for the stop file."""
    from ckptcache.data import CachedDataLoader  # imported in both modes: same baseline

    dl: Any
    before = _pss()  # before the loader exists: its own working memory counts too
    if cfg["cached"]:
        loading = cfg["rank"] == 0
        dl = CachedDataLoader(
            _hold_loader if loading else None, cache_dir=cfg["cache_dir"], run_id="hold",
            is_loading_rank=loading, prefetch=HOLD, lookback=HOLD, start_step=0,
        )  # fmt: skip
    else:
        dl = _hold_loader()
    it = iter(dl)
    held = [next(it) for _ in range(HOLD)]
    checksum = sum(float(b.sum()) for b in held)  # touch every page
    print(json.dumps({"pss": _pss() - before, "checksum": checksum}), flush=True)
    while not os.path.exists(cfg["stop"]):
        time.sleep(0.02)


# ---------------------------------------------------------------------- orchestration


def _spawn(role: str, cfg: dict[str, Any]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, __file__, role, json.dumps(cfg)], stdout=subprocess.PIPE, text=True
    )


def _result(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"benchmark process exited with {proc.wait()}")
    return dict(json.loads(line))


def bench_restart(cache_dir: str, state: str) -> tuple[list[dict[str, float]], ...]:
    """Kill a cached trainer at RESTART_STEP, then time both restarts REPEATS times."""
    cached, plain = [], []
    for _ in range(REPEATS):
        shutil.rmtree(cache_dir, ignore_errors=True)
        trainer = _spawn("train", {"cache_dir": cache_dir, "state": state})
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                with open(state) as f:
                    if json.load(f)["step"] >= RESTART_STEP:
                        break
            except (FileNotFoundError, ValueError):
                pass
            time.sleep(0.01)
        time.sleep(1.0)  # the prefetcher keeps filling its window while training goes on
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
        with open(state) as f:
            step = json.load(f)["step"]
        proc = _spawn("resume_cached", {"cache_dir": cache_dir, "state": state})
        cached.append(_result(proc))
        proc.wait()
        proc = _spawn("resume_plain", {"step": step})
        plain.append(_result(proc))
        proc.wait()
        os.unlink(state)
    return cached, plain


def _tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def bench_memory(cache_dir: str, stop: str) -> dict[tuple[int, bool], tuple[int, int]]:
    """(sum of Pss deltas, bytes in tmpfs) of N processes holding the same batches."""
    out: dict[tuple[int, bool], tuple[int, int]] = {}
    for n in (1, 2, 4):
        for cached in (False, True):
            shutil.rmtree(cache_dir, ignore_errors=True)
            procs = [
                _spawn("hold", {"cache_dir": cache_dir, "stop": stop, "rank": r, "cached": cached})
                for r in range(n)
            ]
            results = [_result(p) for p in procs]
            assert len({r["checksum"] for r in results}) == 1, "processes saw different data"
            out[(n, cached)] = (sum(r["pss"] for r in results), _tree_bytes(cache_dir))
            open(stop, "w").close()
            for p in procs:
                p.wait()
            os.unlink(stop)
    return out


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def main() -> None:
    """Run both parts and print the README tables."""
    tag = uuid.uuid4().hex[:8]
    cache_dir = f"/dev/shm/ckptcache-bench-data-{tag}"
    state = f"/tmp/ckptcache-bench-data-{tag}.json"
    stop = f"/tmp/ckptcache-bench-data-{tag}.stop"
    try:
        cached, plain = bench_restart(cache_dir, state)
        memory = bench_memory(cache_dir, stop)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    data = HOLD * 4 * torch.Size(HOLD_SHAPE).numel() / 2**20
    print(f"\nRestart at step {RESTART_STEP}, median of {REPEATS} (seconds):\n")
    print("| loader | first batch | 30th batch |")
    print("|---|---|---|")
    for name, runs in (("DataLoader, 2 workers", plain), ("CachedDataLoader", cached)):
        print(
            f"| {name} | {_median([r['first'] for r in runs]):.3f} | "
            f"{_median([r['thirtieth'] for r in runs]):.3f} |"
        )
    print(
        f"\nHost memory for {data:.0f} MiB of held batches, "
        "sum over N processes of Pss_Anon + Pss_Shmem (MiB):\n"
    )
    print("| N | own copies | shared cache | ratio | cache files in tmpfs |")
    print("|---|---|---|---|---|")
    for n in (1, 2, 4):
        own, shared = memory[(n, False)][0] / 2**20, memory[(n, True)][0] / 2**20
        tmpfs = memory[(n, True)][1] / 2**20
        print(f"| {n} | {own:.1f} | {shared:.1f} | {own / shared:.2f}x | {tmpfs:.1f} |")


if __name__ == "__main__":
    if len(sys.argv) > 2:
        globals()[f"role_{sys.argv[1]}"](json.loads(sys.argv[2]))
    else:
        main()
