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
  shared filesystem: hence the floor);
- under every launcher, its own rank stopped (``SIGSTOP``, ``kill -STOP``: state T) for
  HPCDDP_TIMEOUT while the job starts, before hpcddp's watchdog runs: seen, a rank stopped
  while it imported torch, or in the first collective of hpcddp.init or of DDP's constructor,
  left the others waiting until the job's time limit under plain ``mpirun`` too. The guard
  names it and ends it (and, in an srun step, the step), so that the launcher ends the job as
  for any lost rank. A stopped rank is a frozen one, not a slow one: no floor applies; a rank
  stopped by a debugger (state t) is left alone.

The rank writes one byte to the pipe between them once MPI has started (:meth:`Guard.mpi_started`):
a loss is then MPI's, hpcddp.elastic's or the launcher's to handle (in an srun step without
ULFM the guard still ends the step on a lost task of its node, since srun does not); and
closes it once hpcddp has started and its watchdog runs (:meth:`Guard.done`); the guard reads
its end of file and exits, as it does when the rank has gone. Under plain ``mpirun`` the
launcher ends the job itself when a rank dies, and the guard only watches for a stopped rank.

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
GAP_S = 5.0              # a look this late means the guard itself was stopped (a whole job
                         # suspended): what it saw before does not count
SIBLING_GRACE_S = 2.0    # a stopped rank's own guard acts first; a sibling's after this
SCAN_S = 1.0             # between two looks for stopped siblings alone (plain mpirun)
MPI_STARTED = b"m"
_GUARD_PATH = os.path.abspath(__file__).encode()


class Guard:
    """The running guard of this rank's MPI start-up."""

    def __init__(self, proc: subprocess.Popen, write_fd: int):
        self.proc, self._fd = proc, write_fd
        # a forked child (a DataLoader worker) must not hold the pipe open after done()
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None

    def mpi_started(self) -> None:
        """MPI_Init has completed: a lost rank is no longer the guard's (but srun's step's)."""
        if self._fd is not None:
            try:
                os.write(self._fd, MPI_STARTED)
            except OSError:
                pass

    def done(self) -> None:
        """hpcddp has started (its watchdog runs): the guard reads end of file and exits."""
        if self._fd is not None:
            self._forget()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def start(rank: int, size: int | None, local_rank: int | None, local_size: int | None,
          timeout: float | None, *, fault_tolerant: bool = False, slurm_step: str = "",
          act_on_lost: bool = True) -> Guard | None:
    """Start the guard for this rank (RANK of SIZE in the job, LOCAL_RANK of LOCAL_SIZE on this
    node; TIMEOUT: HPCDDP_TIMEOUT, None for the watchdog off: no stopped rank is ended;
    FAULT_TOLERANT: under ULFM, where the launcher ends nothing and the start-up has a limit;
    SLURM_STEP: "JOB.STEP:NODE" where srun started the rank, to end the step on a loss;
    ACT_ON_LOST: whether a lost rank of this node is the guard's to act on, not only a stopped
    one). None where it has nothing to watch or cannot run."""
    namespace = os.environ.get("PMIX_NAMESPACE", "")
    launch = f"step:{slurm_step}" if slurm_step else namespace
    limit = max(timeout, START_TIMEOUT_FLOOR_S) if timeout and fault_tolerant else 0.0
    stopped_limit = timeout or 0.0
    siblings_lost = act_on_lost and launch and (local_size or 0) > 1 and local_rank is not None
    if not (limit or stopped_limit or siblings_lost):
        return None
    # past MPI_Init a lost task is still the guard's in an srun step (srun ends nothing),
    # not under ULFM (hpcddp.elastic's)
    after = "1" if slurm_step and not fault_tolerant else "0"
    read_fd, write_fd = os.pipe()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", os.path.abspath(__file__), str(read_fd),
             str(os.getpid()), str(rank), str(size or 0),
             str(-1 if local_rank is None else local_rank), str(local_size or 0),
             launch or "-", str(limit), str(stopped_limit), after,
             "1" if act_on_lost else "0"],
            pass_fds=(read_fd,), stdin=subprocess.DEVNULL, close_fds=True)
    except OSError:
        os.close(write_fd)
        return None
    finally:
        os.close(read_fd)
    return Guard(proc, write_fd)


