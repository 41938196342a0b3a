"""Diagnostics without MPI: recorder, settings, the mismatch message, the stall report's text."""
import os
import sys
import threading
import time

import numpy as np
import pytest
import torch

from hpcddp.diagnostics import config, mismatch, recorder, report, state


class FakeComm:
    def __init__(self, name="WORLD", ranks=(0, 1, 2, 3), rank=0, uid=1):
        self.name, self.world_ranks, self.rank, self.uid = name, tuple(ranks), rank, uid
        self.size, self.seq = len(ranks), 0


# -- flight recorder ----------------------------------------------------------------------------

def test_recorder_counts_collectives_per_group_and_p2p_apart():
    rec = recorder.FlightRecorder(8)
    a, b = FakeComm("A", uid=1), FakeComm("B", uid=2)
    e1 = rec.start(a, "all_reduce", torch.Size([4]), torch.float32)
    e2 = rec.start_p2p(a, "send", torch.Size([4]), torch.float32, 1)
    e3 = rec.start(a, "broadcast", torch.Size([2]), torch.float32, 0)
    e4 = rec.start(b, "barrier")
    assert [e1[0], e2[0], e3[0], e4[0]] == [1, 1, 2, 1]    # send does not move A's number
    assert a.seq == 2 and rec.p2p_seq(a) == 1
    recorder.end(e1)
    # within one tick of the recorder's clock only each group's own order is known
    assert sorted(e[recorder.OP] for e in rec.in_flight()) == ["barrier", "broadcast", "send"]


def test_recorder_clock_is_the_watchdog_tick():
    rec = recorder.FlightRecorder(8)
    e = rec.start(FakeComm(), "all_reduce")
    assert e[recorder.T_START] == recorder.TICK[0] > 0 and e[recorder.T_END] == 0.0
    time.sleep(0.01)
    later = recorder.tick()
    recorder.end(e)
    assert e[recorder.T_END] == later > e[recorder.T_START]


def test_recorder_is_a_bounded_ring():
    rec = recorder.FlightRecorder(4)
    c = FakeComm()
    for _ in range(10):
        recorder.end(rec.start(c, "all_reduce"))
    got = rec.entries()
    assert len(got) == 4 and [e[0] for e in got] == [7, 8, 9, 10]


def test_recorder_from_threads_loses_nothing():
    rec = recorder.FlightRecorder(4096)
    comms = [FakeComm(uid=i) for i in range(4)]

    def work(c):
        for _ in range(500):
            recorder.end(rec.start(c, "all_reduce"))
    ts = [threading.Thread(target=work, args=(c,)) for c in comms]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert len(rec.entries()) == 2000


def test_describe_is_plain_data():
    c = FakeComm("group[0, 2]", ranks=(0, 2), rank=1)
    e = recorder.RECORDER.start(c, "reduce", torch.Size([3, 2]), torch.bfloat16, 0)
    d = recorder.describe(e)
    recorder.end(e)
    assert d["op"] == "reduce" and d["shape"] == [3, 2] and d["dtype"] == "bfloat16"
    assert d["group"] == "group[0, 2]" and d["ranks"] == [0, 2] and d["peer"] == 0
    assert d["done_ago"] is None and not d["abandoned"]


# -- settings -----------------------------------------------------------------------------------

def test_settings_defaults_and_overrides():
    s = config.read({})
    assert s.timeout == config.DEFAULT_TIMEOUT and s.policy == "abort" and not s.detail
    assert s.peer_timeout == 5.0 and s.pid_check
    s = config.read({"HPCDDP_TIMEOUT": "4", "HPCDDP_STALL_POLICY": "warn",
                     "HPCDDP_DEBUG": "detail", "HPCDDP_PID_CHECK": "0"})
    assert (s.timeout, s.policy, s.detail, s.peer_timeout, s.pid_check) == (4.0, "warn", True,
                                                                            4.0, False)
    assert config.read({"HPCDDP_TIMEOUT": "off"}).timeout is None
    assert config.read({"HPCDDP_TIMEOUT": "0"}).timeout is None


