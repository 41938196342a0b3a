"""What hpcddp's node-local fast paths share: the /dev/shm arena (paths/arena.py) and cross-memory
attach (_cma) are used only by groups whose ranks all share one node, each behind its own
switch, and each only from the size where a race against MPI says it is faster, per op."""
from __future__ import annotations

import math
import time

import numpy as np

from hpcddp import settings
from hpcddp.comm import links
from hpcddp.comm._mpi import MPI

# What each race decided, in order (Crossover.as_dict). Benchmarks report it (a job where MPI
# won runs at MPI's speed: that must show). The latest MAX_DECISIONS: a job that makes and
# destroys groups in a loop races on each, and keeps no more than these.
MAX_DECISIONS = 256
decisions: list[dict] = []


def one_node(comm) -> bool:
    """Whether every rank of COMM runs on this node (collective; the same answer everywhere)."""
    node = comm.mpi.Split_type(MPI.COMM_TYPE_SHARED)
    same = node.Get_size() == comm.size
    node.Free()
    return same


def _mib(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


class Crossover:
    """Where a node-local path beats MPI for one op on one group, measured at start-up: a
    race at the sizes of LADDER, smallest first (:func:`crossover`). The path serves the op
    from ``start`` bytes (None: MPI won at every size raced); ``steps`` holds each size's
    (bytes, this path's s, MPI's s), the slowest rank's best of TRIES; ``cost_s`` what the
    race took."""
    def __init__(self, path: str, op: str, comm, start, steps, cost_s: float, win: float = 0.95):
        self.path, self.op, self.group, self.ranks = path, op, comm.name, comm.size
        self.start, self.steps, self.cost_s, self.win = start, steps, cost_s, win

    def why(self) -> str:
        """The sizes around the decision, in words (hpcddp info, the bench header)."""
        def at(step):
            nbytes, ours, mpi = step
            return f"at {_mib(nbytes)}: this path {ours * 1e3:.2f} ms, MPI {mpi * 1e3:.2f} ms"
        lost = [s for s in self.steps if s[1] > self.win * s[2]]
        won = [s for s in self.steps if s[0] >= (self.start or 1 << 62)]
        parts = ([f"{losing(self.win)} {at(lost[-1])}"] if lost else []) + \
                ([f"faster {at(won[0])}"] if won else [])
        return f"{'; '.join(parts)}; race {self.cost_s * 1e3:.0f} ms"

    def as_dict(self) -> dict:
        return {"path": self.path, "op": self.op, "group": self.group, "ranks": self.ranks,
                "start_bytes": self.start, "steps": [list(s) for s in self.steps],
                "cost_s": self.cost_s, "win": self.win}


# The sizes a race tries, a factor of 2 apart. Where a path overtakes MPI differs by machine,
# op and ranks per node (docs/benchmarks.md, "Where each path starts"); a fixed size is wrong
# on some machine for the calls between the fixed size and the real crossover.
LADDER = tuple((256 << 10) << i for i in range(7))           # 256 KiB .. 16 MiB
# Above its ladder a path serves as it did at the top size, so one slow try there closes it for
# every larger call. The node-local paths go up to 32 MiB, where their lead over MPI is widest
# (the arena 2.5-3x, the split broadcast 1.4x here) and their buffers no longer fit a 32 MiB L3
# (at 8-16 MiB MPI's one-copy broadcast can tie with two half copies in cache).
LADDER_LARGE = LADDER + (32 << 20,)
TRIES = 3
# A size counts as won only where the path took at most this fraction of MPI's time: near a
# tie the best of 3 favours whichever path varies more, and a user compares against MPI
WIN = 0.95
MARGIN = f"{(1 - WIN) * 100:.0f}%"
# A path that waits in the kernel where MPI polls (the ring over TCP links) also takes a tie:
# it serves up to TIE of MPI's time, and leaves the core MPI's wait would take to the caller
TIE = links.TIE


def losing(win: float) -> str:
    """How a size the path did not take reads, under the race's rule WIN."""
    return f"not {MARGIN} faster" if win < 1 else f"over {MARGIN} slower"


def best_times(comm, ours, mpis, tries: int = TRIES) -> tuple:
    """This rank's best of TRIES interleaved runs of OURS and of MPIS (seconds); collective."""
    best = [math.inf, math.inf]
    for _ in range(tries):
        for i, op in enumerate((ours, mpis)):
            comm.mpi.Barrier()
            t = time.perf_counter()
            op()
            best[i] = min(best[i], time.perf_counter() - t)
    return tuple(best)


def crossover(path: str, op: str, comm, pair, ladder=LADDER, win: float = WIN) -> Crossover:
    """Race PATH against MPI for OP on COMM up LADDER: PAIR(nbytes) gives the two calls on
    scratch buffers of that size. The path serves OP from the first size where it won there
    (took at most WIN of MPI's time) and at the next size up (the race stops there: larger calls only favour it more); won
    only at the last size, from there; else never. Times are the slowest rank's, so every
    rank decides alike (collective). Kept in ``decisions``."""
    t0 = time.perf_counter()
    steps, won_at, start = [], None, None
    for nbytes in ladder:
        ours, mpis = pair(nbytes)
        times = np.array(best_times(comm, ours, mpis))
        comm.mpi.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
        steps.append((nbytes, float(times[0]), float(times[1])))
        if times[0] <= win * times[1]:
            if won_at is not None:
                start = won_at
                break
            won_at = nbytes
        else:
            won_at = None
    else:
        start = won_at
    cost = comm.mpi.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    found = Crossover(path, op, comm, start, steps, cost, win)
    decisions.append(found.as_dict())
    del decisions[:-MAX_DECISIONS]
    return found


class Scratch:
    """Buffers a path's object for a group reuses from call to call, one per KEY, grown to the
    largest call (freed with the group). Fresh pages cost a fault each on first touch: a
    16 MiB hierarchical all_gather across 2 virtual nodes x 2 took 81-83 ms on kept buffers,
    92-107 ms on fresh ones (docs/benchmarks.md). Calls on one group never run at once (the
    async engine's queue for the group), so one buffer per key suffices. KEEP=False: fresh every time
    (:data:`FRESH`, for callers with no group object)."""
    def __init__(self, keep: bool = True):
        self.keep = keep
        self._bufs: dict = {}

    def get(self, key: str, count: int, dtype) -> np.ndarray:
        """COUNT elements of DTYPE, uninitialised, under KEY."""
        dtype = np.dtype(dtype)
        if not self.keep:
            return np.empty(count, dtype)
        nbytes = count * dtype.itemsize
        buf = self._bufs.get(key)
        if buf is None or buf.nbytes < nbytes:
            buf = self._bufs[key] = np.empty(nbytes, np.uint8)
        return buf[:nbytes].view(dtype)


FRESH = Scratch(keep=False)


NEVER = 1 << 62               # a row's size on a group it can never serve
_UNMADE = object()


def group_floor(comm, key: str, race_op: str, min_bytes: int, min_size: int = 2) -> tuple:
    """(from which size, the group's state) of the node-local path KEY (its state attached to
    COMM under KEY) for the op its race RACE_OP measures on COMM, from what the group has
    already made and raced (no message): the size is MIN_BYTES while it has not, NEVER where
    it cannot serve (switched off, fewer than MIN_SIZE ranks, no state for the group, or MPI
    won the race at every size); the state is the path's object for the group where it serves from that
    size (made and raced, or forced), else None (the path's applies() makes and races it)."""
    if comm.size < min_size or switch(key) == "0":
        return NEVER, None
    made = comm._attached.get(key, _UNMADE)
    if made is _UNMADE:
        return min_bytes, None
    if made is None:
        return NEVER, None
    starts = made.starts
    if starts.forced:
        return max(min_bytes, starts.floor), made
    found = starts.found.get(race_op)
    if found is None:
        return min_bytes, None
    return (NEVER, None) if found.start is None else (max(min_bytes, found.start), made)


def serves(path, op: str, nbytes: int) -> bool:
    """Whether PATH (a path's object for the group, with ``starts``; None: not open to the
    group) serves OP at NBYTES; OP's race runs on the first ask (collective)."""
    if path is None:
        return False
    start = path.starts.start(op)
    return start is not None and nbytes >= start


class Starts:
    """A path's crossover per op on its group, raced on the op's first call that could take
    the path (collective: every rank of the group makes that call); FORCED: the mode that
    skips the races (the path serves every op from FLOOR)."""
    def __init__(self, path: str, comm, pair, forced: bool, floor: int, ladder=LADDER,
                 win: float = WIN):
        self.path, self.comm, self.pair, self.forced = path, comm, pair, forced
        self.floor, self.ladder, self.win = floor, ladder, win
        self.found: dict = {}                # op -> Crossover

    def start(self, op: str):
        """The size from which the path serves OP (None: never)."""
        if self.forced:
            return self.floor
        found = self.found.get(op)
        if found is None:
            found = self.found[op] = crossover(self.path, op, self.comm,
                                               lambda nbytes: self.pair(op, nbytes), self.ladder,
                                               self.win)
            self.comm.rows.clear()     # the group's rows now know where the path starts
        return found.start


# each node-local path's switch: its variable (docs/settings.md) and its field in this
# process's settings, the one snapshot every path reads where it decides (hpcddp.settings.get,
# replaced as a whole where a setting changes: hpcddp.init(timeout=), tests), never a copy of
# its own made at import
# (keyed as the path's state is attached to a group). A group's rows (call.group_rows) leave
# out a path switched off and are made again when the snapshot is replaced, so a call that
# finds its path made in its rows need not read the switch again.
SWITCHES = {"shm": ("HPCDDP_SHM_ALLREDUCE", "shm_allreduce"), "cma": ("HPCDDP_CMA", "cma"),
            "hier": ("HPCDDP_HIER", "hier"), "ring": ("HPCDDP_RING", "ring")}


def switch(key: str) -> str:
    """The switch of the path attached under KEY, now: "0" (off), "auto" (raced against MPI)
    or "force" (no race)."""
    return getattr(settings.get(), SWITCHES[key][1])


def path_state(name: str, opened, unopened: str, raced: dict | None = None, how=None):
    """``hpcddp info``'s state of the node-local path attached under NAME (a key of SWITCHES)
    for an op: its switch
    (the value the path's own usable() tests), then whether OPENED(comm) set it up for the
    group (closed: UNOPENED), then from which size it serves the op (RACED: the table's ops ->
    the op its start-up race measures; the race runs here if the op has not had it). HOW:
    what the opened path says of how it runs (the ring: on which transport), if anything."""
    variable = SWITCHES[name][0]

    def state(comm, op) -> str:
        if switch(name) == "0":
            return f"closed ({variable}=0)"
        if comm.size < 2:
            return "closed (one rank)"
        path = opened(comm)
        if path is None:
            return f"closed ({unopened})"
        on = f" {how(path)}" if how else ""
        if raced is None:
            return f"open{on}"
        starts = path.starts
        start = starts.start(raced[op])
        if starts.forced:
            return f"open from {_mib(start)}{on} ({variable}=force: no race)"
        found = starts.found[raced[op]]
        if start is None:
            return (f"closed ({losing(found.win)} than MPI at any size raced, up to "
                    f"{_mib(found.steps[-1][0])}: {found.why()})")
        return f"open from {_mib(start)}{on} ({found.why()})"
    return state
