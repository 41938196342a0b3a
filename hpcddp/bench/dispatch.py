"""Where a ``torch.distributed`` call on the hpcddp backend spends its time.

    mpirun -n 2 python -m hpcddp.bench.dispatch [--ops all_gather,all_to_all_single]
                                               [--sizes 8,1M] [--rounds 9] [--json FILE]

For each op and size, on the buffers of ``hpcddp bench comm`` (its cells), one job measures
per call: the time from the ``dist.<op>(...)`` call until torch enters the backend's method
(torch's Python wrapper: argument checks, group lookup, the options object, the call into a
Python ``ProcessGroup``), the backend method itself, and from its return until ``dist.<op>``
returns; beside them the same op through hpcddp's direct API and through raw mpi4py. The
backend's methods are wrapped with two clock reads for this (~0.1 us, inside "backend").

What it answers: the part of ``hpcddp``'s row in ``hpcddp bench comm`` that no backend can
remove. At 1 MiB on 2 ranks of one node MPI moves the data in ~60-80 us, so 0.95x raw
mpi4py's busbw leaves 3-4 us for everything else; torch's wrapper alone takes about that
(docs/benchmarks.md, "Why the misses"). send_recv is bench comm's ring: dist.isend and
dist.irecv (two backend calls, both counted), then the two Works' waits (counted as the
backend's: they are hpcddp's Works and MPI's transfer).

Rounds rotate the order of the three ways to call; each is a batch of K calls after a
barrier. Per call the figures are medians over the kept rounds (round 1 is dropped) of each
batch's per-call median, the MAX over ranks.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

# the ops of `hpcddp bench comm`; each torch call enters one backend method, except send_recv:
# dist.isend then dist.irecv (two methods), then the two Works' wait()
OPS = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
       "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "send_recv")
# ProcessGroupHPCDDP methods torch calls for those ops (torch renames them across releases)
METHODS = ("allreduce", "broadcast", "allgather", "_allgather_base", "all_gather_single",
           "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_single", "alltoall",
           "alltoall_base", "all_to_all_single", "send", "recv")


class Stamps:
    """Wraps the backend's methods so that each call notes when it entered and returned."""

    def __init__(self, cls):
        self.calls: list = []
        self._saved = {}
        clock = time.perf_counter_ns
        calls = self.calls
        for name in METHODS:
            orig = cls.__dict__.get(name)
            if orig is None:
                continue
            self._saved[name] = orig

            def stamped(*args, _orig=orig, **kw):
                t_in = clock()
                try:
                    return _orig(*args, **kw)
                finally:
                    calls.append((t_in, clock()))
            setattr(cls, name, stamped)
        self.cls = cls

    def restore(self) -> None:
        for name, orig in self._saved.items():
            setattr(self.cls, name, orig)


def _ring_torch(cell, marks: list, clock=time.perf_counter_ns):
    """send_recv's torch way (as in bench comm) with one clock read once dist.isend and
    dist.irecv have both returned: the waits after it are MPI's and hpcddp's time."""
    import torch.distributed as dist
    c = cell.ctx
    s, r = cell.s, cell.r
    nxt, prv = (c.rank + 1) % c.n, (c.rank - 1) % c.n

    def go():
        w1 = dist.isend(s, nxt)
        w2 = dist.irecv(r, prv)
        marks.append(clock())
        w1.wait()
        w2.wait()
    return go


def _torch_batch(fn, k: int, stamps: Stamps, ctl, marks=None, clock=time.perf_counter_ns):
    """K calls of FN; per-call medians (ns) of torch-before, backend, torch-after. With MARKS
    (send_recv): FN enters the backend twice; torch-before counts both entries (the isend's
    after-part with the irecv's before-part), torch-after runs from the irecv's return to
    the mark, and the waits after the mark count as the backend's."""
    before, inside, after = [], [], []
    entries = 1 if marks is None else 2
    ctl.Barrier()
    for _ in range(k):
        stamps.calls.clear()
        t0 = clock()
        fn()
        t1 = clock()
        if len(stamps.calls) != entries:
            raise RuntimeError(f"bench dispatch: one torch call entered the backend "
                               f"{len(stamps.calls)} times, expected {entries}")
        if marks is None:
            t_in, t_out = stamps.calls[0]
            before.append(t_in - t0)
            inside.append(t_out - t_in)
            after.append(t1 - t_out)
        else:
            (a_in, a_out), (b_in, b_out) = stamps.calls
            mark = marks.pop()
            before.append((a_in - t0) + (b_in - a_out))
            inside.append((a_out - a_in) + (b_out - b_in) + (t1 - mark))
            after.append(mark - b_out)
    return [statistics.median(x) for x in (before, inside, after)]


def _plain_batch(fn, k: int, ctl, clock=time.perf_counter_ns) -> float:
    ctl.Barrier()
    t0 = clock()
    for _ in range(k):
        fn()
    return (clock() - t0) / k