@pytest.mark.parametrize("env, words", [
    ({"HPCDDP_STALL_POLICY": "kill"}, "abort or warn"),
    ({"HPCDDP_TIMEOUT": "soon"}, "seconds"),
    ({"HPCDDP_TIMEOUT": "-3"}, "seconds"),
    ({"HPCDDP_PEER_TIMEOUT": "x"}, "HPCDDP_PEER_TIMEOUT"),
])
def test_bad_settings_are_rejected_with_the_valid_ones(env, words):
    with pytest.raises(ValueError, match=words):
        config.read(env)


def test_timeout_accepts_timedelta():
    from datetime import timedelta
    assert config.timeout_from(timedelta(minutes=2)) == 120.0


def test_detail_in_a_list():
    assert config.detail_enabled({"HPCDDP_DEBUG": "trace,detail"})
    assert not config.detail_enabled({"HPCDDP_DEBUG": "1"})


def test_job_id():
    assert config.job_id({"SLURM_JOB_ID": "123", "SLURM_STEP_ID": "0"}) == "123.0"
    assert config.job_id({"PMIX_NAMESPACE": "prterun-vm-14592@1"}) == "prterun-vm-14592-1"
    assert config.job_id({}) == ""


# -- mismatch check -----------------------------------------------------------------------------

def _rows(*calls):
    return np.stack([mismatch.fingerprint(*c) for c in calls])


def test_mismatch_message_names_the_odd_rank():
    rows = _rows(("all_reduce", 5, [4], torch.float32), ("broadcast", 5, [4], torch.float32, 0),
                 ("all_reduce", 5, [4], torch.float32), ("all_reduce", 5, [4], torch.float32))
    msg = mismatch.mismatch_message("WORLD", range(4), rows)
    assert "rank 1 called broadcast(src=0, shape=[4]) while ranks 0,2,3 called " \
           "all_reduce(shape=[4])" in msg
    assert msg.startswith("collective mismatch on group WORLD at collective #5")


def test_mismatch_shows_seq_and_dtype_only_when_they_differ():
    rows = _rows(("all_reduce", 5, [4], torch.float32), ("all_reduce", 6, [4], torch.float64))
    msg = mismatch.mismatch_message("g", [3, 7], rows)
    assert "rank 3 called all_reduce #5(shape=[4], dtype=float32)" in msg
    assert "rank 7 called all_reduce #6(shape=[4], dtype=float64)" in msg


def test_fingerprint_ignores_shapes_where_they_may_differ():
    a = mismatch.fingerprint("all_to_all", 1, [3, 2], torch.float32)
    b = mismatch.fingerprint("all_to_all", 1, [5, 2], torch.float32)
    assert (a == b).all()
    big = mismatch.fingerprint("all_reduce", 1, [1] * 8, torch.float32)
    assert "8 dims" in mismatch.describe(big)


def test_mismatch_three_kinds_in_rank_order():
    rows = _rows(("barrier", 2), ("all_reduce", 2, [1], torch.float32),
                 ("all_reduce", 2, [1], torch.float32), ("gather", 2, [1], torch.float32, 0))
    msg = mismatch.mismatch_message("WORLD", range(4), rows)
    assert "rank 0 called barrier(), rank 3 called gather(dst=0, shape=[1]) while ranks 1,2 " \
           "called all_reduce(shape=[1])" in msg


def test_collectives_choose_the_checked_record_only_when_enabled():
    import hpcddp.collectives._common as common
    if config.detail_enabled():
        assert common.record is mismatch.checked_start
    else:
        # default: the recorder plus the agreement of large collectives (nothing else)
        assert common.record is mismatch.agreed_start


def test_agreement_message_names_the_odd_rank_and_every_call():
    row = lambda count, dtype=1, red=0, root=-1: [1, 4, count, dtype, red, root]  # noqa: E731
    text = mismatch.agreement_message("WORLD", [0, 1, 2], [row(100), row(100), row(96)])
    assert text.startswith("all_reduce #4 on group WORLD: the ranks disagree")
    assert "rank 0 (count 100, float32, op SUM); rank 1 (count 100, float32, op SUM); " \
           "rank 2 (count 96, float32, op SUM)" in text
    assert "The culprit: rank 2," in text
    text = mismatch.agreement_message("g", [4, 5], [row(8, dtype=6), row(8)])
    assert "rank 0 (world rank 4) (count 8, int32, op SUM)" in text
    assert "No majority" in text and "culprit: rank" not in text


