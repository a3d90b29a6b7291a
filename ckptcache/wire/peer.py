"""Data-plane messages between daemons: frozen dataclasses carried as JSON records.

Framing and authentication are the data plane's (:mod:`ckptcache.server.cluster.dataplane`); this
module only says what the JSON of each record means. Every request carries its kind in
``"op"``; a reply carries ``"ok"`` and, when refused, the error type and message.

Exchanges (one connection may carry several, one after the other)::

    push:    PushRequest  -> Ack (reserved: send the bytes) | Refused
             <segment body, digest table>      -> Pushed | Refused
             (with the offer's digests, the receiver may name the storages it holds in
             Ack.have: then only the rest of the body is sent, in order, then the table)
             (striped: the first stripe of the body here, then the table once every
             stripe is in; each other stripe on a connection of its own:)
    stripe:  PushStripe   -> Ack <its stripe of the body> -> Ack | Refused
    fetch:   FetchRequest -> ObjectHead <segment body, digest table>
                           (with FetchRequest.delta, a head with the digest table, then
                           Ack naming the storages held -> the rest of the body, the table)
                           (striped: the first stripe, then the table; the fetching node
                           asks for each other stripe on a connection of its own:)
                           | RelayHead  <segment body as it lands here>
                           (striped: the first stripe's blocks as they land; the
                           fetching node asks for each other stripe on a connection of
                           its own, and closes the relay with Ack once all are in:)
                           | Refused
    stripe:  FetchStripe  -> Ack <that stripe of the body> | Refused
    stripe:  RelayStripe  -> Ack <that stripe's blocks as they land> | Refused
    corrupt: CorruptReport -> Ack

Decoding raises :class:`~ckptcache.errors.ProtocolMismatch` naming the bad field; nothing
else escapes a decoder, whatever the bytes.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from ckptcache.errors import ProtocolMismatch
from ckptcache.wire.messages import PathMessage, build, message

__all__ = [
    "MAX_STREAMS",
    "Ack",
    "CorruptReport",
    "FetchRequest",
    "FetchStripe",
    "ObjectHead",
    "PeerRequest",
    "PushRequest",
    "PushStripe",
    "Pushed",
    "Refused",
    "RelayHead",
    "RelayStripe",
    "decode_ack",
    "decode_fetch_reply",
    "decode_pushed",
    "decode_request",
    "encode",
    "refusal",
]

M = TypeVar("M")


def _non_negative(message: Any, *names: str) -> None:
    for name in names:
        if getattr(message, name) < 0:
            raise ValueError(f"{type(message).__name__}.{name}: must be >= 0")


#: Most connections one transfer is split across (a bound on what a peer may ask for).
MAX_STREAMS = 64

#: Latest wall-clock time (s) a commit time may name: it is stored in ns in a uint64 header
#: field (and compared with storage's times), so anything beyond is a bad message.
_MAX_WALL_CLOCK = (2**63 - 1) / 1e9


def _check_stripes(starts: tuple[int, ...], name: str) -> None:
    increasing = all(b > a for a, b in itertools.pairwise(starts))
    if starts and (len(starts) > MAX_STREAMS or starts[0] != 0 or not increasing):
        raise ValueError(f"{name}: at most {MAX_STREAMS} increasing offsets from 0")


def _wall_clock(message: Any, name: str) -> None:
    value = getattr(message, name)
    if not (math.isfinite(value) and 0 <= value < _MAX_WALL_CLOCK):
        raise ValueError(f"{type(message).__name__}.{name}: must be a time in seconds >= 0")


def _copy_head(message: Any) -> None:
    """Check what a copy offered or served says about itself: sizes, commit time, saver."""
    _non_negative(message, "nbytes", "manifest_offset", "manifest_size", "skeleton_digest")
    _wall_clock(message, "committed")
    if message.saver_uid < -1 or message.saver_gid < -1:
        raise ValueError(f"{type(message).__name__}.saver_uid/gid: must be >= -1")
    if not 0 <= message.saver_umask <= 0o777:
        raise ValueError(f"{type(message).__name__}.saver_umask: must be 0 to 0o777")


@dataclass(frozen=True, kw_only=True)
class _CopyHead:
    """What a copy offered (:class:`PushRequest`) or served (:class:`ObjectHead`) carries
    besides the fields each declares: who saved it (uid, gid; -1: unknown) and their umask.
    The copy is held and persisted for that user, never as the daemon (uids are the same on
    every node). Keyword-only, so these come after a message's own fields; checked together
    with the sizes and the commit time the message declares."""

    saver_uid: int = -1
    saver_gid: int = -1
    saver_umask: int = 0o077

    def __post_init__(self) -> None:
        _copy_head(self)


@message
class _Extent(PathMessage):
    """Where a copy of a path lies in its segment: the segment's size and its manifest's
    offset and size (what every copy offered, served or relayed declares first)."""

    nbytes: int
    manifest_offset: int
    manifest_size: int


@message
class PushRequest(_Extent, _CopyHead):
    """A backup copy offered to a peer; the receiver answers :class:`Ack` once it has
    reserved room, then :class:`Pushed` once the bytes are verified and committed."""

    OP: ClassVar[str] = "push"
    origin: str
    manifest: str
    skeleton_digest: int
    committed: float
    #: The origin's stamp of the save, exact (``committed`` is for clocks only; 0: unknown).
    committed_ns: int = 0
    #: Connections the sender may split the body across (1: all on this one); the receiver
    #: answers where each stripe starts in :attr:`Ack.stripes`.
    streams: int = 1
    #: Names the transfer on the other connections (:class:`PushStripe`); empty with one.
    token: str = ""
    #: The copy's digest table, offered up front so the receiver can name the storages it
    #: holds already (:attr:`Ack.have`, :mod:`ckptcache.server.cluster.delta`); empty: the
    #: whole body is sent.
    digests: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _copy_head(self)  # not super(): a slots dataclass is a new class without its cell
        _non_negative(self, "committed_ns")
        if not 1 <= self.streams <= MAX_STREAMS:
            raise ValueError(f"PushRequest.streams: must be 1 to {MAX_STREAMS}")
        if not all(0 <= d < 1 << 64 for d in self.digests):
            raise ValueError("PushRequest.digests: each must be a 64-bit digest")


@message
class PushStripe:
    """One more connection of a striped push: stripe ``index`` (1 on; 0 is the offer's own
    connection) of the transfer named ``token``, sent once the receiver answers :class:`Ack`,
    acknowledged once its bytes are in and checked."""

    OP: ClassVar[str] = "push_stripe"
    token: str
    index: int

    def __post_init__(self) -> None:
        if not 1 <= self.index < MAX_STREAMS:
            raise ValueError(f"PushStripe.index: must be 1 to {MAX_STREAMS - 1}")


@message
class FetchRequest(PathMessage):
    """Ask a peer for its newest copy of a path."""

    OP: ClassVar[str] = "fetch"
    #: Connections the asking node may receive a committed copy on (1: all on this one); the
    #: holder answers where each stripe starts in :attr:`ObjectHead.stripes`.
    streams: int = 1
    #: The asking node takes a copy still arriving at the holder in stripes too
    #: (:attr:`RelayHead.token`, :class:`RelayStripe`).
    relays: bool = False
    #: The asking node may hold some of the copy's storages: a committed copy's head then
    #: carries its digest table (:attr:`ObjectHead.digests`), and the holder sends the body
    #: once the asking node answered :class:`Ack` naming what it holds.
    delta: bool = False
    #: With :attr:`delta`: the asking node takes a body it holds none of in stripes, which
    #: its :class:`Ack` asks for (:attr:`Ack.stripes`, as the head planned them).
    delta_stripes: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.streams <= MAX_STREAMS:
            raise ValueError(f"FetchRequest.streams: must be 1 to {MAX_STREAMS}")


@message
class FetchStripe(PathMessage):
    """Bytes ``[lo, hi)`` of the body of ``generation`` of a path: one stripe of a fetch
    whose :class:`ObjectHead` named its stripes, on a connection of its own."""

    OP: ClassVar[str] = "fetch_stripe"
    generation: int
    lo: int
    hi: int

    def __post_init__(self) -> None:
        _non_negative(self, "generation", "lo")
        if self.hi <= self.lo:
            raise ValueError("FetchStripe.hi: must be above lo")


@message
class RelayStripe:
    """One more connection of a striped relay: stripe ``index`` (1 on; 0 comes on the fetch's
    own connection) of the relay named ``token`` (:attr:`RelayHead.token`), its blocks sent
    as they land at the relaying node."""

    OP: ClassVar[str] = "relay_stripe"
    token: str
    index: int

    def __post_init__(self) -> None:
        if not 1 <= self.index < MAX_STREAMS:
            raise ValueError(f"RelayStripe.index: must be 1 to {MAX_STREAMS - 1}")


@message
class CorruptReport(PathMessage):
    """Tell a peer that the copy it served was corrupt (it drops that generation)."""

    OP: ClassVar[str] = "corrupt"
    detail: str = ""
    #: The generation served (0: a relayed copy, verified again where it lands).
    generation: int = 0

    def __post_init__(self) -> None:
        _non_negative(self, "generation")


PeerRequest = PushRequest | PushStripe | FetchRequest | FetchStripe | RelayStripe | CorruptReport
_REQUESTS: dict[str, type[Any]] = {
    c.OP: c
    for c in (PushRequest, PushStripe, FetchRequest, FetchStripe, RelayStripe, CorruptReport)
}


@message
class Ack:
    """Go on (a push may send its bytes; a report was taken)."""

    #: Where each stripe of a push's body starts (offsets from the end of the segment header,
    #: the first 0), as the receiver planned them (at most the offer's
    #: :attr:`PushRequest.streams`); empty: the whole body on the offer's connection. For a
    #: fetch that named its digests, the head's :attr:`ObjectHead.stripes`: the body whole,
    #: in those stripes.
    stripes: tuple[int, ...] = ()
    #: The storages (by index, increasing) a push's receiver holds already, from the
    #: offer's :attr:`PushRequest.digests`: their bytes are not sent, the rest of the body
    #: comes on the offer's connection (:mod:`ckptcache.server.cluster.delta`).
    have: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _check_stripes(self.stripes, "Ack.stripes")
        if any(b <= a for a, b in itertools.pairwise(self.have)) or any(i < 0 for i in self.have):
            raise ValueError("Ack.have: increasing storage indices >= 0")
        if self.have and len(self.stripes) > 1:
            raise ValueError("Ack.have: a push sends what is left on one connection")


@message
class Pushed:
    """A pushed copy was verified and committed as ``generation``."""

    generation: int


@message
class Refused:
    """A request refused: ``error`` names a :mod:`ckptcache.errors` type."""

    error: str
    message: str


@message
class ObjectHead(_Extent, _CopyHead):
    """A committed copy follows: the segment body, then its digest table."""

    generation: int
    manifest: str
    skeleton_digest: int
    #: The sender's copy is the one stored at the path: the receiver's is persisted too.
    persisted: bool = False
    #: When its content was saved (wall clock, s; 0: unknown): the receiver's copy keeps it.
    committed: float = 0.0
    #: The same, the save's exact stamp in ns (0: unknown).
    committed_ns: int = 0
    #: Where each stripe of the body starts when it comes on several connections (the first
    #: 0, see :class:`FetchStripe`); empty: the whole body on this one. With
    #: :attr:`digests`, only if the asking node's :class:`Ack` asks for them.
    stripes: tuple[int, ...] = ()
    #: The copy's digest table, for an asking node that may hold some of its storages
    #: (:attr:`FetchRequest.delta`): the body follows its :class:`Ack`, less the storages
    #: that names (:attr:`Ack.have`), on this connection; or, where it holds none of them,
    #: whole, in the stripes it names (:attr:`Ack.stripes`, :attr:`FetchRequest.delta_stripes`).
    digests: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _copy_head(self)  # not super(): a slots dataclass is a new class without its cell
        _non_negative(self, "committed_ns")
        _check_stripes(self.stripes, "ObjectHead.stripes")
        if not all(0 <= d < 1 << 64 for d in self.digests):
            raise ValueError("ObjectHead.digests: each must be a 64-bit digest")


@message
class RelayHead(_Extent):
    """A copy still arriving at the sender follows, relayed in order as it lands."""

    #: The bytes are those stored at the path (read from storage, or relayed from a copy
    #: that was): the receiver's copy is persisted too.
    persisted: bool = False
    #: When its content was saved (wall clock, s; 0: unknown).
    committed: float = 0.0
    #: The same, the save's exact stamp in ns (0: unknown).
    committed_ns: int = 0
    #: A striped relay (only to a node that asked with :attr:`FetchRequest.relays`): the
    #: lanes the copy lands in at the sender (:attr:`~ckptcache.server.state.Inflight.lanes`),
    #: cut in blocks of ``block`` bytes dealt to ``streams`` stripes
    #: (:func:`ckptcache.server.cluster.relay.plan`), the others asked for under ``token``.
    lanes: tuple[int, ...] = ()
    block: int = 0
    streams: int = 1
    token: str = ""

    def __post_init__(self) -> None:
        _non_negative(self, "nbytes", "manifest_offset", "manifest_size", "committed_ns",
                      "block")  # fmt: skip
        _wall_clock(self, "committed")
        _check_stripes(self.lanes, "RelayHead.lanes")
        if not 1 <= self.streams <= MAX_STREAMS:
            raise ValueError(f"RelayHead.streams: must be 1 to {MAX_STREAMS}")
        if self.streams > 1 and not (self.token and self.lanes and self.block > 0):
            raise ValueError("RelayHead: a striped relay names its token, lanes and block")


#: Fields newer than the format older nodes read (they refuse unknown fields): left out at
#: their defaults, so a message that does not use them is the one older nodes speak.
_NEWER: dict[str, Any] = {
    "streams": 1,
    "token": "",
    "stripes": (),
    "relays": False,
    "lanes": (),
    "block": 0,
    "digests": (),
    "have": (),
    "delta": False,
    "delta_stripes": False,
}


def encode(message: Any) -> dict[str, Any]:
    """The JSON object of a peer message (requests carry ``op``; replies ``ok``, and
    ``relay`` for a :class:`RelayHead`)."""
    body = {k: v for k, v in dataclasses.asdict(message).items()
            if k not in _NEWER or v != _NEWER[k]}  # fmt: skip
    op = getattr(type(message), "OP", None)
    if op is not None:
        return {"op": op, **body}
    if isinstance(message, Refused):
        return {"ok": False, **body}
    if isinstance(message, RelayHead):
        return {"ok": True, "relay": True, **body}
    return {"ok": True, **body}


def refusal(error: BaseException) -> dict[str, Any]:
    """The JSON object refusing a request because of ``error``."""
    return encode(Refused(type(error).__name__, str(error)))


def _object(raw: Any, what: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise ProtocolMismatch(f"malformed {what}: expected an object, not {type(raw).__name__}")
    return raw


def _fields(raw: dict[str, Any], *drop: str) -> dict[str, Any]:
    return {k: v for k, v in raw.items() if k not in drop}


def decode_request(raw: Any) -> PeerRequest:
    """A request, by its ``op``."""
    raw = _object(raw, "peer request")
    cls = _REQUESTS.get(raw.get("op")) if isinstance(raw.get("op"), str) else None
    if cls is None:
        raise ProtocolMismatch(f"malformed peer request: unknown op {raw.get('op')!r}")
    message: PeerRequest = build(cls, _fields(raw, "op"))
    return message


def _reply(raw: Any, what: str) -> dict[str, Any] | Refused:
    raw = _object(raw, what)
    ok = raw.get("ok")
    if ok is False:
        refused: Refused = build(Refused, _fields(raw, "ok"))
        return refused
    if ok is not True:
        raise ProtocolMismatch(f"malformed {what}: 'ok' must be true or false, not {ok!r}")
    return _fields(raw, "ok")


def decode_ack(raw: Any) -> Ack | Refused:
    """The answer to a push's offer (or a corrupt report)."""
    body = _reply(raw, "Ack")
    return body if isinstance(body, Refused) else build(Ack, body)


def decode_pushed(raw: Any) -> Pushed | Refused:
    """The answer once a pushed copy is committed."""
    body = _reply(raw, "Pushed")
    return body if isinstance(body, Refused) else build(Pushed, body)


def decode_fetch_reply(raw: Any) -> ObjectHead | RelayHead | Refused:
    """The answer to a :class:`FetchRequest`."""
    body = _reply(raw, "fetch reply")
    if isinstance(body, Refused):
        return body
    relay = body.get("relay", False)
    if relay is True:
        relayed: RelayHead = build(RelayHead, _fields(body, "relay"))
        return relayed
    if relay is not False:
        raise ProtocolMismatch(f"malformed fetch reply: 'relay' must be a bool, not {relay!r}")
    head: ObjectHead = build(ObjectHead, _fields(body, "relay"))
    return head
