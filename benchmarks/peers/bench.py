"""ckptcache against the open checkpointing systems a user would pick instead, in one run.

    bash benchmarks/peers/setup.sh            # once: the peers, in benchmarks/peers/.venv
    benchmarks/peers/.venv/bin/python benchmarks/peers/bench.py --shapes small   # README's run

Every system saves the same state (five shapes, two sizes) on this machine, each measurement in
a fresh process, the systems in an order rotated round by round (interleaved), and every
figure is the median over the rounds. Every reload is compared byte for byte with the saved
state. Next to each figure: its ratio to the physical limit measured in the same run (memcpy
into touched memory for stall and load, a raw write + fsync of the same bytes for durable;
1.00x = as fast as the limit).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(HERE), str(ROOT)]

from states import SHAPES  # noqa: E402
from systems import GUARANTEES, SYSTEMS  # noqa: E402
from worker import MARK  # noqa: E402

from ckptcache._units import parse_bytes  # noqa: E402

METRICS = ("stall", "durable", "load")
LIMIT_OF = {"stall": "memcpy", "durable": "raw_write", "load": "memcpy"}


def run_worker(system: str, shape: str, nbytes: int, directory: str, timeout: float) -> dict:
    """One fresh process; its result line, or an error row."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE)]))
    cmd = [sys.executable, "-W", "ignore", str(HERE / "worker.py"), system, str(nbytes)]
    cmd += ["--shapes", shape, "--dir", directory]
    row: dict[str, Any] = {"system": system, "shape": shape, "size": nbytes}
    # Its own process group, and files rather than pipes for its output: peers leave saver
    # processes behind (DLRover's outlives the trainer by design) that would hold a pipe open,
    # and a stale one would answer the next process's first save.
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return {**row, "error": f"no result within {timeout:.0f} s"}
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    for line in stdout.decode(errors="replace").splitlines():
        if line.startswith(MARK):
            return dict(json.loads(line[len(MARK) :]))
    tail = stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
    return {**row, "error": f"exit {proc.returncode}: {tail[0]}"}


def cell(seconds: float | None, limit: float | None) -> str:
    if seconds is None:
        return "-"
    text = f"{seconds * 1e3:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"
    return f"{text} ({limit / seconds:.2f}x)" if limit else text


def report(rows: list[dict], sizes: list[int], shapes: list[str], systems: list[str]) -> str:
    """Markdown: per shape a table of medians with ratios; then limits, errors, mismatches."""
    med: dict[tuple[str, str, int, str], float] = {}
    samples: dict[tuple[str, str, int, str], list[float]] = defaultdict(list)
    tensors: dict[tuple[str, int], int] = {}
    errors: dict[str, str] = {}
    mismatches = []
    for r in rows:
        if "error" in r:
            errors.setdefault(r["system"], r["error"])
            continue
        tensors[(r["shape"], r["size"])] = r["tensors"]
        if r.get("mismatch"):
            mismatches.append(f"{r['system']} {r['shape']} {r['size'] >> 20} MiB: {r['mismatch']}")
        for key in (*METRICS, "memcpy", "raw_write", "held"):
            if key in r:
                samples[(r["system"], r["shape"], r["size"], key)].append(r[key])
    for k, v in samples.items():
        med[k] = statistics.median(v)

    def mib(n: int) -> str:
        return f"{n / 2**30:g} GiB" if n >= 2**30 else f"{n >> 20} MiB"

    out = []
    for shape in shapes:
        counts = ", ".join(f"{tensors.get((shape, s), '?')} at {mib(s)}" for s in sizes)
        out.append(f"\n### {shape} ({counts} tensors)\n")
        head = ["system"] + [f"{m} {mib(s)}" for m in METRICS for s in sizes]
        out.append("| " + " | ".join(head) + " |")
        out.append("|---|" + "---:|" * (len(head) - 1))
        limit_row = ["**limit** (memcpy; raw write + fsync)"]
        for m in METRICS:
            for s in sizes:
                limit_row.append(cell(med.get(("limits", shape, s, LIMIT_OF[m])), None))
        out.append("| " + " | ".join(limit_row) + " |")
        for system in systems:
            if system in errors and not any(k[0] == system for k in med):
                continue
            line = [GUARANTEES[system][0]]
            for m in METRICS:
                for s in sizes:
                    limit = med.get(("limits", shape, s, LIMIT_OF[m]))
                    line.append(cell(med.get((system, shape, s, m)), limit))
            out.append("| " + " | ".join(line) + " |")
    held = {k: v for k, v in med.items() if k[3] == "held"}
    if held:
        out.append("\nMemory held once the saves are settled (segment files, x the state):\n")
        out += [f"* {GUARANTEES[k[0]][0]}, {k[1]} {mib(k[2])}: {v:.2f}x" for k, v in held.items()]
    if errors:
        out.append("\nErrors (a system with no figures above refused to run here):\n")
        out += [f"* {GUARANTEES.get(s, (s,))[0]}: `{e}`" for s, e in errors.items()]
    out.append("\nReloads that differed from the saved state: " + ("; ".join(mismatches) or "none"))
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", default=["512MiB", "2GiB"])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default=tempfile.gettempdir(), help="directory on the disk tested")
    p.add_argument("--timeout", type=float, default=600, help="seconds for one process")
    p.add_argument("--json", help="write every measured row here")
    args = p.parse_args()
    sizes = [parse_bytes(s) for s in args.sizes]
    names = ["limits", *args.systems]
    rows: list[dict] = []
    refused: set[str] = set()
    loads: list[float] = []
    t_start = time.monotonic()
    for rnd in range(args.rounds):
        for size in sizes:
            for shape in args.shapes:
                order = names[rnd % len(names) :] + names[: rnd % len(names)]
                for system in order:
                    if system in refused:
                        continue
                    loads.append(os.getloadavg()[0])
                    row = run_worker(system, shape, size, args.dir, args.timeout)
                    row["round"] = rnd
                    rows.append(row)
                    err = row.get("error", "")
                    status = err or " ".join(
                        f"{m}={row[m]:.3f}" for m in (*METRICS, "memcpy", "raw_write") if m in row
                    )
                    print(f"[round {rnd}] {system} {shape} {size >> 20} MiB: {status}",
                          file=sys.stderr, flush=True)  # fmt: skip
                    if err.startswith(("ModuleNotFoundError", "ImportError")):
                        refused.add(system)  # it will refuse the same way every time
    minutes = (time.monotonic() - t_start) / 60
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print(f"{args.rounds} rounds, {minutes:.1f} min; load average (1 min) during the run: "
          f"{min(loads):.2f}-{max(loads):.2f}, median {statistics.median(loads):.2f}; "
          f"{os.cpu_count()} CPUs")  # fmt: skip
    print(report(rows, sizes, args.shapes, args.systems))


if __name__ == "__main__":
    main()
