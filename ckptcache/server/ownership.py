"""Who saved what: the saver's identity travels with each generation and decides who may see,
load, delete and overwrite it, and which owner and mode its persisted file gets.

Root and the daemon's own uid see everything. Any other admitted uid sees, loads and deletes
only what it saved, and cannot save over a path another user holds in the cache.
"""

from __future__ import annotations

import grp
import os
import pwd
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypedDict

from ckptcache._secure_fs import current_umask
from ckptcache.errors import InvalidPath, PathNotAllowed
from ckptcache.server.memory import records

if TYPE_CHECKING:
    from ckptcache.wire import messages as m
    from ckptcache.wire import peer

__all__ = [
    "Holder",
    "Owned",
    "Requester",
    "Saver",
    "SaverFields",
    "Segment",
    "check_may_save",
    "daemon_saver",
    "groups_of",
    "may_load",
    "may_see",
    "read_record",
    "saver_for",
    "write_record",
]

#: The saver record's place in the daemon's record of a segment (see server/memory/records.py).
_RECORD_OFFSET = 3072
_RECORD = struct.Struct("<8siii")
_MAGIC = b"CKPTOWN\x00"


@dataclass(frozen=True)
class Saver:
    """The process that saved a generation: its uid, gid and umask."""

    uid: int
    gid: int
    umask: int

    @property
    def file_mode(self) -> int:
        """What ``torch.save`` by the saver would give a new file."""
        return 0o666 & ~self.umask

    @property
    def dir_mode(self) -> int:
        """What ``os.makedirs`` by the saver would give a new directory."""
        return 0o777 & ~self.umask


# What ownership reads of the daemon's types, as narrow protocols: the index, the state owner
# and the arena hold savers and call in here, so naming their classes would make each module
# need the other.


class Owned(Protocol):
    """A generation as ownership sees it: who saved it."""

    @property
    def saver(self) -> Saver | None:
        """The saver (``None``: unknown, a copy from a peer or storage)."""


class Requester(Protocol):
    """A client connection as ownership sees it: its peer credentials."""

    @property
    def uid(self) -> int:
        """The connected process's uid."""

    @property
    def gid(self) -> int:
        """The connected process's gid."""


class _Arena(Protocol):
    @property
    def uid(self) -> int:
        """The daemon's own uid."""


class _Index(Protocol):
    def generations(self, key: tuple[str, str]) -> Iterable[Owned]:
        """The generations held for ``key`` (namespace, path)."""


class Holder(Protocol):
    """The state owner as ownership sees it: the daemon's uid (on its arena) and the
    generations held for a key (on its index)."""

    @property
    def arena(self) -> _Arena:
        """Where the daemon's uid is kept."""

    @property
    def index(self) -> _Index:
        """The generations held, by key."""


class Segment(records.Segment, Protocol):
    """A segment as ownership sees it: what its record is kept for, and the file's owner."""

    @property
    def owner(self) -> int:
        """The uid that owns the segment's file."""


class SaverFields(TypedDict, total=False):
    """The saver's fields of a peer message (see :func:`saver_fields`)."""

    saver_uid: int
    saver_gid: int
    saver_umask: int


def saver_fields(saver: Saver | None) -> SaverFields:
    """``saver`` as peer messages carry it (``saver_uid``, ...; nothing when unknown)."""
    if saver is None:
        return {}
    return {"saver_uid": saver.uid, "saver_gid": saver.gid, "saver_umask": saver.umask}


def sent_saver(head: peer.PushRequest | peer.ObjectHead) -> Saver | None:
    """The saver a peer named for a copy (None: unknown)."""
    if head.saver_uid < 0:
        return None
    return Saver(head.saver_uid, head.saver_gid, head.saver_umask)


def daemon_saver() -> Saver:
    """The identity used for objects whose saver is unknown (from peers or storage)."""
    return Saver(os.geteuid(), os.getegid(), current_umask())


def groups_of(uid: int, gid: int) -> set[int]:
    """The groups a process of ``uid`` with primary group ``gid`` is a member of."""
    try:
        return set(os.getgrouplist(pwd.getpwuid(uid).pw_name, gid))
    except KeyError:
        return {gid}


