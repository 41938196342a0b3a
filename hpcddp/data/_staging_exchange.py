"""Staging, phase 2's MPI side: replicate shards across the node leaders of a group.

The union of what the group's nodes miss is cut into byte-balanced, contiguous ranges, one
per leader (:func:`~hpcddp.data._staging_plan.split_by_bytes`); each leader reads only its
range (a :class:`~hpcddp.data._staging_io.Reader` thread, one chunk ahead) and the chunks
travel to every leader:

* bcast: shard by shard, chunk by chunk, from the leader that read it (``MPI_Bcast``);
  buffers do not grow with the group;
* allgather: in each round every leader contributes its next chunk and one
  ``MPI_Allgatherv`` delivers them all, so all leaders read and send at once.

Every leader walks the same sequence of collectives, derived from what all of them already
hold (the union and the split), so the group stays in step whatever each node misses. A
shard that cannot be read is sent as zeros with its reader's verdict, so the receivers fail
it too instead of waiting.
"""
from __future__ import annotations

from hpcddp.data import manifest as mf
from hpcddp.data._comm import watched
from hpcddp.data._staging_io import CopyStats, Reader, Sink, slot_pool
from hpcddp.data._staging_plan import chunks_of, split_by_bytes


def copy_exchange(gl, strategy: str, src: str, node_dest: str, m: mf.Manifest, todo: list,
                  chunk: int, fsync: bool, bar) -> CopyStats:
    """Replicate within a group of several nodes (collective over the group's leaders GL)."""
    gsize, me = gl.Get_size(), gl.Get_rank()
    sizes = [s.bytes for s in m.shards]
    pool = slot_pool(chunk * (gsize if strategy == "allgather" else 1))
    sink = Sink(pool, node_dest, m.shards, fsync, bar)
    try:
        with watched(gl, "stage:allgather"):
            union = sorted(set().union(*map(set, gl.allgather(todo))))
        reader_of = _readers(union, sizes, gsize)
        at = me * chunk if strategy == "allgather" else 0
        reader = Reader(src, m.shards, _pieces(union, reader_of, sizes, chunk, gsize)[me], pool, at)
        reader.start()
        run = _run_bcast if strategy == "bcast" else _run_allgather
        run(gl, union, reader_of, sizes, chunk, me, reader, pool, sink, set(todo))
        reader.join()
    finally:
        sink.close()
    return CopyStats(reader.bytes_read, sink.bytes_written, reader.read_s, sink.write_s,
                     sink.hash_s, sink.copied, sink.errors)


def _readers(union: list, sizes: list, gsize: int) -> dict:
    """shard -> the group index of the leader that reads it from the source."""
    reader_of = {}
    for j, part in enumerate(split_by_bytes([sizes[s] for s in union], gsize)):
        for i in part:
            reader_of[union[i]] = j
    return reader_of


def _pieces(union: list, reader_of: dict, sizes: list, chunk: int, gsize: int) -> list:
    """Per leader, its reads in order: (shard, offset, nbytes, last piece of the shard)."""
    plans: list = [[] for _ in range(gsize)]
    for s in union:
        pieces = chunks_of(sizes[s], chunk)
        for i, (off, n) in enumerate(pieces):
            plans[reader_of[s]].append((s, off, n, i == len(pieces) - 1))
    return plans


def _run_bcast(gl, union, reader_of, sizes, chunk, me, reader, pool, sink, want) -> None:
    from hpcddp.comm import MPI
    for s in union:
        root = reader_of[s]
        pieces = chunks_of(sizes[s], chunk)
        for i, (off, n) in enumerate(pieces):
            if root == me:
                slot, s2, off2, n2, last, status = reader.next()
                assert (s2, off2, n2) == (s, off, n)
            else:
                slot, last, status = pool.get(), i == len(pieces) - 1, None
            with watched(gl, "stage:bcast"):
                if last:  # the reader's verdict on this shard travels with its last piece
                    status = gl.bcast(status, root=root)
                if n:
                    gl.Bcast([slot.buf, n, MPI.BYTE], root=root)
            if s in want:
                sink.submit(slot, [(s, off, 0, n, last, status)])
            else:
                pool.put(slot)


def _run_allgather(gl, union, reader_of, sizes, chunk, me, reader, pool, sink, want) -> None:
    from hpcddp.comm import MPI
    g = gl.Get_size()
    plans = _pieces(union, reader_of, sizes, chunk, g)
    rounds = max((len(p) for p in plans), default=0)
    mine = len(plans[me])
    displs = [j * chunk for j in range(g)]
    for r in range(rounds):
        if r < mine:
            slot, s, off, n, last, status = reader.next()
            hdr = (s, off, n, last, status)
        else:
            slot, hdr = pool.get(), None
        with watched(gl, "stage:allgather"):
            hdrs = gl.allgather(hdr)
            counts = [h[2] if h else 0 for h in hdrs]
            gl.Allgatherv(MPI.IN_PLACE, [slot.buf, (counts, displs), MPI.BYTE])
        pieces = [(h[0], h[1], j * chunk, h[2], h[3], h[4]) for j, h in enumerate(hdrs)
                  if h is not None and h[0] in want]
        sink.submit(slot, pieces)