# -- the guard process -------------------------------------------------------------------------
def _state(pid: int) -> str:
    """PID's state letter in /proc ("R", "S", "T" stopped...), "" where it is gone."""
    # hpcddp.launch.process.pid_state's test, written again: under ``python -I -S`` the guard
    # cannot import hpcddp (it is not on the path), only the standard library
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _alive(pid: int) -> bool:
    return _state(pid) not in ("", "Z", "X")


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


def _uts(pid: str) -> str:
    """PID's hostname namespace: a test cluster's virtual nodes share one /proc, each with
    its own (the same launch and local rank may then run on two nodes); "" if unreadable."""
    try:
        return os.readlink(f"/proc/{pid}/ns/uts")
    except OSError:
        return ""


def siblings(launch: str) -> dict:
    """{local rank: (world rank, pid, state letter)} of the live processes of LAUNCH (a PMIx
    namespace, or "step:JOB.STEP:NODE") on this node: each local rank's first process (a
    process it forked shares its variables), never a guard (it shares them too)."""
    found: dict = {}
    marks = _launch_marks(launch)
    node = _uts("self")
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read().split(b"\0")
            if not all(m in env for m in marks):
                continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if _GUARD_PATH in f.read():
                    continue
        except OSError:
            continue
        if _uts(name) != node:
            continue         # another (virtual) node sharing this /proc: not a sibling
        values = dict(v.split(b"=", 1) for v in env if b"=" in v)
        local = next((values[k] for k in _LOCAL_RANK_VARIABLES if k in values), None)
        world = next((values[k] for k in _WORLD_RANK_VARIABLES if k in values), None)
        state = _state(int(name))
        if local is None or world is None or state in ("", "Z", "X"):
            continue
        try:
            key, entry = int(local), (int(world), int(name), state)
        except ValueError:
            continue
        if key not in found or entry[1] < found[key][1]:
            found[key] = entry
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


WAITS_IN_MPI_INIT = "which waits in MPI's start-up (MPI_Init) and would wait for ever"


def _end(rank_pid: int, rank: int, why: str, launch: str = "",
         tail: str = WAITS_IN_MPI_INIT) -> None:
    step, _ = _slurm_step(launch)
    what = (f"ending the job step ({' '.join(_SCANCEL)} {step}) and this rank (pid "
            f"{rank_pid})" if step else f"ending this rank (pid {rank_pid})")
    print(f"[rank{rank}] hpcddp: {why}: {what}, {tail}", file=sys.stderr, flush=True)
    _kill(rank_pid, step)