# -- the report ---------------------------------------------------------------------------------

def _op(op, seq, age, shape=(4,), group="WORLD", ranks=(0, 1, 2, 3), peer=None, done=None):
    return {"op": op, "seq": seq, "group": group, "ranks": list(ranks), "grank": 0,
            "shape": list(shape) if shape is not None else None, "dtype": "float32",
            "peer": peer, "age": age, "done_ago": done, "abandoned": False}


def _snap(rank, inflight=(), seq=0, where="train.py:88 (in step)", blocked=None, **kw):
    last = _op("all_reduce", seq, 9.0, done=8.0) if seq else None
    s = {"rank": rank, "host": "n1", "pid": 100 + rank, "inflight": list(inflight),
         "groups": [{"group": "WORLD", "ranks": [0, 1, 2, 3], "seq": seq, "p2p_seq": 0,
                     "last": last, "recent": [last] if last else []}],
         "where": where, "stack": f'  File "train.py", line 88, in step', "threads": {},
         "exception": None, "finalizing": False,
         "blocked": bool(inflight) if blocked is None else blocked}
    s.update(kw)
    return s


def test_report_names_ranks_that_never_arrived():
    snaps = {r: _snap(r, [_op("all_reduce", 57, 6.0)], seq=56) for r in (0, 2)}
    snaps[1] = _snap(1, [_op("broadcast", 57, 6.5, peer=0)], seq=56)
    snaps[3] = _snap(3, seq=56)
    a = report.analyse(snaps, {}, 4)
    text = "\n".join(a["lines"])
    assert "ranks 0,2 have waited 6.0 s in all_reduce #57 (shape=[4], float32) on WORLD" in text
    assert "rank 1 called broadcast #57 (src=0, shape=[4], float32) on WORLD instead" in text
    assert "rank 3 has not called all_reduce #57 on WORLD: it is in Python at train.py:88 " \
           "(in step)" in text
    assert a["stall"] and any("HPCDDP_DEBUG=detail" in h for h in a["hints"])


def test_report_groups_ranks_with_the_same_story():
    snaps = {0: _snap(0, [_op("all_reduce", 57, 6.0)], seq=56)}
    for r in (1, 3):
        snaps[r] = _snap(r, seq=56)
    snaps[2] = _snap(2, [_op("all_reduce", 57, 6.0)], seq=56)
    text = "\n".join(report.analyse(snaps, {}, 4)["lines"])
    assert "ranks 1,3 have not called all_reduce #57 on WORLD; they are in Python at " \
           "train.py:88 (in step)" in text


def test_report_names_dead_and_unresponsive_ranks():
    snaps = {r: _snap(r, [_op("all_reduce", 4, 3.5)], seq=3) for r in (0, 2)}
    gone = {1: {"host": "n1", "pid": 4242, "pid_state": "dead", "waited": 0.0},
            3: {"host": "n2", "pid": 77, "pid_state": "unknown", "waited": 5.0}}
    a = report.analyse(snaps, gone, 4)
    text = "\n".join(a["lines"])
    assert "rank 1 is dead: its process (pid 4242 on n1) has exited" in text
    assert "rank 3 is dead or unresponsive: it did not answer the diagnostics exchange within " \
           "5.0 s" in text
    full = report.render(snaps, gone, 4, timeout=3, policy="abort", job="j", reporter=0,
                         reason="r")
    assert "rank 1 (n1, pid 4242): dead" in full and "--- rank 0, main thread ---" in full


def test_report_finalize_and_exception():
    snaps = {r: _snap(r, [_op("all_reduce", 3, 3.2)], seq=2) for r in (0, 1, 3)}
    snaps[2] = _snap(2, [_op("finalize", 2, 3.4)], seq=2, finalizing=True, blocked=True,
                     exception="ValueError: corrupt sample in batch 3")
    text = "\n".join(report.analyse(snaps, {}, 4)["lines"])
    assert "rank 2 has not called all_reduce #3 on WORLD: it is in hpcddp's finalize: its " \
           "script has ended after an uncaught exception (ValueError: corrupt sample in " \
           "batch 3)" in text


