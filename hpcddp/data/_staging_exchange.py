"""Staging, phase 2's MPI side: replicate shards across the node leaders of a group.

The union of what the group's nodes miss is cut into byte-balanced, contiguous ranges, one
per leader (:func:`~hpcddp.data._staging_plan.split_by_bytes`); each leader reads only its
range (a :class:`~hpcddp.data._staging_io.Reader` thread, one chunk ahead) and the chunks
travel to every leader:

* bcast: leader by leader, chunk by chunk, from the leader that read it (``MPI_Bcast``);
  buffers do not grow with the group;
* allgather: in each round every leader contributes its next chunk and one
  ``MPI_Allgatherv`` delivers them all, so all leaders read and send at once;
* ring: every leader sends to the next one around the ring its own chunks and the chunks it
  received and must pass on, with nonblocking sends and receives posted ahead: each link
  carries (N-1)/N of the data with several chunks in flight, and no leader waits for any
  but its neighbours (mpifileutils' dbcast pipelines the same way).

Shards (a tree's files) are laid end to end in chunks (:func:`pack_chunks`): a chunk carries
thousands of small files in one round, and a large file spans several chunks.
Every leader walks the same sequence of collectives (or, in the ring, of messages), derived
from what all of them already hold (the union and the split), so the group stays in step
whatever each node misses. A
shard that cannot be read is sent as zeros with its reader's verdict, so the receivers fail
it too instead of waiting.
"""
from __future__ import annotations

import collections
import time

from hpcddp.data import manifest as mf
from hpcddp.data._comm import watch_begin, watch_end, watch_local, watched
from hpcddp.data._staging_io import CopyStats, Reader, Sink, slot_pool
from hpcddp.data._staging_plan import NBUFS, pack_chunks, ring_share, split_by_bytes

# ring: seconds between polls of MPI while nothing can move (on TCP links: at most this long
# asleep in the kernel, woken at once by the network)
RING_POLL_S = 0.0005
# up to this many leaders the ring's chunks travel on TCP links, one connection per origin's
# stream each way (more: MPI's point-to-point, not two sockets per node of the group)
MAX_LINKED_LEADERS = 64
# the links serve only where a shift of this many bytes round the ring is not slower on them
# than on MPI (a fabric MPI drives natively, InfiniBand or Slingshot, beats TCP by far, which
# 1 MiB shows; the race costs ~35 ms at 1 Gbit/s, once per job and group of leaders)
PROBE_BYTES = 1 << 20


def copy_exchange(gl, strategy: str, src: str, node_dest: str, m: mf.Manifest, todo: list,
                  chunk: int, fsync: bool, bar, files: bool = False, suffix: str = "") -> CopyStats:
    """Replicate within a group of several nodes (collective over the group's leaders GL).

    A plain tree (``files``) also comes here where nothing travels (partition mode, one-node
    groups, every-rank: GL is then ``MPI.COMM_SELF``), for its batching of small files and
    its read-side CRC-32C. SUFFIX keeps the temporary names of ranks sharing a node apart.
    """
    gsize, me = gl.Get_size(), gl.Get_rank()
    sizes = [s.bytes for s in m.shards]
    if strategy == "ring":       # the reader's slots also hold my chunks in flight
        pool = slot_pool(chunk, NBUFS + ring_share(gsize))
    else:
        pool = slot_pool(chunk * (gsize if strategy == "allgather" else 1))
    sink = Sink(node_dest, m.shards, fsync, bar, files, suffix)
    try:
        with watched(gl, "stage:allgather"):
            union = sorted(set().union(*map(set, gl.allgather(todo))))
        plans = _chunk_plans(union, sizes, chunk, gsize)
        at = me * chunk if strategy == "allgather" else 0
        reader = Reader(src, m.shards, plans[me], pool, at, files)
        reader.start()
        run = {"bcast": _run_bcast, "allgather": _run_allgather, "ring": _run_ring}[strategy]
        if gsize == 1:           # nothing travels: the bcast loop is the plain copy
            run = _run_bcast
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


