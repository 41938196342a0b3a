"""The stall report: every rank's state (from :mod:`hpcddp.diagnostics.state`) made readable.

Pure functions over plain data, so they are unit-tested without MPI. The report says which
ranks wait in which op, which ranks never arrived and where they are instead, which ranks are
dead or do not answer, each rank's Python stack, and what to do about the pattern found.
"""
from __future__ import annotations

import time

from hpcddp.diagnostics.network import lossy_links
from hpcddp.diagnostics.recorder import P2P_OPS

_SELF_TIMED = ("monitored_barrier",)   # it raises on its own timeout, naming the missing ranks


def format_ranks(ranks) -> str:
    """[0, 1, 2, 3, 7, 9, 10] -> '0-3,7,9,10' (runs of three or more become ranges)."""
    rs = sorted(set(int(r) for r in ranks))
    out, i = [], 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        if j - i >= 2:
            out.append(f"{rs[i]}-{rs[j]}")
        else:
            out.extend(str(r) for r in rs[i:j + 1])
        i = j + 1
    return ",".join(out)


def ranks_word(ranks) -> str:
    return ("rank " if len(set(ranks)) == 1 else "ranks ") + format_ranks(ranks)


def _peer_text(d: dict) -> str:
    op, peer = d.get("op"), d.get("peer")
    if isinstance(peer, str):      # a wait on the rank's own node (the staging ring's writer)
        return ""
    if peer is None:
        return "from any rank" if op == "recv" else ""
    ranks = d.get("ranks") or []
    world = ranks[peer] if isinstance(peer, int) and 0 <= peer < len(ranks) else peer
    if op == "send":
        return f"to rank {world}"
    if op == "recv":
        return f"from rank {world}"
    if op in ("broadcast", "scatter", "broadcast_object", "scatter_object_list"):
        return f"src={peer}"
    return f"dst={peer}"


def op_args(d: dict, with_dtype: bool = True) -> str:
    parts = []
    p = _peer_text(d)
    if p:
        parts.append(p)
    if d.get("shape") is not None:
        parts.append(f"shape={list(d['shape'])}")
    if with_dtype and d.get("dtype"):
        parts.append(str(d["dtype"]))
    return ", ".join(parts)


def op_name(d: dict) -> str:
    """'all_reduce #57 on WORLD'."""
    return f"{d['op']} #{d['seq']} on {d['group']}"


def op_text(d: dict) -> str:
    """'all_reduce #57 (shape=[4], float32) on WORLD'."""
    args = op_args(d)
    return f"{d['op']} #{d['seq']}{f' ({args})' if args else ''} on {d['group']}"


def _key(d: dict) -> tuple:
    # the generation tells apart two groups torch names alike (recorder.generation)
    return (d["group"], tuple(d.get("ranks") or ()), d.get("gen"))


def _status(snap: dict | None, gone: dict | None, not_on=None) -> str:
    """Where a rank is, in one phrase ('in Python at train.py:88 (in step)')."""
    if snap is None:
        return dead_text(gone or {})
    waits = [d for d in snap["inflight"] if d["op"] != "finalize"
             and (not_on is None or _key(d) != not_on)]
    exc = snap.get("exception")
    if waits and not snap.get("blocked", True) and not snap.get("finalizing"):
        d = max(waits, key=lambda d: d["age"])
        more = f" and {len(waits) - 1} more" if len(waits) > 1 else ""
        text = (f"in Python at {snap.get('where', '?')} (with {op_text(d)}{more} started "
                f"{d['age']:.1f} s ago and not waited for)")
    elif waits:
        d = max(waits, key=lambda d: d["age"])
        text = f"in {op_text(d)} for {d['age']:.1f} s"
    elif snap.get("finalizing"):
        text = ("in hpcddp's finalize: its script has ended" +
                (f" after an uncaught exception ({exc})" if exc else ""))
        return text
    else:
        text = f"in Python at {snap.get('where', '?')}"
    if exc:
        text += f", exiting after an uncaught exception ({exc})"
    return text


