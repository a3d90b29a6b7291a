"""The lab's S3 endpoint: moto's server, with a ranged GET served in time proportional to the range.

    python tests/lab_s3.py -H 10.213.0.3 -p 5000      (moto.server's own arguments)

moto 5 answers ``GET`` with a ``Range`` header by reading the whole stored object
(``FakeKey.value``: seek to 0, read everything) and only then cutting the range out of it
(``S3Response._handle_range_header``). A 4 MiB range of a 64 MiB object costs a 64 MiB read and
copy, about 100 ms on this machine under load, on a server that answers on one interpreter:
the group read of a restore, made of ranges, paid it per range, a direct single GET once. Real
S3 serves a range in time proportional to the range, so the lab measured a cost that a cluster
does not have.

:func:`patch_moto` changes that one step: while ``S3Response.get_object`` runs for a request with
a ``Range`` header, ``FakeKey.value`` returns an :class:`ObjectView` (the object's length, and
any slice read with ``pread`` from a duplicate of the stored file's descriptor) instead of the
whole bytes. moto's own range handling then takes ``len()`` and one slice of it, exactly as of
bytes, so status codes, headers and errors (416 for a range past the end) are moto's. Whatever
else reaches a response with a view still in it (a Range header moto decides to ignore, which
answers 200 with the whole object) gets the whole bytes, read then.

A part copy (``UploadPartCopy`` with ``x-amz-copy-source-range``) read the whole source object
the same way, per part; it is served the same way here. moto also ignores a part copy's
``x-amz-copy-source-if-match``; S3 refuses the copy with 412 when the source's ETag is another,
and so does this endpoint (an incremental persist names the ETag it proved its ranges against).

What it keeps: the descriptor is duplicated under the key's lock at the moment the original
would have read, so a later overwrite of the key (a new ``FakeKey`` with a new file; moto closes
the old one) does not change what this GET returns. Objects moto keeps in memory (below
``MOTO_S3_DEFAULT_KEY_BUFFER_SIZE``, 5 MiB by default) are read whole as before: they are small.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import weakref
from typing import Any
from urllib.parse import unquote, urlparse

__all__ = ["ObjectView", "patch_moto"]

_local = threading.local()


class ObjectView:
    """A stored object's bytes, read on demand: ``len()`` is its size, a slice is one ``pread``.

    Owns ``fd`` (closed when the view is collected or :meth:`close` is called)."""

    def __init__(self, fd: int, size: int) -> None:
        self._fd = fd
        self._size = size
        self._closer = weakref.finalize(self, os.close, fd)

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __getitem__(self, item: slice) -> bytes:
        if not isinstance(item, slice) or item.step not in (None, 1):
            raise TypeError("an ObjectView is read by contiguous slices only")
        start, stop, _ = item.indices(self._size)
        out = bytearray()
        while start + len(out) < stop:  # pread may return less than asked
            chunk = os.pread(self._fd, stop - start - len(out), start + len(out))
            if not chunk:
                raise OSError(f"stored object ended at {start + len(out)} of {self._size} bytes")
            out += chunk
        return bytes(out)

    def __bytes__(self) -> bytes:
        return self[:]

    def close(self) -> None:
        self._closer()


def _view_of(key: Any) -> ObjectView | None:
    """An :class:`ObjectView` of ``key``'s stored bytes, or None where they live in memory."""
    buffer = key._value_buffer  # a SpooledTemporaryFile; rolled to a file above its max size
    with key.lock:
        if not getattr(buffer, "_rolled", False):
            return None
        return ObjectView(os.dup(buffer.fileno()), key.contentsize)


_PRECONDITION = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>PreconditionFailed</Code>'
    b"<Message>At least one of the pre-conditions you specified did not hold</Message>"
    b"<Condition>x-amz-copy-source-If-Match</Condition></Error>"
)


