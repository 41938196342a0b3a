"""Diagnostics settings, read from the environment (documented in docs/hangs.md).

=========================  ============================================================
``HPCDDP_TIMEOUT``         seconds an op may wait before the watchdog reports a stall
                           (default 600, torch's NCCL default; ``0``/``off``: no watchdog).
                           ``hpcddp.init(timeout=...)`` sets it too.
``HPCDDP_STALL_POLICY``    ``abort`` (default): report, then MPI_Abort the job with exit
                           code 3; ``warn``: report, keep waiting, report again after
                           another timeout.
``HPCDDP_PEER_TIMEOUT``    seconds a rank has to answer the diagnostics exchange before it
                           is named dead/unresponsive (default ``min(5, timeout)``).
``HPCDDP_REPORT_DIR``      where ``hpcddp-stall-<jobid>.txt`` is written (default: cwd).
``HPCDDP_DEBUG=detail``    the mismatch check before every collective (costs one small
                           allgather per op; see docs/hangs.md for the measured cost).
``HPCDDP_RECORDER_SIZE``   flight recorder entries per rank (default 2048).
``HPCDDP_PID_CHECK``       ``1`` (default): a same-host peer whose process has gone is
                           named dead at once; ``0``: rely on the exchange timeout only
                           (ranks in separate PID namespaces on one host).
=========================  ============================================================

Bad values are rejected with the valid ones listed, on the rank that reads them, at init.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

DEFAULT_TIMEOUT = 600.0
POLICIES = ("abort", "warn")
STALL_EXIT_CODE = 3          # the job's exit code when the watchdog aborts it
_OFF = ("0", "off", "none", "false", "no")


@dataclass(frozen=True)
class Settings:
    timeout: float | None        # None: watchdog off
    policy: str
    peer_timeout: float
    report_dir: str
    detail: bool
    pid_check: bool = True

    @property
    def poll(self) -> float:
        """Seconds between two looks of the watchdog (a fraction of the timeout, at most 1)."""
        t = self.timeout or DEFAULT_TIMEOUT
        return max(0.05, min(1.0, t / 10.0))


def _seconds(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0 or value != value or value == float("inf"):
        raise ValueError(f"{name}={raw!r}: expected a number of seconds >= 0 "
                         f"(or 'off' to disable)")
    return value


def timeout_from(raw) -> float | None:
    """Parse a timeout given as seconds, a timedelta, or 'off' (None = off)."""
    if raw is None:
        return None
    if hasattr(raw, "total_seconds"):
        raw = raw.total_seconds()
    if isinstance(raw, (int, float)):
        if raw < 0:
            raise ValueError(f"timeout={raw!r}: expected seconds >= 0 (0 disables the watchdog)")
        return float(raw) or None
    text = str(raw).strip().lower()
    if text in _OFF:
        return None
    return _seconds("HPCDDP_TIMEOUT", text) or None


def detail_enabled(env=None) -> bool:
    """HPCDDP_DEBUG=detail (also a comma list containing 'detail', e.g. 'trace,detail')."""
    env = os.environ if env is None else env
    words = re.split(r"[,\s]+", env.get("HPCDDP_DEBUG", "").strip().lower())
    return "detail" in words


def read(env=None) -> Settings:
    env = os.environ if env is None else env
    raw = env.get("HPCDDP_TIMEOUT", "").strip()
    timeout = DEFAULT_TIMEOUT if raw == "" else timeout_from(raw)
    policy = env.get("HPCDDP_STALL_POLICY", "abort").strip().lower() or "abort"
    if policy not in POLICIES:
        raise ValueError(f"HPCDDP_STALL_POLICY={policy!r}: expected one of "
                         f"{', '.join(POLICIES)}")
    raw_peer = env.get("HPCDDP_PEER_TIMEOUT", "").strip()
    if raw_peer:
        peer = _seconds("HPCDDP_PEER_TIMEOUT", raw_peer)
    else:
        peer = min(5.0, timeout or DEFAULT_TIMEOUT)
    pid = env.get("HPCDDP_PID_CHECK", "1").strip().lower() or "1"
    if pid not in ("1", "0", "on", "off", "true", "false", "yes", "no"):
        raise ValueError(f"HPCDDP_PID_CHECK={pid!r}: expected 1 or 0")
    return Settings(timeout=timeout, policy=policy, peer_timeout=max(0.2, peer),
                    report_dir=env.get("HPCDDP_REPORT_DIR", "") or os.getcwd(),
                    detail=detail_enabled(env), pid_check=pid not in _OFF)


def job_id(env=None) -> str:
    """A name for this job, the same on every rank: the scheduler's job id where there is one."""
    env = os.environ if env is None else env
    for name in ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "COBALT_JOBID", "JOB_ID",
                 "PMIX_NAMESPACE", "OMPI_MCA_orte_ess_jobid", "PMI_JOBID"):
        value = env.get(name)
        if value:
            if name == "SLURM_JOB_ID" and env.get("SLURM_STEP_ID"):
                value = f"{value}.{env['SLURM_STEP_ID']}"
            return re.sub(r"[^A-Za-z0-9_.-]+", "-", value).strip("-") or "job"
    return ""
