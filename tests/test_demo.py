"""The demo job (`hpcddp demo`) at small scale, and the 1-rank vs N-rank parameter parity.

Three jobs, each 300 digits (240 train, 60 held out), 2 epochs of 8 steps, global batch 30:

* 1 rank, hpcddp, LMDB, float64: the reference;
* 3 ranks on 2 emulated nodes, hpcddp, HDF5, float64: the same parameters to ~1e-12;
* 2 ranks, gloo, LMDB, float32, started through `hpcddp demo --nprocs 2` itself (the
  README's path): the same parameters to float32 rounding.

Every job must evaluate each held-out sample exactly once and print every phase. Then the
reference run is resumed from its epoch-1 checkpoint and must end with the same parameters.
"""
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from hpcddp.launch.mpirun import run_mpi

ROOT = pathlib.Path(__file__).resolve().parents[1]
SMALL = ["--limit", "300", "--epochs", "2", "--batch-size", "30", "--checkpoint-every", "1"]
PHASES = ("launch", "data", "pack", "stage", "setup", "train", "evaluate", "total")
JOB_TIMEOUT = 240


def _env(ranks_per_node):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               HPCDDP_RANKS_PER_NODE=str(ranks_per_node))
    env.pop("HPCDDP_LAUNCHER", None)
    return env


def _job_args(tmp, name, *extra):
    return ["--workdir", str(tmp / name), "--stage-dest", str(tmp / f"{name}-local" / "node{node}"),
            "--save-params", str(tmp / f"{name}.pt"), "--results", str(tmp / f"{name}.json"),
            *SMALL, *extra]


def _check_job(res, tmp, name, nprocs):
    out = res.stdout + res.stderr
    assert res.returncode == 0, f"{name}: exit {res.returncode}\n{out[-6000:]}"
    results = json.loads((tmp / f"{name}.json").read_text())
    assert results["world_size"] == nprocs
    assert results["test_samples"] == 60, "each held-out sample exactly once"
    assert results["train_samples"] == 240
    assert set(PHASES) <= set(results["phases_s"]), results["phases_s"]
    assert 0.0 <= results["accuracy"] <= 1.0
    for phase in ("[data]", "[pack]", "[stage]", "[train] epoch  2/2", "[evaluate]", "[summary]"):
        assert f"[rank0] {phase}" in res.stdout, f"{name}: no '{phase}' line\n{res.stdout}"
    # progress comes from rank 0 only
    assert "[rank1] [train]" not in res.stdout
    ckpts = sorted(os.listdir(tmp / name / "checkpoints"))
    assert ckpts == ["demo-000000001.pt", "demo-000000002.pt"], ckpts
    return results


def _params(path):
    import torch
    return {k: v.double() for k, v in torch.load(path, map_location="cpu").items()}


