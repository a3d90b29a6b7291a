"""Staging: tensors copied once into the daemon's memory and handed back as tensors over it.

What an asynchronous checkpoint needs before it lets training go on (DCP's ``async_save``
stages into CPU buffers): a copy of the tensors that the trainer's next step cannot change,
which a background writer then reads. The order of :meth:`Stager.stage`:

1. ``Stager._commit``: plan (cached by structure), ``reserve`` a ``memory`` segment under a
   name of its own, one copy in through the client's reused shared mapping, then
   ``commit_pinned``: the daemon publishes it and pins it for this connection under a lease
   in the same request (no eviction or retention drops it meanwhile);
2. map the segment copy-on-write (:func:`~ckptcache.codec.shm.map_private`, as a zero-copy
   load does: a shared ``flock`` keeps the daemon from reusing the segment while the mapping
   lives) and build each tensor over its storage's bytes there, from the plan: no ``open``
   request, no unpickling. A write to a staged tensor faults in a private page: neither the
   committed copy nor any other reader sees it;
3. :meth:`Staged.release` (or the mapping's end, or the connection's) drops the lease, and
   the daemon drops the copy with it.

With no daemon (or no room) the tensors are plain private copies (``Staged.cached`` is False).
"""

from __future__ import annotations

import os
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptcache import errors
from ckptcache.client._connection import Connection
from ckptcache.client._saves import Saves
from ckptcache.client._settings import Settings
from ckptcache.client._spares import SpareMapper
from ckptcache.errors import BudgetExceeded, DaemonUnavailable
from ckptcache.wire import messages as m

if TYPE_CHECKING:
    import torch

    from ckptcache.codec.flatten import Flattened
    from ckptcache.format.manifest import ObjectPlan

__all__ = ["Staged", "Stager"]


@dataclass(frozen=True)
class _Staging:
    """A staging copy committed by :meth:`Stager._commit`: where it lies, the lease that holds
    it (taken on connection ``epoch``), and the flattened tensors and plan it was written by."""

    segment: str
    capacity: int
    lease: int
    epoch: int
    flat: Flattened
    plan: ObjectPlan


class _Lease:
    """The daemon's lease on one staging copy, released by :meth:`Staged.release`, or with
    the next request once every staged tensor is gone (:meth:`Connection.release_with`),
    whichever comes first.

    Two threads racing may both send the release; the daemon ignores a lease it no longer
    has."""

    def __init__(self, connection: Connection, lease: int, epoch: int):
        self._connection, self._lease, self._epoch = connection, lease, epoch
        self._done = False

    def _take(self) -> bool:
        done, self._done = self._done, True
        return not done

    def release_now(self) -> None:
        """Release the lease in one request (the copy is dropped from the daemon's memory)."""
        if not self._take():
            return
        connection = self._connection
        if connection.pid != os.getpid():
            return  # a forked child: the lease is the parent's
        try:
            with connection.lock:
                if connection.epoch != self._epoch or connection.rpc is None:
                    return  # that connection ended, and the daemon dropped the copy with it
                connection.call("release", m.ReleaseRequest((self._lease,)))
        except errors.CkptCacheError:
            pass  # the daemon went away: it drops what a lost connection held


