"""The open backend registry: a custom scheme served by a registered factory."""

from __future__ import annotations

import os

import pytest

from ckptcache.storage import StorageOptions, backend_for, register_backend
from ckptcache.storage.fs import FileBackend
from ckptcache.storage.registry import _factories, forget_backends


class RootedBackend(FileBackend):
    """``vault://name`` stored as ``<root>/name``: what a site-specific backend looks like."""

    def __init__(self, root: str, options: StorageOptions):
        self.root, self.options = root, options

    def _real(self, path: str) -> str:
        return os.path.join(self.root, path.split("://", 1)[1])

    def write_bytes(self, path: str, data: bytes | memoryview) -> None:
        super().write_bytes(self._real(path), data)

    def exists(self, path: str) -> bool:
        return super().exists(self._real(path))

    def read_into(self, path: str, offset: int, view: memoryview) -> None:
        super().read_into(self._real(path), offset, view)


@pytest.fixture
def vault(tmp_path):
    yield tmp_path
    _factories.pop("vault", None)


def test_registered_scheme_is_served_by_its_factory(vault):
    register_backend("vault", lambda opts: RootedBackend(str(vault), opts))
    opts = StorageOptions(s3_max_concurrency=2)
    backend = backend_for("vault://ckpt/model.pt", opts)
    assert isinstance(backend, RootedBackend) and backend.options == opts
    assert backend_for("VAULT://other", opts) is backend  # one instance per scheme and options
    backend.write_bytes("vault://model.pt", b"weights")
    assert (vault / "model.pt").read_bytes() == b"weights"
    buf = bytearray(3)
    backend.read_ranges("vault://model.pt", [(4, memoryview(buf))])
    assert bytes(buf) == b"hts"


def test_registering_again_needs_clobber_and_replaces_the_cached_instance(vault):
    register_backend("vault://", lambda opts: RootedBackend(str(vault), opts))
    first = backend_for("vault://a")
    with pytest.raises(ValueError, match="already registered"):
        register_backend("vault", lambda opts: RootedBackend(str(vault / "x"), opts))
    with pytest.raises(ValueError, match="already registered"):
        register_backend("file", lambda opts: FileBackend())
    assert backend_for("vault://a") is first
    register_backend("vault", lambda opts: RootedBackend(str(vault / "x"), opts), clobber=True)
    second = backend_for("vault://a")
    assert second is not first and isinstance(second, RootedBackend)
    assert second.root == str(vault / "x")


def test_forgotten_backends_are_built_again_and_others_kept(vault):
    register_backend("vault", lambda opts: RootedBackend(str(vault), opts))
    first, local = backend_for("vault://a"), backend_for("/tmp/a")
    forget_backends("VAULT://", "s3")
    again = backend_for("vault://a")
    assert again is not first and isinstance(again, RootedBackend)
    assert backend_for("vault://b") is again  # built once more, then cached as before
    assert backend_for("/tmp/a") is local  # another scheme's instance is kept


@pytest.mark.parametrize("scheme", ["", "a/b", "x y"])
def test_bad_scheme_is_refused(scheme):
    with pytest.raises(ValueError, match="not a URL scheme"):
        register_backend(scheme, lambda opts: FileBackend())
