"""`hpcddp run SCRIPT`: __main__ semantics, exit codes, and abort-on-exception under mpirun.

Each case is a child process under a timeout (a hang is a failure, never a stuck test run).
"""
import os
import subprocess
import sys
import textwrap

import pytest

from hpcddp.launch.mpirun import run_mpi

SCRIPT = textwrap.dedent("""\
    import os, sys
    import helper_mod                      # a sibling module: sys.path[0] is the script's dir
    from hpcddp.launch import detect
    info = detect()
    rank = info.rank if info else 0
    what = sys.argv[1]
    if what == "ok":
        print(f"[rank{rank}] name={__name__} argv={sys.argv[1:]} helper={helper_mod.VALUE}",
              flush=True)
    elif what == "exit":
        sys.exit(int(sys.argv[2]))
    elif what == "exit-text":
        sys.exit("bad configuration: no such file")
    elif what == "raise":
        def inner():
            raise ValueError("boom from the user script")
        inner()
    elif what == "raise-on-last":
        # the other ranks wait in a collective that will never complete without the abort
        import hpcddp
        if rank == int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")) - 1:
            raise RuntimeError("only the last rank fails")
        hpcddp.world().mpi.Barrier()
    elif what == "exit-on-last":
        import hpcddp
        if rank == int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")) - 1:
            sys.exit(3)
        hpcddp.world().mpi.Barrier()
""")


@pytest.fixture
def script(tmp_path):
    (tmp_path / "helper_mod.py").write_text("VALUE = 42\n")
    path = tmp_path / "user script.py"   # a space in the name, on purpose
    path.write_text(SCRIPT)
    return str(path)


def hpcddp_run(*argv, cwd=None, timeout=120):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "hpcddp", "run", *argv], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd, env=env)


def test_runs_the_script_as_main_with_its_argv(script):
    res = hpcddp_run(script, "ok", "--flag", "x y")
    assert res.returncode == 0, res.stderr
    assert "[rank0] name=__main__ argv=['ok', '--flag', 'x y'] helper=42" in res.stdout


def test_exit_codes_propagate(script):
    assert hpcddp_run(script, "exit", "7").returncode == 7
    res = hpcddp_run(script, "exit-text")
    assert res.returncode == 1 and "bad configuration: no such file" in res.stderr


def test_exception_prints_the_users_traceback_and_exits_1(script):
    res = hpcddp_run(script, "raise")
    assert res.returncode == 1
    assert "ValueError: boom from the user script" in res.stderr
    assert "[rank0] Traceback (most recent call last):" in res.stderr
    # the traceback starts in the user's file, not in hpcddp run or runpy
    frames = [ln for ln in res.stderr.splitlines() if ln.strip().startswith("[rank0]   File ")]
    assert frames and "user script.py" in frames[0], res.stderr
    assert not any("runpy" in f or "cli/run.py" in f for f in frames), res.stderr


def test_module_mode(tmp_path):
    (tmp_path / "mymod.py").write_text(
        "import sys\nprint('module', __name__, sys.argv[1:])\n")
    res = hpcddp_run("-m", "mymod", "a", "b", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "module __main__ ['a', 'b']" in res.stdout


def test_usage_errors_start_nothing(tmp_path, capsys):
    # checked before MPI starts, so in this process
    from hpcddp.cli import main
    assert main(["run", str(tmp_path / "missing.py")]) == 2
    assert "is not a file" in capsys.readouterr().err
    assert main(["run"]) == 2
    assert "give a SCRIPT" in capsys.readouterr().err


def _hpcddp_run_argv(*argv):
    return [sys.executable, "-m", "hpcddp", "run", *argv]


def test_mpi_exception_on_one_rank_aborts_the_job(script):
    res = run_mpi(2, _hpcddp_run_argv(script, "raise-on-last"), timeout=120,
                  env=dict(os.environ, PYTHONUNBUFFERED="1"))
    out = res.stdout + res.stderr
    assert res.returncode not in (0, -9), f"expected an abort, got {res.returncode}\n{out}"
    assert "[rank1] uncaught exception" in out and "only the last rank fails" in out, out
    assert "Sorry!" not in out, "Open MPI could not find its help files:\n" + out


def test_mpi_nonzero_exit_on_one_rank_aborts_with_its_status(script):
    res = run_mpi(2, _hpcddp_run_argv(script, "exit-on-last"), timeout=120,
                  env=dict(os.environ, PYTHONUNBUFFERED="1"))
    out = res.stdout + res.stderr
    assert res.returncode == 3, f"exit {res.returncode}\n{out}"
    assert "[rank1] hpcddp run:" in out and "exited with status 3" in out
