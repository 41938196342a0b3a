"""hpcddp: MPI-backed HPC training toolkit for PyTorch.

Importing hpcddp starts nothing and imports no torch: MPI starts in :func:`init` (or
:func:`init_process_group`, or the first op). The torch.distributed backend "hpcddp" is
registered by torch itself when it is imported (hpcddp's ``torch.backends`` entry point, torch's
plugin autoload), or here at once when torch was imported first; so ``import hpcddp`` and then
``dist.init_process_group("hpcddp")`` work in either order, and ``hpcddp stage``/``pack`` never
load torch (thousands of ranks importing it from a shared file system is a start-up storm).
"""
from __future__ import annotations

import importlib
import importlib.util
import sys

from hpcddp._version import __version__

# name -> module that defines it; resolved on first access so `import hpcddp` stays light
_LAZY = {
    "init": "hpcddp.comm", "finalize": "hpcddp.comm", "world": "hpcddp.comm",
    "get_topology": "hpcddp.comm", "Communicator": "hpcddp.comm", "rank_print": "hpcddp.comm",
    "log": "hpcddp.comm",
    "init_process_group": "hpcddp.backend", "group_from_comm": "hpcddp.backend",
    "topology_groups": "hpcddp.backend", "ProcessGroupHPCDDP": "hpcddp.backend",
}
for _op in ("all_gather", "all_gather_into_tensor", "all_gather_object", "all_gather_single",
            "all_reduce",
            "all_to_all", "all_to_all_single", "barrier", "broadcast", "broadcast_object",
            "broadcast_object_list", "gather", "gather_object", "irecv", "isend",
            "monitored_barrier", "recv", "reduce", "reduce_scatter", "reduce_scatter_single",
            "reduce_scatter_tensor", "scatter", "scatter_object_list", "send", "Work"):
    _LAZY[_op] = "hpcddp.collectives"

__all__ = ["Communicator", "ProcessGroupHPCDDP", "Work", "__version__", "all_gather",
           "all_gather_into_tensor", "all_gather_object", "all_gather_single", "all_reduce", "all_to_all",
           "all_to_all_single", "barrier", "broadcast", "broadcast_object",
           "broadcast_object_list", "finalize", "gather", "gather_object", "get_topology",
           "group_from_comm", "init", "init_process_group", "irecv", "isend", "log",
           "monitored_barrier", "rank_print", "recv", "reduce", "reduce_scatter",
           "reduce_scatter_single", "reduce_scatter_tensor", "scatter", "scatter_object_list", "send",
           "topology_groups", "world"]


# What starts and stops with MPI in the layers above hpcddp.comm, as "module:function" names:
# comm runs them at every start-up (hpcddp.init, init_process_group, an op's first call) and
# finalize without importing those layers (the layer map: CONTRIBUTING.md).
ON_MPI_START = ("hpcddp.diagnostics:on_mpi_start",)
ON_MPI_FINALIZE = ("hpcddp.diagnostics:shutdown_diagnostics",)


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hpcddp' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def _register_backend() -> None:
    """torch's autoload entry point (pyproject.toml: ``torch.backends``), and ``import hpcddp``
    after torch: register the backend "hpcddp" (idempotent, no MPI)."""
    try:
        from hpcddp.backend import register
    except ImportError:  # torch without distributed support: the rest of hpcddp still imports
        return
    register()


class _RegisterAfterTorch:
    """An import hook, until torch is imported: registers the backend once torch's own import
    has run, where torch's autoload does not reach hpcddp (TORCH_DEVICE_BACKEND_AUTOLOAD=0, a
    source tree on PYTHONPATH with no installed metadata, an older egg-info shadowing it)."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)     # where the other finders find torch
        if spec is not None and spec.loader is not None:
            load = spec.loader.exec_module

            def exec_module(module):
                load(module)
                _register_backend()
            spec.loader.exec_module = exec_module
        return spec


if "torch" in sys.modules:      # torch came first (or is being imported, autoloading us)
    _register_backend()
else:
    sys.meta_path.insert(0, _RegisterAfterTorch())


def _torchrun_vars() -> None:
    # torchrun's RANK, LOCAL_RANK... under an MPI launcher, for an installation without
    # hpcddp-start.pth (which sets them at interpreter start): hpcddp/launch/torchrun_env.py
    from hpcddp.launch.torchrun_env import export
    export()


_torchrun_vars()
