"""What a restarted daemon must know of a generation to never persist it wrongly.

A daemon killed with ``-9`` keeps nothing but the segments in shared memory and its own
records of them, so these facts of each generation live in the daemon's record of its segment
(:mod:`ckptcache.server.memory.records`, beside the saver record of
:mod:`ckptcache.server.ownership`),
never in the segment itself, which an admitted user may rewrite:

* the **anchor**, the deepest directory of the path that existed at save time
  (:mod:`ckptcache.server.persist.lineage`). Recomputing it after a restart would take a directory
  the user removed meanwhile for one that was never there, and recreate it;
* the **base**, the identity of the object on storage when the save was made
  (:class:`~ckptcache.storage.base.WriteGuard`): newest wins after a restart as before it,
  whatever the clocks say;
* whether the save asked for **memory only** (``durability="memory"``): never persisted,
  even under a root;
* whether the generation was **dropped** because the user removed its directory. The flag
  is written before the drop is reported or acted on, so a crash never brings the checkpoint
  back, even once a later save recreated the directory.

A segment without a record: its anchor is recomputed at start and its base is unknown (the
stamps decide).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckptcache.server.memory import records

if TYPE_CHECKING:
    from ckptcache.server.memory.arena import Segment

__all__ = ["Provenance", "read_provenance", "write_provenance"]

_OFFSET = 1024
_END = 3072  # the saver record starts here
_HEAD = struct.Struct("<8sBBHH")
_MAGIC = b"CKPTPRV\x00"
_DROPPED = 1
_ANCHOR_KEPT = 2
_MEMORY_ONLY = 4
#: ``base`` states: not known, no object, an object whose identity follows.
_UNKNOWN, _ABSENT, _PRESENT = 0, 1, 2


@dataclass(frozen=True)
class Provenance:
    """The durable facts of one generation (see the module docstring)."""

    #: Identity of the stored object at save time; ``""`` none; ``None`` not known.
    base: str | None
    #: The recorded anchor; ``None`` when it did not fit (a restart recomputes it).
    anchor: str | None
    dropped: bool = False
    #: Never to be persisted (``durability="memory"``, or under no root), after a restart too.
    memory_only: bool = False


def write_provenance(segment: Segment, record: Provenance) -> None:
    """Record ``record`` in the daemon's record of ``segment`` (before the generation is
    published or its new state reported)."""
    base = (record.base or "").encode()
    anchor = (record.anchor or "").encode()
    room = _END - _OFFSET - _HEAD.size
    if len(base) > room:
        base, state = b"", _UNKNOWN
    else:
        state = _UNKNOWN if record.base is None else (_PRESENT if record.base else _ABSENT)
    kept = record.anchor is not None and len(base) + len(anchor) <= room
    if not kept:
        anchor = b""
    flags = (_DROPPED if record.dropped else 0) | (_ANCHOR_KEPT if kept else 0)
    flags |= _MEMORY_ONLY if record.memory_only else 0
    packed = _HEAD.pack(_MAGIC, flags, state, len(base), len(anchor)) + base + anchor
    records.write(segment, _OFFSET, packed)


def read_provenance(segment: Segment) -> Provenance | None:
    """The record of a segment adopted at start; ``None`` when there is none (or it is torn)."""
    page = records.page(segment)
    if page is None:
        return None
    magic, flags, state, n_base, n_anchor = _HEAD.unpack_from(page, _OFFSET)
    if magic != _MAGIC or state > _PRESENT or _HEAD.size + n_base + n_anchor > _END - _OFFSET:
        return None
    start = _OFFSET + _HEAD.size
    try:
        base = bytes(page[start : start + n_base]).decode()
        anchor = bytes(page[start + n_base : start + n_base + n_anchor]).decode()
    except UnicodeDecodeError:
        return None
    return Provenance(
        base=None if state == _UNKNOWN else base,
        anchor=anchor if flags & _ANCHOR_KEPT else None,
        dropped=bool(flags & _DROPPED),
        memory_only=bool(flags & _MEMORY_ONLY),
    )
