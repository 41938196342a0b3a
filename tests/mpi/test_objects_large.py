"""One object over 2 GiB through the object collectives, at 2 ranks.

MPI-3 counts are C ints: one call moves at most 2**31 - 1 elements. torch's
broadcast_object_list pickles the object into one uint8 tensor and broadcasts it through our
broadcast, so a 2 GiB object is a broadcast of more than 2**31 - 1 elements (hpcddp splits
it); the direct API goes through mpi4py's pkl5, which splits its messages itself.

Opt-in (HPCDDP_TEST_LARGE=1), because it is too heavy for CI: torch's path holds the object,
its pickle and a tensor copy on the source and the tensor, a bytes copy and the unpickled
object on the receiver, 2 GiB each. Measured on the 2-core, 24 GB machine under load: 227 s
and 13.5 GB above the baseline at the job's peak. The same pieced code paths run in every CI job at
2, 3 and 4 ranks with a lowered limit (test_collectives_large.py).

    HPCDDP_TEST_LARGE=1 python -m pytest tests/test_mpi_suites.py -k objects_large
"""
from __future__ import annotations

import gc
import os

import pytest
import torch
import torch.distributed as dist

import hpcddp

MPI_SIZES = (2,)
MPI_TIMEOUT = 900

SIZE = (1 << 31) + (1 << 20)  # just over 2 GiB, not a multiple of any chunk size
pytestmark = pytest.mark.skipif(os.environ.get("HPCDDP_TEST_LARGE", "0") != "1",
                                reason="objects over 2 GiB: opt in with HPCDDP_TEST_LARGE=1 "
                                       "(~19 GB of memory)")


def big_object(rank: int) -> bytearray:
    b = bytearray(SIZE)  # zero pages until written: cheap to make
    b[0], b[SIZE // 2], b[-1] = 1 + rank, 2 + rank, 3 + rank
    return b


def check(obj, rank: int) -> None:
    assert isinstance(obj, bytearray) and len(obj) == SIZE
    assert (obj[0], obj[SIZE // 2], obj[-1]) == (1 + rank, 2 + rank, 3 + rank)
    assert obj[1:4096] == bytes(4095)  # and a zero-filled stretch where nothing was set


@pytest.fixture(scope="module", autouse=True)
def pg():
    if not dist.is_initialized():
        hpcddp.init_process_group()
    yield
    gc.collect()


def test_broadcast_object_list_over_2gib():
    r = dist.get_rank()
    lst = [big_object(0), "tail"] if r == 0 else [None, None]
    dist.broadcast_object_list(lst, src=0)
    check(lst[0], 0)
    assert lst[1] == "tail"
    del lst
    gc.collect()


def test_broadcast_tensor_over_2gib():
    """The tensor op under it: a uint8 tensor of more than 2**31 - 1 elements, blocking and
    async, through dist and the direct API."""
    r = dist.get_rank()
    t = torch.zeros(SIZE, dtype=torch.uint8)
    if r == 1:
        t[0], t[-1] = 5, 6
    dist.broadcast(t, src=1)
    assert (t[0].item(), t[-1].item(), t[SIZE // 2].item()) == (5, 6, 0)
    if r == 0:
        t[-1] = 7
    hpcddp.broadcast(t, 0, async_op=True).wait()
    assert t[-1].item() == 7
    del t
    gc.collect()


def test_all_reduce_over_2gib():
    """Blocking all_reduce: MPI refuses the count, hpcddp reduces piece by piece."""
    r = dist.get_rank()
    t = torch.ones(SIZE, dtype=torch.uint8)
    t[-1] = 1 + r
    dist.all_reduce(t)
    assert (t[0].item(), t[SIZE // 2].item(), t[-1].item()) == (2, 2, 3)
    del t
    gc.collect()


def test_direct_broadcast_object_over_2gib():
    r = dist.get_rank()
    got = hpcddp.broadcast_object(big_object(1) if r == 1 else None, src=1)
    check(got, 1)
    del got
    gc.collect()


def test_send_object_list_over_2gib():
    r = dist.get_rank()
    if r == 0:
        dist.send_object_list([big_object(0)], dst=1)
    else:
        lst = [None]
        dist.recv_object_list(lst, src=0)
        check(lst[0], 0)
        del lst
    gc.collect()
    dist.barrier()