def run(ops=OPS, sizes=(8, 1 << 20), rounds: int = 9, k: int | None = None) -> dict | None:
    """Measure; returns {"kind", "setup", "rows"} on rank 0 (None elsewhere). Collective over
    the world."""
    from hpcddp.bench.comm import CELLS, Context
    from hpcddp.bench import machine, protocol
    from hpcddp.backend.process_group import ProcessGroupHPCDDP
    from hpcddp.comm import MPI
    unknown = [o for o in ops if o not in OPS]
    if unknown:
        raise ValueError(f"bench dispatch: unknown op(s) {unknown}; valid: {', '.join(OPS)}")
    if rounds < 2:
        raise ValueError(f"bench dispatch: rounds must be >= 2 (round 1 is dropped), got {rounds}")
    ctx = Context(need_gloo=False)
    ctl = ctx.ctl
    setup = machine.describe(ctl, ctx.n)
    stamps = Stamps(ProcessGroupHPCDDP)
    rows = []
    try:
        for op in ops:
            for size in sizes:
                cell = CELLS[op](ctx, size)
                fns = cell.fns()
                marks = [] if op == "send_recv" else None
                torch_way = fns["hpcddp"] if marks is None else _ring_torch(cell, marks)
                ways = {"torch": torch_way, "direct": fns["direct"], "mpi4py": fns["mpi4py"]}
                for name, fn in ways.items():   # right answer first, outside timing
                    ok = cell.check(name, fn)
                    if marks is not None:
                        marks.clear()
                    if not ok:
                        raise RuntimeError(f"bench dispatch: {op} {size} B: {name} computed a "
                                           f"wrong result")
                calls = k or max(20, min(3000, int(2e-3 / max(
                    protocol.time_batch(fns["mpi4py"], 5, ctl), 1e-7))))
                calls = int(ctl.allreduce(calls, op=MPI.MAX))
                got = {"before": [], "backend": [], "after": [], "direct": [], "mpi4py": []}
                for r in range(rounds):
                    order = list(ways)
                    order = order[r % 3:] + order[:r % 3]
                    for name in order:
                        if name == "torch":
                            parts = _torch_batch(ways[name], calls, stamps, ctl, marks)
                            for key, v in zip(("before", "backend", "after"), parts):
                                got[key].append(ctl.allreduce(v, op=MPI.MAX) / 1e3)
                        else:
                            v = _plain_batch(ways[name], calls, ctl)
                            got[name].append(ctl.allreduce(v, op=MPI.MAX) / 1e3)
                row = {"op": op, "bytes": cell.nbytes, "calls": calls,
                       **{key: statistics.median(v[1:]) for key, v in got.items()}}
                row["torch"] = row["before"] + row["backend"] + row["after"]
                rows.append(row)
                del cell, fns, ways
    finally:
        stamps.restore()
    if ctx.rank != 0:
        return None
    return {"kind": "hpcddp-bench-dispatch", "setup": setup, "rows": rows}


def table(rows) -> str:
    from hpcddp.bench.protocol import fmt_size
    head = (f"{'op':24s} {'size':>8s} {'mpi4py':>8s} {'direct':>8s} {'dist.*':>8s} "
            f"{'torch before':>13s} {'backend':>8s} {'torch after':>12s} "
            f"{'torch share of mpi4py':>22s}")
    lines = [head]
    for r in rows:
        share = (r["before"] + r["after"]) / r["mpi4py"]
        lines.append(f"{r['op']:24s} {fmt_size(r['bytes']):>8s} {r['mpi4py']:8.2f} "
                     f"{r['direct']:8.2f} {r['torch']:8.2f} {r['before']:13.2f} "
                     f"{r['backend']:8.2f} {r['after']:12.2f} {share:21.1%}")
    lines.append("µs per call (medians; MAX over ranks). 'torch share': torch's wrapper before "
                 "and after the backend, over raw mpi4py's time for the whole op.")
    return "\n".join(lines)


def main(argv=None) -> int:
    from hpcddp.bench import protocol
    p = argparse.ArgumentParser(
        prog="python -m hpcddp.bench.dispatch",
        description="Split a torch.distributed call on the hpcddp backend into torch's wrapper "
                    "before the backend, the backend, and torch after it; beside hpcddp's "
                    "direct API and raw mpi4py. Run under mpirun/srun.")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, from: {', '.join(OPS)}")
    p.add_argument("--sizes", default="8,1M", help="sizes as in hpcddp bench comm (default 8,1M)")
    p.add_argument("--rounds", type=int, default=9, help="rounds, the first dropped (default 9)")
    p.add_argument("--calls", type=int, default=None,
                   help="calls per batch (default: ~2 ms of raw mpi4py's op)")
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    a = p.parse_args(argv)
    try:
        ops = [o.strip() for o in a.ops.split(",") if o.strip()]
        result = run(ops, protocol.parse_sizes(a.sizes), a.rounds, a.calls)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if result is not None:
        print(table(result["rows"]), flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(result, f, indent=1)
            print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
