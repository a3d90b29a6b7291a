"""A restore from storage through one daemon, its file's pages out of the page cache, next to a
cold ``torch.load`` of the same file, in one run.

    python benchmarks/restore/cold_load.py --size 512MiB --rounds 5

The state is ``benchmarks/save_load/tensor_count.py``'s ``mix`` (2,072 tensors at 512 MiB),
saved through a daemon with a persist root on the local disk and persisted. Each round, in an
order alternated by round: the daemon's copy is dropped (``delete``: storage untouched), the
file's pages are dropped from the page cache (``posix_fadvise(DONTNEED)`` on that one file, so
the machine's other work keeps its cache), and a fresh process loads it: through the daemon
(``load()`` and ``load(mmap=False)``; the daemon reads storage, checks every record as it
lands, commits, and the client maps or copies it), or with ``torch.load`` (``mmap=False``).
Every load is compared byte for byte with the state. The table gives each load's time in each
round, and its median and spread against the median cold ``torch.load``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from ckptcache._units import parse_bytes
from ckptcache.cli.benchmarking import running_daemon
from ckptcache.errors import CheckpointNotFound

MARK = "COLD-LOAD "
KINDS = ("torch.load", "ckptcache load()", "ckptcache load(mmap=False)")


def drop_cached(path: str) -> None:
    """Drop ``path``'s clean pages from the page cache (this file only)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def loader(kind: str, socket: str, path: str, nbytes: int) -> None:
    """One fresh process: the state (to compare), then the timed load."""
    import torch

    from ckptcache.cli.benchmarking import mixed_state

    state = mixed_state(nbytes)
    if kind == "torch.load":
        t0 = time.perf_counter()
        loaded = torch.load(path, weights_only=True, mmap=False)
        seconds = time.perf_counter() - t0
    else:
        from ckptcache.client import Client

        with Client(socket, fallback="raise") as client:
            client.exists("/")  # connected and warmed up before the timer, as a trainer is
            time.sleep(0.5)
            t0 = time.perf_counter()
            loaded = client.load(path, mmap=False if "mmap=False" in kind else None)
            seconds = time.perf_counter() - t0
    equal = set(loaded) == set(state)
    equal = equal and all(torch.equal(loaded[k], v) for k, v in state.items())
    print(MARK + json.dumps({"seconds": seconds, "equal": equal}), flush=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--loader":
        loader(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="512MiB")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", default=None, help="directory on the disk tested (a persist root)")
    args = p.parse_args()
    nbytes = parse_bytes(args.size)
    env = dict(os.environ, PYTHONPYCACHEPREFIX=tempfile.mkdtemp(prefix="cold-load-pyc-"))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    bad: set[str] = set()
    loads = []
    with tempfile.TemporaryDirectory(dir=args.dir or os.getcwd()) as root:
        path = os.path.join(root, "job", "step-1", "model.pt")
        budget = ("--memory-limit", str(3 * nbytes + (512 << 20)), "--persist-root", root)
        with running_daemon(*budget) as daemon:
            from ckptcache.cli.benchmarking import mixed_state
            from ckptcache.client import Client

            with Client(daemon.socket, fallback="raise") as client:
                client.save(mixed_state(nbytes), path, durability="persisted")
            for rnd in range(args.rounds):
                order = KINDS[rnd % len(KINDS) :] + KINDS[: rnd % len(KINDS)]
                for kind in order:
                    with (
                        Client(daemon.socket, fallback="raise") as client,
                        contextlib.suppress(CheckpointNotFound),
                    ):
                        client.delete(path)  # only storage holds it now
                    drop_cached(path)
                    loads.append(os.getloadavg()[0])
                    cmd = [sys.executable, __file__, "--loader", kind, daemon.socket, path,
                           str(nbytes)]  # fmt: skip
                    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
                    if done.returncode != 0:
                        raise RuntimeError(done.stderr.strip()[-2000:])
                    line = next(x for x in done.stdout.splitlines() if x.startswith(MARK))
                    row = json.loads(line[len(MARK) :])
                    times[kind].append(row["seconds"])
                    if not row["equal"]:
                        bad.add(kind)
                    print(f"[round {rnd}] {kind}: {row['seconds'] * 1e3:.0f} ms", file=sys.stderr)
    base = statistics.median(times["torch.load"])
    print(f"{args.size}, {args.rounds} rounds, load average (1 min) {min(loads):.2f}-"
          f"{max(loads):.2f}; the file's pages dropped before each load")  # fmt: skip
    print("\n| load (cold file) | median | x cold torch.load (median) | each round (ms) |")
    print("|---|---:|---:|---|")
    for kind, ts in times.items():
        each = ", ".join(f"{t * 1e3:.0f}" for t in ts)
        med = statistics.median(ts)
        print(f"| {kind} | {med * 1e3:.0f} ms | {med / base:.2f}x | {each} |")
    print("\nLoads that differed from the saved state: " + (", ".join(sorted(bad)) or "none"))


if __name__ == "__main__":
    main()
