"""`hpcddp stage --files`: a plain directory tree staged as it is, in jobs of 2, 3 and 4
emulated nodes (one rank each, one shared disk: DEST has {node}).

The scenarios run inside one job per size (tests/scripts/stage_files_job.py: replicate and
partition, a re-run that keeps everything, a re-run that copies exactly the changed files,
a link and a FIFO refused, a file changed during the copy named); a stager killed mid-copy
and re-run is a job of its own, as a user meets it.
"""
import json
import os
import pathlib
import subprocess
import sys

import pytest

from hpcddp.data import _staging_files as ft
from hpcddp.data import destlock
from hpcddp.data import manifest as mf
from hpcddp.launch.mpirun import run_mpi
from test_data_cli import HPCDDP, KILLED_AFTER, TIMEOUT, _env

JOB = [sys.executable, str(pathlib.Path(__file__).parent / "scripts" / "stage_files_job.py")]


def make_tree(root: pathlib.Path) -> pathlib.Path:
    """Deep, empty files and directories, 300 small files, files larger than a 16 KiB chunk."""
    rng = __import__("random").Random(0)
    for i in range(300):                                    # 1 KiB each, 10 directories
        p = root / "small" / f"d{i // 30:02d}" / f"f{i:04d}.bin"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(rng.randbytes(1024))
    for i, size in enumerate((40_000, 16 << 10, 60_001)):   # > chunk, = chunk, > 3 chunks
        p = root / "big" / f"large-{i}.bin"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(rng.randbytes(size))
    deep = root / "deep" / "/".join(f"l{i}" for i in range(12))
    deep.mkdir(parents=True)
    (deep / "bottom.txt").write_bytes(b"twelve levels down\n")
    for name in ("empty-a", "small/d03/empty-b", "deep/l0/empty-c"):
        (root / name).write_bytes(b"")
    (root / "empty-dir" / "nested-empty").mkdir(parents=True)
    (root / "run.sh").write_bytes(b"#!/bin/sh\necho hi\n")
    os.chmod(root / "run.sh", 0o751)
    return root


def _bad_trees(src: pathlib.Path) -> None:
    for kind in ("link", "fifo"):
        bad = src.parent / f"{src.name}-{kind}"
        (bad / "big").mkdir(parents=True)
        (bad / "big" / "ok.bin").write_bytes(b"fine")
    os.symlink("../big", src.parent / f"{src.name}-link" / "big" / "loop")
    os.mkfifo(src.parent / f"{src.name}-fifo" / "big" / "pipe")


@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_stage_files_replicate_partition_resume_and_refusals(tmp_path, nprocs):
    src = make_tree(tmp_path / "src")
    _bad_trees(src)
    work = tmp_path / "work"
    work.mkdir()
    res = run_mpi(nprocs, JOB + [str(src), str(work)], timeout=TIMEOUT,
                  env=_env(HPCDDP_TIMEOUT="60"))
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("stage_files_job: ok") == nprocs, res.stdout + res.stderr


def _same(src, dst):
    dirs, files = ft.list_tree(str(src))
    assert all((dst / d).is_dir() for d in dirs)
    for name, *_ in files:
        assert (dst / name).read_bytes() == (src / name).read_bytes(), name
    assert (dst / mf.READY).exists() and not (dst / mf.STAGING).exists()


def test_stage_files_killed_mid_copy_then_resumed(tmp_path):
    src = make_tree(tmp_path / "src")
    nfiles = len(ft.list_tree(str(src))[1])
    stage = ["stage", "--files", str(src), str(tmp_path / "dst-{node}"), "--chunk-size", "4K",
             "--no-progress"]
    killed = run_mpi(2, KILLED_AFTER + ["150", "1"] + stage, timeout=TIMEOUT, env=_env())
    assert killed.returncode != 0 and "test kill point" in killed.stderr, killed.stderr
    node1 = tmp_path / "dst-1"
    assert (node1 / mf.STAGING).exists() and not (node1 / mf.READY).exists()
    left = [os.path.join(r, n) for r, _, ns in os.walk(node1) for n in ns if ft.partial_base(n)]
    assert left, "killed inside a file: its temporary name is left"
    holder = json.loads((node1 / destlock.LOCK_NAME).read_text())

    out = tmp_path / "summary.json"
    again = run_mpi(2, HPCDDP + stage + ["--json", str(out)], timeout=TIMEOUT, env=_env())
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"pid {holder['pid']} is no longer running" in again.stderr, again.stderr
    assert f"staged {nfiles} files" in again.stdout
    s = json.loads(out.read_text())
    assert s["files"] and s["num_shards"] == nfiles
    assert s["shards_skipped"] >= 1                        # files verified before the kill kept
    assert s["shards_copied"] + s["shards_skipped"] == 2 * nfiles
    for node in (0, 1):
        _same(src, tmp_path / f"dst-{node}")
    assert not [n for r, _, ns in os.walk(node1) for n in ns if ft.partial_base(n)]


def test_stage_files_refuses_a_file_source_before_mpi(tmp_path):
    (tmp_path / "one.h5").write_bytes(b"")
    res = subprocess.run(HPCDDP + ["stage", "--files", str(tmp_path / "one.h5"), str(tmp_path / "d")],
                         capture_output=True, text=True, timeout=TIMEOUT, env=_env())
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        f"[rank0] hpcddp stage: --files: SOURCE '{tmp_path / 'one.h5'}' is not a directory; "
        f"expected a directory tree (a single file: stage the directory holding it)"]
    res = subprocess.run(HPCDDP + ["stage", str(tmp_path), str(tmp_path / "d")],
                         capture_output=True, text=True, timeout=TIMEOUT, env=_env())
    assert res.returncode == 2 and "stage a plain directory tree with --files" in res.stderr
