"""Footprint of the daemon and the CLI: start-to-serving time, idle RSS, CLI wall time.

Run: ``python benchmarks/footprint/bench.py`` (the daemon is started with ``python -m
ckptcache.cli daemon`` exactly as the ``ckptcache daemon`` console script would).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid


def _serving(path: str, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"daemon exited with {proc.returncode}")
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect(path)
            return
        except OSError:
            time.sleep(0.01)
        finally:
            s.close()
    raise TimeoutError(path)


def _status_field(pid: int, field: str) -> str:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return line.split(":", 1)[1].strip()
    return "?"


def _torch_mapped(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch" in f.read()


def _cli(*args: str) -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "ckptcache.cli", *args], check=True,
                   stdout=subprocess.DEVNULL)  # fmt: skip
    return time.perf_counter() - t


def main() -> None:
    """Print one line per figure (best of three for the CLI commands)."""
    work = tempfile.mkdtemp(prefix="ckptcache-footprint-")
    sock = os.path.join(work, "d.sock")
    shm = f"/dev/shm/ckptcache-footprint-{uuid.uuid4().hex[:8]}"
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckptcache.cli", "daemon", "--socket", sock, "--shm-dir", shm,
         "--memory-limit", "64MiB"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        _serving(sock, proc)
        started = time.perf_counter() - t0
        time.sleep(1.0)  # let start-up threads settle before reading the idle footprint
        print(f"daemon start to serving   {started:6.2f} s")
        print(f"idle daemon VmRSS         {_status_field(proc.pid, 'VmRSS')}")
        print(f"libtorch mapped in daemon {_torch_mapped(proc.pid)}")
        for cmd in ("status", "ls"):
            best = min(_cli(cmd, "--socket", sock) for _ in range(3))
            print(f"ckptcache {cmd:<16}{best:6.2f} s")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


if __name__ == "__main__":
    main()
