"""The tensor table's C++ loop (``_tensors.cpp``), built at install where torch and a C++
compiler are found."""

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
