"""One adapter per checkpointing system, each driven through its own documented calls.

Every adapter answers the same four questions about one state:

* ``save(state, step)``: a repeated save as the training loop meets it; returns when the loop
  may go on (and may change its tensors).
* ``settle()``: waits (untimed) until the previous save's background work is done: training
  saves minutes apart, so that work must not be charged to the next save.
* ``durable(state, step)``: a save asked to reach the disk; returns when the system reports the
  bytes there (whether that report means fsync is in ``GUARANTEES``). Where a save and a save
  to disk are one call (``separate_durable`` false), the benchmark times one save from its
  call to the end of ``settle`` instead.
* ``load()``: what a trainer recovering the last save gets: usable tensors.

A system that cannot run here raises from ``open``; the benchmark lists it with its error.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch

#: name -> (label for the tables, what the system guarantees; the README repeats these).
GUARANTEES: dict[str, tuple[str, str]] = {
    "ckptcache": (
        "ckptcache",
        "daemon outside the trainer; shm copy survives the trainer; xxh3 digests; persist "
        "verified, CRC-32, fsync; two generations kept",
    ),
    "ckptcache_1.2x": (
        "ckptcache, budget 1.2x the state",
        "as ckptcache, with a memory budget of 1.2x the state: one generation in memory, the "
        "previous one's memory given to the next save once it is on storage",
    ),
    "gemini": (
        "lm-resiliency 0.2.0 (open Gemini)",
        "buffers in the trainer's own memory (lost with the process); disk flush = torch.save "
        "+ fsync; CRC-32 only with verify_integrity (off by default)",
    ),
    "dlrover": (
        "DLRover flash checkpoint 0.6.1",
        "shm held by a saver process; disk = torch.save, no fsync of the checkpoint "
        "(only of its tracker file); no digests",
    ),
    "nvrx_async": (
        "NVRx 0.7.0 async (CPU stand-in)",
        "forked writer does torch.save, no fsync; no digests",
    ),
    "nvrx_local": (
        "NVRx 0.7.0 local checkpointing (CPU stand-in)",
        "forked writer does torch.save + rename, no fsync; no digests",
    ),
    "mlflashpoint": ("ML Flashpoint 0.0.10", ""),
    "dcp": (
        "DCP `async_save`",
        "staged copy, writer thread; fsync (sync_files=True); no digests",
    ),
    "torch_save": ("`torch.save` (+ fsync)", "blocking; fsync; CRC-32 of each record"),
}


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _init_gloo() -> None:
    """A one-rank gloo group: NVRx asks for ranks, DCP for a group."""
    import torch.distributed as dist

    if not dist.is_initialized():
        from ckptcache.cli.benchmarking import free_port

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)


class System:
    """Base: subclasses open in ``workdir`` (on the disk under test) and keep what they need."""

    #: True where a save to disk is another call than a (memory) save.
    separate_durable = False

    def __init__(self, workdir: str, nbytes: int):
        self.workdir = workdir
        self.nbytes = nbytes

    def save(self, state: Any, step: int) -> None:
        raise NotImplementedError

    def settle(self) -> None:
        """Nothing runs in the background after ``save`` unless a subclass says so."""

    def durable(self, state: Any, step: int) -> None:
        """Only where ``separate_durable``."""
        raise NotImplementedError

    def held(self) -> int | None:
        """Bytes of memory the system holds for its checkpoints once its saves are settled
        (None: not measured for this system)."""
        return None

    def load(self) -> Any:
        raise NotImplementedError

    def close(self) -> None:
        """Release what ``open`` made."""


class Ckptcache(System):
    """A real daemon (default keep=2 generations, spare pool) with a persist root on disk;
    the client warms up at start as a trainer does. Saves are blocking; load is the default
    zero-copy load."""

    def budget(self, nbytes: int) -> int:
        """The daemon's memory budget for a state of ``nbytes``: room for every generation
        it keeps and its spares."""
        return 4 * nbytes + (256 << 20)

    def __init__(self, workdir: str, nbytes: int):
        super().__init__(workdir, nbytes)
        import contextlib

        from ckptcache.cli.benchmarking import running_daemon
        from ckptcache.client import Client

        self._stack = contextlib.ExitStack()
        budget = str(self.budget(nbytes))
        daemon = self._stack.enter_context(
            running_daemon("--persist-root", workdir, "--memory-limit", budget)
        )
        self.client = self._stack.enter_context(Client(daemon.socket, fallback="raise"))
        self.client.warmup(wait=True)
        self.path = os.path.join(workdir, "model.pt")

    def save(self, state: Any, step: int) -> None:
        self.client.save(state, self.path)

    def settle(self) -> None:
        self.client.wait(self.path, timeout=600)

    def load(self) -> Any:
        return self.client.load(self.path)

    def held(self) -> int | None:
        """Bytes of the daemon's segment files (generations, spares, free segments)."""
        return self.client.daemon_status().memory_used

    def close(self) -> None:
        self._stack.close()


