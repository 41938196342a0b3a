"""The device paths: a call on CUDA tensors through a CUDA-aware MPI (device pointers) or
through pinned host copies (host staging). take() (hpcddp.collectives.call) asks them first,
and only for a call on CUDA tensors (``call.device``: the op's validation met one). The op has
validated the call already, as a CPU call, on what the tensors say of themselves (shapes,
dtypes, lists, one device); these paths check nothing again.

- :data:`CUDA_AWARE` takes the call where :func:`cuda_aware` says so: an MPI known to be
  CUDA-aware and a reduce op of MPI's own (hpcddp.comm.cuda.decide). take records, agrees on,
  scales (PREMUL_SUM, AVG) and ends it as any call, with this path's method of the op as its
  one row: the *blocking* MPI call on device pointers (Open MPI documents device pointers for
  point-to-point and the blocking collectives; its non-blocking reductions are not
  CUDA-aware), so an ``async_op`` collective returns a completed Work; send/recv stay
  non-blocking. The caller's CUDA stream is synchronised before MPI reads (never queued on
  the async engine, whose thread has another stream).
- :data:`STAGED` takes the others: the call's tensors get host twins in pinned memory
  (hpcddp.collectives._gpu_staging), the call is pointed at them and take runs it once more,
  now a CPU call, on the host rows (the arena, the ring, MPI, ...); what the op writes is
  copied back as it completes (a blocking call: before it returns; async: in its Work's
  finishing step). Large blocking all_reduce, reduce and broadcast are pipelined: the copies
  of chunk i+1 overlap MPI on chunk i, one host call per chunk.

:data:`DEVICE` (a :class:`DeviceCtx`) holds the process's CUDA-awareness (detected on first
use) and staging settings; tests set both, with CPU tensors posing as CUDA tensors.
"""
from __future__ import annotations

import torch

from hpcddp.collectives._gpu_staging import Staging, default_staging
from hpcddp.collectives.call import Call, take
from hpcddp.collectives._common import IN_PLACE, record_end, record_p2p
from hpcddp.collectives.paths.mpi import scatter_copy
from hpcddp.collectives.work import Work
from hpcddp.comm import cuda as _cuda
from hpcddp.comm import ops as _ops
from hpcddp.comm._mpi import MPI
from hpcddp.comm.buffers import as_array

OPS = frozenset({"all_reduce", "reduce", "reduce_scatter_tensor", "reduce_scatter",
                 "broadcast", "all_gather_into_tensor", "all_gather", "gather", "scatter",
                 "all_to_all_single", "all_to_all", "isend", "send", "irecv", "recv"})


class DeviceCtx:
    """What the device paths use: AWARENESS (None: the process's detection) and STAGING (None:
    the process's pool, copier and chunking, from the environment)."""
    __slots__ = ("awareness", "staging")

    def __init__(self, awareness=None, staging: Staging | None = None):
        self.awareness = awareness
        self.staging = staging

    def aware(self):
        return self.awareness if self.awareness is not None else _cuda.cuda_awareness()

    def stage(self) -> Staging:
        return self.staging if self.staging is not None else default_staging()


DEVICE = DeviceCtx()


def cuda_aware(call) -> bool:
    """Whether the CUDA-aware row takes device CALL: an MPI known to be CUDA-aware, and no
    user-defined MPI reduce op (bfloat16's: Python code reading the buffers); else host
    staging does."""
    mop = getattr(call, "mop", None)
    custom = mop is not None and any(mop == o for o in _ops._custom.values())
    return _cuda.decide(DEVICE.aware().aware, on_device=True, custom_op=custom) == _cuda.DIRECT


def _ptr(t, fn: str, arg: str, sync: bool = True):
    """A buffer over T (FN's argument ARG) in device memory (refused, before any message,
    unless the MPI is known to be CUDA-aware); SYNC: after T's current stream (CPU stand-ins
    in tests have none)."""
    return _cuda.device_buffer(t, fn, arg, sync=sync and t.is_cuda,
                               awareness=DEVICE.aware())