def patch_moto() -> None:
    """Serve ranged GETs and ranged part copies by seek and read, refuse a part copy whose
    ``x-amz-copy-source-if-match`` names another ETag, and check a multipart completion's
    condition (``If-Match`` too) and a conditional PUT's in one step with the write, as S3
    does (idempotent; see the module's docstring)."""
    from moto.s3.models import FakeKey
    from moto.s3.models import S3Backend as Models
    from moto.s3.responses import S3Response

    if getattr(FakeKey, "_lab_ranged_reads", False):
        return
    whole = FakeKey.value
    get_object = S3Response.get_object
    key_response = S3Response.key_response

    def value(self: Any) -> Any:
        if getattr(_local, "ranged", False):
            view = _view_of(self)
            if view is not None:
                return view
        return whole.fget(self)

    def ranged_get_object(self: Any) -> Any:
        _local.ranged = bool(self.headers.get("range"))
        try:
            return get_object(self)
        finally:
            _local.ranged = False

    def whole_bytes_out(self: Any, *args: Any, **kwargs: Any) -> Any:
        status, headers, body = key_response(self, *args, **kwargs)
        if isinstance(body, ObjectView):  # moto ignored the range: the whole object
            with contextlib.closing(body):
                body = bytes(body)
        return status, headers, body

    copy_part = Models.upload_part_copy
    copy_response = S3Response.upload_part_copy

    def ranged_copy_part(self: Any, *args: Any, **kwargs: Any) -> Any:
        _local.ranged = kwargs.get("start_byte") is not None
        try:
            return copy_part(self, *args, **kwargs)
        finally:
            _local.ranged = False

    def conditional_copy_response(self: Any) -> Any:
        want = self.headers.get("x-amz-copy-source-if-match")
        if want:
            source = unquote(urlparse(self.headers.get("x-amz-copy-source", "")).path)
            bucket, key = source.lstrip("/").split("/", 1)
            found = self.backend.get_object(bucket, key)
            if found is None or found.etag != want:
                return 412, {"content-type": "application/xml"}, _PRECONDITION
        return copy_response(self)

    post = S3Response._key_response_post
    completing = threading.Lock()

    def atomic_conditional_post(
        self: Any, request: Any, body: bytes, bucket_name: str, query: dict[str, Any],
        key_name: str,
    ) -> Any:  # fmt: skip
        # S3 checks a completion's condition and completes in one step; moto checks and then
        # completes unlocked (two completions can both pass), and ignores If-Match there.
        with completing:
            want = self.headers.get("If-Match")
            if want and query.get("uploadId"):
                found = self.backend.get_object(bucket_name, key_name)
                if found is None or found.etag.strip('"') != want.strip('"'):
                    return 412, {"content-type": "application/xml"}, _PRECONDITION
            return post(self, request, body, bucket_name, query, key_name)

    put = S3Response.put_object

    def atomic_conditional_put(self: Any) -> Any:
        # The same for a PUT: moto checks If-Match / If-None-Match, then writes unlocked.
        if self.headers.get("If-Match") or self.headers.get("If-None-Match"):
            with completing:
                return put(self)
        return put(self)

    FakeKey.value = property(value, whole.fset)  # type: ignore[method-assign]
    S3Response._key_response_post = atomic_conditional_post  # type: ignore[method-assign]
    S3Response.put_object = atomic_conditional_put  # type: ignore[method-assign]
    Models.upload_part_copy = ranged_copy_part  # type: ignore[method-assign]
    S3Response.upload_part_copy = conditional_copy_response  # type: ignore[method-assign]
    S3Response.get_object = ranged_get_object  # type: ignore[method-assign]
    S3Response.key_response = whole_bytes_out  # type: ignore[method-assign]
    FakeKey._lab_ranged_reads = True  # type: ignore[attr-defined]


def main(argv: list[str] | None = None) -> None:
    """moto's server (same arguments) with :func:`patch_moto` applied."""
    patch_moto()
    from moto.server import main as moto_main

    moto_main(argv if argv is not None else sys.argv[1:])


if __name__ == "__main__":
    main()
