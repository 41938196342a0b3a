"""The tables of docs/benchmarks.md "Where each path starts", from the JSON files of
`hpcddp bench comm` runs (docs/benchmarks/crossover/): how often each op and size held
hpcddp's time <= 1/0.95 of raw mpi4py's over the runs, and old/new A/B of the per-size races.

    python scripts/crossover_table.py docs/benchmarks/crossover          # from 256 KiB
    python scripts/crossover_table.py docs/benchmarks/spread-5-runs 4    # every size
"""
from __future__ import annotations

import glob
import json
import os
import statistics
import sys

LIMIT = 1 / 0.95


def size(b: int) -> str:
    return f"{b >> 20} MiB" if b >= 1 << 20 else (f"{b >> 10} KiB" if b >= 1024 else f"{b} B")


def ratios(run: dict, impl: str) -> dict:
    return {(c["op"], c["bytes"]): c["ratios"][f"{impl}/mpi4py"]["median"] for c in run["cells"]
            if f"{impl}/mpi4py" in c["ratios"]}


def spread(runs: list, impl: str, smallest: int) -> list[str]:
    """One row per op and size from SMALLEST: each run's time / mpi4py's, and how many held."""
    per = [ratios(r, impl) for r in runs]
    lines = [f"| op | size | {impl}/mpi4py time, runs 1-{len(runs)} | held (≤ 1.053) |",
             "|---|---:|---|---:|"]
    for key in per[0]:
        if key[1] < smallest:
            continue
        vals = [p[key] for p in per]
        held = sum(v <= LIMIT for v in vals)
        mark = "" if held >= 4 else " **miss**"
        lines.append(f"| {key[0]} | {size(key[1])} | {' '.join(f'{v:.2f}' for v in vals)} | "
                     f"{held}/{len(vals)}{mark} |")
    return lines


def decisions(runs: list) -> list[str]:
    lines = ["| run | path, op | from | its time / MPI's at each size raced | race |",
             "|---|---|---:|---|---:|"]
    for i, r in enumerate(runs, 1):
        for d in r.get("node_paths", []):
            start = size(d["start_bytes"]) if d["start_bytes"] else "never"
            steps = ", ".join(f"{size(b)} {o / m:.2f}" for b, o, m in d["steps"])
            lines.append(f"| {i} | {d['path']}, {d['op']} | {start} | {steps} | "
                         f"{d['cost_s'] * 1e3:.0f} ms |")
    return lines


def ab(folder: str) -> list[str]:
    """Old (one fixed start, one 8/24 MiB race) against new code, alternating jobs."""
    old = [json.load(open(f)) for f in sorted(glob.glob(os.path.join(folder, "old-*.json")))]
    new = [json.load(open(f)) for f in sorted(glob.glob(os.path.join(folder, "new-*.json")))]
    o, n = [ratios(r, "direct") for r in old], [ratios(r, "direct") for r in new]
    lines = ["| op | size | old: direct/mpi4py time per job | new | median old → new |",
             "|---|---:|---|---|---|"]
    for key in o[0]:
        a, b = [x[key] for x in o], [x[key] for x in n]
        lines.append(f"| {key[0]} | {size(key[1])} | {' '.join(f'{v:.2f}' for v in a)} | "
                     f"{' '.join(f'{v:.2f}' for v in b)} | {statistics.median(a):.2f} → "
                     f"{statistics.median(b):.2f} |")
    return lines


def main(folder: str, smallest: int = 256 << 10) -> None:
    runs = [json.load(open(f)) for f in sorted(glob.glob(os.path.join(folder, "run*.json")))]
    for impl in ("direct", "hpcddp"):
        print("\n".join(spread(runs, impl, smallest)), end="\n\n")
    print("\n".join(decisions(runs)), end="\n\n")
    if glob.glob(os.path.join(folder, "ab", "old-*.json")):
        print("\n".join(ab(os.path.join(folder, "ab"))))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/benchmarks/crossover",
         int(sys.argv[2]) if len(sys.argv) > 2 else 256 << 10)
