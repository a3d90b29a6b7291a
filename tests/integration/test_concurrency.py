"""Two writers of one path: one generation wins whole, never a mix."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch

from ckptcache.format.digest import digest_bytes

WRITER = textwrap.dedent(
    """
    import sys, torch, ckptcache
    fill = float(sys.argv[2])
    for i in range(15):
        ckptcache.save({"a": torch.full((1 << 20,), fill), "b": torch.full((1 << 19,), fill)}, sys.argv[1])
    """
)


def test_concurrent_writers_never_mix(daemon, tmp_path):
    path = str(tmp_path / "same.pt")
    env = {**os.environ, "CKPTCACHE_SOCKET": daemon.socket}
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER, path, str(v)], env=env) for v in (1, 2)
    ]
    seen = set()
    with daemon.client() as c:
        while any(p.poll() is None for p in procs):
            if c.exists(path):
                out = c.load(path, mmap=False)
                values = {out["a"][0].item(), out["a"][-1].item(), out["b"][-1].item()}
                assert len(values) == 1, values  # every tensor from the same writer
                seen |= values
        assert [p.wait() for p in procs] == [0, 0]
        final = c.load(path, verify=True)
        fill = final["a"][0].item()
        expected = torch.full((1 << 20,), fill)
        assert digest_bytes(final["a"].numpy().tobytes()) == digest_bytes(
            expected.numpy().tobytes()
        )
        assert c.status(path).generation == 30
    assert seen <= {1.0, 2.0}
