"""One cached batch = one file in ckptcache's segment format, published by rename.

Plain files are exactly a checkpoint segment (header page, torch.save-compatible archive,
manifest, digest table), so the tools and invariants of the checkpoint cache apply to them.
Encrypted files wrap such a segment image in an envelope::

    offset 0   b"CKPTENC1"
    offset 8   u64 little-endian: size of the segment image
    offset 16  nonce (12 bytes) || AES-GCM ciphertext of the image || tag (16 bytes)

Write protocol (a reader never sees a partial batch; :func:`ckptcache._atomic.atomic_write`):
create ``.tmp-<pid>-<n>`` with ``O_EXCL``, ``posix_fallocate``, map it shared, copy archive +
tensors + manifest, write the digest table, write the header (state COMMITTED, digests VALID)
last, then ``rename`` to the final name. Readers map the final file ``MAP_PRIVATE``: tensors
are zero-copy views of the one shared copy in tmpfs, and a trainer that writes into a batch
only dirties its own pages.
"""

from __future__ import annotations

import errno
import itertools
import mmap
import os
import stat
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, BinaryIO

from ckptcache._atomic import atomic_write
from ckptcache.codec.encode import encode
from ckptcache.codec.flatten import Flattened
from ckptcache.codec.objectio import read_object, write_object
from ckptcache.codec.shm import Mapping, map_shared
from ckptcache.data._crypto import NONCE_SIZE, TAG_SIZE, BatchCipher
from ckptcache.errors import ConfigError, CorruptCheckpoint
from ckptcache.format.layout import HEADER_SIZE, DigestState, SegmentHeader, SegmentState
from ckptcache.format.manifest import (
    Manifest,
    ObjectPlan,
    compute_digests,
    pack_digests,
    unpack_digests,
)

__all__ = [
    "NAMESPACE",
    "TMP_PREFIX",
    "PreparedBatch",
    "check_batch",
    "prepare_batch",
    "read_batch",
    "write_batch",
]

#: Manifest namespace of cached batches (checkpoints use the job namespace).
NAMESPACE = "ckptcache-data"
#: Temporary files are ``.tmp-<pid>-<n>``: the pid lets a later start reclaim a dead writer's.
TMP_PREFIX = ".tmp-"

_ENVELOPE = struct.Struct("<8sQ")
_ENVELOPE_MAGIC = b"CKPTENC1"
_counter = itertools.count()


def _fill(mapping: mmap.mmap, plan: ObjectPlan, flat: Flattened) -> None:
    """Lay the object out in ``mapping`` and publish its header last."""
    write_object(mapping, plan, flat)
    view = memoryview(mapping)
    try:
        digests = compute_digests(view, plan.manifest)
        off = plan.layout.digest_offset
        table = pack_digests(digests)
        view[off : off + len(table)] = table
        now = time.time_ns()
        header = SegmentHeader(
            state=SegmentState.COMMITTED, generation=0, payload_offset=HEADER_SIZE,
            payload_size=plan.archive.size, manifest_offset=plan.layout.manifest_offset,
            manifest_size=len(plan.manifest_bytes), digest_offset=off,
            n_storages=len(plan.manifest.storages), digest_state=DigestState.VALID,
            created_ns=now, committed_ns=now,
        ).pack()  # fmt: skip
        view[: len(header)] = header
    finally:
        view.release()


def _tmp_name(directory: str) -> str:
    return os.path.join(directory, f"{TMP_PREFIX}{os.getpid()}-{next(_counter)}")


def _publish(directory: str, name: str, tmp: str, write: Callable[[BinaryIO], None]) -> None:
    # Batches live in tmpfs (no disk to fsync) and are private to this user.
    atomic_write(os.path.join(directory, name), write, tmp=tmp, fsync=False, mode=0o600,
                 exclusive=True)  # fmt: skip


def _reserve(f: BinaryIO, nbytes: int) -> None:
    # Reserve the pages now: running out of tmpfs fails here, not as SIGBUS in a memcpy.
    os.posix_fallocate(f.fileno(), 0, max(nbytes, 1))


@dataclass(frozen=True)
class PreparedBatch:
    """A batch flattened and laid out, not yet written (its size is known before writing)."""

    key: str
    flat: Flattened
    plan: ObjectPlan

    @property
    def nbytes(self) -> int:
        """Bytes of the segment image (an encrypted file adds 36 bytes of envelope)."""
        return self.plan.layout.nbytes


def prepare_batch(key: str, obj: Any) -> PreparedBatch:
    """Flatten ``obj`` (no tensor bytes copied) and plan its segment under ``key``."""
    flat, plan = encode(obj, key, NAMESPACE)
    return PreparedBatch(key, flat, plan)


def write_batch(directory: str, name: str, batch: PreparedBatch, cipher: BatchCipher | None) -> int:
    """Write ``batch`` as ``directory/name`` atomically; returns the file's size in bytes."""
    key, flat, plan, nbytes = batch.key, batch.flat, batch.plan, batch.nbytes
    tmp = _tmp_name(directory)
    if cipher is None:

        def fill(f: BinaryIO) -> None:
            _reserve(f, nbytes)
            mapping = map_shared(tmp, nbytes)
            try:
                _fill(mapping, plan, flat)
            finally:
                mapping.close()

        _publish(directory, name, tmp, fill)
        return nbytes
    # Build the plaintext image in private memory: only ciphertext ever reaches tmpfs.
    image = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        _fill(image, plan, flat)
        with memoryview(image) as view:
            sealed = cipher.seal(view, key.encode())
    finally:
        image.close()
    blob = _ENVELOPE.pack(_ENVELOPE_MAGIC, nbytes) + sealed

    def put(f: BinaryIO) -> None:
        _reserve(f, len(blob))
        f.write(blob)

    _publish(directory, name, tmp, put)
    return len(blob)


