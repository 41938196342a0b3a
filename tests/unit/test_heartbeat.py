"""The heartbeat pump (hpcddp.comm.heartbeat): it turns MPI's progress engine from a thread of
its own while the script holds the GIL (the C pump) or not (both), and ends before
MPI_Finalize. Each case runs in a process of its own (MPI starts as a singleton there). Its
use, a rank holding the GIL past ULFM's detector timeout across two Slurm nodes:
tests/test_elastic_slurm.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import ctypes, json, sys, time
    from hpcddp.comm._mpi import MPI
    from hpcddp.comm import heartbeat
    if sys.argv[1] == "python":
        heartbeat._load_c = lambda MPI: (None, "the test asks for the Python pump")
    kind = heartbeat.start(MPI)
    assert heartbeat.start(MPI) == kind          # once per process
    time.sleep(0.35)                             # the GIL free: either pump runs
    free = heartbeat.rounds()
    before = heartbeat.rounds()
    ctypes.PyDLL(None).usleep(600000)            # 0.6 s holding the GIL, no MPI call
    held = heartbeat.rounds() - before
    stopped = heartbeat.stop()
    print(json.dumps({"kind": kind, "free": free, "held": held, "stopped": stopped,
                      "again": heartbeat.stop(), "running": heartbeat.running()}))
    MPI.Finalize()
""")


def run(which: str) -> dict:
    res = subprocess.run([sys.executable, "-c", SCRIPT, which], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, (res.stdout, res.stderr)
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_the_c_pump_turns_mpi_progress_while_the_script_holds_the_gil():
    pytest.importorskip("hpcddp.comm._heartbeat", reason="the C module was not built (no mpicc)")
    r = run("c")
    assert r["kind"] == "C thread"
    assert r["free"] >= 2, r                     # every 0.1 s
    assert r["held"] >= 3, r                     # 0.6 s with the GIL taken: it went on
    assert (r["stopped"], r["again"], r["running"]) == (True, False, None), r


def test_the_python_pump_runs_where_the_c_module_cannot_but_stops_while_the_gil_is_held():
    r = run("python")
    assert r["kind"] == "Python thread"
    assert r["free"] >= 2, r
    assert r["held"] <= 1, r                     # what the C pump is there for
    assert (r["stopped"], r["again"], r["running"]) == (True, False, None), r


FORKED = textwrap.dedent("""
    import json, os, time
    from hpcddp.comm._mpi import MPI
    from hpcddp.comm import heartbeat
    heartbeat.start(MPI)
    pid = os.fork()
    if pid == 0:             # as the child's exit handlers would: a no-op there
        os._exit(0 if heartbeat.stop() is False else 3)
    _, status = os.waitpid(pid, 0)
    before = heartbeat.rounds()
    time.sleep(0.35)
    print(json.dumps([os.waitstatus_to_exitcode(status), heartbeat.running(),
                      heartbeat.rounds() > before]))
    heartbeat.stop()
    MPI.Finalize()
""")


def test_a_forked_child_leaves_its_parents_pump_alone():
    res = subprocess.run([sys.executable, "-c", FORKED], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, (res.stdout, res.stderr)
    code, kind, beating = json.loads(res.stdout.strip().splitlines()[-1])
    assert (code, beating) == (0, True) and kind in ("C thread", "Python thread"), res.stdout


FINALIZED_BY_THE_SCRIPT = textwrap.dedent("""
    import time
    from hpcddp.comm._mpi import MPI
    from hpcddp.comm import heartbeat
    heartbeat.start(MPI)
    time.sleep(0.25)
    MPI.Finalize()           # as an mpi4py script ends, no hpcddp.finalize
    time.sleep(0.35)         # a pump still probing would now call MPI after MPI_Finalize
    print("ended", heartbeat.running())
""")


def test_the_pump_ends_when_the_script_finalizes_mpi_itself():
    res = subprocess.run([sys.executable, "-c", FINALIZED_BY_THE_SCRIPT], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0 and "ended None" in res.stdout, (res.stdout, res.stderr)
    assert "after MPI_FINALIZE" not in res.stdout + res.stderr, res.stderr


MPI_FIRST = textwrap.dedent("""
    from mpi4py import MPI          # the script starts MPI itself, before hpcddp
    import hpcddp.comm._mpi
    from hpcddp.comm import heartbeat
    print("PUMP", heartbeat.running(), flush=True)
""")


@pytest.mark.parametrize("detector,want", [("true", "C thread"), (None, "None")])
def test_a_script_that_starts_mpi_first_gets_the_pump_where_the_detector_needs_it(detector, want):
    """hpcddp sets ULFM's detector only where it starts MPI itself; a script that imports
    mpi4py first and sets the detector on (without its thread) gets the pump from hpcddp's
    import, and one that leaves the detector off gets none."""
    pytest.importorskip("hpcddp.comm._heartbeat", reason="the C module was not built (no mpicc)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMPI_MCA_mpi_ft_")}
    env["OMPI_MCA_mpi_ft_enable"] = "1"
    if detector:
        env.update(OMPI_MCA_mpi_ft_detector=detector, OMPI_MCA_mpi_ft_detector_thread="false")
    res = subprocess.run([sys.executable, "-c", MPI_FIRST], capture_output=True, text=True,
                         timeout=60, env=env)
    assert res.returncode == 0, (res.stdout, res.stderr)
    assert f"PUMP {want}" in res.stdout, (res.stdout, res.stderr)
