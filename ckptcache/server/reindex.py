"""Recovery after a restart: rebuild the index from the committed segments left in shm.

Call order (once, before anything is served): :func:`recover` scans the arena, reclaims
uncommitted or unreadable segments, re-indexes the rest, retires generations older than the
object on storage (URLs are compared in the background), applies retention, and re-queues
digests and persists that had not finished.
"""

from __future__ import annotations

import logging
import threading

from ckptcache._units import format_bytes
from ckptcache.errors import CorruptCheckpoint, PathNotAllowed
from ckptcache.format.layout import HEADER_SIZE, DigestState, SegmentHeader, SegmentState
from ckptcache.format.manifest import Manifest, unpack_digests
from ckptcache.server import ownership
from ckptcache.server.memory import records
from ckptcache.server.memory.arena import Segment
from ckptcache.server.memory.index import Generation, Key
from ckptcache.server.memory.retention import Retention
from ckptcache.server.memory.sharing import Run, intersect
from ckptcache.server.persist.digester import Digester
from ckptcache.server.persist.lineage import anchor_of, is_orphaned, removed_reason
from ckptcache.server.persist.persister import Persister
from ckptcache.server.persist.provenance import Provenance, read_provenance, write_provenance
from ckptcache.server.persist.roots import PersistRoots
from ckptcache.server.saves import persistable
from ckptcache.server.state import CacheState
from ckptcache.storage import backend_for
from ckptcache.storage.base import AlreadyStored, NewerObjectExists, StorageConflict
from ckptcache.wire.states import PersistState

__all__ = ["recover"]

log = logging.getLogger(__name__)


def recover(
    state: CacheState,
    roots: PersistRoots,
    retention: Retention,
    digester: Digester,
    persister: Persister,
) -> None:
    """Rebuild the index from committed segments; reclaim everything else."""
    arena = state.arena
    shared = arena.sharing.records.load()
    backings = {name for runs in shared.values() for _, _, name in runs or ()}
    orphans: list[Segment] = []
    for segment, header in arena.scan():
        page = records.page(segment) if segment.sealable else None
        if segment.sealable:
            # An admitted user's file: only the daemon's own record says what it holds.
            header = _recorded_header(segment, page)
        if header is not None and header.state == SegmentState.FREE and segment.name in backings:
            orphans.append(segment)  # its generation left, pages of others still lie in it
            continue
        if header is None or header.state != SegmentState.COMMITTED:
            if header is not None:  # an unreadable one was reported by the scan
                log.info("reclaiming uncommitted segment %s", segment.name)
            arena.destroy(segment)
            continue
        if records.is_staging(segment):
            # Held for its stager's lease, which ended with the last incarnation's connections.
            log.info("reclaiming staging copy in segment %s: its stager's lease is gone",
                     segment.name)  # fmt: skip
            arena.destroy(segment)
            continue
        view = segment.view()
        try:
            manifest = Manifest.from_json(
                view[header.manifest_offset : header.manifest_offset + header.manifest_size],
                segment_size=segment.capacity,
            )
            if page is not None and records.read_key(page) != (manifest.namespace, manifest.path):
                raise CorruptCheckpoint(
                    f"its manifest names {manifest.path!r}, not the path the daemon committed"
                )
        except CorruptCheckpoint as e:
            log.error("dropping segment %s: %s", segment.name, e)
            del view
            arena.destroy(segment)
            continue
        record = read_provenance(segment)
        anchor = record.anchor if record is not None else None
        gen = Generation(
            manifest.namespace, manifest.path, header.generation, segment, manifest,
            size=header.payload_size, committed=header.committed_ns / 1e9,
            saver=ownership.read_record(segment, arena.uid),
            committed_ns=header.committed_ns,
            # Recorded at save time; recomputing it now would take a directory the user
            # removed while the daemon was down for one that never existed.
            anchor=anchor if anchor is not None else anchor_of(manifest.path),
            base=record.base if record is not None else None,
        )  # fmt: skip
        # Persisted or not, a path under a root is a persisted kind of object (wait()
        # answers "persisted", never "memory-only", for it after a restart).
        chosen = record is not None and record.memory_only  # durability="memory"
        gen.needs_persist = not chosen and persistable(roots, gen.path)
        if header.persisted:
            state.persist_states.advance(gen, PersistState.PERSISTED, persisted=True)
        elif gen.needs_persist:
            _keep_deleted(state, gen, dropped=record is not None and record.dropped)
        # A user's digest table lies in its own file: computed again rather than believed.
        if header.digest_state == DigestState.VALID and not segment.sealable:
            table = view[header.digest_offset : header.digest_offset + 8 * header.n_storages]
            gen.digests = unpack_digests(table, header.n_storages)
        del view
        state.index.add(gen)
        log.info("recovered %s generation %d (%s)", gen.path, gen.number, format_bytes(gen.size))
    _rebuild_sharing(state, shared, orphans)
    check = _StorageCheck(state, roots, retention, persister)
    remote = [k for k in state.index.paths() if "://" in k[1]]
    for key in state.index.paths():
        if key not in remote:  # a stat each: before anything is served
            check.retire_older_than_storage(key)
    if remote:  # object stores may be slow or down: compare in the background
        threading.Thread(target=check.run, args=(remote,), name="stale-check", daemon=True).start()
    with state.lock.held():
        for key in state.index.paths():
            retention.supersede_older_locked(key)
            retention.apply_locked(key)
    for gen in state.generations():
        if gen.digests is None:
            digester.put(gen)
        if gen.needs_persist and not gen.persisted and gen.persist_state != PersistState.CONFLICT:
            log.info("re-queueing unpersisted %s generation %d", gen.path, gen.number)
            persister.submit(gen)


