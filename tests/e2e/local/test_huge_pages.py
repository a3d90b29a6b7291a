"""Segments on a tmpfs mounted with huge pages: the daemon reports the policy and its
segments really are mapped with 2 MiB pages; on a tmpfs without them it says so and how to
change it. Each test mounts its own tmpfs (root only: marked ``privileged``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from ckptcache.server.config import load_config
from tests.helpers import DaemonProc, assert_same

pytestmark = pytest.mark.privileged
MIB = 1 << 20


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[[str], str]]:
    """``mount(huge)``: a fresh 512 MiB tmpfs with ``huge=<huge>``; unmounted afterwards."""
    mounted: list[str] = []

    def mount(huge: str) -> str:
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root")
        point = tmp_path / f"tmpfs-{huge}"
        point.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size=512m,huge={huge}", "tmpfs", str(point)],
            capture_output=True, text=True,
        )  # fmt: skip
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(str(point))
        return str(point)

    yield mount
    for point in mounted:
        subprocess.run(["umount", "--lazy", point], check=False)


@pytest.fixture
def daemon_on(tmp_path: Path) -> Iterator[Callable[[str], DaemonProc]]:
    started: list[DaemonProc] = []

    def start(base: str) -> DaemonProc:
        workdir = tmp_path / f"node-{uuid.uuid4().hex[:6]}"
        workdir.mkdir()
        d = DaemonProc(workdir, os.path.join(base, "ckptcache"), ["--memory-limit", "256MiB"])
        started.append(d)
        return d.start()

    yield start
    for d in started:
        d.cleanup()


def _pmd_mapped_kib(pid: int, under: str) -> int:
    """KiB of ``pid``'s mappings of files under ``under`` that are mapped by 2 MiB entries."""
    with open(f"/proc/{pid}/smaps") as f:
        blocks = re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", f.read())
    total = 0
    for block in blocks:
        if under in block.splitlines()[0]:
            found = re.search(r"^ShmemPmdMapped:\s+(\d+) kB", block, re.M)
            total += int(found[1]) if found else 0
    return total


def test_segments_on_a_huge_page_tmpfs_use_huge_pages(tmpfs, daemon_on, tmp_path):
    base = tmpfs("within_size")
    d = daemon_on(base)
    state = {"w": torch.randn(4 * MIB), "step": 7}  # 16 MiB: eight huge pages
    path = tmp_path / "ckpt" / "model.pt"
    with d.client(fallback="raise") as c:
        c.save(state, path)
        assert c.daemon_status().shm_huge_pages == "within_size"
        assert_same(c.load(path, mmap=False), state)
        assert_same(c.load(path), state)
    # The daemon's own mapping of the 16 MiB object is made of huge pages.
    assert _pmd_mapped_kib(d.proc.pid, d.segments_dir) >= 16 * 1024
    assert "use 4 KiB pages" not in d.log()


def test_a_tmpfs_without_huge_pages_is_reported_with_the_fix(tmpfs, daemon_on, tmp_path):
    d = daemon_on(tmpfs("never"))
    state = {"w": torch.arange(MIB)}
    with d.client(fallback="raise") as c:
        c.save(state, tmp_path / "a.pt")
        assert c.daemon_status().shm_huge_pages == "never"
        assert_same(c.load(tmp_path / "a.pt"), state)
    assert _pmd_mapped_kib(d.proc.pid, d.segments_dir) == 0
    assert re.search(r"segments in \S+ use 4 KiB pages; a tmpfs mounted with huge=within_size",
                     d.log())  # fmt: skip
    status = subprocess.run(
        [sys.executable, "-m", "ckptcache.cli", "status", "--socket", d.socket],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "4 KiB (tmpfs huge=never; docs/tuning.md, Huge pages)" in status


def test_the_default_budget_fits_the_tmpfs_under_shm_dir(tmpfs):
    base = tmpfs("within_size")  # 512 MiB: far below half of any test machine's memory
    config = load_config(overrides={"shm_dir": os.path.join(base, "not-yet", "made")})
    assert config.memory_limit == int(512 * MIB * 0.9)
    assert load_config(overrides={"memory_limit": "64MiB", "shm_dir": base}).memory_limit == (
        64 * MIB
    )
