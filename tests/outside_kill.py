"""Kill a rank (or its DataLoader worker) from outside, as the OOM killer or an admin does.

A test starts a job with :class:`Job` (mpirun under a hard timeout, in its own session,
every process of it marked by an environment variable), waits for a line that says the
target rank is in the phase to test (the client script prints it; the rank never kills
itself), sends SIGKILL from this process, and then checks what a user would: mpirun exits
in time, the output names the lost rank, and no process of the job is left anywhere, also
none re-parented to init (found by the marker in /proc/*/environ, not by walking a tree
that an orphan has left).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import uuid

from hpcddp.launch.mpirun import mpirun_command

MARK = "HPCDDP_TEST_JOB"


def job_processes(tag: str) -> list[int]:
    """PIDs of every live process whose environment holds MARK=TAG (zombies excluded)."""
    found = []
    needle = f"{MARK}={tag}".encode()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{name}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    continue
        except OSError:
            continue
        found.append(int(name))
    return found


def environ_of(pid: int) -> dict:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            items = f.read().split(b"\0")
    except OSError:
        return {}
    return dict(i.decode(errors="replace").split("=", 1) for i in items if b"=" in i)


def parent_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def name_of(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


class Job:
    """One mpirun job under a hard TIMEOUT, its output in OUTFILE, its processes marked."""

    def __init__(self, nprocs: int, argv, *, outfile, timeout: float, env=None,
                 fault_tolerant: bool = False, extra=(), cmd=None):
        self.tag = uuid.uuid4().hex[:12]
        self.env = dict(os.environ if env is None else env)
        self.env.update({MARK: self.tag, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
        self.cmd = cmd or mpirun_command(nprocs, list(argv), fault_tolerant=fault_tolerant,
                                         extra=list(extra))
        self.outfile = str(outfile)
        self.timeout = timeout
        self.killed_at = None
        self.killed: list[tuple[str, int]] = []
        self._out = open(self.outfile, "wb")
        self.t0 = time.monotonic()
        # run where its output goes: stall reports land beside it, not in the checkout
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=self._out,
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     cwd=os.path.dirname(os.path.abspath(self.outfile)))

    def output(self) -> str:
        with open(self.outfile, "rb") as f:
            return f.read().decode(errors="replace")

    def wait_for(self, pattern: str, within: float = 90.0) -> re.Match:
        """Wait until the output matches PATTERN (a regex); fail if the job ends first."""
        rx = re.compile(pattern, re.M)
        end = time.monotonic() + within
        while time.monotonic() < end:
            m = rx.search(self.output())
            if m:
                return m
            if self.proc.poll() is not None:
                raise AssertionError(f"job ended (exit {self.proc.returncode}) before "
                                     f"{pattern!r}:\n{self.output()[-4000:]}")
            time.sleep(0.05)
        raise AssertionError(f"no {pattern!r} within {within} s:\n{self.output()[-4000:]}")

    def ranks(self) -> dict[int, int]:
        """{rank: pid} of the MPI processes (children of the launcher's daemon)."""
        out = {}
        for pid in job_processes(self.tag):
            env = environ_of(pid)
            r = env.get("OMPI_COMM_WORLD_RANK", env.get("PMIX_RANK"))
            if r is not None and name_of(parent_of(pid)) in ("prterun", "prted", "mpirun",
                                                        "slurmstepd"):
                out[int(r)] = pid
        return out

    def workers(self, rank: int) -> list[int]:
        """PIDs of the processes RANK's process forked (its DataLoader workers)."""
        parent = self.ranks()[rank]
        return sorted(p for p in job_processes(self.tag) if parent_of(p) == parent)

    def kill(self, pid: int, what: str, sig: int = signal.SIGKILL) -> None:
        os.kill(pid, sig)
        self.killed_at = time.monotonic()
        self.killed.append((what, pid))

    def kill_rank(self, rank: int) -> int:
        pid = self.ranks()[rank]
        self.kill(pid, f"rank {rank}")
        return pid

    def finish(self) -> tuple[int, str, float | None]:
        """Wait for mpirun (at most what is left of TIMEOUT). Returns (exit status, output,
        seconds from the kill to the end). After a timeout the job is killed: 124."""
        left = max(1.0, self.timeout - (time.monotonic() - self.t0))
        try:
            rc = self.proc.wait(timeout=left)
        except subprocess.TimeoutExpired:
            self.cleanup()
            rc = 124
        end = time.monotonic()
        self._out.close()
        return rc, self.output(), (None if self.killed_at is None else end - self.killed_at)

    def leftovers(self, grace: float = 5.0) -> list[str]:
        """The job's processes still alive GRACE seconds after mpirun ended (then killed)."""
        end = time.monotonic() + grace
        while True:
            left = job_processes(self.tag)
            if not left or time.monotonic() > end:
                break
            time.sleep(0.1)
        described = [f"{p} ({name_of(p)}, parent {parent_of(p)})" for p in left]
        self.cleanup()
        return described

    def cleanup(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for p in job_processes(self.tag):
            try:
                os.kill(p, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

