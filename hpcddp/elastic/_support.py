"""Does this MPI survive a lost rank? Checked at start-up, before any training.

ULFM (User-Level Failure Mitigation: ``MPIX_Comm_revoke``, ``MPIX_Comm_shrink``,
``MPIX_Comm_agree``) must be both built into the library and switched on for the job:

- Open MPI >= 5.0 is built with it (``ompi_info``: "FT MPI support: yes") but runs it only
  under ``mpirun --with-ft ulfm`` (which sets ``OMPI_MCA_mpi_ft_enable=1`` in every rank), or
  with that MCA variable set for the job. Without it the runtime kills the whole job when
  one rank dies, before any survivor could react.
- MPICH >= 4.1 with ULFM: its ULFM support is on by default. ``HPCDDP_ELASTIC=force``
  skips the check (other ULFM-capable builds).

Standard library plus mpi4py (through ``hpcddp.comm``): no torch.
"""
from __future__ import annotations

import os

ENV_FORCE = "HPCDDP_ELASTIC"


class ElasticUnsupportedError(RuntimeError):
    """Elastic mode asked for on an MPI (or a launch) that cannot survive a lost rank."""


def support_problem(env=None) -> str | None:
    """Why elastic mode cannot run in this job, or None when it can."""
    from hpcddp import settings
    from hpcddp.comm import startup
    from hpcddp.comm._mpi import MPI
    from hpcddp.launch.env import fault_tolerant_job
    s = settings.get() if env is None else settings.read(env)
    env = os.environ if env is None else env
    if s.elastic == "force":
        return None
    missing = [n for n in ("Revoke", "Shrink", "Agree", "Get_failed") if not hasattr(MPI.Comm, n)]
    if missing:
        return (f"mpi4py {__import__('mpi4py').__version__} has no Comm.{', Comm.'.join(missing)} "
                f"(ULFM needs mpi4py >= 4.0): pip install 'mpi4py>=4'")
    lib = startup._mpi_library()[0]
    if lib == "Open MPI":
        if not fault_tolerant_job(env):
            return ("Open MPI runs this job without fault tolerance, so one lost rank ends "
                    "the whole job: start it with `mpirun --with-ft ulfm ...` (what `hpcddp "
                    "demo --elastic` does; in a Slurm job too, instead of srun: "
                    "docs/elastic.md), with Open MPI >= 5.0 (`ompi_info | grep 'FT MPI "
                    "support'` says yes)")
        return None
    if lib == "MPICH":
        return None
    return (f"{lib} has no ULFM support hpcddp knows of (supported: Open MPI >= 5.0 under "
            f"`mpirun --with-ft ulfm`, MPICH >= 4.1); set {ENV_FORCE}=force to try anyway")


def check_support() -> None:
    """Raise ElasticUnsupportedError (naming the fix) when elastic mode cannot work here."""
    problem = support_problem()
    if problem is not None:
        raise ElasticUnsupportedError(f"hpcddp.elastic: {problem}")
