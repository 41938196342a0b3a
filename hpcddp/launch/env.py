"""Launcher environment tables (placeholder: Open MPI and Slurm only; the full table is issue 2)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional


class LaunchEnvError(ValueError):
    """The launcher's variables are partial or contradict each other."""


@dataclass(frozen=True)
class LaunchInfo:
    launcher: str
    rank: int
    size: int
    local_rank: Optional[int] = None
    local_size: Optional[int] = None
    node_rank: Optional[int] = None
    num_nodes: Optional[int] = None
    hosts: Optional[tuple] = None


def detect(env: Mapping[str, str] | None = None) -> Optional[LaunchInfo]:
    env = os.environ if env is None else env
    if "OMPI_COMM_WORLD_RANK" in env:
        g = lambda k: int(env[k]) if k in env else None  # noqa: E731
        return LaunchInfo("openmpi", g("OMPI_COMM_WORLD_RANK"), g("OMPI_COMM_WORLD_SIZE"),
                          g("OMPI_COMM_WORLD_LOCAL_RANK"), g("OMPI_COMM_WORLD_LOCAL_SIZE"),
                          g("OMPI_COMM_WORLD_NODE_RANK"), None)
    if "SLURM_PROCID" in env:
        g = lambda k: int(env[k]) if k in env else None  # noqa: E731
        return LaunchInfo("slurm", g("SLURM_PROCID"), g("SLURM_NTASKS"), g("SLURM_LOCALID"),
                          None, g("SLURM_NODEID"), g("SLURM_NNODES"))
    return None
