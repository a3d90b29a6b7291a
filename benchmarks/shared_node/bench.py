"""Repeated save stall and zero-copy load of an admitted user of a root daemon, vs memcpy.

    sudo python benchmarks/shared_node/bench.py --sizes 256MiB 1GiB \\
        --trees before=/path/to/old/checkout after=.

An admitted user's segment is sealed by the daemon at each commit and unsealed at each
reservation (``ckptcache/server/memory/sealing.py``), and the daemon records each commit in its own
directory (``server/memory/records.py``): this measures what that costs the user, next to a memcpy
of
the same tensors measured in the same process. Each tree (a source checkout) is measured in
turn in one run, its daemon and client imported from it; sizes interleave trees so that the
machine's drift hits both alike. Needs root (a root daemon and a second local user).
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time

_USER = "ckptcache-bench"


def _user() -> tuple[int, int]:
    try:
        entry = pwd.getpwnam(_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell",
                        "/usr/sbin/nologin", _USER], check=True)  # fmt: skip
        entry = pwd.getpwnam(_USER)
    return entry.pw_uid, entry.pw_gid


def _child(socket_path: str, nbytes: int, repeats: int) -> dict[str, float]:
    """As the admitted user: repeated saves and zero-copy loads, best of ``repeats``."""
    import torch

    from ckptcache.cli.bench import wait_idle
    from ckptcache.cli.benchmarking import make_state, memcpy_seconds
    from ckptcache.client import Client

    state = make_state(nbytes)
    out = {"memcpy": memcpy_seconds(state)}
    path = "/nonexistent-ckptcache-bench/model.pt"
    with Client(socket_path, fallback="raise") as c:
        c.save(state, path, durability="memory")  # the first save: a new segment
        best = float("inf")
        for _ in range(repeats):
            wait_idle(c, path)
            t0 = time.perf_counter()
            c.save(state, path, durability="memory")
            best = min(best, time.perf_counter() - t0)
        out["save, repeated"] = best
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            loaded = c.load(path)
            best = min(best, time.perf_counter() - t0)
            assert all(torch.equal(loaded[k], v) for k, v in state.items())
            del loaded
        out["load, zero-copy"] = best
    return out


def _as_user(socket_path: str, nbytes: int, repeats: int, uid: int, gid: int) -> None:
    """Run :func:`_child` as ``uid`` in a forked child and print its figures. The client's
    code paths run once as root first: the user cannot read the interpreter's own
    directory, so every module it needs is imported before the fork."""
    import torch

    from ckptcache.client import Client

    with Client(socket_path, fallback="raise") as c:
        warm = "/nonexistent-ckptcache-bench/warm.pt"
        c.save({"w": torch.ones(4)}, warm, durability="memory")
        c.load(warm)
        c.status(warm)
        c.delete(warm)
    if uid == 0:  # --saver root: the daemon's own user, whose segments are never sealed
        print(json.dumps(_child(socket_path, nbytes, repeats)))
        return
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
        with os.fdopen(write, "w") as f:
            json.dump(_child(socket_path, nbytes, repeats), f)
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    if status:
        raise RuntimeError(f"the measuring child failed ({status})")
    print(data)


def _measure(tree: str, nbytes: int, repeats: int, saver: str) -> dict[str, float]:
    """Start a root daemon from ``tree`` admitting the bench user, run :func:`_child` as that
    user, or as root (``saver``; a fresh interpreter importing ``tree``), and return its
    figures."""
    uid, gid = _user()
    saver_uid, saver_gid = (uid, gid) if saver == "user" else (0, 0)
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
    work = tempfile.mkdtemp(prefix="ckptcache-bench-", dir="/tmp")
    os.chmod(work, 0o755)
    shm = tempfile.mkdtemp(prefix="ckptcache-bench-", dir="/dev/shm")
    os.rmdir(shm)  # the daemon creates it
    cfg = os.path.join(work, "cfg.yaml")
    with open(cfg, "w") as f:
        f.write(f"allowed_uids: [{uid}]\n")
    sock = os.path.join(work, "daemon.sock")
    budget = str(3 * nbytes + (64 << 20))
    cmd = [sys.executable, "-m", "ckptcache.cli", "daemon", "--socket", sock, "--shm-dir", shm,
           "--config", cfg, "--memory-limit", budget, "--keep", "1",
           "--memory-only", "allow"]  # fmt: skip
    with open(os.path.join(work, "daemon.log"), "wb") as log:
        daemon = subprocess.Popen(cmd, stdout=log, stderr=log, env=env, cwd="/")
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(sock):
            if daemon.poll() is not None or time.monotonic() > deadline:
                with open(os.path.join(work, "daemon.log")) as log_file:
                    raise RuntimeError(log_file.read())
            time.sleep(0.05)
        # A root interpreter importing ``tree`` measures, as the user, in a forked child.
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--child", sock, str(nbytes),
             str(repeats), str(saver_uid), str(saver_gid)],
            env=env, capture_output=True, text=True, check=True, cwd="/",
        )  # fmt: skip
        return json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        daemon.terminate()
        daemon.wait(timeout=60)
        subprocess.run(["chattr", "-R", "-a", shm], check=False, capture_output=True)
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        sock, nbytes, repeats, uid, gid = sys.argv[2:7]
        _as_user(sock, int(nbytes), int(repeats), int(uid), int(gid))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", default=["256MiB", "1GiB"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--trees", nargs="+", default=["this=."], help="NAME=DIR source checkouts")
    p.add_argument(
        "--saver",
        choices=("user", "root"),
        default="user",
        help="who saves: the admitted user (sealed segments) or root",
    )
    args = p.parse_args()
    from ckptcache._units import format_bytes, parse_bytes

    trees = [t.split("=", 1) for t in args.trees]
    print("| size | tree | memcpy | save, repeated | (x memcpy) | load, zero-copy |")
    print("|---|---|---:|---:|---:|---:|")
    for size in args.sizes:
        nbytes = parse_bytes(size)
        for name, tree in trees:
            r = _measure(tree, nbytes, args.repeats, args.saver)
            ratio = r["memcpy"] / r["save, repeated"]
            print(f"| {format_bytes(nbytes)} | {name} | {r['memcpy']:.3f} s | "
                  f"{r['save, repeated']:.3f} s | {ratio:.2f}x | "
                  f"{r['load, zero-copy'] * 1e3:.1f} ms |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
