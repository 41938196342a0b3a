"""A call of an op: validated once into a :class:`Call`, then :func:`take`, the one place for what
every call shares.

An op (reduce.py, gather.py, alltoall.py, p2p.py) checks its tensors (``as_array``: the numpy
views MPI takes), resolves its group and reduce op here, fills a Call and hands it to
``take`` with its route (hpcddp.collectives.paths.route: the op's rows of the dispatch
table). ``take``:

1. sends a call on CUDA tensors (validated by its op as any call, without host views) to a
   device row (hpcddp.collectives.paths.device): host staging points the call at host twins
   and hands it back here, a CPU call, once; the CUDA-aware row is the call's only row in
   the steps below;
2. records a collective in the flight recorder (written here as the recorder's native writer
   does: one list in its ring) and, for a call of AGREE_BYTES or more (every call with
   HPCDDP_DEBUG=detail), has every rank agree on it before any path is asked (a node-local
   path's first use is collective; the arguments that choose it are the ones agreed on);
   an async call where the async engine is on, or any call while calls issued before it are
   still queued, goes to the engine instead, in issue order (hpcddp.collectives.engine);
3. runs the first row that applies (the last, MPI, always does), of the rows as they stand on
   the call's group (:func:`group_rows`: a node-local path that cannot serve the group is
   not asked, one that serves from a size is skipped below it with a compare); the paths
   only SUM: a PREMUL_SUM's inputs are scaled before (:func:`premultiply`; put back as they
   were where the call fails), an AVG's result divided after (:func:`average`, chained onto the path's Work where it returns one);
4. ends the record and answers where the path completed the op (None, or a completed Work
   for ``async_op``), or hands out the path's Work; a path that raises leaves the record
   closed as unfinished (:func:`failed`);
5. keeps the plan memo, one policy for every op: a call on the same tensor objects as the
   op's call before (the op names them: ``memo``), where the row that ran has a planner
   (``plan_<op>``: the MPI path's calls, the list forms' exchange), is planned, and the
   plan-hit rows replay it from the next call on, before validation
   (hpcddp.collectives._plans; the C hit where the module is built). Fresh tensors per call
   are never planned.

Everything take does is written out in it, in that order, so the first call of a small
all_reduce enters five files, each once (scripts/journey.py counts it): the torch backend,
the op, the views, this module, the path.
"""
from __future__ import annotations

import weakref
from operator import is_ as _is

import torch

from hpcddp import settings as _settings
from hpcddp.collectives import engine as _engine
from hpcddp.collectives._node import NEVER
from hpcddp.collectives.work import CompletedWork
from hpcddp.comm import startup as _rt
from hpcddp.comm._mpi import MPI
from hpcddp.comm.buffers import DeviceTensor, as_array, one_device
from hpcddp.comm.communicator import Communicator
from hpcddp.comm.ops import RedOpType, mpi_op
from hpcddp.diagnostics import mismatch as _mismatch, recorder as _rec


class Call:
    """One call of an op, validated once. Every op sets what ``take`` reads: ``comm``,
    ``group``, ``async_op``, ``device`` (the tensors are CUDA tensors: validated alike,
    without host views; hpcddp.collectives.paths.device), ``nbytes``, what the flight recorder files the
    call under: ``name`` (the recorded op), ``shape``, ``dtype``, ``root`` (the root or peer,
    None without one), ``red`` (a reduction's kind, else None), ``results`` (what a
    completed async call's Work returns), and ``memo`` (the tensors a plan of the call is
    filed under, None where the op's call cannot be planned). The rest are the op's own,
    read only by the paths of that op. No __init__: the fields are set where they are found,
    which costs a small call less than an __init__ would (docs/benchmarks.md, "The dispatch
    table")."""
    __slots__ = ("comm", "group", "async_op", "device", "nbytes", "name", "shape", "dtype",
                 "root", "red", "results", "memo", "entry",
                 "tensor", "arr", "output", "out", "input", "inp", "tensors", "views", "op",
                 "mop", "kind", "tag",
                 "block",       # the list forms: one block's element count, the same on every
                                # rank (0: blocks of any size, all_to_all)
                 "layout",      # all_to_all_single: (send counts, displacements, recv ...)
                 "exchange",    # the list forms' exchange as run: (own copy, sends, recvs)
                 "via",         # what a path's applies() found for the group (its Arena,
                                # Peers, Hier, Ring), for its run
                 "plannable")   # point-to-point: the C plan may take the call


