"""Which generation each of this node's holder keys speaks for.

A holder key names a path, a content digest and a node (``holders/<ph>/<digest>/<node>``), not
a generation: two generations of one path with the same bytes (a state saved twice, a backup
copy pushed again, the copy of a save this node also made) share one key. Announcing the
newer one and then withdrawing the older one as it leaves would delete the newer one's
holding, and an older one announced late would overwrite the newer one's stamp; either way
loaders that want the newest save no longer find this node, though it holds it and a
``durability="backup"`` save was acknowledged on the strength of it.

So every announcement and withdrawal of a key goes through :class:`Holdings`, which keeps the
generation the key was last announced for and runs the coordinator calls of one key one at a
time, in the order they were decided:

* an announcement of a generation older than the live one the key speaks for is skipped,
  and so is one of a generation that already left this node;
* a withdrawal happens only if the key still speaks for the generation that left.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ckptcache.server.memory.index import Generation

__all__ = ["Holdings"]

#: Locks that order the coordinator calls of one key (keys share them by hash).
_LOCKS = 64


class Holdings:
    """The generation each holder key of this node speaks for (see the module docstring)."""

    def __init__(self) -> None:
        self._locks = [threading.Lock() for _ in range(_LOCKS)]
        self._mutex = threading.Lock()  # guards _for
        self._for: dict[str, Generation] = {}

    def _lock(self, key: str) -> threading.Lock:
        return self._locks[zlib.crc32(key.encode()) % _LOCKS]

    def announce(self, key: str, gen: Generation, call: Callable[[], None]) -> bool:
        """Run ``call`` (the coordinator's announcement of ``key`` for ``gen``) unless the key
        speaks for a newer generation still here, or ``gen`` left; returns whether it ran."""
        with self._lock(key):
            with self._mutex:
                held = self._for.get(key)
            if gen.removed:
                return False
            if held is not None and held is not gen and not held.removed \
                    and held.committed_ns > gen.committed_ns:  # fmt: skip
                return False
            call()
            with self._mutex:
                self._for[key] = gen
            return True

    def withdraw(self, key: str, gen: Generation, call: Callable[[], None]) -> bool:
        """Run ``call`` (the coordinator's withdrawal of ``key``) only if the key speaks for
        ``gen`` (which left this node); returns whether it ran."""
        with self._lock(key):
            with self._mutex:
                if self._for.get(key) is not gen:
                    return False
                del self._for[key]
            call()
            return True
