"""Control-plane messages between clients and the daemon: frozen dataclasses carried as JSON.

No pickle crosses the socket: rpyc carries one ``request(kind, body)`` call whose body and
reply are JSON text. Each message kind has exactly one request type and one handler in the
daemon. Replies are wrapped in an envelope: ``{"ok": true, "result": {...}}`` or
``{"ok": false, "error": {"type": "BudgetExceeded", "message": "..."}}``, and the client
re-raises the named :mod:`ckptcache.errors` type.

Call order of a save: ``hello`` once per connection, then ``reserve`` -> (client copies bytes
into the segment) -> ``commit`` (or ``abort``). A load: ``open`` -> (client maps the segment)
-> ``release`` when the mapping is gone. Everything else is a single request.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ckptcache.errors import ProtocolMismatch
from ckptcache.wire.states import PersistState, Tier, WaitState

__all__ = [
    "PROTOCOL_VERSION",
    "AbortRequest",
    "CommitReply",
    "CommitRequest",
    "DaemonStatus",
    "DeleteReply",
    "DeleteRequest",
    "FindPlanReply",
    "FindPlanRequest",
    "HelloReply",
    "HelloRequest",
    "KeepPlanRequest",
    "KeptPlan",
    "ListPlansReply",
    "ListPlansRequest",
    "ListReply",
    "ListRequest",
    "ObjectInfo",
    "OpenReply",
    "OpenRequest",
    "PathMessage",
    "PeerClock",
    "PinnedCommitReply",
    "PoolReply",
    "PoolRequest",
    "PrefetchReply",
    "PrefetchRequest",
    "ReleaseRequest",
    "ReportCorruptRequest",
    "ReserveReply",
    "ReserveRequest",
    "StatRequest",
    "StatusRequest",
    "SupersedeRequest",
    "VerifyReply",
    "VerifyRequest",
    "WaitReply",
    "WaitRequest",
    "build",
    "decode",
    "encode",
    "error_envelope",
    "message",
    "ok_envelope",
]

#: Bumped on any incompatible change; hello refuses a mismatch with ProtocolMismatch.
PROTOCOL_VERSION = 2
#: The largest request body a daemon accepts (replies are not capped).
MAX_REQUEST_BYTES = 1 << 20

M = TypeVar("M")

T = TypeVar("T")


@typing.dataclass_transform(frozen_default=True, field_specifiers=(field,))
def message(cls: type[T]) -> type[T]:
    """Declare a message (every one of the wire is declared so): a frozen dataclass with slots,
    so no instance carries a dict of its own (a list reply holds one per object)."""
    return dataclass(frozen=True, slots=True)(cls)


def encode(message: Any) -> str:
    """Encode a message dataclass as JSON."""
    return json.dumps(dataclasses.asdict(message), separators=(",", ":"))


_FIELD_TYPES: dict[Any, dict[str, Any]] = {}


def _field_types(cls: Any) -> dict[str, Any]:
    """The resolved annotations of message ``cls`` (resolved once: get_type_hints is slow)."""
    hints = _FIELD_TYPES.get(cls)
    if hints is None:
        hints = _FIELD_TYPES[cls] = typing.get_type_hints(cls)
    return hints


def _type_ok(value: Any, hint: Any) -> bool:
    """Whether a decoded JSON value fits a field's annotation (ints are floats; bools are not
    ints); annotations other than the plain ones messages use are not checked."""
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return isinstance(value, str) and value in hint._value2member_map_
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in args)
    if hint is type(None):
        return value is None
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return isinstance(value, tuple) and all(_type_ok(v, args[0]) for v in value)
    return True


def _hint_name(hint: Any) -> str:
    """``int``, ``float | None``: an annotation as an error message names it."""
    return getattr(hint, "__name__", None) or str(hint)


def _build(cls: type[M], raw: Any, newer: bool = False) -> M:
    if not isinstance(raw, dict):
        raise ValueError(f"{cls.__name__}: expected an object")
    hints = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = set(raw) - set(hints)
    if unknown and not newer:
        raise ValueError(f"{cls.__name__}: unknown fields {sorted(unknown)}")
    values = {k: v for k, v in raw.items() if k in hints}
    types_ = _field_types(cls)
    for name, f in hints.items():
        if name not in values:
            continue  # a missing field without a default fails in the constructor
        # Nested message lists are the only composite fields; rebuild them by name.
        item_type = f.metadata.get("items")
        if item_type is not None:
            if not isinstance(values[name], list):
                raise ValueError(f"{cls.__name__}.{name}: expected a list")
            values[name] = tuple(_build(item_type, v, newer) for v in values[name])
        elif isinstance(values[name], list):
            values[name] = tuple(values[name])
        hint = types_[name]
        is_enum = isinstance(hint, type) and issubclass(hint, enum.Enum)
        if not _type_ok(values[name], hint):
            got = values[name]
            shown = repr(got) if is_enum and isinstance(got, str) else type(got).__name__
            raise ValueError(f"{cls.__name__}.{name}: must be {_hint_name(hint)}, not {shown}")
        if is_enum:
            values[name] = hint(values[name])
    return cls(**values)


def build(cls: type[M], raw: Any) -> M:
    """Build message ``cls`` from decoded JSON (a dict); raises :class:`ProtocolMismatch`
    naming the bad field when one is missing, unknown or of the wrong type."""
    try:
        return _build(cls, raw)
    except (TypeError, ValueError, RecursionError) as e:
        raise ProtocolMismatch(f"malformed {cls.__name__}: {e}") from e


def decode(cls: type[M], text: str, *, reply: bool = False) -> M:
    """Decode JSON text into message ``cls``; raises :class:`ProtocolMismatch` when it is not
    valid JSON, misses or adds fields, or a field has the wrong type. A ``reply`` (a daemon's
    answer, read by a client) may carry fields newer than the client: they are left out, so
    a daemon upgraded first still answers older clients (a request's unknown field is
    refused: the daemon would not do what it asks)."""
    try:
        return _build(cls, json.loads(text), reply)
    except (TypeError, ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise ProtocolMismatch(f"malformed {cls.__name__}: {e}") from e


def ok_envelope(result: Any) -> str:
    """Wrap a successful reply."""
    is_message = dataclasses.is_dataclass(result) and not isinstance(result, type)
    body = dataclasses.asdict(result) if is_message else result
    return json.dumps({"ok": True, "result": body}, separators=(",", ":"))


def error_envelope(error_type: str, message: str, **fields: str | None) -> str:
    """Wrap an error reply naming a :mod:`ckptcache.errors` type; ``fields`` are the error's
    attributes the client restores (a :class:`~ckptcache.errors.CorruptCheckpoint`'s
    ``tensor`` and ``tier``), those that are None left out."""
    error: dict[str, str] = {"type": error_type, "message": message}
    error.update({k: v for k, v in fields.items() if isinstance(v, str)})
    return json.dumps({"ok": False, "error": error})


@message
class PathMessage:
    """A message about one path of a namespace; the requests that name a path extend it with
    their own fields, which follow these two."""

    namespace: str
    path: str


@message
class HelloRequest:
    """First message on a connection."""

    protocol: int
    pid: int
    namespace: str


@message
class HelloReply:
    """The daemon's identity and where its segments live."""

    protocol: int
    node_id: str
    shm_dir: str
    version: str


