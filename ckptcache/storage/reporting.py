"""Ranged reads that say how far they have got.

A group's storage read is relayed as it lands, and a relay can only send the contiguous prefix
of landed bytes. When that prefix moves only as whole ranges land, it trails the read by about
as many ranges as are read at once (each of ``n`` parallel requests gets ``1/n`` of the link,
so the first one lands last), and the first joiner idles until then
(``benchmarks/restore/README.md``). A backend whose ranged read can report its progress lets
the prefix follow the first range byte by byte instead.

Call order: :func:`read_into_reporting` (any backend; one that has no reporting read reports
the whole view once it has landed).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from ckptcache.storage.base import StorageBackend

__all__ = ["Progress", "ReportingReads", "read_into_reporting"]

#: ``progress(n)``: the first ``n`` bytes of the view are in place (``n`` only grows).
Progress = Callable[[int], None]


@runtime_checkable
class ReportingReads(Protocol):
    """A backend whose ranged read reports the bytes in place as they land."""

    def read_into_reporting(
        self, path: str, offset: int, view: memoryview, progress: Progress
    ) -> None:
        """:meth:`StorageBackend.read_into`, calling ``progress(n)`` each time the first
        ``n`` bytes of ``view`` are in place (at least once, with ``len(view)``, at the end)."""


def read_into_reporting(
    backend: StorageBackend, path: str, offset: int, view: memoryview, progress: Progress
) -> None:
    """Fill ``view`` from ``path`` at ``offset``, reporting progress as the backend can: as
    the bytes land where it has a reporting read, else once, when all have landed."""
    if isinstance(backend, ReportingReads):
        backend.read_into_reporting(path, offset, view, progress)
        return
    backend.read_into(path, offset, view)
    progress(len(view))
