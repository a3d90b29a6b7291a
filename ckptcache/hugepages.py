"""Which pages back the segment files: the ``huge=`` policy of the tmpfs under a directory.

On a tmpfs mounted without ``huge=`` (``/dev/shm`` on most distributions) every segment is
made of 4 KiB pages: allocating 1 GiB zeroes and maps 262,144 of them, and every copy into a
fresh mapping takes a page fault per 4 KiB. On a tmpfs mounted with ``huge=within_size`` (or
``always``) the same gigabyte is 512 huge pages: allocation and first writes run several
times faster (docs/tuning.md, "Huge pages"). The daemon reports the policy in ``ckptcache status``
and suggests the mount when it is off; it never mounts anything itself, nor asks for huge
pages with ``madvise`` (see :data:`HUGE`).

Torch-free and cheap: one read of ``/proc/self/mountinfo``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["HUGE", "MountInfo", "huge_policy", "mount_of", "parse_mountinfo"]

#: The policies under which segment files get huge pages without asking. ``advise`` is left
#: out on purpose: ``madvise(MADV_HUGEPAGE)`` opts a mapping into direct compaction, which can
#: stall a save for as long as the kernel takes to assemble 2 MiB pages.
HUGE = ("within_size", "always", "force")

_MOUNTINFO = "/proc/self/mountinfo"


@dataclass(frozen=True)
class MountInfo:
    """The mount a path lies on, as ``/proc/self/mountinfo`` describes it."""

    mount_point: str
    fs_type: str
    #: Per-superblock options (``size=...``, ``huge=...``), as given to the mount.
    options: dict[str, str]


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as three octal digits.
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1 : i + 4].isdigit() and i + 3 < len(field):
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def parse_mountinfo(text: str) -> list[MountInfo]:
    """The mounts listed in ``text`` (the format of ``/proc/<pid>/mountinfo``), in order."""
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        sep = fields.index("-")
        if sep < 5 or len(fields) < sep + 4:
            continue
        options: dict[str, str] = {}
        for option in fields[sep + 3].split(","):
            key, _, value = option.partition("=")
            options[key] = value
        mounts.append(MountInfo(_unescape(fields[4]), fields[sep + 1], options))
    return mounts


def mount_of(path: str, mountinfo: str | None = None) -> MountInfo | None:
    """The mount ``path`` lies on (the last-mounted one with the longest matching mount
    point), or None where ``/proc`` is not readable."""
    if mountinfo is None:
        try:
            with open(_MOUNTINFO, encoding="utf-8", errors="replace") as f:
                mountinfo = f.read()
        except OSError:
            return None
    real = os.path.realpath(path)
    best: MountInfo | None = None
    for mount in parse_mountinfo(mountinfo):
        point = mount.mount_point.rstrip("/") or "/"
        inside = real == point or real.startswith(point + "/") or point == "/"
        if inside and (best is None or len(point) >= len(best.mount_point.rstrip("/") or "/")):
            best = mount
    return best


def huge_policy(path: str, mountinfo: str | None = None) -> str:
    """The ``huge=`` policy of the tmpfs under ``path``: ``never`` (the default: 4 KiB
    pages), ``within_size``, ``always`` or ``advise``; ``unknown`` when ``path`` is not on a
    tmpfs or the mounts cannot be read."""
    mount = mount_of(path, mountinfo)
    if mount is None or mount.fs_type != "tmpfs":
        return "unknown"
    return mount.options.get("huge", "never") or "never"
