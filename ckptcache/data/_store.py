"""The on-disk (tmpfs) layout of the batch cache, and its hygiene.

```
<cache_dir>/                     0700, owned by this user (as are all below; never links)
  <run_id>/                      one directory per run: other runs' files are never looked at
    .ckptcache-data-run          marker: ckptcache created this directory (only such are reclaimed)
    <name>/                      one per wrapped loader and group ("train", "train-g8")
      owner                      lease of the loading rank (pid, start time), touched = heartbeat
      lock                       flock'ed by the loading rank while it lives (one at a time)
      meta                       {"length": n} once the real loader reported a length
      failed                     "<pid> <message>" if the real loader raised
      pos-<pid>                  "<epoch> <step>": next batch that consumer process will take
      e000003.end                number of batches of epoch 3, once known
      e000003-s000000000042.batch    batch 42 of epoch 3 (segment format, see _batchfile)
      .tmp-<pid>-<n>             a batch being written; reclaimed if <pid> is dead
```

Only the loading rank writes batches, markers and the lease; every consumer writes its own
``pos-<pid>``. All writes are temp + rename, so readers never see half a file.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import stat
import time
from collections.abc import Iterator

from ckptcache._atomic import atomic_write
from ckptcache._secure_fs import foreign_control
from ckptcache.data._batchfile import TMP_PREFIX
from ckptcache.data._lease import STALE_AFTER_S, Lease, pid_alive, read_lease
from ckptcache.data._positions import Pos, batch_name, end_name, parse_batch_name, parse_end_name
from ckptcache.errors import ConfigError

__all__ = [
    "BatchDir",
    "check_component",
    "check_private",
    "ensure_private_dir",
    "reclaim_cache_dir",
]

_COMPONENT = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.=+-]{0,127}$")
_TMP = re.compile(rf"^{re.escape(TMP_PREFIX)}(\d+)-\d+$")
_POS = re.compile(r"^pos-(\d+)$")
#: A dead run's directory is reclaimed only once its lease is this old: a job that is just
#: restarting (same run_id, new pids) keeps its batches.
RECLAIM_AFTER_S = max(30.0, 2 * STALE_AFTER_S)
#: Written in every run directory ckptcache creates. ``cache_dir`` may be a directory the user
#: keeps other things in: only directories carrying this file are ever reclaimed. (A name
#: starting with "." cannot collide with a loader's ``name``.)
RUN_MARKER = ".ckptcache-data-run"


def check_component(value: str, what: str) -> str:
    """Refuse names that are not one safe path component (no traversal, no hidden files)."""
    if not isinstance(value, str) or not _COMPONENT.match(value):
        raise ConfigError(
            f"{what} must be 1-128 characters of letters, digits and _.=+- (not starting "
            f"with '.' or '-'), got {value!r}"
        )
    return value


def ensure_private_dir(path: str) -> None:
    """Create ``path`` (0700) or check that the existing one belongs to this user."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    check_private(path, "cache directory")


