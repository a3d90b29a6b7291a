"""Text from outside (paths, node ids, error messages) made safe to print on one line.

A path is any bytes but ``/`` and NUL: one holding ESC (``\\x1b]...``) or a line break would
recolour, retitle or forge lines of a terminal or a log that shows it raw. :func:`escape`
writes every control character (C0 and C1, DEL, and Unicode's line and paragraph
separators) as Python's escape (``\\n``, ``\\x1b``, ``\\u2028``); a tab is kept. The daemon's
log (:mod:`ckptcache.server.logsafe`) and the command line's tables use it.
"""

from __future__ import annotations

__all__ = ["escape"]

_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F, *range(0x80, 0xA0))}
_ESCAPES.update({ord("\n"): "\\n", ord("\r"): "\\r", 0x2028: "\\u2028", 0x2029: "\\u2029"})
del _ESCAPES[ord("\t")]


def escape(text: str) -> str:
    """``text`` with every character that could break or recolour a line escaped."""
    return text.translate(_ESCAPES)
