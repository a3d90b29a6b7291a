"""State digests that replicas compare before a transfer and receivers check after it.

Two algorithms, chosen once per :class:`~ckptcache.recovery.PeerRecovery` so every rank computes
the same thing whatever device its tensors live on:

* ``"checksum"`` (default): each tensor's bytes are summed as 64-bit words on the tensor's own
  device (wrapping integer addition, so the result does not depend on reduction order, device or
  thread count); only one 8-byte word per tensor reaches the host. It detects every single-bit
  error and almost every corruption, but it is not collision resistant.
* ``"xxh3"``: the exact xxh3-64 digest used everywhere else in ckptcache. CPU tensors are hashed
  in place; accelerator tensors are first copied to the host, which costs a full device-to-host
  copy of the state.

Per-tensor values and each tensor's path, dtype and shape are then folded into one 64-bit digest
(:func:`state_digests`: what replicas compare when nothing is sent). A transfer is checked per
bucket instead (:func:`buffer_word` on the flat bytes that move, :func:`fold_words` over the
buckets), so each side hashes a bucket while the next one is on the wire and no rank makes an
extra pass over the state before or after the transfer.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Literal

import torch

from ckptcache.format.digest import digest_bytes
from ckptcache.recovery._state import TensorSpec

__all__ = ["DigestMode", "buffer_word", "combine", "fold_words", "state_digests", "tensor_words"]

DigestMode = Literal["checksum", "xxh3"]

_U64 = 1 << 64


def _word_sum(t: torch.Tensor) -> torch.Tensor:
    """Wrapping int64 sum of the tensor's bytes read as 64-bit words (tail bytes added singly)."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    whole = raw.numel() // 8 * 8
    total = torch.zeros((), dtype=torch.int64, device=t.device)
    if whole:
        head = raw[:whole]
        try:
            total = head.view(torch.int64).sum()
        except RuntimeError:
            # A view whose byte offset is not 8-aligned cannot be reinterpreted; copy it once.
            total = head.clone().view(torch.int64).sum()
    if raw.numel() > whole:
        total = total + raw[whole:].to(torch.int64).sum()
    return total


def _xxh3(t: torch.Tensor) -> int:
    host = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    # The numpy view shares the tensor's memory: hashing reads it in place.
    return digest_bytes(host.numpy().data)


def buffer_word(buf: torch.Tensor, mode: DigestMode) -> int:
    """One unsigned 64-bit value for the bytes of one flat bucket buffer."""
    if mode == "xxh3":
        return _xxh3(buf)
    if mode != "checksum":
        raise ValueError(f"unknown digest mode {mode!r}; use 'checksum' or 'xxh3'")
    if buf.device.type == "cpu" and buf.is_contiguous() and buf.nbytes % 8 == 0:
        try:
            # numpy sums on this thread: torch's parallel reduction would compete with the
            # transfer's own threads for the cores. Integer sums wrap, as on the device.
            return int(buf.view(torch.int64).numpy().sum()) % _U64
        except RuntimeError:
            pass  # not 8-byte aligned: the general path below copies it once
    return int(_word_sum(buf).item()) % _U64


def fold_words(words: Sequence[int]) -> int:
    """One digest of a sequence of per-bucket values (their order and count included)."""
    return digest_bytes(struct.pack(f"<{len(words)}Q", *words))


def tensor_words(tensors: Sequence[torch.Tensor], mode: DigestMode) -> list[int]:
    """One unsigned 64-bit value per tensor."""
    if mode == "xxh3":
        return [_xxh3(t) for t in tensors]
    if mode != "checksum":
        raise ValueError(f"unknown digest mode {mode!r}; use 'checksum' or 'xxh3'")
    words: list[int] = [0] * len(tensors)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    for indices in by_device.values():
        # Stack on the device, then one small copy to the host per device instead of one per tensor.
        sums = torch.stack([_word_sum(tensors[i]) for i in indices]).cpu().tolist()
        for i, v in zip(indices, sums, strict=True):
            words[i] = v % _U64
    return words


def combine(specs: Sequence[TensorSpec], words: Sequence[int]) -> int:
    """Fold per-tensor words and tensor descriptions into one unsigned 64-bit digest."""
    entries = sorted(
        (repr((spec.path, str(spec.dtype), spec.shape)).encode(), word)
        for spec, word in zip(specs, words, strict=True)
    )
    # Sorted by path: a replica whose optimizer state dict lists parameters in another order
    # (it was rebuilt by load_state_dict) still digests the same.
    buf = bytearray()
    for name, word in entries:
        buf += name + struct.pack("<Q", word)
    return digest_bytes(buf)


def state_digests(
    specs: Sequence[TensorSpec], tensors: Sequence[torch.Tensor], mode: DigestMode
) -> tuple[int, int]:
    """``(digest of everything but frozen weights, digest of frozen weights)``.

    Kept apart so that a receiver that skips frozen weights can still be compared.
    """
    words = tensor_words(tensors, mode)
    live = [i for i, s in enumerate(specs) if not s.frozen]
    frozen = [i for i, s in enumerate(specs) if s.frozen]
    return (
        combine([specs[i] for i in live], [words[i] for i in live]),
        combine([specs[i] for i in frozen], [words[i] for i in frozen]),
    )
