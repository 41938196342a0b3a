"""Job templates rendered to text: golden files, validation, and `hpcddp submit` with a fake sbatch.

Golden files (tests/golden/*.sbatch) hold each template rendered with non-default options,
including values that are awkward to quote. A mismatch prints a diff; when the change is
intended, regenerate them with

    HPCDDP_UPDATE_GOLDEN=1 python -m pytest tests/unit/test_templates.py

The committed jobs/slurm/*.sbatch must equal the templates rendered with their defaults
(regenerate: python -m hpcddp.launch.templates --write jobs/slurm). Running them on a real
Slurm is tests/test_jobs_slurm.py.
"""
import difflib
import os
import pathlib
import re
import subprocess
import sys
import types

import pytest

from hpcddp.launch import templates as T
from hpcddp.launch.templates import TemplateError, defaults, render

ROOT = pathlib.Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden"

GOLDEN_OPTIONS = {
    "single-node-ddp": dict(
        gpus=8, tasks_per_node=8, cpus_per_task=6, time="2-00:00:00", partition="gpu",
        account="proj-42", script="src/train.py",
        args=["--config", "configs/my run.yaml", "--note", "it's $HOME; `x`"],
        setup=["module load openmpi/5.0", "source $HOME/venvs/train/bin/activate"]),
    "multi-node-ddp": dict(nodes=16, tasks_per_node=4, gpus=4, time="12:00:00",
                           job_name="big.run_1", output="logs/%x-%j.out", signal_lead=300),
    "stage-then-train": dict(stage_src="/lustre/proj/datasets/imagenet-packed",
                             stage_dest="$SCRATCH/imagenet", data_arg="--data-root",
                             nodes=4, args=["--epochs", "90"]),
    "cpu-mpi": dict(nodes=4, tasks_per_node=64, mpi="pmi2", time="30", account="cpu-acct"),
    "array-sweep": dict(sweep="weight-decay=0,1e-4,1e-3", max_parallel=0,
                        output="logs/%x-%A_%a.out", gpus=0, cpus_per_task=4),
}


