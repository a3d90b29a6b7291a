"""The checkpoint format: how a saved object is laid out in a segment and on storage.

One package for every module that reads or writes checkpoint bytes:

- ``layout``: the segment header (magic, layout version, sizes) at the front of each segment;
- ``archive``: the ``torch.save`` zip archive (stored entries, alignment, zip64) that a
  segment's payload and a persisted file both are;
- ``manifest``: the per-object record of tensors, offsets and digests;
- ``digest``: the digest algorithm and its helpers; ``crc``: combining CRC-32s of blocks;
- ``persisted``: reading and verifying a persisted archive from storage;
- ``flatten``, ``objectio``, ``shm``: the client side, which turns Python objects with
  tensors into an archive plan and back. Only these three import torch; the daemon and the
  CLI use the other modules and stay torch-free (``tests/e2e/local/test_footprint.py``).

Importing the package imports none of its modules.
"""