def test_a_rank_that_ended_without_a_call_others_wait_in_is_named_at_once():
    """The coordinator's look after a rank's script ended (watchdog._look_at_the_end)."""
    fin = dict(finalizing=True, blocked=True)
    snaps = {r: _snap(r, [_op("all_reduce", 6, 1.5)], seq=5) for r in (0, 1, 3)}
    snaps[2] = _snap(2, [_op("finalize", 5, 1.6)], seq=5, **fin)
    op, ended = report.ended_without(snaps, 4)
    assert (op["op"], op["seq"], ended) == ("all_reduce", 6, [2])
    # the root of a broadcast ends first: its others still receive #6, which it made
    snaps[2] = _snap(2, [_op("finalize", 6, 1.6)], seq=6, **fin)
    assert report.ended_without(snaps, 4)[1] == []
    # the ranks wait on a group without the ended rank: not its call
    sub = dict(group="group[0, 1]", ranks=(0, 1))
    snaps = {r: _snap(r, [_op("all_reduce", 1, 4.0, **sub)], seq=5) for r in (0, 1)}
    snaps[3] = _snap(3, seq=5)
    snaps[2] = _snap(2, [_op("finalize", 5, 4.1)], seq=5, **fin)
    assert report.ended_without(snaps, 4)[1] == []
    # others computing, nobody waits: nothing to say
    snaps = {r: _snap(r, seq=5) for r in (0, 1, 3)}
    snaps[2] = _snap(2, [_op("finalize", 5, 4.1)], seq=5, **fin)
    assert report.ended_without(snaps, 4) == (None, [])
    # the ended rank's recorder holds nothing of the group: cannot be told, not reported
    snaps = {r: _snap(r, [_op("all_reduce", 6, 1.5)], seq=5) for r in (0, 1, 3)}
    snaps[2] = _snap(2, [_op("finalize", 5, 1.6)], seq=5, groups=[], **fin)
    assert report.ended_without(snaps, 4)[1] == []


def _stuck(snaps, size=4):
    return {r: peers for r, (_, peers) in report.p2p_stuck(snaps, size).items()}


def test_a_send_or_receive_whose_peer_ended_without_its_half_is_named_at_once():
    """The coordinator's looks (after a rank's script ended, at long waits), for
    point-to-point waits whose peers have ended."""
    fin = dict(finalizing=True, blocked=True)
    ended = _snap(3, [_op("finalize", 5, 2.0)], seq=5, **fin)
    snaps = {0: _snap(0, seq=5), 1: _snap(1, [_op("recv", 1, 1.5, peer=3)], seq=5),
             2: _snap(2, seq=5), 3: ended}
    got = report.p2p_stuck(snaps, 4)
    assert list(got) == [1] and got[1][0]["op"] == "recv" and got[1][1] == [3]
    # a blocking send to the ended rank (MPI's rendezvous waits for a receive)
    snaps[1] = _snap(1, [_op("send", 1, 1.5, peer=3)], seq=5)
    assert _stuck(snaps) == {1: [3]}
    # a receive from any rank: only once every other member has ended
    snaps[1] = _snap(1, [_op("recv", 1, 1.5)], seq=5)
    assert _stuck(snaps) == {}
    for r in (0, 2):
        snaps[r] = _snap(r, [_op("finalize", 5, 2.0)], seq=5, **fin)
    assert _stuck(snaps) == {1: [0, 2, 3]}
    # not told: the ended rank left an isend towards it in flight (it may still arrive) ...
    snaps = {0: _snap(0, seq=5), 1: _snap(1, [_op("recv", 1, 1.5, peer=3)], seq=5),
             2: _snap(2, seq=5),
             3: _snap(3, [_op("finalize", 5, 2.0), _op("send", 2, 2.1, peer=1)], seq=5, **fin)}
    assert _stuck(snaps) == {}
    # ... the peer still runs, the wait is young, or the rank also waits for a live rank
    snaps[3] = _snap(3, seq=5, where="train.py:12 (in send_back)")
    assert _stuck(snaps) == {}
    snaps[3] = ended
    snaps[1] = _snap(1, [_op("recv", 1, 0.2, peer=3)], seq=5)
    assert _stuck(snaps) == {}
    snaps[1] = _snap(1, [_op("recv", 1, 1.5, peer=3), _op("recv", 2, 1.5, peer=2)], seq=5)
    assert _stuck(snaps) == {}
    # a collective in flight is the other looks' (ended_without); a rank not blocked waits not
    snaps[1] = _snap(1, [_op("recv", 1, 1.5, peer=3), _op("all_reduce", 6, 1.5)], seq=5)
    assert _stuck(snaps) == {}
    snaps[1] = _snap(1, [_op("recv", 1, 1.5, peer=3)], seq=5, blocked=False)
    assert _stuck(snaps) == {}
    # on a subgroup: the peer is a group rank, mapped to its world rank
    sub = dict(group="group[1, 3]", ranks=(1, 3))
    snaps[1] = _snap(1, [_op("recv", 1, 1.5, peer=1, **sub)], seq=5)
    assert _stuck(snaps) == {1: [3]}


