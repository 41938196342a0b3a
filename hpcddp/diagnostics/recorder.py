"""Flight recorder: a bounded per-rank ring of the last ops (what each rank was doing).

Every hpcddp op, through torch.distributed or the direct API, calls :func:`start` (collectives)
or :func:`start_p2p` (send/recv) before its first message and :func:`end` when it completes.
An entry is a small list ``[seq, op, comm, shape, dtype, peer, t_start, t_end]`` (``t_end``
0.0 while in flight). ``seq`` counts collectives per communicator, as torch's per-group
sequence numbers do, so the same collective has the same number on every member; send/recv
have their own per-communicator counter (they involve two ranks, not the group, and would
otherwise make the collective numbers differ between ranks).

Times come from :data:`TICK`, a clock the watchdog thread advances every :data:`TICK_S`
seconds (20 ms): reading the system clock twice per op cost more than all the rest of the
recording (measured: ~0.25 us of ~0.5 us per op inside an MPI job), and a hang is measured in
seconds. Cost per op: one list, one ring store, one attribute update, two list reads
(``python -m hpcddp.bench.recorder`` measures it against the op itself). Entries keep a
reference to their shape and dtype objects (no copies); the watchdog turns them into plain
data only when it reports.
"""
from __future__ import annotations

import itertools
import time

from hpcddp import settings

_now = time.monotonic
TICK_S = 0.02
TICK = [_now()]          # [seconds]: advanced by the watchdog thread (see tick()); never 0.0


def tick() -> float:
    """Advance the recorder's clock to now (the watchdog calls it every TICK_S seconds)."""
    t = TICK[0] = _now()
    return t

SEQ, OP, GROUP, SHAPE, DTYPE, PEER, T_START, T_END = range(8)
P2P_OPS = frozenset({"send", "recv"})


class FlightRecorder:
    """A ring of the last CAPACITY entries of this process (all threads, all communicators)."""

    def __init__(self, capacity: int = 2048):
        if capacity < 1:
            raise ValueError(f"FlightRecorder: capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.buf: list = [None] * capacity
        # next() on a cycle is atomic (one C call under the GIL): safe from autograd threads,
        # and cheaper than a counter and a modulo
        self._slots = itertools.cycle(range(capacity))
        self._p2p_seq: dict = {}
        self.start = self._make_start()

    def _make_start(self):
        buf, slots, clock = self.buf, self._slots, TICK

        def start(comm, op: str, shape=None, dtype=None, peer=None) -> list:
            seq = comm.seq = comm.seq + 1
            buf[next(slots)] = entry = [seq, op, comm, shape, dtype, peer, clock[0], 0.0]
            return entry
        return start

    def add(self, entry: list) -> None:
        """Put a ready-made entry in the ring (hpcddp's finalize marks itself this way)."""
        self.buf[next(self._slots)] = entry

    def start_p2p(self, comm, op: str, shape=None, dtype=None, peer=None) -> list:
        key = comm.uid
        seq = self._p2p_seq[key] = self._p2p_seq.get(key, 0) + 1
        self.buf[next(self._slots)] = entry = [seq, op, comm, shape, dtype, peer, TICK[0], 0.0]
        return entry

    def native_writer(self) -> tuple:
        """(ring, slot cycle, clock, p2p sequence numbers by communicator uid): what a writer
        of entries in C (hpcddp.collectives._fastpath) shares to record as start() and
        start_p2p() do, entries laid out as SEQ ... T_END above."""
        return self.buf, self._slots, TICK, self._p2p_seq

    def p2p_seq(self, comm) -> int:
        return self._p2p_seq.get(comm.uid, 0)

    def entries(self) -> list:
        """Recorded entries, oldest first (by start time, then sequence number: entries of
        one group within one TICK_S are in call order)."""
        return sorted((e for e in list(self.buf) if e is not None),
                      key=lambda e: (e[T_START], e[SEQ]))

    def in_flight(self) -> list:
        return [e for e in self.entries() if e[T_END] == 0.0]

    def clear(self) -> None:
        for i in range(self.capacity):
            self.buf[i] = None


def _capacity() -> int:
    return settings.get().recorder_size


RECORDER = FlightRecorder(_capacity())
start = RECORDER.start
start_p2p = RECORDER.start_p2p


def end(entry: list, _clock=TICK) -> None:
    entry[T_END] = _clock[0]


def generation(comm) -> int | None:
    """How many groups of COMM's name and members this process made before it: tells apart,
    on every rank alike, two groups torch names alike (Communicator.audit_key); None for a
    group without a given name."""
    key = getattr(comm, "audit_key", None)
    return None if key is None else key[2]


def describe(entry: list, now: float | None = None) -> dict:
    """An entry as plain data (what crosses ranks in a report)."""
    comm = entry[GROUP]
    now = _now() if now is None else now
    shape = entry[SHAPE]
    return {
        "seq": entry[SEQ], "op": entry[OP],
        "group": getattr(comm, "name", str(comm)),
        "ranks": list(getattr(comm, "world_ranks", ())),
        "gen": generation(comm),
        "grank": getattr(comm, "rank", None),
        "shape": None if shape is None else [int(s) for s in shape],
        "dtype": None if entry[DTYPE] is None else str(entry[DTYPE]).replace("torch.", ""),
        "peer": entry[PEER],
        "age": now - entry[T_START],
        "done_ago": None if entry[T_END] == 0.0 else now - entry[T_END],
        # left in flight when the script ended (an exception), or failed; not one the
        # agreement refused (every rank raised; the group goes on)
        "abandoned": len(entry) > 8 and entry[8] != "refused",
    }
