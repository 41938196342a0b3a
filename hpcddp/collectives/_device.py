"""The device path of every op: CUDA tensors, through a CUDA-aware MPI or through host memory.

The ops (reduce.py, gather.py, ...) call ``as_array`` on their tensors while they validate a
call; for a CUDA tensor it raises ``DeviceTensor`` (only on its cache-miss path, so CPU tensors
pay nothing), the op marks the ``Call`` as a device call, and one of the dispatch table's two
device rows (hpcddp.collectives.paths: "CUDA-aware MPI" where :func:`cuda_aware` says so, else
"host staging") runs the function of the same name here with its :func:`row_ctx`. Each
one:

1. checks that the op's tensors share one device (before any message);
2. runs the path its ``ctx`` names (the table's rows force it; the default ``ctx`` asks
   :func:`hpcddp.comm.cuda.decide`, as :func:`cuda_aware` does):

   - DIRECT (the MPI is known to be CUDA-aware): synchronise the tensor's current stream and
     pass device pointers (:func:`hpcddp.comm.cuda.device_buffer`, the only place that makes
     them). Collectives use *blocking* MPI calls: Open MPI documents device pointers for
     point-to-point and the blocking collectives, and its non-blocking reductions are not
     CUDA-aware. So an ``async_op=True`` collective returns a completed Work; send/recv stay
     non-blocking.
   - STAGING (not CUDA-aware, unknown, or a reduction with a user-defined MPI op): the CPU op
     itself runs on host twins in pinned memory (:mod:`hpcddp.collectives._gpu_staging`); large
     blocking all_reduce/broadcast/reduce are pipelined in chunks.

``ctx`` (a :class:`DeviceCtx`) forces the path, the awareness and the staging settings: the
tests run both paths with CPU tensors standing in for CUDA tensors.
"""
from __future__ import annotations

import importlib

import torch

from hpcddp.collectives import _common as _c
from hpcddp.collectives.work import CompletedWork, Work
from hpcddp.comm import cuda as _cuda
from hpcddp.comm import ops as _ops
from hpcddp.comm._mpi import MPI
from hpcddp.comm.buffers import DevicePointerRefused, TensorError
from hpcddp.collectives._gpu_staging import Staging, default_staging
from hpcddp.collectives.call import recorded_name

IN_PLACE = MPI.IN_PLACE
DIRECT, STAGING = _cuda.DIRECT, _cuda.STAGING
_PREMUL = _ops.RedOpType.PREMUL_SUM


class DeviceCtx:
    """What the device path uses: PATH forces "direct" or "staging" (None: decide from
    AWARENESS, default the process's detection); STAGING the pool, copier and chunking."""
    __slots__ = ("path", "awareness", "staging")

    def __init__(self, path: str | None = None, awareness=None, staging: Staging | None = None):
        if path not in (None, DIRECT, STAGING):
            raise ValueError(f"DeviceCtx: path must be None, {DIRECT!r} or {STAGING!r}, "
                             f"got {path!r}")
        self.path = path
        self.awareness = awareness
        self.staging = staging

    def aware(self):
        return self.awareness if self.awareness is not None else _cuda.cuda_awareness()

    def stage(self) -> Staging:
        return self.staging if self.staging is not None else default_staging()


_DEFAULT = DeviceCtx()


def row_ctx(path: str) -> DeviceCtx:
    """The DeviceCtx a device row of the dispatch table (hpcddp.collectives.paths) runs its
    op with: PATH, and the default context's awareness and staging (the process's)."""
    return DeviceCtx(path, _DEFAULT.awareness, _DEFAULT.staging)


def cuda_aware(call) -> bool:
    """Whether the table's CUDA-aware row takes device CALL: an MPI known to be CUDA-aware,
    and no user-defined MPI reduce op (hpcddp.comm.cuda.decide); else host staging does."""
    mop = getattr(call, "mop", None)
    return _cuda.decide(_DEFAULT.aware().aware, on_device=True,
                        custom_op=mop is not None and _is_custom(mop)) == DIRECT


