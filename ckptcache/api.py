"""Module-level drop-ins for ``torch.save``/``torch.load`` (and ``open``) on a per-process
default client."""

from __future__ import annotations

import os
import threading
from typing import IO, TYPE_CHECKING, Any

from ckptcache.client import CacheStatus, Client, cache_status, normalize_path, open_checkpoint
from ckptcache.wire.messages import ObjectInfo

if TYPE_CHECKING:
    from ckptcache.client import SaveHandle
    from ckptcache.codec.flatten import MapLocation

__all__ = [
    "default_client",
    "delete",
    "exists",
    "load",
    "prefetch",
    "save",
    "set_default_client",
    "status",
    "wait",
    "warmup",
]
# ``open`` is public but left out of ``__all__``: ``from ckptcache.api import *`` must not
# shadow the built-in ``open``.

_lock = threading.Lock()
_default: Client | None = None
#: The process ``_default`` belongs to: a forked child makes its own.
_default_pid = 0


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # a thread of the parent may have held it at the fork


os.register_at_fork(after_in_child=_after_fork_in_child)


def default_client() -> Client:
    """The process's default :class:`Client` (created on first use, recreated with the same
    settings in a forked child)."""
    global _default, _default_pid
    with _lock:
        if _default is None:
            _default = Client()
        elif _default_pid != os.getpid():
            # The parent's client is left alone: closing it here could disturb the parent.
            _default = _default.renew()
        _default_pid = os.getpid()
        return _default


def set_default_client(client: Client | None) -> None:
    """Replace the default client (``None``: a fresh one from the environment on next use)."""
    global _default, _default_pid
    with _lock:
        old, _default, _default_pid = _default, client, os.getpid()
    if old is not None and old is not client:
        old.close()


def save(
    obj: Any,
    path: str | os.PathLike[str],
    *,
    durability: str = "local",
    blocking: bool = True,
) -> SaveHandle | None:
    """Drop-in for ``torch.save(obj, path)``: returns once the bytes are in node memory.

    ``blocking=False`` returns a :class:`~ckptcache.SaveHandle` at once and copies the
    tensors in a background thread while training goes on. Do not modify them in place until
    ``handle.wait()`` returns (or inside ``StepGuard.optimizer_step()``, which waits for the
    copies): a modification seen through a tensor's version counter aborts the save with
    :class:`~ckptcache.errors.TensorMutated` and keeps the previous generation.

    Same object model as ``torch.save``. ``durability="local"`` returns after phase 1 on this
    node; ``durability="persisted"`` also waits for phase 2 (see :func:`wait`). Without a
    reachable daemon (or with a full budget) the object is written to ``path`` with
    ``torch.save`` and a :class:`~ckptcache.errors.CkptCacheWarning` is issued once.
    """
    return default_client().save(obj, path, durability=durability, blocking=blocking)


def warmup() -> None:
    """Connect the default client and map the daemon's spare segments in the background, so
    the first save of this process runs like a repeated one (call it at trainer start)."""
    default_client().warmup()


def load(
    path: str | os.PathLike[str],
    map_location: MapLocation = None,
    *,
    weights_only: bool = True,
    mmap: bool | None = None,
    verify: bool | None = None,
) -> Any:
    """Drop-in for ``torch.load(path, map_location, weights_only=..., mmap=...)``.

    From the cache, CPU tensors are zero-copy copy-on-write views of the daemon's segment
    (``mmap=None`` or ``True``): writing to them never changes the cached copy. ``mmap=False``
    returns private copies instead, in memory of this process that holds nothing of the
    daemon's (no pin); from the cache they share one allocation, freed once none of them is
    referenced, and their storages cannot be resized, as with a zero-copy load. Paths the
    cache does not hold are read from the file.

    Bytes that cross a tier are verified by default (``verify=None``): a stored file read
    here is checked record by record (digest record or zip CRC-32, and the zip structure)
    while it is read into memory, and copies the daemon brings in from a peer or from storage
    are checked as they land; damage raises :class:`~ckptcache.errors.CorruptCheckpoint`
    naming the tier and the tensor. This node's own memory is trusted unless
    ``verify=True``, which also checks every digest of the cached copy (and falls back to the
    file at ``path`` when it holds the same save or a newer one). ``verify=False`` checks no
    digest of a stored file (its structure still is): for trusted storage, or a lazy
    ``mmap=True`` load that should not read the whole file up front.
    """
    return default_client().load(
        path, map_location, weights_only=weights_only, mmap=mmap, verify=verify
    )


