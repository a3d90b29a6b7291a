"""CUDA tensors: ckptcache's save and load against the PCIe/NVLink-C2C limit and what users
would run instead, in one process, one run.

    python benchmarks/gpu/bench.py --sizes 512MiB 2GiB --shapes few mix

For each shape (``few``: 32 float32 tensors; ``mix``: 75% of the bytes in 16 MiB tensors, the
rest in 64 KiB ones, 2,072 tensors at 512 MiB) and size, all tensors on ``cuda:0``:

* **limits**: one device-to-host copy per tensor into a pinned, touched host buffer (what
  DCP's and DLRover's stagers do), one copy of a single flat tensor of the same bytes, and the
  host-to-device copies back; the smallest time of each is the limit;
* **ckptcache** through a real daemon: the first save of a client that never called
  ``warmup`` (pageable copies; the mapping is registered in the background), the first save
  of a client that did (its spare registered by then), the repeated
  save, ``save(blocking=False)`` until it returns and until ``wait()`` returns, a load to
  ``cuda`` (host-to-device from the mapping, pinned read-only) and a zero-copy load to the CPU;
* **torch.save** / **torch.load(map_location="cuda")** of the same state to ``/dev/shm``;
* **DCP**: ``dcp.save`` to ``/dev/shm`` (no process group) and ``dcp.load`` into tensors
  allocated before the timer.

Every reload is compared with the saved state byte for byte. Figures are the best of
``--repeats``; each line gives the limit / figure ratio (1.00x: as fast as the limit).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from ckptcache._units import format_bytes, parse_bytes
from ckptcache.cli.bench import _wait_for_spare, wait_idle
from ckptcache.cli.benchmarking import make_state, mixed_state, running_daemon
from ckptcache.client import Client


def cuda_state(nbytes: int, shape: str) -> dict[str, torch.Tensor]:
    """The state ``shape`` of ``nbytes`` with every tensor on ``cuda:0``."""
    host = make_state(nbytes, n_tensors=32) if shape == "few" else mixed_state(nbytes)
    return {k: v.to("cuda") for k, v in host.items()}


def timed(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """Best time of ``repeats`` calls of ``fn`` (device idle before each), the last result."""
    best, out = float("inf"), None
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best, out


def check_equal(state: dict[str, torch.Tensor], loaded: dict[str, Any], device: str) -> None:
    """Raise unless ``loaded`` holds ``state``'s keys and bytes, on ``device``."""
    assert set(loaded) == set(state), "reloaded keys differ"
    for k, v in state.items():
        got = loaded[k]
        assert got.device.type == device, (k, got.device)
        assert torch.equal(got.to(v.device), v), f"bytes of {k} differ"


def limits(state: dict[str, torch.Tensor], repeats: int) -> dict[str, float]:
    """Device-to-host and host-to-device copies into and out of touched pinned memory."""
    total = sum(v.untyped_storage().nbytes() for v in state.values())
    host = torch.ones(total, dtype=torch.uint8).pin_memory()
    views, offset = [], 0
    for v in state.values():
        n = v.untyped_storage().nbytes()
        views.append(host[offset : offset + n].view(v.dtype).view(v.shape))
        offset += n
    flat = torch.empty(total, dtype=torch.uint8, device="cuda")
    back = [torch.empty_like(v) for v in state.values()]

    def d2h_each() -> None:
        for dst, src in zip(views, state.values(), strict=True):
            dst.copy_(src, non_blocking=True)

    def h2d_each() -> None:
        for dst, src in zip(back, views, strict=True):
            dst.copy_(src, non_blocking=True)

    def d2h_flat() -> None:
        host.copy_(flat, non_blocking=True)

    def h2d_flat() -> None:
        flat.copy_(host, non_blocking=True)

    def pageable() -> None:
        for v in state.values():
            v.cpu()

    out = {
        "d2h one flat copy (pinned)": timed(d2h_flat, repeats)[0],
        "h2d one flat copy (pinned)": timed(h2d_flat, repeats)[0],
        # per tensor last: the host buffer then holds the state, which goes back
        "d2h per tensor (pinned)": timed(d2h_each, repeats)[0],
        "h2d per tensor (pinned)": timed(h2d_each, repeats)[0],
        "d2h per tensor (pageable, .cpu())": timed(pageable, repeats)[0],
    }
    assert all(torch.equal(b, v) for b, v in zip(back, state.values(), strict=True))
    return out


def ckptcache_figures(state: dict[str, torch.Tensor], nbytes: int, repeats: int) -> dict:
    """ckptcache's save and load figures through a real daemon."""
    out: dict[str, float] = {}
    pool = ("--pool-segments", "1", "--pool-bytes", str(nbytes + (64 << 20)))
    args = ("--memory-limit", str(4 * nbytes + (512 << 20)), "--keep", "1", *pool)
    root = tempfile.mkdtemp(prefix="gpu-bench-")
    with running_daemon(*args) as daemon:
        with Client(daemon.socket, fallback="raise") as c:  # never warmed up
            _wait_for_spare(c, nbytes)
            cold = os.path.join(root, "cold.pt")
            out["ckptcache first save (no warmup)"] = timed(lambda: c.save(state, cold), 1)[0]
            wait_idle(c, cold)
            c.delete(cold)
        _more_ckptcache_figures(state, nbytes, repeats, daemon.socket, root, out)
    shutil.rmtree(root, ignore_errors=True)
    return out