# -- what an op resolves -------------------------------------------------------------------------

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


_SUM, _AVG, _PREMUL = RedOpType.SUM, RedOpType.AVG, RedOpType.PREMUL_SUM
_sum_cache: dict = {}
_op_cache: dict = {}


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


_names: dict = {}


def recorded_name(fn: str, kind) -> str:
    """The name a reduction FN with reduce op KIND is recorded under: FN for a SUM, else
    FN[OP] (``all_reduce[MAX]``), so that the audit, the agreement and the stall report tell
    apart ranks that reduce with different ops."""
    if kind == _SUM:
        return fn
    key = (fn, int(kind))
    name = _names.get(key)
    if name is None:
        name = _names[key] = f"{fn}[{kind.name}]"
    return name


def pair(fn: str, output, input, group, async_op: bool, out_arg: str = "output",
         in_arg: str = "input") -> Call:
    """The Call of op FN from INPUT into OUTPUT, with their views ``out`` and ``inp`` (or
    ``device`` where one is a CUDA tensor: the device path checks them); nbytes is the op's.
    Recorded under FN with INPUT's shape and dtype, OUTPUT its result (ops refine both)."""
    call = Call()
    call.comm, call.group, call.async_op = resolve(group, fn), group, async_op
    call.output, call.input, call.nbytes = output, input, 0
    try:
        call.out = as_array(output, fn, out_arg)
        call.inp = as_array(input, fn, in_arg)
    except DeviceTensor:  # a CUDA tensor (CPU tensors never raise it): both on its device
        call.device = True
        one_device(fn, (out_arg, output), (in_arg, input))
    else:
        call.device = False
    call.name, call.shape, call.dtype = fn, input.shape, input.dtype
    call.root = call.red = call.memo = None
    call.results = [output]
    return call


# -- take ----------------------------------------------------------------------------------------

# the flight recorder's ring, as its native writers share it (diagnostics.recorder)
_ring, _slots, _clock, _ = _rec.RECORDER.native_writer()
_T_END = _rec.T_END
_ref = weakref.ref
_deref = weakref.ref.__call__      # a C slot: r() without a Python frame (3.10 has no
#                                   operator.call)
# from which size take runs the cross-rank agreement after the record: every collective with
# HPCDDP_DEBUG=detail, else those of at least AGREE_BYTES (agree_recorded re-tests exactly)
_agree_recorded = _mismatch.check_recorded if _mismatch.enabled() else _mismatch.agree_large
_AGREE_FROM = 0 if _mismatch.enabled() else _mismatch.AGREE_BYTES
# the plan memo: (op, id of the call's first tensor) -> weak references to the call's tensors.
# A call is planned where they still are its tensors: fresh tensors whose ids the allocator
# reuses are never planned (written with C builtins only: map, operator.is_, ref.__call__)
_seen: dict = {}
MAX_SEEN = 4096


