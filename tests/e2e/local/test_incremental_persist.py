"""Incremental persists against real daemons: records the previous persisted file of the path
holds unchanged are copied from it, and the file written is the one a full persist writes."""

from __future__ import annotations

import os
import urllib.request

import pytest
import torch

from ckptcache.format.persisted import list_records, verify_stored
from ckptcache.storage.ranges import COPY_ENV, shares_blocks
from tests.helpers import assert_same, wait_until

MiB = 1 << 20


def config(tmp_path, **extra) -> str:
    lines = {"persist_retries": 2, "persist_backoff": 0.1, "persist_backoff_max": 0.2, **extra}
    path = tmp_path / f"cfg-{len(list(tmp_path.glob('cfg-*')))}.yaml"
    path.write_text("".join(f"{k}: {v}\n" for k, v in lines.items()))
    return str(path)


def frozen(n: int = 6) -> dict[str, torch.Tensor]:
    """Tensors that never change between saves (a frozen base), 1 MiB each."""
    g = torch.Generator().manual_seed(7)
    return {f"base.{i}": torch.randn(MiB // 4, generator=g) for i in range(n)}


def state(step: int, *, base: dict[str, torch.Tensor] | None = None) -> dict[str, object]:
    g = torch.Generator().manual_seed(1000 + step)
    return {
        "base": frozen() if base is None else base,
        "adapter": torch.randn(MiB // 4, generator=g),  # changes every save
        "small": torch.randn(16, generator=g),
        "step": step,
    }


#: The test directory's file system may share no blocks (ext4): copy there all the same.
ALWAYS = {COPY_ENV: "always"}


def started(daemon_factory, tmp_path, root, env=None, **extra):
    d = daemon_factory("--persist-root", str(root), "--metrics-port", "0",
                       "--config", config(tmp_path, **extra),
                       env={**ALWAYS, **(env or {})})  # fmt: skip
    wait_until(lambda: "metrics=:" in d.log(), 30, "the daemon's ready line")
    return d


def reused(d) -> float:
    port = int(d.log().split("metrics=:")[1].split()[0])
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    for line in text.splitlines():
        if line.startswith("ckptcache_persist_bytes_reused_total "):
            return float(line.split()[1])
    raise AssertionError("no reuse counter in the metrics")


def persist(d, path, obj) -> None:
    with d.client() as c:
        c.save(obj, path)
        c.wait(path, timeout=60)


def data_range(path, name_suffix: str) -> tuple[int, int]:
    """(header offset, size) of the record of ``path`` whose name ends with ``name_suffix``."""
    with open(path, "rb") as f:
        view = memoryview(f.read())
    records, _ = list_records(view, str(path))
    record = next(r for r in records if r.name.endswith(name_suffix))
    return record.header_offset, record.size


def large_records(path) -> list[tuple[int, int]]:
    with open(path, "rb") as f:
        view = memoryview(f.read())
    records, _ = list_records(view, str(path))
    return [(r.data_offset, r.size) for r in records if r.size >= MiB]


@pytest.mark.parametrize("direct", ["1", "0"])
def test_unchanged_records_are_copied_into_the_file_a_full_persist_writes(
    daemon_factory, tmp_path, direct
):
    inc = started(daemon_factory, tmp_path, tmp_path / "a", env={"CKPTCACHE_DIRECT_IO": direct})
    full = started(daemon_factory, tmp_path, tmp_path / "b", incremental_persist="false")
    rel = os.path.join("run", "model.pt")
    base = frozen()
    for d, root in ((inc, tmp_path / "a"), (full, tmp_path / "b")):
        persist(d, root / rel, state(1, base=base))
    old = tmp_path / "a" / "old.pt"
    os.link(tmp_path / "a" / rel, old)  # the previous file, kept past its replacement
    before = old.read_bytes()
    for d, root in ((inc, tmp_path / "a"), (full, tmp_path / "b")):
        persist(d, root / rel, state(2, base=base))
    # Six 1 MiB base tensors copied, less the partial blocks at their edges.
    assert reused(inc) >= 5 * MiB
    assert reused(full) == 0
    new, other = (tmp_path / "a" / rel).read_bytes(), (tmp_path / "b" / rel).read_bytes()
    # The same file, byte for byte, up to the id torch gives each save (and the digest
    # record that covers it): every tensor's data, header and descriptor.
    sid = data_range(tmp_path / "a" / rel, "/.data/serialization_id")[0]
    assert len(new) == len(other) and new[:sid] == other[:sid]
    assert large_records(tmp_path / "a" / rel) == large_records(tmp_path / "b" / rel)
    verify_stored(str(tmp_path / "b" / rel), deep=True)
    assert old.read_bytes() == before  # the previous file is never written
    old.unlink()
    verify_stored(str(tmp_path / "a" / rel), deep=True)
    assert_same(state(2, base=base), torch.load(tmp_path / "a" / rel, weights_only=True))


@pytest.mark.parametrize("keep_mtime", [True, False])
def test_a_byte_flipped_in_the_previous_file_never_reaches_the_new_one(
    daemon_factory, tmp_path, keep_mtime
):
    root = tmp_path / "a"
    d = started(daemon_factory, tmp_path, root)
    path = root / "model.pt"
    base = frozen()
    persist(d, path, state(1, base=base))
    offset, _ = data_range(path, "/data/0")  # the first base tensor (its header, then data)
    st = os.stat(path)
    with open(path, "r+b") as f:  # damage in place, behind the daemon's back
        f.seek(offset + 8192)
        byte = f.read(1)
        f.seek(offset + 8192)
        f.write(bytes([byte[0] ^ 0xFF]))
    if keep_mtime:  # the file still looks like the one persisted: only the read-back sees it
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    persist(d, path, state(2, base=base))
    verify_stored(str(path), deep=True)
    assert_same(state(2, base=base), torch.load(path, weights_only=True))
    if keep_mtime:  # the others were copied; the damaged one written from memory
        assert 4 * MiB <= reused(d) < 6 * MiB
        assert "reads back with another digest" in d.log()
    else:  # not the file persisted: nothing taken from it
        assert reused(d) == 0


def _shares_blocks(directory) -> bool:
    (directory / "probe").write_bytes(b"x" * 8192)
    source = os.open(directory / "probe", os.O_RDONLY)
    dest = os.open(directory / "probe2", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        return shares_blocks(source, dest)
    finally:
        os.close(source)
        os.close(dest)
        for name in ("probe", "probe2"):
            (directory / name).unlink()


def test_no_copy_where_the_file_system_would_write_every_byte_anyway(daemon_factory, tmp_path):
    root = tmp_path / "a"
    root.mkdir()
    if _shares_blocks(root):
        pytest.skip("this file system shares blocks: copies pay here")
    d = started(daemon_factory, tmp_path, root, env={COPY_ENV: ""})
    path = root / "model.pt"
    base = frozen()
    persist(d, path, state(1, base=base))
    persist(d, path, state(2, base=base))
    assert reused(d) == 0  # an in-kernel copy would write as much and read the old file too
    verify_stored(str(path), deep=True)
    assert_same(state(2, base=base), torch.load(path, weights_only=True))


def test_everything_changed_is_a_plain_persist(daemon_factory, tmp_path):
    root = tmp_path / "a"
    d = started(daemon_factory, tmp_path, root)
    path = root / "model.pt"
    persist(d, path, state(1))
    g = torch.Generator().manual_seed(99)
    changed = {k: torch.randn(v.shape, generator=g) for k, v in frozen().items()}
    persist(d, path, state(2, base=changed))
    assert reused(d) == 0
    verify_stored(str(path), deep=True)
    assert_same(state(2, base=changed), torch.load(path, weights_only=True))


def test_a_daemon_killed_mid_persist_loses_nothing_acknowledged(daemon_factory, tmp_path):
    root = tmp_path / "a"
    d = started(daemon_factory, tmp_path, root)
    path = root / "model.pt"
    base = {f"base.{i}": torch.full((4 * MiB,), float(i)) for i in range(16)}  # 256 MiB
    persist(d, path, state(1, base=base))
    with d.client() as c:
        c.save(state(2, base=base), path)  # acknowledged: in memory
        wait_until(lambda: c.status(path).persist_state in ("persisting", "persisted"),
                   30, "the persist to start", interval=0.002)  # fmt: skip
    d.restart()  # kill -9, most often while the incremental persist is under way
    # Whatever moment the kill hit, the path holds a complete file, never a torn one.
    verify_stored(str(path), deep=True)
    with d.client() as c:
        c.wait(path, timeout=120)
        assert_same(state(2, base=base), c.load(path))
    verify_stored(str(path), deep=True)
    assert_same(state(2, base=base), torch.load(path, weights_only=True))
