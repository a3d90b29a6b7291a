"""Attacks by other local users on a root daemon and its clients (issue: trust boundaries).

Each test plays the attacker as a real second uid (``useradd``; see tests/local_users.py)
against real daemon processes, and asserts what the attack achieved: nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
import rpyc
import torch

import ckptcache
from ckptcache.errors import (
    CheckpointNotFound,
    DaemonUnavailable,
    PathNotAllowed,
    PersistError,
    RequestTooLarge,
)
from ckptcache.wire import messages as m
from tests.helpers import assert_same, wait_until
from tests.local_users import ChildError, run_as, shared_daemon, users

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root to create second local users (CI runs as root)"
)


def _start_refused(tmp_path: Path, shm_dir: str, socket_path: str) -> str:
    """Start a daemon that must refuse to start; returns what it printed."""
    proc = subprocess.run(
        [sys.executable, "-m", "ckptcache.cli", "daemon", "--shm-dir", shm_dir,
         "--socket", socket_path, "--memory-limit", "64MiB"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    return proc.stderr


@pytest.fixture
def attacker():
    return users(1)[0]


@pytest.fixture
def shm_name():
    name = f"/dev/shm/ckptcache-test-{uuid.uuid4().hex[:10]}"
    yield name
    shutil.rmtree(name, ignore_errors=True)


# ------------------------------------------------------------------ 1. directory squatting


def test_daemon_refuses_a_shm_dir_planted_by_another_user(tmp_path, attacker, shm_name):
    victim = tmp_path / "root-only.txt"
    victim.write_text("precious")

    def plant() -> None:
        os.mkdir(shm_name, 0o777)
        os.chmod(shm_name, 0o777)
        os.symlink(str(victim), os.path.join(shm_name, "daemon.lock"))

    run_as(attacker, plant)
    err = _start_refused(tmp_path, shm_name, str(tmp_path / "d.sock"))
    assert f"refusing shm dir {shm_name}: it is owned by uid {attacker.uid}" in err
    assert victim.read_text() == "precious"
    assert not (tmp_path / "d.sock").exists()


def test_daemon_refuses_a_symlinked_lock_and_foreign_segments(tmp_path, attacker, shm_name):
    os.mkdir(shm_name, 0o700)
    target = tmp_path / "target"
    target.write_text("x")
    os.symlink(str(target), os.path.join(shm_name, "daemon.lock"))
    err = _start_refused(tmp_path, shm_name, str(tmp_path / "d.sock"))
    assert "refusing lock file daemon.lock: it is a symlink" in err
    assert target.read_text() == "x"

    # A forged committed segment owned by somebody else is never adopted.
    os.unlink(os.path.join(shm_name, "daemon.lock"))
    segments = os.path.join(shm_name, "segments")
    os.mkdir(segments, 0o700)
    forged = os.path.join(segments, "seg-forged-000001")
    Path(forged).write_bytes(b"\0" * 8192)
    os.chown(forged, attacker.uid, attacker.gid)
    err = _start_refused(tmp_path, shm_name, str(tmp_path / "d.sock"))
    assert f"refusing segment {forged}: it is owned by uid {attacker.uid}" in err


def test_daemon_refuses_a_socket_dir_of_another_user(tmp_path, attacker, shm_name):
    sock_dir = Path(tempfile.mkdtemp(dir="/tmp"))
    try:
        os.chown(sock_dir, attacker.uid, attacker.gid)
        err = _start_refused(tmp_path, shm_name, str(sock_dir / "daemon.sock"))
        assert f"refusing socket dir {sock_dir}: it is owned by uid {attacker.uid}" in err
    finally:
        shutil.rmtree(sock_dir)


# ------------------------------------------------------------------ 2. socket squatting


def _squat(attacker, tmp_path: Path, sock_dir_owner: int) -> tuple[Path, int, int]:
    """A fake daemon as ``attacker``: records how many bytes a client sends it."""
    sock_dir = Path(tempfile.mkdtemp(dir="/tmp"))
    os.chmod(sock_dir, 0o755)
    os.chown(sock_dir, sock_dir_owner, -1)
    path = sock_dir / "daemon.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))  # as root, in a root directory; listen() runs as the attacker
    os.chmod(path, 0o777)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        os.setgroups([])
        os.setgid(attacker.gid)
        os.setuid(attacker.uid)
        server.listen(4)
        os.write(write, b"L")
        # Every connection is taken, not just the first: a client made in a process with
        # torch loaded also makes contact from a thread of its own (its spares, its plans).
        server.settimeout(60)
        got, accepted = b"", 0
        try:
            while True:
                conn, _ = server.accept()
                accepted += 1
                server.settimeout(3)  # after the first, until the client is done
                conn.settimeout(2)
                try:
                    while chunk := conn.recv(65536):
                        got += chunk
                except OSError:
                    pass
                conn.close()
        except OSError:
            pass
        os.write(write, str(len(got) if accepted else -1).encode())
        os._exit(0)
    os.close(write)
    assert os.read(read, 1) == b"L"
    server.close()
    return path, pid, read


def _received(pid: int, read: int) -> int:
    data = b""
    while chunk := os.read(read, 64):
        data += chunk
    os.waitpid(pid, 0)
    os.close(read)
    return int(data)


def test_client_refuses_a_daemon_run_by_another_user(tmp_path, attacker):
    path, pid, read = _squat(attacker, tmp_path, 0)
    try:
        with (
            ckptcache.Client(str(path), fallback="raise", timeout=5) as c,
            pytest.raises(DaemonUnavailable, match=f"runs as uid {attacker.uid}"),
        ):
            c.save({"w": torch.ones(4)}, str(tmp_path / "x.pt"))
        # Nothing was sent: the attacker's socket was closed without a byte of rpyc.
        assert _received(pid, read) == 0
    finally:
        shutil.rmtree(path.parent)


def test_configured_daemon_uid_is_accepted(tmp_path, attacker):
    path, pid, read = _squat(attacker, tmp_path, 0)
    try:
        client = ckptcache.Client(str(path), fallback="raise", timeout=3, daemon_uid=attacker.uid)
        with client, pytest.raises(DaemonUnavailable):  # the fake speaks no rpyc: times out
            client.list()
        assert _received(pid, read) > 0  # the check, not the fake, is what stopped the others
    finally:
        shutil.rmtree(path.parent)


def test_client_refuses_a_socket_dir_owned_by_another_user(tmp_path, attacker):
    path, pid, _ = _squat(attacker, tmp_path, attacker.uid)
    try:
        with (
            ckptcache.Client(str(path), fallback="raise", timeout=5) as c,
            pytest.raises(DaemonUnavailable, match=f"owned by uid {attacker.uid}"),
        ):
            c.list()
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    finally:
        shutil.rmtree(path.parent)


# ------------------------------------------------------------------ 3. persisted modes/owners


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 64, generator=g), "step": seed}


def _warm(d, path: Path, durability: str) -> None:
    """Warm the client code paths in this process before a child (another user) uses them:
    the child cannot read modules from root's interpreter directory."""
    with d.client() as c:
        c.save(_state(), str(path), durability=durability)
        c.load(str(path))


