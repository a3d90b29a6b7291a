"""What a process's allocations wait for while another of its threads maps a segment.

    python benchmarks/save_load/spare_beside.py --spare 576MiB --rounds 5

After a save of a new path the client's spare thread maps the daemon's next spare while the
trainer goes on, and the daemon's pool makes that spare beside its request threads.
Populating a mapping's page tables holds the process's address-space lock (``mmap_lock``),
and ``MAP_POPULATE`` holds it for the whole mapping: every ``mmap`` and ``munmap`` of the
process's other threads (a CPU tensor over glibc's mmap threshold, 32 MiB at most, is one of
each) waits behind it. This maps a tmpfs file of ``--spare`` bytes on one thread with
``MAP_POPULATE`` and with ``MADV_POPULATE_READ`` a step at a time
(``ckptcache.format.pagetables.populate_in_steps``, what the daemon's pool does), while the
main thread makes and drops 64 MiB CPU tensors (one page touched each) in a loop, and reports
the longest single allocation beside it, next to the same loop alone. Interleaved rounds; per
column the median over rounds of each round's longest allocation, and the median time of the
mapping itself.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable

import torch

from ckptcache._units import parse_bytes
from ckptcache.codec import shm
from ckptcache.format import pagetables

_TENSOR = 64 << 20  # over glibc's largest mmap threshold: an mmap and a munmap each time


def _allocate_until(stop: threading.Event, out: list[float]) -> None:
    """Make and drop tensors until ``stop``; append the longest one's time."""
    longest = 0.0
    while not stop.is_set():
        t = time.perf_counter()
        tensor = torch.empty(_TENSOR, dtype=torch.uint8)
        tensor[0] = 1
        del tensor
        longest = max(longest, time.perf_counter() - t)
    out.append(longest)


def _in_steps(path: str, size: int) -> shm.Mapping:
    mapping = shm.map_shared(path, size, populate=False)
    pagetables.populate_in_steps(mapping)
    return mapping


def _round(mapper: Callable[[], shm.Mapping] | None) -> tuple[float, float]:
    """The longest allocation while ``mapper`` runs (alone: for 100 ms), and its time."""
    stop = threading.Event()
    longest: list[float] = []
    trainer = threading.Thread(target=_allocate_until, args=(stop, longest))
    trainer.start()
    time.sleep(0.01)  # allocations under way
    t0 = time.perf_counter()
    mapping = None
    if mapper is None:
        time.sleep(0.1)
    else:
        mapping = mapper()
    took = time.perf_counter() - t0
    stop.set()
    trainer.join()
    if mapping is not None:
        # Unmapping a populated mapping holds the lock for writing (about 35 ms for 576 MiB
        # here): the spare thread never does; a save drops a deleted segment's mapping.
        mapping.close()
    return longest[0], took


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spare", default="576MiB")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    size = parse_bytes(args.spare)
    fd, path = tempfile.mkstemp(prefix="ckptcache-spare-", dir="/dev/shm")
    try:
        os.posix_fallocate(fd, 0, size)
        os.close(fd)
        modes: dict[str, Callable[[], shm.Mapping] | None] = {
            "alone": None,
            "beside MAP_POPULATE": lambda: shm.map_shared(path, size),
            "beside steps": lambda: _in_steps(path, size),
        }
        longest: dict[str, list[float]] = {m: [] for m in modes}
        mapped: dict[str, list[float]] = {m: [] for m in modes}
        _round(None)  # warm: torch's allocator, the file's pages
        for _ in range(args.rounds):
            for name, mapper in modes.items():
                stall, took = _round(mapper)
                longest[name].append(stall)
                mapped[name].append(took)
        print(f"spare {size >> 20} MiB, load average {os.getloadavg()[0]:.2f}, "
              f"{args.rounds} rounds, medians in ms")  # fmt: skip
        print("| | " + " | ".join(modes) + " |")
        print("|---|" + "---:|" * len(modes))
        cells = [f"{statistics.median(longest[m]) * 1e3:.1f}" for m in modes]
        print("| longest 64 MiB allocation | " + " | ".join(cells) + " |")
        cells = [""] + [f"{statistics.median(mapped[m]) * 1e3:.1f}" for m in list(modes)[1:]]
        print("| mapping the spare | " + " | ".join(cells) + " |")
    finally:
        os.unlink(path)


if __name__ == "__main__":
    main()
