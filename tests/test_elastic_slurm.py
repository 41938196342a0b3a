"""Elastic mode in a Slurm batch job, on the one-machine Slurm of tests/test_jobs_slurm.py.

The job is the single-node-ddp template rendered with elastic=True: it runs ``mpirun
--with-ft ulfm`` inside its allocation (prterun starts its daemons through Slurm), and rank 1
SIGKILLs itself in a gradient all-reduce: the job must end
COMPLETED with exit 0, the two survivors holding the same parameters. Direct ``srun`` launch
is not the way here: Slurm 22.05's PMIx plugin cancels the step when a task dies, whatever
``--kill-on-bad-exit=0 --no-kill`` say (docs/elastic.md). Skips exactly when
test_jobs_slurm.py does.
"""
import json
import pathlib
import shlex
import sys

import pytest

from hpcddp.launch.templates import render
from test_elastic import needs_ulfm
from test_jobs_slurm import Job, assert_completed, sh, slurm  # noqa: F401

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "elastic_train.py"

pytestmark = pytest.mark.timeout(600)


def batch(out: pathlib.Path) -> str:
    """The single-node-ddp template with elastic=True (what `hpcddp submit single-node-ddp
    --elastic` writes), running the test's training script on 3 ranks."""
    text = render("single-node-ddp", elastic=True, job_name="hpcddp-elastic", tasks_per_node=3,
                  gpus=0, cpus_per_task=1, time="5", output=f"{out}/elastic-%j.out",
                  script=str(SCRIPT), args=[str(out)],
                  setup=[f". {shlex.quote(sys.prefix)}/bin/activate",
                         "export HPCDDP_ELASTIC_KILL=1@5:backward",
                         # the local test cluster runs jobs as root
                         "export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1"])
    # the local cluster's nodes have 2 CPUs: 3 ranks are overcommitted (sbatch --overcommit),
    # which mpirun accepts only when told (a real job asks for no more ranks than cores)
    step = "run_step mpirun --with-ft ulfm"
    assert step in text
    return text.replace(step, "run_step mpirun --oversubscribe --with-ft ulfm")


@needs_ulfm
def test_elastic_job_under_slurm(slurm, tmp_path):
    script = tmp_path / "elastic.sbatch"
    script.write_text(batch(tmp_path))
    res = sh(["sbatch", "--parsable", "--overcommit", str(script)], 60, cwd=tmp_path)
    assert res.returncode == 0, f"sbatch failed: {res.stderr}"
    job = Job(res.stdout.strip().split(";")[0], tmp_path, "elastic-*.out")
    recs = job.wait(timeout=400)
    assert_completed(job, recs)
    log = job.logs()
    assert "[rank1] elastic: fault injection: SIGKILL" in log and "elastic: lost rank 1" in log
    finals = [json.loads((tmp_path / f"final.{r}.json").read_text()) for r in (0, 2)]
    assert not (tmp_path / "final.1.json").exists()
    assert finals[0]["params"] == finals[1]["params"] and finals[0]["size"] == 2
