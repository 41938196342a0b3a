"""Elastic mode (hpcddp.elastic): a job that loses ranks goes on and ends well.

Each case runs tests/scripts/elastic_train.py (a float64 MLP, 240 samples, global batch 24:
10 steps an epoch, 2 epochs, small gradient buckets) under ``mpirun --with-ft ulfm`` with
ranks SIGKILLing themselves (HPCDDP_ELASTIC_KILL) at a step and phase. Each case checks what
a user would: the job exits 0; exactly the survivors finish; they hold the same parameters
bit for bit; in every epoch each sample was trained on exactly once (counted from every
rank's log, the dead ranks' included: the samples of a step are those of the attempt whose
optimizer update was kept); the lost ranks are the ones killed, and the run holds the steps
it should. Outside elastic mode a lost rank still ends the job at once, naming it.
"""
import collections
import json
import os
import pathlib
import sys
import time

import pytest

from hpcddp.launch.mpirun import mpirun_command, run_mpi

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "tests" / "scripts" / "elastic_train.py")
ULFM = ["--with-ft", "ulfm"]
EPOCHS, BATCH, N = 2, 24, 240
STEPS = EPOCHS * (N // BATCH)
TIMEOUT = 150


def _ulfm_problem():
    try:
        import mpi4py
        from hpcddp.launch.mpirun import find_mpirun
        import subprocess
        info = subprocess.run([os.path.join(os.path.dirname(find_mpirun()), "ompi_info")],
                              capture_output=True, text=True, timeout=60).stdout
    except (OSError, ImportError, subprocess.SubprocessError) as exc:
        return f"no Open MPI to ask for ULFM: {exc}"
    if "FT MPI support: yes" not in info:
        return "this Open MPI is built without ULFM (ompi_info: FT MPI support is not yes)"
    if int(mpi4py.__version__.split(".")[0]) < 4:
        return "mpi4py < 4 has no Comm.Revoke/Shrink"
    return None


_problem = _ulfm_problem()
needs_ulfm = pytest.mark.skipif(_problem is not None, reason=str(_problem))


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for k in ("HPCDDP_RANKS_PER_NODE", "HPCDDP_ELASTIC_KILL", "HPCDDP_LAUNCHER"):
        env.pop(k, None)
    env.update(extra)
    return env


def _run(tmp, nprocs, kill, workers=0, rpn=None):
    env = _env(HPCDDP_ELASTIC_KILL=kill, TMPDIR=str(tmp))
    if rpn:
        env["HPCDDP_RANKS_PER_NODE"] = str(rpn)
    t0 = time.monotonic()
    res = run_mpi(nprocs, [sys.executable, SCRIPT, str(tmp), str(EPOCHS), str(BATCH),
                           str(workers)], timeout=TIMEOUT, env=env, extra=ULFM)
    return res, time.monotonic() - t0


def _check(tmp, res, nprocs, killed):
    out = res.stdout + res.stderr
    assert res.returncode == 0, f"exit {res.returncode}\n{out[-5000:]}"
    survivors = sorted(set(range(nprocs)) - set(killed))
    finals = {int(p.name.split(".")[1]): json.loads(p.read_text()) for p in tmp.glob("final.*.json")}
    assert sorted(finals) == survivors, (sorted(finals), out[-3000:])
    params = {r: f["params"] for r, f in finals.items()}
    assert len(set(params.values())) == 1, "survivors' parameters differ"
    f0 = finals[survivors[0]]
    assert f0["size"] == len(survivors) and f0["global_step"] == STEPS, f0
    lost = sorted(r for rec in f0["recoveries"] for r in rec["lost"])
    assert lost == sorted(killed), (lost, f0["recoveries"])
    for r in killed:
        assert f"[rank{r}] elastic: fault injection: SIGKILL" in out
    assert "elastic: lost rank" in out
    _check_samples(tmp, nprocs)
    return finals


def _check_samples(tmp, nprocs):
    """Each epoch: the kept attempt of every step, over all ranks, holds each sample once."""
    attempts = collections.defaultdict(list)     # (epoch, step, gen) -> indices
    commits = collections.defaultdict(set)       # (epoch, step) -> generations that committed
    for r in range(nprocs):
        for line in (tmp / f"trained.{r}").read_text().splitlines():
            rec = json.loads(line)
            if rec[0] == "attempt":
                _, epoch, step, gen, idx = rec
                attempts[(epoch, step, gen)].extend(idx)
            else:
                _, epoch, step, gen = rec
                commits[(epoch, step)].add(gen)
    assert sorted(s for _, s in commits) == list(range(STEPS)), sorted(commits)
    for epoch in range(EPOCHS):
        seen = collections.Counter()
        for (e, step), gens in commits.items():
            if e == epoch:
                seen.update(attempts[(e, step, max(gens))])
        twice = [i for i, c in seen.items() if c > 1]
        missing = sorted(set(range(N)) - set(seen))
        assert not twice and not missing, f"epoch {epoch}: repeated {twice}, lost {missing}"


@needs_ulfm
@pytest.mark.parametrize("nprocs,kill,workers", [
    (3, "1@5:backward", 0),          # inside a gradient-bucket all-reduce
    (4, "2@3:forward", 0),
    (3, "0@7:optimizer", 0),         # rank 0 (the store's host) lost
], ids=["backward-3", "forward-4", "rank0-optimizer-3"])
def test_one_rank_lost(tmp_path, nprocs, kill, workers):
    res, _ = _run(tmp_path, nprocs, kill, workers)
    _check(tmp_path, res, nprocs, [int(kill.split("@")[0])])


@needs_ulfm
def test_two_failures_one_run(tmp_path):
    res, _ = _run(tmp_path, 4, "3@2:backward,0@13:forward")
    finals = _check(tmp_path, res, 4, [3, 0])
    assert len(finals[1]["recoveries"]) == 2


@needs_ulfm
def test_node_lost(tmp_path):
    """Both ranks of emulated node 1 (HPCDDP_RANKS_PER_NODE=2) die in one step, one while
    loading its batch (a DataLoader worker process runs), one inside a bucket all-reduce: the
    two survivors are node 0, its node group holds both, and there is one node left."""
    res, _ = _run(tmp_path, 4, "2@14:data,3@14:backward", workers=1, rpn=2)
    finals = _check(tmp_path, res, 4, [2, 3])
    for f in finals.values():
        assert f["num_nodes"] == 1 and f["node_group_size"] == 2, f


@needs_ulfm
def test_demo_elastic(tmp_path):
    """`hpcddp demo --elastic` loses rank 1 inside a gradient all-reduce at step 100 of 276
    (epoch 5 of 12) and still ends with held-out accuracy >= 0.95 and exit 0, saying what
    it lost and how long recovery took; without ULFM it refuses at start-up (exit 2, the
    fix named: hpcddp.elastic.support_problem, which State checks too)."""
    import subprocess
    base = [sys.executable, "-m", "hpcddp", "demo", "--elastic", "--workdir", str(tmp_path / "w"),
            "--stage-dest", str(tmp_path / "local" / "node{node}")]
    res = subprocess.run(base + ["--nprocs", "3", "--kill-rank", "1", "--kill-step", "100",
                                 "--results", str(tmp_path / "r.json")],
                         capture_output=True, text=True, timeout=TIMEOUT, env=_env(TMPDIR=str(tmp_path)))
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["accuracy"] >= 0.95 and r["test_samples"] == 359 and r["world_size"] == 2, r
    assert r["elastic"]["lost_ranks"] == [1]
    assert "[rank0] [elastic] lost rank 1, training went on from step" in out, out[-3000:]
    assert "recovery " in out
    assert "kill -> first completed step" in out
    # the same option, run as a one-rank job with no fault tolerance switched on
    res = subprocess.run(base + ["--no-launch"], capture_output=True, text=True, timeout=TIMEOUT,
                         env=_env())
    assert res.returncode == 2, res.stdout + res.stderr
    assert "hpcddp demo --elastic: Open MPI runs this job without fault tolerance" in res.stderr


def _left_behind(tmp, wait=10.0):
    """The job's processes (their command line names TMP) still running after WAIT seconds."""
    import subprocess
    deadline = time.monotonic() + wait
    while True:
        found = subprocess.run(["pgrep", "-f", str(tmp)], capture_output=True, text=True).stdout
        if not found.strip() or time.monotonic() > deadline:
            return found.split()
        time.sleep(0.5)


def _launch(mpirun_cmd, env):
    """MPIRUN_CMD under `hpcddp launch`, as the templates and the demo run elastic jobs (a
    replacement rank is a job of its own for Open MPI's mpirun: its status is read there)."""
    import subprocess
    cmd = [sys.executable, "-m", "hpcddp", "launch", "--timeout", str(TIMEOUT), "--", *mpirun_cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT + 30, env=env)


def _check_regrown(tmp, res, nprocs, killed, line="elastic: replacement for rank {r} started on"):
    """Grown back: every start-up rank finishes (replacements in place of the lost), at full
    size, with the same parameters bit for bit; each sample once; nothing left running. LINE:
    what each replacement says once it joined."""
    out = res.stdout + res.stderr
    assert res.returncode == 0, f"exit {res.returncode}\n{out[-5000:]}"
    finals = {int(p.name.split(".")[1]): json.loads(p.read_text()) for p in tmp.glob("final.*.json")}
    assert sorted(finals) == list(range(nprocs)), (sorted(finals), out[-3000:])
    assert len({f["params"] for f in finals.values()}) == 1, "ranks' parameters differ"
    assert {(f["size"], f["global_step"]) for f in finals.values()} == {(nprocs, STEPS)}, finals
    never_lost = min(set(range(nprocs)) - set(killed))
    recs = finals[never_lost]["recoveries"]
    assert sorted(r for rec in recs for r in rec["lost"]) == sorted(killed), recs
    assert sorted(r for rec in recs for r, _ in rec["replaced"]) == sorted(killed), recs
    for r in set(killed):
        assert f"[rank{r}] " + line.format(r=r) in out, out[-3000:]
    assert "elastic: back to full size" in out and "kill -> full size" in out, out[-3000:]
    _check_samples(tmp, nprocs)
    assert not _left_behind(tmp), "processes left behind"
    return finals


@needs_ulfm
@pytest.mark.parametrize("nprocs,kill,workers", [
    (4, "2@3:forward", 1),                   # one loss replaced, a DataLoader worker per rank
    (3, "0@7:optimizer", 0),                 # rank 0 (the store's host) lost and replaced
    (4, "1@4:backward,3@4:backward", 0),     # two losses at once
    (3, "1@3:backward,1@12:forward", 0),     # the replacement itself lost and replaced
], ids=["one-4", "rank0-3", "two-at-once-4", "replacement-lost-3"])
def test_regrow(tmp_path, nprocs, kill, workers):
    """State(regrow=True) (HPCDDP_ELASTIC_REGROW=1): each lost rank is replaced by a spawned
    process and the job ends at full size."""
    env = _env(HPCDDP_ELASTIC_KILL=kill, HPCDDP_ELASTIC_REGROW="1", TMPDIR=str(tmp_path))
    res = _launch(mpirun_command(nprocs, [sys.executable, SCRIPT, str(tmp_path), str(EPOCHS),
                                          str(BATCH), str(workers)], extra=ULFM), env)
    killed = [int(k.split("@")[0]) for k in kill.split(",")]
    finals = _check_regrown(tmp_path, res, nprocs, killed)
    if kill.count("1@") == 2:
        assert len(finals[0]["recoveries"]) == 2


@needs_ulfm
def test_regrow_without_a_free_slot_goes_on_smaller(tmp_path):
    """3 slots on this host (`--host localhost:3`, no oversubscription): the lost rank's slot
    stays taken, the replacement cannot start, and the job goes on with 2 ranks, saying so;
    `hpcddp launch` gives the survivors' status (mpirun's own is 213 for the failed spawn)."""
    from hpcddp.launch.mpirun import find_mpirun
    env = _env(HPCDDP_ELASTIC_KILL="1@5:backward", HPCDDP_ELASTIC_REGROW="1",
               TMPDIR=str(tmp_path))
    res = _launch([find_mpirun(), "-n", "3", "--host", "localhost:3", "--bind-to", "none",
                   *(["--allow-run-as-root"] if os.geteuid() == 0 else []), *ULFM,
                   sys.executable, SCRIPT, str(tmp_path), str(EPOCHS), str(BATCH), "0"], env)
    out = res.stdout + res.stderr
    _check(tmp_path, res, 3, [1])
    assert "elastic: no free slot for a replacement for rank 1" in out, out[-3000:]
    assert "the job goes on with 2 of 3 ranks" in out
    assert not _left_behind(tmp_path)


SPARE_JOINED = "elastic: spare process took rank {r} on"


def _run_with_spares(tmp, nprocs, spares, kill):
    """NPROCS ranks and SPARES spare processes (HPCDDP_ELASTIC_SPARES; regrow then on by
    default), under `hpcddp launch`."""
    env = _env(HPCDDP_ELASTIC_SPARES=str(spares), TMPDIR=str(tmp),
               **({"HPCDDP_ELASTIC_KILL": kill} if kill else {}))
    return _launch(mpirun_command(nprocs + spares, [sys.executable, SCRIPT, str(tmp), str(EPOCHS),
                                                    str(BATCH), "0"], extra=ULFM), env)


@needs_ulfm
@pytest.mark.parametrize("nprocs,spares,kill", [
    (3, 1, "1@5:backward"),                  # one loss, one spare
    (4, 2, "1@4:backward,3@4:backward"),     # two losses at once, two spares
    (3, 1, "0@7:optimizer"),                 # rank 0 (the store's host) lost
    (3, 2, "1@3:backward,1@12:forward"),     # the spare that replaced rank 1 lost, the next one
], ids=["one-3", "two-at-once-4", "rank0-3", "spare-lost-3"])
def test_spares(tmp_path, nprocs, spares, kill):
    """Spare processes started with the job take the lost ranks' places at once: the job
    ends at full size, parameters equal bit for bit, each sample once, the unused spares
    released, nothing left running; kill -> full size well under a spawn's seconds."""
    res = _run_with_spares(tmp_path, nprocs, spares, kill)
    killed = [int(k.split("@")[0]) for k in kill.split(",")]
    finals = _check_regrown(tmp_path, res, nprocs, killed, line=SPARE_JOINED)
    out = res.stdout + res.stderr
    recs = [rec for f in finals.values() for rec in f["recoveries"]]
    assert all(rec["from_spares"] for rec in recs), recs
    assert "MPI_Comm_spawn" not in out, out[-3000:]
    # the launcher's start-up and the spare's warm-up are behind; 3 s is the target
    assert all(rec["kill_to_full_size_s"] < 3 for rec in recs if rec["kill_to_full_size_s"]), recs
    left = spares - len(killed)
    assert out.count("spare process not needed: released at the job's end") == left, out[-3000:]
    # one node: each process would hold a GPU of its own (a spare, the one after the ranks')
    devices = [f["device_index"] for f in finals.values()]
    assert len(set(devices)) == nprocs, devices


@needs_ulfm
def test_spares_unused_are_released(tmp_path):
    """No rank lost: the spare waits through the whole job and finalizes with it, exit 0."""
    res = _run_with_spares(tmp_path, 3, 1, "")
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    finals = sorted(int(p.name.split(".")[1]) for p in tmp_path.glob("final.*.json"))
    assert finals == [0, 1, 2], out[-3000:]
    assert "[rank3] hpcddp: spare process not needed: released at the job's end" in out
    assert not _left_behind(tmp_path)


@needs_ulfm
def test_spares_all_taken_the_job_goes_on_smaller(tmp_path):
    """Two losses one after the other, one spare: the first is replaced, the second is not
    (the job goes on with 2 of 3, saying so), status 0, nothing left running."""
    res = _run_with_spares(tmp_path, 3, 1, "1@3:backward,2@12:forward")
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-5000:]
    finals = {int(p.name.split(".")[1]): json.loads(p.read_text()) for p in tmp_path.glob("final.*.json")}
    assert sorted(finals) == [0, 1], (sorted(finals), out[-3000:])
    assert len({f["params"] for f in finals.values()}) == 1
    assert {f["size"] for f in finals.values()} == {2}
    assert "[rank1] " + SPARE_JOINED.format(r=1) in out, out[-3000:]
    assert "every spare process (HPCDDP_ELASTIC_SPARES) is taken" in out, out[-3000:]
    assert "the job goes on with 2 of 3 ranks" in out, out[-3000:]
    _check_samples(tmp_path, 3)
    assert not _left_behind(tmp_path)


