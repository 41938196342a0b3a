"""The watchdog's settings, derived from hpcddp.settings (HPCDDP_TIMEOUT, HPCDDP_STALL_POLICY,
HPCDDP_PEER_TIMEOUT, HPCDDP_REPORT_DIR, HPCDDP_DEBUG, HPCDDP_PID_CHECK, HPCDDP_AUDIT: docs/settings.md,
docs/hangs.md) and from hpcddp.init's / torch's timeout=.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from hpcddp import settings as _settings

DEFAULT_TIMEOUT = _settings.DEFAULT_TIMEOUT
STALL_EXIT_CODE = 3          # the job's exit code when the watchdog aborts it


@dataclass(frozen=True)
class Settings:
    timeout: float | None        # None: watchdog off
    policy: str
    peer_timeout: float
    report_dir: str
    detail: bool
    pid_check: bool = True
    audit: bool = True

    @property
    def poll(self) -> float:
        """Seconds between two looks of the watchdog (a fraction of the timeout, at most 1)."""
        t = self.timeout or DEFAULT_TIMEOUT
        return max(0.05, min(1.0, t / 10.0))


timeout_from = _settings.timeout_from


def detail_enabled(env=None) -> bool:
    """HPCDDP_DEBUG=detail (also a list containing 'detail', e.g. 'trace,detail')."""
    return "detail" in _settings_of(env).debug


def peer_timeout_for(timeout: float | None, env=None) -> float:
    """HPCDDP_PEER_TIMEOUT, or (unset) min(5, TIMEOUT): a rank that has not answered the
    exchange by then is named unresponsive."""
    peer = _settings_of(env).peer_timeout
    if peer is None:
        peer = min(5.0, timeout or DEFAULT_TIMEOUT)
    return max(0.2, peer)


def read(env=None) -> Settings:
    s = _settings_of(env)
    return Settings(timeout=s.timeout, policy=s.stall_policy,
                    peer_timeout=peer_timeout_for(s.timeout, env),
                    report_dir=s.report_dir or os.getcwd(), detail="detail" in s.debug,
                    pid_check=s.pid_check, audit=s.audit)


def _settings_of(env):
    return _settings.get() if env is None else _settings.read(env)


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
