"""The ckptcache command: tables, --json, exit codes, bad configuration."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request

import torch

from tests.helpers import run_on_terminal, wait_until


def cli(daemon, *args):
    env = {**os.environ, "CKPTCACHE_SOCKET": daemon.socket}
    return subprocess.run([sys.executable, "-m", "ckptcache.cli", *args], env=env,
                          capture_output=True, text=True)  # fmt: skip


def test_ls_status_inspect_rm(daemon, tmp_path):
    path = str(tmp_path / "iter_1" / "model.pt")
    with daemon.client() as c:
        c.save({"w": torch.zeros(1 << 18)}, path)
    out = cli(daemon, "ls")
    assert out.returncode == 0 and path in out.stdout and "1.0 MiB" in out.stdout
    listed = json.loads(cli(daemon, "ls", str(tmp_path), "--json").stdout)
    assert [o["path"] for o in listed] == [path]
    assert json.loads(cli(daemon, "ls", "/elsewhere", "--json").stdout) == []
    status = json.loads(cli(daemon, "status", "--json").stdout)
    assert status["daemon"]["objects"] == 1 and status["daemon"]["memory_limit"] == 1 << 30
    assert "memory" in cli(daemon, "status").stdout
    inspect = json.loads(cli(daemon, "inspect", path, "--verify", "--json").stdout)
    assert inspect["verify"]["ok"] is True and inspect["object"]["generation"] == 1
    assert cli(daemon, "rm", path).stdout.startswith("dropped 1 generation")
    missing = cli(daemon, "inspect", path)
    assert missing.returncode == 1 and "neither cached" in missing.stderr


def test_daemon_refuses_bad_config(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("memory_limit: plenty\n")
    out = subprocess.run([sys.executable, "-m", "ckptcache.cli", "daemon", "--config", str(cfg)],
                         capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 2 and "invalid 'memory_limit'" in out.stderr


def test_second_daemon_on_same_shm_dir_is_refused(daemon, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "ckptcache.cli", "daemon", "--shm-dir", daemon.shm_dir,
         "--socket", str(tmp_path / "other.sock")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2 and "another daemon already uses" in out.stderr


def test_metrics_endpoint(daemon_factory, tmp_path):
    d = daemon_factory("--metrics-port", "0", "--memory-limit", "256MiB")
    wait_until(lambda: "metrics=:" in d.log(), 30, "the daemon's ready line")
    port = int(d.log().split("metrics=:")[1].split()[0])
    with d.client() as c:
        c.save({"w": torch.zeros(1000)}, str(tmp_path / "a.pt"))
        c.load(str(tmp_path / "a.pt"))
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    assert float(samples["ckptcache_saves_total"]) == 1
    assert float(samples['ckptcache_loads_total{tier="local"}']) == 1
    assert float(samples["ckptcache_memory_limit_bytes"]) == 256 << 20
    assert float(samples["ckptcache_save_stall_seconds_count"]) == 1


def test_a_reader_that_goes_away_is_no_error(daemon, tmp_path):
    """``ckptcache inspect ... | head``: the reader closes the pipe before the command
    writes; the command stops quietly (141, as SIGPIPE would) with no traceback."""
    path = str(tmp_path / "a.pt")
    with daemon.client() as c:
        c.save({"w": torch.zeros(8)}, path)
    for args in (("inspect", path), ("ls",), ("status",), ("ls", "--json")):
        env = {**os.environ, "CKPTCACHE_SOCKET": daemon.socket}
        proc = subprocess.Popen([sys.executable, "-m", "ckptcache.cli", *args], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()  # gone before the first byte
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=60) == 141, err
        assert err == "", err


def _json_error(out: subprocess.CompletedProcess[str]) -> dict[str, object]:
    body = json.loads(out.stdout)["error"]
    assert body["exit_code"] == out.returncode != 0 and out.stderr == ""
    return body  # type: ignore[no-any-return]


def test_json_errors_are_json_with_a_non_zero_exit(daemon, tmp_path):
    missing = _json_error(cli(daemon, "inspect", str(tmp_path / "missing.pt"), "--json"))
    assert missing["type"] == "CheckpointNotFound" and "missing.pt" in str(missing["message"])
    assert _json_error(cli(daemon, "rm", "a/../b.pt", "--json"))["type"] == "PathNotAllowed"
    assert _json_error(cli(daemon, "prefetch", "--json", str(tmp_path / "none.pt")))["type"] == (
        "CheckpointNotFound"
    )
    usage = _json_error(cli(daemon, "inspect", "--json"))
    assert usage["type"] == "UsageError" and usage["exit_code"] == 2
    assert "required: path" in str(usage["message"])
    bad = _json_error(cli(daemon, "bench", "--sizes", "lots", "--json"))
    assert bad["type"] == "ConfigError" and bad["exit_code"] == 2
    env = {**os.environ, "CKPTCACHE_SOCKET": str(tmp_path / "nobody.sock")}
    gone = subprocess.run([sys.executable, "-m", "ckptcache.cli", "status", "--json"], env=env,
                          capture_output=True, text=True)  # fmt: skip
    assert _json_error(gone)["type"] == "DaemonUnavailable"
    # Without --json: one line on stderr, nothing on stdout, the same exit codes.
    plain = cli(daemon, "inspect", str(tmp_path / "missing.pt"))
    assert plain.returncode == 1 and plain.stdout == ""
    assert plain.stderr.startswith("ckptcache: ") and plain.stderr.count("\n") == 1


def test_ls_resolves_a_relative_prefix_like_inspect_and_rm(daemon, tmp_path):
    a, b = tmp_path / "run" / "a.pt", tmp_path / "run2" / "b.pt"
    with daemon.client() as c:
        for p in (a, b):
            c.save({"w": torch.zeros(4)}, p)
    env = {**os.environ, "CKPTCACHE_SOCKET": daemon.socket}

    def ls(*args: str) -> list[str]:
        out = subprocess.run([sys.executable, "-m", "ckptcache.cli", "ls", *args, "--json"],
                             env=env, cwd=tmp_path, capture_output=True, text=True)  # fmt: skip
        assert out.returncode == 0, out.stderr
        return [o["path"] for o in json.loads(out.stdout)]

    assert ls("run") == [str(a), str(b)]  # a prefix of names, as for an absolute one
    assert ls("run/") == [str(a)]  # the trailing slash keeps to the directory
    assert ls("./run2") == [str(b)]
    assert ls(str(tmp_path / "run") + "/") == [str(a)]
    assert "no cached checkpoints under" in subprocess.run(
        [sys.executable, "-m", "ckptcache.cli", "ls", "nothing"], env=env, cwd=tmp_path,
        capture_output=True, text=True,
    ).stdout  # fmt: skip
    rm = subprocess.run([sys.executable, "-m", "ckptcache.cli", "rm", "run/a.pt"], env=env,
                        cwd=tmp_path, capture_output=True, text=True)  # fmt: skip
    assert rm.stdout.strip() == f"dropped 1 generation(s) of {a}"


def test_inspect_of_a_stored_only_checkpoint_shows_what_storage_holds(daemon_factory, tmp_path):
    root = tmp_path / "store"
    root.mkdir()
    d = daemon_factory("--memory-limit", "256MiB", "--persist-root", str(root))
    path = str(root / "iter_1" / "model.pt")
    with d.client() as c:
        c.save({"w": torch.arange(1000.0)}, path)
        c.wait(path)
        c.delete(path)  # storage only from here on
    text = cli(d, "inspect", path)
    assert text.returncode == 0, text.stderr
    assert "on storage only" in text.stdout and "digest record  yes" in text.stdout
    for untrue in ("generation", "saved here", "pending", "segment"):
        assert untrue not in text.stdout
    data = json.loads(cli(d, "inspect", path, "--verify", "--json").stdout)
    assert "object" not in data and data["storage_verify"] == ""
    stored = data["stored"]
    assert stored["path"] == path and stored["size"] == os.path.getsize(path)
    assert stored["digest_record"] is True and stored["modified"] == os.path.getmtime(path)
    # A plain torch.save file: storage only, no digest record.
    plain_file = root / "plain.pt"
    torch.save({"w": torch.ones(3)}, plain_file)
    assert "digest record  no" in cli(d, "inspect", str(plain_file)).stdout
    # Cached and persisted: where it is, then the cached generation's facts.
    with d.client() as c:
        c.save({"w": torch.arange(10.0)}, path)
        c.wait(path)
    cached = cli(d, "inspect", path).stdout
    assert "in this node's memory and on storage" in cached and "\ngeneration " in cached


def test_help_shows_no_markup():
    for command in ("", "daemon", "ls", "status", "inspect", "rm", "prefetch", "bench", "demo"):
        out = subprocess.run([sys.executable, "-m", "ckptcache.cli", *command.split(), "--help"],
                             capture_output=True, text=True)  # fmt: skip
        assert out.returncode == 0 and "usage: ckptcache" in out.stdout
        assert "``" not in out.stdout and ":func:" not in out.stdout, (command, out.stdout)


def test_daemon_logs_no_line_per_connection_at_info(daemon, tmp_path):
    with daemon.client() as c:
        c.save({"w": torch.zeros(4)}, tmp_path / "a.pt")
    for _ in range(3):
        assert cli(daemon, "ls").returncode == 0
    log = daemon.log()
    assert "ckptcache daemon ready" in log  # INFO is on
    per_connection = [line for line in log.splitlines() if "ckptcache.rpc" in line]
    assert per_connection == [], per_connection


def test_daemon_logs_no_line_per_persist_at_info(daemon_factory, tmp_path):
    """The quick start's daemon logs into the user's terminal: each persist (one a save) was
    an INFO line, 600 lines for 600 saves, and so was each eviction of a persisted generation
    once the budget was full. Both are at DEBUG: INFO names no saved path."""
    root = tmp_path / "store"
    root.mkdir()
    for level in ("INFO", "DEBUG"):
        # 12 saves of 6 MiB persisted under a 48 MiB budget: the later ones evict earlier ones
        # (each holds other bytes: equal ones would share memory, and fit).
        d = daemon_factory("--memory-limit", "48MiB", "--pool-bytes", "0",
                           "--persist-root", str(root), "--log-level", level)  # fmt: skip
        paths = [str(root / level / f"iter_{i}" / "model.pt") for i in range(12)]
        with d.client() as c:
            for i, p in enumerate(paths):
                c.save({"w": torch.full((6 << 18,), float(i))}, p)
                c.wait(p)  # persisted, so evictable
        if level == "DEBUG":  # a persist's line may follow the answer to its wait
            wait_until(lambda: all(f"persisted {p} generation" in d.log() for p in paths))  # noqa: B023
        lines = d.log().splitlines()
        assert any("ckptcache daemon ready" in line for line in lines)  # INFO is on
        info = [line for line in lines if " INFO " in line and any(p in line for p in paths)]
        assert info == [], info
        persisted = {p for p in paths for line in lines if f"persisted {p} generation" in line}
        evicted = [line for line in lines if " DEBUG " in line and "evicting " in line]
        if level == "DEBUG":  # each persist and each eviction is there, at DEBUG
            assert persisted == set(paths) and evicted
        else:
            assert persisted == set() and evicted == []


def test_restart_over_empty_leftover_segments_logs_no_error(daemon_factory):
    """A daemon stopped between creating a segment file and allocating or writing it leaves
    an empty file, or one of zeros: the next start removes them and says so, as INFO."""
    d = daemon_factory("--memory-limit", "64MiB")
    d.kill(signal.SIGTERM)
    segs = d.segments_dir
    empty = os.path.join(segs, "seg-0abc-000001")
    zeros = os.path.join(segs, "seg-0abc-000002")
    for name, size in ((empty, 0), (zeros, 1 << 20)):
        fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        os.ftruncate(fd, size)
        os.close(fd)
    d.start()
    log = d.log()
    assert " ERROR " not in log, log
    assert "removing empty segment seg-0abc-000001 left by an allocation cut short" in log
    assert "reclaiming segment seg-0abc-000002: allocated but never written" in log
    assert not os.path.exists(empty) and not os.path.exists(zeros)


def test_demo_persists_the_save_of_a_trainer_killed_after_it():
    """The main job's demo: the daemon persists (phase 2 runs after the trainer's SIGKILL),
    the reload is bit-identical, and the table holds the copy limit."""
    out = subprocess.run([sys.executable, "-m", "ckptcache.cli", "demo", "--size-mib", "16"],
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "persisting under" in out.stdout
    assert re.search(r"persisted: \S+model_optim_rng\.pt \(16 MiB, a plain torch\.save file\)",
                     out.stdout), out.stdout  # fmt: skip
    assert "reloaded state is bit-identical: True" in out.stdout
    # The limit row is the save's own copy engine, named as it ran (tests/cli/test_copy_limit.py).
    assert "| copy limit (the save's own copy: " in out.stdout
    assert "memcpy (physical limit)" not in out.stdout


COMMANDS = {"daemon": [], "ls": [], "status": [], "inspect": ["a.pt"], "rm": ["a.pt"],
            "prefetch": ["a.pt"], "bench": [], "demo": []}  # fmt: skip


def ckptcache_cmd(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """The real command, its help unwrapped (``COLUMNS``: one line per entry)."""
    return subprocess.run([sys.executable, "-m", "ckptcache.cli", *args], capture_output=True,
                          text=True, env={**os.environ, "COLUMNS": "1000", **env})  # fmt: skip


def test_an_unknown_argument_of_a_command_is_reported_with_that_commands_usage():
    """``ckptcache ls --bogus`` used to print the usage of ``ckptcache`` (the list of
    commands), not of ``ls``."""
    for command, required in COMMANDS.items():
        out = ckptcache_cmd(command, *required, "--bogus")
        assert out.returncode == 2 and out.stdout == "", (command, out.stderr)
        assert out.stderr.startswith(f"usage: ckptcache {command} "), (command, out.stderr)
        assert f"ckptcache {command}: error: unrecognized arguments: --bogus" in out.stderr
        if command in ("daemon", "demo"):  # no --json of their own
            continue
        as_json = json.loads(ckptcache_cmd(command, *required, "--json", "--bogus").stdout)
        assert as_json["error"]["message"] == (
            f"ckptcache {command}: unrecognized arguments: --bogus"
        )
    top = ckptcache_cmd("--bogus", "ls")  # before the command: the top level's to report
    assert top.returncode == 2 and top.stderr.startswith("usage: ckptcache [-h] {daemon,")


def _entries(help_text: str) -> dict[str, str]:
    """The arguments an argparse help lists, each with its help text ('' for none)."""
    entries: dict[str, str] = {}
    last = ""
    for line in help_text.splitlines():
        match = re.match(r"^  (\S.*?)(?:\s{2,}(\S.*))?$", line)
        if match:
            last = match.group(1)
            entries[last] = match.group(2) or ""
        elif last and line.startswith("   ") and not entries[last]:
            entries[last] = line.strip()  # a long name's help starts on the next line
        else:
            last = ""
    return entries


def test_every_argument_of_every_command_has_help():
    """``ls --help`` listed ``prefix`` and ``--all-namespaces`` with no text."""
    for command in COMMANDS:
        out = ckptcache_cmd(command, "--help")
        assert out.returncode == 0
        entries = _entries(out.stdout)
        assert entries and all(entries.values()), (command, entries)
    ls = _entries(ckptcache_cmd("ls", "--help").stdout)
    assert "relative to the working directory" in ls["prefix"]
    assert "--namespace" in ls["--all-namespaces"]


def test_socket_help_names_every_socket_the_command_tries():
    """A command without ``--socket`` tries ``$CKPTCACHE_SOCKET``, else its user's daemon,
    else root's (``ckptcache._defaults.candidate_sockets``): its help says so, not only
    "default: $CKPTCACHE_SOCKET"."""
    from ckptcache._defaults import ROOT_SOCKET

    for command in ("ls", "status", "inspect", "rm", "prefetch", "bench"):
        text = _entries(ckptcache_cmd(command, "--help").stdout)["--socket SOCKET"]
        assert "$CKPTCACHE_SOCKET" in text and ROOT_SOCKET in text, text
        assert "$XDG_RUNTIME_DIR/ckptcache/daemon.sock" in text, text
        assert "/tmp/ckptcache-UID/daemon.sock" in text and "the first that exists" in text
    # What the help says is where the client looks, for this user.
    env = {k: v for k, v in os.environ.items() if k != "CKPTCACHE_SOCKET"}
    env["XDG_RUNTIME_DIR"] = "/run/user/4242"
    code = "from ckptcache._defaults import candidate_sockets as c; print(*c())"
    looked = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, check=True).stdout.split()  # fmt: skip
    user = ["/run/user/4242/ckptcache/daemon.sock"] if os.geteuid() != 0 else []
    assert looked == [*user, ROOT_SOCKET]


def test_bench_checks_its_arguments_before_importing_torch(tmp_path):
    """A typo in ``--sizes`` is reported before torch is imported (seconds): here a torch
    that cannot be imported stands in for the real one, and the error is the typo's."""
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('torch imported before the check')\n")
    for args in (["--sizes", "lots"], ["--sizes", "1MiB", "--repeats", "0"]):
        out = ckptcache_cmd("bench", *args, PYTHONPATH=str(tmp_path))
        assert out.returncode == 2, out.stderr
        assert "torch imported" not in out.stderr and out.stderr.startswith("ckptcache: --")
    assert ckptcache_cmd("bench", "--sizes", "lots", PYTHONPATH=str(tmp_path)).stderr == (
        "ckptcache: --sizes: not a size: 'lots' (use a number with an optional unit: 4GiB, 512M)\n"
    )


def test_prefetch_draws_its_bar_on_a_terminal_and_lists_the_tiers_in_a_pipe(daemon, tmp_path):
    paths = [str(tmp_path / f"{i}.pt") for i in range(2)]
    with daemon.client() as c:
        for p in paths:
            c.save({"w": torch.zeros(4)}, p)
    cmd = [sys.executable, "-m", "ckptcache.cli", "prefetch", *paths, "--socket", daemon.socket]
    piped = subprocess.run(cmd, capture_output=True, text=True)
    assert piped.returncode == 0 and "\r" not in piped.stdout and "[#" not in piped.stdout
    assert piped.stdout.splitlines() == ["PATH" + " " * (len(paths[0]) - 2) + "TIER",
                                         *(f"{p}  local" for p in paths)]  # fmt: skip
    code, terminal, _ = run_on_terminal(cmd, "stdout")
    assert code == 0 and f"\r[{'#' * 30}] 2/2 local   {paths[1]}" in terminal
