"""Samplers and exact metrics without MPI (explicit ranks; a fake communicator)."""
import numpy as np
import pytest
import torch

from hpcddp.data import DistributedEvalSampler, DistributedSampler, MetricSums, padding_mask
from hpcddp.data.metrics import reduce_sums


class _DS:
    def __init__(self, n, local=None, info=None, manifest=None, local_shards=None):
        self.n, self.local_indices, self.stage_info = n, local, info
        self.manifest, self.local_shards = manifest, local_shards

    def __len__(self):
        return self.n


@pytest.mark.parametrize("n", [0, 1, 7, 10, 13])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
def test_matches_torch(n, world, shuffle, drop_last):
    ds = _DS(n)
    for epoch in (0, 3):
        for r in range(world):
            ours = DistributedSampler(ds, world, r, shuffle=shuffle, seed=5, drop_last=drop_last)
            theirs = torch.utils.data.DistributedSampler(ds, world, r, shuffle=shuffle, seed=5,
                                                         drop_last=drop_last)
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs) and len(ours) == len(theirs)


@pytest.mark.parametrize("n", [1, 7, 10, 13])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_padding_mask_counts_each_sample_once(n, world):
    seen = []
    for r in range(world):
        s = torch.utils.data.DistributedSampler(_DS(n), world, r, shuffle=True, seed=1)
        idx = np.array(list(s))
        seen += idx[padding_mask(n, world, r)].tolist()
    assert sorted(seen) == list(range(n))


@pytest.mark.parametrize("n", [0, 1, 5, 10, 11])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_eval_sampler_exact(n, world):
    parts = [list(DistributedEvalSampler(_DS(n), world, r)) for r in range(world)]
    assert sum(parts, []) == list(range(n))  # in order, each once
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_local_mode_equal_lengths_and_local_only():
    # 2 nodes x 2 ranks; node 0 holds 0..5, node 1 holds 6..12 (uneven)
    n, pools = 13, {0: list(range(6)), 1: list(range(6, 13))}
    lens = set()
    for epoch in range(3):
        per_node = {0: [], 1: []}
        for rank in range(4):
            node, lr = divmod(rank, 2)
            s = DistributedSampler(_DS(n, local=pools[node]), 4, rank, seed=2,
                                   local_rank=lr, local_size=2)
            s.set_epoch(epoch)
            idx = list(s)
            lens.add(len(idx))
            assert set(idx) <= set(pools[node])
            per_node[node] += idx
        assert len(set(per_node[0])) == 6  # the short node covers all of its pool
    assert lens == {4}  # ceil(13 / 4) on every rank


def test_local_mode_needs_position_and_samples():
    with pytest.raises(ValueError, match="local_rank and local_size"):
        DistributedSampler(_DS(4, local=[0, 1]), 2, 0)
    with pytest.raises(ValueError, match="holds no samples"):
        DistributedSampler(_DS(4, local=[]), 2, 0, local_rank=0, local_size=1)
    with pytest.raises(ValueError, match="out of range"):
        DistributedSampler(_DS(4), 2, 2)


class _FakeComm:
    """Sums a fixed set of ranks' contributions: enough to test the reduction's bookkeeping."""

    def __init__(self, others):
        self.others = others  # list of (names, buffer-producing dict sums/counts)

    def allgather(self, names):
        return [names] + [sorted(set(s) | set(c)) for s, c in self.others]

    def Allreduce(self, buf, out, op=None):
        out[:] = buf
        names = self._names
        for s, c in self.others:
            for i, k in enumerate(names):
                out[2 * i] += s.get(k, 0.0)
                out[2 * i + 1] += c.get(k, 0)


def test_metric_sums_with_empty_rank(monkeypatch):
    m = MetricSums()
    m.add("loss", torch.tensor(6.0), 3)
    m.add_samples("acc", torch.tensor([1.0, 0.0, 1.0, 1.0]), mask=[True, True, True, False])
    comm = _FakeComm([({}, {}), ({"loss": 4.0, "acc": 1.0}, {"loss": 2, "acc": 2})])
    comm._names = ["acc", "loss"]
    res = m.reduce(comm)
    assert m.counts == {"acc": 5, "loss": 5}
    assert res == pytest.approx({"loss": 2.0, "acc": 3.0 / 5})


def test_reduce_sums_agrees_names():
    comm = _FakeComm([({"b": 1.0}, {"b": 1})])
    comm._names = ["a", "b"]
    sums, counts = reduce_sums({"a": 2.0}, {"a": 1}, comm)
    assert sums == {"a": 2.0, "b": 1.0} and counts == {"a": 1, "b": 1}
