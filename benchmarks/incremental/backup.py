"""Backup pushes and peer fetches that move only what the receiving node lacks, against whole
ones, in one run: bytes moved, the ``durability="backup"`` save's and the peer load's time, and
both daemons' CPU, on a LoRA-shaped and a MoE-shaped state.

    python benchmarks/incremental/backup.py --base 512 --expert 6 --rounds 3

Two daemons on one etcd (Debian's ``etcd-server``) stand in for two nodes; each state is run on
a pair with ``incremental_push: false``, then on a pair with ``true``. Each round saves the
next state of the sequence (the first one whole, then the LoRA adapters and their Adam state
new, or 8 of 64 experts touched) to a new path, as training writes ``step-N/model.pt``, with
``durability="backup"``: the save returns once the backup node holds a verified copy. Per
round:

* bytes sent: the checkpoint's body less ``ckptcache_push_bytes_held`` (what the backup node
  copied from its own memory), against the bytes of the tensors that changed;
* the backup save's time, from ``save`` to its return (the client's copy, the commit, the
  push and the backup node's commit);
* CPU-s per GiB of checkpoint: both daemon processes' user + system time over the save (the
  client's copy is the benchmark process's and is not counted). The previous round's persist
  is waited for before the save, so what runs is this save's work; its own persist starts
  when the save pauses and may overlap the push in both configurations alike;
* then, the save persisted, the first node drops its copy (``delete`` is local) and loads it
  back: a peer fetch from the backup node, less what the first node holds (the previous
  checkpoint) when incremental. Bytes received, the load's time (a zero-copy load of the
  fetched copy) and both daemons' CPU over it.

Medians over ``--rounds`` (the first, whole save is not counted).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench import _cpu, _metric, lora_state, moe_maker  # this directory's persist benchmark

from ckptcache.cli.benchmarking import EtcdServer, running_cluster
from ckptcache.client import Client

MiB = 1 << 20
GiB = 1 << 30


@dataclass
class Round:
    size: int
    sent: int
    seconds: float
    cpu: float
    #: The peer fetch of the same checkpoint: bytes received, seconds, both daemons' CPU.
    fetched: int
    fetch_seconds: float
    fetch_cpu: float


def _port(socket: str) -> int:
    log = os.path.join(os.path.dirname(socket), "daemon.log")
    while "metrics=:" not in Path(log).read_text():
        time.sleep(0.05)
    return int(Path(log).read_text().split("metrics=:")[1].split()[0])


def run(etcd: EtcdServer, root: Path, incremental: bool, make: Callable[[int], dict],
        rounds: int) -> list[Round]:  # fmt: skip
    """A pair of nodes, ``1 + rounds`` backup saves of ``make(seed)``; the later rounds."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    cfg = root / "config.yaml"
    cfg.write_text(f"incremental_push: {'true' if incremental else 'false'}\n")
    args = ("--persist-root", str(root), "--memory-limit", "6GiB", "--metrics-port", "0",
            "--backup", "auto", "--config", str(cfg))  # fmt: skip
    out = []
    with running_cluster(2, etcd.url, *args) as nodes, Client(nodes[0].socket) as c:
        port = _port(nodes[0].socket)
        pids = [n.proc.pid for n in nodes]
        previous = None
        for seed in range(rounds + 1):
            obj = make(seed)
            path = str(root / f"step-{seed}" / "model.pt")
            if previous is not None:
                c.wait(previous, timeout=600)
            held0, cpu0 = _metric(port, "ckptcache_push_bytes_held_total"), sum(map(_cpu, pids))
            t0 = time.perf_counter()
            c.save(obj, path, durability="backup")
            seconds = time.perf_counter() - t0
            cpu = sum(map(_cpu, pids)) - cpu0
            held = _metric(port, "ckptcache_push_bytes_held_total") - held0
            size = c.status(path).size
            c.wait(path, timeout=600)
            # This node's copy dropped (delete is local): the load fetches the backup node's.
            c.delete(path)
            fetch0, cpu0 = _metric(port, "ckptcache_fetch_bytes_held_total"), sum(map(_cpu, pids))
            t0 = time.perf_counter()
            loaded = c.load(path)
            fetch_seconds = time.perf_counter() - t0
            fetch_cpu = sum(map(_cpu, pids)) - cpu0
            fetched = size - (_metric(port, "ckptcache_fetch_bytes_held_total") - fetch0)
            assert c.status(path).last_load_tier == "peer"
            del loaded
            if seed:
                out.append(Round(size, int(size - held), seconds, cpu, int(fetched),
                                 fetch_seconds, fetch_cpu))  # fmt: skip
            previous = path
            del obj
    return out


def _median(rounds: list[Round], field: str) -> float:
    return statistics.median(getattr(r, field) for r in rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base", default=1024, type=int, help="LoRA frozen base, MiB")
    parser.add_argument("--expert", default=12, type=int, help="MoE bytes per expert, MiB")
    parser.add_argument("--rounds", default=3, type=int)
    args = parser.parse_args()
    # What changes between two saves: the adapters and their Adam state (96 MiB); 8 experts
    # and the shared attention (16 MiB).
    changed = {"LoRA": 96 * MiB, "MoE": 8 * args.expert * MiB + 16 * MiB}
    os.environ.setdefault("CKPTCACHE_CLUSTER_SECRET", "bench-secret")
    work = Path(tempfile.mkdtemp(prefix="ckptcache-bench-"))
    etcd = EtcdServer(work / "etcd").start()
    print(f"load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} cores\n", flush=True)
    print("| state | transfers | size | push: bytes sent | sent / changed | backup save (s) "
          "| push: daemons' CPU-s per GiB | fetch: bytes received | peer load (s) "
          "| fetch: daemons' CPU-s per GiB |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    try:
        for label, make_for in (
            ("LoRA", lambda: lambda seed: lora_state(args.base * MiB, seed)),
            ("MoE", lambda: moe_maker(args.expert * MiB)),
        ):
            for incremental in (False, True):
                rounds = run(etcd, work / "ckpt", incremental, make_for(), args.rounds)
                size, sent = _median(rounds, "size"), _median(rounds, "sent")
                print(
                    f"| {label} | {'incremental' if incremental else 'whole'} "
                    f"| {size / MiB:.0f} MiB | {sent / MiB:.0f} MiB "
                    f"| {sent / changed[label]:.2f}x | {_median(rounds, 'seconds'):.3f} "
                    f"| {_median(rounds, 'cpu') / (size / GiB):.2f} "
                    f"| {_median(rounds, 'fetched') / MiB:.0f} MiB "
                    f"| {_median(rounds, 'fetch_seconds'):.3f} "
                    f"| {_median(rounds, 'fetch_cpu') / (size / GiB):.2f} |",
                    flush=True,
                )
    finally:
        etcd.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nload average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
