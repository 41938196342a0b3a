"""Two `hpcddp stage` jobs into one destination, as a user starts them (child jobs under
run_mpi, 2, 3 and 4 ranks, emulated nodes): one stager per destination, both end correct; a
stager timed out by a held lock. A killed stager's lock taken over: test_data_cli.py (a real
kill) and tests/mpi/test_stage_safety.py (2, 3, 4 ranks, both lock modes).

Nodes: 2 and 3 ranks run one rank per node; 4 ranks run 2 nodes of 2 (leaders and others).
"""
import json
import os
import sys
import threading
import time

import numpy as np
import pytest

from hpcddp.data import destlock, open_dataset, pack
from hpcddp.data import manifest as mf
from hpcddp.launch.mpirun import run_mpi

HPCDDP = [sys.executable, "-m", "hpcddp"]
TIMEOUT = 180
SIZES = (2, 3, 4)
WAITING = "stage: waiting for the destination lock"


def _env(n, **extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               HPCDDP_RANKS_PER_NODE="2" if n == 4 else "1")
    env.pop(destlock.MODE_ENV, None)
    env.update(extra)
    return env


def _nodes(n):
    return 2 if n == 4 else n


@pytest.fixture
def src(tmp_path):
    rng = np.random.default_rng(1)
    items = [(f"k{i:04d}", rng.bytes(48_000)) for i in range(64)]   # ~3 MB, 12 shards
    pack(items, tmp_path / "src", format="lmdb", shard_bytes=256_000, progress=False)
    return tmp_path / "src", items


def _stage_argv(src, dest, *more):
    return HPCDDP + ["stage", str(src), str(dest), "--no-progress", "--chunk-size", "4K", *more]


def _in_background(n, argv, env, log=None):
    """run_mpi in a thread (its own timeout kills a hung job); LOG: the ranks' stderr also
    goes to this file while the job runs, so the test can watch it."""
    if log is not None:
        argv = ["bash", "-c", f'exec "$@" 2>>{log}', "stage-job"] + list(argv)
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("res", run_mpi(n, argv, timeout=TIMEOUT,
                                                                      env=env)))
    t.start()
    return t, out


def _check_copies(src, items, tmp_path, n):
    for node in range(_nodes(n)):
        d = tmp_path / f"dst-{node}"
        names = os.listdir(d)
        assert mf.READY in names and mf.STAGING not in names, names
        assert destlock.LOCK_NAME not in names and not [x for x in names if mf.PARTIAL_SUFFIX in x]
        for s in mf.load(str(src)).shards:
            assert (d / s.name).read_bytes() == (src / s.name).read_bytes(), (node, s.name)
        ds = open_dataset(d)   # the CRC-32C check on open passes too
        assert [ds[i] for i in range(len(items))] == [v for _, v in items]


def _summary(res):
    return json.loads(res.stdout[res.stdout.index("{"):])


@pytest.mark.parametrize("n", SIZES)
def test_two_stagers_started_together_both_succeed(src, tmp_path, n):
    src, items = src
    argv = _stage_argv(src, tmp_path / "dst-{node}", "--json", "-")
    jobs = [_in_background(n, argv, _env(n)) for _ in range(2)]
    for t, _ in jobs:
        t.join(TIMEOUT + 30)
    res = [out["res"] for _, out in jobs]
    for r in res:
        assert r.returncode == 0, r.stdout + r.stderr
        assert "No such file or directory" not in r.stderr
    total = len(mf.load(str(src)).shards) * _nodes(n)
    # one copied everything; the other waited for it (or came after) and found it in place
    assert sorted(_summary(r)["shards_copied"] for r in res) == [0, total]
    for r in res:
        if WAITING in r.stderr:   # the holder named, or (caught between its lock and its
            #                       record's write) said to be writing its record
            assert (" is being staged by another stager: pid " in r.stderr
                    or "another stager (its record is not written yet)" in r.stderr), r.stderr
    _check_copies(src, items, tmp_path, n)


def _wait_for(paths, text, timeout=120):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if all(os.path.exists(p) and text in open(p).read() for p in paths):
            return
        time.sleep(0.1)
    raise AssertionError(f"no {text!r} in all of {paths} after {timeout} s: "
                         + " | ".join(open(p).read() if os.path.exists(p) else "-" for p in paths))


@pytest.mark.parametrize("n", SIZES)
def test_queued_stagers_wait_then_exactly_one_copies(src, tmp_path, n):
    src, items = src
    held = []
    for node in range(_nodes(n)):   # a stager holds every destination when both jobs start
        d = tmp_path / f"dst-{node}"
        d.mkdir()
        lock = destlock.DestLock(str(d))
        assert lock.try_acquire() is None
        held.append(lock)
    argv = _stage_argv(src, tmp_path / "dst-{node}", "--json", "-")
    logs = [str(tmp_path / f"job{j}.err") for j in range(2)]
    jobs = [_in_background(n, argv, _env(n), log) for log in logs]
    try:
        _wait_for(logs, WAITING)    # both queued behind the holder, and said so
    finally:
        for lock in held:
            lock.release()
    for t, _ in jobs:
        t.join(TIMEOUT + 30)
    res = [out["res"] for _, out in jobs]
    for r, log in zip(res, logs):
        assert r.returncode == 0, r.stdout + r.stderr
        text = open(log).read()
        assert text.count(WAITING) == 1 and f"[rank0] {WAITING}" in text   # once, by rank 0
        assert f"is being staged by another stager: pid {os.getpid()} on host" in text
    total = len(mf.load(str(src)).shards) * _nodes(n)
    assert sorted(_summary(r)["shards_copied"] for r in res) == [0, total]
    _check_copies(src, items, tmp_path, n)


@pytest.mark.parametrize("n", SIZES)
def test_held_destination_times_out(src, tmp_path, n):
    # lock_wait=0 (refuse at once) is tested inside a job: tests/mpi/test_stage_safety.py
    src, _ = src
    last = tmp_path / f"dst-{_nodes(n) - 1}"
    last.mkdir()
    lock = destlock.DestLock(str(last))
    assert lock.try_acquire() is None
    try:
        r = run_mpi(n, _stage_argv(src, tmp_path / "dst-{node}", "--lock-wait", "1"),
                    timeout=TIMEOUT, env=_env(n))
    finally:
        lock.release()
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stderr.count(WAITING) == 1 and f"[rank0] {WAITING}" in r.stderr
    line = [x for x in r.stderr.splitlines() if x.startswith("[rank0] hpcddp stage: ")]
    assert line and f"DEST {last} on node {_nodes(n) - 1}" in line[0], r.stderr
    assert f"pid {os.getpid()} on host" in line[0] and "--lock-wait" in line[0]
    assert "still held after waiting lock_wait=1 s" in line[0]
    for node in range(_nodes(n)):   # nothing written anywhere
        d = tmp_path / f"dst-{node}"
        assert os.listdir(d) == []
