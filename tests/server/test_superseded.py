"""The record of superseded saves: newest kept, bounded, forgotten by a newer save."""

from __future__ import annotations

from types import SimpleNamespace

from ckptcache.server.memory.superseded import SupersededSaves


def gen(path: str, number: int, error: str = "") -> SimpleNamespace:
    return SimpleNamespace(
        namespace="default", path=path, number=number, size=10, committed=1.0,
        persist_error=error, origin="", saver=None, key=("default", path),
    )  # fmt: skip


def test_the_newest_superseded_save_of_a_path_is_kept():
    saves = SupersededSaves()
    saves.remember(gen("/a", 3, "replaced by hand"))  # type: ignore[arg-type]
    saves.remember(gen("/a", 2))  # type: ignore[arg-type]
    record = saves.get(("default", "/a"))
    assert record is not None
    info = record.info
    assert (info.generation, info.persist_state, info.stages) == (3, "superseded", ())
    assert info.persist_error == "replaced by hand"
    saves.forget(("default", "/a"))
    assert saves.get(("default", "/a")) is None


def test_memory_is_bounded_oldest_record_first_out():
    saves = SupersededSaves(limit=3)
    for i in range(5):
        saves.remember(gen(f"/p{i}", 1))  # type: ignore[arg-type]
    assert len(saves) == 3
    assert saves.get(("default", "/p1")) is None and saves.get(("default", "/p2")) is not None
    record = saves.get(("default", "/p4"))
    assert record is not None and "newer" in record.info.persist_error