def dead_text(gone: dict) -> str:
    state = gone.get("pid_state")
    host, pid = gone.get("host", "?"), gone.get("pid", "?")
    waited = gone.get("waited", 0.0)
    if state == "dead":
        return f"dead: its process (pid {pid} on {host}) has exited"

    if state == "alive":
        return (f"unresponsive: its process (pid {pid} on {host}) exists but did not answer "
                f"the diagnostics exchange within {waited:.1f} s (stopped, swapping, or "
                f"holding the GIL in native code)")
    return (f"dead or unresponsive: it did not answer the diagnostics exchange within "
            f"{waited:.1f} s (pid {pid} on {host}: its process cannot be checked from here)")


def _last_on(snap: dict, key) -> dict | None:
    for g in snap.get("groups", []):
        if _key(g) == key:
            return g
    return None


def stalled_op(snaps: dict) -> tuple:
    """(rank, entry) of the op the job is stuck in, (None, None) if nothing can stall.

    The oldest in-flight collective (a send/recv only if no collective is in flight) picks
    the group; on it, the lowest sequence number in flight, and there the op most ranks
    called (so a minority's wrong call is reported as the odd one out).
    """
    # only a rank that waits (a thread blocked in hpcddp) is stuck in its ops; a rank running
    # Python with an async op in flight (an isend never waited for) is not
    cands = [(r, d) for r, s in sorted(snaps.items()) if s and s.get("blocked", True)
             for d in s["inflight"] if d["op"] not in _SELF_TIMED and d["op"] != "finalize"]
    coll = [(r, d) for r, d in cands if d["op"] not in P2P_OPS]
    if not cands:
        return None, None
    if not coll:
        return max(cands, key=lambda rd: (rd[1]["age"], -rd[0]))
    _, oldest = max(coll, key=lambda rd: (rd[1]["age"], -rd[0]))
    key = _key(oldest)
    same = [(r, d) for r, d in coll if _key(d) == key]
    low = min(d["seq"] for _, d in same)
    at = [(r, d) for r, d in same if d["seq"] == low]
    votes: dict = {}
    for r, d in at:
        votes.setdefault(_call(d), []).append(r)
    best = max(votes, key=lambda c: (len(votes[c]), -min(votes[c])))
    return max(((r, d) for r, d in at if _call(d) == best), key=lambda rd: (rd[1]["age"], -rd[0]))


def _call(d: dict) -> tuple:
    peer = d.get("peer")
    return (d["op"], tuple(d.get("shape") or ()), d.get("dtype"),
            None if isinstance(peer, str) else peer)


def ended_without(snaps: dict, size: int) -> tuple:
    """(the stalled collective, the members whose script has ended before they called it):
    those ranks will never call it, so its wait has no end. (op, []) where none did or it
    cannot be told (a member's recorder holds nothing of the group: it never used it, or its
    entries were overwritten)."""
    _, op = stalled_op(snaps)
    if op is None or op["op"] in P2P_OPS:
        return op, []
    key, ended = _key(op), []
    for m in op.get("ranks") or range(size):
        s = snaps.get(m)
        g = _last_on(s, key) if s and s.get("finalizing") else None
        if g is not None and (g.get("seq") or 0) < op["seq"]:
            ended.append(m)
    return op, ended


def _p2p_peers(d: dict, rank: int, size: int) -> list | None:
    """The world ranks a send or receive D of RANK can be matched by: its peer, every other
    member for a receive from any rank; None where that cannot be told."""
    members, peer = list(d.get("ranks") or range(size)), d.get("peer")
    if peer is None:
        return [m for m in members if m != rank] if d["op"] == "recv" else None
    return [members[peer]] if isinstance(peer, int) and 0 <= peer < len(members) else None


def _p2p_waits(s: dict | None, min_age: float) -> list | None:
    """A rank's waits where it waits only in sends and receives, each MIN_AGE seconds old;
    else None."""
    if not s or not s.get("blocked", True) or s.get("finalizing"):
        return None
    waits = [d for d in s["inflight"] if d["op"] != "finalize" and d["op"] not in _SELF_TIMED
             and not d.get("abandoned")]
    if not waits or any(d["op"] not in P2P_OPS or d["age"] < min_age for d in waits):
        return None
    return waits


