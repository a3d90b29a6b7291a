"""The client of the local daemon: drop-in ``save``/``load`` through shared memory.

:class:`Client` is a face: each call checks its arguments and hands them to one part, made
and wired by :func:`~ckptcache.client._parts.build_parts`. The call order of a save:

1. ``Client.save`` normalizes the path, checks ``durability``, starts mapping the daemon's
   spare segments on a first contact (:mod:`~ckptcache.client._spares`; a client made in a
   process with torch loaded starts as it is made);
2. ``Saves.save`` (:mod:`~ckptcache.client._saves`) flattens and plans the object (cached by
   structure); ``blocking=False`` takes version counters (:mod:`~ckptcache.client._async`) and
   runs the rest on the client's save thread;
3. ``reserve`` on the connection (:mod:`~ckptcache.client._connection`), lock held to the
   commit; a daemon gone or full: ``WriteThrough.write`` (:mod:`~ckptcache.client._fallback`)
   and the save ends there;
4. the segment's mapping (:mod:`~ckptcache.client._segments`), one copy in, ``commit``;
5. ``durability="persisted"``: ``Waits.persisted`` (:mod:`~ckptcache.client._waits`).

The call order of a load:

1. ``Client.load`` normalizes the path and starts the spare mapping on a first contact;
2. ``Loads.load`` (:mod:`~ckptcache.client._loads`): ``open`` pins the newest generation,
   the segment is mapped copy-on-write and the object read from it (zero-copy CPU tensors);
3. not cached, or no daemon: the stored file (:mod:`~ckptcache.client._paths` says whether
   storage has one), checked as it is read; a corrupt cached copy is reported and the file
   read in its place if it is not older.

When the daemon cannot be reached (or has no room), ``save`` writes through to the path with
``torch.save`` and warns once, and ``load`` reads the file at the path: a checkpoint error never
stops training unless ``fallback="raise"`` asks for it.
"""

from __future__ import annotations

import builtins
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ckptcache.client._loads import LoadOptions
from ckptcache.client._parts import build_parts
from ckptcache.client._paths import normalize_path, object_path
from ckptcache.client._saves import check_durability
from ckptcache.client._settings import Setting, Settings, check_timeout
from ckptcache.wire import messages as m

if TYPE_CHECKING:
    import torch

    from ckptcache.client._async import SaveHandle
    from ckptcache.client._staging import Staged
    from ckptcache.codec.flatten import MapLocation
    from ckptcache.codec.packing import Packed
    from ckptcache.codec.shm import Mapping

__all__ = ["Client"]


