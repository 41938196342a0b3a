"""The setup recorded with every result (BENCHMARKING.md "Protocol", item 7).

CPU, kernel, MPI library and version, the transport and single-copy mechanism Open MPI was
asked for, versions, thread settings and binding, and the load on the machine: the load
average before and after, and how much CPU *other* processes took while we ran (the machine's
busy time from /proc/stat minus our ranks' own CPU time), which is what decides whether
absolute figures from two runs can be compared at all.
"""
from __future__ import annotations

import os
import platform
import resource
import socket
import subprocess
import sys
import time


def _run(cmd: list[str], timeout: float = 20) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _hypervisor() -> str:
    out = _run(["lscpu"])
    for line in out.splitlines():
        if line.startswith("Hypervisor vendor:"):
            return line.split(":", 1)[1].strip()
    return ""


def cpu_times() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine from /proc/stat (0, 0 if unavailable)."""
    try:
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0, 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)   # idle + iowait
    guest = sum(fields[8:10]) if len(fields) > 9 else 0.0        # already counted in user
    total = sum(fields) - guest
    return total - idle, total


def steal_jiffies() -> float:
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return float(fields[8]) if len(fields) > 8 else 0.0
    except (OSError, ValueError):
        return 0.0


def own_cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def open_mpi_info() -> dict:
    """What Open MPI was asked for: MCA settings in the environment and the parameter files,
    and the shared-memory components this build has (``ompi_info``). Empty for other MPIs."""
    info: dict = {}
    # what a user or mpirun flag chose (not the bookkeeping variables mpirun sets itself)
    chosen = ("pml", "btl", "smsc", "coll", "mtl", "osc", "mpi_", "opal_", "hwloc_", "rmaps_")
    env = {k: v for k, v in os.environ.items()
           if k.startswith("OMPI_MCA_") and k[len("OMPI_MCA_"):].startswith(chosen)}
    if env:
        info["mca_env"] = env
    exe = os.path.join(os.path.dirname(sys.executable), "ompi_info")
    if not os.access(exe, os.X_OK):
        import shutil
        exe = shutil.which("ompi_info") or ""
    if not exe:
        return info
    out = _run([exe, "--parsable"])
    comps: dict = {}
    for line in out.splitlines():
        # mca:smsc:cma:version:... -> framework smsc has component cma
        parts = line.split(":")
        if len(parts) > 3 and parts[0] == "mca" and parts[3] == "version":
            comps.setdefault(parts[1], set()).add(parts[2])
    for fw in ("pml", "btl", "smsc", "coll"):
        if fw in comps:
            info[f"{fw}_components"] = sorted(comps[fw])
    conf = os.path.join(os.path.dirname(os.path.dirname(exe)), "etc", "openmpi-mca-params.conf")
    try:
        with open(conf) as f:
            lines = [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]
        if lines:
            info["mca_params_conf"] = lines
    except OSError:
        pass
    return info


def git_commit() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    rev = _run(["git", "-C", here, "rev-parse", "--short", "HEAD"]).strip()
    if not rev:
        return ""
    dirty = _run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"]).strip()
    return rev + ("+dirty" if dirty else "")


class LoadMeter:
    """Load average and foreign CPU use between start() and stop() (call on every rank)."""

    def __init__(self, ctl):
        self.ctl = ctl

    def start(self) -> None:
        self.t0 = time.monotonic()
        self.load0 = os.getloadavg()
        self.busy0, self.total0 = cpu_times()
        self.steal0 = steal_jiffies()
        self.own0 = own_cpu_seconds()

    def stop(self) -> dict:
        from hpcddp.comm import MPI
        busy1, total1 = cpu_times()
        steal1 = steal_jiffies()
        own = self.ctl.allreduce(own_cpu_seconds() - self.own0, op=MPI.SUM)
        wall = time.monotonic() - self.t0
        ncpu = os.cpu_count() or 1
        hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        busy_s = (busy1 - self.busy0) / hz
        out = {
            "wall_s": round(wall, 3),
            "loadavg_before": [round(x, 2) for x in self.load0],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
            "cpus": ncpu,
            "machine_busy_pct": round(100 * busy_s / (wall * ncpu), 1) if wall > 0 else None,
            "ranks_cpu_pct": round(100 * own / (wall * ncpu), 1) if wall > 0 else None,
            "steal_pct": round(100 * (steal1 - self.steal0) / hz / (wall * ncpu), 1)
            if wall > 0 else None,
        }
        if out["machine_busy_pct"] is not None:
            out["other_processes_cpu_pct"] = round(
                max(0.0, out["machine_busy_pct"] - out["ranks_cpu_pct"]), 1)
        return out


def describe(ctl, world_size: int, extra: dict | None = None) -> dict:
    """The machine and software set-up (collective over CTL: every rank calls it)."""
    from hpcddp.comm import MPI, runtime
    import mpi4py
    import numpy
    import torch
    from hpcddp.collectives import _plans, engine
    rt = runtime()
    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    per_rank = ctl.gather({"host": socket.gethostname(), "affinity": affinity}, root=0)
    setup = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": socket.gethostname(),
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "hypervisor": _hypervisor(),
        "kernel": platform.release(),
        "os": platform.platform(terse=True),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "mpi4py": mpi4py.__version__,
        "mpi_library": rt.mpi_library,
        "mpi_version": rt.mpi_version,
        "mpi_thread_level": rt.thread_level,
        "ranks": world_size,
        "nodes": rt.topology.num_nodes,
        "nodes_emulated": rt.topology.emulated,
        "launcher": getattr(rt.launch, "launcher", None),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "torch_threads": torch.get_num_threads(),
        "hpcddp_commit": git_commit(),
        "all_reduce_hit": _plans.KIND,
        "plan_hit_ops": list(_plans.PLANNED_OPS),
        "gloo_transport": "tcp (no shared-memory transport exists in gloo)",
        "async_engine": engine.state(),
        "mpi_yield_when_idle": os.environ.get("OMPI_MCA_mpi_yield_when_idle", ""),
    }
    if per_rank is not None:
        setup["rank_affinity"] = [p["affinity"] for p in per_rank]
        setup["hosts"] = sorted({p["host"] for p in per_rank})
    if "Open MPI" in rt.mpi_library and ctl.Get_rank() == 0:
        setup["open_mpi"] = open_mpi_info()
    if extra:
        setup.update(extra)
    del MPI
    return setup