def _may_match(wait: dict, rank: int, snap: dict, size: int) -> bool:
    """Whether SNAP's rank holds a send or receive in flight that RANK's WAIT may match (a
    send to RANK for its receive, a receive from RANK or any rank for its send)."""
    want = "send" if wait["op"] == "recv" else "recv"
    for d in snap["inflight"]:
        if d["op"] == want:
            peers = _p2p_peers(d, snap.get("rank"), size)
            if peers is None or rank in peers:
                return True
    return False


def _silent_since(snap: dict) -> float:
    """The wall-clock time from which SNAP's rank has made no call: the latest time it began
    or ended one (a send of another thread that ended a moment ago counts: its message may
    not have arrived yet), else the start of its latest call in flight (its finalize where
    it has ended)."""
    quiet = [d["age"] for d in snap["inflight"]]
    if "quiet_for" in snap:
        quiet.append(snap["quiet_for"])
    return snap.get("wall", 0.0) - (min(quiet) if quiet else 0.0)


def p2p_stuck(snaps: dict, size: int, min_age: float = 1.0) -> dict:
    """{rank: (its oldest wait, the world ranks its waits are for)} of the ranks that wait
    only in sends and receives no rank can match any more: each peer is *silent* and holds
    nothing in flight the wait may match. A rank is silent where its script has ended
    (hpcddp's finalize), or where it is itself stuck so, its main thread waiting and no
    other thread of its own running that might still call hpcddp (a point-to-point
    deadlock: both ranks receive first). Each wait must be MIN_AGE seconds old, and the
    rank's snapshot taken MIN_AGE seconds after each peer went silent, so that a message the
    peer sent before it ended or waited has had time to arrive. Empty where no
    rank waits so, or it cannot be told (a peer not answering, a wait on the rank's own
    node)."""
    waits = {r: w for r, s in snaps.items() if (w := _p2p_waits(s, min_age)) is not None}
    ended = {r for r, s in snaps.items() if s and s.get("finalizing")}
    silent = ended | {r for r in waits if snaps[r].get("main_blocked")
                      and snaps[r].get("running_threads", 1) == 0}

    def stuck(r):
        found, wall = set(), snaps[r].get("wall", 0.0)
        for d in waits[r]:
            peers = _p2p_peers(d, r, size)
            # each rank's snapshot is taken when its watchdog answers (up to a poll apart):
            # R's must come MIN_AGE after the peer went silent, else a message the peer sent
            # just before may not have arrived when R's was taken
            if not peers or any(p not in silent or _may_match(d, r, snaps[p], size)
                                or wall - _silent_since(snaps[p]) < min_age for p in peers):
                return None
            found.update(peers)
        return found

    while True:                 # a silent rank that may go on is not silent: until none is
        going = {r for r in silent - ended if stuck(r) is None}
        if not going:
            break
        silent -= going
    out = {}
    for r in sorted(waits):
        peers = stuck(r)
        if peers:
            out[r] = (max(waits[r], key=lambda d: d["age"]), sorted(peers))
    return out


def analyse(snaps: dict, gone: dict, size: int) -> dict:
    """What is stuck and why. snaps: rank -> snapshot; gone: rank -> what is known of a rank
    that did not answer. Returns {"lines": [...], "hints": [...], "stall": bool}: the calls
    first, then the TCP connections that lose packets (ranks all waiting in the same call may
    be waiting for a lossy link)."""
    found = _analyse_calls(snaps, gone, size)
    network = lossy_links(snaps)
    if network:
        found["lines"] += network
        found["hints"].append(_HINT["network"])
    return found


def _analyse_calls(snaps: dict, gone: dict, size: int) -> dict:
    r0, op = stalled_op(snaps)
    dead = sorted(gone)
    kinds = {"dead"} if dead else set()
    if op is None:
        return _analyse_no_call(snaps, gone, dead, kinds)
    if op["op"] in P2P_OPS:
        return _analyse_p2p(snaps, gone, dead, kinds, r0, op, size)
    return _analyse_collective(snaps, gone, dead, kinds, op, size)


