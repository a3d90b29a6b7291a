"""Restore at scale and backup copies in the cluster lab (tests/lab.py): real daemons in
network namespaces with shaped links, so the links, not this machine's cores, bound them.

    python benchmarks/cluster/bench.py --size 128MiB --nodes 1 2 4 8 \\
        --node-mbit 400 --storage-mbit 800

* restore: N nodes restarting together load one object only storage holds, through the cache
  (one storage read per group, peers relay) and directly (each node GETs it and
  ``torch.load``s it), from trainer processes inside the node namespaces;
* backup copy: a ``durability="backup"`` save on one node, less the same save with
  ``durability="local"``, against the node link;
* 8 nodes saving with ``durability="backup"`` at once.

Every row shows the CPU the lab's processes (daemons, etcd, the S3 server, trainers) used per
second of the run (below the machine's cores, the links bound the run) and per GiB the run
delivered (what a byte costs whatever the link: cores needed = GiB/s x CPU-s/GiB).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the lab lives with the tests (tests/lab.py)

import torch  # noqa: E402
import yaml  # noqa: E402

from ckptcache._units import parse_bytes  # noqa: E402
from ckptcache.cli.benchmarking import make_state  # noqa: E402
from ckptcache.client import Client  # noqa: E402
from ckptcache.format.archive_read import BLOCK  # noqa: E402
from ckptcache.format.prefix_read import PROBE  # noqa: E402
from ckptcache.server.cluster.transfer import RELAY_RECORD  # noqa: E402
from ckptcache.server.config import load_config  # noqa: E402
from tests.helpers import wait_until  # noqa: E402
from tests.lab import Lab, LabNode  # noqa: E402

WORKER = str(Path(__file__).resolve().parent / "worker.py")
# A deployment runs from compiled bytecode: without it every daemon and trainer compiles the
# modules it imports lazily (the load path's among them) inside the timed restore.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
MB = 1e6


@dataclass(frozen=True)
class Run:
    """One measured run: wall seconds, the lab's CPU seconds in it, what it moved."""

    what: str
    seconds: float
    cpu_seconds: float
    nbytes: int
    note: str = ""
    #: CPU seconds the whole machine spent busy in the run (the lab and everything else).
    box_seconds: float = 0.0

    @property
    def cores(self) -> float:
        return self.cpu_seconds / self.seconds if self.seconds > 0 else 0.0

    @property
    def box_cores(self) -> float:
        return self.box_seconds / self.seconds if self.seconds > 0 else 0.0

    @property
    def cpu_per_gib(self) -> float:
        """The lab's CPU seconds per GiB the run delivered: what one byte costs, whatever the
        link (cores needed = GiB/s x this)."""
        return self.cpu_seconds / (self.nbytes / 2**30) if self.nbytes > 0 else 0.0

    @property
    def mbit(self) -> float:
        return self.nbytes * 8 / self.seconds / MB if self.seconds > 0 else 0.0