def _compare(path: pathlib.Path, text: str, regenerate: str):
    if os.environ.get("HPCDDP_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return
    assert path.exists(), f"{path} is missing; {regenerate}"
    want = path.read_text()
    if text != want:
        diff = "".join(difflib.unified_diff(want.splitlines(True), text.splitlines(True),
                                            str(path), "rendered now"))
        pytest.fail(f"{path.name} differs from the rendered template:\n{diff}\n"
                    f"If the change is intended: {regenerate}")


@pytest.mark.parametrize("name", list(GOLDEN_OPTIONS))
def test_golden(name):
    _compare(GOLDEN / f"{name}.sbatch", render(name, **GOLDEN_OPTIONS[name]),
             "HPCDDP_UPDATE_GOLDEN=1 python -m pytest tests/unit/test_templates.py")


@pytest.mark.parametrize("name", list(T.TEMPLATES))
def test_committed_jobs_are_the_rendered_defaults(name):
    t = T.TEMPLATES[name]
    _compare(ROOT / "jobs" / "slurm" / t.filename, render(name),
             "python -m hpcddp.launch.templates --write jobs/slurm")


def test_every_template_has_golden_options():
    assert set(GOLDEN_OPTIONS) == set(T.TEMPLATES)


def _rendered_variants():
    for name in T.TEMPLATES:
        yield pytest.param(name, {}, id=f"{name}-defaults")
        yield pytest.param(name, GOLDEN_OPTIONS[name], id=f"{name}-golden")


@pytest.mark.parametrize("name,opts", list(_rendered_variants()))
def test_rendered_script_is_valid_bash(name, opts, tmp_path):
    path = tmp_path / "job.sbatch"
    path.write_text(render(name, **opts))
    res = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("name,opts", list(_rendered_variants()))
def test_directives_come_before_the_first_command(name, opts):
    # sbatch stops reading #SBATCH lines at the first line that is not a comment.
    lines = render(name, **opts).splitlines()
    assert lines[0] == "#!/bin/bash"
    first_cmd = next(i for i, line in enumerate(lines[1:], 1)
                     if line.strip() and not line.startswith("#"))
    last_directive = max(i for i, line in enumerate(lines) if line.startswith("#SBATCH"))
    assert last_directive < first_cmd


@pytest.mark.parametrize("name", list(T.TEMPLATES))
def test_common_machinery(name):
    text = render(name)
    for needle in ("#SBATCH --signal=B:USR1@120", "#SBATCH --requeue", "--open-mode=append",
                   "--mpi=pmix", "pmi2", "SCRATCH=${SLURM_TMPDIR:-/tmp/$SLURM_JOB_ID}",
                   "export PMIX_MCA_psec=", "trap requeue USR1", "scontrol requeue",
                   "export CKPT_DIR=", "hpcddp run \"$SCRIPT\" \"${ARGS[@]}\"",
                   "--kill-on-bad-exit=1", "export OMP_NUM_THREADS="):
        assert needle in text, f"{name}: missing {needle!r}"


def test_options_show_up_as_directives():
    text = render("multi-node-ddp", nodes=3, tasks_per_node=2, gpus=2, cpus_per_task=5,
                  time="1-12", partition="p1", account="a1", job_name="j1",
                  output="o/%x.%j.log", signal_lead=600)
    for d in ("--nodes=3", "--ntasks-per-node=2", "--gpus-per-node=2", "--cpus-per-task=5",
              "--time=1-12", "--partition=p1", "--account=a1", "--job-name=j1",
              "--output=o/%x.%j.log", "--signal=B:USR1@600"):
        assert f"#SBATCH {d}\n" in text
    assert "##SBATCH --partition" not in text


def test_unset_partition_and_account_are_disabled_directives():
    text = render("single-node-ddp")
    assert "##SBATCH --partition=gpu\n" in text and "##SBATCH --account=myproject\n" in text
    assert "\n#SBATCH --partition" not in text


def test_no_gpu_directive_without_gpus():
    assert "--gpus-per-node" not in render("cpu-mpi")
    assert "--gpus-per-node" not in render("single-node-ddp", gpus=0)


def test_script_and_args_are_shell_quoted(tmp_path):
    args = ["--name", "a b", "it's", "$HOME", "`id`", ""]
    text = render("single-node-ddp", script="my dir/train.py", args=args)
    # Evaluate exactly the two lines bash will see, and read back what it got.
    lines = [ln for ln in text.splitlines() if ln.startswith(("SCRIPT=", "ARGS=("))]
    probe = "\n".join(lines) + '\nprintf "%s\\n" "$SCRIPT" "${#ARGS[@]}" "${ARGS[@]}"\n'
    out = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, timeout=30,
                         env={"HOME": "/nowhere", "PATH": os.environ["PATH"]}).stdout
    assert out.split("\n")[:-1] == ["my dir/train.py", str(len(args)), *args]


def test_sweep_values_and_array_range():
    text = render("array-sweep", sweep="lr=0.1,0.03,0.01", max_parallel=2)
    assert "#SBATCH --array=0-2%2\n" in text
    assert "SWEEP_NAME=lr\n" in text and "SWEEP_VALUES=(0.1 0.03 0.01)\n" in text
    assert "#SBATCH --array=0-2\n" in render("array-sweep", sweep="lr=1,2,3", max_parallel=0)
    assert "${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}" in text  # per-task checkpoints


def test_stage_settings():
    text = render("stage-then-train", stage_src="/gpfs/d", stage_dest="$SCRATCH/x",
                  data_arg="")
    assert 'STAGE_SRC="/gpfs/d"\n' in text and 'STAGE_DEST="$SCRATCH/x"\n' in text
    assert "DATA_ARG=''\n" in text
    assert "hpcddp stage --no-progress \"$STAGE_SRC\" \"$STAGE_DEST\"" in text


def test_render_is_deterministic():
    for name in T.TEMPLATES:
        assert render(name) == render(name)


