"""hpcddp.launch.process: what a forked child of a rank gets, and the launcher watch.

Each case runs in a fresh interpreter (a subprocess): os.register_at_fork hooks cannot be
removed, so they must not be armed in the pytest process itself.
"""
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux prctl/proc")


def _run(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout)


def test_forked_child_gets_python_hooks_back_and_dies_with_its_parent():
    res = _run("""
        import ctypes, os, sys, threading, time
        from hpcddp.launch import process
        from hpcddp.diagnostics import abort
        process.own()
        abort.install_abort_on_exception()
        assert sys.excepthook is not sys.__excepthook__
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            libc = ctypes.CDLL(None)
            sig = ctypes.c_int()
            libc.prctl(2, ctypes.byref(sig), 0, 0, 0)          # PR_GET_PDEATHSIG
            ok = (not process.in_rank_process(), sys.excepthook is sys.__excepthook__,
                  threading.excepthook is threading.__excepthook__, sig.value == 9)
            os.write(w, repr(ok).encode())
            os._exit(0)
        os.waitpid(pid, 0)
        print(os.read(r, 100).decode(), process.in_rank_process())
    """)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["(True,", "True,", "True,", "True)", "True"], res.stdout


def test_child_exception_in_a_thread_is_reported_without_mpi():
    """The hang of issue 29: a thread of a forked child raises; Python reports it and the
    child goes on (no MPI_Abort from an inherited hook)."""
    res = _run("""
        import os, threading
        from hpcddp.launch import process
        from hpcddp.diagnostics import abort
        process.own()
        abort.install_abort_on_exception()
        pid = os.fork()
        if pid == 0:
            t = threading.Thread(target=lambda: 1 / 0)
            t.start(); t.join()
            print("child went on", flush=True)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        print("child exit", os.waitstatus_to_exitcode(status))
    """)
    assert "ZeroDivisionError" in res.stderr and "aborting the job" not in res.stderr, res.stderr
    assert "child went on" in res.stdout and "child exit 0" in res.stdout, res.stdout


RANK_WITH_A_WORKER = """
import os, sys, time
from hpcddp.launch import process
process.own()
pid = os.fork()
if pid == 0:
    time.sleep(60)
    os._exit(0)
print(pid, flush=True)
time.sleep(60)
"""

RANK_WATCHING = """
import os, sys, time
from hpcddp.launch import process
print(process.watch_launcher(say=lambda s: None), flush=True)
time.sleep(60)
"""


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return "gone" if f.read().rsplit(")", 1)[1].split()[0] in "ZX" else "alive"
    except FileNotFoundError:
        return "gone"


def _kill(pid: int) -> None:
    import os
    try:
        os.kill(pid, 9)
    except ProcessLookupError:
        pass


def test_orphaned_child_is_killed_at_once():
    """A worker whose rank is killed dies with it (PR_SET_PDEATHSIG), instead of living on."""
    import time
    rank = subprocess.Popen([sys.executable, "-c", RANK_WITH_A_WORKER], stdout=subprocess.PIPE,
                            text=True)
    child = int(rank.stdout.readline())
    rank.kill()
    rank.wait()
    time.sleep(1.0)
    state = _state(child)
    _kill(child)
    assert state == "gone"


def test_rank_ends_itself_when_its_launcher_is_gone(tmp_path):
    """A stand-in launcher (a shell waiting for its one child, the rank) is killed: the rank
    sees it gone within a second and exits."""
    import shlex
    import time
    script = tmp_path / "rank.py"
    script.write_text(RANK_WATCHING)
    launcher = subprocess.Popen(["bash", "-c", f"{shlex.quote(sys.executable)} {script} & wait"],
                                stdout=subprocess.PIPE, text=True)
    watched = int(launcher.stdout.readline())
    with open(f"/proc/{launcher.pid}/task/{launcher.pid}/children") as f:
        rank = int(f.read().split()[0])
    launcher.kill()
    launcher.wait()
    time.sleep(1.5)
    state = _state(rank)
    _kill(rank)
    assert watched == launcher.pid and state == "gone"