@message
class ReserveRequest(PathMessage):
    """Phase 1, step 1: ask for a segment of at least ``nbytes``."""

    nbytes: int
    durability: str = "local"
    #: The saver's uid and gid (-1: the connection's credentials) and umask: persisted files
    #: get the owner and mode ``torch.save`` by the saver would give them. An old client
    #: sends none and gets the most private mode.
    uid: int = -1
    gid: int = -1
    umask: int = 0o077
    #: The most the client waits for the reply (s): the daemon waits no longer for memory.
    timeout: float | None = None


@message
class ReserveReply:
    """A segment reserved for this connection until commit or abort."""

    reservation: int
    segment: str
    capacity: int
    #: The token of the commit whose bytes the segment still holds, unchanged since (0:
    #: none, or unknown): where it is the one the client was given at that commit, the
    #: storages it did not write since need no copy. An older daemon sends none.
    content: int = 0


@message
class CommitRequest:
    """Phase 1, step 2: the bytes are in place; validate and publish them."""

    reservation: int
    manifest_offset: int
    manifest_size: int
    stall_seconds: float = 0.0
    #: The client watches storages of this save for writes: name the bytes it leaves
    #: (``CommitReply.content``), and check them when the segment is freed.
    watched: bool = False
    #: Offsets of the storages the client did not copy, their bytes being in the segment
    #: already (``ReserveReply.content``): checked against the digests the daemon found there.
    kept: tuple[int, ...] = ()


