"""One conformance suite every storage backend passes (a new backend's test is a subclass)."""

from __future__ import annotations

import os
import tempfile
import time
import uuid

import pytest

from ckptcache.storage import StorageBackend, StorageOptions, backend_for
from ckptcache.storage.base import COMMIT_NS_KEY, NewerObjectExists, StorageConflict, WriteGuard
from ckptcache.storage.fs import TEMP_MARK
from tests.helpers import read_only_dir


def source_file(data: bytes, prefix: bytes = b"H" * 100) -> tuple[int, str]:
    fd, name = tempfile.mkstemp(dir="/dev/shm")
    os.write(fd, prefix + data)
    return fd, name


class Conformance:
    """Subclasses provide ``backend`` and ``url(name)``."""

    backend: StorageBackend
    #: Whether the backend records commit times (file mtime, S3 metadata).
    records_commit_time = True

    def url(self, name: str) -> str:
        raise NotImplementedError

    def test_write_from_fd_round_trips(self):
        data = os.urandom(3 << 20) + b"tail"
        fd, name = source_file(data)
        try:
            path = self.url("dir/sub/obj.pt")
            self.backend.write(path, fd, 100, len(data))
        finally:
            os.close(fd)
            os.unlink(name)
        assert self.backend.exists(path)
        with self.backend.open_read(path) as f:
            assert f.read() == data

    def test_write_stream_round_trips_and_a_failing_producer_leaves_nothing(self):
        data = os.urandom(12 << 20) + b"tail"  # several S3 parts in the S3 suite
        path = self.url("streamed/obj.pt")

        def produce(sink):
            view = memoryview(data)
            for start in range(0, len(data), 1 << 20):
                sink(view[start : start + (1 << 20)])

        self.backend.write_stream(path, produce)
        with self.backend.open_read(path) as f:
            assert f.read() == data

        def fail_late(sink):
            produce(sink)
            raise ValueError("bad bytes found at the end")

        bad = self.url("streamed/bad.pt")
        with pytest.raises(ValueError, match="bad bytes"):
            self.backend.write_stream(bad, fail_late)
        self.backend.cleanup(bad)
        assert not self.backend.exists(bad)

    def test_write_bytes_replaces_atomically(self):
        path = self.url("obj.bin")
        self.backend.write_bytes(path, b"first")
        self.backend.write_bytes(path, memoryview(b"second"))
        with self.backend.open_read(path) as f:
            assert f.read() == b"second"

    def test_missing_objects(self):
        path = self.url("never-written.pt")
        assert not self.backend.exists(path)
        with pytest.raises(FileNotFoundError):
            self.backend.open_read(path)
        self.backend.delete(path)  # missing is fine

    def test_size(self):
        path = self.url("sized/obj.bin")
        self.backend.write_bytes(path, b"x" * 12345)
        assert self.backend.size(path) == 12345
        with pytest.raises(FileNotFoundError):
            self.backend.size(self.url("never-written.bin"))

    def test_read_into_fills_the_range_and_fails_past_the_end(self):
        data = os.urandom(1 << 20)
        path = self.url("ranged/obj.bin")
        self.backend.write_bytes(path, data)
        buf = bytearray(4096)
        self.backend.read_into(path, 1000, memoryview(buf))
        assert bytes(buf) == data[1000:5096]
        with pytest.raises(OSError):
            self.backend.read_into(path, len(data) - 10, memoryview(bytearray(100)))
        with pytest.raises(FileNotFoundError):
            self.backend.read_into(self.url("never-written.bin"), 0, memoryview(bytearray(1)))

    def test_read_ranges_fills_every_view(self):
        data = os.urandom(3 << 20)
        path = self.url("ranged/many.bin")
        self.backend.write_bytes(path, data)
        # Out of order, overlapping, one spanning most of the object.
        spans = [(2 << 20, 1000), (0, 1), (5, 64 << 10), (100, 3 << 19), (len(data) - 7, 7)]
        bufs = [bytearray(n) for _, n in spans]
        self.backend.read_ranges(
            path, [(o, memoryview(b)) for (o, _), b in zip(spans, bufs, strict=True)]
        )
        for (offset, n), buf in zip(spans, bufs, strict=True):
            assert bytes(buf) == data[offset : offset + n], offset
        with pytest.raises(OSError):
            ranges = [(0, memoryview(bytearray(10))), (len(data) - 1, memoryview(bytearray(2)))]
            self.backend.read_ranges(path, ranges)

    def test_delete(self):
        path = self.url("gone.pt")
        self.backend.write_bytes(path, b"x")
        self.backend.delete(path)
        assert not self.backend.exists(path)

    def test_newest_wins_by_what_was_there_not_by_clocks(self):
        """A guarded write replaces the object only if it is the one that was there when the
        save was made (its base), whatever the stamps say; without a base the stamps decide."""
        data = os.urandom(6 << 20)  # above S3's test part size: the multipart path
        fd, name = source_file(data)
        path, t = self.url("stamped/obj.pt"), 2_000_000_000_123_456_789
        try:
            self.backend.write(path, fd, 100, len(data), guard=WriteGuard(t, base=""))
            if not self.records_commit_time:
                assert self.backend.commit_time_ns(path) is None
                assert self.backend.version(path) is None
                return
            assert self.backend.commit_time_ns(path) == t
            first = self.backend.version(path)
            assert first is not None and first.stamp_ns == t
            with pytest.raises(NewerObjectExists):  # no base: an older stamp never replaces
                self.backend.write(path, fd, 100, 1000, guard=WriteGuard(t - 1))
            # A save made while ``first`` was there replaces it, even stamped an hour earlier
            # (its node's clock is behind).
            behind = t - 3600 * 10**9
            self.backend.write(path, fd, 100, 1000, guard=WriteGuard(behind, base=first.identity))
            with self.backend.open_read(path) as f:
                assert f.read() == data[:1000]
            assert self.backend.commit_time_ns(path) == behind
            # A save made while ``first`` was there, after which another save replaced it, is
            # never written, even stamped an hour later (its node's clock is ahead).
            ahead = t + 3600 * 10**9
            with pytest.raises((NewerObjectExists, StorageConflict)):
                self.backend.write(
                    path, fd, 200, 1000, guard=WriteGuard(ahead, base=first.identity)
                )
            with self.backend.open_read(path) as f:
                assert f.read() == data[:1000]
        finally:
            os.close(fd)
            os.unlink(name)
        assert self.backend.commit_time_ns(self.url("never-written.pt")) is None
        assert self.backend.version(self.url("never-written.pt")) is None

    def test_short_source_fails_and_leaves_nothing(self):
        fd, name = source_file(b"only-a-few-bytes", prefix=b"")
        path = self.url("short.pt")
        try:
            with pytest.raises(OSError):
                self.backend.write(path, fd, 0, 10 << 20)
        finally:
            os.close(fd)
            os.unlink(name)
        self.backend.cleanup(path)
        assert not self.backend.exists(path)


