"""The hand-written jobs/mpirun scripts: valid bash, one shared launcher block, documented knobs.

Running them is tests/test_jobs_mpirun.py (and, inside a Slurm allocation, test_jobs_slurm.py).
"""
import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
MPIRUN_DIR = ROOT / "jobs" / "mpirun"
SCRIPTS = sorted(MPIRUN_DIR.glob("*.sh"))
WITH_BLOCK = [p for p in SCRIPTS if p.name != "pbs_pals.sh"]
BLOCK_START = "# ---- launcher flags: Open MPI or Hydra"
BLOCK_END = "\n}\n"  # the block ends with run_step's closing brace


def _block(path: pathlib.Path) -> str:
    text = path.read_text()
    start = text.index(BLOCK_START)
    run_step = text.index("run_step() {", start)
    return text[start:text.index(BLOCK_END, run_step) + len(BLOCK_END)]


def test_the_expected_scripts_exist():
    names = {p.name for p in SCRIPTS}
    assert {"single_node_ddp.sh", "multi_node_ddp.sh", "stage_then_train.sh", "cpu_mpi.sh",
            "array_sweep.sh", "pbs_pals.sh"} <= names


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_valid_bash(path):
    res = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    assert path.read_text().startswith("#!/bin/bash\n")


def test_launcher_block_is_the_same_everywhere():
    # Each script is meant to be copied alone, so the block is repeated: keep the copies equal.
    blocks = {p.name: _block(p) for p in WITH_BLOCK}
    first = blocks[WITH_BLOCK[0].name]
    for name, block in blocks.items():
        assert block == first, f"{name}: its launcher block differs from {WITH_BLOCK[0].name}"


@pytest.mark.parametrize("path", WITH_BLOCK, ids=lambda p: p.name)
def test_settings_come_from_the_environment(path):
    text = path.read_text()
    for var in re.findall(r"^([A-Z_]+)=\$\{", text, re.M):
        assert re.search(rf"^{var}=\$\{{{var}:?-", text, re.M), f"{var} ignores the environment"
    assert "hpcddp run" in text and "CKPT_DIR" in text and "trap on_signal USR1 TERM" in text


def _mpi_cmd(tmp_path, version_text, ppn=2, total=4, hostfile="", cpus=1):
    """Evaluate mpi_cmd from a script against a fake launcher; return the words it built."""
    fake = tmp_path / "fakempirun"
    fake.write_text(f"#!/bin/sh\ncat <<'X'\n{version_text}\nX\n")
    fake.chmod(0o755)
    probe = (_block(WITH_BLOCK[0]).replace("trap on_signal USR1 TERM", "") +
             f'\nMPIRUN={fake}; CPUS_PER_RANK={cpus}; HOSTFILE="{hostfile}"\n'
             f'mpi_cmd {ppn} {total}; printf "%s\\n" "${{MPI_CMD[@]}}"\n')
    res = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, timeout=30,
                         env={"PATH": "/usr/bin:/bin", "CKPT_DIR": "/ck"})
    assert res.returncode == 0, res.stderr
    return res.stdout.split("\n")[1:-1]  # drop the launcher path itself


def test_open_mpi_flags(tmp_path):
    words = _mpi_cmd(tmp_path, "mpirun (Open MPI) 5.0.3", ppn=1, total=1, hostfile="h")
    assert words[:4] == ["-n", "1", "--map-by", "ppr:1:node:PE=1"]
    assert "--bind-to" in words and "--hostfile" in words and "h" in words
    assert words[words.index("CKPT_DIR") - 1] == "-x"  # passed on to other nodes


def test_open_mpi_oversubscribes_without_binding(tmp_path):
    words = _mpi_cmd(tmp_path, "mpirun (Open MPI) 5.0.3", ppn=64, total=64)
    assert "ppr:64:node:OVERSUBSCRIBE" in words and words[words.index("--bind-to") + 1] == "none"


def test_mpich_flags(tmp_path):
    words = _mpi_cmd(tmp_path, "HYDRA build details:\n    Version: 4.1.2", ppn=4, total=8,
                     hostfile="hosts", cpus=2)
    assert words == ["-n", "8", "-ppn", "4", "-bind-to", "core:2", "-f", "hosts"]


def test_intel_mpi_flags(tmp_path):
    words = _mpi_cmd(tmp_path, "Intel(R) MPI Library for Linux* OS, Version 2021.10\nHYDRA",
                     ppn=4, total=8)
    assert words == ["-n", "8", "-ppn", "4"]