def test_defaults_lists_only_the_templates_options():
    d = defaults("cpu-mpi")
    assert d["gpus"] == 0 and d["tasks_per_node"] == 32 and "stage_src" not in d
    assert "sweep" in defaults("array-sweep") and "stage_src" in defaults("stage-then-train")


# --- rejected options --------------------------------------------------------------------------

def test_unknown_template_lists_the_valid_ones():
    with pytest.raises(TemplateError) as e:
        render("single-node")
    msg = str(e.value)
    assert "unknown template 'single-node'" in msg
    for name in T.TEMPLATES:
        assert name in msg


def test_unknown_option_lists_the_valid_ones_with_defaults():
    with pytest.raises(TemplateError) as e:
        render("single-node-ddp", gpus_per_node=4)
    msg = str(e.value)
    assert "unknown option 'gpus_per_node'" in msg
    for key in defaults("single-node-ddp"):
        assert f"  {key} (default " in msg
    assert "gpus (default 4)" in msg


def test_option_of_another_template_names_where_it_applies():
    with pytest.raises(TemplateError, match=r"'stage_src' does not apply.*stage-then-train"):
        render("cpu-mpi", stage_src="/x")
    with pytest.raises(TemplateError, match=r"'sweep' does not apply.*array-sweep"):
        render("single-node-ddp", sweep="lr=1")


@pytest.mark.parametrize("opts,match", [
    (dict(nodes=0), "nodes must be >= 1"),
    (dict(nodes="two"), "nodes must be an integer"),
    (dict(nodes=1.5), "nodes must be an integer"),
    (dict(nodes=True), "nodes must be an integer"),
    (dict(gpus=-1), "gpus must be >= 0"),
    (dict(time="1h"), "time must be a Slurm time limit"),
    (dict(time="10:5"), "time must be a Slurm time limit"),
    (dict(job_name="my job"), "job_name may hold"),
    (dict(partition="a;b"), "partition may hold"),
    (dict(output="my log.out"), "output may hold"),
    (dict(script=""), "script must not be empty"),
    (dict(args="--lr 0.1"), "args must be a list of strings"),
    (dict(setup=["module load a\nrm x"]), "setup items must be single lines"),
    (dict(mpi="openmpi"), "mpi must be pmix, pmi2 or none"),
    (dict(job_name="x\ny"), "job_name must be one line"),
])
def test_bad_values_are_refused(opts, match):
    with pytest.raises(TemplateError, match=match):
        render("single-node-ddp", **opts)


@pytest.mark.parametrize("value", ["/data/`id`", "/data/$(id)", '/da"ta', "/da\\ta"])
def test_stage_paths_refuse_shell_tricks(value):
    with pytest.raises(TemplateError, match="stage_src may use"):
        render("stage-then-train", stage_src=value)


@pytest.mark.parametrize("sweep", ["lr", "lr=", "=1,2", "1lr=1", "l r=1"])
def test_bad_sweep(sweep):
    with pytest.raises(TemplateError, match="sweep must look like NAME=V1,V2"):
        render("array-sweep", sweep=sweep)


# --- hpcddp submit -----------------------------------------------------------------------------

@pytest.fixture
def hpcddp(capsys):
    """Run the hpcddp command in this process (torch is imported once, not per call)."""
    from hpcddp.cli import main

    def call(*argv):
        try:
            rc = main(list(argv))
        except SystemExit as exc:  # argparse errors
            rc = exc.code
        out, err = capsys.readouterr()
        return types.SimpleNamespace(returncode=rc, stdout=out, stderr=err)
    return call


def test_submit_knows_every_template_and_option():
    from hpcddp.cli import submit
    assert tuple(T.TEMPLATES) == submit.TEMPLATE_NAMES
    dests = {dest for dest, _, _ in submit.FLAGS.values()}
    assert dests | {"script", "args"} == set(T.OPTIONS)


def test_submit_dry_run_prints_the_rendered_script(hpcddp):
    res = hpcddp("submit", "multi-node-ddp", "--nodes", "3", "--gpus", "2", "--setup",
                 "module load x", "--setup", "module load y", "--dry-run", "train.py",
                 "--epochs", "5", "--nodes", "9")
    assert res.returncode == 0, res.stderr
    assert res.stdout == render("multi-node-ddp", nodes=3, gpus=2,
                                setup=["module load x", "module load y"], script="train.py",
                                args=["--epochs", "5", "--nodes", "9"])


