"""Pick a backend by URL scheme; heavy clients are imported only when first used.

The registry is open (as fsspec's ``register_implementation``): :func:`register_backend` maps
a scheme to a factory taking the daemon's :class:`StorageOptions`. Built in: plain paths and
``file://`` (:class:`~ckptcache.storage.fs.FileBackend`), ``s3://``/``s3a://``
(:class:`~ckptcache.storage.s3.S3Backend`); any other scheme falls back to fsspec.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ckptcache.storage.base import StorageBackend, StorageOptions

__all__ = ["BackendFactory", "backend_for", "forget_backends", "register_backend", "scheme_of"]

#: Builds the backend of one scheme from the storage options.
BackendFactory = Callable[[StorageOptions], StorageBackend]

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
            factory = _factories.get(scheme)
            backend = factory(options) if factory else _fsspec(scheme)
            _cache[key] = backend
        return backend


def register_backend(scheme: str, factory: BackendFactory, *, clobber: bool = False) -> None:
    """Serve ``scheme://`` paths with the backend ``factory(options)`` builds.

    Registering a scheme that already has a factory (built-in or registered) raises
    ``ValueError`` unless ``clobber``; instances already built for the scheme are dropped, so
    the next :func:`backend_for` uses the new factory. A daemon that should persist to the
    scheme must register it before it starts (e.g. in a ``sitecustomize`` module)."""
    scheme = scheme.lower().removesuffix("://")
    if not scheme or not scheme.replace("+", "").replace("-", "").replace(".", "").isalnum():
        raise ValueError(f"not a URL scheme: {scheme!r}")
    with _lock:
        if scheme in _factories and not clobber:
            raise ValueError(f"a storage backend for {scheme}:// is already registered")
        _factories[scheme] = factory
    forget_backends(scheme)


def forget_backends(*schemes: str) -> None:
    """Drop the backends already built for ``schemes``, so the next :func:`backend_for`
    builds them again: from the factory now registered, and with the endpoint the
    environment names now (an S3 client reads ``AWS_ENDPOINT_URL_S3`` once, when built)."""
    wanted = {s.lower().removesuffix("://") for s in schemes}
    with _lock:
        for key in [k for k in _cache if k[0] in wanted]:
            del _cache[key]


def _file(options: StorageOptions) -> StorageBackend:
    from ckptcache.storage.fs import FileBackend

    return FileBackend()


def _s3(options: StorageOptions) -> StorageBackend:
    try:
        import boto3  # noqa: F401
    except ImportError as e:
        raise ImportError("s3:// paths need boto3: pip install boto3") from e
    from ckptcache.storage.s3 import S3Backend

    return S3Backend(options)


def _fsspec(scheme: str) -> StorageBackend:
    try:
        import fsspec  # noqa: F401
    except ImportError as e:
        raise ImportError(f"{scheme}:// paths need fsspec: pip install fsspec") from e
    from ckptcache.storage.fsspec_backend import FsspecBackend

    return FsspecBackend()


_factories: dict[str, BackendFactory] = {"file": _file, "s3": _s3, "s3a": _s3}
