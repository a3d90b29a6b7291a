"""Small objects cost the budget about their size, not a MiB each: a DCP or Megatron rank
writes many small files (``.metadata``, ``common.pt``, per-rank shards)."""

from __future__ import annotations

import torch

from tests.helpers import assert_same

MIB = 1 << 20


def test_a_thousand_saves_of_4_kib_hold_under_16_mib(daemon_factory, tmp_path):
    d = daemon_factory("--memory-limit", "2GiB")
    with d.client(fallback="raise") as c:
        for i in range(1000):
            c.save({"w": torch.full((1024,), float(i))}, str(tmp_path / f"{i}.pt"))
        st = c.daemon_status()
        assert st.objects == 1000 and st.reservations == 0
        assert st.memory_stored >= 1000 * 4096
        assert st.memory_used < 16 * MIB, st  # was 1,000 MiB: a MiB per object
        assert d.segment_bytes() < 16 * MIB
        for i in (0, 517, 999):
            assert_same(c.load(str(tmp_path / f"{i}.pt")), {"w": torch.full((1024,), float(i))})
        # A larger object after them still gets (and reuses) whole MiBs.
        c.save({"w": torch.ones(3 * MIB // 4)}, str(tmp_path / "big.pt"))
        assert c.status(str(tmp_path / "big.pt")).size > 3 * MIB
        assert c.daemon_status().memory_used < 16 * MIB + 4 * MIB