def _save_as(user, d, seed: int, path: Path, durability: str, umask: int) -> None:
    def save() -> None:
        with d.client(fallback="raise") as c:
            c.save(_state(seed), str(path), durability=durability)

    run_as(user, save, umask=umask)


def test_persisted_file_gets_the_savers_owner_and_mode(tmp_path):
    alice, bob = users(2)
    root = Path(tempfile.mkdtemp(dir="/tmp"))
    root.chmod(0o777)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"allowed_uids: [{alice.uid}, {bob.uid}]\npersist_roots: ['{root}']\n")
    try:
        with shared_daemon("--config", str(cfg), "--memory-limit", "256MiB") as d:
            target = root / "alice" / "run1" / "model.pt"
            _warm(d, root / "warm.pt", "persisted")
            _save_as(alice, d, 1, target, "persisted", umask=0o077)
            st = target.stat()
            assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (alice.uid, alice.gid, 0o600)
            for directory in (target.parent, target.parent.parent):
                dst = directory.stat()
                assert (dst.st_uid, stat.S_IMODE(dst.st_mode)) == (alice.uid, 0o700)
            assert_same(torch.load(target, weights_only=True), _state(1))

            # Root saving with umask 027 gets 0640, as torch.save would give.
            old = os.umask(0o027)
            try:
                with d.client() as c:
                    c.save(_state(2), str(root / "root.pt"), durability="persisted")
            finally:
                os.umask(old)
            assert stat.S_IMODE((root / "root.pt").stat().st_mode) == 0o640

            # Bob may not write into alice's 0700 directory through the root daemon.
            def save_as_bob() -> None:
                with d.client(fallback="raise") as c:
                    c.save(_state(3), str(target.parent / "bob.pt"), durability="persisted")

            with pytest.raises(ChildError) as e:
                run_as(bob, save_as_bob)
            assert e.value.type_name == "PersistError"
            assert f"uid {bob.uid} may not write under" in e.value.message
            assert not (target.parent / "bob.pt").exists()

            # A sticky, world-writable directory (shared scratch): bob may add files, never
            # replace alice's, as his own rename there would be refused.
            scratch = root / "scratch"
            scratch.mkdir(mode=0o1777)
            scratch.chmod(0o1777)
            shared = scratch / "model.pt"
            run_as(alice, lambda: torch.save(_state(4), shared))

            def replace_as_bob() -> None:
                with d.client(fallback="raise") as c:
                    c.save(_state(5), str(scratch / "bob.pt"), durability="persisted")
                    c.save(_state(6), str(shared), durability="persisted")

            with pytest.raises(ChildError) as e:
                run_as(bob, replace_as_bob)
            assert e.value.type_name == "PersistError"
            assert "its directory is sticky" in e.value.message
            assert (scratch / "bob.pt").stat().st_uid == bob.uid  # a new file is allowed
            assert shared.stat().st_uid == alice.uid
            assert_same(torch.load(shared, weights_only=True), _state(4))
    finally:
        shutil.rmtree(root)


