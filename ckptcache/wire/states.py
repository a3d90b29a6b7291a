"""The named states the daemon and its clients exchange, as string-valued enums.

Each member *is* its string (``PersistState.PERSISTED == "persisted"``), so the JSON on the
wire, ``ckptcache status --json`` and metric labels read exactly as before; the enums only give
the spellings one home. Torch-free: imported by the daemon and by the client.
"""

from __future__ import annotations

import enum

__all__ = ["ClaimRole", "PersistState", "Tier", "WaitState"]


class _StrEnum(str, enum.Enum):
    """A ``str`` enum whose ``str()`` and format are its value (``enum.StrEnum`` from 3.11)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class PersistState(_StrEnum):
    """Phase 2 state of one generation (``Generation.persist_state``, ``ObjectInfo``).

    ``memory-only`` -> never persisted (no root covers it); ``queued -> persisting ->
    persisted | failed | conflict``; ``queued -> superseded | dropped``; ``standby`` while
    another node of the replica group persists the same content. ``conflict``: another
    ckptcache writer replaced the stored object after this save was made, and only wall
    clocks could order the two; neither was overwritten (kept in memory, reported).
    """

    MEMORY_ONLY = "memory-only"
    QUEUED = "queued"
    PERSISTING = "persisting"
    PERSISTED = "persisted"
    STANDBY = "standby"
    FAILED = "failed"
    SUPERSEDED = "superseded"
    DROPPED = "dropped"
    CONFLICT = "conflict"


class WaitState(_StrEnum):
    """How a ``wait`` for persistence ended (``WaitReply.state``)."""

    PERSISTED = "persisted"
    MEMORY_ONLY = "memory-only"
    FAILED = "failed"
    DROPPED = "dropped"
    CONFLICT = "conflict"
    #: Storage holds a write made after this save (a save written through, another writer):
    #: this save's bytes were not written, and need not be.
    SUPERSEDED = "superseded"
    TIMEOUT = "timeout"


class ClaimRole(_StrEnum):
    """This node's part in persisting a generation its replica group holds."""

    #: Storage already holds this content: nothing to write.
    DONE = "done"
    #: Elected representative: write it (to the returned target path).
    LEAD = "lead"
    #: Another node writes it; watch and take over if it fails.
    STANDBY = "standby"
    #: The election could not be decided now (coordinator busy or down): try again later.
    RETRY = "retry"


class Tier(_StrEnum):
    """Where a copy was served or found corrupt."""

    LOCAL = "local"
    PEER = "peer"
    STORAGE = "storage"
    #: A disagreement between the copies of a replica group (corruption metrics only).
    GROUP = "group"
