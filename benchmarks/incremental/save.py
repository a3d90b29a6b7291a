"""A save that copies only what changed, against one that copies every byte, in the same run:
the trainer's stall and CPU per save on a LoRA-shaped and a MoE-shaped state, beside what a
memcpy of the changed tensors alone, and of the whole state, costs in the same process.

    python benchmarks/incremental/save.py --rounds 3

One daemon (``--memory-only allow``: the saves use ``durability="memory"``, so no persist
runs beside them), a memory budget of 4x the larger state. Per round, per state, per mode
(skipping on, then ``CKPTCACHE_SKIP_UNCHANGED=0``; the order flips every round), a fresh
trainer process builds the state and saves it ``--saves`` times to one path, changing between
saves only what ``bench.py``'s states change (the LoRA adapters and their Adam state; 8 of 64
experts and the shared part, as new tensors, and in "MoE in place" written in place, as an
optimizer's step does), with ``--interval`` seconds of "training" (a sleep) after each
save: the daemon checks a freed segment in the background before a save may keep its bytes,
so saves back to back find none checked. The daemon keeps 2 generations a path, so the
segments rotate and a save is handed the segment of the save three before it from the 4th save
on; the saves from ``--from`` on are counted. Per save:

* the stall: the wall time of ``client.save(obj, path, durability="memory")`` (blocking);
* the trainer process's CPU-seconds over it (user + system, ``getrusage``: every thread);
* where the stall went, from timers wrapped around the client's steps: the plan, the
  reservation's and the commit's round trips, the write-protect scan of the watched
  storages (and the watching of new ones), and the copy (what changed, the partial edge
  pages of the skipped storages and the archive's metadata);
* the bytes the save did not copy (read from the save's pass, for reporting only);
* the daemon's CPU-seconds per save over the trainer's run (``/proc/<pid>/stat``): its intake,
  digests and the checks of freed segments.

Then, in the same process: the memcpy (``Tensor.copy_``, torch's intra-op threads) of the
last save's changed tensors into touched, preallocated memory of the same size, and of every
tensor of the state (medians of 5). Last, ``client.load(path)`` must return every tensor
bitwise equal to the live state, or the run fails.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

MiB = 1 << 20
GiB = 1 << 30
STATES = ("LoRA", "MoE", "MoE in place")


def lora_maker(base_bytes: int) -> Callable[[int], dict]:
    """Successive LoRA states on one live frozen base: ``bench.lora_state``'s adapters and
    Adam state new at every save (``bench.py`` makes the base anew each time, which a
    trainer does not)."""
    from bench import lora_state

    state: dict = {}

    def make(seed: int) -> dict:
        if not state:
            state.update(lora_state(base_bytes, seed))
        else:
            fresh = lora_state(0, seed)  # its base is 32 empty tensors: only the rest is used
            model = {k: v for k, v in fresh["model"].items() if k.startswith("lora.")}
            state["model"] = {**state["model"], **model}
            state["optimizer"], state["step"] = fresh["optimizer"], fresh["step"]
        return dict(state)

    return make


def moe_in_place_maker(expert_bytes: int) -> Callable[[int], dict]:
    """Successive MoE states as an optimizer makes them: the 8 touched experts and the shared
    part written in place (``add_``, ``copy_``), every tensor the same live object from save to
    save. ``make.touched`` names the tensors the last call wrote."""
    import torch

    state: dict = {}

    def make(seed: int) -> dict:
        g = torch.Generator().manual_seed(seed)
        if not state:
            g0 = torch.Generator().manual_seed(0)
            state.update({f"attn.{i}": torch.randn(MiB, generator=g0) for i in range(4)})
            for e in range(64):
                for j in range(3):
                    state[f"expert.{e:02d}.w{j}"] = torch.randn(expert_bytes // 12, generator=g0)
            make.touched = set(state)  # type: ignore[attr-defined]
        else:
            touched = {f"attn.{i}" for i in range(4)}
            for name in touched:
                state[name].copy_(torch.randn(MiB, generator=g))
            for e in torch.randperm(64, generator=g)[:8].tolist():
                for j in range(3):
                    state[f"expert.{e:02d}.w{j}"].add_(0.01)
                    touched.add(f"expert.{e:02d}.w{j}")
            make.touched = touched  # type: ignore[attr-defined]
        return {"model": dict(state), "step": seed}

    return make


def _tensors(obj: dict) -> dict[str, object]:
    import torch

    out = {}
    for part in ("model", "optimizer"):
        for name, t in obj.get(part, {}).items():
            assert isinstance(t, torch.Tensor)
            out[f"{part}.{name}"] = t
    return out


def _memcpy(tensors: list) -> float:
    """Median seconds of a libc ``memcpy`` (one thread) of ``tensors`` into touched memory
    of their size, one call a tensor."""
    import ctypes

    import torch

    total = sum(t.nbytes for t in tensors)
    dst = torch.ones(total, dtype=torch.uint8)
    base = dst.data_ptr()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        offset = 0
        for t in tensors:
            ctypes.memmove(base + offset, t.data_ptr(), t.nbytes)
            offset += t.nbytes
        times.append(time.perf_counter() - t0)
    del dst
    return statistics.median(times)


class Timers:
    """Seconds spent in the client's steps during one save (wrapped, for reporting only)."""

    def __init__(self, client) -> None:
        import ckptcache.codec.objectio as objectio
        from ckptcache.client import _unchanged

        self.spent: dict[str, float] = {}
        self.skipped = 0
        saves = client._parts.saves
        saves.plan = self._timed("plan", saves.plan)
        saves.mapping = self._timed("map", saves.mapping)
        connection = saves._connection
        call = connection.call

        def timed_call(method, *a, **k):
            t0 = time.perf_counter()
            try:
                return call(method, *a, **k)
            finally:
                self._add(method, time.perf_counter() - t0)

        connection.call = timed_call
        objectio.write_object = self._timed("copy", objectio.write_object)
        runs = _unchanged.Pass.runs

        def timed_runs(pass_, *a, **k):
            t0 = time.perf_counter()
            try:
                return runs(pass_, *a, **k)
            finally:
                self._add("scan", time.perf_counter() - t0)
                self.skipped += pass_.skipped

        _unchanged.Pass.runs = timed_runs

    def _add(self, name: str, seconds: float) -> None:
        self.spent[name] = self.spent.get(name, 0.0) + seconds

    def _timed(self, name: str, f: Callable) -> Callable:
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                self._add(name, time.perf_counter() - t0)

        return timed

    def take(self) -> tuple[dict[str, float], int]:
        spent, skipped = self.spent, self.skipped
        self.spent, self.skipped = {}, 0
        return spent, skipped


