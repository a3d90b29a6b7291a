"""Checkpoint stall in the frameworks, with the cache and without, same model, same run.

* DeepSpeed ``engine.save_checkpoint`` (ZeRO 0, AdamW): the default ``TorchCheckpointEngine``
  (``torch.save`` to disk) vs ``ckptcache.adapters.deepspeed.enable(engine)``.
* DCP ``dcp.save``: ``FileSystemWriter`` vs ``CacheWriter``; ``dcp.async_save``: the stall
  until it returns with ``FileSystemWriter`` (DCP's own staging into CPU memory) vs
  ``CacheWriter`` (the cache's memcpy), each followed by waiting for the upload outside the
  timed part.

Every figure is the best of ``--repeats`` saves (page cache warm, the daemon's segments
reused); the memcpy of the same state is printed as the physical limit. The daemon persists
in the background to the same directory the baselines write to. One process, world size 1.

    python benchmarks/frameworks/bench.py --mib 256 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

import ckptcache
import ckptcache.api
from ckptcache.benchmarking import Row, format_table, memcpy_seconds, running_daemon


def model_of(mib: int) -> torch.nn.Module:
    """An MLP whose parameters total about ``mib`` MiB (float32)."""
    width = 2048
    layers = max(1, mib * 2**20 // (4 * width * width))
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def timed(
    repeats: int, fn: Callable[[int], Any], after: Callable[[Any], None] | None = None
) -> float:
    """Best stall of ``repeats`` calls ``fn(i)``; ``after(result)`` runs untimed (uploads)."""
    best = float("inf")
    for i in range(repeats):
        t0 = time.perf_counter()
        result = fn(i)
        best = min(best, time.perf_counter() - t0)
        if after is not None:
            after(result)
    return best


def state_bytes(obj: Any) -> int:
    """Bytes of every tensor reachable in ``obj``."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_bytes(v) for v in obj)
    return 0


def bench_deepspeed(mib: int, repeats: int, root: str) -> list[Row]:
    import deepspeed

    import ckptcache.adapters.deepspeed as ds_cache

    deepspeed.init_distributed(dist_backend="gloo")
    model = model_of(mib)
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 0},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    loss = engine(torch.randn(1, 2048)).sum()
    engine.backward(loss)
    engine.step()  # optimizer state exists: the checkpoint is params + 2 Adam moments
    nbytes = state_bytes(engine.module.state_dict()) + state_bytes(engine.optimizer.state_dict())
    default_dir, cache_dir = os.path.join(root, "ds-default"), os.path.join(root, "ds-cache")
    t_default = timed(repeats, lambda i: engine.save_checkpoint(default_dir, tag=f"s{i}"))
    ds_cache.enable(engine)
    t_cache = timed(repeats, lambda i: engine.save_checkpoint(cache_dir, tag=f"s{i}"))
    ckptcache.wait(prefix=cache_dir, timeout=600)
    return [
        Row("DeepSpeed save_checkpoint, default engine (torch.save)", nbytes, t_default),
        Row("DeepSpeed save_checkpoint, ckptcache engine", nbytes, t_cache),
    ]


def bench_dcp(mib: int, repeats: int, root: str) -> tuple[list[Row], Row]:
    import torch.distributed.checkpoint as dcp

    from ckptcache.adapters.dcp import CacheWriter

    model = model_of(mib)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(1, 2048)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    nbytes = state_bytes(state)
    tensors = {
        f"t{i}": t for i, t in enumerate(v for v in _leaves(state) if isinstance(v, torch.Tensor))
    }
    limit = Row("memcpy of the same state (limit)", nbytes, memcpy_seconds(tensors))

    def path(kind: str, i: int) -> str:
        return os.path.join(root, f"dcp-{kind}-{i}")

    def fs(kind: str, i: int) -> dcp.FileSystemWriter:
        return dcp.FileSystemWriter(path(kind, i))

    rows = [
        Row(
            "dcp.save, FileSystemWriter",
            nbytes,
            timed(
                repeats,
                lambda i: dcp.save(state, storage_writer=dcp.FileSystemWriter(path("fs", i))),
            ),
        ),
        Row(
            "dcp.save, CacheWriter",
            nbytes,
            timed(repeats, lambda i: dcp.save(state, storage_writer=CacheWriter(path("c", i)))),
        ),
        Row(
            "dcp.async_save stall, FileSystemWriter (DCP staging)",
            nbytes,
            timed(
                repeats,
                lambda i: dcp.async_save(
                    state, storage_writer=dcp.FileSystemWriter(path("afs", i))
                ),
                lambda r: r.result(),
            ),
        ),
        Row(
            "dcp.async_save stall, CacheWriter (cache memcpy)",
            nbytes,
            timed(
                repeats,
                lambda i: dcp.async_save(state, storage_writer=CacheWriter(path("ac", i))),
                lambda r: r.result(),
            ),
        ),
    ]
    ckptcache.wait(prefix=root, timeout=600)
    return rows, limit


def _leaves(obj: Any) -> list[Any]:
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in _leaves(v)]
    if isinstance(obj, (list, tuple)):
        return [x for v in obj for x in _leaves(v)]
    return [obj]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="model parameters in MiB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    args = parser.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="ckptcache-bench-fw-")
    os.makedirs(root, exist_ok=True)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29533"))
    try:
        with running_daemon("--persist-root", root, "--memory-limit", "16GiB") as d:
            os.environ["CKPTCACHE_SOCKET"] = d.socket
            ckptcache.api.set_default_client(None)
            ds_rows = bench_deepspeed(args.mib, args.repeats, root)
            dcp_rows, limit = bench_dcp(args.mib, args.repeats, root)
            print(format_table([*ds_rows, *dcp_rows], limit=limit, limit_name="memcpy"))
            print(format_table([limit]))
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