class _Stream:
    """One origin's chunks as they pass this leader: receives posted in round order into the
    stream's own slots (so no stream can starve another of buffers), each chunk kept until it
    is passed on and handed to the Sink."""

    def __init__(self, origin: int, chunks: list, chunk: int, nslots: int):
        self.origin, self.chunks = origin, chunks
        self.slots = slot_pool(chunk, nslots) if chunks else None
        self.posted: collections.deque = collections.deque()   # [round, slot, request]
        self.next_post = 0
        self.received = 0

    @property
    def done(self) -> bool:
        return self.received == len(self.chunks)


def _run_ring(gl, plans, chunk, me, reader, pool, sink, want) -> None:
    """Pass every leader's chunks around the ring (see the module's docstring).

    Each origin's chunks form a stream with tags of its own: the origin sends them right as
    its reader delivers them, every other leader receives them from the left in round order
    and passes them on, but the last one (the origin's left neighbour). So a stream never
    waits for another, and several chunks are in flight on each link (one or two in flight
    leave Open MPI's TCP transport idle between messages: measured, docs/data.md). Every
    wait polls MPI (its TCP transport moves bytes only inside MPI calls); chunks go to the
    Sink in each stream's order, which keeps a shard's pieces in order for its hash. The
    recorder holds one entry per round (the oldest one not yet complete here), the same
    sequence on every leader, so a peer that stops shows in the stall report.
    """
    _Ring(gl, plans, chunk, me, reader, pool, sink, want).run()


