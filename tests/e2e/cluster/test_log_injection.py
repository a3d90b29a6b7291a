"""Strings from outside cannot forge lines in the daemon log: a checkpoint path holding a line
break and a whole fake log record is logged escaped by every daemon that names it (the
origin's backup and persist lines, the backup node's), as is an exception's message."""

from __future__ import annotations

import io
import logging

import torch

from ckptcache.server import logsafe
from tests.helpers import wait_until

FORGED = "2026-01-01 00:00:00,000 ERROR ckptcache.daemon: FORGED by a path"


def test_a_path_with_a_line_break_writes_no_forged_line(cluster_factory, tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    # DEBUG: routine lines (a persist, a group's persist) name the path too.
    a, b = cluster_factory(2, "--persist-root", str(root), "--log-level", "DEBUG")
    path = root / f"model\n{FORGED}\x1b[2K\u2028.pt"
    with a.client() as ca:
        ca.save({"w": torch.arange(1024)}, path, durability="backup")
        ca.wait(path, timeout=60)
    assert path.exists()  # the odd name is a legal file name: persisted as asked
    wait_until(lambda: "FORGED by a path" in b.log(), what="the backup node naming the path")
    for d in (a, b):
        log = d.log()
        assert not [line for line in log.splitlines() if line.startswith(FORGED[:23])]
        assert "\x1b" not in log and "\u2028" not in log
        assert "model\\n" + FORGED + "\\x1b[2K\\u2028.pt" in log  # escaped, on its own line


def test_exception_messages_are_escaped_but_tracebacks_keep_their_frames():
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logsafe.SafeFormatter(logsafe.FORMAT))
    log = logging.getLogger("tests.log_injection")
    log.addHandler(handler)
    log.propagate = False
    try:
        try:
            raise OSError(f"cannot write x\n{FORGED}")
        except OSError as e:
            raise RuntimeError(f"persist failed\n{FORGED}") from e
    except RuntimeError:
        log.exception("persist of %s failed", f"p\n{FORGED}")
    finally:
        log.removeHandler(handler)
    lines = out.getvalue().splitlines()
    assert not [line for line in lines if line.startswith(FORGED[:23])]
    assert lines[0].endswith(f"persist of p\\n{FORGED} failed")
    assert f"OSError: cannot write x\\n{FORGED}" in lines
    assert f"RuntimeError: persist failed\\n{FORGED}" in lines
    assert any(line.startswith('  File "') for line in lines)  # frames still one per line