def take(route: tuple, call: Call):
    """Run CALL on the first of ROUTE's paths that applies: what the op answers (the steps
    in this module's docstring). A path returns None once the op is complete, or the Work
    that completes it. Point-to-point ops (route[6] False) are recorded by their path, under
    their own numbering, and never queued (MPI orders them among themselves)."""
    if call.device:       # the device rows (a flag, tested without a call)
        _engine.drain(call.comm)   # the caller's thread keeps its CUDA stream
        if not route[0](call):     # host staging: this take again, on host twins
            return route[2](call, route)
        route = route[8]           # CUDA-aware: its row alone, recorded and scaled here
    collective, comm = route[6], call.comm
    if collective:
        if _engine.pending or call.async_op and _engine.on() and not call.device:
            return _enqueue(route, call)
        seq = comm.seq = comm.seq + 1          # the record (recorder.FlightRecorder.start)
        _ring[next(_slots)] = entry = call.entry = [seq, call.name, comm, call.shape,
                                                    call.dtype, call.root, _clock[0], 0.0]
    nbytes, red, unscaled = call.nbytes, call.red, None
    try:
        if collective and nbytes >= _AGREE_FROM:
            _agree_recorded(comm, entry, red)
        # !=, ==: torch hands out new enum objects; a SUM stops at the first compare
        scaled = red is not None and red != _SUM and (red == _PREMUL or red == _AVG)
        if scaled and red == _PREMUL:
            unscaled = premultiply(route[7], call)
        rows = None if nbytes < route[3] else group_rows(route, comm)
        if rows is None or nbytes < rows[1]:
            run, plan = route[4]                # below every middle row's start
            done = run(call)
        else:
            for min_bytes, applies, run, plan, made in rows[2]:
                if nbytes >= min_bytes and (applies is None or applies(call, made)):
                    done = run(call)
                    break
        if scaled and red == _AVG:
            average(call, done)
    except BaseException:
        if collective:
            failed(entry)
        if unscaled is not None:
            call.tensor.copy_(unscaled)
        raise
    if collective and done is None:             # complete: the record's end, the answer
        entry[_T_END] = _clock[0]
        done = CompletedWork(call.results) if call.async_op else None
    keys = call.memo
    if keys is not None and plan is not None:   # the plan memo (docstring, step 5)
        key = (route[7], id(keys[0]))
        seen = _seen.get(key)
        if seen is not None and len(seen) == len(keys) and all(map(_is, map(_deref, seen),
                                                                   keys)):
            plan(call)                          # the same tensor objects as the call before
        else:
            if len(_seen) >= MAX_SEEN:
                _seen.clear()
            _seen[key] = tuple(map(_ref, keys))
    return done


def _enqueue(route: tuple, call: Call):
    """CALL on the async engine, behind the calls queued before it: recorded now, in issue
    order; agreed on and run on the engine's thread (:func:`_queued`). Async: its Work;
    blocking: None once it ran."""
    call.entry = _rec.start(call.comm, call.name, call.shape, call.dtype, call.root)
    run = _Queued(route)
    if call.async_op:
        return _engine.submit(run, call)
    _engine.in_order(run, call)
    return None


class _Queued:
    """A queued call's run on the engine's thread: the cross-rank agreement, its row, its
    end (never planned: a plan replays blocking calls on the caller's thread)."""
    __slots__ = ("route",)

    def __init__(self, route: tuple):
        self.route = route

    def __call__(self, call: Call):
        entry, red, unscaled = call.entry, call.red, None
        try:
            _agree_recorded(call.comm, entry, red)
            if red is not None and red == _PREMUL:
                unscaled = premultiply(self.route[7], call)
            done = run_host(self.route, call)
            if red is not None and red == _AVG:
                average(call, done)
        except BaseException:
            failed(entry)
            if unscaled is not None:
                call.tensor.copy_(unscaled)
            raise
        if done is None:
            entry[_T_END] = _clock[0]
            return CompletedWork(call.results)
        return done


def premul_factor(op):
    """The factor of a PREMUL_SUM reduce op (a float or a tensor)."""
    factor = getattr(op, "factor", None)
    if factor is None:
        raise ValueError("PREMUL_SUM needs a factor: use dist._make_nccl_premul_sum(factor)")
    return factor


