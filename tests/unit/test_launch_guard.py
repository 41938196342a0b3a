"""`hpcddp launch` (hpcddp.launch.mpirun.run_job): a launcher that would outlive its job, or say
it succeeded when it lost a node, is ended and its status told truly. The launchers here are
small shell scripts printing what Open MPI's mpirun prints; the real thing, on a virtual cluster
with a node cut off, is tests/test_vcluster_faults.py."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

HPCDDP = [sys.executable, "-m", "hpcddp"]


def launch(script: str, *opts: str, timeout: float = 60) -> tuple:
    start = time.monotonic()
    res = subprocess.run([*HPCDDP, "launch", *opts, "--", "bash", "-c", script],
                         capture_output=True, text=True, timeout=timeout)
    return res, time.monotonic() - start


def test_status_and_output_pass_through():
    res, _ = launch("echo out; echo err >&2; exit 7")
    assert res.returncode == 7
    assert res.stdout == "out\n" and res.stderr == "err\n"


def test_launcher_left_running_after_an_abort_is_ended(tmp_path):
    pidfile = tmp_path / "child"
    script = (f"sleep 300 & echo $! > {pidfile}; "
              "echo 'MPI_ABORT was invoked on rank 0 in communicator MPI_COMM_WORLD' >&2; "
              "echo '  Errorcode: 3' >&2; wait")
    res, took = launch(script, "--abort-grace", "1")
    assert res.returncode == 3, res.stderr
    assert took < 20
    assert "still running 1 s after a rank aborted the job" in res.stderr
    child = int(pidfile.read_text())
    time.sleep(0.2)
    assert not os.path.exists(f"/proc/{child}") or "Z" in open(f"/proc/{child}/stat").read().split()[2], \
        "what the launcher started was left running"


def test_lost_node_with_exit_0_is_a_failure():
    script = ("echo 'PRTE has lost communication with a remote daemon.' >&2; echo >&2; "
              "echo '  HNP daemon   : [prterun-node1-1@0,0] on node node1' >&2; "
              "echo '  Remote daemon: [prterun-node1-1@0,2] on node node3' >&2; exit 0")
    res, _ = launch(script)
    assert res.returncode == 1
    assert "the launcher lost node node3" in res.stderr


def test_timeout_ends_the_job():
    res, took = launch("sleep 300", "--timeout", "1")
    assert res.returncode == 124 and took < 20
    assert "killed the job after 1 s" in res.stderr


def test_usr1_reaches_the_launcher():
    proc = subprocess.Popen([*HPCDDP, "launch", "--", "bash", "-c",
                             "trap 'echo got-usr1; exit 5' USR1; echo ready; "
                             "while :; do sleep 0.1; done"],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=20)
    assert "got-usr1" in out and proc.returncode == 5


def test_bad_input_is_refused_before_anything_runs():
    res = subprocess.run([*HPCDDP, "launch"], capture_output=True, text=True)
    assert res.returncode == 2 and "give the launcher command after --" in res.stderr
    res = subprocess.run([*HPCDDP, "launch", "--timeout", "-1", "--", "true"],
                         capture_output=True, text=True)
    assert res.returncode == 2 and "--timeout must be a positive number of seconds, got -1" in res.stderr
    res = subprocess.run([*HPCDDP, "launch", "--", "no-such-launcher-xyz"],
                         capture_output=True, text=True)
    assert res.returncode == 127 and "'no-such-launcher-xyz' not found" in res.stderr


def test_a_reader_that_goes_away_does_not_hang_the_job():
    """`hpcddp launch ... | head`: the copying stops, the launcher's output is still drained."""
    proc = subprocess.Popen([*HPCDDP, "launch", "--", "bash", "-c", "seq 300000; exit 4"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout.readline() == b"1\n"
    proc.stdout.close()
    assert proc.wait(timeout=30) == 4


def test_launcher_waiting_after_every_survivor_left_is_ended():
    """An elastic job that lost a node: every survivor printed its leaving line, the launcher
    still waits for the node's daemon: ended after SURVIVORS_GRACE, with the survivors' status."""
    script = ("echo '[rank0] elastic: rank 0 of 2 leaves the job, exit 0'; "
              "echo '[rank1] elastic: rank 1 of 2 leaves the job, exit 0'; sleep 300")
    res, took = launch(script, timeout=90)
    assert res.returncode == 0, res.stderr
    assert took < 40
    assert "every survivor of the elastic job left (2 ranks, exit 0)" in res.stderr


def test_survivors_status_and_a_missing_survivor():
    # one survivor failed: its status is the job's
    res, took = launch("echo 'elastic: rank 1 of 2 leaves the job, exit 1'; "
                       "echo 'elastic: rank 0 of 2 leaves the job, exit 0'; sleep 300",
                       "--abort-grace", "1", timeout=90)
    assert res.returncode == 1, res.stderr
    assert "still running 1 s after every survivor of the elastic job left" in res.stderr
    assert took < 20
    # one survivor has not left: the launcher is left to end by itself, past the grace
    res, _ = launch("echo 'elastic: rank 0 of 2 leaves the job, exit 0'; sleep 4; exit 5",
                    "--abort-grace", "1", timeout=90)
    assert res.returncode == 5 and "every survivor" not in res.stderr


def test_grown_back_job_gets_the_status_of_its_ranks():
    """Open MPI's mpirun runs a replacement rank as a job of its own, without fault tolerance:
    it exits 213 after a spawn that found no slot, 137 after a replacement was lost. Where
    every rank of the elastic job left with 0, that is the job's status, said in a line."""
    for code, line in ((137, "elastic: replacement for rank 1 started on vm and joined"),
                       (213, "elastic: no free slot for a replacement for rank 1")):
        res, _ = launch(f"echo '[rank1] {line}'; echo 'elastic: rank 0 of 2 leaves the job, "
                        f"exit 0'; echo 'elastic: rank 1 of 2 leaves the job, exit 0'; "
                        f"exit {code}", timeout=90)
        assert res.returncode == 0, (code, res.stderr)
        assert f"the launcher exited {code} for a replacement rank" in res.stderr
    # no replacement in the job: mpirun's status stands
    res, _ = launch("echo 'elastic: rank 0 of 1 leaves the job, exit 0'; exit 137", timeout=90)
    assert res.returncode == 137, res.stderr


def test_ulfm_launches_get_no_keepalives():
    """PRRTE 3.0 ends the whole job when a keepalive finds a daemon lost, recovery or not: under
    --with-ft ulfm hpcddp switches them off (ULFM's detector finds the node instead)."""
    from hpcddp.launch.mpirun import launcher_env
    env = {"PATH": "/bin"}
    assert launcher_env(env, ["mpirun", "-n", "2", "x"])["PRTE_MCA_oob_tcp_keepalive_time"] == "30"
    for cmd in (["mpirun", "--with-ft", "ulfm", "x"], ["mpirun", "--with-ft=ulfm", "x"]):
        assert launcher_env(env, cmd)["PRTE_MCA_oob_tcp_keepalive_time"] == "0"
    assert launcher_env({**env, "OMPI_MCA_mpi_ft_enable": "1"}, ["mpirun", "x"])[
        "PRTE_MCA_oob_tcp_keepalive_time"] == "0"
    assert launcher_env(env, ["mpirun", "--with-ft", "none", "x"])[
        "PRTE_MCA_oob_tcp_keepalive_time"] == "30"
    user = {**env, "PRTE_MCA_oob_tcp_keepalive_time": "120"}
    assert launcher_env(user, ["mpirun", "--with-ft", "ulfm"])["PRTE_MCA_oob_tcp_keepalive_time"] == "120"


def test_ulfm_job_in_which_no_rank_said_it_ended_has_failed():
    """Under --with-ft ulfm Open MPI's mpirun exits 0 even where every process was killed or
    crashed; hpcddp's ranks say as they end that they did: a job with no such line fails."""
    ulfm = {**os.environ, "OMPI_MCA_mpi_ft_enable": "1"}

    def run(script):
        return subprocess.run([*HPCDDP, "launch", "--", "bash", "-c", script], env=ulfm,
                              capture_output=True, text=True, timeout=60)
    res = run("echo '[vm:1] *** Process received signal ***' >&2; exit 0")
    assert res.returncode == 1, res.stderr
    assert "no rank of the job said it ended" in res.stderr
    # one rank left (the others were killed: an elastic job's survivor), or one saw its peer
    # lost outside elastic mode: the launcher's 0 stands
    for line in ("[rank1] elastic: rank 1 of 2 leaves the job, exit 0",
                 "[rank0] hpcddp: rank 1 of the job lost: this rank exits (exit 0) without "
                 "MPI_Finalize, which would wait for it"):
        res = run(f"echo '{line}' >&2; exit 0")
        assert res.returncode == 0 and "no rank" not in res.stderr, res.stderr
    # without ULFM a killed rank makes mpirun's status non-zero itself: nothing is looked for
    res, _ = launch("exit 0")
    assert res.returncode == 0, res.stderr
