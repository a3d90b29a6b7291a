"""One ranged GET's body, read piece by piece and shut from another thread when it stalls
(:class:`ckptcache.storage.reporting.RangeStream`)."""

from __future__ import annotations

import contextlib
from typing import Any

__all__ = ["S3Range"]


class S3Range:
    """The body of a ranged GET (botocore's ``StreamingBody``)."""

    def __init__(self, body: Any, what: str):
        self._body = body
        self._what = what

    def read(self, n: int) -> bytes:
        """The next ``n`` bytes (fewer only at the end); an ``OSError`` once shut."""
        try:
            return bytes(self._body.read(n))
        except OSError:
            raise
        except Exception as e:  # urllib3/botocore errors of a connection shut under the read
            raise OSError(f"{self._what}: {type(e).__name__}: {e}") from e

    def abort(self) -> None:
        """Shut the connection under the body: a read blocked on it in another thread
        returns at once (urllib3's ``HTTPResponse.shutdown``, 2.3 and later). Without it the
        blocked read ends at the client's read timeout; the reader refuses its bytes either
        way (:mod:`ckptcache.format.hedged_read`)."""
        raw = getattr(self._body, "_raw_stream", None)
        shutdown = getattr(raw, "shutdown", None)
        if callable(shutdown):
            with contextlib.suppress(Exception):  # already closed or finished
                shutdown()

    def close(self) -> None:
        """Release the connection (from the reading thread)."""
        with contextlib.suppress(Exception):
            self._body.close()
