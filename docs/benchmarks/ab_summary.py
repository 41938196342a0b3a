"""An A/B of two code versions in one sitting, from a folder of six `bench comm` jobs
(comm-old-1..3.json, comm-new-1..3.json; per-round times left out): each row's time over raw
mpi4py's, old and new, and the headline new/old, as docs/benchmarks.md quotes them:

    python docs/benchmarks/ab_summary.py docs/benchmarks/arena-module-ab

The figures are computed as for the first such A/B (paths-objects-ab/summarize.py)."""
import importlib.util
import json
import os
import sys

BENCH = os.path.dirname(os.path.abspath(__file__))


def of(folder: str):
    """paths-objects-ab's summarize module (comm, headline), reading FOLDER's six jobs."""
    name = "ab_" + os.path.basename(os.path.normpath(folder)).replace("-", "_")
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(BENCH, "paths-objects-ab", "summarize.py"))
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    ab.HERE = os.path.abspath(folder)
    return ab


def jobs(folder: str, op: str, nbytes: int, impl: str) -> list:
    """Each job's median time (us) of IMPL for OP at NBYTES, old jobs then new."""
    out = []
    for version in ("old", "new"):
        for i in (1, 2, 3):
            with open(os.path.join(folder, f"comm-{version}-{i}.json")) as f:
                cells = json.load(f)["cells"]
            out += [c["stats"][impl]["median_us"] for c in cells
                    if c["op"] == op and c["bytes"] == nbytes]
    return out


def main(folder: str) -> None:
    ab = of(folder)
    old, new = ab.comm("old"), ab.comm("new")
    for (op, nbytes, key) in sorted(k for k in old if k[2] in ("ratio", "dratio")):
        print(f"{op:22} {nbytes:>8} {'torch' if key == 'ratio' else 'direct':6} "
              f"old {old[op, nbytes, key]:.3f} new {new[op, nbytes, key]:.3f}")
    for name, (med, lo, hi, n) in ab.headline().items():
        print(f"{name}: time over mpi4py's, new/old: median {med:.3f}, min {lo:.3f}, "
              f"max {hi:.3f} over {n} rows")


if __name__ == "__main__":
    main(sys.argv[1])
