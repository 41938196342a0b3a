"""``hpcddp bench comm``: every collective, every implementation, one job.

Implementations, all on the same buffers (float32, SUM) in the same job:

==============  ===========================================================================
``mpi4py``      raw mpi4py on numpy views of the buffers (the floor we add overhead to)
``hpcddp``      hpcddp through ``torch.distributed`` (``dist.all_reduce(t)``, default group)
``direct``      hpcddp's direct API (``hpcddp.all_reduce(t)``: no torch dispatch)
``gloo``        gloo through ``torch.distributed`` (a second group, ``backend="gloo"``)
``memcpy``      ``np.copyto`` of the same S bytes on each rank: a ceiling, not a collective
``hpcddp-async`` (opt-in) ``dist.all_reduce(t, async_op=True).wait()``: the path DDP takes
``direct-unchecked`` (opt-in; all_reduce, reduce_scatter, broadcast) the direct API with default mode's
                cross-rank call agreement turned off: ``direct`` / ``direct-unchecked`` is
                what the agreement costs (docs/hangs.md). Not a mode users can select.
==============  ===========================================================================

Sizes S follow nccl-tests: all_reduce, broadcast, reduce and send/recv one rank's buffer;
all_gather and gather the total output (per-rank input x n); reduce_scatter and scatter the
total input; all_to_all one rank's whole send buffer. Per-rank blocks are rounded down to whole
float32 elements (at least one), and the bytes actually moved are what is reported. busbw =
algbw x factor (all_reduce 2(n-1)/n; all_gather, reduce_scatter, all_to_all, gather, scatter
(n-1)/n; broadcast, reduce, send/recv 1). reduce, gather and scatter (rank 0 the root) run
only when ``--ops`` names them.

The ``*_list`` free forms (``all_gather``, ``reduce_scatter``, ``all_to_all``) take lists of
separate tensors, as torch's documentation examples do; the ``*_tensor``/``_single`` forms one
flat tensor. mpi4py has no list form: its row is the flat call in both cases.

Correctness is checked once per cell and implementation, outside timing, with integer-valued
data whose result is exact in float32; timing runs on zeros (an in-place SUM stays finite).
"""
from __future__ import annotations

import gc

OPS = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
       "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "send_recv")
# rooted ops, on request (``--ops reduce,gather,scatter``): rank 0 is the root; the saved
# default runs (and ``--compare`` against them) keep the ops above
ROOTED_OPS = ("reduce", "gather", "scatter")
ALL_OPS = OPS + ROOTED_OPS
IMPLS = ("mpi4py", "hpcddp", "direct", "gloo", "memcpy")
OPTIONAL_IMPLS = ("hpcddp-async", "direct-unchecked")
ALL_IMPLS = IMPLS + OPTIONAL_IMPLS


def busbw_factor(op: str, n: int) -> float:
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("broadcast", "send_recv", "reduce"):
        return 1.0
    return (n - 1) / n


def _torch_name(dist, new: str, old: str):
    """torch's current name for an op: torch 2.13 renamed all_gather_into_tensor and
    reduce_scatter_tensor to *_single and warns on every call of the old names, which costs
    each call 2-5 us (``python -m hpcddp.bench.dispatch``), for gloo as for hpcddp."""
    return getattr(dist, new, None) or getattr(dist, old)