def _mod(name: str):
    # the op modules by import path: hpcddp.collectives.reduce/.gather as attributes of the
    # package are the functions of those names, not the modules
    return importlib.import_module(f"hpcddp.collectives.{name}")


def _is_custom(mop) -> bool:
    return any(mop == o for o in _ops._custom.values())


def _route(ctx: DeviceCtx, fn: str, t, mop=None) -> str:
    """DIRECT or STAGING for an op on device tensor T. A forced DIRECT to an MPI that is not
    known to be CUDA-aware is refused here, before any change to a tensor or any message."""
    path = ctx.path
    if path is None:
        return _cuda.decide(ctx.aware().aware, on_device=True,
                            custom_op=mop is not None and _is_custom(mop))
    if path == DIRECT and ctx.aware().aware is not True:
        raise DevicePointerRefused(_cuda.refusal(fn, "tensor", t.device, ctx.aware()))
    return path


def _one_device(fn: str, named) -> torch.device:
    """The device all tensors of an op share; raise naming the first that differs."""
    ref_name, ref = None, None
    for name, t in named:
        if t is None:
            continue
        _c.check_tensor(t, fn, name)
        if ref is None:
            ref_name, ref = name, t
        elif t.device != ref.device:
            raise TensorError(f"{fn}: {name} is on {t.device} but {ref_name} is on {ref.device}; "
                              f"all tensors of one op must be on one device")
    return ref.device if ref is not None else torch.device("cpu")


def _listed(name: str, lst):
    return [(f"{name}[{i}]", t) for i, t in enumerate(lst or [])]


def _buf(t, fn, arg, ctx, sync=True):
    # CPU stand-ins (tests) have no stream to wait for
    return _cuda.device_buffer(t, fn, arg, sync=sync and t.is_cuda, awareness=ctx.aware())


def _sync(t) -> None:
    if t.is_cuda:
        torch.cuda.current_stream(t.device).synchronize()


def _done(async_op: bool, result):
    return CompletedWork(result) if async_op else None


def _run_staged(ctx, ref, specs, call, async_op, result):
    """Stage SPECS [(tensor, read, write)], run CALL(host twins) (the CPU op), copy back."""
    st = ctx.stage().staged(ref)
    hosts = st.twins(specs)
    try:
        work = call(hosts)
    except BaseException:
        st.abort()
        raise
    return st.complete(work, async_op, result)


def _elementwise(ctx, t, call, *, read, write, async_op):
    """Staging for ops that treat every element alike: pipelined when large and blocking."""
    stg = ctx.stage()
    if not async_op and stg.pipelined(t):
        stg.pipeline(t, lambda h: call(h, False), read=read, write=write)
        return None
    return _run_staged(ctx, t, [(t, read, write)], lambda hs: call(hs[0], async_op), async_op,
                       [t])


# -- reductions -----------------------------------------------------------------------------

def all_reduce(tensor, op, comm, async_op, ctx: DeviceCtx = _DEFAULT):
    R = _mod("reduce")
    fn = "all_reduce"
    _one_device(fn, [("tensor", tensor)])
    mop, kind = _c.reduce_op(op, tensor.dtype, fn)
    if _route(ctx, fn, tensor, mop) == STAGING:
        return _elementwise(ctx, tensor, lambda h, a: R.all_reduce(h, op, comm, a),
                            read=True, write=True, async_op=async_op)
    entry = _c.record(comm, recorded_name(fn, kind), tensor.shape, tensor.dtype)
    _c.pre_reduce(tensor, op, kind)
    comm.mpi.Allreduce(IN_PLACE, _buf(tensor, fn, "tensor", ctx), mop)
    _c.post_reduce(tensor, kind, comm.size)
    _c.record_end(entry)
    return _done(async_op, [tensor])