def _sync(t) -> None:
    if t.is_cuda:
        torch.cuda.current_stream(t.device).synchronize()


class CudaAwarePath:
    """Every op on device pointers to a CUDA-aware MPI: the blocking call where MPI has one.
    Each method returns None once the op is complete (take ends the record), or the Work of a
    point-to-point op (recorded here, as the MPI path's)."""
    name = "CUDA-aware MPI"
    min_bytes = 0
    OPS = OPS

    @staticmethod
    def applies(call, made=None):
        return cuda_aware(call)

    @staticmethod
    def state(comm, op) -> str:
        try:
            found = _cuda.cuda_awareness()
        except Exception as e:  # detection must never break the report
            return f"closed (detection failed: {e})"
        return "open" if found.aware is True else \
            f"closed (this MPI is not known to be CUDA-aware: {found.status()})"

    # -- reductions (take has scaled a PREMUL_SUM's inputs and divides an AVG after) ----------

    @staticmethod
    def all_reduce(c):
        c.comm.mpi.Allreduce(IN_PLACE, _ptr(c.tensor, "all_reduce", "tensor"), c.mop)

    @staticmethod
    def reduce(c):
        comm = c.comm
        if comm.rank == c.root:
            comm.mpi.Reduce(IN_PLACE, _ptr(c.tensor, "reduce", "tensor"), c.mop, root=c.root)
        else:
            comm.mpi.Reduce(_ptr(c.tensor, "reduce", "tensor"), None, c.mop, root=c.root)

    @staticmethod
    def reduce_scatter_tensor(c):
        _sync(c.tensor)
        fn = "reduce_scatter_tensor"
        c.comm.mpi.Reduce_scatter_block(_ptr(c.input, fn, "input", False),
                                        _ptr(c.tensor, fn, "output", False), c.mop)

    @staticmethod
    def reduce_scatter(c):
        c.input = (torch.cat([t.reshape(-1) for t in c.tensors]) if c.tensors
                   else c.tensor.new_empty(0))
        return CudaAwarePath.reduce_scatter_tensor(c)

    # -- data movement ---------------------------------------------------------------------

    @staticmethod
    def broadcast(c):
        # receivers wait too: a kernel still queued on their tensor would overwrite what MPI wrote
        c.comm.mpi.Bcast(_ptr(c.tensor, "broadcast", "tensor"), root=c.root)

    @staticmethod
    def all_gather_into_tensor(c):
        _sync(c.output)
        fn = "all_gather_into_tensor"
        c.comm.mpi.Allgather(_ptr(c.input, fn, "input_tensor", False),
                             _ptr(c.output, fn, "output_tensor", False))

    @staticmethod
    def all_gather(c):
        flat = c.tensor.new_empty(c.tensor.numel() * c.comm.size)
        c.comm.mpi.Allgather(_ptr(c.tensor, "all_gather", "tensor"),
                             _ptr(flat, "all_gather", "tensor_list", False))
        scatter_copy(flat, c.tensors)

    @staticmethod
    def gather(c):
        comm, dst = c.comm, c.root
        if comm.rank != dst:
            comm.mpi.Gather(_ptr(c.tensor, "gather", "tensor"), None, root=dst)
            return
        flat = c.tensor.new_empty(c.tensor.numel() * comm.size)
        comm.mpi.Gather(_ptr(c.tensor, "gather", "tensor"),
                        _ptr(flat, "gather", "gather_list", False), root=dst)
        scatter_copy(flat, c.tensors)

    @staticmethod
    def scatter(c):
        comm, src = c.comm, c.root
        if comm.rank != src:
            comm.mpi.Scatter(None, _ptr(c.tensor, "scatter", "tensor"), root=src)
            return
        flat = torch.cat([t.reshape(-1) for t in c.tensors])
        comm.mpi.Scatter(_ptr(flat, "scatter", "scatter_list"),
                         _ptr(c.tensor, "scatter", "tensor", False), root=src)

    @staticmethod
    def all_to_all_single(c):
        # Alltoallv whatever the splits, as the MPI path (paths/mpi.py says why)
        scounts, sdis, rcounts, rdis = c.layout
        _sync(c.output)
        fn = "all_to_all_single"
        c.comm.mpi.Alltoallv([_ptr(c.input, fn, "input", False), (scounts, sdis)],
                             [_ptr(c.output, fn, "output", False), (rcounts, rdis)])

    @staticmethod
    def all_to_all(c):
        outputs, inputs = c.output, c.input
        flat_in = torch.cat([t.reshape(-1) for t in inputs])
        flat_out = flat_in.new_empty(sum(t.numel() for t in outputs))
        scounts, rcounts = [t.numel() for t in inputs], [t.numel() for t in outputs]
        sdis = [sum(scounts[:i]) for i in range(len(scounts))]
        rdis = [sum(rcounts[:i]) for i in range(len(rcounts))]
        c.comm.mpi.Alltoallv([_ptr(flat_in, "all_to_all", "input_tensor_list"), (scounts, sdis)],
                             [_ptr(flat_out, "all_to_all", "output_tensor_list", False),
                              (rcounts, rdis)])
        scatter_copy(flat_out, outputs)

    # -- point-to-point: recorded here, as the MPI path's; no count check on a receive (MPI
    # writes device memory the host cannot look at cheaply) ------------------------------

    @staticmethod
    def isend(c):
        entry = record_p2p(c.comm, "send", c.tensor.shape, c.tensor.dtype, c.root)
        req = c.comm.mpi.Isend(_ptr(c.tensor, "isend", "tensor"), c.root, c.tag)
        return Work([req], [c.tensor], None, entry, keep=c.tensor)

    @staticmethod
    def send(c):
        entry = record_p2p(c.comm, "send", c.tensor.shape, c.tensor.dtype, c.root)
        c.comm.mpi.Send(_ptr(c.tensor, "send", "tensor"), c.root, c.tag)
        record_end(entry)

    @staticmethod
    def irecv(c):
        entry = record_p2p(c.comm, "recv", c.tensor.shape, c.tensor.dtype, c.root)
        source = MPI.ANY_SOURCE if c.root is None else c.root
        req = c.comm.mpi.Irecv(_ptr(c.tensor, "irecv", "tensor"), source, c.tag)
        return Work([req], [c.tensor], None, entry, keep=c.tensor, status=MPI.Status())

    @staticmethod
    def recv(c) -> int:
        entry = record_p2p(c.comm, "recv", c.tensor.shape, c.tensor.dtype, c.root)
        source = MPI.ANY_SOURCE if c.root is None else c.root
        status = MPI.Status()
        c.comm.mpi.Recv(_ptr(c.tensor, "recv", "tensor"), source, c.tag, status)
        record_end(entry)
        return status.Get_source()


