"""pack(): sources, shards, manifest, determinism, errors (no MPI)."""
import json
import os

import numpy as np
import pytest

from hpcddp.data import manifest as mf
from hpcddp.data import open_dataset, pack


def _items(n, seed=0, hi=5000):
    rng = np.random.default_rng(seed)
    return [(f"k{i:04d}", rng.bytes(int(rng.integers(0, hi)))) for i in range(n)]


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5"])
def test_iterable_round_trip_and_shards(tmp_path, fmt):
    items = _items(200)
    m = pack(items, tmp_path / "ds", format=fmt, shard_bytes=50_000, progress=False)
    assert m.num_samples == 200 and m.keys == [k for k, _ in items]
    assert len(m.shards) > 3
    payload = [sum(len(v) for _, v in items[s.first:s.first + s.count]) for s in m.shards]
    assert all(p <= 50_000 for p in payload)
    for s, p in zip(m.shards[:-1], payload):  # full: the next sample would not have fit
        assert p + len(items[s.first + s.count][1]) > 50_000
    for s in m.shards:
        p = tmp_path / "ds" / s.name
        assert p.stat().st_size == s.bytes and mf.file_sha256(str(p)) == s.sha256
    ds = open_dataset(tmp_path / "ds")
    assert len(ds) == 200 and ds.labels is None
    assert all(ds[i] == items[i][1] for i in range(200))
    assert ds[-1] == items[-1][1]
    with pytest.raises(IndexError):
        ds[200]


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5"])
def test_deterministic(tmp_path, fmt):
    a = pack(_items(120, 1), tmp_path / "a", format=fmt, shard_bytes=40_000, progress=False)
    b = pack(_items(120, 1), tmp_path / "b", format=fmt, shard_bytes=40_000, progress=False)
    assert (tmp_path / "a" / mf.MANIFEST).read_bytes() == (tmp_path / "b" / mf.MANIFEST).read_bytes()
    for s in a.shards:
        assert (tmp_path / "a" / s.name).read_bytes() == (tmp_path / "b" / s.name).read_bytes()
    assert a.dumps() == b.dumps()


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5"])
def test_numpy_array_with_labels(tmp_path, fmt):
    x = np.random.default_rng(0).standard_normal((37, 3, 5)).astype(np.float32)
    y = np.arange(37) % 4
    m = pack(x, tmp_path / "ds", format=fmt, shard_bytes=1000, labels=y, progress=False)
    assert m.encoding == "array" and m.dtype == "<f4" and m.shape == (3, 5)
    doc = json.loads((tmp_path / "ds" / mf.MANIFEST).read_bytes())
    assert doc["format_version"] == mf.FORMAT_VERSION and doc["num_samples"] == 37
    ds = open_dataset(tmp_path / "ds")
    for i in range(37):
        v, lab = ds[i]
        assert v.dtype == np.float32 and v.flags.writeable
        np.testing.assert_array_equal(v, x[i])
        assert lab == y[i]


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5"])
def test_folder_tree_with_parent_labels(tmp_path, fmt):
    root = tmp_path / "imgs"
    files = {"cat/1.bin": b"c1", "cat/2.bin": b"c22", "dog/a.bin": b"d" * 3000,
             "dog/sub/b.bin": b"", "ant/x.bin": b"ant"}
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    m = pack(root, tmp_path / "ds", format=fmt, label_from_parent=True, progress=False)
    assert m.keys == sorted(files)
    assert m.classes == ["ant", "cat", "dog", "dog/sub"]
    ds = open_dataset(tmp_path / "ds")
    for i, k in enumerate(m.keys):
        value, label = ds[i]
        assert value == files[k] and m.classes[label] == k.rpartition("/")[0]