def _max_diff(a, b):
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Run the three jobs once; the tests below check what they left."""
    tmp = tmp_path_factory.mktemp("demo")
    py = [sys.executable, "-m", "hpcddp", "demo"]
    ran = {}
    ran["ref"] = run_mpi(1, py + _job_args(tmp, "ref", "--dtype", "float64"),
                         timeout=JOB_TIMEOUT, env=_env(1), cwd=str(tmp))
    ran["np3"] = run_mpi(3, py + _job_args(tmp, "np3", "--dtype", "float64", "--format", "hdf5"),
                         timeout=JOB_TIMEOUT, env=_env(2), cwd=str(tmp))
    # through the CLI's own launcher: `hpcddp demo --nprocs 2` starts mpirun itself
    cmd = py + ["--nprocs", "2", "--ranks-per-node", "1", "--timeout", str(JOB_TIMEOUT),
                "--backend", "gloo"] + _job_args(tmp, "gloo2")
    env = _env(1)
    del env["HPCDDP_RANKS_PER_NODE"]
    try:
        ran["gloo2"] = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(tmp),
                                      timeout=JOB_TIMEOUT + 30)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"hpcddp demo --nprocs 2 outlived its own --timeout: {exc}")
    # resume: the reference run again from its epoch-1 checkpoint, as after a preemption
    if ran["ref"].returncode == 0:
        ckpt = tmp / "ref" / "checkpoints"
        (ckpt / "demo-000000002.pt").rename(tmp / "ref-epoch2.ckpt")
        args = _job_args(tmp, "ref", "--dtype", "float64", "--resume")
        args[args.index("--save-params") + 1] = str(tmp / "resumed.pt")
        args[args.index("--results") + 1] = str(tmp / "resumed.json")
        ran["resumed"] = run_mpi(1, py + args, timeout=JOB_TIMEOUT, env=_env(1), cwd=str(tmp))
    return tmp, ran


def test_demo_one_rank_reference(jobs):
    tmp, ran = jobs
    _check_job(ran["ref"], tmp, "ref", 1)


def test_demo_resumes_from_a_checkpoint_exactly(jobs):
    tmp, ran = jobs
    _check_job(ran["ref"], tmp, "ref", 1)
    res = ran["resumed"]
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "resuming from checkpoint step 1" in res.stderr
    assert "[rank0] [train] epoch  1/2" not in res.stdout, "epoch 1 ran again"
    assert "[rank0] [train] epoch  2/2" in res.stdout
    diff = _max_diff(_params(tmp / "ref.pt"), _params(tmp / "resumed.pt"))
    assert diff == 0.0, f"resumed run differs from the uninterrupted one by {diff:.3e}"


def test_demo_three_ranks_hdf5_matches_one_rank_float64(jobs):
    tmp, ran = jobs
    ref = _check_job(ran["ref"], tmp, "ref", 1)
    got = _check_job(ran["np3"], tmp, "np3", 3)
    assert got["nodes"] == 2 and got["format"] == "hdf5"
    assert "3 rank(s) on 2 node(s)" in ran["np3"].stdout
    diff = _max_diff(_params(tmp / "ref.pt"), _params(tmp / "np3.pt"))
    assert diff < 1e-12, f"3 ranks vs 1 rank: parameters differ by {diff:.3e}"
    assert got["accuracy"] == ref["accuracy"]
    assert abs(got["test_loss"] - ref["test_loss"]) < 1e-12


def test_demo_two_ranks_gloo_via_launcher(jobs):
    tmp, ran = jobs
    got = _check_job(ran["gloo2"], tmp, "gloo2", 2)
    assert got["backend"] == "gloo" and got["dtype"] == "float32"
    assert "DDP over gloo on 2 rank(s)" in ran["gloo2"].stdout
    assert "mpirun" in ran["gloo2"].stderr and "-n 2" in ran["gloo2"].stderr
    # float32 on 2 ranks against the float64 reference: the same training up to rounding
    diff = _max_diff(_params(tmp / "ref.pt"), _params(tmp / "gloo2.pt"))
    assert diff < 1e-5, f"2 ranks (float32) vs 1 rank (float64): parameters differ by {diff:.3e}"


# -- no MPI ----------------------------------------------------------------------------------

def test_digits_are_sklearns():
    from sklearn.datasets import load_digits

    from hpcddp.demo.digits import load_arrays
    images, labels = load_arrays()
    d = load_digits()
    assert images.shape == (1797, 8, 8) and images.dtype == np.uint8
    np.testing.assert_array_equal(labels, d.target)
    np.testing.assert_array_equal(images, np.rint(d.images * 255 / 16).astype(np.uint8))


def test_split_is_fixed_stratified_and_disjoint():
    from hpcddp.demo.digits import load_arrays, split_indices
    _, labels = load_arrays()
    train, test = split_indices(labels)
    assert len(train) + len(test) == 1797 and not set(train) & set(test)
    assert (np.bincount(labels[test], minlength=10) >= 35).all()
    again = split_indices(labels)
    np.testing.assert_array_equal(train, again[0])
    tr, te = split_indices(labels, limit=300)
    assert len(tr) + len(te) == 300 and len(te) == 60


def test_write_digits_refuses_foreign_folder(tmp_path):
    from hpcddp.demo.digits import write_digits
    (tmp_path / "mine.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not written by write_digits"):
        write_digits(str(tmp_path), limit=20)
    assert (tmp_path / "mine.txt").exists()


def test_config_round_trip_and_batch_split():
    import argparse

    from hpcddp.demo.config import DemoConfig, add_arguments, from_args
    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = from_args(p.parse_args(["--format", "hdf5", "--epochs", "3", "--resume",
                                  "--batch-size", "30"]))
    assert from_args(p.parse_args(cfg.to_argv())) == cfg
    assert DemoConfig().global_batch(4) == 60 and DemoConfig().global_batch(7) == 63
    with pytest.raises(ValueError, match="does not split evenly across 4 ranks"):
        cfg.global_batch(4)
    with pytest.raises(ValueError, match="--limit"):
        from_args(p.parse_args(["--limit", "5"]))


def test_demo_help_explains_the_phases():
    res = subprocess.run([sys.executable, "-m", "hpcddp", "demo", "--help"], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    for word in ("pack", "stage", "evaluate", "--nprocs", "--backend", "--format", "mpirun"):
        assert word in res.stdout