class CkptcacheTight(Ckptcache):
    """The same daemon with a budget of 1.2x the state (``docs/tuning.md``, "Sizing the
    memory budget"): the memory a DLRover-like single generation holds."""

    def budget(self, nbytes: int) -> int:
        return int(1.2 * nbytes)


class _NaturalReplicas:
    """Gemini's documented switch for a group that needs no peer replica (HSDP): two slots
    instead of four. A one-process benchmark has no peer to replicate to."""

    has_natural_replicas = True


class Gemini(System):
    """``InMemoryCheckpointManager``: save() copies into its CPU buffers (on CPU tensors the
    copy runs on the caller's thread); the disk tier is ``flush_to_disk`` + the serializer's
    wait (the flush's own join; the manager has no public wait). Load is its memory tier."""

    def __init__(self, workdir: str, nbytes: int):
        super().__init__(workdir, nbytes)
        from lm_resiliency.checkpointing import InMemoryCheckpointManager, InMemoryCkptConfig

        config = InMemoryCkptConfig(
            interval=1,
            disk_flush_interval=0,  # flushed on demand below
            disk_folder=workdir,
            run_id="bench",
            pin_memory=False,  # no CUDA here
        )
        self.mgr = InMemoryCheckpointManager(config, parallelism_info=_NaturalReplicas())

    separate_durable = True

    def save(self, state: Any, step: int) -> None:
        self.mgr.save(state, step)
        self.mgr.maybe_wait()

    def durable(self, state: Any, step: int) -> None:
        self.save(state, step)
        self.mgr.flush_to_disk(step)
        self.mgr._disk.wait()

    def load(self) -> Any:
        loaded = self.mgr.load()
        if loaded is None:
            raise RuntimeError("Gemini found no checkpoint to load")
        return loaded[0]

    def close(self) -> None:
        self.mgr.close()


class DLRover(System):
    """``DdpCheckpointer``: ``StorageType.MEMORY`` copies into shared memory that its saver
    (started by the trainer itself when not launched by dlrover-run) holds; ``StorageType.DISK``
    has the saver write it, and the tracker file naming the step is its report (polled every
    5 ms here; its own ``wait_latest_checkpoint`` polls every 3 s)."""

    def __init__(self, workdir: str, nbytes: int):
        super().__init__(workdir, nbytes)
        from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType

        # Its IPC sockets go under /tmp/ckpt_sock/<run id>: one of its own per process, so
        # sockets left by an earlier process's saver are never dialled.
        os.environ["TORCHELASTIC_RUN_ID"] = f"peers-bench-{os.getpid()}"
        self.storage = StorageType
        self.ckpt = DdpCheckpointer(workdir)
        self.tracker = os.path.join(workdir, "dlrover_latest.txt")

    def save(self, state: Any, step: int) -> None:
        self.ckpt.save_checkpoint(step, state, storage_type=self.storage.MEMORY)

    def durable(self, state: Any, step: int) -> None:
        path = os.path.join(self.workdir, f"{step}.pt")
        self.ckpt.save_checkpoint(step, state, path, storage_type=self.storage.DISK)
        deadline = time.monotonic() + 600
        while not self._tracked(step):
            if time.monotonic() > deadline:
                raise TimeoutError(f"DLRover did not report step {step} on disk")
            time.sleep(0.005)

    def _tracked(self, step: int) -> bool:
        try:
            with open(self.tracker) as f:
                return f.read().strip() == str(step)
        except FileNotFoundError:
            return False

    def load(self) -> Any:
        return self.ckpt.load_checkpoint()

    separate_durable = True

    def close(self) -> None:
        import contextlib
        import shutil

        engine = self.ckpt._engine
        if hasattr(engine, "close"):
            engine.close()
        # Its shared memory outlives the trainer by design (for the agent); the benchmark
        # ends the saver, so it removes the segment too.
        with contextlib.suppress(Exception):
            engine._shm_handler.unlink()
        shutil.rmtree(f"/tmp/ckpt_sock/{os.environ['TORCHELASTIC_RUN_ID']}", ignore_errors=True)


def _nvrx_on_cpu() -> None:
    """The CPU stand-in for NVRx: its documented calls end the GPU->host copy with
    ``torch.cuda.synchronize()``, which asserts on a CPU build; with CPU tensors there is no
    device work to wait for, so it becomes a no-op. Nothing else of NVRx is changed."""
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    _init_gloo()


class NVRxAsync(System):
    """``TorchAsyncCheckpoint(persistent_queue=False)``: ``async_save`` forks a process that
    runs ``torch.save`` (the persistent worker picks a CUDA device and cannot start here);
    ``finalize_async_save(blocking=True)`` is its durable report. Load is ``torch.load``."""

    def __init__(self, workdir: str, nbytes: int):
        super().__init__(workdir, nbytes)
        _nvrx_on_cpu()
        from nvidia_resiliency_ext.checkpointing.async_ckpt.torch_ckpt import (
            TorchAsyncCheckpoint,
        )

        self.ckpt = TorchAsyncCheckpoint(persistent_queue=False)
        self.path = ""

    def save(self, state: Any, step: int) -> None:
        self.path = os.path.join(self.workdir, f"{step}.pt")
        self.ckpt.async_save(state, self.path)

    def settle(self) -> None:
        self.ckpt.finalize_async_save(blocking=True, no_dist=True)

    def load(self) -> Any:
        return torch.load(self.path)

    def close(self) -> None:
        self.ckpt.close()


