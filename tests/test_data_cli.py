"""`hpcddp pack` and `hpcddp stage` as a user runs them: child jobs under run_mpi.

Covers what needs a job of its own: a stager killed mid-copy then re-run, a destination
without enough room (a real 256 KiB tmpfs; skipped where mounting needs privileges we lack),
and the --json summary.
"""
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from hpcddp.data import NotReadyError, destlock, open_dataset
from hpcddp.data import manifest as mf
from hpcddp.launch.mpirun import run_mpi

HPCDDP = [sys.executable, "-m", "hpcddp"]
# `hpcddp ...` whose rank R exits after N chunk writes: KILLED_AFTER + [N, R, "stage", ...]
KILLED_AFTER = [sys.executable, str(pathlib.Path(__file__).parent / "scripts" / "stage_killed.py")]
TIMEOUT = 180


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HPCDDP_RANKS_PER_NODE="1")
    env.update(extra)
    return env


def _pack_folder(tmp_path, n=40, size=3000, fmt="lmdb", shard="8K"):
    root = tmp_path / "files"
    rng = np.random.default_rng(0)
    for i in range(n):
        p = root / f"class{i % 3}" / f"f{i:03d}.bin"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(rng.bytes(size))
    src = tmp_path / "src"
    res = subprocess.run(HPCDDP + ["pack", str(root), str(src), "--format", fmt, "--labels",
                                   "parent", "--shard-size", shard, "--no-progress", "--json", "-"],
                         capture_output=True, text=True, timeout=TIMEOUT, env=_env())
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout[res.stdout.index("{"):])
    assert summary["num_samples"] == n and summary["num_shards"] > 3
    return root, src


def _same_files(src, dst):
    m = mf.load(str(src))
    for s in m.shards:
        assert (src / s.name).read_bytes() == (dst / s.name).read_bytes(), s.name
    assert (src / mf.MANIFEST).read_bytes() == (dst / mf.MANIFEST).read_bytes()
    assert (dst / mf.READY).exists() and not (dst / mf.STAGING).exists()


def test_pack_npz_cli(tmp_path):
    x = np.arange(60, dtype=np.int32).reshape(20, 3)
    np.savez(tmp_path / "d.npz", x=x, y=np.arange(20) % 2)
    res = subprocess.run(HPCDDP + ["pack", str(tmp_path / "d.npz"), str(tmp_path / "out"),
                                   "--format", "hdf5", "--array", "x", "--label-array", "y",
                                   "--no-progress"],
                         capture_output=True, text=True, timeout=TIMEOUT, env=_env())
    assert res.returncode == 0, res.stderr
    ds = open_dataset(tmp_path / "out")
    assert [int(ds[i][0].sum()) for i in range(20)] == x.sum(1).tolist()
    assert [ds[i][1] for i in range(20)] == [i % 2 for i in range(20)]
    bad = subprocess.run(HPCDDP + ["pack", str(tmp_path / "d.npz"), str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=TIMEOUT, env=_env())
    assert bad.returncode == 2 and "not empty" in bad.stderr


def test_stage_killed_mid_copy_then_resumed(tmp_path):
    root, src = _pack_folder(tmp_path)
    dest = str(tmp_path / "dst-{node}")
    # ~60 chunks of 2K per node: killed halfway, after some shards are finished whatever the
    # strategy (allgather interleaves the leaders' shards, so it finishes them later than bcast)
    stage = ["stage", str(src), dest, "--chunk-size", "2K", "--no-progress"]
    killed = run_mpi(2, KILLED_AFTER + ["30", "1"] + stage, timeout=TIMEOUT, env=_env())
    assert killed.returncode != 0, killed.stdout + killed.stderr
    assert "test kill point" in killed.stderr
    node1 = tmp_path / "dst-1"
    assert (node1 / mf.STAGING).exists() and not (node1 / mf.READY).exists()
    names = os.listdir(node1)
    assert any(n.endswith(mf.PARTIAL_SUFFIX) for n in names)  # killed inside a shard
    with pytest.raises(NotReadyError, match="half-staged"):
        open_dataset(node1)
    left = json.loads((node1 / destlock.LOCK_NAME).read_text())   # the killed leader's lock

    out = tmp_path / "summary.json"
    again = run_mpi(2, HPCDDP + stage + ["--json", str(out)], timeout=TIMEOUT, env=_env())
    assert again.returncode == 0, again.stdout + again.stderr
    assert (f"[rank1] stage: {node1}: taking over the lock left by pid {left['pid']} on host "
            in again.stderr and f"pid {left['pid']} is no longer running" in again.stderr), \
        again.stderr
    assert not (node1 / destlock.LOCK_NAME).exists()
    s = json.loads(out.read_text())
    assert s["shards_skipped"] >= 1  # finished shards of the killed run were kept
    assert s["shards_copied"] + s["shards_skipped"] == 2 * s["num_shards"]
    for node in (0, 1):
        _same_files(src, tmp_path / f"dst-{node}")
    ds = open_dataset(node1)
    m = mf.load(str(src))
    for i, key in enumerate(m.keys):
        value, label = ds[i]
        assert value == (root / key).read_bytes() and m.classes[label] == key.split("/")[0]


def test_stage_json_summary_every_rank_vs_bcast(tmp_path):
    _, src = _pack_folder(tmp_path, fmt="hdf5")
    out = {}
    for strategy in ("bcast", "every-rank"):
        res = run_mpi(2, HPCDDP + ["stage", str(src), str(tmp_path / f"{strategy}-{{node}}"),
                                   "--strategy", strategy, "--json", "-", "--no-progress"],
                      timeout=TIMEOUT, env=_env())
        assert res.returncode == 0, res.stdout + res.stderr
        out[strategy] = json.loads(res.stdout[res.stdout.index("{"):])
        assert "[rank0] " in res.stderr  # human summary goes to stderr with --json -
    for key in ("bytes_read_from_source", "bytes_written", "seconds", "phases", "read_amplification"):
        assert key in out["bcast"]
    size = out["bcast"]["dataset_bytes"]
    assert out["bcast"]["bytes_read_from_source"] == size            # read once
    assert out["every-rank"]["bytes_read_from_source"] == 2 * size   # every rank reads all
    assert out["bcast"]["bytes_written"] == out["every-rank"]["bytes_written"]


@pytest.fixture
def small_tmpfs(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                         capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({res.stderr.strip()}): needs root")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


def test_stage_not_enough_space(tmp_path, small_tmpfs):
    _, src = _pack_folder(tmp_path, n=200, size=3000, shard="64K")  # ~600 KB > 256 KiB
    res = run_mpi(2, HPCDDP + ["stage", str(src), str(small_tmpfs / "d-{node}"), "--no-progress"],
                  timeout=TIMEOUT, env=_env())
    assert res.returncode == 1
    assert "not enough space" in res.stderr and "needs" in res.stderr and "free" in res.stderr
    for node in (0, 1):
        d = small_tmpfs / f"d-{node}"
        assert not (d / mf.READY).exists() and not (d / mf.STAGING).exists()
        assert os.listdir(d) == []  # checked before anything was written