def check_batch(path: str, key: str, encrypted: bool) -> bool:
    """Cheaply check that ``path`` is a committed batch for ``key`` (no digests, no unpickling).

    Used on files a previous incarnation left behind; an encrypted file is authenticated only
    when read (its key is bound into the AES-GCM tag).
    """
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER_SIZE)
            size = os.fstat(f.fileno()).st_size
            if encrypted:
                magic, nbytes = _ENVELOPE.unpack_from(head)
                return bool(
                    magic == _ENVELOPE_MAGIC
                    and size == _ENVELOPE.size + NONCE_SIZE + nbytes + TAG_SIZE
                )
            header = SegmentHeader.unpack(head)
            if header.state != SegmentState.COMMITTED or header.digest_state != DigestState.VALID:
                return False
            manifest = Manifest.from_json(
                os.pread(f.fileno(), header.manifest_size, header.manifest_offset),
                segment_size=size,
            )
    except (OSError, ValueError, struct.error, CorruptCheckpoint):
        return False
    return (manifest.namespace, manifest.path) == (NAMESPACE, key)


def _map_own(path: str) -> mmap.mmap:
    """Map the batch file ``path`` copy-on-write, after checking (on the opened file, not the
    name) that it is a regular file of this user that nobody else may write: unpickling a
    planted file could run its code. ``FileNotFoundError`` if it is not there (yet)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise ConfigError(f"cached batch {path} is a symbolic link: refusing to serve it") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"cached batch {path} is not a regular file: refusing to serve it")
        if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise ConfigError(
                f"cached batch {path} belongs to uid {st.st_uid} (mode "
                f"{stat.S_IMODE(st.st_mode):04o}), not to this user (uid {os.getuid()}) "
                "alone: it could be forged; refusing to serve it"
            )
        # PROT_WRITE on a MAP_PRIVATE mapping of a read-only fd: writes stay private.
        return Mapping(
            fd, st.st_size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
        )
    finally:
        os.close(fd)


def _open_sealed(path: str, key: str, cipher: BatchCipher) -> mmap.mmap:
    """Decrypt an envelope into a private anonymous mapping."""
    sealed = _map_own(path)
    size = len(sealed)
    try:
        with memoryview(sealed) as view:
            magic, nbytes = _ENVELOPE.unpack_from(view)
            if magic != _ENVELOPE_MAGIC or size != _ENVELOPE.size + NONCE_SIZE + nbytes + TAG_SIZE:
                raise ConfigError(
                    f"cached batch {path} is not encrypted but encrypt=True: refusing to serve "
                    "it; delete the cache directory or turn encryption off on every rank"
                )
            image = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            # Slices are views too: release them before the mapping is closed.
            with view[_ENVELOPE.size :] as body, memoryview(image) as out:
                cipher.open_into(body, key.encode(), out)
    finally:
        sealed.close()
    return image


def read_batch(
    path: str,
    key: str,
    cipher: BatchCipher | None,
    *,
    weights_only: bool = True,
    verify: bool = True,
) -> Any:
    """Rebuild the batch in ``path``; raises ``FileNotFoundError`` if it is not there (yet).

    Without encryption the tensors are zero-copy copy-on-write views of the shared file.
    """
    if cipher is not None:
        mapping: mmap.mmap = _open_sealed(path, key, cipher)
    else:
        mapping = _map_own(path)
    with memoryview(mapping) as view:
        if cipher is None and bytes(view[:8]) == _ENVELOPE_MAGIC:
            raise ConfigError(
                f"cached batch {path} is encrypted: pass encrypt=True and set "
                "$CKPTCACHE_DATA_KEY on this rank too"
            )
        try:
            header = SegmentHeader.unpack(view[:HEADER_SIZE])
        except ValueError as e:
            raise CorruptCheckpoint(f"cached batch {path}: {e}", tier="data-cache") from e
        if header.state != SegmentState.COMMITTED or header.digest_state != DigestState.VALID:
            raise CorruptCheckpoint(f"cached batch {path} was never committed", tier="data-cache")
        mo, ms = header.manifest_offset, header.manifest_size
        manifest = Manifest.from_json(view[mo : mo + ms], segment_size=len(mapping))
        if (manifest.namespace, manifest.path) != (NAMESPACE, key):
            # A file renamed or left over from another run/step: never serve it.
            raise CorruptCheckpoint(
                f"cached batch {path} holds {manifest.path!r}, not {key!r}", tier="data-cache"
            )
        digests = None
        if verify:
            do = header.digest_offset
            if do + 8 * header.n_storages > len(mapping):
                raise CorruptCheckpoint(f"cached batch {path} is truncated", tier="data-cache")
            digests = unpack_digests(view[do : do + 8 * header.n_storages], header.n_storages)
    return read_object(
        mapping, mo, ms, zero_copy=True, weights_only=weights_only, digests=digests,
        tier="data-cache",
    )  # fmt: skip