class TestFileBackend(Conformance):
    @pytest.fixture(autouse=True)
    def _setup(self, tmp_path):
        self.root = tmp_path
        self.backend = backend_for(str(tmp_path))

    def url(self, name):
        return str(self.root / name)

    def test_no_temp_debris_after_failure(self):
        self.test_short_source_fails_and_leaves_nothing()
        assert not [p for p in self.root.rglob("*") if TEMP_MARK in p.name]

    def test_permission_denied_is_a_permission_error(self):
        ro = self.root / "ro"
        ro.mkdir()
        with read_only_dir(ro), pytest.raises(PermissionError):
            self.backend.write_bytes(str(ro / "x.pt"), b"x")
        assert list(ro.iterdir()) == []


class TestFsspecMemory(Conformance):
    records_commit_time = False

    @pytest.fixture(autouse=True)
    def _setup(self):
        pytest.importorskip("fsspec")
        self.prefix = f"memory://conformance-{uuid.uuid4().hex[:8]}"
        self.backend = backend_for(self.prefix)

    def url(self, name):
        return f"{self.prefix}/{name}"


class TestS3(Conformance):
    @pytest.fixture(autouse=True)
    def _setup(self, s3_server, s3_bucket):
        self.bucket = s3_bucket
        # small parts so a 3 MiB object exercises the parallel multipart path
        self.backend = backend_for(
            f"s3://{s3_bucket}/x",
            StorageOptions(s3_endpoint_url=s3_server.endpoint, s3_part_size=5 << 20),
        )
        self.client = s3_server.client()

    def url(self, name):
        return f"s3://{self.bucket}/{name}"

    def test_multipart_upload_of_large_object(self):
        data = os.urandom(11 << 20)
        fd, name = source_file(data)
        try:
            self.backend.write(self.url("big.pt"), fd, 100, len(data))
        finally:
            os.close(fd)
            os.unlink(name)
        with self.backend.open_read(self.url("big.pt")) as f:
            assert f.read() == data
        uploads = self.client.list_multipart_uploads(Bucket=self.bucket).get("Uploads", [])
        assert uploads == []

    def test_failed_multipart_leaves_no_object_and_no_upload(self):
        fd, name = source_file(b"x" * (6 << 20), prefix=b"")
        try:
            with pytest.raises(OSError):
                self.backend.write(self.url("partial.pt"), fd, 0, 20 << 20)
        finally:
            os.close(fd)
            os.unlink(name)
        self.backend.cleanup(self.url("partial.pt"))
        assert not self.backend.exists(self.url("partial.pt"))
        uploads = self.client.list_multipart_uploads(Bucket=self.bucket).get("Uploads", [])
        assert uploads == []

    def test_a_head_refused_for_want_of_the_list_permission_says_so(self):
        """AWS answers 403 to a HEAD of a missing key when the caller may not list the bucket:
        the persist must fail with a typed error naming the permission, writing nothing."""
        from botocore.exceptions import ClientError

        def forbidden(**kwargs):
            raise ClientError({"Error": {"Code": "403", "Message": "Forbidden"}}, "HeadObject")

        self.backend.client.head_object = forbidden
        fd, name = source_file(b"x" * 1000)
        try:
            with pytest.raises(PermissionError, match="needs s3:ListBucket on bucket"):
                self.backend.write(
                    self.url("f.pt"), fd, 100, 1000, guard=WriteGuard(time.time_ns())
                )
        finally:
            os.close(fd)
            os.unlink(name)
            del self.backend.client.head_object
        assert not self.backend.exists(self.url("f.pt"))

    @pytest.mark.parametrize("by_ckptcache", [False, True], ids=["foreign", "ckptcache"])
    def test_a_write_landing_between_the_check_and_a_single_put_is_kept(self, by_ckptcache):
        """The single PUT is conditional on the object the guard checked (If-None-Match /
        If-Match): S3 itself refuses it once another write landed, so the check and the write
        are one step (a fenced representative's PUT in flight can no longer land late)."""
        url, t = self.url("put-raced.pt"), time.time_ns()
        put_object = self.backend.client.put_object
        other = {COMMIT_NS_KEY: str(t - 5)} if by_ckptcache else {}

        def newer_write_first(**kwargs):
            if kwargs.get("Body") != b"other":  # the guarded PUT: another write lands first
                put_object(Bucket=kwargs["Bucket"], Key=kwargs["Key"], Body=b"other",
                           Metadata=other)  # fmt: skip
            return put_object(**kwargs)

        self.backend.client.put_object = newer_write_first
        fd, name = source_file(b"x" * 1000)
        try:
            expected = StorageConflict if by_ckptcache else NewerObjectExists
            with pytest.raises(expected):
                self.backend.write(url, fd, 100, 1000, guard=WriteGuard(t, base=""))
        finally:
            os.close(fd)
            os.unlink(name)
            del self.backend.client.put_object
        with self.backend.open_read(url) as f:
            assert f.read() == b"other"

    def test_a_newer_write_landing_during_a_multipart_upload_is_kept(self):
        """The guard is checked again right before the upload completes: an object written
        meanwhile (a write-through) is not replaced by the upload of an earlier save, and
        another ckptcache writer's is reported as a conflict."""
        data = os.urandom(11 << 20)
        url, t = self.url("raced.pt"), time.time_ns()
        upload_part = self.backend.client.upload_part
        newer: dict[str, str] = {}

        def part_then_newer_write(**kwargs):
            reply = upload_part(**kwargs)
            if kwargs["PartNumber"] == 1:  # while the upload runs, a newer save lands
                self.backend.write_bytes(url, b"newer", metadata=newer)
            return reply

        self.backend.client.upload_part = part_then_newer_write
        fd, name = source_file(data)
        try:
            with pytest.raises(NewerObjectExists):
                self.backend.write(url, fd, 100, len(data), guard=WriteGuard(t, base=""))
        finally:
            os.close(fd)
            os.unlink(name)
            del self.backend.client.upload_part
        with self.backend.open_read(url) as f:
            assert f.read() == b"newer"
        uploads = self.client.list_multipart_uploads(Bucket=self.bucket).get("Uploads", [])
        assert uploads == []
