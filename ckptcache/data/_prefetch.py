"""The loading rank's prefetcher: a background thread that keeps the cache ahead of consumers.

Pipeline of one batch (and the memory budget that bounds it)::

    missing (in the window [slowest consumer, +prefetch)) -> fetched from the real loader
    -> prepared (flattened, size known) -> room (max_bytes) -> committed file -> consumed
    -> evicted (more than ``lookback`` behind the slowest consumer)

The real loader is created here, in the background, the first time a batch is missing, so a
restarted trainer reads the batches its previous incarnation prefetched while the loader spins
up. To reach a position the thread asks the loader to ``skip(n)`` if it offers that hook, and
otherwise iterates and discards; batches already cached are stepped over, not rewritten.
Exactness therefore rests on the loader being deterministic for a given epoch (see
``CachedDataLoader``).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ckptcache.data._batchfile import check_batch, prepare_batch, write_batch
from ckptcache.data._crypto import BatchCipher
from ckptcache.data._positions import Pos, batch_name, distance
from ckptcache.data._store import BatchDir
from ckptcache.errors import CkptCacheWarning

__all__ = ["Prefetcher", "batch_key", "set_epoch"]

#: How often the thread re-reads other processes' positions when it has nothing to do.
POLL_S = 0.02


def batch_key(run_id: str, name: str, pos: Pos) -> str:
    """The manifest path of a cached batch: names the run, the loader and the position."""
    return f"{run_id}/{name}/{batch_name(pos)}"


def set_epoch(loader: Any, epoch: int) -> None:
    """Call ``set_epoch`` on the loader, or on its sampler / batch sampler (as Lightning does)."""
    for target in (
        loader,
        getattr(loader, "sampler", None),
        getattr(getattr(loader, "batch_sampler", None), "sampler", None),
    ):
        fn = getattr(target, "set_epoch", None)
        if callable(fn):
            fn(epoch)
            return


class Prefetcher:
    """Fills ``bdir`` ahead of the slowest live consumer; see the module docstring.

    Call order: construct (starts the thread) -> ``wake()`` whenever the local consumer moved
    -> ``stop()``. ``error`` holds what the real loader raised; ``cond`` is notified after each
    batch, end-of-epoch marker and failure.
    """

    def __init__(
        self,
        make_loader: Callable[[], Iterable[Any]],
        bdir: BatchDir,
        *,
        run_id: str,
        name: str,
        cipher: BatchCipher | None,
        prefetch: int,
        lookback: int,
        max_bytes: int | None,
    ):
        self._make_loader = make_loader
        self._bdir = bdir
        self._run_id = run_id
        self._name = name
        self._cipher = cipher
        self._prefetch = prefetch
        self._lookback = lookback
        self._max_bytes = max_bytes
        self.cond = threading.Condition()
        self.error: BaseException | None = None
        self._stopped = threading.Event()
        # What is in the directory: only this thread writes or deletes batches there.
        self._files = self._trusted(bdir.scan())
        self._ends = bdir.ends()
        self._invalid: set[Pos] = set()
        self._invalid_lock = threading.Lock()
        self._loader: Iterable[Any] | None = None
        self._it: Iterator[Any] | None = None
        self._it_pos = Pos(-1, 0)
        self._warned_oversize = False
        self._thread = threading.Thread(target=self._run, name="ckptcache-data-prefetch")
        self._thread.daemon = True  # never keeps a finished trainer alive
        self._thread.start()

    # ------------------------------------------------------------------ control

    def _trusted(self, found: dict[Pos, int]) -> dict[Pos, int]:
        """Keep the files a previous incarnation committed for this run; delete the rest."""
        for pos in list(found):
            key = batch_key(self._run_id, self._name, pos)
            if not check_batch(self._bdir.batch_path(pos), key, self._cipher is not None):
                self._bdir.remove_batch(pos)
                del found[pos]
        return found

    def invalidate(self, pos: Pos) -> None:
        """A consumer found the batch at ``pos`` corrupt: delete it and write it again."""
        with self._invalid_lock:
            self._invalid.add(pos)
        self.wake()

    def wake(self) -> None:
        """A local consumer moved: re-plan now instead of at the next poll."""
        with self.cond:
            self.cond.notify_all()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread (it finishes the batch it is writing)."""
        self._stopped.set()
        self.wake()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """Whether the thread is still running."""
        return self._thread.is_alive()

    def _idle(self) -> None:
        with self.cond:
            if not self._stopped.is_set():
                self.cond.wait(POLL_S)

    # ------------------------------------------------------------------ the loop

    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                if not self._step():
                    self._idle()
        except BaseException as e:
            self.error = e
            try:
                self._bdir.write_failure(f"{type(e).__name__}: {e}")
            except OSError:
                pass
        finally:
            # Shut the real loader's iterator down here, in its own thread (worker processes
            # of a torch DataLoader are joined by its iterator's destructor).
            self._it = None
            with self.cond:
                self.cond.notify_all()

    def _consumer(self) -> Pos | None:
        """The slowest live consumer's next position."""
        positions = self._bdir.positions()
        if not positions:
            return None
        return min(positions.values()).normalized(self._ends)

    def _step(self) -> bool:
        """Produce at most one batch; False when there was nothing to do."""
        with self._invalid_lock:
            invalid, self._invalid = self._invalid, set()
        for pos in invalid:
            self._remove(pos)
        consumer = self._consumer()
        if consumer is None:
            return False
        self._evict(consumer)
        target = self._next_missing(consumer)
        if target is None:
            return False
        batch = self._fetch(target)
        if batch is _END:
            return True
        prepared = prepare_batch(batch_key(self._run_id, self._name, target), batch)
        if not self._make_room(prepared.nbytes, target):
            return False
        size = write_batch(self._bdir.path, batch_name(target), prepared, self._cipher)
        self._files[target] = size
        with self.cond:
            self.cond.notify_all()
        return True

    def _next_missing(self, consumer: Pos) -> Pos | None:
        pos = consumer
        for _ in range(self._prefetch):
            pos = pos.normalized(self._ends)
            if pos not in self._files:
                return pos
            pos = Pos(pos.epoch, pos.step + 1)
        return None

    # ------------------------------------------------------------------ the real loader

    def _fetch(self, target: Pos) -> Any:
        """The real loader's batch at ``target``, or ``_END`` if its epoch is shorter."""
        if self._it is None or self._it_pos.epoch != target.epoch or self._it_pos > target:
            self._open(target)
        assert self._it is not None
        while True:
            try:
                batch = next(self._it)
            except StopIteration:
                self._end_epoch(self._it_pos)
                return _END
            pos = self._it_pos
            self._it_pos = Pos(pos.epoch, pos.step + 1)
            if pos == target:
                return batch
            # Catching up (restart, or a batch already cached): drop it unwritten.

    def _open(self, target: Pos) -> None:
        if self._loader is None:
            self._loader = self._make_loader()
            try:
                self._bdir.write_meta(len(self._loader))  # type: ignore[arg-type]
            except TypeError:
                pass  # an iterable without len(): consumers report no length either
        set_epoch(self._loader, target.epoch)
        skip = getattr(self._loader, "skip", None)
        if callable(skip):
            skip(target.step)
            self._it_pos = target
        else:
            self._it_pos = Pos(target.epoch, 0)
        self._it = iter(self._loader)

    def _end_epoch(self, end: Pos) -> None:
        self._ends[end.epoch] = end.step
        self._bdir.write_end(end.epoch, end.step)
        self._it = None
        with self.cond:
            self.cond.notify_all()

    # ------------------------------------------------------------------ budget

    def _evict(self, consumer: Pos) -> None:
        """Drop batches more than ``lookback`` behind or ``prefetch`` ahead of the consumer."""
        for pos in sorted(self._files):
            behind = distance(pos, consumer, self._ends)
            if behind > self._lookback or -behind >= self._prefetch:
                self._remove(pos)
        for epoch in [e for e in self._ends if e < consumer.epoch - 1]:
            del self._ends[epoch]
            self._bdir.remove_end(epoch)

    def _remove(self, pos: Pos) -> None:
        self._files.pop(pos, None)
        self._bdir.remove_batch(pos)

    def _make_room(self, nbytes: int, target: Pos) -> bool:
        """Block until ``nbytes`` fit in ``max_bytes``; False if stopped while waiting.

        The batch the slowest consumer waits for is never blocked (that would deadlock): it
        evicts the look-back batches, oldest first, and if it still does not fit it is written
        anyway, once over budget, with a warning.
        """
        if self._max_bytes is None:
            return True
        while not self._stopped.is_set():
            consumer = self._consumer() or target
            self._evict(consumer)
            if sum(self._files.values()) + nbytes <= self._max_bytes:
                return True
            if target <= consumer:
                for pos in sorted(p for p in self._files if p < consumer):
                    self._remove(pos)
                    if sum(self._files.values()) + nbytes <= self._max_bytes:
                        return True
                if not self._warned_oversize:
                    self._warned_oversize = True
                    warnings.warn(
                        f"ckptcache.data: a batch of {nbytes} bytes does not fit in max_bytes="
                        f"{self._max_bytes} next to the batches already cached; raise max_bytes",
                        CkptCacheWarning,
                        stacklevel=1,
                    )
                return True
            self._idle()
        return False


_END: Any = object()