def _more_ckptcache_figures(
    state: dict[str, torch.Tensor], nbytes: int, repeats: int, socket: str, root: str,
    out: dict[str, float],
) -> None:  # fmt: skip
    with Client(socket, fallback="raise") as c:
        c.warmup(wait=True)
        _wait_for_spare(c, nbytes)
        path = os.path.join(root, "a.pt")
        out["ckptcache first save (warmed up)"] = timed(lambda: c.save(state, path), 1)[0]
        wait_idle(c, path)
        stalls = []
        for _ in range(repeats):
            wait_idle(c, path)
            stalls.append(timed(lambda: c.save(state, path), 1)[0])
        out["ckptcache repeated save"] = min(stalls)
        returns, waits = [], []
        for _ in range(repeats):
            wait_idle(c, path)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            handle = c.save(state, path, blocking=False)
            returns.append(time.perf_counter() - t0)
            handle.wait()
            waits.append(time.perf_counter() - t0)
        out["ckptcache save(blocking=False) returns"] = min(returns)
        out["ckptcache save(blocking=False) wait()"] = min(waits)
        wait_idle(c, path)
        STEPS.update(_steps_beside_a_save(c, state, path))
        wait_idle(c, path)
        t, loaded = timed(lambda: c.load(path, map_location="cuda"), repeats)
        check_equal(state, loaded, "cuda")
        out["ckptcache load to cuda"] = t
        del loaded
        if PROFILE:
            _profile(lambda: c.load(path, map_location="cuda"))
        t, loaded = timed(lambda: c.load(path, map_location="cpu"), repeats)
        check_equal(state, loaded, "cpu")
        out["ckptcache load to cpu (zero-copy)"] = t
        del loaded


#: Whether to print a cProfile of one load to ``cuda`` (``--profile``).
PROFILE = False

#: Training steps alone and beside a non-blocking save (seconds; not limited by a copy).
STEPS: dict[str, float] = {}


def _steps_beside_a_save(c: Client, state: dict[str, torch.Tensor], path: str) -> dict:
    """Ten training-like steps (a 8192^2 matmul each) alone, then begun right after
    ``save(blocking=False)`` returned: what the save's copy takes from the step it overlaps."""
    x = torch.randn(8192, 8192, device="cuda")

    def steps() -> None:
        for _ in range(10):
            x.matmul(x)
        torch.cuda.synchronize()

    steps()  # warm the kernels
    alone = timed(steps, 1)[0]
    handle = c.save(state, path, blocking=False)
    beside = timed(steps, 1)[0]
    handle.wait()
    return {"10 steps alone": alone, "10 steps beside save(blocking=False)": beside}


def _profile(fn: Callable[[], Any]) -> None:
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(fn)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(14)


def torch_figures(state: dict[str, torch.Tensor], repeats: int) -> dict[str, float]:
    """torch.save / torch.load to a file in /dev/shm."""
    d = tempfile.mkdtemp(dir="/dev/shm")
    path = os.path.join(d, "state.pt")
    try:
        out = {"torch.save to /dev/shm": timed(lambda: torch.save(state, path), repeats)[0]}
        t, loaded = timed(lambda: torch.load(path, map_location="cuda"), repeats)
        check_equal(state, loaded, "cuda")
        out["torch.load to cuda from /dev/shm"] = t
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return out


def dcp_figures(state: dict[str, torch.Tensor], repeats: int) -> dict[str, float]:
    """dcp.save / dcp.load (one process, no process group) to a folder in /dev/shm."""
    import torch.distributed.checkpoint as dcp

    d = tempfile.mkdtemp(dir="/dev/shm")
    try:
        where = os.path.join(d, "s")
        out = {"dcp.save to /dev/shm": timed(lambda: dcp.save(state, checkpoint_id=where),
                                             repeats)[0]}  # fmt: skip
        target = {k: torch.empty_like(v) for k, v in state.items()}
        t, _ = timed(lambda: dcp.load(target, checkpoint_id=where), repeats)
        check_equal(state, target, "cuda")
        out["dcp.load to cuda from /dev/shm"] = t
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return out


def report(title: str, figures: dict[str, float], d2h: float, h2d: float) -> None:
    """One line per figure, with the limit / figure ratio."""
    print(f"\n### {title}\n\n| operation | time | limit / time |\n|---|---:|---:|")
    for name, seconds in figures.items():
        limit = h2d if ("load" in name or "h2d" in name) else d2h
        print(f"| {name} | {seconds * 1e3:.1f} ms | {limit / seconds:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["512MiB", "2GiB"])
    parser.add_argument("--shapes", nargs="+", default=["few", "mix"], choices=["few", "mix"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="profile one load to cuda")
    opts = parser.parse_args()
    global PROFILE
    PROFILE = opts.profile
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    print(f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}")
    for size in opts.sizes:
        nbytes = parse_bytes(size)
        for shape in opts.shapes:
            state = cuda_state(nbytes, shape)
            figures = limits(state, opts.repeats)
            d2h = min(v for k, v in figures.items() if k.startswith("d2h"))
            h2d = min(v for k, v in figures.items() if k.startswith("h2d"))
            for part in (ckptcache_figures, torch_figures, dcp_figures):
                try:
                    if part is ckptcache_figures:
                        figures.update(part(state, nbytes, opts.repeats))
                    else:
                        figures.update(part(state, opts.repeats))  # type: ignore[call-arg]
                except Exception as e:  # a failing system is reported, the others still run
                    print(f"{part.__name__} failed: {type(e).__name__}: {e}")
            report(f"{format_bytes(nbytes)}, {shape} ({len(state)} tensors)", figures, d2h, h2d)
            if STEPS:
                alone, beside = STEPS.values()
                print(f"\ntraining steps: {alone * 1e3:.1f} ms alone, {beside * 1e3:.1f} ms beside "
                      f"a non-blocking save ({beside / alone:.2f}x)")  # fmt: skip
                STEPS.clear()
            del state
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
