"""The shared-memory all_reduce and reduce_scatter (hpcddp.collectives._arena): large tensors,
ranks of one node.

Every rank builds every rank's input itself, so the reference needs no message: the sum in
rank order ((x0 + x1) + x2) + ..., computed in the dtype by torch, which is exactly what the
arena computes; the result must match it bit for bit, on every rank. Sizes straddle the
threshold, the chunk (n x slot) boundaries and slices that do not divide evenly.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hpcddp import settings
import hpcddp
from hpcddp.collectives.paths import arena as _arena
from hpcddp.comm._mpi import MPI

MPI_TIMEOUT = 300
# The arena only where it is faster than MPI (a probe); these tests are about its results, and
# 3-4 ranks oversubscribed on 2 cores would lose the race, so take it wherever possible.
settings._current = settings.get().replace(shm_allreduce="force")
R = dist.ReduceOp
pytestmark = pytest.mark.filterwarnings("ignore:.*(is|will be) deprecated:FutureWarning")


@pytest.fixture(scope="module")
def world():
    if not dist.is_initialized():
        hpcddp.init_process_group()
    yield hpcddp.world()


def inputs(dtype, numel: int, n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point or dtype.is_complex:
        # random floats: sums round, so the reduction order shows in the bits
        return [torch.randn(numel, generator=g, dtype=dtype) for _ in range(n)]
    return [torch.randint(-100, 100, (numel,), generator=g).to(dtype) for _ in range(n)]


def in_rank_order(xs: list[torch.Tensor]) -> torch.Tensor:
    out = xs[0] + xs[1]
    for x in xs[2:]:
        out = out + x
    return out


def elements(dtype, nbytes: int) -> int:
    return nbytes // torch.empty(0, dtype=dtype).element_size()


def sizes(comm) -> list[int]:
    """Byte sizes: at the threshold, one chunk +- a little, several chunks and a ragged end."""
    arena = _arena.arena(comm)
    chunk = comm.size * arena.slot * comm.size  # n slots per rank, in bytes over all ranks
    return [_arena.MIN_BYTES, _arena.MIN_BYTES + 8 * 3, chunk - 16, chunk + 40, 3 * chunk + 1000]


def reduced_and_expected(comm, dtype, seed: int):
    """An all_reduce of 2 x MIN_BYTES on COMM: (the result, the rank-order sum)."""
    xs = inputs(dtype, elements(dtype, 2 * _arena.MIN_BYTES), comm.size, seed=seed)
    t = xs[comm.rank].clone()
    hpcddp.all_reduce(t, group=comm)
    return t, in_rank_order(xs)


def assert_same_everywhere(comm, t: torch.Tensor) -> None:
    """Every rank ends with the same bits (compared through a byte-wise allgather)."""
    b = t.view(torch.uint8).numpy()
    allb = comm.mpi.allgather(b.tobytes())
    assert all(x == allb[0] for x in allb), "ranks hold different results"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16,
                                   torch.complex64, torch.int64, torch.int8, torch.uint8])
def test_sum_matches_rank_order_bitwise(world, dtype):
    n, r = world.size, world.rank
    assert _arena.arena(world) is not None, "ranks of one machine should get an arena"
    for nbytes in sizes(world):
        numel = elements(dtype, nbytes)
        xs = inputs(dtype, numel, n, seed=numel)
        want = in_rank_order(xs)
        t = xs[r].clone()
        hpcddp.all_reduce(t, group=world)
        assert torch.equal(t, want), f"{dtype} {numel} elements"
        assert_same_everywhere(world, t)


@pytest.mark.parametrize("api", ["dist", "direct"])
def test_avg_premul_and_async(world, api):
    n, r = world.size, world.rank
    numel = 7 * (elements(torch.float64, 3 * _arena.MIN_BYTES) // 7 + 1)  # a 7 x k tensor
    xs = inputs(torch.float64, numel, n, seed=1)
    ops = {"AVG": (R.AVG, in_rank_order(xs) / n),
           "PREMUL_SUM": (dist._make_nccl_premul_sum(2.0), in_rank_order([2.0 * x for x in xs]))}
    for name, (op, want) in ops.items():
        for async_op in (False, True):
            t = xs[r].clone().view(7, -1)
            fn = dist.all_reduce if api == "dist" else hpcddp.all_reduce
            work = fn(t, op=op, async_op=async_op)
            if async_op:
                assert work.wait() is not False
            assert torch.allclose(t.view(-1), want, rtol=0, atol=1e-12), f"{name} async={async_op}"


@pytest.mark.parametrize("form", ["tensor", "list"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
def test_reduce_scatter_matches_rank_order_bitwise(world, form, dtype):
    n, r = world.size, world.rank
    arena = _arena.arena(world)
    for block_bytes in (_arena.MIN_BYTES // n + 8, arena.slot - 4, 2 * arena.slot + 12):
        c = elements(dtype, block_bytes)
        xs = inputs(dtype, n * c, n, seed=c)
        want = in_rank_order([x[r * c:(r + 1) * c] for x in xs])
        out = torch.full((c,), 7, dtype=dtype)
        if form == "tensor":
            hpcddp.reduce_scatter_tensor(out, xs[r].clone())
        else:
            dist.reduce_scatter(out, list(xs[r].clone().chunk(n)))
        assert torch.equal(out, want), f"{form} {dtype} block of {c}"


def test_reduce_scatter_avg_premul_leave_input(world):
    n, r = world.size, world.rank
    c = elements(torch.float64, _arena.MIN_BYTES)
    xs = inputs(torch.float64, n * c, n, seed=9)
    for op, want in [(R.AVG, in_rank_order([x[r * c:(r + 1) * c] for x in xs]) / n),
                     (dist._make_nccl_premul_sum(2.0),
                      in_rank_order([2.0 * x[r * c:(r + 1) * c] for x in xs]))]:
        inp = xs[r].clone()
        out = torch.empty(c, dtype=torch.float64)
        work = dist.reduce_scatter_tensor(out, inp, op=op, async_op=True)
        work.wait()
        assert torch.allclose(out, want, rtol=0, atol=1e-12)
        assert torch.equal(inp, xs[r]), "the input must not change (PREMUL_SUM scales a copy)"


def test_subgroups_get_their_own_arena(world):
    """A group of some ranks reduces among them only; the others' tensors are untouched."""
    n, r = world.size, world.rank
    members = list(range(0, n, 2)) if n > 2 else [0, 1]
    group = dist.new_group(members)
    numel = elements(torch.float32, 2 * _arena.MIN_BYTES) + 3
    xs = inputs(torch.float32, numel, n, seed=2)
    t = xs[r].clone()
    if r in members:
        dist.all_reduce(t, group=group)
        assert torch.equal(t, in_rank_order([xs[m] for m in members]))
    else:
        assert torch.equal(t, xs[r])
    dist.barrier()