def _analyse_no_call(snaps: dict, gone: dict, dead: list, kinds: set) -> dict:
    """No rank waits in an op: some reached the end of the script, or ranks died."""
    lines = []
    fin = sorted(r for r, s in snaps.items() if s and s.get("finalizing"))
    others = sorted(r for r in snaps if r not in fin)
    if fin:
        lines.append(f"{ranks_word(fin)} {'has' if len(fin) == 1 else 'have'} reached "
                     f"hpcddp's finalize (the end of the script) and "
                     f"{'waits' if len(fin) == 1 else 'wait'} for the others")
        for status, rs in _grouped({r: _status(snaps[r], None) for r in others}):
            lines.append(f"{ranks_word(rs)}: {status}")
    for r in dead:
        lines.append(f"rank {r} is {dead_text(gone[r])}")
    return {"lines": lines, "hints": _hints(kinds | ({"finalize"} if fin else set())),
            "stall": bool(dead)}


def _analyse_p2p(snaps: dict, gone: dict, dead: list, kinds: set, r0: int, op: dict,
                 size: int) -> dict:
    """Rank R0 waits in a send or receive: its peer, and a cycle of blocking calls."""
    members = list(op.get("ranks") or range(size))
    kinds.add("p2p")
    peer_world = None
    if isinstance(op.get("peer"), int) and 0 <= op["peer"] < len(members):
        peer_world = members[op["peer"]]
    lines = [f"rank {r0} has waited {op['age']:.1f} s in {op_text(op)}"]
    cycle = _p2p_cycle(snaps, r0)
    if cycle:
        kinds.discard("p2p")
        kinds.add("deadlock")
        waits = "; ".join(f"rank {a} waits for rank {b}" for a, b in
                          zip(cycle, cycle[1:] + cycle[:1]))
        lines.append(f"a point-to-point deadlock: {waits}: each waits in a blocking "
                     f"send/recv for a rank that itself waits, so none can go on")
    if peer_world is not None and peer_world != r0:
        s = snaps.get(peer_world)
        lines.append(f"rank {peer_world} (its peer) is {_status(s, gone.get(peer_world))}")
    for r in dead:
        if r != peer_world:
            lines.append(f"rank {r} is {dead_text(gone[r])}")
    return {"lines": lines, "hints": _hints(kinds), "stall": True}


def _analyse_collective(snaps: dict, gone: dict, dead: list, kinds: set, op: dict,
                        size: int) -> dict:
    """The stalled collective OP: who waits in it, and where each other member is."""
    key, seq = _key(op), op["seq"]
    members = list(op.get("ranks") or range(size))
    waiting, other, ages, local = [], {}, {}, {}
    for m in members:
        s = snaps.get(m)
        if s is None:
            other[m] = dead_text(gone.get(m, {}))
            continue
        mine = sorted((d for d in s["inflight"] if _key(d) == key and d["op"] not in P2P_OPS
                       and d["op"] != "finalize"),
                      key=lambda d: d["seq"])
        if not mine:
            other[m] = _outside_the_group(s, op, key, seq, kinds)
            continue
        d = mine[0]
        if d["seq"] == seq and d["op"] == op["op"]:
            if isinstance(d.get("peer"), str):
                local[m] = d["peer"]
            if d.get("shape") != op.get("shape") or d.get("dtype") != op.get("dtype"):
                kinds.add("mismatch")
                other[m] = f"called {op['op']} #{seq} with ({op_args(d)}) instead"
            else:
                waiting.append(m)
                ages[m] = d["age"]
        else:
            other[m] = _in_another_call(s, d, op, key, seq, kinds)
    lines = []
    culprit = _differing_calls(snaps, members, key, seq, op["group"])
    if culprit:
        kinds.add("mismatch")
        lines.append(culprit)
    if waiting:
        lines.append(f"{ranks_word(waiting)} {'has' if len(waiting) == 1 else 'have'} waited "
                     f"{max(ages.get(w, 0.0) for w in waiting):.1f} s in {op_text(op)}")
    for m, what in sorted(local.items()):
        kinds.add("local")
        lines.append(f"rank {m} waits for {what}, not for another rank: the stall is on its "
                     f"own node (the others wait for it)")
    lines += _others_lines(other, op, seq)
    for r in dead:
        if r not in members:
            lines.append(f"rank {r} (not in {op['group']}) is {dead_text(gone[r])}")
    return {"lines": lines, "hints": _hints(kinds), "stall": True}


