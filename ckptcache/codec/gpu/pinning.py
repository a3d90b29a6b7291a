"""Segment mappings registered as page-locked (pinned) memory, off the save's path.

A device-to-host copy into pinned memory runs as DMA at the link's speed; into pageable memory
the driver stages it through a bounce buffer at about a quarter of that. Registering a mapping
(``cudaHostRegister``) costs far more than one pageable copy of it
(``benchmarks/gpu/README.md``), so a save never registers on its own path:

* the spare mapper registers each spare it maps once CUDA is in use (:func:`reserve_if_cuda`,
  on its background thread), so a warmed-up client's first save runs by DMA;
* a save into a mapping not yet registered copies pageable, then asks for the registration
  in the background (:func:`pin_later`), so the later saves into it run by DMA.

The driver holds other threads' CUDA calls while it registers, so a mapping is registered in
pieces of :data:`CHUNK_BYTES` (each wait short), and a DMA copy is cut where two pieces meet
(:func:`pieces`).

A registration must end before its mapping is unmapped: the driver keeps the old pages pinned
under the address, and a new mapping made there later would be copied to the old pages.
:func:`unpin` waits for a registration in progress, then ends it.
"""

from __future__ import annotations

import functools
import itertools
import logging
import mmap
import threading
from collections.abc import Callable

import torch

__all__ = ["CHUNK_BYTES", "pieces", "pin", "pin_later", "pinned", "reserve_if_cuda", "unpin"]

log = logging.getLogger(__name__)

#: A mapping is registered a piece of this size at a time. The driver holds other threads'
#: CUDA calls while it registers (a save's copies would wait for the whole registration of
#: its segment): short pieces keep each wait short.
CHUNK_BYTES = 16 << 20

_lock = threading.Lock()
#: Address -> size of the mappings this process registered.
_pinned: dict[int, int] = {}
#: Address -> an event set when the registration under way there has ended.
_pinning: dict[int, threading.Event] = {}


def _address(mapping: mmap.mmap) -> int:
    probe = torch.frombuffer(mapping, dtype=torch.uint8, count=1)
    address = int(probe.data_ptr())
    del probe  # releases the buffer export: the mapping may be closed later
    return address


def pinned(mapping: mmap.mmap) -> bool:
    """Whether ``mapping`` is registered now (never waits for a registration under way)."""
    return bool(_pinned) and _address(mapping) in _pinned


def pin(mapping: mmap.mmap) -> bool:
    """Register ``mapping`` (or wait for the registration another thread is making); whether
    it is registered. A refusal (a driver without the call, a locked-memory limit) leaves
    copies pageable."""
    address = _address(mapping)
    event = _begin(address)
    if event is None:  # registered, or another thread is at it
        with _lock:
            waiting = _pinning.get(address)
        if waiting is not None:
            waiting.wait()
        return address in _pinned
    return _register(mapping, address, event)


def pin_later(mapping: mmap.mmap) -> None:
    """Start registering ``mapping`` on a thread of its own, unless it is or is being. The
    registration counts as under way from this call on: :func:`unpin` waits for it."""
    address = _address(mapping)
    event = _begin(address)
    if event is not None:
        threading.Thread(target=_register, args=(mapping, address, event),
                         name="ckptcache-pin", daemon=True).start()  # fmt: skip


def _begin(address: int) -> threading.Event | None:
    """An event to set once the registration at ``address`` ends, if this caller is to make
    it; ``None`` if it is made or being made."""
    with _lock:
        if address in _pinned or address in _pinning:
            return None
        event = _pinning[address] = threading.Event()
        return event


def _register(mapping: mmap.mmap, address: int, event: threading.Event) -> bool:
    size, done = len(mapping), 0
    try:
        cudart = torch.cuda.cudart()
        for start in range(0, size, CHUNK_BYTES):
            rc = int(cudart.cudaHostRegister(address + start, min(CHUNK_BYTES, size - start), 0))
            if rc != 0:
                log.debug("cudaHostRegister refused a segment mapping (%s): pageable copies", rc)
                break
            done += 1
        if done * CHUNK_BYTES >= size:
            with _lock:
                _pinned[address] = size
        else:
            _unregister(address, done * CHUNK_BYTES)
    except RuntimeError as e:  # CUDA unusable here: copies stay pageable
        log.debug("registering a segment mapping failed: %s", e)
    finally:
        with _lock:
            _pinning.pop(address, None)
        event.set()
    return address in _pinned


def _unregister(address: int, size: int) -> None:
    cudart = torch.cuda.cudart()
    for start in range(0, size, CHUNK_BYTES):
        cudart.cudaHostUnregister(address + start)


def pieces(first: int, end: int) -> list[tuple[int, int]]:
    """``[first, end)`` of a mapping cut where its registrations meet: a DMA copy must lie
    within one registration."""
    cuts = range((first // CHUNK_BYTES + 1) * CHUNK_BYTES, end, CHUNK_BYTES)
    bounds = [first, *cuts, end]
    return list(itertools.pairwise(bounds))


def reserve_if_cuda(mapping: mmap.mmap) -> Callable[[], bool] | None:
    """Where this process uses CUDA and ``mapping`` is not registered: mark its registration
    as under way (so :func:`unpin` waits for it) and return the call that makes it (slow,
    in proportion to the size: make it on a background thread, without locks held).
    ``None`` otherwise."""
    if mapping.closed or not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    address = _address(mapping)
    event = _begin(address)
    if event is None:
        return None
    return functools.partial(_register, mapping, address, event)


def unpin(mapping: mmap.mmap) -> None:
    """End ``mapping``'s registration, after any under way (call before unmapping it)."""
    if (not _pinned and not _pinning) or mapping.closed:
        return
    address = _address(mapping)
    with _lock:
        event = _pinning.get(address)
    if event is not None:
        event.wait()
    with _lock:
        size = _pinned.pop(address, None)
    if size is not None:
        _unregister(address, size)
