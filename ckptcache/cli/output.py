"""How the ``ckptcache`` command writes: aligned tables for people, JSON for machines, and
errors in the form the caller asked for (``--json``: a JSON object on stdout)."""

from __future__ import annotations

import dataclasses
import datetime
import json
import re
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["emit", "emit_error", "plain", "table", "when"]

_LITERAL = re.compile(r"``(.+?)``")


def plain(text: str) -> str:
    """``text`` without reST literal markup (docstrings double as ``--help`` text)."""
    return _LITERAL.sub(r"\1", text)


def table(rows: Sequence[Sequence[str]], headers: Sequence[str]) -> str:
    """Left-aligned columns, two spaces apart, no trailing blanks."""
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows, strict=False)]
    lines = ["  ".join(str(h).ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def when(ts: float) -> str:
    """A wall-clock time in local time ("-" for none)."""
    return datetime.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S") if ts else "-"


def _jsonable(data: Any) -> Any:
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        return dataclasses.asdict(data)
    if isinstance(data, list):
        return [_jsonable(d) for d in data]
    return data


def emit(as_json: bool, data: Any, text: str) -> None:
    """Print ``data`` as JSON, or ``text``."""
    print(json.dumps(_jsonable(data), indent=2, default=str) if as_json else text)


def emit_error(as_json: bool, error: BaseException | str, code: int) -> None:
    """Report a failure: ``{"error": {"type", "message", "exit_code"}}`` on stdout with
    ``--json`` (where the caller's parser reads), else ``ckptcache: message`` on stderr."""
    message = str(error)
    kind = type(error).__name__ if isinstance(error, BaseException) else "UsageError"
    if as_json:
        body = {"error": {"type": kind, "message": message, "exit_code": code}}
        print(json.dumps(body, indent=2))
    else:
        print(f"ckptcache: {message}", file=sys.stderr)
