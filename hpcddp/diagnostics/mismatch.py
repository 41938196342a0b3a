"""Mismatch check (``HPCDDP_DEBUG=detail``): ranks compare each collective before running it.

Before every collective, each member puts a fixed-size fingerprint of the call (op, sequence
number on the group, dtype, shape, root) into an allgather on a private duplicate of the op's
communicator (never the op's own: the check's messages cannot match the user's). If the
fingerprints differ, every rank raises the same :class:`CollectiveMismatchError`, e.g.::

    rank 1 called broadcast(src=0, shape=[4]) while ranks 0,2,3 called all_reduce(shape=[4])

instead of hanging or silently mixing up data. Send/recv are not checked (two ranks, not the
group). Shapes are not compared for ops whose shapes may differ by rank (all_to_all with
splits, object collectives).

Cost: one 96-byte allgather per collective, paid only when enabled: ``hpcddp.collectives``
picks :func:`checked_start` instead of the plain recorder *once, at import*, so the ops carry
no ``if`` for it (docs/hangs.md has the measured cost).
"""
from __future__ import annotations

import array
import zlib

import numpy as np

from hpcddp.diagnostics import config as _cfg
from hpcddp.diagnostics import recorder as _rec
from hpcddp.diagnostics.report import ranks_word

K = 13                    # int64 words per fingerprint
OP, SEQ, DTYPE, ROOT, NDIM, DIMS = 0, 1, 2, 3, 4, 5   # DIMS..DIMS+5: the first 6 dims
SHAPE_HASH = 11
RED = 12                  # the reduce op's kind (reductions), else -1
MAX_DIMS = 6

OPS = ("all_reduce", "reduce", "reduce_scatter", "broadcast", "all_gather", "gather", "scatter",
       "all_to_all", "barrier", "monitored_barrier", "broadcast_object", "all_gather_object",
       "gather_object", "scatter_object_list")
SHAPE_FREE = frozenset({"all_to_all", "barrier", "monitored_barrier", "broadcast_object",
                        "all_gather_object", "gather_object", "scatter_object_list"})
SRC_OPS = frozenset({"broadcast", "scatter", "broadcast_object", "scatter_object_list"})
DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8",
          "uint8", "bool", "complex64", "complex128", "uint16", "uint32", "uint64",
          "float8_e4m3fn", "float8_e5m2")


class CollectiveMismatchError(RuntimeError):
    """Ranks of a group called different collectives (raised on every rank, same text)."""


def enabled() -> bool:
    return _cfg.detail_enabled()


def _code(name: str, table: tuple) -> int:
    try:
        return table.index(name) + 1
    except ValueError:
        return 1000 + (zlib.crc32(name.encode()) & 0x3FFFFFFF)


def _name(code: int, table: tuple, what: str) -> str:
    if 1 <= code <= len(table):
        return table[code - 1]
    return f"{what}#{code}"


_op_codes: dict = {}
_dtype_codes: dict = {None: 0}


def _codes(op: str, dtype) -> tuple:
    """(op code, dtype code), each computed once per process. A reduction recorded under its
    reduce op (``all_reduce[MAX]``: call.recorded_name) has its op's code: the fingerprint
    holds the reduce op apart (RED)."""
    oc = _op_codes.get(op)
    if oc is None:
        oc = _op_codes[op] = _code(op.split("[", 1)[0], OPS)
    dc = _dtype_codes.get(dtype)
    if dc is None:
        dc = _dtype_codes[dtype] = _code(str(dtype).replace("torch.", ""), DTYPES)
    return oc, dc


def _fp(op: str, seq: int, shape=None, dtype=None, peer=None, red=None) -> list:
    """The fingerprint as K Python ints (the hot path of the check: no numpy)."""
    oc, dc = _codes(op, dtype)
    fp = [oc, seq, dc, -1 if peer is None else int(peer), -1, 0, 0, 0, 0, 0, 0, 0,
          -1 if red is None else int(red)]
    if shape is not None and op not in SHAPE_FREE:
        n = len(shape)
        fp[NDIM] = n
        if n <= MAX_DIMS:
            fp[DIMS:DIMS + n] = shape
        else:
            fp[DIMS:DIMS + MAX_DIMS] = shape[:MAX_DIMS]
            fp[SHAPE_HASH] = zlib.crc32(repr(tuple(int(d) for d in shape)).encode())
    return fp