def _kill(pid: int, step: str = "") -> None:
    """SIGKILL PID; in an srun step (STEP "JOB.STEP") cancel the step first: the ranks on the
    other nodes cannot see the loss, and srun ends nothing for it."""
    if step:
        try:
            subprocess.run([*_SCANCEL, step], timeout=30, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def _stopped_line(rank: int, pid: int, host: str, seconds: float, limit: float,
                  mpi_started: bool) -> str:
    return (f"rank {rank} (pid {pid} on {host}) has been stopped (state T: SIGSTOP, kill -STOP) "
            f"for {seconds:.0f} s while the job starts ({'after' if mpi_started else 'before'} "
            f"MPI_Init; HPCDDP_TIMEOUT={limit:g} s), and the other ranks wait for it")


def _watch(fd: int, rank_pid: int, rank: int, size: int, local_rank: int, local_size: int,
           launch: str, limit: float, stopped_limit: float = 0.0,
           siblings_after_start: bool = False, act_on_lost: bool = True) -> None:
    """LAUNCH: the launch whose processes on this node are the siblings ("" for none);
    ACT_ON_LOST: whether a lost sibling is the guard's (ULFM, srun), else only a stopped one."""
    t0 = last = time.monotonic()
    next_scan = 0.0
    missing_since: dict = {}
    stopped: dict = {}                        # pid -> since when it is seen stopped
    seen: dict = _slurm_world_ranks(launch)
    host = os.uname().nodename
    mpi_started = False
    # LAUNCH also names the srun step that _end cancels, with or without node-mates
    watch = bool(launch) and local_size > 1 and local_rank >= 0
    while True:
        ready, _, _ = select.select([fd], [], [], PERIOD_S)
        if ready:
            if not os.read(fd, 64):          # end of file: hpcddp has started
                return
            mpi_started = True               # MPI_Init completed
            # the siblings past it: their own guards watch for a stop; a loss is MPI's, the
            # launcher's or hpcddp.elastic's, but in an srun step (srun ends nothing)
            watch = watch and siblings_after_start
            limit = 0.0
        state = _state(rank_pid)
        if state in ("", "Z", "X"):          # the rank is gone
            return
        now = time.monotonic()
        gap, last = now - last, now
        if gap > GAP_S:      # the guard was stopped too (a whole job suspended): what it saw
            t0 += gap        # before does not count
            stopped, missing_since = {pid: now for pid in stopped}, {}
        if stopped_limit and state == "T":
            since = stopped.setdefault(rank_pid, now)
            if now - since >= stopped_limit:
                _end(rank_pid, rank, _stopped_line(rank, rank_pid, host, now - since,
                                                   stopped_limit, mpi_started),
                     launch, tail="so that the launcher ends the job as for a lost rank")
                return
        else:
            stopped.pop(rank_pid, None)
        if watch and now >= next_scan:
            next_scan = now + (PERIOD_S if act_on_lost else SCAN_S)
            found = siblings(launch)
            seen.update((r, w) for r, (w, _, _) in found.items())
            if stopped_limit:
                _watch_stopped_siblings(found, stopped, now, rank, local_rank, host, launch,
                                        stopped_limit, mpi_started)
            if act_on_lost:
                missing = set(range(local_size)) - set(found) - {local_rank}
                missing_since = {r: missing_since.get(r, now) for r in missing}
                dead = sorted(r for r, t in missing_since.items() if now - t >= SETTLE_S)
                if dead:
                    when = "while hpcddp started" if mpi_started else \
                        "before MPI's start-up completed"
                    _end(rank_pid, rank, f"{_named(dead, seen, rank, size)} on {host} ended "
                         f"{when} (killed from outside, the OOM killer, a crash"
                         f"{'' if mpi_started else ' before MPI_Init'}); " + (
                             "srun without --kill-on-bad-exit does not end the step for it"
                             if launch.startswith("step:") else
                             "under --with-ft ulfm MPI does not end the job for it"), launch,
                         tail="which waits for it" if mpi_started else WAITS_IN_MPI_INIT)
                    return
        if limit and now - t0 > limit:
            _end(rank_pid, rank, f"MPI's start-up (MPI_Init) has not completed in {limit:g} s "
                 f"(max(HPCDDP_TIMEOUT, {START_TIMEOUT_FLOOR_S:g} s)): a rank of the job, on "
                 f"another node, is lost or has not started")
            return


def _watch_stopped_siblings(found: dict, stopped: dict, now: float, rank: int,
                            local_rank: int, host: str, launch: str, limit: float,
                            mpi_started: bool) -> None:
    """A sibling stopped before its own guard started (while it imported torch, say) has no
    guard to end it: the guard of the node's lowest running local rank ends it, a grace after
    its own guard would have, so that the launcher ends the job as for a lost rank."""
    running = [r for r, (_, _, st) in found.items() if st != "T"]
    for r, (world, pid, st) in found.items():
        if r == local_rank:
            continue
        if st != "T":
            stopped.pop(pid, None)
            continue
        since = stopped.setdefault(pid, now)
        if now - since < limit + SIBLING_GRACE_S or min(running, default=-1) != local_rank:
            continue
        step, _ = _slurm_step(launch)
        line = _stopped_line(world, pid, host, now - since, limit, mpi_started)
        print(f"[rank{rank}] hpcddp: {line}: ending it (SIGKILL"
              f"{', and the job step: srun ends nothing' if step else ''}), so that the "
              f"launcher ends the job as for a lost rank", file=sys.stderr, flush=True)
        _kill(pid, step)
        stopped.pop(pid, None)


if __name__ == "__main__":
    _fd, _pid, _rank, _size, _local, _local_size, _ns, _limit = sys.argv[1:9]
    _rest = sys.argv[9:12]
    _stopped, _after, _act = _rest + ["0", "0", "1"][len(_rest):]
    _watch(int(_fd), int(_pid), int(_rank), int(_size), int(_local), int(_local_size),
           "" if _ns == "-" else _ns, float(_limit), float(_stopped), _after == "1",
           _act == "1")
