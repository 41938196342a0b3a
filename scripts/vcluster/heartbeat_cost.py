"""What ULFM's heartbeat detector and hpcddp's heartbeat pump cost a rank that loses no peer:
a compute loop (256x256 float32 matmul) and hpcddp.all_reduce of 8 B and 1 MiB, the median of 7
batches, under ``mpirun --with-ft ulfm`` across virtual nodes (docs/elastic.md, "What it
costs when nothing fails"). Run it three ways, alternating, and compare:

    scripts/vcluster.sh up 2
    M=(mpirun --allow-run-as-root --with-ft ulfm --host node1:1,node2:1 -n 2 --bind-to none \\
       --mca btl tcp,self,sm --mca btl_tcp_if_include eth0 --mca oob_tcp_if_include eth0)
    scripts/vcluster.sh run node1 "${M[@]}" python scripts/vcluster/heartbeat_cost.py      # the pump
    scripts/vcluster.sh run node1 "${M[@]}" -x OMPI_MCA_mpi_ft_detector_thread=true \\
        python scripts/vcluster/heartbeat_cost.py                                         # its own thread
    scripts/vcluster.sh run node1 "${M[@]}" -x OMPI_MCA_mpi_ft_detector=false \\
        python scripts/vcluster/heartbeat_cost.py                                         # no detector

Prints one JSON line on rank 0: compute_ms, ar8_us, ar1m_ms, which pump ran, the detector's
settings. ``heartbeat_cost.py --table RUNS.jsonl`` prints docs/elastic.md's table from such
lines (docs/benchmarks/heartbeat-cost/runs.jsonl; tests/unit/test_elastic_network_docs.py
keeps the page equal to it).
"""
import json
import os
import statistics
import sys
import time

WAYS = [("off", "off (`OMPI_MCA_mpi_ft_detector=false`)"),
        ("pump", "on, hpcddp's pump (the default)"),
        ("thread", "on, its own thread (`_detector_thread=true`)")]
COLUMNS = [("compute_ms", "ms", 2), ("ar8_us", "µs", 1), ("ar1m_ms", "ms", 2)]


def way(run: dict) -> str:
    if run["detector"] == "false":
        return "off"
    return "pump" if run["pump"] else "thread"


def table(path: str) -> str:
    """The markdown table of the runs in PATH: each way's median of the jobs' medians and
    their range."""
    runs = [json.loads(line) for line in open(path) if line.strip()]
    lines = ["| ULFM's detector | jobs | compute (256x256 matmul) | all_reduce 8 B | "
             "all_reduce 1 MiB |", "|---|---|---|---|---|"]
    for key, label in WAYS:
        mine = [r for r in runs if way(r) == key]
        cells = []
        for c, unit, d in COLUMNS:
            values = [r[c] for r in mine]
            cells.append(f"{statistics.median(values):.{d}f} ({min(values):.{d}f}-"
                         f"{max(values):.{d}f}) {unit}")
        lines.append(f"| {label} | {len(mine)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def per_call(fn, n: int) -> float:
    import hpcddp
    hpcddp.barrier()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n


def main() -> None:
    import torch

    import hpcddp
    from hpcddp.comm import heartbeat
    hpcddp.init()
    torch.set_num_threads(1)
    a, small, big = torch.randn(256, 256), torch.ones(2), torch.ones(1 << 18)
    runs = {"compute_ms": [], "ar8_us": [], "ar1m_ms": []}
    for _ in range(7):
        runs["compute_ms"].append(per_call(lambda: a @ a, 400) * 1e3)
        runs["ar8_us"].append(per_call(lambda: hpcddp.all_reduce(small), 2000) * 1e6)
        runs["ar1m_ms"].append(per_call(lambda: hpcddp.all_reduce(big), 40) * 1e3)
    out = {k: round(statistics.median(v), 3) for k, v in runs.items()}
    out.update(pump=heartbeat.running(), detector=os.environ.get("OMPI_MCA_mpi_ft_detector"),
               detector_thread=os.environ.get("OMPI_MCA_mpi_ft_detector_thread"))
    if hpcddp.world().rank == 0:
        print(json.dumps(out), flush=True)
    hpcddp.finalize()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--table"]:
        print(table(sys.argv[2]))
    else:
        main()