def saver_for(session: Requester, req: m.ReserveRequest) -> Saver:
    """The saver of a reservation: the peer's credentials, refined by what the client sent.

    A client may name a gid among its own groups; only root may save on behalf of another uid.
    """
    uid = session.uid if req.uid < 0 else req.uid
    gid = session.gid if req.gid < 0 else req.gid
    if not 0 <= req.umask <= 0o777:
        raise InvalidPath(f"umask {req.umask!r} is out of range (0 to 0o777)")
    if session.uid != 0:
        if uid != session.uid:
            raise PathNotAllowed(f"uid {session.uid} cannot save on behalf of uid {uid}")
        if gid != session.gid and gid not in groups_of(uid, session.gid):
            name = _group_name(gid)
            raise PathNotAllowed(f"uid {uid} is not a member of group {name} and cannot save as it")
    return Saver(uid, gid, req.umask)


def _group_name(gid: int) -> str:
    try:
        return f"{grp.getgrgid(gid).gr_name} ({gid})"
    except KeyError:
        return str(gid)


def _privileged(core: Holder, uid: int) -> bool:
    return uid in (0, core.arena.uid)


def may_see(core: Holder, session: Requester, gen: Owned) -> bool:
    """Whether ``session`` may list, stat, wait on or delete ``gen``."""
    if _privileged(core, session.uid):
        return True
    return gen.saver is not None and gen.saver.uid == session.uid


def may_load(core: Holder, session: Requester, gen: Owned) -> bool:
    """Whether ``session`` may map ``gen``: its own saves; privileged users also accept what
    root, the daemon or a peer (unknown saver) put there, never an unprivileged user's bytes
    (that user could save under a path the privileged trainer is about to load)."""
    if gen.saver is not None and gen.saver.uid == session.uid:
        return True
    if not _privileged(core, session.uid):
        return False
    return gen.saver is None or _privileged(core, gen.saver.uid)


def check_may_save(core: Holder, session: Requester, key: tuple[str, str]) -> None:
    """Refuse a save over a path that another user holds in the cache (call under the lock)."""
    if _privileged(core, session.uid):
        return
    for gen in core.index.generations(key):
        if gen.saver is None or gen.saver.uid != session.uid:
            raise PathNotAllowed(
                f"{key[1]!r} (namespace {key[0]!r}) is held in the cache by another user; "
                "save under another path or namespace"
            )


def write_record(segment: Segment, saver: Saver) -> None:
    """Keep the saver where a restarted daemon finds it and no client can write it."""
    records.write(segment, _RECORD_OFFSET, _RECORD.pack(_MAGIC, saver.uid, saver.gid, saver.umask))


def read_record(segment: Segment, daemon_uid: int) -> Saver:
    """The saver of a segment adopted at start.

    The record is the daemon's own (:mod:`ckptcache.server.memory.records`); it is checked all the
    same, so that no record, however it came to be, gives more than the file's owner has: its
    uid is believed only when it agrees with who owns the file (an admitted user's segments
    are that user's files), and its gid only when that user is a member of the group (a
    forged gid would let a root daemon write into that group's directories for the user); an
    unbelievable or missing record gives the file's owner with the most private umask, an
    unbelievable gid the user's primary group.
    """
    page = records.page(segment)
    if page is None:
        return Saver(segment.owner, -1, 0o077)
    magic, uid, gid, umask = _RECORD.unpack_from(page, _RECORD_OFFSET)
    owner_ok = uid == segment.owner or (segment.owner == daemon_uid and uid == 0)
    if magic != _MAGIC or not owner_ok or not 0 <= umask <= 0o777:
        return Saver(segment.owner, -1, 0o077)
    if segment.owner != daemon_uid and gid >= 0:
        primary = _primary(uid)
        if gid not in groups_of(uid, primary):
            gid = primary
    return Saver(uid, gid, umask)


def _primary(uid: int) -> int:
    try:
        return pwd.getpwuid(uid).pw_gid
    except KeyError:
        return -1