@message
class CommitReply:
    """The generation the commit created."""

    generation: int
    #: A token naming the bytes now in the segment (see ``ReserveReply.content``).
    content: int = 0


@message
class AbortRequest:
    """Give a reservation back without publishing it."""

    reservation: int


@message
class OpenRequest(PathMessage):
    """Pin the newest (or a given) generation of a path for loading."""

    generation: int | None = None
    need_digests: bool = False
    #: The most the client waits for the reply (s): bounds a fetch from peers or storage.
    timeout: float | None = None
    #: While the cluster's coordinator is unreachable, serve this node's copy although a
    #: newer save may exist elsewhere (else CoordinatorUnavailable).
    allow_stale: bool = False
    #: The client's own reading ahead (a plan read before a save), not a load its user asked
    #: for: served only from this node's memory, neither counted nor recorded as the path's
    #: last load.
    ahead: bool = False


@message
class OpenReply:
    """Where a pinned generation lies; valid until ``release(lease)``."""

    lease: int
    segment: str
    size: int
    generation: int
    manifest_offset: int
    manifest_size: int
    digest_offset: int
    n_storages: int
    digests_valid: bool
    tier: Tier = Tier.LOCAL


@message
class ReleaseRequest:
    """Drop leases whose mappings are gone."""

    leases: tuple[int, ...]


@message
class ReportCorruptRequest(PathMessage):
    """A client found a generation's bytes do not match their digests: drop it."""

    generation: int
    detail: str


@message
class PrefetchRequest(PathMessage):
    """Bring a path into this node's memory (from a peer or storage) without loading it."""

    #: The most the client waits for the reply (s).
    timeout: float | None = None


@message
class PoolRequest:
    """The daemon's spare segments, for a client to map ahead of its next save."""


@message
class PoolReply:
    """Spare segments (names and capacities) and whether another is being created."""

    segments: tuple[str, ...]
    capacities: tuple[int, ...]
    growing: bool


@message
class PrefetchReply:
    """Which tier the copy came from ("local" if it was already here)."""

    tier: Tier
    size: int
    generation: int


@message
class StatRequest(PathMessage):
    """Status of one path."""


@message
class ObjectInfo:
    """What the daemon knows of one generation of a path."""

    namespace: str
    path: str
    generation: int
    size: int
    stages: tuple[str, ...]
    committed: float
    segment: str
    pins: int
    digests_valid: bool
    generations: int = 1
    persist_state: PersistState = PersistState.MEMORY_ONLY
    persist_error: str = ""
    persist_seconds: float = 0.0
    replicas: tuple[str, ...] = ()
    origin: str = ""
    conflict: str = ""
    last_load_tier: str = ""


@message
class ListRequest:
    """List newest generations under a prefix (empty prefix: everything)."""

    namespace: str | None
    prefix: str = ""


@message
class ListReply:
    """Objects, sorted by path."""

    objects: tuple[ObjectInfo, ...] = field(default=(), metadata={"items": ObjectInfo})


@message
class DeleteRequest(PathMessage):
    """Drop every generation of a path from memory."""


@message
class DeleteReply:
    """How many generations were dropped."""

    dropped: int


@message
class SupersedeRequest(PathMessage):
    """The client wrote ``path`` straight to storage: retire every older generation."""


@message
class VerifyRequest(PathMessage):
    """Recompute digests of the newest generation and compare."""


@message
class VerifyReply:
    """Result of a verification; ``error`` names the bad tensor."""

    ok: bool
    generation: int
    storages: int
    error: str = ""


@message
class WaitRequest(PathMessage):
    """Block until a path's newest generation reaches ``stage`` (or a timeout)."""

    prefix: bool = False
    timeout: float = 60.0


