"""Elastic training: survive a lost rank (or node) and go on, over MPI with ULFM.

Opt-in. The job starts under an MPI with fault tolerance switched on (``mpirun --with-ft
ulfm``; docs/elastic.md lists the MPIs), and the training loop differs from plain DDP by a
few lines::

    import hpcddp, hpcddp.elastic as elastic
    hpcddp.init_process_group()
    sampler = elastic.ElasticBatchSampler(len(ds), global_batch=60, seed=0)
    loader = DataLoader(ds, batch_sampler=sampler, num_workers=1)
    state = elastic.State(model, opt, sampler, scheduler=sched)   # wraps model in DDP
    for epoch in state.epochs(12):
        for x, y in state.batches(loader):
            with state.step():
                loss = F.cross_entropy(state.model(x), y)
                opt.zero_grad(); loss.backward(); opt.step(); sched.step()

When a rank dies, the survivors' MPI calls fail (MPI_ERR_PROC_FAILED / MPI_ERR_REVOKED),
the step is abandoned, and before the next batch the survivors shrink the world, take model,
optimizer and scheduler state from one of them, rebuild the torch group and DDP, deal the
rest of the epoch over themselves and retry. With ``State(..., regrow=True)`` they then
spawn a replacement per lost rank and go on at full size (docs/elastic.md, "Growing back").
"""
from hpcddp.elastic._sampler import ElasticBatchSampler
from hpcddp.elastic._state import Recovery, State, is_process_failure, is_replacement
from hpcddp.elastic._support import (ElasticUnsupportedError, check_support,
                                     support_problem)

__all__ = ["ElasticBatchSampler", "ElasticUnsupportedError", "Recovery", "State",
           "check_support", "is_process_failure", "is_replacement", "support_problem"]
