"""A byte changed in a packed or staged copy after it was verified: the datasets check each
shard's CRC-32C on its first open in a process and raise, never returning a wrong sample; the
READY marker's shard stats (what --verify auto trusts) see the change (no MPI)."""
import os
import time

import numpy as np
import pytest
import torch

from hpcddp import settings
from hpcddp.data import DatasetError, open_dataset, pack
from hpcddp.data import datasets as dsmod
from hpcddp.data import manifest as mf

N = 30


@pytest.fixture(params=["lmdb", "hdf5"])
def packed(request, tmp_path):
    d = tmp_path / "ds"
    rng = np.random.default_rng(9)
    items = [(f"s{i:03d}", rng.bytes(2000), i % 2) for i in range(N)]
    pack(items, d, format=request.param, shard_bytes=12_000, progress=False)
    return d, items


def _flip(path, at=None):
    data = bytearray(open(path, "rb").read())
    at = len(data) // 2 if at is None else at
    data[at] ^= 0x01
    with open(path, "r+b") as f:  # in place: same inode and size, as a bit flip would be
        f.write(bytes(data))


def _sample_bytes_offset(d, shard, items):
    """Where a sample's value lies in the shard file: flip a byte the reader returns."""
    blob = open(d / shard.name, "rb").read()
    value = items[shard.first][1]
    at = blob.find(value)
    assert at >= 0
    return at + 7


def test_flipped_byte_raises_on_first_open(packed):
    d, items = packed
    m = mf.load(str(d))
    victim = m.shards[1]
    _flip(d / victim.name, _sample_bytes_offset(d, victim, items))
    ds = open_dataset(d)   # sizes match: construction does not read the shards
    assert ds[0][0] == items[0][1]   # other shards read fine
    with pytest.raises(DatasetError) as ei:
        ds[victim.first]
    msg = str(ei.value)
    assert str(d / victim.name) in msg and "crc32c" in msg and f"expected {victim.crc32c}" in msg
    assert "got " in msg and "--verify full" in msg and "no sample of it was returned" in msg
    with pytest.raises(DatasetError, match="fails its crc32c check"):
        ds[victim.first + 1]         # a failed shard is never marked checked
    # the opt-outs: the flipped byte then reaches the caller unnoticed
    for quiet in (open_dataset(d, check=False), None):
        if quiet is None:   # a job started with HPCDDP_DATA_CHECK=0
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(settings, "_current", settings.read({dsmod.CHECK_ENV: "0"}))
                quiet = open_dataset(d)
        assert quiet[victim.first][0] != items[victim.first][1]


def test_checked_once_per_shard_per_process(packed, monkeypatch):
    d, items = packed
    m = mf.load(str(d))
    calls = []
    real = mf.file_checker
    monkeypatch.setattr(mf, "file_checker", lambda p, s: calls.append(s.name) or real(p, s))
    ds = open_dataset(d)
    for _ in range(2):
        assert [ds[i][0] for i in range(N)] == [v for _, v, _ in items]
    ds.close()                        # reopening in the same process: no second check
    assert ds[N - 1][0] == items[N - 1][1]
    assert sorted(calls) == sorted(s.name for s in m.shards)


def test_check_env_value_validated():
    assert dsmod.check_default({}) is True
    assert dsmod.check_default({dsmod.CHECK_ENV: "off"}) is False
    with pytest.raises(ValueError, match=r"HPCDDP_DATA_CHECK='maybe': expected 1 or 0"):
        dsmod.check_default({dsmod.CHECK_ENV: "maybe"})


def test_worker_raises_instead_of_a_wrong_sample(packed):
    d, items = packed
    m = mf.load(str(d))
    ds = open_dataset(d)
    ds[m.shards[0].first]            # the parent checked shard 0 before the corruption...
    _flip(d / m.shards[0].name, _sample_bytes_offset(d, m.shards[0], items))
    assert ds[m.shards[0].first][0] != items[0][1]   # ...and does not re-read it (once per process)
    loader = torch.utils.data.DataLoader(ds, batch_size=2, num_workers=1, shuffle=False,
                                         multiprocessing_context="fork",
                                         collate_fn=lambda b: b)
    with pytest.raises(DatasetError, match=rf"{m.shards[0].name} fails its crc32c check"):
        list(loader)                 # a forked worker is a new process: it checks


def test_shard_stats_see_a_rewrite_and_a_touch(packed):
    d, _ = packed
    m = mf.load(str(d))
    stats = mf.shard_stats(str(d), m, range(len(m.shards)))
    p = str(d / m.shards[2].name)
    assert all(mf.stat_matches(str(d / s.name), stats[s.name]) for s in m.shards)
    assert not mf.stat_matches(p, None)
    time.sleep(0.02)
    _flip(p)
    assert not mf.stat_matches(p, stats[m.shards[2].name])
    st = os.stat(p)
    _flip(p)                          # flipped back, mtime set back: ctime still moved
    os.utime(p, ns=(st.st_atime_ns, stats[m.shards[2].name]["mtime_ns"]))
    assert not mf.stat_matches(p, stats[m.shards[2].name])
    assert mf.stat_matches(str(d / m.shards[0].name), stats[m.shards[0].name])


def test_stat_recorded_in_the_same_tick_as_ready_is_not_vouched_for(packed):
    d, _ = packed
    m = mf.load(str(d))
    p = str(d / m.shards[0].name)
    rec = mf.shard_stats(str(d), m, [0])[m.shards[0].name]
    # file times are coarse: a write in the tick READY was written in could keep them
    assert not mf.stat_matches(p, rec, before_ns=rec["mtime_ns"])
    assert mf.stat_matches(p, rec, before_ns=rec["mtime_ns"] + 1)
