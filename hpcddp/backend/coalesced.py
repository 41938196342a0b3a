"""Coalesced calls: torch's ``*_coalesced`` ops and a list of tensors given to one op. A
coalesced all_reduce is one MPI call over a flat copy (fewer, larger messages: what
"coalesced" promises); the other coalesced ops start each tensor's op and hand back one
Work over them all."""
from __future__ import annotations

import torch

from hpcddp import collectives as C
from hpcddp.collectives.work import AllWork, CompletedWork, Work
from hpcddp.comm.buffers import as_array


def combine(works, result) -> Work:
    """One Work over several started ops."""
    return AllWork([w for w in works if w is not None], result)


def all_reduce(comm, tensors, op) -> Work:
    """TENSORS (one dtype) each reduced with OP over COMM, through one flat copy."""
    if not tensors:
        return CompletedWork([])
    for i, t in enumerate(tensors):
        as_array(t, "allreduce_coalesced", f"tensors[{i}]")
        if t.dtype != tensors[0].dtype:
            raise TypeError(f"allreduce_coalesced: tensors[{i}] has dtype {t.dtype}, expected "
                            f"{tensors[0].dtype} (one dtype per coalesced call)")
    flat = torch.cat([t.reshape(-1) for t in tensors])
    C.all_reduce(flat, op, comm, False)  # the copies back need it done: blocking
    off = 0
    for t in tensors:
        n = t.numel()
        t.view(-1).copy_(flat[off:off + n])
        off += n
    return CompletedWork(list(tensors))
