"""S3 through boto3: single PUT for small objects, parallel multipart upload for large ones.

An object becomes visible only when ``CompleteMultipartUpload`` succeeds, so a failed or
killed persist never leaves a partial object; its uploaded parts are aborted (now, or by
``cleanup`` before the next attempt after a daemon crash).
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO

from ckptcache.storage.base import (
    COMMIT_NS_KEY,
    Producer,
    StorageBackend,
    StorageOptions,
    StoredVersion,
    WriteGuard,
)
from ckptcache.storage.ranges import GappedProducer
from ckptcache.storage.s3_parts import MIN_PART, copy_pieces
from ckptcache.storage.s3_upload import Splice, Upload

__all__ = ["READ_PIECE", "S3Backend", "split_s3_url"]

#: Bytes of a ranged GET's body taken at a time, each reported as it lands: a relay record.
READ_PIECE = 1 << 20


def _ignore(n: int) -> None:
    """Progress nobody follows."""


def split_s3_url(path: str) -> tuple[str, str]:
    """``s3://bucket/key`` -> (bucket, key); raises ``ValueError`` when malformed."""
    if not path.startswith("s3://"):
        raise ValueError(f"not an s3:// URL: {path!r}")
    bucket, _, key = path[5:].partition("/")
    if not bucket or not key:
        raise ValueError(f"s3 URL needs a bucket and a key: {path!r}")
    return bucket, key


def _modified_ns(head: dict[str, Any]) -> int:
    return int(head["LastModified"].timestamp() * 1e9)


def _as_oserror(e: Exception, what: str) -> OSError:
    """botocore errors are not OSErrors; the persister classifies OSErrors."""
    code = getattr(e, "response", {}).get("Error", {}).get("Code", "")
    if code in ("AccessDenied", "403"):
        return PermissionError(f"{what}: {e}")
    if code in ("NoSuchKey", "404", "NoSuchBucket"):
        return FileNotFoundError(f"{what}: {e}")
    if code in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409"):
        return _Changed(f"{what}: the object changed while it was written ({code})")
    return OSError(f"{what}: {type(e).__name__}: {e}")


class _Changed(OSError):
    """A conditional write found another object than the one its guard allowed replacing."""


