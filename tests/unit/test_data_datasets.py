"""LMDBDataset / HDF5Dataset: lazy per-process handles, DataLoader workers (fork, spawn),
pickling, half-staged copies, corruption (no MPI)."""
import json
import multiprocessing as mp
import os
import pickle

import numpy as np
import pytest
import torch

from hpcddp.data import DatasetError, HDF5Dataset, LMDBDataset, NotReadyError, open_dataset, pack
from hpcddp.data import manifest as mf

N = 41


def _decode(b):  # module level: picklable for spawn workers
    return torch.frombuffer(bytearray(b), dtype=torch.uint8).sum()


@pytest.fixture(params=["lmdb", "hdf5"])
def packed(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param) / "ds"
    rng = np.random.default_rng(3)
    items = [(f"s{i}", rng.bytes(int(rng.integers(1, 3000))), i % 3) for i in range(N)]
    pack(items, d, format=request.param, shard_bytes=8000, progress=False)
    return d, items


@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_dataloader_workers(packed, ctx):
    d, items = packed
    ds = open_dataset(d, decode=_decode)
    ds[0]  # open handles in the parent first: forked workers must not use them
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2,
                                         multiprocessing_context=ctx, shuffle=False)
    got_v, got_l = [], []
    for v, lab in loader:
        got_v += v.tolist()
        got_l += lab.tolist()
    assert got_v == [sum(b) for _, b, _ in items]
    assert got_l == [lab for _, _, lab in items]
    assert ds[5][0].item() == sum(items[5][1])  # parent's handles still work afterwards


def test_pickle_drops_handles(packed):
    d, items = packed
    ds = open_dataset(d)
    assert ds[3][0] == items[3][1]
    assert ds._handles
    copy = pickle.loads(pickle.dumps(ds))
    assert copy._handles == {} and copy[3][0] == items[3][1]
    twin = open_dataset(d)  # a second object on the same files in this process
    assert twin[4][0] == items[4][1]
    ds.close()
    assert twin[4][0] == items[4][1] and ds[4][0] == items[4][1]


def _child_reads(ds, q):
    q.put(ds[7][0])


def test_fork_after_open(packed):
    d, items = packed
    ds = open_dataset(d)
    ds[7]
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child_reads, args=(ds, q))
    p.start()
    p.join(60)
    assert p.exitcode == 0 and q.get(timeout=5) == items[7][1]


def test_wrong_class_and_missing(packed, tmp_path):
    d, _ = packed
    storage = json.loads((d / mf.MANIFEST).read_bytes())["storage"]
    other = HDF5Dataset if storage == "lmdb" else LMDBDataset
    with pytest.raises(DatasetError, match="open it with"):
        other(d)
    with pytest.raises(FileNotFoundError):
        LMDBDataset(tmp_path / "nope")


def test_half_staged_copy_refused(packed):
    d, _ = packed
    (d / mf.STAGING).write_text(json.dumps({"started": "2025-01-01T00:00:00"}))
    with pytest.raises(NotReadyError, match="half-staged.*hpcddp stage"):
        open_dataset(d)
    (d / mf.STAGING).unlink()
    m = mf.load(str(d))
    victim = d / m.shards[1].name
    data = victim.read_bytes()
    victim.write_bytes(data[:-10])
    with pytest.raises(DatasetError, match="truncated or corrupted"):
        open_dataset(d)
    victim.unlink()
    with pytest.raises(DatasetError, match="missing"):
        open_dataset(d)
    victim.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
    ds = open_dataset(d)  # sizes match: opening is cheap...
    assert ds.verify() == [m.shards[1].name]  # ...verify() finds it
    with pytest.raises(DatasetError, match="checksum"):
        open_dataset(d, verify=True)


def test_partition_copy_restricts_reads(packed):
    d, items = packed
    m = mf.load(str(d))
    (d / mf.READY).write_text(json.dumps({"mode": "partition", "node": 1, "group": 0,
                                          "num_groups": 1, "local_shards": [0, 2]}))
    (d / m.shards[1].name).unlink()  # not staged here: fine in partition mode
    ds = open_dataset(d)
    assert ds.local_indices.tolist() == m.indices_of([0, 2])
    assert ds[m.shards[2].first][0] == items[m.shards[2].first][1]
    with pytest.raises(IndexError, match="partition-mode"):
        ds[m.shards[1].first]
