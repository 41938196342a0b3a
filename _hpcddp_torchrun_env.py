"""Run at interpreter start by hpcddp-torchrun-env.pth: torchrun's variables under MPI launchers.

A script that reads ``os.environ["LOCAL_RANK"]`` before importing anything finds it under
mpirun and srun (hpcddp/launch/torchrun_env.py says what is set and why). Outside a job this
costs one look at six environment variables. Under a launcher it loads hpcddp.launch's pure
modules without running hpcddp's ``__init__`` (which imports torch), then forgets them, so that
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


if any(n in os.environ for n in _MARKERS) and os.environ.get("HPCDDP_TORCH_VARS") != "0":
    try:
        _export()
    except Exception:   # noqa: BLE001 - never break the interpreter's start
        pass