def load_into(
    path: str | os.PathLike[str],
    into: Any,
    *,
    weights_only: bool = True,
    verify: bool | None = None,
) -> Any:
    """Load ``path`` into tensors the caller already has, such as ``model.state_dict()`` and
    ``optimizer.state_dict()``: one copy from the cache's memory (or the file) into memory
    the process already holds, where ``load(mmap=False)`` makes fresh memory for every tensor.

    Every tensor in ``into`` (nested dicts, lists and tuples) is filled from the checkpoint's
    tensor at the same key path, on its own device. All are checked before the first is
    written: a tensor the checkpoint lacks, or holds with another shape or dtype, raises
    :class:`~ckptcache.errors.StateMismatch` naming it, and nothing is written. Returns the
    loaded object with those tensors replaced by ``into``'s; its other values are as
    :func:`load` returns them (tensors ``into`` does not name are zero-copy views).
    ``weights_only`` and ``verify`` are :func:`load`'s. ``into`` with no tensor at all (a
    module rather than its ``state_dict()``) raises :class:`TypeError` before anything is
    read.
    """
    return default_client().load_into(path, into, weights_only=weights_only, verify=verify)


def wait(
    path: str | os.PathLike[str] | None = None,
    *,
    prefix: str | os.PathLike[str] | None = None,
    timeout: float | None = None,
) -> None:
    """Block until ``path`` is persisted to storage; raise the persist error if it failed.

    With ``prefix``, wait for every cached object under that directory or URL prefix; with
    neither, for everything this process saved. Raises
    :class:`~ckptcache.errors.PersistError` once the daemon's retries ran out,
    :class:`~ckptcache.errors.PersistTimeout` after ``timeout`` seconds, and
    :class:`~ckptcache.errors.PathNotAllowed` for a path under no persist root.
    """
    default_client().wait(path, prefix=prefix, timeout=timeout)


def prefetch(paths: Any) -> list[str]:
    """Warm the local cache with ``paths`` before the trainer needs them (from a peer's memory
    or storage, one storage read per group; a daemon without a cluster reads storage itself),
    verified as the bytes land; returns the tier each came from."""
    return default_client().prefetch(paths)


def exists(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` can be loaded (from the cache or from storage)."""
    return default_client().exists(path)


def status(path: str | os.PathLike[str] | None = None) -> ObjectInfo | CacheStatus:
    """Generation, size and stages reached (``local``, ``persisted``, ``storage``) of ``path``.

    Without ``path``: whether the cache is on for this process (:class:`CacheStatus`: daemon
    reachable, socket, fallback policy, saves written through so far, daemon counters).
    """
    if path is None:
        return cache_status(default_client())
    return default_client().status(path)


def delete(path: str | os.PathLike[str]) -> int:
    """Drop every cached generation of ``path`` from memory; storage is untouched."""
    return default_client().delete(path)


def open(  # the name reads like builtins.open; this module never calls that one
    path: str | os.PathLike[str],
    mode: str = "rb",
    *,
    client: Client | None = None,
    verify: bool = True,
) -> IO[bytes]:
    """Open the newest generation of ``path`` for reading, from memory when it is not yet a
    file (see :mod:`ckptcache.client._readthrough`): ``torch.load(ckptcache.open(path))``.
    Only ``mode="rb"`` is supported: the cache stores binary checkpoints and writes go
    through :func:`save`. A stored file is checked as it is read unless ``verify=False``
    (this node's memory is served as it is)."""
    if mode not in ("rb", "br"):
        raise ValueError(f"ckptcache.open reads binary files only: mode must be 'rb', not {mode!r}")
    return open_checkpoint(client or default_client(), normalize_path(path), verify)
