"""Checkpoint stall in the frameworks, with the cache and without, same model, same run.

For each framework the call that blocks training is timed three ways on the same state:

* a memcpy of that state's tensors into already-faulted buffers (the physical limit);
* the framework's default path (its own writer, ``torch.save`` to local files);
* the ckptcache path:

  - DeepSpeed ``engine.save_checkpoint`` (ZeRO 0, 1, 2, 3; AdamW) with
    ``ckptcache.adapters.deepspeed.enable(engine)`` vs the default ``TorchCheckpointEngine``;
  - DCP ``dcp.save`` with ``CacheWriter`` vs ``FileSystemWriter``, and ``dcp.async_save``'s
    stall with each;
  - megatron-core ``dist_checkpointing.save`` with ``CacheSaveShardedStrategy`` vs the same
    ``torch_dist`` translation written by DCP's ``FileSystemWriter`` (megatron-core's own
    ``torch_dist`` writer calls CUDA APIs; this is what it does on CPU);
  - Lightning ``trainer.save_checkpoint`` with the ``CkptCacheIO`` plugin vs Lightning's
    default ``TorchCheckpointIO``.

Every save names a new checkpoint (a new tag, a new directory), as training does. Between two
saves the run waits, untimed, until the daemon is idle again (digests computed, persists done,
spare pool refilled), the client's own spare thread has mapped the spares and the kernel has
written back the dirty pages of earlier saves (``os.sync()``), as it is minutes apart in
training: each figure is the steady-state stall, the best of ``--repeats`` saves after two
untimed ones. The memcpy limit is sampled right before every timed save, and each framework's
own work is measured with a writer that writes nothing. Each framework (each ZeRO stage) gets
a fresh daemon, as a job has its node's cache to itself. The daemon persists in the
background into the directory the baselines write to. One process, world size 1.

The daemon and the adapters run at their defaults (``--pool default``): the daemon's spare
pool as it sizes itself, no ``warmup()`` call. ``--pool sized`` is the configuration these
figures used before: four spares bounded by four checkpoints' bytes, mapped by ``warmup()``.

    python benchmarks/frameworks/bench.py --mib 256 --repeats 5
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

import ckptcache
import ckptcache.api
from ckptcache.adapters.dcp import CacheWriter
from ckptcache.cli.benchmarking import Row, memcpy_seconds, running_daemon

WIDTH = 1024
#: Untimed saves before the timed ones, per row.
WARMUP = 2


def model_of(state_mib: int) -> torch.nn.Module:
    """An MLP whose parameters plus two AdamW moments total about ``state_mib`` MiB (fp32)."""
    per_layer = 4 * (WIDTH * WIDTH + WIDTH)
    layers = max(1, state_mib * 2**20 // 3 // per_layer)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """The bytes a save of ``obj`` copies: every storage a tensor reachable in ``obj`` (dicts,
    lists, tuples) uses, once, whole, as a flat ``uint8`` tensor over it.

    Whole storages, not the tensors: a save copies each storage whole, as ``torch.save``
    does, and DeepSpeed's ZeRO 1/2 parameters are views of one flat buffer (counting the
    first view alone left 80 of 84 MiB of weights out of the limit)."""
    out: list[torch.Tensor] = []
    seen: set[int] = set()

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            storage = x.untyped_storage()
            key = storage.data_ptr()
            if key not in seen:
                seen.add(key)
                out.append(torch.empty(0, dtype=torch.uint8).set_(storage))
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(obj)
    return out


#: ``--pool``: "default" (the daemon's and the client's defaults) or "sized" (four spares of
#: the checkpoint's size, mapped by ``warmup()``: the configuration of the earlier figures).
POOL = {"mode": "default"}


def settle(client: ckptcache.Client) -> None:
    """Wait until the daemon is idle (no digest or persist pending, the spare pool full) and
    the client has mapped its spares: the state training finds its cache in minutes after a
    save. At the defaults the client maps them by itself after each save: only waited for
    (its spare thread's round), never asked for."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        busy = client.daemon_status().persist_queue > 0
        busy = busy or any(not o.digests_valid for o in client.list(""))
        pool = client.pool()
        if not busy and not pool.growing:
            break
        time.sleep(0.02)
    if POOL["mode"] == "sized":
        client.warmup(wait=True)
    else:
        # The spare thread's round after the last save: the wait a trainer's minutes between
        # saves give it (a private event: no public call waits without asking for a round).
        client._spares._done.wait(120)


def timed(
    sec: Section,
    repeats: int,
    fn: Callable[[int], Any],
    *,
    client: ckptcache.Client | None = None,
    after: Callable[[Any], None] | None = None,
) -> float:
    """Best time of ``repeats`` calls ``fn(i)`` after ``WARMUP`` untimed ones (first-use
    costs: a file's creation; the daemon's spare pool, whose first spares have a guessed
    size, learning this job's sizes). Untimed before each: the daemon settles (with
    ``client``: the cache's rows), dirty pages are written back and ``sec`` samples its
    memcpy limit; after each,
    ``after(result)`` (waiting for an upload)."""
    best = float("inf")
    for i in range(repeats + WARMUP):
        if client is not None:
            settle(client)
        # Minutes between saves let the kernel write back the dirty pages of the last ones
        # (the baselines' files, the daemon's persists); without this a save's own small
        # writes (DeepSpeed's `latest`) wait behind that writeback.
        os.sync()
        sec.sample()
        t0 = time.perf_counter()
        result = fn(i)
        if i >= WARMUP:
            best = min(best, time.perf_counter() - t0)
        if after is not None:
            after(result)
    return best


class Section:
    """The rows of one framework: its memcpy limit, its default path, the cache's path.

    The limit is sampled right before every timed save (:meth:`sample`), so that it sees the
    machine as the saves do (this VM's speed drifts with its neighbours' load), and it reads
    the state as the training step before a save would; the best sample is the limit.
    """

    def __init__(self, name: str, state: Any):
        self.name = name
        self._src = [t.detach() for t in tensors_in(state)]
        self._dst = [torch.empty_like(t) for t in self._src]
        self.nbytes = sum(t.nbytes for t in self._src)
        self._samples = [memcpy_seconds({str(i): t for i, t in enumerate(self._src)}, 3)]
        self.rows: list[tuple[Row, Row | None]] = []  # (measured, its default for the ratio)

    def sample(self) -> None:
        """Time one more memcpy of the state into the pre-faulted buffers."""
        t0 = time.perf_counter()
        for dst, src in zip(self._dst, self._src, strict=True):
            dst.copy_(src)
        self._samples.append(time.perf_counter() - t0)

    @property
    def memcpy(self) -> float:
        """The limit: the fastest memcpy of the state seen in this section."""
        return min(self._samples)

    def add(self, what: str, seconds: float, default: Row | None = None) -> Row:
        row = Row(what, self.nbytes, seconds)
        self.rows.append((row, default))
        return row

    def table(self) -> str:
        lines = [
            f"\n{self.name}: {self.nbytes / 2**20:.0f} MiB of state, "
            f"memcpy {self.memcpy:.4f} s ({self.nbytes / self.memcpy / 1e9:.2f} GB/s)\n",
            "| operation | time (s) | GB/s | vs memcpy | vs default |",
            "|---|---:|---:|---:|---:|",
        ]
        for row, default in self.rows:
            vs_default = f"{default.seconds / row.seconds:.2f}x" if default else "-"
            lines.append(
                f"| {row.what} | {row.seconds:.4f} | {row.gbps:.2f} | "
                f"{self.memcpy / row.seconds:.2f}x | {vs_default} |"
            )
        self._src, self._dst = [], []  # done: give the buffers back
        return "\n".join(lines)


def _cleanup(client: ckptcache.Client, root: str) -> None:
    """Drop what a section cached (storage keeps its files until the temp dir goes)."""
    client.wait(prefix=root, timeout=600)
    for info in client.list(os.path.join(root, "")):
        client.delete(info.path)


def bench_deepspeed(
    client: ckptcache.Client, mib: int, repeats: int, root: str, stage: int
) -> Section:
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # gloo is enough on CPU
    deepspeed.init_distributed(dist_backend="gloo")
    return _deepspeed_stage(client, stage, mib, repeats, root)


def _deepspeed_stage(
    client: ckptcache.Client, stage: int, mib: int, repeats: int, root: str
) -> Section:
    import deepspeed
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

    import ckptcache.adapters.deepspeed as ds_cache

    class NullEngine(CheckpointEngine):  # type: ignore[misc]
        """Writes nothing: what remains is DeepSpeed's own work around the files."""

        def create(self, info: Any) -> None:
            pass

        def save(self, state_dict: Any, path: str) -> None:
            pass

        def load(self, path: str, map_location: Any = None) -> Any:
            raise NotImplementedError

        def commit(self, info: Any) -> bool:
            return True

    model = model_of(mib)
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    engine.backward(engine(torch.randn(1, WIDTH)).sum())
    engine.step()  # optimizer state exists: the checkpoint is params + 2 Adam moments
    state = {"module": engine.module.state_dict(), "optim": engine.optimizer.state_dict()}
    sec = Section(f"DeepSpeed ZeRO {stage}", state)
    del state
    where = os.path.join(root, f"ds{stage}")

    def save(kind: str) -> Callable[[int], None]:
        return lambda i: engine.save_checkpoint(where, tag=f"{kind}{i}")

    default = sec.add(
        "save_checkpoint, default engine (torch.save)", timed(sec, repeats, save("d"))
    )
    stock_engine = engine.checkpoint_engine
    engine.checkpoint_engine = NullEngine(None)
    t_null = timed(sec, repeats, save("n"))
    sec.add("save_checkpoint, engine writes nothing (DeepSpeed's own work)", t_null)
    engine.checkpoint_engine = stock_engine
    ds_cache.enable(engine, client=client)
    t_cache = timed(sec, repeats, save("c"), client=client)
    sec.add("save_checkpoint, ckptcache engine", t_cache, default)
    _cleanup(client, where)
    return sec


def _trained_state(mib: int) -> dict[str, Any]:
    model = model_of(mib)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(1, WIDTH)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict()}


