"""The figures of docs/benchmarks.md ("The dispatch table", each group's own rows) from the runs
in this folder (each job's JSON, per-round times left out):
python docs/benchmarks/group-rows-ab/summarize.py

The comm figures are computed as for the paths-objects A/B (its summarize.py, read from this
folder); DDP has seven jobs a side here (one-node DDP varies by job)."""
import json
import os
import statistics as st
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from ab_summary import of  # noqa: E402

_base = of(HERE)            # its comm() and headline() read this folder's six comm jobs
comm, headline = _base.comm, _base.headline


def ddp() -> list:
    """(job, hpcddp steps/s, gloo steps/s, compute steps/s) of each DDP 10M job."""
    rows = []
    for v in ("old", "new"):
        for i in range(1, 8):
            with open(os.path.join(HERE, f"ddp-{v}-{i}.json")) as f:
                s = json.load(f)["models"][0]["stats"]
            rows.append((f"{v} {i}", s["hpcddp"]["steps_per_s"], s["gloo"]["steps_per_s"],
                         s["compute"]["steps_per_s"]))
    return rows


def ddp_median(version: str) -> float:
    """The median hpcddp steps/s of VERSION's DDP jobs."""
    return st.median(h for job, h, _, _ in ddp() if job.startswith(version))


if __name__ == "__main__":
    for name, (med, lo, hi, n) in headline().items():
        print(f"{name}: time over mpi4py's, new/old: median {med:.3f}, min {lo:.3f}, "
              f"max {hi:.3f} over {n} rows")
    for job, h, g, c in ddp():
        print(f"| {job} | {h:.2f} | {g:.2f} | {c:.2f} | {h / g:.2f} |")
    for v in ("old", "new"):
        print(f"DDP {v}: hpcddp steps/s median {ddp_median(v):.2f}")