def test_other_ops_and_small_sizes_stay_with_mpi(world):
    """MAX is not the arena's (MPI reduces it); below MIN_BYTES neither is SUM. Both right."""
    n, r = world.size, world.rank
    for numel, op, ref in [(elements(torch.float32, 4 * _arena.MIN_BYTES), R.MAX,
                            lambda xs: torch.stack(xs).amax(0)),
                           (elements(torch.float32, _arena.MIN_BYTES) - 1, R.SUM, in_rank_order)]:
        xs = inputs(torch.float32, numel, n, seed=3)
        t = xs[r].clone()
        hpcddp.all_reduce(t, op=op)
        assert torch.allclose(t, ref(xs), rtol=1e-6, atol=1e-6)


def test_a_rank_that_cannot_map_sends_everyone_to_mpi(world, monkeypatch):
    """Any rank failing to set up the arena -> every rank falls back, nobody hangs."""
    comm = hpcddp.Communicator(world.mpi.Dup(), "shm-refused")  # fresh: no arena yet
    if comm.rank == comm.size - 1:
        def refuse(*a, **k):
            raise OSError(12, "Cannot allocate memory (test)")
        monkeypatch.setattr(_arena.mmap, "mmap", refuse)
    assert _arena.arena(comm) is None
    monkeypatch.undo()
    t, want = reduced_and_expected(comm, torch.float32, seed=4)
    assert torch.allclose(t, want, rtol=1e-6, atol=1e-6)