def _in_another_call(s: dict, d: dict, op: dict, key, seq: int, kinds: set) -> str:
    """Where a member is whose first unfinished call D on the group is not the stalled one."""
    if d["seq"] == seq:
        kinds.add("mismatch")
        return f"called {op_text(d)} instead"
    if d["seq"] == seq + 1 and _finished_same(s, key, op):
        # a ring or a tree lets a rank finish its part of a call before the others
        return f"has finished its part of #{seq} and waits in the next call, {op_text(d)}"
    if (d["seq"] > seq and d["op"] == op["op"] and op["op"] in PIPELINED_OPS
            and _ran_ahead(s, key, op, d["seq"])):
        return (f"has finished its part of #{seq} to #{d['seq'] - 1} and waits in "
                f"{op_text(d)}: a pipeline (the staging ring) lets a rank run "
                f"ahead of the slowest")
    if d["seq"] > seq:
        kinds.add("mismatch")
        return (f"already passed #{seq} and is in {op_text(d)}: its calls were "
                f"matched with different ones on other ranks")
    return f"is behind, in {op_text(d)}"


def _outside_the_group(s: dict, op: dict, key, seq: int, kinds: set) -> str:
    """Where a member is that has no call in flight on the group."""
    g = _last_on(s, key)
    done = (g or {}).get("seq") or 0
    st = _status(s, None, not_on=key)
    if "uncaught exception" in st:       # in finalize or not: the exception is why
        kinds.add("exception")
    elif "finalize" in st:
        kinds.add("finalize")
    elif st.startswith("in Python"):
        kinds.add("python")
    else:
        kinds.add("elsewhere")
    if done < seq:
        last = (g or {}).get("last")
        tail = f"; its last op on {op['group']} was {last['op']} #{last['seq']}" if last else ""
        return f"has not called {op['op']} #{seq} on {op['group']}: it is {st}{tail}"
    kinds.add("mismatch")
    rec = [d for d in (g or {}).get("recent", []) if d and d["seq"] == seq]
    if rec and rec[0].get("abandoned"):
        return (f"called {rec[0]['op']}({op_args(rec[0])}) as #{seq} on "
                f"{op['group']}, left it unfinished, and is now {st}")
    as_ = f" (as {rec[0]['op']}({op_args(rec[0])}))" if rec else ""
    return (f"already completed #{seq} on {op['group']}{as_} and is now {st}: "
            f"its calls were matched with different ones on other ranks")


def _others_lines(other: dict, op: dict, seq: int) -> list:
    """One line per group of ranks in the same place (OTHER: rank -> where it is)."""
    lines = []
    for text, rs in _grouped(other):
        if text.startswith("has not called"):
            if len(rs) > 1:
                head, _, rest = text.partition(": it is ")
                lines.append(f"{ranks_word(rs)} have not called {op['op']} #{seq} on "
                             f"{op['group']}; they are {rest}" if rest else
                             f"{ranks_word(rs)} {text}")
            else:
                lines.append(f"{ranks_word(rs)} {text}")
        elif text.startswith(("dead", "unresponsive")):
            lines.append(f"{ranks_word(rs)} {'is' if len(rs) == 1 else 'are'} {text}")
        else:
            lines.append(f"{ranks_word(rs)} {text}")
    return lines


def _finished_same(snap: dict, key, op: dict) -> bool:
    """Whether SNAP's rank completed call #seq of OP's group as the same call (op, shape, dtype)."""
    rec = [d for d in (_last_on(snap, key) or {}).get("recent", [])
           if d and d["seq"] == op["seq"] and d.get("done_ago") is not None
           and not d.get("abandoned")]
    return bool(rec) and all(rec[0].get(k) == op.get(k) for k in ("op", "shape", "dtype"))


