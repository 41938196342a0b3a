"""After READY, inside an MPI job (2, 3, 4 ranks, emulated nodes as in test_stage.py): a byte
flipped in a staged shard is caught by the dataset on open and replaced by a --verify auto
re-stage; one stager per destination (a held lock is waited for or refused, on every rank)."""
import os

from hpcddp import settings
from hpcddp.launch import detect

_info = detect()
_size = _info.size if _info else 1
# must be set before hpcddp.comm.init() builds the topology
os.environ["HPCDDP_RANKS_PER_NODE"] = "2" if _size == 4 else "1"

import json  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from hpcddp.data import DatasetError, StageError, open_dataset, pack, stage  # noqa: E402
from hpcddp.data import destlock  # noqa: E402
from hpcddp.data import manifest as mf  # noqa: E402

MPI_TIMEOUT = 300


@pytest.fixture(scope="module")
def rt():
    import hpcddp.comm as hc
    return hc.init()


@pytest.fixture
def tmp(rt):
    w = rt.world.mpi
    path = tempfile.mkdtemp(prefix="hpcddp-integrity-") if w.Get_rank() == 0 else None
    path = w.bcast(path, root=0)
    yield path
    w.Barrier()
    if w.Get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


def _items(n, seed):
    rng = np.random.default_rng(seed)
    return [(f"key{i:05d}", rng.bytes(int(rng.integers(500, 4000)))) for i in range(n)]


def _pack_on_root(rt, items, path, **kw):
    w = rt.world.mpi
    err = None
    if w.Get_rank() == 0:
        try:
            pack(items, path, progress=False, **kw)
        except Exception as exc:  # pragma: no cover - reported on every rank below
            err = repr(exc)
    err = w.bcast(err, root=0)
    assert err is None, err
    return mf.load(path)


def _node_dir(rt, tmp):
    return os.path.join(tmp, f"node{rt.topology.node}")


def _flip_value_byte(path, value):
    """Flip one byte of a sample's stored value in place (same size and inode)."""
    with open(path, "r+b") as f:
        blob = f.read()
        at = blob.find(value) + 11
        assert at > 10
        f.seek(at)
        f.write(bytes([blob[at] ^ 0x20]))


@pytest.mark.mpi
@pytest.mark.parametrize("fmt", ["lmdb", "hdf5"])
def test_flipped_byte_after_ready_caught_on_open_and_by_auto(rt, tmp, fmt):
    items = _items(40, seed=11)
    src = os.path.join(tmp, "src")
    m = _pack_on_root(rt, items, src, format=fmt, shard_bytes=20_000)
    dest = os.path.join(tmp, "node{node}")
    stage(src, dest, chunk_bytes=4096, progress=False)
    topo, w = rt.topology, rt.world.mpi
    node_dir = _node_dir(rt, tmp)
    ready = mf.read_marker(node_dir, mf.READY)
    assert sorted(ready["shard_stats"]) == sorted(s.name for s in m.shards)
    victim = m.shards[1]
    last = topo.num_nodes - 1
    if topo.is_leader and topo.node == last:   # one node's copy goes bad after READY
        _flip_value_byte(os.path.join(node_dir, victim.name), items[victim.first][1])
    w.Barrier()
    ds = open_dataset(node_dir)
    if topo.node == last:   # every rank of that node: an error, not the flipped sample
        with pytest.raises(DatasetError, match=rf"{victim.name} fails its crc32c check.*"
                                               rf"expected {victim.crc32c}.*--verify full"):
            ds[victim.first]
    else:
        assert ds[victim.first] == items[victim.first][1]
    assert ds[0] == items[0][1]

    # --verify auto (the default) re-hashes the shard whose stat changed since READY
    res = stage(src, dest, chunk_bytes=4096, progress=False)
    assert res.shards_copied == 1 and res.bytes_written_per_node[last] == victim.bytes
    fresh = open_dataset(node_dir)
    assert [fresh[i] for i in range(len(items))] == [v for _, v in items]