def test_no_shm_dir_falls_back(world, monkeypatch):
    monkeypatch.setattr(_arena, "SHM_DIR", "/nonexistent-hpcddp-test")
    comm = hpcddp.Communicator(world.mpi.Dup(), "shm-no-dir")
    assert _arena.arena(comm) is None
    monkeypatch.undo()
    t, want = reduced_and_expected(comm, torch.int32, seed=5)
    assert torch.equal(t, want)


def test_arena_file_is_gone(world):
    """The /dev/shm name is unlinked once every rank has mapped it: nothing to clean up."""
    import glob
    import os
    _arena.arena(world)
    world.mpi.Barrier()
    mine = glob.glob(os.path.join(_arena.SHM_DIR, f"hpcddp-{os.getpid()}-*"))
    assert mine == []
    assert MPI.COMM_WORLD.allreduce(len(mine)) == 0


def test_probe_decides_the_same_everywhere(world, monkeypatch):
    """Without "force" a new arena races MPI; whatever wins, every rank agrees and the result
    is right."""
    monkeypatch.setattr(settings, "_current", settings.get().replace(shm_allreduce="auto"))
    comm = hpcddp.Communicator(world.mpi.Dup(), "shm-probe")
    a = _arena.arena(comm)
    chose = comm.mpi.allgather(a is not None)
    assert len(set(chose)) == 1, f"ranks chose differently: {chose}"
    t, want = reduced_and_expected(comm, torch.float32, seed=6)
    assert torch.allclose(t, want, rtol=1e-6, atol=1e-6)


def test_no_room_leaves_no_file(world, monkeypatch):
    """/dev/shm too full for the arena: every rank uses MPI and the half-made file is gone."""
    import glob
    import os

    def full(fd, offset, length):
        raise OSError(28, "No space left on device (test)")
    monkeypatch.setattr(_arena.os, "posix_fallocate", full)
    comm = hpcddp.Communicator(world.mpi.Dup(), "shm-full")
    assert _arena.arena(comm) is None
    monkeypatch.undo()
    assert glob.glob(os.path.join(_arena.SHM_DIR, f"hpcddp-{os.getpid()}-*")) == []
    t, want = reduced_and_expected(comm, torch.float64, seed=7)
    assert torch.allclose(t, want, rtol=1e-12, atol=1e-12)  # MPI's order of the sum may differ


def test_arena_file_is_private_to_its_creator(world, monkeypatch):
    """The /dev/shm file is a regular file, mode 0600, owned by the user who runs the job: no
    other user can open it while it has a name (docs/security.md)."""
    import os
    import stat
    seen = []
    real_unlink = os.unlink

    def look_then_unlink(path, *a, **kw):
        if str(path).startswith(os.path.join(_arena.SHM_DIR, "hpcddp-")):
            seen.append(os.lstat(path))
        return real_unlink(path, *a, **kw)
    monkeypatch.setattr(_arena.os, "unlink", look_then_unlink)
    comm = hpcddp.Communicator(world.mpi.Dup(), "shm-private")
    assert _arena.arena(comm) is not None
    monkeypatch.undo()
    if comm.rank == 0:
        assert len(seen) == 1, seen
        st = seen[0]
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600, oct(st.st_mode)
        assert st.st_uid == os.getuid()
    else:
        assert seen == []   # only the creator unlinks


def test_a_name_planted_in_shm_is_never_opened(world, monkeypatch, tmp_path_factory):
    """O_CREAT | O_EXCL: a symlink (or file) someone left at the arena's name makes rank 0 give
    the arena up, so nothing is written through it; every rank uses MPI and gets the right sum."""
    import os
    monkeypatch.setattr(_arena.secrets, "token_hex", lambda n: "planted0")
    planted = os.path.join(_arena.SHM_DIR, f"hpcddp-{os.getpid()}-planted0")
    target = None
    if world.rank == 0:
        target = tmp_path_factory.mktemp("shm-plant") / "victim"
        target.write_bytes(b"")
        os.symlink(target, planted)
    try:
        comm = hpcddp.Communicator(world.mpi.Dup(), "shm-planted")
        assert _arena.arena(comm) is None
        monkeypatch.undo()
        if comm.rank == 0:
            assert target.read_bytes() == b"" and os.path.islink(planted)
        t, want = reduced_and_expected(comm, torch.int32, seed=8)
        assert torch.equal(t, want)
    finally:
        if world.rank == 0:
            os.unlink(planted)
