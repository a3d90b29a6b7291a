"""The daemon's log format, safe against strings from outside.

Paths, node ids, peer addresses and error messages that reach the log come from trainers,
peers and storage. One holding a line break (``"ckpt\\n2026-01-01 ... ERROR forged"``) would
otherwise start a forged line that log readers and alerting take for the daemon's own. So the
formatter installed by :func:`install` escapes every control character (C0 and C1, DEL, and
Unicode's line and paragraph separators) in each record's message *after* its arguments are
substituted, and in the message part of any traceback: one record is one line, plus the
traceback's own frames. Escapes are Python's (``\\n``, ``\\x1b``, ``\\u2028``); a tab is
kept.
"""

from __future__ import annotations

import logging
import sys
import traceback
from collections.abc import Iterator
from types import TracebackType
from typing import IO

from ckptcache._escape import escape

__all__ = ["FORMAT", "SafeFormatter", "escape", "install"]

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _EscapedTraceback(traceback.TracebackException):
    """A traceback whose exception lines (``Type: message``, notes) are escaped; the frames
    are the interpreter's own text and keep their line breaks."""

    def format_exception_only(self) -> Iterator[str]:  # type: ignore[override]
        for line in super().format_exception_only():
            yield escape(line.rstrip("\n")) + "\n"


def _chain(te: traceback.TracebackException) -> Iterator[traceback.TracebackException]:
    """``te`` and every exception it carries (cause, context, group members)."""
    seen: set[int] = set()
    todo = [te]
    while todo:
        t = todo.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        yield t
        todo.extend(x for x in (t.__cause__, t.__context__) if x is not None)
        todo.extend(getattr(t, "exceptions", None) or ())


class SafeFormatter(logging.Formatter):
    """:class:`logging.Formatter` that escapes control characters (see the module)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return escape(super().formatMessage(record))

    def formatException(
        self,
        ei: tuple[type[BaseException], BaseException, TracebackType | None]
        | tuple[None, None, None],
    ) -> str:
        if ei[0] is None:
            return ""
        te = traceback.TracebackException(ei[0], ei[1], ei[2])
        for t in _chain(te):
            # The chained exceptions are built by the stdlib as plain TracebackExceptions;
            # giving each the escaping subclass is the only way to reach their messages.
            t.__class__ = _EscapedTraceback
        return "".join(te.format()).rstrip("\n")


def install(level: str, stream: IO[str] | None = None) -> logging.Handler:
    """Log every record at ``level`` and above to ``stream`` (stderr) through a
    :class:`SafeFormatter`, replacing the root logger's handlers; returns the handler."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(SafeFormatter(FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    return handler
