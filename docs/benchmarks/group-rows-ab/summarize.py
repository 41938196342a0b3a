"""The figures of docs/benchmarks.md ("The dispatch table", each group's own rows) from the runs
in this folder (each job's JSON, per-round times left out):
python docs/benchmarks/group-rows-ab/summarize.py"""
import json
import os
import statistics as st

HERE = os.path.dirname(os.path.abspath(__file__))


def comm(version: str) -> dict:
    """(op, bytes, impl) -> the 3 jobs' medians (us); impl "ratio"/"dratio": hpcddp's and the
    direct API's time over raw mpi4py's, paired within each job."""
    out: dict = {}
    for i in (1, 2, 3):
        with open(os.path.join(HERE, f"comm-{version}-{i}.json")) as f:
            cells = json.load(f)["cells"]
        for c in cells:
            s, key = c["stats"], (c["op"], c["bytes"])
            for impl in ("hpcddp", "direct", "mpi4py"):
                out.setdefault((*key, impl), []).append(s[impl]["median_us"])
            out.setdefault((*key, "ratio"), []).append(s["hpcddp"]["median_us"]
                                                      / s["mpi4py"]["median_us"])
            out.setdefault((*key, "dratio"), []).append(s["direct"]["median_us"]
                                                       / s["mpi4py"]["median_us"])
    return {k: st.median(v) for k, v in out.items()}


def headline() -> dict:
    """impl -> (median, min, max) over the rows of new/old (time over mpi4py's)."""
    old, new = comm("old"), comm("new")
    out = {}
    for name, key in (("torch", "ratio"), ("direct", "dratio")):
        r = [new[k] / old[k] for k in old if k[2] == key]
        out[name] = (st.median(r), min(r), max(r), len(r))
    return out


def ddp() -> list:
    """(job, hpcddp steps/s, gloo steps/s, compute steps/s) of each DDP 10M job (seven of
    each side, alternating: one-node DDP varies by job)."""
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

