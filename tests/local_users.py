"""Second local users for security tests: created with ``useradd`` (tests run as root), and
code run as them in a forked child that drops privileges (the interpreter and the modules the
parent already imported stay usable even where the user could not read them from disk)."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import tempfile
import traceback
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import DaemonProc

NEEDS_ROOT = "needs root to create a second local user (useradd) and act as it; CI runs as root"


@dataclass(frozen=True)
class User:
    """A local test user."""

    name: str
    uid: int
    gid: int


def ensure_user(name: str) -> User:
    """Create ``name`` (no home, no login) unless it exists; idempotent across runs."""
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
            check=True, capture_output=True,
        )  # fmt: skip
        entry = pwd.getpwnam(name)
    return User(name, entry.pw_uid, entry.pw_gid)


def users(count: int) -> list[User]:
    """``count`` test users; skips (with the reason) unless running as root."""
    if os.geteuid() != 0:
        pytest.skip(NEEDS_ROOT)
    return [ensure_user(f"ckptcache-test-{i}") for i in range(1, count + 1)]


def run_as(user: User, fn: Callable[[], Any], *, umask: int | None = None) -> Any:
    """Run ``fn()`` as ``user`` in a forked child; returns its (JSON-able) result or re-raises
    its exception as ``RuntimeError`` carrying the child's exception type and message."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: drop root for good, then act
        os.close(read)
        try:
            os.setgroups([])
            os.setgid(user.gid)
            os.setuid(user.uid)
            if umask is not None:
                os.umask(umask)
            out = {"ok": True, "result": fn()}
        except BaseException as e:
            out = {"ok": False, "type": type(e).__name__, "message": str(e),
                   "trace": traceback.format_exc()}  # fmt: skip
        with os.fdopen(write, "w") as f:
            json.dump(out, f)
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        data = f.read()
    os.waitpid(pid, 0)
    out = json.loads(data)
    if not out["ok"]:
        raise ChildError(out["type"], out["message"], out["trace"])
    return out["result"]


class ChildError(RuntimeError):
    """An exception raised by code run through :func:`run_as`."""

    def __init__(self, type_name: str, message: str, trace: str):
        super().__init__(f"{type_name}: {message}\n{trace}")
        self.type_name = type_name
        self.message = message


@contextmanager
def shared_daemon(*args: str, env: dict[str, str] | None = None) -> Iterator[DaemonProc]:
    """A root daemon whose socket other users can reach (its directory is not under pytest's
    0700 tmp tree)."""
    workdir = Path(tempfile.mkdtemp(prefix="ckptcache-sec-", dir="/tmp"))
    workdir.chmod(0o755)
    d = DaemonProc(workdir, f"/dev/shm/ckptcache-test-{uuid.uuid4().hex[:10]}", list(args),
                   env or {})  # fmt: skip
    try:
        yield d.start()
    finally:
        d.cleanup()
        shutil.rmtree(workdir, ignore_errors=True)
