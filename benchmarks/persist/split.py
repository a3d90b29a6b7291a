"""Where a local persist's time goes, in one process: the same archive written plainly, its
persisted form made into a sink that writes nothing, and both together (the daemon's path).

    python benchmarks/persist/split.py --size 2GiB --shape mix --rounds 2

The archive is the one a segment holds for the state (planned and written by the client's
own code into memory); the persist is ``stream_archive`` (CRC-32s, xxh3, the digest record)
through the file backend, as the daemon runs it. Interleaved rounds, medians.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import tempfile
import time
from collections.abc import Callable

from ckptcache._units import parse_bytes
from ckptcache.cli.benchmarking import make_state, mixed_state
from ckptcache.codec.flatten import flatten
from ckptcache.codec.objectio import plan_object, write_object
from ckptcache.format.persisted import stream_archive
from ckptcache.storage.fs import FileBackend

_PIECE = 8 << 20


def archive(nbytes: int, shape: str) -> memoryview:
    """The archive a segment would hold for the benchmark's state, in anonymous memory."""
    state = make_state(nbytes) if shape == "few" else mixed_state(nbytes)
    flat = flatten(state)
    plan = plan_object(flat, "/ckpt/a.pt", "bench")
    mapping = mmap.mmap(-1, plan.layout.nbytes)
    write_object(mapping, plan, flat)
    return memoryview(mapping)[4096 : 4096 + plan.archive.size]


def cases(view: memoryview, directory: str) -> dict[str, Callable[[], None]]:
    def plain() -> None:
        FileBackend().write_stream(
            os.path.join(directory, "plain.pt"),
            lambda sink: [sink(view[i : i + _PIECE]) for i in range(0, len(view), _PIECE)],
        )

    def persist() -> None:
        FileBackend().write_stream(
            os.path.join(directory, "persist.pt"),
            lambda sink: stream_archive(view, sink, path="bench"),
        )

    return {
        "the bytes through the file backend": plain,
        "stream_archive, no write": lambda: stream_archive(view, lambda p: None, path="bench"),
        "stream_archive through the file backend": persist,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="2GiB")
    p.add_argument("--shape", choices=["few", "mix"], default="mix")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dir", default="/var/tmp")
    args = p.parse_args()
    view = archive(parse_bytes(args.size), args.shape)
    directory = tempfile.mkdtemp(prefix="ckptcache-split-", dir=args.dir)
    times: dict[str, list[float]] = {}
    try:
        for r in range(args.rounds):
            for name, run in cases(view, directory).items():
                os.sync()
                time.sleep(0.5)
                t0 = time.perf_counter()
                run()
                times.setdefault(name, []).append(time.perf_counter() - t0)
                print(f"round {r} {name}: {times[name][-1]:.3f} s", flush=True)
                for leftover in os.listdir(directory):
                    os.unlink(os.path.join(directory, leftover))
    finally:
        os.rmdir(directory)
    for name, runs in times.items():
        print(f"{name}: median {statistics.median(runs):.3f} s")


if __name__ == "__main__":
    main()
