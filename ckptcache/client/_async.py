"""Non-blocking saves: ``save(obj, path, blocking=False)`` returns a :class:`SaveHandle` at
once and copies the tensors into the daemon's segment in a background thread.

The contract: tensors of a pending save must not be modified in place until the handle's copy
is done (``handle.wait()``, or :meth:`StepGuard.optimizer_step` which waits for every pending
copy of the process). A violation is detected where it is cheap to: each tensor's autograd
version counter (``tensor._version``, bumped by every in-place op) is recorded at submit and
checked after the copy, before the commit; a changed counter aborts the save with
:class:`~ckptcache.errors.TensorMutated` (the previous generation stays the newest) instead of
committing torn bytes.

A storage that no counter watches is copied before ``save()`` returns instead (a snapshot, on
its device): one of an inference-mode tensor (such tensors have no counter), or one pickled as a
bare storage with no tensor of it in the object. The background copy reads the snapshot, so a
later write cannot tear it; the cost is a copy of those storages alone. In-place writes that
bypass the counter of a counted tensor (through ``tensor.data``, numpy views, DLPack, another
process's mapping) are not seen: telling such memory apart would take a digest of every tensor,
and ``Storage.resizable()`` (false for ``from_numpy``) is just as false for every tensor
``torch.load`` returns, optimizer states resumed from a checkpoint included.

A handle is held by this module until its save is done, whether or not the caller keeps it:
``ckptcache.save(sd, p, blocking=False)`` without keeping the result still blocks
:func:`wait_for_copies`, and a failure of a save whose handle nobody waited on is logged as
an error once the handle is dropped (as asyncio does for a task's unretrieved exception).
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from typing import TYPE_CHECKING, Any

import torch

from ckptcache._signals import signals_deferred
from ckptcache.client._settings import check_timeout
from ckptcache.errors import PersistTimeout, TensorMutated

if TYPE_CHECKING:
    from ckptcache.codec.flatten import Flattened

__all__ = ["SaveHandle", "VersionCheck", "pending_saves", "wait_for_copies"]

log = logging.getLogger(__name__)

#: Every save not done yet, held strongly: a dropped handle must not let its save go unseen.
_pending: set[SaveHandle] = set()
_pending_lock = threading.Lock()


def _after_fork_in_child() -> None:
    """The parent's save threads do not exist in a forked child: its handles never finish
    there, and the lock may have been held by one of them at the fork."""
    global _pending_lock
    _pending_lock = threading.Lock()
    _pending.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _version(tensor: torch.Tensor) -> int | None:
    try:
        return int(tensor._version)
    except RuntimeError:  # an inference-mode tensor has no version counter to check
        return None


_cdata = operator.attrgetter("_cdata")
_counter = operator.attrgetter("_version")


def _storage_id(tensor: torch.Tensor) -> int | None:
    """The ``_cdata`` of ``tensor``'s storage, the key ``flatten`` keeps storages by; ``None``
    for a tensor without one (sparse, nested: their parts are pickled as tensors of their own)."""
    try:
        return int(tensor.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError):
        return None


def _unwatched(
    flat: Flattened, versions: Sequence[int | None], storage_ids: Sequence[int | None]
) -> set[int]:
    """The ``_cdata`` of each storage of ``flat`` whose changes no version counter shows: one
    that an uncounted (inference-mode) tensor uses, or that no pickled tensor uses at all."""
    stored = set(map(_cdata, flat.storages))
    if None not in versions:  # every tensor counted (the usual case): sets built in C
        return stored - set(storage_ids)
    rows = list(zip(versions, storage_ids, strict=True))
    counted = {sid for version, sid in rows if version is not None}
    uncounted = {sid for version, sid in rows if version is None}
    return (stored - counted) | (stored & uncounted)


def _snapshot(storage: torch.UntypedStorage) -> torch.UntypedStorage:
    """A private copy of ``storage``. On a CUDA device it is queued on the current stream (after
    the trainer's pending writes, before the event the background copy waits for); if the device
    has no room for it, a host copy serves as well (the record keeps its location)."""
    if storage.nbytes() == 0 or storage.device.type == "meta":
        return storage  # no bytes to change
    try:
        return storage.clone()
    except torch.OutOfMemoryError:
        if storage.device.type == "cpu":
            raise
        return storage.cpu()


def _keep_location(storage: torch.UntypedStorage, location: str) -> torch.UntypedStorage:
    """``map_location`` that leaves each storage where it is (a snapshot, or the live one)."""
    return storage


class VersionCheck:
    """The version counters of a save's tensors at submit; :meth:`check` raises if any moved,
    or if a storage no longer has the size it was planned with.

    The tensors are the ones the flattener pickled (:attr:`Flattened.tensors`): a walk of
    ``obj`` would miss those inside Namespaces, dataclasses and other objects. Sizes are
    checked too because ``untyped_storage().resize_`` leaves the counter alone.

    The storages that no counter watches are copied here, on the submitting thread:
    :attr:`flat` is the save's :class:`Flattened` with those copies in their places, which
    the background copy must read instead of the caller's (see the module docstring)."""

    def __init__(self, obj: Any, path: str, flat: Flattened):
        self.path = path
        self._obj = obj  # for naming a modified tensor, only once one is found
        tensors = list(flat.tensors)
        versions: list[int | None]
        ids: list[int | None]
        if flat.versions:  # recorded by the plan cache's walk
            versions, ids = list(flat.versions), list(flat.storage_ids)
        else:
            versions = [_version(t) for t in tensors]
            ids = [_storage_id(t) for t in tensors]
        # The walk's storages are its tensors' own: with every tensor counted, each storage
        # is watched (a flatten's may hold storages no pickled tensor uses: looked at).
        counted = bool(flat.versions) and None not in versions
        unwatched = set() if counted else _unwatched(flat, versions, ids)
        #: ``flat`` with a private copy of each storage no counter watches.
        self.flat = flat
        if unwatched:
            storages = tuple(_snapshot(s) if s._cdata in unwatched else s for s in flat.storages)
            self.flat = dataclasses.replace(flat, storages=storages)
        if unwatched or None in versions:
            # A counted tensor on a copied storage may change freely: the copy is what is saved.
            rows = zip(tensors, versions, ids, strict=True)
            kept = [(t, v) for t, v, sid in rows if v is not None and sid not in unwatched]
            tensors, versions = [t for t, _ in kept], [v for _, v in kept]
        self._tensors: list[torch.Tensor] = tensors
        self._versions: list[int | None] = versions
        self._copied = bool(unwatched)

    def check(self) -> None:
        """Raise :class:`TensorMutated` naming the first tensor modified since submit."""
        from ckptcache.codec.shm import checked_nbytes

        # All counters and sizes read at once (``map`` over C getters); only a difference is
        # looked at tensor by tensor, to name it.
        if list(map(_counter, self._tensors)) != self._versions:
            for i, (tensor, version) in enumerate(zip(self._tensors, self._versions, strict=True)):
                if tensor._version != version:
                    raise TensorMutated(
                        f"tensor {self._name(tensor, i)!r} of {self.path!r} was modified in "
                        "place while a non-blocking save was copying it; the save was aborted "
                        "and the previous generation kept. Call handle.wait() (or run "
                        "optimizer steps inside StepGuard.optimizer_step()) before modifying "
                        "saved tensors"
                    )
        infos, storages = self.flat.infos, self.flat.storages
        if list(map(torch.UntypedStorage.nbytes, storages)) != [i.nbytes for i in infos]:
            for info, storage in zip(infos, storages, strict=True):
                checked_nbytes(storage, info.nbytes, info.name)

    def source(self, obj: Any) -> Any:
        """The object a write-through of this save must ``torch.save`` in place of ``obj``:
        ``obj`` itself when nothing was copied at submit, else ``obj`` rebuilt from its
        skeleton over :attr:`flat`'s storages (the live ones no counter watches may have
        changed since; the others are still checked by :meth:`check` after the write)."""
        if not self._copied:
            return obj
        from ckptcache.codec.decode import decode_skeleton

        storages = self.flat.storages
        return decode_skeleton(
            self.flat.skeleton,
            lambda key, _nbytes: storages[int(key)],
            weights_only=False,  # the skeleton was pickled here, from the caller's own object
            map_location=_keep_location,
        )

    def _name(self, tensor: torch.Tensor, index: int) -> str:
        """The state-dict path of ``tensor`` where a container walk finds it, else a label."""
        from ckptcache.codec.flatten import tensor_names

        try:
            name = tensor_names(self._obj).get(tensor.untyped_storage()._cdata)
        except (RuntimeError, NotImplementedError):
            name = None
        return name or f"<tensor {index} of shape {tuple(tensor.shape)}>"


class _Seen:
    """Whether a handle's outcome reached its caller (shared with the handle's finalizer)."""

    def __init__(self) -> None:
        self.seen = False


def _forget(ref: weakref.ref[SaveHandle]) -> None:
    """Done callback: stop holding the handle (weakly referenced: no cycle through the
    future, so a dropped handle is freed, and its finalizer runs, right here)."""
    handle = ref()
    if handle is not None:
        with _pending_lock:
            _pending.discard(handle)


def _report_unseen(path: str, future: Future[None], seen: _Seen) -> None:
    """Finalizer: log the error of a failed save whose handle was dropped without a wait."""
    if seen.seen or not future.done() or future.cancelled():
        return
    error = future.exception()
    if error is not None:
        log.error(
            "non-blocking save of %r failed and its handle was never waited on: %s: %s",
            path, type(error).__name__, error, exc_info=error,
        )  # fmt: skip


class SaveHandle:
    """A save in flight: :meth:`wait` returns once its bytes are committed (or raises)."""

    def __init__(
        self, path: str, future: Future[None], copied: threading.Event, owner: object = None
    ):
        self.path = path
        #: The client that runs the save (``Client.wait`` waits for its own saves).
        self.owner = owner
        self._future = future
        self._copied = copied
        self._seen = _Seen()
        with _pending_lock:
            _pending.add(self)
        ref = weakref.ref(self)
        future.add_done_callback(lambda _: _forget(ref))
        weakref.finalize(self, _report_unseen, path, future, self._seen)

    def done(self) -> bool:
        """Whether the save finished (committed or failed)."""
        return self._future.done()

    def copied(self) -> bool:
        """Whether the tensors are copied out (they may be modified again)."""
        return self._copied.is_set()

    def wait_copied(self, timeout: float | None = None) -> bool:
        """Block until the tensors are copied out (or the save failed); no error raised."""
        return _in_slices(self._copied.wait, check_timeout(timeout))

    def wait_done(self, timeout: float | None = None) -> bool:
        """Block until the save finished (committed or failed); no error raised (it stays
        with the handle for :meth:`wait`). Returns whether it finished."""
        return _in_slices(self._finished_within, check_timeout(timeout))

    def _finished_within(self, seconds: float) -> bool:
        return not wait([self._future], seconds).not_done

    def wait(self, timeout: float | None = None) -> None:
        """Block until committed; raises the save's error (e.g. :class:`TensorMutated`), or
        :class:`~ckptcache.errors.PersistTimeout` once ``timeout`` seconds have passed."""
        if not _in_slices(self._finished_within, check_timeout(timeout)):
            raise PersistTimeout(
                f"the non-blocking save of {self.path!r} did not finish within {timeout} s"
            )
        self._seen.seen = True  # the outcome reaches the caller: nothing left to log
        with signals_deferred():  # the future's lock, taken once more
            self._future.result()

    def __repr__(self) -> str:
        state = "done" if self.done() else "copied" if self.copied() else "copying"
        return f"<SaveHandle {self.path!r} {state}>"


#: The longest a wait on a save runs with signals deferred: how late a Ctrl-C may be seen.
_SLICE = 0.05


def _in_slices(within: Callable[[float], bool], timeout: float | None) -> bool:
    """Wait until ``within(t)`` (a wait of at most ``t`` seconds that says whether it is
    over) says so, or ``timeout`` seconds passed (``None``: no limit); whether it is over.

    In slices of at most :data:`_SLICE`, each with signals deferred: a Ctrl-C's exception is
    raised between two slices, never inside the lock of the condition a wait holds (left
    held, it would stop the save's own thread at its next notify, and with it every later
    non-blocking save)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = _SLICE if deadline is None else max(0.0, deadline - time.monotonic())
        with signals_deferred():
            if within(min(left, _SLICE)):
                return True
        if deadline is not None and time.monotonic() >= deadline:
            return False


def submit(
    run: Callable[[Callable[[], None]], None],
    path: str,
    executor: Any,
    owner: object = None,
) -> SaveHandle:
    """Run ``run(on_copied)`` on ``executor``; ``on_copied`` marks the tensors free again."""
    copied = threading.Event()

    def task() -> None:
        try:
            run(copied.set)
        finally:
            copied.set()

    return SaveHandle(path, executor.submit(task), copied, owner)


def pending_saves(owner: object, match: Callable[[str], bool] = lambda _: True) -> list[SaveHandle]:
    """The saves of ``owner`` not done yet whose path ``match`` accepts, in no set order."""
    with _pending_lock:
        return [h for h in _pending if h.owner is owner and not h.done() and match(h.path)]


def wait_for_copies(timeout: float | None = None) -> None:
    """Block until every pending non-blocking save of this process has copied its tensors
    (errors stay with their handles)."""
    with _pending_lock:
        pending = [h for h in _pending if not h.copied()]
    for handle in pending:
        handle.wait_copied(timeout)
