"""Starting the hpcddp backend, in whole jobs under mpirun (each under a timeout).

Both ``hpcddp.init_process_group()`` and plain ``dist.init_process_group("hpcddp")`` work with
nothing set (no MASTER_ADDR/MASTER_PORT, no RANK/WORLD_SIZE); explicit rank/world_size,
init_method and store are honoured; a rank or size that disagrees with MPI is a clear error
on every rank (no hang); a device map "cpu:hpcddp,..." puts CPU tensors on hpcddp; importing
hpcddp registers the backend once and starts no MPI.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from hpcddp.launch.mpirun import run_mpi

TIMEOUT = 150

PRELUDE = """
import os, sys
import torch, torch.distributed as dist
import hpcddp
"""

CHECK = """
n, r = dist.get_world_size(), dist.get_rank()
t = torch.full((3,), float(r + 1))
dist.all_reduce(t)
assert t.eq(n * (n + 1) / 2).all(), t
assert dist.get_backend() == "hpcddp", dist.get_backend()
print(f"ok {r} {n} {dist.get_backend()}", flush=True)
dist.destroy_process_group()
"""

# what a plain mpirun job sees: nothing of torch's rendezvous variables
_TORCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
               "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "GROUP_RANK", "GROUP_WORLD_SIZE",
               "HPCDDP_TORCH_VARS_SET")


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in _TORCH_VARS}
    env.pop("HPCDDP_RANKS_PER_NODE", None)
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def _run(tmp_path, n, body, check=True, **env):
    """Run PRELUDE + BODY (+ CHECK) on N ranks."""
    script = tmp_path / "job.py"
    script.write_text(PRELUDE + textwrap.dedent(body) + (CHECK if check else ""))
    return run_mpi(n, [sys.executable, str(script)], timeout=TIMEOUT, env=_env(**env),
                   cwd=str(tmp_path))


def _oks(res, n):
    lines = sorted(l for l in res.stdout.splitlines() if l.startswith("ok "))
    return lines == sorted(f"ok {r} {n} hpcddp" for r in range(n))


def test_hpcddp_init_process_group_with_nothing_set(tmp_path):
    res = _run(tmp_path, 3, "hpcddp.init_process_group()\n")
    assert res.returncode == 0 and _oks(res, 3), res.stdout + res.stderr


def test_a_second_init_raises_as_torchs_does(tmp_path):
    res = _run(tmp_path, 2, """
        hpcddp.init_process_group()
        for second in (lambda: hpcddp.init_process_group("gloo"),
                       lambda: dist.init_process_group("hpcddp")):
            try:
                second()
            except ValueError as exc:
                assert "twice" in str(exc), exc
            else:
                raise AssertionError("a second init_process_group returned")
    """)
    assert res.returncode == 0 and _oks(res, 2), res.stdout + res.stderr


def test_plain_dist_init_process_group_with_nothing_set(tmp_path):
    res = _run(tmp_path, 2, """
        # RANK is there (hpcddp set torchrun's variables at start-up), MASTER_ADDR is not
        assert "MASTER_ADDR" not in os.environ
        assert os.environ["HPCDDP_TORCH_VARS_SET"].startswith("RANK,WORLD_SIZE,")
        dist.init_process_group("hpcddp")
    """)
    assert res.returncode == 0 and _oks(res, 2), res.stdout + res.stderr


def test_explicit_rank_world_size_and_init_method(tmp_path):
    """rank/world_size given with a tcp:// init_method: torch's rendezvous, hpcddp's ops."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = _run(tmp_path, 2, f"""
        from hpcddp.comm import MPI
        rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
        dist.init_process_group("hpcddp", init_method="tcp://127.0.0.1:{port}", rank=rank,
                                world_size=size)
    """)
    assert res.returncode == 0 and _oks(res, 2), res.stdout + res.stderr


def test_env_rendezvous_when_master_addr_is_set(tmp_path):
    """MASTER_ADDR/PORT set by the user: torch's env:// handler runs, rank and size explicit."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = _run(tmp_path, 2, """
        from hpcddp.comm import MPI
        dist.init_process_group("hpcddp", rank=MPI.COMM_WORLD.Get_rank(),
                                world_size=MPI.COMM_WORLD.Get_size())
    """, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    assert res.returncode == 0 and _oks(res, 2), res.stdout + res.stderr


def test_explicit_store(tmp_path):
    res = _run(tmp_path, 2, """
        from hpcddp.backend import bootstrap_store
        from hpcddp.comm import MPI
        store = bootstrap_store()
        hpcddp.init_process_group(store=store, rank=MPI.COMM_WORLD.Get_rank(),
                                  world_size=MPI.COMM_WORLD.Get_size())
    """)
    assert res.returncode == 0 and _oks(res, 2), res.stdout + res.stderr


@pytest.mark.parametrize("rank_expr,size_expr", [("(r + 1) % n", "n"), ("r", "n + 1")],
                         ids=["rank", "world_size"])
def test_mismatch_with_mpi_is_a_clear_error(tmp_path, rank_expr, size_expr):
    res = _run(tmp_path, 2, f"""
        from hpcddp.backend import bootstrap_store
        from hpcddp.comm import MPI
        r, n = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
        store = bootstrap_store()
        try:
            dist.init_process_group("hpcddp", store=store, rank={rank_expr},
                                    world_size={size_expr})
        except Exception as exc:
            print(f"refused {{r}}: {{exc}}", flush=True)
            sys.exit(0)
        print(f"accepted {{r}}", flush=True)
    """, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = [l for l in res.stdout.splitlines() if l.startswith(("refused", "accepted"))]
    assert len(lines) == 2 and all(l.startswith("refused") for l in lines), res.stdout
    for line in lines:
        assert "disagree with MPI" in line and "world_size=" in line and "launch" in line, line


def test_device_map_puts_cpu_tensors_on_hpcddp(tmp_path):
    """"cpu:hpcddp,cuda:nccl" where CUDA exists; here (CPU torch) the CPU half of such a map."""
    res = _run(tmp_path, 2, """
        backend = "cpu:hpcddp,cuda:nccl" if torch.cuda.is_available() else "cpu:hpcddp"
        hpcddp.init_process_group(backend)
        n, r = dist.get_world_size(), dist.get_rank()
        t = torch.full((3,), float(r + 1))
        dist.all_reduce(t)
        assert t.eq(n * (n + 1) / 2).all(), t
        assert "hpcddp" in str(dist.get_backend()), dist.get_backend()
        print(f"ok {r} {n} hpcddp", flush=True)
    """, check=False)
    assert res.returncode == 0 and _oks(res, 2), res.stdout + res.stderr


def test_import_registers_once_and_starts_no_mpi():
    code = textwrap.dedent("""
        import sys, importlib
        import torch.distributed as dist
        import hpcddp
        assert "mpi4py.MPI" not in sys.modules
        assert "HPCDDP" in dist.Backend._plugins, dist.Backend._plugins
        from hpcddp import backend
        backend.register(); backend.register()   # idempotent
        importlib.reload(hpcddp)                  # a second import: no double registration
        assert "mpi4py.MPI" not in sys.modules
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=_env())
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