def reduce(tensor, dst, op, comm, async_op, ctx: DeviceCtx = _DEFAULT):
    R = _mod("reduce")
    fn = "reduce"
    comm.check_rank(dst, fn, "dst")
    _one_device(fn, [("tensor", tensor)])
    mop, kind = _c.reduce_op(op, tensor.dtype, fn)
    root = comm.rank == dst
    if _route(ctx, fn, tensor, mop) == STAGING:
        return _elementwise(ctx, tensor, lambda h, a: R.reduce(h, dst, op, comm, a),
                            read=True, write=root, async_op=async_op)
    entry = _c.record(comm, recorded_name(fn, kind), tensor.shape, tensor.dtype, dst)
    if root:
        _c.pre_reduce(tensor, op, kind)
        comm.mpi.Reduce(IN_PLACE, _buf(tensor, fn, "tensor", ctx), mop, root=dst)
        _c.post_reduce(tensor, kind, comm.size)
    else:
        send = tensor.clone() if kind == _PREMUL else tensor
        _c.pre_reduce(send, op, kind)
        comm.mpi.Reduce(_buf(send, fn, "tensor", ctx), None, mop, root=dst)
    _c.record_end(entry)
    return _done(async_op, [tensor])


def reduce_scatter_tensor(output, input, op, comm, async_op, ctx: DeviceCtx = _DEFAULT):
    R = _mod("reduce")
    fn = "reduce_scatter_tensor"
    _one_device(fn, [("output", output), ("input", input)])
    mop, kind = _c.reduce_op(op, output.dtype, fn)
    if _route(ctx, fn, output, mop) == STAGING:
        return _run_staged(ctx, output, [(output, False, True), (input, True, False)],
                           lambda h: R.reduce_scatter_tensor(h[0], h[1], op, comm, async_op),
                           async_op, [output])
    if input.dtype != output.dtype:
        raise TypeError(f"{fn}: input has dtype {input.dtype}, expected {output.dtype} "
                        f"(output's)")
    if input.numel() != output.numel() * comm.size:
        raise ValueError(f"{fn}: input has {input.numel()} elements, expected "
                         f"{output.numel() * comm.size} (output's {output.numel()} x group size "
                         f"{comm.size})")
    entry = _c.record(comm, recorded_name("reduce_scatter", kind), output.shape, output.dtype)
    if kind == _PREMUL:
        input = input.clone()
        _c.pre_reduce(input, op, kind)
    _sync(output)
    comm.mpi.Reduce_scatter_block(_buf(input, fn, "input", ctx, sync=False),
                                  _buf(output, fn, "output", ctx, sync=False), mop)
    _c.post_reduce(output, kind, comm.size)
    _c.record_end(entry)
    return _done(async_op, [output])


def reduce_scatter(output, input_list, op, comm, async_op, ctx: DeviceCtx = _DEFAULT):
    fn = "reduce_scatter"
    _c.check_list(input_list, comm.size, fn, "input_list")
    _one_device(fn, [("output", output)] + _listed("input_list", input_list))
    _c.same_spec(input_list, output, fn, "input_list")
    flat = torch.cat([t.reshape(-1) for t in input_list])
    return reduce_scatter_tensor(output, flat, op, comm, async_op, ctx)


# -- data movement --------------------------------------------------------------------------

def broadcast(tensor, src, comm, async_op, ctx: DeviceCtx = _DEFAULT):
    G = _mod("gather")
    fn = "broadcast"
    comm.check_rank(src, fn, "src")
    _one_device(fn, [("tensor", tensor)])
    root = comm.rank == src
    if _route(ctx, fn, tensor) == STAGING:
        return _elementwise(ctx, tensor, lambda h, a: G.broadcast(h, src, comm, a),
                            read=root, write=not root, async_op=async_op)
    entry = _c.record(comm, fn, tensor.shape, tensor.dtype, src)
    # receivers wait too: a kernel still queued on their tensor would overwrite what MPI wrote
    comm.mpi.Bcast(_buf(tensor, fn, "tensor", ctx), root=src)
    _c.record_end(entry)
    return _done(async_op, [tensor])