class NullWriter(CacheWriter):
    """A DCP writer that writes no item (``.metadata`` only): what remains is DCP's own work
    (planning, collectives, the metadata file)."""

    def _write_file(self, name: str, items: list[Any], planner: Any, saved: list[str]) -> Any:
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.storage import WriteResult

        for item in items:
            planner.resolve_data(item)
        return [WriteResult(item.index, 0, _StorageInfo(name, 0, 0)) for item in items]


class NullStager(NullWriter):
    """A DCP writer that stages nothing (hands DCP the live state dict) and writes no item:
    what remains of an ``async_save`` stall is DCP's own work (its executor, its thread)."""

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict


def bench_dcp(client: ckptcache.Client, mib: int, repeats: int, root: str) -> Section:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    state = _trained_state(mib)
    sec = Section("DCP", state)

    def path(kind: str, i: int) -> str:
        return os.path.join(root, "dcp", f"{kind}-{i}")

    fs = sec.add(
        "dcp.save, FileSystemWriter",
        timed(
            sec, repeats, lambda i: dcp.save(state, storage_writer=FileSystemWriter(path("fs", i)))
        ),
    )
    sec.add(
        "dcp.save, writer writes nothing (DCP's own work)",
        timed(sec, repeats, lambda i: dcp.save(state, storage_writer=NullWriter(path("n", i)))),
    )
    sec.add(
        "dcp.save, CacheWriter",
        timed(
            sec,
            repeats,
            lambda i: dcp.save(state, storage_writer=CacheWriter(path("c", i), client=client)),
            client=client,
        ),
        fs,
    )
    afs = sec.add(
        "dcp.async_save stall, FileSystemWriter (DCP staging)",
        timed(
            sec,
            repeats,
            lambda i: dcp.async_save(state, storage_writer=dcp.FileSystemWriter(path("afs", i))),
            # Settled too: the daemon persisting the rows above must not slow DCP's staging.
            client=client,
            after=lambda r: r.result(),
        ),
    )
    sec.add(
        "dcp.async_save stall, no staging, writes nothing (DCP's own work)",
        timed(
            sec,
            repeats,
            lambda i: dcp.async_save(state, storage_writer=NullStager(path("an", i))),
            client=client,
            after=lambda r: r.result(),
        ),
    )
    sec.add(
        "dcp.async_save stall, CacheWriter (cache memcpy)",
        timed(
            sec,
            repeats,
            lambda i: dcp.async_save(
                state, storage_writer=CacheWriter(path("ac", i), client=client)
            ),
            client=client,
            after=lambda r: r.result(),
        ),
        afs,
    )
    _cleanup(client, os.path.join(root, "dcp"))
    return sec


