"""A trainer beside the client's spare thread, after a save of a new path: how long its own
allocations wait, and how long a save that wants the spare being mapped waits.

    python benchmarks/save_load/spare_client.py --size 512MiB --rounds 5

A real daemon with its spare pool (``--pool-segments 1``) and one client that warmed up, as a
trainer: each checkpoint is a new path, so each save takes the spare the client mapped, the
daemon makes the next one, and the client's spare thread maps that one once saves pause. Two
kinds of rounds, alternated:

* **allocations:** a save, then for one second the trainer makes and drops 64 MiB CPU tensors
  (an ``mmap`` and a ``munmap`` each) while the spare thread maps the next spare; the longest
  single allocation, next to the same loop with no spare being mapped (``alone``);
* **a save while the spare is being mapped:** a save, then, as soon as the spare thread is
  mapping the next spare, a save of another new path, which gets that spare. Timed from the
  moment the spare thread starts mapping (it registers the spare in ``mapping_now``) to the
  save's return: a spare mapped with ``MAP_POPULATE`` freezes the trainer's own page faults
  and allocations before its save even starts, which the save's own stall would not show.
  Next to it, a save into a spare mapped already, and the memcpy of the same tensors.

Medians over rounds, ms. The state: ``--size`` bytes in 32 float32 tensors.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from ckptcache._units import format_bytes, parse_bytes
from ckptcache.cli.bench import _wait_for_spare, wait_idle
from ckptcache.cli.benchmarking import make_state, memcpy_seconds, running_daemon
from ckptcache.client import Client

_TENSOR = 64 << 20  # over glibc's largest mmap threshold: an mmap and a munmap each time


def _longest_allocation(seconds: float) -> float:
    """Make and drop tensors for ``seconds``; the longest one's time."""
    longest, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        tensor = torch.empty(_TENSOR, dtype=torch.uint8)
        tensor[0] = 1
        del tensor
        longest = max(longest, time.perf_counter() - t)
    return longest


def _timed(fn) -> float:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class _Started(dict):  # type: ignore[type-arg]
    """The spare thread's ``mapping_now``, noting when a spare is registered in it."""

    at = 0.0

    def __setitem__(self, key: object, value: object) -> None:
        type(self).at = time.perf_counter()
        super().__setitem__(key, value)


def _spare_being_mapped(c: Client, timeout: float = 30.0) -> float | None:
    """Wait until the client's spare thread is mapping a spare; when it started (``None``: not
    within ``timeout``)."""
    deadline = time.monotonic() + timeout
    while not c._spares.mapping_now:
        if time.monotonic() > deadline:
            return None
        time.sleep(0.0002)
    return _Started.at


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="512MiB")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    nbytes = parse_bytes(args.size)
    state = make_state(nbytes, n_tensors=32)
    root = tempfile.mkdtemp(prefix="ckptcache-spare-client-")
    budget = (4 * args.rounds + 4) * (nbytes + (64 << 20))
    daemon_args = (
        "--memory-limit", str(budget), "--pool-segments", "1",
        "--pool-bytes", str(nbytes + (64 << 20)),
    )  # fmt: skip
    figures: dict[str, list[float]] = {
        k: [] for k in ("alone", "beside", "save, spare mapped", "save, spare being mapped")
    }
    memcpy: list[float] = []
    caught = 0
    with running_daemon(*daemon_args) as daemon, Client(daemon.socket, fallback="raise") as c:
        c.warmup(wait=True)
        c._spares.mapping_now = _Started()
        n = 0

        def new_path() -> str:
            nonlocal n
            n += 1
            return os.path.join(root, f"iter_{n}", "model.pt")

        def settle() -> None:
            _wait_for_spare(c, nbytes)
            c._spares.refresh().wait()  # the spare mapped by this client too
            time.sleep(0.2)

        c.save(state, new_path(), durability="memory")
        settle()
        for _ in range(args.rounds):
            figures["alone"].append(_longest_allocation(1.0))
            c.save(state, new_path(), durability="memory")
            figures["beside"].append(_longest_allocation(1.0))
            settle()
            memcpy.append(memcpy_seconds(state))
            path = new_path()
            figures["save, spare mapped"].append(
                _timed(lambda p=path: c.save(state, p, durability="memory"))
            )
            wait_idle(c, path)
            started = _spare_being_mapped(c)
            if started is not None:
                caught += 1
                path = new_path()
                c.save(state, path, durability="memory")
                figures["save, spare being mapped"].append(time.perf_counter() - started)
            settle()
            for reloaded in (c.load(path),):
                assert all(torch.equal(reloaded[k], v) for k, v in state.items()), "bytes differ"
    print(
        f"{format_bytes(nbytes)} in 32 tensors, load average {os.getloadavg()[0]:.2f}, "
        f"{args.rounds} rounds ({caught} caught the spare being mapped), medians in ms, "
        f"memcpy {statistics.median(memcpy) * 1e3:.1f}"
    )
    print("| | " + " | ".join(figures) + " |")
    print("|---|" + "---:|" * len(figures))
    cells = [f"{statistics.median(v) * 1e3:.1f}" if v else "-" for v in figures.values()]
    print("| ms | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
