"""Every Slurm job template, run on a real one-machine Slurm (scripts/slurm-local.sh).

The module fixture installs (apt-get, first time only) and starts Slurm with two nodes on this
host (`slurmd -N`, each in its own UTS namespace), then submits every template at once, each
rendered by hpcddp.launch.templates with small shapes and jobs/train_tiny.py; each test waits
for its own job. Every sbatch/scontrol/scancel runs under a timeout, and a job that outlives
its timeout is cancelled and reported with its log.

There is no slurmdbd here, so `sacct` has nothing: states and exit codes come from
`scontrol show job` (finished jobs stay listed for MinJobAge = 1 h).

Skips (with the reason) only when Slurm cannot start: not root, no apt-get and no Slurm, or
scripts/slurm-local.sh failing. HPCDDP_REQUIRE_SLURM=1 turns those skips into failures.
"""
import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import time

import pytest

from hpcddp.launch.templates import render

ROOT = pathlib.Path(__file__).resolve().parents[1]
TRAIN = str(ROOT / "jobs" / "train_tiny.py")
SLURM_LOCAL = str(ROOT / "scripts" / "slurm-local.sh")
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE", "PREEMPTED"}
JOB_TIMEOUT = 300  # seconds per job, from submission; jobs queue behind each other on 2 cores
# What must never show in a clean job's log: PMIx/Open MPI help-file noise ("Sorry! You were
# supposed to get help about ... help-pmix-mca-base.txt: No such file"), and any message from
# srun or slurmstepd (warnings such as "lacks support for cpu binding", step errors).
NOISE = ("Sorry!", "help-pmix", "No such file or directory", "srun: ", "slurmstepd")

pytestmark = pytest.mark.timeout(900)


