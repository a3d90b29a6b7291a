"""A load's storages moved to a device through two page-locked staging buffers.

Registering the load's mapping as page-locked memory costs many times the copy it would
speed up (``benchmarks/gpu/README.md``), and a copy from pageable memory is
staged by the driver at about a quarter of the link's speed. Instead, two staging buffers of
:data:`SLOT_BYTES` each, page-locked once per process (torch's caching host allocator keeps
them), take turns: the CPU copies storages into one while the other's bytes move to the
device, and a full buffer goes over in one host-to-device copy. One kernel then scatters it
into the storages (``_foreach_copy_``), so a thousand small storages cost one copy call, not
a thousand.

Every storage is its own device allocation of exactly its bytes, as ``torch.load`` makes it.
The storages are only filled once :meth:`DeviceLoad.finish` returns.
"""

from __future__ import annotations

import contextlib
import mmap

import torch

__all__ = ["SLOT_BYTES", "DeviceLoad", "slot_size"]

#: The size of each of the two staging buffers (and of their device twins).
SLOT_BYTES = 32 << 20


def slot_size(total: int) -> int:
    """The staging buffers' size for a load of ``total`` bytes: :data:`SLOT_BYTES`, or less
    for a smaller load (whole MiB), so a small load neither allocates nor keeps (torch's
    caching allocators keep what they handed out) 128 MiB of buffers."""
    return max(1 << 20, min(SLOT_BYTES, -(-total // (1 << 20)) << 20))


class DeviceLoad:
    """Host-to-device copies from one load mapping. ``device`` is a CUDA device; the CPU is
    accepted too (private copies, no streams), which the tests use to check the staging."""

    def __init__(self, mapping: mmap.mmap, device: torch.device, slot_bytes: int = SLOT_BYTES):
        self.device = device
        self.slot_bytes = slot_bytes
        cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if cuda else None
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(device))
        self._whole: torch.Tensor | None = torch.frombuffer(mapping, dtype=torch.uint8)
        self._host = [torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=cuda)
                      for _ in range(2)]  # fmt: skip
        with self._on_stream():
            self._dev = [torch.empty(slot_bytes, dtype=torch.uint8, device=device)
                         for _ in range(2)]  # fmt: skip
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._slot = 0
        self._used = 0
        #: (destination, start in the slot, bytes) of what the current slot holds.
        self._pending: list[tuple[torch.Tensor, int, int]] = []

    def _on_stream(self) -> contextlib.AbstractContextManager[object]:
        if self.stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.stream)

    def storage(self, offset: int, nbytes: int) -> torch.UntypedStorage:
        """A storage on the device that :meth:`finish` fills from ``offset`` of the mapping."""
        assert self._whole is not None, "finish() was called"
        out = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        done = 0
        while done < nbytes:
            if self._used == self.slot_bytes:
                self._flush()
            k = min(nbytes - done, self.slot_bytes - self._used)
            start = self._used
            self._host[self._slot][start : start + k].copy_(
                self._whole[offset + done : offset + done + k]
            )
            self._pending.append((out[done : done + k], start, k))
            self._used += k
            done += k
        if self.stream is not None and nbytes:
            out.record_stream(self.stream)  # filled on the side stream
        return out.untyped_storage()

    def _flush(self) -> None:
        """Send the current slot over and scatter it; then wait until the other slot's last
        transfer is done, and fill that one next."""
        if self._pending:
            slot, used = self._slot, self._used
            with self._on_stream():
                staged = self._dev[slot][:used]
                staged.copy_(self._host[slot][:used], non_blocking=True)
                if self.stream is not None:
                    event = torch.cuda.Event()
                    event.record(self.stream)
                    self._events[slot] = event
                torch._foreach_copy_(
                    [dst for dst, _, _ in self._pending],
                    [staged[start : start + k] for _, start, k in self._pending],
                )  # fmt: skip
        self._pending = []
        self._used = 0
        self._slot ^= 1
        last = self._events[self._slot]
        if last is not None:
            last.synchronize()  # the host slot is free once its transfer has run

    def finish(self) -> None:
        """Send what is left and wait for every copy; the storages are then filled."""
        self._flush()
        if self.stream is not None:
            self.stream.synchronize()
        self._whole = None  # releases the mapping's buffer export