def test_a_point_to_point_deadlock_is_named_at_once():
    """Ranks that wait for each other in sends and receives, nothing else running."""
    def waiting(r, *ops, threads=0):
        return _snap(r, list(ops), seq=5, main_blocked=True, running_threads=threads)
    # both receive first
    snaps = {0: waiting(0, _op("recv", 1, 2.5, peer=1)), 1: waiting(1, _op("recv", 1, 2.5, peer=0)),
             2: _snap(2, seq=5), 3: _snap(3, seq=5)}
    assert _stuck(snaps) == {0: [1], 1: [0]}
    # a cycle of three, one of them a large blocking send
    snaps[1] = waiting(1, _op("send", 1, 2.5, peer=2))
    snaps[2] = waiting(2, _op("recv", 1, 2.5, peer=0))
    assert _stuck(snaps) == {0: [1], 1: [2], 2: [0]}
    # one isend left in flight towards a receiver (not waited for: it may match): no deadlock
    snaps = {0: waiting(0, _op("send", 1, 3.0, peer=1), _op("recv", 2, 2.5, peer=1)),
             1: waiting(1, _op("send", 1, 3.0, peer=0), _op("recv", 2, 2.5, peer=0)),
             2: _snap(2, seq=5), 3: _snap(3, seq=5)}
    assert _stuck(snaps) == {}
    # a peer whose other thread still runs may yet send; so may one whose main thread does not
    # wait (the wait is in another thread)
    snaps = {0: waiting(0, _op("recv", 1, 2.5, peer=1)),
             1: waiting(1, _op("recv", 1, 2.5, peer=0), threads=1),
             2: _snap(2, seq=5), 3: _snap(3, seq=5)}
    assert _stuck(snaps) == {}
    snaps[1] = _snap(1, [_op("recv", 1, 2.5, peer=0)], seq=5, main_blocked=False,
                     running_threads=0)
    assert _stuck(snaps) == {}
    # the peer waits for a third rank that still runs: it may go on, and then send
    snaps[1] = waiting(1, _op("recv", 1, 2.5, peer=2))
    assert _stuck(snaps) == {}
    # a snapshot from a rank that did not answer: nothing is said
    snaps[1] = None
    assert _stuck(snaps) == {}
    # snapshots taken apart: rank 2 answered 1 s after rank 1, and its latest call (a
    # send to 0) began 0.5 s before its answer: what it sent to rank 1 just before may not
    # have arrived when rank 1 answered (seen in tests/scenarios/p2p_waits.py)
    snaps = {0: waiting(0, _op("recv", 1, 3.0, peer=1)), 3: _snap(3, seq=5),
             1: dict(waiting(1, _op("recv", 1, 3.0, peer=2)), wall=100.0),
             2: dict(waiting(2, _op("send", 2, 0.5, peer=0)), wall=101.0)}
    snaps[0]["wall"] = 100.0
    assert _stuck(snaps) == {}
    snaps[2]["wall"] = 100.2           # answered together: rank 2 silent 0.3 s before ... still
    assert _stuck(snaps) == {}         # too young; 1.5 s before: the deadlock is sure
    snaps[2]["inflight"][0]["age"] = 1.7
    assert _stuck(snaps) == {0: [1], 1: [2], 2: [0]}
    # a call that *ended* a moment before the answer counts too: rank 1's worker thread sent
    # to rank 0 and ended between the two answers, so rank 1 looks silent (its main thread
    # waits, nothing else runs) while its message is on its way (seen in p2p_waits.py)
    snaps = {0: dict(waiting(0, _op("recv", 2, 2.0, peer=1)), wall=100.0),
             1: dict(waiting(1, _op("recv", 3, 3.0, peer=0)), wall=100.4, quiet_for=0.1),
             2: _snap(2, seq=5), 3: _snap(3, seq=5)}
    assert _stuck(snaps) == {}
    snaps[1]["quiet_for"] = 1.6         # it ended 1.2 s before rank 0 answered: not on its way
    assert _stuck(snaps) == {0: [1], 1: [0]}