def _sharded(state: dict[str, torch.Tensor]) -> dict[str, Any]:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return {k: ShardedTensor.from_rank_offsets(k, v) for k, v in state.items()}


def bench_megatron(client: ckptcache.Client, mib: int, repeats: int, root: str) -> Section:
    import torch.distributed.checkpoint as dcp
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )

    from ckptcache.adapters.megatron import CacheSaveShardedStrategy

    trained = _trained_state(mib)
    flat = {f"model.{k}": v for k, v in trained["model"].items()}
    for pid, s in trained["optim"]["state"].items():
        flat.update({f"optim.{pid}.{k}": v for k, v in s.items() if v.dim() > 0})
    sec = Section("megatron-core dist_checkpointing", flat)

    class StockOnCpu(CacheSaveShardedStrategy):
        """The ``torch_dist`` translation, written by ``writer`` (DCP's ``FileSystemWriter``)."""

        def __init__(self, writer: type = dcp.FileSystemWriter):
            super().__init__()
            self.writer = writer

        def save(self, sharded_state_dict: Any, checkpoint_dir: Any) -> None:
            sd, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, True)
            dcp.save(
                mcore_to_pyt_state_dict(sd, False),
                storage_writer=self.writer(checkpoint_dir),
                planner=MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False),
            )

    def save(kind: str, strategy: Any) -> Callable[[int], None]:
        def run(i: int) -> None:
            where = os.path.join(root, "mcore", f"{kind}-{i}")
            os.makedirs(where)
            dist_checkpointing.save(_sharded(flat), where, sharded_strategy=strategy)

        return run

    default = sec.add(
        "dist_checkpointing.save, torch_dist via FileSystemWriter",
        timed(sec, repeats, save("fs", StockOnCpu())),
    )
    sec.add(
        "dist_checkpointing.save, writer writes nothing (megatron-core + DCP's own work)",
        timed(sec, repeats, save("n", StockOnCpu(NullWriter))),
    )
    sec.add(
        "dist_checkpointing.save, CacheSaveShardedStrategy",
        timed(
            sec,
            repeats,
            save("c", CacheSaveShardedStrategy(client=client)),
            client=client,
        ),
        default,
    )
    _cleanup(client, os.path.join(root, "mcore"))
    return sec


