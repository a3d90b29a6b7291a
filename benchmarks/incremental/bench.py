"""Incremental persists against full ones, in the same run: bytes written from memory, time to
durable and the daemon's CPU-seconds per GiB, on a LoRA-shaped and a MoE-shaped state.

    python benchmarks/incremental/bench.py --roots ext4=/var/tmp/inc xfs=/mnt/xfs-reflink
    python benchmarks/incremental/bench.py --roots s3=moto

``s3=moto`` persists to a bucket of moto's S3 server, started on loopback by the script (real
HTTP, boto3 on both sides); ``s3=<endpoint URL>/<bucket>`` to another S3 endpoint.

Each root is measured with two daemons in turn, ``incremental_persist: false`` then ``true``,
each saving the same sequence to the same path: a first save (always written in full), then
``--rounds`` saves where only the changing part differs. Per round: time to durable is from
``save`` to ``wait`` returning (the file named and synced); bytes written from memory are the
file's size less what the daemon copied from the previous file
(``ckptcache_persist_bytes_reused``); CPU is the daemon process's user + system time over the
round (it does nothing else), per GiB of checkpoint; disk writes are the daemon's
``write_bytes`` (``/proc/<pid>/io``: an in-kernel copy on a file system without reflinks
still writes its pages). Medians over the rounds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ckptcache.cli.benchmarking import running_daemon
from ckptcache.client import Client

MiB = 1 << 20
GiB = 1 << 30


def lora_state(base_bytes: int, seed: int) -> dict[str, object]:
    """A frozen base (32 tensors) and 32 MiB of adapters with their Adam state (64 MiB)."""
    g = torch.Generator().manual_seed(0)
    base = {f"base.{i:02d}": torch.randn(base_bytes // 4 // 32, generator=g) for i in range(32)}
    g = torch.Generator().manual_seed(seed)
    adapters = {f"lora.{i:02d}": torch.randn(MiB // 8, generator=g) for i in range(64)}
    optim = {
        f"{kind}.{i:02d}": torch.rand(MiB // 8, generator=g)
        for kind in ("exp_avg", "exp_avg_sq")
        for i in range(64)
    }
    return {"model": {**base, **adapters}, "optimizer": optim, "step": seed}


def moe_state(expert_bytes: int, seed: int, experts: dict[int, list[torch.Tensor]]) -> dict:
    """64 experts (3 tensors each) and a small shared part; 8 experts change each save."""
    if not experts:
        g = torch.Generator().manual_seed(0)
        for e in range(64):
            experts[e] = [torch.randn(expert_bytes // 4 // 3, generator=g) for _ in range(3)]
    else:
        g = torch.Generator().manual_seed(seed)
        for e in torch.randperm(64, generator=g)[:8].tolist():
            experts[e] = [t + 0.01 for t in experts[e]]
    g = torch.Generator().manual_seed(seed)
    shared = {f"attn.{i}": torch.randn(MiB, generator=g) for i in range(4)}  # 16 MiB
    flat = {f"expert.{e:02d}.w{j}": t for e, ts in experts.items() for j, t in enumerate(ts)}
    return {"model": {**shared, **flat}, "step": seed}


def moe_maker(expert_bytes: int) -> Callable[[int], dict]:
    """Successive MoE states, each from the one before (8 experts touched)."""
    experts: dict[int, list[torch.Tensor]] = {}
    return lambda seed: moe_state(expert_bytes, seed, experts)


@dataclass
class Round:
    durable: float
    persisted: float  # the daemon's own persist time
    size: int
    from_memory: int
    cpu: float
    disk: int


def _metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def _cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _disk(pid: int) -> int:
    with open(f"/proc/{pid}/io") as f:
        for line in f:
            if line.startswith("write_bytes:"):
                return int(line.split()[1])
    return 0


class Store:
    """Where the persists go: a directory, or an S3 bucket (``endpoint``)."""

    def __init__(self, root: str, endpoint: str = ""):
        self.root, self.endpoint = root, endpoint

    def reset(self) -> None:
        if not self.endpoint:
            shutil.rmtree(self.root, ignore_errors=True)
            os.makedirs(self.root)

    def path(self) -> str:
        return f"{self.root}/run/model.pt"

    def size(self, path: str) -> int:
        if not self.endpoint:
            return os.path.getsize(path)
        import boto3

        bucket, key = path[5:].split("/", 1)
        s3 = boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1")
        return int(s3.head_object(Bucket=bucket, Key=key)["ContentLength"])

    def args(self) -> tuple[str, ...]:
        return ("--s3-endpoint-url", self.endpoint) if self.endpoint else ()


def s3_store(spec: str) -> Store:
    """``moto`` (a server started here) or ``<endpoint URL>/<bucket>``."""
    import boto3

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    if spec == "moto":
        import logging

        from moto.server import ThreadedMotoServer

        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
        from tests.lab_s3 import patch_moto

        patch_moto()  # ranges and part copies read only their range, as S3 does
        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise

        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        endpoint, bucket = f"http://{host}:{port}", "bench-incremental"
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(
            Bucket=bucket
        )
    else:
        endpoint, bucket = spec.rsplit("/", 1)
    return Store(f"s3://{bucket}/bench", endpoint)


def run(store: Store, incremental: bool, make, rounds: int) -> list[Round]:
    """One daemon, ``1 + rounds`` saves of ``make(seed)`` to one path; the later rounds."""
    store.reset()
    cfg = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)  # noqa: SIM115
    cfg.write(f"incremental_persist: {'true' if incremental else 'false'}\n")
    cfg.close()
    path = store.path()
    out = []
    args = ("--persist-root", store.root, "--memory-limit", "6GiB", "--metrics-port", "0",
            "--config", cfg.name, *store.args())  # fmt: skip
    with running_daemon(*args) as d:
        log = os.path.join(os.path.dirname(d.socket), "daemon.log")
        while "metrics=:" not in open(log).read():  # noqa: SIM115
            time.sleep(0.05)
        port = int(open(log).read().split("metrics=:")[1].split()[0])  # noqa: SIM115
        with Client(d.socket) as c:
            for seed in range(rounds + 1):
                obj = make(seed)
                reused0, cpu0, disk0 = (
                    _metric(port, "ckptcache_persist_bytes_reused_total"),
                    _cpu(d.proc.pid),
                    _disk(d.proc.pid),
                )
                t0 = time.perf_counter()
                c.save(obj, path)
                c.wait(path, timeout=600)
                durable = time.perf_counter() - t0
                size = store.size(path)
                reused = _metric(port, "ckptcache_persist_bytes_reused_total") - reused0
                if seed:
                    out.append(Round(
                        durable, c.status(path).persist_seconds or 0.0, size,
                        int(size - reused), _cpu(d.proc.pid) - cpu0, _disk(d.proc.pid) - disk0,
                    ))  # fmt: skip
                del obj
    os.unlink(cfg.name)
    if not store.endpoint:
        shutil.rmtree(store.root, ignore_errors=True)
    return out


def _median(rounds: list[Round], field: str) -> float:
    return statistics.median(getattr(r, field) for r in rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--roots", nargs="+", required=True, help="label=directory ...")
    parser.add_argument("--base", default=1024, type=int, help="LoRA frozen base, MiB")
    parser.add_argument("--expert", default=12, type=int, help="MoE bytes per expert, MiB")
    parser.add_argument("--rounds", default=3, type=int)
    args = parser.parse_args()
    stores = []
    for spec in args.roots:
        fs, where = spec.split("=", 1)
        is_s3 = fs == "s3"
        stores.append((fs, s3_store(where) if is_s3 else Store(os.path.join(where, "bench"))))
    print("| state | storage | persist | size | written from memory | time to durable (s) "
          "| daemon persist (s) | CPU-s per GiB | disk writes |")  # fmt: skip
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for label, make_for in (
        ("LoRA", lambda: lambda seed: lora_state(args.base * MiB, seed)),
        ("MoE", lambda: moe_maker(args.expert * MiB)),
    ):
        for fs, store in stores:
            if os.environ.get("CKPTCACHE_INCREMENTAL_COPY") == "always":
                fs += " (copy always)"
            for incremental in (False, True):
                rounds = run(store, incremental, make_for(), args.rounds)
                size = _median(rounds, "size")
                print(
                    f"| {label} | {fs} | {'incremental' if incremental else 'full'} "
                    f"| {size / MiB:.0f} MiB | {_median(rounds, 'from_memory') / MiB:.0f} MiB "
                    f"| {_median(rounds, 'durable'):.2f} | {_median(rounds, 'persisted'):.2f} "
                    f"| {_median(rounds, 'cpu') / (size / GiB):.2f} "
                    f"| {_median(rounds, 'disk') / MiB:.0f} MiB |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
