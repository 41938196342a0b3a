"""The torch.distributed process group over an MPI communicator.

torch calls these methods (old and new names: torch renames them across releases) with
option objects; each translates the options and calls the op in hpcddp.collectives. Calls
from Python with ``asyncOp=False`` (``dist.all_reduce(t)``, ``dist.all_gather(...)``: every
collective, torch sets it in the options) complete here and return None, which torch's
wrappers accept, so the blocking path creates no Future and no Work (4-5 us a call saved at
8 B, 8-18 us at 1 MiB on 2 ranks, measured A/B in one job). Everything else (async_op=True,
send/recv, callers from C++ such as DDP's reducer, whose options keep torch's default
asyncOp=True) gets an hpcddp Work (torch's Work subclass) driven by MPI requests.

torch's C++ ``Backend`` cannot be subclassed from Python, so this is a ``ProcessGroup``
subclass (as torch's own test_c10d_pypg.py does), and it answers itself what torch asks a
group's registered backends: its name and description, ``_get_backend(device)``,
``_device_types``, sequence numbers. A device map such as ``cpu:hpcddp,cuda:nccl`` is served
by real per-device backends: torch hands the whole group to hpcddp, which creates the other
backends itself (:mod:`hpcddp.backend.devices`) and sends each tensor to its device's backend.

This module is the torch API only; what a call needs before it reaches hpcddp's ops lives
beside it, one module each: :mod:`~hpcddp.backend.routing` (the device map, the retry on
contiguous copies), :mod:`~hpcddp.backend.strided`, :mod:`~hpcddp.backend.sparse` (sparse
all_reduce) and :mod:`~hpcddp.backend.coalesced`.
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from hpcddp import collectives as C
from hpcddp.backend import BACKEND_NAME, coalesced, sparse
from hpcddp.backend.routing import routed
from hpcddp.backend.strided import through_contiguous
from hpcddp.collectives.work import TorchP2PWork
from hpcddp.comm.buffers import NotContiguous, TensorError
from hpcddp.comm.communicator import Communicator


def _for_torch(work):
    """WORK as torch's C++ side takes it: the C P2PWork of isend/irecv gets a torch Work over it."""
    return work if isinstance(work, dist._Work) else TorchP2PWork(work)


def _blocking(opts) -> bool:
    return getattr(opts, "asyncOp", True) is False


_UNRESOLVED = object()   # truthy: the first op asks torch for the group's device map


