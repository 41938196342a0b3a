"""The shared-memory arena path: all_reduce and reduce_scatter among ranks of one node through one
shared buffer, from the size where its start-up race finds it faster than MPI: the path's
object (``ArenaPath``, the dispatch table's rows) and its mechanism (``Arena``), one module.

Why: Open MPI's shared-memory Allreduce moves large buffers at a fraction of what the memory
can do: its pipeline copies every fragment through the sm transport's small buffers and
reduces in the receiver's loop. Reducing straight out of a shared arena in chunks that stay in
cache is several times faster at large sizes (docs/benchmarks.md, "The shared-memory arena").
DeepSpeed's and oneCCL's CPU all-reduces do the same; gloo has no shared memory at all.

How, per chunk of the tensor (a chunk = n slices, one per rank; the arena holds one row of
n slots per rank, so n x n slots in all)::

    1. rank i copies its slices j != i into row i, slot j           (the peers' inputs)
    2. barrier
    3. rank j reduces slice j over ranks 0, 1, ..., n-1 in that order (its own slice from its
       tensor, the others' from their rows) into slot (j, j), and copies it into its tensor
    4. barrier
    5. rank i copies slots (j, j), j != i, into its tensor           (the others' results)

Each element is reduced by one rank in rank order and copied to all: every rank ends with the
same bits, whatever the chunking. Two barriers per chunk keep rounds apart: a rank writes a
row only after every peer has passed the barrier that ends the previous chunk's reads. The
MPI barrier is also the memory fence (its own shared-memory flags need one on every
architecture MPI runs on).

The arena is a file in /dev/shm made by the group's rank 0, mapped by every member and
unlinked as soon as all have it open (no file outlives the job, even when it is killed), with
its pages reserved up front (posix_fallocate: a full /dev/shm fails here, cleanly, instead of
a SIGBUS on first touch). Any failure on any rank -> every rank keeps using MPI for this
group. Only groups whose ranks all share one node use it, and only for the SUM family (SUM,
AVG, PREMUL_SUM) on non-bool dtypes of at least MIN_BYTES.

Measured, not assumed: on an op's first call of at least MIN_BYTES, the group races the
arena against MPI's own op (Allreduce, Reduce_scatter_block) at sizes from 256 KiB up
(_node.crossover: best of 3 each, the slowest rank's time) and the arena serves that op from
the size where it starts to win. Machines differ (cache sizes, MPI's shared-memory transport),
and some virtual machines start a job in a state where writes into the shared pages are
several times slower (docs/benchmarks.md): the race finds the crossover of the job at hand.
``HPCDDP_SHM_ALLREDUCE=0`` turns the arena off, ``force`` skips the race and serves from
MIN_BYTES (tests), ``auto`` or ``1`` is the default; set it alike on every rank.
"""
from __future__ import annotations

import mmap
import os
import secrets

import torch

from hpcddp.collectives import _node
from hpcddp.comm._mpi import MPI
from hpcddp.comm.ops import RedOpType
from hpcddp.diagnostics import mismatch as _mismatch

# The smallest size the race tries: below it MPI's own algorithm always wins here
MIN_BYTES = _node.LADDER[0]
ROW_BYTES = 2 << 20       # per rank and chunk: slices of ROW_BYTES / n stay in L2 while reduced
ARENA_MAX = 32 << 20      # the whole arena, n x row, whatever the ranks per node
SHM_DIR = "/dev/shm"
KINDS = (RedOpType.SUM, RedOpType.AVG, RedOpType.PREMUL_SUM)



# the ops of the table served by the arena -> the op its race measures
RACED = {"all_reduce": "all_reduce", "reduce_scatter": "reduce_scatter",
         "reduce_scatter_tensor": "reduce_scatter"}


def usable(comm, nbytes: int, dtype, kind, op: str = "all_reduce", made=None):
    """COMM's arena where OP (all_reduce or a reduce_scatter; NBYTES: the whole input, at
    least MIN_BYTES: the dispatch table's row tested it) should take this path, else None
    (the same answer on every rank of COMM: the arguments of a collective agree). MADE: the
    group's arena where its row already knows it serves from the row's size (made and raced:
    call.group_rows), else None (made and raced here, on the op's first call)."""
    if comm.size < 2 or kind not in KINDS or dtype is torch.bool:
        return None
    if made is not None:            # the group's rows leave the arena out where switched off
        return made
    if _node.switch("shm") == "0":
        return None
    found = arena(comm)
    return found if _node.serves(found, RACED[op], nbytes) else None


def arena(comm):
    """COMM's arena, made on first use (collective: every rank of COMM), or None if it cannot
    have one (ranks on several nodes, no /dev/shm, no room)."""
    return comm.attached("shm", Arena.make)