# ops whose ranks legitimately run several calls apart (each call is a round of a pipeline of
# point-to-point messages, not a collective every rank completes together)
PIPELINED_OPS = frozenset({"stage:ring"})


def _ran_ahead(snap: dict, key, op: dict, upto: int) -> bool:
    """Whether SNAP's rank completed every call it still remembers from #seq to #UPTO-1 of OP's
    group, all as OP's op: a pipeline's rank that runs several calls ahead (the recorder keeps
    the last few calls per group, so a longer run is judged by those)."""
    rec = [d for d in (_last_on(snap, key) or {}).get("recent", [])
           if d and op["seq"] <= d["seq"] < upto]
    return bool(rec) and all(d.get("done_ago") is not None and not d.get("abandoned")
                             and d["op"] == op["op"] for d in rec)


def _differing_calls(snaps: dict, members: list, key, seq: int, group: str) -> str:
    """'' if every rank's flight recorder holds the same call (op, shape, dtype, root) as #SEQ
    on the group, else a line naming each call and the rank(s) that differ from the majority."""
    calls: dict = {}
    for m in members:
        s = snaps.get(m)
        if not s:
            continue
        d = next((d for d in s["inflight"] if _key(d) == key and d["seq"] == seq
                  and d["op"] not in P2P_OPS and d["op"] != "finalize"), None)
        if d is None:
            g = _last_on(s, key)
            d = next((x for x in (g or {}).get("recent", []) if x and x["seq"] == seq
                      and x["op"] != "finalize"), None)
        if d is not None:
            calls.setdefault(_call(d), (d, []))[1].append(m)
    if len(calls) < 2:
        return ""
    kinds = sorted(calls.values(), key=lambda v: (-len(v[1]), v[1][0]))
    each = "; ".join(f"{ranks_word(rs)} {d['op']}({op_args(d)})" for d, rs in kinds)
    text = f"the flight recorders hold different calls as #{seq} on {group}: {each}"
    if len(kinds[0][1]) > len(kinds[1][1]):
        odd = sorted(r for _, rs in kinds[1:] for r in rs)
        text += (f"; the culprit: {ranks_word(odd)}, whose call differs from the other "
                 f"ranks'")
    return text


def _p2p_waits_for(snap: dict) -> int | None:
    """The world rank a blocked rank's oldest in-flight send/recv waits for, if any."""
    if not snap or not snap.get("blocked", True):
        return None
    p2p = [d for d in snap["inflight"] if d["op"] in P2P_OPS and isinstance(d.get("peer"), int)]
    if not p2p:
        return None
    peers = _p2p_peers(max(p2p, key=lambda d: d["age"]), snap.get("rank"), 0)
    return peers[0] if peers else None


def _p2p_cycle(snaps: dict, start: int) -> list:
    """The ranks of a wait-for cycle of blocking send/recv through START ([] if none): rank
    a waits for b, b for c, ..., the last for a."""
    chain, r = [], start
    while r is not None and r not in chain:
        chain.append(r)
        r = _p2p_waits_for(snaps.get(r))
    return chain[chain.index(r):] if r is not None and len(chain) > 1 else []


def _grouped(status: dict) -> list:
    """{rank: text} -> [(text, [ranks])] in rank order of first appearance."""
    out: dict = {}
    for r in sorted(status):
        out.setdefault(status[r], []).append(r)
    return list(out.items())