def test_a_backup_copy_is_held_and_persisted_for_its_saver(tmp_path, etcd_server):
    """A backup node holds a user's copy as that user's (its segment is the user's) and
    persists it with the user's owner and mode, never as root: it used to write every copy
    it persisted as root with mode 0600, over files the user could not otherwise replace."""
    (alice,) = users(1)
    root = Path(tempfile.mkdtemp(dir="/tmp"))
    root.chmod(0o777)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"allowed_uids: [{alice.uid}]\npersist_roots: ['{root}']\n"
                   "secret: s3cret\nlease_ttl: 2\n")  # fmt: skip
    cluster = f"c{uuid.uuid4().hex[:8]}"
    common = ("--config", str(cfg), "--coordinator", etcd_server.url, "--cluster", cluster,
              "--listen", "127.0.0.1:0", "--backup", "auto", "--memory-limit", "256MiB")  # fmt: skip
    target = root / "alice" / "model.pt"
    try:
        with shared_daemon(*common, "--node-id", "node0", "--host", "h0") as a, \
                shared_daemon(*common, "--node-id", "node1", "--host", "h1") as b:  # fmt: skip
            wait_until(lambda: all(len(d.status().cluster_nodes) == 2 for d in (a, b)))
            _warm(a, root / "warm.pt", "backup")
            _save_as(alice, a, 8, target, "backup", umask=0o027)
            copy = b.info(target)
            assert copy.origin == "node0"
            assert os.stat(os.path.join(b.segments_dir, copy.segment)).st_uid == alice.uid
            wait_until(lambda: target.exists(), what="persisted")  # by either node
            st = target.stat()
            assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (alice.uid, 0o640)
            assert_same(torch.load(target, weights_only=True), _state(8))
    finally:
        shutil.rmtree(root)


