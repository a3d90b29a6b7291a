"""The planned archive is what torch.load and zip readers expect, zip64 included."""

from __future__ import annotations

import zipfile

import torch

from ckptcache.codec.flatten import flatten
from ckptcache.format.archive import plan_archive


def write_archive(obj, path):
    flat = flatten(obj)
    plan = plan_archive(flat.skeleton, [i.nbytes for i in flat.infos])
    buf = bytearray(plan.size)
    plan.write_metadata(memoryview(buf))
    for off, storage in zip(plan.storage_offsets, flat.storages, strict=False):
        n = storage.nbytes()
        buf[off : off + n] = bytes(torch.empty(0, dtype=torch.uint8).set_(storage).numpy())
    path.write_bytes(buf)
    return plan


def test_torch_load_reads_planned_archive(tmp_path, monkeypatch):
    x = torch.arange(100, dtype=torch.float64).reshape(10, 10)
    obj = {"x": x, "xt": x.t(), "b": torch.ones(3, dtype=torch.bfloat16), "e": torch.empty(0)}
    plan = write_archive(obj, tmp_path / "a.pt")
    assert all(off % 64 == 0 for off in plan.storage_offsets)
    for mmap in (False, True):
        out = torch.load(tmp_path / "a.pt", mmap=mmap)
        assert torch.equal(out["xt"], x.t()) and out["xt"].stride() == (1, 10)
        assert torch.equal(out["b"], obj["b"])
    # torch's own offset arithmetic (which assumes miniz's exact layout) agrees with ours
    from torch.utils.serialization import config

    monkeypatch.setenv("TORCH_SERIALIZATION_DEBUG", "1")
    with config.patch({"load.calculate_storage_offsets": True}):
        assert torch.equal(torch.load(tmp_path / "a.pt", mmap=True)["x"], x)
    names = zipfile.ZipFile(tmp_path / "a.pt").namelist()
    assert names[:4] == ["archive/data.pkl", "archive/.format_version",
                         "archive/.storage_alignment", "archive/byteorder"]  # fmt: skip
    assert names[-2:] == ["archive/version", "archive/.data/serialization_id"]


def test_zip64_records_for_storages_past_4gib(tmp_path):
    sizes = [16, 5 << 30, 32]  # the middle storage forces zip64 sizes and offsets
    plan = plan_archive(b"\x80\x02}q\x00.", sizes)
    path = tmp_path / "big.zip"
    with open(path, "wb") as f:  # sparse: only the metadata is written
        f.truncate(plan.size)
        for off, data in plan.pieces:
            f.seek(off)
            f.write(data)
    infos = {i.filename: i for i in zipfile.ZipFile(path).infolist()}
    assert infos["archive/data/1"].file_size == 5 << 30
    assert infos["archive/data/2"].header_offset > 5 << 30
    assert infos["archive/data/2"].file_size == 32