# -- host staging ----------------------------------------------------------------------------

# a Call's tensor fields and the fields of their host views (as the ops set them for CPU calls)
_VIEWS = {"tensor": "arr", "output": "out", "input": "inp", "tensors": "views"}
_NOT_SET = object()


def _copy(call: Call) -> Call:
    new = Call()
    for name in Call.__slots__:
        value = getattr(call, name, _NOT_SET)
        if value is not _NOT_SET:
            setattr(new, name, value)
    return new


def _staged(call: Call, route: tuple, fields, arr: str | None = None) -> object:
    """CALL run on host twins of its tensors: FIELDS [(field, read, write)] name the Call's
    tensor (or tensor list) fields, READ those copied in, WRITE those copied back (ARR: the
    view field the op also files as ``arr``); then take runs it as a CPU call on ROUTE's host
    rows. What take answers (an async call's Work completes with the copies back)."""
    specs, spans = [], []
    for field, read, write in fields:
        value = getattr(call, field)
        many = isinstance(value, (list, tuple))
        items = list(value) if many else [value]
        spans.append((field, many, len(specs), len(items)))
        specs += [(t, read, write) for t in items]
    # what the Work answers: the op's results, or a point-to-point op's tensor (the device one)
    results = getattr(call, "results", None) or [specs[0][0]]
    st = DEVICE.stage().staged(specs[0][0])
    hosts = st.twins(specs)
    try:
        for field, many, at, k in spans:
            twins = hosts[at:at + k]
            views = [as_array(h) for h in twins]
            setattr(call, field, twins if many else twins[0])
            setattr(call, _VIEWS[field], views if many else views[0])
        if arr is not None:
            call.arr = getattr(call, arr)
        call.device, call.memo = False, None    # a CPU call now, never planned (new twins)
        done = take(route, call)
    except BaseException:
        st.abort()
        raise
    if done is None or type(done) is int:   # complete: a blocking call, or a recv's source
        st.copy_out()
        return done
    return st.complete(done, True, results)