def test_folder_top_level_file_needs_class_folder(tmp_path):
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "loose.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="label_from_parent"):
        pack(tmp_path / "imgs", tmp_path / "ds", label_from_parent=True, progress=False)


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5"])
def test_empty_and_one_sample(tmp_path, fmt):
    m = pack([], tmp_path / "empty", format=fmt, progress=False)
    assert m.num_samples == 0 and m.shards == [] and len(open_dataset(tmp_path / "empty")) == 0
    m = pack([("only", b"\x00\x01")], tmp_path / "one", format=fmt, progress=False)
    assert m.num_samples == 1 and len(m.shards) == 1
    assert open_dataset(tmp_path / "one")[0] == b"\x00\x01"
    m = pack(np.zeros((0, 4), np.int16), tmp_path / "empty_arr", format=fmt, progress=False)
    assert m.num_samples == 0 and m.encoding == "array" and m.shape == (4,)


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5"])
def test_npy_encoding_varying_shapes(tmp_path, fmt):
    arrs = [np.arange(i * 2, dtype=np.int32).reshape(i, 2) for i in range(1, 6)]
    with pytest.raises(ValueError, match="encoding='npy'"):
        pack([(str(i), a) for i, a in enumerate(arrs)], tmp_path / "bad", format=fmt,
             progress=False)
    pack([(str(i), a) for i, a in enumerate(arrs)], tmp_path / "ds", format=fmt,
         encoding="npy", progress=False)
    ds = open_dataset(tmp_path / "ds")
    for i, a in enumerate(arrs):
        np.testing.assert_array_equal(ds[i], a)


def test_large_sample_gets_own_shard(tmp_path):
    items = [("a", b"1" * 10), ("big", b"2" * 5000), ("c", b"3" * 10)]
    m = pack(items, tmp_path / "ds", shard_bytes=100, progress=False)
    assert [s.count for s in m.shards] == [1, 1, 1]


def test_errors(tmp_path):
    pack([("a", b"1")], tmp_path / "ds", progress=False)
    with pytest.raises(FileExistsError, match="overwrite"):
        pack([("a", b"1")], tmp_path / "ds", progress=False)
    pack([("a", b"2")], tmp_path / "ds", progress=False, overwrite=True)
    assert open_dataset(tmp_path / "ds")[0] == b"2"
    with pytest.raises(ValueError, match="twice"):
        pack([("a", b"1"), ("a", b"2")], tmp_path / "dup", progress=False)
    with pytest.raises(ValueError, match="format"):
        pack([], tmp_path / "x", format="zip", progress=False)
    with pytest.raises(TypeError, match="bytes or numpy"):
        pack([("a", 3)], tmp_path / "y", progress=False)
    with pytest.raises(ValueError, match="no label"):
        pack([("a", b"1", 0), ("b", b"2")], tmp_path / "z", progress=False)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="refusing"):
        pack([("a", b"1")], tmp_path / "other", progress=False, overwrite=True)
    assert (tmp_path / "other" / "keep.txt").exists()


@pytest.mark.parametrize("name", ["../shard-00000.lmdb", "/etc/passwd", "a/b", "..", ".hidden",
                                  "", "manifest.json", "READY", "STAGING", "x\0y", 7])
def test_manifest_shard_names_stay_inside_the_directory(tmp_path, name):
    """A manifest someone else edited cannot point a reader or a stager outside the data set
    directory, nor make a shard of the manifest or a marker (docs/security.md)."""
    pack(_items(10), tmp_path / "ds", shard_bytes=10_000, progress=False)
    doc = json.loads((tmp_path / "ds" / mf.MANIFEST).read_bytes())
    doc["shards"][0]["name"] = name
    with pytest.raises(mf.DatasetError, match=r"shards\[0\]\.name .* must be a plain file name"):
        mf.Manifest.from_json(json.dumps(doc))
    (tmp_path / "ds" / mf.MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(mf.DatasetError, match="must be a plain file name"):
        open_dataset(str(tmp_path / "ds"))


def test_manifest_validation(tmp_path):
    pack(_items(10), tmp_path / "ds", shard_bytes=10_000, progress=False)
    doc = json.loads((tmp_path / "ds" / mf.MANIFEST).read_bytes())
    doc["format_version"] = 99
    with pytest.raises(mf.DatasetError, match="format_version"):
        mf.Manifest.from_json(json.dumps(doc))
    doc["format_version"] = mf.FORMAT_VERSION
    doc["shards"][0]["count"] += 1
    with pytest.raises(mf.DatasetError, match="shards"):
        mf.Manifest.from_json(json.dumps(doc))
    with pytest.raises(mf.DatasetError, match="not valid JSON"):
        mf.Manifest.from_json(b"{")
    with pytest.raises(mf.DatasetError, match="no manifest.json"):
        mf.load(str(tmp_path))
