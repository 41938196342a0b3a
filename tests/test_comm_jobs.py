"""Start-up and topology checked through whole jobs (each under a timeout)."""
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from hpcddp.launch.mpirun import run_mpi

TESTS = pathlib.Path(__file__).parent
SCRIPTS = TESTS / "scripts"


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("HPCDDP_RANKS_PER_NODE", None)
    env.update(extra)
    return env


def _hpcddp():
    return [shutil.which("hpcddp") or "hpcddp"]


def test_info_json_reports_emulated_nodes():
    res = run_mpi(4, _hpcddp() + ["info", "--json"], timeout=120,
                  env=_env(HPCDDP_RANKS_PER_NODE="2"))
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    assert info["world_size"] == 4 and info["nodes"] == 2
    assert info["launcher"] == "openmpi"
    assert info["mpi"]["thread_level"] == "multiple"
    assert info["mpi"]["library"] == "Open MPI"
    assert [r["local_rank"] for r in info["ranks"]] == [0, 1, 0, 1]
    assert [r["node"] for r in info["ranks"]] == [0, 0, 1, 1]
    assert "cuda_aware" in info


def test_info_text_names_layout():
    res = run_mpi(2, _hpcddp() + ["info"], timeout=120, env=_env())
    assert res.returncode == 0, res.stderr
    assert "2 ranks on 1 node(s)" in res.stdout and "Open MPI" in res.stdout


def test_six_ranks_on_two_nodes_of_three():
    res = run_mpi(6, [sys.executable, str(SCRIPTS / "topology_probe.py")], timeout=180,
                  env=_env(HPCDDP_RANKS_PER_NODE="3"))
    assert res.returncode == 0, res.stderr
    rows = sorted((json.loads(l) for l in res.stdout.splitlines() if l.startswith("{")),
                  key=lambda r: r["rank"])
    assert [r["node"] for r in rows] == [0, 0, 0, 1, 1, 1]
    assert [r["local_rank"] for r in rows] == [0, 1, 2, 0, 1, 2]
    assert [r["cross"] for r in rows] == [[0, 3], [1, 4], [2, 5]] * 2
    assert rows[0]["leaders"] == [0, 3] and rows[1]["leaders"] is None
    # node groups of 2 nodes: both nodes in group 0
    assert {(r["group_rank"], r["group_size"], r["group_ws"], r["group_nodes"]) for r in rows} == {(0, 6, 1, 2)}
    assert [r["local_group_rank"] for r in rows] == list(range(6))


def test_node_groups_with_uneven_last_group():
    # 3 emulated nodes of 1 rank, groups of 2 nodes: group 0 = nodes 0,1; group 1 = node 2
    res = run_mpi(3, [sys.executable, str(SCRIPTS / "topology_probe.py")], timeout=120,
                  env=_env(HPCDDP_RANKS_PER_NODE="1"))
    assert res.returncode == 0, res.stderr
    rows = sorted((json.loads(l) for l in res.stdout.splitlines() if l.startswith("{")),
                  key=lambda r: r["rank"])
    assert [(r["group_rank"], r["group_size"], r["group_nodes"], r["group_rank_base"])
            for r in rows] == [(0, 2, 2, 0), (0, 2, 2, 0), (1, 1, 1, 2)]
    assert [r["group_ws"] for r in rows] == [2, 2, 2]


def test_bad_emulation_setting_is_a_clear_error():
    res = run_mpi(2, _hpcddp() + ["info"], timeout=120, env=_env(HPCDDP_RANKS_PER_NODE="zero"))
    assert res.returncode != 0
    assert "HPCDDP_RANKS_PER_NODE='zero': expected a positive integer" in res.stderr


def test_init_after_mpi4py_started_mpi():
    res = run_mpi(2, [sys.executable, str(SCRIPTS / "mpi4py_first.py")], timeout=120, env=_env())
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.split("\n")[:2]) == ["ok 0 multiple", "ok 1 multiple"]


def test_import_hpcddp_does_not_start_mpi():
    code = ("import sys, hpcddp; assert 'mpi4py.MPI' not in sys.modules; "
            "from mpi4py import MPI; print(MPI.Is_initialized())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=_env())
    assert out.returncode == 0, out.stderr
    # hpcddp left mpi4py alone: the user's own import initialised MPI as usual
    assert out.stdout.strip() == "True"


def test_failing_rank_ends_the_job_instead_of_hanging():
    argv = [sys.executable, "-m", "pytest", "--with-mpi", "-q", "-p", "no:cacheprovider",
            "-o", "addopts=", "--rootdir", str(TESTS), "--confcutdir", str(TESTS / "mpi"),
            "-c", "/dev/null", "-p", "tests.mpi.conftest", str(SCRIPTS / "failing_mpi_test.py")]
    res = run_mpi(2, argv, timeout=90, env=_env(PYTHONPATH=str(TESTS.parent)),
                  cwd=str(TESTS.parent))
    assert res.returncode not in (0, -9), "the job must fail, and not by our timeout"
    assert "[rank1] FAILED" in res.stderr and "deliberate failure on rank 1" in res.stderr