def trainer(args: argparse.Namespace) -> None:
    """One trainer process: build, save ``args.saves`` times, measure, verify; one JSON line."""
    import torch
    from bench import moe_maker

    from ckptcache.client import Client

    makers = {"LoRA": lambda: lora_maker(args.base * MiB),
              "MoE": lambda: moe_maker(args.expert * MiB),
              "MoE in place": lambda: moe_in_place_maker(args.expert * MiB)}  # fmt: skip
    make = makers[args.state]()
    path = f"/bench/incremental/{args.state.replace(' ', '-')}-{args.tag}/model.pt"
    saves = []
    with Client(args.socket) as client:
        timers = Timers(client)
        previous: dict = {}
        history: list[dict] = []  # the tensors of the last 3 saves (kept alive)
        written: list[set] = []  # in place: the names written before each of the last 3 saves
        obj: dict = {}
        changed: list = []
        window: list = []
        for seed in range(args.saves):
            obj = make(seed)
            tensors = _tensors(obj)
            if hasattr(make, "touched"):  # written in place: the maker names what it wrote
                written = [*written[-2:], make.touched]
                changed = [tensors[f"model.{k}"] for k in make.touched]
                since = (
                    {f"model.{k}" for k in set().union(*written)}
                    if len(written) >= 3
                    else set(tensors)
                )
                window = [tensors[k] for k in since]
            else:
                changed = [t for k, t in tensors.items() if previous.get(k) is not t]
                previous = tensors
                # What a save handed the segment of the save 3 before it has to copy.
                back = history[-3] if len(history) >= 3 else {}
                window = [t for k, t in tensors.items() if back.get(k) is not t]
                history = [*history[-2:], tensors]
            timers.take()
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.perf_counter()
            client.save(obj, path, durability="memory")
            stall = time.perf_counter() - t0
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            time.sleep(args.interval)  # training until the next checkpoint
            spent, skipped = timers.take()
            spent["copy"] = spent.get("copy", 0.0) - spent.get("scan", 0.0)  # runs in the copy
            saves.append({
                "stall": stall,
                "cpu": r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime,
                "changed": sum(t.nbytes for t in changed),
                "window": sum(t.nbytes for t in window),
                "skipped": skipped,
                "spent": spent,
            })  # fmt: skip
        assert not torch.cuda.is_initialized()
        tensors = _tensors(obj)
        memcpy_changed = _memcpy(changed)
        memcpy_window = _memcpy(window)
        memcpy_full = _memcpy(list(tensors.values()))
        loaded = client.load(path)
        got = _tensors(loaded)
        assert got.keys() == tensors.keys(), "the loaded state's tensors are not the saved ones"
        for name, t in tensors.items():
            a, b = t.reshape(-1).view(torch.uint8), got[name].reshape(-1).view(torch.uint8)
            if not torch.equal(a, b):
                raise AssertionError(f"{args.state}: {name} loaded differs from the live state")
        assert loaded["step"] == obj["step"]
        del loaded, got, history, previous, changed, window
        client.delete(path)
    size = sum(t.nbytes for t in tensors.values())
    print(json.dumps({"saves": saves, "memcpy_changed": memcpy_changed,
                      "memcpy_window": memcpy_window,
                      "memcpy_full": memcpy_full, "size": size}))  # fmt: skip


