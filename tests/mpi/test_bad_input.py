"""Bad arguments raise on the calling rank before any message, naming the function, the
argument, what was expected and what arrived; no segfault, no hang.

Each case runs on the ranks that can see the mistake (every rank when the mistake is in an
argument all ranks pass; the root alone for root-only arguments such as scatter_list) and is
followed by an all_reduce whose value would be wrong, or would fail with MPI_ERR_TRUNCATE, had
any message of the refused call been sent. The direct API's messages are checked word for
word; through dist.*, torch's own wrapper sometimes refuses first (its wording), which is
checked to name the function at least.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hpcddp
import test_collectives as M  # noqa: E402  (tests/mpi is on sys.path: pytest's rootdir import)
from hpcddp.comm.buffers import TensorError

MPI_TIMEOUT = 240
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

_step = [0]


def in_step():
    """Every rank still in step: a message sent by a refused call would spoil this one."""
    _step[0] += 1
    n = dist.get_world_size()
    t = torch.full((3,), float(_step[0] + dist.get_rank()))
    dist.all_reduce(t)
    assert t.eq(n * _step[0] + n * (n - 1) / 2).all(), t


def refuses(fn, exc, *needles):
    with pytest.raises(exc) as info:
        fn()
    msg = str(info.value)
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"
    return msg


@pytest.fixture(scope="module")
def world():
    return M.init_world()


def test_mixed_dtypes_and_shapes_in_lists(world):
    n = dist.get_world_size()
    f32, f64 = torch.zeros(2), torch.zeros(2, dtype=torch.float64)
    mixed = [f32.clone() for _ in range(n - 1)] + [f64]
    refuses(lambda: hpcddp.all_gather(mixed, f32), TensorError,
            "all_gather:", f"tensor_list[{n - 1}]", "torch.float64", "expected torch.float32")
    refuses(lambda: dist.all_gather(mixed, f32), ValueError, "different dtypes")  # torch's check
    refuses(lambda: hpcddp.all_to_all([f32] * n, mixed), TensorError,
            "all_to_all:", "input_tensor_list", "torch.float64")
    refuses(lambda: hpcddp.reduce_scatter(f32, mixed), TensorError,
            "reduce_scatter:", f"input_list[{n - 1}]", "torch.float64", "torch.float32")
    shapes = [torch.zeros(2) for _ in range(n - 1)] + [torch.zeros(3)]
    refuses(lambda: hpcddp.all_gather(shapes, torch.zeros(2)), ValueError,
            "all_gather:", f"tensor_list[{n - 1}]", "3 elements", "expected 2")
    refuses(lambda: hpcddp.reduce_scatter(torch.zeros(2), shapes), TensorError,
            "reduce_scatter:", f"input_list[{n - 1}]", "shape [3]", "expected [2]")
    if dist.get_rank() == 0:  # root-only arguments: only the root can see them
        refuses(lambda: hpcddp.scatter(torch.zeros(2), shapes, src=0), TensorError,
                "scatter:", f"scatter_list[{n - 1}]", "shape [3]", "expected [2]")
        refuses(lambda: hpcddp.gather(torch.zeros(2), mixed, dst=0), TensorError,
                "gather:", f"gather_list[{n - 1}]", "torch.float64")
        refuses(lambda: dist.scatter(torch.zeros(2), shapes, src=0), Exception, "scatter")
    # output and input that disagree
    refuses(lambda: hpcddp.all_gather_into_tensor(torch.zeros(2 * n), torch.zeros(2, dtype=torch.int32)),
            TypeError, "all_gather_into_tensor:", "output_tensor", "torch.float32",
            "torch.int32")
    refuses(lambda: hpcddp.all_gather_into_tensor(torch.zeros(2 * n + 1), torch.zeros(2)),
            ValueError, "all_gather_into_tensor:", f"{2 * n + 1} elements", f"expected {2 * n}")
    refuses(lambda: hpcddp.reduce_scatter_tensor(torch.zeros(2), torch.zeros(2 * n + 1)),
            ValueError, "reduce_scatter_tensor:", f"{2 * n + 1} elements", f"expected {2 * n}")
    refuses(lambda: dist.reduce_scatter_tensor(torch.zeros(2), torch.zeros(2 * n + 1)),
            Exception, "reduce_scatter_tensor")
    refuses(lambda: hpcddp.all_to_all_single(torch.zeros(2 * n), torch.zeros(2 * n, dtype=torch.int64)),
            TypeError, "all_to_all_single:", "output", "torch.float32", "torch.int64")
    in_step()


def test_all_to_all_single_splits(world):
    n = dist.get_world_size()
    t = torch.zeros(2 * n)
    refuses(lambda: hpcddp.all_to_all_single(t, t, input_split_sizes=[1] * (n + 1)), ValueError,
            "all_to_all_single:", "input_split_sizes", f"{n + 1} entries", f"expected {n}")
    refuses(lambda: hpcddp.all_to_all_single(t, t, input_split_sizes=[2 * n] + [0] * (n - 2) + [1]),
            ValueError, "all_to_all_single:", "input_split_sizes", f"sum to dim 0 ({2 * n})")
    refuses(lambda: hpcddp.all_to_all_single(t, t, input_split_sizes=[-1] + [2] * (n - 2) + [3]),
            ValueError, "all_to_all_single:", "non-negative")
    refuses(lambda: hpcddp.all_to_all_single(torch.zeros(2 * n + 1), torch.zeros(2 * n + 1)),
            ValueError, "all_to_all_single:", f"dim 0 ({2 * n + 1})", f"group size {n}")
    refuses(lambda: dist.all_to_all_single(t, t, [1] * (n + 1), [1] * (n + 1)), Exception,
            "all_to_all_single")
    # this rank's block to itself: as many elements out as in (checked before any message)
    r = dist.get_rank()
    sin, sout = [2] * n, [2] * n
    sout[r], sout[(r + 1) % n] = 1, 3
    refuses(lambda: hpcddp.all_to_all_single(torch.zeros(2 * n), torch.zeros(2 * n), sout, sin),
            ValueError, "all_to_all_single:", "block to itself", "2 elements in input",
            "1 in output")
    refuses(lambda: hpcddp.all_to_all_single(t, t), ValueError, "all_to_all_single:",
            "same memory")
    outs, ins = [torch.zeros(2) for _ in range(n)], [torch.zeros(2) for _ in range(n)]
    outs[r] = torch.zeros(3)      # the list form's block to itself, on every path
    refuses(lambda: hpcddp.all_to_all(outs, ins), ValueError, "all_to_all:",
            f"output_tensor_list[{r}] has 3 elements", "block to itself")
    in_step()


def test_non_contiguous(world):
    n = dist.get_world_size()
    t = torch.zeros(4, 6)
    cases = [("all_reduce", lambda x: hpcddp.all_reduce(x)),
             ("broadcast", lambda x: hpcddp.broadcast(x, 0)),
             ("reduce", lambda x: hpcddp.reduce(x, 0)),
             ("all_gather", lambda x: hpcddp.all_gather([torch.zeros(4, 3)] * n, x)),
             ("all_gather_into_tensor", lambda x: hpcddp.all_gather_into_tensor(
                 torch.zeros(n * 12), x)),
             ("send", lambda x: hpcddp.send(x, (dist.get_rank() + 1) % n)),
             ("recv", lambda x: hpcddp.recv(x, (dist.get_rank() + 1) % n))]
    for fn, call in cases:
        refuses(lambda: call(t[:, ::2]), TensorError, f"{fn}:", "not contiguous",
                "stride [6, 2]", "contiguous()")
    # (through torch.distributed such views run on contiguous copies: test_strided_sparse.py)
    refuses(lambda: hpcddp.all_reduce(t.T), TensorError, "all_reduce:", "not contiguous")
    refuses(lambda: hpcddp.broadcast(t[:, 1:], 0), TensorError, "broadcast:", "not contiguous")
    cl = torch.zeros(2, 3, 4, 5).to(memory_format=torch.channels_last)
    refuses(lambda: hpcddp.all_reduce(cl), TensorError, "all_reduce:", "not contiguous")
    refuses(lambda: hpcddp.all_reduce(torch.zeros(3, dtype=torch.complex64).conj()), TensorError,
            "all_reduce:", "conj")
    # a contiguous slice (non-zero storage offset) is fine
    base = torch.zeros(10)
    hpcddp.all_reduce(base[3:7])
    in_step()


def test_ranks_out_of_range(world):
    n, r = dist.get_world_size(), dist.get_rank()
    t = torch.zeros(2)
    for fn, call, arg in [("broadcast", lambda s: hpcddp.broadcast(t, s), "src"),
                          ("reduce", lambda s: hpcddp.reduce(t, s), "dst"),
                          ("gather", lambda s: hpcddp.gather(t, None, s), "dst"),
                          ("scatter", lambda s: hpcddp.scatter(t, None, s), "src"),
                          ("send", lambda s: hpcddp.send(t, s), "dst"),
                          ("isend", lambda s: hpcddp.isend(t, s), "dst"),
                          ("recv", lambda s: hpcddp.recv(t, s), "src"),
                          ("irecv", lambda s: hpcddp.irecv(t, s), "src")]:
        for bad in (n, -1, 99):
            refuses(lambda: call(bad), ValueError, f"{fn}:", f"{arg}={bad}", "out of range",
                    f"size {n}", f"0..{n - 1}")
        refuses(lambda: call(1.0), ValueError, f"{fn}:", arg, "int", "float")
    # through torch: a world rank beyond the world
    refuses(lambda: dist.broadcast(t, src=n), Exception, "")
    refuses(lambda: dist.reduce(t, dst=n + 3), Exception, "")
    # torch's send and isend (recv, irecv) reach one backend method: the error names both
    for call in (lambda: dist.send(t, dst=n + 5), lambda: dist.isend(t, dst=n + 5)):
        refuses(call, ValueError, "dist.send/dist.isend:", f"dst={n + 5}", "out of range")
    for call in (lambda: dist.recv(t, src=n + 5), lambda: dist.irecv(t, src=n + 5)):
        refuses(call, ValueError, "dist.recv/dist.irecv:", f"src={n + 5}", "out of range")
    in_step()


def test_rank_not_in_group(world):
    """src/dst that are world ranks outside the group (torch's translation refuses them), and
    group ranks outside a sub-group through the direct API."""
    n, r = dist.get_world_size(), dist.get_rank()
    ranks = [0, n - 1]
    pg = dist.new_group(ranks)
    t = torch.zeros(2)
    if r in ranks:
        if n > 2:
            refuses(lambda: dist.broadcast(t, src=1, group=pg), ValueError, "1", "not part of")
            refuses(lambda: dist.reduce(t, dst=1, group=pg), ValueError, "not part of")
        comm = pg.hpcddp_comm
        refuses(lambda: hpcddp.broadcast(t, 2, group=comm), ValueError, "broadcast:", "src=2",
                f"group {comm.name!r} of size 2", "0..1")
    else:
        # a caller outside the group: torch's wrapper warns and returns (no message at all) ...
        with pytest.warns(UserWarning, match="does not belong to the given group"):
            dist.all_reduce(t, group=pg)
        # ... the direct API refuses with the reason
        refuses(lambda: hpcddp.all_reduce(t, group=pg), ValueError, "all_reduce:",
                f"world rank {r}", "not a member")
    in_step()


def test_wrong_list_lengths(world):
    n, r = dist.get_world_size(), dist.get_rank()
    t = torch.zeros(2)
    short, long = [torch.zeros(2) for _ in range(n - 1)], [torch.zeros(2) for _ in range(n + 1)]
    refuses(lambda: hpcddp.all_gather(short, t), ValueError, "all_gather:", "tensor_list",
            f"{n - 1} tensors", f"expected {n}")
    refuses(lambda: dist.all_gather(long, t), ValueError, "all_gather:", f"{n + 1} tensors")
    refuses(lambda: hpcddp.all_to_all(short, long), ValueError, "all_to_all:",
            "input_tensor_list", f"{n + 1} tensors", f"expected {n}")
    refuses(lambda: dist.all_to_all(short, [torch.zeros(2) for _ in range(n)]), ValueError,
            "all_to_all:", "output_tensor_list", f"{n - 1} tensors")
    refuses(lambda: hpcddp.reduce_scatter(t, short), ValueError, "reduce_scatter:",
            "input_list", f"{n - 1} tensors", f"expected {n}")
    refuses(lambda: hpcddp.all_gather_object([None] * (n + 1), 1), ValueError,
            "all_gather_object:", f"{n} items", f"length {n + 1}")
    if r == 0:
        refuses(lambda: hpcddp.scatter(t, short, src=0), ValueError, "scatter:", "scatter_list",
                f"{n - 1} tensors", f"expected {n}")
        refuses(lambda: dist.scatter(t, long, src=0), ValueError, "scatter:", f"{n + 1} tensors")
        refuses(lambda: hpcddp.gather(t, long, dst=0), ValueError, "gather:", "gather_list",
                f"{n + 1} tensors", f"expected {n}")
        refuses(lambda: hpcddp.gather(t, None, dst=0), TypeError, "gather:", "gather_list",
                "NoneType")
        refuses(lambda: hpcddp.scatter_object_list([None], [1] * (n + 1), src=0), ValueError,
                "scatter_object_list:", f"list of {n} items")
        refuses(lambda: hpcddp.gather_object(1, [None] * (n - 1), dst=0), ValueError,
                "gather_object:", f"list of {n} items")
    else:
        refuses(lambda: hpcddp.gather(t, [torch.zeros(2)] * n, dst=0), ValueError, "gather:",
                "gather_list", "None or empty", f"rank {r}", "dst=0")
        refuses(lambda: hpcddp.scatter(t, [torch.zeros(2)] * n, src=0), ValueError, "scatter:",
                "scatter_list", "None or empty", "src=0")
    in_step()


def test_sending_to_self(world):
    r = dist.get_rank()
    t = torch.zeros(2)
    for fn, call, arg in [("send", lambda: hpcddp.send(t, r), "dst"),
                          ("isend", lambda: hpcddp.isend(t, r), "dst"),
                          ("recv", lambda: hpcddp.recv(t, r), "src"),
                          ("irecv", lambda: hpcddp.irecv(t, r), "src")]:
        refuses(call, ValueError, f"{fn}:", f"{arg}={r}", "this rank itself")
    refuses(lambda: dist.send(t, r), ValueError, "")
    refuses(lambda: dist.recv(t, r), ValueError, "")
    in_step()


def test_sparse_meta_and_foreign_tensors(world):
    n = dist.get_world_size()
    sparse = torch.zeros(3, 3).to_sparse()
    meta = torch.zeros(3, device="meta")
    refuses(lambda: hpcddp.all_reduce(sparse), TensorError, "all_reduce:", "tensor",
            "dense (strided)", "sparse_coo", "to_dense()")
    # torch.distributed all-reduces sparse tensors as gloo does (test_strided_sparse.py);
    # its other ops refuse them
    refuses(lambda: dist.broadcast(sparse, 0), TensorError, "broadcast:", "sparse_coo")
    refuses(lambda: hpcddp.broadcast(meta, 0), TensorError, "broadcast:", "tensor", "meta",
            "to_empty")
    refuses(lambda: dist.all_reduce(meta), TensorError, "all_reduce:", "meta")
    refuses(lambda: hpcddp.all_gather([torch.zeros(2)] * n, meta[:2]), TensorError,
            "all_gather:", "meta")
    refuses(lambda: hpcddp.send([1, 2], 0 if dist.get_rank() else 1), TensorError, "send:",
            "torch.Tensor", "list")
    refuses(lambda: hpcddp.all_reduce(torch.zeros(2, dtype=torch.uint16)), TensorError,
            "all_reduce:", "torch.uint16", "expected one of")
    refuses(lambda: hpcddp.all_reduce(torch.zeros(2, dtype=torch.float8_e4m3fn)), TensorError,
            "all_reduce:", "float8")
    in_step()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_cuda_tensor_on_a_cpu_group(world):
    """A device the group does not serve: refused before any message (or served by the
    device path when the group serves CUDA: tests/mpi/test_gpu_staging.py)."""
    t = torch.zeros(2, device="cuda")
    try:
        hpcddp.all_reduce(t)
    except (TensorError, ValueError, RuntimeError) as exc:
        assert "all_reduce" in str(exc) and "cuda" in str(exc)
    in_step()


def test_reduce_ops_and_tags(world):
    t = torch.zeros(2, dtype=torch.int32)
    refuses(lambda: hpcddp.all_reduce(t, op="sum"), ValueError, "all_reduce:", "op",
            "ReduceOp", "'sum'")
    refuses(lambda: hpcddp.all_reduce(t, op=dist.ReduceOp.AVG), ValueError, "all_reduce:",
            "AVG", "floating-point", "torch.int32")
    refuses(lambda: dist.all_reduce(torch.zeros(2), op=dist.ReduceOp.BXOR), ValueError,
            "all_reduce:", "BXOR", "integer", "torch.float32")
    refuses(lambda: hpcddp.reduce_scatter(torch.zeros(2, dtype=torch.int8),
                                          [torch.zeros(2, dtype=torch.int8)] * dist.get_world_size(),
                                          op=dist.ReduceOp.AVG),
            ValueError, "reduce_scatter:", "AVG", "torch.int8")
    refuses(lambda: hpcddp.reduce(torch.zeros(2, dtype=torch.bool), 0,
                                  op=dist._make_nccl_premul_sum(2.0)),
            ValueError, "reduce:", "PREMUL_SUM", "bool")
    refuses(lambda: hpcddp.all_reduce(torch.zeros(2, dtype=torch.complex64),
                                      op=dist.ReduceOp.MAX), ValueError, "all_reduce:", "MAX",
            "complex")
    peer = 1 - dist.get_rank() if dist.get_rank() < 2 else 0
    for bad in (-1, 1 << 40, "x", True):
        refuses(lambda: hpcddp.send(torch.zeros(1), peer, tag=bad), ValueError, "send:", "tag",
                "MPI_TAG_UB", repr(bad))
    in_step()


def test_destroyed_and_foreign_groups(world):
    from hpcddp.comm import Communicator, MPI
    c = Communicator(MPI.COMM_WORLD.Dup(), "scratch")
    c.free()
    refuses(lambda: hpcddp.all_reduce(torch.zeros(1), group=c), ValueError, "all_reduce:",
            "'scratch'", "destroyed")
    refuses(lambda: hpcddp.all_reduce(torch.zeros(1), group=world.gloo), TypeError,
            "all_reduce:", "group", "hpcddp", "ProcessGroup")
    in_step()