def test_a_forged_group_in_a_users_segment_record_is_not_believed_after_a_restart():
    """The saver record lies in the user's own segment file: a gid the user is not a member
    of (written there before a daemon restart) falls back to the user's primary group."""
    import mmap

    from ckptcache.server.memory.arena import Segment
    from ckptcache.server.ownership import Saver, read_record, write_record

    (alice,) = users(1)
    mapping = mmap.mmap(-1, 4096)
    segment = Segment("seg-x", "/nonexistent/seg-x", 4096, mapping, owner=alice.uid)
    write_record(segment, Saver(alice.uid, alice.gid, 0o022))
    assert read_record(segment, 0) == Saver(alice.uid, alice.gid, 0o022)
    write_record(segment, Saver(alice.uid, 4, 0o022))  # adm: alice is not a member
    assert read_record(segment, 0) == Saver(alice.uid, alice.gid, 0o022)
    write_record(segment, Saver(0, 0, 0o022))  # root's record in alice's file: not believed
    assert read_record(segment, 0) == Saver(alice.uid, -1, 0o077)


# ------------------------------------------------------------------ 4. allowed_uids


def test_admitted_users_use_the_cache_and_see_only_their_own(tmp_path):
    alice, bob = users(2)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"allowed_uids: [{alice.uid}, {bob.uid}]\n")
    path = "/nonexistent-ckptcache/alice/model.pt"  # memory only: no storage involved
    with shared_daemon("--config", str(cfg), "--memory-limit", "256MiB") as d:
        with d.client() as c:  # warm the code paths (see above)
            c.save(_state(), "/nonexistent-ckptcache/warm.pt")
            assert_same(c.load("/nonexistent-ckptcache/warm.pt"), _state())
            c.list()
            c.delete("/nonexistent-ckptcache/warm.pt")

        def alice_saves_and_loads() -> list:
            with d.client(fallback="raise") as c:
                c.save(_state(5), path)
                got = c.load(path)
                assert_same(got, _state(5))
                return [o.path for o in c.list()]

        assert run_as(alice, alice_saves_and_loads) == [path]
        seg = d.info(path).segment
        seg_path = os.path.join(d.segments_dir, seg)
        st = os.stat(seg_path)
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (alice.uid, 0o600)

        def bob_tries() -> dict:
            out = {}
            with d.client(fallback="raise") as c:
                out["list"] = [o.path for o in c.list(all_namespaces=True)]
                for name, op in (("load", lambda: c.load(path)),
                                 ("delete", lambda: c.delete(path)),
                                 ("save", lambda: c.save(_state(6), path)),
                                 ("read", lambda: Path(seg_path).read_bytes())):  # fmt: skip
                    try:
                        op()
                        out[name] = "ok"
                    except Exception as e:
                        out[name] = type(e).__name__
                # Claims the daemon cannot check: "I wrote it through", "I found it corrupt".
                superseded = c._connection.call("supersede", m.SupersedeRequest(c.namespace, path),
                                     m.DeleteReply)  # fmt: skip
                out["supersede"] = superseded.dropped
                try:
                    c._connection.call(
                        "report_corrupt", m.ReportCorruptRequest(c.namespace, path, 1, "x")
                    )
                    out["report_corrupt"] = "ok"
                except Exception as e:
                    out["report_corrupt"] = type(e).__name__
            return out

        assert run_as(bob, bob_tries) == {
            "list": [],
            "load": "CheckpointNotFound",
            "delete": "CheckpointNotFound",
            "save": "PathNotAllowed",
            "read": "PermissionError",
            "supersede": 0,
            "report_corrupt": "CheckpointNotFound",
        }
        # Root sees everything, alice's object is intact.
        with d.client() as c:
            assert [o.path for o in c.list()] == [path]
            assert c.verify(path).ok
        assert run_as(alice, lambda: d.client().delete(path)) == 1


