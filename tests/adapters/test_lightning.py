"""Lightning Trainer.fit with the CkptCacheIO plugin, killed after a checkpoint and resumed."""

from __future__ import annotations

import pytest
import torch

from tests.adapters.conftest import run_script
from tests.adapters.scripts._dist import tensors_of

pytest.importorskip("lightning")


def test_fit_killed_then_resumed_from_the_cache(daemon_factory, tmp_path):
    ck, out = tmp_path / "ck", tmp_path / "out"
    out.mkdir()
    d = daemon_factory("--persist-root", str(ck))
    run_script("lightning_trainer.py", "reference", str(tmp_path / "ref-ck"), str(out))
    run_script("lightning_trainer.py", "crash", str(ck), str(out), daemon=d, expect_kill=True)
    with d.client() as c:
        assert c.exists(ck / "epoch=0-step=3.ckpt")
    run_script("lightning_trainer.py", "resume", str(ck), str(out), daemon=d)
    ref, res = (tensors_of(torch.load(out / f"{m}.pt")) for m in ("reference", "resume"))
    assert ref.keys() == res.keys() and ref
    for k in ref:
        assert torch.equal(ref[k], res[k]), k
    with d.client() as c:
        c.wait(prefix=str(ck), timeout=120)
    # Cache off: Lightning's own format, readable by torch.load.
    final = torch.load(ck / "epoch=1-step=6.ckpt", weights_only=False)
    assert final["global_step"] == 6 and "state_dict" in final


def test_remove_checkpoint_drops_cache_and_file(daemon_factory, tmp_path, monkeypatch):
    from ckptcache.adapters.lightning import CkptCacheIO

    d = daemon_factory("--persist-root", str(tmp_path))
    io = CkptCacheIO(client=d.client())
    path = tmp_path / "a.ckpt"
    io.save_checkpoint({"w": torch.ones(3)}, path)
    assert torch.equal(io.load_checkpoint(path)["w"], torch.ones(3))
    io.remove_checkpoint(path)
    assert not path.exists() and not io.client.exists(path)
    with pytest.raises(FileNotFoundError):
        io.load_checkpoint(path)
