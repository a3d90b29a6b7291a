"""Ingest: take a copy from a peer or from storage (an
:class:`~ckptcache.server.state.Incoming`) into this node's memory.

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
from dataclasses import replace

from ckptcache.errors import CheckpointNotFound
from ckptcache.format.layout import HEADER_SIZE
from ckptcache.format.manifest import compute_digests, pack_digests, unpack_digests, verify_digests
from ckptcache.server.memory.index import Generation
from ckptcache.server.saves import Saves
from ckptcache.server.state import CacheState, Incoming, Inflight
from ckptcache.wire import messages as m
from ckptcache.wire.states import Tier

__all__ = ["Ingest"]


class Ingest:
    """Backup copies and relays arriving from peers, and copies read from storage."""

    def __init__(self, state: CacheState, saves: Saves):
        self.state = state
        self.saves = saves

    def receive(self, copy: Incoming) -> Generation:
        """Take ``copy`` in: reserve, fill the bytes after the header, verify every digest
        (or compute the table), and commit it as this node's generation."""
        state, saves, internal = self.state, self.saves, self.saves.internal
        namespace, path, nbytes, saved_at = copy.namespace, copy.path, copy.nbytes, copy.saved_at
        self._refuse_deleted(namespace, path, copy)
        started = time.time()  # a copy of unknown age was saved before its read began
        content = saved_at or copy.content_time or started
        request = m.ReserveRequest(namespace, path, nbytes)
        saver = copy.saver
        if saver is not None and os.geteuid() == 0:  # only root may save on behalf of a user
            request = replace(request, uid=saver.uid, gid=saver.gid, umask=saver.umask)
        reply = saves.reserve(internal, request)
        key = (namespace, path)
        commit = m.CommitRequest(reply.reservation, copy.manifest_offset, copy.manifest_size)
        with state.lock.held():
            segment = internal.reservations[reply.reservation].segment
            flight = Inflight(segment, nbytes, copy.manifest_offset, copy.manifest_size,
                              persisted=copy.persisted, saved_at=content,
                              saved_ns=copy.content_ns)  # fmt: skip
            state.inflight.setdefault(key, flight)

        advance = state.landing(flight)  # relays follow what lands, range by range

        try:
            view = segment.view()
            try:
                copy.fill(view[HEADER_SIZE:nbytes], advance)
            finally:
                del view
            manifest, header = saves.validate(
                segment, internal.reservations[reply.reservation], commit
            )
            view = segment.view()
            try:
                start, n = header.digest_offset, header.n_storages
                if copy.digests is not None:
                    table = copy.digests()
                elif copy.verify:
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
            self._refuse_deleted(namespace, path, copy)
        except CheckpointNotFound:
            state.end_flight(key, flight, failed=True)  # its relays stop before the abort
            saves.abort(internal, m.AbortRequest(reply.reservation))
            raise
        with state.lock.held():
            state.end_flight(key, flight)  # committed below: later fetches use the index
            res = internal.reservations[reply.reservation]
            res.digests = table  # published with the generation: nobody hashes it again
            res.relayed = flight  # relays still sending keep the generation they read
            # Marked inside the commit, under the lock that publishes the generation: a
            # trainer's save of the same path committing meanwhile is never labelled a copy.
            res.origin, res.saved_at, res.saved_ns = copy.origin, content, copy.content_ns
            if copy.persisted:
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

    def _refuse_deleted(self, namespace: str, path: str, copy: Incoming) -> None:
        """Refuse a backup copy of a save made before the path was deleted here: stamps
        compared, exact (``CacheState.deleted``)."""
        if copy.saved_at is None:
            return  # not a backup copy: a load brought it
        with self.state.lock.held():
            deleted = self.state.deleted.get((namespace, path))
        if deleted is None:
            return
        # Without the exact stamp (a peer of an older version), in the float seconds the
        # copy came with: a mark made from that same save's stamp rounds the same way.
        if copy.content_ns:
            before = deleted >= copy.content_ns
        else:
            before = deleted / 1e9 >= copy.saved_at
        if before:
            raise CheckpointNotFound(
                f"{path!r} was deleted on node {self.state.config.node_id!r} after this copy "
                "was saved: backup copy refused"
            )
