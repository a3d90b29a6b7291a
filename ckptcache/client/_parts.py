"""The client's parts, made and wired in one place (as the daemon's are in ``build_core``).

Each part gets what it uses and nothing more: no part holds the :class:`Client`, and the
spare thread sees the segment cache through a narrow port. A forked child keeps its parts and
resets them here, in one order, from one at-fork handler.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass

from ckptcache.client._connection import Connection
from ckptcache.client._fallback import WriteThrough
from ckptcache.client._ledger import Ledger
from ckptcache.client._loads import Loads
from ckptcache.client._plans import PlanWarmer
from ckptcache.client._queries import Queries
from ckptcache.client._saves import Saves
from ckptcache.client._segments import WriteMaps
from ckptcache.client._settings import Settings
from ckptcache.client._spares import SpareMapper
from ckptcache.client._staging import Stager
from ckptcache.client._waits import Waits

__all__ = ["Parts", "build_parts"]


@dataclass(eq=False)
class Parts:
    """One client's parts."""

    settings: Settings
    connection: Connection
    maps: WriteMaps
    spares: SpareMapper
    ledger: Ledger
    fallback: WriteThrough
    waits: Waits
    saves: Saves
    loads: Loads
    queries: Queries
    stager: Stager
    plans: PlanWarmer

    def after_fork(self) -> None:
        """In a forked child (an at-fork handler): new locks, since a thread of the parent
        (a save in flight, the spare mapper) may have held one at the fork and does not
        exist here to release it, and none of the parent's threads or connection."""
        self.connection.after_fork()
        self.saves.after_fork()
        self.disown()

    def disown(self) -> None:
        """Forked: the parent's socket and mappings are not ours to use or close, nor are
        its saves ours to wait for."""
        self.connection.disown()
        self.maps.disown()
        self.ledger.disown()
        self.spares.disown()
        self.plans.disown()

    def close(self) -> None:
        """Finish pending non-blocking saves, release pins, close the connections and the
        cached write mappings; its save and spare threads have ended when it returns."""
        self.plans.stop()  # before the connection goes: its requests use it
        self.saves.close()
        self.connection.close_waiter()
        with self.connection.lock:
            self.spares.stop()
            self.connection.close()
            self.maps.close()
        self.spares.join()  # outside the lock, which the spare thread's round takes


#: The parts of every live client, for the fork handler.
_alive: weakref.WeakSet[Parts] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for parts in list(_alive):
        parts.after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


def build_parts(settings: Settings) -> Parts:
    """A client's parts for ``settings``, wired."""
    connection = Connection(settings)
    maps = WriteMaps(connection)
    spares = SpareMapper(maps)
    ledger = Ledger()
    fallback = WriteThrough(settings, connection, ledger)
    waits = Waits(settings, connection, ledger)
    saves = Saves(settings, connection, maps, spares, fallback, ledger, waits)
    loads, queries = Loads(settings, connection), Queries(settings, connection)
    parts = Parts(
        settings, connection, maps, spares, ledger, fallback, waits, saves, loads, queries,
        Stager(settings, connection, saves, spares), PlanWarmer(queries, loads, saves),
    )  # fmt: skip
    # A request that finds itself in a child no at-fork handler told (a C fork()) disowns
    # every part's share of the parent, not the connection's alone.
    connection.forked = parts.disown
    _alive.add(parts)
    return parts
