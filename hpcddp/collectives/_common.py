"""What every op and path shares: resolving the group, reduce ops, recording, the
blocking/async split."""
from __future__ import annotations

import torch

from hpcddp.comm import startup as _rt
from hpcddp.comm._mpi import MPI
from hpcddp.comm.buffers import as_array, as_arrays, check_tensor, same_spec  # noqa: F401
from hpcddp.comm.communicator import Communicator
from hpcddp.comm.ops import RedOpType, mpi_op
from hpcddp.diagnostics import mismatch as _mismatch, recorder as _rec
from hpcddp.collectives.work import CompletedWork, Work  # noqa: F401

IN_PLACE = MPI.IN_PLACE
# Chosen once, at import: with HPCDDP_DEBUG=detail every collective's record() also runs the
# cross-rank mismatch check; otherwise the flight recorder plus, for large collectives, the
# agreement on count, dtype, reduce op and root (diagnostics.mismatch says which sizes).
record = _mismatch.checked_start if _mismatch.enabled() else _mismatch.agreed_start
agree_recorded = _mismatch.check_recorded if _mismatch.enabled() else _mismatch.agree_large
record_p2p = _rec.start_p2p   # send/recv: own sequence numbers, never cross-checked
record_end = _rec.end
_op_cache: dict = {}


def resolve(group, fn: str) -> Communicator:
    """The Communicator an op runs on: GROUP, or hpcddp's world when None."""
    if group is None:
        rt = _rt._runtime
        return rt.world if rt is not None else _rt.init().world
    if isinstance(group, Communicator):
        if group.mpi == MPI.COMM_NULL:
            raise ValueError(f"{fn}: group {group.name!r} was destroyed")
        return group
    comm = getattr(group, "hpcddp_comm", None)  # an hpcddp torch ProcessGroup
    if isinstance(comm, Communicator):
        if comm.mpi is MPI.COMM_NULL:
            raise ValueError(f"{fn}: group {comm.name!r} was destroyed "
                             f"(dist.destroy_process_group)")
        return comm
    if isinstance(group, int) and group == -100:  # torch's GroupMember.NON_GROUP_MEMBER
        me = world_rank()
        raise ValueError(f"{fn}: this rank (world rank {me}) is not a member of the group; only "
                         f"members call its ops (torch's dist.* return at once on non-members)")
    raise TypeError(f"{fn}: group must be an hpcddp Communicator, an hpcddp process group or "
                    f"None (the world), got {type(group).__name__}")


def world_rank() -> int:
    rt = _rt._runtime
    return (rt.world if rt is not None else _rt.init().world).rank


_SUM = RedOpType.SUM
_sum_cache: dict = {}


def reduce_op(op, dtype: torch.dtype, fn: str):
    """(MPI.Op, RedOpType) for OP on DTYPE, cached (the hot path).

    SUM, the op of nearly every call, is found by identity and dtype alone: hashing a
    ReduceOp enum costs more than the rest of the lookup.
    """
    if op is _SUM:
        hit = _sum_cache.get(dtype)
        if hit is None:
            hit = _sum_cache[dtype] = mpi_op(op, dtype, fn)
        return hit
    kind = getattr(op, "op", op)
    key = (int(kind) if isinstance(kind, RedOpType) else kind, dtype)
    hit = _op_cache.get(key)
    if hit is None or kind is RedOpType.PREMUL_SUM:
        hit = mpi_op(op, dtype, fn)
        if kind is not RedOpType.PREMUL_SUM:
            _op_cache[key] = hit
    return hit


def pre_reduce(tensor: torch.Tensor, op, kind) -> None:
    """PREMUL_SUM scales its input before the SUM (NCCL's definition)."""
    if kind == RedOpType.PREMUL_SUM:
        factor = getattr(op, "factor", None)
        if factor is None:
            raise ValueError("PREMUL_SUM needs a factor: use dist._make_nccl_premul_sum(factor)")
        tensor.mul_(factor)


def post_reduce(tensor: torch.Tensor, kind, size: int) -> None:
    if kind == RedOpType.AVG:
        tensor.div_(size)


def check_list(lst, n: int, fn: str, arg: str, what: str = "one per rank in the group") -> None:
    if not isinstance(lst, (list, tuple)):
        raise TypeError(f"{fn}: {arg} must be a list of tensors, got {type(lst).__name__}")
    if len(lst) != n:
        raise ValueError(f"{fn}: {arg} has {len(lst)} tensors, expected {n} ({what})")


def finish_or_work(async_op: bool, entry, requests, result, finish=None, keep=None):
    """Blocking: wait here and return None. Async: return a Work over the requests."""
    if async_op:
        return Work(requests, result, finish, entry, keep)
    MPI.Request.Waitall(requests)
    if finish is not None:
        finish()
    record_end(entry)
    return None


def wait_or_work(call, requests, finish=None, keep=None):
    """A path's non-blocking MPI REQUESTS for CALL (hpcddp.collectives.paths.take's
    contract): async_op, the Work that completes them and ends the record; blocking, waited
    here and FINISH run: None (take ends the record)."""
    if call.async_op:
        return Work(requests, call.results, finish, call.entry, keep)
    MPI.Request.Waitall(requests)
    if finish is not None:
        finish()
    return None


def sum_in_place(call, path_sum) -> None:
    """AVG's and PREMUL_SUM's scaling around PATH_SUM(), a path's SUM of CALL's tensor in
    place (what the node-local all_reduce paths share)."""
    pre_reduce(call.tensor, call.op, call.kind)
    path_sum()
    post_reduce(call.tensor, call.kind, call.comm.size)


def flat_buffer(like: torch.Tensor, count: int) -> torch.Tensor:
    return torch.empty(count, dtype=like.dtype)