def all_gather_into_tensor(output_tensor, input_tensor, comm, async_op,
                           ctx: DeviceCtx = _DEFAULT):
    G = _mod("gather")
    fn = "all_gather_into_tensor"
    _one_device(fn, [("output_tensor", output_tensor), ("input_tensor", input_tensor)])
    if _route(ctx, fn, output_tensor) == STAGING:
        return _run_staged(ctx, output_tensor,
                           [(output_tensor, False, True), (input_tensor, True, False)],
                           lambda h: G.all_gather_into_tensor(h[0], h[1], comm, async_op),
                           async_op, [output_tensor])
    if output_tensor.dtype != input_tensor.dtype:
        raise TypeError(f"{fn}: output_tensor has dtype {output_tensor.dtype}, expected "
                        f"{input_tensor.dtype} (input_tensor's)")
    if output_tensor.numel() != input_tensor.numel() * comm.size:
        raise ValueError(f"{fn}: output_tensor has {output_tensor.numel()} elements, expected "
                         f"{input_tensor.numel() * comm.size} (input's {input_tensor.numel()} x "
                         f"group size {comm.size})")
    entry = _c.record(comm, "all_gather", input_tensor.shape, input_tensor.dtype)
    _sync(output_tensor)
    comm.mpi.Allgather(_buf(input_tensor, fn, "input_tensor", ctx, sync=False),
                       _buf(output_tensor, fn, "output_tensor", ctx, sync=False))
    _c.record_end(entry)
    return _done(async_op, [output_tensor])


def _copy_into(flat, outputs) -> None:
    off = 0
    for t in outputs:
        n = t.numel()
        t.view(-1).copy_(flat[off:off + n])
        off += n


def all_gather(tensor_list, tensor, comm, async_op, ctx: DeviceCtx = _DEFAULT):
    G = _mod("gather")
    fn = "all_gather"
    _c.check_list(tensor_list, comm.size, fn, "tensor_list")
    _one_device(fn, [("tensor", tensor)] + _listed("tensor_list", tensor_list))
    if _route(ctx, fn, tensor) == STAGING:
        specs = [(tensor, True, False)] + [(t, False, True) for t in tensor_list]
        return _run_staged(ctx, tensor, specs,
                           lambda h: G.all_gather(h[1:], h[0], comm, async_op),
                           async_op, list(tensor_list))
    _c.same_spec(tensor_list, tensor, fn, "tensor_list", same_shape=False)
    for i, t in enumerate(tensor_list):
        if t.numel() != tensor.numel():
            raise ValueError(f"{fn}: tensor_list[{i}] has {t.numel()} elements, expected "
                             f"{tensor.numel()} (tensor's; every rank sends the same size)")
    flat = tensor.new_empty(tensor.numel() * comm.size)
    all_gather_into_tensor(flat, tensor, comm, False, ctx)
    _copy_into(flat, tensor_list)
    return _done(async_op, list(tensor_list))


def gather(tensor, gather_list, dst, comm, async_op, ctx: DeviceCtx = _DEFAULT):
    G = _mod("gather")
    fn = "gather"
    comm.check_rank(dst, fn, "dst")
    root = comm.rank == dst
    _one_device(fn, [("tensor", tensor)] + (_listed("gather_list", gather_list) if root else []))
    if _route(ctx, fn, tensor) == STAGING:
        glist = list(gather_list) if root and gather_list is not None else []
        specs = [(tensor, True, False)] + [(t, False, True) for t in glist]
        return _run_staged(ctx, tensor, specs,
                           lambda h: G.gather(h[0], h[1:] if root else gather_list, dst, comm,
                                              async_op),
                           async_op, glist if root else [tensor])
    if not root:
        if gather_list:
            raise ValueError(f"{fn}: gather_list must be None or empty on rank {comm.rank}, "
                             f"which is not the destination (dst={dst})")
        entry = _c.record(comm, fn, tensor.shape, tensor.dtype, dst)
        comm.mpi.Gather(_buf(tensor, fn, "tensor", ctx), None, root=dst)
        _c.record_end(entry)
        return _done(async_op, [tensor])
    _c.check_list(gather_list, comm.size, fn, "gather_list")
    _c.same_spec(gather_list, tensor, fn, "gather_list")
    flat = tensor.new_empty(tensor.numel() * comm.size)
    entry = _c.record(comm, fn, tensor.shape, tensor.dtype, dst)
    comm.mpi.Gather(_buf(tensor, fn, "tensor", ctx), _buf(flat, fn, "gather_list", ctx,
                                                          sync=False), root=dst)
    _copy_into(flat, gather_list)
    _c.record_end(entry)
    return _done(async_op, list(gather_list))


