"""pack -> stage -> read inside an MPI job (2, 3, 4 ranks) with emulated nodes.

Nodes: 2 and 3 ranks run one rank per node (2 and 3 nodes); 4 ranks run 2 nodes of 2 ranks
(leaders and non-leaders). Rank 0 packs into a shared temporary directory; every node stages
into its own ``node{node}`` directory; leaders compare files byte for byte with the source.
"""
import os

from hpcddp.launch import detect

_info = detect()
_size = _info.size if _info else 1
# must be set before hpcddp.comm.init() builds the topology
os.environ["HPCDDP_RANKS_PER_NODE"] = "2" if _size == 4 else "1"

import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from hpcddp.data import (DistributedEvalSampler, DistributedSampler, MetricSums,  # noqa: E402
                         StageError, open_dataset, pack, stage)
from hpcddp.data import manifest as mf  # noqa: E402

MPI_TIMEOUT = 300


@pytest.fixture(scope="module")
def rt():
    # imported here, not at the top: spawn DataLoader workers import this module to unpickle
    # _decode, and importing hpcddp.comm starts MPI (a worker would join the job as a rank)
    import hpcddp.comm as hc
    return hc.init()


@pytest.fixture
def tmp(rt):
    w = rt.world.mpi
    path = tempfile.mkdtemp(prefix="hpcddp-stage-") if w.Get_rank() == 0 else None
    path = w.bcast(path, root=0)
    yield path
    w.Barrier()
    if w.Get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


def _items(n, seed, lo=0, hi=9000):
    rng = np.random.default_rng(seed)
    return [(f"key{i:05d}", rng.bytes(int(rng.integers(lo, hi)))) for i in range(n)]


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


def _dest(tmp):
    return os.path.join(tmp, "node{node}")


def _check_copy(rt, src, dest_tpl, items, shards=None):
    """Leaders: byte-identical files (all, or the listed shards); everyone: readable samples."""
    topo = rt.topology
    m = mf.load(src)
    node_dir = dest_tpl.replace("{node}", str(topo.node))
    assert os.path.exists(os.path.join(node_dir, mf.READY))
    assert not os.path.exists(os.path.join(node_dir, mf.STAGING))
    if topo.is_leader:
        want = range(len(m.shards)) if shards is None else shards
        for s in want:
            name = m.shards[s].name
            with open(os.path.join(src, name), "rb") as a, open(os.path.join(node_dir, name), "rb") as b:
                assert a.read() == b.read(), f"node {topo.node}: {name} differs"
        with open(os.path.join(src, mf.MANIFEST), "rb") as a, \
                open(os.path.join(node_dir, mf.MANIFEST), "rb") as b:
            assert a.read() == b.read()
        assert not [n for n in os.listdir(node_dir) if n.endswith(mf.PARTIAL_SUFFIX)]
    ds = open_dataset(node_dir)
    idx = range(len(ds)) if ds.local_indices is None else ds.local_indices.tolist()
    for i in idx:
        got = ds[i]
        assert (got[0] if isinstance(got, tuple) else got) == items[i][1]
    return ds


@pytest.mark.mpi
@pytest.mark.parametrize("fmt", ["lmdb", "hdf5"])
@pytest.mark.parametrize("strategy", ["bcast", "allgather", "ring", "every-rank"])
def test_round_trip_replicate(rt, tmp, fmt, strategy):
    items = _items(97, seed=1)  # ~440 KB in 11..12 uneven shards
    src = os.path.join(tmp, "src")
    m = _pack_on_root(rt, items, src, format=fmt, shard_bytes=40_000)
    # chunks far smaller than a shard: every shard travels in many pieces
    res = stage(src, _dest(tmp), strategy=strategy, chunk_bytes=7_000, progress=False)
    _check_copy(rt, src, _dest(tmp), items)
    topo = rt.topology
    dataset_bytes = m.total_bytes + os.path.getsize(os.path.join(src, mf.MANIFEST))
    assert res.dataset_bytes == dataset_bytes
    assert res.nodes == topo.num_nodes and res.groups == 1
    assert res.bytes_written_per_node == [m.total_bytes * (topo.local_size if strategy == "every-rank" else 1)] * topo.num_nodes
    if strategy == "every-rank":
        assert res.bytes_read_from_source == rt.world.size * dataset_bytes
    else:
        assert res.bytes_read_from_source == dataset_bytes  # read once, counted
        assert res.read_amplification == 1.0
    # a second run finds everything in place
    again = stage(src, _dest(tmp), strategy=strategy, chunk_bytes=7_000, progress=False)
    assert again.shards_copied == 0 and again.shards_skipped == len(m.shards) * topo.num_nodes
    assert again.bytes_read_per_group == [res.bytes_read_per_group[0] - m.total_bytes * (
        rt.world.size if strategy == "every-rank" else 1)]


