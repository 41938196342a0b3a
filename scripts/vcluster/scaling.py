"""The scaling curve across virtual nodes in one command: all_reduce busbw and DDP steps/s for
hpcddp, raw MPI and gloo, with the link's bound, at 2 to 8 nodes (docs/benchmarks.md,
"Scaling across virtual nodes").

    python scripts/vcluster/scaling.py                          # 2,3,4,6,8 nodes x 1, 2 and 4 x 2
    python scripts/vcluster/scaling.py --nodes 2,4 --per-node-2 "" --out /tmp/scaling

For each layout (N nodes x K ranks per node) it brings up the virtual cluster with 1 Gbit/s
links (scripts/vcluster.sh, VCLUSTER_NAME=sc), runs scripts/vcluster/busbw.py over raw MPI
(MPI_Allreduce), hpcddp and gloo (float32, 1, 4 and 16 MiB), takes the cluster down, then runs
``hpcddp bench ddp --vcluster N --ranks-per-node K --rate R --models 10M`` (its own cluster).
busbw's bound is the link's payload rate (0.94 of the line rate: TCP/IP and Ethernet headers);
DDP's is bench ddp's (the larger of the compute-only step and 2(M-1)/M of the gradients at
the link rate). Every virtual node shares this machine's cores: busbw reports, beside each
figure, the cores rank 0's process used while it timed the 16 MiB calls (CPU seconds over
wall seconds), and the table says how many ranks shared how many cores.

Writes OUT/scaling.json, OUT/scaling.md (the tables) and OUT/scaling.png (the plot). Needs root
(namespaces) and the project's checkout. Each job runs under a timeout (--timeout).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
SH = ROOT / "scripts" / "vcluster.sh"
BUSBW = ROOT / "scripts" / "vcluster" / "busbw.py"
NAME, SUBNET = "sc", "10.84.0"
MODES = ("mpi", "hpcddp", "gloo")
PAYLOAD = 0.94            # TCP payload / line rate on a 1500-byte MTU


def _env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PRTE_", "HPCDDP_RANKS_PER_NODE"))}
    env.update(VCLUSTER_NAME=NAME, VCLUSTER_SUBNET=SUBNET, OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1", TORCH_CPP_LOG_LEVEL="ERROR",
               PATH=os.path.join(sys.prefix, "bin") + os.pathsep + os.environ.get("PATH", ""))
    return env


def _mpirun(n: int, k: int) -> list[str]:
    cmd = [os.path.join(sys.prefix, "bin", "mpirun"),
           "--host", ",".join(f"node{i}:{k}" for i in range(1, n + 1)), "-n", str(n * k),
           "--bind-to", "none", "--mca", "btl", "tcp,self,sm", "--mca", "btl_tcp_if_include",
           "eth0", "--mca", "oob_tcp_if_include", "eth0",
           "-x", "OMP_NUM_THREADS", "-x", "PYTHONUNBUFFERED", "-x", "TORCH_CPP_LOG_LEVEL"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    return cmd


def busbw(n: int, k: int, rate: str, timeout: int) -> dict:
    """{mode: {"1": MB/s, "4": ..., "16": ..., "cores": ...}} on a cluster of N x K."""
    env = _env()
    subprocess.run(["bash", str(SH), "down"], env=env, capture_output=True)
    up = subprocess.run(["bash", str(SH), "up", str(n), "--slots", str(k), "--rate", rate],
                        env=env, capture_output=True, text=True)
    if up.returncode != 0:
        raise SystemExit(f"scaling.py: vcluster up {n} failed:\n{up.stderr}")
    out = {}
    try:
        for mode in MODES:
            cmd = ["bash", str(SH), "run", "node1", *_mpirun(n, k), sys.executable, str(BUSBW),
                   mode]
            try:
                res = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                     timeout=timeout)
                m = re.search(r"busbw MB/s by MiB: (\{.*\})", res.stdout)
                out[mode] = json.loads(m.group(1)) if m else {"error": res.stderr[-2000:]}
            except subprocess.TimeoutExpired:
                out[mode] = {"error": f"timed out after {timeout} s"}
            print(f"scaling: {n} x {k} busbw {mode}: {out[mode]}", file=sys.stderr, flush=True)
    finally:
        subprocess.run(["bash", str(SH), "down"], env=env, capture_output=True)
    return out


def ddp(n: int, k: int, rate: str, rounds: int, timeout: int, out_dir: pathlib.Path) -> dict:
    path = out_dir / f"ddp-{n}x{k}.json"
    cmd = [sys.executable, "-m", "hpcddp", "bench", "ddp", "--vcluster", str(n),
           "--ranks-per-node", str(k), "--rate", rate, "--models", "10M", "--rounds",
           str(rounds), "--json", str(path), "--timeout", str(timeout)]
    res = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                         text=True, timeout=timeout + 120)
    if res.returncode != 0 or not path.exists():
        return {"error": (res.stdout + res.stderr)[-2000:]}
    m = json.loads(path.read_text())["models"][0]
    st = m["stats"]
    row = {"hpcddp": st["hpcddp"]["steps_per_s"], "gloo": st["gloo"]["steps_per_s"],
           "compute": st["compute"]["steps_per_s"], "bound": m.get("bound_steps_per_s")}
    print(f"scaling: {n} x {k} ddp: {row}", file=sys.stderr, flush=True)
    return row


def _cell(v, nd=0) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def tables(rows: list, line_mb_s: float, cores: int) -> str:
    bound = PAYLOAD * line_mb_s
    head = ("| nodes x ranks | busbw MB/s at 1 / 4 / 16 MiB: raw MPI | hpcddp | gloo | "
            "hpcddp/gloo at 16 MiB | cores used by a rank (16 MiB: MPI / hpcddp / gloo) | "
            "DDP 10M steps/s: hpcddp | gloo | bound | hpcddp/gloo | hpcddp/bound |\n"
            "|---|---|---|---|---:|---|---:|---:|---:|---:|---:|\n")
    lines = []
    for r in rows:
        b, d = r["busbw"], r["ddp"]

        def trio(mode):
            x = b.get(mode, {})
            return " / ".join(_cell(x.get(s)) for s in ("1", "4", "16")) if "error" not in x \
                else "failed"
        ratio = (b["hpcddp"]["16"] / b["gloo"]["16"]) if all(
            "16" in b.get(m, {}) for m in ("hpcddp", "gloo")) else None
        used = " / ".join(_cell(b.get(m, {}).get("cores"), 2) for m in MODES)
        dd = d if "error" not in d else {}
        lines.append(
            f"| {r['nodes']} x {r['per_node']} | {trio('mpi')} | {trio('hpcddp')} | "
            f"{trio('gloo')} | {_cell(ratio, 2)} | {used} | {_cell(dd.get('hpcddp'), 2)} | "
            f"{_cell(dd.get('gloo'), 2)} | {_cell(dd.get('bound'), 2)} | "
            f"{_cell(dd['hpcddp'] / dd['gloo'] if dd else None, 2)} | "
            f"{_cell(dd['hpcddp'] / dd['bound'] if dd and dd.get('bound') else None, 2)} |")
    return (f"busbw's bound: the link's payload rate, {bound:.0f} MB/s; {cores} cores shared "
            f"by every rank of every virtual node.\n\n" + head + "\n".join(lines) + "\n")


def plot(rows: list, line_mb_s: float, path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    for k, style in ((1, "-o"), (2, "--s")):
        rs = [r for r in rows if r["per_node"] == k]
        if not rs:
            continue
        xs = [r["nodes"] for r in rs]
        for mode, color in zip(MODES, ("tab:gray", "tab:blue", "tab:orange")):
            ys = [r["busbw"].get(mode, {}).get("16") for r in rs]
            a.plot(xs, ys, style, color=color, label=f"{mode}, {k}/node")
        ds = [r["ddp"] for r in rs]
        for key, color in (("hpcddp", "tab:blue"), ("gloo", "tab:orange"), ("bound", "k")):
            b.plot(xs, [d.get(key) for d in ds], style, color=color, label=f"{key}, {k}/node")
    a.axhline(PAYLOAD * line_mb_s, color="k", lw=1, ls=":", label="link payload")
    a.set_xlabel("nodes")
    a.set_ylabel("MB/s")
    a.set_title("all_reduce busbw, 16 MiB", fontsize=10)
    a.set_ylim(0, 175)                 # room above the lines for the legend
    a.legend(fontsize=7, loc="upper center", ncol=3)
    b.set_xlabel("nodes")
    b.set_ylabel("steps/s")
    b.set_title("DDP 10M", fontsize=10)
    b.set_ylim(0, None)
    b.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="2,3,4,6,8", help="node counts, one rank each")
    p.add_argument("--per-node-2", default="2,4", help="node counts with 2 ranks each")
    p.add_argument("--rate", default="1gbit", help="each node's link (a tc rate)")
    p.add_argument("--ddp-rounds", type=int, default=3)
    p.add_argument("--timeout", type=int, default=900, help="seconds per job")
    p.add_argument("--out", default="scaling-out", help="directory for the results")
    p.add_argument("--replot", action="store_true",
                   help="only redraw OUT/scaling.png and OUT/scaling.md from OUT/scaling.json")
    args = p.parse_args(argv)
    out = pathlib.Path(args.out)
    if args.replot:
        saved = json.loads((out / "scaling.json").read_text())
        (out / "scaling.md").write_text(tables(saved["rows"], saved["line_mb_s"], saved["cores"]))
        plot(saved["rows"], saved["line_mb_s"], out / "scaling.png")
        return 0
    if os.geteuid() != 0:
        raise SystemExit("scaling.py: needs root (the virtual cluster's namespaces)")
    from hpcddp.bench.vcluster import link_bytes_per_s
    line_mb_s = link_bytes_per_s(args.rate) / 1e6
    out.mkdir(parents=True, exist_ok=True)
    layouts = [(int(n), 1) for n in args.nodes.split(",") if n] + \
        [(int(n), 2) for n in args.per_node_2.split(",") if n]
    rows = []
    t0 = time.time()
    for n, k in layouts:
        rows.append({"nodes": n, "per_node": k, "busbw": busbw(n, k, args.rate, args.timeout),
                     "ddp": ddp(n, k, args.rate, args.ddp_rounds, args.timeout, out)})
        (out / "scaling.json").write_text(json.dumps(
            {"rate": args.rate, "line_mb_s": line_mb_s, "cores": os.cpu_count(),
             "rows": rows, "seconds": time.time() - t0}, indent=1))
    text = tables(rows, line_mb_s, os.cpu_count())
    (out / "scaling.md").write_text(text)
    print(text)
    try:
        plot(rows, line_mb_s, out / "scaling.png")
    except ImportError:
        print("scaling.py: no matplotlib: no plot", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
