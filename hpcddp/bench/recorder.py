"""What the flight recorder and the mismatch check cost: all_reduce with recording off/on/detail.

    mpirun -n 2 python -m hpcddp.bench.recorder [--api direct|dist] [--sizes 8,1024,4096]
                                                 [--rounds 101] [--json]

Runs ``hpcddp.all_reduce`` (the direct API, where an extra microsecond shows most; ``--api
dist``: ``dist.all_reduce`` on the hpcddp backend) on float32 tensors of each size with three
versions of the op's ``record``:

- ``off``: no recording at all (a no-op ``record``/``record_end``; not a shipped setting, the
  baseline);
- ``on``: the flight recorder (the default);
- ``detail``: the recorder plus the cross-rank mismatch check (HPCDDP_DEBUG=detail);
- ``off2``: ``off`` again: an A/A comparison, what a change that costs nothing measures as
  on this machine (the noise floor of the ``on / off`` column);
- ``shipped``: what a job runs by default: the recorder, and for a tensor reduced before the
  C plan hit where it is built (hpcddp.collectives._plans), which records in C.

The first four run the Python plan hit (``_plans.hit_py``) with their ``record``, so ``on / off``
is the recorder's cost in Python; ``shipped / off`` is what the default costs over a Python
path that records nothing.

Each round runs one short batch (~2 ms) of every mode, in an order that rotates; the table
gives the median time per op of each mode and the median of the per-round paired ratios (on a
shared machine only ratios taken side by side are comparable). Also prints the recorder's own
cost per op measured in one process (start + end), which is what "on" adds to any op.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def _recorder_cost(n: int = 200_000) -> float:
    """Seconds per start+end pair of the flight recorder, in this process (no MPI)."""
    from hpcddp.diagnostics import recorder

    class _C:
        seq, uid, name, world_ranks, rank = 0, -1, "bench", (0,), 0
    c, start, end = _C(), recorder.FlightRecorder(2048).start, recorder.end
    shape, dtype = (256,), "float32"
    best = float("inf")
    for _ in range(5):   # best of 5: the cost itself, not the machine's other load
        t0 = time.perf_counter()
        for _ in range(n // 5):
            end(start(c, "all_reduce", shape, dtype))
        best = min(best, (time.perf_counter() - t0) / (n // 5))
    return best


def run(sizes, rounds: int = 101, batch_time: float = 0.002, api: str = "direct") -> dict:
    import importlib

    import torch
    from mpi4py import MPI

    import hpcddp
    red = importlib.import_module("hpcddp.collectives.reduce")  # the module, not the function
    from hpcddp.collectives import _plans
    from hpcddp.diagnostics import mismatch, recorder
    world = hpcddp.init().world
    saved = (_plans.record, _plans.record_end, red._plan_hit)
    if api == "dist":
        import torch.distributed as dist
        hpcddp.init_process_group()
        op = dist.all_reduce
    else:
        op = hpcddp.all_reduce

    def nothing(*a, **k):
        return None
    # "off2" is "off" again (an A/A test): its ratio to "off" is the noise floor
    py = _plans.hit_py
    modes = {"off": (nothing, nothing, py), "off2": (nothing, nothing, py),
             "on": (recorder.start, recorder.end, py),
             "detail": (mismatch.checked_start, recorder.end, py),
             "shipped": (saved[0], saved[1], _plans.hit)}

    def batch(mode, t, iters) -> float:
        red._plan_hit = modes[mode][2]
        _plans.record, _plans.record_end = modes[mode][:2]   # what hit_py records with
        hpcddp.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            op(t)
        return world.mpi.allreduce((time.perf_counter() - t0) / iters, op=MPI.MAX)

    results = {}
    try:
        for nbytes in sizes:
            t = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
            for m in modes:                      # warm up every path (plans, duplicates)
                batch(m, t, 50)
            per = batch("off", t, 100)
            iters = int(world.mpi.allreduce(max(10, int(batch_time / per)), op=MPI.MAX))
            times = {m: [] for m in modes}
            on_off, det_on, noise = [], [], []
            order = list(modes)
            for _ in range(rounds):
                order = order[1:] + order[:1]    # rotate: no mode always runs first
                got = {m: batch(m, t, iters) for m in order}
                for m in modes:
                    times[m].append(got[m])
                on_off.append(got["on"] / got["off"])
                noise.append(got["off2"] / got["off"])
                det_on.append(got["detail"] / got["on"])
            r = {m: statistics.median(v) for m, v in times.items()}
            r.update(iters=iters, on_over_off=statistics.median(on_off),
                     shipped_over_off=statistics.median(
                         [a / b for a, b in zip(times["shipped"], times["off"])]),
                     off2_over_off=statistics.median(noise),
                     detail_over_on=statistics.median(det_on))
            results[nbytes] = r
    finally:
        _plans.record, _plans.record_end, red._plan_hit = saved
    return {"ranks": world.size, "rounds": rounds, "api": api, "plan_hit": _plans.KIND,
            "recorder_cost_s": _recorder_cost(),
            "sizes": results}


def _table(res: dict) -> str:
    us = 1e6
    api = "direct API" if res["api"] == "direct" else "torch.distributed"
    lines = [f"all_reduce (float32, {api}), {res['ranks']} ranks, {res['rounds']} "
             f"interleaved rounds; medians of times and of per-round paired ratios. "
             f"Recorder start+end alone: {res['recorder_cost_s'] * us:.2f} us/op. "
             f"Plan hit shipped here: {res.get('plan_hit', '?')}",
             "",
             "| size | recording off | on | on / off | A/A: off again / off "
             "| detail (mismatch check) | detail / on | shipped (default) | shipped / off |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n, r in res["sizes"].items():
        size = f"{n} B" if n < 1024 else (f"{n // 1024} KiB" if n < 1 << 20 else
                                          f"{n >> 20} MiB")
        lines.append(f"| {size} | {r['off'] * us:.2f} us | {r['on'] * us:.2f} us | "
                     f"{(r['on_over_off'] - 1) * 100:+.1f}% | "
                     f"{(r['off2_over_off'] - 1) * 100:+.1f}% | "
                     f"{r['detail'] * us:.2f} us | "
                     f"{(r['detail_over_on'] - 1) * 100:+.0f}% | "
                     f"{r['shipped'] * us:.2f} us | {(r['shipped_over_off'] - 1) * 100:+.1f}% |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hpcddp.bench.recorder",
                                description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="8,1024,4096,16384,65536,1048576",
                   help="message sizes in bytes, comma-separated (default %(default)s)")
    p.add_argument("--rounds", type=int, default=101, help="rounds per size (default 101)")
    p.add_argument("--api", choices=("direct", "dist"), default="direct",
                   help="hpcddp.all_reduce (default) or dist.all_reduce on the hpcddp backend")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        p.error(f"--sizes: expected comma-separated byte counts, got {args.sizes!r}")
    res = run(sizes, rounds=args.rounds, api=args.api)
    import hpcddp
    if hpcddp.world().rank == 0:
        print(json.dumps(res, indent=1) if args.json else _table(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