def test_ranks_in_finalize_waiting_for_python_is_not_a_stall():
    snaps = {r: _snap(r, [_op("finalize", 9, 5.0)], seq=9, finalizing=True) for r in (1, 2, 3)}
    snaps[0] = _snap(0, seq=9, where="train.py:120 (in save_checkpoint)")
    a = report.analyse(snaps, {}, 4)
    assert not a["stall"]
    assert "rank 0: in Python at train.py:120 (in save_checkpoint)" in "\n".join(a["lines"])


def test_async_op_never_waited_is_not_a_stall():
    snaps = {r: _snap(r, seq=3) for r in (1, 2, 3)}
    snaps[0] = _snap(0, [_op("send", 1, 40.0, peer=1)], seq=3, blocked=False)
    r, op = report.stalled_op(snaps)
    assert op is None


def test_p2p_stall_names_the_peer():
    snaps = {0: _snap(0, [_op("recv", 2, 4.0, peer=3)], seq=5), 1: _snap(1, seq=5),
             2: _snap(2, seq=5), 3: _snap(3, seq=5, where="train.py:12 (in send_back)")}
    text = "\n".join(report.analyse(snaps, {}, 4)["lines"])
    assert "rank 0 has waited 4.0 s in recv #2 (from rank 3, shape=[4], float32) on WORLD" in text
    assert "rank 3 (its peer) is in Python at train.py:12 (in send_back)" in text


def test_format_ranks():
    assert report.format_ranks([0, 2, 3]) == "0,2,3"
    assert report.format_ranks([7, 0, 1, 2, 3, 9, 10]) == "0-3,7,9,10"


# -- this rank's state --------------------------------------------------------------------------

def test_snapshot_sees_a_thread_blocked_in_hpcddp_code():
    import hpcddp.diagnostics.mismatch as m   # any file under hpcddp/diagnostics counts
    ev = threading.Lock()
    ev.acquire()
    # a C-level wait called from a function "in" hpcddp/diagnostics, as an MPI call would be
    code = compile("def wait(lock):\n    lock.acquire()\n", m.__file__, "exec")
    ns = {}
    exec(code, ns)
    t = threading.Thread(target=ns["wait"], args=(ev,), name="blocked-one")
    t.start()
    try:
        time.sleep(0.05)
        assert (t.ident, "blocked-one") in state.blocked_threads()
        snap = state.snapshot(0, "h", os.getpid())
        assert "blocked-one" in snap["threads"] and snap["blocked"]
        assert snap["where"].startswith("test_diagnostics.py:")
    finally:
        ev.release()
        t.join()


def test_user_frame_skips_library_frames():
    f = sys._getframe()
    assert state.where(f).startswith("test_diagnostics.py:")