class Staged:
    """Tensors staged by :meth:`Client.stage`, held in the cache until :meth:`release`.

    :attr:`tensors` are CPU tensors equal to the ones given, in order (same dtype, shape,
    strides and storage sharing), over this process's copy-on-write mapping of the daemon's
    copy: the originals may change at once, and a write to a staged tensor stays private to
    it. The copy is pinned (no eviction or retention drops it) until :meth:`release`, the
    end of the client's connection or of the process (the daemon drops it with the lease).
    Use it as a context manager, or call :meth:`release` when the background writer is done.
    """

    def __init__(
        self,
        tensors: list[torch.Tensor],
        lease: _Lease | None,
        released: Callable[[], object] | None = None,
    ):
        #: The staged tensors (empty once released).
        self.tensors = tensors
        self._lease = lease
        self._released = released

    @property
    def cached(self) -> bool:
        """Whether the tensors are in the cache (False: private copies, no daemon)."""
        return self._lease is not None

    def release(self) -> None:
        """Give the copy back to the daemon (idempotent). Staged tensors still referenced stay
        readable and unchanged: the daemon reuses the segment only once the last is gone."""
        self.tensors = []
        if self._lease is not None:
            self._lease.release_now()
        released, self._released = self._released, None
        if released is not None:
            released()

    def __enter__(self) -> Staged:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Stager:
    """Runs a client's stages (see the module docstring for the order)."""

    def __init__(
        self, settings: Settings, connection: Connection, saves: Saves, spares: SpareMapper
    ):
        self._settings, self._connection, self._saves = settings, connection, saves
        self._spares = spares

    def stage(self, tensors: Sequence[torch.Tensor]) -> Staged:
        """See :meth:`Client.stage`."""
        import torch

        if not isinstance(tensors, (list, tuple)):  # a tensor alone would stage its rows
            raise TypeError(f"stage takes a list or tuple of tensors, not {type(tensors).__name__}")
        items = list(tensors)
        for t in items:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"stage takes tensors, not {type(t).__name__}")
            if t.layout is not torch.strided or t.is_nested:
                # Staged tensors are made over their storage's bytes: these have no storage.
                raise TypeError(f"stage takes dense (strided) tensors, not {t.layout} ones")
            if t.is_meta:
                raise TypeError("stage takes tensors with bytes, not ones on the meta device")
        # A name of its own, outside any checkpoint directory (so under no persist root).
        path = os.path.join(
            tempfile.gettempdir(), f"ckptcache-staging-{os.getpid()}-{uuid.uuid4().hex}"
        )
        lease = None
        try:
            staging = self._commit(items, path)
            if staging is None:  # no daemon, or no room: plain copies (the trainer is held)
                return Staged([t.detach().to("cpu", copy=True) for t in items], None)
            lease = _Lease(self._connection, staging.lease, staging.epoch)
            # The spares are mapped afresh once the copy is given back (off the stall: a
            # spare the daemon made for the next new path).
            views = _views(self._map(staging), staging, items)
            return Staged(views, lease, self._spares.refresh)
        except BaseException as e:
            if lease is not None and isinstance(e, Exception):
                lease.release_now()
            elif not isinstance(e, Exception):
                # A signal's, wherever it landed once the copy was pinned (before its lease
                # was made, say): the connection ends, and the pin with it.
                with self._connection.lock:
                    self._connection.drop()
            raise

    def _commit(self, tensors: list[Any], path: str) -> _Staging | None:
        """Copy ``tensors`` into a segment committed as a staging copy of ``path`` (durability
        ``memory``, pinned for this connection: ``commit_pinned``); ``None`` when the daemon
        is gone or full (the caller copies them itself), unless the client raises then.
        The trainer is held throughout: the originals cannot change under the copy."""
        from ckptcache.codec.objectio import write_object

        t0 = time.perf_counter()
        saves = self._saves
        flat, plan = saves.plan(tensors, path)
        with self._connection.lock:
            request = saves.reserve_request(path, plan.layout.nbytes, "memory")
            try:
                reply = self._connection.call("reserve", request, m.ReserveReply)
            except (DaemonUnavailable, BudgetExceeded):
                if self._settings.fallback == "raise":
                    raise
                return None
            except BaseException:
                # A signal's exception, or a reply not understood, once the reservation may
                # be made: the connection ends, and the reservation with it.
                self._connection.drop()
                raise
            try:
                mapping = saves.mapping(reply.segment, reply.capacity)
                write_object(mapping, plan, flat)
                commit = m.CommitRequest(
                    reply.reservation, plan.layout.manifest_offset, len(plan.manifest_bytes),
                    time.perf_counter() - t0,
                )  # fmt: skip
                held = self._connection.call("commit_pinned", commit, m.PinnedCommitReply)
                epoch = self._connection.epoch
            except DaemonUnavailable:
                if self._settings.fallback == "raise":
                    raise
                return None  # the connection is gone, and the reservation with it
            except Exception:
                saves.abort(reply)
                raise
            except BaseException:
                # A signal's (Ctrl-C): the connection ends, and the reservation with it.
                self._connection.drop()
                raise
        # No spare refresh here (a save's commit does one): its thread would take the GIL
        # from the trainer inside the stall; the release of the copy refreshes instead.
        return _Staging(reply.segment, reply.capacity, held.lease, epoch, flat, plan)

    def _map(self, staging: _Staging) -> Any:
        from ckptcache.codec.shm import map_private

        path = self._connection.seg_path(staging.segment)
        mapping = map_private(path, staging.capacity, hold_lock=True)
        self._connection.release_with(mapping, staging.lease, staging.epoch)
        return mapping


def _views(mapping: Any, staging: _Staging, items: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each of ``items`` rebuilt over its storage's bytes in ``mapping`` (as the plan laid
    them out), with its dtype, shape, strides and offset: views of one storage stay views of
    one storage. The tensors keep the mapping alive."""
    import numpy as np
    import torch

    records = staging.plan.manifest.storages
    index = {s._cdata: i for i, s in enumerate(staging.flat.storages)}
    # One array over the whole mapping, each storage a slice of it, as a zero-copy load
    # makes them (cheaper than torch.frombuffer per storage).
    whole = np.frombuffer(mapping, dtype=np.uint8)
    from_numpy, empty = torch.from_numpy, torch.UntypedStorage
    views = [
        from_numpy(whole[r.offset : r.offset + r.nbytes]).untyped_storage()
        if r.nbytes
        else empty(0)
        for r in records
    ]
    out = []
    for t in items:
        view = torch.empty(0, dtype=t.dtype)
        view.set_(
            views[index[t.untyped_storage()._cdata]], t.storage_offset(), t.size(), t.stride()
        )
        out.append(view)
    return out
