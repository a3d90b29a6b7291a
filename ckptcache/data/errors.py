"""Errors of the batch cache, under ckptcache's root error and the built-in a caller catches."""

from __future__ import annotations

from ckptcache.errors import CkptCacheError

__all__ = ["BatchLoadError", "BatchTimeout", "LoaderDied"]


class BatchTimeout(CkptCacheError, TimeoutError):
    """A batch did not appear in the cache within the timeout (the loading rank is too slow,
    hung, or gone)."""


class LoaderDied(BatchTimeout):
    """The loading rank's process is dead (or frozen) and the batch is not cached: waiting
    longer cannot help. The message names the loader's pid."""

    def __init__(self, message: str, *, pid: int):
        super().__init__(message)
        #: Process id of the loading rank recorded in its lease file.
        self.pid = pid


class BatchLoadError(CkptCacheError, RuntimeError):
    """The real data loader raised while the loading rank prefetched; readers see the
    loader's message, the loading rank the original exception as ``__cause__``."""
