"""Errors raised by checkpointless recovery."""

from __future__ import annotations

from ckptcache.errors import CkptCacheError

__all__ = ["RecoveryError"]


class RecoveryError(CkptCacheError, RuntimeError):
    """Peer recovery was not feasible or failed, and no fallback was given to take over.

    ``reason`` is the same text a :class:`~ckptcache.recovery.RecoveryResult` would carry;
    it is identical on every rank of the replica group, so any rank's log explains the decision.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(
            f"checkpointless recovery failed: {reason}. Pass fallback= (for example "
            "lambda: ckptcache.load(path)) to resume from the last checkpoint instead."
        )
        #: Why recovery did not happen (same wording as ``RecoveryResult.reason``).
        self.reason = reason
