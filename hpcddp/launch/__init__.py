"""Where am I in the job? Launcher-aware environment resolution, with no MPI and no torch.

``detect()`` reads the variables that mpirun (Open MPI, MPICH/Hydra, MVAPICH), PMIx, srun,
Cray PALS and torchrun set, and returns a :class:`LaunchInfo`, or ``None`` when the process was
started by none of them (a singleton). Contradictory or partial variables raise
:class:`LaunchEnvError` naming the variables seen. ``check_world()`` compares that with MPI's
world once MPI has started (:class:`LaunchWorldError`: torchrun's workers, an MPI that did not
connect to its launcher). The tables and precedence rules are in ``hpcddp.launch.env``;
docs/launching.md lists the variables per launcher.
"""
from hpcddp.launch.env import (LAUNCHER_OVERRIDE, LAUNCHERS, LaunchEnvError, LaunchInfo,
                               LaunchWorldError, check_world, detect, parse_tasks_per_node)
from hpcddp.launch.hostlist import compress_hostlist, expand_hostlist

__all__ = ["LAUNCHER_OVERRIDE", "LAUNCHERS", "LaunchEnvError", "LaunchInfo", "LaunchWorldError",
           "check_world", "compress_hostlist", "detect", "expand_hostlist",
           "parse_tasks_per_node"]