def bench_lightning(client: ckptcache.Client, mib: int, repeats: int, root: str) -> Section:
    import lightning as L

    from ckptcache.adapters.lightning import CkptCacheIO

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model_of(mib)

        def training_step(self, batch: Any, _idx: int) -> torch.Tensor:
            return self.net(batch[0]).sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters())

    data = torch.utils.data.TensorDataset(torch.randn(1, WIDTH))
    trainer = L.Trainer(
        max_steps=1, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
    module = Module()
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=1))
    sec = Section("Lightning", trainer._checkpoint_connector.dump_checkpoint())
    where = os.path.join(root, "lightning")
    default = sec.add(
        "trainer.save_checkpoint, TorchCheckpointIO",
        timed(sec, repeats, lambda i: trainer.save_checkpoint(os.path.join(where, f"d{i}.ckpt"))),
    )
    stock_io = trainer.strategy.checkpoint_io

    class NullIO(type(stock_io)):  # type: ignore[misc]
        def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
            pass

    trainer.strategy.checkpoint_io = NullIO()
    sec.add(
        "trainer.save_checkpoint, plugin writes nothing (Lightning's own work)",
        timed(sec, repeats, lambda i: trainer.save_checkpoint(os.path.join(where, f"n{i}.ckpt"))),
    )
    trainer.strategy.checkpoint_io = CkptCacheIO(client=client)
    sec.add(
        "trainer.save_checkpoint, CkptCacheIO",
        timed(
            sec,
            repeats,
            lambda i: trainer.save_checkpoint(os.path.join(where, f"c{i}.ckpt")),
            client=client,
        ),
        default,
    )
    _cleanup(client, where)
    return sec


