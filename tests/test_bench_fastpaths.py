"""The speed paths `hpcddp bench` led to, checked for correctness in a real 2- and 3-rank job:

- all_reduce plans (hpcddp.collectives._plans), with the C hit and the Python one: a plan must
  never outlive what it describes (tensor resized, memory swapped, another group, a freed
  group, another op, a dead tensor whose id is reused, async and blocking, direct API and
  torch.distributed on the same tensor), and a hit is recorded like any op;
- zero-copy list forms (hpcddp.collectives._lists): all_gather, all_to_all, reduce_scatter
  on separate tensors, views of one buffer, an output that is the input, async, AVG, and
  an op that falls back to the flat path (MAX).
Results are compared with gloo on the same data (exact: integer-valued floats).
"""
import os
import sys
import textwrap

import pytest

from hpcddp.launch.mpirun import run_mpi

SCRIPT = textwrap.dedent(r'''
    import os, torch, torch.distributed as dist, hpcddp
    from hpcddp.collectives import _plans
    from hpcddp.collectives._common import resolve
    from hpcddp.diagnostics import recorder as REC
    EXPECT_KIND = os.environ["EXPECT_KIND"]
    torch.set_num_threads(1)
    hpcddp.init(abort_on_exception=True)
    hpcddp.init_process_group()
    G = dist.new_group(backend="gloo")
    r, n = dist.get_rank(), dist.get_world_size()
    SUM, MAX, AVG = dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.AVG

    def same(a, b, what):
        assert torch.equal(a, b), f"rank {r}: {what}: {a} != {b}"

    def ref_all_reduce(t, op=SUM):
        u = t.clone(); dist.all_reduce(u, op=op, group=G); return u

    # -- plans -----------------------------------------------------------------------------
    t = torch.arange(6, dtype=torch.float32) + r
    for i in range(3):                        # plan made, then used
        want = ref_all_reduce(t)
        hpcddp.all_reduce(t); same(t, want, f"direct #{i}")
        want = ref_all_reduce(t)
        dist.all_reduce(t); same(t, want, f"dist #{i}")
        assert id(t) in _plans.plans, "dist.all_reduce made no plan"  # torch's own ReduceOp
    v = torch.ones(3)
    dist.all_reduce(v); assert id(v) in _plans.plans, "dist.all_reduce alone made no plan"
    want = ref_all_reduce(t, MAX)
    hpcddp.all_reduce(t, op=MAX); same(t, want, "MAX after SUM plan")
    want = ref_all_reduce(t, MAX)
    dist.all_reduce(t, op=MAX); same(t, want, "dist MAX after SUM plan")
    alias = torch.empty(0).set_(t.untyped_storage(), 0, (6,))
    tail = alias[3:].clone()
    t.resize_(3)                              # same memory, fewer elements
    want = ref_all_reduce(t)
    hpcddp.all_reduce(t); same(t, want, "after resize_")
    same(alias[3:], tail, "memory past a shrunk tensor left alone")
    t.set_(torch.full((5,), float(r + 1)))    # new memory, same object
    want = ref_all_reduce(t)
    hpcddp.all_reduce(t); same(t, want, "after set_")
    t.data = torch.full((4,), 2.0)
    want = ref_all_reduce(t)
    hpcddp.all_reduce(t); same(t, want, "after .data =")
    sub = dist.new_group([0, 1])              # another communicator on the same tensor
    sub_gloo = dist.new_group([0, 1], backend="gloo")
    u = torch.full((4,), float(r + 1))
    want = ref_all_reduce(u)
    hpcddp.all_reduce(u); same(u, want, "world before sub")
    if r in (0, 1):
        want = u.clone(); dist.all_reduce(want, group=sub_gloo)
        dist.all_reduce(u, group=sub); same(u, want, "dist on sub after a world plan")
        want = u.clone(); dist.all_reduce(want, group=sub_gloo)
        hpcddp.all_reduce(u, group=sub); same(u, want, "direct with the sub process group")
    want = ref_all_reduce(u)
    hpcddp.all_reduce(u); same(u, want, "world after sub")
    if r in (0, 1):                           # a planned group, then freed: an error, not MPI
        c = sub.hpcddp_comm                   # on a freed handle
        v = torch.ones(2); hpcddp.all_reduce(v, group=c); hpcddp.all_reduce(v, group=c)
        c.free()
        try:
            hpcddp.all_reduce(v, group=c)
        except ValueError as e:
            assert "destroyed" in str(e), e
        else:
            raise AssertionError("all_reduce ran on a freed group")
    world = resolve(None, "test")             # a plan hit is recorded like any op
    y = torch.ones(5); hpcddp.all_reduce(y)
    last = lambda: max((e for e in REC.RECORDER.buf if e is not None and e[2] is world),
                       key=lambda e: e[0])
    e0 = last(); hpcddp.all_reduce(y); e1 = last()
    assert e1 is not e0 and e1[:6] == [e0[0] + 1, "all_reduce", world, y.shape, y.dtype, None] \
        and e1[7] != 0.0 and world.seq == e1[0], (e0, e1)
    assert _plans.KIND == EXPECT_KIND, (_plans.KIND, EXPECT_KIND)
    for i in range(200):                      # ids of dead tensors get reused
        x = torch.full((7,), float(r + i))
        want = ref_all_reduce(x)
        hpcddp.all_reduce(x); same(x, want, f"fresh tensor #{i}")
    for i in range(5):                        # async, both APIs
        x = torch.full((3,), float(r + 1))
        w = hpcddp.all_reduce(x, async_op=True); w.wait()
        same(x, torch.full((3,), float(n * (n + 1) // 2)), f"async direct #{i}")
        dist.all_reduce(x, async_op=True).wait()
        same(x, torch.full((3,), float(n * n * (n + 1) // 2)), f"async dist #{i}")
    x = torch.full((3,), float(r + 1))
    hpcddp.all_reduce(x, op=AVG); same(x, torch.full((3,), (n + 1) / 2), "AVG")
    i32 = torch.full((3,), r + 1, dtype=torch.int32)
    hpcddp.all_reduce(i32); hpcddp.all_reduce(i32)
    same(i32, torch.full((3,), n * (n * (n + 1) // 2), dtype=torch.int32), "int32 twice")

    # -- list forms ------------------------------------------------------------------------
    for count in (1, 5, 70000):
        for dtype in (torch.float32, torch.float64, torch.int64, torch.bfloat16):
            inp = (torch.arange(count) % 97 + 100 * r).to(dtype)
            outs = [torch.empty(count, dtype=dtype) for _ in range(n)]
            ref = [torch.empty(count, dtype=dtype) for _ in range(n)]
            dist.all_gather(ref, inp, group=G)
            hpcddp.all_gather(outs, inp)
            for j in range(n): same(outs[j], ref[j], f"all_gather {count} {dtype} [{j}]")
            flat = torch.empty(n * count, dtype=dtype)         # views of one buffer
            dist.all_gather(list(flat.chunk(n)), inp)
            same(flat, torch.cat(ref), f"all_gather views {count} {dtype}")
            outs = [torch.empty(count, dtype=dtype) for _ in range(n)]
            outs[r] = inp                                       # output r is the input
            w = dist.all_gather(outs, inp, async_op=True); w.wait()
            for j in range(n): same(outs[j], ref[j], f"all_gather aliased {count} {dtype} [{j}]")

            ins = [(torch.arange(count) % 89 + 10 * r + j).to(dtype) for j in range(n)]
            ref_out = [torch.empty(count, dtype=dtype) for _ in range(n)]
            ref_in = torch.cat(ins)
            ref_flat = torch.empty(n * count, dtype=dtype)
            dist.all_to_all_single(ref_flat, ref_in, group=G)
            ref_out = list(ref_flat.chunk(n))
            outs = [torch.empty(count, dtype=dtype) for _ in range(n)]
            hpcddp.all_to_all(outs, ins)
            for j in range(n): same(outs[j], ref_out[j], f"all_to_all {count} {dtype} [{j}]")
            outs = [torch.empty(count, dtype=dtype) for _ in range(n)]
            dist.all_to_all(outs, ins, async_op=True).wait()
            for j in range(n): same(outs[j], ref_out[j], f"all_to_all async {count} {dtype}")

            if dtype == torch.bfloat16 and count > 1000:
                continue   # gloo's bf16 sum order differs from ours; exactness not defined
            for op in (SUM, MAX) + ((AVG,) if dtype.is_floating_point else ()):
                out = torch.empty(count, dtype=dtype)
                want = torch.empty(count, dtype=dtype)
                dist.reduce_scatter_tensor(want, ref_in.clone(), op=op if op is not AVG else SUM, group=G)
                if op is AVG:
                    want = want / n
                hpcddp.reduce_scatter(out, ins, op=op)
                same(out, want.to(dtype), f"reduce_scatter {op} {count} {dtype}")
                out2 = torch.empty(count, dtype=dtype)
                dist.reduce_scatter(out2, ins, op=op, async_op=True).wait()
                same(out2, want.to(dtype), f"reduce_scatter async {op} {count} {dtype}")
    dist.barrier()
    if r == 0:
        print("FASTPATHS OK", flush=True)
''')


# the plan hit in C (built by setup.py: `force` fails the job if it was not) and in Python
@pytest.mark.parametrize("fastpath,kind", [("force", "C"), ("0", "Python (HPCDDP_FASTPATH=0)")])
@pytest.mark.parametrize("nprocs", [2, 3])
def test_fast_paths_match_gloo(nprocs, fastpath, kind, tmp_path):
    script = tmp_path / "fastpaths.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HPCDDP_FASTPATH=fastpath,
               EXPECT_KIND=kind)
    res = run_mpi(nprocs, [sys.executable, str(script)], timeout=400, env=env)
    assert res.returncode == 0 and "FASTPATHS OK" in res.stdout, \
        f"exit {res.returncode}\n{res.stdout[-5000:]}\n{res.stderr[-5000:]}"
