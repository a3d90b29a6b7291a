"""A persist that starts before the digester has recorded a generation's digests does not
wait for that pass: it records the digests its own stream took, or, if the digester finished
meanwhile, checks them against the digester's before the file is synced or named."""

from __future__ import annotations

import os

import torch

from ckptcache.format.layout import DigestState
from ckptcache.format.manifest import compute_digests
from ckptcache.format.persisted import verify_stored
from ckptcache.wire.states import PersistState
from tests.helpers import wait_until
from tests.server.conftest import NS, save_object


def _core(make_core, tmp_path):
    root = str(tmp_path / "store")
    os.makedirs(root)
    core = make_core(persist_roots=(root,), persist_workers=1, pool_bytes=0)
    core.digester.stop()  # no background digests: every persist starts ahead of them
    return core, root


def _settled(core, path):
    gen = core.state.index.newest((NS, path))
    done = (PersistState.PERSISTED, PersistState.FAILED)
    return gen if gen is not None and gen.persist_state in done else None


def test_the_digests_the_persist_took_are_recorded_and_describe_the_file(make_core, tmp_path):
    core, root = _core(make_core, tmp_path)
    path = f"{root}/a.pt"
    value = torch.arange(300_000, dtype=torch.float32)
    save_object(core, core.saves.open_session(1, os.getuid()), path, value)
    gen = wait_until(lambda: _settled(core, path), what="the persist")

    assert gen.persist_state == PersistState.PERSISTED
    view = gen.segment.view()
    try:
        assert gen.digests == compute_digests(view, gen.manifest)  # the bytes' own digests
    finally:
        del view
    header = gen.segment.read_header()
    assert header.digest_state == DigestState.VALID and header.skeleton_digest != 0
    verify_stored(path)  # every record against the file's digest record, and its structure
    assert torch.equal(torch.load(path)["w"], value)


def test_a_tensor_changed_before_the_digester_hashed_it_is_never_persisted(make_core, tmp_path):
    """The stream hashed the tensor's bytes; then they changed, and the digester's pass (first
    to record) saw the changed bytes: the persist is refused before the file is named."""
    core, root = _core(make_core, tmp_path)
    path = f"{root}/b.pt"
    record = core.persister.record_digests

    def digester_first(gen, mine):
        storage = gen.manifest.storages[0]
        view = gen.segment.view()
        try:
            view[storage.offset] ^= 0xFF
        finally:
            del view
        core.digester.compute(gen)  # records the digests of the changed bytes
        return record(gen, mine)  # the stream's are not recorded: the digester's stand

    core.persister.record_digests = digester_first
    save_object(core, core.saves.open_session(1, os.getuid()), path, torch.ones(100_000))
    gen = wait_until(lambda: _settled(core, path), what="the persist")

    assert gen.persist_state == PersistState.FAILED
    assert "'w'" in gen.corrupt and "changed while it was persisted" in gen.corrupt
    assert os.listdir(root) == []  # neither the object nor a temporary file
