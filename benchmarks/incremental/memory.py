"""Memory a daemon holds for several checkpoints of a LoRA- and a MoE-shaped state, with the
generations sharing their unchanged pages (``share_pages: true``, the default) against each
holding its own (``false``), in the same run; and what reading an older checkpoint back costs.

    python benchmarks/incremental/memory.py --base 1024 --expert 12 --saves 4

Per state, per way of naming checkpoints, per setting (a fresh daemon each, ``--persist-root``
a temporary directory on the local disk, a budget of ``saves + 2`` times the state, no spare
pool): one trainer saves ``--saves`` checkpoints, changing what ``bench.py``'s states change
between saves, and waits until each is persisted; either under a new path each step (as
Megatron and DeepSpeed name theirs: every checkpoint stays in memory), or to one path (the
daemon keeps its 2 newest generations, and a freed segment for the next save). Then, once the
daemon's background work is done (no digest queued, the shared bytes steady for 2 s):

* **held**: the bytes every segment file of the daemon allocates (``st_blocks``, the kernel's
  count), against the state's size; and the daemon's own ``memory_used``;
* **shared**: ``ckptcache_memory_shared_bytes``; against what a save changes;
* **the daemon's CPU** over the whole run, per GiB of checkpoint saved (intake, digests,
  persist, and with sharing on, the comparison and the punch);
* **reading the oldest back**: ``load(path, mmap=False)`` of the first checkpoint (with
  sharing on, its pages are first copied back from the newest's memory and checked against
  its digests) and of the newest, each checked bitwise against the state saved.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

MiB = 1 << 20
GiB = 1 << 30


def _metric(socket: str, name: str) -> float:
    from bench import _metric as read

    port = int(Path(socket).with_name("metrics.port").read_text())
    return read(port, name)


def _allocated(shm: str) -> int:
    """Bytes allocated by every segment file under the daemon's shm root."""
    folder = os.path.join(shm, "segments")
    return sum(
        os.stat(os.path.join(folder, name)).st_blocks * 512
        for name in os.listdir(folder)
        if name.startswith("seg-")
    )


def run(state_name: str, one_path: bool, share: bool, args: argparse.Namespace) -> dict:
    import torch
    from bench import _cpu, lora_state, moe_maker

    import ckptcache
    from ckptcache.cli.benchmarking import free_port, running_daemon

    make = (lambda seed: lora_state(args.base * MiB, seed)) if state_name == "LoRA" else (
        moe_maker(args.expert * MiB)
    )  # fmt: skip
    first = make(0)
    size = sum(t.untyped_storage().nbytes() for t in _tensors(first))
    # The persisted checkpoints (GiBs of disk) go with the directory.
    with tempfile.TemporaryDirectory(prefix="ckptcache-mem-", dir=args.root) as root:
        config = Path(root) / "daemon.yaml"
        config.write_text(f"share_pages: {'true' if share else 'false'}\n")
        limit = -(-(args.saves + 2) * size // GiB)
        port = free_port()
        with running_daemon(
            "--memory-limit", f"{limit}GiB", "--persist-root", root, "--config", str(config),
            "--metrics-port", str(port), "--pool-bytes", "0",
        ) as d:  # fmt: skip
            Path(d.socket).with_name("metrics.port").write_text(str(port))
            cpu0 = _cpu(d.proc.pid)
            saved: dict[str, dict] = {}
            with ckptcache.Client(d.socket) as client:
                state = first
                for i in range(args.saves):
                    if i:
                        state = make(i)
                    step = "latest" if one_path else f"iter_{i:07d}"
                    path = os.path.join(root, step, "model.pt")
                    client.save(state, path)
                    client.wait(path, timeout=600)
                    saved[path] = state
                if one_path:  # the newest and the generation before it, still in memory
                    saved = {path: state}
                last, steady = -1.0, time.monotonic()
                while time.monotonic() - steady < 2.0:
                    time.sleep(0.2)
                    now = _metric(d.socket, "ckptcache_memory_shared_bytes")
                    busy = client.daemon_status().digest_queue
                    if now != last or busy:
                        last, steady = now, time.monotonic()
                cpu = _cpu(d.proc.pid) - cpu0
                held = _allocated(d.shm_dir)
                used = client.daemon_status().memory_used
                paths = list(saved)
                loads = {}
                for which, path in (("oldest", paths[0]), ("newest", paths[-1])):
                    t0 = time.perf_counter()
                    got = client.load(path, mmap=False)
                    loads[which] = time.perf_counter() - t0
                    for a, b in zip(_tensors(got), _tensors(saved[path]), strict=True):
                        if not torch.equal(a, b):
                            raise SystemExit(f"{path}: a tensor differs from the state saved")
    return {
        "size": size, "held": held, "used": used, "shared": last, "cpu": cpu,
        "cpu_per_gib": cpu / (args.saves * size / GiB), "loads": loads,
    }  # fmt: skip


def _tensors(obj: object) -> list:
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for k in sorted(obj, key=str) for t in _tensors(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", type=int, default=1024, help="LoRA frozen base, MiB")
    parser.add_argument("--expert", type=int, default=12, help="MoE expert size, MiB")
    parser.add_argument("--saves", type=int, default=4, help="checkpoints saved and held")
    parser.add_argument("--root", default="/var/tmp", help="where the persist root is made")
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} cores\n", flush=True)
    print("| state | checkpoints | pages shared | state size | memory held (segment "
          "files) | x state size | daemon memory_used | shared | daemon CPU-s per GiB saved "
          "| load oldest (s) | load newest (s) |")  # fmt: skip
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for state in ("LoRA", "MoE"):
        for one_path in (False, True):
            for share in (False, True):
                r = run(state, one_path, share, args)
                kind = "one path, keep 2" if one_path else f"{args.saves} paths"
                oldest = "-" if one_path else f"{r['loads']['oldest']:.3f}"  # not loadable
                print(f"| {state} | {kind} | {'yes' if share else 'no'} | "
                      f"{r['size'] / MiB:.0f} MiB | {r['held'] / MiB:.0f} MiB | "
                      f"{r['held'] / r['size']:.2f}x | {r['used'] / MiB:.0f} MiB | "
                      f"{r['shared'] / MiB:.0f} MiB | {r['cpu_per_gib']:.2f} | "
                      f"{oldest} | {r['loads']['newest']:.3f} |",
                      flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
