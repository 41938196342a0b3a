"""docs/data.md runs as written: its pack commands, its stage commands (packed and --files) and
its Python examples.

The page's blocks are taken from the page itself, in order, and run in a temporary directory
the way a reader would paste them (bash blocks with bash, the stage command under its own
mpirun, the Python stage/read/evaluate examples as one script under `mpirun -n 2`). The
page's `/tmp/` paths are moved into the test's directory. Root and oversubscription come from
Open MPI's environment variables, so the commands keep the page's wording.
"""
import os
import pathlib
import re
import signal
import subprocess
import sys

from hpcddp.launch.mpirun import run_mpi

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "data.md"
BLOCK = re.compile(r"```(bash|python|text)\n(.*?)```", re.S)
TIMEOUT = 180


def _blocks():
    return [(m.group(1), m.group(2)) for m in BLOCK.finditer(DOC.read_text())]


def _env(tmp):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               # Open MPI 5 (PRRTE) reads oversubscription from here, not from OMPI_MCA_*
               PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe")
    env["PATH"] = f"{pathlib.Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def _here(code: str, tmp) -> str:
    return code.replace("/tmp/", f"{tmp}/")


def test_data_page_examples_run(tmp_path):
    blocks = _blocks()
    env = _env(tmp_path)

    def bash(code, timeout=TIMEOUT):
        # its own session: on a timeout the whole group (bash, mpirun, ranks) is killed
        proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", _here(code, tmp_path)],
                                cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise AssertionError(f"timed out after {timeout} s: {code}\n{out}\n{err}")
        assert proc.returncode == 0, f"{code}\n--- stdout ---\n{out}\n--- stderr ---\n{err}"
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    # 1. pack: the folder tree and the .npz array, then the Python iterable
    pack_sh = next(c for k, c in blocks if k == "bash" and "hpcddp pack images" in c)
    bash(pack_sh)
    assert (tmp_path / "packed-images" / "manifest.json").exists()
    assert (tmp_path / "packed-arrays" / "manifest.json").exists()
    pack_py = next(c for k, c in blocks if k == "python" and "packed-items" in c)
    res = subprocess.run([sys.executable, "-c", pack_py], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=TIMEOUT)
    assert res.returncode == 0, res.stderr
    samples, shards = map(int, res.stdout.split())
    assert samples == 500 and shards > 1

    # 1b. packing an HDF5 file: the file and the CLI, then the Python examples in one process
    bash(next(c for k, c in blocks if k == "bash" and "hpcddp pack scans.h5" in c))
    assert (tmp_path / "packed-scans" / "manifest.json").exists()
    assert (tmp_path / "packed-scans-h5" / "manifest.json").exists()
    h5_py = [c for k, c in blocks if k == "python" and "h5py" in c]
    res = subprocess.run([sys.executable, "-c", "\n".join(h5_py)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=TIMEOUT)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split()[:2] == ["1000", "4"], res.stdout
    assert (tmp_path / "packed-many" / "manifest.json").exists()

    # 2. the stage command, whose output the page shows
    stage_sh = next(c for k, c in blocks if k == "bash" and "mpirun -n 4 hpcddp stage" in c)
    res = bash(stage_sh)
    shown = next(c for k, c in blocks if k == "text" and "[rank0] staged 100 samples" in c)
    for line in res.stdout.splitlines():
        if line.startswith("[rank0] staged"):
            assert line == shown.splitlines()[0], (line, shown)
    assert "(1.00x the data set per group)" in res.stdout
    for node in (0, 1):
        assert (tmp_path / f"staged-{node}" / "images" / "READY").exists()

    # 2b. the plain tree (--files): the folder packed in step 1, as it is
    tree_sh = next(c for k, c in blocks if k == "bash" and "hpcddp stage --files images" in c)
    res = bash(tree_sh)
    shown = next(c for k, c in blocks if k == "text" and "[rank0] staged 100 files" in c)
    first = [line for line in res.stdout.splitlines() if line.startswith("[rank0] staged")]
    assert first == shown.splitlines()[:1], (first, shown)
    assert "(200 file copies, 0 already in place)" in res.stdout, res.stdout
    for node in (0, 1):
        assert (tmp_path / f"staged-tree-{node}" / "images" / "READY").exists()
        assert (tmp_path / f"staged-tree-{node}" / "images" / "cat" / "007.bin").read_bytes() == \
            (tmp_path / "images" / "cat" / "007.bin").read_bytes()

    # 3. the Python examples: stage, train loop, exact evaluation, as one script on 2 ranks
    py = [c for k, c in blocks if k == "python" and "packed-items" not in c and "h5py" not in c]
    script = tmp_path / "stage_and_read.py"
    script.write_text(_here("\n".join(py), tmp_path))
    # HPCDDP_TIMEOUT: a rank that fails leaves the other waiting; the watchdog's report ends
    # the job in seconds instead of at run_mpi's hard timeout
    res = run_mpi(2, [sys.executable, str(script)], timeout=TIMEOUT, env=dict(
        env, HPCDDP_RANKS_PER_NODE="1", HPCDDP_TIMEOUT="30"), cwd=str(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "(0 shard copies, 14 already in place)" in res.stdout   # staged by step 2
    assert "staged 100 files" in res.stdout                        # the tree, by step 2b
    counts = [line.split() for line in res.stdout.splitlines() if re.fullmatch(r"\d+ \d+", line)]
    assert counts == [["100", "100"], ["100", "100"]], res.stdout   # each sample counted once
