"""A guard over MPI's start-up: a rank lost before MPI_Init completes ends the job instead of
hanging it, where the launcher would not end it.

Under ``mpirun --with-ft ulfm`` Open MPI does not end the job when a rank dies, and MPI_Init's
exchange of addresses (PMIx's fence) waits for every rank of the job: seen, rank 1 SIGKILLed
while it imported torch, ranks 0 and 2 waited in ``from mpi4py import MPI`` until the batch
system's time limit, with no line at all. A plain ``srun`` step does the same unless it was
given ``--kill-on-bad-exit`` (or the site sets KillOnBadExit): srun says "task 1: Killed" and
waits for the other tasks, which wait in MPI_Init. Nothing in the rank can see it: MPI_Init
holds Python's GIL, so no thread of the rank runs. So before MPI starts, the rank starts this
module as a small process of its own (:func:`start`), which watches:

- the rank's siblings on this node (the processes of the same launch, found in /proc by their
  ``PMIX_NAMESPACE``, or their Slurm job and step, and their local rank): a local rank missing
  for ``SETTLE_S`` died before MPI could start (a kill from outside, the OOM killer, a crash in
  an import). The guard prints which and SIGKILLs the rank (it sits in MPI's C code: nothing
  else ends it); in an srun step it first ends the whole step (``scancel --signal=KILL
  JOB.STEP``), so that the ranks on the other nodes, which cannot see the loss, end too;
- in a fault-tolerant job, a start-up longer than ``max(HPCDDP_TIMEOUT,
  START_TIMEOUT_FLOOR_S)``: a rank lost on another node, where no process of this node can see
  it (ranks reach MPI_Init as fast as their imports go, tens of seconds apart on a loaded
  shared filesystem: hence the floor).

The rank closes the pipe between them once MPI has started (:meth:`Guard.done`); the guard
reads its end of file and exits, as it does when the rank has gone. Under plain ``mpirun`` the
launcher ends the job itself when a rank dies, and no guard runs.

Standard library only, and run with ``python -I -S`` (no site-packages): it must start in
milliseconds and never touch MPI.
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

PERIOD_S = 0.25          # between two looks at the siblings
SETTLE_S = 1.0           # a local rank missing this long (from the guard's start) is dead
START_TIMEOUT_FLOOR_S = 300.0


class Guard:
    """The running guard of this rank's MPI start-up."""

    def __init__(self, proc: subprocess.Popen, write_fd: int):
        self.proc, self._fd = proc, write_fd

    def done(self) -> None:
        """MPI has started: the guard reads end of file and exits."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def start(rank: int, size: int | None, local_rank: int | None, local_size: int | None,
          timeout: float | None, slurm_step: str = "") -> Guard | None:
    """Start the guard for this rank (RANK of SIZE in the job, LOCAL_RANK of LOCAL_SIZE on this
    node; TIMEOUT: the start-up limit's HPCDDP_TIMEOUT, None for no limit; SLURM_STEP:
    "JOB.STEP:NODE" where srun started the rank, to end the step on a loss). None where it
    has nothing to watch or cannot run."""
    namespace = os.environ.get("PMIX_NAMESPACE", "")
    launch = f"step:{slurm_step}" if slurm_step else namespace
    limit = max(timeout, START_TIMEOUT_FLOOR_S) if timeout else 0.0
    if not limit and not (launch and (local_size or 0) > 1 and local_rank is not None):
        return None
    read_fd, write_fd = os.pipe()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", os.path.abspath(__file__), str(read_fd),
             str(os.getpid()), str(rank), str(size or 0),
             str(-1 if local_rank is None else local_rank), str(local_size or 0), launch,
             str(limit)],
            pass_fds=(read_fd,), stdin=subprocess.DEVNULL, close_fds=True)
    except OSError:
        os.close(write_fd)
        return None
    finally:
        os.close(read_fd)
    return Guard(proc, write_fd)


# -- the guard process -------------------------------------------------------------------------
def _alive(pid: int) -> bool:
    # hpcddp.launch.process.pid_state's test, written again: under ``python -I -S`` the guard
    # cannot import hpcddp (it is not on the path), only the standard library
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


_LOCAL_RANK_VARIABLES = (b"OMPI_COMM_WORLD_LOCAL_RANK", b"SLURM_LOCALID")
_WORLD_RANK_VARIABLES = (b"PMIX_RANK", b"SLURM_PROCID")
_SCANCEL = ("scancel", "--signal=KILL")


def _slurm_step(launch: str) -> tuple:
    """(JOB.STEP, NODE) of LAUNCH "step:JOB.STEP:NODE" (an srun step), or ("", "")."""
    if not launch.startswith("step:"):
        return "", ""
    return tuple(launch[5:].rsplit(":", 1))


def _launch_marks(launch: str) -> list:
    """The environment entries every process of LAUNCH on this node has: a PMIx namespace, or
    "step:JOB.STEP:NODE" (an srun step, whichever MPI plugin it uses; the node too: a test
    cluster's slurmds may share one host's /proc)."""
    step, node = _slurm_step(launch)
    if step:
        job, step_id = step.split(".", 1)
        return [b"SLURM_JOB_ID=" + job.encode(), b"SLURM_STEP_ID=" + step_id.encode(),
                b"SLURM_NODEID=" + node.encode()]
    return [b"PMIX_NAMESPACE=" + launch.encode()]


def local_ranks_alive(launch: str) -> dict:
    """{local rank: world rank} of the live processes of LAUNCH (a PMIx namespace, or
    "step:JOB.STEP:NODE") on this node."""
    found = {}
    marks = _launch_marks(launch)
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if not all(m in env for m in marks):
            continue
        values = dict(v.split(b"=", 1) for v in env if b"=" in v)
        local = next((values[k] for k in _LOCAL_RANK_VARIABLES if k in values), None)
        world = next((values[k] for k in _WORLD_RANK_VARIABLES if k in values), None)
        if local is None or world is None or not _alive(int(name)):
            continue
        try:
            found[int(local)] = int(world)
        except ValueError:
            continue
    return found


def _slurm_world_ranks(launch: str) -> dict:
    """{local rank: world rank} of this node's tasks in an srun step, from SLURM_GTIDS (the
    step's task ids on this node, in local-rank order; Slurm 22.05 sets it, later ones may
    not): a task killed before the guard first looked is then still named by its rank."""
    if not _slurm_step(launch)[0]:
        return {}
    ids = os.environ.get("SLURM_GTIDS", "").split(",")
    return {i: int(g) for i, g in enumerate(ids) if g.strip().isdigit()}


def _named(dead: list, seen: dict, rank: int, size: int) -> str:
    """"rank 1" for DEAD local ranks. The launcher numbers a node's ranks in its own order
    (local rank 2 may be world rank 1) and a rank that died before the guard looked was never
    seen: on one node the world ranks not seen alive are the dead ones; across nodes a rank
    is named by its world rank where it was seen (or srun said it), else by its local rank."""
    if size and len(set(seen) | set(dead)) == size:          # every rank is on this node
        gone = sorted(set(range(size)) - set(seen.values()) - {rank})
        if len(gone) == len(dead):
            return f"rank{'s' if len(gone) > 1 else ''} {', '.join(map(str, gone))} of this job"
    return ", ".join(f"rank {seen[r]}" if r in seen else f"the job's local rank {r}"
                     for r in dead)


def _end(rank_pid: int, rank: int, why: str, launch: str = "") -> None:
    step, _ = _slurm_step(launch)
    what = (f"ending the job step ({' '.join(_SCANCEL)} {step}) and this rank (pid "
            f"{rank_pid})" if step else f"ending this rank (pid {rank_pid})")
    print(f"[rank{rank}] hpcddp: {why}: {what}, which waits in MPI's start-up (MPI_Init) and "
          f"would wait for ever", file=sys.stderr, flush=True)
    if step:         # the ranks on the other nodes cannot see the loss: srun's step ends them
        try:
            subprocess.run([*_SCANCEL, step], timeout=30, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        os.kill(rank_pid, signal.SIGKILL)
    except OSError:
        pass


def _watch(fd: int, rank_pid: int, rank: int, size: int, local_rank: int, local_size: int,
           launch: str, limit: float) -> None:
    t0 = time.monotonic()
    missing_since: dict = {}
    seen: dict = _slurm_world_ranks(launch)
    host = os.uname().nodename
    while True:
        ready, _, _ = select.select([fd], [], [], PERIOD_S)
        if ready or not _alive(rank_pid):   # end of file: MPI has started, or the rank is gone
            return
        now = time.monotonic()
        if launch and local_size and local_rank >= 0:
            alive = local_ranks_alive(launch)
            seen.update(alive)
            missing = set(range(local_size)) - set(alive) - {local_rank}
            missing_since = {r: missing_since.get(r, now) for r in missing}
            dead = sorted(r for r, t in missing_since.items() if now - t >= SETTLE_S)
            if dead:
                _end(rank_pid, rank, f"{_named(dead, seen, rank, size)} on {host} ended "
                     f"before MPI's start-up completed (killed from outside, the OOM killer, "
                     f"a crash before MPI_Init); " + (
                         "srun without --kill-on-bad-exit does not end the step for it"
                         if launch.startswith("step:") else
                         "under --with-ft ulfm MPI does not end the job for it"), launch)
                return
        if limit and now - t0 > limit:
            _end(rank_pid, rank, f"MPI's start-up (MPI_Init) has not completed in {limit:g} s "
                 f"(max(HPCDDP_TIMEOUT, {START_TIMEOUT_FLOOR_S:g} s)): a rank of the job, on "
                 f"another node, is lost or has not started")
            return


if __name__ == "__main__":
    _fd, _pid, _rank, _size, _local, _local_size, _ns, _limit = sys.argv[1:9]
    _watch(int(_fd), int(_pid), int(_rank), int(_size), int(_local), int(_local_size), _ns,
           float(_limit))
