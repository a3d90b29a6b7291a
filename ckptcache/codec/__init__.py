"""The torch codec: Python objects with tensors into a checkpoint archive and back.

Built on :mod:`ckptcache.format` (the torch-free layout); the client, the adapters and the
data-loader batch cache use it, the daemon never does.

- ``encode``, ``decode``: the one entry each way, each stating its fast-path order;
- ``flatten``, ``skeleton``: an object into its tensors and its pickled skeleton, and back;
- ``objectio``: a flattened object written into a mapped segment, and rebuilt from one;
- ``shm``: the segment mappings and the copy into them;
- ``fast_unpickle``, ``table/``: the fast loads of a plain state dict (the skeleton in the C
  unpickler; the tensor table, made in bulk);
- ``plan/``: save plans reused across saves of the same structure;
- ``stored_load``: a checkpoint loaded straight from storage;
- ``packing``: many small items in one cached object;
- ``gpu/``: CUDA tensors into and out of segments.

Importing the package imports none of its modules (nor torch).
"""
