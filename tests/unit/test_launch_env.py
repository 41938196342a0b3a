"""Launcher environment resolution (hpcddp.launch.detect): every table, precedence, bad envs.

Pure unit tests over env mappings, except the last test, which runs ``detect()`` inside a real
``mpirun -n 2`` job through ``run_mpi`` (under a timeout).
"""
import ast
import json
import os
import pathlib
import sys

import pytest

import hpcddp.launch as launch
from hpcddp.launch import (LaunchEnvError, LaunchInfo, LaunchWorldError, check_world, detect,
                           parse_tasks_per_node)
from hpcddp.launch.env import LAUNCHERS, TABLES

# ----------------------------------------------------------------- one env per launcher

# What Open MPI 5's mpirun set for rank 1 of `mpirun -n 2` on this machine (trimmed).
OPENMPI = {
    "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "OMPI_COMM_WORLD_NODE_RANK": "1",   # a local rank across jobs, NOT the node index
    "OMPI_UNIVERSE_SIZE": "2", "OMPI_VERSION": "5.0.11",
    "PMIX_RANK": "1", "PMIX_NAMESPACE": "prterun-vm-4899@1", "PRTE_LAUNCHED": "1",
}
HYDRA = {"PMI_RANK": "3", "PMI_SIZE": "4", "PMI_FD": "6",
         "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
MVAPICH = {"MV2_COMM_WORLD_RANK": "5", "MV2_COMM_WORLD_SIZE": "8",
           "MV2_COMM_WORLD_LOCAL_RANK": "1", "MV2_COMM_WORLD_LOCAL_SIZE": "4"}
PALS = {"PALS_RANKID": "6", "PALS_LOCAL_RANKID": "2", "PALS_NODEID": "1", "PALS_LOCAL_SIZE": "4",
        "PALS_APID": "5e1d", "PALS_DEPTH": "1",
        "PMI_RANK": "6", "PMI_SIZE": "8", "PMI_LOCAL_RANK": "2", "PMI_LOCAL_SIZE": "4"}
# srun -N 4 -n 7 (tasks 3,2,1,1 per node) inside `sbatch`; this is task 4, the 2nd on node 1.
SLURM_STEP = {
    "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "gpu[001-004],cpu07", "SLURM_JOB_NUM_NODES": "5",
    "SLURM_STEP_ID": "0", "SLURM_STEPID": "0",
    "SLURM_PROCID": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
    "SLURM_STEP_NUM_TASKS": "7", "SLURM_NTASKS": "7", "SLURM_NPROCS": "7",
    "SLURM_STEP_NUM_NODES": "4", "SLURM_NNODES": "4",
    "SLURM_STEP_NODELIST": "gpu[001-003],cpu07", "SLURM_NODELIST": "gpu[001-003],cpu07",
    "SLURM_STEP_TASKS_PER_NODE": "3,2,1(x2)", "SLURM_TASKS_PER_NODE": "3,2,1(x2)",
}
SLURM_HOSTS = ("gpu001", "gpu002", "gpu003", "cpu07")
SLURM_PMIX = dict(SLURM_STEP, PMIX_RANK="4", PMIX_NAMESPACE="slurm.pmix.42.0")
SLURM_PMI2 = dict(SLURM_STEP, PMI_RANK="4", PMI_SIZE="7", PMI_FD="5", PMI_JOBID="42.0")
TORCHRUN = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
            "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "ROLE_RANK": "5", "ROLE_NAME": "default",
            "MASTER_ADDR": "n1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "none",
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0"}
TORCH_ENV = {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
             "MASTER_ADDR": "n1", "MASTER_PORT": "29500"}
PMIX = {"PMIX_RANK": "2", "PMIX_NAMESPACE": "prterun-x@1"}
PMI = {"PMI_RANK": "1", "PMI_SIZE": "3"}
# Captured from Slurm 22.05 here (scripts/slurm-local.sh, 2 nodes), trimmed. The shell of
# `sbatch -N 2 -n 3 job.sh`: the allocation's variables, and task 0 of the batch step.
BATCH_SHELL = {
    "SLURM_JOB_ID": "12", "SLURM_JOBID": "12", "SLURM_JOB_NODELIST": "node[1-2]",
    "SLURM_NODELIST": "node[1-2]", "SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2",
    "SLURM_NTASKS": "3", "SLURM_NPROCS": "3", "SLURM_TASKS_PER_NODE": "2,1", "SLURM_GTIDS": "0",
    "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_CPUS_ON_NODE": "2"}
# `srun --mpi=pmix -n 3` in that job: task 1 (2nd task on node1).
REAL_SRUN_PMIX = {
    **BATCH_SHELL, "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NODEID": "0",
    "SLURM_GTIDS": "0,1", "SLURM_STEP_ID": "0", "SLURM_STEPID": "0", "SLURM_MPI_TYPE": "pmix",
    "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "3",
    "SLURM_STEP_TASKS_PER_NODE": "2,1", "PMIX_RANK": "1", "PMIX_NAMESPACE": "slurm.pmix.12.0"}
# `mpirun -n 3` in `sbatch -N 2 -n 3`: rank 2. PRRTE started its prted daemons with
# `srun --mpi=none -N 2 -n 2`; the rank inherits daemon 0's SLURM_* (SLURM_PROCID=0, 2 tasks).
REAL_MPIRUN_IN_SBATCH = {
    **BATCH_SHELL, "SLURM_NTASKS": "2", "SLURM_NPROCS": "2", "SLURM_TASKS_PER_NODE": "1(x2)",
    "SLURM_STEP_ID": "0", "SLURM_STEPID": "0", "SLURM_STEP_NODELIST": "node[1-2]",
    "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
    "OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "3", "OMPI_COMM_WORLD_NODE_RANK": "1",
    "PMIX_RANK": "2", "PMIX_NAMESPACE": "prterun-vm-15750@1", "PMIX_HOSTNAME": "node1"}

CASES = {
    "openmpi": (OPENMPI, LaunchInfo("openmpi", 1, 2, 1, 2, None, None, None), "pmix"),
    "hydra": (HYDRA, LaunchInfo("hydra", 3, 4, 1, 2), "pmi"),
    "mvapich": (MVAPICH, LaunchInfo("mvapich", 5, 8, 1, 4), "pmi"),
    "pals": (PALS, LaunchInfo("pals", 6, 8, 2, 4, 1), "pmi"),
    "slurm": (SLURM_STEP, LaunchInfo("slurm", 4, 7, 1, 2, 1, 4, SLURM_HOSTS), None),
    "slurm-pmix": (SLURM_PMIX, LaunchInfo("slurm", 4, 7, 1, 2, 1, 4, SLURM_HOSTS), "pmix"),
    "slurm-pmi2": (SLURM_PMI2, LaunchInfo("slurm", 4, 7, 1, 2, 1, 4, SLURM_HOSTS), "pmi"),
    "torchrun": (TORCHRUN, LaunchInfo("torchrun", 5, 8, 1, 4, 1, 2), None),
    "torch-env": (TORCH_ENV, LaunchInfo("torch-env", 2, 4, 0, 2), None),
    "pmix": (PMIX, LaunchInfo("pmix", 2, None), "pmix"),
    "pmi": (PMI, LaunchInfo("pmi", 1, 3), "pmi"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_launcher(name):
    env, expected, pmi = CASES[name]
    info = detect(env)
    assert info == expected
    assert info.pmi == pmi
    assert info.outer == ()
    # provenance: every variable reported was in the env, with its value
    assert info.variables and all(env[k] == v for k, v in info.variables)


def test_every_table_has_a_case():
    assert {info.launcher for _, info, _ in CASES.values()} == set(LAUNCHERS)
    assert set(launch.LAUNCHERS) == {t.name for t in TABLES}


def test_open_mpi_node_rank_is_not_the_node_index():
    # OMPI_COMM_WORLD_NODE_RANK=1 on a one-node job: it must not become node_rank.
    assert detect(OPENMPI).node_rank is None


def test_slurm_host_and_local_size():
    info = detect(SLURM_STEP)
    assert info.host == "gpu002"
    assert info.local_size == 2                      # "3,2,1(x2)"[node 1]
    assert detect(dict(SLURM_STEP, SLURM_NODEID="3", SLURM_LOCALID="0", SLURM_PROCID="6")
                  ).local_size == 1


def test_slurm_minimal_env_without_job_id():
    # written by hand (tests, wrappers): SLURM_PROCID alone marks a task
    assert detect({"SLURM_PROCID": "1", "SLURM_NTASKS": "2"}) == LaunchInfo("slurm", 1, 2)


def test_detect_reads_os_environ(monkeypatch):
    for var in list(os.environ):
        monkeypatch.delenv(var)
    assert detect() is None
    for k, v in OPENMPI.items():
        monkeypatch.setenv(k, v)
    assert detect().rank == 1


def test_launch_info_is_frozen_and_compatible():
    info = detect(OPENMPI)
    with pytest.raises(AttributeError):
        info.rank = 3
    # positional construction as before the added fields, which take no part in ==
    assert info == LaunchInfo("openmpi", 1, 2, 1, 2, None, None)
    assert LaunchInfo("slurm", 0, 1).host is None


# ----------------------------------------------------------------- not a launched rank

@pytest.mark.parametrize("env", [
    {},
    {"PATH": "/usr/bin", "HOME": "/root"},
    BATCH_SHELL,                                               # sbatch script's shell
    {k: v for k, v in BATCH_SHELL.items() if k not in ("SLURM_PROCID", "SLURM_LOCALID",
                                                       "SLURM_NODEID")},   # salloc shell
    {"LOCAL_RANK": "0"},                    # exported by wrapper scripts to pick a GPU
    {"RANK": "", "WORLD_SIZE": ""},         # `export RANK=` clears
    {"HPCDDP_LAUNCHER": "none", **OPENMPI},
], ids=["empty", "unrelated", "sbatch-shell", "salloc-shell", "local-rank-only", "cleared",
        "override-none"])
def test_singleton(env):
    assert detect(env) is None


# ----------------------------------------------------------------- precedence

def test_srun_launching_open_mpi_app_is_slurm_with_pmix():
    info = detect(SLURM_PMIX)
    assert (info.launcher, info.rank, info.pmi, info.outer) == ("slurm", 4, "pmix", ())
    info = detect(REAL_SRUN_PMIX)
    assert info == LaunchInfo("slurm", 1, 3, 1, 2, 0, 2, ("node1", "node2"))
    assert (info.pmi, info.host) == ("pmix", "node1")


def test_real_mpirun_in_sbatch():
    info = detect(REAL_MPIRUN_IN_SBATCH)
    assert info == LaunchInfo("openmpi", 2, 3, 1, 3)
    assert (info.pmi, info.outer) == ("pmix", ("slurm",))


def test_mpirun_in_batch_shell_is_open_mpi():
    # the ranks inherit the batch shell's SLURM_* (no srun step): Slurm is not even outer
    info = detect({**BATCH_SHELL, **OPENMPI})
    assert (info.launcher, info.rank, info.size, info.outer) == ("openmpi", 1, 2, ())


def test_mpirun_with_daemons_started_by_srun():
    # PRRTE starts prted with `srun -N 2 -n 2`: the ranks inherit the daemon step's SLURM_*,
    # which describe the daemon (task 0 of 2), not the rank. Open MPI wins, Slurm is outer.
    daemons = {"SLURM_JOB_ID": "42", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
               "SLURM_NODEID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "2",
               "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}
    env = dict(daemons, OMPI_COMM_WORLD_RANK="3", OMPI_COMM_WORLD_SIZE="8",
               OMPI_COMM_WORLD_LOCAL_RANK="3", OMPI_COMM_WORLD_LOCAL_SIZE="4", PMIX_RANK="3")
    info = detect(env)
    assert (info.launcher, info.rank, info.size, info.pmi, info.outer) == \
        ("openmpi", 3, 8, "pmix", ("slurm",))
    hydra = dict(daemons, PMI_RANK="3", PMI_SIZE="8", MPI_LOCALRANKID="3", MPI_LOCALNRANKS="4")
    assert detect(hydra).launcher == "hydra"
    assert detect(hydra).outer == ("slurm",)


def test_other_protocol_under_mpirun_is_outer():
    # srun --mpi=pmi2 started prted: the ranks inherit the daemon's PMI_RANK/PMI_SIZE,
    # which Open MPI never sets; likewise a daemon step's PMIX_RANK under Hydra.
    step = {"SLURM_JOB_ID": "42", "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2"}
    info = detect({**step, **OPENMPI, "PMI_RANK": "0", "PMI_SIZE": "2"})
    assert (info.launcher, info.rank, info.pmi, info.outer) == ("openmpi", 1, "pmix",
                                                                ("slurm", "pmi"))
    info = detect({**step, **HYDRA, "PMIX_RANK": "0"})
    assert (info.launcher, info.rank, info.pmi, info.outer) == ("hydra", 3, "pmi",
                                                                ("slurm", "pmix"))


def test_torchrun_inside_srun_and_mpirun():
    # srun -N 2 --ntasks-per-node=1 torchrun --nproc-per-node=4: SLURM_PROCID is the agent's
    outer = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2",
             "SLURM_JOB_ID": "7", "PMIX_RANK": "1"}
    info = detect({**outer, **TORCHRUN})
    assert (info.launcher, info.rank, info.size, info.pmi) == ("torchrun", 5, 8, None)
    assert info.outer == ("slurm", "pmix")
    info = detect({**OPENMPI, **TORCHRUN})
    assert info.launcher == "torchrun" and info.outer == ("openmpi", "pmix")


def test_torch_env_agreeing_with_mpirun_names_mpirun():
    # mpirun ... sh -c 'RANK=$OMPI_COMM_WORLD_RANK WORLD_SIZE=$OMPI_COMM_WORLD_SIZE python ...'
    info = detect({**OPENMPI, "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"})
    assert (info.launcher, info.outer) == ("openmpi", ())
    assert info.stray == (("RANK", 1), ("WORLD_SIZE", 2), ("LOCAL_RANK", 1))
    assert check_world(info, 1, 2) is None       # complete and agreeing: nothing to say


def test_mvapich_under_hydra_and_pals_with_cray_pmi():
    env = {**MVAPICH, "PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1",
           "MPI_LOCALNRANKS": "4"}
    assert detect(env).launcher == "mvapich"
    assert detect(PALS).launcher == "pals"


def test_pals_without_pmi_size():
    info = detect({"PALS_RANKID": "3", "PALS_LOCAL_RANKID": "0"})
    assert (info.launcher, info.rank, info.size) == ("pals", 3, None)


def test_pmix_alone_has_no_size():
    assert detect({"PMIX_RANK": "0"}).size is None


# ----------------------------------------------------------------- torch's variables beside MPI

# An MPI launcher in charge, its values for (rank, size, local rank), and the variable of each.
MPI_ENVS = {
    "openmpi": (OPENMPI, (1, 2, 1), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                                     "OMPI_COMM_WORLD_LOCAL_RANK")),
    "slurm": (SLURM_PMIX, (4, 7, 1), ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID")),
    "hydra": (HYDRA, (3, 4, 1), ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID")),
    "mvapich": (MVAPICH, (5, 8, 1), ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE",
                                     "MV2_COMM_WORLD_LOCAL_RANK")),
    "pals": (PALS, (6, 8, 2), ("PALS_RANKID", "PMI_SIZE", "PALS_LOCAL_RANKID")),
}


@pytest.mark.parametrize("name", sorted(MPI_ENVS))
@pytest.mark.parametrize("given", [("WORLD_SIZE",), ("RANK",), ("WORLD_SIZE", "LOCAL_RANK")],
                         ids=["size", "rank", "size+local"])
def test_partial_stray_that_agrees_is_accepted_with_a_warning(name, given):
    """PyTorch's test tooling exports WORLD_SIZE alone: beside mpirun/srun it is a stray."""
    env, (rank, size, local), _ = MPI_ENVS[name]
    value = {"RANK": rank, "WORLD_SIZE": size, "LOCAL_RANK": local}
    info = detect({**env, **{n: str(value[n]) for n in given}})
    assert info == detect(env) and info.launcher == name        # the launcher is unchanged
    assert info.stray == tuple((n, value[n]) for n in ("RANK", "WORLD_SIZE", "LOCAL_RANK")
                               if n in given)
    warning = check_world(info, rank, size)
    missing = "RANK" if "RANK" not in given else "WORLD_SIZE"
    names = [n for n, _ in info.stray]
    listing = ", ".join(f"{n}={value[n]}" for n in names)
    assert warning.startswith(f"{listing} {'is' if len(given) == 1 else 'are'} set without "
                              f"{missing} "), warning
    assert "\n" not in warning and f"`unset {' '.join(names)}`" in warning
    title = next(t.title for t in TABLES if t.name == name)
    assert f"agree{'s' if len(given) == 1 else ''} with {title}, which is in charge" in warning


@pytest.mark.parametrize("name", sorted(MPI_ENVS))
@pytest.mark.parametrize("wrong", [("WORLD_SIZE",), ("RANK",), ("RANK", "WORLD_SIZE"),
                                   ("LOCAL_RANK",)],
                         ids=["size", "rank", "both", "local"])
def test_stray_that_contradicts_is_refused(name, wrong):
    """A different size or rank is refused: the variable, its value, the launcher's, the fix."""
    env, (rank, size, local), sources = MPI_ENVS[name]
    right = {"RANK": rank, "WORLD_SIZE": size, "LOCAL_RANK": local}
    source = dict(zip(("RANK", "WORLD_SIZE", "LOCAL_RANK"), sources))
    bad = {n: right[n] + 1 for n in wrong}
    given = dict(bad) if "LOCAL_RANK" not in wrong else {**bad, "WORLD_SIZE": size}
    text = _raises({**env, **{n: str(v) for n, v in given.items()}},
                   *[f"{n}={bad[n]}" for n in wrong],                 # what is set
                   *[f"{source[n]}={right[n]}" for n in wrong],       # what the launcher says
                   *[f"expected {' and '.join(f'{n}={right[n]}' for n in wrong)}, or unset"],
                   f"`unset {' '.join(wrong)}`", f"HPCDDP_LAUNCHER={name}")
    assert text.startswith(f"detect: {' and '.join(f'{n}={bad[n]}' for n in wrong)} "
                           f"contradict"), text


def test_stray_exported_before_mpirun_gives_every_rank_the_same_number():
    text = _raises({**OPENMPI, "RANK": "0", "WORLD_SIZE": "2"}, "RANK=0", "`unset RANK`")
    assert "inherited by every rank" in text and "WORLD_SIZE" not in text.split(";")[0]


def test_torch_variables_without_an_mpi_launcher_are_still_checked():
    # no MPI launcher in charge: torch-env names the launcher and must be complete
    _raises({"WORLD_SIZE": "2"}, "partial", "WORLD_SIZE=2", "RANK is not")
    _raises({"RANK": "0"}, "partial", "RANK=0", "WORLD_SIZE is not")
    assert detect(TORCH_ENV).stray == ()


def test_lone_local_rank_beside_mpirun_is_not_read():
    # wrapper scripts export LOCAL_RANK to pick a GPU: it is not torch-env, as without MPI
    info = detect({**OPENMPI, "LOCAL_RANK": "0"})
    assert info.stray == () and check_world(info, 1, 2) is None


def test_torchruns_variables_are_its_own_not_strays():
    info = detect({**OPENMPI, **TORCHRUN})
    assert info.launcher == "torchrun" and info.stray == ()


def test_torch_variables_beside_a_protocol_alone():
    # complete: they name the launcher (precedence 4 before 5), the protocol must agree
    info = detect({**PMIX, "RANK": "2", "WORLD_SIZE": "4"})
    assert (info.launcher, info.rank, info.size, info.stray) == ("torch-env", 2, 4, ())
    _raises({**PMIX, "RANK": "1", "WORLD_SIZE": "4"}, "disagree", "PMIX_RANK=2", "RANK=1")
    # partial: PMIx is in charge; PMIx has no size, so WORLD_SIZE is compared with MPI's
    info = detect({**PMIX, "WORLD_SIZE": "4"})
    assert (info.launcher, info.rank, info.size, info.stray) == ("pmix", 2, None,
                                                                 (("WORLD_SIZE", 4),))
    assert "WORLD_SIZE=4 is set without RANK" in check_world(info, 2, 4)
    with pytest.raises(LaunchWorldError) as err:
        check_world(info, 2, 3)
    text = str(err.value)
    assert text.startswith("init: WORLD_SIZE=4 contradicts MPI's rank 2 of 3; "
                           "expected WORLD_SIZE=3, or unset"), text
    assert "`unset WORLD_SIZE`" in text
    _raises({**PMIX, "RANK": "1"}, "RANK=1 contradicts PMIx", "PMIX_RANK=2")


def test_override_reads_no_strays():
    info = detect({**OPENMPI, "WORLD_SIZE": "5", "HPCDDP_LAUNCHER": "openmpi"})
    assert (info.rank, info.size, info.stray) == (1, 2, ())


# ----------------------------------------------------------------- against MPI's world

def test_check_world_with_no_launcher_or_an_agreeing_one():
    assert check_world(None, 0, 1) is None
    assert check_world(detect(OPENMPI), 1, 2) is None
    assert check_world(detect(PMIX), 2, 7) is None          # PMIx gives no size to compare


def test_check_world_mpi_that_did_not_connect():
    with pytest.raises(LaunchWorldError, match=r"^init: the launcher \(slurm\) started 7 ranks "
                       r"but MPI sees a world of 1: MPI did not connect") as err:
        check_world(detect(SLURM_PMI2), 0, 1)
    assert "srun --mpi=pmix" in str(err.value)
    assert isinstance(err.value, RuntimeError)   # what hpcddp.init raised before


TORCHRUN_2 = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
              "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "x",
              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("argv,commands", [
    (["train.py", "--epochs", "10"],
     ["mpirun -n 2 python train.py --epochs 10", "srun --mpi=pmix -n 2 python train.py --epochs 10",
      "mpirun -n 2 hpcddp run train.py --epochs 10"]),
    (["-c"], ["mpirun -n 2 python script.py", "srun --mpi=pmix -n 2 python script.py",
              "mpirun -n 2 hpcddp run script.py"]),
    ([], ["mpirun -n 2 python script.py", "srun --mpi=pmix -n 2 python script.py",
          "mpirun -n 2 hpcddp run script.py"]),
    (["/venv/bin/hpcddp", "run", "my train.py"],     # a console script: as it is, quoted
     ["mpirun -n 2 hpcddp run 'my train.py'", "srun --mpi=pmix -n 2 hpcddp run 'my train.py'"]),
], ids=["script", "python-c", "no-argv", "console-script"])
def test_check_world_under_torchrun(argv, commands):
    """torchrun's workers are singletons: the error's first words say torchrun cannot start
    MPI ranks, then what to run instead, with this program's own arguments."""
    with pytest.raises(LaunchWorldError) as err:
        check_world(detect(TORCHRUN_2), 0, 1, argv)
    text = str(err.value)
    assert text.startswith(f"torchrun cannot start MPI ranks: run `{commands[0]}` instead"), text
    for command in commands:
        assert f"`{command}`" in text, text
    if len(commands) == 2:
        assert "hpcddp run hpcddp run" not in text and text.count("`") == 4
    assert "RANK=1, WORLD_SIZE=2" in text and "world of 1" in text
    assert "docs/launching.md" in text


def test_check_world_accepts_a_one_process_torchrun():
    # torchrun --nproc-per-node 1: a singleton MPI world of 1 is the world torchrun made
    info = detect({**TORCHRUN_2, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                   "LOCAL_WORLD_SIZE": "1"})
    assert check_world(info, 0, 1) is None


# ----------------------------------------------------------------- malformed envs

def _raises(env, *needles):
    with pytest.raises(LaunchEnvError) as err:
        detect(env)
    text = str(err.value)
    assert text.startswith("detect: ")
    assert "expected" in text
    for needle in needles:
        assert needle in text, text
    return text


def _field_var(table, key):
    return table.fields[key][0]


def _minimal(table, **values):
    """The smallest env that makes ``table`` present, with those of the quantities it has."""
    env = {_field_var(table, k): str(v) for k, v in values.items() if k in table.fields}
    if table.name == "torchrun":
        env["TORCHELASTIC_RUN_ID"] = "x"
    if table.name == "pals" and "rank" not in values:
        env["PALS_APID"] = "a"
    return env


@pytest.mark.parametrize("table", [t for t in TABLES if "size" in t.fields],
                         ids=lambda t: t.name)
def test_rank_not_below_size(table):
    env = _minimal(table, rank=4, size=4)
    _raises(env, f"{_field_var(table, 'rank')}=4", f"{_field_var(table, 'size')}=4",
            "rank < size")


@pytest.mark.parametrize("table", [t for t in TABLES if "local_rank" in t.fields],
                         ids=lambda t: t.name)
def test_local_rank_without_rank(table):
    env = _minimal(table, local_rank=0, local_size=2)
    if table.name == "torch-env":
        env["WORLD_SIZE"] = "2"          # LOCAL_RANK alone does not mark torch-env
    text = _raises(env, "partial", f"{_field_var(table, 'local_rank')}=0",
                   f"{_field_var(table, 'rank')} is not")
    assert "variables seen" in text


@pytest.mark.parametrize("table", [t for t in TABLES if t.needs_size], ids=lambda t: t.name)
def test_rank_without_size(table):
    _raises(_minimal(table, rank=0), "partial", f"{_field_var(table, 'rank')}=0")


@pytest.mark.parametrize("table", TABLES, ids=lambda t: t.name)
@pytest.mark.parametrize("value,problem", [("abc", "not an integer"), ("1.5", "not an integer"),
                                           ("-1", "negative"), ("0x1", "not an integer"),
                                           ("1_0", "not an integer")])
def test_rank_not_a_non_negative_integer(table, value, problem):
    env = _minimal(table, rank=0, size=4)
    env[_field_var(table, "rank")] = value
    _raises(env, problem, _field_var(table, "rank"), value)


def test_whitespace_around_numbers_is_accepted():
    assert detect({"PMI_RANK": " 1 ", "PMI_SIZE": "2\n"}) == LaunchInfo("pmi", 1, 2)


@pytest.mark.parametrize("env,needles", [
    ({**OPENMPI, "OMPI_COMM_WORLD_LOCAL_RANK": "2"}, ["OMPI_COMM_WORLD_LOCAL_RANK=2",
                                                      "local rank < local size"]),
    ({**OPENMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "3"}, ["OMPI_COMM_WORLD_LOCAL_SIZE=3", "exceeds"]),
    ({**OPENMPI, "OMPI_COMM_WORLD_SIZE": "0"}, ["OMPI_COMM_WORLD_SIZE=0", "at least 1"]),
    ({**PALS, "PALS_NODEID": "2", "PALS_APID": "x"}, []),   # no node count: nothing to compare
    ({**TORCHRUN, "GROUP_RANK": "2"}, ["GROUP_RANK=2", "node index < node count"]),
])
def test_contradictions_within_one_launcher(env, needles):
    if not needles:
        assert detect(env).node_rank == 2
        return
    _raises(env, *needles)


@pytest.mark.parametrize("env,needles", [
    ({**OPENMPI, "PMIX_RANK": "0"}, ["PMIX_RANK=0", "OMPI_COMM_WORLD_RANK=1", "rank"]),
    ({**SLURM_PMI2, "PMI_SIZE": "8"}, ["PMI_SIZE=8", "SLURM_STEP_NUM_TASKS=7", "size"]),
    ({**SLURM_PMIX, "PMIX_RANK": "0"}, ["PMIX_RANK=0", "SLURM_PROCID=4"]),
    ({**PALS, "PMI_LOCAL_RANK": "3"}, ["PMI_LOCAL_RANK=3", "PALS_LOCAL_RANKID=2", "local rank"]),
    ({**HYDRA, **MVAPICH}, ["MV2_COMM_WORLD_RANK=5", "PMI_RANK=3"]),
    ({**OPENMPI, **MVAPICH}, ["MV2_COMM_WORLD_RANK=5", "OMPI_COMM_WORLD_RANK=1"]),
])
def test_launchers_that_disagree(env, needles):
    text = _raises(env, "disagree", *needles)
    assert "HPCDDP_LAUNCHER" in text


def test_slurm_step_layout_errors():
    _raises(dict(SLURM_STEP, SLURM_STEP_NODELIST="gpu[001-002]"),
            "SLURM_STEP_NODELIST", "names 2 nodes", "SLURM_STEP_NUM_NODES=4")
    _raises(dict(SLURM_STEP, SLURM_STEP_TASKS_PER_NODE="3,2,1"),
            "SLURM_STEP_TASKS_PER_NODE=3,2,1", "6 tasks on 3 nodes", "7 tasks on 4 nodes")
    _raises(dict(SLURM_STEP, SLURM_STEP_TASKS_PER_NODE="2(x"), "SLURM_STEP_TASKS_PER_NODE", "2(x")
    _raises(dict(SLURM_STEP, SLURM_STEP_NODELIST="gpu[001-003"), "not a valid Slurm hostlist",
            "gpu[001-003")
    _raises(dict(SLURM_STEP, SLURM_STEP_TASKS_PER_NODE="3,1,2,1"), "SLURM_LOCALID=1",
            "not below the 1 tasks")
    _raises(dict(SLURM_STEP, SLURM_NODEID="4"), "SLURM_NODEID=4", "node index < node count")


def test_slurm_job_level_fallbacks_are_used_only_when_they_fit_the_step():
    # srun --preserve-env, or an env written by hand: only job-wide lists are there
    env = {k: v for k, v in SLURM_STEP.items()
           if k not in ("SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_STEP_TASKS_PER_NODE")}
    info = detect(dict(env, SLURM_TASKS_PER_NODE="4(x2)"))        # the allocation's: ignored
    assert (info.hosts, info.local_size) == (None, None)            # JOB_NODELIST has 5 nodes
    info = detect(dict(env, SLURM_JOB_NODELIST="gpu[001-004]"))
    assert info.hosts == ("gpu001", "gpu002", "gpu003", "gpu004") and info.local_size == 2


def test_slurm_localid_without_procid_in_a_step():
    env = {k: v for k, v in SLURM_STEP.items() if k != "SLURM_PROCID"}
    _raises(env, "partial", "SLURM_LOCALID=1", "SLURM_PROCID is not")


def test_partial_marker_only():
    _raises({"PALS_APID": "a"}, "partial", "PALS_APID", "PALS_RANKID is not")
    _raises({"TORCHELASTIC_RUN_ID": "r"}, "partial", "TORCHELASTIC_RUN_ID", "RANK is not")
    _raises({"MPI_LOCALNRANKS": "2"}, "partial", "PMI_RANK is not")


# ----------------------------------------------------------------- override

def test_override_reads_one_table():
    nested = {**HYDRA, "RANK": "0", "WORLD_SIZE": "1"}         # a launcher rules don't know
    with pytest.raises(LaunchEnvError):
        detect(nested)
    info = detect({**nested, "HPCDDP_LAUNCHER": "hydra"})
    assert (info.launcher, info.rank, info.size, info.outer) == ("hydra", 3, 4, ())
    assert detect({**nested, "HPCDDP_LAUNCHER": " Torch-Env "}).rank == 0


def test_override_errors():
    text = _raises({"HPCDDP_LAUNCHER": "lsf"}, "'lsf' is not a launcher", "torchrun", "none")
    assert all(name in text for name in LAUNCHERS)
    _raises({"HPCDDP_LAUNCHER": "slurm"}, "none of Slurm", "SLURM_PROCID")


# ----------------------------------------------------------------- helpers, purity

@pytest.mark.parametrize("text,counts", [("2(x3),1", [2, 2, 2, 1]), ("4", [4]),
                                         ("1,2,3", [1, 2, 3]), ("0(x2)", [0, 0])])
def test_parse_tasks_per_node(text, counts):
    assert parse_tasks_per_node(text) == counts


@pytest.mark.parametrize("text", ["", "2(x0)", "2(x3", "x", "2(3)", "-1", "1,,2"])
def test_parse_tasks_per_node_malformed(text):
    with pytest.raises(ValueError, match="parse_tasks_per_node"):
        parse_tasks_per_node(text)


def test_launch_imports_only_the_standard_library():
    """hpcddp.launch must not import MPI or torch (DESIGN.md layers): check every import
    (hpcddp.settings is standard library only too: tests/unit/test_settings.py)."""
    allowed = set(sys.stdlib_module_names) | {"__future__"}
    root = pathlib.Path(launch.__file__).parent
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = ([f"{node.module}.{a.name}" for a in node.names] if node.level == 0
                         else [])
            else:
                continue
            for name in names:
                assert name.split(".")[0] in allowed or \
                    name.startswith(("hpcddp.launch", "hpcddp.settings")), \
                    f"{path.name} imports {name}"


def test_detect_under_real_mpirun():
    """``mpirun -n 2``: each rank's detect() says openmpi, its own rank, size 2."""
    from hpcddp.launch.mpirun import find_mpirun, run_mpi
    try:
        find_mpirun()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    script = ("import json; from hpcddp.launch import detect; i = detect(); "
              "print('DETECT', json.dumps([i.launcher, i.rank, i.size, i.local_rank, "
              "i.local_size, i.pmi]))")
    drop = {"HPCDDP_LAUNCHER"}.union(*(t.variables for t in TABLES))
    env = {k: v for k, v in os.environ.items() if k not in drop}
    proc = run_mpi(2, [sys.executable, "-c", script], timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = sorted(json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines()
                  if line.startswith("DETECT "))
    assert rows == [["openmpi", 0, 2, 0, 2, "pmix"], ["openmpi", 1, 2, 1, 2, "pmix"]], \
        proc.stdout + proc.stderr


def _fake_runs(monkeypatch, results):
    """run_mpi with mpirun replaced by RESULTS, one (returncode, stderr) per attempt."""
    import subprocess
    from hpcddp.launch import mpirun
    calls = []

    def run_once(cmd, timeout, env, cwd):
        code, err = results[len(calls)]
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, code, "", err)
    monkeypatch.setattr(mpirun, "_run_once", run_once)
    return mpirun, calls


def test_run_mpi_retries_a_launcher_that_failed_to_start(monkeypatch):
    mpirun, calls = _fake_runs(monkeypatch, [
        (213, "The PMIx server's listener thread failed to start. We cannot\ncontinue."),
        (0, "")])
    res = mpirun.run_mpi(2, ["true"], timeout=10)
    assert res.returncode == 0 and len(calls) == 2


def test_run_mpi_does_not_rerun_a_job_that_ran(monkeypatch):
    """A rank's failure (or a timeout) is the job's result: running it again could hide it."""
    mpirun, calls = _fake_runs(monkeypatch, [(1, "Traceback ... ValueError"), (0, "")])
    assert mpirun.run_mpi(2, ["true"], timeout=10).returncode == 1 and len(calls) == 1
    mpirun, calls = _fake_runs(monkeypatch, [(-9, "run_mpi: killed after 10 s timeout")])
    assert mpirun.run_mpi(2, ["true"], timeout=10).returncode == -9 and len(calls) == 1


def test_run_mpi_gives_up_after_the_retries(monkeypatch):
    fail = (213, "The PMIx server's listener thread failed to start.")
    mpirun, calls = _fake_runs(monkeypatch, [fail] * 5)
    res = mpirun.run_mpi(2, ["true"], timeout=10)
    assert res.returncode == 213 and len(calls) == 1 + mpirun.LAUNCH_RETRIES
    assert "the launcher failed to start" in res.stderr


@pytest.mark.parametrize("env,spans", [
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2",
      "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}, True),
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
      "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, False),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "SLURM_NNODES": "2",
      "SLURM_NODEID": "0", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4",
      "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
      "SLURM_TASKS_PER_NODE": "2(x2)"}, True),
    ({}, False),
], ids=["ompi-2-nodes", "ompi-1-node", "slurm-2-nodes", "singleton"])
def test_spans_nodes(env, spans):
    """What decides, before MPI starts, that Open MPI should yield while idle (comm/_mpi.py)."""
    from hpcddp.launch.env import spans_nodes
    assert spans_nodes(detect(env)) is spans
