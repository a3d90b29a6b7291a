"""Manifests decoded once per save plan: a repeated save's commit checks bytes, not records.

A trainer saves the same structure again and again, and each commit's manifest (thousands of
storage records, the tensor table) is then the one the daemon decoded and checked last time,
but for its path, namespace and creation time. Decoding and checking it again cost 3-5 ms at
2,072 records and 8-17 ms at 8,288, on the save's critical path. Here the daemon keeps the
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
* the checks that depend on the segment (its size) are made again for every commit.

Anything else (another plan, other bytes, text our encoder would not write) is decoded and
checked in full, exactly as before: a client that lies in its manifest gains nothing from the
memo. The bytes are read from the segment once, after it is sealed, and only that copy is used.
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
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
            for entry in reversed(entries):
                manifest = _matched(entry, data, len(head), path, namespace)
                if manifest is not None:
                    _check_segment(manifest, segment_size)
                    self.hits += 1
                    return manifest
        manifest = Manifest.from_json(data, segment_size=segment_size)
        self.misses += 1
        if len(data) <= self._max_bytes:
            self._remember(manifest, data)
        return manifest

    def _remember(self, manifest: Manifest, data: bytes) -> None:
        if manifest.to_json() != data:
            return  # not our encoder's text: where each field lies is not known
        head = _head(manifest.path, manifest.namespace)
        created = _dumps(manifest.created).encode()
        tail = b',"digest_algorithm":' + data.rsplit(b',"digest_algorithm":', 1)[-1]
        middle = data[len(head) : len(data) - len(tail) - len(created)]
        if not middle.endswith(b',"created":') or head + middle + created + tail != data:
            return
        entry = _Entry(manifest, middle, tail)
        with self._lock:
            self._entries = [e for e in self._entries if e.middle != middle or e.tail != tail]
            self._entries.append(entry)
            del self._entries[: -self._size]


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