@pytest.mark.mpi
def test_auto_hashes_only_shards_changed_since_ready(rt, tmp, monkeypatch):
    items = _items(30, seed=12)
    src = os.path.join(tmp, "src")
    m = _pack_on_root(rt, items, src, shard_bytes=20_000)
    dest = os.path.join(tmp, "node{node}")
    stage(src, dest, progress=False)
    # shards written in the same clock tick as READY are not vouched for (file times are
    # coarse): the next run hashes them and records READY again, a tick later
    time.sleep(0.05)
    stage(src, dest, progress=False)
    topo, w = rt.topology, rt.world.mpi
    node_dir = _node_dir(rt, tmp)
    hashed = []
    real = mf.file_matches
    monkeypatch.setattr(mf, "file_matches", lambda p, s: hashed.append(s.name) or real(p, s))
    ready_before = os.stat(os.path.join(node_dir, mf.READY))
    res = stage(src, dest, progress=False)     # nothing changed: stat only, READY left alone
    assert res.shards_copied == 0 and hashed == []
    after = os.stat(os.path.join(node_dir, mf.READY))
    assert (after.st_ino, after.st_mtime_ns) == (ready_before.st_ino, ready_before.st_mtime_ns)
    if topo.is_leader:                         # touched, not changed: hashed, kept
        os.utime(os.path.join(node_dir, m.shards[0].name))
    time.sleep(0.05)                           # READY, re-recorded, a tick after the touch
    w.Barrier()
    res = stage(src, dest, progress=False)
    assert res.shards_copied == 0
    assert hashed == ([m.shards[0].name] if topo.is_leader else [])
    hashed.clear()
    res = stage(src, dest, progress=False)     # READY re-recorded the touched shard's stat
    assert res.shards_copied == 0 and hashed == []


@pytest.mark.mpi
def test_held_destination_waited_for_or_refused(rt, tmp, capfd, monkeypatch):
    items = _items(20, seed=13)
    src = os.path.join(tmp, "src")
    _pack_on_root(rt, items, src, shard_bytes=20_000)
    dest = os.path.join(tmp, "node{node}")
    topo, w = rt.topology, rt.world.mpi
    last_dir = os.path.join(tmp, f"node{topo.num_nodes - 1}")
    holder = None
    if w.Get_rank() == 0:   # another "stager" holds the last node's destination
        os.makedirs(last_dir, exist_ok=True)
        holder = destlock.DestLock(last_dir)
        assert holder.try_acquire() is None
    w.Barrier()
    with pytest.raises(StageError) as ei:      # refused at once, on every rank
        stage(src, dest, progress=False, lock_wait=0)
    msg = str(ei.value)
    assert f"{last_dir} on node {topo.num_nodes - 1}" in msg and "lock_wait=0" in msg
    assert f"pid {w.bcast(os.getpid(), root=0)} on host" in msg
    w.Barrier()            # every leader has returned (and let its own lock go) before the look
    for node in range(topo.num_nodes):         # nothing touched, no lock left by this job
        d = os.path.join(tmp, f"node{node}")
        assert not os.path.exists(os.path.join(d, mf.STAGING))
        assert os.path.exists(os.path.join(d, destlock.LOCK_NAME)) == (node == topo.num_nodes - 1)
    w.Barrier()
    if holder is not None:
        # the holder finishes when rank 0 tries its own lock a second time: after a round
        # that found the last node's destination held (and said so), whatever the timing
        tries = []
        real_try = destlock.DestLock.try_acquire

        def try_then_free(self):
            tries.append(self.path)
            if len(tries) == 2:
                holder.release()
            return real_try(self)
        monkeypatch.setattr(destlock.DestLock, "try_acquire", try_then_free)
    capfd.readouterr()
    res = stage(src, dest, progress=False, lock_wait=120)
    err = capfd.readouterr().err
    assert res.phases["lock"] > 0 and res.shards_copied == len(mf.load(src).shards) * topo.num_nodes
    if w.Get_rank() == 0:   # said once, by rank 0, with whom it waits for
        assert err.count("[rank0] stage: waiting for the destination lock") == 1, err
        assert "got the destination lock after" in err
    w.Barrier()                                # every leader has returned: locks released
    assert not any(os.path.exists(os.path.join(tmp, f"node{n}", destlock.LOCK_NAME))
                   for n in range(topo.num_nodes))
    ready = json.loads(open(os.path.join(_node_dir(rt, tmp), mf.READY)).read())
    assert ready["local_shards"]


