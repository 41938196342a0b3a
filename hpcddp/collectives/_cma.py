"""Large broadcasts among ranks of one node by cross-memory attach (Linux process_vm_readv and
process_vm_writev: the kernel copies straight between two processes' memory).

Why: MPI's broadcast of a large buffer between ranks of one node is one copy made by each
receiver (Open MPI's sm transport reads the root's pages through the same syscall, its smsc/cma
component), so with two ranks one core copies while the root's core waits: the op can go no
faster than one core's memcpy. Here the root and the receivers split the copy. The payload is
cut into n parts; the root writes part i into receiver i's tensor while receiver i reads every
other part out of the root's tensor, so every core copies (n-1)/n of the payload at once
(measured against MPI's Bcast in docs/benchmarks.md, "Cross-memory attach").

Per call (the tensor itself is the buffer on both sides: no staging copy)::

    1. Allgather (address, bytes, call hash) of every rank's tensor    (24 bytes per rank)
    2. the copies: root -> part i of receiver i; receiver r <- parts j != r of the root
    3. Allreduce of "all my copies succeeded"                      (the end of the op)

Step 3 is what makes it safe: the root's tensor stays untouched until every reader is done,
and a receiver's tensor is complete only once the root's write into it is. If any rank's copy
failed (the kernel refused: a ptrace policy, a seccomp filter, a peer gone), every rank moves
the tensor again with MPI's Bcast and the group stops using this path. The call hash
(diagnostics.mismatch: op, sequence number, count, dtype, root) rides in step 1's Allgather:
ranks that disagree on the call (a caller's bug: a different root would have two ranks write
into each other) all see it in the same table and all raise before any copy.

A group gets the path on its first large broadcast (collective): its ranks must share one
node, each must be able to read a neighbour's memory (checked against a random token, so a
process id from another PID namespace cannot pass); a race against MPI's Bcast at sizes from
256 KiB up (_node.crossover: best of 3, the slowest rank's time) decides from which size the
path serves. ``HPCDDP_CMA=0`` turns it off, ``force`` skips the race and serves from MIN_BYTES
(tests), ``auto`` or ``1`` is the default; set it alike on every rank.
"""
from __future__ import annotations

import ctypes
import os
import secrets

import numpy as np

from hpcddp.collectives import _node
from hpcddp.comm._mpi import MPI

