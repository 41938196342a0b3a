"""`hpcddp info`: one screen about the job (MPI library, launcher, layout, versions), gathered
to rank 0 and printed there."""
from __future__ import annotations

import argparse
import importlib
import platform

DESCRIPTION = """\
Show hpcddp's version, whether its C module is built (and how to build it), the MPI library and version, thread level, launcher, the rank / local rank / node / host
layout, fault tolerance (ULFM, its heartbeat detector and what keeps it beating), torch and CUDA, CUDA-aware MPI status, h5py/lmdb versions, and which path each
collective takes on the world group (in the order tried; open or closed, and why). Run it the way you run
your training job, e.g.:

    mpirun -n 4 hpcddp info
    srun --mpi=pmix -n 8 hpcddp info --json
    HPCDDP_RANKS_PER_NODE=2 mpirun -n 4 hpcddp info     # emulate 2 nodes of 2 ranks
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (world_size, nodes, launcher, mpi, cuda_aware, "
                        "ranks, paths)")


def run(args) -> int:
    import json

    info = collect_info()
    if info is not None:
        print(json.dumps(info, indent=2) if args.json else format_info(info), flush=True)
    return 0


def _version(module: str) -> str | None:
    try:
        return getattr(importlib.import_module(module), "__version__", "?")
    except ImportError:
        return None


def _cuda_aware() -> str:
    try:
        from hpcddp.comm.cuda import cuda_aware_status
    except ImportError:
        return "unknown"
    try:
        return cuda_aware_status()
    except Exception as exc:  # detection must never break `hpcddp info`
        return f"unknown ({exc})"


def collect_info() -> dict | None:
    """Collective over the world: rank 0 gets the job's info dict, other ranks None."""
    import mpi4py
    import torch

    from hpcddp.comm import startup
    rt = startup.init(set_cuda_device=False)
    topo, world = rt.topology, rt.world
    mine = {"rank": world.rank, "local_rank": topo.local_rank, "node": topo.node,
            "host": topo.hostname, "pid": __import__("os").getpid()}
    ranks = world.mpi.gather(mine, root=0)
    from hpcddp.collectives import paths
    path_table = paths.table(world)     # collective: the node-local paths' start-up races
    if world.rank != 0:
        return None
    launch = rt.launch
    cuda = torch.cuda.is_available()
    from hpcddp.collectives import _plans, engine
    import hpcddp
    return {
        "hpcddp": hpcddp.__version__,
        "c_module": _c_module_state(_plans),
        "async_engine": engine.state(),
        "mpi_yield_when_idle": __import__("os").environ.get("OMPI_MCA_mpi_yield_when_idle", ""),
        "fault_tolerance": _fault_tolerance(),
        "world_size": world.size,
        "nodes": topo.num_nodes,
        "ranks_per_node_emulated": topo.emulated,
        "local_rank_source": rt.local_rank_source,
        "launcher": launch.launcher if launch else "singleton",
        "mpi": {"library": rt.mpi_library, "version": rt.mpi_version,
                "thread_level": rt.thread_level,
                "thread_level_requested": rt.thread_level_requested,
                "mpi4py": mpi4py.__version__},
        "cuda_aware": _cuda_aware(),
        "all_reduce_hit": _plans.KIND,    # "C" or "Python (why)": setup.py, docs/install.md
        "plan_hit_ops": list(_plans.PLANNED_OPS),
        "torch": torch.__version__,
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if cuda else [],
        "python": platform.python_version(),
        "h5py": _version("h5py"),
        "lmdb": _version("lmdb"),
        "notes": list(rt.notes),
        "ranks": ranks,
        "paths": path_table,
    }


#: How to build the C module after the fact (docs/install.md, "The C module").
BUILD_C = ("MPICC=$(which mpicc) pip install --force-reinstall --no-deps hpcddp "
           "(from a checkout: pip install --no-deps -e .)")


def _c_module_state(plans) -> str:
    """"built", or one plain sentence: why the C module does not run here and how to fix it."""
    if plans.KIND == "C":
        return "built"
    why = plans.WHY_PYTHON
    if why.startswith("not built"):
        return (f"missing: hpcddp was installed without an MPI C compiler, so the repeat "
                f"calls take the slower Python path (everything works). Build it with an "
                f"MPI compiler present: {BUILD_C}")
    return f"not used: {why}"


def _fault_tolerance() -> str:
    """What happens to the job when a rank is lost, and how a silent node is found (rank 0's
    view: every rank starts with the same settings)."""
    import os
    from hpcddp.comm import heartbeat
    from hpcddp.launch.env import fault_tolerant_job, ft_setting
    if not fault_tolerant_job():
        return "off: a lost rank ends the job (elastic training: mpirun --with-ft ulfm)"
    if not ft_setting("detector"):
        return "ULFM on; heartbeat detector off (one node, or set off: a silent node is not found)"
    pump = heartbeat.running()
    beat = (f"beaten by hpcddp's heartbeat pump ({pump})" if pump else
            "on its own thread" if ft_setting("detector_thread")
            else "beaten only inside MPI calls (no pump runs)")
    period, timeout = (os.environ.get(f"OMPI_MCA_mpi_ft_detector_{name}", "?")
                       for name in ("period", "timeout"))
    return (f"ULFM on; heartbeat detector every {period} s, a node silent {timeout} s is lost; "
            f"{beat}")


def format_info(info: dict) -> str:
    m = info["mpi"]
    emu = " (emulated: HPCDDP_RANKS_PER_NODE)" if info["ranks_per_node_emulated"] else ""
    lines = [
        f"hpcddp     {info['hpcddp']}; C module {info['c_module']}",
        f"hpcddp job: {info['world_size']} ranks on {info['nodes']} node(s){emu}, "
        f"launcher {info['launcher']}",
        f"MPI        {m['library']}: {m['version']}",
        f"threads    {m['thread_level']} (asked {m['thread_level_requested']}); mpi4py {m['mpi4py']}",
        f"CUDA-aware {info['cuda_aware']}",
        f"repeat calls ({', '.join(info['plan_hit_ops'])}) in {info['all_reduce_hit']}",
        f"async ops  engine {info['async_engine']}; MPI waits "
        f"{'yielding the core' if info['mpi_yield_when_idle'] == '1' else 'spinning'}",
        f"failures   {info['fault_tolerance']}",
        f"torch      {info['torch']}; CUDA devices: "
        f"{', '.join(info['cuda_devices']) if info['cuda_devices'] else 'none'}",
        f"data       h5py {info['h5py']}, lmdb {info['lmdb']}; python {info['python']}",
        f"local rank from {info['local_rank_source']}",
        "",
        f"{'rank':>5} {'local':>5} {'node':>5}  host",
    ]
    for r in info["ranks"]:
        lines.append(f"{r['rank']:>5} {r['local_rank']:>5} {r['node']:>5}  {r['host']}")
    for n in info["notes"]:
        lines.append(f"note: {n}")
    from hpcddp.collectives.paths import format_table
    lines += ["", format_table(info["paths"])]
    return "\n".join(lines)
