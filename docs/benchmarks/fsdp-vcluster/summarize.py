"""FSDP2 across 2 virtual nodes at 1 Gbit/s, old (9bf0b17, before the ring's halves) and new
code alternating, two jobs each of scripts/vcluster/fsdp_step.py (--rounds 4 --steps 3) per
layout ({old,new}-2x{1,2}-{1,2}.json, one JSON line each). Prints the table
docs/benchmarks.md quotes: the range over jobs.

    python docs/benchmarks/fsdp-vcluster/summarize.py"""
import glob
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def jobs(version: str, layout: str) -> list:
    out = []
    for path in sorted(glob.glob(os.path.join(HERE, f"{version}-{layout}-*.json"))):
        with open(path) as f:
            out.append(json.load(f))
    return out


def span(xs) -> str:
    return f"{min(xs):.2f}-{max(xs):.2f}"


def table() -> str:
    rows = ["| FSDP2, 10M MLP, 1 Gbit/s | steps/s hpcddp | gloo | hpcddp/gloo | hpcddp / the "
            "bound |", "|---|---:|---:|---:|---:|"]
    for layout in ("2x1", "2x2"):
        for version in ("old", "new"):
            js = jobs(version, layout)
            rows.append(f"| {layout.replace('x', ' x ')}, {version} | "
                        f"{span([j['steps_per_s']['hpcddp'] for j in js])} | "
                        f"{span([j['steps_per_s']['gloo'] for j in js])} | "
                        f"{span([j['hpcddp_over_gloo'] for j in js])} | "
                        f"{span([j['over_bound']['hpcddp'] for j in js])} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
