"""The torch.distributed process group over an MPI communicator.

torch calls these methods (old and new names: torch renames them across releases) with
option objects; each translates the options and calls the op in hpcddp.collectives. Calls
from Python with ``asyncOp=False`` (``dist.all_reduce(t)``, ``dist.all_gather(...)``: every
collective, torch sets it in the options) complete here and return None, which torch's
wrappers accept, so the blocking path creates no Future and no Work (4-5 us a call saved at
8 B, 8-18 us at 1 MiB on 2 ranks, measured A/B in one job). Everything else (async_op=True,
send/recv, callers from C++ such as DDP's reducer, whose options keep torch's default
asyncOp=True) gets an hpcddp Work (torch's Work subclass) driven by MPI requests.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from hpcddp import collectives as C
from hpcddp.collectives.work import CompletedWork, TorchP2PWork, Work
from hpcddp.comm.buffers import as_array
from hpcddp.comm.communicator import Communicator

from hpcddp.backend import BACKEND_NAME


def _combine(works, result) -> Work:
    """One Work over several started ops (coalesced calls)."""
    works = [w for w in works if w is not None]
    reqs = [r for w in works for r in w._requests]

    def finish():
        for w in works:
            with w._lock:
                w._complete()
    return Work(reqs, result, finish)


def _for_torch(work):
    """WORK as torch's C++ side takes it: the C P2PWork of isend/irecv gets a torch Work over it."""
    return work if isinstance(work, dist._Work) else TorchP2PWork(work)


def _blocking(opts) -> bool:
    return getattr(opts, "asyncOp", True) is False


class ProcessGroupHPCDDP(dist.ProcessGroup):
    """A torch ProcessGroup whose ranks are an MPI communicator's (``hpcddp_comm``)."""

    def __init__(self, comm: Communicator):
        super().__init__(comm.rank, comm.size)
        self.hpcddp_comm = comm

    def getBackendName(self) -> str:
        return BACKEND_NAME

    @property
    def name(self):  # torch prints it in errors
        return BACKEND_NAME

    def __repr__(self) -> str:
        return f"ProcessGroupHPCDDP({self.hpcddp_comm.name!r}, rank={self.rank()}, size={self.size()})"

    # -- reductions -------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        op = opts.reduceOp if opts is not None and hasattr(opts, "reduceOp") else (
            opts if opts is not None else dist.ReduceOp.SUM)
        if len(tensors) == 1:
            if opts is not None and _blocking(opts):
                return C.all_reduce(tensors[0], op, self.hpcddp_comm, False)
            return C.all_reduce(tensors[0], op, self.hpcddp_comm, True)
        return self.allreduce_coalesced(tensors, opts)

    def allreduce_coalesced(self, tensors, opts=None):
        # one MPI call over a flat copy: fewer, larger messages (what "coalesced" promises)
        op = getattr(opts, "reduceOp", dist.ReduceOp.SUM)
        if not tensors:
            return CompletedWork([])
        for i, t in enumerate(tensors):
            as_array(t, "allreduce_coalesced", f"tensors[{i}]")
            if t.dtype != tensors[0].dtype:
                raise TypeError(f"allreduce_coalesced: tensors[{i}] has dtype {t.dtype}, expected "
                                f"{tensors[0].dtype} (one dtype per coalesced call)")
        flat = torch.cat([t.reshape(-1) for t in tensors])
        C.all_reduce(flat, op, self.hpcddp_comm, False)  # all_reduce is blocking in MPI anyway
        off = 0
        for t in tensors:
            n = t.numel()
            t.view(-1).copy_(flat[off:off + n])
            off += n
        return CompletedWork(list(tensors))

    def reduce(self, tensors, opts):
        return C.reduce(tensors[0], opts.rootRank, opts.reduceOp, self.hpcddp_comm,
                        not _blocking(opts))

    def reduce_scatter(self, output_tensors, input_tensors, opts):
        return C.reduce_scatter(output_tensors[0], input_tensors[0], opts.reduceOp,
                                self.hpcddp_comm, not _blocking(opts))

    def _reduce_scatter_base(self, output, input, opts):
        return C.reduce_scatter_tensor(output, input, opts.reduceOp, self.hpcddp_comm,
                                       not _blocking(opts))

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts):
        return _combine([self._reduce_scatter_base(o, i, opts) for o, i in zip(outputs, inputs)],
                        list(outputs))

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    # -- data movement ------------------------------------------------------------------------
    def broadcast(self, tensors, opts):
        if len(tensors) == 1:
            return C.broadcast(tensors[0], opts.rootRank, self.hpcddp_comm, not _blocking(opts))
        return _combine([C.broadcast(t, opts.rootRank, self.hpcddp_comm, True) for t in tensors],
                        list(tensors))

    def allgather(self, output_tensors, input_tensors, opts=None):
        return C.all_gather(output_tensors[0], input_tensors[0], self.hpcddp_comm,
                            not _blocking(opts))

    def _allgather_base(self, output, input, opts=None):
        return C.all_gather_into_tensor(output, input, self.hpcddp_comm, not _blocking(opts))

    all_gather_single = _allgather_base

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        return _combine([C.all_gather_into_tensor(o, i, self.hpcddp_comm, True)
                         for o, i in zip(outputs, inputs)], list(outputs))

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        # torch's layout: output_lists[r][i] receives rank r's input_list[i]
        return _combine([C.all_gather([out[i] for out in output_lists], t, self.hpcddp_comm, True)
                         for i, t in enumerate(input_list)],
                        [t for o in output_lists for t in o])

    def gather(self, output_tensors, input_tensors, opts):
        out = output_tensors[0] if output_tensors else None
        return C.gather(input_tensors[0], out, opts.rootRank, self.hpcddp_comm,
                        not _blocking(opts))

    def scatter(self, output_tensors, input_tensors, opts):
        inp = input_tensors[0] if input_tensors else None
        return C.scatter(output_tensors[0], inp, opts.rootRank, self.hpcddp_comm,
                         not _blocking(opts))

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return C.all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                   self.hpcddp_comm, not _blocking(opts))

    all_to_all_single = alltoall_base

    def alltoall(self, output_tensors, input_tensors, opts=None):
        return C.all_to_all(output_tensors, input_tensors, self.hpcddp_comm, not _blocking(opts))

    # -- synchronisation and point-to-point -----------------------------------------------------
    def barrier(self, opts=None):
        return C.barrier(self.hpcddp_comm, not _blocking(opts))

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        return C.monitored_barrier(self.hpcddp_comm, timeout, wait_all_ranks)

    def send(self, tensors, dst, tag=0):
        return _for_torch(C.isend(tensors[0], dst, self.hpcddp_comm, tag))

    def recv(self, tensors, src, tag=0):
        return _for_torch(C.irecv(tensors[0], src, self.hpcddp_comm, tag))

    def recv_anysource(self, tensors, tag=0):
        return _for_torch(C.irecv(tensors[0], None, self.hpcddp_comm, tag))