def test_spares_without_fault_tolerance_say_so(tmp_path):
    """Plain mpirun (no --with-ft ulfm), 3 processes, 1 spare: the world is 2 ranks (an
    all_reduce of ones sums to 2), rank 0 says a lost rank would end the job, the spare is
    released at the end, status 0."""
    script = tmp_path / "sum.py"
    script.write_text("import torch, torch.distributed as dist, hpcddp\n"
                      "hpcddp.init_process_group()\n"
                      "t = torch.ones(1); dist.all_reduce(t)\n"
                      "print(f'sum {t.item():.0f} over {dist.get_world_size()}', flush=True)\n"
                      "dist.destroy_process_group()\n")
    res = run_mpi(3, [sys.executable, str(script)], timeout=TIMEOUT,
                  env=_env(HPCDDP_ELASTIC_SPARES="1"))
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert out.count("sum 2 over 2") == 2, out[-3000:]
    assert ("[rank0] hpcddp.init: HPCDDP_ELASTIC_SPARES=1 but this job runs without fault "
            "tolerance") in out, out[-3000:]
    assert "[rank2] hpcddp: spare process not needed: released at the job's end" in out


def test_spares_differing_between_processes_end_the_job_at_once(tmp_path):
    """HPCDDP_ELASTIC_SPARES=1 given to one process of three (a launcher that did not pass
    it everywhere): every rank says so, the job ends non-zero, nothing hangs."""
    import subprocess
    from hpcddp.launch.mpirun import find_mpirun
    script = tmp_path / "init.py"
    script.write_text("import hpcddp\nhpcddp.init()\nprint('started', flush=True)\n")
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    cmd = [find_mpirun(), *root, "--oversubscribe", "-n", "1", "env", "HPCDDP_ELASTIC_SPARES=1",
           sys.executable, str(script), ":", "-n", "2", sys.executable, str(script)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=_env())
    out = res.stdout + res.stderr
    assert res.returncode != 0, out[-3000:]
    assert "hpcddp.init: HPCDDP_ELASTIC_SPARES differs between the job's processes (0 to 1" \
        in out, out[-3000:]
    assert "started" not in out, out[-3000:]


