"""The daemon and the control-plane commands run without torch (start-up time and memory), and
an idle daemon holds only what was saved (the spare pool is sized from the saves)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from ckptcache.wire import messages as m
from tests.helpers import REPO, wait_until

MIB = 1 << 20

# Runs the CLI entry point in a fresh interpreter, then reports whether torch got imported.
_CLI_DRIVER = textwrap.dedent(
    """
    import json, sys
    from ckptcache.cli import main
    commands = json.loads(sys.argv[1])
    codes = [main(argv) for argv in commands]
    print(json.dumps({"codes": codes, "torch": "torch" in sys.modules}))
    """
)


def _fresh(code: str, *args: str) -> str:
    out = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout


def _torch_mapped(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch" in f.read()


def test_importing_the_daemon_does_not_import_torch():
    code = "import sys, ckptcache, ckptcache.server.daemon, ckptcache.cli; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    assert _fresh(code).strip() == "[]"


def test_lazy_package_keeps_its_public_names():
    code = "import sys, ckptcache; print('torch' in sys.modules, ckptcache.__version__, ckptcache.Client.__name__, ckptcache.ObjectStatus.__name__)"
    assert _fresh(code).split() == ["False", "0.1.0", "Client", "ObjectInfo"]
    # Submodules the eager package used to load are still reachable as attributes.
    code = "import ckptcache; print(ckptcache.api.default_client.__name__, ckptcache.wire.messages.PROTOCOL_VERSION)"
    assert _fresh(code).split() == ["default_client", str(m.PROTOCOL_VERSION)]
    import ckptcache
    import ckptcache.api

    assert [n for n in ckptcache.__all__ if not hasattr(ckptcache, n)] == []
    assert ckptcache.save is ckptcache.api.save and set(ckptcache.__all__) <= set(dir(ckptcache))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        ckptcache.nope  # noqa: B018


def test_cli_commands_and_daemon_run_without_torch(daemon_factory, tmp_path):
    root = tmp_path / "store"
    root.mkdir()
    d = daemon_factory("--memory-limit", "256MiB", "--persist-root", str(root))
    path = str(root / "iter_1" / "model.pt")
    with d.client() as c:
        c.save({"w": torch.arange(1000)}, path)
        c.wait(path)  # the daemon persisted it: still no torch
    sock = ["--socket", d.socket]
    commands = [["status", *sock], ["ls", *sock], ["inspect", path, "--verify", *sock],
                ["prefetch", path, *sock], ["rm", path, *sock]]  # fmt: skip
    report = json.loads(_fresh(_CLI_DRIVER, json.dumps(commands)).splitlines()[-1])
    assert report == {"codes": [0, 0, 0, 0, 0], "torch": False}
    assert d.proc is not None and not _torch_mapped(d.proc.pid)
    assert (root / "iter_1" / "model.pt").exists()
    assert d.status().objects == 0


def _rss(pid: int) -> int:
    """Resident bytes of process ``pid`` (shared memory it touched included)."""
    with open(f"/proc/{pid}/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib * 1024


def test_the_spare_pool_is_sized_from_the_saves_not_the_budget(daemon_factory, tmp_path):
    """A 2 GiB budget and the pool at its defaults (bounded by a quarter of the budget): after
    one tiny save the daemon holds that object and one spare of its size, a few pages each
    (not shares of the bound made at start, nor a MiB), and stays as small as an idle
    daemon."""
    d = daemon_factory("--memory-limit", "2GiB")
    with d.client(fallback="raise") as c:
        c.save({"w": torch.arange(256)}, str(tmp_path / "tiny.pt"))
        size = c.status(str(tmp_path / "tiny.pt")).size

        def settled() -> tuple[int, ...] | None:
            reply = c._connection.call("pool", m.PoolRequest(), m.PoolReply)
            return reply.capacities if len(reply.capacities) == 1 and not reply.growing else None

        (capacity,) = wait_until(settled, what="one spare")
        assert size < capacity <= 16 * 1024  # whole pages: the object, its header, its manifest
        assert d.segment_bytes() == 2 * capacity
        assert c.daemon_status().memory_used == 2 * capacity
    assert d.proc is not None and _rss(d.proc.pid) < 150 * MIB