def sh(cmd, timeout=60, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


# --- the cluster ---------------------------------------------------------------------------

def _unavailable(reason: str):
    if os.environ.get("HPCDDP_REQUIRE_SLURM") == "1":
        pytest.fail(f"HPCDDP_REQUIRE_SLURM=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def slurm():
    if os.geteuid() != 0:
        _unavailable("the local Slurm needs root (scripts/slurm-local.sh installs packages and "
                     "starts daemons)")
    if not shutil.which("apt-get") and not shutil.which("slurmctld"):
        _unavailable("no apt-get to install Slurm and no Slurm installed")
    was_running = shutil.which("scontrol") and sh(["scontrol", "ping"], 30).returncode == 0 \
        and "UP" in sh(["scontrol", "ping"], 30).stdout
    try:
        res = sh(["bash", SLURM_LOCAL, "start"], timeout=900)
    except subprocess.TimeoutExpired:
        _unavailable("scripts/slurm-local.sh start did not finish in 900 s (apt-get?)")
    if res.returncode != 0:
        _unavailable(f"scripts/slurm-local.sh start failed (exit {res.returncode}):\n"
                     f"{(res.stdout + res.stderr)[-3000:]}")
    nodes = sh(["sinfo", "-h", "-N", "-o", "%N"], 30).stdout.split()
    yield {"nodes": sorted(set(nodes))}
    if not was_running:  # leave a developer's running cluster alone; stop the one we started
        sh(["bash", SLURM_LOCAL, "stop"], 120)


def job_records(job_id: str) -> list[dict]:
    """`scontrol show job` as dicts, one per job (several for an array)."""
    res = sh(["scontrol", "-o", "show", "job", job_id], 30)
    if res.returncode != 0:
        return []
    return [dict(re.findall(r"(\w+)=(\S*)", line)) for line in res.stdout.splitlines() if line]


class Job:
    def __init__(self, job_id: str, workdir: pathlib.Path, log_glob: str):
        self.id, self.workdir, self.log_glob = job_id, workdir, log_glob
        self.submitted = time.monotonic()

    def logs(self) -> str:
        return "".join(p.read_text(errors="replace")
                       for p in sorted(self.workdir.glob(self.log_glob)))

    def records(self) -> list[dict]:
        return job_records(self.id)

    def state(self) -> str:
        recs = self.records()
        return recs[0].get("JobState", "?") if recs else "?"

    def wait(self, until=None, timeout=JOB_TIMEOUT, what="to finish", poll=1.0) -> list[dict]:
        """Poll until UNTIL(records) (default: every record in a final state)."""
        until = until or (lambda recs: recs and all(r.get("JobState") in TERMINAL for r in recs))
        deadline = self.submitted + timeout if what == "to finish" else time.monotonic() + timeout
        while True:
            recs = self.records()
            if until(recs):
                return recs
            if time.monotonic() > deadline:
                sh(["scancel", self.id], 30)
                states = [(r.get("JobId"), r.get("JobState"), r.get("Reason")) for r in recs]
                pytest.fail(f"job {self.id} did not get {what} within {timeout} s (cancelled); "
                            f"states {states}\n--- log ---\n{self.logs()[-6000:]}")
            time.sleep(poll)

    def finish(self) -> list[dict]:
        recs = self.wait()
        return recs


def submit(text: str, workdir: pathlib.Path, log_glob: str, *extra) -> Job:
    workdir.mkdir(parents=True, exist_ok=True)
    res = sh(["sbatch", "--parsable", *extra], 60, input=text, cwd=workdir)
    assert res.returncode == 0, f"sbatch failed: {res.stderr}"
    return Job(res.stdout.strip().split(";")[0], workdir, log_glob)


def small(template: str, **opts) -> dict:
    """Options that fit the local cluster (2 nodes x 2 CPUs, 2 fake GPUs each)."""
    base = dict(cpus_per_task=1, time="10", script=TRAIN,
                setup=[f". {shlex.quote(sys.prefix)}/bin/activate"])
    base.update(opts)
    return base


# Slurm's own notice that a step waits for another job's step on the same nodes (the jobs
# of this module run at once): scheduling, not noise from the job
QUEUED_STEP = re.compile(r"^srun: (Job \d+ step creation temporarily disabled, retrying "
                         r"\(Requested nodes are busy\)|Step created for job \d+)$", re.M)


def assert_clean(log: str, allow=()):
    log = QUEUED_STEP.sub("", log)
    for bad in NOISE:
        if bad in allow:
            continue
        assert bad not in log, f"job log has {bad!r}:\n{log[-6000:]}"


def without_stack_frames(log: str) -> str:
    """LOG without Open MPI's backtrace lines ("[node1:123] [ 7] libmpi.so...(+0x..)"): after a
    crash of every process they fill the log's end, and the line that says who died first is
    lost from what CI shows."""
    return "\n".join(line for line in log.splitlines()
                     if not re.match(r"\[[^]]+:\d+\] \[ *\d+\] ", line))


def assert_completed(job: Job, recs):
    for r in recs:
        assert r.get("JobState") == "COMPLETED" and r.get("ExitCode") == "0:0", (
            f"job {r.get('JobId')}: {r.get('JobState')} exit {r.get('ExitCode')}\n"
            f"--- log (stack frames left out) ---\n{without_stack_frames(job.logs())[-6000:]}")


# --- all jobs go in at once; each test waits for its own ----------------------------------------

@pytest.fixture(scope="module")
def jobs(slurm, tmp_path_factory):
    base = tmp_path_factory.mktemp("slurm-jobs")
    two_nodes = len(slurm["nodes"]) >= 2
    out = {"two_nodes": two_nodes, "nodes": slurm["nodes"]}

    # Requeue first: it is the longest (three runs).
    d = base / "requeue"
    out["requeue"] = submit(render("single-node-ddp", **small(
        "single-node-ddp", job_name="requeue", tasks_per_node=2, gpus=2,
        args=["--steps", "200", "--step-time", "0.1", "--out", "result.json"])),
        d, "requeue-*.out")

    d = base / "single"
    out["single"] = submit(render("single-node-ddp", **small(
        "single-node-ddp", tasks_per_node=2, gpus=2,
        args=["--steps", "5", "--out", "result.json"])), d, "ddp-1node-*.out")

    # The multi-node job also takes the templates' other scratch branch: a site without
    # SLURM_TMPDIR, where the job makes /tmp/$SLURM_JOB_ID on every node and removes it.
    d = base / "multi"
    opts = small("multi-node-ddp", nodes=2 if two_nodes else 1, tasks_per_node=1, gpus=1,
                 args=["--steps", "5", "--out", "result.json"])
    opts["setup"] = opts["setup"] + ["unset SLURM_TMPDIR  # test: no site scratch"]
    out["multi"] = submit(render("multi-node-ddp", **opts), d, "ddp-nnode-*.out")

    d = base / "stage"
    data = d / "data"
    (data / "sub").mkdir(parents=True)
    (data / "a.bin").write_bytes(os.urandom(1000))
    (data / "sub" / "b.bin").write_bytes(os.urandom(2345))
    out["stage"] = submit(render("stage-then-train", **small(
        "stage-then-train", nodes=2 if two_nodes else 1, tasks_per_node=1, gpus=0,
        stage_src="$SLURM_SUBMIT_DIR/data", args=["--steps", "3", "--out", "result.json"])),
        d, "stage-train-*.out")

    # The same template with a packed data set: its stage step is `hpcddp stage` over MPI.
    d = base / "stage-packed"
    files = d / "files"
    (files / "cls").mkdir(parents=True)
    for i in range(6):
        (files / "cls" / f"{i}.bin").write_bytes(os.urandom(3000))
    res = sh([sys.executable, "-m", "hpcddp", "pack", str(files), str(d / "packed"),
              "--format", "lmdb", "--shard-size", "8K"], 180)
    assert res.returncode == 0, f"hpcddp pack failed: {res.stdout}{res.stderr}"
    out["stage_packed"] = submit(render("stage-then-train", **small(
        "stage-then-train", job_name="stage-packed", nodes=2 if two_nodes else 1,
        tasks_per_node=1, gpus=0, stage_src="$SLURM_SUBMIT_DIR/packed",
        args=["--steps", "3", "--out", "result.json"])), d, "stage-packed-*.out")

    d = base / "sweep"
    out["sweep"] = submit(render("array-sweep", **small(
        "array-sweep", sweep="lr=0.1,0.01", max_parallel=2,
        args=["--steps", "3", "--out", "result-$SLURM_ARRAY_TASK_ID.json"])),
        d, "sweep-*.out")

    d = base / "fail"
    out["fail"] = submit(render("single-node-ddp", **small(
        "single-node-ddp", job_name="fail", tasks_per_node=2, gpus=0,
        args=["--steps", "50", "--step-time", "0.1", "--fail-at-step", "1"])),
        d, "fail-*.out")

    # jobs/mpirun inside an allocation: Open MPI's mpirun reads the nodes from Slurm and starts
    # its daemons with srun (no ssh), across both nodes.
    d = base / "mpirun"
    nodes = 2 if two_nodes else 1
    text = (f"#!/bin/bash\n#SBATCH --job-name=mpirun --nodes={nodes} --ntasks-per-node=1 "
            f"--time=10 --output=%x-%j.out\n"
            f". {shlex.quote(sys.prefix)}/bin/activate\n"
            f"export NODES={nodes} RANKS_PER_NODE=1 SCRIPT={shlex.quote(TRAIN)}\n"
            f"bash {shlex.quote(str(ROOT / 'jobs' / 'mpirun' / 'multi_node_ddp.sh'))} "
            f"--steps 3 --out result.json\n")
    out["mpirun"] = submit(text, d, "mpirun-*.out")

    # cpu-mpi goes through the CLI, as a user would: hpcddp submit ... SCRIPT ARGS.
    d = base / "cpu"
    d.mkdir()
    cmd = [sys.executable, "-m", "hpcddp", "submit", "cpu-mpi", "--nodes", "1",
           "--tasks-per-node", "2", "--cpus-per-task", "1", "--time", "10",
           "--setup", f". {shlex.quote(sys.prefix)}/bin/activate",
           TRAIN, "--steps", "3", "--out", "result.json"]
    res = sh(cmd, 120, cwd=d)
    assert res.returncode == 0, f"hpcddp submit failed: {res.stderr}"
    out["cpu_cli_stderr"] = res.stderr
    out["cpu"] = Job(res.stdout.strip(), d, "cpu-mpi-*.out")
    return out


def result(job: Job, name="result.json") -> dict:
    return json.loads((job.workdir / name).read_text())


# --- the tests -------------------------------------------------------------------------------

def _resume_start_now(job: Job):
    """Slurm holds a requeued job for ~2 minutes (BeginTime): release it now."""
    def running_again(recs):
        if recs and recs[0].get("JobState") == "PENDING":
            sh(["scontrol", "update", f"JobId={job.id}", "StartTime=now"], 30)
        return bool(recs) and recs[0].get("JobState") == "RUNNING"
    return running_again


def _log_after(job: Job, offset: int, pattern: str, timeout: float):
    def seen(_recs):
        return re.search(pattern, job.logs()[offset:]) is not None
    job.wait(until=seen, timeout=timeout, what=f"log line /{pattern}/")


def test_requeued_job_resumes_from_its_checkpoint(jobs):
    """USR1 (the time-limit path) then `scontrol requeue` (the preemption path), then done.

    First in the file: it must signal its job while it still runs.
    """
    job = jobs["requeue"]
    _log_after(job, 0, r"\[rank0\] step 20 ", JOB_TIMEOUT)

    # 1. What --signal=B:USR1@120 does before the time limit: USR1 to the batch script only.
    mark = len(job.logs())
    res = sh(["scancel", "--signal=USR1", "--batch", job.id], 30)
    assert res.returncode == 0, res.stderr
    _log_after(job, mark, r"checkpoint saved, exiting for requeue", 120)
    job.wait(until=lambda recs: recs and recs[0].get("Restarts") == "1", timeout=120,
             what="requeued by its own trap")
    job.wait(until=_resume_start_now(job), timeout=180, what="running again")
    _log_after(job, mark, r"resuming from checkpoint step \d+[\s\S]*\[rank0\] step \d+ ", 180)

    # 2. Preemption / an admin: `scontrol requeue` sends TERM to every rank (KillWait later KILL).
    mark = len(job.logs())
    res = sh(["scontrol", "requeue", job.id], 30)
    assert res.returncode == 0, res.stderr
    job.wait(until=lambda recs: recs and recs[0].get("Restarts") == "2", timeout=120,
             what="requeued by scontrol")
    job.wait(until=_resume_start_now(job), timeout=180, what="running again")

    recs = job.wait(timeout=300, what="to finish after the second requeue")
    assert_completed(job, recs)
    r = result(job)
    log = job.logs()
    resumed = [int(s) for s in re.findall(r"resuming from checkpoint step (\d+)", log)]
    assert len(resumed) == 2 and 0 < resumed[0] < resumed[1] < 199, log[-6000:]
    assert r["resumed_from"] == resumed[1] + 1 and r["restart_count"] == 2, r
    assert "USR1: checkpointing, then requeueing" in log
    # Slurm says what it does on a requeue ("srun: forcing job termination", "slurmstepd-node1:
    # error: *** JOB n CANCELLED ... DUE TO JOB REQUEUE ***"): expected here, nothing else.
    assert_clean(log, allow=("srun: ", "slurmstepd"))



def test_single_node_ddp(jobs):
    job = jobs["single"]
    assert_completed(job, job.finish())
    r = result(job)
    assert r["world_size"] == 2 and r["steps"] == 5 and len(r["hosts"]) == 1
    log = job.logs()
    assert "[rank1] world 2" in log and "[job]" in log
    assert_clean(log)
    assert (job.workdir / "checkpoints" / job.id / "ckpt-000000004.pt").exists()


def test_multi_node_ddp_spans_two_nodes(jobs):
    job = jobs["multi"]
    assert_completed(job, job.finish())
    r = result(job)
    assert r["world_size"] == (2 if jobs["two_nodes"] else 1)
    if jobs["two_nodes"]:
        # two slurmd -N nodes, each with its own hostname: ranks really sit on two nodes
        assert r["hosts"] == jobs["nodes"][:2], r
    log = job.logs()
    assert f"[job] scratch /tmp/{job.id}," in log, log[-3000:]
    assert not os.path.exists(f"/tmp/{job.id}"), "the job's own scratch was not removed"
    assert_clean(log)


def test_stage_then_train_puts_data_on_every_node(jobs):
    job = jobs["stage"]
    assert_completed(job, job.finish())
    r = result(job)
    assert r["data_files"] == 2 and r["data_bytes"] == 3345, r
    log = job.logs()
    ranks = 2 if jobs["two_nodes"] else 1
    for rank in range(ranks):
        assert f"[rank{rank}] data " in log and "2 files, 3345 bytes" in log, log[-4000:]
    assert "staged" in log
    assert_clean(log)


def test_stage_then_train_with_hpcddp_stage(jobs):
    job = jobs["stage_packed"]
    assert_completed(job, job.finish())
    packed = job.workdir / "packed"
    manifest = json.loads((packed / "manifest.json").read_text())
    shards = manifest.get("shards", [])
    r = result(job)
    # every shard, the manifest and READY arrived in the node-local copy
    assert r["data_files"] == len(shards) + 2, (r, len(shards))
    log = job.logs()
    ranks = 2 if jobs["two_nodes"] else 1
    counts = re.findall(r"\[rank(\d)\] data \S+: (\d+) files, (\d+) bytes", log)
    assert len(counts) == ranks and len({c[1:] for c in counts}) == 1, log[-4000:]
    assert_clean(log)


def test_cpu_mpi_via_hpcddp_submit(jobs):
    job = jobs["cpu"]
    assert job.id.isdigit(), jobs["cpu_cli_stderr"]
    assert f"submitted as job {job.id}" in jobs["cpu_cli_stderr"]
    assert_completed(job, job.finish())
    assert result(job)["world_size"] == 2
    assert_clean(job.logs())


def test_array_sweep_runs_every_value(jobs):
    job = jobs["sweep"]
    recs = job.finish()
    assert len(recs) == 2, recs
    assert_completed(job, recs)
    lrs = sorted(result(job, f"result-{i}.json")["lr"] for i in range(2))
    assert lrs == [0.01, 0.1]
    log = job.logs()
    assert "array task 0: --lr 0.1" in log and "array task 1: --lr 0.01" in log
    assert_clean(log)


def test_failing_rank_fails_the_job_promptly(jobs):
    job = jobs["fail"]
    recs = job.finish()
    rec = recs[0]
    assert rec["JobState"] == "FAILED" and rec["ExitCode"] != "0:0", rec
    log = job.logs()
    assert "[rank1] uncaught exception" in log, log[-4000:]
    assert "failing on purpose at step 1" in log
    # rank 0 did not run its 50 steps: the abort ended the job
    assert "done:" not in log
    # MPI_Abort's own banner is expected here; its help text must be readable (no "Sorry!")
    assert_clean(log, allow=("srun: ", "slurmstepd"))




def test_mpirun_script_inside_an_allocation(jobs):
    job = jobs["mpirun"]
    assert_completed(job, job.finish())
    r = result(job)
    assert r["world_size"] == (2 if jobs["two_nodes"] else 1)
    if jobs["two_nodes"]:
        assert r["hosts"] == jobs["nodes"][:2], r
    assert_clean(job.logs())


def test_hpcddp_submit_says_when_a_job_will_never_start(slurm, tmp_path):
    """A shape no node of the partition can hold: Slurm (EnforcePartLimits=NO, its default)
    accepts it and leaves it pending for good; hpcddp submit says so and exits 4."""
    cmd = [sys.executable, "-m", "hpcddp", "submit", "cpu-mpi", "--nodes", "1",
           "--tasks-per-node", "1", "--cpus-per-task", "64", "--time", "5", TRAIN]
    res = sh(cmd, 120, cwd=tmp_path)
    job = res.stdout.strip()
    try:
        assert res.returncode == 4, res.stderr
        assert job.isdigit(), res.stdout
        assert (f"warning: job {job} is pending with reason PartitionConfig: it asks for more "
                f"than the partition's nodes can hold") in res.stderr
        assert f"scancel {job}" in res.stderr
    finally:
        if job.isdigit():
            sh(["scancel", job], 30)
