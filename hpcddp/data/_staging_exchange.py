"""Staging, phase 2's MPI side: replicate shards across the node leaders of a group.

The union of what the group's nodes miss is cut into byte-balanced, contiguous ranges, one
per leader (:func:`~hpcddp.data._staging_plan.split_by_bytes`); each leader reads only its
range (a :class:`~hpcddp.data._staging_io.Reader` thread, one chunk ahead) and the chunks
travel to every leader:

* bcast: leader by leader, chunk by chunk, from the leader that read it (``MPI_Bcast``);
  buffers do not grow with the group;
* allgather: in each round every leader contributes its next chunk and one
  ``MPI_Allgatherv`` delivers them all, so all leaders read and send at once.

Shards (a tree's files) are laid end to end in chunks (:func:`pack_chunks`): a chunk carries
thousands of small files in one round, and a large file spans several chunks.
Every leader walks the same sequence of collectives, derived from what all of them already
hold (the union and the split), so the group stays in step whatever each node misses. A
shard that cannot be read is sent as zeros with its reader's verdict, so the receivers fail
it too instead of waiting.
"""
from __future__ import annotations

from hpcddp.data import manifest as mf
from hpcddp.data._comm import watched
from hpcddp.data._staging_io import CopyStats, Reader, Sink, slot_pool
from hpcddp.data._staging_plan import pack_chunks, split_by_bytes


def copy_exchange(gl, strategy: str, src: str, node_dest: str, m: mf.Manifest, todo: list,
                  chunk: int, fsync: bool, bar, files: bool = False, suffix: str = "") -> CopyStats:
    """Replicate within a group of several nodes (collective over the group's leaders GL).

    A plain tree (``files``) also comes here where nothing travels (partition mode, one-node
    groups, every-rank: GL is then ``MPI.COMM_SELF``), for its batching of small files and
    its read-side CRC-32C. SUFFIX keeps the temporary names of ranks sharing a node apart.
    """
    gsize, me = gl.Get_size(), gl.Get_rank()
    sizes = [s.bytes for s in m.shards]
    pool = slot_pool(chunk * (gsize if strategy == "allgather" else 1))
    sink = Sink(pool, node_dest, m.shards, fsync, bar, files, suffix)
    try:
        with watched(gl, "stage:allgather"):
            union = sorted(set().union(*map(set, gl.allgather(todo))))
        plans = _chunk_plans(union, sizes, chunk, gsize)
        at = me * chunk if strategy == "allgather" else 0
        reader = Reader(src, m.shards, plans[me], pool, at, files)
        reader.start()
        run = _run_bcast if strategy == "bcast" else _run_allgather
        run(gl, plans, chunk, me, reader, pool, sink, set(todo))
        reader.join()
    finally:
        sink.close()
    return CopyStats(reader.bytes_read, sink.bytes_written, reader.read_s, sink.write_s,
                     sink.hash_s, sink.copied, sink.errors)


def _chunk_plans(union: list, sizes: list, chunk: int, gsize: int) -> list:
    """Per leader, the chunks it reads, in order (:func:`pack_chunks` over its byte-balanced,
    contiguous range of the union). Every leader derives the same plans from the union."""
    parts = split_by_bytes([sizes[s] for s in union], gsize)
    return [pack_chunks([union[i] for i in part], sizes, chunk) for part in parts]


def _pieces_kept(pieces: list, verdicts: list, base: int, want: set) -> list:
    """The Sink's pieces of a chunk this node keeps: each shard's last piece gets the
    reader's (status, crc), which arrive in the order of the chunk's last pieces."""
    it = iter(verdicts)
    out = []
    for (s, off, start, n, last) in pieces:
        status, crc = next(it) if last else (None, None)
        if s in want:
            out.append((s, off, base + start, n, last, status, crc))
    return out


def _run_bcast(gl, plans, chunk, me, reader, pool, sink, want) -> None:
    from hpcddp.comm import MPI
    for root, chunks in enumerate(plans):
        for pieces in chunks:
            if root == me:
                slot, verdicts = reader.next()
            else:
                slot, verdicts = pool.get(), None
            n = sum(p[3] for p in pieces)
            with watched(gl, "stage:bcast"):
                # the reader's verdicts (and CRCs) on the shards ending here travel with them
                if any(p[4] for p in pieces):
                    verdicts = gl.bcast(verdicts, root=root)
                if n:
                    gl.Bcast([slot.buf, n, MPI.BYTE], root=root)
            kept = _pieces_kept(pieces, verdicts or [], 0, want)
            if kept:
                sink.submit(slot, kept)
            else:
                pool.put(slot)


def _run_allgather(gl, plans, chunk, me, reader, pool, sink, want) -> None:
    from hpcddp.comm import MPI
    g = gl.Get_size()
    rounds = max((len(p) for p in plans), default=0)
    mine = len(plans[me])
    displs = [j * chunk for j in range(g)]
    for r in range(rounds):
        if r < mine:
            slot, verdicts = reader.next()
        else:
            slot, verdicts = pool.get(), None
        chunks = [p[r] if r < len(p) else [] for p in plans]
        counts = [sum(p[3] for p in c) for c in chunks]
        with watched(gl, "stage:allgather"):
            every = gl.allgather(verdicts)
            gl.Allgatherv(MPI.IN_PLACE, [slot.buf, (counts, displs), MPI.BYTE])
        kept = [p for j, c in enumerate(chunks)
                for p in _pieces_kept(c, every[j] or [], j * chunk, want)]
        sink.submit(slot, kept)