def test_a_rank_that_finished_its_part_of_a_ring_is_not_a_mismatch():
    """A ring or tree lets a rank complete call #57 while the others still wait in it (a lossy
    link to the next rank): it then waits in #58. That is no mismatch."""
    snaps = {r: _snap(r, [_op("all_reduce", 57, 20.0)], seq=56) for r in (0, 2, 3)}
    done = _op("all_reduce", 57, 9.0, done=8.0)
    snaps[1] = _snap(1, [_op("all_reduce", 58, 8.0)], seq=57)
    snaps[1]["groups"][0]["recent"] = [done]
    text = "\n".join(report.analyse(snaps, {}, 4)["lines"])
    assert "rank 1 has finished its part of #57 and waits in the next call" in text
    assert "matched with different ones" not in text
    # a different call as #57 on that rank stays a mismatch
    snaps[1]["groups"][0]["recent"] = [_op("broadcast", 57, 9.0, done=8.0)]
    assert "matched with different ones" in "\n".join(report.analyse(snaps, {}, 4)["lines"])


def test_a_rank_ahead_in_a_pipeline_is_not_a_mismatch():
    """The staging ring holds one recorder entry per round; a leader whose neighbour still
    has chunks to pass runs several rounds ahead of a leader that stopped."""
    snaps = {0: _snap(0, [_op("stage:ring", 25, 5.0)], seq=24),
             1: _snap(1, [_op("stage:ring", 20, 6.1)], seq=19)}
    snaps[0]["groups"][0]["recent"] = [_op("stage:ring", q, 6.0, done=5.5) for q in range(20, 25)]
    text = "\n".join(report.analyse(snaps, {}, 2)["lines"])
    assert "rank 1 has waited 6.1 s in stage:ring #20" in text
    assert "rank 0 has finished its part of #20 to #24 and waits in stage:ring #25" in text
    assert "matched with different ones" not in text
    # another op among those calls stays a mismatch
    snaps[0]["groups"][0]["recent"][2] = _op("stage:agree", 22, 6.0, done=5.5)
    assert "matched with different ones" in "\n".join(report.analyse(snaps, {}, 2)["lines"])
    # a collective every rank completes together cannot legitimately run ahead: a rank that
    # completed #20-#24 of all_reduce while another waits in #20 had them matched elsewhere
    coll = {0: _snap(0, [_op("all_reduce", 25, 5.0)], seq=24),
            1: _snap(1, [_op("all_reduce", 20, 6.1)], seq=19)}
    coll[0]["groups"][0]["recent"] = [_op("all_reduce", q, 6.0, done=5.5) for q in range(20, 25)]
    assert "matched with different ones" in "\n".join(report.analyse(coll, {}, 2)["lines"])


def test_a_rank_waiting_on_its_own_node_is_named():
    """Both leaders of the staging ring wait in the same round; one says its own writer
    thread holds every buffer: the report names it, and that is no mismatch."""
    snaps = {0: _snap(0, [_op("stage:ring", 23, 6.0)], seq=22),
             1: _snap(1, [_op("stage:ring", 23, 6.0)], seq=22)}
    snaps[1]["inflight"][0]["peer"] = "this node's writer thread"
    res = report.analyse(snaps, {}, 2)
    text = "\n".join(res["lines"])
    assert "ranks 0,1 have waited 6.0 s in stage:ring #23" in text
    assert "rank 1 waits for this node's writer thread, not for another rank" in text
    assert "matched with different ones" not in text and "differ" not in text
    assert any("its own node" in h for h in res["hints"])


SS = """\
0      0      10.9.0.2:40000 10.9.0.3:50000 ino:11 sk:1 cgroup:/ <->
\t ts sack cubic wscale:7,7 rto:1600 backoff:3 rtt:0.5/0.2 segs_out:40 segs_in:12 retrans:1/9
0      0      10.9.0.2:40001 10.9.0.1:50001 ino:12 sk:2 cgroup:/ <->
\t ts sack cubic wscale:7,7 rto:204 rtt:0.05/0.02 segs_out:9000 segs_in:9000
0      0      10.9.0.2:40002 10.9.0.3:50002 ino:99 sk:3 cgroup:/ <->
\t ts sack cubic rto:204 rtt:0.05/0.02 segs_out:5 segs_in:5 retrans:0/5
"""