def _elementwise(call: Call, route: tuple, read: bool, write: bool):
    """all_reduce, reduce, broadcast staged: large blocking calls pipelined in chunks (each
    chunk a host call of its own), the others whole."""
    t, stg = call.tensor, DEVICE.stage()
    if call.async_op or not stg.pipelined(t):
        return _staged(call, route, [("tensor", read, write)])

    def chunk(h):
        c = _copy(call)
        c.tensor, c.arr, c.shape, c.nbytes, c.results = h, as_array(h), h.shape, h.nbytes, [h]
        c.device, c.memo = False, None
        take(route, c)
    stg.pipeline(t, chunk, read=read, write=write)
    return None


class StagedPath:
    """Every op on host twins of its CUDA tensors, through the host rows (module docstring).
    Each method takes the call and its route (take's) and returns what take answers."""
    name = "host staging"
    min_bytes = 0
    OPS = OPS
    applies = None                  # the device call the CUDA-aware row does not take

    @staticmethod
    def state(comm, op) -> str:
        return "open"

    @staticmethod
    def all_reduce(c, route):
        return _elementwise(c, route, True, True)

    @staticmethod
    def reduce(c, route):
        return _elementwise(c, route, True, c.comm.rank == c.root)

    @staticmethod
    def broadcast(c, route):
        root = c.comm.rank == c.root
        return _elementwise(c, route, root, not root)

    @staticmethod
    def reduce_scatter_tensor(c, route):
        return _staged(c, route, [("tensor", False, True), ("input", True, False)])

    @staticmethod
    def reduce_scatter(c, route):
        return _staged(c, route, [("tensor", False, True), ("tensors", True, False)])

    @staticmethod
    def all_gather_into_tensor(c, route):
        return _staged(c, route, [("output", False, True), ("input", True, False)], arr="out")

    @staticmethod
    def all_gather(c, route):
        return _staged(c, route, [("tensor", True, False), ("tensors", False, True)])

    @staticmethod
    def gather(c, route):
        root = c.comm.rank == c.root
        return _staged(c, route, [("tensor", True, False)]
                       + ([("tensors", False, True)] if root else []))

    @staticmethod
    def scatter(c, route):
        root = c.comm.rank == c.root
        return _staged(c, route, [("tensor", False, True)]
                       + ([("tensors", True, False)] if root else []))

    @staticmethod
    def all_to_all_single(c, route):    # all_to_all's fields are the same, as lists
        return _staged(c, route, [("output", False, True), ("input", True, False)])

    all_to_all = all_to_all_single

    # point-to-point: never pipelined (a CPU peer posts one receive for the whole tensor, so
    # the message stays one message whatever the device on either side)
    @staticmethod
    def isend(c, route):
        return _staged(c, route, [("tensor", True, False)])

    send = isend

    @staticmethod
    def irecv(c, route):
        return _staged(c, route, [("tensor", False, True)])

    recv = irecv


CUDA_AWARE = CudaAwarePath()
STAGED = StagedPath()
