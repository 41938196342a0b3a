"""What the ops and paths share besides the Call (hpcddp.collectives.call, whose resolve is
re-exported here): recording outside take, list checks, the blocking/async split."""
from __future__ import annotations

from hpcddp.comm._mpi import MPI
from hpcddp.comm.buffers import as_array, as_arrays, same_spec  # noqa: F401
from hpcddp.diagnostics import mismatch as _mismatch, recorder as _rec
from hpcddp.collectives.work import CompletedWork, Work  # noqa: F401
from hpcddp.collectives.call import resolve  # noqa: F401

IN_PLACE = MPI.IN_PLACE
# Chosen once, at import: with HPCDDP_DEBUG=detail every collective's record() also runs the
# cross-rank mismatch check; otherwise the flight recorder plus, for large collectives, the
# agreement on count, dtype, reduce op and root (diagnostics.mismatch says which sizes).
record = _mismatch.checked_start if _mismatch.enabled() else _mismatch.agreed_start
record_p2p = _rec.start_p2p   # send/recv: own sequence numbers, never cross-checked
record_end = _rec.end


def check_list(lst, n: int, fn: str, arg: str, what: str = "one per rank in the group") -> None:
    if not isinstance(lst, (list, tuple)):
        raise TypeError(f"{fn}: {arg} must be a list of tensors, got {type(lst).__name__}")
    if len(lst) != n:
        raise ValueError(f"{fn}: {arg} has {len(lst)} tensors, expected {n} ({what})")


def check_blocks(fn: str, whole, whole_arg: str, block, block_arg: str, n: int) -> None:
    """WHOLE (argument WHOLE_ARG) must be N blocks like BLOCK (BLOCK_ARG): the same dtype,
    N times its element count (reduce_scatter_tensor's input, all_gather_into_tensor's
    output)."""
    if whole.dtype != block.dtype:
        raise TypeError(f"{fn}: {whole_arg} has dtype {whole.dtype}, expected {block.dtype} "
                        f"({block_arg}'s)")
    if whole.numel() != block.numel() * n:
        raise ValueError(f"{fn}: {whole_arg} has {whole.numel()} elements, expected "
                         f"{block.numel() * n} ({block_arg}'s {block.numel()} x group size {n})")


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
    """A path's non-blocking MPI REQUESTS for CALL (hpcddp.collectives.call.take's
    contract): async_op, the Work that completes them and ends the record; blocking, waited
    here and FINISH run: None (take ends the record)."""
    if call.async_op:
        return Work(requests, call.results, finish, call.entry, keep)
    MPI.Request.Waitall(requests)
    if finish is not None:
        finish()
    return None
