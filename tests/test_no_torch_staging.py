"""`hpcddp stage` and `hpcddp pack` never import torch; `import hpcddp` keeps the backend there.

Thousands of ranks importing torch from a shared file system before staging is a start-up
storm, and staging needs none of it. Each case runs in a fresh interpreter (as a user's job
does) through tests/scripts/torch_free.py, which runs `hpcddp ARGS` and says at exit whether
any torch module was loaded; the registration cases run from a directory outside the checkout,
so the installed metadata (the entry point) is what Python sees.
"""
import os
import pathlib
import subprocess
import sys

import pytest

from hpcddp.launch.mpirun import run_mpi
from test_data_cli import _env, _pack_folder

ROOT = pathlib.Path(__file__).resolve().parents[1]
TORCH_FREE = [sys.executable, str(ROOT / "tests" / "scripts" / "torch_free.py")]
TIMEOUT = 180


def _python(code, tmp_path, **env):
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=TIMEOUT, cwd=tmp_path, env=dict(os.environ, **env))
    assert res.returncode == 0, res.stderr
    return res.stdout.split()


@pytest.mark.parametrize("autoload", ["1", "0"])
def test_import_hpcddp_loads_no_torch_and_the_backend_is_there_once_torch_is(tmp_path, autoload):
    out = _python("import sys, hpcddp; print('torch' in sys.modules); "
                  "import torch.distributed as dist; print('HPCDDP' in dist.Backend._plugins)",
                  tmp_path, TORCH_DEVICE_BACKEND_AUTOLOAD=autoload)
    assert out == ["False", "True"]


def test_torch_first_then_hpcddp_registers(tmp_path):
    out = _python("import torch.distributed as dist, hpcddp; "
                  "print('HPCDDP' in dist.Backend._plugins)",
                  tmp_path, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert out == ["True"]


def test_torch_alone_finds_the_backend_through_its_entry_point(tmp_path):
    """A program that never imports hpcddp (a Lightning strategy given backend="hpcddp")."""
    out = _python("import torch.distributed as dist; print('HPCDDP' in dist.Backend._plugins)",
                  tmp_path)
    assert out == ["True"]


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5"])
def test_pack_never_imports_torch(tmp_path, fmt):
    root = tmp_path / "files"
    root.mkdir()
    for i in range(6):
        (root / f"f{i}.bin").write_bytes(os.urandom(100))
    res = subprocess.run(TORCH_FREE + ["pack", str(root), str(tmp_path / "out"), "--format", fmt,
                                       "--no-progress"],
                         capture_output=True, text=True, timeout=TIMEOUT, env=_env())
    assert res.returncode == 0, res.stderr
    assert "torch_free: no torch module loaded" in res.stdout, res.stdout + res.stderr


@pytest.mark.parametrize("nprocs", [2, 3])
def test_stage_under_mpirun_never_imports_torch(tmp_path, nprocs):
    _, src = _pack_folder(tmp_path)
    res = run_mpi(nprocs, TORCH_FREE + ["stage", str(src), str(tmp_path / "dst-{node}"),
                                        "--no-progress"], timeout=TIMEOUT, env=_env())
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("torch_free: no torch module loaded") == nprocs, \
        res.stdout + res.stderr
    assert all((tmp_path / f"dst-{n}" / "READY").exists() for n in range(nprocs))


def test_stage_files_under_mpirun_never_imports_torch(tmp_path):
    root = tmp_path / "files"
    for i in range(40):
        (root / f"class{i % 3}").mkdir(parents=True, exist_ok=True)
        (root / f"class{i % 3}" / f"f{i:03d}.bin").write_bytes(os.urandom(3000))
    res = run_mpi(2, TORCH_FREE + ["stage", "--files", str(root), str(tmp_path / "dst-{node}"),
                                   "--no-progress"], timeout=TIMEOUT, env=_env())
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("torch_free: no torch module loaded") == 2, res.stdout + res.stderr
    assert "[rank0] staged 40 files" in res.stdout, res.stdout
    assert all((tmp_path / f"dst-{n}" / "READY").exists() for n in range(2))


def test_the_start_up_table_is_the_recorded_runs():
    """docs/data.md's start-up table: the min-max of docs/benchmarks/stage-startup.txt, the
    output of scripts/stage_startup_times.sh, never figures typed in apart from it."""
    runs = {}
    for line in (ROOT / "docs" / "benchmarks" / "stage-startup.txt").read_text().splitlines():
        if line.startswith("#"):
            continue
        which, _, help_s, what, run_s = line.split()
        runs.setdefault((which, "help"), []).append(float(help_s))
        runs.setdefault((which, what), []).append(float(run_s))
    page = (ROOT / "docs" / "data.md").read_text()

    def span(key, digits):
        return f"{min(runs[key]):.{digits}f}-{max(runs[key]):.{digits}f} s"

    assert (f"| `hpcddp stage --help` | {span(('before', 'help'), 1)} | "
            f"{span(('after', 'help'), 2)} |") in page
    for n in (2, 4):
        assert (f"| `mpirun -n {n} hpcddp stage SRC DEST` (whole run) | "
                f"{span(('before', f'stage-np{n}'), 1)} | {span(('after', f'stage-np{n}'), 1)} |"
                ) in page
