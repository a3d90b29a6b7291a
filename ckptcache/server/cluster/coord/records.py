"""The values the daemon keeps under its coordinator keys, as typed records.

One frozen dataclass per key family (keys in :mod:`ckptcache.server.cluster.coord.keys`). Each
writes exactly the JSON fields daemons have always written (:meth:`to_dict`), so daemons of
different versions sharing one etcd still read each other, and reads back what it finds with
:meth:`from_dict`, which checks every field it uses: a record someone wrote by hand, or a
future version's with a field of another type, raises :class:`MalformedRecord` there, never a
``KeyError`` deep inside an election. Fields an older writer left out take the default the
readers have always assumed (``committed`` 0, ``origin`` the node itself).

:func:`parse_all` is how a scan is read: a malformed record is skipped (logged once per key),
as if its key were absent. So a group whose own persisted record is malformed persists again,
a writer whose record is malformed counts as deposed, and a holder that cannot be read is not
dialled; no daemon writes such records, so only a hand edit of etcd meets this path.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any, ClassVar, Self, TypeVar, cast

from ckptcache.errors import CkptCacheError

__all__ = [
    "HolderRecord",
    "InFlightRecord",
    "LatestRecord",
    "LoaderRecord",
    "MalformedRecord",
    "PersistedRecord",
    "RepRecord",
    "WriterRecord",
    "parse_all",
    "parse_one",
]

log = logging.getLogger(__name__)


class MalformedRecord(CkptCacheError, ValueError):
    """A coordinator value lacks a field the daemon needs, or holds one of the wrong type."""


def _mapping(raw: object, kind: str) -> Mapping[str, Any]:
    if not isinstance(raw, Mapping):
        raise MalformedRecord(f"{kind} record is a {type(raw).__name__}, not an object")
    return raw


def _node(raw: Mapping[str, Any], kind: str) -> str:
    node = raw.get("node")
    if not isinstance(node, str) or not node:
        raise MalformedRecord(f"{kind} record has no node id (node={node!r})")
    return node


def _text(raw: Mapping[str, Any], name: str, kind: str, default: str = "") -> str:
    value = raw.get(name)
    if value is None:  # absent, or null from a writer that had nothing to say
        return default
    if not isinstance(value, str):
        raise MalformedRecord(f"{kind} record's {name} is not a string: {value!r}")
    return value


def _number(
    raw: Mapping[str, Any], name: str, kind: str, *, integral: bool, default: float = 0
) -> float | int:
    value = raw.get(name, default)
    # bool is an int to Python but never a time or a count on the wire.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MalformedRecord(f"{kind} record's {name} is not a number: {value!r}")
    if not integral:
        return float(value)
    # A stamp in ns needs 61 bits: through a float it would come back up to 256 ns off.
    if isinstance(value, float) and not value.is_integer():
        raise MalformedRecord(f"{kind} record's {name} is not a whole number: {value!r}")
    return int(value)


class _Record:
    """What every record shares: its JSON form and the checked read-back, each field by its
    declared type (the field ``node``: a non-empty node id)."""

    KIND: ClassVar[str]
    #: Text fields that must not be empty.
    REQUIRED: ClassVar[tuple[str, ...]] = ()

    def to_dict(self) -> dict[str, Any]:
        """JSON form: every field, in the order declared (what every version writes)."""
        return {f.name: getattr(self, f.name) for f in fields(cast(Any, self))}

    @classmethod
    def from_dict(cls, raw: object) -> Self:
        """Inverse of :meth:`to_dict`; raises :class:`MalformedRecord`."""
        m = _mapping(raw, cls.KIND)
        values: dict[str, Any] = {}
        for f in fields(cast(Any, cls)):
            if f.name == "node":
                values[f.name] = _node(m, cls.KIND)
            elif f.type == "str":
                values[f.name] = _text(m, f.name, cls.KIND)
            else:  # a time or a count
                default = 0 if f.default is MISSING else f.default
                values[f.name] = _number(m, f.name, cls.KIND, integral=f.type == "int",
                                         default=default)  # fmt: skip
        for name in cls.REQUIRED:
            if not values[name]:
                raise MalformedRecord(f"{cls.KIND} record has no {name}")
        return cls(**values)


@dataclass(frozen=True)
class HolderRecord(_Record):
    """``holders/<ph>/<digest>/<node>``: ``node`` holds generation ``generation`` of
    ``path``, committed at ``committed`` (wall clock) by ``origin`` (a backup copy is its
    origin's save; ``""`` for the node's own); ``committed_ns`` is the save's stamp, exact
    (0 from a writer that predates it), and ``seen`` the stamp of the newest save of the path
    the save followed (-1: not known, a copy; see :func:`ckptcache.server.cluster.truth.races`)."""

    KIND: ClassVar[str] = "holder"
    node: str
    path: str = ""
    generation: int = 0
    committed: float = 0.0
    origin: str = ""
    committed_ns: int = 0
    seen: int = -1

    @property
    def saver(self) -> str:
        """Whose save this content is: the origin of a backup copy, else the holder."""
        return self.origin or self.node


@dataclass(frozen=True)
class InFlightRecord(_Record):
    """``holders/<ph>/inflight/<node>``: ``node`` started receiving a copy at ``committed``
    (wall clock; it ranks with the holders' commit times, newest first)."""

    KIND: ClassVar[str] = "in-flight"
    node: str
    committed: float = 0.0


@dataclass(frozen=True)
class RepRecord(_Record):
    """``reps/<ph>/<digest>``: ``node`` represents the group since ``since`` (wall clock)."""

    KIND: ClassVar[str] = "representative"
    node: str
    since: float = 0.0


@dataclass(frozen=True)
class WriterRecord(_Record):
    """``writer/<ph>``: ``node`` writes content ``digest`` of the path to storage now."""

    KIND: ClassVar[str] = "writer"
    REQUIRED: ClassVar[tuple[str, ...]] = ("digest",)
    node: str
    digest: str


@dataclass(frozen=True)
class LoaderRecord(_Record):
    """``loads/<ph>``: ``node`` reads the path from storage for its group."""

    KIND: ClassVar[str] = "loader"
    node: str


@dataclass(frozen=True)
class PersistedRecord(_Record):
    """``persisted/<ph>/<digest>`` (durable): ``node`` persisted the content to ``path``
    (the path itself, or its ``.conflict-<digest>`` sidecar) at ``time``; ``committed`` is
    when the content was saved (wall clock), which orders the contents of one path."""

    KIND: ClassVar[str] = "persisted"
    node: str
    path: str
    time: float = 0.0
    committed: float = 0.0
    #: The content's save stamp, exact (0 from a writer that predates it).
    committed_ns: int = 0

    @property
    def sidecar(self) -> bool:
        """Whether the content went beside the path (a digest disagreement's loser)."""
        return ".conflict-" in self.path


@dataclass(frozen=True)
class LatestRecord(_Record):
    """``latest/<ph>`` (durable): the newest save of the path in the whole cluster, whichever
    node made it: ``node`` saved it as its generation ``generation`` with the stamp
    ``committed_ns`` (a hybrid logical clock, later than every save of the path it followed)."""

    KIND: ClassVar[str] = "latest"
    node: str
    path: str = ""
    generation: int = 0
    committed_ns: int = 0


R = TypeVar("R", bound=_Record)

#: Keys whose malformed value was already logged: a scan repeats every few milliseconds.
_reported: set[str] = set()
_REPORTED_MAX = 1024


def parse_all(kind: type[R], entries: Mapping[str, object]) -> dict[str, R]:
    """The well-formed records of a scan, by key; a malformed one is skipped and logged
    (once per key)."""
    out: dict[str, R] = {}
    for key, raw in entries.items():
        try:
            out[key] = kind.from_dict(raw)
        except MalformedRecord as e:
            if key not in _reported and len(_reported) < _REPORTED_MAX:
                _reported.add(key)
                log.warning("ignored coordinator key %s: %s", key, e)
    return out


def parse_one(kind: type[R], key: str, raw: object | None) -> R | None:
    """The record of one read (``None`` when the key is absent or its value malformed; a
    malformed one is logged once)."""
    if raw is None:
        return None
    return parse_all(kind, {key: raw}).get(key)
