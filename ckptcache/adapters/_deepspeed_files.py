"""DeepSpeed's own small files around a save (rank 0), written so that they do not wait for
the disk: ``latest`` replaced atomically, the recovery scripts copied only when they changed.

DeepSpeed (0.19) writes both itself once the payload files are handed over: ``latest`` with
``open(path, "w")``, which truncates the previous file in place, and, at every ZeRO save,
``zero_to_fp32.py`` and ``zero_to_torch.py`` copied again over the same two files in the save
directory. On ext4 a truncate waits for the journal, and a file truncated and rewritten is
flushed at close; while the daemon persists the checkpoint just saved (or the kernel writes
back earlier ones) those small writes wait behind it, longer than the copy into the cache
(``benchmarks/frameworks/README.md``). A new file renamed over ``latest`` needs neither, and
is never seen empty or half-written by a reader or after a crash; an unchanged script needs
no write at all.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Callable
from typing import Any

__all__ = ["LATEST", "recovery_scripts", "scripts_current", "write_latest"]

#: The file naming the newest tag of a save directory (DeepSpeed's ``latest``).
LATEST = "latest"


def write_latest(save_dir: str, tag: str) -> None:
    """Make ``save_dir/latest`` name ``tag``: a new file, with the mode DeepSpeed's ``open``
    gives it (``0o666`` less the umask, applied by the kernel), renamed over the previous
    one."""
    tmp = os.path.join(save_dir, f".{LATEST}.{os.getpid()}.{secrets.token_hex(6)}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        with os.fdopen(fd, "w") as f:
            f.write(tag)
        os.replace(tmp, os.path.join(save_dir, LATEST))
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def recovery_scripts(copier: Callable[..., Any]) -> tuple[str, tuple[str, ...]] | None:
    """Where ``copier`` (DeepSpeed's ``_copy_recovery_script``) copies from (DeepSpeed's
    ``utils`` directory) and the names it copies, read from the function itself; ``None`` when
    they cannot be told (another DeepSpeed: the scripts are then always copied, as it does)."""
    code = getattr(copier, "__code__", None)
    if code is None:
        return None
    names = [
        c
        for c in code.co_consts
        if isinstance(c, tuple) and c and all(isinstance(n, str) and n.endswith(".py") for n in c)
    ]
    if len(names) != 1:
        return None
    # DeepSpeed's own expression: the package directory above the engine's module, then utils.
    source = os.path.join(os.path.dirname(os.path.dirname(code.co_filename)), "utils")
    return source, names[0]


def scripts_current(save_path: str, source: str, names: tuple[str, ...]) -> bool:
    """Whether every script of ``names`` in ``save_path`` is a regular file, executable by its
    owner, holding the bytes of the one in ``source``: what DeepSpeed's copy would leave."""
    for name in names:
        try:
            st = os.stat(os.path.join(save_path, name), follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode) or not st.st_mode & stat.S_IXUSR:
                return False
            if st.st_size != os.stat(os.path.join(source, name)).st_size:
                return False
            if _read(os.path.join(save_path, name)) != _read(os.path.join(source, name)):
                return False
        except OSError:
            return False
    return True


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()