def premultiply(method: str, call: Call):
    """A PREMUL_SUM's inputs times its factor (NCCL's definition), so the path runs a SUM: in
    place where the op's input is its result (all_reduce; reduce on the root), else on copies
    the call then sends (the caller's inputs are left as they were). In place, in the tensor's
    dtype: a factor tensor of another dtype must not promote what MPI is told it sends.

    Returns a copy of the tensor as the caller passed it where it was scaled in place (take
    puts it back if the call fails: a path's agreement refuses a call before it runs, and the
    refusal says the tensor is as it was; dividing by the factor again would not be exact),
    else None."""
    factor = premul_factor(call.op)
    if method == "all_reduce" or method == "reduce" and call.comm.rank == call.root:
        unscaled = call.tensor.clone()
        call.tensor.mul_(factor)
        return unscaled
    # (a device call has no host views: the CUDA-aware path reads the tensors)
    if method == "reduce":
        call.tensor = call.tensor.clone().mul_(factor)
        if not call.device:
            call.arr = as_array(call.tensor)
    elif method == "reduce_scatter_tensor":
        call.input = call.input.clone().mul_(factor)
        if not call.device:
            call.inp = as_array(call.input)
    else:                                   # reduce_scatter: one block per rank
        call.tensors = [t.clone().mul_(factor) for t in call.tensors]
    return None


def average(call: Call, done) -> None:
    """An AVG's result: the SUM the path made (where the op has one on this rank: reduce only
    on its root) divided by the group's size, now or, where the path left the op in flight
    (DONE, its Work), as the Work completes."""
    if call.root is not None and call.comm.rank != call.root:
        return
    tensor, size = call.tensor, call.comm.size
    if done is None:
        tensor.div_(size)
    else:
        done.then_finish(lambda: tensor.div_(size))


def failed(entry: list) -> None:
    """Close the record ENTRY of a call whose path raised: no longer in flight, and marked as
    left unfinished (diagnostics.recorder.describe: "abandoned"), so a stall report names it
    as the call this rank gave up, not one it still waits in."""
    if entry[_T_END] == 0.0:      # one the agreement refused is closed already (mismatch.refused)
        entry[_T_END] = _clock[0]
        entry.append("failed")


def run_host(route: tuple, call: Call):
    """CALL (on CPU tensors, recorded) on the first of ROUTE's host rows that applies: what
    the row returns."""
    nbytes, comm = call.nbytes, call.comm
    rows = None if nbytes < route[3] else group_rows(route, comm)
    if rows is None or nbytes < rows[1]:
        return route[4][0](call)
    for min_bytes, applies, run, _, made in rows[2]:
        if nbytes >= min_bytes and (applies is None or applies(call, made)):
            return run(call)


def group_rows(route: tuple, comm: Communicator) -> tuple:
    """ROUTE's host rows as they stand on COMM: (ROUTE, the smallest start of a middle row,
    the rows, the settings snapshot they were made under), each row with its floor on the
    group as its size and, last, the path's state
    for the group where made and raced (what its applies() then need not look up; None
    elsewhere), the node-local paths that can never serve it left out
    (hpcddp.collectives._node.group_floor; also those switched off). Kept in
    ``comm.rows`` under the op's name (a string: its hash is cached) until the group's
    attached state changes (a path made, closed or raced) or the settings snapshot is
    replaced (a switch may have changed: an attribute compared, no call); one lookup, as a
    race on another thread may forget them meanwhile."""
    got = comm.rows.get(route[7])
    if got is not None and got[0] is route and got[3] is _settings._current:
        return got
    state = comm._attached
    rows = []
    for row in route[5]:
        at, made = (row[0], None) if row[4] is None else row[4](comm)
        if at < NEVER:
            rows.append((at, *row[1:4], made))
    floor = min((row[0] for row in rows[:-1]), default=NEVER)
    got = (route, floor, tuple(rows), _settings._current)
    if comm._attached is state:     # not released meanwhile (by another thread): keep them
        comm.rows[route[7]] = got
    return got

