"""What the command line prints about paths from outside: a path holding ESC or a line break
is escaped as the daemon's log escapes it (root's ``ls`` lists every user's objects), and
``inspect`` of a path neither cached nor stored says so."""

from __future__ import annotations

import os
import subprocess
import sys

import torch


def cli(daemon, *args):
    env = {**os.environ, "CKPTCACHE_SOCKET": daemon.socket}
    return subprocess.run([sys.executable, "-m", "ckptcache.cli", *args], env=env,
                          capture_output=True, text=True)  # fmt: skip


def test_ls_escapes_control_characters_of_paths(daemon, tmp_path):
    path = str(tmp_path / "evil\x1b]0;owned\x07\nFORGED LINE\r.pt")
    with daemon.client() as c:
        c.save({"w": torch.zeros(16)}, path, durability="memory")
    out = cli(daemon, "ls", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "\x1b" not in out.stdout and "\x07" not in out.stdout and "\r" not in out.stdout
    assert "evil\\x1b]0;owned\\x07\\nFORGED LINE\\r.pt" in out.stdout
    assert not any(line.startswith("FORGED") for line in out.stdout.splitlines())
    assert len(out.stdout.strip().splitlines()) == 2  # the header and one row


def test_inspect_of_a_path_neither_cached_nor_stored_says_so(daemon, tmp_path):
    out = cli(daemon, "inspect", str(tmp_path / "never.pt"))
    assert out.returncode == 1
    assert "neither cached" in out.stderr and "nor on storage" in out.stderr
    assert "load it from storage" not in out.stderr
