"""Manifests decoded once per save plan: a repeated save's commit checks bytes, not records.

A trainer saves the same structure again and again, and each commit's manifest (thousands of
storage records, the tensor table) is then the one the daemon decoded and checked last time,
but for its path, namespace and creation time. Decoding and checking it again costs time per
record, on the save's critical path (``benchmarks/save_load/README.md``). Here the daemon keeps the
manifests it decoded in full, and accepts a new one from them only where its bytes prove it
equal:

* an entry is made only from a manifest whose bytes are exactly what
  :meth:`~ckptcache.format.manifest.Manifest.to_json` writes for the decoded manifest (the
  canonical text), so the place of every field in those bytes is known;
* a manifest matches an entry when its bytes are that text with only the path and namespace
  (each written as :func:`json.dumps` writes the reservation's own, which the commit requires
  anyway) and the creation time (one JSON number, checked by a strict pattern) replaced. Each
  replacement is one complete JSON token, so the bytes decode to the entry's manifest with
  those three values replaced: what a full decode would return;
* the checks that depend on the segment (its size) are made again for every commit;
* the canonical check (an encode, as costly as the decode) is made only once a manifest is
  likely to repeat: a manifest decoded in full is kept aside as a candidate, and made an
  entry when a later one, matching no entry, is about as long. A save whose structure never
  repeats pays the decode alone, as before the memo.

Anything else (another plan, other bytes, text our encoder would not write) is decoded and
checked in full, exactly as before: a client that lies in its manifest gains nothing from the
memo. The bytes are read from the segment once, after it is sealed, and only that copy is used.
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass

from ckptcache.errors import CorruptCheckpoint
from ckptcache.format.manifest import Manifest

__all__ = ["ManifestMemo"]

#: A JSON number as ``json.dumps`` writes a float or int (no NaN, Infinity or whitespace).
_NUMBER = re.compile(rb"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
_dumps = json.dumps


@dataclass(frozen=True)
class _Entry:
    manifest: Manifest
    #: The canonical text from after the namespace's value up to the creation time's value
    #: (``,"payload_offset":...,"created":``), and from after that value to the end.
    middle: bytes
    tail: bytes


def _head(path: str, namespace: str) -> bytes:
    """The canonical text up to the namespace's value, inclusive."""
    return b'{"path":' + _dumps(path).encode() + b',"namespace":' + _dumps(namespace).encode()


class ManifestMemo:
    """The last ``size`` manifests decoded in full, to accept their repeats from their bytes
    (see the module docstring). Safe to share between the daemon's threads."""

    def __init__(self, size: int = 8, max_bytes: int = 8 << 20):
        self._size, self._max_bytes = size, max_bytes
        self._entries: list[_Entry] = []  # newest last
        #: Manifests decoded in full and their bytes, not checked canonical yet: newest last.
        self._candidates: list[tuple[Manifest, bytes]] = []
        self._lock = threading.Lock()
        #: Commits accepted from an entry, and manifests decoded in full (for tests).
        self.hits = 0
        self.misses = 0

    def decode(self, data: bytes, *, path: str, namespace: str, segment_size: int) -> Manifest:
        """The manifest ``data`` encodes, as :meth:`Manifest.from_json` decodes and checks it
        against ``segment_size``; ``path`` and ``namespace``: what the reservation says (a
        manifest that names others is decoded in full and refused by the caller)."""
        head = _head(path, namespace)
        if data.startswith(head):
            with self._lock:
                entries = list(self._entries)
            found = _first_match(reversed(entries), data, len(head), path, namespace)
            if found is None:  # the candidates are checked only where no entry matched
                found = _first_match(self._promoted(data), data, len(head), path, namespace)
            if found is not None:
                _check_segment(found, segment_size)
                self.hits += 1
                return found
        # Its records are made when first read (the digests, the persist: after the commit's
        # reply), not in the commit: every one is checked here all the same.
        manifest = Manifest.from_json(data, segment_size=segment_size, keep_columns=True)
        self.misses += 1
        if len(data) <= self._max_bytes:
            with self._lock:
                self._candidates.append((manifest, data))
                del self._candidates[: -self._size]
        return manifest

    def _promoted(self, data: bytes) -> list[_Entry]:
        """The entries made of the candidates whose last bytes ``data`` ends with (likely the
        same plan), which leave the candidates: the canonical check, once per plan."""
        with self._lock:
            alike: list[tuple[Manifest, bytes]] = []
            rest: list[tuple[Manifest, bytes]] = []
            for candidate in self._candidates:
                (alike if abs(len(candidate[1]) - len(data)) <= _SLACK else rest).append(candidate)
            self._candidates = rest
        made = [e for e in (_entry_of(m, d) for m, d in alike) if e is not None]
        with self._lock:
            for entry in made:
                self._entries = [e for e in self._entries
                                 if e.middle != entry.middle or e.tail != entry.tail]  # fmt: skip
                self._entries.append(entry)
            del self._entries[: -self._size]
        return made


#: How much longer or shorter than a candidate a repeat of its plan may be (its path,
#: namespace and time differ): the cheap sign that makes a candidate worth the canonical
#: check. A wrong guess costs one encode, once: a checked candidate leaves the candidates.
_SLACK = 512


def _entry_of(manifest: Manifest, data: bytes) -> _Entry | None:
    """The entry of ``manifest`` decoded from ``data``, or None where ``data`` is not our
    encoder's text of it (where each field lies is then not known)."""
    if manifest.to_json() != data:
        return None
    head = _head(manifest.path, manifest.namespace)
    created = _dumps(manifest.created).encode()
    tail = b',"digest_algorithm":' + data.rsplit(b',"digest_algorithm":', 1)[-1]
    middle = data[len(head) : len(data) - len(tail) - len(created)]
    if not middle.endswith(b',"created":') or head + middle + created + tail != data:
        return None
    return _Entry(manifest, middle, tail)


def _first_match(
    entries: Iterable[_Entry], data: bytes, start: int, path: str, namespace: str
) -> Manifest | None:
    """The manifest of the first of ``entries`` that ``data`` matches (see :func:`_matched`)."""
    for entry in entries:
        manifest = _matched(entry, data, start, path, namespace)
        if manifest is not None:
            return manifest
    return None


def _matched(entry: _Entry, data: bytes, start: int, path: str, namespace: str) -> Manifest | None:
    """``entry``'s manifest with this path, namespace and creation time, if ``data`` (whose
    first ``start`` bytes are the head of ``path`` and ``namespace``) is its text with only
    those replaced; else ``None``."""
    middle, tail = entry.middle, entry.tail
    end = len(data) - len(tail)
    if not data.startswith(middle, start) or not data.endswith(tail):
        return None
    number = data[start + len(middle) : end]
    if end < start + len(middle) or _NUMBER.fullmatch(number) is None:
        return None
    created = json.loads(number)
    return dataclasses.replace(entry.manifest, path=path, namespace=namespace, created=created)


def _check_segment(manifest: Manifest, segment_size: int) -> None:
    """The one check of :meth:`Manifest.from_json` that depends on the segment, not the
    bytes (with its error)."""
    if manifest.payload_offset + manifest.payload_size > segment_size:
        raise CorruptCheckpoint(
            "invalid segment manifest: payload larger than the segment", tier="local"
        )
