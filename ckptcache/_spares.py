"""Mapping the daemon's spare segments ahead of use, so a save into one pays no page faults.

Mapping a segment with ``MAP_POPULATE`` fills this process's page tables for every page: for
a never-seen segment that costs about as much as the copy itself. The daemon keeps spares
ready for saves of new paths (:mod:`ckptcache.server.pool`); this maps them in a background
thread after each save and on :meth:`Client.warmup`, so the save that gets one finds its
mapping cached like a reused segment's.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING

from ckptcache import errors
from ckptcache.wire import messages as m

if TYPE_CHECKING:
    from ckptcache.client import Client
    from ckptcache.format.shm import Mapping

__all__ = ["SpareMapper"]

log = logging.getLogger(__name__)

#: How long the background thread follows a spare the daemon is still creating.
_FOLLOW_SECONDS = 60.0


class SpareMapper:
    """Maps ``client``'s daemon's spares into ``client``'s write-mapping cache."""

    def __init__(self, client: Client):
        self._client = client
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._again = False
        self._stopped = threading.Event()
        #: Segments being mapped right now: a save that needs one waits instead of mapping twice.
        self.mapping_now: dict[str, threading.Event] = {}
        #: Mappings made, not yet moved into the client's cache.
        self.ready: dict[str, Mapping] = {}

    def refresh(self) -> threading.Thread:
        """Map new spares in the background (one thread at a time); returns that thread."""
        with self._lock:
            self._stopped.clear()
            if self._thread is not None and self._thread.is_alive():
                self._again = True
                return self._thread
            self._thread = threading.Thread(target=self._run, name="ckptcache-spares", daemon=True)
            self._thread.start()
            return self._thread

    def stop(self) -> None:
        """No further requests (the client is closing: a request would reconnect it)."""
        self._stopped.set()

    def wait_for(self, segment: str) -> None:
        """If ``segment`` is being mapped now, wait until it is, then cache its mapping."""
        event = self.mapping_now.get(segment)
        if event is not None:
            event.wait()
        self.adopt(segment)

    def adopt(self, segment: str) -> None:
        """Move a finished mapping into the client's cache (call under the client lock)."""
        mapping = self.ready.pop(segment, None)
        if (
            mapping is not None
            and self._client._write_maps.setdefault(segment, mapping) is not mapping
        ):
            mapping.close()

    def _run(self) -> None:
        deadline = time.monotonic() + _FOLLOW_SECONDS
        while True:
            try:
                with self._client._lock:  # close() stops us under this lock
                    if self._stopped.is_set():
                        return
                    reply = self._client._call("pool", m.PoolRequest(), m.PoolReply)
            except errors.CkptCacheError as e:
                log.debug("no spare segments to map: %s", e)
                return
            for name, capacity in zip(reply.segments, reply.capacities, strict=True):
                self._map(name, capacity)
            with self._lock:
                again, self._again = self._again, False
            if not (again or reply.growing) or time.monotonic() > deadline:
                return
            if not again and self._stopped.wait(0.05):  # the daemon is still making a spare
                return

    def _map(self, name: str, capacity: int) -> None:
        from ckptcache.format.shm import map_shared  # torch: only where spares are mapped

        client = self._client
        with client._lock:
            if name in client._write_maps or name in self.mapping_now or name in self.ready:
                return
            event = self.mapping_now[name] = threading.Event()
        try:
            mapping: Mapping | None = map_shared(client._seg_path(name), capacity)
        except OSError as e:  # taken and dropped meanwhile: nothing to warm
            log.debug("spare %s went away: %s", name, e)
            mapping = None
        finally:
            # Handed over without the client lock: a save holding it may be waiting for this.
            if mapping is not None and os.getpid() == client._pid:
                self.ready[name] = mapping
            self.mapping_now.pop(name, None)
            event.set()
        with client._lock:  # close() iterates the cache under this lock
            self.adopt(name)