def _rebuild_sharing(
    state: CacheState,
    shared: dict[str, list[tuple[int, int, str]] | None],
    orphans: list[Segment],
) -> None:
    """Give each recovered hollow generation its runs again; one whose record is unreadable,
    or whose backing is gone (or holds a hole where it should back), cannot be made whole,
    and is dropped."""
    arena = state.arena
    held = {gen.segment.name: gen for gen in state.index}
    holes = {name: [(lo, hi) for lo, hi, _ in runs or ()] for name, runs in shared.items()}
    unknown = {name for name, runs in shared.items() if runs is None}  # holes anywhere
    unsound = []
    for name, runs in shared.items():
        gen = held.get(name)
        if gen is None:
            arena.sharing.records.drop_name(name)
            continue
        if (
            runs is None
            or gen.digests is None
            or not all(
                b in arena.segments
                and b not in unknown
                and not intersect([(lo, hi)], holes.get(b, []))
                for lo, hi, b in runs
            )
        ):
            unsound.append(gen)
            continue
        arena.sharing.restore(gen.segment, [Run(lo, hi, arena.segments[b]) for lo, hi, b in runs])
        log.info("%s generation %d shares %s with newer saves again", gen.path, gen.number,
                 format_bytes(gen.segment.hollow))  # fmt: skip
    # Once every sound one holds its runs: a dropped one that backs them stays, an orphan.
    for gen in unsound:
        log.error("dropping %s generation %d: part of its pages lay in memory that is gone, "
                  "or its record of where is unreadable", gen.path, gen.number)  # fmt: skip
        with state.lock.held():
            state.retire_locked(gen)  # its header freed before its record goes
        arena.sharing.records.drop_name(gen.segment.name)
    for segment in orphans:
        if segment.dependents:
            segment.orphan = True
        else:
            arena.destroy(segment)


class _StorageCheck:
    """Compares recovered generations with the object on storage."""

    def __init__(
        self, state: CacheState, roots: PersistRoots, retention: Retention, persister: Persister
    ):
        self.state, self.roots, self.retention, self.persister = state, roots, retention, persister

    def run(self, keys: list[Key]) -> None:
        for key in keys:
            self.retire_older_than_storage(key)

    def retire_older_than_storage(self, key: Key) -> None:
        """Drop recovered generations older than the object on storage.

        A save written through while this daemon was down (or a newer persist by another
        node) is the last completed save: an older generation must neither be served nor
        persisted over it. Each generation is compared as its persist would be
        (:class:`~ckptcache.storage.base.WriteGuard`: the object on storage against the one
        there when it was saved), not by wall clocks; one that only clocks could order
        against the stored object is kept and reported as a conflict.
        """
        path = key[1]
        try:
            if self.roots.root_for(path) is None and "://" in path:
                return  # a URL under no root: storage is none of our business
            stored = backend_for(path, self.persister.options).version(path)
        except (OSError, ValueError, ImportError, PathNotAllowed) as e:
            log.warning("cannot compare %s with storage: %s", path, e)
            return
        if stored is None:
            return
        with self.state.lock.held():
            for gen in list(self.state.index.generations(key)):
                try:
                    self.persister.guard_locked(gen).check(path, stored)
                except AlreadyStored:
                    pass  # this generation is the object: its persist finds it there
                except NewerObjectExists:
                    log.warning(
                        "dropping %s generation %d: storage holds a newer object (written "
                        "through or persisted after it)", path, gen.number,
                    )  # fmt: skip
                    if not gen.persisted:
                        self.state.persist_states.advance(
                            gen, PersistState.SUPERSEDED, needs_persist=False
                        )
                    self.state.retire_locked(gen)
                except StorageConflict as e:
                    if gen.persisted:  # storage holds another writer's object now
                        self.state.retire_locked(gen)
                    else:
                        self.state.persist_states.advance(gen, PersistState.CONFLICT, error=str(e))
                        log.error("not persisting %s generation %d: %s", path, gen.number, e)


def _recorded_header(segment: Segment, page: bytes | memoryview | None) -> SegmentHeader | None:
    """The header the daemon recorded for an admitted user's segment; None without one, or
    with one it cannot read (another layout version's, or one its user wrote a header into)."""
    if page is None:
        log.error("segment %s has no record of the daemon's: not adopted", segment.name)
        return None
    try:
        header = SegmentHeader.unpack(page[:HEADER_SIZE])
    except ValueError as e:
        log.error("reclaiming segment %s: its recorded header is unreadable (%s)", segment.name, e)
        return None
    segment.header = header
    return header


def _keep_deleted(state: CacheState, gen: Generation, *, dropped: bool) -> None:
    """A recovered generation whose directory the user removed stays deleted: never persisted
    (the mark is made durable first if the removal happened while the daemon was down)."""
    if not dropped and not is_orphaned(gen.anchor):
        return
    if not dropped:
        write_provenance(gen.segment, Provenance(gen.base, gen.anchor, dropped=True))
    state.persist_states.advance(
        gen, PersistState.DROPPED, needs_persist=False, error=removed_reason(gen.anchor)
    )
    gen.orphaned = True
    log.info("%s generation %d stays deleted: %s", gen.path, gen.number, gen.persist_error)
