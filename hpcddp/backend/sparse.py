"""Sparse tensors: all_reduce of a sparse COO tensor (an ``nn.Embedding(sparse=True)``'s
gradient under DDP), as gloo does it. MPI reduces dense buffers only, so every rank gathers
every rank's indices and values (padded to the largest nnz), sums and coalesces them in rank
order, so every rank computes the same floats."""
from __future__ import annotations

import torch
import torch.distributed as dist

from hpcddp import collectives as C
from hpcddp.collectives.work import CompletedWork


def all_reduce(comm, tensor, op):
    """TENSOR (sparse COO) becomes the SUM over COMM's ranks, in place; a completed Work."""
    fn = "all_reduce"
    if getattr(op, "op", op) != dist.ReduceOp.SUM:
        raise ValueError(f"{fn}: a sparse tensor can only be reduced with ReduceOp.SUM "
                         f"(as gloo), got {op}")
    n = comm.size
    mine = tensor.coalesce()
    sizes = torch.tensor(list(tensor.shape), dtype=torch.int64)
    shapes = torch.empty(n * sizes.numel(), dtype=torch.int64)
    C.all_gather_into_tensor(shapes, sizes, comm, False)
    if not torch.equal(shapes.view(n, -1), sizes.expand(n, -1)):
        raise ValueError(f"{fn}: sparse tensors differ in shape between ranks: "
                         f"{shapes.view(n, -1).tolist()} (rank order); every rank must pass "
                         f"the same shape")
    nnz = torch.empty(n, dtype=torch.int64)
    C.all_gather_into_tensor(nnz, torch.tensor([mine._nnz()], dtype=torch.int64), comm, False)
    most = int(nnz.max())
    idx, val = mine.indices(), mine.values()
    pad_idx = idx.new_zeros((idx.shape[0], most))
    pad_idx[:, :idx.shape[1]] = idx
    pad_val = val.new_zeros((most, *val.shape[1:]))
    pad_val[:val.shape[0]] = val
    all_idx = idx.new_empty((n, *pad_idx.shape))
    all_val = val.new_empty((n, *pad_val.shape))
    C.all_gather_into_tensor(all_idx, pad_idx.contiguous(), comm, False)
    C.all_gather_into_tensor(all_val, pad_val.contiguous(), comm, False)
    parts = [(all_idx[r][:, :int(nnz[r])], all_val[r][:int(nnz[r])]) for r in range(n)]
    total = torch.sparse_coo_tensor(torch.cat([i for i, _ in parts], 1),
                                    torch.cat([v for _, v in parts]), tensor.shape,
                                    dtype=tensor.dtype).coalesce()
    tensor.copy_(total)
    return CompletedWork([tensor])