def fingerprint(op: str, seq: int, shape=None, dtype=None, peer=None, red=None) -> np.ndarray:
    """(op, seq, dtype, root, shape, reduce op) as K int64 words: what ranks compare."""
    return np.array(_fp(op, seq, shape, dtype, peer, red), dtype=np.int64)


def describe(row, show_seq: bool = False, show_dtype: bool = False,
             show_red: bool = False) -> str:
    """'broadcast(src=0, shape=[4])' from a fingerprint row."""
    op = _name(int(row[OP]), OPS, "op")
    args = []
    if row[ROOT] >= 0:
        args.append(f"{'src' if op in SRC_OPS else 'dst'}={int(row[ROOT])}")
    nd = int(row[NDIM])
    if nd >= 0:
        if nd <= MAX_DIMS:
            args.append(f"shape={[int(d) for d in row[DIMS:DIMS + nd]]}")
        else:
            args.append(f"shape=[{', '.join(str(int(d)) for d in row[DIMS:DIMS + MAX_DIMS])}, "
                        f"... ({nd} dims)]")
    if show_dtype and row[DTYPE]:
        args.append(f"dtype={_name(int(row[DTYPE]), DTYPES, 'dtype')}")
    if show_red and row[RED] >= 0:
        args.append(f"op={_red_name(int(row[RED]))}")
    seq = f" #{int(row[SEQ])}" if show_seq else ""
    return f"{op}{seq}({', '.join(args)})"


def mismatch_message(group: str, world_ranks, rows) -> str:
    """The error every rank raises: minority calls first, the majority's last."""
    rows = np.asarray(rows)
    by: dict = {}
    for i, row in enumerate(rows):
        by.setdefault(tuple(int(x) for x in row), []).append(int(world_ranks[i]))
    kinds = sorted(by.items(), key=lambda kv: (len(kv[1]), kv[1][0]))
    show_seq = len({k[SEQ] for k, _ in kinds}) > 1
    show_dtype = len({k[DTYPE] for k, _ in kinds if k[DTYPE]}) > 1
    show_red = len({k[RED] for k, _ in kinds}) > 1
    parts = [f"{ranks_word(rs)} called {describe(k, show_seq, show_dtype, show_red)}"
             for k, rs in kinds]
    text = ", ".join(parts[:-1]) + " while " + parts[-1]
    seq = max(k[SEQ] for k, _ in kinds)
    return (f"collective mismatch on group {group} at collective #{seq} (HPCDDP_DEBUG=detail): "
            f"{text}. Every rank of a group must call the same collectives in the same order, "
            f"with the same shapes, dtypes and roots.")


# -- default mode: the agreement on large collectives -----------------------------------------
# A large collective whose ranks disagree on count, dtype, reduce op or root does not fail in
# MPI: the shared-memory arena chunks by each rank's own size, Allreduce of int32 against
# float32 sums the bits, and unequal counts can corrupt the heap. So ranks agree on the call
# (op, sequence number, element count, dtype, reduce op, root) before its data moves: one
# 16-byte Allreduce(MIN) of (h, -h) on the private duplicate, where h hashes the call;
# min(h) == h == max(h) on every rank, or every rank raises.
# - The shared-memory arena (one node, SUM family, from 1 MiB) needs no message for it: each
#   rank writes h into the arena before the arena's own first barrier and reads everyone's
#   after it (hpcddp.collectives.paths.arena). The CMA broadcast (one node, from 1 MiB)
#   carries h in the address exchange it makes anyway (hpcddp.collectives._cma).
# - Every other collective of at least AGREE_BYTES runs it before the op (agreed_start). An
#   extra synchronisation before an op costs more than the message (ranks that ran apart
#   wait for each other: docs/hangs.md has the figures), hence the threshold.
# Smaller calls on other paths are checked with HPCDDP_DEBUG=detail only: the table in
# docs/hangs.md says what default mode catches at which size.
AGREE_BYTES = 8 << 20
AGREE_FREE = SHAPE_FREE | {"gather", "scatter"}   # per-rank sizes that may differ by design
A_OP, A_SEQ, A_COUNT, A_DTYPE, A_RED, A_ROOT = range(6)


def _agree_row(op: str, seq: int, count: int, dtype, red, peer) -> list:
    oc, dc = _codes(op, dtype)
    return [oc, seq, count, dc, -1 if red is None else int(red), -1 if peer is None else int(peer)]


