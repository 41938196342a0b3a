"""hpcddp.launch.torchrun_env: torchrun's variables from each MPI launcher's (pure: env dicts).

And the interpreter-start hook (hpcddp-start.pth -> _hpcddp_start) in a child
Python under a launcher's variables written by hand: it sets them without importing hpcddp,
torch or mpi4py.
"""
import os
import subprocess
import sys

import pytest

from hpcddp.launch import torchrun_env as T

OMPI = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "PMIX_RANK": "2"}
SLURM = {"SLURM_JOB_ID": "7", "SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "3",
         "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_STEP_NUM_NODES": "2",
         "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "PMIX_RANK": "3"}
HYDRA = {"PMI_RANK": "1", "PMI_SIZE": "3", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "3"}


def exported(env):
    env = dict(env)
    T.export(env)
    return {k: env[k] for k in T.NAMES if k in env}


def test_open_mpi():
    assert exported(OMPI) == {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0",
                              "LOCAL_WORLD_SIZE": "2"}


def test_slurm_srun_gives_the_node_too():
    assert exported(SLURM) == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                               "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
                               "GROUP_WORLD_SIZE": "2"}


def test_mpich_hydra():
    assert exported(HYDRA) == {"RANK": "1", "WORLD_SIZE": "3", "LOCAL_RANK": "1",
                               "LOCAL_WORLD_SIZE": "3"}


def test_mpirun_inside_a_slurm_job_takes_mpiruns_numbers():
    # srun started mpirun's daemons: SLURM_* describe them, not the ranks
    env = dict(OMPI, SLURM_JOB_ID="7", SLURM_STEP_NUM_TASKS="1", SLURM_PROCID="0",
               SLURM_LOCALID="0", SLURM_NODEID="0", SLURM_STEP_NUM_NODES="1")
    assert exported(env)["RANK"] == "2" and exported(env)["WORLD_SIZE"] == "4"


def test_pmix_alone_has_no_size_so_no_rank_until_mpi_knows():
    env = {"PMIX_RANK": "1"}
    assert exported(env) == {}
    from hpcddp.launch import detect   # after start-up, MPI's world fills the pair
    launch = detect(env)
    env2 = dict(env)
    T.export_after_start(launch, 1, 2, 1, 2, 0, 1, env=env2)
    assert {k: env2[k] for k in T.NAMES} == {
        "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1"}


def test_after_start_fills_open_mpis_node_index():
    env = dict(OMPI)
    T.export(env)
    from hpcddp.launch import detect
    T.export_after_start(detect(env), 2, 4, 0, 2, 1, 2, env=env)
    assert (env["GROUP_RANK"], env["GROUP_WORLD_SIZE"], env["RANK"]) == ("1", "2", "2")
    assert env[T.MARKER].startswith("RANK,WORLD_SIZE,LOCAL_RANK,LOCAL_WORLD_SIZE,GROUP_RANK")


def test_user_values_are_never_changed():
    env = dict(OMPI, LOCAL_RANK="5")      # a wrapper picked the GPU itself
    T.export(env)
    assert env["LOCAL_RANK"] == "5" and env["RANK"] == "2"
    assert "LOCAL_RANK," not in env[T.MARKER]


def test_rank_and_world_size_are_a_pair():
    # a stray WORLD_SIZE the user exported stays alone, so hpcddp.init still warns about it
    out = exported(dict(OMPI, WORLD_SIZE="4"))
    assert "RANK" not in out and out["WORLD_SIZE"] == "4" and out["LOCAL_RANK"] == "0"


def test_contradicting_user_values_set_nothing_and_init_reports_them():
    env = dict(OMPI, RANK="0")            # exported before mpirun: every rank would be 0
    assert T.export(env) == {} and T.MARKER not in env


def test_values_inherited_from_another_jobs_rank_are_replaced():
    parent = dict(SLURM)                  # a rank of an srun step...
    T.export(parent)
    child = {k: v for k, v in parent.items() if not k.startswith("SLURM_") and k != "PMIX_RANK"}
    child.update(OMPI)                    # ...runs mpirun: its ranks inherit RANK=3 etc.
    T.export(child)
    assert {k: child.get(k) for k in T.NAMES} == {
        "RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": None, "GROUP_WORLD_SIZE": None}
    assert child[T.MARKER].endswith("@openmpi:2/4")


def test_a_child_of_the_same_rank_changes_nothing():
    env = dict(OMPI)
    T.export(env)
    assert T.export(env) == {}


@pytest.mark.parametrize("env", [
    {},                                                               # singleton
    {"RANK": "0", "WORLD_SIZE": "1"},                                 # torch env:// alone
    dict(SLURM, TORCHELASTIC_RUN_ID="x", RANK="0", WORLD_SIZE="2", LOCAL_RANK="0",
         LOCAL_WORLD_SIZE="2"),                                       # torchrun under srun
    dict(OMPI, HPCDDP_TORCH_VARS="0"),                                # switched off
    {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "4"},  # a batch script's shell
])
def test_nothing_set(env):
    before = dict(env)
    T.export(env)
    assert env == before


def test_interpreter_start_sets_them_without_importing_hpcddp_torch_or_mpi():
    env = {k: v for k, v in os.environ.items() if k not in T.NAMES and k != T.MARKER
           and not k.startswith(("OMPI_", "PMIX_", "PMI_", "SLURM_", "TORCHELASTIC_"))}
    env.update(OMPI)
    code = ("import os, sys; print(os.environ.get('RANK'), os.environ.get('LOCAL_WORLD_SIZE'), "
            "sorted(m for m in ('hpcddp', 'torch', 'mpi4py') if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60, cwd="/")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split("\n")[0] == "2 2 []", res.stdout + res.stderr
    assert res.stderr == ""
