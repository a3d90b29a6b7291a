"""Loads: the newest generation pinned and mapped copy-on-write from the daemon's segment (the
returned CPU tensors are zero-copy views the trainer may still modify), else the stored file.

The order of a load:

1. ``open``: the daemon pins the newest generation (brought in from a peer or storage and
   checked as it lands, when this node has none) and names its segment;
2. map the segment privately (the pin lasts as long as the mapping) and read the object,
   its digests checked first with ``verify=True``;
3. not in any cache, or no daemon: the stored file, checked as it is read; a corrupt cached
   copy is reported to the daemon and the file read instead, if it is not older.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptcache import errors
from ckptcache.client._connection import Connection
from ckptcache.client._paths import in_storage
from ckptcache.client._settings import Settings
from ckptcache.codec.stored_load import load_from_storage
from ckptcache.errors import (
    CheckpointNotFound,
    CoordinatorUnavailable,
    CorruptCheckpoint,
    DaemonUnavailable,
)
from ckptcache.format.layout import HEADER_SIZE, SegmentHeader
from ckptcache.format.manifest import Manifest, unpack_digests, verify_meta
from ckptcache.storage import backend_for
from ckptcache.wire import messages as m
from ckptcache.wire.states import Tier

if TYPE_CHECKING:
    from ckptcache.codec.flatten import MapLocation
    from ckptcache.codec.shm import Mapping

__all__ = ["LoadOptions", "Loads"]

log = logging.getLogger("ckptcache.client")


@dataclass(frozen=True)
class LoadOptions:
    """The options of a load (:meth:`Client.load`), the same for each place it may be read
    from: the daemon's segment or the stored file."""

    #: Where the storages go, with ``torch.load``'s rules.
    map_location: MapLocation = None
    #: Unpickle only torch's allowlist (and ckptcache's few additions).
    weights_only: bool = True
    #: None: zero-copy views where the bytes allow; False: private copies; True: a stored
    #: file mapped, not read.
    mmap: bool | None = None
    #: None: check what crosses a tier and trust this node's memory; True: check this node's
    #: memory too; False: check no digest here.
    verify: bool | None = None


