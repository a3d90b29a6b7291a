"""Read-through files: the bytes of a checkpoint file the cache holds, before it is a file.

A save returns after phase 1, so for a while (for ever, under no persist root) the newest
generation of a path lives only in the daemon's memory. Tools that read the file themselves
(``torch.load(path)``, a DCP reader seeking to an item's offset, ``zipfile``) can read it
through :func:`open` instead of waiting for persistence::

    torch.load(ckptcache.open(path), weights_only=True)

What :func:`open` returns, by where the newest generation is:

* held by this node's daemon and **not yet persisted**: a :class:`CachedFile`, a seekable
  read-only file over the daemon's segment (no copy: the pages are mapped). Its bytes are the
  ``torch.save`` archive the daemon will persist, record for record at the same offsets. Until
  the daemon persists it, the archive's zip CRC-32 fields read 0 (the save computes none) and
  the digest record ``.ckptcache/digests.json`` is not there yet; ``torch.load`` and DCP's
  readers check neither, ``zipfile`` checks the CRC-32 when a member is read to its end.
* persisted, or not held by the daemon: the file in storage. Its bytes cross a tier, so they
  are checked (``verify=True``, the default) as they are read into this process's memory,
  every record against the digest record (or its zip CRC-32) and the zip structure against its
  digest: damage raises :class:`ckptcache.CorruptCheckpoint` naming the file, the storage tier
  and the tensor, before the caller reads a byte. The file returned is an
  ``io.BufferedReader`` over those checked bytes (it holds the whole object in memory until
  closed). ``verify=False`` returns the stored file itself, unchecked, as
  ``open(path, "rb")`` (or the storage backend, for a URL) gives it; so does a file that is no
  zip archive (a legacy ``torch.save`` file: nothing to check it against).
* neither: :class:`ckptcache.CheckpointNotFound` (a ``FileNotFoundError``).

The view pins its generation: a later save of the same path does not change what an open
view reads, and the daemon keeps the segment until the view is closed (or collected).
"""

from __future__ import annotations

import builtins
import io
import os
from typing import IO, Any, cast

from ckptcache.client import Client, normalize_path
from ckptcache.errors import CheckpointNotFound, DaemonUnavailable
from ckptcache.format.archive import ViewReader
from ckptcache.format.layout import HEADER_SIZE, SegmentHeader
from ckptcache.format.persisted import read_verified
from ckptcache.storage import backend_for
from ckptcache.wire.messages import ObjectInfo

__all__ = ["CachedFile", "open"]


class CachedFile(ViewReader):
    """A read-only, seekable binary file over a cached generation (see the module docstring).

    ``name`` is the checkpoint's path, ``generation`` the generation it shows, ``size`` its
    length in bytes. Close it (or use ``with``) to let the daemon reuse the memory.
    """

    mode = "rb"

    def __init__(self, path: str, mapping: Any, generation: int):
        view = memoryview(mapping)
        header = SegmentHeader.unpack(view[:HEADER_SIZE])
        super().__init__(view[header.payload_offset : header.payload_offset + header.payload_size])
        view.release()
        self.name = path
        self.generation = generation
        self.size = header.payload_size
        self._mapping = mapping  # the pin lives as long as the mapping

    def close(self) -> None:
        if not self.closed:
            self._view.release()
            self._mapping = None
        super().close()

    def __repr__(self) -> str:
        return f"<ckptcache.CachedFile {self.name!r} generation={self.generation}>"


def _held_unpersisted(client: Client, path: str) -> ObjectInfo | None:
    """The daemon's newest generation of ``path`` if it is in memory and not yet persisted."""
    try:
        info = client.status(path)
    except (CheckpointNotFound, DaemonUnavailable):
        return None
    if "local" not in info.stages or "persisted" in info.stages:
        return None
    return info


def open(  # the name reads like builtins.open, which this module calls as builtins.open
    path: str | os.PathLike[str],
    mode: str = "rb",
    *,
    client: Client | None = None,
    verify: bool = True,
) -> IO[bytes]:
    """Open the newest generation of ``path`` for reading, from memory when it is not yet a
    file (see the module docstring). Only ``mode="rb"`` is supported: the cache stores
    binary checkpoints and writes go through :func:`ckptcache.save`. A stored file is checked
    as it is read unless ``verify=False`` (this node's memory is served as it is)."""
    if mode not in ("rb", "br"):
        raise ValueError(f"ckptcache.open reads binary files only: mode must be 'rb', not {mode!r}")
    if client is None:
        from ckptcache.api import default_client

        client = default_client()
    name = normalize_path(path)
    if _held_unpersisted(client, name) is not None:
        try:
            mapping, reply = client.map_local(name)
        except CheckpointNotFound:
            pass  # dropped or evicted since: storage is what is left
        else:
            return cast(IO[bytes], CachedFile(name, mapping, reply.generation))
    return _open_stored(name, verify)


class _CheckedBytes(ViewReader):
    """The raw file under the reader :func:`_open_stored` returns: a stored object's bytes,
    checked, in this process's memory."""

    def __init__(self, path: str, mapping: Any):
        super().__init__(memoryview(mapping))
        self.name = path
        self._mapping = mapping

    def close(self) -> None:
        if not self.closed:
            self._view.release()
            self._mapping.close()
        super().close()


def _open_stored(path: str, verify: bool) -> IO[bytes]:
    try:
        checked = read_verified(path) if verify else None
        if checked is not None:
            return io.BufferedReader(_CheckedBytes(path, checked))
        if "://" not in path:
            return builtins.open(path, "rb")
        return backend_for(path).open_read(path)
    except FileNotFoundError as e:
        raise CheckpointNotFound(
            f"{path!r} is neither in the memory of this node's cache nor in storage"
        ) from e
