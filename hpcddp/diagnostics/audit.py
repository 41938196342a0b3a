"""The audit: ranks compare the collectives their flight recorders hold, after they ran.

Default mode checks a call before it runs only where that costs nothing or the call is large
(diagnostics.mismatch, from 8 MiB). A smaller call whose ranks disagree on the op, the element
count, the dtype or the root can complete in MPI with wrong data: an int32 all_reduce against
a float32 one of the same byte count adds the bits of one type as the other. The audit finds
those after the fact, off the ops' path (docs/hangs.md "The audit"):

- Once a second the watchdog's thread takes the tensor collectives recorded since its last
  look (:func:`collect`) and sends them to the coordinator (rank 0 of the job), which keeps
  them by group and sequence number in a :class:`Ledger`. Calls that ended only: one in
  flight may still be refused by an agreement (every rank raises; the group goes on), and a
  mismatch that hangs is the stall report's to explain.
- At the script's end every rank sends what is left before hpcddp's last barrier, and the
  coordinator compares it once all have arrived, so a short script is audited too.
- Where two ranks recorded different calls as the same collective of a group, the coordinator
  writes a report naming each call and the odd rank, and the stall policy acts (abort: exit
  code 3): the results of that call are wrong, and the job should not go on as if not.

Compared as the large calls' agreement compares (mismatch.AGREE_FREE left out: per-rank sizes
that differ by design): op, element count, dtype, root. Not the reduce op (not recorded).
Groups are matched by name, members and creation order (Communicator.audit_key); a group
without a given name is not audited. The flight recorder keeps its last HPCDDP_RECORDER_SIZE
calls: where a rank makes more calls than that between two looks, the calls in between are
not compared (a mismatch repeated every step is still found).
"""
from __future__ import annotations

import math

from hpcddp.diagnostics import recorder as _rec
from hpcddp.diagnostics.mismatch import AGREE_FREE
from hpcddp.diagnostics.report import ranks_word

MAX_ROWS = 512           # calls one rank sends per look, the most recent ...
ALL_ROWS = 16384         # ... and all ranks together (rank 0 compares ~0.6 us per call)
_LEFT_OUT = AGREE_FREE | _rec.P2P_OPS    # per-rank sizes that may differ; two ranks, not a group
KEEP_S = 30.0            # how long the coordinator keeps a call not every member has sent
WAIT_S = 3.0             # how long it waits for every member's call where calls differ