@message
class WaitReply:
    """Stage reached (or the last state seen)."""

    generation: int
    state: WaitState
    error: str = ""


@message
class StatusRequest:
    """Daemon-wide status."""


@message
class PeerClock:
    """How far a peer's wall clock is from this daemon's, as last measured over the data
    plane: ``offset`` seconds ahead (negative: behind), within half the round trip
    ``delay``; ``checked`` is when (this daemon's clock)."""

    node_id: str
    offset: float
    delay: float
    checked: float


@message
class DaemonStatus:
    """Daemon-wide counters for ``ckptcache status``."""

    node_id: str
    pid: int
    version: str
    uptime: float
    memory_limit: int
    memory_used: int
    memory_free_pool: int
    segments: int
    free_segments: int
    objects: int
    generations: int
    pinned: int
    reservations: int
    shm_dir: str
    socket: str
    persist_queue: int = 0
    #: Generations waiting for their digests and freed segments for their check
    #: (``Digester.backlog``): background work that waits for saves to pause.
    digest_queue: int = 0
    persist_roots: tuple[str, ...] = ()
    cluster_nodes: tuple[str, ...] = ()
    coordinator: str = "embedded://"
    #: Bytes of the objects held (``memory_used`` is what their segments reserve).
    memory_stored: int = 0
    #: Free segments never used yet, kept pre-faulted for first saves (counted in segments).
    spare_segments: int = 0
    #: ``huge=`` policy of the tmpfs under ``shm_dir`` (``never``: 4 KiB pages; see
    #: :mod:`ckptcache.hugepages`), ``unknown`` when it cannot be told.
    shm_huge_pages: str = "unknown"
    #: Clock offsets of the live peers (empty for a node alone or before the first check).
    clock_offsets: tuple[PeerClock, ...] = field(default=(), metadata={"items": PeerClock})
    #: Offsets beyond this many seconds are logged as warnings (0: never).
    clock_offset_bound: float = 0.0


@message
class PinnedCommitReply:
    """The reply to ``commit_pinned`` (a :class:`CommitRequest` of a ``memory`` reservation):
    the new generation, pinned for this connection under ``lease`` as a staging copy. It is
    never announced, replicated, digested or persisted, and is dropped when ``lease`` is
    released or the connection ends (a dead trainer holds nothing)."""

    generation: int
    lease: int


@message
class KeepPlanRequest(PathMessage):
    """A client's save of ``path`` (committed) was the first of its structure in that
    client: the daemon keeps where the plan of that structure lies, for the first save of the
    next trainer of this user (``find_plan``). ``structure``: a digest of the structure's key
    (the compiled walk's); ``check``: a digest that binds the plan held in ``path``'s
    segment (skeleton, tensor table, storages' records) to that key; ``ints``: the integers
    the key holds by width (:mod:`ckptcache.codec.plan.stored`)."""

    structure: str
    check: str
    ints: tuple[int, ...] = ()


@message
class FindPlanRequest:
    """Where the plan of a structure lies, as this user's last ``keep_plan`` of it said."""

    namespace: str
    structure: str


@message
class FindPlanReply:
    """The path whose newest generation holds the plan (``""``: none kept), and what the
    client that kept it sent with it; where that generation lies on this node (its segment,
    ``""`` where this node holds none the asking user may load, and its manifest), for the
    client to read the plan from the segment's file."""

    path: str = ""
    check: str = ""
    ints: tuple[int, ...] = ()
    segment: str = ""
    manifest_offset: int = 0
    manifest_size: int = 0


@message
class KeptPlan:
    """One structure's plan as kept (``keep_plan``): where it lies (its path, and the segment
    and manifest of that path's newest generation, as in :class:`FindPlanReply`) and its
    check."""

    structure: str
    path: str
    check: str
    ints: tuple[int, ...] = ()
    segment: str = ""
    manifest_offset: int = 0
    manifest_size: int = 0


@message
class ListPlansRequest:
    """The plans this user kept in ``namespace``, the newest first (``most`` at most)."""

    namespace: str
    most: int = 4


@message
class ListPlansReply:
    """The reply to ``list_plans``."""

    plans: tuple[KeptPlan, ...] = field(default=(), metadata={"items": KeptPlan})
