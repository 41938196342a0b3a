"""``hpcddp bench comm|ddp|stage --vcluster N``: the benchmark across N virtual nodes.

The project's virtual cluster (scripts/vcluster.sh, docs/multinode-testing.md) gives each node
its own network namespace, hostname and a veth link, shaped with ``--rate`` (1gbit: a 1 Gbit/s
link each way). This module brings up a cluster of its own (VCLUSTER_NAME=hb, subnet 10.79.0,
beside any other), runs the benchmark there under mpirun with the ranks placed as a user
should place them across nodes, and takes the cluster down again:

- ``--host node1:K,...,nodeN:K`` (K = ``--ranks-per-node``), TCP between the nodes on eth0,
  shared memory inside one;
- ``--bind-to none``: every virtual node sees all of this machine's cores, so Open MPI's
  default binding would put node1's and node2's first ranks on the same core 0;
- HPCDDP_* variables forwarded to every rank (``-x``).

The link's rate goes to the benchmark (``--link-rate``) for its bound. Needs root (namespaces)
and the project's checkout (the script is not part of the wheel).
"""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

NAME, SUBNET = "hb", "10.79.0"
_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def link_bytes_per_s(rate: str) -> float:
    """Bytes per second of a tc rate such as 1gbit, 100mbit (what --rate takes)."""
    m = re.fullmatch(r"\s*([\d.]+)\s*([kmg]?bit)\s*", rate.lower())
    if not m:
        raise SystemExit(f"hpcddp bench: --rate {rate!r}: expected a tc rate such as 1gbit or "
                         f"100mbit")
    return float(m.group(1)) * _UNITS[m.group(2)] / 8


def script() -> pathlib.Path:
    path = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "vcluster.sh"
    if not path.is_file():
        raise SystemExit("hpcddp bench --vcluster: needs the project's checkout "
                         f"(scripts/vcluster.sh, looked for {path}); the wheel has no virtual "
                         f"cluster")
    return path


def launch(args, argv: list[str]) -> int:
    """Run ARGV (the benchmark's command line for each rank) on ``args.vcluster`` virtual
    nodes of ``args.ranks_per_node`` ranks each; the exit status."""
    from hpcddp.launch.mpirun import find_mpirun, run_job
    n, k = args.vcluster, args.ranks_per_node
    if n < 1 or k < 1:
        raise SystemExit(f"hpcddp bench: --vcluster {n} --ranks-per-node {k}: expected >= 1")
    if n * k < 2:
        raise SystemExit("hpcddp bench: --vcluster needs at least 2 ranks in all")
    sh = script()
    # not this shell's own launcher variables (a bench started inside a job); the venv's bin
    # first on PATH: the rsh agent hands PATH to the other nodes (their python and prted)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PRTE_", "HPCDDP_RANKS_PER_NODE"))}
    env.update(VCLUSTER_NAME=NAME, VCLUSTER_SUBNET=SUBNET, PYTHONUNBUFFERED="1",
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               TORCH_CPP_LOG_LEVEL=os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR"),
               PATH=os.path.join(sys.prefix, "bin") + os.pathsep + os.environ.get("PATH", ""))
    subprocess.run(["bash", str(sh), "down"], env=env, capture_output=True)  # a stale one
    up = ["bash", str(sh), "up", str(n), "--slots", str(k)]
    if args.rate:
        link_bytes_per_s(args.rate)
        up += ["--rate", args.rate]
        argv = argv + ["--link-rate", args.rate]
    got = subprocess.run(up, env=env, capture_output=True, text=True)
    if got.returncode != 0:
        print(got.stderr, file=sys.stderr)
        raise SystemExit(f"hpcddp bench --vcluster: `{' '.join(up)}` failed (exit "
                         f"{got.returncode})")
    try:
        forward = sorted(v for v in env if v.startswith("HPCDDP_")) + \
            ["OMP_NUM_THREADS", "PYTHONUNBUFFERED", "TORCH_CPP_LOG_LEVEL"]
        # no --oversubscribe (PRRTE would map every rank onto node1): each node has K slots
        mpi = [find_mpirun(), "--host", ",".join(f"node{i}:{k}" for i in range(1, n + 1)),
               "-n", str(n * k), "--bind-to", "none", "--mca", "btl", "tcp,self,sm",
               "--mca", "btl_tcp_if_include", "eth0", "--mca", "oob_tcp_if_include", "eth0"]
        if os.geteuid() == 0:
            mpi.append("--allow-run-as-root")
        for v in forward:
            mpi += ["-x", v]
        cmd = ["bash", str(sh), "run", "node1", *mpi, *argv]
        print(f"hpcddp bench: {n} virtual node(s) x {k} rank(s), link "
              f"{args.rate or 'unshaped'}: " + " ".join(cmd[4:]), file=sys.stderr, flush=True)
        return run_job(cmd, env=env, timeout=args.timeout, name="hpcddp bench")
    finally:
        subprocess.run(["bash", str(sh), "down"], env=env, capture_output=True)
