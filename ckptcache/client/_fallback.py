"""The write-through fallback: with the daemon gone or full, a save becomes ``torch.save`` to
its path, whole or not at all, and is reported (never silently) unless the client was asked to
raise instead."""

from __future__ import annotations

import errno
import io
import logging
import warnings
from typing import TYPE_CHECKING, Any

from ckptcache import errors
from ckptcache._defaults import fallback_log_every
from ckptcache.client._connection import Connection
from ckptcache.client._ledger import Ledger
from ckptcache.client._paths import is_url
from ckptcache.client._settings import Settings
from ckptcache.errors import CkptCacheWarning, DaemonUnavailable
from ckptcache.storage import backend_for
from ckptcache.wire import messages as m

if TYPE_CHECKING:
    from ckptcache.client._async import VersionCheck

__all__ = ["WriteThrough"]

log = logging.getLogger("ckptcache.client")


class WriteThrough:
    """Writes saves the daemon could not take straight to storage, and counts them."""

    def __init__(self, settings: Settings, connection: Connection, ledger: Ledger):
        self._settings = settings
        self._connection = connection
        self._ledger = ledger
        #: Saves written straight to storage because the daemon was gone or full.
        self.count = 0
        self._warned: set[str] = set()

    def write(
        self,
        obj: Any,
        path: str,
        reason: errors.CkptCacheError,
        *,
        check: VersionCheck | None = None,
    ) -> None:
        """Write ``obj`` to ``path`` with ``torch.save``, whole or not at all: a failed write
        (a crash, a full disk, ``check`` raising :class:`~ckptcache.errors.TensorMutated`)
        leaves the previous file and the cached generations as they were. With the client's
        ``fallback="raise"``, ``reason`` is raised instead."""
        import torch

        from ckptcache._atomic import atomic_write

        if self._settings.fallback == "raise":
            raise reason
        self.count += 1
        self._report(path, reason)

        def write(f: Any) -> None:
            torch.save(obj, f)
            if check is not None:
                check.check()  # before the rename: a torn object never replaces a good one

        try:
            if is_url(path):
                buf = io.BytesIO()
                write(buf)
                backend_for(path).write_bytes(path, buf.getbuffer())
            else:
                atomic_write(path, write)
        except OSError as e:
            typed = _cannot_write(path, e)
            if typed is e:
                raise
            raise typed from e
        # Only now that the new file is in place may the older generations go.
        self._supersede(path)

    def _report(self, path: str, reason: errors.CkptCacheError) -> None:
        # One message per event, never a warning and a log line for the same write: the
        # first of each cause is a CkptCacheWarning (aimed at the script's author: it names
        # their line, and -W error::ckptcache.CkptCacheWarning turns it into a failure); the
        # repeats, which a warning filter would hide, are counted in a log line.
        if type(reason).__name__ not in self._warned:  # once per client and cause
            self._warned.add(type(reason).__name__)
            warnings.warn(
                f"ckptcache: writing {path!r} straight to storage with torch.save ({reason}); "
                "set CKPTCACHE_REQUIRE=1 to fail instead",
                CkptCacheWarning,
                stacklevel=7,  # the caller of Client.save
            )
        elif self.count % fallback_log_every() == 0:  # repeats stay visible: every N-th
            log.warning(
                "ckptcache: %d save(s) written through to storage without the cache, last %r "
                "(%s); set CKPTCACHE_REQUIRE=1 to fail instead",
                self.count, path, reason,
            )  # fmt: skip

    def _supersede(self, path: str) -> None:
        """The file just written is the newest save: the daemon must forget older generations
        (a load from memory, or a later persist, would otherwise bring them back)."""
        request = m.SupersedeRequest(self._settings.namespace, path)
        try:
            self._connection.call("supersede", request, m.DeleteReply)
        except DaemonUnavailable:
            pass  # a restarted daemon compares with storage itself (docs/guarantees.md)
        self._ledger.wrote_through(path)


#: What a write-through that the path itself refuses raises: the errors a daemon's save of
#: the same path raises at its reservation.
_REFUSALS: dict[int, type[errors.CannotPersist]] = {
    errno.EISDIR: errors.PathIsADirectory,
    errno.ENOTDIR: errors.ParentNotADirectory,
    errno.ENAMETOOLONG: errors.NameTooLong,
}


def _cannot_write(path: str, e: OSError) -> OSError:
    """``e`` as the typed error a save of ``path`` through the daemon raises (the path is a
    directory, a parent is a file, a name too long), else ``e`` itself."""
    kind = _REFUSALS.get(e.errno or 0)
    if kind is None or isinstance(e, errors.CkptCacheError):
        return e
    return kind(f"cannot save {path!r} (written through, no daemon): {e.strerror}")
