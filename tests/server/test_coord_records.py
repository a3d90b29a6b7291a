"""Coordinator keys and records: the key strings and JSON fields daemons of every version
share (pinned here: a change is a protocol change), records read back as written, and a
malformed value read from the coordinator is a typed error or a skipped key, never a
``KeyError`` inside an election."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from ckptcache.errors import CkptCacheError
from ckptcache.format.manifest import object_digest
from ckptcache.server.cluster.coord import EmbeddedCoordinator, NodeInfo, keys
from ckptcache.server.cluster.coord.records import (
    HolderRecord,
    InFlightRecord,
    LatestRecord,
    LoaderRecord,
    MalformedRecord,
    PersistedRecord,
    RepRecord,
    WriterRecord,
    parse_all,
    parse_one,
)
from ckptcache.server.cluster.membership import path_hash
from ckptcache.wire.states import PersistState
from tests.helpers import wait_until
from tests.server.conftest import NS, save_object

PH, DIGEST = "ab12", "cd34"

# --- keys -----------------------------------------------------------------------------------


def test_every_key_is_the_string_daemons_have_always_used():
    assert keys.node_key("n1") == "nodes/n1"
    assert keys.holders_prefix(PH) == "holders/ab12/"
    assert keys.group_prefix(PH, DIGEST) == "holders/ab12/cd34/"
    assert keys.holder_key(PH, DIGEST, "n1") == "holders/ab12/cd34/n1"
    assert keys.inflight_key(PH, "n1") == "holders/ab12/inflight/n1"
    assert keys.writer_key(PH) == "writer/ab12"
    assert keys.load_key(PH) == "loads/ab12"
    assert keys.rep_key(PH, DIGEST) == "reps/ab12/cd34"
    assert keys.persisted_prefix(PH) == "persisted/ab12/"
    assert keys.persisted_key(PH, DIGEST) == "persisted/ab12/cd34"
    assert keys.latest_key(PH) == "latest/ab12"


def test_prefixes_cover_their_keys_and_digest_of_reads_the_slot():
    assert keys.holder_key(PH, DIGEST, "n").startswith(keys.group_prefix(PH, DIGEST))
    assert keys.inflight_key(PH, "n").startswith(keys.holders_prefix(PH))
    assert not keys.inflight_key(PH, "n").startswith(keys.group_prefix(PH, DIGEST))
    assert keys.persisted_key(PH, DIGEST).startswith(keys.persisted_prefix(PH))
    assert keys.node_key("n").startswith(keys.NODES)
    assert keys.digest_of(keys.holder_key(PH, DIGEST, "n")) == DIGEST
    assert keys.digest_of(keys.persisted_key(PH, DIGEST)) == DIGEST
    assert keys.digest_of(keys.inflight_key(PH, "n")) == keys.INFLIGHT
    assert keys.digest_of(keys.writer_key(PH)) == ""


# --- records --------------------------------------------------------------------------------

#: A save stamp in ns: more bits than a float keeps, so it must come back exact.
STAMP = 1_765_000_000_123_456_789

WIRE = [  # (record, the JSON object every version writes for it)
    (HolderRecord("n1", "/p", 3, 12.5, "n0", STAMP, STAMP - 7),
     {"node": "n1", "path": "/p", "generation": 3, "committed": 12.5, "origin": "n0",
      "committed_ns": STAMP, "seen": STAMP - 7}),
    (InFlightRecord("n1", 7.0), {"node": "n1", "committed": 7.0}),
    (RepRecord("n1", 8.0), {"node": "n1", "since": 8.0}),
    (WriterRecord("n1", DIGEST), {"node": "n1", "digest": DIGEST}),
    (LoaderRecord("n1"), {"node": "n1"}),
    (PersistedRecord("n1", "/p.conflict-cd34", 9.0, 4.0, STAMP),
     {"node": "n1", "path": "/p.conflict-cd34", "time": 9.0, "committed": 4.0,
      "committed_ns": STAMP}),
    (LatestRecord("n1", "/p", 5, STAMP),
     {"node": "n1", "path": "/p", "generation": 5, "committed_ns": STAMP}),
]  # fmt: skip


@pytest.mark.parametrize(("record", "wire"), WIRE, ids=lambda x: type(x).__name__)
def test_a_record_writes_the_same_fields_and_reads_back_equal(record, wire):
    assert record.to_dict() == wire
    through_json = json.loads(json.dumps(record.to_dict()))
    assert type(record).from_dict(through_json) == record


def test_fields_an_older_writer_left_out_take_the_defaults_readers_assumed():
    old = HolderRecord.from_dict({"node": "n1", "path": "/p", "generation": 1, "committed": 5})
    assert old == HolderRecord("n1", "/p", 1, 5.0, "")
    assert (old.committed_ns, old.seen) == (0, -1)  # no stamp; races with nothing
    assert old.saver == "n1"  # no origin: the holder's own save
    assert HolderRecord.from_dict({"node": "n1", "origin": None}).saver == "n1"
    assert HolderRecord("n2", origin="n1").saver == "n1"
    assert PersistedRecord.from_dict({"node": "n1", "path": "/p"}).committed == 0.0
    assert PersistedRecord("n", "/p.conflict-ab").sidecar
    assert not PersistedRecord("n", "/p").sidecar


MALFORMED = [  # (record type, value, words the error must say)
    (HolderRecord, ["node", "n1"], "list, not an object"),
    (HolderRecord, None, "NoneType, not an object"),
    (HolderRecord, {"path": "/p"}, "no node id"),
    (HolderRecord, {"node": ""}, "no node id"),
    (HolderRecord, {"node": 7}, "no node id"),
    (HolderRecord, {"node": "n", "committed": "soon"}, "committed is not a number"),
    (HolderRecord, {"node": "n", "generation": True}, "generation is not a number"),
    (HolderRecord, {"node": "n", "path": 3}, "path is not a string"),
    (InFlightRecord, {"node": "n", "committed": [1]}, "committed is not a number"),
    (RepRecord, {"node": "n", "since": "x"}, "since is not a number"),
    (WriterRecord, {"node": "n"}, "no digest"),
    (WriterRecord, {"node": "n", "digest": 5}, "digest is not a string"),
    (LoaderRecord, "n1", "str, not an object"),
    (PersistedRecord, {"node": "n", "path": "/p", "time": {}}, "time is not a number"),
    (LatestRecord, {"node": "n", "committed_ns": 1.5}, "committed_ns is not a whole number"),
]  # fmt: skip


@pytest.mark.parametrize(("kind", "raw", "words"), MALFORMED)
def test_a_malformed_value_is_a_typed_error_that_says_what_is_wrong(kind, raw, words):
    with pytest.raises(MalformedRecord, match=words) as caught:
        kind.from_dict(raw)
    assert isinstance(caught.value, CkptCacheError) and isinstance(caught.value, ValueError)


def test_a_scan_keeps_the_good_records_and_logs_a_bad_key_once(caplog):
    scan = {
        "holders/ab/cd/good": {"node": "good", "committed": 2.0},
        "holders/ab/cd/bad": {"committed": 2.0},
        "holders/ab/cd/worse": "not json object",
    }
    with caplog.at_level(logging.WARNING, logger="ckptcache.server.cluster.coord.records"):
        for _ in range(3):
            parsed = parse_all(HolderRecord, scan)
            assert parsed == {"holders/ab/cd/good": HolderRecord("good", committed=2.0)}
    bad = [r for r in caplog.records if "holders/ab/cd/bad" in r.getMessage()]
    assert len(bad) == 1 and "no node id" in bad[0].getMessage()
    assert parse_one(WriterRecord, "writer/ab", None) is None
    assert parse_one(WriterRecord, "writer/ab", {"node": "n"}) is None
    assert parse_one(WriterRecord, "writer/ab", {"node": "n", "digest": "d"}) == WriterRecord(
        "n", "d"
    )


def test_a_malformed_node_record_is_typed_and_left_out_of_live_nodes():
    with pytest.raises(MalformedRecord, match="node_id"):
        NodeInfo.from_dict({"host": "h"})
    with pytest.raises(MalformedRecord, match="issued"):
        NodeInfo.from_dict({"node_id": "n", "host": "h", "issued": "yesterday"})
    coord = EmbeddedCoordinator("/ckptcache/t/j/", 5.0)
    coord.join(NodeInfo("a", "h", "1.2.3.4:5"))
    coord.announce(keys.node_key("forged"), {"host": "h"})
    coord.announce(keys.node_key("junk"), {"node_id": "junk", "host": "h", "issued": True})
    assert [n.node_id for n in coord.live_nodes()] == ["a"]
    coord.close()


def test_a_group_persists_past_malformed_records_of_its_path(make_core, tmp_path):
    """Hand-written garbage under a path's holder and persisted keys does not stop its
    persist: the holder is skipped, and a malformed persisted record of the very content
    counts as absent, so the content is written (again) rather than assumed stored."""
    root = str(tmp_path / "store")
    os.makedirs(root)
    core = make_core(persist_roots=(root,), listen="127.0.0.1:0", secret="s" * 32, pool_bytes=0)
    session = core.saves.open_session(1, os.getuid())
    coord = core.cluster.membership.coord  # type: ignore[union-attr]
    path = f"{root}/g.pt"
    ph = path_hash(NS, path)
    tensor = torch.full((64,), 5.0)
    first = save_object(core, session, path, tensor)
    wait_until(lambda: core.state.index.get((NS, path), first.generation).digests is not None,
               what="digests of the first save")  # fmt: skip
    digest = object_digest(core.state.index.get((NS, path), first.generation).digests)
    wait_until(lambda: _persisted(core, path, first.generation), what="first persisted")
    os.unlink(path)
    coord.announce(keys.holder_key(ph, "feed", "ghost"), {"committed": "now"})
    coord.record(keys.persisted_key(ph, digest), {"path": 7})  # the content's own, broken
    coord.record(keys.persisted_key(ph, "beef"), {"node": 3, "committed": 1e12})
    second = save_object(core, session, path, tensor)  # same content, saved again
    wait_until(lambda: _persisted(core, path, second.generation), what="second persisted")
    assert torch.equal(torch.load(path)["w"], tensor)
    # The group's record is written right after the node's verdict, which the wait above sees.
    record = wait_until(lambda: PersistedRecord.from_dict(coord.get(keys.persisted_key(ph, digest))),
                        what="the content's persisted record rewritten")  # fmt: skip
    assert record.path == path


def _persisted(core, path: str, number: int) -> bool:
    gen = core.state.index.get((NS, path), number)
    return gen is not None and gen.persist_state == PersistState.PERSISTED
