"""The state dicts every system saves: five shapes that matter, made the same way in every
process, so a reload is checked byte for byte against a fresh copy of what was saved.

* ``large``: 16 float32 tensors (a few large ones: the shape the demo uses).
* ``small``: 75% of the bytes in 16 MiB tensors, the rest in 64 KiB tensors (2,072 tensors at
  512 MiB, 8,288 at 2 GiB): a real model's weights and its norms, biases and small layers.
* ``flat``: DeepSpeed-like: bf16 parameters that are views into one flat buffer (the module's
  state dict), next to the optimizer's fp32 master copy and two moments as three flat buffers.
* ``moe``: 20,000 float32 tensors (100 layers x 100 experts x two weights), nested dicts.
* ``moe-fine``: 50,000 float32 tensors (100 layers x 250 experts x two weights), nested dicts:
  a rank's file of a fine-grained mixture-of-experts model.

The bytes are a seeded random block tiled with a per-tensor shift: as incompressible as
random data, and cheap to make at 2 GiB on two cores.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

SHAPES = ("large", "small", "flat", "moe", "moe-fine")

_BLOCK = 16 << 20
_MIB = 1 << 20


def _block(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (_BLOCK + 4096,), dtype=torch.uint8, generator=g)


def _fill(t: torch.Tensor, block: torch.Tensor, index: int) -> torch.Tensor:
    """Fill ``t``'s bytes from ``block``, shifted by ``index`` (every tensor differs)."""
    raw = t.view(-1).view(torch.uint8)
    shift = (index * 97) % 4096
    done = 0
    while done < raw.numel():
        n = min(_BLOCK, raw.numel() - done)
        raw[done : done + n].copy_(block[shift : shift + n])
        done += n
    return t


def make(shape: str, nbytes: int, seed: int = 0) -> Any:
    """The state of ``shape`` totalling about ``nbytes``."""
    block = _block(seed)
    counter = iter(range(1 << 30))

    def tensor(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return _fill(torch.empty(numel, dtype=dtype), block, next(counter))

    if shape == "large":
        per = nbytes // 16 // 4
        return {f"layer{i:02d}.weight": tensor(per) for i in range(16)}
    if shape == "small":
        big = max(1, (nbytes * 3 // 4) // (16 * _MIB))
        small = max(1, (nbytes - big * 16 * _MIB) // (64 << 10))
        state = {f"blocks.{i}.mlp.weight": tensor(4 * _MIB) for i in range(big)}
        state.update({f"blocks.{i}.norm.weight": tensor(16 << 10) for i in range(small)})
        return state
    if shape == "flat":
        # 14 bytes a parameter: bf16 weights (2) + fp32 master, exp_avg, exp_avg_sq (3 x 4).
        params = nbytes // 14
        n_layers = 256
        per = params // n_layers
        flat16 = tensor(per * n_layers, torch.bfloat16)
        module = {f"layers.{i}.weight": flat16[i * per : (i + 1) * per] for i in range(n_layers)}
        opt = {k: tensor(per * n_layers) for k in ("fp32_flat", "exp_avg", "exp_avg_sq")}
        return {"module": module, "optimizer": {"state": opt, "step": 100}, "iteration": 100}
    if shape in ("moe", "moe-fine"):
        layers, experts, weights = 100, 100 if shape == "moe" else 250, ("w1", "w2")
        per = max(1, nbytes // (layers * experts * len(weights)) // 4)
        return {
            f"layers.{layer}": {
                f"experts.{e}": {w: tensor(per) for w in weights} for e in range(experts)
            }
            for layer in range(layers)
        }
    raise ValueError(f"unknown shape {shape!r}; one of {', '.join(SHAPES)}")


def leaves(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every leaf of nested dicts and lists."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from leaves(v, f"{prefix}{k}.")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from leaves(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], obj


def tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor of ``obj``, in order."""
    return [v for _, v in leaves(obj) if isinstance(v, torch.Tensor)]


def storages(obj: Any) -> list[torch.Tensor]:
    """A uint8 tensor over each distinct storage of ``obj``'s tensors (views of one buffer
    give it once): the bytes a save must move."""
    seen: dict[int, torch.Tensor] = {}
    for t in tensors(obj):
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen[s.data_ptr()] = torch.empty(0, dtype=torch.uint8).set_(s)
    return list(seen.values())


def state_bytes(obj: Any) -> int:
    """Bytes of the distinct storages of ``obj``'s tensors."""
    return sum(b.numel() for b in storages(obj))


def mismatch(expected: Any, got: Any) -> str | None:
    """None when ``got`` holds the same keys, dtypes, shapes and bytes as ``expected``;
    otherwise the first difference, in words."""
    want, have = dict(leaves(expected)), dict(leaves(got))
    if want.keys() != have.keys():
        missing = sorted(want.keys() - have.keys())[:3]
        extra = sorted(have.keys() - want.keys())[:3]
        return f"keys differ: missing {missing}, unexpected {extra}"
    for k, w in want.items():
        h = have[k]
        if isinstance(w, torch.Tensor):
            if not isinstance(h, torch.Tensor):
                return f"{k}: a {type(h).__name__}, not a tensor"
            if h.dtype != w.dtype or h.shape != w.shape:
                return f"{k}: {h.dtype} {tuple(h.shape)}, saved {w.dtype} {tuple(w.shape)}"
            a = w.contiguous().view(-1).view(torch.uint8)
            b = h.contiguous().view(-1).view(torch.uint8)
            if not torch.equal(a, b):
                return f"{k}: bytes differ"
        elif h != w:
            return f"{k}: {h!r}, saved {w!r}"
    return None