def _run_trainer(socket: str, state: str, skip: bool, tag: str, args: argparse.Namespace) -> dict:
    env = {**os.environ, "CKPTCACHE_SKIP_UNCHANGED": "1" if skip else "0"}
    here = str(Path(__file__).resolve().parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (here, env.get("PYTHONPATH"))))
    cmd = [sys.executable, __file__, "--trainer", "--socket", socket, "--state", state,
           "--tag", tag, "--base", str(args.base), "--expert", str(args.expert),
           "--saves", str(args.saves), "--interval", str(args.interval)]  # fmt: skip
    out = subprocess.run(cmd, env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base", default=1024, type=int, help="LoRA frozen base, MiB")
    parser.add_argument("--expert", default=12, type=int, help="MoE bytes per expert, MiB")
    parser.add_argument("--saves", default=8, type=int, help="saves per trainer process")
    parser.add_argument("--from", dest="first", default=5, type=int,
                        help="the first save counted (1-based)")  # fmt: skip
    parser.add_argument("--rounds", default=3, type=int)
    parser.add_argument("--interval", default=1.0, type=float,
                        help="seconds of training between saves (the daemon checks a freed "
                        "segment in the background before a save may keep its bytes)")  # fmt: skip
    parser.add_argument("--trainer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--socket", help=argparse.SUPPRESS)
    parser.add_argument("--state", choices=STATES, help=argparse.SUPPRESS)
    parser.add_argument("--states", nargs="+", choices=STATES, default=list(STATES))
    parser.add_argument("--tag", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trainer:
        trainer(args)
        return

    from ckptcache.cli.benchmarking import running_daemon

    largest = max(args.base + 96, 64 * args.expert + 16) * MiB
    limit = -(-4 * largest // GiB)
    from ckptcache.client._watch import SCAN_IMPLEMENTATION

    print(f"load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} cores, "
          f"daemon budget {limit} GiB, scans: {SCAN_IMPLEMENTATION}\n", flush=True)  # fmt: skip
    results: dict[tuple[str, bool], list[dict]] = {}
    t_start = time.perf_counter()
    with running_daemon("--memory-limit", f"{limit}GiB", "--memory-only", "allow") as d:
        for r in range(args.rounds):
            for state in args.states:
                for skip in (True, False) if r % 2 == 0 else (False, True):
                    tag = f"{'skip' if skip else 'copy'}-{r}"
                    before = _cpu_of(d.proc.pid)
                    result = _run_trainer(d.socket, state, skip, tag, args)
                    result["daemon_cpu"] = (_cpu_of(d.proc.pid) - before) / args.saves
                    results.setdefault((state, skip), []).append(result)
    print(f"{time.perf_counter() - t_start:.0f} s, load average at the end "
          f"{os.getloadavg()[0]:.1f}\n")  # fmt: skip
    _report(results, args.first - 1)


def _cpu_of(pid: int) -> float:
    """User + system CPU-seconds of process ``pid`` so far (every thread)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _report(results: dict[tuple[str, bool], list[dict]], first: int) -> None:
    med = statistics.median
    print("| state | save | size | changed since the last save | since the segment's save "
          "| copied | stall (s) | x memcpy of changed | x memcpy of changed since the segment's "
          "| x full memcpy | trainer CPU-s per save | CPU-s per GiB of state "
          "| daemon CPU-s per save |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    memcpy = {}
    states = sorted({state for state, _ in results}, key=STATES.index)
    for state in states:
        runs = results[(state, True)] + results[(state, False)]
        mc = tuple(med(r[k] for r in runs) for k in ("memcpy_changed", "memcpy_window",
                                                     "memcpy_full"))  # fmt: skip
        memcpy[state] = mc
        for skip in (True, False):
            size = results[(state, skip)][0]["size"]
            counted = [s for r in results[(state, skip)] for s in r["saves"][first:]]
            stall, cpu = med(s["stall"] for s in counted), med(s["cpu"] for s in counted)
            changed, window = med(s["changed"] for s in counted), med(s["window"] for s in counted)
            copied = size - med(s["skipped"] for s in counted)
            print(
                f"| {state} | {'skip unchanged' if skip else 'copy all'} | {size / MiB:.0f} MiB "
                f"| {changed / MiB:.0f} MiB | {window / MiB:.0f} MiB | {copied / MiB:.0f} MiB "
                f"| {stall:.3f} | {stall / mc[0]:.2f}x | {stall / mc[1]:.2f}x "
                f"| {stall / mc[2]:.2f}x | {cpu:.3f} | {cpu / (size / GiB):.3f} "
                f"| {med(r['daemon_cpu'] for r in results[(state, skip)]):.3f} |",
                flush=True,
            )
    print("\n| state | memcpy: changed since the last save (s) | changed since the segment's "
          "save (s) | whole state (s) |")  # fmt: skip
    print("|---|---:|---:|---:|")
    for state, mc in memcpy.items():
        print(f"| {state} | " + " | ".join(f"{x:.3f}" for x in mc) + " |")
    steps = ("plan", "map", "reserve", "scan", "copy", "commit")
    print("\nWhere the stall went (medians over the counted saves, ms):\n")
    print(f"| state | save | {' | '.join(steps)} | other | stall |")
    print("|---|---|" + "---:|" * (len(steps) + 2))
    for state in states:
        for skip in (True, False):
            counted = [s for r in results[(state, skip)] for s in r["saves"][first:]]
            cells = [med(s["spent"].get(k, 0.0) for s in counted) * 1e3 for k in steps]
            other = med(
                s["stall"] - sum(v for k, v in s["spent"].items() if k in steps) for s in counted
            )
            stall = med(s["stall"] for s in counted)
            print(f"| {state} | {'skip unchanged' if skip else 'copy all'} | "
                  + " | ".join(f"{c:.1f}" for c in cells)
                  + f" | {other * 1e3:.1f} | {stall * 1e3:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
