"""Read-through files: the bytes of a checkpoint file the cache holds, before it is a file.

A save returns after phase 1, so for a while (for ever, under no persist root) the newest
generation of a path lives only in the daemon's memory. Tools that read the file themselves
(``torch.load(path)``, a DCP reader seeking to an item's offset, ``zipfile``) can read it
through :func:`ckptcache.open` instead of waiting for persistence::

    torch.load(ckptcache.open(path), weights_only=True)

What :func:`ckptcache.open` returns, by where the newest generation is:

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

The other way round, :func:`write_from_memory` writes such a generation to its file exactly as
the daemon persists it (for adapters whose frameworks read the files right after a save), and
:class:`BlobFile` serves a packed blob a load returned as the bytes of its file.
"""

from __future__ import annotations

import builtins
import io
import os
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, Any, cast

from ckptcache._atomic import atomic_write
from ckptcache.client._paths import is_url
from ckptcache.codec.stored_load import read_verified
from ckptcache.errors import CheckpointNotFound, DaemonUnavailable
from ckptcache.format.archive import ViewReader
from ckptcache.format.layout import HEADER_SIZE, SegmentHeader
from ckptcache.format.persisted import stream_archive
from ckptcache.storage import backend_for
from ckptcache.storage.handoff import Gather
from ckptcache.wire.messages import ObjectInfo

if TYPE_CHECKING:
    import torch

    from ckptcache.client._client import Client

__all__ = ["BlobFile", "CachedFile", "open_checkpoint", "write_from_memory"]


def _payload(view: memoryview) -> memoryview:
    """The ``torch.save`` archive in a segment (its header says where)."""
    header = SegmentHeader.unpack(view[:HEADER_SIZE])
    return view[header.payload_offset : header.payload_offset + header.payload_size]


class CachedFile(ViewReader):
    """A read-only, seekable binary file over a cached generation (see the module docstring).

    ``name`` is the checkpoint's path, ``generation`` the generation it shows, ``size`` its
    length in bytes. Close it (or use ``with``) to let the daemon reuse the memory.
    """

    mode = "rb"

    def __init__(self, path: str, mapping: Any, generation: int):
        view = memoryview(mapping)
        payload = _payload(view)
        super().__init__(payload)
        view.release()
        self.name = path
        self.generation = generation
        self.size = len(payload)
        self._mapping = mapping  # the pin lives as long as the mapping

    def close(self) -> None:
        if not self.closed:
            self._view.release()
            self._mapping = None
        super().close()

    def __repr__(self) -> str:
        return f"<ckptcache.CachedFile {self.name!r} generation={self.generation}>"


class BlobFile(ViewReader):
    """A read-only file over a packed blob (:meth:`Client.save_packed`) as a load returned it:
    its bytes are those of the persisted file from the blob's offset on, served from memory
    without a copy (a read before that offset raises ``OSError``)."""

    def __init__(self, blob: torch.Tensor):
        from ckptcache.codec.packing import storage_offsets

        view = blob.numpy().data if blob.numel() else memoryview(b"")
        super().__init__(view, storage_offsets(blob)[0])
        self._blob = blob  # keeps the mapping alive


def _held_unpersisted(client: Client, path: str) -> ObjectInfo | None:
    """The daemon's newest generation of ``path`` if it is in memory and not yet persisted."""
    try:
        info = client.status(path)
    except (CheckpointNotFound, DaemonUnavailable):
        return None
    if "local" not in info.stages or "persisted" in info.stages:
        return None
    return info


def open_checkpoint(client: Client, path: str, verify: bool = True) -> IO[bytes]:
    """The newest generation of ``path`` (normalized) as a binary file: from ``client``'s
    daemon when it is not yet a file, else from storage, checked unless ``verify=False``
    (see the module docstring; :func:`ckptcache.open` is the public entry)."""
    if _held_unpersisted(client, path) is not None:
        try:
            mapping, reply = client.map_local(path)
        except CheckpointNotFound:
            pass  # dropped or evicted since: storage is what is left
        else:
            return cast(IO[bytes], CachedFile(path, mapping, reply.generation))
    return _open_stored(path, verify)


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
        if not is_url(path):
            return builtins.open(path, "rb")
        return backend_for(path).open_read(path)
    except FileNotFoundError as e:
        raise CheckpointNotFound(
            f"{path!r} is neither in the memory of this node's cache nor in storage"
        ) from e


def _sink(f: Any) -> Callable[[memoryview | bytes], None]:
    """``f.write`` as the sink :func:`stream_archive` takes (its result dropped)."""

    def write(chunk: memoryview | bytes) -> None:
        f.write(chunk)

    return write


def write_from_memory(client: Client, info: ObjectInfo) -> None:
    """Write the newest generation of ``info.path`` from the daemon's memory to its file,
    exactly as the daemon persists it: the segment's ``torch.save`` archive streamed once,
    with its zip CRC-32s and digest record filled in (no unpickling, no device placement of
    the tensors, the bytes any later persist would write), temp + fsync + rename, stamped with
    the generation's commit time as the daemon stamps what it persists. A URL gets one
    whole-object write (a store has no rename), as the client's write-through does."""
    mapping, _ = client.map_local(info.path)
    view = memoryview(mapping)
    archive = _payload(view)
    stamp = round(info.committed * 1e9)
    try:
        if is_url(info.path):
            buf = io.BytesIO()
            stream_archive(archive, _sink(buf), path=info.path)
            backend_for(info.path).write_bytes(info.path, buf.getbuffer())
            return

        def write(f: Any) -> None:
            gather = Gather(_sink(f))  # a header or descriptor per call otherwise
            stream_archive(archive, gather.write, path=info.path)
            gather.flush()
            f.flush()
            os.utime(f.fileno(), ns=(stamp, stamp))

        atomic_write(info.path, write)
    finally:
        archive.release()
        view.release()
        del mapping  # the last reference: unmapped, and the daemon's pin released
