"""pack() and `hpcddp pack` from an HDF5 file: rows of a named dataset, streamed in blocks
(no MPI). Equal sample for sample to the source, byte-equal to packing the same array from a
.npy file, deterministic, and every wrong input refused with one line that names it."""
import os

import h5py
import numpy as np
import pytest

from hpcddp.cli import main
from hpcddp.data import manifest as mf
from hpcddp.data import open_dataset, pack
from hpcddp.data import packing

N = 203                      # not a multiple of the chunk rows (16) nor of a block's


def _images(dtype, n=N):
    rng = np.random.default_rng(7)
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal((n, 4, 32, 32)).astype(dtype)
    return rng.integers(0, 256, (n, 4, 32, 32)).astype(dtype)


def _write(path, x, y=None, *, chunked=True):
    with h5py.File(path, "w") as f:
        grp = f.create_group("grp")
        if chunked:
            grp.create_dataset("images", data=x, chunks=(min(16, len(x)), 4, 16, 32),
                               compression="gzip")
        else:
            grp.create_dataset("images", data=x)
        if y is not None:
            f.create_dataset("labels", data=y)
    return path


def _assert_equal(out, x, y):
    ds = open_dataset(out)
    assert len(ds) == len(x)
    for i in range(len(x)):
        value, label = ds[i] if y is not None else (ds[i], None)
        assert value.dtype == x.dtype and value.shape == x.shape[1:]
        np.testing.assert_array_equal(value, x[i])
        assert label == (None if y is None else y[i])


@pytest.fixture
def small_blocks(monkeypatch):
    # 3 chunks of 16 rows per block: 203 rows take 5 blocks, the last one partial
    row = 4 * 32 * 32
    monkeypatch.setattr(packing, "HDF5_BLOCK_BYTES", 48 * row + 100)


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5"])
@pytest.mark.parametrize("dtype", ["uint8", "float32"])
@pytest.mark.parametrize("chunked", [True, False], ids=["chunked-gzip", "contiguous"])
def test_rows_equal_the_source(tmp_path, small_blocks, fmt, dtype, chunked):
    x = _images(dtype)
    y = np.arange(N, dtype=np.int64) % 10
    src = _write(tmp_path / "d.h5", x, y, chunked=chunked)
    m = pack(src, tmp_path / "out", format=fmt, array="grp/images", label_array="labels",
             shard_bytes=40 * x[0].nbytes, progress=False)
    assert m.encoding == "array" and m.dtype == x.dtype.str and m.shape == (4, 32, 32)
    assert m.keys == [str(i) for i in range(N)] and len(m.shards) == 6
    assert m.labels == y.tolist()
    _assert_equal(tmp_path / "out", x, y)


def test_blocks_are_whole_chunks(tmp_path):
    x = _images("uint8", 40)
    with h5py.File(tmp_path / "d.h5", "w") as f:
        a = f.create_dataset("a", data=x, chunks=(7, 4, 32, 32))
        b = f.create_dataset("b", data=x)
        row = x[0].nbytes
        assert packing.hdf5_block_rows(a, 20 * row) == 14     # two chunks, not 20 rows
        assert packing.hdf5_block_rows(a, 3 * row) == 7       # at least one chunk
        assert packing.hdf5_block_rows(b, 20 * row) == 20     # contiguous: by bytes
        assert packing.hdf5_block_rows(b, 1) == 1