def rows_per_look(size: int) -> int:
    """How many calls each of SIZE ranks sends per look: rank 0's work stays bounded."""
    return max(32, min(MAX_ROWS, ALL_ROWS // max(1, size)))


def collect(sent: dict, limit: int = MAX_ROWS) -> dict:
    """{group's audit key: [(seq, op, count, dtype, root, shape), ...]}: the ended, audited
    collectives in the flight recorder not sent before (SENT: key -> last seq sent, updated),
    at most LIMIT, the most recent."""
    rows = []
    for e in list(_rec.RECORDER.buf):
        if e is None or len(e) != 8 or e[_rec.T_END] == 0.0 or e[_rec.DTYPE] is None \
                or e[_rec.SHAPE] is None or e[_rec.OP] in _LEFT_OUT:
            continue
        key = getattr(e[_rec.GROUP], "audit_key", None)
        if key is None or e[_rec.SEQ] <= sent.get(key, 0):
            continue
        rows.append((e[_rec.T_END], key, e))
    rows.sort(key=lambda r: r[0])
    out: dict = {}
    for _, key, e in rows[-limit:]:
        shape = tuple(int(d) for d in e[_rec.SHAPE])
        dtype = str(e[_rec.DTYPE]).replace("torch.", "")
        out.setdefault(key, []).append(
            (e[_rec.SEQ], *compared(e[_rec.OP], shape, dtype, e[_rec.PEER]), shape))
    for key, calls in out.items():
        sent[key] = max(sent.get(key, 0), max(c[0] for c in calls))
    return out


def compared(op: str, shape, dtype: str, peer) -> tuple:
    """What the audit compares of a call: (op, element count, dtype, root)."""
    return op, math.prod(shape), dtype, peer if isinstance(peer, int) else None


def differ_in_flight(snaps: dict, min_age: float):
    """((group, members, generation, seq), {call: [ranks]}) of a collective that ranks have
    waited in for MIN_AGE seconds or more, each in a call this module's rule tells apart from
    another's (op, element count, dtype, root; a barrier by its name), else None. SNAPS: the
    stall report's snapshots. Such a wait has no good end (MPI hangs, errors or mixes the
    data), and an agreement on the calls would have refused them long before MIN_AGE."""
    slots: dict = {}
    for r, s in sorted(snaps.items()):
        if not s or not s.get("blocked", True):
            continue
        for d in s["inflight"]:
            if d.get("gen") is None or d["age"] < min_age or d.get("abandoned"):
                continue
            op, shape, peer = d["op"], d["shape"], d["peer"]
            if op == "barrier":
                call = (op, None, None, None)
            elif op in _LEFT_OUT or shape is None or d["dtype"] is None:
                continue
            else:
                call = compared(op, shape, d["dtype"], peer)
            at = (d["group"], tuple(d["ranks"]), d["gen"], d["seq"])
            slots.setdefault(at, {}).setdefault(call, []).append(r)
    for at, calls in slots.items():
        if len(calls) > 1:
            return at, calls
    return None


class Ledger:
    """The coordinator's record of what each rank called, by (group, seq), until every member
    has sent the call (then forgotten if they agree) or KEEP_S has passed. Calls that differ
    are reported once every member's has arrived, or WAIT_S after the first (a member's
    recorder may have dropped it), or at the end: so the majority, and the odd rank, show."""

    def __init__(self):
        self.calls: dict = {}     # (key, seq) -> [first seen, {call: [ranks]}, {rank: shape}]
        self.differ: set = set()  # (key, seq) whose ranks' calls differ, not yet reported

    def add(self, rank: int, rows: dict, now: float) -> None:
        for key, calls in rows.items():
            members = len(key[1])
            for seq, op, count, dtype, root, shape in calls:
                slot = self.calls.get((key, seq))
                if slot is None:
                    slot = self.calls[(key, seq)] = [now, {}, {}]
                elif slot[1] is None:                   # reported already
                    continue
                slot[1].setdefault((op, count, dtype, root), []).append(rank)
                slot[2][rank] = shape
                if len(slot[1]) > 1:
                    self.differ.add((key, seq))
                elif len(slot[2]) >= members:
                    del self.calls[(key, seq)]
        if len(self.calls) > 64 * MAX_ROWS:
            self.prune(now, keep=0.0)

    def prune(self, now: float, keep: float = KEEP_S) -> None:
        for k in [k for k, slot in self.calls.items()
                  if now - slot[0] > keep and k not in self.differ]:
            del self.calls[k]

    def take(self, now: float, final: bool = False) -> list:
        """Reports of the calls that differ and are ready to report (all, where FINAL)."""
        found = []
        for k in sorted(self.differ, key=lambda k: (k[0][0], k[1])):
            slot = self.calls[k]
            if final or len(slot[2]) >= len(k[0][1]) or now - slot[0] >= WAIT_S:
                found.append(self.text(k[0], k[1], slot))
                self.differ.discard(k)
                self.calls[k] = [slot[0], None, None]       # reported: ignored from now on
        return found

    @staticmethod
    def text(key, seq: int, slot) -> str:
        """'#5 on WORLD: rank 2 all_reduce(shape=[4], float64); ranks 0,1,3 ...; the culprit'."""
        name, members = key[0], key[1]
        kinds = sorted(slot[1].items(), key=lambda kv: (-len(kv[1]), min(kv[1])))

        def call(c, ranks) -> str:
            op, _, dtype, root = c
            shape = list(slot[2][ranks[0]])
            args = ([f"{'src' if op == 'broadcast' else 'dst'}={root}"] if root is not None
                    else []) + [f"shape={shape}", dtype]
            return f"{ranks_word(sorted(ranks))} {op}({', '.join(args)})"
        each = "; ".join(call(c, rs) for c, rs in kinds)
        text = (f"the ranks called different collectives as #{seq} on {name} "
                f"(ranks {list(members)}), and the call completed: {each}")
        if len(kinds[0][1]) > len(kinds[1][1]):
            odd = sorted(r for _, rs in kinds[1:] for r in rs)
            text += f"; the culprit: {ranks_word(odd)}, whose call differs from the other ranks'"
        return text