_HINT = {
    "network": "A link loses packets: TCP resends them, slower and slower, and the collectives "
               "stall. Check the named host's link (`ip -s link`, `ethtool -S`, its switch "
               "port) and keep the job off that node until it is mended (Slurm: --exclude).",
    "dead": "A dead rank was killed (signal, out-of-memory killer, segfault, node failure): "
            "look at the scheduler's log and `dmesg` on its host; the survivors cannot go on "
            "without it.",
    "exception": "A rank's script ended with an uncaught exception while the others wait for "
                 "it: its traceback is above in its output; fix the exception. (By default the "
                 "rank reports this at once and the job ends; with HPCDDP_ABORT_ON_EXCEPTION=0 "
                 "or hpcddp.init(abort_on_exception=False) only the timeout ends it.)",
    "finalize": "A rank reached the end of its script while others still wait in a "
                "collective: it made fewer collective calls than they did (a collective "
                "skipped under a rank-dependent condition, a loop with a rank-dependent length, "
                "an exception caught and the step skipped).",
    "python": "A rank never called the collective the others wait in: it skipped it (a "
              "condition true on some ranks only) or is still computing (see its stack). "
              "Every rank of a group must call the same collectives in the same order.",
    "mismatch": "Ranks called different collectives at the same point: run with "
                "HPCDDP_DEBUG=detail to stop at the first mismatched call with the same error "
                "on every rank.",
    "elsewhere": "A rank waits in an op on another group or another op: ops on different "
                 "groups must be called in the same order by the ranks they share.",
    "p2p": "A send or recv has no matching recv/send on its peer (check tags, peers and the "
           "order of point-to-point calls on both sides).",
    "deadlock": "Blocking point-to-point calls wait for each other in a cycle (for example "
                "both ranks recv first): reorder one side (send first on even ranks, recv "
                "first on odd ones), or start them with isend/irecv (batch_isend_irecv) and "
                "wait on all of them.",
    "finalize-only": "",
    "local": "A rank waits for something on its own node, not for another rank (the staging "
             "ring: its writer thread has not finished a write for the whole timeout): look at "
             "that node's disk or file system (`df`, `dmesg`) and at the writer thread's stack "
             "below.",
}


def _hints(kinds: set) -> list:
    order = ("dead", "local", "exception", "mismatch", "finalize", "python", "elsewhere",
             "deadlock", "p2p")
    return [_HINT[k] for k in order if k in kinds]


def render(snaps: dict, gone: dict, size: int, *, timeout: float, policy: str, job: str,
           reporter: int, reason: str, analysis: dict | None = None,
           stacks: bool = True, local_only: bool = False) -> str:
    """The whole report as text (no rank prefixes: the caller adds them)."""
    a = analysis or analyse(snaps, gone, size)
    out = [f"hpcddp stall report: job {job or '?'}, {size} ranks, "
           f"{time.strftime('%Y-%m-%d %H:%M:%S')}, HPCDDP_TIMEOUT={timeout:g} s, "
           f"policy {policy}",
           f"rank {reporter} writes it: {reason}",
           "", "What is stuck:"]
    out += [f"  {line}" for line in a["lines"]] or ["  (nothing in flight)"]
    out += ["", "Every rank:"]
    for r in range(size):
        s = snaps.get(r)
        if s is None and r not in gone:
            if not local_only:
                out.append(f"  rank {r}: (no state)")
            continue
        if s is None:
            g = gone.get(r, {})
            out.append(f"  rank {r} ({g.get('host', '?')}, pid {g.get('pid', '?')}): "
                       f"{dead_text(g)}")
            continue
        last = [g["last"] for g in s.get("groups", []) if g.get("last")]
        last_text = ""
        if last:
            lt = min(last, key=lambda d: d["done_ago"])
            last_text = f"; last completed: {op_name(lt)} {lt['done_ago']:.1f} s ago"
        out.append(f"  rank {r} ({s['host']}, pid {s['pid']}): {_status(s, None)}{last_text}")
    if a["hints"]:
        out += ["", "What to do:"] + [f"  - {h}" for h in a["hints"]]
    if stacks:
        out += ["", "Python stacks (most recent call last):"]
        for r in range(size):
            s = snaps.get(r)
            if s is None:
                continue
            out.append(f"  --- rank {r}, main thread ---")
            out += [f"  {line}" for line in (s.get("stack") or "(no stack)").splitlines()]
            for name, st in sorted(s.get("threads", {}).items()):
                out.append(f"  --- rank {r}, thread {name!r} ---")
                out += [f"  {line}" for line in st.splitlines()]
    return "\n".join(out) + "\n"
