"""One system, one size, every shape, in this fresh process: ``bench.py`` starts one per system
per round and reads the result lines this prints.

    python benchmarks/peers/worker.py SYSTEM NBYTES --shapes large small --dir /tmp/x

``SYSTEM`` ``limits`` measures the physical limits instead: a memcpy of the state into touched
memory (``ckptcache.cli.benchmarking.memcpy_seconds``) and a raw write + fsync of its bytes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from typing import Any

import states
import torch
from systems import SYSTEMS

#: Result lines start with this (peers log to stdout too).
MARK = "PEERS-RESULT "


def raw_write_seconds(buffers: list[torch.Tensor], directory: str) -> float:
    """One sequential write of the bytes into one file, then fsync."""
    path = os.path.join(directory, "raw.bin")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        t0 = time.perf_counter()
        for b in buffers:
            view = b.numpy().data
            while view:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
        return time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)


def measure_limits(state: Any, directory: str) -> dict[str, float]:
    """The physical limits for ``state``'s bytes (its distinct storages, each once)."""
    from ckptcache.cli.benchmarking import memcpy_seconds

    buffers = states.storages(state)
    memcpy = memcpy_seconds({str(i): b for i, b in enumerate(buffers)}, repeats=2)
    return {"memcpy": memcpy, "raw_write": raw_write_seconds(buffers, directory)}


def measure_system(name: str, state: Any, directory: str, nbytes: int) -> dict[str, Any]:
    system = SYSTEMS[name](directory, nbytes)
    try:
        system.save(state, 1)  # the first save: allocation, warm-up; not timed
        system.settle()
        t0 = time.perf_counter()
        system.save(state, 2)
        stall = time.perf_counter() - t0
        system.settle()
        durable = time.perf_counter() - t0
        if system.separate_durable:
            t0 = time.perf_counter()
            system.durable(state, 3)
            durable = time.perf_counter() - t0
        t0 = time.perf_counter()
        loaded = system.load()
        load = time.perf_counter() - t0
        wrong = states.mismatch(state, loaded)
        del loaded
        row = {"stall": stall, "durable": durable, "load": load, "mismatch": wrong}
        held = system.held()
        if held is not None:
            row["held"] = held / nbytes
        return row
    finally:
        system.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("system", choices=[*SYSTEMS, "limits"])
    p.add_argument("nbytes", type=int)
    p.add_argument("--shapes", nargs="+", default=list(states.SHAPES))
    p.add_argument("--dir", default=tempfile.gettempdir(), help="directory on the disk tested")
    args = p.parse_args()
    for shape in args.shapes:
        state = states.make(shape, args.nbytes)
        row: dict[str, Any] = {
            "system": args.system,
            "shape": shape,
            "size": args.nbytes,
            "nbytes": states.state_bytes(state),
            "tensors": len(states.tensors(state)),
            "loadavg": os.getloadavg()[0],
        }
        directory = tempfile.mkdtemp(prefix=f"peers-{args.system}-", dir=args.dir)
        try:
            if args.system == "limits":
                row.update(measure_limits(state, directory))
            else:
                row.update(measure_system(args.system, state, directory, row["nbytes"]))
        except BaseException as e:  # a peer that refuses to run here is listed with its error
            row["error"] = f"{type(e).__name__}: {e}".strip()
            traceback.print_exc()
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        print(MARK + json.dumps(row), flush=True)
        del state
        gc.collect()
        if "error" in row and row["error"].startswith(("ModuleNotFoundError", "ImportError")):
            break  # the same for every shape
    sys.stdout.flush()
    os._exit(0)  # peers leave non-daemon threads and saver processes behind


if __name__ == "__main__":
    main()
