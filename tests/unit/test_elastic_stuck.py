"""A recovery step that cannot return (an MPI call waiting on a process that MPI reported lost
to some ranks only) ends the rank after its limit with a line that says where it stuck: for
the regroup with spare processes, the step of the regroup it was in (hpcddp.comm.spares.step)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")

SCRIPT = textwrap.dedent("""
    import time
    from hpcddp.comm import spares
    from hpcddp.elastic import _state
    spares.step = "in MPI_Comm_shrink of the 4 processes of the pool"
    with _state._stuck_after(0.3, lambda: f"the regroup with the spare processes ({spares.step})"):
        time.sleep(30)
    print("returned")
""")


def test_a_stuck_regroup_ends_the_rank_naming_its_step():
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=60)
    from hpcddp.elastic._state import RECOVERY_STUCK_LINE, STUCK_EXIT
    assert res.returncode == STUCK_EXIT, (res.returncode, res.stdout, res.stderr)
    assert "returned" not in res.stdout
    assert (f"{RECOVERY_STUCK_LINE}: the regroup with the spare processes (in MPI_Comm_shrink "
            f"of the 4 processes of the pool) did not return within 0 s") in res.stdout + \
        res.stderr, (res.stdout, res.stderr)