class Client:
    """A connection to the local daemon, with its own namespace, timeouts and fallback policy.

    ``socket_path`` defaults to ``$CKPTCACHE_SOCKET``, else this user's daemon, else the node's
    root daemon (docs/daemon.md, Configuration); the daemon must run as root, this user or
    ``daemon_uid`` (``$CKPTCACHE_DAEMON_UID``), which is checked before a byte is sent.
    ``namespace`` to ``$CKPTCACHE_NAMESPACE`` or ``default``. ``fallback`` is
    ``"write-through"`` (save to the path with torch.save when the daemon is gone or full) or
    ``"raise"``; unset, ``$CKPTCACHE_REQUIRE=1`` means ``"raise"``. Every write-through is
    counted in ``fallbacks`` and reported once: a warning for the first of each cause, a log
    line for every ``$CKPTCACHE_FALLBACK_LOG_EVERY``-th. ``allow_stale``: while a cluster's
    coordinator is unreachable, a load returns this node's copy or the stored file although
    another node may have saved a newer one since (default ``$CKPTCACHE_ALLOW_STALE``, else
    False: such a load raises :class:`~ckptcache.CoordinatorUnavailable`).
    A client may be shared by threads; after ``fork`` the child reconnects (with its own
    locks and threads: the parent's save in flight does not hang it).
    """

    socket_path = Setting()
    namespace = Setting()
    timeout = Setting()
    fallback = Setting()
    daemon_uid = Setting()
    allow_stale = Setting()

    def __init__(
        self,
        socket_path: str | None = None,
        *,
        namespace: str | None = None,
        timeout: float = 60.0,
        fallback: str | None = None,
        daemon_uid: int | None = None,
        allow_stale: bool | None = None,
    ):
        #: What this client was given, with the environment's defaults; its parts share it.
        self.settings = Settings.resolve(
            socket_path, namespace, timeout, fallback, daemon_uid, allow_stale
        )
        self._parts = parts = build_parts(self.settings)
        self._connection, self._spares, self._saves = parts.connection, parts.spares, parts.saves
        self._loads, self._queries, self._waits = parts.loads, parts.queries, parts.waits
        self._stager = parts.stager
        if "torch" in sys.modules:
            self._start_early()

    def _start_early(self) -> None:
        """What a first save needs, made as the client is: a process with torch loaded (a
        trainer; the control-plane commands start without torch) makes its client before it
        builds its model and takes its first steps, seconds before its first save. The
        save's modules are imported here (tens of milliseconds a first save would pay), and
        the daemon's spare segments mapped on the spare thread meanwhile, as
        :meth:`warmup` does (their page tables: as long as the copy, inside a first save
        that is the client's first contact), and the plans the daemon keeps for this user
        read (:meth:`~ckptcache.client._saves.Saves.read_ahead`)."""
        import ckptcache.client._async
        import ckptcache.codec.encode
        import ckptcache.codec.gpu.copy
        import ckptcache.codec.objectio
        import ckptcache.codec.plan.stored
        import ckptcache.format.gcpause  # noqa: F401 - each one a first save imports

        self._spares.first_contact()
        self._saves.read_ahead()

    @property
    def node_id(self) -> str:
        """The daemon's node (known once connected)."""
        return self._connection.node_id

    @property
    def fallbacks(self) -> int:
        """Saves this client wrote straight to storage because the daemon was gone or full."""
        return self._parts.fallback.count

    def renew(self) -> Client:
        """A new client with this one's settings (its own connection and threads): what a
        forked child uses in place of its parent's."""
        return Client(**self.settings.given())

    def close(self) -> None:
        """Finish pending non-blocking saves, release pins, close the connection and the
        cached write mappings."""
        self._parts.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def warmup(self, *, wait: bool = False) -> None:
        """Connect and map the daemon's spare segments in the background, so that even the
        first save of this process runs at memcpy speed (call it when the trainer starts);
        ``wait=True`` blocks until they are mapped."""
        self._queries.daemon_status()
        self._spares.warmed = True
        done = self._spares.refresh()
        if wait:
            done.wait()

    def save(
        self, obj: Any, path: Any, *, durability: str = "local", blocking: bool = True
    ) -> SaveHandle | None:
        """Save ``obj`` under ``path``; returns once the bytes are in the daemon's memory.

        ``blocking=False`` returns a :class:`~ckptcache.SaveHandle` at once and copies in a
        background thread (one at a time, in order); see :func:`ckptcache.save`.
        """
        path = object_path(path)
        check_durability(durability)
        self._spares.first_contact()
        self._parts.plans.saving()
        return self._saves.save(obj, path, durability, blocking)

    def save_packed(self, packed: Packed, path: Any, *, durability: str = "local") -> int:
        """Save the ``uint8`` blob that ``packed`` lays out (see
        :mod:`ckptcache.codec.packing`) under ``path``, its items copied straight into the
        segment: no blob is made, so the stall is one copy of the items' bytes. Returns where
        the blob's bytes start in the archive persisted at ``path``. Without a daemon the blob
        is made and written through, as :meth:`save` would write it."""
        path = object_path(path)
        check_durability(durability)
        self._spares.first_contact()
        self._parts.plans.saving()
        return self._saves.save_packed(packed, path, durability)

    def stage(self, tensors: Sequence[torch.Tensor]) -> Staged:
        """Copy ``tensors`` into the daemon's memory and return them staged there: what an
        asynchronous checkpoint copies before training goes on (``dcp.async_save``'s
        staging), at the cost of one copy and the requests of a save (reserve, commit).

        :attr:`Staged.tensors <ckptcache.client.Staged.tensors>` are CPU tensors equal to
        ``tensors`` (same dtypes, shapes, strides, storage sharing), built straight over this
        process's copy-on-write mapping of the copy: the originals may change at once, and a
        write to a staged tensor never reaches the cached copy. The copy stays in memory,
        pinned (no eviction or retention drops it), until :meth:`Staged.release
        <ckptcache.client.Staged.release>`; the daemon drops it as well when this client's
        connection or process ends (``kill -9`` included). It is never persisted. Without a
        daemon (or with no room) the staged tensors are private copies, unless the client's
        ``fallback="raise"`` raises instead. Not a list or tuple of dense tensors with bytes
        (a tensor alone, a sparse one, one on the meta device): :class:`TypeError`."""
        self._spares.first_contact()
        return self._stager.stage(tensors)

    def load(
        self,
        path: Any,
        map_location: MapLocation = None,
        *,
        weights_only: bool = True,
        mmap: bool | None = None,
        verify: bool | None = None,
    ) -> Any:
        """Load the newest generation of ``path`` (see :func:`ckptcache.load`).

        ``verify``: None (the default) checks every byte that crosses a tier (a stored file
        read here; the daemon checks what it brings in from peers and storage as it lands)
        and trusts this node's memory; True checks this node's memory too; False checks no
        digest here (a stored file's structure still is)."""
        path = object_path(path)
        self._spares.first_contact()
        self._parts.plans.first_contact(path)  # the job's earlier saves' plans, made ahead
        options = LoadOptions(map_location, weights_only, mmap, verify)
        return self._loads.load(path, options)

    def load_into(
        self, path: Any, into: Any, *, weights_only: bool = True, verify: bool | None = None
    ) -> Any:
        """Load the newest generation of ``path`` into the tensors of ``into`` (see
        :func:`ckptcache.load_into`)."""
        from ckptcache.client._into import check, fill

        check(into)
        # Mapped, never read into fresh memory: a stored file is checked through its mapping
        # (page cache), a cached copy is the segment; the fill is the one copy. On the CPU
        # whatever device saved it: each tensor's copy_ moves it to its destination's device
        # (a checkpoint saved from a GPU fills CPU tensors, and no GPU memory is made twice).
        loaded = self.load(path, "cpu", weights_only=weights_only, mmap=True, verify=verify)
        return fill(into, loaded)

    def map_local(self, path: Any) -> tuple[Mapping, m.OpenReply]:
        """Pin the newest generation of ``path`` and map its segment (read-only for the
        caller; copy-on-write). The pin lasts until the mapping is garbage. Raises
        :class:`~ckptcache.CheckpointNotFound` when the daemon has no copy (for read-through
        views, :func:`ckptcache.open`; a loader wants :meth:`load`)."""
        return self._loads.map_local(normalize_path(path))

    def status(self, path: Any) -> m.ObjectInfo:
        """What the cache (or storage) holds for ``path``."""
        return self._queries.status(normalize_path(path))

    def exists(self, path: Any) -> bool:
        """Whether ``path`` can be loaded from the cache or from storage."""
        path = normalize_path(path)
        self._spares.first_contact()
        self._parts.plans.first_contact(path)  # the job's earlier saves' plans, made ahead
        return self._queries.exists(path)

    def delete(self, path: Any) -> int:
        """Drop every cached generation of ``path`` (storage is untouched); returns the count."""
        return self._queries.delete(normalize_path(path))

    def list(
        self, prefix: str = "", *, all_namespaces: bool = False
    ) -> builtins.list[m.ObjectInfo]:
        """Newest generation of every cached path starting with ``prefix``."""
        return self._queries.list(prefix, all_namespaces)

    def verify(self, path: Any) -> m.VerifyReply:
        """Have the daemon recompute and compare the digests of ``path``'s newest generation."""
        return self._queries.verify(normalize_path(path))

    def wait(self, path: Any = None, *, prefix: Any = None, timeout: float | None = None) -> None:
        """Block until ``path`` is persisted (or every object under ``prefix``, or with
        neither, everything this client saved); see :func:`ckptcache.wait`.

        This client's non-blocking saves of those paths still running are waited for first
        (their errors, e.g. :class:`~ckptcache.errors.TensorMutated`, are raised here)."""
        if path is not None and prefix is not None:
            raise ValueError("give path or prefix, not both")
        path = None if path is None else normalize_path(path)
        prefix = None if prefix is None else normalize_path(prefix)
        self._waits.wait(path, prefix, check_timeout(timeout))

    def prefetch(
        self, paths: Any, progress: Callable[[int, int, str, str], None] | None = None
    ) -> builtins.list[str]:
        """Warm this node's cache with ``paths`` (from peers or storage; a daemon without a
        cluster reads storage itself), every copy checked by the daemon as it lands; returns
        the tier each came from. ``progress(done, total, path, tier)`` is called after each
        path. Raises :class:`~ckptcache.CorruptCheckpoint` for a damaged copy (tier and
        tensor named) and :class:`~ckptcache.CoordinatorUnavailable` when etcd is
        unreachable."""
        return self._queries.prefetch(paths, progress)

    def daemon_status(self) -> m.DaemonStatus:
        """Daemon-wide counters."""
        return self._queries.daemon_status()

    def pool(self) -> m.PoolReply:
        """The daemon's spare segments, ready for saves of new paths (names, capacities,
        whether more are being made): what a benchmark waits on before it times a first save."""
        return self._queries.pool()
