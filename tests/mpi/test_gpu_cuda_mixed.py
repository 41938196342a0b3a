"""Mixed mode: hpcddp (MPI) for CPU tensors, another backend for CUDA tensors, one process
group, bootstrapped through MPI (no MASTER_ADDR): "cpu:hpcddp,cuda:nccl".

With a GPU and NCCL this is ``hpcddp.init_process_group(device="cuda")``. Without one, gloo
stands in for NCCL ("cpu:hpcddp,cuda:gloo"): the wiring of the two backends is the same, and
that is what these tests check on a CPU-only machine.

torch builds the per-device backends in device order and stops at the first creator that
returns a Python ProcessGroup subclass, which ProcessGroupHPCDDP is; so the hpcddp group
creates the other devices' backends itself from the map torch recorded
(hpcddp/backend/devices.py): test_cuda_device_gets_its_own_backend checks the CUDA one is
torch's own backend, registered on the group.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hpcddp
from hpcddp.backend import init_process_group

MPI_OWN_JOB = True    # its own default group (a mixed cpu/cuda backend), set up and torn down here
MPI_SIZES = (2, 3)
GPU = torch.cuda.is_available() and dist.is_nccl_available()
needs_gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU and NCCL; CI has none")


@pytest.fixture(scope="module")
def world():
    comm = hpcddp.init().world
    if GPU:
        init_process_group(device="cuda")              # picks "cpu:hpcddp,cuda:nccl"
    else:
        init_process_group("cpu:hpcddp,cuda:gloo")     # gloo stands in for NCCL
    yield comm
    dist.destroy_process_group()


def test_backend_config_names_both(world):
    cfg = str(dist.get_backend_config())
    assert "cpu:hpcddp" in cfg and ("cuda:nccl" in cfg if GPU else "cuda:gloo" in cfg), cfg


def test_cpu_tensors_use_hpcddp(world):
    t = torch.full((5,), float(world.rank))
    dist.all_reduce(t)
    assert torch.all(t == sum(range(world.size)))
    out = [None] * world.size
    dist.all_gather_object(out, {"rank": world.rank})
    assert out == [{"rank": r} for r in range(world.size)]


def test_cuda_device_gets_its_own_backend(world):
    backend = dist.group.WORLD._get_backend(torch.device("cuda"))
    assert type(backend).__name__ == ("ProcessGroupNCCL" if GPU else "ProcessGroupGloo")


@needs_gpu
def test_cuda_all_reduce_correct(world):
    """CUDA tensors go to the map's CUDA backend (NCCL)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    t = torch.full((1 << 20,), float(world.rank + 1), device=dev)
    dist.all_reduce(t)
    assert torch.all(t == sum(range(1, world.size + 1))).item()


@needs_gpu
def test_ddp_on_cuda_in_mixed_mode(world):
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3).to(dev)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[dev.index])
    g = torch.Generator().manual_seed(world.rank)
    inp = torch.randn(4, 8, generator=g).to(dev)
    ddp(inp).sum().backward()
    grads = [torch.zeros_like(model.weight.grad) for _ in range(world.size)]
    dist.all_gather(grads, model.weight.grad)
    for g in grads[1:]:
        torch.testing.assert_close(g, grads[0])        # every rank holds the same average
