"""Save plans made while a job starts, from the daemon's records of the job's earlier saves.

The first save of a structure a process has not saved yet plans it afresh: the skeleton, the
tensor table, the archive's layout and manifest, tens of milliseconds for thousands of
tensors and most of a job's first save. A job's checkpoints repeat their structure, and the
daemon outlives trainers: it holds what the last job saved under the same prefix. So at the
client's first contact by a load or an ``exists`` (a trainer resuming, or looking for a
checkpoint to resume from), a background thread lists the daemon's newest objects under the
job's prefix (the parent of the path's directory: ``/ckpt/job/`` for
``/ckpt/job/step-100/model.pt``), loads each zero-copy, plans its structure into the client's
plan cache (:meth:`~ckptcache.client._saves.Saves.warm_plan`) and lets it go. The job's first
save of a state of the same structure then finds its plan made, as a repeated save does.

Nothing is taken on trust that a fresh plan would not give: a cached plan is found by the
structure's key alone, and equal keys give byte-equal skeletons and plans whatever object
they were made from (:mod:`ckptcache.codec.plan.cache`); a state of another structure (other
keys, shapes, dtypes, devices) plans afresh, as before. The bytes are copied and digested by
the save as always.

Not on a save's first contact: planning beside the save's own plan and copy would slow that
save down, and a save that starts stops the thread after the object in hand. The thread is a
daemon thread that ends with its work; ``Client.close()`` stops and joins it.

A save that is the client's first contact (or meets a structure no earlier call planned)
takes the plan the daemon keeps for its structure instead
(:meth:`~ckptcache.client._saves.Saves.stored_plan`, :mod:`ckptcache.codec.plan.stored`):
a few milliseconds where a fresh plan takes tens.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING, Any

from ckptcache._workers import StoppableThread, join_started

if TYPE_CHECKING:
    from ckptcache.client._loads import Loads
    from ckptcache.client._queries import Queries
    from ckptcache.client._saves import Saves

__all__ = ["PlanWarmer", "job_prefix"]

log = logging.getLogger(__name__)

#: The most objects planned ahead (one per file name: a model file, an optimizer file, ...).
MOST = 4


def job_prefix(path: str) -> str:
    """The prefix of the job that saves ``path``: the parent of its directory, where each
    checkpoint of the job has a directory of its own (``/ckpt/job/`` for
    ``/ckpt/job/step-100/model.pt``)."""
    parent = os.path.dirname(os.path.dirname(path.rstrip("/")))
    return parent if parent.endswith("/") else parent + "/"


def newest_per_name(objects: list[Any], most: int = MOST) -> list[Any]:
    """The newest object (by commit time) of each file name, newest first, at most ``most``."""
    newest: dict[str, Any] = {}
    for info in sorted(objects, key=lambda o: o.committed, reverse=True):
        newest.setdefault(os.path.basename(info.path), info)
    return list(newest.values())[:most]


class PlanWarmer:
    """Plans the structures of a job's earlier saves into ``saves``' plan cache, once per
    client, in a background thread started by :meth:`first_contact`."""

    def __init__(self, queries: Queries, loads: Loads, saves: Saves):
        self._queries, self._loads, self._saves = queries, loads, saves
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self._started = False
        self._stop = threading.Event()
        self._thread: StoppableThread | None = None
        #: The objects planned ahead (for tests and tuning).
        self.planned: list[str] = []

    def disown(self) -> None:
        """In a forked child: the parent's thread is not ours."""
        self._reset()

    def first_contact(self, path: str) -> None:
        """The client's first contact was a load or an ``exists`` of ``path`` (normalized):
        plan the structures of the newest saves under its job's prefix, in the background."""
        with self._lock:
            if self._started:
                return
            self._started = True
            self._thread = StoppableThread(
                lambda: self._run(job_prefix(path)), "ckptcache-plans", self._stop.set
            )
            self._thread.start()

    def saving(self) -> None:
        """A save starts: no planning ahead from now on (it would compete with the save);
        the save plans what it needs itself."""
        with self._lock:
            self._started = True
        self._stop.set()

    def stop(self) -> None:
        """End the thread after the object in hand and wait for it."""
        self._stop.set()
        join_started(self._thread)

    def _run(self, prefix: str) -> None:
        from ckptcache.client._loads import LoadOptions

        try:
            objects = self._queries.list(prefix, all_namespaces=False)
        except Exception as e:  # planning ahead only saves time; a save plans anyway
            log.debug("no earlier saves to plan from under %s: %s", prefix, e)
            return
        for info in newest_per_name(objects):
            if self._stop.is_set():
                return
            try:
                obj = self._loads.load(info.path, LoadOptions(), ahead=True)
                self._saves.warm_plan(obj, info.path)
                del obj  # the zero-copy mapping and its pin go with it
                self.planned.append(info.path)
            except Exception as e:  # not loadable with the default options, gone meanwhile
                log.debug("not planning ahead from %s: %s", info.path, e)
