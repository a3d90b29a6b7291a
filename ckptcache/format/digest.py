"""Content digests shared by every tier (segments, persisted files, peer transfers)."""

from __future__ import annotations

import xxhash

__all__ = ["DIGEST_ALGORITHM", "digest_bytes", "digest_hex"]

#: Name recorded in manifests so a future change of algorithm is detectable.
DIGEST_ALGORITHM = "xxh3_64"


def digest_bytes(data: bytes | bytearray | memoryview) -> int:
    """Return the xxh3-64 digest of ``data`` as an unsigned int (zero-copy on memoryviews)."""
    return xxhash.xxh3_64_intdigest(data)


def digest_hex(value: int) -> str:
    """Format a digest the way manifests, logs and errors print it."""
    return f"{value:016x}"
