"""The moving parts of an S3 multipart upload: :class:`Upload` (parts uploaded or copied in
parallel, in order of their numbers, aborted on any failure) and :class:`Splice` (where a
stream's bytes fall between the ranges copied from the previous object)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType
from typing import Any

__all__ = ["Call", "Splice", "Upload"]

#: ``call(what, fn, **kwargs)``: ``fn(**kwargs)`` with the store's errors as ``OSError``s.
Call = Callable[..., Any]


class Upload:
    """One multipart upload of ``path``, created at its first part. Parts are numbered in the
    order they are added; at most ``s3_max_concurrency`` are in flight, which bounds the bytes
    held. Leaving the ``with`` block by an exception aborts the upload (``cleanup`` aborts
    what a killed daemon left)."""

    def __init__(
        self, call: Call, client: Any, bucket: str, key: str, meta: dict[str, str], window: int
    ):
        self.call, self.client, self.meta = call, client, meta
        self.bucket, self.key = bucket, key
        self.id = ""
        self._pending: list[bytes | memoryview] = []
        self.pending = 0  # bytes added since the last part
        self._window = window
        self._futures: list[Future[dict[str, Any]]] = []
        self._pool = ThreadPoolExecutor(self._window, thread_name_prefix="ckptcache-s3-put")

    @property
    def started(self) -> bool:
        """Whether a part was sent (the upload exists)."""
        return bool(self.id)

    def add(self, chunk: bytes | memoryview) -> None:
        """Bytes for the next uploaded part (referenced until :meth:`flush` joins them)."""
        self._pending.append(chunk)
        self.pending += len(chunk)

    def take(self) -> bytes:
        """The bytes added since the last part, joined (for a single PUT instead)."""
        body = b"".join(self._pending)
        self._pending.clear()
        self.pending = 0
        return body

    def flush(self) -> None:
        """Send the bytes added since the last part as the next part (none: nothing)."""
        if not self.pending:
            return
        body = self.take()
        self._submit(lambda number: self._put(number, body))

    def copy(self, piece: tuple[int, int], token: str) -> None:
        """Copy ``[start, end)`` of the object now at the key, whose ETag must be ``token``,
        as the next part."""
        self._submit(lambda number: self._copy(number, piece, token))

    def parts(self) -> list[dict[str, Any]]:
        """Every part's number and ETag, once all are sent (raises the first failure)."""
        return [future.result() for future in self._futures]

    def _submit(self, send: Callable[[int], dict[str, Any]]) -> None:
        if not self.id:
            reply = self.call(
                "create multipart upload", self.client.create_multipart_upload,
                Bucket=self.bucket, Key=self.key, Metadata=self.meta,
            )  # fmt: skip
            self.id = reply["UploadId"]
        if len(self._futures) >= self._window:
            self._futures[len(self._futures) - self._window].result()  # bound what is held
        self._futures.append(self._pool.submit(send, len(self._futures) + 1))

    def _put(self, number: int, body: bytes) -> dict[str, Any]:
        reply = self.call(
            f"upload part {number}", self.client.upload_part, Bucket=self.bucket,
            Key=self.key, UploadId=self.id, PartNumber=number, Body=body,
        )  # fmt: skip
        return {"PartNumber": number, "ETag": reply["ETag"]}

    def _copy(self, number: int, piece: tuple[int, int], token: str) -> dict[str, Any]:
        start, end = piece
        reply = self.call(
            f"copy part {number}", self.client.upload_part_copy, Bucket=self.bucket,
            Key=self.key, UploadId=self.id, PartNumber=number,
            CopySource={"Bucket": self.bucket, "Key": self.key},
            CopySourceRange=f"bytes={start}-{end - 1}", CopySourceIfMatch=token,
        )  # fmt: skip
        return {"PartNumber": number, "ETag": reply["CopyPartResult"]["ETag"]}

    def __enter__(self) -> Upload:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        try:
            if error is not None:
                for future in self._futures:
                    future.cancel()
                if self.id:
                    try:
                        self.client.abort_multipart_upload(
                            Bucket=self.bucket, Key=self.key, UploadId=self.id
                        )
                    except Exception:
                        pass  # cleanup() aborts it before the next attempt
        finally:
            self._pool.shutdown(wait=True)


class Splice:
    """Follows a stream's position over an object whose ranges ``copies`` (sorted, disjoint)
    are copied: bytes outside them are uploaded, bytes inside them dropped (the copy holds
    them) and skips must fall inside them. ``enter`` is called as each copied range begins,
    after the uploaded bytes before it."""

    def __init__(self, copies: Sequence[tuple[int, int]]):
        self.copies = list(copies)
        self.at = 0  # position in the object
        self._next = 0  # index of the copied range at or after the position
        self._entered = False

    @property
    def copy(self) -> tuple[int, int]:
        """The copied range the position is entering or in."""
        return self.copies[self._next]

    def room(self) -> int:
        """Bytes uploaded from here before the next copied range (a large number: none)."""
        if self._next < len(self.copies):
            return self.copies[self._next][0] - self.at
        return 1 << 62

    def uploaded(
        self, chunk: bytes | memoryview, enter: Callable[[], None]
    ) -> Iterator[memoryview]:
        """The parts of ``chunk`` to upload, in order (``enter`` called between them)."""
        view = memoryview(chunk)
        while view:
            self._enter_if_due(enter)
            if self._inside():
                end = self.copies[self._next][1]
                n = min(len(view), end - self.at)
                self._move(n)
            else:
                n = min(len(view), self.room())
                self.at += n  # before the part is cut: room() counts from after it
                yield view[:n]
            view = view[n:]
        self._enter_if_due(enter)

    def skip(self, n: int, enter: Callable[[], None]) -> None:
        """Pass over ``n`` bytes that must lie inside one copied range."""
        self._enter_if_due(enter)
        if not self._inside() or self.at + n > self.copies[self._next][1]:
            raise AssertionError(f"a skip of {n} bytes at {self.at} leaves the copied ranges")
        self._move(n)

    def finish(self, path: str) -> None:
        """Check the stream passed every copied range."""
        if self._next < len(self.copies):
            raise OSError(f"{path}: the stream ended at {self.at}, before the copied range "
                          f"{self.copies[self._next]}")  # fmt: skip

    def _inside(self) -> bool:
        return self._next < len(self.copies) and self.copies[self._next][0] <= self.at

    def _enter_if_due(self, enter: Callable[[], None]) -> None:
        if not self._entered and self._next < len(self.copies) and self.at == self.copy[0]:
            self._entered = True
            enter()

    def _move(self, n: int) -> None:
        self.at += n
        if self.at == self.copies[self._next][1]:
            self._next += 1
            self._entered = False