class ProcessGroupHPCDDP(dist.ProcessGroup):
    """A torch ProcessGroup whose ranks are an MPI communicator's (``hpcddp_comm``).

    What torch and its clients (DeviceMesh, FSDP2, DTensor, DCP, functional collectives)
    ask of a group's backend, this group answers itself: ``group_name``/``group_desc``,
    ``name()``, ``_get_backend(device)`` (itself for the devices hpcddp serves, torch's own
    backend for devices the device map gives to another), ``_device_types``,
    ``_get_sequence_number_for_group()``, ``_set_default_timeout``.
    """

    # what torch's Python side reads off a backend before using an optional feature
    supports_splitting = False
    supports_coalescing = False
    supports_time_estimate = False
    supports_shrinking = False

    def __init__(self, comm: Communicator, store=None, timeout: timedelta | None = None):
        super().__init__(comm.rank, comm.size)
        self.hpcddp_comm = comm
        self._store = store
        self._timeout = timeout or dist.default_pg_timeout
        self._group_name: str | None = None
        self._group_desc = ""
        self._others = _UNRESOLVED if store is not None else {}

    def getBackendName(self) -> str:
        return BACKEND_NAME

    # torch keeps a group's name and description on its registered backends, and this group
    # has none of its own: keep them here (torch's wrapper calls these overrides)
    def getGroupName(self) -> str:
        if self._group_name is None:
            raise RuntimeError("ProcessGroup name not set")
        return self._group_name

    def setGroupName(self, name: str) -> None:
        # (the other devices' backends are made later and keep no name: torch has no Python
        # setter for a Backend's name, and its C++ one is this override)
        self._group_name = name

    def getGroupDesc(self) -> str:
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def _device_types(self) -> list:
        served = [torch.device("cpu"), torch.device("cuda")]
        others = [torch.device(d) for d in self._other_backends()]
        return others + [d for d in served if d.type not in {o.type for o in others}]

    def _get_backend(self, device):
        """torch's per-device backend lookup: this group for CPU (and CUDA unless the device
        map gives it to another backend), else that backend."""
        other = self._backend_for(torch.device(device).type)
        return self if other is None else other

    def _other_backends(self) -> dict:
        if self._others is _UNRESOLVED:
            from hpcddp.backend import devices
            made = devices.other_backends(self, self._store, self._timeout)
            if made is None:
                return {}
            self._others = made
        return self._others

    def _backend_for(self, device_type: str):
        return self._other_backends().get(device_type)

    def _get_sequence_number_for_group(self) -> int:
        return self.hpcddp_comm.seq

    def _set_sequence_number_for_group(self) -> None:
        """Sequence numbers start at 0 on every member already (one count per communicator)."""

    def _set_default_timeout(self, timeout) -> None:
        self._timeout = timeout
        self.hpcddp_comm.timeout = timeout.total_seconds()

    def supports_tensor_alloc(self, device) -> bool:
        return False

    def shutdown(self) -> None:
        """torch's ``destroy_process_group``: release what hpcddp keeps for the group (its
        arena, ring links, private communicators) and free the MPI communicator hpcddp made
        for it (the world's, and one given to ``group_from_comm``, stay). Local: no message.
        While the async engine still holds queued calls, which may run on the group, the
        state stays until ``hpcddp.finalize``."""
        from hpcddp.collectives import engine
        for backend in (self._others if isinstance(self._others, dict) else {}).values():
            if hasattr(backend, "shutdown"):
                backend.shutdown()
        comm = self.hpcddp_comm
        if engine.pending:
            return
        if comm.owned:
            comm.free()
        else:
            comm.release()

    def __repr__(self) -> str:
        return f"ProcessGroupHPCDDP({self.hpcddp_comm.name!r}, rank={self.rank()}, size={self.size()})"

    # -- reductions -------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        if isinstance(tensors, torch.Tensor):
            # torch's allreduce(tensor, op) overload: DDP's join hook calls it on the group
            # (a 1-row tensor read as a list of one would reduce only its first row)
            tensors = [tensors]
        # the hottest op: routed's checks written out here, without its extra call
        if self._others:
            return _routed_allreduce(self, tensors, opts)
        return self._allreduce_here(tensors, opts)

    def _allreduce_here(self, tensors, opts):
        op = opts.reduceOp if opts is not None and hasattr(opts, "reduceOp") else (
            opts if opts is not None else dist.ReduceOp.SUM)
        if len(tensors) == 1:
            try:
                if opts is not None and _blocking(opts):
                    return C.all_reduce(tensors[0], op, self.hpcddp_comm, False)
                return C.all_reduce(tensors[0], op, self.hpcddp_comm, True)
            except NotContiguous:
                return through_contiguous(ProcessGroupHPCDDP._allreduce_here, self,
                                          (tensors, opts))
            except TensorError:
                if tensors[0].layout != torch.sparse_coo:
                    raise
                return sparse.all_reduce(self.hpcddp_comm, tensors[0], op)
        return self.allreduce_coalesced(tensors, opts)

    @routed
    def allreduce_coalesced(self, tensors, opts=None):
        return coalesced.all_reduce(self.hpcddp_comm, tensors,
                                    getattr(opts, "reduceOp", dist.ReduceOp.SUM))

    @routed
    def reduce(self, tensors, opts):
        return C.reduce(tensors[0], opts.rootRank, opts.reduceOp, self.hpcddp_comm,
                        not _blocking(opts))

    @routed
    def reduce_scatter(self, output_tensors, input_tensors, opts):
        return C.reduce_scatter(output_tensors[0], input_tensors[0], opts.reduceOp,
                                self.hpcddp_comm, not _blocking(opts))

    @routed
    def _reduce_scatter_base(self, output, input, opts):
        return C.reduce_scatter_tensor(output, input, opts.reduceOp, self.hpcddp_comm,
                                       not _blocking(opts))

    reduce_scatter_single = _reduce_scatter_base

    @routed
    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts):
        return coalesced.combine([self._reduce_scatter_base(o, i, opts)
                                  for o, i in zip(outputs, inputs)], list(outputs))

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    # -- data movement ------------------------------------------------------------------------
    @routed
    def broadcast(self, tensors, opts):
        if len(tensors) == 1:
            return C.broadcast(tensors[0], opts.rootRank, self.hpcddp_comm, not _blocking(opts))
        return coalesced.combine([C.broadcast(t, opts.rootRank, self.hpcddp_comm, True)
                                  for t in tensors], list(tensors))

    @routed
    def allgather(self, output_tensors, input_tensors, opts=None):
        return C.all_gather(output_tensors[0], input_tensors[0], self.hpcddp_comm,
                            not _blocking(opts))

    @routed
    def _allgather_base(self, output, input, opts=None):
        return C.all_gather_into_tensor(output, input, self.hpcddp_comm, not _blocking(opts))

    all_gather_single = _allgather_base

    @routed
    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        return coalesced.combine([C.all_gather_into_tensor(o, i, self.hpcddp_comm, True)
                                  for o, i in zip(outputs, inputs)], list(outputs))

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    @routed
    def allgather_coalesced(self, output_lists, input_list, opts=None):
        # torch's layout: output_lists[r][i] receives rank r's input_list[i]
        return coalesced.combine([C.all_gather([out[i] for out in output_lists], t,
                                               self.hpcddp_comm, True)
                                  for i, t in enumerate(input_list)],
                                 [t for o in output_lists for t in o])

    @routed
    def gather(self, output_tensors, input_tensors, opts):
        out = output_tensors[0] if output_tensors else None
        return C.gather(input_tensors[0], out, opts.rootRank, self.hpcddp_comm,
                        not _blocking(opts))

    @routed
    def scatter(self, output_tensors, input_tensors, opts):
        inp = input_tensors[0] if input_tensors else None
        return C.scatter(output_tensors[0], inp, opts.rootRank, self.hpcddp_comm,
                         not _blocking(opts))

    @routed
    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return C.all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                   self.hpcddp_comm, not _blocking(opts))

    all_to_all_single = alltoall_base

    @routed
    def alltoall(self, output_tensors, input_tensors, opts=None):
        return C.all_to_all(output_tensors, input_tensors, self.hpcddp_comm, not _blocking(opts))

    # -- synchronisation and point-to-point -----------------------------------------------------
    def barrier(self, opts=None):
        return C.barrier(self.hpcddp_comm, not _blocking(opts))

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        return C.monitored_barrier(self.hpcddp_comm, timeout, wait_all_ranks)

    # torch's send and isend (recv and irecv) both call these: errors name both
    @routed
    def send(self, tensors, dst, tag=0):
        return _for_torch(C.isend(tensors[0], dst, self.hpcddp_comm, tag,
                                  fn="dist.send/dist.isend"))

    @routed
    def recv(self, tensors, src, tag=0):
        return _for_torch(C.irecv(tensors[0], src, self.hpcddp_comm, tag,
                                  fn="dist.recv/dist.irecv"))

    @routed
    def recv_anysource(self, tensors, tag=0):
        return _for_torch(C.irecv(tensors[0], None, self.hpcddp_comm, tag,
                                  fn="dist.recv/dist.irecv"))


_routed_allreduce = routed(ProcessGroupHPCDDP._allreduce_here, "allreduce")