BENCHES: dict[str, list[Callable[[ckptcache.Client, int, int, str], Section]]] = {
    "deepspeed": [functools.partial(bench_deepspeed, stage=stage) for stage in (0, 1, 2, 3)],
    "dcp": [bench_dcp],
    "megatron": [bench_megatron],
    "lightning": [bench_lightning],
}


@contextlib.contextmanager
def node(root: str, mib: int) -> Iterator[ckptcache.Client]:
    """A fresh daemon for one framework, as one job has a node's cache to itself: its spare
    pool learns that job's checkpoint sizes only. ``--pool sized``: four spares, room for
    four checkpoints, mapped by ``warmup()`` before the first save."""
    args: tuple[str, ...] = ("--persist-root", root, "--memory-limit", "6GiB")
    if POOL["mode"] == "sized":
        args += ("--pool-segments", "4", "--pool-bytes", str(4 * mib << 20))
    with running_daemon(*args) as d:
        os.environ["CKPTCACHE_SOCKET"] = d.socket
        ckptcache.api.set_default_client(None)
        with ckptcache.Client(d.socket, fallback="raise") as client:
            if POOL["mode"] == "sized":
                client.warmup(wait=True)
            yield client


def _sections(args: argparse.Namespace, root: str) -> Iterator[Section]:
    for name in args.only or list(BENCHES):
        for bench in BENCHES[name]:
            with node(root, args.mib) as client:
                yield bench(client, args.mib, args.repeats, root)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="MiB of state per checkpoint")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", nargs="*", choices=list(BENCHES), help="some frameworks only")
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    parser.add_argument(
        "--pool",
        choices=("default", "sized"),
        default="default",
        help="the daemon's spare pool and the client's mapping at their defaults, or four "
        "spares of the checkpoint's size mapped by warmup() (the earlier figures)",
    )
    args = parser.parse_args()
    POOL["mode"] = args.pool
    root = args.dir or tempfile.mkdtemp(prefix="ckptcache-bench-fw-")
    os.makedirs(root, exist_ok=True)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29533"))
    # The stall at memory speed, as these figures always were: the adapters' default
    # ("files") adds the wait for the files, which the persist figures of benchmarks/persist
    # measure. Set CKPTCACHE_COMMIT_WAITS=files to time the defaults instead.
    os.environ.setdefault("CKPTCACHE_COMMIT_WAITS", "local")
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo")
    try:
        for section in _sections(args, root):
            print(section.table(), flush=True)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
