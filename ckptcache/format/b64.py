"""Strict base64 decoding of a manifest's packed fields (the records' columns, the tensor
table), by the ``_b64`` extension where it is built: faster than binascii, whose decoding is a
visible part of a zero-copy load of thousands of tensors (``docs/per-tensor-cost.md``).

:func:`decode` accepts exactly what ``base64.b64decode(text, validate=True)`` accepts, and
raises its error (with binascii's own message) for anything else: the extension decodes
base64 as ``b64encode`` writes it, and hands anything else to binascii.
"""

from __future__ import annotations

import base64
from collections.abc import Callable

__all__ = ["IMPLEMENTATION", "decode"]


def _native() -> Callable[[str | bytes], bytes] | None:
    try:
        from ckptcache.format import _b64
    except ImportError:
        return None
    return _b64.decode


_NATIVE = _native()
#: Which decoder runs: ``"native"`` (the extension) or ``"binascii"``.
IMPLEMENTATION = "binascii" if _NATIVE is None else "native"


def decode(text: str | bytes) -> bytes:
    """The bytes of the strict base64 ``text``; ``binascii.Error`` where it is not (and
    ``ValueError`` for a ``str`` that is not ASCII), as ``base64.b64decode``."""
    if _NATIVE is not None and type(text) in (str, bytes):
        try:
            return _NATIVE(text)
        except ValueError:
            pass  # binascii says what is wrong, in its words
    return base64.b64decode(text, validate=True)
