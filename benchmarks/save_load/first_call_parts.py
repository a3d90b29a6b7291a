"""Where the time of a save that is a process's very first call goes: a fresh trainer process
(no ``warmup()``, no ``exists`` or ``load`` before) whose first contact with the daemon is its
save, each part of that save timed in the process (wrapping the client's own steps), next to
the memcpy of the same process.

    python benchmarks/save_load/first_call_parts.py --size 512MiB --rounds 3

Each round, on a fresh daemon: an earlier trainer saves ``job/step-1/model.pt`` (the daemon's
first save: a new segment); a new trainer saves ``job/step-2/model.pt`` as its first call (the
daemon has a spare made from the earlier save); a third trainer does the same after importing
the save's modules itself, untimed (what the imports cost the first call). The state is
``tensor_count.py``'s ``mix`` (2,072 tensors at 512 MiB). The trainers run on modules compiled
beforehand, as an installed package has them.

The parts: ``plan`` (the save's modules imported, the state walked, flattened, its tensor
table and archive planned: a plan-cache miss), ``reserve`` (the round trip that names the
segment), ``mapping`` (the wait for the segment's mapping, the spare's page tables made by
the client's threads meanwhile), ``copy`` (into the segment), and the rest (the connection
made at first contact, the commit).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from ckptcache._units import parse_bytes
from ckptcache.cli.benchmarking import running_daemon

MARK = "FIRST-CALL "
PARTS = ("plan", "reserve", "mapping", "copy")


def _timed(owner: Any, name: str, part: str, into: dict[str, float]) -> None:
    """Wrap ``owner.name`` so that its calls' time adds up in ``into[part]``."""
    inner: Callable[..., Any] = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            into[part] = into.get(part, 0.0) + time.perf_counter() - t0

    setattr(owner, name, timed)


def trainer(socket: str, path: str, nbytes: int, imported: bool) -> None:
    """One fresh trainer process: the state, a memcpy, then its first call, a save."""
    from ckptcache.cli.benchmarking import memcpy_seconds, mixed_state
    from ckptcache.client import Client, _saves

    state = mixed_state(nbytes)
    memcpy = memcpy_seconds(state)
    parts: dict[str, float] = {}
    if imported:
        t0 = time.perf_counter()
        import ckptcache.codec.encode
        import ckptcache.codec.objectio
        import ckptcache.codec.plan.cache  # noqa: F401

        parts["imports, before"] = time.perf_counter() - t0
    from ckptcache.codec import objectio

    _timed(_saves.Saves, "plan", "plan", parts)
    _timed(_saves.Saves, "_reserve", "reserve", parts)
    _timed(_saves.Saves, "mapping", "mapping", parts)
    _timed(objectio, "write_object", "copy", parts)
    client = Client(socket, fallback="raise")
    t0 = time.perf_counter()
    client.save(state, path, durability="memory")
    save = time.perf_counter() - t0
    client.close()
    print(MARK + json.dumps({"memcpy": memcpy, "save": save, **parts}), flush=True)


def run_trainer(socket: str, path: str, nbytes: int, imported: bool, env: dict[str, str]) -> Any:
    """``trainer`` in a fresh interpreter; its result line."""
    cmd = [sys.executable, __file__, "--trainer", socket, path, str(nbytes), str(int(imported))]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"trainer failed: {done.stderr.strip()[-2000:]}")
    line = next(x for x in done.stdout.splitlines() if x.startswith(MARK))
    return json.loads(line[len(MARK) :])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--trainer":
        trainer(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5] == "1")
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="512MiB")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    nbytes = parse_bytes(args.size)
    pycache = tempfile.mkdtemp(prefix="first-call-pyc-")
    env = dict(os.environ, PYTHONPYCACHEPREFIX=pycache)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    package = os.path.join(os.path.dirname(__file__), "..", "..", "ckptcache")
    subprocess.run([sys.executable, "-m", "compileall", "-q", package], check=True, env=env)
    cases = (("the daemon's first save", False), ("first call", False),
             ("first call, modules imported before", True))  # fmt: skip
    print(f"| {args.size}, ms (x memcpy) | memcpy | save | " + " | ".join(PARTS) + " | rest |")
    print("|---|" + "---:|" * (len(PARTS) + 3))
    for _ in range(args.rounds):
        with (
            tempfile.TemporaryDirectory() as root,
            running_daemon("--memory-limit", str(5 * nbytes + (512 << 20))) as daemon,
        ):
            for step, (name, imported) in enumerate(cases, 1):
                path = os.path.join(root, "job", f"step-{step}", "model.pt")
                r = run_trainer(daemon.socket, path, nbytes, imported, env)
                rest = r["save"] - sum(r.get(part, 0.0) for part in PARTS)
                cells = " | ".join(f"{r.get(part, 0.0) * 1e3:.1f}" for part in PARTS)
                print(f"| {name} (load {os.getloadavg()[0]:.1f}) | {r['memcpy'] * 1e3:.1f} | "
                      f"{r['save'] * 1e3:.1f} ({r['save'] / r['memcpy']:.2f}x) | {cells} | "
                      f"{rest * 1e3:.1f} |", flush=True)  # fmt: skip
                time.sleep(2.0)  # the trainer ended; the daemon's background work done
    shutil.rmtree(pycache, ignore_errors=True)


if __name__ == "__main__":
    main()
