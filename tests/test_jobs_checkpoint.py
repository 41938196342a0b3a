"""hpcddp.parallel.checkpoint: atomic saves, latest-on-restart, signals agreed across ranks,
loading that runs no code planted in the checkpoint directory.

In-process tests cover one rank (no communicator, and torch.distributed with one process);
mpirun jobs cover the real thing: a signal that reaches one rank only makes every rank save
at the same step, every rank resumes from the same file, and a planted file is refused on
every rank.
"""
import dataclasses
import os
import signal
import sys
import textwrap

import pytest
import torch

from hpcddp.launch.mpirun import run_mpi
from hpcddp.parallel import checkpoint as ckpt_mod
from hpcddp.parallel.checkpoint import (Checkpointer, UnsafeCheckpointError, find_latest,
                                        list_checkpoints)


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


def test_a_save_never_prunes_itself(tmp_path):
    """A file at a higher step (an earlier run's, or a planted one) stays "newest"; with keep=1
    the file just saved is kept anyway, and the older ones go."""
    c = Checkpointer(str(tmp_path), keep=1, signals=())
    torch.save({"s": 99}, c.path_for(99))
    c.save({"s": 1}, 1)
    c.save({"s": 2}, 2)
    assert [s for s, _ in list_checkpoints(str(tmp_path))] == [2, 99]


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


# --- loading: weights_only, and what a planted file can and cannot do -----------------------

class Planted:
    """What someone who can write the checkpoint directory leaves there: unpickling it runs
    code (here it only writes MARKER, so a test sees whether it ran)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('planted code ran')",))


def plant(directory, step, marker, prefix="ckpt"):
    """Write a file named as checkpoint STEP holding a Planted object; returns its path."""
    path = os.path.join(str(directory), f"{prefix}-{step:09d}.pt")
    torch.save({"model": {}, "x": Planted(marker)}, path)
    return path


@dataclasses.dataclass
class RunConfig:
    """A user's own type in a checkpoint (module level: pickle names it by module and name)."""
    lr: float
    tag: str


def _train_a_little():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    for _ in range(3):
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return model, opt, sched


def test_real_checkpoint_loads_with_weights_only(tmp_path, monkeypatch):
    """Model, Adam state, scheduler, RNG state, plain values: all load with weights_only=True,
    and into fresh objects they give back the same state."""
    model, opt, sched = _train_a_little()
    c = Checkpointer(str(tmp_path), signals=())
    c.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
            "rng": torch.get_rng_state(), "epoch": 3, "config": {"lr": 0.01, "tags": ["a"]},
            "shape": (4, 8), "ids": {1, 2}, "blob": b"x"}, 3)
    seen = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **kw: seen.append(kw) or real_load(*a, **kw))
    found = c.load_latest()
    assert [kw["weights_only"] for kw in seen] == [True]
    m2, o2, s2 = _train_a_little()   # the same shapes; then overwritten from the checkpoint
    m2.load_state_dict(found.state["model"])
    o2.load_state_dict(found.state["opt"])
    s2.load_state_dict(found.state["sched"])
    for a, b in zip(model.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    for k, v in opt.state_dict()["state"][0].items():
        assert torch.equal(torch.as_tensor(v), torch.as_tensor(o2.state_dict()["state"][0][k]))
    assert s2.state_dict() == sched.state_dict()
    assert found.state["epoch"] == 3 and found.state["shape"] == (4, 8)


def test_demo_checkpoint_loads_with_weights_only(tmp_path):
    """What hpcddp's own demo saves (hpcddp/demo/train.py): its model, SGD with momentum, the
    cosine schedule, its config as a dict, ints."""
    from hpcddp.demo.config import DemoConfig
    from hpcddp.demo.model import build_model
    model = build_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=12)
    model(torch.rand(2, 1, 8, 8)).sum().backward()
    opt.step()
    sched.step()
    c = Checkpointer(str(tmp_path), prefix="demo", signals=())
    c.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(), "epoch": 1, "config": DemoConfig().as_dict(),
            "world_size": 2}, 1)
    state = c.load_latest().state
    build_model(0).load_state_dict(state["model"])
    assert state["config"] == DemoConfig().as_dict() and state["world_size"] == 2


def test_planted_checkpoint_is_refused_and_its_code_never_runs(tmp_path):
    marker = tmp_path / "marker"
    c = Checkpointer(str(tmp_path / "ck"), signals=())
    model, opt, _ = _train_a_little()
    c.save({"model": model.state_dict(), "opt": opt.state_dict()}, 5)
    path = plant(c.directory, 99, marker)
    assert c.latest() == (99, path)
    with pytest.raises(UnsafeCheckpointError) as ei:
        c.load_latest()
    msg = str(ei.value)
    assert not marker.exists(), "the planted file's code ran"
    assert ei.value.path == path and ei.value.global_name == "exec"
    assert f"refused {path}" in msg and "global exec" in msg
    assert "trust_pickle=True" in msg and "safe_globals=" in msg
    # no quiet fall-back: the older checkpoint is named, not loaded
    assert "Nothing older was loaded instead (older here: ckpt-000000005.pt)" in msg
    assert c.latest() == (99, path) and os.path.exists(path)
    os.remove(path)             # what the user does after looking at it
    assert c.load_latest().step == 5 and not marker.exists()