class _Cell:
    """One op at one size: buffers, one callable per implementation, prepare/verify."""

    per_block = False   # S is split into n blocks (all_gather, reduce_scatter, all_to_all)

    def __init__(self, ctx, size: int):
        import torch
        self.torch = torch
        self.ctx = ctx
        n = ctx.n
        if self.per_block:
            self.count = max(1, size // (4 * n))
            self.nbytes = self.count * 4 * n
        else:
            self.count = max(1, size // 4)
            self.nbytes = self.count * 4
        nelem = self.nbytes // 4
        self.m_src = torch.zeros(nelem).numpy()
        self.m_dst = torch.zeros(nelem).numpy()
        self.build()

    # subclasses: build() makes buffers; fns() -> {impl: callable}; prepare(impl); verify(impl)
    def memcpy(self):
        import numpy as np
        src, dst = self.m_src, self.m_dst
        return lambda: np.copyto(dst, src)

    def pattern(self, count: int, offset: float):
        # exact in float32: integers below 2**24
        return (self.torch.arange(count, dtype=self.torch.float32) % 997) + offset

    def callables(self, impls) -> dict:
        fns = self.fns()
        fns["memcpy"] = self.memcpy()
        return {name: fns[name] for name in impls if name in fns}

    def check(self, impl: str, fn) -> bool:
        if impl == "memcpy":
            self.m_src[:] = self.pattern(self.m_src.size, 1.0).numpy()
            fn()
            ok = bool((self.m_dst == self.m_src).all())
            self.m_src[:] = 0
            self.m_dst[:] = 0
            return ok
        self.prepare(impl)
        fn()
        ok = self.verify(impl)
        self.reset()
        return ok

    def reset(self) -> None:
        for t in self.buffers():
            t.zero_()


class AllReduce(_Cell):
    def build(self):
        self.t = self.torch.zeros(self.count)
        self.a = self.t.numpy()

    def buffers(self):
        return [self.t]

    def fns(self):
        c, t, a = self.ctx, self.t, self.a
        raw, MPI, dist, hp, G = c.raw, c.MPI, c.dist, c.hpcddp, c.gloo
        in_place, SUM = MPI.IN_PLACE, MPI.SUM
        return {
            "mpi4py": lambda: raw.Allreduce(in_place, a, SUM),
            "hpcddp": lambda: dist.all_reduce(t),
            "direct": lambda: hp.all_reduce(t),
            "gloo": lambda: dist.all_reduce(t, group=G),
            "hpcddp-async": lambda: dist.all_reduce(t, async_op=True).wait(),
            "direct-unchecked": c.unchecked(lambda: hp.all_reduce(t)),
        }

    def prepare(self, impl):
        self.t.copy_(self.pattern(self.count, 0.0) * (self.ctx.rank + 1))

    def verify(self, impl):
        n = self.ctx.n
        return bool(self.torch.equal(self.t, self.pattern(self.count, 0.0) * (n * (n + 1) // 2)))


class Broadcast(_Cell):
    def build(self):
        self.t = self.torch.zeros(self.count)
        self.a = self.t.numpy()

    def buffers(self):
        return [self.t]

    def fns(self):
        c, t, a = self.ctx, self.t, self.a
        raw, dist, hp, G = c.raw, c.dist, c.hpcddp, c.gloo
        return {
            "mpi4py": lambda: raw.Bcast(a, root=0),
            "hpcddp": lambda: dist.broadcast(t, 0),
            "direct": lambda: hp.broadcast(t, 0),
            "direct-unchecked": c.unchecked(lambda: hp.broadcast(t, 0)),
            "gloo": lambda: dist.broadcast(t, 0, group=G),
            "hpcddp-async": lambda: dist.broadcast(t, 0, async_op=True).wait(),
        }

    def prepare(self, impl):
        if self.ctx.rank == 0:
            self.t.copy_(self.pattern(self.count, 5.0))
        else:
            self.t.fill_(-1.0)

    def verify(self, impl):
        return bool(self.torch.equal(self.t, self.pattern(self.count, 5.0)))


class _Blocks(_Cell):
    """Ops whose S is n blocks of ``count`` elements."""
    per_block = True

    def block(self, src_rank: int, dst_rank: int):
        # what rank SRC_RANK sends towards DST_RANK's block: distinct for every pair
        return self.pattern(self.count, 1000.0 * src_rank + 100.0 * dst_rank)


class AllGather(_Blocks):
    list_form = True

    def build(self):
        z = self.torch.zeros
        n, c = self.ctx.n, self.count
        self.inp = z(c)
        self.flat = z(n * c)
        self.outs = [z(c) for _ in range(n)]

    def buffers(self):
        return [self.inp, self.flat, *self.outs]

    def fns(self):
        c = self.ctx
        raw, dist, hp, G = c.raw, c.dist, c.hpcddp, c.gloo
        inp, flat, outs = self.inp, self.flat, self.outs
        a_in, a_flat = inp.numpy(), flat.numpy()
        fns = {"mpi4py": lambda: raw.Allgather(a_in, a_flat)}
        if self.list_form:
            fns.update({
                "hpcddp": lambda: dist.all_gather(outs, inp),
                "direct": lambda: hp.all_gather(outs, inp),
                "gloo": lambda: dist.all_gather(outs, inp, group=G),
                "hpcddp-async": lambda: dist.all_gather(outs, inp, async_op=True).wait(),
            })
        else:
            single = _torch_name(dist, "all_gather_single", "all_gather_into_tensor")
            fns.update({
                "hpcddp": lambda: single(flat, inp),
                "direct": lambda: hp.all_gather_into_tensor(flat, inp),
                "gloo": lambda: single(flat, inp, group=G),
                "hpcddp-async": lambda: single(flat, inp, async_op=True).wait(),
            })
        return fns

    def prepare(self, impl):
        self.inp.copy_(self.block(self.ctx.rank, 0))

    def verify(self, impl):
        n, c = self.ctx.n, self.count
        if self.list_form and impl != "mpi4py":
            got = self.outs
        else:
            got = [self.flat[j * c:(j + 1) * c] for j in range(n)]
        return all(self.torch.equal(got[j], self.block(j, 0)) for j in range(n))


class AllGatherIntoTensor(AllGather):
    list_form = False


class ReduceScatter(_Blocks):
    list_form = True

    def build(self):
        z = self.torch.zeros
        n, c = self.ctx.n, self.count
        self.flat = z(n * c)
        self.ins = [z(c) for _ in range(n)]
        self.out = z(c)

    def buffers(self):
        return [self.flat, self.out, *self.ins]

    def fns(self):
        c = self.ctx
        raw, MPI, dist, hp, G = c.raw, c.MPI, c.dist, c.hpcddp, c.gloo
        flat, ins, out = self.flat, self.ins, self.out
        a_flat, a_out, SUM = flat.numpy(), out.numpy(), MPI.SUM
        fns = {"mpi4py": lambda: raw.Reduce_scatter_block(a_flat, a_out, SUM)}
        if self.list_form:
            fns.update({
                "hpcddp": lambda: dist.reduce_scatter(out, ins),
                "direct": lambda: hp.reduce_scatter(out, ins),
                "direct-unchecked": c.unchecked(lambda: hp.reduce_scatter(out, ins)),
                "gloo": lambda: dist.reduce_scatter(out, ins, group=G),
                "hpcddp-async": lambda: dist.reduce_scatter(out, ins, async_op=True).wait(),
            })
        else:
            single = _torch_name(dist, "reduce_scatter_single", "reduce_scatter_tensor")
            fns.update({
                "hpcddp": lambda: single(out, flat),
                "direct": lambda: hp.reduce_scatter_tensor(out, flat),
                "direct-unchecked": c.unchecked(lambda: hp.reduce_scatter_tensor(out, flat)),
                "gloo": lambda: single(out, flat, group=G),
                "hpcddp-async": lambda: single(out, flat, async_op=True).wait(),
            })
        return fns

    def prepare(self, impl):
        n, c, r = self.ctx.n, self.count, self.ctx.rank
        for j in range(n):
            blk = self.pattern(c, 0.0) * ((r + 1) * (j + 1))
            self.ins[j].copy_(blk)
            self.flat[j * c:(j + 1) * c].copy_(blk)

    def verify(self, impl):
        n, r = self.ctx.n, self.ctx.rank
        want = self.pattern(self.count, 0.0) * ((r + 1) * (n * (n + 1) // 2))
        return bool(self.torch.equal(self.out, want))


class ReduceScatterTensor(ReduceScatter):
    list_form = False


class AllToAll(_Blocks):
    list_form = True

    def build(self):
        z = self.torch.zeros
        n, c = self.ctx.n, self.count
        self.flat_in, self.flat_out = z(n * c), z(n * c)
        self.ins = [z(c) for _ in range(n)]
        self.outs = [z(c) for _ in range(n)]

    def buffers(self):
        return [self.flat_in, self.flat_out, *self.ins, *self.outs]

    def fns(self):
        c = self.ctx
        raw, dist, hp, G = c.raw, c.dist, c.hpcddp, c.gloo
        fi, fo, ins, outs = self.flat_in, self.flat_out, self.ins, self.outs
        a_in, a_out = fi.numpy(), fo.numpy()
        fns = {"mpi4py": lambda: raw.Alltoall(a_in, a_out)}
        if self.list_form:
            fns.update({
                "hpcddp": lambda: dist.all_to_all(outs, ins),
                "direct": lambda: hp.all_to_all(outs, ins),
                "gloo": lambda: dist.all_to_all(outs, ins, group=G),
                "hpcddp-async": lambda: dist.all_to_all(outs, ins, async_op=True).wait(),
            })
        else:
            fns.update({
                "hpcddp": lambda: dist.all_to_all_single(fo, fi),
                "direct": lambda: hp.all_to_all_single(fo, fi),
                "gloo": lambda: dist.all_to_all_single(fo, fi, group=G),
                "hpcddp-async": lambda: dist.all_to_all_single(fo, fi, async_op=True).wait(),
            })
        return fns

    def prepare(self, impl):
        n, c, r = self.ctx.n, self.count, self.ctx.rank
        for j in range(n):
            blk = self.block(r, j)
            self.ins[j].copy_(blk)
            self.flat_in[j * c:(j + 1) * c].copy_(blk)

    def verify(self, impl):
        n, c, r = self.ctx.n, self.count, self.ctx.rank
        if self.list_form and impl != "mpi4py":
            got = self.outs
        else:
            got = [self.flat_out[j * c:(j + 1) * c] for j in range(n)]
        return all(self.torch.equal(got[j], self.block(j, r)) for j in range(n))


class AllToAllSingle(AllToAll):
    list_form = False


class SendRecv(_Cell):
    """Ring exchange as nccl-tests' sendrecv: each rank sends S bytes to rank+1 while it
    receives S bytes from rank-1 (isend + irecv + wait: never deadlocks, any n)."""

    def build(self):
        self.s = self.torch.zeros(self.count)
        self.r = self.torch.zeros(self.count)

    def buffers(self):
        return [self.s, self.r]

    def fns(self):
        c = self.ctx
        raw, dist, hp, G = c.raw, c.dist, c.hpcddp, c.gloo
        s, r = self.s, self.r
        a_s, a_r = s.numpy(), r.numpy()
        nxt, prv = (c.rank + 1) % c.n, (c.rank - 1) % c.n

        def torch_api(isend, irecv, **kw):
            def go():
                w1 = isend(s, nxt, **kw)
                w2 = irecv(r, prv, **kw)
                w1.wait()
                w2.wait()
            return go

        return {
            "mpi4py": lambda: raw.Sendrecv(a_s, nxt, 0, a_r, prv, 0),
            "hpcddp": torch_api(dist.isend, dist.irecv),
            "direct": torch_api(hp.isend, hp.irecv),
            "gloo": torch_api(dist.isend, dist.irecv, group=G),
        }

    def prepare(self, impl):
        self.s.copy_(self.pattern(self.count, 1000.0 * self.ctx.rank))
        self.r.fill_(-1.0)

    def verify(self, impl):
        prv = (self.ctx.rank - 1) % self.ctx.n
        return bool(self.torch.equal(self.r, self.pattern(self.count, 1000.0 * prv)))


class Reduce(AllReduce):
    def fns(self):
        c, t, a = self.ctx, self.t, self.a
        raw, MPI, dist, hp, G = c.raw, c.MPI, c.dist, c.hpcddp, c.gloo
        SUM = MPI.SUM
        send, recv = (MPI.IN_PLACE, a) if c.rank == 0 else (a, None)
        return {
            "mpi4py": lambda: raw.Reduce(send, recv, SUM, root=0),
            "hpcddp": lambda: dist.reduce(t, 0),
            "direct": lambda: hp.reduce(t, 0),
            "gloo": lambda: dist.reduce(t, 0, group=G),
            "hpcddp-async": lambda: dist.reduce(t, 0, async_op=True).wait(),
        }

    def verify(self, impl):
        # what a non-root's tensor holds after is the backend's
        return self.ctx.rank != 0 or super().verify(impl)


class _Rooted(_Blocks):
    """gather (``list_in``: False) or scatter (True): rank 0's list of n blocks, every rank's
    one block; mpi4py's row is the flat call on one buffer of the n blocks."""
    name, raw_name, list_in = "gather", "Gather", False

    def build(self):
        z = self.torch.zeros
        n, c = self.ctx.n, self.count
        self.one, self.flat = z(c), z(n * c)
        self.lst = [z(c) for _ in range(n)]

    def buffers(self):
        return [self.one, self.flat, *self.lst]

    def fns(self):
        c = self.ctx
        root = c.rank == 0
        raw, op, hp_op = getattr(c.raw, self.raw_name), getattr(c.dist, self.name), \
            getattr(c.hpcddp, self.name)
        one, lst, G = self.one, self.lst if root else None, c.gloo
        a_one, a_flat = one.numpy(), self.flat.numpy() if root else None
        bufs = (a_flat, a_one) if self.list_in else (a_one, a_flat)
        return {
            "mpi4py": lambda: raw(*bufs, root=0),
            "hpcddp": lambda: op(one, lst, 0),
            "direct": lambda: hp_op(one, lst, 0),
            "gloo": lambda: op(one, lst, 0, group=G),
            "hpcddp-async": lambda: op(one, lst, 0, async_op=True).wait(),
        }


class Gather(_Rooted):
    def prepare(self, impl):
        self.one.copy_(self.block(self.ctx.rank, 0))

    def verify(self, impl):
        n, c = self.ctx.n, self.count
        if self.ctx.rank != 0:
            return True
        got = [self.flat[j * c:(j + 1) * c] for j in range(n)] if impl == "mpi4py" else self.lst
        return all(self.torch.equal(got[j], self.block(j, 0)) for j in range(n))


class Scatter(_Rooted):
    name, raw_name, list_in = "scatter", "Scatter", True

    def prepare(self, impl):
        c = self.count
        if self.ctx.rank == 0:
            for j in range(self.ctx.n):
                self.lst[j].copy_(self.block(0, j))
                self.flat[j * c:(j + 1) * c].copy_(self.block(0, j))
        self.one.fill_(-1.0)

    def verify(self, impl):
        return bool(self.torch.equal(self.one, self.block(0, self.ctx.rank)))


CELLS = {"all_reduce": AllReduce, "broadcast": Broadcast, "all_gather": AllGather,
         "all_gather_into_tensor": AllGatherIntoTensor, "reduce_scatter": ReduceScatter,
         "reduce_scatter_tensor": ReduceScatterTensor, "all_to_all": AllToAll,
         "all_to_all_single": AllToAllSingle, "send_recv": SendRecv,
         "reduce": Reduce, "gather": Gather, "scatter": Scatter}


class Context:
    """What every cell needs: ranks, the raw communicator, the torch groups."""

    def __init__(self, need_gloo: bool = True):
        import torch
        import torch.distributed as dist
        import hpcddp
        from hpcddp.comm import MPI
        torch.set_num_threads(1)
        hpcddp.init(abort_on_exception=True)
        hpcddp.init_process_group()
        self.MPI, self.dist, self.hpcddp = MPI, dist, hpcddp
        self.raw = MPI.COMM_WORLD.Dup()      # the raw mpi4py implementation's communicator
        self.ctl = MPI.COMM_WORLD.Dup()      # barriers and MAX of the protocol only
        self.rank, self.n = self.raw.Get_rank(), self.raw.Get_size()
        self.gloo = dist.new_group(backend="gloo") if need_gloo else None

    @staticmethod
    def unchecked(fn):
        """FN run with the cross-rank call agreement off: the record without take()'s
        agreement on a large call, and no hash for the node-local paths to compare. Swapped
        per call (a few attribute writes each way), so every other row runs the real code."""
        from hpcddp.collectives import call
        from hpcddp.diagnostics import mismatch
        # take() agrees on a recorded call through call._agree_recorded
        checked = call._agree_recorded, mismatch.agreement

        def no_agreement(comm, entry, red=None):
            return None

        def run():
            call._agree_recorded = no_agreement
            mismatch.agreement = no_agreement
            try:
                fn()
            finally:
                call._agree_recorded, mismatch.agreement = checked
        return run


def _agree_ok(ctl, ok: bool) -> bool:
    from hpcddp.comm import MPI
    return bool(ctl.allreduce(1 if ok else 0, op=MPI.MIN))


def run(ops=OPS, sizes=None, impls=IMPLS, rounds: int = 7, batch_s: float = 2e-3,
        max_k: int = 100_000, progress=None, ctx: Context | None = None) -> dict | None:
    """Run the communication benchmark; collective over the world (every rank calls it).

    Returns the result (a dict, see :mod:`hpcddp.bench.report`) on rank 0, None elsewhere.
    ``progress(text)`` is called on rank 0 after every cell.
    """
    from hpcddp.bench import machine, protocol
    sizes = list(sizes or protocol.DEFAULT_SIZES)
    unknown = [o for o in ops if o not in CELLS]
    if unknown:
        raise ValueError(f"bench comm: unknown op(s) {unknown}; valid: {', '.join(ALL_OPS)}")
    bad = [i for i in impls if i not in ALL_IMPLS]
    if bad:
        raise ValueError(f"bench comm: unknown implementation(s) {bad}; valid: "
                         f"{', '.join(ALL_IMPLS)}")
    if rounds < 2:
        raise ValueError(f"bench comm: rounds must be >= 2 (round 1 is discarded), got {rounds}")
    ctx = ctx or Context(need_gloo="gloo" in impls)
    ctl = ctx.ctl
    meter = machine.LoadMeter(ctl)
    setup = machine.describe(ctl, ctx.n)
    meter.start()
    cells = []
    for op in ops:
        for size in sizes:
            cell = CELLS[op](ctx, size)
            fns = cell.callables(impls)
            status = {}
            for name, fn in list(fns.items()):
                try:
                    ok = cell.check(name, fn)
                    err = None
                except Exception as exc:  # unsupported by that backend (gloo: all_to_all)
                    ok, err = False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                supported = _agree_ok(ctl, err is None)
                correct = _agree_ok(ctl, ok)
                if not supported:
                    status[name] = {"na": err or "raised on another rank"}
                    del fns[name]
                else:
                    status[name] = {"wrong": 0 if correct else 1}
            times, ks = protocol.run_rounds(fns, ctl, rounds, batch_s, max_k,
                                            lead_in=setup["nodes"] > 1)
            if ctx.rank == 0:
                entry = {"op": op, "bytes": cell.nbytes, "requested_bytes": size,
                         "count": cell.count, "busbw_factor": busbw_factor(op, ctx.n),
                         "impls": {}}
                for name in impls:
                    rec = dict(status.get(name, {"na": "not defined for this op"}))
                    if name in times:
                        rec["k"] = ks[name]
                        rec["times_s"] = times[name]
                    entry["impls"][name] = rec
                cells.append(entry)
                if progress:
                    progress(f"{op} {protocol.fmt_size(cell.nbytes)} done")
            del cell, fns
            gc.collect()
    load = meter.stop()
    from hpcddp.collectives import _node  # what the node-local paths' races chose (setup)
    if ctx.rank != 0:
        return None
    return {"kind": "hpcddp-bench-comm", "version": 1, "setup": setup, "load": load,
            "node_paths": list(_node.decisions),
            "config": {"ops": list(ops), "sizes": sizes, "impls": list(impls),
                       "rounds": rounds, "discarded_rounds": 1, "batch_ms": batch_s * 1e3,
                       "lead_in": setup["nodes"] > 1, "dtype": "float32", "reduce_op": "SUM",
                       "ranks": ctx.n},
            "cells": cells}