class Loads:
    """Runs a client's loads (see the module docstring for the order)."""

    def __init__(self, settings: Settings, connection: Connection):
        self._settings, self._connection = settings, connection

    def load(self, path: str, options: LoadOptions, *, ahead: bool = False) -> Any:
        """See :meth:`Client.load` (``path`` normalized); ``ahead``: the client's own reading
        ahead, not recorded as the path's last load."""
        local = options.verify is True
        request = m.OpenRequest(
            self._settings.namespace, path, need_digests=local,
            timeout=self._settings.server_wait(), allow_stale=self._settings.allow_stale,
            ahead=ahead,
        )  # fmt: skip
        try:
            reply, mapping = self._open(request)
        except (CheckpointNotFound, DaemonUnavailable, CoordinatorUnavailable) as e:
            return self._load_file(path, options, e)
        log.debug("load of %s served from the %s tier", path, reply.tier)
        try:
            return self._load_segment(reply, mapping, options)
        except CorruptCheckpoint as e:
            usable = self._file_not_older_than(path, reply.generation)
            report = m.ReportCorruptRequest(
                self._settings.namespace, path, reply.generation, str(e)
            )
            try:
                self._connection.call("report_corrupt", report)
            except errors.CkptCacheError:
                pass
            if not os.path.exists(path):
                raise
            if not usable:
                # An earlier save's file: returning it would silently go back in training.
                raise CorruptCheckpoint(
                    f"{e}; the file at {path!r} is older than this generation (an earlier "
                    "save), so it is not loaded in its place",
                    tensor=e.tensor, tier=e.tier,
                ) from e  # fmt: skip
            return self._load_file(path, options, e)

    def map_local(self, path: str, *, ahead: bool = False) -> tuple[Mapping, m.OpenReply]:
        """See :meth:`Client.map_local` (``path`` normalized; ``ahead`` as for :meth:`load`)."""
        namespace, wait = self._settings.namespace, self._settings.server_wait()
        request = m.OpenRequest(namespace, path, timeout=wait, ahead=ahead)
        reply, mapping = self._open(request)
        return mapping, reply

    def _open(self, request: m.OpenRequest) -> tuple[m.OpenReply, Mapping]:
        """The daemon's reply to ``request`` and the pinned segment it names, mapped
        copy-on-write; the pin goes once the mapping is garbage. A failure after the pin was
        taken releases it; a signal's exception (Ctrl-C) ends the connection, and the pin with
        it, wherever it lands between the request and the mapping's registration."""
        from ckptcache.codec.shm import map_private

        connection = self._connection
        reply = None
        try:
            reply = connection.call("open", request, m.OpenReply)
            epoch = connection.epoch
            mapping = map_private(connection.seg_path(reply.segment), reply.size, hold_lock=True)
            connection.release_with(mapping, reply.lease, epoch)
            return reply, mapping
        except BaseException as e:
            try:
                if not isinstance(e, Exception):
                    raise
                if reply is not None:
                    with contextlib.suppress(errors.CkptCacheError):
                        connection.call("release", m.ReleaseRequest((reply.lease,)))
            except BaseException:  # a signal's, here or while the release was asked
                with connection.lock:
                    connection.drop()
                raise
            raise

    def _file_not_older_than(self, path: str, generation: int) -> bool:
        """Whether the file at ``path`` holds generation ``generation`` or a later save, as
        far as the daemon's record shows: persisted (the daemon never replaces a newer file),
        or stamped no earlier than the commit (the daemon stamps what it persists with the
        generation's commit time, as mtime; any later write is newer still). Asked before the
        generation is reported corrupt (then dropped); unknown means no."""
        try:
            info = self._connection.call(
                "stat", m.StatRequest(self._settings.namespace, path), m.ObjectInfo
            )
        except errors.CkptCacheError:
            return False
        if info.generation < generation:
            return False  # ours is gone already: its commit time is unknown
        if info.generation == generation and "persisted" in info.stages:
            return True
        # A newer generation committed since is a stricter bound, never a looser one.
        try:
            stamp = backend_for(path).commit_time_ns(path)
        except (OSError, ValueError, ImportError):
            return False
        # Commit times travel as float seconds (exact to about 0.2 us at today's dates).
        return stamp is not None and stamp >= round(info.committed * 1e9) - 1_000

    def _load_segment(self, reply: m.OpenReply, mapping: Mapping, options: LoadOptions) -> Any:
        """The object of the segment ``reply`` names (mapped as ``mapping``), its digests
        checked first where ``options.verify`` is True."""
        from ckptcache.codec.gpu.copy import device_target
        from ckptcache.codec.objectio import read_object

        zero_copy = options.mmap is not False
        if not zero_copy and device_target(options.map_location) is None:
            from ckptcache.codec.shm import private_copy

            # Private copies: the whole object read at once into this process's memory by
            # several threads, then read from there as a zero-copy load reads the segment.
            # The segment stays mapped (pinned, locked) while it is read; then its mapping
            # and pin go. What is checked below is the copy, the bytes the caller gets.
            mapping = private_copy(self._connection.seg_path(reply.segment), reply.size)
            zero_copy = True
        digests = None
        if options.verify is True:
            if not reply.digests_valid:
                raise CorruptCheckpoint("the daemon returned no digests to verify against")
            table = memoryview(mapping)[
                reply.digest_offset : reply.digest_offset + 8 * reply.n_storages
            ]
            digests = unpack_digests(table, reply.n_storages)
            table.release()
            _verify_meta(mapping, reply)
        return read_object(
            mapping, reply.manifest_offset, reply.manifest_size,
            zero_copy=zero_copy, weights_only=options.weights_only,
            map_location=options.map_location, digests=digests,
        )  # fmt: skip

    def _load_file(self, path: str, options: LoadOptions, reason: errors.CkptCacheError) -> Any:
        """Read the stored file at ``path`` here, checked unless ``options.verify`` is False
        (see :meth:`Client.load`); ``reason`` is why the daemon did not serve it."""
        if isinstance(reason, DaemonUnavailable) and self._settings.fallback == "raise":
            raise reason
        if isinstance(reason, CoordinatorUnavailable) and not self._settings.allow_stale:
            raise reason  # another node may have saved it since: the file may be older
        if not in_storage(path):
            if isinstance(reason, CoordinatorUnavailable):
                raise reason  # other nodes may hold it: "not found" would be a wrong answer
            where = "the cache" if isinstance(reason, CheckpointNotFound) else "a reachable cache"
            raise CheckpointNotFound(
                f"{path!r} is neither in {where} nor in storage; check the path "
                "(and the namespace, if the job sets one)"
            ) from reason
        return load_from_storage(
            path, options.map_location, weights_only=options.weights_only, mmap=options.mmap,
            verify=options.verify is not False,
        )  # fmt: skip


def _verify_meta(mapping: Mapping, reply: m.OpenReply) -> None:
    """Check the skeleton and manifest against the digests in the segment's header."""
    view = memoryview(mapping)
    try:
        header = SegmentHeader.unpack(view[:HEADER_SIZE])
        mo, ms = reply.manifest_offset, reply.manifest_size
        manifest = Manifest.from_json(view[mo : mo + ms], segment_size=len(view))
        verify_meta(view, manifest, mo, ms, (header.skeleton_digest, header.manifest_digest),
                    tier=Tier.LOCAL)  # fmt: skip
    except ValueError as e:
        if isinstance(e, CorruptCheckpoint):
            raise
        raise CorruptCheckpoint(f"unreadable segment header: {e}", tier=Tier.LOCAL) from e
    finally:
        view.release()