def check_private(path: str, what: str) -> None:
    """Refuse a directory others could plant batches in: a symlink, another user's, or one
    group or other users may write to (``lstat``: a link is judged, not followed)."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a directory"
        raise ConfigError(f"{what} {path} is {kind}: choose another cache_dir")
    problem = foreign_control(st, {os.getuid()})
    if problem is not None:
        raise ConfigError(
            f"{what} {path} {problem} (this user is uid {os.getuid()}): batches there could "
            "be forged; choose another cache_dir (or chmod go-w one of your own)"
        )


def _write_atomic(path: str, text: str) -> None:
    # tmpfs: nothing to fsync.
    atomic_write(path, lambda f: f.write(text.encode()), tmp=f"{path}.{os.getpid()}.tmp",
                 fsync=False)  # fmt: skip


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


class BatchDir:
    """One ``<cache_dir>/<run_id>/<name>`` directory (see the module docstring)."""

    def __init__(self, cache_dir: str, run_id: str, name: str):
        self.cache_dir = cache_dir
        self.run_dir = os.path.join(cache_dir, check_component(run_id, "run_id"))
        self.path = os.path.join(self.run_dir, check_component(name, "name"))
        ensure_private_dir(cache_dir)
        # mkdir, not makedirs: only the process that creates the run directory marks it.
        while True:
            with contextlib.suppress(FileExistsError):
                os.mkdir(self.run_dir, 0o700)
                _write_marker(self.run_dir)  # ours: reclaimable once its loaders are dead
            try:
                os.mkdir(self.path, 0o700)
            except FileExistsError:
                pass
            except FileNotFoundError:
                continue  # another loader of this run closed and removed the run directory
            break
        # Either may have been created by someone else before this job started.
        check_private(self.run_dir, "run directory")
        check_private(self.path, "run directory")
        self.lease_path = os.path.join(self.path, "owner")
        self.lock_path = os.path.join(self.path, "lock")

    # ------------------------------------------------------------------ batches

    def batch_path(self, pos: Pos) -> str:
        """Where the batch at ``pos`` lives (whether or not it is there)."""
        return os.path.join(self.path, batch_name(pos))

    def scan(self) -> dict[Pos, int]:
        """Committed batches and their sizes (what a previous incarnation left included)."""
        found: dict[Pos, int] = {}
        for entry in self._entries():
            pos = parse_batch_name(entry.name)
            if pos is not None:
                with contextlib.suppress(FileNotFoundError):
                    found[pos] = entry.stat().st_size
        return found

    def remove_batch(self, pos: Pos) -> None:
        """Delete one batch (a reader that mapped it keeps its pages until it unmaps)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.batch_path(pos))

    # ------------------------------------------------------------------ epoch ends

    def ends(self) -> dict[int, int]:
        """Known epoch lengths."""
        found: dict[int, int] = {}
        for entry in self._entries():
            epoch = parse_end_name(entry.name)
            if epoch is not None:
                n = self.end_of(epoch)
                if n is not None:
                    found[epoch] = n
        return found

    def end_of(self, epoch: int) -> int | None:
        """Number of batches of ``epoch`` if the loader has run out of it already."""
        text = _read(os.path.join(self.path, end_name(epoch)))
        return int(text) if text else None

    def write_end(self, epoch: int, n: int) -> None:
        """Record that ``epoch`` has ``n`` batches."""
        _write_atomic(os.path.join(self.path, end_name(epoch)), str(n))

    def remove_end(self, epoch: int) -> None:
        """Forget an old epoch's length."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.path, end_name(epoch)))

    # ------------------------------------------------------------------ consumers

    def publish_position(self, pos: Pos) -> None:
        """Tell the loading rank where this process will read next."""
        _write_atomic(os.path.join(self.path, f"pos-{os.getpid()}"), f"{pos.epoch} {pos.step}")

    def withdraw_position(self) -> None:
        """This process no longer consumes (closed)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.path, f"pos-{os.getpid()}"))

    def positions(self) -> dict[int, Pos]:
        """Positions of live consumer processes; dead ones' files are removed."""
        found: dict[int, Pos] = {}
        for entry in self._entries():
            m = _POS.match(entry.name)
            if not m:
                continue
            pid = int(m.group(1))
            if not pid_alive(pid):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                continue
            text = _read(entry.path)
            if text:
                epoch, step = text.split()
                found[pid] = Pos(int(epoch), int(step))
        return found

    # ------------------------------------------------------------------ loader state

    def read_lease(self) -> Lease | None:
        """The loading rank's lease, if one was ever written."""
        return read_lease(self.lease_path)

    def write_meta(self, length: int) -> None:
        """Record the real loader's ``len()``."""
        _write_atomic(os.path.join(self.path, "meta"), json.dumps({"length": length}))

    def read_length(self) -> int | None:
        """The recorded ``len()``, if any."""
        text = _read(os.path.join(self.path, "meta"))
        return int(json.loads(text)["length"]) if text else None

    def write_failure(self, message: str) -> None:
        """Tell readers the real loader raised (they stop waiting)."""
        _write_atomic(os.path.join(self.path, "failed"), f"{os.getpid()} {message}")

    def read_failure(self) -> tuple[int, str] | None:
        """``(pid, message)`` of a failure marker."""
        text = _read(os.path.join(self.path, "failed"))
        if not text:
            return None
        pid, _, message = text.partition(" ")
        return int(pid), message

    def clear_failure(self) -> None:
        """A new loading rank starts afresh."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.path, "failed"))

    # ------------------------------------------------------------------ hygiene

    def reclaim_tmp(self) -> int:
        """Remove temp files of writers that died mid-write; returns how many."""
        return _reclaim_tmp(self.path)

    def remove(self) -> None:
        """Delete this directory, and the run's directory if nothing else is left in it."""
        shutil.rmtree(self.path, ignore_errors=True)
        try:
            left = os.listdir(self.run_dir)
            if left not in ([], [RUN_MARKER]):
                return  # other loaders of the run (or files that are not ours) remain
            if left:
                os.unlink(os.path.join(self.run_dir, RUN_MARKER))
            os.rmdir(self.run_dir)
        except FileNotFoundError:
            return  # removed by another loader of the run (or a reclaim) meanwhile
        except OSError:
            # Another loader of the run created its directory meanwhile: keep the run marked.
            with contextlib.suppress(OSError):
                _write_marker(self.run_dir)

    def _entries(self) -> Iterator[os.DirEntry[str]]:
        try:
            with os.scandir(self.path) as it:
                yield from it
        except FileNotFoundError:
            return