class _Ring:
    """One leader's part of the ring: its own stream out, the others' streams through."""

    def __init__(self, gl, plans, chunk, me, reader, pool, sink, want):
        g = gl.Get_size()
        self.gl, self.g, self.me = gl, g, me
        self.right, self.left = (me + 1) % g, (me - 1) % g
        self.rounds = max((len(p) for p in plans), default=0)
        self.share = ring_share(g)        # each stream's chunks in flight
        self.streams = [_Stream(o, plans[o], chunk, self.share + 1) for o in range(g) if o != me]
        # per origin, in order: (send requests, slot, the pieces kept here)
        self.held = {o: collections.deque() for o in range(g)}
        self.mine = plans[me]
        self.sent = 0
        self.reader, self.pool, self.sink, self.want = reader, pool, sink, want
        self.rc = None

    def run(self) -> None:
        self.rc = self.gl.Dup()           # the ring's messages apart from every other call's
        self.links = None
        done = 0
        entry = watch_begin(self.gl, "stage:ring")
        try:
            self._open_links()
            while done < self.rounds or any(self.held.values()):
                moved = self.step()
                watch_local(entry, None if moved or not self.held_by_writer() else
                            "this node's writer thread (every chunk buffer waits to be written)")
                if not moved:
                    self._wait()
                while done < min(self.rounds_done(), self.rounds):
                    done += 1
                    watch_end(entry)
                    entry = watch_begin(self.gl, "stage:ring")
        finally:
            watch_end(entry)
            if self.links is not None:
                self.links.close()
            self.rc.Free()

    def _open_links(self) -> None:
        """The chunks' way to the right neighbour: one TCP connection per origin's stream
        (hpcddp.comm.links: the rank sleeps in the kernel while it waits, where Open MPI's
        TCP transport moves bytes only while polled), else MPI's point-to-point on RC."""
        from hpcddp import settings
        from hpcddp.comm import MPI, links
        wanted = settings.get().ring_transport == "tcp" and self.g <= MAX_LINKED_LEADERS
        if self.rc.allreduce(int(wanted), op=MPI.MIN):      # every leader, or none
            self.links = links.Links.make(self.rc, channels=self.g)
        if self.links is not None and not links.faster_than_mpi(self.links, PROBE_BYTES):
            self.links.close()        # MPI's own transport is faster here (a fabric, not TCP)
            self.links = None
        if self.links is not None:
            self.sends = [links.Pipe(self.links, s, True) for s in self.links.outs]
            self.recvs = [links.Pipe(self.links, s, False) for s in self.links.intos]

    def _isend(self, slot, n: int, origin: int):
        from hpcddp.comm import MPI
        if self.links is not None:
            return self.sends[origin].post(slot.buf[:n])
        return self.rc.Isend([slot.buf, n, MPI.BYTE], dest=self.right, tag=origin)

    def _irecv(self, slot, n: int, origin: int):
        from hpcddp.comm import MPI
        if self.links is not None:
            return self.recvs[origin].post(slot.buf[:n])
        return self.rc.Irecv([slot.buf, n, MPI.BYTE], source=self.left, tag=origin)

    def _wait(self) -> None:
        """Nothing could move: wait a little for the network (or the reader, or the writer)."""
        from hpcddp.comm import MPI, links
        # the verdicts' MPI sends move only while MPI is called, on TCP links too
        MPI.Request.Testall([q for d in self.held.values() for e in d for q in e[0]
                             if isinstance(q, MPI.Request)] +
                            [e[2] for st in self.streams for e in st.posted
                             if isinstance(e[2], MPI.Request)])
        if self.links is not None:
            links.wait_any(self.sends + self.recvs, RING_POLL_S)
        else:
            time.sleep(RING_POLL_S)

    def pass_on(self, origin, slot, pieces, verdicts) -> None:
        """Send SLOT right unless it ends its way here; keep it until sent, then write it."""
        reqs = []
        if (origin - 1) % self.g != self.me:
            if any(p[4] for p in pieces):
                reqs.append(self.rc.isend(verdicts, dest=self.right, tag=self.g + origin))
            if _nbytes(pieces):
                reqs.append(self._isend(slot, _nbytes(pieces), origin))
        self.held[origin].append((reqs, slot,
                                  _pieces_kept(pieces, verdicts or [], 0, self.want)))

    def step(self) -> bool:
        """Do what can be done now without waiting; whether anything moved."""
        moved = False
        if self.links is not None:     # every queued transfer moves, not only the heads tested
            for pipe in self.sends + self.recvs:
                pipe.progress()
        while (self.sent < len(self.mine) and len(self.held[self.me]) < self.share
               and self.reader.ready()):
            slot, verdicts = self.reader.next()
            self.pass_on(self.me, slot, self.mine[self.sent], verdicts)
            self.sent += 1
            moved = True
        for st in self.streams:
            moved |= self.step_stream(st)
        for q in self.held.values():
            while q and all([req.Test() for req in q[0][0]]):   # each tested: each moves
                _, slot, kept = q.popleft()
                self.sink.submit(slot, kept)
                moved = True
        return moved

    def step_stream(self, st: _Stream) -> bool:
        """Post receives for ST into its free slots; pass on what arrived, in round order."""
        while st.next_post < len(st.chunks) and not st.slots.empty():
            slot = st.slots.get_nowait()
            n = _nbytes(st.chunks[st.next_post])
            req = self._irecv(slot, n, st.origin) if n else None
            st.posted.append((st.next_post, slot, req))
            st.next_post += 1
        moved = False
        while st.posted and (st.posted[0][2] is None or st.posted[0][2].Test()):
            r, slot, _ = st.posted.popleft()
            pieces = st.chunks[r]
            verdicts = (self.rc.recv(source=self.left, tag=self.g + st.origin)
                        if any(p[4] for p in pieces) else None)
            self.pass_on(st.origin, slot, pieces, verdicts)
            st.received += 1
            moved = True
        return moved

    def held_by_writer(self) -> bool:
        """Whether nothing can move because every buffer waits for this node's writer: no
        chunk of mine to send and no free slot to receive into while the Sink is behind."""
        mine_waits = self.sent == len(self.mine) or (not self.reader.ready()
                                                      and self.pool.empty())
        return self.sink.backlog > 0 and mine_waits and all(
            st.slots.empty() for st in self.streams if st.next_post < len(st.chunks))

    def rounds_done(self) -> int:
        """Rounds complete here: my chunk sent and every stream's chunk received."""
        return min([self.sent if self.sent < len(self.mine) else self.rounds] +
                   [st.received if not st.done else self.rounds for st in self.streams])


def _nbytes(pieces) -> int:
    return sum(p[3] for p in pieces)