def _count(shape) -> int:
    count = 1
    for d in shape:
        count *= d
    return count


def agreed_start(comm, op: str, shape=None, dtype=None, peer=None, red=None) -> list:
    """The recorder's ``start``; for a collective of at least AGREE_BYTES also the agreement
    of every rank on the call (default mode; RED: the reduce op's kind, for reductions)."""
    entry = _start(comm, op, shape, dtype, peer)
    agree_large(comm, entry, red)
    return entry


def agree_large(comm, entry, red=None) -> None:
    """agreed_start's agreement on the call recorded in ENTRY, where it is large (run apart
    from the record where the async engine runs the call: in issue order, on its thread)."""
    shape, dtype = entry[_rec.SHAPE], entry[_rec.DTYPE]
    if dtype is not None and shape is not None:     # the cheap tests first: this runs per op
        count = shape.numel() if hasattr(shape, "numel") else _count(shape)   # torch.Size
        op = entry[_rec.OP]
        if count * dtype.itemsize >= AGREE_BYTES and comm.size > 1 and op not in AGREE_FREE:
            _agree(comm, entry, _agree_row(op, entry[_rec.SEQ], count, dtype, red,
                                           entry[_rec.PEER]))


class CallHash:
    """A call's hash for a node-local path to compare across ranks in a synchronisation it
    makes anyway (no message of the check's own). It covers op, element count, dtype, reduce
    op and root, not the sequence number, so one object serves every call of the same kind
    (made once: the hot path pays a dict lookup)."""
    __slots__ = ("value", "_comm", "_row")

    def __init__(self, comm, row: list):
        self._comm, self._row = comm, row           # row: _agree_row's, SEQ left at 0
        self.value = hash(tuple(row)) & 0x3FFFFFFFFFFFFFFF

    def _with_seq(self, entry) -> list:
        row = list(self._row)
        row[A_SEQ] = entry[_rec.SEQ]
        return row

    def refuse(self, entry) -> None:
        """Every rank, once all have seen the hashes differ: raise the same error."""
        _disagree(self._comm, entry, self._with_seq(entry))

    def agree(self, entry) -> None:
        """The agreement by message, for a path with no synchronisation of its own to carry
        the hash (one 16-byte Allreduce on the private duplicate; raises as refuse)."""
        _agree(self._comm, entry, self._with_seq(entry))


_hashes: dict = {}    # (comm uid, op, shape, dtype, reduce op, root) -> CallHash


def agreement(comm, entry, red=None):
    """ENTRY's CallHash, for a node-local path to compare in a synchronisation it makes anyway
    (the arena's first barrier, the CMA broadcast's address exchange), or None where nothing
    is left to check: the call was agreed on by agreed_start already, or
    HPCDDP_DEBUG=detail compared it."""
    if _DETAIL:
        return None
    key = (comm.uid, entry[_rec.OP], entry[_rec.SHAPE], entry[_rec.DTYPE], red, entry[_rec.PEER])
    check = _hashes.get(key)
    if check is None:
        shape, dtype = entry[_rec.SHAPE], entry[_rec.DTYPE]
        count = shape.numel() if hasattr(shape, "numel") else _count(shape)   # torch.Size
        if count * dtype.itemsize >= AGREE_BYTES:
            return None
        if len(_hashes) >= 4096:
            _hashes.clear()
        check = _hashes[key] = CallHash(comm, _agree_row(entry[_rec.OP], 0, count, dtype, red,
                                                         entry[_rec.PEER]))
    return check


_DETAIL = _cfg.detail_enabled()   # read once, as hpcddp.collectives picks its record()


def _agree(comm, entry, row: list) -> None:
    # hash() of a tuple of ints is the same in every process (PYTHONHASHSEED salts only
    # str/bytes); masked to 62 bits so that -h fits an int64 too
    h = hash(tuple(row)) & 0x3FFFFFFFFFFFFFFF
    dup, seen, mpi_min, in_place = _agreement(comm)
    seen[0], seen[1] = h, -h
    dup.Allreduce(in_place, seen, mpi_min)
    if seen[0] == h and seen[1] == -h:
        return
    _disagree(comm, entry, row)


def _disagree(comm, entry, row: list) -> None:
    """Every rank: gather each rank's call and raise the same error."""
    dup = _agreement(comm)[0]
    rows = np.array(dup.allgather(row), dtype=np.int64)
    refused(entry)
    raise CollectiveMismatchError(agreement_message(comm.name, comm.world_ranks, rows))