def test_submit_rejects_unknown_options_listing_the_valid_ones(hpcddp):
    res = hpcddp("submit", "cpu-mpi", "--gpus-per-node", "2", "train.py")
    assert res.returncode == 2
    assert "unknown option(s) --gpus-per-node" in res.stderr
    assert "--tasks-per-node" in res.stderr and "--dry-run" in res.stderr


def test_submit_rejects_options_of_other_templates(hpcddp):
    res = hpcddp("submit", "cpu-mpi", "--stage-src", "/x", "--dry-run", "train.py")
    assert res.returncode == 2
    assert "'stage_src' does not apply" in res.stderr and "stage-then-train" in res.stderr


def test_submit_rejects_unknown_template(hpcddp):
    res = hpcddp("submit", "gpu-job", "train.py")
    assert res.returncode == 2 and "invalid choice: 'gpu-job'" in res.stderr


def _fake_sbatch(tmp_path, reply="4242;local", rc=0):
    """An `sbatch` that records its arguments and the script it reads on stdin."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sbatch = bin_dir / "sbatch"
    sbatch.write_text("#!/bin/bash\n"
                      f'printf "%s\\n" "$@" > "{tmp_path}/argv"\n'
                      f'cat > "{tmp_path}/script"\n'
                      f'echo "{reply}"\n'
                      f'[ {rc} = 0 ] || echo "sbatch: error: Batch job submission failed" >&2\n'
                      f"exit {rc}\n")
    sbatch.chmod(0o755)
    return f"{bin_dir}{os.pathsep}{os.environ['PATH']}"


def test_submit_sends_the_script_to_sbatch_and_prints_the_job_id(tmp_path, hpcddp, monkeypatch):
    monkeypatch.setenv("PATH", _fake_sbatch(tmp_path))
    res = hpcddp("submit", "array-sweep", "--sweep", "lr=1,2", "--sbatch=--hold",
                 "--save", str(tmp_path / "saved.sbatch"), "train.py", "--x")
    assert res.returncode == 0, res.stderr
    assert res.stdout == "4242\n"
    assert "submitted as job 4242" in res.stderr
    want = render("array-sweep", sweep="lr=1,2", script="train.py", args=["--x"])
    assert (tmp_path / "script").read_text() == want
    assert (tmp_path / "saved.sbatch").read_text() == want
    assert (tmp_path / "argv").read_text().split() == ["--parsable", "--hold"]


def test_submit_reports_sbatch_failure(tmp_path, hpcddp, monkeypatch):
    monkeypatch.setenv("PATH", _fake_sbatch(tmp_path, reply="", rc=1))
    res = hpcddp("submit", "cpu-mpi", "train.py")
    assert res.returncode == 1
    assert "sbatch failed (exit 1): sbatch: error: Batch job submission failed" in res.stderr


def test_submit_without_sbatch(tmp_path, hpcddp, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no sbatch anywhere
    res = hpcddp("submit", "cpu-mpi", "train.py")
    assert res.returncode == 127 and "sbatch not found" in res.stderr


def test_cli_modules_import_light():
    # Importing hpcddp.comm._mpi would start MPI; torch costs seconds. These modules add
    # neither to what `import hpcddp` itself brings.
    code = ("import sys, hpcddp; before = set(sys.modules);"
            "import hpcddp.cli.run, hpcddp.cli.submit, hpcddp.launch.templates;"
            "heavy = [m for m in ('torch', 'mpi4py.MPI', 'numpy')"
            "         if m in sys.modules and m not in before];"
            "print(heavy); sys.exit(1 if heavy or 'mpi4py.MPI' in sys.modules else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


def test_help_lists_run_and_submit(hpcddp):
    res = hpcddp("--help")
    assert res.returncode == 0, res.stderr
    assert re.search(r"\brun\b", res.stdout) and re.search(r"\bsubmit\b", res.stdout)


@pytest.mark.parametrize("name", ["single-node-ddp", "multi-node-ddp", "stage-then-train",
                                  "cpu-mpi"])
def test_elastic_option_trains_under_mpirun_with_ulfm(name, tmp_path):
    plain, elastic = render(name), render(name, elastic=True)
    assert "--with-ft ulfm" not in plain and "hpcddp run" in plain
    train = elastic[elastic.index("# Train, surviving a lost rank"):]
    assert 'run_step hpcddp launch -- mpirun --with-ft ulfm -n "$SLURM_NTASKS"' in train
    assert "HPCDDP_ELASTIC_SPARES" not in train and "HPCDDP_ELASTIC_REGROW" not in train
    assert "srun" not in train.split("# survivors go on")[-1]     # the step itself: no srun
    assert render(name, elastic="yes") == elastic and render(name, elastic=0) == plain
    script = tmp_path / "job.sbatch"
    script.write_text(elastic)
    res = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    with pytest.raises(TemplateError, match="elastic must be true or false, got 'maybe'"):
        render(name, elastic="maybe")


def test_spares_run_as_spare_processes(tmp_path):
    """spares=N (elastic grow-back): every task starts, the last N as spare processes."""
    text = render("multi-node-ddp", elastic=True, spares=1, nodes=2, tasks_per_node=2)
    train = text[text.index("# Train, surviving a lost rank"):]
    assert "export HPCDDP_ELASTIC_SPARES=1\n" in train
    assert 'mpirun --with-ft ulfm -n "$SLURM_NTASKS"' in train
    assert "SPARES" not in render("multi-node-ddp", elastic=True, nodes=2)
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    res = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    with pytest.raises(TemplateError, match="spares=1 needs elastic=true"):
        render("multi-node-ddp", spares=1)
    with pytest.raises(TemplateError, match="spares must be fewer than the job's 1 x 2 tasks, "
                                            "got 2"):
        render("single-node-ddp", elastic=True, spares=2, tasks_per_node=2)


def test_submit_elastic_flag(tmp_path, hpcddp):
    res = hpcddp("submit", "multi-node-ddp", "--elastic", "--dry-run", "train.py")
    assert res.returncode == 0, res.stderr
    assert "mpirun --with-ft ulfm" in res.stdout and "hpcddp run" not in res.stdout


@pytest.mark.parametrize("restarts, requeued", [(0, True), (2, True), (3, False), (7, False)])
def test_the_time_limit_trap_requeues_at_most_max_requeues_times(tmp_path, restarts, requeued):
    """The trap's function, run in bash with a fake scontrol: requeues while
    SLURM_RESTART_COUNT < MAX_REQUEUES, then checkpoints and ends with status 1."""
    text = render("single-node-ddp", script="train.py")
    assert "MAX_REQUEUES=3" in text
    start = text.index("requeue() {")
    function = text[start:text.index("\n}\n", start) + 3]
    (tmp_path / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/calls\n")
    (tmp_path / "scontrol").chmod(0o755)
    script = f"MAX_REQUEUES=3\n{function}\nrequeue\n"
    res = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30,
                         env={"PATH": f"{tmp_path}:/usr/bin:/bin", "SLURM_JOB_ID": "42",
                              "SLURM_RESTART_COUNT": str(restarts)})
    calls = (tmp_path / "calls").read_text() if (tmp_path / "calls").exists() else ""
    if requeued:
        assert res.returncode == 0 and calls == "requeue 42\n", res.stdout + res.stderr
        assert f"(requeue {restarts + 1} of at most 3)" in res.stdout
    else:
        assert res.returncode == 1 and calls == "", res.stdout + res.stderr
        assert "not requeueing job 42" in res.stdout and "MAX_REQUEUES=3" in res.stdout


def test_max_requeues_is_an_option():
    assert "MAX_REQUEUES=0" in render("cpu-mpi", script="x.py", max_requeues=0)
    with pytest.raises(TemplateError):
        render("cpu-mpi", script="x.py", max_requeues=-1)
