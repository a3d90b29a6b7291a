"""The package's C++ module: the tensor table's loop (``_tensors.cpp``) and a save's walk
(``_walk.cpp``), built where ``CKPTCACHE_TORCH_EXTENSION=1`` asks and torch and a C++ compiler
are found."""

import torch

#: The torch release this was compiled against (major, minor, patch).
torch_version: tuple[int, int, int]

def over_mapping(
    whole: torch.Tensor,
    starts: torch.Tensor,
    sizes: torch.Tensor,
    dims: torch.Tensor,
    ndim: torch.Tensor,
    code: torch.Tensor,
    kinds: list[torch.Tensor],
    /,
) -> list[torch.Tensor]:
    """The tensors over ``whole`` (uint8, the mapping): the i-th of ``kinds[code[i]]``'s dtype,
    shaped by the next ``ndim[i]`` entries of ``dims``, over exactly the ``sizes[i]`` bytes
    from byte ``starts[i]``, each its own storage holding the mapping; ``ValueError`` where a
    column does not check out."""

class WalkPolicy:
    """What the walk compares by identity, the reference key's marker, the dtypes refused."""

    def __init__(
        self, tensor_class: type, ordered_dict: type, ref_marker: object, refused: list[torch.dtype]
    ) -> None: ...

class Walked:
    """What a walk found (``_walk.cpp``)."""

    key: bytes | tuple[object, ...]
    tensors: list[torch.Tensor]
    ints: tuple[int, ...]
    versions: tuple[int | None, ...]
    storage_ids: tuple[int, ...]
    columns: tuple[object, ...] | None
    on_cpu: bool
    def __len__(self) -> int: ...
    def addresses(self) -> bytes: ...
    def sizes(self) -> bytes: ...
    def storages(self) -> list[torch.UntypedStorage]: ...

def walk(policy: WalkPolicy, obj: object, reference: bool, versions: bool) -> Walked | None:
    """The plan key of ``obj`` (bytes, or with ``reference`` the Python walk's tuple) and its
    tensors' storages, or None where the Python walk must decide."""