def test_root_trainer_never_loads_what_another_user_saved_under_its_path(tmp_path):
    (alice,) = users(1)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"allowed_uids: [{alice.uid}]\n")
    path = "/nonexistent-ckptcache/root-job/model.pt"
    with shared_daemon("--config", str(cfg), "--memory-limit", "256MiB") as d:
        with d.client() as c:
            c.save(_state(), "/nonexistent-ckptcache/warm.pt")
            c.delete("/nonexistent-ckptcache/warm.pt")
        run_as(alice, lambda: d.client(fallback="raise").save(_state(9), path))
        with d.client(fallback="raise") as c, pytest.raises(CheckpointNotFound):
            c.load(path)


# ------------------------------------------------------------------ 5. persist-root escape


def test_a_path_through_a_symlink_under_the_root_is_refused_at_save(daemon_factory, tmp_path):
    """The persist follows no link below its root, so a save whose path goes through one
    (even to a directory of the same root) could never be written: refused before a byte is
    copied, not accepted and then failed for good in the background."""
    root = tmp_path / "root"
    (root / "real").mkdir(parents=True)
    (root / "link").symlink_to(root / "real")
    d = daemon_factory("--persist-root", str(root), "--memory-limit", "256MiB")
    with d.client(fallback="raise") as c:
        with pytest.raises(PathNotAllowed, match="symlink"):
            c.save(_state(), str(root / "link" / "x.pt"))
        c.save(_state(), "/" + str(root / "real" / "x.pt"))  # '//' and '/' name one file
        c.wait(str(root / "real" / "x.pt"), timeout=60)
    assert_same(torch.load(root / "real" / "x.pt", weights_only=True), _state())


def test_symlink_swapped_in_under_the_root_between_save_and_persist(daemon_factory, tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    held = root / "run" / "sub"
    held.mkdir(parents=True)
    outside.mkdir()
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        f"persist_roots: ['{root}']\npersist_retries: 100\npersist_backoff: 0.1\n"
        "persist_backoff_max: 0.2\n"
    )
    d = daemon_factory("--config", str(cfg), "--memory-limit", "256MiB")
    target = held / "model.pt"
    # Hold the persist up: nothing can be created in an immutable directory, even by root.
    subprocess.run(["chattr", "+i", str(held)], check=True)
    try:
        with d.client(fallback="raise") as c:
            c.save(_state(), str(target))
            wait_until(lambda: d.info(target).persist_error)  # checked, then failed once
            (root / "run").rename(root / "run-old")  # the directory leaves ...
            (root / "run").symlink_to(outside)  # ... and a symlink out of the root comes in
            with pytest.raises(PersistError, match="is a symlink or not a directory"):
                c.wait(str(target), timeout=60)
            assert list(outside.rglob("*")) == []
            info = d.info(target)
            assert info.persist_state == "failed" and "PathNotAllowed" in info.persist_error
            assert_same(c.load(str(target)), _state())  # the memory copy is kept
    finally:
        subprocess.run(["chattr", "-i", str(root / "run-old" / "sub")], check=False)
        subprocess.run(["chattr", "-i", str(held)], check=False)


# ------------------------------------------------------------------ 8. the rpyc surface


def test_raw_rpyc_reaches_only_the_request_method(daemon):
    conn = rpyc.utils.factory.unix_connect(daemon.socket)
    try:
        root = conn.root
        for name in ("get_service_name", "get_service_aliases", "exposed_get_service_name",
                     "_core", "_session", "_hello", "on_connect", "__dict__"):  # fmt: skip
            with pytest.raises(AttributeError):
                getattr(root, name)
        assert dir(root) == ["exposed_request"]
        reply = json.loads(root.request("status", m.encode(m.StatusRequest())))
        assert reply["ok"]
        big = root.request("list", "x" * (m.MAX_REQUEST_BYTES + 1))
        assert json.loads(big)["error"]["type"] == "RequestTooLarge"
        # A frame far past the cap ends that connection before it is buffered ...
        with pytest.raises((EOFError, OSError)):
            root.request("list", "x" * (8 * m.MAX_REQUEST_BYTES))
    finally:
        try:
            conn.close()
        except Exception:
            pass
    # ... and the daemon serves everyone else as before.
    with daemon.client(fallback="raise") as c:
        assert c.daemon_status().objects == 0
        with pytest.raises(RequestTooLarge):
            c.list("x" * (2 * m.MAX_REQUEST_BYTES))


