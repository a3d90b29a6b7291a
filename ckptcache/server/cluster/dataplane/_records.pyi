"""Type stub of the record extension (``_records.c``), used through
``ckptcache/server/cluster/dataplane/_tagging.py``."""

from collections.abc import Sequence

from typing_extensions import Buffer

def bind_xxh3(create: int, free: int, reset: int, update: int, digest: int, /) -> None: ...
def xxh3_state() -> object: ...
def tag_and_hash(
    key: Buffer,
    head: Buffer,
    data: Buffer,
    spans: Sequence[tuple[int, int, bool]] | None = None,
    state: object = None,
    /,
) -> tuple[bytes, list[int]]: ...
