"""Per-tensor cost: save stall, first save, non-blocking return and zero-copy load against
the number of tensors at fixed bytes, each next to a memcpy of the same tensors in the same run.

    python benchmarks/save_load/tensor_count.py --sizes 512MiB 2GiB

Three states per size, all float32 CPU tensors: ``few`` (32 equal tensors), ``mix`` (75% of the
bytes in 16 MiB tensors, the rest in 64 KiB ones: 2,072 tensors at 512 MiB, 8,288 at 2 GiB) and
``many`` (four times ``mix``'s count, equal tensors). The per-tensor cost of an operation is the
slope of its time against the tensor count (least squares over the three states). A fresh daemon
per state; every reload is compared with the saved state byte for byte.

``--profile`` prints a cProfile of one repeated save and one zero-copy load of ``mix``.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import os
import pstats
import statistics
import tempfile
import time
from typing import Any

import torch

from ckptcache._units import format_bytes, parse_bytes
from ckptcache.cli.bench import _wait_for_spare, wait_idle
from ckptcache.cli.benchmarking import make_state, memcpy_seconds, mixed_state, running_daemon
from ckptcache.client import Client
from ckptcache.format.fastcopy import COPY_IMPLEMENTATION


def make_state_of(nbytes: int, shape: str) -> dict[str, torch.Tensor]:
    """The state ``shape`` (few, mix or many tensors) of ``nbytes``."""
    if shape == "few":
        return make_state(nbytes, n_tensors=32)
    mix = mixed_state(nbytes)
    if shape == "mix":
        return mix
    n_many = 4 * len(mix)
    del mix
    size = nbytes // n_many // 64 * 64
    return {f"layers.{i}.bias": torch.full((size // 4,), float(i % 251)) for i in range(n_many)}


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure_state(state: dict[str, torch.Tensor], nbytes: int, root: str, repeats: int) -> dict:
    """Every figure of one state, with its memcpy (the best of a sample before the saves and
    one between them)."""
    out: dict[str, float] = {"memcpy": memcpy_seconds(state)}
    pool = ("--pool-segments", "1", "--pool-bytes", str(nbytes + (64 << 20)))
    args = ("--memory-limit", str(5 * nbytes + (512 << 20)), "--keep", "1", *pool)
    with running_daemon(*args) as daemon:
        sizing = os.path.join(root, "sizing.pt")
        with Client(daemon.socket, fallback="raise") as c:  # sizes the daemon's spare pool
            c.save(state, sizing, durability="memory")
            _wait_for_spare(c, c.status(sizing).size)
            c.delete(sizing)
        # A trainer that never calls warmup(): its first contact with the daemon is the save.
        # The checkpoint is kept (a deleted one's segment would be handed out next, ahead of
        # the spare the next client maps: not what a training job meets).
        with Client(daemon.socket, fallback="raise") as c:
            out["first, save is first contact"] = _timed(
                lambda: c.save(state, os.path.join(root, "a.pt"), durability="memory")
            )
            _wait_for_spare(c, nbytes)
        # The trainer's next runs, each after the previous run's checkpoint was deleted: the
        # deleted one's segment is free beside the spare, and only the spare was listed to
        # the new client (best of ``repeats`` runs, a fresh client each).
        firsts, last = [], os.path.join(root, "a.pt")
        for i in range(repeats):
            with Client(daemon.socket, fallback="raise") as c:
                c.delete(last)
                _wait_for_spare(c, nbytes)
            last = os.path.join(root, f"c{i}.pt")
            with Client(daemon.socket, fallback="raise") as c:
                c.exists(last)
                time.sleep(1.0)
                firsts.append(_timed(lambda p=last: c.save(state, p, durability="memory")))
                wait_idle(c, last)
        out["first, after a delete"] = min(firsts)
        with Client(daemon.socket, fallback="raise") as c:
            _wait_for_spare(c, nbytes)
        # A trainer that never calls warmup() but asked the daemon something a second before
        # (a resume check): the client warms up on its own at first contact.
        path = os.path.join(root, "b.pt")
        with Client(daemon.socket, fallback="raise") as c:
            c.exists(path)
            time.sleep(1.0)
            out["first, contact 1 s before"] = _timed(lambda: c.save(state, path))
            stalls, returns, loads = [], [], []
            for _ in range(repeats):
                wait_idle(c, path)
                # The limit sampled again right before each save: the machine's copy speed
                # moves between moments, and a limit that gets fewer chances at a quiet one
                # than the save can be beaten (mis-measured).
                out["memcpy"] = min(out["memcpy"], memcpy_seconds(state))
                stalls.append(_timed(lambda: c.save(state, path)))
            for _ in range(repeats):
                wait_idle(c, path)
                handle: Any = None

                def submit() -> None:
                    nonlocal handle
                    handle = c.save(state, path, blocking=False)

                returns.append(_timed(submit))
                handle.wait()
            wait_idle(c, path)
            for _ in range(repeats):
                loaded: Any = None

                def load() -> None:
                    nonlocal loaded
                    loaded = c.load(path)

                loads.append(_timed(load))
                assert set(loaded) == set(state), "reloaded keys differ"
                assert all(torch.equal(loaded[k], v) for k, v in state.items()), "bytes differ"
                del loaded
                gc.collect()
            out["repeated"] = min(stalls)
            out["non-blocking return"] = min(returns)
            out["zero-copy load"] = min(loads)
    return out


def profile(state: dict[str, torch.Tensor], nbytes: int, root: str) -> str:
    """cProfile of one repeated save and one zero-copy load of ``state``."""
    args = ("--memory-limit", str(3 * nbytes + (256 << 20)), "--keep", "1")
    path = os.path.join(root, "p.pt")
    text = io.StringIO()
    with running_daemon(*args) as daemon, Client(daemon.socket, fallback="raise") as c:
        c.save(state, path)
        wait_idle(c, path)
        for what, fn in (
            ("repeated save", lambda: c.save(state, path)),
            ("load", lambda: c.load(path)),
        ):
            prof = cProfile.Profile()
            prof.runcall(fn)
            text.write(f"\n#### {what}\n\n```\n")
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(15)
            text.write("```\n")
            wait_idle(c, path)
    return text.getvalue()


def slope(counts: list[int], seconds: list[float]) -> float:
    """Least-squares seconds per tensor (nan with fewer than two tensor counts)."""
    if len(set(counts)) < 2:
        return float("nan")
    mx, my = statistics.fmean(counts), statistics.fmean(seconds)
    num = sum((x - mx) * (y - my) for x, y in zip(counts, seconds, strict=True))
    return num / sum((x - mx) ** 2 for x in counts)


_OPS = [
    ("repeated", "ckptcache.save, repeated (stall)"),
    ("first, contact 1 s before", "ckptcache.save, first (no warmup(); contact 1 s before)"),
    ("first, save is first contact", "ckptcache.save, first (no warmup(); save is first contact)"),
    (
        "first, after a delete",
        "ckptcache.save, first (no warmup(); contact 1 s before; a deleted checkpoint's "
        "segment free; best of the repeats, a fresh client each)",
    ),
    ("non-blocking return", "ckptcache.save(blocking=False), until it returns"),
    ("zero-copy load", "ckptcache.load, zero-copy"),
]


def table(nbytes: int, states: dict[str, int], results: dict[str, dict]) -> str:
    """Markdown: one row per operation, one column per state (name: tensor count), the
    per-tensor slope last."""
    counts = list(states.values())
    head = " | ".join(f"{name} ({n:,} tensors)" for name, n in states.items())
    lines = [
        f"| operation, {format_bytes(nbytes)} | {head} | per tensor |",
        "|---|" + "---:|" * (len(states) + 1),
    ]
    memcpys = [results[n]["memcpy"] for n in states]
    cells = " | ".join(f"{s * 1e3:.1f} ms" for s in memcpys)
    lines.append(f"| memcpy (limit) | {cells} | |")
    for key, label in _OPS:
        secs = [results[n][key] for n in states]
        cells = " | ".join(
            f"{s * 1e3:.1f} ms ({s / mc:.2f}x)" if key != "zero-copy load" else f"{s * 1e3:.1f} ms"
            for s, mc in zip(secs, memcpys, strict=True)
        )
        per = f"{slope(counts, secs) * 1e6:.2f} us" if len(set(counts)) > 1 else ""
        lines.append(f"| {label} | {cells} | {per} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", default=["512MiB", "2GiB"])
    p.add_argument("--states", nargs="+", default=["few", "mix", "many"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="also profile a save and a load of mix")
    args = p.parse_args()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}, "
          f"save copy: {COPY_IMPLEMENTATION}")  # fmt: skip
    for size in args.sizes:
        nbytes = parse_bytes(size)
        counts, results = {}, {}
        with contextlib.ExitStack() as stack:
            root = stack.enter_context(tempfile.TemporaryDirectory())
            for name in args.states:  # one state in memory at a time
                state = make_state_of(nbytes, name)
                counts[name] = len(state)
                results[name] = measure_state(state, nbytes, root, args.repeats)
                if args.profile and name == "mix":
                    profiled = profile(state, nbytes, root)
                del state
                gc.collect()
            print(f"\n### {size} (load average {os.getloadavg()[0]:.2f})\n")
            print(table(nbytes, counts, results))
            if args.profile and "mix" in counts:
                print(profiled)


if __name__ == "__main__":
    main()