# ------------------------------------------------------------------ 9. refilled free segments

SECRET = 7.75  # exact in float32: its bytes are searched for in another user's segments

ROOT_SAVER = """
import sys, time, torch, ckptcache
MiB = 1 << 20
value = float(sys.argv[2])
state = {"experts": [torch.full((2 * MiB // 4,), value) for _ in range(8)], "step": 0}
with ckptcache.Client(sys.argv[1], fallback="raise") as c:
    for i in range(10_000):
        c.save(state, f"/secret/step-{i}/model.pt", durability="memory")
        if i >= 2:
            c.delete(f"/secret/step-{i - 2}/model.pt")
        print(i, flush=True)
        time.sleep(0.02)
"""


def test_a_freed_segment_never_takes_another_users_bytes(tmp_path):
    """Alice saves a checkpoint per step (the one two back deleted), so the daemon copies into
    each of her freed segments the newest save of the same layout; meanwhile root saves, over
    and over, a secret state of that very layout. None of Alice's segment files ever holds
    root's bytes, and every save of hers loads back equal to her state."""
    (alice,) = users(1)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"allowed_uids: [{alice.uid}]\n")
    with shared_daemon("--config", str(cfg), "--memory-limit", "512MiB",
                       "--memory-only", "allow") as d:  # fmt: skip
        _warm(d, Path("/warm/model.pt"), "memory")
        root = subprocess.Popen([sys.executable, "-c", ROOT_SAVER, d.socket, str(SECRET)],
                                stdout=subprocess.PIPE, text=True)  # fmt: skip
        try:
            assert root.stdout is not None and root.stdout.readline().startswith("0")

            def alice_saves() -> int:
                import ctypes
                import time

                # A process that dropped root is not dumpable, so its /proc/self/pagemap is
                # root's and the write watch cannot open: a user's own process is.
                ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE
                # A forked child cannot use the intra-op threads its parent started (OpenMP
                # hangs at its first parallel region): the experts' updates run on this one.
                torch.set_num_threads(1)

                g = torch.Generator().manual_seed(1)
                mib = 1 << 20
                state = {"experts": [torch.randn(2 * mib // 4, generator=g) for _ in range(8)],
                         "step": 0}  # fmt: skip
                with ckptcache.Client(d.socket, fallback="raise") as c:
                    for i in range(10):
                        for e in (i % 8, (i + 3) % 8):
                            state["experts"][e].add_(1.0)
                        state["step"] += 1
                        path = f"/alice/step-{i}/model.pt"
                        c.save(state, path, durability="memory")
                        loaded = c.load(path, mmap=False, verify=True)
                        assert loaded["step"] == state["step"]
                        for a, b in zip(loaded["experts"], state["experts"], strict=True):
                            assert torch.equal(a, b)
                        if i >= 2:
                            c.delete(f"/alice/step-{i - 2}/model.pt")
                        time.sleep(0.3)
                    return c._saves.unchanged.skipped

            kept = run_as(alice, alice_saves)
        finally:
            root.kill()
            root.wait()
        secret = torch.full((1024,), SECRET).numpy().tobytes()
        hers = Path(d.segments_dir) / f"u{alice.uid}"
        files = [p for p in hers.iterdir() if p.name.startswith("seg-")]
        assert files
        for path in files:
            assert secret not in path.read_bytes(), f"{path.name} holds root's bytes"
        assert kept > 0  # her freed segments were refilled (with her own saves) and reused
