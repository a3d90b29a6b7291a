"""Ingest: take a copy from a peer or from storage into this node's memory.

Call order of :meth:`Ingest.receive`: refuse a path deleted since the copy was saved ->
reserve (internal session) -> register the object in flight (peers asking for it are relayed
its bytes as they land, see :func:`ckptcache.server.cluster.transfer.relay_in_flight`) -> ``fill``
->
validate the manifest and verify (or compute) every digest -> refuse a delete that came during
the transfer -> commit as this node's generation, marked (origin, persisted) in the commit
itself, unless a save of the same path committed here meanwhile is newer
(:class:`~ckptcache.server.state.NewerHeld`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import replace

from ckptcache.errors import CheckpointNotFound
from ckptcache.format.layout import HEADER_SIZE
from ckptcache.format.manifest import compute_digests, pack_digests, unpack_digests, verify_digests
from ckptcache.server.memory.index import Generation
from ckptcache.server.ownership import Saver
from ckptcache.server.saves import Saves
from ckptcache.server.state import CacheState, Inflight
from ckptcache.wire import messages as m
from ckptcache.wire.states import Tier

__all__ = ["Ingest"]


class Ingest:
    """Backup copies and relays arriving from peers, and copies read from storage."""

    def __init__(self, state: CacheState, saves: Saves):
        self.state = state
        self.saves = saves

    def receive(
        self,
        namespace: str,
        path: str,
        nbytes: int,
        manifest_offset: int,
        manifest_size: int,
        fill: Callable[[memoryview, Callable[[int], None]], None],
        origin: str,
        *,
        verify: bool = True,
        persisted: bool = False,
        digests: Callable[[], list[int]] | None = None,
        saved_at: float | None = None,
        content_time: float = 0.0,
        content_ns: int = 0,
        saver: Saver | None = None,
    ) -> Generation:
        """Take a copy from a peer or storage: reserve, ``fill`` the bytes after the header,
        verify every digest against the table that came with them (``verify``) or compute the
        table (a copy read from storage), and commit it as this node's generation.
        ``digests()``, when given, returns the digests ``fill`` already verified.

        ``fill(view, advance)`` calls ``advance(n)`` whenever the first ``n`` bytes of ``view``
        are final: until the commit, peers asking for the same path are relayed those bytes
        as they land (see :attr:`CacheState.inflight`), so a broadcast is pipelined hop by hop.
        ``saved_at``: the origin's commit time of a backup copy; refused if the path was
        deleted here since (checked before and after the transfer). ``content_time``: when
        the sender says a fetched copy's content was saved. The copy keeps the origin's time
        as its commit time (what "newest wins" compares on storage and in memory), else the
        time its read began (an upper bound); ``content_ns``, when known, is the origin's
        exact stamp, which the copy keeps (a stamp that came through a float would be a few
        ns off, and no longer name the same save). ``saver``: who saved it on the origin; a root
        daemon holds and persists the copy as that user (else as itself: unknown saver).
        """
        state, saves, internal = self.state, self.saves, self.saves.internal
        self._refuse_deleted(namespace, path, saved_at)
        started = time.time()  # a copy of unknown age was saved before its read began
        content = saved_at or content_time or started
        request = m.ReserveRequest(namespace, path, nbytes)
        if saver is not None and os.geteuid() == 0:  # only root may save on behalf of a user
            request = replace(request, uid=saver.uid, gid=saver.gid, umask=saver.umask)
        reply = saves.reserve(internal, request)
        key = (namespace, path)
        commit = m.CommitRequest(reply.reservation, manifest_offset, manifest_size)
        with state.lock.held():
            segment = internal.reservations[reply.reservation].segment
            flight = Inflight(segment, nbytes, manifest_offset, manifest_size, persisted=persisted,
                              saved_at=content, saved_ns=content_ns)  # fmt: skip
            state.inflight.setdefault(key, flight)

        def advance(n: int) -> None:
            state.advance(flight, HEADER_SIZE + n)

        try:
            view = segment.view()
            try:
                fill(view[HEADER_SIZE:nbytes], advance)
            finally:
                del view
            manifest, header = saves.validate(
                segment, internal.reservations[reply.reservation], commit
            )
            view = segment.view()
            try:
                start, n = header.digest_offset, header.n_storages
                if digests is not None:
                    table = digests()
                elif verify:
                    table = unpack_digests(view[start : start + 8 * n], n)
                    verify_digests(view, manifest, table, tier=Tier.PEER)
                else:
                    table = compute_digests(view, manifest)
                    view[start : start + 8 * n] = pack_digests(table)
            finally:
                del view
        except BaseException:
            state.end_flight(key, flight, failed=True)
            saves.abort(internal, m.AbortRequest(reply.reservation))
            raise
        try:
            self._refuse_deleted(namespace, path, saved_at)
        except CheckpointNotFound:
            state.end_flight(key, flight)
            saves.abort(internal, m.AbortRequest(reply.reservation))
            raise
        with state.lock.held():
            state.end_flight(key, flight)  # committed below: later fetches use the index
            res = internal.reservations[reply.reservation]
            res.digests = table  # published with the generation: nobody hashes it again
            # Marked inside the commit, under the lock that publishes the generation: a
            # trainer's save of the same path committing meanwhile is never labelled a copy.
            res.origin, res.saved_at, res.saved_ns = origin, content, content_ns
            if persisted:
                res.persist, res.stored = False, True
        try:
            number = saves.commit(internal, commit).generation
        except BaseException:
            state.end_flight(key, flight, failed=True)  # relays of it stop: segment freed
            raise
        with state.lock.held():
            gen = state.index.get(key, number)
            if gen is None:  # retired (deleted, evicted) before this line: nothing to serve
                raise state.not_found(namespace, path, number)
            return gen

    def _refuse_deleted(self, namespace: str, path: str, saved_at: float | None) -> None:
        with self.state.lock.held():
            deleted = self.state.deleted.get((namespace, path))
        if saved_at is not None and deleted is not None and deleted >= saved_at:
            raise CheckpointNotFound(
                f"{path!r} was deleted on node {self.state.config.node_id!r} after this copy "
                "was saved: backup copy refused"
            )