def test_reads_block_by_block(tmp_path, monkeypatch, small_blocks):
    """The source is read in slices of whole blocks, never whole (what bounds the memory)."""
    x = _images("uint8")
    src = _write(tmp_path / "d.h5", x)
    reads = []
    real = h5py.Dataset.__getitem__

    def spy(self, sel):
        if self.name == "/grp/images":
            reads.append(sel)
        return real(self, sel)
    monkeypatch.setattr(h5py.Dataset, "__getitem__", spy)
    pack(src, tmp_path / "out", array="grp/images", progress=False)
    assert reads == [slice(i, i + 48) for i in range(0, N, 48)]


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5"])
def test_same_array_from_npy_and_h5_gives_the_same_bytes(tmp_path, small_blocks, fmt):
    x = _images("float32")
    y = (np.arange(N) * 7 % 5).astype(np.int32)
    _write(tmp_path / "d.h5", x, y)
    np.save(tmp_path / "d.npy", x)
    kw = dict(format=fmt, shard_bytes=30 * x[0].nbytes, progress=False)
    a = pack(tmp_path / "d.h5", tmp_path / "a", array="grp/images", label_array="labels", **kw)
    b = pack(np.load(tmp_path / "d.npy", mmap_mode="r"), tmp_path / "b", labels=y.tolist(), **kw)
    a_raw, b_raw = ((tmp_path / d / mf.MANIFEST).read_bytes() for d in "ab")
    assert a_raw == b_raw
    assert sorted(os.listdir(tmp_path / "a")) == sorted(os.listdir(tmp_path / "b"))
    for s in a.shards:
        assert (tmp_path / "a" / s.name).read_bytes() == (tmp_path / "b" / s.name).read_bytes()
    c = pack(tmp_path / "d.h5", tmp_path / "c", array="grp/images", label_array="labels", **kw)
    assert c.dumps() == a.dumps()      # deterministic


def test_default_array_and_other_dtypes(tmp_path):
    # the one dataset of ndim >= 1 (a scalar attribute-like dataset beside it is not a candidate)
    x = np.arange(30, dtype=">i2").reshape(10, 3)
    with h5py.File(tmp_path / "d.h5", "w") as f:
        f.create_dataset("deep/down/x", data=x)
        f.create_dataset("version", data=3)
        f.create_dataset("y", data=np.arange(10, dtype=np.uint8))
    m = pack(tmp_path / "d.h5", tmp_path / "out", label_array="y", progress=False)
    assert m.dtype == ">i2"
    _assert_equal(tmp_path / "out", x, list(range(10)))
    # 1-D rows (0-d samples), and a compound dtype (kept with its fields: encoding npy)
    rec = np.zeros(5, dtype=[("a", "<f8"), ("b", "<i4")])
    rec["a"], rec["b"] = np.arange(5) / 2, np.arange(5)
    with h5py.File(tmp_path / "e.h5", "w") as f:
        f.create_dataset("v", data=np.arange(5.0))
        f.create_dataset("rec", data=rec, chunks=(2,), compression="gzip")
    pack(tmp_path / "e.h5", tmp_path / "v", array="v", progress=False)
    assert [float(open_dataset(tmp_path / "v")[i]) for i in range(5)] == [0, 1, 2, 3, 4]
    m = pack(tmp_path / "e.h5", tmp_path / "rec", array="/rec", progress=False)
    assert m.encoding == "npy"
    ds = open_dataset(tmp_path / "rec")
    assert [ds[i].item() for i in range(5)] == rec.tolist()


@pytest.fixture
def files(tmp_path):
    x = _images("uint8", 12)
    _write(tmp_path / "d.h5", x, np.arange(12))
    with h5py.File(tmp_path / "bad.h5", "w") as f:
        f.create_dataset("grp/images", data=x)
        f.create_dataset("labels", data=np.arange(11))
        f.create_dataset("scalar", data=1.5)
        f.create_dataset("float_labels", data=np.zeros(12))
        f.create_dataset("strings", data=["a", "bc"], dtype=h5py.string_dtype())
    with h5py.File(tmp_path / "two.h5", "w") as f:
        f.create_dataset("a", data=x)
        f.create_dataset("b", data=x)
    (tmp_path / "fake.h5").write_bytes(b"not an HDF5 file\n" * 10)
    (tmp_path / "trunc.h5").write_bytes((tmp_path / "d.h5").read_bytes()[:600])
    return tmp_path


