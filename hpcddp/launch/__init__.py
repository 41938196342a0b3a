"""Where am I in the job? Launcher-aware environment resolution, with no MPI and no torch.

``detect()`` reads the variables that mpirun (Open MPI, MPICH/Hydra, MVAPICH), PMIx, srun,
Cray PALS and torchrun set, and returns a :class:`LaunchInfo`, or ``None`` when the process was
started by none of them (a singleton). Contradictory or partial variables raise
:class:`LaunchEnvError` naming the variables seen.
"""
from hpcddp.launch.env import LaunchEnvError, LaunchInfo, detect
from hpcddp.launch.hostlist import expand_hostlist

__all__ = ["LaunchEnvError", "LaunchInfo", "detect", "expand_hostlist"]
