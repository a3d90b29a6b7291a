"""A load with private copies (``load(mmap=False)``) from the daemon's memory, next to a memcpy
of the same tensors into touched memory, a zero-copy load and a load into tensors the process
already has (``load_into``, as a trainer restores its model), in one fresh process per round.

    python benchmarks/save_load/private_load.py --size 512MiB --rounds 4 [--against OTHER_TREE]

The state is ``tensor_count.py``'s ``mix`` (2,072 tensors at 512 MiB). Each round: a daemon, a
fresh trainer process that saves the state, waits for the daemon to be idle, loads it
zero-copy (which also imports the decoder), then privately (the first private load of the
process: fresh memory, as a restarted trainer meets it; then the best of 3), then into
tensors of the state's shapes it made and zeroed before (first, then the best of 3), every
load compared byte for byte with the state. The trainers run with compiled modules, as an
installed package has them. ``--against`` runs the same trainer with another checkout's
client (e.g. the tree before a change) in the same round on the same daemon, the order
alternated by round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from ckptcache._units import parse_bytes
from ckptcache.cli.benchmarking import running_daemon

MARK = "PRIVATE-LOAD "


def trainer(socket: str, path: str, nbytes: int) -> None:
    """One fresh process: save, then time the loads and a memcpy."""
    import torch

    from ckptcache.cli.benchmarking import memcpy_seconds, mixed_state
    from ckptcache.client import Client

    state = mixed_state(nbytes)
    with Client(socket, fallback="raise") as client:
        client.save(state, path, durability="memory")
        settle(client)
        t0 = time.perf_counter()  # first: the decoder's modules imported before the timings
        view = client.load(path)
        zero_copy = time.perf_counter() - t0
        del view
        privates, equal = [], True
        for _ in range(3):
            t0 = time.perf_counter()
            loaded = client.load(path, mmap=False)
            privates.append(time.perf_counter() - t0)
            equal = equal and all(torch.equal(loaded[k], v) for k, v in state.items())
            del loaded
        live = {k: torch.zeros_like(v) for k, v in state.items()}  # the trainer's own, touched
        intos = []
        for _ in range(3):
            t0 = time.perf_counter()
            client.load_into(path, live)
            intos.append(time.perf_counter() - t0)
            equal = equal and all(torch.equal(live[k], v) for k, v in state.items())
            for t in live.values():
                t.zero_()
    memcpy = memcpy_seconds(state)
    row = {"memcpy": memcpy, "first": privates[0], "best": min(privates), "zero_copy": zero_copy,
           "into_first": intos[0], "into_best": min(intos)}  # fmt: skip
    print(MARK + json.dumps({**row, "equal": equal}), flush=True)


def settle(client: object) -> None:
    """Wait until the daemon is idle after the save (its digests done, its spare pool full),
    as a restarted trainer finds it: the loads are not timed beside the daemon's hashing."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        busy = any(not o.digests_valid for o in client.list(""))  # type: ignore[attr-defined]
        if not busy and not client.pool().growing:  # type: ignore[attr-defined]
            return
        time.sleep(0.02)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--trainer":
        trainer(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="512MiB")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--against", help="another checkout whose client runs in turns with this one")
    args = p.parse_args()
    nbytes = parse_bytes(args.size)
    # Compiled modules, as an installed package has them (a checkout run with
    # PYTHONDONTWRITEBYTECODE would compile them in each trainer).
    pycache = tempfile.mkdtemp(prefix="private-load-pyc-")
    env = dict(os.environ, PYTHONPYCACHEPREFIX=pycache)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    trees = {"this tree": (env, here)}
    if args.against:
        trees["--against tree"] = (dict(env, PYTHONPATH=args.against), args.against)
    for tree_env, root_dir in trees.values():
        subprocess.run(
            [sys.executable, "-m", "compileall", "-q", os.path.join(root_dir, "ckptcache")],
            check=True, env=tree_env,
        )  # fmt: skip
    envs = {name: tree_env for name, (tree_env, _) in trees.items()}
    rows: dict[str, list[dict]] = {name: [] for name in trees}
    loads = []
    for rnd in range(args.rounds):
        order = list(trees) if rnd % 2 == 0 else list(reversed(trees))
        loads.append(os.getloadavg()[0])
        with (
            tempfile.TemporaryDirectory() as root,
            running_daemon("--memory-limit", str(4 * nbytes + (512 << 20))) as daemon,
        ):
            for i, name in enumerate(order):
                cmd = [sys.executable, __file__, "--trainer", daemon.socket,
                       os.path.join(root, f"{i}.pt"), str(nbytes)]  # fmt: skip
                done = subprocess.run(cmd, capture_output=True, text=True, env=envs[name])
                if done.returncode != 0:
                    raise RuntimeError(done.stderr.strip()[-2000:])
                line = next(x for x in done.stdout.splitlines() if x.startswith(MARK))
                rows[name].append(json.loads(line[len(MARK) :]))
    print(f"{args.size}, {args.rounds} rounds, load average (1 min) {min(loads):.2f}-"
          f"{max(loads):.2f}; medians, each against its own process's memcpy")  # fmt: skip
    print("\n| client | memcpy | private load, first | best of 3 | zero-copy load | "
          "`load_into`, first | best of 3 | private first, all rounds (x memcpy) |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for name, rs in rows.items():

        def med(key: str, rs: list[dict] = rs) -> float:
            return statistics.median(r[key] for r in rs)

        firsts = ", ".join(f"{r['first'] / r['memcpy']:.2f}" for r in rs)
        first_x = statistics.median(r["first"] / r["memcpy"] for r in rs)
        best_x = statistics.median(r["best"] / r["memcpy"] for r in rs)
        into_x = [statistics.median(r[k] / r["memcpy"] for r in rs)
                  for k in ("into_first", "into_best")]  # fmt: skip
        print(
            f"| {name} | {med('memcpy') * 1e3:.1f} ms "
            f"| {med('first') * 1e3:.1f} ms ({first_x:.2f}x) "
            f"| {med('best') * 1e3:.1f} ms ({best_x:.2f}x) "
            f"| {med('zero_copy') * 1e3:.1f} ms "
            f"| {med('into_first') * 1e3:.1f} ms ({into_x[0]:.2f}x) "
            f"| {med('into_best') * 1e3:.1f} ms ({into_x[1]:.2f}x) | {firsts} |"
        )
    bad = [n for n, rs in rows.items() if not all(r["equal"] for r in rs)]
    print("\nLoads that differed from the saved state: " + (", ".join(bad) or "none"))


if __name__ == "__main__":
    main()
