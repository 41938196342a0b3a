"""A 2-D device mesh over hpcddp (4 ranks: dp x tp = 2 x 2): DTensor on both dimensions, and
tensor parallel inside FSDP2 (HSDP-style), trained against one process."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)

import hpcddp

MPI_SIZES = (4,)
TOL = 1e-10


@pytest.fixture(scope="module")
def mesh():
    if not dist.is_initialized():
        hpcddp.init_process_group()
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def test_dtensor_sharded_on_both_dimensions(mesh):
    x = torch.arange(48, dtype=torch.float64).view(6, 8)
    d = distribute_tensor(x, mesh, [Shard(0), Shard(1)])
    assert d.to_local().shape == (3, 4)
    assert torch.equal(d.full_tensor(), x)
    names = [mesh[d].get_group().group_name for d in ("dp", "tp")]
    assert all(isinstance(n, str) and n for n in names) and names[0] != names[1]


def test_fsdp2_over_tensor_parallel_trains_as_one_process(mesh):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 6)).double()
    model = copy.deepcopy(ref)
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    opts = [torch.optim.Adam(m.parameters(), lr=0.01) for m in (model, ref)]
    dp = mesh["dp"].get_local_rank()
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(8, 6, generator=g, dtype=torch.float64)
        y = torch.randn(8, 6, generator=g, dtype=torch.float64)
        for o in opts:
            o.zero_grad()
        # each dp replica: its half of the batch; both tp ranks of a replica see the same half
        nn.functional.mse_loss(model(x[4 * dp:4 * dp + 4]), y[4 * dp:4 * dp + 4]).backward()
        nn.functional.mse_loss(ref(x), y).backward()
        for o in opts:
            o.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        full = p.full_tensor() if isinstance(p, DTensor) else p
        assert torch.allclose(full, q, atol=TOL), f"{name}: {(full - q).abs().max():.3e}"