@pytest.mark.mpi
def test_groups_read_once_each(rt, tmp):
    items = _items(40, seed=2)
    src = os.path.join(tmp, "src")
    m = _pack_on_root(rt, items, src, shard_bytes=30_000)
    nodes = rt.topology.num_nodes
    res = stage(src, _dest(tmp), group_nodes=2, chunk_bytes=4096, progress=False)
    groups = (nodes + 1) // 2
    assert res.groups == groups
    per = m.total_bytes + os.path.getsize(os.path.join(src, mf.MANIFEST))
    assert res.bytes_read_per_group == [per] * groups
    _check_copy(rt, src, _dest(tmp), items)


@pytest.mark.mpi
@pytest.mark.parametrize("fmt", ["lmdb", "hdf5"])
def test_empty_and_single_sample(rt, tmp, fmt):
    for name, items in (("empty", []), ("one", [("only", b"\x07" * 10)])):
        src = os.path.join(tmp, name)
        _pack_on_root(rt, items, src, format=fmt)
        dest = os.path.join(tmp, name + "-{node}")
        res = stage(src, dest, progress=False)
        assert res.num_samples == len(items)
        ds = _check_copy(rt, src, dest, items)
        assert len(ds) == len(items)


@pytest.mark.mpi
def test_partition_mode_sampler_and_exact_eval(rt, tmp):
    items = [(f"k{i}", bytes([i % 251]) * (300 + 7 * i), i % 5) for i in range(61)]
    src = os.path.join(tmp, "src")
    m = _pack_on_root(rt, items, src, format="hdf5", shard_bytes=3_000)
    res = stage(src, _dest(tmp), mode="partition", group_nodes=2, chunk_bytes=1024,
                progress=False)
    topo = rt.topology
    w = rt.world.mpi
    node_dir = _dest(tmp).replace("{node}", str(topo.node))
    ds = open_dataset(node_dir)
    local = set(ds.local_indices.tolist())
    # within each group, the nodes' shard sets are disjoint and cover the data set
    groups = (topo.num_nodes + 1) // 2
    per_node = w.allgather((topo.node, tuple(sorted(ds.local_shards))))
    by_group = {}
    for node, shards in dict(per_node).items():
        by_group.setdefault(node // 2, []).append(set(shards))
    for g, sets in by_group.items():
        assert set().union(*sets) == set(range(len(m.shards)))
        assert sum(map(len, sets)) == len(m.shards)
    assert res.bytes_read_per_group == [m.total_bytes + os.path.getsize(os.path.join(src, mf.MANIFEST))] * groups
    _check_copy(rt, src, _dest(tmp), [(k, v) for k, v, _ in items], shards=sorted(ds.local_shards))

    # training: same number of steps everywhere, only local indices
    sampler = DistributedSampler(ds, shuffle=True, seed=3)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        idx = list(sampler)
        assert set(idx) <= local
        assert len(set(w.allgather(len(idx)))) == 1

    # evaluation: every sample exactly once across the job, metrics exact
    ev = DistributedEvalSampler(ds)
    seen = sum(w.allgather(list(ev)), [])
    assert sorted(seen) == list(range(len(items)))
    sums = MetricSums()
    for i in ev:
        value, label = ds[i]
        sums.add("len", len(value), 1)
        sums.add("label", label, 1)
    res = sums.reduce()
    assert sums.counts == {"len": 61, "label": 61}
    assert res["len"] == pytest.approx(np.mean([len(v) for _, v, _ in items]))
    assert res["label"] == pytest.approx(np.mean([lab for _, _, lab in items]))


@pytest.mark.mpi
def test_corrupted_source_shard_detected(rt, tmp):
    items = _items(30, seed=4)
    src = os.path.join(tmp, "src")
    m = _pack_on_root(rt, items, src, shard_bytes=30_000)
    w = rt.world.mpi
    victim = os.path.join(src, m.shards[1].name)
    if w.Get_rank() == 0:
        with open(victim, "r+b") as f:
            f.seek(5000)
            b = f.read(1)
            f.seek(5000)
            f.write(bytes([b[0] ^ 0x55]))
    w.Barrier()
    with pytest.raises(StageError, match="checksum mismatch") as ei:
        stage(src, _dest(tmp), chunk_bytes=8192, progress=False)
    assert m.shards[1].name in str(ei.value) and "nothing marked READY" in str(ei.value)
    node_dir = _dest(tmp).replace("{node}", str(rt.topology.node))
    assert not os.path.exists(os.path.join(node_dir, mf.READY))
    with pytest.raises(mf.NotReadyError):
        open_dataset(node_dir)
    w.Barrier()
    if w.Get_rank() == 0:  # repair the source: the re-run copies only what is missing
        with open(victim, "r+b") as f:
            f.seek(5000)
            b = f.read(1)
            f.seek(5000)
            f.write(bytes([b[0] ^ 0x55]))
    w.Barrier()
    res = stage(src, _dest(tmp), chunk_bytes=8192, progress=False)
    assert res.shards_copied == rt.topology.num_nodes  # just the bad shard, on each node
    _check_copy(rt, src, _dest(tmp), items)


@pytest.mark.mpi
def test_corrupted_staged_shard_replaced(rt, tmp):
    items = _items(30, seed=5)
    src = os.path.join(tmp, "src")
    m = _pack_on_root(rt, items, src, format="hdf5", shard_bytes=30_000)
    stage(src, _dest(tmp), chunk_bytes=8192, progress=False)
    topo = rt.topology
    node_dir = _dest(tmp).replace("{node}", str(topo.node))
    if topo.is_leader and topo.node == 0:  # flip a byte on node 0 only, size unchanged
        p = os.path.join(node_dir, m.shards[0].name)
        data = bytearray(open(p, "rb").read())
        data[len(data) // 2] ^= 0xFF
        open(p, "wb").write(bytes(data))
        assert open_dataset(node_dir).verify() == [m.shards[0].name]
    rt.world.mpi.Barrier()
    res = stage(src, _dest(tmp), verify="full", chunk_bytes=8192, progress=False)
    assert res.shards_copied == 1
    assert res.bytes_written_per_node[0] == m.shards[0].bytes
    assert res.bytes_read_from_source == m.shards[0].bytes + os.path.getsize(os.path.join(src, mf.MANIFEST))
    _check_copy(rt, src, _dest(tmp), items)


@pytest.mark.mpi
def test_resume_keeps_verified_shards(rt, tmp):
    items = _items(50, seed=6)
    src = os.path.join(tmp, "src")
    m = _pack_on_root(rt, items, src, shard_bytes=30_000)
    stage(src, _dest(tmp), chunk_bytes=8192, progress=False)
    topo = rt.topology
    node_dir = _dest(tmp).replace("{node}", str(topo.node))
    lost = [0, len(m.shards) - 1] if topo.node == topo.num_nodes - 1 else []
    if topo.is_leader:  # as a killed stager leaves it: STAGING, partial files, missing shards
        for s in lost:
            os.rename(os.path.join(node_dir, m.shards[s].name),
                      os.path.join(node_dir, mf.partial_name(m.shards[s].name)))
        open(os.path.join(node_dir, mf.STAGING), "w").write("{}")
        os.remove(os.path.join(node_dir, mf.READY))
    rt.world.mpi.Barrier()
    with pytest.raises(mf.NotReadyError, match="half-staged"):
        open_dataset(node_dir)
    res = stage(src, _dest(tmp), chunk_bytes=8192, progress=False)
    assert res.shards_copied == 2
    assert res.shards_skipped == len(m.shards) * topo.num_nodes - 2
    _check_copy(rt, src, _dest(tmp), items)


@pytest.mark.mpi
def test_errors_are_collective(rt, tmp):
    items = _items(5, seed=7)
    src = os.path.join(tmp, "src")
    _pack_on_root(rt, items, src)
    with pytest.raises(StageError, match="no manifest.json|cannot read the source manifest"):
        stage(os.path.join(tmp, "missing"), _dest(tmp), progress=False)
    if rt.topology.num_nodes > 1:
        with pytest.raises(StageError, match=r"put \{node\} in DEST"):
            stage(src, os.path.join(tmp, "same"), progress=False)
    with pytest.raises(StageError, match="HPCDDP_SURELY_UNSET"):
        stage(src, "$HPCDDP_SURELY_UNSET/x", progress=False)
    with pytest.raises(ValueError, match="mode="):
        stage(src, _dest(tmp), mode="mirror")


def _decode(b):
    import torch
    return torch.tensor(len(b))


@pytest.mark.mpi
@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_dataloader_workers_on_staged_copy(rt, tmp, ctx):
    import torch
    items = _items(24, seed=8, hi=2000)
    src = os.path.join(tmp, "src")
    _pack_on_root(rt, items, src, format="lmdb", shard_bytes=8_000)
    stage(src, _dest(tmp), progress=False)
    ds = open_dataset(_dest(tmp).replace("{node}", str(rt.topology.node)), decode=_decode)
    ds[0]  # handles open in the parent before the workers start
    sampler = DistributedEvalSampler(ds)
    w = rt.world.mpi
    # spawn costs a fresh interpreter importing torch per worker: on rank 0 only (the unit
    # tests spawn for both formats); fork everywhere
    workers = 2 if ctx == "fork" or w.Get_rank() == 0 else 0
    loader = torch.utils.data.DataLoader(ds, batch_size=4, sampler=sampler, num_workers=workers,
                                         multiprocessing_context=ctx if workers else None)
    got = torch.cat([b for b in loader]).tolist() if len(sampler) else []
    assert got == [len(items[i][1]) for i in sampler]
    req = w.Ibarrier()  # wait without spinning: rank 0's workers need the cores
    while not req.Test():
        time.sleep(0.01)
    assert sorted(sum(w.allgather(list(sampler)), [])) == list(range(24))
