"""Mapping daemon-owned segment files and moving tensor bytes in and out of them.

Two kinds of mapping, chosen for their cost profile:

* **write mappings** (``MAP_SHARED``, page tables populated up front: by the copy threads at
  once where a save waits for them) are made once per segment and kept by the client across
  saves: page tables stay populated, so a repeated save into a reused segment runs at memcpy
  speed instead of paying a page fault per 4 KiB.
* **load mappings** (``MAP_PRIVATE``) back zero-copy tensors: reads share the daemon's pages,
  while a write by the trainer faults in a private copy of that page. A trainer that updates a
  loaded tensor in place (an optimizer step) can therefore never corrupt the cached copy.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import mmap
import operator
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import numpy as np
import torch

from ckptcache._signals import signals_deferred
from ckptcache._workers import LingeringPool
from ckptcache.errors import TensorMutated
from ckptcache.format.fastcopy import copy_runs, copy_table
from ckptcache.format.pagetables import POPULATE_IN_PARALLEL, populate_range

__all__ = [
    "Mapping",
    "bytes_of",
    "checked_nbytes",
    "copy_cpu_storages",
    "copy_runs_on_threads",
    "copy_sources",
    "copy_storage_into",
    "copy_storages_into",
    "copy_threads",
    "device_of",
    "device_type",
    "map_private",
    "map_shared",
    "populate_in_parallel",
    "private_copy",
    "storage_copy",
    "storage_view",
]


class Mapping(mmap.mmap):
    """An ``mmap`` that supports weak references (so a finalizer can see it unmapped)."""


def _open(path: str, writable: bool) -> int:
    return os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)


def map_shared(path: str, size: int, *, populate: bool = True, parallel: bool = False) -> Mapping:
    """Map ``size`` bytes of ``path`` read-write and shared, pre-faulting the page tables;
    ``parallel``: by the copy threads at once (a mapping a save waits for), where the kernel
    can (:func:`populate_in_parallel`)."""
    fd = _open(path, True)
    try:
        split = populate and parallel and POPULATE_IN_PARALLEL
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate and not split else 0)
        mapping = Mapping(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    if split:
        populate_in_parallel(mapping)
    return mapping


def populate_in_parallel(mapping: mmap.mmap) -> None:
    """Fault in the page tables of all of ``mapping`` by the copy threads, each its share.

    A new segment of gigabytes has hundreds of thousands of 4 KiB pages to map:
    ``MAP_POPULATE`` does that on one thread, longer than the save's copy that waits for it.
    The work splits by
    range. Faulting as reads maps 16 pages a fault (the kernel's fault-around), and on a
    tmpfs (shmem) shared mapping a read fault maps the page writable (shmem asks for no
    notice of a first write), so the save's writes that follow take no fault. Best effort: a
    range the kernel does not populate faults in as the copy writes it, as it would anyway.
    """
    size = len(mapping)
    threads = _threads_for(size)
    view = ctypes.c_char.from_buffer(mapping)  # an export: the mapping cannot close under us
    try:
        base = ctypes.addressof(view)
        share = -(-size // threads // mmap.PAGESIZE) * mmap.PAGESIZE
        ranges = [(base + start, min(share, size - start)) for start in range(0, size, share)]
        pool = _copier_pool(len(ranges) - 1) if len(ranges) > 1 else None
        with signals_deferred():  # no lock of the pool's is left half taken (_signals.py)
            others = []
            if pool is not None:
                others = [pool.submit(functools.partial(populate_range, *r)) for r in ranges[1:]]
            try:
                populate_range(*ranges[0])
            finally:
                for future in others:
                    future.result()
    finally:
        del view


def map_private(path: str, size: int, *, hold_lock: bool = False) -> Mapping:
    """Map ``path`` copy-on-write.

    ``hold_lock`` keeps a shared ``flock`` on the file for as long as the mapping lives (the
    kernel drops it if the process dies): the daemon never reuses a segment someone still
    maps (see ``ckptcache.server.memory.arena.mapped_by_others``), whatever happened to the
    client's connection. The lock is held by the mapping's own descriptor (an ``mmap``
    keeps a duplicate of the one it was made from, and closes it when it is freed), so no
    Python finalizer has to run for it to go: a signal's exception landing in one would
    have left it held for the life of the process.
    """
    fd = _open(path, False)
    try:
        if hold_lock:
            fcntl.flock(fd, fcntl.LOCK_SH)
        # PROT_WRITE on a MAP_PRIVATE mapping of a read-only fd is allowed: writes stay private.
        return Mapping(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A ``uint8`` tensor over ``storage``'s bytes, on its device (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def checked_nbytes(storage: torch.UntypedStorage, planned: int | None, name: str = "") -> int:
    """``storage``'s size, which must still be ``planned``: the size its place was laid out
    for. A storage resized since (``untyped_storage().resize_``, as FSDP and ZeRO free
    parameters; it does not bump the version counter) would put wrong bytes in its record or
    write over the next one: :class:`TensorMutated` instead. ``None``: nothing planned."""
    nbytes = storage.nbytes()
    if planned is not None and nbytes != planned:
        what = f"storage of {name!r}" if name else "a storage"
        raise TensorMutated(
            f"{what} was resized from {planned} to {nbytes} bytes after the save was planned; "
            "the save was aborted rather than store wrong bytes. Do not resize or free the "
            "storages of saved tensors until the save's copy is done (handle.wait())"
        )
    return nbytes


_Storage = torch.UntypedStorage
#: A storage's (or tensor's) device, and its type, read by ``map`` for thousands at once.
device_of = operator.attrgetter("device")
device_type = operator.attrgetter("device.type")

#: ``(offset, storage)``, or ``(offset, storage, planned nbytes)`` to have the size checked.
Run = tuple[int, torch.UntypedStorage] | tuple[int, torch.UntypedStorage, int]


def copy_storage_into(
    mapping: mmap.mmap, offset: int, storage: torch.UntypedStorage, planned: int | None = None
) -> None:
    """Copy a storage's bytes (CPU or device) to ``offset`` of ``mapping``; ``planned`` as in
    :func:`checked_nbytes`."""
    nbytes = checked_nbytes(storage, planned)
    if nbytes == 0:
        return
    dst = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=offset)
    dst.copy_(bytes_of(storage))


#: Below this many bytes per thread a save's copy runs on the calling thread alone.
_MIN_BYTES_PER_THREAD = 8 << 20


def _threads_for(nbytes: int) -> int:
    """Copy threads for ``nbytes``: torch's thread count, at least 8 MiB each."""
    return max(1, min(torch.get_num_threads(), nbytes // _MIN_BYTES_PER_THREAD))


def copy_threads(nbytes: int) -> int:
    """The threads a save's copy of ``nbytes`` runs on (benchmarks name them beside their
    figures)."""
    return _threads_for(nbytes)


#: Pieces per thread that the threads share out as they go.
_PIECES_PER_THREAD = 8

#: Copy threads: daemon threads that end a moment after the last save's copy (a training
#: process must not keep idle threads of ours, see ``ckptcache._workers``).
_copiers: LingeringPool | None = None
_copiers_pid = 0
_copiers_lock = threading.Lock()


def _after_fork_in_child() -> None:
    global _copiers, _copiers_lock
    _copiers, _copiers_lock = None, threading.Lock()  # the parent's threads are not ours


os.register_at_fork(after_in_child=_after_fork_in_child)


def _copier_pool(workers: int) -> LingeringPool:
    global _copiers, _copiers_pid
    with _copiers_lock:
        # A forked child inherits the pool but not its threads: it needs its own.
        if _copiers is None or _copiers.max_workers < workers or _copiers_pid != os.getpid():
            _copiers = LingeringPool(workers, "ckptcache-copy")
            _copiers_pid = os.getpid()
        return _copiers


def _split(runs: list[tuple[int, int, int]], parts: int) -> list[list[tuple[int, int, int]]]:
    """``(dst, src, n)`` runs in at most ``parts`` lists of (nearly) equal bytes, in order:
    consecutive runs grouped, a run longer than a share cut into shares.

    Columns and ``numpy``, not a Python step per run: with thousands of small storages, a
    step per run would cost more than the copy's own calls."""
    if parts <= 1 or not runs:
        return [runs] + [[] for _ in range(parts - 1)]
    sizes = np.fromiter(map(_third, runs), np.int64, len(runs))
    share = max(1, -(-int(sizes.sum()) // parts))
    if int(sizes.max()) > share:  # the few large storages: cut them (a Python step each)
        cut: list[tuple[int, int, int]] = []
        for dst, src, n in runs:  # n > 0: the caller drops empty runs
            cut += [(dst + at, src + at, min(share, n - at)) for at in range(0, n, share)]
        runs = cut
        sizes = np.fromiter(map(_third, runs), np.int64, len(runs))
    # Each run goes to the share its first byte falls in.
    share_of = (np.cumsum(sizes) - sizes) // share
    bounds = (np.flatnonzero(np.diff(share_of)) + 1).tolist()
    return [runs[a:b] for a, b in zip([0, *bounds], [*bounds, len(runs)], strict=True)]


_third = operator.itemgetter(2)
_CPU = torch.device("cpu")


def copy_storages_into(dst: torch.Tensor, runs: Sequence[Run]) -> None:
    """Copy each CPU storage of ``runs`` to its byte offset of ``dst`` (a CPU ``uint8``
    tensor, e.g. a whole mapped segment), with one fork and one join for all of them; a run
    with a planned size raises :class:`TensorMutated` (nothing copied) if the storage's
    size differs (:func:`checked_nbytes`).

    A per-storage ``Tensor.copy_`` opens one intra-op parallel region per storage (hundreds
    per state dict): on a busy machine each waits for a descheduled worker, and a save's copy
    takes many times a memcpy of the same bytes. Here the bytes are cut into one equal share per
    ``torch.get_num_threads()`` thread, each copied outside the GIL by
    :func:`~ckptcache.format.fastcopy.copy_runs` (streaming stores where it can).
    Raises :class:`ValueError` for a run outside ``dst`` or a storage not on the CPU.
    """
    # Every check reads one field of every run at once (``map`` over a C getter), not a Python
    # step per run: a save may hold thousands of small storages.
    entries = list(runs)
    offsets = [entry[0] for entry in entries]
    storages = [entry[1] for entry in entries]
    if not set(map(device_of, storages)) <= {_CPU}:  # devices compare in C; their types do not
        other = next(s.device for s in storages if s.device.type != "cpu")
        raise ValueError(f"copy_storages_into copies CPU storages, not {other}")
    sizes = list(map(_Storage.nbytes, storages))
    for entry, n in zip(entries, sizes, strict=True):
        if len(entry) == 3 and entry[2] != n:
            checked_nbytes(entry[1], entry[2])  # raises TensorMutated, naming the sizes
    copy_cpu_storages(dst, offsets, storages, sizes)


_P = TypeVar("_P")


def _on_copy_threads(pieces: Iterator[_P], copy: Callable[[_P], None], threads: int) -> None:
    """``copy`` each of ``pieces`` on this thread and on ``threads - 1`` copy threads at
    once, each taking the next piece (``next()`` on a shared iterator is atomic under the
    GIL), and return once every one has ended: the sources and the destination must outlive
    every copy, even on an error, which is raised here."""

    def work() -> None:
        for piece in pieces:
            copy(piece)

    if threads == 1:
        work()
        return
    with signals_deferred():  # no lock of the pool's is left half taken (_signals.py)
        others = [_copier_pool(threads - 1).submit(work) for _ in range(threads - 1)]
        try:
            work()
        finally:
            for future in others:
                future.result()


def copy_cpu_storages(
    dst: torch.Tensor, offsets: list[int], storages: list[torch.UntypedStorage], sizes: list[int]
) -> None:
    """:func:`copy_storages_into` for a caller that has checked already that ``storages`` are
    CPU storages of ``sizes`` bytes (as :func:`~ckptcache.codec.objectio.write_object`
    does); raises :class:`ValueError` for a run outside ``dst``."""
    if dst.dtype != torch.uint8 or dst.device.type != "cpu" or not dst.is_contiguous():
        raise ValueError("copy_storages_into needs a contiguous CPU uint8 destination")
    base, size = dst.data_ptr(), dst.numel()
    if offsets and (min(offsets) < 0 or max(map(operator.add, offsets, sizes)) > size):
        # the copy checks nothing: never write outside
        n, offset = next((n, o) for o, n in zip(offsets, sizes, strict=True)
                         if o < 0 or o + n > size)  # fmt: skip
        raise ValueError(f"storage of {n} bytes at {offset} is outside {size} bytes")
    ptrs = map(_Storage.data_ptr, storages)
    jobs = list(zip(map(base.__add__, offsets), ptrs, sizes, strict=True))
    if 0 in sizes:  # an empty storage may have no address at all: nothing to copy
        jobs = [job for job in jobs if job[2]]
    copy_runs_on_threads(jobs)


def copy_runs_on_threads(jobs: list[tuple[int, int, int]]) -> None:
    """Copy each ``(dst, src, nbytes)`` run (addresses, none empty, no two destinations
    overlapping; the caller has checked every one) on the copy threads, in shares of about
    equal bytes, as a save copies its storages."""
    total = sum(job[2] for job in jobs)
    threads = _threads_for(total)
    # Many more pieces than threads, each thread taking the next one: a thread that the node's
    # other work (the daemon refilling its pool, say) deschedules holds up one piece, not half.
    pieces = iter(_split(jobs, threads * _PIECES_PER_THREAD if threads > 1 else 1))
    _on_copy_threads(pieces, copy_runs, threads)


def copy_sources(
    dst: torch.Tensor, offsets: np.ndarray, addresses: np.ndarray, sizes: np.ndarray
) -> None:
    """:func:`copy_cpu_storages` for CPU storages given as columns (``int64`` offsets in
    ``dst``, ``uint64`` addresses, ``int64`` sizes; the compiled walk's
    :class:`~ckptcache.codec.plan.walk.Sources`, whose owner keeps them alive): the copy's
    table made by numpy, no Python object per storage. Raises :class:`ValueError` for a run
    outside ``dst``."""
    if dst.dtype != torch.uint8 or dst.device.type != "cpu" or not dst.is_contiguous():
        raise ValueError("copy_sources needs a contiguous CPU uint8 destination")
    size, n = dst.numel(), len(sizes)
    if len(offsets) != n or len(addresses) != n:
        raise ValueError("copy_sources needs columns of equal lengths")
    ends = offsets + sizes
    if n and (int(offsets.min()) < 0 or int(ends.max()) > size):  # the copy checks nothing
        i = int(np.flatnonzero((offsets < 0) | (ends > size))[0])
        raise ValueError(f"storage of {sizes[i]} bytes at {offsets[i]} is outside {size} bytes")
    table = np.empty((n, 3), dtype=np.uint64)
    table[:, 0] = offsets
    table[:, 0] += np.uint64(dst.data_ptr())
    table[:, 1] = addresses
    table[:, 2] = sizes
    if n and not sizes.all():  # an empty storage may have no address at all: nothing to copy
        table = table[sizes > 0]
    total = int(sizes.sum())
    threads = _threads_for(total)
    pieces = iter(_split_table(table, threads * _PIECES_PER_THREAD if threads > 1 else 1))
    _on_copy_threads(pieces, copy_table, threads)


def _split_table(table: np.ndarray, parts: int) -> list[np.ndarray]:
    """:func:`_split` of the rows of a copy table (non-empty runs): the same pieces, made by
    numpy (a run longer than a share cut into shares, rows repeated per cut)."""
    if parts <= 1 or not len(table):
        return [table]
    sizes = table[:, 2].astype(np.int64)
    share = max(1, -(-int(sizes.sum()) // parts))
    if int(sizes.max()) > share:
        cuts = -(-sizes // share)
        table = np.repeat(table, cuts, axis=0)
        first = np.cumsum(cuts) - cuts
        at = (np.arange(len(table)) - np.repeat(first, cuts)).astype(np.uint64) * np.uint64(share)
        table[:, 0] += at
        table[:, 1] += at
        table[:, 2] = np.minimum(np.uint64(share), table[:, 2] - at)
        sizes = table[:, 2].astype(np.int64)
    # Each run goes to the share its first byte falls in.
    share_of = (np.cumsum(sizes) - sizes) // share
    bounds = np.flatnonzero(np.diff(share_of)) + 1
    return np.split(table, bounds)


def storage_view(mapping: mmap.mmap, offset: int, nbytes: int) -> torch.UntypedStorage:
    """A storage backed by ``mapping`` itself (zero copy); it keeps the mapping alive."""
    if nbytes == 0:
        return torch.UntypedStorage(0)
    return torch.frombuffer(
        mapping, dtype=torch.uint8, count=nbytes, offset=offset
    ).untyped_storage()


def storage_copy(mapping: mmap.mmap, offset: int, nbytes: int) -> torch.UntypedStorage:
    """A private heap copy of ``nbytes`` at ``offset`` (no reference to the mapping is kept)."""
    out = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes:
        out.copy_(torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=offset))
    return out.untyped_storage()


#: Bytes a copy thread of :func:`private_copy` reads at a time (many per thread, so that a
#: descheduled thread holds up one chunk, not a half).
_PRIVATE_CHUNK = 8 << 20


def private_copy(path: str, size: int) -> Mapping:
    """A private copy of the first ``size`` bytes of the file ``path`` (a segment) in anonymous
    memory of this process, read by the copy threads at once: what a load with private copies
    (``mmap=False``) decodes from, as a zero-copy load decodes from the segment, so that its
    tensors hold no page of the daemon's and no pin. Raises :class:`OSError` when the file
    ends before ``size`` bytes.

    Fresh memory costs a fault per page at its first write, and a mapping of the segment a
    fault per page (or per few) at its first read; a storage at a time on one thread
    (``torch.empty`` and ``copy_``), those faults cost several times the copy. Here one
    mapping takes every storage, of 2 MiB pages where the kernel gives them on request
    (``MADV_HUGEPAGE``: 512 times fewer faults), and each copy thread reads a chunk at a time
    straight from the file into it (``preadv``: the kernel copies from its pages, with no
    page tables made for the source)."""
    out = Mapping(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            out.madvise(advice)
        except OSError:  # transparent huge pages off: 4 KiB pages, faulted by the reads
            pass
    if size == 0:
        return out
    fd = _open(path, False)
    view = memoryview(out)
    try:
        threads = _threads_for(size)
        pieces = iter(range(0, size, _PRIVATE_CHUNK))

        def read(at: int) -> None:
            end = min(at + _PRIVATE_CHUNK, size)
            while at < end:  # preadv releases the interpreter lock
                got = os.preadv(fd, [view[at:end]], at)
                if got <= 0:
                    raise OSError(f"{path} ends at {at} bytes, before {size}")
                at += got

        _on_copy_threads(pieces, read, threads)
    finally:
        view.release()
        os.close(fd)
    return out
