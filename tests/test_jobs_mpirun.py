"""The jobs/mpirun scripts, run as a user would (bash SCRIPT ARGS), with the pip Open MPI.

The committed scripts are hpcddp.launch.templates' renderings (checked first, no MPI needed).
Small shapes (2 ranks, a few steps of jobs/train_tiny.py), every run under a timeout. The
interrupted run gets USR1 the way a scheduler signals a job script; resumed, it must end with
the weights an uninterrupted run has (computed here, in-process, without MPI).
multi_node_ddp.sh runs inside a Slurm allocation in tests/test_jobs_slurm.py.
"""
import difflib
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from hpcddp.launch import templates as T

ROOT = pathlib.Path(__file__).resolve().parents[1]
TRAIN = str(ROOT / "jobs" / "train_tiny.py")
MPIRUN_DIR = ROOT / "jobs" / "mpirun"
TIMEOUT = 240


def env_for(**extra):
    env = dict(os.environ, PYTHONUNBUFFERED="1", SCRIPT=TRAIN,
               MPIRUN=str(pathlib.Path(sys.executable).parent / "mpirun"))
    env.pop("OMP_NUM_THREADS", None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_script(name, *args, cwd, timeout=TIMEOUT, **env):
    return subprocess.run(["bash", str(MPIRUN_DIR / name), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd, env=env_for(**env))


REGENERATE = "python -m hpcddp.launch.templates --write-mpirun jobs/mpirun"


@pytest.mark.parametrize("name", list(T.MPIRUN_SCRIPTS))
def test_committed_script_is_the_rendering(name):
    path = MPIRUN_DIR / T.MPIRUN_SCRIPTS[name].filename
    assert path.exists(), f"{path} is missing; {REGENERATE}"
    text = T.render_mpirun(name)
    if path.read_text() != text:
        diff = "".join(difflib.unified_diff(path.read_text().splitlines(True),
                                            text.splitlines(True), str(path), "rendered now"))
        pytest.fail(f"{path.name} differs from its template:\n{diff}\nEdit "
                    f"hpcddp/launch/templates.py, then: {REGENERATE}")
    assert os.access(path, os.X_OK), f"{path} is not executable; {REGENERATE}"
    check = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stderr


def test_every_script_is_rendered_or_named_as_hand_written():
    rendered = {s.filename for s in T.MPIRUN_SCRIPTS.values()}
    on_disk = {p.name for p in MPIRUN_DIR.glob("*.sh")}
    assert on_disk - rendered == set(T.MPIRUN_HAND_WRITTEN), \
        "a script in jobs/mpirun is neither rendered nor listed in MPIRUN_HAND_WRITTEN"


def test_the_launcher_block_is_written_once():
    # the point of rendering: the mpi_cmd function lives in templates.py once, and every
    # rendered script carries it unchanged
    source = pathlib.Path(T.__file__).read_text()
    assert source.count("mpi_cmd() {") == 1
    for name in T.MPIRUN_SCRIPTS:
        assert T._MPIRUN_LAUNCHER in T.render_mpirun(name)


def test_unknown_script_lists_the_valid_ones():
    with pytest.raises(T.TemplateError, match="valid scripts: single-node-ddp, multi-node-ddp"):
        T.render_mpirun("single_node_ddp.sh")


def reference_weight(steps, world, lr=0.05, batch=32):
    """What jobs/train_tiny.py's DDP computes, on one process: the mean of the ranks' gradients
    is the gradient on their concatenated batches."""
    torch.manual_seed(0)
    true_w = torch.arange(1.0, 9.0).unsqueeze(1)
    model = torch.nn.Linear(8, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    gen = torch.Generator()
    for step in range(steps):
        xs = []
        for rank in range(world):
            gen.manual_seed(1_000_003 * rank + step)
            xs.append(torch.randn(batch, 8, generator=gen))
        x = torch.cat(xs)
        loss = torch.nn.functional.mse_loss(model(x), x @ true_w)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.weight.detach().flatten()


def test_single_node_ddp_checkpoints_on_signal_and_resumes_exactly(tmp_path):
    steps = 60
    log = tmp_path / "run1.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(
            ["bash", str(MPIRUN_DIR / "single_node_ddp.sh"), "--steps", str(steps),
             "--step-time", "0.1", "--out", "result.json"],
            stdout=f, stderr=subprocess.STDOUT, cwd=tmp_path, env=env_for(NPROCS=2),
            start_new_session=True)
    try:
        deadline = time.monotonic() + TIMEOUT
        while not re.search(r"\[rank0\] step 10 ", log.read_text()):
            assert proc.poll() is None, f"ended before step 10:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"no step 10 in {TIMEOUT} s:\n{log.read_text()}"
            time.sleep(0.3)
        # What a scheduler does before the time limit: signal the job script.
        os.kill(proc.pid, signal.SIGUSR1)
        assert proc.wait(timeout=120) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    out1 = log.read_text()
    assert "signal: asking the ranks to checkpoint" in out1, out1
    saved = re.search(r"saved checkpoint step (\d+)", out1)
    assert saved and 10 <= int(saved.group(1)) < steps - 1, out1
    assert not (tmp_path / "result.json").exists()

    res = run_script("single_node_ddp.sh", "--steps", str(steps), "--out", "result.json",
                     cwd=tmp_path, NPROCS=2)
    out2 = res.stdout + res.stderr
    assert res.returncode == 0, out2
    assert f"resuming from checkpoint step {saved.group(1)}" in out2, out2
    r = json.loads((tmp_path / "result.json").read_text())
    assert r["resumed_from"] == int(saved.group(1)) + 1 and r["world_size"] == 2
    got = torch.tensor(r["weight"])
    want = reference_weight(steps, 2)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), (got, want)
    assert "Sorry!" not in out1 + out2


def test_stage_then_train(tmp_path):
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "x.bin").write_bytes(b"x" * 100)
    (data / "sub" / "y.bin").write_bytes(b"y" * 23)
    res = run_script("stage_then_train.sh", "--steps", "3", "--out", "result.json",
                     cwd=tmp_path, RANKS_PER_NODE=2, STAGE_SRC=data,
                     SCRATCH=tmp_path / "scratch")
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    r = json.loads((tmp_path / "result.json").read_text())
    assert r["data_files"] == 2 and r["data_bytes"] == 123, r
    assert (tmp_path / "scratch" / "data" / "sub" / "y.bin").read_bytes() == b"y" * 23
    assert not list((tmp_path / "scratch").glob("*.partial.*"))
    assert "[rank1] data " in out


def test_array_sweep_runs_each_value(tmp_path):
    res = run_script("array_sweep.sh", "--steps", "2", "--out", "$CKPT_DIR/result.json",
                     cwd=tmp_path, NPROCS=1, SWEEP_VALUES="0.5 0.25")
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    lrs = [json.loads((tmp_path / "checkpoints" / "array_sweep" / str(i) /
                       "result.json").read_text())["lr"] for i in range(2)]
    assert lrs == [0.5, 0.25]
    assert "done: 2 runs" in out


def test_cpu_mpi(tmp_path):
    res = run_script("cpu_mpi.sh", "--steps", "2", "--out", "result.json", cwd=tmp_path,
                     RANKS_PER_NODE=2)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert json.loads((tmp_path / "result.json").read_text())["world_size"] == 2
    # 2 ranks on a 2-core machine: one core each, bound (more ranks would oversubscribe)
    if (os.cpu_count() or 1) >= 2:
        assert "--bind-to core" in out