def _proc_cpu(pid: int) -> float:
    """utime + stime of ``pid`` in seconds (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def box_busy() -> float:
    """CPU seconds every core of the machine has been busy since boot (all but idle and
    iowait, from /proc/stat): its growth over a run, against the core count, says whether the
    run could have been short of CPU, whoever used it."""
    fields = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def lab_cpu(lab: Lab, exclude: frozenset[int] = frozenset()) -> float:
    """CPU seconds used so far by the lab's long-lived processes (daemons, etcd, S3 server):
    every process in its namespaces but ``exclude`` (trainers, which report their own)."""
    total = 0.0
    for ns in lab._namespaces:
        out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
        total += sum(_proc_cpu(int(p)) for p in out.stdout.split() if int(p) not in exclude)
    return total


def fresh_object(lab: Lab, url: str, nbytes: int, seed: int) -> dict[str, torch.Tensor]:
    """Store an object written by plain ``torch.save`` at ``url`` (no daemon has it)."""
    obj = make_state(nbytes, seed=seed)
    buf = io.BytesIO()
    torch.save(obj, buf)
    lab.put(url, buf.getvalue())
    return obj


def start_workers(lab: Lab, nodes: list[LabNode], mode: str, url: str) -> list[subprocess.Popen]:
    """One trainer per node, imports done, waiting for the start line (``mode``: worker.py's
    cache, cache-copy or direct)."""
    procs = []
    for node in nodes:
        where = lab.s3_endpoint if mode == "direct" else node.socket
        argv = node.exec_argv(sys.executable, WORKER, mode, where, url)
        procs.append(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      text=True))  # fmt: skip
    for p in procs:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return procs


def restore(lab: Lab, n: int, mode: str, nbytes: int, seed: int, copy: bool = False) -> Run:
    """N nodes load one uncached object at the same moment; until the last has it (and has
    read every byte of it). ``copy``: the cached load makes a private copy (``mmap=False``)."""
    url = f"s3://lab/run/restore-{mode}-{n}-{seed}.pt"
    fresh_object(lab, url, nbytes, seed)
    nodes = lab.nodes[:n]
    procs = start_workers(lab, nodes, "cache-copy" if mode == "cache" and copy else mode, url)
    trainers = frozenset(p.pid for p in procs)
    cpu0 = lab_cpu(lab, trainers)  # the daemons, etcd and the S3 server
    box0 = box_busy()
    t0 = time.time()
    # The start in the daemons' log time, to line their per-node commits up with it.
    print(f"# {n} node(s) {mode} started at {time.strftime('%H:%M:%S', time.localtime(t0))}"
          f",{int(t0 % 1 * 1000):03d}", file=sys.stderr, flush=True)  # fmt: skip
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    reports = []
    for p in procs:
        out, _ = p.communicate(timeout=600)
        reports.append(json.loads(out.strip().splitlines()[-1]))
    print("# per node: loaded " + " ".join(f"{r['loaded'] - t0:.2f}" for r in reports)
          + "; done " + " ".join(f"{r['end'] - t0:.2f}" for r in reports),
          file=sys.stderr, flush=True)  # fmt: skip
    seconds = max(r["end"] for r in reports) - t0
    # The machine's busy CPU over the same window (read once every trainer has reported).
    box = (box_busy() - box0) * seconds / max(time.time() - t0, 1e-9)
    cpu = lab_cpu(lab, trainers) - cpu0 + sum(r["cpu"] for r in reports)
    tiers = sorted(r["tier"] for r in reports)
    note = ", ".join(f"{tiers.count(t)} x {t}" for t in sorted(set(tiers)))
    note += f"; last load returned at {max(r['loaded'] for r in reports) - t0:.2f} s"
    if mode == "cache":
        for node in nodes:  # uncached again for the next run
            with Client(node.socket) as c:
                c.delete(url)
    return Run(f"{n} node(s), {'through the cache' if mode == 'cache' else 'direct'}",
               seconds, cpu, nbytes * n, note, box)  # fmt: skip


def timed_save(node: LabNode, obj: object, path: str, durability: str) -> float:
    with Client(node.socket, fallback="raise", timeout=600) as c:
        t0 = time.perf_counter()
        c.save(obj, path, durability=durability)
        return time.perf_counter() - t0


def backup_copy(lab: Lab, nbytes: int) -> Run:
    """One node's backup push alone on its link: a memory-only path (nothing persists over the
    same uplink); the ``local`` save of the same bytes is subtracted."""
    a = lab.nodes[0]
    obj = make_state(nbytes, seed=7)
    locals_ = []  # (seconds, the lab's CPU seconds) of each local save
    for i in range(2):
        cpu0 = lab_cpu(lab)
        seconds = timed_save(a, obj, f"/mem/local-{i}.pt", "local")
        locals_.append((seconds, lab_cpu(lab) - cpu0))
    local, local_cpu = min(locals_)
    # A local save is copied to the backup node in the background (--backup auto): timed
    # while those copies still ran, the push shared its uplink with them.
    with Client(a.socket) as c:
        for i in range(2):
            wait_until(lambda i=i: bool(c.status(f"/mem/local-{i}.pt").replicas), timeout=600,
                       what="the local saves' background copies")  # fmt: skip
    cpu0, box0, t0 = lab_cpu(lab), box_busy(), time.perf_counter()
    backup = timed_save(a, obj, "/mem/backup.pt", "backup")
    box = (box_busy() - box0) * backup / (time.perf_counter() - t0)  # per second of the save
    push = backup - local
    with Client(a.socket) as c:  # room for the waves
        for path in ("/mem/local-0.pt", "/mem/local-1.pt", "/mem/backup.pt"):
            c.delete(path)
    # The lab's CPU in the backup save less that in the local save: the push's.
    return Run("backup copy, 1 node (backup save - local save)", push,
               lab_cpu(lab) - cpu0 - local_cpu, nbytes,
               f"backup save {backup:.2f} s, local save {local:.3f} s",
               box * push / backup)  # fmt: skip


def backup_wave(lab: Lab, nbytes: int, persist: bool) -> Run:
    """Every node saves its own object with ``durability="backup"`` at once (a ring: each
    uplink carries one push, each downlink one), under the persist root or memory-only."""
    objs = [make_state(nbytes, seed=100 + i) for i in range(len(lab.nodes))]
    times: list[float] = [0.0] * len(lab.nodes)

    errors: list[str] = []

    def one(i: int) -> None:
        path = f"s3://lab/run/wave-{i}.pt" if persist else f"/mem/wave-{i}.pt"
        try:
            times[i] = timed_save(lab.nodes[i], objs[i], path, "backup")
        except Exception as e:  # reported in the row, never dropped
            errors.append(f"node{i}: {type(e).__name__}")

    cpu0, box0 = lab_cpu(lab), box_busy()
    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(lab.nodes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    box = box_busy() - box0
    what = f"{len(lab.nodes)} nodes save with durability=backup at once" + (
        " (persisting meanwhile)" if persist else " (memory-only paths)"
    )
    note = f"per node {min(times):.2f}-{max(times):.2f} s" + (
        f"; failed: {', '.join(errors)}" if errors else ""
    )
    return Run(what, seconds, lab_cpu(lab) - cpu0, nbytes * len(lab.nodes), note, box)


def model_seconds(
    n: int, nbytes: int, node_mbit: float, storage_mbit: float, mode: str, streams: int
) -> float:
    """The chain model (cache) or the shared-storage model (direct), in seconds. Their ratio
    is at most ``n x min(node, storage) / storage``: N / 2 where storage has twice a node's
    link, N where it has one node's."""
    link, storage = node_mbit * MB / 8, storage_mbit * MB / 8
    if mode == "direct":  # every node reads its own copy through the shared storage link
        return max(nbytes / link, n * nbytes / storage)
    # The first joiner trails the reader by the ranges that land together at the end of its
    # read (tapered to one block each: server/restore/storage_read.py, format/prefix_read.py), and
    # each later hop by one relay record.
    # By default (0, "auto") the read chooses its streams on its first bytes: where one
    # connection fills the link it keeps one, and the probe's second range (PROBE bytes) has
    # landed ahead of the prefix once.
    first = streams * BLOCK if streams else BLOCK + PROBE  # group_read_streams
    return nbytes / min(link, storage) + first / link + (n - 1) * RELAY_RECORD / link


