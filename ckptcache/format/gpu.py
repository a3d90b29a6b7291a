"""CUDA tensors straight into and out of segments, through page-locked (pinned) mappings.

A copy between a device and pageable host memory is staged by the driver through a bounce
buffer at a fraction of the link's speed. Registering the segment mapping itself with
``cudaHostRegister`` makes it pinned memory: device-to-host copies on save and host-to-device
copies on load then run as DMA at link speed, asynchronously on a side stream, synchronised
before the save commits (or the load returns).

Nothing here runs without CUDA; it has not been run on GPU hardware by the test suite here
(the ``gpu``-marked tests skip without a device).
"""

from __future__ import annotations

import logging
import mmap
import operator
from collections.abc import Callable, Sequence

import torch

__all__ = ["copy_to_segment", "device_target", "load_to_device", "record_ready", "unpin"]

log = logging.getLogger(__name__)

#: cudaHostRegister flags: pin read-only, so a copy-on-write load mapping is not un-shared.
_REGISTER_DEFAULT = 0
_REGISTER_READ_ONLY = 8

#: Address -> size of the mappings this process pinned (saves keep theirs across saves).
_pinned: dict[int, int] = {}


def _address(mapping: mmap.mmap) -> int:
    probe = torch.frombuffer(mapping, dtype=torch.uint8, count=1)
    address = int(probe.data_ptr())
    del probe  # releases the buffer export: the mapping may be closed later
    return address


def _pin(mapping: mmap.mmap, flags: int) -> int | None:
    """Register ``mapping`` as pinned memory; returns its address, or ``None`` if refused."""
    address = _address(mapping)
    if address in _pinned:
        return address
    rc = torch.cuda.cudart().cudaHostRegister(address, len(mapping), flags)
    if int(rc) != 0:
        log.debug("cudaHostRegister refused the segment mapping (%s): staged copies", rc)
        return None
    _pinned[address] = len(mapping)
    return address


def unpin(mapping: mmap.mmap) -> None:
    """Unregister ``mapping`` if it was pinned (call before closing it)."""
    if not _pinned or mapping.closed:
        return
    address = _address(mapping)
    if _pinned.pop(address, None) is not None:
        torch.cuda.cudart().cudaHostUnregister(address)


#: Per device, an event recorded on the saving thread's current stream when the save was
#: submitted: what the copies must wait for when they run on another thread.
Ready = dict[torch.device, torch.cuda.Event]


_device_of = operator.attrgetter("device")


def record_ready(storages: Sequence[torch.UntypedStorage]) -> Ready:
    """Call on the caller's thread at submit: an event per CUDA device of ``storages`` on
    that thread's current stream (the current stream is per thread, so the background save
    thread's would not order the copies after the trainer's pending kernels). Empty, and no
    CUDA call made, when no storage is on a CUDA device."""
    # ``UntypedStorage.is_cuda`` is a Python property: one ``device`` read per storage by
    # ``map``, then a look at the few distinct devices.
    devices = {d for d in set(map(_device_of, storages)) if d.type == "cuda"}
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


def copy_to_segment(
    mapping: mmap.mmap,
    items: Sequence[tuple[int, torch.UntypedStorage, int]],
    ready: Ready | None = None,
) -> Callable[[], None]:
    """Start device-to-host copies of ``(offset, storage, planned nbytes)`` CUDA storages
    into ``mapping``, after ``ready``'s events (:func:`record_ready`; without them, after
    this thread's current streams); returns the function that waits for the copies (call it
    before the commit). A storage resized since it was planned raises
    :class:`~ckptcache.errors.TensorMutated`."""
    from ckptcache.format.shm import checked_nbytes

    if not items:
        return lambda: None
    for _, storage, planned in items:  # all checked before the first copy starts
        checked_nbytes(storage, planned)
    _pin(mapping, _REGISTER_DEFAULT)
    streams = _side_streams({s.device for _, s, _ in items}, ready)
    for offset, storage, nbytes in items:
        if nbytes == 0:
            continue
        dst = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=offset)
        src = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        with torch.cuda.stream(streams[storage.device]):
            dst.copy_(src, non_blocking=True)

    def wait() -> None:
        for stream in streams.values():
            stream.synchronize()

    return wait


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


class DeviceLoad:
    """Host-to-device copies from one load mapping, pinned read-only for their duration."""

    def __init__(self, mapping: mmap.mmap, device: torch.device):
        self.mapping = mapping
        self.device = device
        self.pinned = _pin(mapping, _REGISTER_READ_ONLY) is not None
        self.stream = _side_streams({device})[device]

    def storage(self, offset: int, nbytes: int) -> torch.UntypedStorage:
        """A device storage filled (asynchronously) from ``offset`` of the mapping."""
        out = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        if nbytes:
            src = torch.frombuffer(self.mapping, dtype=torch.uint8, count=nbytes, offset=offset)
            with torch.cuda.stream(self.stream):
                out.copy_(src, non_blocking=self.pinned)
            out.record_stream(self.stream)
        return out.untyped_storage()

    def finish(self) -> None:
        """Wait for every copy, then unpin the mapping."""
        self.stream.synchronize()
        if self.pinned:
            unpin(self.mapping)


def load_to_device(mapping: mmap.mmap, device: torch.device) -> DeviceLoad:
    """Start a load whose storages go straight to ``device``."""
    return DeviceLoad(mapping, device)
