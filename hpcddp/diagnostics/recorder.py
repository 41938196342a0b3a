"""Flight recorder: a bounded per-rank ring of the last ops (what each rank was doing).

Every hpcddp op, through torch.distributed or the direct API, calls :func:`start` before its
first message and :func:`end` when it completes. An entry is a small list
``[seq, op, group, shape, dtype, peer, t_start, t_end]`` (t_end 0.0 while in flight);
``seq`` counts ops per communicator, as torch's per-group sequence numbers do.
Cost: one list allocation and two clock reads per op (well under a microsecond).
"""
from __future__ import annotations

import os
import time

_now = time.monotonic

SEQ, OP, GROUP, SHAPE, DTYPE, PEER, T_START, T_END = range(8)


class FlightRecorder:
    def __init__(self, capacity: int = 2048):
        self.capacity = capacity
        self.buf: list = [None] * capacity
        self.count = 0

    def start(self, comm, op: str, shape=None, dtype=None, peer=None) -> list:
        comm.seq += 1
        entry = [comm.seq, op, comm.name, shape, dtype, peer, _now(), 0.0]
        n = self.count
        self.buf[n % self.capacity] = entry
        self.count = n + 1
        return entry

    def entries(self) -> list:
        """Recorded entries, oldest first."""
        n, cap = self.count, self.capacity
        if n <= cap:
            return [e for e in self.buf[:n]]
        i = n % cap
        return self.buf[i:] + self.buf[:i]

    def in_flight(self) -> list:
        return [e for e in self.entries() if e[T_END] == 0.0]


RECORDER = FlightRecorder(int(os.environ.get("HPCDDP_RECORDER_SIZE", "2048")))
start = RECORDER.start


def end(entry: list) -> None:
    entry[T_END] = _now()
