"""reduce_scatter_tensor on the blocking MPI call, and the ring from 256 KiB: old (6f37afe)
and new code alternating in one sitting.

- one node, 2 ranks, three `bench comm` jobs each (comm-{old,new}-{1,2,3}.json: 8 B to 16 MiB,
  reduce_scatter_tensor, reduce_scatter, all_reduce): docs/benchmarks/ab_summary.py on this
  folder gives each row's time over raw mpi4py's and the headline;
- across 2 virtual nodes at 1 Gbit/s, x 1 and x 2 ranks, two jobs each
  (vc-{old,new}-2x{1,2}-{1,2}.json: 8 B to 1 MiB, gloo beside): :func:`table` below, hpcddp's
  median time over raw mpi4py's in the same job, the range over jobs.

    python docs/benchmarks/rst-blocking-ab/vcluster.py"""
import glob
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
SIZES = (8, 64 << 10, 256 << 10, 512 << 10, 1 << 20)   # 8 B: one float32 per rank (16 B at 4)


def ratios(version: str, layout: str, op: str = "reduce_scatter_tensor") -> dict:
    """bytes -> [hpcddp's time over raw mpi4py's, per job]."""
    out: dict = {}
    for path in sorted(glob.glob(os.path.join(HERE, f"vc-{version}-{layout}-*.json"))):
        with open(path) as f:
            for c in json.load(f)["cells"]:
                if c["op"] == op:
                    s = c["stats"]
                    out.setdefault(8 if c["bytes"] <= 64 else c["bytes"], []).append(s["hpcddp"]["median_us"] /
                                                          s["mpi4py"]["median_us"])
    return out


def _size(n: int) -> str:
    return "4 B per rank" if n == 8 else f"{n} B" if n < 1024 else f"{n >> 10} KiB" if n < 1 << 20 else f"{n >> 20} MiB"


def table() -> str:
    rows = ["| reduce_scatter_tensor, hpcddp time / raw mpi4py's | " +
            " | ".join(_size(n) for n in SIZES) + " |", "|---|" + "---:|" * len(SIZES)]
    for layout in ("2x1", "2x2"):
        for version in ("old", "new"):
            r = ratios(version, layout)
            cells = [f"{min(r[n]):.2f}-{max(r[n]):.2f}" for n in SIZES]
            rows.append(f"| {layout.replace('x', ' x ')}, {version} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
