"""``CachedDataLoader``: a restart-proof, node-shared batch cache around any iterable loader."""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NoReturn

from ckptcache.data._batchfile import read_batch
from ckptcache.data._cachedir import default_cache_dir
from ckptcache.data._crypto import BatchCipher
from ckptcache.data._lease import Heartbeat, Lease, lock_exclusive, unlock
from ckptcache.data._positions import Pos
from ckptcache.data._prefetch import Prefetcher, batch_key
from ckptcache.data._store import BatchDir, check_component, reclaim_cache_dir
from ckptcache.data.errors import BatchLoadError, BatchTimeout, LoaderDied
from ckptcache.errors import CkptCacheError, ConfigError, CorruptCheckpoint

__all__ = ["CachedDataLoader", "default_cache_dir", "default_loading_rank"]

#: How often a waiting reader re-reads the loading rank's lease.
_LEASE_CHECK_S = 0.1
#: Longest sleep between two looks for a batch file on a reading rank.
_MAX_POLL_S = 0.01
#: Longest wait of the loading rank's ``close()`` for reading ranks to reach its position.
_CLOSE_WAIT_S = 10.0


def _group_suffix(group: Any) -> str:
    """A directory suffix that tells the groups of one node apart."""
    if group is None:
        return ""
    if isinstance(group, str):
        return "-" + check_component(group, "group")
    import torch.distributed as dist

    return f"-g{min(dist.get_process_group_ranks(group))}"


def default_loading_rank(group: Any) -> bool:
    """Whether this process loads for ``group`` when the caller does not say: its rank 0
    (every process, without a group)."""
    if group is None or isinstance(group, str):
        return True
    import torch.distributed as dist

    return dist.get_rank(group) == 0


