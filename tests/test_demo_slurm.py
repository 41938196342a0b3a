"""jobs/slurm/demo.sbatch on the one-machine Slurm of tests/test_jobs_slurm.py.

Small: 300 digits, 1 epoch, two Slurm nodes with one task each. Checks that every step ran
(write + pack in the batch script, `hpcddp stage` on each node, `hpcddp demo --staged` on
every task), that each node read its own staged copy (per-node $SLURM_TMPDIR), and that the
evaluation counted each held-out sample once. Skips exactly when test_jobs_slurm.py does.
"""
import json
import os
import pathlib
import sys

import pytest

from test_jobs_slurm import Job, assert_clean, assert_completed, sh, slurm  # noqa: F401

ROOT = pathlib.Path(__file__).resolve().parents[1]
SBATCH = ROOT / "jobs" / "slurm" / "demo.sbatch"

pytestmark = pytest.mark.timeout(600)


def test_demo_sbatch_stages_then_trains(slurm, tmp_path):
    nodes = 2 if len(slurm["nodes"]) >= 2 else 1
    export = ",".join([
        "ALL", f"VENV={sys.prefix}", "DIGITS_ARGS=--limit 300",
        "DEMO_ARGS=--epochs 1 --batch-size 30"])
    res = sh(["sbatch", "--parsable", f"--nodes={nodes}", f"--export={export}", str(SBATCH)],
             60, cwd=tmp_path)
    assert res.returncode == 0, f"sbatch failed: {res.stderr}"
    job = Job(res.stdout.strip().split(";")[0], tmp_path, "hpcddp-demo-*.out")
    recs = job.wait(timeout=400)
    assert_completed(job, recs)
    log = job.logs()
    assert_clean(log)
    for line in ("step 1 (write + pack)", f"step 2 (stage to {nodes} node(s))",
                 "step 3 (train + evaluate)", "[rank0] [train] epoch  1/1",
                 "[rank0] [evaluate] held-out accuracy", "[rank0] [summary]   train"):
        assert line in log, f"no {line!r} in the job log:\n{log[-6000:]}"
    workdir = tmp_path / f"hpcddp-demo-{job.id}"
    r = json.loads((workdir / "results.json").read_text())
    assert r["world_size"] == nodes and r["nodes"] == nodes
    assert r["test_samples"] == 60 and r["train_samples"] == 240
    assert (workdir / "checkpoints" / "demo-000000001.pt").exists()
    # the packed data sets stayed on the shared filesystem; the staged copies were node-local
    assert (workdir / "packed" / "train" / "manifest.json").exists()
    assert "using the copy staged on each node" in log and "/node0 (rank 0's node)" in log
    assert os.path.isdir(workdir / "digits" / "train" / "7")
