"""save/load through a real daemon: the object model, zero-copy CoW, map_location, status."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

import ckptcache
from ckptcache.errors import CheckpointNotFound, InvalidPath, SerializationError, UnsafeUnpickle
from tests.codec.test_flatten import DTYPES, Evil, sample
from tests.helpers import assert_same, wait_until


def state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 32, generator=g)
    return {
        "model": {"w": w, "wt": w.t(), "rows": w[8:16], "b": torch.randn(32, generator=g)},
        "dtypes": {str(d): sample(d) for d in DTYPES},
        "args": argparse.Namespace(lr=1e-3, iters=[1, 2]),
        "np": np.linspace(0, 1, 5),
        "iteration": 1000,
    }


def test_round_trip_whole_object_model(client, tmp_path):
    path = tmp_path / "iter_0001000" / "model_optim_rng.pt"
    obj = state()
    ckptcache.save(obj, path)
    out = ckptcache.load(path)
    assert_same(obj, out)
    assert out["model"]["wt"].stride() == (1, 32)
    shared = out["model"]["w"].untyped_storage().data_ptr()
    assert out["model"]["rows"].untyped_storage().data_ptr() == shared
    assert not path.exists()  # phase 1 only: nothing written to storage


def test_loaded_tensors_are_copy_on_write(client, tmp_path):
    path = tmp_path / "a.pt"
    ckptcache.save({"w": torch.zeros(1000)}, path)
    first = ckptcache.load(path)
    first["w"].add_(5)  # an optimizer step on loaded state
    again = ckptcache.load(path, verify=True)
    assert torch.equal(again["w"], torch.zeros(1000))
    assert torch.equal(first["w"], torch.full((1000,), 5.0))


def test_private_copy_and_map_locations(client, tmp_path):
    path = tmp_path / "b.pt"
    obj = {"w": torch.arange(10.0)}
    ckptcache.save(obj, path)
    for kwargs in ({"mmap": False}, {"map_location": "cpu"}, {"map_location": {"cpu": "cpu"}},
                   {"map_location": torch.device("cpu")},
                   {"map_location": lambda storage, loc: storage}):  # fmt: skip
        assert_same(obj, ckptcache.load(path, **kwargs))


@pytest.mark.parametrize("mmap", [None, False])
def test_a_map_location_is_applied_as_torch_load_applies_it(client, tmp_path, mmap):
    """From the cache as from the file: a map_location that leaves the CPU, a dict, or a
    callable is applied to every storage (never ignored), and one torch.load refuses is
    refused."""
    path = tmp_path / "m.pt"
    obj = {"w": torch.arange(10.0), "nested": [torch.ones(3)]}
    ckptcache.save(obj, path)
    torch.save(obj, tmp_path / "plain.pt")
    seen: list[str] = []

    def where(storage, location):
        seen.append(location)
        return storage

    for map_location in ("meta", torch.device("meta"), {"cpu": "meta"}):
        loaded = ckptcache.load(path, map_location, mmap=mmap)
        plain = torch.load(tmp_path / "plain.pt", map_location, weights_only=True)
        assert [t.device.type for t in (loaded["w"], loaded["nested"][0])] == ["meta", "meta"]
        assert [t.device.type for t in (plain["w"], plain["nested"][0])] == ["meta", "meta"]
        assert loaded["w"].shape == (10,) and loaded["nested"][0].shape == (3,)
    assert_same(obj, ckptcache.load(path, where, mmap=mmap))
    assert seen == ["cpu", "cpu"]  # once a storage
    with pytest.raises(RuntimeError, match="bogus"):
        ckptcache.load(path, "bogus", mmap=mmap)


def test_generations_and_newest_wins(client, tmp_path):
    path = str(tmp_path / "c.pt")
    for i in range(4):
        ckptcache.save({"i": torch.tensor(i)}, path)
    assert ckptcache.load(path)["i"].item() == 3
    st = ckptcache.status(path)
    assert (st.generation, st.generations, st.stages) == (4, 2, ("local",))
    assert ckptcache.exists(path)
    assert ckptcache.delete(path) == 2
    assert not ckptcache.exists(path)
    with pytest.raises(CheckpointNotFound) as err:
        ckptcache.load(path)
    assert isinstance(err.value, FileNotFoundError)


def test_relative_paths_name_the_absolute_file(client, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ckptcache.save({"x": torch.ones(1)}, "rel.pt")
    assert ckptcache.status(tmp_path / "rel.pt").path == str(tmp_path / "rel.pt")


def test_bad_input_gets_typed_errors(client, tmp_path):
    with pytest.raises(InvalidPath, match=r"str or os\.PathLike"):
        ckptcache.save({}, 42)
    with pytest.raises(InvalidPath):
        ckptcache.load(None)
    with pytest.raises(SerializationError):
        ckptcache.save({"f": lambda: 1}, tmp_path / "x.pt")
    with pytest.raises(ValueError, match="durability"):
        ckptcache.save({}, tmp_path / "x.pt", durability="eventually")
    with pytest.raises(CheckpointNotFound, match="neither in the cache nor in storage"):
        ckptcache.load(tmp_path / "never-saved.pt")
    assert not (tmp_path / "x.pt").exists()


def test_weights_only_refuses_malicious_skeleton(client, tmp_path):
    path = tmp_path / "evil.pt"
    ckptcache.save({"payload": Evil()}, path)
    with pytest.raises(UnsafeUnpickle, match="weights_only=False"):
        ckptcache.load(path)


def test_namespaces_do_not_collide(daemon, tmp_path):
    path = str(tmp_path / "shared-name.pt")
    with daemon.client(namespace="job-a") as a, daemon.client(namespace="job-b") as b:
        a.save({"who": torch.tensor(1)}, path)
        b.save({"who": torch.tensor(2)}, path)
        assert a.load(path)["who"].item() == 1
        assert b.load(path)["who"].item() == 2
        assert [o.namespace for o in a.list(all_namespaces=True)] == ["job-a", "job-b"]


def test_repeated_saves_reuse_segments(daemon, tmp_path):
    path = str(tmp_path / "d.pt")
    with daemon.client() as c:
        for i in range(6):
            c.save({"w": torch.full((1 << 18,), float(i))}, path)
            # The digester pins each new generation while it hashes it: a retired one it still
            # holds is freed only then, and a save meanwhile would need another segment.
            wait_until(lambda: c.daemon_status().pinned == 0, what="the digester's pin dropped")
        st = c.daemon_status()
    # keep=2 plus the one being written: reused, never grown (spares stand ready besides; the
    # freed third one may be a spare itself now, the pool's for saves of its size)
    assert st.segments - st.spare_segments in (2, 3)
    assert st.segments <= 3 + 2  # the default pool keeps at most two spares
    assert st.generations == 2


def test_malformed_requests_get_typed_errors(daemon):
    import json

    from ckptcache.errors import ProtocolMismatch
    from ckptcache.wire import messages as m

    with daemon.client() as c:
        c.daemon_status()  # connect
        root = c._connection.rpc.root
        for kind, body, expected in [
            ("reserve", "{not json", "ProtocolMismatch"),
            ("reserve", json.dumps({"namespace": "n", "path": "/p", "nbytes": 1, "x": 1}),
             "ProtocolMismatch"),
            ("teleport", "{}", "ProtocolMismatch"),
            ("reserve", json.dumps({"namespace": "n", "path": "", "nbytes": 10}), "InvalidPath"),
            ("reserve", json.dumps({"namespace": "n", "path": "/p", "nbytes": -5}), "InvalidPath"),
            ("reserve", json.dumps({"namespace": "n", "path": "/p", "nbytes": 1 << 50}),
             "ObjectTooLarge"),
            ("commit", json.dumps({"reservation": 999, "manifest_offset": 0, "manifest_size": 0}),
             "CkptCacheError"),
        ]:  # fmt: skip
            reply = json.loads(root.request(kind, body))
            assert reply["ok"] is False and reply["error"]["type"] == expected, (kind, reply)
        with pytest.raises(ProtocolMismatch, match="protocol"):
            c._connection.request(
                "hello", m.HelloRequest(m.PROTOCOL_VERSION + 1, 0, "x"), m.HelloReply
            )
        assert c.daemon_status().objects == 0  # the daemon is unharmed


def test_commit_with_a_bad_manifest_is_refused_and_nothing_is_published(daemon, tmp_path):
    from ckptcache.codec.flatten import flatten
    from ckptcache.codec.objectio import plan_object, write_object
    from ckptcache.errors import CorruptCheckpoint
    from ckptcache.wire import messages as m

    path = str(tmp_path / "bad.pt")
    with daemon.client() as c:
        plan = plan_object(flatten({"w": torch.ones(4)}), path, c.namespace)
        for manifest in (b'{"format": 1, "path": "elsewhere"}', b"\xff\xfe not json"):
            reply = c._connection.call("reserve", m.ReserveRequest(c.namespace, path, plan.layout.nbytes),
                            m.ReserveReply)  # fmt: skip
            mapping = c._saves.mapping(reply.segment, reply.capacity)
            write_object(mapping, plan, flatten({"w": torch.ones(4)}))
            off = plan.layout.manifest_offset
            mapping[off : off + len(manifest)] = manifest
            with pytest.raises(CorruptCheckpoint, match="manifest"):
                c._connection.call("commit", m.CommitRequest(reply.reservation, off, len(manifest)),
                        m.CommitReply)  # fmt: skip
        assert not c.exists(path)
        st = c.daemon_status()
        assert st.generations == 0 and st.free_segments == st.segments  # segments reclaimed


def test_parallel_copy_of_many_storages_round_trips_and_persists(daemon_factory, tmp_path):
    """A state dict large enough for the save's copy to be cut across threads (storages of
    uneven sizes, views, shared storage): the cache and the persisted file, read with
    torch.load, both give back the same tensors, and the daemon's digests check."""
    root = tmp_path / "ckpt"
    root.mkdir()
    d = daemon_factory("--memory-limit", "256MiB", "--persist-root", str(root))
    g = torch.Generator().manual_seed(3)
    big = torch.randn(3 << 20, generator=g)  # 12 MiB
    obj = {
        "layers": [torch.randn(n, generator=g) for n in (1, 1000, 1 << 20, 77, 3 << 18)],
        "big": big,
        "view": big[5:1005],
        "moments": {"exp_avg": torch.randn(2 << 20, generator=g), "step": torch.tensor(9.0)},
        "dtypes": {str(dt): sample(dt) for dt in DTYPES},
    }
    path = root / "iter_0000007" / "model.pt"
    with d.client() as c:
        c.save(obj, path)
        out = c.load(path, verify=True)
        assert c.verify(path).ok
        c.wait(path)
    assert_same(obj, out)
    assert_same(obj, torch.load(path))
