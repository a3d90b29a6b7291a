"""CUDA tensors straight into and out of segments.

Saves: device-to-host copies into the segment mapping on a side stream, synchronised before
the commit. Once the mapping is registered as page-locked memory
(:mod:`~ckptcache.codec.gpu.pinning`, off the training thread) they run as DMA at the link's
speed; before that, pageable. Small storages are gathered on the device first (one kernel for
all of them) and moved by one copy per run of neighbours: a copy call costs the CPU the same
whatever its size.

Loads to a device: through two page-locked staging buffers (:mod:`~ckptcache.codec.gpu.
staging`), never by registering the load's mapping (which would cost more than the copy).
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Sequence

import torch

from ckptcache.codec.gpu.pinning import pieces, pin_later, pinned
from ckptcache.codec.gpu.staging import DeviceLoad, slot_size
from ckptcache.codec.shm import checked_nbytes, device_of

__all__ = [
    "GATHER_BELOW", "RUN_BYTES", "Item", "copy_to_segment", "device_target", "load_to_device",
    "record_ready",
]  # fmt: skip

#: Per device, an event recorded on the saving thread's current stream when the save was
#: submitted: what the copies must wait for when they run on another thread.
Ready = dict[torch.device, torch.cuda.Event]


def record_ready(storages: Sequence[torch.UntypedStorage]) -> Ready:
    """Call on the caller's thread at submit: an event per CUDA device of ``storages`` on
    that thread's current stream (the current stream is per thread, so the background save
    thread's would not order the copies after the trainer's pending kernels). Empty, and no
    CUDA call made, when no storage is on a CUDA device."""
    # ``UntypedStorage.is_cuda`` is a Python property: one ``device`` read per storage by
    # ``map``, then a look at the few distinct devices.
    devices = {d for d in set(map(device_of, storages)) if d.type == "cuda"}
    ready: Ready = {}
    for device in devices:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        ready[device] = event
    return ready


def _side_streams(
    devices: set[torch.device], ready: Ready | None = None
) -> dict[torch.device, torch.cuda.Stream]:
    streams = {}
    for device in devices:
        stream = torch.cuda.Stream(device)
        if ready is not None and device in ready:
            stream.wait_event(ready[device])  # the submitting thread's pending writes
        else:
            stream.wait_stream(torch.cuda.current_stream(device))  # this thread's
        streams[device] = stream
    return streams


#: Storages smaller than this are gathered on the device and moved a run at a time.
GATHER_BELOW = 1 << 20
#: The most bytes one gathered run spans (its device buffer is reused in stream order).
RUN_BYTES = 64 << 20
#: The widest gap between two storages of one run (their archive metadata lies there).
_RUN_GAP = 64 << 10

#: ``(index in the plan's storages, offset in the segment, storage, planned nbytes)``.
Item = tuple[int, int, torch.UntypedStorage, int]


def copy_to_segment(
    mapping: mmap.mmap, items: Sequence[Item], ready: Ready | None = None
) -> Callable[[], None]:
    """Start device-to-host copies of ``items`` (CUDA storages, in plan order) into
    ``mapping``, after ``ready``'s events (:func:`record_ready`; without them, after this
    thread's current streams); returns the function that waits for the copies (call it
    before the commit). A storage resized since it was planned raises
    :class:`~ckptcache.errors.TensorMutated`, before any copy.

    A gathered run also writes the bytes between its storages: write the archive's metadata
    (every byte between two storages) after the wait.
    """
    if not items:
        return lambda: None
    for _, _, storage, planned in items:  # all checked before the first copy starts
        checked_nbytes(storage, planned)
    dma = pinned(mapping)
    streams = _side_streams({item[2].device for item in items}, ready)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    for run in _runs(items):
        device = run[0][2].device
        first, end = run[0][1], run[-1][1] + run[-1][3]
        with torch.cuda.stream(streams[device]):
            if len(run) == 1:
                src = _bytes_of(run[0][2])
            else:  # one kernel gathers the run, laid out as in the segment
                src = torch.empty(end - first, dtype=torch.uint8, device=device)
                torch._foreach_copy_(
                    [src[o - first : o - first + n] for _, o, _, n in run],
                    [_bytes_of(s) for _, _, s, _ in run],
                )  # fmt: skip
            for a, b in pieces(first, end):  # each piece within one registration
                whole[a:b].copy_(src[a - first : b - first], non_blocking=dma)
            del src  # reused in stream order by the next run's buffer
    del whole  # releases the mapping's buffer export

    def wait() -> None:
        for stream in streams.values():
            stream.synchronize()
        if not dma:  # copied pageable: the next saves into this mapping by DMA
            pin_later(mapping)  # once this one's copies are done: they would wait for it

    return wait


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _runs(items: Sequence[Item]) -> list[list[Item]]:
    """``items`` split into runs to gather: neighbours in the plan, each small, on one
    device, a run spanning at most :data:`RUN_BYTES`."""
    runs: list[list[Item]] = []
    for item in items:
        index, offset, storage, nbytes = item
        if runs and nbytes < GATHER_BELOW:
            last = runs[-1][-1]
            end = last[1] + last[3]
            if (
                last[0] == index - 1
                and last[3] < GATHER_BELOW
                and last[2].device == storage.device
                and 0 <= offset - end <= _RUN_GAP
                and offset + nbytes - runs[-1][0][1] <= RUN_BYTES
            ):
                runs[-1].append(item)
                continue
        runs.append([item])
    return runs


def device_target(map_location: object) -> torch.device | None:
    """The CUDA device a ``map_location`` moves every storage to, if it is that simple."""
    if not isinstance(map_location, (str, torch.device)) or not torch.cuda.is_available():
        return None
    device = torch.device(map_location)
    if device.type != "cuda":
        return None
    return torch.device(
        "cuda", torch.cuda.current_device() if device.index is None else device.index
    )


def load_to_device(mapping: mmap.mmap, device: torch.device, total: int) -> DeviceLoad:
    """Start a load of ``total`` bytes of storages that go straight to ``device``."""
    return DeviceLoad(mapping, device, slot_bytes=slot_size(total))
