"""The main job's demo: start a daemon that persists under a scratch directory, save from a
trainer that then dies (kill -9), see the file persisted anyway, reload the checkpoint in a new
process, and print a small benchmark table against the copy limit and torch.save.

The limit is what the save's own copy engine reaches (its streaming stores on its threads, into
memory touched before, as a spare or reused segment is), measured in the trainer's process
beside its saves: a limit measured with another copy was beaten by a first save.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap

from ckptcache.cli.bench import load_stalls
from ckptcache.cli.benchmarking import (
    Row,
    best_of,
    copy_limit_label,
    format_table,
    make_state,
    running_daemon,
    torch_baselines,
)
from ckptcache.client import Client

__all__ = ["run_demo"]

_TRAINER = textwrap.dedent(
    """
    import json, os, signal, sys
    import ckptcache
    from ckptcache.cli.bench import save_stalls
    from ckptcache.cli.benchmarking import copy_limit_seconds, make_state
    path, nbytes = sys.argv[1], int(sys.argv[2])
    client = ckptcache.api.default_client()
    client.warmup()  # at trainer start: spare segments get mapped while the model is built
    state = {"model": make_state(nbytes, seed=1), "iteration": 100}
    client.warmup(wait=True)  # (here building the model takes less time than mapping)
    # The limit of the saves' copy, by the same copy engine, in this process, on these
    # tensors, right before and after the saves (the faster of the two).
    limit = copy_limit_seconds(state["model"])
    first, repeat = save_stalls(client, state, path, repeats=3)
    limit = min(limit, copy_limit_seconds(state["model"]))
    print(json.dumps({"first": first, "repeat": repeat, "limit": limit}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # the trainer crashes right after checkpointing
    """
)


def _step(text: str) -> None:
    print(f"==> {text}", flush=True)


def run_demo(size_mib: int = 512) -> int:
    """Run the demo end to end; returns 0 when the reloaded checkpoint is bit-identical."""
    nbytes = size_mib << 20
    budget = f"{4 * size_mib + 64}MiB"
    pool = ("--pool-segments", "1", "--pool-bytes", f"{size_mib + 16}MiB")  # one spare fits
    with (
        tempfile.TemporaryDirectory() as tmp,
        running_daemon("--memory-limit", budget, *pool, "--persist-root", tmp) as daemon,
    ):
        _step(f"daemon up (socket {daemon.socket}, budget {budget}, persisting under {tmp})")
        path = os.path.join(tmp, "run", "iter_0000100", "mp_rank_00", "model_optim_rng.pt")
        env = {**os.environ, "CKPTCACHE_SOCKET": daemon.socket}
        _step(f"trainer saves a {size_mib} MiB state dict, then is killed with SIGKILL")
        child = subprocess.run(
            [sys.executable, "-c", _TRAINER, path, str(nbytes)], env=env, capture_output=True
        )
        if child.returncode != -signal.SIGKILL:
            print(child.stderr.decode(), file=sys.stderr)
            return 1
        saved = json.loads(child.stdout)

        _step("a new process loads the checkpoint back from the daemon's memory")
        expected = make_state(nbytes, seed=1)
        with Client(daemon.socket, fallback="raise") as client:
            # Phase 2 went on after the trainer died: the daemon persists the file on its own.
            client.wait(path, timeout=300)
            print(f"    persisted: {path} ({os.path.getsize(path) >> 20} MiB, a plain "
                  "torch.save file)")  # fmt: skip
            same = client.load(path)["iteration"] == 100
            zero_copy, private, matched = load_stalls(client, path, expected, 2, key="model")
            same = same and matched
            verified = best_of(1, lambda: client.load(path, mmap=False, verify=True))
            print(f"    reloaded state is bit-identical: {same}")

        _step("baselines: the copy limit, torch.save/torch.load to /dev/shm and to a local file")
        limit = Row(copy_limit_label(nbytes), nbytes, saved["limit"])
        rows = [
            limit,
            Row("ckptcache.save, first (new path, spare segment)", nbytes, saved["first"]),
            Row("ckptcache.save, repeated (reused segment)", nbytes, saved["repeat"]),
        ]
        rows += torch_baselines(expected, nbytes, {"/dev/shm": "/dev/shm", "local file": tmp})
        rows += [
            Row(
                "ckptcache.load, zero-copy (maps, copies nothing)", nbytes, zero_copy, copies=False
            ),
            Row("ckptcache.load, private copy", nbytes, private),
            Row("ckptcache.load, private copy + verify", nbytes, verified),
        ]
        print()
        print(format_table(rows, limit=limit))
        print()
        return 0 if same else 1