def test_lost_rank_outside_elastic_mode_ends_the_job():
    """Plain mpirun, plain DDP: a rank SIGKILLed in backward ends the job quickly, named."""
    t0 = time.monotonic()
    res = run_mpi(3, [sys.executable, str(ROOT / "tests" / "scenarios" / "sigkill.py"), "ddp", "1"],
                  timeout=TIMEOUT, env=_env())
    took = time.monotonic() - t0
    out = res.stdout + res.stderr
    assert res.returncode != 0
    # two notices race, either names the rank: mpirun's ("rank 1 ... exited on signal 9") and
    # hpcddp's watchdog, which sees a same-host peer's process gone ("rank 1 died (process gone")
    assert ("rank 1" in out and "signal 9" in out) or "rank 1 died (process gone" in out, out[-3000:]
    assert took < 60, f"the job took {took:.0f} s to end"


def _ulfm_cost_ratios():
    """(hpcddp, gloo) steps/s with --with-ft ulfm over without, per committed pair."""
    runs = ROOT / "docs" / "benchmarks" / "ulfm-cost"
    out = []
    for plain in sorted(runs.glob("plain*.json")):
        ulfm = runs / plain.name.replace("plain", "ulfm")
        a, b = (json.loads(f.read_text())["models"][0]["stats"] for f in (plain, ulfm))
        out.append(tuple(b[k]["steps_per_s"] / a[k]["steps_per_s"] for k in ("hpcddp", "gloo")))
    return out


def test_docs_ulfm_cost_is_the_committed_runs():
    """docs/elastic.md's cost of --with-ft ulfm is docs/benchmarks/ulfm-cost/ (six pairs)."""
    import statistics
    ratios = _ulfm_cost_ratios()
    assert len(ratios) == 6
    page = (ROOT / "docs" / "elastic.md").read_text()
    for i, name in ((0, "hpcddp's"), (1, "gloo's")):
        vals = [r[i] for r in ratios]
        text = (f"{min(vals):.2f}-{max(vals):.2f}, median {statistics.median(vals):.2f}")
        assert text in page, (name, text)
