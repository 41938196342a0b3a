"""Run at interpreter start by hpcddp-start.pth, for processes of an MPI job. Two things:

1. **A child of a rank dies with it.** A Python process whose parent is a rank that hpcddp
   started in (``HPCDDP_RANK_PID``, set by hpcddp.launch.process) asks the kernel for
   ``SIGKILL`` when that parent dies (``PR_SET_PDEATHSIG``). That reaches what the rank's own
   at-fork hook cannot: DataLoader workers started by spawn, and multiprocessing's forkserver,
   whose forked workers keep the forkserver alive (they hold the pipe whose end would tell it
   its rank died) while their watchdog watches the forkserver, not the rank: the pair outlived
   a killed rank and held mpirun's output open forever. Multiprocessing's resource tracker is
   not tied to the rank: it cleans up after its parent's end, and gets a process group of its
   own so that a launcher killing the rank's group does not kill it first.
2. **torchrun's variables under MPI launchers** (below).

A script that reads ``os.environ["LOCAL_RANK"]`` before importing anything finds it under
mpirun and srun (hpcddp/launch/torchrun_env.py says what is set and why). Outside a job this
costs one look at six environment variables. Under a launcher it loads hpcddp.launch's pure
modules without running hpcddp's ``__init__`` (which sets up the backend's registration), then forgets them, so that
the script's own ``import hpcddp`` starts from scratch. It never imports MPI or torch and never
raises: a problem is left for ``hpcddp.init`` to report.
"""
import os

_MARKERS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID", "PALS_RANKID",
            "MV2_COMM_WORLD_RANK")   # hpcddp.launch.torchrun_env.LAUNCHER_MARKERS


def _export() -> None:
    import importlib
    import importlib.util
    import sys
    import types
    if "hpcddp" in sys.modules:
        return
    spec = importlib.util.find_spec("hpcddp")
    if spec is None or not spec.submodule_search_locations:
        return
    bare = types.ModuleType("hpcddp")   # the package without its __init__: no torch
    bare.__path__ = list(spec.submodule_search_locations)
    bare.__spec__ = spec
    sys.modules["hpcddp"] = bare
    try:
        importlib.import_module("hpcddp.launch.torchrun_env").export()
    finally:
        for name in [n for n in sys.modules if n == "hpcddp" or n.startswith("hpcddp.")]:
            del sys.modules[name]


def _die_with_the_rank() -> None:
    import sys
    rank = os.environ.get("HPCDDP_RANK_PID", "")
    if not rank.isdigit() or os.getppid() != int(rank) or not sys.platform.startswith("linux"):
        return
    if "multiprocessing.resource_tracker" in " ".join(getattr(sys, "orig_argv", ())):
        # its own process group: Open MPI's launcher kills a rank's whole group once a rank of
        # the job died, and the tracker killed there leaves the semaphores of the rank's spawn
        # and forkserver workers in /dev/shm (sem.mp-*) for good. Alone, it ends as it is made
        # to: on its pipe's end, when the rank and its workers are gone, after unlinking them.
        os.setpgid(0, 0)
        return
    import ctypes
    import signal
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != int(rank):       # the rank died before prctl: too late for the kernel
        os._exit(1)


if "HPCDDP_RANK_PID" in os.environ:
    try:
        _die_with_the_rank()
    except Exception:   # noqa: BLE001 - never break the interpreter's start
        pass

if any(n in os.environ for n in _MARKERS) and os.environ.get("HPCDDP_TORCH_VARS") != "0":
    try:
        _export()
    except Exception:   # noqa: BLE001 - never break the interpreter's start
        pass