def _write_marker(run_dir: str) -> None:
    fd = os.open(os.path.join(run_dir, RUN_MARKER), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    os.close(fd)


def _is_run_dir(path: str) -> bool:
    """Whether ckptcache created ``path``: it holds our marker, a regular file of this user."""
    try:
        st = os.lstat(os.path.join(path, RUN_MARKER))
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid()


def _reclaim_tmp(path: str) -> int:
    removed = 0
    try:
        names = os.listdir(path)
    except OSError:
        return 0
    for name in names:
        m = _TMP.match(name)
        if m and not pid_alive(int(m.group(1))):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(path, name))
                removed += 1
    return removed


def reclaim_cache_dir(cache_dir: str, keep_run: str) -> list[str]:
    """Clean up after crashed runs sharing ``cache_dir``; returns the run directories removed.

    Only run directories ckptcache created (they carry :data:`RUN_MARKER`) are looked into;
    anything else in ``cache_dir`` is never touched, and symbolic links are never followed.
    Temp files of dead writers go in every run. A whole run directory (other than
    ``keep_run``) goes when every loader lease in it names a dead process and is older than
    :data:`RECLAIM_AFTER_S` (or no lease exists and the directory is that old).

    Loading ranks of other jobs (or other groups) may reclaim the same directories at the same
    time: a file or directory that vanishes meanwhile is taken as reclaimed.
    """
    removed: list[str] = []
    try:
        with os.scandir(cache_dir) as it:
            runs = [e for e in it if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return removed
    now = time.time()
    for run in runs:
        try:
            if not _is_run_dir(run.path):
                continue  # not ours (the user's own directory, or a run of an old version)
            with os.scandir(run.path) as it:
                subdirs = [e for e in it if e.is_dir(follow_symlinks=False)]
            for sub in subdirs:
                _reclaim_tmp(sub.path)
            if run.name == keep_run:
                continue
            if all(_abandoned(sub.path, now) for sub in subdirs) and (
                subdirs or now - run.stat(follow_symlinks=False).st_mtime > RECLAIM_AFTER_S
            ):
                shutil.rmtree(run.path, ignore_errors=True)
                removed.append(run.path)
        except FileNotFoundError:
            continue  # another rank reclaimed it (or its loader closed) meanwhile
    return removed


def _abandoned(path: str, now: float) -> bool:
    # A live loading rank touches its lease every HEARTBEAT_S, so an old heartbeat is enough.
    lease = read_lease(os.path.join(path, "owner"))
    last = lease.heartbeat if lease is not None else os.lstat(path).st_mtime
    return now - last > RECLAIM_AFTER_S
