"""scripts/journey.py (the functions and files a torch all_reduce enters, #31's count) runs
under mpirun and reports what it counts: the first small call enters at most 5 files, none
twice, and a repeated small call (the plan hit, from the third) far fewer of hpcddp's
functions than the first; a 4 MiB call asks no path its group's rows left out, and one the
arena takes enters at most 5 files too."""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _journey(**env):
    """(what -> (stops, files, returns), what -> the path it ran on, the output) of
    scripts/journey.py under mpirun -n 2, with ENV set on both ranks."""
    mpirun = os.path.join(sys.prefix, "bin", "mpirun")
    pass_env = [a for k in env for a in ("-x", k)]
    res = subprocess.run([mpirun, "--allow-run-as-root", "--oversubscribe", "-n", "2",
                          *pass_env, sys.executable, str(ROOT / "scripts" / "journey.py"), "-v"],
                         capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, **env))
    assert res.returncode == 0, res.stdout + res.stderr
    got = {m[0]: (int(m[1]), int(m[2]), int(m[3])) for m in re.findall(
        r"^(.+?): (\d+) stops, (\d+) files, (\d+) returns", res.stdout, re.M)}
    ran = dict(re.findall(r"^(.+?): .* ran on (.+)$", res.stdout, re.M))
    return got, ran, res


def test_journey_counts_the_first_call_and_the_plan_hit():
    got, ran, res = _journey()
    assert set(got) == {f"{s} all_reduce, {t}" for s in ("8 B", "4 MiB")
                        for t in ("first", "second", "third")}, res.stdout
    # 8 B always plans, on the second call (4 MiB may take the arena, whose calls are not
    # planned: no claim); the first call's journey is #31's: at most 5 files, none entered twice
    first, third = got["8 B all_reduce, first"], got["8 B all_reduce, third"]
    assert first[0] > 2 * third[0] and first[1] >= third[1] >= 1, (first, third)
    assert first[1] <= 5 and first[2] == 0, first
    assert all(stops >= 1 and files >= 1 for stops, files, _ in got.values()), got
    # 4 MiB: the arena or MPI, as the start-up race found on this machine; two ranks on one
    # node: the world's rows leave out the hierarchical path and the ring (never asked), and
    # a first call MPI takes enters five files, none twice, as the small one does
    what = "4 MiB all_reduce, first"
    assert ran[what] in ("collectives/paths/arena.py", "collectives/paths/mpi.py"), ran
    if ran[what].endswith("mpi.py"):
        assert got[what][1] <= 5 and got[what][2] == 0, (what, got[what])
    assert "paths/hier.py" not in res.stdout and "paths/ring.py" not in res.stdout


def test_an_arena_call_enters_five_files_none_twice():
    """A 4 MiB all_reduce the shared-memory arena takes (forced: no race) enters at most five
    files, none twice: the path's object and its mechanism are one module, its applies()
    reads the group's arena from the group's rows, and the arena keeps its calls' hashes."""
    got, ran, res = _journey(HPCDDP_SHM_ALLREDUCE="force")
    for turn in ("first", "second", "third"):
        what = f"4 MiB all_reduce, {turn}"
        assert ran[what] == "collectives/paths/arena.py", (what, res.stdout)
        assert got[what][1] <= 5 and got[what][2] == 0, (what, got[what], res.stdout)
