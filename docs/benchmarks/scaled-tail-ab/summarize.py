"""The figures of docs/benchmarks.md ("AVG and PREMUL_SUM in take") from the runs in this
folder (each job's JSON, per-round times left out):
python docs/benchmarks/scaled-tail-ab/summarize.py

Computed as for the paths-objects A/B (its summarize.py, read from this folder)."""
import importlib.util
import os

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location(
    "paths_objects_ab", os.path.join(HERE, os.pardir, "paths-objects-ab", "summarize.py"))
_base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_base)
_base.HERE = HERE           # its comm() and headline() read this folder's six comm jobs
comm, headline = _base.comm, _base.headline

if __name__ == "__main__":
    old, new = comm("old"), comm("new")
    for (op, nbytes, key) in sorted(k for k in old if k[2] in ("ratio", "dratio")):
        print(f"{op:22} {nbytes:>8} {'torch' if key == 'ratio' else 'direct':6} "
              f"old {old[op, nbytes, key]:.3f} new {new[op, nbytes, key]:.3f}")
    for name, (med, lo, hi, n) in headline().items():
        print(f"{name}: time over mpi4py's, new/old: median {med:.3f}, min {lo:.3f}, "
              f"max {hi:.3f} over {n} rows")
