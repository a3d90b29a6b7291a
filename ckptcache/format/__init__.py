"""The checkpoint format: how a saved object is laid out in a segment and on storage,
without torch.

- ``layout``: the segment header (magic, layout version, sizes) at the front of each segment;
- ``archive``, ``archive_read``, ``zip_records``: the ``torch.save`` zip archive (stored
  entries, alignment, zip64) that a segment's payload and a persisted file both are, written,
  read in ranges and listed;
- ``manifest``, ``names``, ``packed_records``, ``b64``: the per-object record of tensors,
  offsets and digests;
- ``digest``: the digest algorithm and its helpers; ``crc``: combining CRC-32s of blocks;
- ``persisted``, ``prefix_read``: reading and verifying a persisted archive from storage;
- ``fastcopy``, ``pagetables``, ``gcpause``: the byte-moving primitives under both (the copy
  and page-population extension, the collector paused around a save).

The daemon and the CLI use only this package and stay torch-free
(``tests/e2e/local/test_footprint.py``); turning Python objects with tensors into an archive
and back is :mod:`ckptcache.codec`'s job. Importing the package imports none of its modules.
"""