@pytest.mark.parametrize("argv, says", [
    (["d.h5", "--array", "images"],
     "d.h5 has no dataset 'images' (--array); it has ['grp/images', 'labels']"),
    (["d.h5", "--array", "grp/images", "--label-array", "y"],
     "d.h5 has no dataset 'y' (--label-array); it has ['grp/images', 'labels']"),
    (["d.h5", "--array", "grp"], "'grp' in {t}/d.h5 is a group, not a dataset (--array)"),
    (["bad.h5", "--array", "grp/images", "--label-array", "labels"],
     "label dataset 'labels' has 11 entries, dataset 'grp/images' in {t}/bad.h5 has 12 samples"),
    (["bad.h5", "--array", "scalar"], "dataset 'scalar' in {t}/bad.h5 (--array) is a scalar"),
    (["bad.h5", "--array", "grp/images", "--label-array", "scalar"],
     "dataset 'scalar' in {t}/bad.h5 (--label-array) is a scalar"),
    (["bad.h5", "--array", "grp/images", "--label-array", "float_labels"],
     "label dataset 'float_labels' in {t}/bad.h5 is float64[12]; labels are one integer"),
    (["bad.h5", "--array", "strings"], "dataset 'strings' in {t}/bad.h5 has variable-length"),
    (["bad.h5"], "bad.h5 holds 4 datasets that could be the samples"),
    (["two.h5"], "two.h5 holds 2 datasets that could be the samples (['a', 'b']); name one "
                 "with --array"),
    (["fake.h5"], "SOURCE '{t}/fake.h5' is a file that is not .npy or .npz, nor HDF5"),
    (["trunc.h5"], "cannot open '{t}/trunc.h5' as an HDF5 file"),
    (["d.h5", "--labels", "parent"], "--labels parent labels the files of a folder; SOURCE is "
                                     "an HDF5 file"),
])
def test_bad_input_one_line_exit_2_nothing_written(files, capsys, argv, says):
    t = str(files)
    before = sorted(p.name for p in files.iterdir())
    assert main(["pack", f"{t}/{argv[0]}", f"{t}/out", *argv[1:]]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hpcddp pack: "), err
    assert says.format(t=t) in err, err
    assert err.count("pack:") == 1, err
    assert sorted(p.name for p in files.iterdir()) == before


def test_python_refusals(files):
    with pytest.raises(ValueError, match="is a file that is not HDF5"):
        pack(files / "fake.h5", files / "out", progress=False)
    with pytest.raises(ValueError, match="labels given both"):
        pack(files / "d.h5", files / "out", array="grp/images", label_array="labels",
             labels=list(range(12)), progress=False)
    with pytest.raises(ValueError, match="name datasets of an HDF5 file"):
        pack(np.zeros((3, 2)), files / "out", array="x", progress=False)
    with pytest.raises(ValueError, match="array= names a dataset of an HDF5 file"):
        pack(files, files / "out", array="x", progress=False)
    assert not (files / "out").exists()


def test_cli(files, capsys):
    t = str(files)
    assert main(["pack", f"{t}/d.h5", f"{t}/out", "--format", "hdf5", "--array", "grp/images",
                 "--label-array", "labels", "--shard-size", "20K", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("packed 12 samples into 3 hdf5 shard(s)"), out
    _assert_equal(files / "out", _images("uint8", 12), list(range(12)))


def test_an_open_h5py_dataset_as_source(tmp_path, small_blocks):
    x = _images("uint8")
    y = np.arange(N) % 3
    _write(tmp_path / "d.h5", x, y)
    pack(tmp_path / "d.h5", tmp_path / "a", array="grp/images", label_array="labels",
         progress=False)
    with h5py.File(tmp_path / "d.h5") as f:
        m = pack(f["grp/images"], tmp_path / "b", labels=f["labels"], progress=False)
        assert f.id.valid                       # the caller's file: left open
        with pytest.raises(ValueError, match=r"labels has 202 entries, dataset '/grp/images' in"):
            pack(f["grp/images"], tmp_path / "c", labels=y[1:], progress=False)
    assert m.dumps() == (tmp_path / "a" / mf.MANIFEST).read_bytes()
    _assert_equal(tmp_path / "b", x, y)