def scatter(tensor, scatter_list, src, comm, async_op, ctx: DeviceCtx = _DEFAULT):
    G = _mod("gather")
    fn = "scatter"
    comm.check_rank(src, fn, "src")
    root = comm.rank == src
    _one_device(fn, [("tensor", tensor)] + (_listed("scatter_list", scatter_list) if root
                                            else []))
    if _route(ctx, fn, tensor) == STAGING:
        slist = list(scatter_list) if root and scatter_list is not None else []
        specs = [(tensor, False, True)] + [(t, True, False) for t in slist]
        return _run_staged(ctx, tensor, specs,
                           lambda h: G.scatter(h[0], h[1:] if root else scatter_list, src, comm,
                                               async_op),
                           async_op, [tensor])
    if not root:
        if scatter_list:
            raise ValueError(f"{fn}: scatter_list must be None or empty on rank {comm.rank}, "
                             f"which is not the source (src={src})")
        entry = _c.record(comm, fn, tensor.shape, tensor.dtype, src)
        comm.mpi.Scatter(None, _buf(tensor, fn, "tensor", ctx), root=src)
        _c.record_end(entry)
        return _done(async_op, [tensor])
    _c.check_list(scatter_list, comm.size, fn, "scatter_list")
    _c.same_spec(scatter_list, tensor, fn, "scatter_list")
    flat = torch.cat([t.reshape(-1) for t in scatter_list])
    entry = _c.record(comm, fn, tensor.shape, tensor.dtype, src)
    comm.mpi.Scatter(_buf(flat, fn, "scatter_list", ctx), _buf(tensor, fn, "tensor", ctx,
                                                               sync=False), root=src)
    _c.record_end(entry)
    return _done(async_op, [tensor])


def all_to_all_single(output, input, output_split_sizes, input_split_sizes, comm, async_op,
                      ctx: DeviceCtx = _DEFAULT):
    A = _mod("alltoall")
    fn = "all_to_all_single"
    _one_device(fn, [("output", output), ("input", input)])
    if _route(ctx, fn, output) == STAGING:
        return _run_staged(ctx, output, [(output, False, True), (input, True, False)],
                           lambda h: A.all_to_all_single(h[0], h[1], output_split_sizes,
                                                         input_split_sizes, comm, async_op),
                           async_op, [output])
    if input.dtype != output.dtype:
        raise TypeError(f"{fn}: output has dtype {output.dtype}, expected {input.dtype} (input's)")
    scounts, sdis, rcounts, rdis = A.v_layout(output, input, output_split_sizes,
                                              input_split_sizes, comm.size, comm.rank, fn)
    entry = _c.record(comm, "all_to_all", input.shape, input.dtype)
    _sync(output)
    inp = _buf(input, fn, "input", ctx, sync=False)
    out = _buf(output, fn, "output", ctx, sync=False)
    # Alltoallv whatever the splits, as the host path (alltoall.all_to_all_single says why)
    comm.mpi.Alltoallv([inp, (scounts, sdis)], [out, (rcounts, rdis)])
    _c.record_end(entry)
    return _done(async_op, [output])


def all_to_all(output_tensor_list, input_tensor_list, comm, async_op, ctx: DeviceCtx = _DEFAULT):
    A = _mod("alltoall")
    fn = "all_to_all"
    n = comm.size
    _c.check_list(input_tensor_list, n, fn, "input_tensor_list")
    _c.check_list(output_tensor_list, n, fn, "output_tensor_list")
    _one_device(fn, _listed("input_tensor_list", input_tensor_list)
                + _listed("output_tensor_list", output_tensor_list))
    ref = input_tensor_list[0]
    if _route(ctx, fn, ref) == STAGING:
        specs = ([(t, True, False) for t in input_tensor_list]
                 + [(t, False, True) for t in output_tensor_list])
        return _run_staged(ctx, ref, specs,
                           lambda h: A.all_to_all(h[n:], h[:n], comm, async_op),
                           async_op, list(output_tensor_list))
    _c.same_spec(input_tensor_list, ref, fn, "input_tensor_list", same_shape=False)
    _c.same_spec(output_tensor_list, ref, fn, "output_tensor_list", same_shape=False)
    flat_in = torch.cat([t.reshape(-1) for t in input_tensor_list])
    flat_out = ref.new_empty(sum(t.numel() for t in output_tensor_list))
    all_to_all_single(flat_out, flat_in, [t.numel() for t in output_tensor_list],
                      [t.numel() for t in input_tensor_list], comm, False, ctx)
    _copy_into(flat_out, output_tensor_list)
    return _done(async_op, list(output_tensor_list))


