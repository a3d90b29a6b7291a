"""The daemon's parts, as the control service sees them (built by :mod:`ckptcache.server.daemon`).

Call order (per client connection, see :mod:`ckptcache.wire.messages`)::

    session = core.saves.open_session(pid, uid)
    saves.reserve(session, ReserveRequest)  -> segment to copy into
    saves.commit(session, CommitRequest)    -> generation published (or saves.abort)
    saves.commit_pinned(...)                -> a staging copy, pinned under a lease
    loads.open(session, OpenRequest)        -> generation pinned for a load
    loads.release(session, ReleaseRequest)  -> pin dropped
    saves.close_session(session)            -> everything the connection held is let go

Pipeline of one generation: ``reserved -> committed -> digested -> (persisted) -> retired ->
free``. All state lives in :class:`~ckptcache.server.state.CacheState` behind one lock; bulk
work (digests, persistence, transfers) runs outside it on pinned generations, so a generation
can never be freed while a worker reads it.

Parts, each with one job: :mod:`~ckptcache.server.saves` (sessions, budget, commit),
:mod:`~ckptcache.server.ingest` (copies from peers and storage),
:mod:`~ckptcache.server.persist.digester`, :mod:`~ckptcache.server.memory.retention`,
:mod:`~ckptcache.server.persist.persister`, :mod:`~ckptcache.server.restore.loads`,
:mod:`~ckptcache.server.restore.queries`; in a cluster, :mod:`~ckptcache.server.cluster.cluster`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ckptcache._units import format_bytes
from ckptcache.server.config import DaemonConfig
from ckptcache.server.ingest import Ingest
from ckptcache.server.memory.pool import SegmentPool
from ckptcache.server.memory.retention import Retention
from ckptcache.server.memory.sharer import Sharer
from ckptcache.server.persist.digester import Digester
from ckptcache.server.persist.persister import Persister
from ckptcache.server.restore.loads import Loads
from ckptcache.server.restore.queries import Queries
from ckptcache.server.saves import Saves
from ckptcache.server.state import CacheState, Session
from ckptcache.wire import messages as m

__all__ = ["CacheCore", "Session"]

log = logging.getLogger(__name__)


class _Stoppable(Protocol):
    def stop(self) -> None: ...


Handler = tuple[type[Any], Callable[[Session, Any], Any]]


@dataclass
class CacheCore:
    """The daemon's parts, wired; holds no logic of its own beyond dispatch and shutdown."""

    config: DaemonConfig
    state: CacheState
    retention: Retention
    digester: Digester
    persister: Persister
    pool: SegmentPool
    saves: Saves
    ingest: Ingest
    loads: Loads
    queries: Queries
    sharer: Sharer
    cluster: _Stoppable | None = None

    def handlers(self) -> dict[str, Handler]:
        """Control message kind -> (request type, handler)."""
        saves, loads, queries = self.saves, self.loads, self.queries
        return {
            "reserve": (m.ReserveRequest, saves.reserve),
            "commit": (m.CommitRequest, saves.commit),
            "commit_pinned": (m.CommitRequest, saves.commit_pinned),
            "abort": (m.AbortRequest, saves.abort),
            "open": (m.OpenRequest, loads.open),
            "release": (m.ReleaseRequest, loads.release),
            "report_corrupt": (m.ReportCorruptRequest, loads.report_corrupt),
            "stat": (m.StatRequest, queries.stat),
            "list": (m.ListRequest, queries.list),
            "delete": (m.DeleteRequest, self.retention.delete),
            "supersede": (m.SupersedeRequest, self.retention.supersede),
            "verify": (m.VerifyRequest, self.digester.verify),
            "status": (m.StatusRequest, queries.status),
            "wait": (m.WaitRequest, queries.wait),
            "prefetch": (m.PrefetchRequest, loads.prefetch),
            "pool": (m.PoolRequest, queries.pool_info),
        }

    def shutdown(self) -> None:
        """Stop background workers. Unpersisted segments stay for the next incarnation;
        persisted ones are unlinked (they are on storage) unless ``keep_on_stop``."""
        self.retention.stop()
        self.sharer.stop()
        self.pool.stop()
        self.persister.stop()
        if self.cluster is not None:
            self.cluster.stop()
        self.digester.stop()
        if self.config.keep_on_stop:
            return
        count, released = self.retention.release_persisted_at_stop()
        with self.state.lock.held():
            kept, used = len(list(self.state.index)), self.state.arena.used
        log.info(
            "released %d persisted generation(s), %s, on storage; %d unpersisted kept for "
            "the next start (%s)", count, format_bytes(released), kept, format_bytes(used),
        )  # fmt: skip
