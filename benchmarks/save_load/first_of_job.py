"""A job's first save: a fresh trainer process that never calls ``warmup()``, whose first
contact with the daemon is its first save, next to a memcpy of the same tensors measured in
that process, and to DCP ``async_save``'s first save in a fresh process of its own.

    python benchmarks/save_load/first_of_job.py --size 512MiB --rounds 3

The situations, each round in this order (interleaved with DCP's):

* **fresh daemon:** the daemon has never seen a save;
* **after an earlier job:** the daemon served an earlier trainer (another process, ended)
  that saved the same state under the same prefix (``<prefix>/step-1/model.pt``); the new
  trainer saves ``<prefix>/step-2/model.pt``;
* **after an earlier job, ``exists`` first:** the same, where the new trainer first looks for
  a checkpoint to resume from (``exists``), as a resuming trainer does, and saves a second
  later (its start-up: building the model, the first steps);
* **after an earlier job, the client made at start:** the same, where the new trainer makes
  its :class:`~ckptcache.Client` first, then builds its state (the model) and saves it, its
  first call; timed from the save.

The state is ``tensor_count.py``'s ``mix`` (75% of the bytes in 16 MiB tensors, the rest in
64 KiB ones: 2,072 tensors at 512 MiB). The trainer's first save is compared byte for byte
with its state after a load (untimed). Figures: each situation's median over the rounds, in
ms and against the memcpy of the same process. ``--against OTHER_TREE`` adds the trainers
of another checkout's client after the earlier job (each situation), on the same daemon, in
turns with this tree's (which goes first alternates by round): a before/after comparison in
one run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from ckptcache._units import parse_bytes
from ckptcache.cli.benchmarking import running_daemon

MARK = "FIRST-OF-JOB "


def trainer(kind: str, socket: str, path: str, nbytes: int) -> None:
    """One fresh trainer process: make the state, time a memcpy, then the first save."""
    import torch

    from ckptcache.cli.benchmarking import memcpy_seconds, mixed_state

    early = None
    if kind == "ckptcache-early":  # the client first, then the model
        from ckptcache.client import Client

        early = Client(socket, fallback="raise")
    state = mixed_state(nbytes)
    memcpy = memcpy_seconds(state)
    if kind == "dcp":
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        from ckptcache.cli.benchmarking import free_port

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
        t0 = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=path)
        first = time.perf_counter() - t0
        future.result()
        equal = True
    else:
        from ckptcache.client import Client

        t0 = time.perf_counter()
        client = early if early is not None else Client(socket, fallback="raise")
        if kind == "ckptcache-exists":
            client.exists(path)
            time.sleep(1.0)
            t0 = time.perf_counter()
        client.save(state, path, durability="memory")
        first = time.perf_counter() - t0
        loaded = client.load(path)
        equal = set(loaded) == set(state)
        equal = equal and all(torch.equal(loaded[k], v) for k, v in state.items())
        del loaded
        client.close()
    print(MARK + json.dumps({"memcpy": memcpy, "first": first, "equal": equal}), flush=True)


def trainer_env(pycache: str) -> dict[str, str]:
    """The trainers' environment: compiled modules under ``pycache`` (as an installed
    package has them), so no trainer's first save compiles the modules it imports."""
    env = dict(os.environ, PYTHONPYCACHEPREFIX=pycache)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def run_trainer(kind: str, socket: str, path: str, nbytes: int, env: dict[str, str]) -> dict:
    """``trainer`` in a fresh interpreter; its result line."""
    cmd = [sys.executable, __file__, "--trainer", kind, socket, path, str(nbytes)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{kind} trainer failed: {done.stderr.strip()[-2000:]}")
    line = next(x for x in done.stdout.splitlines() if x.startswith(MARK))
    return dict(json.loads(line[len(MARK) :]))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--trainer":
        trainer(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="512MiB")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--against",
        help="another checkout (e.g. the tree before a change): its client's `exists`-first "
        "trainer runs too, on the same daemon, in turns with this tree's",
    )
    p.add_argument("--no-dcp", action="store_true", help="leave DCP's first save out")
    args = p.parse_args()
    nbytes = parse_bytes(args.size)
    ours = [  # after the earlier job: (situation, kind)
        ("after an earlier job", "ckptcache"),
        ("after an earlier job, `exists` first", "ckptcache-exists"),
        ("after an earlier job, the client made at start", "ckptcache-early"),
    ]
    # Every save of a round is held in memory (durability "memory"), and a spare beside.
    budget = ("--memory-limit", str((2 * len(ours) + 3) * nbytes + (512 << 20)))
    rows: dict[str, list[dict]] = {"fresh daemon": [], **{name: [] for name, _ in ours}}
    rows["dcp"] = []
    loads = []
    pycache = tempfile.mkdtemp(prefix="first-of-job-pyc-")
    env = trainer_env(pycache)
    root_dir = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run(  # what pip install does: the package compiled before its first use
        [sys.executable, "-m", "compileall", "-q", os.path.join(root_dir, "ckptcache")],
        check=True, env=env,
    )  # fmt: skip
    other = None
    if args.against:
        for name, _ in ours:
            rows[f"{name}: --against tree"] = []
        other = dict(trainer_env(os.path.join(pycache, "against")), PYTHONPATH=args.against)
        subprocess.run(
            [sys.executable, "-m", "compileall", "-q", os.path.join(args.against, "ckptcache")],
            check=True, env=other,
        )  # fmt: skip
    if args.no_dcp:
        del rows["dcp"]
    for rnd in range(args.rounds):
        loads.append(os.getloadavg()[0])
        with tempfile.TemporaryDirectory() as root:
            prefix = os.path.join(root, "job")
            with running_daemon(*budget) as daemon:
                cases = [("fresh daemon", "ckptcache", env)]
                for name, kind in ours:
                    pair = [(name, kind, env)]
                    if other is not None:  # the two trees' trainers in turns, first by round
                        pair.append((f"{name}: --against tree", kind, other))
                        pair = pair if rnd % 2 == 0 else pair[::-1]
                    cases += pair
                for step, (name, kind, how) in enumerate(cases, 1):
                    path = f"{prefix}/step-{step}/model.pt"
                    rows[name].append(run_trainer(kind, daemon.socket, path, nbytes, how))
                    time.sleep(2.0)  # the job ended; the daemon's background work done
            if args.no_dcp:
                continue
            rows["dcp"].append(run_trainer("dcp", "", os.path.join(root, "dcp"), nbytes, env))
    loads.append(os.getloadavg()[0])
    print(f"{args.size}, {args.rounds} rounds, load average (1 min) {min(loads):.2f}-"
          f"{max(loads):.2f} (median {statistics.median(loads):.2f}); medians, each against "
          "its own process's memcpy")  # fmt: skip
    print("\n| first save | memcpy | first save | vs memcpy | all rounds (x memcpy) |")
    print("|---|---:|---:|---:|---|")
    for name, rs in rows.items():
        ratios = [r["first"] / r["memcpy"] for r in rs]
        print(
            f"| {name} | {statistics.median(r['memcpy'] for r in rs) * 1e3:.1f} ms "
            f"| {statistics.median(r['first'] for r in rs) * 1e3:.1f} ms "
            f"| {statistics.median(ratios):.2f}x | {', '.join(f'{x:.2f}' for x in ratios)} |"
        )
    shutil.rmtree(pycache, ignore_errors=True)
    bad = [n for n, rs in rows.items() if not all(r["equal"] for r in rs)]
    print("\nReloads that differed from the saved state: " + (", ".join(bad) or "none"))


if __name__ == "__main__":
    main()