class NVRxLocal(System):
    """``LocalCheckpointManager.save(..., is_async=True)`` scheduled on an ``AsyncCallsQueue``
    (forked writer); durable = the queue's blocking finalize (which also validates the saved
    iteration); load = ``find_latest`` + ``load``. Its ``BasicTensorAwareStateDict`` asserts
    CUDA tensors: the stand-in subclass drops that assert and nothing else."""

    def __init__(self, workdir: str, nbytes: int):
        super().__init__(workdir, nbytes)
        _nvrx_on_cpu()
        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue
        from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import (
            LocalCheckpointManager,
        )

        self.queue = AsyncCallsQueue(persistent=False)
        self.mgr = LocalCheckpointManager(workdir, session_id="bench")

    def save(self, state: Any, step: int) -> None:
        from nvrx_cpu import CpuTensorAwareStateDict

        request = self.mgr.save(CpuTensorAwareStateDict(state), step, is_async=True)
        self.queue.schedule_async_request(request)

    def settle(self) -> None:
        self.queue.maybe_finalize_async_calls(blocking=True, no_dist=True)

    def load(self) -> Any:
        self.mgr.find_latest()
        loaded, _ = self.mgr.load()
        return loaded.state_dict

    def close(self) -> None:
        self.queue.close()


class MLFlashpoint(System):
    """Listed with its error when it does not install (its build fetches C++ sources)."""

    def __init__(self, workdir: str, nbytes: int):
        super().__init__(workdir, nbytes)
        try:
            import ml_flashpoint  # noqa: F401
        except ImportError as e:
            raise ImportError(f"not installed: {_install_error('ml-flashpoint')}") from e
        raise NotImplementedError("ML Flashpoint installed, but no adapter is written yet")


def _install_error(name: str) -> str:
    """The most telling error line of ``setup.sh``'s log for ``name``."""
    try:
        with open(os.path.join(sys.prefix, f"install-{name}.log")) as f:
            lines = [line.strip() for line in f]
    except OSError:
        return "setup.sh did not run"
    for prefix in ("fatal:", "ERROR:", "error:"):  # git's reason before pip's summary
        found = [line for line in lines if line.startswith(prefix)]
        if found:
            return found[0]
    return "see its install log"


class DCPAsync(System):
    """``torch.distributed.checkpoint.async_save`` (default stager and thread writer); the
    future's result is its durable report; load is ``dcp.load`` into tensors of the right
    shapes allocated before the timer starts (a restarted trainer's model)."""

    def __init__(self, workdir: str, nbytes: int):
        super().__init__(workdir, nbytes)
        _init_gloo()
        import torch.distributed.checkpoint as dcp

        self.dcp = dcp
        self.future: Any = None
        self.target = ""
        self.template: Any = None

    def save(self, state: Any, step: int) -> None:
        self.target = os.path.join(self.workdir, f"step{step}")
        self.future = self.dcp.async_save(state, checkpoint_id=self.target)
        if self.template is None:
            self.template = _empty_like(state)

    def settle(self) -> None:
        if self.future is not None:
            self.future.result()
            self.future = None

    def load(self) -> Any:
        target = self.template
        self.dcp.load(target, checkpoint_id=self.target)
        return target


def _empty_like(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _empty_like(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_empty_like(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return torch.empty_like(obj)
    return obj


class TorchSave(System):
    """``torch.save`` to a file on the training thread, then fsync: blocking, so its stall is
    its time to durable. Load is ``torch.load`` (weights_only, the default)."""

    def __init__(self, workdir: str, nbytes: int):
        super().__init__(workdir, nbytes)
        self.path = os.path.join(workdir, "model.pt")

    def save(self, state: Any, step: int) -> None:
        torch.save(state, self.path)
        _fsync(self.path)

    def load(self) -> Any:
        return torch.load(self.path)


SYSTEMS: dict[str, type[System]] = {
    "ckptcache": Ckptcache,
    "ckptcache_1.2x": CkptcacheTight,
    "gemini": Gemini,
    "dlrover": DLRover,
    "nvrx_async": NVRxAsync,
    "nvrx_local": NVRxLocal,
    "mlflashpoint": MLFlashpoint,
    "dcp": DCPAsync,
    "torch_save": TorchSave,
}

if __name__ == "__main__":  # pragma: no cover - a listing for setup checks
    print("\n".join(f"{k}: {v[0]}" for k, v in GUARANTEES.items()), file=sys.stdout)
