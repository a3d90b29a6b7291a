"""Saves in flight, for the daemon's background work to wait for.

A checkpoint is several files saved back to back (DeepSpeed's model and optimizer files, a
Megatron rank's shards, the ranks of a node). The digest and the persist of the first file
started at its commit would run beside the next file's save: on few cores their work takes
the interpreter lock from the daemon's request threads (the next file's ``reserve`` waits)
and the cores from the trainer's copy (``benchmarks/frameworks/README.md``). They are
background
work: the digester and the persist workers wait, before each generation, until no save is in
flight and none ended for a moment, at most a second after the generation's commit (a node
that never stops saving, or a save that never ends, still digests and persists). A caller
that needs digests at once (a verified load, a backup push) computes them itself, without
waiting.
"""

from __future__ import annotations

import threading
import time

__all__ = ["MAX_WAIT_SECONDS", "SETTLE_SECONDS", "SavesInFlight"]

#: After the last save ended, the next file of the checkpoint comes within this (a
#: framework's own work between its files is short); a persist waits this much longer for it.
SETTLE_SECONDS = 0.01
#: The longest one generation's background work waits for saves to pause.
MAX_WAIT_SECONDS = 1.0


class SavesInFlight:
    """Counts the reservations open (reserved, not yet committed or aborted)."""

    def __init__(self) -> None:
        self._ended = threading.Condition(threading.Lock())
        self._open = 0
        self._last_end = float("-inf")  # monotonic

    def begin(self) -> None:
        """A reservation was made."""
        with self._ended:
            self._open += 1

    def end(self, count: int = 1) -> None:
        """``count`` reservations were committed, aborted or dropped with their connection."""
        if count <= 0:
            return
        with self._ended:
            self._open = max(0, self._open - count)
            self._last_end = time.monotonic()
            self._ended.notify_all()

    @property
    def open(self) -> int:
        """How many reservations are open now."""
        return self._open

    def wait_quiet(self, settle: float = SETTLE_SECONDS, most: float = MAX_WAIT_SECONDS) -> bool:
        """Wait until no reservation is open and none ended in the last ``settle`` seconds,
        at most ``most`` seconds; whether saves paused (``False``: the wait ran out)."""
        deadline = time.monotonic() + most
        with self._ended:
            while True:
                now = time.monotonic()
                if self._open == 0 and now - self._last_end >= settle:
                    return True
                if now >= deadline:
                    return False
                until = deadline if self._open else min(deadline, self._last_end + settle)
                self._ended.wait(max(0.0, until - now))

    def wait_after(self, committed: float) -> bool:
        """:meth:`wait_quiet` for the background work of a generation committed at
        ``committed`` (wall clock): at most until :data:`MAX_WAIT_SECONDS` after its commit,
        so work queued behind a save that never ends is not held up one wait after another.
        Never longer than that bound: a copy's commit time comes from another node's clock,
        which may be ahead of this one."""
        left = MAX_WAIT_SECONDS - (time.time() - committed)
        return self.wait_quiet(most=min(MAX_WAIT_SECONDS, max(0.0, left)))