@pytest.mark.mpi
@pytest.mark.parametrize("mode", destlock.MODES)
def test_lock_left_by_a_dead_stager_taken_over(rt, tmp, mode, monkeypatch, capfd):
    items = _items(10, seed=14)
    src = os.path.join(tmp, "src")
    _pack_on_root(rt, items, src)
    # as if the job had started with HPCDDP_STAGE_LOCK=mode (settings are read once)
    monkeypatch.setattr(settings, "_current", settings.get().replace(stage_lock=mode))
    topo, w = rt.topology, rt.world.mpi
    node_dir = _node_dir(rt, tmp)
    dead = 0
    if topo.is_leader:   # the record a killed stager leaves (its pid is gone)
        import subprocess
        import sys
        p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, timeout=60)
        dead = int(p.stdout)
        os.makedirs(node_dir, exist_ok=True)
        rec = dict(destlock.my_record(node_dir), pid=dead, pid_start=None)
        with open(os.path.join(node_dir, destlock.LOCK_NAME), "w") as f:
            json.dump(rec, f)
    w.Barrier()
    capfd.readouterr()
    res = stage(src, os.path.join(tmp, "node{node}"), progress=False, lock_wait=0)
    err = capfd.readouterr().err
    assert res.shards_copied == len(mf.load(src).shards) * topo.num_nodes
    if topo.is_leader:
        assert f"taking over the lock left by pid {dead} on host" in err, err
        assert f"pid {dead} is no longer running" in err
        assert not os.path.exists(os.path.join(node_dir, destlock.LOCK_NAME))
    w.Barrier()


@pytest.mark.mpi
def test_symlinks_planted_in_the_destination_are_not_written_through(rt, tmp):
    """Someone who can write the destinations plants symlinks to one of the user's files at
    the names a stager writes: the lock file (refused on every rank, naming it) and the
    temporary names of READY, STAGING and manifest.json for every rank's pid (random names
    now: the stage goes on). The user's file is untouched either way (docs/security.md)."""
    items = _items(10, seed=15)
    src = os.path.join(tmp, "src")
    _pack_on_root(rt, items, src)
    dest = os.path.join(tmp, "node{node}")
    topo, w = rt.topology, rt.world.mpi
    victim = os.path.join(tmp, "victim")
    pids = w.allgather(os.getpid())
    if w.Get_rank() == 0:
        with open(victim, "w") as f:
            f.write("mine")
        for node in range(topo.num_nodes):
            d = os.path.join(tmp, f"node{node}")
            os.makedirs(d)
            os.symlink(victim, os.path.join(d, destlock.LOCK_NAME))
            for name in (mf.READY, mf.STAGING, mf.MANIFEST):
                for pid in pids:
                    os.symlink(victim, os.path.join(d, f"{name}.tmp{pid}"))
    w.Barrier()
    with pytest.raises(StageError, match=rf"{destlock.LOCK_NAME}: \[Errno \d+\] Too many levels "
                                         rf"of symbolic links"):
        stage(src, dest, progress=False, lock_wait=0)
    w.Barrier()
    if w.Get_rank() == 0:
        for node in range(topo.num_nodes):
            os.unlink(os.path.join(tmp, f"node{node}", destlock.LOCK_NAME))
    w.Barrier()
    res = stage(src, dest, progress=False, lock_wait=0)
    assert res.shards_copied == len(mf.load(src).shards) * topo.num_nodes
    assert open(victim).read() == "mine"
    assert len(open_dataset(_node_dir(rt, tmp))) == len(items)
