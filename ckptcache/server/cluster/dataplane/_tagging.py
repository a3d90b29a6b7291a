"""A record's Poly1305 tag, and the digests of the storages it carries: one pass in C with
the interpreter lock released where the record extension (``_records.c``) is built, two
passes in Python (``cryptography``'s Poly1305, then ``xxhash``) otherwise.

Both give the same tags and digests, so the two ends of a connection need not agree on which
they run. The extension hashes with the very xxh3 functions of the ``xxhash`` module (bound
by address below): a digest computed while a record lands equals one computed by
:func:`ckptcache.format.digest.digest_bytes` on any node.
"""

from __future__ import annotations

import ctypes
import importlib
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import xxhash
from cryptography.hazmat.primitives.poly1305 import Poly1305

__all__ = ["TAG_IMPLEMENTATION", "Xxh3", "tag", "tag_and_hash"]

#: One span of a record to hash: ``[lo, hi)`` of the record, and whether a storage ends at
#: ``hi`` (its digest is taken and the running state starts afresh).
Span = tuple[int, int, bool]


def _extension() -> ModuleType | None:
    try:
        # By name: the package's face imports this module (through ``records``), and the
        # extension is a module of the package, not a name of its face.
        _records = importlib.import_module("ckptcache.server.cluster.dataplane._records")
    except ImportError:  # not built here (no compiler or no OpenSSL headers)
        return None
    try:
        lib = ctypes.CDLL(xxhash._xxhash.__file__)  # type: ignore[attr-defined]
        # The update that picks the widest vector unit of this CPU at run time, as the
        # module's own calls do; the portable one where the build has no dispatch.
        update = "XXH3_64bits_update_dispatch"
        if not hasattr(lib, update):
            update = "XXH3_64bits_update"
        names = ("XXH3_createState", "XXH3_freeState", "XXH3_64bits_reset", update,
                 "XXH3_64bits_digest")  # fmt: skip
        addresses = [ctypes.cast(getattr(lib, name), ctypes.c_void_p).value or 0
                     for name in names]  # fmt: skip
    except (AttributeError, OSError):  # an xxhash build that does not export them
        return None
    if not all(addresses):
        return None
    _records.bind_xxh3(*addresses)
    return _records


_EXT = _extension()
#: Which code tags and hashes records: ``c-openssl`` (one pass, interpreter lock released)
#: or ``python`` (``cryptography`` then ``xxhash``, two passes).
TAG_IMPLEMENTATION = "python" if _EXT is None else "c-openssl"


class Xxh3:
    """A running xxh3-64 state that :func:`tag_and_hash` feeds across records."""

    __slots__ = ("state",)

    def __init__(self) -> None:
        self.state: Any = _EXT.xxh3_state() if _EXT is not None else xxhash.xxh3_64()


def tag(key: bytes, head: bytes, payload: Any) -> bytes:
    """The Poly1305 tag of ``head + payload`` under the 32-byte one-time ``key``."""
    if _EXT is not None:
        return _EXT.tag_and_hash(key, head, payload)[0]
    poly = Poly1305(key)
    poly.update(head)
    poly.update(payload)
    return poly.finalize()


def tag_and_hash(
    key: bytes, head: bytes, payload: memoryview, spans: Sequence[Span], state: Xxh3
) -> tuple[bytes, list[int]]:
    """The tag of ``head + payload`` (as :func:`tag`), and each span of ``payload`` fed to
    ``state`` in order: returns the tag and the digests of the spans that end a storage.

    The caller must not use the digests unless the tag checks: they are computed in the same
    pass, before the tag is known good.
    """
    if _EXT is not None:
        return _EXT.tag_and_hash(key, head, payload, spans, state.state)
    digests: list[int] = []
    running = state.state
    for lo, hi, ends in spans:
        if hi > lo:
            with payload[lo:hi] as part:
                running.update(part)
        if ends:
            digests.append(running.intdigest())
            running.reset()
    return tag(key, head, payload), digests
