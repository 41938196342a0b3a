"""hpcddp: MPI-backed HPC training toolkit for PyTorch.

Importing hpcddp registers the torch.distributed backend "hpcddp" and starts nothing: MPI
starts in :func:`init` (or :func:`init_process_group`, or the first op).
"""
from __future__ import annotations

import importlib

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
    try:
        from hpcddp.backend import register
    except ImportError:  # torch without distributed support: the rest of hpcddp still imports
        return
    register()


_register_backend()


def _torchrun_vars() -> None:
    # torchrun's RANK, LOCAL_RANK... under an MPI launcher, for an installation without
    # hpcddp-start.pth (which sets them at interpreter start): hpcddp/launch/torchrun_env.py
    from hpcddp.launch.torchrun_env import export
    export()


_torchrun_vars()
