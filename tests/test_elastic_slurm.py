"""Elastic mode in a Slurm batch job, on the one-machine Slurm of tests/test_jobs_slurm.py.

The job runs ``mpirun --with-ft ulfm`` inside its allocation (prterun starts its daemons
through Slurm) and rank 1 SIGKILLs itself in a gradient all-reduce: the job must end
COMPLETED with exit 0, the two survivors holding the same parameters. Direct ``srun`` launch
is not the way here: Slurm 22.05's PMIx plugin cancels the step when a task dies, whatever
``--kill-on-bad-exit=0 --no-kill`` say (docs/elastic.md). Skips exactly when
test_jobs_slurm.py does.
"""
import json
import pathlib
import sys

import pytest

from test_elastic import needs_ulfm
from test_jobs_slurm import Job, assert_completed, sh, slurm  # noqa: F401

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "elastic_train.py"

pytestmark = pytest.mark.timeout(600)

BATCH = """#!/bin/bash
#SBATCH --job-name=hpcddp-elastic
#SBATCH --nodes=1
#SBATCH --ntasks=3
#SBATCH --overcommit
#SBATCH --time=5
#SBATCH --output={out}/elastic-%j.out
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
export HPCDDP_ELASTIC_KILL=1@5:backward
{bindir}/mpirun --with-ft ulfm --allow-run-as-root --oversubscribe -n 3 \\
    {python} {script} {out}
"""


@needs_ulfm
def test_elastic_job_under_slurm(slurm, tmp_path):
    bindir = pathlib.Path(sys.executable).parent
    script = tmp_path / "elastic.sbatch"
    script.write_text(BATCH.format(out=tmp_path, bindir=bindir, python=sys.executable,
                                   script=SCRIPT))
    res = sh(["sbatch", "--parsable", str(script)], 60, cwd=tmp_path)
    assert res.returncode == 0, f"sbatch failed: {res.stderr}"
    job = Job(res.stdout.strip().split(";")[0], tmp_path, "elastic-*.out")
    recs = job.wait(timeout=400)
    assert_completed(job, recs)
    log = job.logs()
    assert "[rank1] elastic: fault injection: SIGKILL" in log and "elastic: lost rank 1" in log
    finals = [json.loads((tmp_path / f"final.{r}.json").read_text()) for r in (0, 2)]
    assert not (tmp_path / "final.1.json").exists()
    assert finals[0]["params"] == finals[1]["params"] and finals[0]["size"] == 2