def test_planted_weights_load_the_limit_of_weights_only(tmp_path):
    """What weights_only does not stop (docs/security.md): someone who can write the directory
    can plant plain tensors at a later step, and the job resumes from them. It checks what a
    file can do when loaded, not who wrote it."""
    c = Checkpointer(str(tmp_path), signals=())
    c.save({"w": torch.ones(3)}, 5)
    torch.save({"w": torch.full((3,), 666.0)}, c.path_for(6))   # not written by this job
    found = c.load_latest()
    assert found.step == 6 and torch.equal(found.state["w"], torch.full((3,), 666.0))


def test_the_planted_file_is_live_under_trust_pickle(tmp_path, capfd):
    """The same file with trust_pickle=True runs its code: the option does what its name says
    (and shows that the refusal above is not a plant that could not have run anyway)."""
    marker = tmp_path / "marker"
    c = Checkpointer(str(tmp_path / "ck"), signals=())
    os.makedirs(c.directory)
    plant(c.directory, 7, marker)
    found = c.load_latest(trust_pickle=True)
    assert found.step == 7 and marker.read_text() == "planted code ran"
    err = capfd.readouterr().err
    assert "trust_pickle=True (weights_only=False): code in the file runs" in err


@pytest.mark.parametrize("raw,err,match", [
    (b"not a checkpoint at all", UnsafeCheckpointError, r"cannot read it \(Unsupported operand"),
    (b"\x80\x02cos\nsystem\nq\x00.", UnsafeCheckpointError, "calls os.system, from a module torch never"),
    (b"", RuntimeError, "rank 0 could not load .*EOFError"),
])
def test_other_files_are_refused_naming_them(tmp_path, raw, err, match):
    """A damaged file, a bare pickle of os.system, an empty file: each error names the file."""
    c = Checkpointer(str(tmp_path), signals=())
    path = c.path_for(3)
    with open(path, "wb") as f:
        f.write(raw)
    with pytest.raises(err, match=match) as ei:
        c.load_latest()
    assert path in str(ei.value)


def test_own_types_through_safe_globals(tmp_path):
    c = Checkpointer(str(tmp_path), signals=())
    c.save({"w": torch.ones(2), "cfg": RunConfig(0.1, "a")}, 1)
    with pytest.raises(UnsafeCheckpointError, match=r"needs the global .*RunConfig.*"
                                                    r"safe_globals=\[RunConfig\]"):
        c.load_latest()
    assert c.load_latest(safe_globals=[RunConfig]).state["cfg"] == RunConfig(0.1, "a")
    with torch.serialization.safe_globals([RunConfig]):   # torch's own list is honoured too
        assert c.load_latest().state["cfg"].tag == "a"
    with pytest.raises(UnsafeCheckpointError):          # and only for that load
        c.load_latest()


@pytest.mark.parametrize("kwargs,err,match", [
    (dict(trust_pickle="yes"), TypeError, "trust_pickle must be True or False"),
    (dict(safe_globals="RunConfig"), TypeError, "safe_globals must be a list"),
    (dict(safe_globals=[1]), TypeError, "safe_globals holds 1"),
    (dict(safe_globals=[RunConfig], trust_pickle=True), ValueError, "not both"),
])
def test_bad_load_arguments(tmp_path, kwargs, err, match):
    c = Checkpointer(str(tmp_path), signals=())
    with pytest.raises(err, match=match):
        c.load_latest(**kwargs)


def test_save_never_writes_through_a_planted_name(tmp_path, monkeypatch):
    """The temporary name is created with O_EXCL: a symlink planted there (pointing at one of
    your files) fails the save and the file it points to is untouched."""
    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    c = Checkpointer(str(tmp_path / "ck"), signals=())
    os.makedirs(c.directory)
    monkeypatch.setattr(ckpt_mod.secrets, "token_hex", lambda n: "guessed")
    tmp = os.path.join(c.directory, f".ckpt-000000001.pt.tmp.{os.getpid()}.guessed")
    os.symlink(victim, tmp)
    with pytest.raises(RuntimeError, match="rank 0 could not write .*File exists"):
        c.save({"w": torch.ones(3)}, 1)
    assert victim.read_text() == "mine" and list_checkpoints(c.directory) == []


MPI_PLANTED = textwrap.dedent("""\
    import os, sys
    import torch
    from mpi4py import MPI
    from hpcddp.parallel.checkpoint import Checkpointer, UnsafeCheckpointError

    directory, marker = sys.argv[1], sys.argv[2]
    rank = MPI.COMM_WORLD.Get_rank()
    ck = Checkpointer(directory, comm=MPI.COMM_WORLD, signals=())
    ck.save({"w": torch.ones(2)}, 5)
    if rank == 0:
        class Planted:
            def __reduce__(self):
                return (exec, (f"open({marker!r}, 'w').write('ran')",))
        torch.save({"x": Planted()}, ck.path_for(99))
    MPI.COMM_WORLD.Barrier()
    try:
        ck.load_latest()
        print(f"[rank{rank}] loaded", flush=True)
    except UnsafeCheckpointError as exc:
        print(f"[rank{rank}] refused {exc.path}", flush=True)
    MPI.COMM_WORLD.Barrier()
    print(f"[rank{rank}] marker {os.path.exists(marker)}", flush=True)
""")


def test_planted_checkpoint_refused_on_every_rank(tmp_path):
    path = tmp_path / "planted.py"
    path.write_text(MPI_PLANTED)
    marker = tmp_path / "marker"
    res = run_mpi(2, [sys.executable, str(path), str(tmp_path / "ck"), str(marker)],
                  timeout=180, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    planted = str(tmp_path / "ck" / "ckpt-000000099.pt")
    for r in (0, 1):
        assert f"[rank{r}] refused {planted}" in out and f"[rank{r}] marker False" in out, out
    assert not marker.exists()
