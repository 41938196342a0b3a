"""hpcddp.parallel.checkpoint: atomic saves, latest-on-restart, signals agreed across ranks.

In-process tests cover one rank (no communicator, and torch.distributed with one process);
an mpirun job covers the real thing: a signal that reaches one rank only makes every rank save
at the same step, and every rank resumes from the same file.
"""
import os
import signal
import sys
import textwrap

import pytest
import torch

from hpcddp.launch.mpirun import run_mpi
from hpcddp.parallel.checkpoint import Checkpointer, find_latest, list_checkpoints


@pytest.fixture
def ckpt(tmp_path):
    c = Checkpointer(str(tmp_path / "ck"))
    yield c
    c.restore_signals()


def test_save_then_load_latest(ckpt):
    assert ckpt.load_latest() is None
    ckpt.save({"w": torch.ones(3), "step": 5}, 5)
    ckpt.save({"w": torch.zeros(3), "step": 12}, 12)
    found = ckpt.load_latest()
    assert found.step == 12 and found.state["step"] == 12
    assert torch.equal(found.state["w"], torch.zeros(3))
    assert found.path.endswith("ckpt-000000012.pt")


def test_latest_is_by_step_not_by_time(ckpt):
    ckpt.save({"s": 100}, 100)
    ckpt.save({"s": 9}, 9)  # written later, older step
    assert ckpt.latest()[0] == 100


def test_unfinished_writes_are_not_checkpoints(ckpt):
    ckpt.save({"s": 1}, 1)
    # what a job killed mid-write leaves behind
    with open(os.path.join(ckpt.directory, ".ckpt-000000002.pt.tmp.123"), "wb") as f:
        f.write(b"half")
    assert [s for s, _ in list_checkpoints(ckpt.directory)] == [1]
    assert ckpt.load_latest().step == 1
    ckpt.save({"s": 3}, 3)  # a save leaves no temporary file of its own
    assert sorted(os.listdir(ckpt.directory)) == [
        ".ckpt-000000002.pt.tmp.123", "ckpt-000000001.pt", "ckpt-000000003.pt"]


def test_keep_prunes_old_checkpoints(tmp_path):
    c = Checkpointer(str(tmp_path), keep=2, signals=())
    for step in range(5):
        c.save({"s": step}, step)
    assert [s for s, _ in list_checkpoints(str(tmp_path))] == [3, 4]
    c0 = Checkpointer(str(tmp_path / "all"), keep=0, signals=())
    for step in range(3):
        c0.save({"s": step}, step)
    assert len(list_checkpoints(str(tmp_path / "all"))) == 3


def test_prefixes_do_not_mix(tmp_path):
    a = Checkpointer(str(tmp_path), prefix="model", signals=())
    b = Checkpointer(str(tmp_path), prefix="ema", signals=())
    a.save({"a": 1}, 10)
    b.save({"b": 1}, 20)
    assert find_latest(str(tmp_path), "model")[0] == 10
    assert a.load_latest().state == {"a": 1}


def test_should_save_every_n_steps(tmp_path):
    c = Checkpointer(str(tmp_path), signals=())
    assert [s for s in range(10) if c.should_save(s, every=4)] == [4, 8]
    assert not any(c.should_save(s) for s in range(10))
    assert not c.preempted


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM])
def test_signal_requests_a_checkpoint(ckpt, sig):
    assert not ckpt.requested
    os.kill(os.getpid(), sig)  # the handler only sets a flag
    assert ckpt.requested and ckpt.signal_name == signal.Signals(sig).name
    assert ckpt.should_save(3) and ckpt.preempted


def test_restore_signals(tmp_path):
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda s, f: seen.append(s))
    try:
        c = Checkpointer(str(tmp_path))
        c.restore_signals()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [signal.SIGUSR1] and not c.requested
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_request_without_signals(tmp_path):
    c = Checkpointer(str(tmp_path), signals=())
    c.request()
    assert c.should_save() and c.preempted


@pytest.mark.parametrize("kwargs,match", [
    (dict(directory=""), "directory is empty"),
    (dict(keep=-1), "keep must be >= 0"),
    (dict(prefix="a/b"), "prefix must be a plain file-name prefix"),
    (dict(comm=object()), "comm must be an mpi4py communicator or an hpcddp Communicator"),
])
def test_bad_arguments(tmp_path, kwargs, match):
    kw = dict(directory=str(tmp_path), signals=())
    kw.update(kwargs)
    directory = kw.pop("directory")
    with pytest.raises((ValueError, TypeError), match=match):
        Checkpointer(directory, **kw)


def test_bad_step(tmp_path):
    c = Checkpointer(str(tmp_path), signals=())
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        c.save({}, -1)


def test_write_failure_is_reported(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    c = Checkpointer(str(blocker / "ck"), signals=())
    with pytest.raises(RuntimeError, match="rank 0 could not write"):
        c.save({"a": 1}, 1)


def test_torch_distributed_group_of_one(tmp_path):
    import torch.distributed as dist
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        c = Checkpointer(str(tmp_path / "ck"), signals=())
        assert c._sync.dist is not None
        c.request()
        assert c.should_save(1)
        c.save({"x": 1}, 1)
        assert c.load_latest().state == {"x": 1}
    finally:
        dist.destroy_process_group()


MPI_SCRIPT = textwrap.dedent("""\
    import os, signal, sys
    from mpi4py import MPI
    import hpcddp
    from hpcddp.parallel.checkpoint import Checkpointer

    kind, directory = sys.argv[1], sys.argv[2]
    comm = MPI.COMM_WORLD if kind == "mpi4py" else hpcddp.world()
    rank = MPI.COMM_WORLD.Get_rank()
    size = MPI.COMM_WORLD.Get_size()
    ck = Checkpointer(directory, comm=comm)
    saved_at = None
    for step in range(20):
        if step == 5 and rank == size - 1:
            os.kill(os.getpid(), signal.SIGUSR1)   # only the last rank is signalled
        if ck.should_save(step):
            ck.save({"step": step, "by": rank}, step)
            saved_at = step
            break
    # every rank saw the decision at the same step, though only one got the signal
    steps = MPI.COMM_WORLD.allgather(saved_at)
    assert steps == [5] * size, steps
    again = Checkpointer(directory, comm=comm, signals=())
    found = again.load_latest()
    names = MPI.COMM_WORLD.allgather((found.step, found.path, found.state["by"]))
    assert len(set(names)) == 1 and names[0][0] == 5 and names[0][2] == 0, names
    print(f"[rank{rank}] ok {kind} saved at {saved_at}", flush=True)
""")


@pytest.mark.parametrize("kind", ["mpi4py", "hpcddp"])
def test_signal_on_one_rank_saves_on_all(tmp_path, kind):
    path = tmp_path / "ck_mpi.py"
    path.write_text(MPI_SCRIPT)
    res = run_mpi(2, [sys.executable, str(path), kind, str(tmp_path / "ck")], timeout=180,
                  env=dict(os.environ, PYTHONUNBUFFERED="1"))
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert f"[rank0] ok {kind} saved at 5" in out and f"[rank1] ok {kind} saved at 5" in out
    assert [s for s, _ in list_checkpoints(str(tmp_path / "ck"))] == [5]
