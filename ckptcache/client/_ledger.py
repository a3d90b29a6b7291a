"""What a client saved, and where it went: what ``wait()`` with no path waits for, and which
paths are persisted whatever the daemon says."""

from __future__ import annotations

__all__ = ["Ledger"]


class Ledger:
    """The paths this client saved through the daemon, and those written through to storage.

    It is also the owner its non-blocking saves are filed under (``pending_saves(ledger)``).
    """

    def __init__(self) -> None:
        #: Paths this client saved through the daemon (what ``wait()`` waits for).
        self.saved: set[str] = set()
        #: Paths whose newest save by this client was written straight to storage: persisted,
        #: whatever the daemon says (or whether it answers at all).
        self.written_through: set[str] = set()

    def committed(self, path: str) -> None:
        """The daemon holds this client's newest save of ``path``."""
        self.saved.add(path)
        self.written_through.discard(path)

    def wrote_through(self, path: str) -> None:
        """This client's newest save of ``path`` is the file in storage."""
        self.saved.discard(path)
        self.written_through.add(path)

    def disown(self) -> None:
        """In a forked child: the parent's saves are not ours to wait for."""
        self.saved = set()
        self.written_through = set()
