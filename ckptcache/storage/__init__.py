"""Storage backends chosen by URL scheme: local/NFS paths, any fsspec file system, and S3.

See :class:`~ckptcache.storage.base.StorageBackend` for the contract every backend meets.
"""

from ckptcache.storage.base import StorageBackend, StorageOptions
from ckptcache.storage.registry import backend_for, register_backend, scheme_of

__all__ = ["StorageBackend", "StorageOptions", "backend_for", "register_backend", "scheme_of"]
