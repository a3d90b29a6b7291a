"""Digests of committed generations: computed once, off the trainer's critical path.

Call order: every commit hands its generation to :meth:`Digester.put`; the background loop
(:meth:`Digester.start`) pins, hashes and records it. A caller that needs the digests at once
(a backup push, a verified load, a persist) calls :meth:`Digester.ensure`; a copy that arrived
with verified digests records them with :meth:`Digester.record`. Single flight per
generation: the loop and a caller never hash the same bytes twice.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace

from ckptcache.errors import CorruptCheckpoint
from ckptcache.format.layout import DigestState
from ckptcache.format.manifest import (
    compute_digests,
    meta_digests,
    pack_digests,
    verify_digests,
    verify_meta,
)
from ckptcache.server.memory import refill
from ckptcache.server.memory.arena import Fill, Segment, mapped_by_others
from ckptcache.server.memory.index import Generation
from ckptcache.server.memory.sharing import allocate_holes
from ckptcache.server.persist.persister import lower_thread_priority
from ckptcache.server.state import CacheState, Session
from ckptcache.wire import messages as m
from ckptcache.wire.states import Tier

__all__ = ["Digester"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _FreeCheck:
    """A freed segment to check against the digests of the generation that left it."""

    gen: Generation
    token: int
    digests: list[int]


class Digester:
    """Computes, records and verifies the per-storage digests of generations."""

    def __init__(self, state: CacheState):
        self.state = state
        self._queue: queue.Queue[Generation | _FreeCheck | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="digester", daemon=True)
        #: Called (without the lock) after a generation's digests are recorded.
        self.on_record: list[Callable[[], None]] = []
        state.metrics.digest_queue.set_function(lambda: self.backlog)

    def start(self) -> None:
        """Start the background digester."""
        self._thread.start()

    def stop(self) -> None:
        """Stop the background digester (waits a few seconds for the current hash)."""
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    @property
    def backlog(self) -> int:
        """Generations and freed segments queued for the background loop, or in its hands."""
        return self._queue.unfinished_tasks

    def put(self, gen: Generation) -> None:
        """Hash ``gen`` in the background."""
        self._queue.put(gen)

    def check_free(self, gen: Generation) -> None:
        """``gen`` leaves memory and its segment is freed (call under the state lock): in the
        background, make the segment hold the newest save of the path where one is to be had
        (:mod:`ckptcache.server.memory.refill`), else check that it holds the bytes ``gen``'s
        digests name; either way its content token is handed to the next save only once the
        bytes were found equal to the digests (``Segment.checked``)."""
        segment = gen.segment
        if segment.content and gen.digests is not None:
            self._queue.put(_FreeCheck(gen, segment.content, gen.digests))

    def _free_with(self, segment: Segment, token: int) -> bool:
        """Whether ``segment`` is still free and names its bytes ``token`` (under the state
        lock): else it was handed out, cut or refilled since, and its bytes are not that."""
        return segment.content == token and segment.name in self.state.arena.free

    def _check_free(self, check: _FreeCheck) -> None:
        gen, token = check.gen, check.token
        segment = gen.segment
        with self.state.lock.held():
            if not self._free_with(segment, token):
                return  # handed out again meanwhile: its bytes are another save's now
            # Never into a segment a load still maps (its connection went, its tensors live):
            # they would change under the trainer. Checking it only reads it.
            source = None if mapped_by_others(segment) else refill.source_for(self.state, gen)
            if source is not None:
                self.state.pin_locked(source)
        try:
            if source is None:
                self._check_held(check)
            else:
                self._refill(check, source)
        finally:
            if source is not None:
                self.state.unpin(source)

    def _check_held(self, check: _FreeCheck) -> None:
        """Check that the freed segment still holds the bytes of the generation that left it."""
        segment = check.gen.segment
        with self.state.lock.held():
            if not self._free_with(segment, check.token):
                return
            if segment.holes:  # no save to refill it from
                self._drop_if_hollow(segment, check.token)
                return
            fill = segment.fill = Fill()  # nothing to copy: only never cut while read here
        fill.finish()
        try:
            self._check(segment, check.token, check.gen, check.digests)
        finally:
            segment.fill = None

    def _check(self, segment: Segment, token: int, gen: Generation, want: list[int]) -> None:
        """Hash the free ``segment`` and record whether it holds ``gen``'s bytes."""
        view = segment.view()
        try:
            found = compute_digests(view, gen.manifest)
        except (ValueError, BufferError, OSError):
            return
        finally:
            del view
        self._note_check(segment, token, gen, found, want)

    def _refill(self, check: _FreeCheck, source: Generation) -> None:
        """Copy ``source`` (pinned) into the freed segment of ``check``, hash the copy, and
        give the segment ``source``'s content token where the copy equals its digests.

        No lock of the daemon's is taken while the copy runs: a reservation that needs the
        segment stops the copy under the state lock and waits for it (``Fill``)."""
        segment = check.gen.segment
        try:
            digests = self.ensure(source)  # takes the state lock: before the fill begins
        except CorruptCheckpoint:  # the newest save is refused: the segment's bytes not kept
            self._drop_if_hollow(segment, check.token)
            return
        with self.state.lock.held():
            if not self._free_with(segment, check.token):
                return
            # A mark no client was given: a hand-out, a cut or a commit replaces it, and so
            # tells the end of this copy that the segment left the free pool meanwhile.
            mark = segment.content = secrets.randbits(62) + 1
            segment.checked, segment.checked_digests = 0, {}
            content = source.segment.content
            fill = segment.fill = Fill()
        try:
            try:
                ranges = refill.differing(check.gen, check.digests, source, digests)
                if segment.holes:  # pages it gave back (sharing.py): allocated, then copied
                    ranges = refill.merged(ranges + refill.within_payload(source, segment.holes))
                    allocate_holes(segment)
                saves = self.state.saves_in_flight
                copied = refill.copy_ranges(source.segment, segment, ranges, fill, saves)
            except (ValueError, BufferError, OSError):
                copied = False
            finally:
                fill.finish()
            if not copied:
                self._drop_if_hollow(segment, mark)
                return
            saves.wait_quiet()
            with self.state.lock.held():
                if segment.content != mark:
                    return
                segment.content = content  # checked next, if equal
            self._check(segment, content, source, digests)
        finally:
            segment.fill = None

    def _drop_if_hollow(self, segment: Segment, token: int) -> None:
        """A freed segment with holes that no refill allocated is given back to the system:
        it would sit in the free pool, counted, never to be handed out."""
        with self.state.lock.held():
            if self._free_with(segment, token) and segment.holes:
                self.state.arena.destroy(segment)

    def _note_check(
        self, segment: Segment, token: int, gen: Generation, found: list[int], want: list[int]
    ) -> None:
        """Record the check of a free segment that should hold ``gen``'s bytes under ``token``:
        checked where ``found`` equals ``want``, else its token forgotten and a warning."""
        with self.state.lock.held():
            if not self._free_with(segment, token):
                return
            equal = found == want
            self.state.metrics.free_checks.labels(result="equal" if equal else "changed").inc()
            if equal:
                segment.checked = token
                offsets = (r.offset for r in gen.manifest.storages)
                segment.checked_digests = dict(zip(offsets, found, strict=True))
                return
            segment.content = 0
        bad = next(r.name for r, a, b in zip(gen.manifest.storages, found, want, strict=True)
                   if a != b)  # fmt: skip
        log.warning("freed segment %s does not hold the bytes of %s generation %d (tensor "
                    "%s differs): none of them is reused", segment.name, gen.path, gen.number,
                    bad)  # fmt: skip

    def ensure(self, gen: Generation) -> list[int]:
        """Digests of ``gen``, computed now if the background worker has not yet."""
        if gen.digests is not None:
            return gen.digests
        self.state.pin(gen)
        try:
            return self.compute(gen)
        finally:
            self.state.unpin(gen)

    def compute(self, gen: Generation) -> list[int]:
        """Compute and record ``gen``'s digests; the caller holds a pin."""
        with gen.digest_lock:
            if gen.digests is not None:
                return gen.digests
            view = gen.segment.view()
            try:
                digests = compute_digests(view, gen.manifest)
            finally:
                del view
            return self.record(gen, digests)

    def _check_kept(self, gen: Generation, digests: list[int], expected: dict[int, int]) -> None:
        """Storages the save kept from the segment's checked bytes, not copied, must still
        hash to what the check found: else the segment changed in between (a write into a
        free segment), and the generation is refused, never served or persisted."""
        for record, digest in zip(gen.manifest.storages, digests, strict=True):
            want = expected.get(record.offset)
            if want is not None and want != digest:
                detail = (
                    f"tensor {record.name!r}, kept in the segment from an earlier save rather "
                    "than copied, changed in memory since it was checked"
                )
                gen.corrupt = detail
                raise CorruptCheckpoint(
                    f"{gen.path!r} generation {gen.number}: {detail}", tensor=record.name,
                    tier=Tier.LOCAL,
                )  # fmt: skip

    def record(self, gen: Generation, digests: list[int]) -> list[int]:
        """Record ``digests`` in ``gen`` and its segment (takes the state lock, re-entrant);
        whoever took them (this digester, a persist's stream), the storages the save kept in
        the segment are checked first (:meth:`_check_kept`)."""
        with self.state.lock.held():
            if gen.digests is None:
                if gen.expected:
                    self._check_kept(gen, digests, gen.expected)
                gen.digests = digests
                header = gen.segment.read_header()
                table = pack_digests(digests)
                mapping = gen.segment.mapping
                mapping[header.digest_offset : header.digest_offset + len(table)] = table
                view = gen.segment.view()
                try:  # the skeleton and manifest are small: hashed here, with the table
                    skeleton, manifest = meta_digests(
                        view, gen.manifest, header.manifest_offset, header.manifest_size
                    )
                finally:
                    del view
                gen.segment.write_header(replace(
                    header, digest_state=DigestState.VALID, skeleton_digest=skeleton,
                    manifest_digest=manifest,
                ))  # fmt: skip
            return gen.digests

    def _loop(self) -> None:
        # Digests are off the trainer's critical path; keep them from competing with training.
        lower_thread_priority()
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            try:
                self._work(item)
            finally:
                self._queue.task_done()

    def _work(self, item: Generation | _FreeCheck) -> None:
        if isinstance(item, _FreeCheck):
            self.state.saves_in_flight.wait_quiet()  # never beside a save's copy
            try:
                self._check_free(item)
            except Exception:  # the segment's token stays unhanded; digests go on
                log.exception("check of freed segment %s failed", item.gen.segment.name)
            return
        gen = item
        # Background work: after the saves in flight (the next files of a checkpoint).
        self.state.saves_in_flight.wait_after(gen.committed)
        if gen.digests is not None or gen.retired or gen.pins < 0:
            return
        if not self.state.pin_if_current(gen):
            return  # retired before we got to it
        try:
            self.compute(gen)
        except Exception:
            log.exception("digest of %s generation %d failed", gen.path, gen.number)
        finally:
            self.state.unpin(gen)
        for hook in self.on_record:
            hook()

    def verify(self, session: Session, req: m.VerifyRequest) -> m.VerifyReply:
        """Recompute digests of the newest generation and compare with the recorded ones."""
        state = self.state
        with state.lock.held():
            gen = state.lookup_visible_locked(req.namespace, req.path, None, session)
            try:
                state.pin_locked(gen)
            except CorruptCheckpoint as e:  # pages read back from a newer save's memory
                return m.VerifyReply(False, gen.number, len(gen.manifest.storages), str(e))
        try:
            recorded = gen.digests if gen.digests is not None else self.compute(gen)
            header = gen.segment.read_header()
            view = gen.segment.view()
            try:
                verify_meta(
                    view, gen.manifest, header.manifest_offset, header.manifest_size,
                    (header.skeleton_digest, header.manifest_digest), tier=Tier.LOCAL,
                )  # fmt: skip
                verify_digests(view, gen.manifest, recorded, tier=Tier.LOCAL)
            finally:
                del view
        except CorruptCheckpoint as e:
            state.metrics.corrupt.labels(tier=Tier.LOCAL).inc()
            return m.VerifyReply(False, gen.number, len(gen.manifest.storages), str(e))
        finally:
            state.unpin(gen)
        return m.VerifyReply(True, gen.number, len(gen.manifest.storages))