# The smallest size the race tries: below it this path's fixed cost (an Allgather and an
# Allreduce) is larger than what the split copy saves (docs/benchmarks.md, "Cross-memory attach")
MIN_BYTES = _node.LADDER[0]
LADDER = _node.LADDER_LARGE
ALIGN = 64           # parts start on cache lines: no line is written by two copies at once


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _syscalls():
    """(process_vm_readv, process_vm_writev) from the C library; (None, None) where it has none
    (not Linux, a libc older than 2.15)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fns = libc.process_vm_readv, libc.process_vm_writev
    except (OSError, AttributeError):
        return None, None
    for f in fns:
        f.restype = ctypes.c_ssize_t
        f.argtypes = [ctypes.c_int, ctypes.POINTER(_IOVec), ctypes.c_ulong,
                      ctypes.POINTER(_IOVec), ctypes.c_ulong, ctypes.c_ulong]
    return fns


READV, WRITEV = _syscalls()


def copy(fn, pid: int, local: int, remote: int, nbytes: int) -> bool:
    """Move NBYTES between address LOCAL of this process and address REMOTE of process PID:
    FN is READV (remote -> local) or WRITEV (local -> remote). False if the kernel refuses
    (EPERM: a ptrace policy; ESRCH: the peer is gone; EFAULT: a bad address)."""
    done = 0
    while done < nbytes:  # the kernel may move less than asked (a fault part way): go on
        here = _IOVec(local + done, nbytes - done)
        there = _IOVec(remote + done, nbytes - done)
        got = fn(pid, ctypes.byref(here), 1, ctypes.byref(there), 1, 0)
        if got <= 0:
            return False
        done += got
    return True




def usable(comm, nbytes: int, made=None):
    """COMM's Peers where a broadcast of NBYTES (at least MIN_BYTES: the dispatch table's row
    tested it) should take this path, else None (the same answer on every rank: a
    collective's arguments agree across ranks). MADE: the group's Peers where its row
    already knows it serves from the row's size (made and raced: call.group_rows), else
    None (made and raced here, on the op's first call)."""
    if comm.size < 2:
        return None
    if made is not None:            # the group's rows leave the path out where switched off
        return made
    if _node.switch("cma") == "0":
        return None
    found = peers(comm)
    return found if _node.serves(found, "broadcast", nbytes) else None


def peers(comm):
    """COMM's Peers, made on first use (collective: every rank of COMM), or None when the path
    is not open to it (several nodes, or the kernel refuses)."""
    return comm.attached("cma", Peers.make)


class Peers:
    def __init__(self, comm, pids: list[int]):
        self.comm = comm
        self.pids = pids
        self.mine = np.zeros(3, np.int64)                 # (address, bytes, call hash) of this rank
        self.table = np.zeros((comm.size, 3), np.int64)   # ... of every rank
        self.ok = np.ones(1, np.int32)
        self.starts = _node.Starts("cma", comm, self._race_pair, _node.switch("cma") == "force",
                                   MIN_BYTES,
                                   LADDER)

    @classmethod
    def make(cls, comm):
        if not _node.one_node(comm):
            return None
        mpi = comm.mpi
        token = np.array([secrets.randbits(62)], np.int64)
        pids, addrs, tokens = zip(*mpi.allgather((os.getpid(), token.ctypes.data, int(token[0]))))
        peer = (comm.rank + 1) % comm.size
        got = np.zeros(1, np.int64)
        try:  # no rank may leave before the allreduce below: the others would wait there
            ok = READV is not None and copy(READV, pids[peer], got.ctypes.data, addrs[peer], 8) \
                and int(got[0]) == tokens[peer]
        except Exception:
            ok = False
        # every rank's token stays alive until all have read theirs: this is the end of it
        if not mpi.allreduce(bool(ok), op=MPI.LAND):
            return None
        return cls(comm, list(pids))

    def _race_pair(self, op: str, nbytes: int):
        """This path's broadcast and MPI's of NBYTES (the start-up race)."""
        arr = np.ones(nbytes, np.uint8)  # touched pages (calloc zeros share one page)
        mpi = self.comm.mpi
        return lambda: self.broadcast(arr, 0), lambda: mpi.Bcast(arr, root=0)

    def broadcast(self, arr: np.ndarray, root: int, check=None) -> bool:
        """ARR (contiguous, this rank's tensor's memory) from group rank ROOT to every rank.
        CHECK: the call's hash (diagnostics.mismatch.agreement) or None. False (on every
        rank, before any copy) where the ranks' calls differ."""
        comm = self.comm
        mpi, n = comm.mpi, comm.size
        nbytes = arr.nbytes
        mine = self.mine
        mine[0], mine[1], mine[2] = arr.ctypes.data, nbytes, 0 if check is None else check.value
        mpi.Allgather(mine, self.table)
        # the same table everywhere: every rank takes the same branch below
        if check is not None and self.table[:, 2].tolist().count(mine[2]) != n:
            return False
        if (self.table[:, 1] != nbytes).any():  # unchecked (detail mode checked it already)
            mpi.Bcast(arr, root=root)           # sizes differ: MPI reports it, as it always did
            return True
        cut = [nbytes * j // n // ALIGN * ALIGN for j in range(n)] + [nbytes]
        try:
            ok = self._copy_parts(root, cut)
        except Exception:   # never leave the op early: the peers wait in the Allreduce below
            ok = False
        self.ok[0] = ok
        mpi.Allreduce(MPI.IN_PLACE, self.ok, MPI.MIN)
        if not self.ok[0]:
            comm.attach("cma", None)            # every rank saw the failure: all stop alike
            mpi.Bcast(arr, root=root)
        return True

    def _copy_parts(self, root: int, cut: list) -> bool:
        """This rank's share of the copies (root: part i into receiver i; receiver r: every
        part j != r out of the root). False at the first the kernel refuses."""
        n, r, table = self.comm.size, self.comm.rank, self.table
        src = int(table[root, 0])
        if r == root:
            return all(copy(WRITEV, self.pids[i], src + cut[i], int(table[i, 0]) + cut[i],
                            cut[i + 1] - cut[i]) for i in range(n) if i != root)
        dst, pid = int(table[r, 0]), self.pids[root]
        return all(copy(READV, pid, dst + cut[j], src + cut[j], cut[j + 1] - cut[j])
                   for j in ((r + k) % n for k in range(1, n)))  # ranks start on different parts
