"""The ring's halves across two virtual nodes at 1 Gbit/s: old (9bf0b17) and new code in one
sitting, `hpcddp bench comm --vcluster 2 --ranks-per-node K --rate 1gbit --ops
reduce_scatter_tensor,all_gather_into_tensor,all_reduce --sizes 64K,1M,16M --rounds 4`, jobs
alternating old/new (2 x 1: two each, 2 x 2: three each). Prints the table docs/benchmarks.md
quotes: busbw (MB/s) of hpcddp, raw mpi4py and gloo, the range over each version's jobs;
then reduce_scatter_tensor's busbw over gloo's in the same job.

    python docs/benchmarks/ring-halves-ab/summarize.py"""
import glob
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
LAYOUTS = ("2x1", "2x2")
OPS = ("reduce_scatter_tensor", "all_gather_into_tensor", "all_reduce")


def busbw(version: str, layout: str) -> dict:
    """(op, bytes, impl) -> [MB/s of each job]."""
    out: dict = {}
    for path in sorted(glob.glob(os.path.join(HERE, f"comm-{version}-{layout}-*.json"))):
        with open(path) as f:
            for c in json.load(f)["cells"]:
                for impl, s in c["stats"].items():
                    out.setdefault((c["op"], c["bytes"], impl), []).append(s["busbw_GBps"] * 1e3)
    return out


def span(xs) -> str:
    lo, hi = min(xs), max(xs)
    return f"{lo:.0f}" if round(lo) == round(hi) else f"{lo:.0f}-{hi:.0f}"


def table() -> str:
    rows = ["| layout | op, size | hpcddp old | hpcddp new | raw mpi4py | gloo |",
            "|---|---|---:|---:|---:|---:|"]
    for layout in LAYOUTS:
        old, new = busbw("old", layout), busbw("new", layout)
        for op in OPS:
            for nbytes in (1 << 20, 16 << 20):
                k = (op, nbytes)
                rows.append(f"| {layout.replace('x', ' x ')} | {op} {nbytes >> 20} MiB | "
                            f"{span(old[k + ('hpcddp',)])} | **{span(new[k + ('hpcddp',)])}** | "
                            f"{span(old[k + ('mpi4py',)] + new[k + ('mpi4py',)])} | "
                            f"{span(old[k + ('gloo',)] + new[k + ('gloo',)])} |")
    return "\n".join(rows)


def over_gloo(version: str, layout: str, op: str = "reduce_scatter_tensor") -> tuple:
    """(min, max) over jobs and sizes from 1 MiB of hpcddp's busbw over gloo's in one job."""
    ratios = []
    for path in sorted(glob.glob(os.path.join(HERE, f"comm-{version}-{layout}-*.json"))):
        with open(path) as f:
            ratios += [c["stats"]["hpcddp"]["busbw_GBps"] / c["stats"]["gloo"]["busbw_GBps"]
                       for c in json.load(f)["cells"] if c["op"] == op and c["bytes"] >= 1 << 20]
    return min(ratios), max(ratios)


if __name__ == "__main__":
    print(table())
    for layout in LAYOUTS:
        for version in ("old", "new"):
            lo, hi = over_gloo(version, layout)
            print(f"{layout} {version}: reduce_scatter_tensor busbw / gloo's from 1 MiB "
                  f"{lo:.2f}-{hi:.2f}")