class S3Backend(StorageBackend):
    """``s3://bucket/key`` objects; endpoint and credentials from the boto3 environment or
    :class:`StorageOptions` (``s3_endpoint_url``, ``s3_region``)."""

    def __init__(self, options: StorageOptions | None = None):
        self.options = options or StorageOptions()
        self._client: Any = None

    @property
    def client(self) -> Any:
        """The boto3 client (created lazily: importing this module needs no boto3)."""
        if self._client is None:
            import boto3
            from botocore.config import Config

            opts = self.options
            connections = 2 * max(opts.s3_max_concurrency, opts.s3_connections)
            self._client = boto3.client(
                "s3",
                endpoint_url=opts.s3_endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3"),
                region_name=opts.s3_region,
                config=Config(
                    retries={"max_attempts": opts.s3_attempts, "mode": "standard"},
                    max_pool_connections=max(10, connections),
                    connect_timeout=5,
                    read_timeout=60,
                ),
            )
        return self._client

    def _call(self, what: str, fn: Any, **kwargs: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn(**kwargs)
        except (ClientError, BotoCoreError) as e:
            raise _as_oserror(e, what) from e

    # ``write`` is the base's: the range read in pieces into write_stream (multipart).

    def write_stream(
        self, path: str, produce: Producer, *, guard: WriteGuard | None = None
    ) -> None:
        """Parts are cut from the stream as it comes (each the next pieces joined once they
        reach the part size) and uploaded in parallel, at most ``s3_max_concurrency`` in
        flight; an object smaller than one part is a single PUT. The pieces are only
        referenced until their part is joined (the producer keeps its source alive)."""
        meta, condition = self._commit_metadata(path, guard)
        part = max(self.options.s3_part_size, MIN_PART)
        with self._upload(path, meta) as upload:

            def sink(chunk: bytes | memoryview) -> None:
                upload.add(chunk)
                if upload.pending >= part:
                    upload.flush()

            produce(sink)
            if not upload.started:
                self._put_guarded(path, upload.take(), meta, condition, guard)
                return
            upload.flush()
            self._complete_guarded(path, upload.id, upload.parts(), guard)

    def write_spliced(
        self,
        path: str,
        produce: GappedProducer,
        copies: Sequence[tuple[int, int]],
        *,
        token: str,
        guard: WriteGuard | None = None,
    ) -> None:
        """:meth:`write_stream` for an object whose ranges ``copies`` (placed by
        :func:`~ckptcache.storage.s3_parts.place_copies`) are copied from the same ranges of
        the object now at ``path``, whose ETag is ``token``: ``produce`` writes the whole
        object but calls ``skip`` for the bytes it leaves to the copies; what it writes inside
        a copied range (a header the copy holds too) is dropped. Each copy names ``token``
        (``CopySourceIfMatch``), and the object is looked up once more before the upload
        completes: a replaced object fails the write (``OSError``), nothing is visible."""
        meta, _ = self._commit_metadata(path, guard)
        part = max(self.options.s3_part_size, MIN_PART)
        splice = Splice(copies)
        with self._upload(path, meta) as upload:

            def to_copy() -> None:  # the uploaded run before a copied range ends here
                if upload.pending:
                    upload.flush()
                start, end = splice.copy
                for piece in copy_pieces(start, end):
                    upload.copy(piece, token)

            def sink(chunk: bytes | memoryview) -> None:
                for piece in splice.uploaded(chunk, to_copy):
                    upload.add(piece)
                    if upload.pending >= part and splice.room() >= MIN_PART:
                        upload.flush()

            def skip(n: int) -> None:
                splice.skip(n, to_copy)

            produce(sink, skip)
            splice.finish(path)
            upload.flush()
            current = self.version(path)
            if current is None or current.token != token:
                raise OSError(
                    f"{path}: the object ranges were copied from was replaced during the "
                    "upload; written again in full"
                )
            self._complete_guarded(path, upload.id, upload.parts(), guard)

    def _upload(self, path: str, meta: dict[str, str]) -> Upload:
        bucket, key = split_s3_url(path)
        window = self.options.s3_max_concurrency
        return Upload(self._call, self.client, bucket, key, meta, window)

    def write_bytes(
        self,
        path: str,
        data: bytes | memoryview,
        *,
        metadata: dict[str, str] | None = None,
        condition: dict[str, str] | None = None,
    ) -> None:
        """One PUT; ``condition`` (``IfMatch``/``IfNoneMatch``) makes S3 refuse it with 412
        if the object is not the one the caller checked."""
        bucket, key = split_s3_url(path)
        self._call("put object", self.client.put_object, Bucket=bucket, Key=key,
                   Body=bytes(data), Metadata=metadata or {}, **(condition or {}))  # fmt: skip

    def _put_guarded(
        self, path: str, body: bytes, meta: dict[str, str], condition: dict[str, str],
        guard: WriteGuard | None,
    ) -> None:  # fmt: skip
        """A single PUT made conditional on the object the guard allowed replacing: the
        check and the write are one step on S3's side (a compare-and-swap on the ETag)."""
        try:
            self.write_bytes(path, body, metadata=meta, condition=condition)
        except _Changed:
            # Says why (newer, conflict, or this generation landed: a retry whose first
            # try's reply was lost), else retried.
            self._check_guard(path, guard)
            raise

    def _complete_guarded(
        self, path: str, upload: str, parts: list[dict[str, Any]], guard: WriteGuard | None
    ) -> None:
        """Complete a multipart upload if the guard still allows it, conditional on the
        object it checked (a write may have landed while the parts went up)."""
        bucket, key = split_s3_url(path)
        condition = self._check_guard(path, guard)
        try:
            self._call("complete multipart upload", self.client.complete_multipart_upload,
                       Bucket=bucket, Key=key, UploadId=upload,
                       MultipartUpload={"Parts": parts}, **condition)  # fmt: skip
        except _Changed:
            self._check_guard(path, guard)
            raise

    def _commit_metadata(
        self, path: str, guard: WriteGuard | None
    ) -> tuple[dict[str, str], dict[str, str]]:
        """Refuse what ``guard`` refuses; the metadata recording its stamp, and the condition
        of a write that replaces only the object checked."""
        if guard is None:
            return {}, {}
        condition = self._check_guard(path, guard)
        return {COMMIT_NS_KEY: str(guard.stamp_ns)}, condition

    def _check_guard(self, path: str, guard: WriteGuard | None) -> dict[str, str]:
        """Raise unless ``guard`` allows replacing the object (checked before an upload starts
        and again right before it completes, as the file backend checks before its rename: a
        multipart upload can take minutes); returns the S3 condition naming the object
        checked (``IfMatch`` its ETag, ``IfNoneMatch: *`` when there was none)."""
        if guard is None:
            return {}
        version = self.version(path)
        guard.check(path, version)
        if version is None:
            return {"IfNoneMatch": "*"}
        return {"IfMatch": version.token} if version.token else {}

    def version(self, path: str) -> StoredVersion | None:
        head = self._head(path)
        if head is None:
            return None
        recorded = head.get("Metadata", {}).get(COMMIT_NS_KEY, "")
        stamp = int(recorded) if recorded.isdigit() else _modified_ns(head)
        etag = str(head.get("ETag", ""))
        identity = f"{etag}:{head.get('VersionId', '')}:{_modified_ns(head)}"
        return StoredVersion(stamp, identity, recorded.isdigit(), token=etag)

    def _head(self, path: str) -> dict[str, Any] | None:
        """The object's HEAD reply, ``None`` when absent."""
        bucket, key = split_s3_url(path)
        try:
            return self._call("head object", self.client.head_object, Bucket=bucket, Key=key)
        except FileNotFoundError:
            return None
        except PermissionError as e:
            # S3 answers 403, not 404, to a HEAD of a missing key when the caller may not list
            # the bucket: without that permission a first persist can never tell "absent".
            raise PermissionError(
                f"{e}. S3 refuses to say whether {path} exists: ckptcache checks that no newer "
                f"object is there before each upload, which needs s3:ListBucket on bucket "
                f"{bucket!r} besides s3:GetObject, s3:PutObject and s3:AbortMultipartUpload"
            ) from e

    def commit_time_ns(self, path: str) -> int | None:
        version = self.version(path)
        return None if version is None else version.stamp_ns

    def exists(self, path: str) -> bool:
        bucket, key = split_s3_url(path)
        try:
            self._call("head object", self.client.head_object, Bucket=bucket, Key=key)
        except FileNotFoundError:
            return False
        return True

    def open_read(self, path: str) -> BinaryIO:
        bucket, key = split_s3_url(path)
        reply = self._call("get object", self.client.get_object, Bucket=bucket, Key=key)
        return io.BytesIO(reply["Body"].read())

    def size(self, path: str) -> int:
        bucket, key = split_s3_url(path)
        reply = self._call("head object", self.client.head_object, Bucket=bucket, Key=key)
        return int(reply["ContentLength"])

    def read_into(self, path: str, offset: int, view: memoryview) -> None:
        self.read_into_reporting(path, offset, view, _ignore)

    def read_into_reporting(
        self, path: str, offset: int, view: memoryview, progress: Callable[[int], None]
    ) -> None:
        """:meth:`read_into`, calling ``progress(n)`` after every :data:`READ_PIECE` bytes
        in place (:mod:`ckptcache.storage.reporting`: a relay follows the range as it lands)."""
        bucket, key = split_s3_url(path)
        rng = f"bytes={offset}-{offset + len(view) - 1}"
        reply = self._call("get object range", self.client.get_object, Bucket=bucket, Key=key,
                           Range=rng)  # fmt: skip
        body = reply["Body"]
        done = 0
        try:
            while done < len(view):
                chunk = body.read(min(len(view) - done, READ_PIECE))
                if not chunk:
                    raise OSError(f"{path}: range {rng} ended early")
                view[done : done + len(chunk)] = chunk
                done += len(chunk)
                progress(done)
        finally:
            body.close()

    def read_ranges(self, path: str, ranges: Sequence[tuple[int, memoryview]]) -> None:
        """One ranged GET per range, at most ``s3_max_concurrency`` in flight."""
        if len(ranges) <= 1 or self.options.s3_max_concurrency <= 1:
            super().read_ranges(path, ranges)
            return
        workers = min(self.options.s3_max_concurrency, len(ranges))
        with ThreadPoolExecutor(workers, thread_name_prefix="ckptcache-s3-get") as pool:
            futures = [pool.submit(self.read_into, path, off, view) for off, view in ranges]
            try:
                for future in futures:
                    future.result()  # the first failure, in range order
            except BaseException:
                for future in futures:
                    future.cancel()  # do not start requests whose result is discarded
                raise

    def delete(self, path: str) -> None:
        bucket, key = split_s3_url(path)
        self._call("delete object", self.client.delete_object, Bucket=bucket, Key=key)

    def cleanup(self, path: str) -> None:
        bucket, key = split_s3_url(path)
        try:
            reply = self.client.list_multipart_uploads(Bucket=bucket, Prefix=key)
        except Exception:
            return
        for upload in reply.get("Uploads", []):
            if upload["Key"] == key:
                try:
                    self.client.abort_multipart_upload(
                        Bucket=bucket, Key=key, UploadId=upload["UploadId"]
                    )
                except Exception:
                    pass
