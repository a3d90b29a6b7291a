"""The ``huge=`` policy of the tmpfs under a directory, read from mountinfo text."""

from __future__ import annotations

from ckptcache.hugepages import huge_policy, mount_of, parse_mountinfo

# Lines in the kernel's format (proc(5)): id, parent, dev, root, mount point, options,
# optional fields, "-", fs type, source, superblock options.
MOUNTINFO = "\n".join([
    "22 1 0:21 / / rw,relatime shared:1 - ext4 /dev/vda rw",
    "25 22 0:5 / /dev rw,nosuid shared:2 - devtmpfs devtmpfs rw,size=4096k,mode=755",
    "27 25 0:24 / /dev/shm rw,nosuid,nodev shared:3 - tmpfs tmpfs rw,size=24682416k",
    "90 22 0:40 / /mnt/huge\\040shm rw,relatime - tmpfs tmpfs rw,size=4194304k,huge=within_size",
    "91 22 0:41 / /mnt/adv rw,relatime shared:9 master:2 - tmpfs none rw,huge=advise",
    "92 27 0:42 / /dev/shm/ckpt rw,relatime - tmpfs tmpfs rw,huge=always",
])  # fmt: skip


def test_mountinfo_is_parsed_with_escapes_and_optional_fields():
    mounts = parse_mountinfo(MOUNTINFO + "\nnot a mountinfo line\n")
    assert [m.mount_point for m in mounts] == [
        "/", "/dev", "/dev/shm", "/mnt/huge shm", "/mnt/adv", "/dev/shm/ckpt",
    ]  # fmt: skip
    assert mounts[3].fs_type == "tmpfs"
    assert mounts[3].options == {"rw": "", "size": "4194304k", "huge": "within_size"}


def test_the_longest_mount_point_wins():
    assert mount_of("/dev/shm/ckpt/segments", MOUNTINFO).mount_point == "/dev/shm/ckpt"
    assert mount_of("/dev/shm/ckptcache-0", MOUNTINFO).mount_point == "/dev/shm"
    assert mount_of("/dev/shmx", MOUNTINFO).mount_point == "/dev"
    assert mount_of("/var/tmp", MOUNTINFO).mount_point == "/"


def test_policy_of_each_kind_of_mount():
    assert huge_policy("/dev/shm/ckptcache-0", MOUNTINFO) == "never"  # tmpfs without huge=
    assert huge_policy("/mnt/huge shm/x", MOUNTINFO) == "within_size"
    assert huge_policy("/mnt/adv", MOUNTINFO) == "advise"
    assert huge_policy("/dev/shm/ckpt/s", MOUNTINFO) == "always"
    assert huge_policy("/var/tmp", MOUNTINFO) == "unknown"  # not a tmpfs
    assert huge_policy("/var/tmp", "") == "unknown"  # nothing readable
