"""ElasticBatchSampler without MPI: the healthy batches are torch's, and any sequence of
repartitions (ranks lost at any position) trains every sample of the epoch exactly once."""
import collections
import random

import pytest
import torch

from hpcddp.elastic import ElasticBatchSampler


@pytest.mark.parametrize("n,batch,ranks", [(240, 24, 3), (1438, 60, 4), (100, 10, 2), (97, 12, 4)])
def test_healthy_batches_are_distributed_sampler_and_loader(n, batch, ranks):
    for r in range(ranks):
        mine = ElasticBatchSampler(n, batch, ranks, r, seed=5)
        mine.set_epoch(2)
        ref_sampler = torch.utils.data.DistributedSampler(range(n), ranks, r, shuffle=True,
                                                          seed=5, drop_last=True)
        ref_sampler.set_epoch(2)
        ref = list(torch.utils.data.BatchSampler(ref_sampler, batch // ranks, drop_last=True))
        assert list(mine) == ref


@pytest.mark.parametrize("seed", range(20))
def test_every_sample_once_whatever_is_lost_where(seed):
    rnd = random.Random(seed)
    n, batch, ranks = rnd.randint(50, 400), rnd.choice([8, 12, 24, 60]), rnd.randint(2, 6)
    if batch < ranks:
        batch = ranks * 2
    samplers = [ElasticBatchSampler(n, batch, ranks, r, seed=seed) for r in range(ranks)]
    for s in samplers:
        s.set_epoch(1)
    epoch = samplers[0].order()
    seen = collections.Counter()
    pos = 0
    while pos < samplers[0].epoch_samples:
        chunks = samplers[0].chunks(pos)
        # train some steps on the current world, then lose ranks (or finish)
        steps = rnd.randint(1, len(chunks)) if len(samplers) > 1 else len(chunks)
        for chunk in chunks[:steps]:
            got = [i for s in samplers for i in s.local(chunk)]
            assert all(s.local(chunk) for s in samplers), "a rank got an empty batch"
            assert sorted(got) == sorted(epoch[chunk[0]:chunk[1]])
            seen.update(got)
            pos = chunk[1]
        if pos < samplers[0].epoch_samples and len(samplers) > 1:
            survivors = rnd.sample(range(len(samplers)), rnd.randint(1, len(samplers) - 1))
            samplers = [samplers[i] for i in sorted(survivors)]
            for new_rank, s in enumerate(samplers):
                s.repartition(len(samplers), new_rank, pos)
    assert set(seen) == set(epoch) and all(c == 1 for c in seen.values())
    assert len(epoch) == n // batch * batch


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="global_batch must be a positive int"):
        ElasticBatchSampler(100, 0, 2, 0)
    with pytest.raises(ValueError, match="smaller than the 4 ranks"):
        ElasticBatchSampler(100, 3, 4, 0)
    with pytest.raises(ValueError, match="rank=2 is out of range"):
        ElasticBatchSampler(100, 8, 2, 0).repartition(2, 2, 0)


def test_fault_injection_spec():
    from hpcddp.elastic._inject import parse
    assert parse("1@30:backward, 0@4:data,2@7") == [(1, 30, "backward"), (0, 4, "data"),
                                                   (2, 7, "backward")]
    assert parse("") == []
    with pytest.raises(ValueError, match="is not RANK@STEP"):
        parse("1-30")
    with pytest.raises(ValueError, match="PHASE one of"):
        parse("1@3:sideways")
