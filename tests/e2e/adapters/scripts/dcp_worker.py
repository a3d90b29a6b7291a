"""DCP through the cache on CPU ranks.

usage: dcp_worker.py MODE CKPT_DIR WORLD
MODE: save | load | loadfs | asyncsave | failures
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _dist import launch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

FULL = torch.arange(96, dtype=torch.float32).reshape(24, 4)
BIAS = torch.linspace(0, 1, 10)


def make_state(mesh, empty: bool) -> dict:
    w = torch.zeros_like(FULL) if empty else FULL
    return {
        "model": {"w": distribute_tensor(w, mesh, [Shard(0)]), "b": BIAS * (0 if empty else 1)},
        "extra": {"step": 0 if empty else 41, "note": "" if empty else "hello"},
    }


def check(sd: dict) -> None:
    assert torch.equal(sd["model"]["w"].full_tensor(), FULL)
    assert torch.equal(sd["model"]["b"], BIAS)
    assert sd["extra"] == {"step": 41, "note": "hello"}, sd["extra"]


def injected(base: type, phase: str, rank: int) -> type:
    """``base`` whose ``phase`` method raises on ``rank``."""

    def boom(self, *args, **kwargs):
        if dist.get_rank() == rank:
            raise OSError(f"injected storage failure in {phase}")
        return getattr(base, phase)(self, *args, **kwargs)

    return type(f"Failing{base.__name__}", (base,), {phase: boom})


def failures(mesh, ck: str) -> None:
    from ckptcache.adapters.dcp import CacheReader, CacheWriter

    rank = dist.get_rank()
    for phase, on in [("prepare_local_plan", 1), ("prepare_global_plan", 0),
                      ("write_data", 1), ("finish", 0)]:  # fmt: skip
        where = os.path.join(ck, f"w-{phase}")
        try:
            dcp.save(
                make_state(mesh, False), storage_writer=injected(CacheWriter, phase, on)(where)
            )
        except CheckpointException as e:
            assert "injected storage failure" in str(e), e
        else:
            raise AssertionError(f"writer failure in {phase} was not reported")
        dist.barrier()
        # Not half-visible: no commit marker, and DCP's own reader refuses the directory.
        assert not os.path.exists(os.path.join(where, ".metadata")), phase
        try:
            dcp.load(make_state(mesh, True), storage_reader=dcp.FileSystemReader(where))
        except CheckpointException:
            pass
        else:
            raise AssertionError(f"a failed save in {phase} is loadable")
        if phase == "write_data" and rank == on:
            from ckptcache.api import default_client

            mine = [o for o in default_client().list(where) if f"__{rank}_" in o.path]
            assert not mine, f"failed rank kept {len(mine)} cached items"
        if rank == 0:
            print(f"WRITER-{phase}-CLEAN", flush=True)
    good = os.path.join(ck, "good")
    dcp.save(make_state(mesh, False), storage_writer=CacheWriter(good))
    for phase, on in [("read_metadata", 1), ("prepare_local_plan", 0),
                      ("prepare_global_plan", 0), ("read_data", 1)]:  # fmt: skip
        try:
            dcp.load(make_state(mesh, True), storage_reader=injected(CacheReader, phase, on)(good))
        except CheckpointException as e:
            assert "injected storage failure" in str(e), e
        else:
            raise AssertionError(f"reader failure in {phase} was not reported")
        if rank == 0:
            print(f"READER-{phase}-CLEAN", flush=True)
    sd = make_state(mesh, True)
    dcp.load(sd, storage_reader=CacheReader(good))  # the failures left the checkpoint intact
    check(sd)


def run(rank: int, world: int, mode: str, ck: str) -> None:
    dist.init_process_group("gloo")
    from ckptcache.adapters.dcp import CacheReader, CacheWriter

    mesh = init_device_mesh("cpu", (world,))
    if mode == "save":
        dcp.save(make_state(mesh, False), storage_writer=CacheWriter(ck))
    elif mode == "asyncsave":
        sd = make_state(mesh, False)
        writer = CacheWriter(ck)
        response = dcp.async_save(sd, storage_writer=writer)
        # Training goes on at once: changing the originals must not reach the checkpoint.
        sd["model"]["b"].mul_(-1)
        sd["model"]["w"].to_local().zero_()
        response.result()
        if os.path.exists(os.environ["CKPTCACHE_SOCKET"]):  # else staged as plain copies
            # The staging copy went back to the daemon once write_data was done.
            mine = f"ckptcache-staging-{os.getpid()}-"
            assert not [o.path for o in writer.client.list() if mine in o.path]
    elif mode in ("load", "loadfs"):
        sd = make_state(mesh, True)
        reader = CacheReader(ck) if mode == "load" else dcp.FileSystemReader(ck)
        dcp.load(sd, storage_reader=reader)
        check(sd)
    elif mode == "failures":
        failures(mesh, ck)
    dist.barrier()
    if rank == 0:
        print(f"{mode.upper()}-OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    launch(run, int(sys.argv[3]), sys.argv[1], sys.argv[2])
