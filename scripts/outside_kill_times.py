"""Time from an outside SIGKILL to the job's end (plain) or to the first completed step after
the recovery (elastic), for each phase of tests/test_outside_kill.py's job.

    python scripts/outside_kill_times.py [--repeat 3] [--json docs/benchmarks/outside-kill.json]

Each case runs tests/scripts/outside_kill_train.py under mpirun (3 ranks, 1 DataLoader worker
each, forked unless the table says spawn or forkserver; 4 ranks, 2 per emulated node, for
the hierarchical path), waits for the target to say it
is in the phase, SIGKILLs it from here and times, as this process sees it: plain mode, the
kill to mpirun's exit; elastic mode, the kill to the line "first step after the recovery
completed". Every case also checks that no process of the job is left. docs/hangs.md and
docs/elastic.md quote the table it prints.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from outside_kill import Job  # noqa: E402

SCRIPT = str(ROOT / "tests" / "scripts" / "outside_kill_train.py")
CASES = [   # (mode, phase, nprocs, target, workers, what, ranks per node[, worker start])
    ("plain", "data", 3, 1, 1, "rank", None),
    ("plain", "data", 3, 1, 1, "worker", None),
    ("plain", "forward", 3, 1, 1, "rank", None),
    ("plain", "backward", 3, 1, 1, "rank", None),
    ("plain", "optimizer", 3, 1, 1, "rank", None),
    ("plain", "eval", 3, 1, 1, "rank", None),
    ("plain", "checkpoint", 3, 0, 1, "rank", None),
    ("plain", "arena", 3, 1, 0, "rank", None),
    ("plain", "arena", 4, 2, 0, "rank", 2),
    ("plain", "forward", 3, 1, 1, "rank", None, "spawn"),
    ("plain", "forward", 3, 1, 1, "rank", None, "forkserver"),
    ("elastic", "data", 3, 1, 1, "rank", None),
    ("elastic", "data", 3, 1, 1, "worker", None),
    ("elastic", "forward", 3, 1, 1, "rank", None),
    ("elastic", "backward", 3, 1, 1, "rank", None),
    ("elastic", "optimizer", 3, 1, 1, "rank", None),
    ("elastic", "arena", 3, 1, 0, "rank", None),
    ("elastic", "eval", 3, 1, 1, "rank", None),
]
RECOVERED = "first step after the recovery completed"


def run_case(mode, phase, nprocs, target, workers, what, rpn, start="fork") -> dict:
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="hpcddp-kill-"))
    env = dict(os.environ, HPCDDP_TIMEOUT="10")
    env.pop("HPCDDP_RANKS_PER_NODE", None)
    if rpn:
        env["HPCDDP_RANKS_PER_NODE"] = str(rpn)
    job = Job(nprocs, [sys.executable, SCRIPT, str(tmp), mode, phase, str(target), str(workers),
                       start],
              outfile=tmp / "out.txt", timeout=150, env=env, fault_tolerant=mode == "elastic")
    m = job.wait_for(rf"\[rank{target}\] AT PHASE {phase} pid (\d+)")
    if what == "worker":
        job.kill(int(m.group(1)), "worker")
    else:
        job.kill_rank(target)
    t_kill = job.killed_at
    recovered = None
    if mode == "elastic" and phase not in ("eval",):
        while job.proc.poll() is None and RECOVERED not in job.output():
            time.sleep(0.01)
        if RECOVERED in job.output():
            recovered = time.monotonic() - t_kill
    rc, out, to_end = job.finish()
    left = job.leftovers()
    return {"mode": mode, "phase": phase, "ranks": nprocs, "killed": what,
            "path": "hierarchical" if rpn else None, "exit": rc,
            "workers": None if start == "fork" else f"{start} workers",
            "kill_to_end_s": round(to_end, 3),
            "kill_to_first_step_s": None if recovered is None else round(recovered, 3),
            "left_behind": len(left)}


def _range(key: str) -> str:
    return key.removesuffix("_s") + "_range_s"


def table(rows) -> str:
    """The Markdown table docs/hangs.md quotes (tests/test_outside_kill.py checks it)."""
    out = ["| mode | phase | killed | kill -> job end, s | kill -> first step after recovery, s "
           "| exit | left behind |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        phase = r["phase"] + "".join(f" ({r[k]})" for k in ("path", "workers") if r.get(k))
        cells = []
        for key in ("kill_to_end_s", "kill_to_first_step_s"):
            lo_hi = r[_range(key)]
            cells.append("-" if r[key] is None else
                         f"{r[key]:.2f} ({lo_hi[0]:.2f}-{lo_hi[1]:.2f})")
        out.append(f"| {r['mode']} | {phase} | {r['killed']} | {cells[0]} | {cells[1]} | "
                   f"{','.join(map(str, r['exits']))} | {r['left_behind']} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    rows = []
    for case in CASES:
        runs = [run_case(*case) for _ in range(args.repeat)]
        row = dict(runs[0])
        for key in ("kill_to_end_s", "kill_to_first_step_s"):
            vals = [r[key] for r in runs if r[key] is not None]
            row[key] = statistics.median(vals) if vals else None
            row[_range(key)] = [min(vals), max(vals)] if vals else None
        row["exits"] = sorted({r["exit"] for r in runs})
        row["left_behind"] = max(r["left_behind"] for r in runs)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n" + table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"repeat": args.repeat, "rows": rows}, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
