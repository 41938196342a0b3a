"""Fault injection for tests and the demo: a rank SIGKILLs itself at a chosen step and phase.

``HPCDDP_ELASTIC_KILL="R@S:PHASE[,R@S:PHASE...]"``: world rank R (the rank it had at start)
kills itself in global step S (counted from 0 over the whole run) during PHASE, one of

- ``data``: while this rank loads the step's batch (before the loader hands it over);
- ``forward``: in the model's forward;
- ``backward``: inside DDP's first gradient-bucket all-reduce (started, not finished);
- ``optimizer``: in ``optimizer.step()``, after the gradients were reduced.

Before dying it appends its wall-clock time to ``kill_log_path()``, so the survivors can
report the time from the kill to their first completed step.
"""
from __future__ import annotations

import os
import signal
import tempfile
import time

ENV = "HPCDDP_ELASTIC_KILL"
PHASES = ("data", "forward", "backward", "optimizer")


def parse(text: str | None) -> list[tuple[int, int, str]]:
    """[(rank, step, phase)] from the variable's value; ValueError naming what is wrong."""
    out = []
    for item in (text or "").replace(" ", "").split(","):
        if not item:
            continue
        try:
            who, rest = item.split("@")
            step, _, phase = rest.partition(":")
            rank, step = int(who), int(step)
            phase = phase or "backward"
        except ValueError:
            raise ValueError(f"{ENV}: {item!r} is not RANK@STEP[:PHASE] (e.g. 1@30:backward)") \
                from None
        if phase not in PHASES or rank < 0 or step < 0:
            raise ValueError(f"{ENV}: {item!r}: expected RANK >= 0, STEP >= 0 and PHASE one of "
                             f"{list(PHASES)}")
        out.append((rank, step, phase))
    return out


ENV_LOG = "HPCDDP_ELASTIC_KILL_LOG"    # set in replacement ranks: their job id is their own


def kill_log_path() -> str:
    if os.environ.get(ENV_LOG):
        return os.environ[ENV_LOG]
    job = (os.environ.get("PMIX_NAMESPACE") or os.environ.get("SLURM_JOB_ID") or "job")
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in job)
    return os.path.join(tempfile.gettempdir(), f"hpcddp-elastic-kills-{safe}.log")


def kill_times() -> dict[int, float]:
    """{world rank: wall time of its injected kill} written so far in this job."""
    out = {}
    try:
        with open(kill_log_path()) as f:
            for line in f:
                r, t = line.split()
                out[int(r)] = float(t)
    except (OSError, ValueError):
        pass
    return out


def die(rank: int, step: int, phase: str) -> None:
    from hpcddp.comm import output as _log
    try:
        with open(kill_log_path(), "a") as f:
            f.write(f"{rank} {time.time():.6f}\n")
    except OSError:
        pass
    _log.log(f"elastic: fault injection: SIGKILL in step {step} during {phase} ({ENV})")
    os.kill(os.getpid(), signal.SIGKILL)