def refused(entry) -> None:
    """Close ENTRY as a call every rank refused before it ran: marked first, so that the audit
    (diagnostics.audit, on another thread) never takes it for a call that ran."""
    if len(entry) == 8:
        entry.append("refused")
    _rec.end(entry)


def _agreement(comm):
    """(private duplicate, 2-word buffer, MPI.MIN, MPI.IN_PLACE): the group's agreement."""
    return comm.attached("agreement", _make_agreement)


def _make_agreement(comm):
    from hpcddp.comm._mpi import MPI
    return (_dup(comm)[0], np.zeros(2, dtype=np.int64), MPI.MIN, MPI.IN_PLACE)


def _call_text(row, op_shown: bool) -> str:
    parts = [f"count {int(row[A_COUNT])}", _name(int(row[A_DTYPE]), DTYPES, "dtype")]
    if row[A_RED] >= 0:
        parts.append(f"op {_red_name(int(row[A_RED]))}")
    if row[A_ROOT] >= 0:
        parts.append(f"root {int(row[A_ROOT])}")
    op = _name(int(row[A_OP]), OPS, "op")
    return (f"{op} #{int(row[A_SEQ])} " if op_shown else "") + f"({', '.join(parts)})"


def _red_name(kind: int) -> str:
    import torch.distributed as dist
    for name, value in dist.ReduceOp.RedOpType.__members__.items():
        if int(value) == kind:
            return name
    return str(kind)


def agreement_message(group: str, world_ranks, rows) -> str:
    """What every rank raises when a large collective's ranks disagree: the call each rank
    made, and the rank(s) that differ from the majority named as the culprit."""
    by: dict = {}
    for i, row in enumerate(rows):
        by.setdefault(tuple(int(x) for x in row), []).append(i)
    kinds = sorted(by.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
    majority = kinds[0][0]
    op_shown = len({(k[A_OP], k[A_SEQ]) for k in by}) > 1
    each = "; ".join(f"rank {i}{'' if world_ranks[i] == i else f' (world rank {world_ranks[i]})'}"
                     f" {_call_text(row, op_shown)}" for i, row in enumerate(rows))
    odd = sorted(i for _, rs in kinds[1:] for i in rs)
    name = _name(majority[A_OP], OPS, "op")
    if len(kinds) == 1 or len(kinds[0][1]) > len(kinds[1][1]):
        culprit = (f"The culprit: {ranks_word(odd)}, whose call differs from the other "
                   f"ranks'")
    else:
        culprit = "No majority, so no single culprit: compare the calls above"
    return (f"{name} #{majority[A_SEQ]} on group {group}: the ranks disagree on the call, so it "
            f"was not run (it would have given wrong data or corrupted memory): {each}. "
            f"{culprit}. Every rank of a group must pass the same element count, dtype, "
            f"reduce op and root.")


_start = _rec.start


def _dup(comm):
    """(private duplicate, receive buffer): collective over COMM, its first checked op runs
    it on every member."""
    return comm.attached("mismatch", _make_dup)


def _make_dup(comm):
    return comm.mpi.Dup(), array.array("q", bytes(8 * K * comm.size))


def checked_start(comm, op: str, shape=None, dtype=None, peer=None, red=None) -> list:
    """The recorder's ``start`` followed by the cross-rank check (HPCDDP_DEBUG=detail)."""
    entry = _start(comm, op, shape, dtype, peer)
    check_recorded(comm, entry, red)
    return entry


def check_recorded(comm, entry, red=None) -> None:
    """checked_start's check of the call recorded in ENTRY (run apart from the record where
    the async engine runs the call)."""
    op, shape, dtype, peer = entry[_rec.OP], entry[_rec.SHAPE], entry[_rec.DTYPE], entry[_rec.PEER]
    if comm.size > 1:
        dup, rows = _dup(comm)
        mine = array.array("q", _fp(op, entry[_rec.SEQ], shape, dtype, peer, red))
        dup.Allgather(mine, rows)
        got = rows.tobytes()
        if got != mine.tobytes() * comm.size:
            refused(entry)
            table = np.frombuffer(got, dtype=np.int64).reshape(comm.size, K)
            raise CollectiveMismatchError(mismatch_message(comm.name, comm.world_ranks, table))