CALL_LINE = 64            # bytes per rank for its call's hash: a cache line each, no false sharing
MAX_CHECKS = 256          # kinds of call an arena keeps the hash of


class Arena:
    def __init__(self, comm, mem: mmap.mmap, slot: int):
        self.comm = comm
        self.mem = mem
        self.slot = slot                      # bytes per (row, slice) slot
        self.bytes = torch.frombuffer(mem, dtype=torch.uint8)
        # after the n x n slots: each rank's hash of the call it is making (see _agreed)
        n = comm.size
        words = memoryview(mem)[n * n * slot:].cast("q")     # int64s: plain Python indexing
        self.calls = words[::CALL_LINE // 8]
        self.starts = _node.Starts("shm arena", comm, self._race_pair,
                                   _node.switch("shm") == "force", MIN_BYTES,
                                   _node.LADDER_LARGE)
        self.checks: dict = {}                # (op, shape, dtype, reduce op) -> its CallHash

    def check(self, c):
        """Call C's hash for the ranks to compare after the first barrier (None: nothing left
        to check, diagnostics.mismatch.agreement), kept per kind of call: a step makes the
        same few calls again and again."""
        key = (c.name, c.shape, c.dtype, c.kind)
        try:
            return self.checks[key]
        except KeyError:
            pass
        if len(self.checks) >= MAX_CHECKS:
            self.checks.clear()
        found = self.checks[key] = _mismatch.agreement(self.comm, c.entry, c.kind)
        return found

    def _agreed(self, check) -> bool:
        """Called right after the first barrier of a call, for which every rank wrote the hash
        of its call (op, count, dtype, reduce op) into its line: whether they are all the
        same. Every rank reads the same lines, so all answer alike; a line is not written
        again before every rank has read it (the next call's write comes after this call's
        last barrier, which every rank passes only after this read)."""
        return self.calls.tolist().count(check.value) == self.comm.size

    def _race_pair(self, op: str, nbytes: int):
        """The arena's call and MPI's for OP on NBYTES of scratch float32 (the start-up race)."""
        mpi, n = self.comm.mpi, self.comm.size
        count = nbytes // 4 // n * n
        x = torch.empty(count).fill_(0.0)     # touched: a page fault is not the op's cost
        if op == "all_reduce":
            arr = x.numpy()
            return (lambda: self.all_reduce(x),
                    lambda: mpi.Allreduce(MPI.IN_PLACE, arr, MPI.SUM))
        out = torch.empty(count // n).fill_(0.0)
        blocks, arr, out_arr = list(x.chunk(n)), x.numpy(), out.numpy()
        return (lambda: self.reduce_scatter(blocks, out),
                lambda: mpi.Reduce_scatter_block(arr, out_arr, MPI.SUM))

    @classmethod
    def make(cls, comm):
        mpi = comm.mpi
        if not _node.one_node(comm):
            return None
        n = comm.size
        row = max(64 << 10, min(ROW_BYTES, ARENA_MAX // n))
        slot = row // n // 4096 * 4096 or 4096
        size = n * n * slot + n * CALL_LINE
        path, fd = "", -1
        if comm.rank == 0:
            path = os.path.join(SHM_DIR, f"hpcddp-{os.getpid()}-{secrets.token_hex(4)}")
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                os.posix_fallocate(fd, 0, size)
            except OSError:
                if fd >= 0:         # made but no room: leave nothing behind
                    os.close(fd)
                    os.unlink(path)
                path, fd = "", -1
        path = mpi.bcast(path, root=0)
        mem = None
        try:
            if path:
                if fd < 0:
                    fd = os.open(path, os.O_RDWR)
                mem = mmap.mmap(fd, size)
        except OSError:
            mem = None
        finally:
            if fd >= 0:
                os.close(fd)
        ok = mpi.allreduce(mem is not None, op=MPI.LAND)
        if comm.rank == 0 and path:
            os.unlink(path)  # every rank has mapped it or given up: the name is not needed
        if not ok:
            if mem is not None:
                mem.close()
            return None
        return cls(comm, mem, slot)

    def close(self) -> None:
        """Unmap the arena (its group has ended; the name was unlinked when it was made)."""
        self.bytes = self.calls = None     # the views that export the mapping
        try:
            self.mem.close()
        except BufferError:                # a view still held elsewhere: unmapped with it
            pass

    def all_reduce(self, flat: torch.Tensor, check=None) -> bool:
        """SUM FLAT (1-D, contiguous, CPU) in place across the group. CHECK: the call's hash
        (diagnostics.mismatch.agreement) or None; ranks compare it after the first barrier,
        when each has written only its own row, before any reads another's or writes FLAT.
        False (on every rank, FLAT untouched) where the ranks' calls differ."""
        comm = self.comm
        n, r, barrier = comm.size, comm.rank, comm.mpi.Barrier
        stage = self.bytes.view(flat.dtype)
        cap = self.slot // flat.element_size()   # elements per slot
        total = flat.numel()
        step = cap * n
        for off in range(0, total, step):
            m = min(step, total - off)
            b = [off + m * j // n for j in range(n + 1)]
            for j in range(n):                                   # 1. publish
                if j != r:
                    s = (r * n + j) * cap
                    stage[s:s + b[j + 1] - b[j]].copy_(flat[b[j]:b[j + 1]])
            if check is not None and off == 0:
                self.calls[r] = check.value
                barrier()                                        # 2.
                if not self._agreed(check):
                    return False
            else:
                barrier()                                        # 2.
            k = b[r + 1] - b[r]
            mine = flat[b[r]:b[r + 1]]
            d = (r * n + r) * cap
            out = stage[d:d + k]
            ins = [mine if i == r else stage[(i * n + r) * cap:(i * n + r) * cap + k]
                   for i in range(n)]
            torch.add(ins[0], ins[1], out=out)                   # 3. reduce in rank order
            for x in ins[2:]:
                out.add_(x)
            mine.copy_(out)
            barrier()                                            # 4.
            for j in range(n):                                   # 5. collect
                if j != r:
                    d = (j * n + j) * cap
                    flat[b[j]:b[j + 1]].copy_(stage[d:d + b[j + 1] - b[j]])
        return True

    def reduce_scatter(self, blocks: list, out: torch.Tensor, check=None) -> bool:
        """SUM BLOCKS[j] (n flat tensors of out's size, one per rank) across the group: rank r
        gets the sum of everyone's BLOCKS[r] in OUT (flat). Steps 1-3 of all_reduce, with the
        op's own partition (block j to rank j) instead of an even split of each chunk; CHECK
        as for all_reduce."""
        comm = self.comm
        n, r, barrier = comm.size, comm.rank, comm.mpi.Barrier
        stage = self.bytes.view(out.dtype)
        cap = self.slot // out.element_size()
        c = out.numel()
        for o in range(0, c, cap):
            k = min(cap, c - o)
            for j in range(n):                                   # publish block j's piece
                if j != r:
                    s = (r * n + j) * cap
                    stage[s:s + k].copy_(blocks[j][o:o + k])
            if check is not None and o == 0:
                self.calls[r] = check.value
                barrier()
                if not self._agreed(check):
                    return False
            else:
                barrier()
            ins = [blocks[r][o:o + k] if i == r else stage[(i * n + r) * cap:(i * n + r) * cap + k]
                   for i in range(n)]
            dst = out[o:o + k]
            torch.add(ins[0], ins[1], out=dst)                   # rank order
            for x in ins[2:]:
                dst.add_(x)
            barrier()  # nobody overwrites a slot before its reader is done with it
        return True


# -- the path ----------------------------------------------------------------------------------

class ArenaPath:
    name = "shm arena"
    min_bytes = MIN_BYTES
    OPS = frozenset({"all_reduce", "reduce_scatter_tensor", "reduce_scatter"})
    state = staticmethod(_node.path_state("shm", lambda g: arena(g),
                                          "ranks on several nodes, or no room in /dev/shm",
                                          RACED))

    @staticmethod
    def floor(comm, op: str) -> tuple:   # the group's row (call.group_rows)
        return _node.group_floor(comm, "shm", RACED[op], MIN_BYTES)

    @staticmethod
    def applies(c, made, op: str) -> bool:
        c.via = usable(c.comm, c.nbytes, c.dtype, c.kind, op, made)     # the group's Arena
        return c.via is not None

    @staticmethod
    def all_reduce(c):
        arena = c.via
        check = arena.check(c)
        if not arena.all_reduce(c.tensor.view(-1), check):
            check.refuse(c.entry)

    @staticmethod
    def reduce_scatter_tensor(c):
        flat, k = c.input.view(-1), c.tensor.numel()
        _reduce_scatter(c, [flat[j * k:(j + 1) * k] for j in range(c.comm.size)])

    @staticmethod
    def reduce_scatter(c):
        _reduce_scatter(c, [t.view(-1) for t in c.tensors])


def _reduce_scatter(c, blocks) -> None:
    """C's BLOCKS (one per rank) summed through the arena into its output, C.tensor."""
    arena = c.via
    check = arena.check(c)
    if not arena.reduce_scatter(blocks, c.tensor.view(-1), check):
        check.refuse(c.entry)


ARENA = ArenaPath()