def table(runs: list[Run], models: dict[str, float]) -> str:
    lines = [
        "| run | time (s) | model (s) | Mbit/s | lab CPU (cores) | lab CPU-s/GiB | "
        "box CPU (cores) | note |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in runs:
        model = models.get(r.what)
        m = f"{model:.2f}" if model else "-"
        lines.append(f"| {r.what} | {r.seconds:.2f} | {m} | {r.mbit:.0f} | {r.cores:.2f} | "
                     f"{r.cpu_per_gib:.2f} | {r.box_cores:.2f} | {r.note} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="128MiB")
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--node-mbit", type=float, default=400.0)
    parser.add_argument("--storage-mbit", type=float, default=800.0)
    parser.add_argument("--skip-restore", action="store_true")
    parser.add_argument("--skip-backup", action="store_true", help="restore rows only")
    parser.add_argument("--modes", nargs="+", default=["cache", "direct"],
                        choices=["cache", "direct"], help="restore rows to run")  # fmt: skip
    parser.add_argument("--cache-load", choices=["zero-copy", "copy"], default="zero-copy",
                        help="the cached load: the default (tensors over the daemon's segment) "
                             "or mmap=False (a private copy)")  # fmt: skip
    parser.add_argument("--daemon-config", default="", metavar="YAML",
                        help="extra lines for every daemon's config file, e.g. "
                             "'group_read_streams: 1'")  # fmt: skip
    parser.add_argument("--workdir", type=Path, help="keep the lab's logs here (default: removed)")
    args = parser.parse_args()
    nbytes = parse_bytes(args.size)
    extra = args.daemon_config.replace("\\n", "\n") + "\n"
    streams = load_config(overrides=yaml.safe_load(extra) or {}, environ={}).group_read_streams
    n_max = max(args.nodes)
    runs: list[Run] = []
    models: dict[str, float] = {}
    budget = f"{max(512, 4 * nbytes >> 20)}MiB"
    with Lab(n_max, node_mbit=args.node_mbit, storage_mbit=args.storage_mbit, lease_ttl=5.0,
             memory_limit=budget, daemon_args=("--memory-only", "allow"),
             config=extra,
             workdir=args.workdir) as lab:  # fmt: skip
        print(lab.describe(), flush=True)
        if not args.skip_restore:
            for n in args.nodes:
                for mode in args.modes:
                    run = restore(lab, n, mode, nbytes, seed=n,
                                  copy=args.cache_load == "copy")  # fmt: skip
                    models[run.what] = model_seconds(n, nbytes, args.node_mbit,
                                                     args.storage_mbit, mode, streams)  # fmt: skip
                    runs.append(run)
                    print(table([run], models).splitlines()[-1], flush=True)
        backups = (
            () if args.skip_backup
            else (lambda: backup_copy(lab, nbytes), lambda: backup_wave(lab, nbytes // 2, False),
                  lambda: backup_wave(lab, nbytes // 2, True))
        )  # fmt: skip
        for measure in backups:
            run = measure()
            runs.append(run)
            print(table([run], models).splitlines()[-1], flush=True)
    print()
    print(f"{args.size}, nodes at {args.node_mbit:g} Mbit/s, storage {args.storage_mbit:g} "
          f"Mbit/s shared, {streams} group-read stream(s), {os.cpu_count()} cores")  # fmt: skip
    print(table(runs, models))


if __name__ == "__main__":
    main()