class CachedDataLoader:
    """Wrap a data loader so its batches live in shared memory, ahead of and behind training.

    On the loading rank a background thread creates the real loader (``make_loader()``) and
    writes the next ``prefetch`` batches into ``<cache_dir>/<run_id>/<name>/`` as
    shared-memory files in ckptcache's segment format; the last ``lookback`` consumed batches
    are kept. Reading ranks (``is_loading_rank=False``, e.g. tensor-parallel ranks > 0 of
    ``group``) map the same files: one copy per node, zero-copy copy-on-write tensors.

    After a crash, construct it again with the same ``cache_dir``/``run_id`` and the position
    from the checkpoint (``load_state_dict`` or ``start_step``/``start_epoch``): the cached
    batches are served at once while the real loader starts in the background and is brought
    to the first missing position (``loader.skip(n)`` if it has that method, else by iterating
    and discarding).

    **Exactness contract.** The sequence after a restart equals the one without a restart if
    the real loader yields the same batches for the same epoch every time it is created: seed
    its shuffling from the epoch (``set_epoch(epoch)`` is called on the loader, or on its
    ``sampler``/``batch_sampler.sampler``, before each epoch), not from global RNG state.

    **Iteration.** ``iter()`` continues from the current position (a resumed epoch continues
    mid-way); exhausting an epoch moves to the next. ``set_epoch(e)`` jumps to the start of
    epoch ``e`` (a no-op for the current epoch, so a resumed position is kept).

    **Lifetime.** ``close()`` (or leaving a ``with`` block without an exception) deletes the
    cached batches; an exception, a crash or plain interpreter exit keeps them for the
    restart (a later start reclaims runs whose loader has been dead for a while).

    **Encryption** (``encrypt=True``, key in ``$CKPTCACHE_DATA_KEY``): only ciphertext lies in
    shared memory; every rank decrypts into private memory, so batches are no longer
    zero-copy or shared once read (one private copy per rank).

    **Validation loaders** should start cold: pass ``cache=False`` (a plain pass-through with
    the same interface) or wrap only the training loader.

    Args:
        make_loader: returns a fresh real loader (any iterable of batches); called in a
            background thread, on the loading rank only (may be ``None`` on reading ranks).
        cache_dir: shared-memory directory (created 0700; must belong to this user); by
            default one no other user can create first (:func:`default_cache_dir`).
        run_id: names the run; batches of other run ids are never served and are reclaimed.
            Must be unique per job (a job reusing another's id is served its leftover
            batches) and stay the same across the job's restarts.
        prefetch: batches kept ready ahead of the slowest consumer.
        lookback: consumed batches kept (a checkpoint slightly behind still finds its batch).
        start_step, start_epoch: the position to resume from. Prefetching starts once the
            position is known: at construction when one of these is given or nothing is
            cached yet (a cold start), else at ``load_state_dict``, ``set_epoch`` or the
            first ``next``.
        is_loading_rank: whether this process runs the real loader; default: rank 0 of
            ``group``, or ``True`` without a process group.
        group: a ``torch.distributed`` process group of ranks reading the same batches, or a
            string naming it; keeps several groups on one node apart.
        name: the loader's name ("train"); distinguishes several wrapped loaders.
        timeout: longest wait for one batch before :class:`BatchTimeout`.
        max_bytes: budget of cached batch files; prefetching blocks when it is full.
        encrypt: AES-GCM encrypt batches at rest.
        weights_only: unpickle batches with ``torch.load(weights_only=True)`` rules; pass
            ``False`` for loaders that yield custom classes.
        verify: check each batch's xxh3 digests when reading it.
        cache: ``False`` iterates ``make_loader()`` directly (validation loaders).
    """

    def __init__(
        self,
        make_loader: Callable[[], Iterable[Any]] | None,
        *,
        run_id: str,
        cache_dir: str | None = None,
        prefetch: int = 10,
        lookback: int = 2,
        start_step: int | None = None,
        start_epoch: int | None = None,
        is_loading_rank: bool | None = None,
        group: Any = None,
        name: str = "train",
        timeout: float = 60.0,
        max_bytes: int | None = None,
        encrypt: bool = False,
        weights_only: bool = True,
        verify: bool = True,
        cache: bool = True,
    ):
        known = start_step is not None or start_epoch is not None
        start_step, start_epoch = start_step or 0, start_epoch or 0
        if prefetch < 1 or lookback < 0 or start_step < 0 or start_epoch < 0:
            raise ConfigError("prefetch must be >= 1; lookback, start_step, start_epoch >= 0")
        if max_bytes is not None and max_bytes <= 0:
            raise ConfigError(f"max_bytes must be positive, got {max_bytes}")
        self.run_id = check_component(run_id, "run_id")
        self.name = check_component(name, "name") + _group_suffix(group)
        self.cache_dir = cache_dir or default_cache_dir()
        self.is_loading_rank = (
            default_loading_rank(group) if is_loading_rank is None else bool(is_loading_rank)
        )
        if self.is_loading_rank and make_loader is None:
            raise ConfigError("the loading rank needs make_loader")
        self.timeout = timeout
        self.cached = cache
        self._make_loader = make_loader
        self._weights_only = weights_only
        self._verify = verify
        self._pos = Pos(start_epoch, start_step)
        self._length: int | None = None
        self._closed = False
        self._prefetcher: Prefetcher | None = None
        self._heartbeat: Heartbeat | None = None
        self._lock_fd: int | None = None
        self._dir_key = (0, 0)
        self._seen_alive: set[tuple[int, int]] = set()
        self._lease_checked = 0.0
        self._lock = threading.Lock()
        #: Batches handed out but not yet used by the trainer (a framework's own look-ahead,
        #: e.g. Lightning's one prefetched batch): ``state_dict`` reports the position before
        #: them, so a restart does not skip them.
        self.held_back: Callable[[], int] = lambda: 0
        #: Batches yielded since construction (or the last ``load_state_dict``/``set_epoch``).
        self.handed_out = 0
        if not cache:
            return
        self._cipher = BatchCipher.from_env() if encrypt else None
        self._bdir = BatchDir(self.cache_dir, self.run_id, self.name)
        self._published = False
        if self.is_loading_rank:
            self._take_lease()
            self._prefetch_args = (prefetch, lookback, max_bytes)
        else:
            self._check_loader()  # remember a loader seen alive: its death is then definite
        # A cold start (nothing cached for this run) may start loading from step 0 at once,
        # overlapping the real loader's spin-up with the model's set-up; with batches left by
        # a previous incarnation, wait for the real position (see _publish).
        if known or (self.is_loading_rank and not self._bdir.scan()):
            self._publish()
        # Interpreter exit keeps the batches (a crash-restart wants them) but stops threads.
        atexit.register(_release_at_exit, weakref.ref(self))

    def _take_lease(self) -> None:
        lease = self._bdir.read_lease()
        mine = Lease.mine()
        if lease is not None and lease.ident != mine.ident and lease.owner_alive():
            self._refuse(lease)
        # A loader of this process that still loads here was abandoned (an exception left it
        # unclosed, as Lightning does on a fault): take over, as a restarted process would,
        # but stop it first, so that one prefetcher at a time writes the directory.
        st = os.stat(self._bdir.path)
        self._dir_key = (st.st_dev, st.st_ino)
        previous = _loading_here.get(self._dir_key)
        if previous is not None:
            previous.close(keep_cache=True)
        # The lock, not the lease, keeps another process out: two processes could both read
        # "no live owner" and both write their lease, then write the same batch files.
        self._lock_fd = lock_exclusive(self._bdir.lock_path)
        if self._lock_fd is None:
            self._refuse(self._bdir.read_lease())  # the lease may not be written yet
        _loading_here[self._dir_key] = self
        reclaim_cache_dir(self.cache_dir, keep_run=self.run_id)
        self._bdir.reclaim_tmp()
        self._bdir.clear_failure()
        mine.write(self._bdir.lease_path)
        self._heartbeat = Heartbeat(self._bdir.lease_path)

    def _refuse(self, lease: Lease | None) -> NoReturn:
        who = lease.describe() if lease is not None else "another process"
        raise ConfigError(
            f"{self._bdir.path} already has a live loading rank ({who}); give "
            "each group its own group=/name= or make only one rank the loading rank"
        )

    # ------------------------------------------------------------------ iteration

    def __iter__(self) -> Iterator[Any]:
        if not self.cached:
            assert self._make_loader is not None
            yield from self._make_loader()
            return
        while True:
            with self._lock:
                if self._closed:
                    raise CkptCacheError("CachedDataLoader is closed")
                if not self._published:
                    self._publish()
                pos = self._pos
            batch = self._get(pos)
            with self._lock:
                if batch is _END:
                    self._pos = Pos(pos.epoch + 1, 0)
                else:
                    self._pos = Pos(pos.epoch, pos.step + 1)
                    self.handed_out += 1
                self._publish()
            if batch is _END:
                return
            yield batch

    def _publish(self) -> None:
        """Announce the position; the first time, start prefetching from it.

        After a restart nothing is announced before the position is known (an explicit
        start, ``load_state_dict``, ``set_epoch`` or the first ``next``): a provisional step 0
        would make the loading rank evict the batches the restart is about to need.
        """
        self._bdir.publish_position(self._pos)
        self._published = True
        if self._prefetcher is not None:
            self._prefetcher.wake()
        elif self.is_loading_rank:
            assert self._make_loader is not None
            prefetch, lookback, max_bytes = self._prefetch_args
            self._prefetcher = Prefetcher(
                self._make_loader, self._bdir, run_id=self.run_id, name=self.name,
                cipher=self._cipher, prefetch=prefetch, lookback=lookback, max_bytes=max_bytes,
            )  # fmt: skip

    def _get(self, pos: Pos) -> Any:
        """The batch at ``pos``, ``_END`` past the end of its epoch; waits at most ``timeout``."""
        path = self._bdir.batch_path(pos)
        key = batch_key(self.run_id, self.name, pos)
        deadline = time.monotonic() + self.timeout
        delay = 0.0002
        while True:
            try:
                return read_batch(
                    path, key, self._cipher, weights_only=self._weights_only, verify=self._verify
                )
            except FileNotFoundError:
                pass  # not written yet, or evicted just now (the prefetcher will rewrite it)
            except CorruptCheckpoint:
                if self._prefetcher is None:
                    raise  # only the loading rank can replace it
                self._prefetcher.invalidate(pos)
            end = self._bdir.end_of(pos.epoch)
            if end is not None and pos.step >= end:
                return _END
            self._check_loader()
            if time.monotonic() > deadline:
                raise BatchTimeout(self._timeout_message(pos))
            if self._prefetcher is not None:
                with self._prefetcher.cond:
                    self._prefetcher.cond.wait(0.05)
            else:
                time.sleep(delay)
                delay = min(2 * delay, _MAX_POLL_S)

    def _check_loader(self) -> None:
        """Raise as soon as waiting cannot help: the loader failed or its process died."""
        if self.is_loading_rank:
            if self._prefetcher is None:
                return
            error = self._prefetcher.error
            if error is not None:
                raise BatchLoadError(
                    f"the real data loader raised in the prefetch thread: {error!r}"
                ) from error
            return
        now = time.monotonic()
        if now - self._lease_checked < _LEASE_CHECK_S:
            return
        self._lease_checked = now
        lease = self._bdir.read_lease()
        if lease is None:
            return
        failure = self._bdir.read_failure()
        alive = lease.owner_alive()
        if alive:
            self._seen_alive.add(lease.ident)
        # A failure counts only if it is the current loading rank's: one this reader saw alive
        # (it may exit right after failing). A dead lease never seen alive may be a previous
        # incarnation's, whose failure the restarted loading rank clears: wait for that one.
        if failure is not None and failure[0] == lease.pid and lease.ident in self._seen_alive:
            raise BatchLoadError(
                f"the loading rank ({lease.describe()}) failed: {failure[1]}; see its log"
            )
        if not alive and lease.ident in self._seen_alive:
            # Seen alive by this reader, dead now: no one will write the batch. (A lease that
            # was dead from the start may be a previous incarnation's: wait for a new one.)
            raise LoaderDied(
                f"the loading rank for {self._bdir.path} ({lease.describe()}) died or stopped "
                f"heartbeating; batch {self._pos.step} of epoch {self._pos.epoch} is not "
                "cached. Restart the job (cached batches are kept)",
                pid=lease.pid,
            )

    def _timeout_message(self, pos: Pos) -> str:
        lease = self._bdir.read_lease()
        if lease is None:
            who = "no loading rank has started for it"
        elif lease.owner_alive():
            who = f"its loading rank ({lease.describe()}) is alive but slow"
        else:
            who = f"its loading rank ({lease.describe()}) is dead and none took over"
        return (
            f"batch {pos.step} of epoch {pos.epoch} did not appear in {self._bdir.path} within "
            f"{self.timeout:g} s: {who}. Raise timeout= if the real loader is just slow"
        )

    # ------------------------------------------------------------------ position

    @property
    def epoch(self) -> int:
        """The epoch the next batch belongs to."""
        return self._pos.epoch

    @property
    def step(self) -> int:
        """Batches of the current epoch already handed out (= index of the next one)."""
        return self._pos.step

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first batch (no-op if it is the current epoch)."""
        with self._lock:
            if epoch != self._pos.epoch or not self._published:
                self._pos = Pos(epoch, 0) if epoch != self._pos.epoch else self._pos
                self.handed_out = 0
                if self.cached:
                    self._publish()

    def state_dict(self) -> dict[str, Any]:
        """The data position, to be saved with the model checkpoint."""
        with self._lock:
            pos = self._pos
        held = self.held_back()
        if held:
            # Held-back batches belong to the epoch being iterated, even if it ended meanwhile.
            if pos.step == 0 and pos.epoch > 0:
                end = self._known_end(pos.epoch - 1)
                pos = Pos(pos.epoch - 1, end) if end is not None else pos
            pos = Pos(pos.epoch, max(0, pos.step - held))
        state: dict[str, Any] = {
            "run_id": self.run_id,
            "name": self.name,
            "epoch": pos.epoch,
            "step": pos.step,
        }
        length = self._known_length()
        if length is not None:
            state["length"] = length
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the saved position (call before iterating).

        The cache of *this* object's ``run_id`` is used; a checkpoint from another run id
        restores the position but finds no cached batches (a cold start, still exact).
        """
        with self._lock:
            self._pos = Pos(int(state["epoch"]), int(state["step"]))
            self.handed_out = 0
            if state.get("length") is not None:
                self._length = int(state["length"])
            if self.cached:
                self._publish()

    def _known_end(self, epoch: int) -> int | None:
        return self._bdir.end_of(epoch) if self.cached else None

    def _known_length(self) -> int | None:
        if not self.cached:
            return None
        end = self._bdir.end_of(self._pos.epoch)
        if end is not None:
            return end
        recorded = self._bdir.read_length()
        return recorded if recorded is not None else self._length

    def __len__(self) -> int:
        """Batches per epoch, once known (the real loader's ``len()`` or a finished epoch)."""
        length = self._known_length()
        if length is None and not self.cached and self._make_loader is not None:
            return len(self._make_loader())  # type: ignore[arg-type]
        if length is None:
            raise TypeError("the length of the cached loader is not known yet")
        return length

    # ------------------------------------------------------------------ lifetime

    def close(self, *, keep_cache: bool = False) -> None:
        """Stop prefetching; delete this loader's cached batches unless ``keep_cache``."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if not self.cached:
            return
        if self.is_loading_rank and not keep_cache:
            self._wait_for_readers()
        self._stop_threads()
        self._bdir.withdraw_position()
        if self.is_loading_rank and not keep_cache:
            self._bdir.remove()
        self._release_lock()  # a restarted loading rank (kept cache) may take over now

    def _wait_for_readers(self) -> None:
        """Let reading ranks a few steps behind finish before their batches are deleted.

        Ranks step in lockstep, so at the end of training every reader reaches this rank's
        position; one still behind it needs batches (or the end-of-epoch marker) from the
        directory about to go. Wait, prefetching on, for at most ``_CLOSE_WAIT_S`` (a reader
        that stopped iterating without closing would otherwise hold the close up forever).
        """
        deadline = time.monotonic() + min(self.timeout, _CLOSE_WAIT_S)
        me = os.getpid()
        while time.monotonic() < deadline:
            if all(p >= self._pos for pid, p in self._bdir.positions().items() if pid != me):
                return
            time.sleep(_MAX_POLL_S)

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            if _loading_here.get(self._dir_key) is self:
                del _loading_here[self._dir_key]
            unlock(self._lock_fd)
            self._lock_fd = None

    def _stop_threads(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.stop()
        if self._heartbeat is not None:
            self._heartbeat.stop()

    def __enter__(self) -> CachedDataLoader:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        # Leaving on an exception is the restart case: keep the batches for the next run.
        self.close(keep_cache=exc_type is not None)


#: The open loading-rank loader of each directory in this process, by (device, inode).
_loading_here: dict[tuple[int, int], CachedDataLoader] = {}


def _release_at_exit(ref: weakref.ref[CachedDataLoader]) -> None:
    loader = ref()
    if loader is not None:
        loader.close(keep_cache=True)


_END: Any = object()
