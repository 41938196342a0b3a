"""The audit's parts in one process (hpcddp.diagnostics.audit): what a rank sends from its flight
recorder, how the coordinator's ledger compares ranks, and how groups are told apart.

The jobs (small calls that disagree, found at the script's end and while it runs; a clean job
with many look-alike calls that must not be reported): tests/test_hangs.py, audit_* scenarios.
"""
from mpi4py import MPI

from hpcddp.collectives.call import failed
from hpcddp.comm.communicator import Communicator
from hpcddp.diagnostics import audit, mismatch
from hpcddp.diagnostics import recorder as rec

WORLD3 = ("WORLD", (0, 1, 2), 0)


class _Group:
    """What the recorder reads of a group."""
    def __init__(self, key, name="g"):
        self.seq, self.uid, self.name, self.rank = 0, -7, name, 0
        self.world_ranks = (0, 1) if key is None else key[1]
        self.audit_key = key


def _call(op="all_reduce", count=4, dtype="float32", root=None, seq=1):
    return (seq, op, count, dtype, root, (count,))


def test_ranks_that_agree_are_forgotten_once_every_member_sent():
    ledger = audit.Ledger()
    for r in range(3):
        ledger.add(r, {WORLD3: [_call(seq=1), _call(seq=2, op="broadcast", root=1)]}, 0.0)
        assert (len(ledger.calls) == 2) == (r < 2)
    assert ledger.take(0.0) == [] and not ledger.calls


def test_a_dtype_on_one_rank_names_that_rank_as_the_culprit():
    ledger = audit.Ledger()
    ledger.add(0, {WORLD3: [_call()]}, 0.0)
    ledger.add(2, {WORLD3: [_call(dtype="int32")]}, 0.0)
    assert ledger.take(1.0) == []                    # waits for rank 1's call (the majority)
    ledger.add(1, {WORLD3: [_call()]}, 0.0)
    found = ledger.take(1.0)
    assert len(found) == 1, found
    assert "as #1 on WORLD (ranks [0, 1, 2])" in found[0]
    assert ("ranks 0,1 all_reduce(shape=[4], float32); rank 2 all_reduce(shape=[4], int32); "
            "the culprit: rank 2") in found[0]
    ledger.add(1, {WORLD3: [_call(dtype="int64")]}, 1.0)    # the same call again: reported once
    assert ledger.take(2.0, final=True) == []


def test_calls_that_differ_are_reported_after_a_wait_without_every_member():
    ledger = audit.Ledger()
    ledger.add(0, {WORLD3: [_call()]}, 0.0)
    ledger.add(1, {WORLD3: [_call(count=5)]}, 0.0)
    assert ledger.take(audit.WAIT_S - 0.1) == []
    (text,) = ledger.take(audit.WAIT_S)
    assert "rank 0 all_reduce(shape=[4], float32); rank 1 all_reduce(shape=[5], float32)" in text


def test_two_ranks_that_differ_have_no_culprit_and_roots_count():
    pair = ("WORLD", (0, 1), 0)
    ledger = audit.Ledger()
    ledger.add(0, {pair: [_call(op="broadcast", root=0, seq=5)]}, 0.0)
    ledger.add(1, {pair: [_call(op="broadcast", root=1, seq=5)]}, 0.0)
    (text,) = ledger.take(0.0)
    assert "rank 0 broadcast(src=0, shape=[4], float32); rank 1 broadcast(src=1" in text
    assert "culprit" not in text


def test_the_same_count_in_another_shape_agrees():
    ledger = audit.Ledger()
    ledger.add(0, {WORLD3: [(1, "all_reduce", 8, "float32", None, (2, 4))]}, 0.0)
    ledger.add(1, {WORLD3: [(1, "all_reduce", 8, "float32", None, (8,))]}, 0.0)
    assert ledger.take(0.0) == []


def test_groups_with_other_keys_and_calls_not_all_sent_are_pruned():
    ledger = audit.Ledger()
    other = ("WORLD", (0, 1, 2), 1)                  # a second group of the same name and ranks
    ledger.add(0, {WORLD3: [_call()]}, 0.0)
    ledger.add(1, {other: [_call(dtype="int32")]}, 0.0)
    assert ledger.take(0.0, final=True) == [] and len(ledger.calls) == 2
    ledger.prune(audit.KEEP_S + 1.0)
    assert not ledger.calls


def test_collect_sends_ended_tensor_collectives_once():
    key = ("audit-test", (0, 1), 0)
    g = _Group(key)
    done = rec.start(g, "all_reduce", (2, 3), "torch.float32")
    rec.end(done)
    rec.end(rec.start(g, "broadcast", (4,), "float64", 1))
    rec.end(rec.start(g, "all_to_all", (9,), "float32"))     # sizes may differ by rank
    rec.end(rec.start(g, "barrier"))                           # no tensor
    rec.end(rec.start_p2p(g, "send", (4,), "float32", 1))      # two ranks, not the group
    refused = rec.start(g, "all_reduce", (4,), "float32")
    mismatch.refused(refused)                                  # the agreement refused it
    failed(refused)                                            # ... and take saw it raise
    broken = rec.start(g, "all_reduce", (4,), "float32")
    failed(broken)                                             # its path raised
    rec.start(g, "all_reduce", (4,), "float32")                # in flight
    unnamed = _Group(None)
    rec.end(rec.start(unnamed, "all_reduce", (4,), "float32"))
    sent: dict = {}
    rows = audit.collect(sent)
    assert rows.get(key) == [(1, "all_reduce", 6, "float32", None, (2, 3)),
                             (2, "broadcast", 4, "float64", 1, (4,))]
    assert None not in rows
    assert audit.collect(sent).get(key) is None                # sent already
    rec.end(rec.start(g, "all_reduce", (1,), "int64"))
    assert audit.collect(sent)[key] == [(8, "all_reduce", 1, "int64", None, (1,))]