# -- point-to-point ---------------------------------------------------------------------------
# Never pipelined: a CPU peer posts one receive for the whole tensor, so the message must stay
# one message whatever the device on either side.

def _p2p():
    P = _mod("p2p")
    return P, getattr(_c, "record_p2p", _c.record)


def send(tensor, dst, comm, tag, ctx: DeviceCtx = _DEFAULT):
    P, rec = _p2p()
    fn = "send"
    _one_device(fn, [("tensor", tensor)])
    if _route(ctx, fn, tensor) == STAGING:
        return _run_staged(ctx, tensor, [(tensor, True, False)],
                           lambda h: P.send(h[0], dst, comm, tag), False, None)
    P._check_peer(comm, dst, fn, "dst")
    P._check_tag(tag, fn)
    entry = rec(comm, "send", tensor.shape, tensor.dtype, dst)
    comm.mpi.Send(_buf(tensor, fn, "tensor", ctx), dst, tag)
    _c.record_end(entry)


def isend(tensor, dst, comm, tag, ctx: DeviceCtx = _DEFAULT):
    P, rec = _p2p()
    fn = "isend"
    _one_device(fn, [("tensor", tensor)])
    if _route(ctx, fn, tensor) == STAGING:
        return _run_staged(ctx, tensor, [(tensor, True, False)],
                           lambda h: P._isend(h[0], dst, comm, tag, False), True, [tensor])
    P._check_peer(comm, dst, fn, "dst")
    P._check_tag(tag, fn)
    entry = rec(comm, "send", tensor.shape, tensor.dtype, dst)
    req = comm.mpi.Isend(_buf(tensor, fn, "tensor", ctx), dst, tag)
    return Work([req], [tensor], None, entry, keep=tensor)


def recv(tensor, src, comm, tag, ctx: DeviceCtx = _DEFAULT) -> int:
    P, rec = _p2p()
    fn = "recv"
    _one_device(fn, [("tensor", tensor)])
    if _route(ctx, fn, tensor) == STAGING:
        got = []
        _run_staged(ctx, tensor, [(tensor, False, True)],
                    lambda h: got.append(P.recv(h[0], src, comm, tag)), False, None)
        return got[0]
    source = MPI.ANY_SOURCE if src is None else P._check_peer(comm, src, fn, "src")
    P._check_tag(tag, fn)
    entry = rec(comm, "recv", tensor.shape, tensor.dtype, src)
    status = MPI.Status()
    comm.mpi.Recv(_buf(tensor, fn, "tensor", ctx), source, tag, status)
    _c.record_end(entry)
    return status.Get_source()


def irecv(tensor, src, comm, tag, ctx: DeviceCtx = _DEFAULT):
    P, rec = _p2p()
    fn = "irecv"
    _one_device(fn, [("tensor", tensor)])
    if _route(ctx, fn, tensor) == STAGING:
        return _run_staged(ctx, tensor, [(tensor, False, True)],
                           lambda h: P._irecv(h[0], src, comm, tag, False), True, [tensor])
    source = MPI.ANY_SOURCE if src is None else P._check_peer(comm, src, fn, "src")
    P._check_tag(tag, fn)
    entry = rec(comm, "recv", tensor.shape, tensor.dtype, src)
    req = comm.mpi.Irecv(_buf(tensor, fn, "tensor", ctx), source, tag)
    return Work([req], [tensor], None, entry, keep=tensor, status=MPI.Status())
