"""Pick a backend by URL scheme; heavy clients are imported only when first used."""

from __future__ import annotations

import threading

from ckptcache.storage.base import StorageBackend, StorageOptions

__all__ = ["backend_for", "scheme_of"]

_lock = threading.Lock()
_cache: dict[tuple[str, StorageOptions], StorageBackend] = {}


def scheme_of(path: str) -> str:
    """``s3`` for ``s3://b/k``, ``file`` for plain paths and ``file://`` URLs."""
    if "://" not in path:
        return "file"
    return path.split("://", 1)[0].lower()


def backend_for(path: str, options: StorageOptions | None = None) -> StorageBackend:
    """The backend that stores ``path`` (one shared instance per scheme and options)."""
    options = options or StorageOptions()
    scheme = scheme_of(path)
    key = (scheme, options)
    with _lock:
        backend = _cache.get(key)
        if backend is None:
            backend = _make(scheme, options)
            _cache[key] = backend
        return backend


def _make(scheme: str, options: StorageOptions) -> StorageBackend:
    if scheme == "file":
        from ckptcache.storage.fs import FileBackend

        return FileBackend()
    if scheme in ("s3", "s3a"):
        try:
            import boto3  # noqa: F401
        except ImportError as e:
            raise ImportError("s3:// paths need boto3: pip install boto3") from e
        from ckptcache.storage.s3 import S3Backend

        return S3Backend(options)
    try:
        import fsspec  # noqa: F401
    except ImportError as e:
        raise ImportError(f"{scheme}:// paths need fsspec: pip install fsspec") from e
    from ckptcache.storage.fsspec_backend import FsspecBackend

    return FsspecBackend()