def test_collect_sends_the_most_recent_calls_up_to_its_limit():
    key = ("audit-limit", (0, 1), 0)
    g = _Group(key)
    for _ in range(10):
        rec.end(rec.start(g, "all_reduce", (1,), "float32"))
    assert [c[0] for c in audit.collect({}, limit=3)[key]] == [8, 9, 10]


def test_groups_of_one_name_and_members_are_numbered_in_creation_order():
    a = Communicator(MPI.COMM_SELF, "audit-g", [0])
    b = Communicator(MPI.COMM_SELF, "audit-g", [0])
    c = Communicator(MPI.COMM_SELF, "audit-h", [0])
    assert a.audit_key[:2] == ("audit-g", (0,)) and b.audit_key[2] == a.audit_key[2] + 1
    assert c.audit_key[2] == 0
    assert Communicator(MPI.COMM_SELF).audit_key is None     # a name of this process's own


def test_rank_0s_work_per_look_stays_bounded_in_large_jobs():
    assert audit.rows_per_look(2) == audit.MAX_ROWS
    assert audit.rows_per_look(1024) * 1024 <= max(audit.ALL_ROWS, 32 * 1024)
    assert audit.rows_per_look(1 << 20) == 32


# -- calls in flight (the watchdog's look at long waits) ----------------------------------------

def _waiting(op="all_reduce", shape=(4,), dtype="float32", peer=None, age=3.0, seq=4, gen=0,
             group="WORLD", ranks=(0, 1, 2)):
    return {"op": op, "seq": seq, "group": group, "ranks": list(ranks), "gen": gen,
            "shape": None if shape is None else list(shape), "dtype": dtype, "peer": peer,
            "age": age, "abandoned": False}


def _snaps(*calls, blocked=True):
    return {r: {"inflight": [d], "blocked": blocked} for r, d in enumerate(calls)}


def test_ranks_waiting_in_different_calls_are_found():
    found = audit.differ_in_flight(_snaps(_waiting(), _waiting("broadcast", peer=0),
                                          _waiting()), 2.0)
    assert found == (("WORLD", (0, 1, 2), 0, 4),
                     {("all_reduce", 4, "float32", None): [0, 2],
                      ("broadcast", 4, "float32", 0): [1]}), found
    for odd in (_waiting(shape=(2, 3)), _waiting(dtype="int32"), _waiting("barrier", None, None)):
        assert audit.differ_in_flight(_snaps(_waiting(shape=(2, 2)), odd), 2.0), odd


def test_waits_that_may_end_well_are_not_found():
    same = _waiting(shape=(2, 2))
    for calls, why in (
            ((_waiting(), same), "the same count in another shape"),
            ((_waiting(), _waiting("broadcast", age=1.0)), "one call is younger than the look"),
            ((_waiting(), _waiting("broadcast", gen=1)), "another group of the same name"),
            ((_waiting(gen=None), _waiting("broadcast", gen=None)), "an unnamed group"),
            ((_waiting(), _waiting("broadcast", seq=5)), "another call of the group"),
            ((_waiting("all_to_all", (4,)), _waiting("all_to_all", (6,))), "sizes free by rank"),
            ((_waiting("send", peer=1), _waiting("recv", peer=0)), "point-to-point"),
            ((_waiting(), _waiting("monitored_barrier", None, None)), "its own timeout")):
        assert audit.differ_in_flight(_snaps(*calls), 2.0) is None, why
    assert audit.differ_in_flight(_snaps(_waiting(), _waiting("broadcast"), blocked=False),
                                  2.0) is None, "ranks computing with calls in flight"


def test_a_reduce_op_on_one_rank_is_recorded_under_its_name_and_found():
    import torch.distributed as dist
    from hpcddp.collectives.call import recorded_name
    K = dist.ReduceOp.RedOpType
    assert recorded_name("all_reduce", K.SUM) == "all_reduce"
    assert recorded_name("all_reduce", K.MAX) == "all_reduce[MAX]"
    assert recorded_name("reduce_scatter", K.AVG) == "reduce_scatter[AVG]"
    ledger = audit.Ledger()
    for r in range(3):
        op = recorded_name("all_reduce", K.MAX if r == 2 else K.SUM)
        ledger.add(r, {WORLD3: [_call(op=op)]}, 0.0)
    (text,) = ledger.take(1.0)
    assert ("ranks 0,1 all_reduce(shape=[4], float32); rank 2 all_reduce[MAX](shape=[4], "
            "float32); the culprit: rank 2") in text