def test_tcp_counters_per_peer_of_this_process_only():
    from hpcddp.diagnostics import network
    got = network.parse_ss(SS, inodes={"11", "12"})       # socket 99 is another process's
    assert got == {"peers": {"10.9.0.3": [40, 9, 3], "10.9.0.1": [9000, 0, 0]},
                   "local": ["10.9.0.2"]}
    before = {"peers": {"10.9.0.3": [20, 1, 0], "10.9.0.1": [8000, 0, 0]}}
    assert network.since(before, got)["peers"] == {"10.9.0.3": [20, 8, 3], "10.9.0.1": [1000, 0, 0]}


def test_stall_report_names_the_lossy_link():
    from hpcddp.diagnostics import network
    snaps = {r: _snap(r, [_op("all_reduce", 57, 20.0)], seq=56) for r in range(3)}
    for r, host in enumerate(("node1", "node2", "node3")):
        snaps[r]["host"] = host
        snaps[r]["tcp"] = {"peers": {}, "local": [f"10.9.0.{r + 1}"]}
    snaps[1]["tcp"]["peers"] = {"10.9.0.3": [40, 12, 0], "10.9.0.1": [900, 0, 0]}
    snaps[2]["tcp"]["peers"] = {"10.9.0.1": [30, 2, 3]}
    a = report.analyse(snaps, {}, 3)
    lossy = [line for line in a["lines"] if line.startswith("the network loses packets")]
    assert lossy == [
        "the network loses packets: rank 1 (node2) resent 12 of 40 TCP segments (30%) to node3",
        "the network loses packets: rank 2 (node3) resent 2 of 30 TCP segments (7%) and has had "
        "its resent segments go unanswered 3 times in a row to node1"]
    assert "every such connection has node3 at one end" in a["lines"][-1]
    assert any("A link loses packets" in h for h in a["hints"])
    # healthy counters (no resends, or a couple among thousands) say nothing
    snaps[1]["tcp"]["peers"] = {"10.9.0.3": [4000, 3, 0]}
    snaps[2]["tcp"]["peers"] = {"10.9.0.1": [30, 1, 1]}
    assert network.lossy_links(snaps) == []


def test_running_threads_counts_every_thread_that_may_still_call_hpcddp():
    """A thread started with _thread (threading does not list it) or named like hpcddp's own
    may still send: it counts; hpcddp's own threads (by the function they run) do not."""
    import _thread
    import sys as _sys
    from hpcddp.diagnostics import state
    gate = threading.Event()
    main = threading.main_thread().ident
    before = state.running_threads(_sys._current_frames(), main)
    _thread.start_new_thread(gate.wait, (10,))
    user = threading.Thread(target=gate.wait, args=(10,), name="hpcddp-sender")
    user.start()
    own = threading.Thread(target=state.blocked_threads, name="x")   # an hpcddp function
    own._target = lambda: gate.wait(10)
    own._target.__module__ = "hpcddp.collectives.engine"
    own.start()
    try:
        time.sleep(0.1)
        assert state.running_threads(_sys._current_frames(), main) == before + 2
    finally:
        gate.set()
        user.join()
        own.join()


def test_running_threads_leaves_out_library_threads_that_never_call_hpcddp():
    """A DataLoader's queue feeders and a tqdm bar's monitor are in every training script:
    they never send, so a point-to-point deadlock beside them is still found in seconds."""
    import multiprocessing
    import sys as _sys
    from hpcddp.diagnostics import state
    import tqdm
    main = threading.main_thread().ident
    before = state.running_threads(_sys._current_frames(), main)
    queue = multiprocessing.get_context("spawn").Queue()
    queue.put(1)                          # starts the queue's feeder thread in this process
    old_interval = tqdm.tqdm.monitor_interval
    tqdm.tqdm.monitor_interval = 10
    bar = tqdm.tqdm(total=3, disable=False, file=open(os.devnull, "w"))   # starts its monitor
    gate = threading.Event()
    user = threading.Thread(target=gate.wait, args=(10,))
    user.start()
    try:
        time.sleep(0.1)
        names = {type(t).__name__ for t in threading.enumerate()} | {
            t.name for t in threading.enumerate()}
        assert "TMonitor" in names and "QueueFeederThread" in names, names
        assert state.running_threads(_sys._current_frames(), main) == before + 1
    finally:
        gate.set()
        user.join()
        bar.close()
        tqdm.tqdm.monitor_interval = old_interval
        queue.close()
        queue.join_thread()
