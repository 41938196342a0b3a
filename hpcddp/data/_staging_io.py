"""Staging, phase 2's file side: read source shards, write and check their copies.

* :class:`Reader` reads one leader's planned pieces of source shards into buffer slots, one
  chunk ahead of the MPI exchange (:mod:`hpcddp.data._staging_exchange`);
* :class:`Sink` writes and checksums the pieces a node keeps, on two threads, and renames each
  shard once it is complete and matches the manifest;
* :func:`copy_local` copies whole shards straight from the source with no MPI (partition
  mode, one-node groups, every-rank): the kernel copies, a second thread checks.

Every shard goes to a temporary name first and gets its final name only once verified, so
a killed stager leaves partial files that the next run's plan recognises and removes.
"""
from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from hpcddp.data import manifest as mf
from hpcddp.data._staging_plan import NBUFS


@dataclass
class CopyStats:
    """One rank's copy phase: bytes, seconds inside reads/writes/checks, outcome per shard."""
    bytes_read: int = 0
    bytes_written: int = 0
    read_s: float = 0.0
    write_s: float = 0.0
    hash_s: float = 0.0
    copied: list = field(default_factory=list)
    errors: list = field(default_factory=list)


def mismatch(sh: mf.Shard, checker: mf.Checker) -> str:
    return (f"{sh.name}: checksum mismatch ({checker.kind} {checker.hexdigest()[:16]}, "
            f"manifest {checker.expected()[:16]}): the source shard is corrupted or changed "
            f"since packing; re-pack it or restore it, then re-run")


def settle(sh: mf.Shard, partial: str, final: str, err: str | None, copied: list,
           errors: list) -> None:
    """A copied shard's end: verified (ERR None) -> renamed to its final name; else the
    error is recorded and the partial file removed (a re-run copies it again)."""
    if err is None:
        try:
            os.replace(partial, final)
            copied.append(sh.index)
            return
        except OSError as exc:
            err = f"{sh.name}: rename to {final}: {exc}"
    errors.append(err)
    try:
        os.remove(partial)
    except OSError:
        pass


# -- the write side: hash and write on two threads, finish shards in order ---------------------

class Slot:
    """One chunk buffer of the pool; REFS counts the threads (write, hash) still using it."""
    __slots__ = ("buf", "refs", "lock")

    def __init__(self, nbytes: int):
        self.buf = np.empty(max(1, nbytes), dtype=np.uint8)
        self.refs = 0
        self.lock = threading.Lock()


def slot_pool(nbytes: int) -> "queue.Queue[Slot]":
    """NBUFS slots of NBYTES: all the buffer memory one leader's copy uses."""
    pool: queue.Queue = queue.Queue()
    for _ in range(NBUFS):
        pool.put(Slot(nbytes))
    return pool


class _ShardOut:
    __slots__ = ("shard", "final", "partial", "fd", "hasher", "written", "error", "done",
                 "lock", "reader_status")

    def __init__(self, shard: mf.Shard, final: str, partial: str):
        self.shard, self.final, self.partial = shard, final, partial
        self.fd = -1
        self.hasher = mf.Checker(shard)
        self.written = 0
        self.error: str | None = None
        self.done = 0
        self.lock = threading.Lock()
        self.reader_status: str | None = None


class Sink:
    """Writes and hashes pieces of shards in submission order; renames verified shards.

    Two threads (write, hash) take the same pieces: hashlib and os.pwrite both release the
    GIL, so they overlap with each other and with the main thread's reads and MPI calls.
    """

    def __init__(self, pool: "queue.Queue[Slot]", dest: str, shards, fsync: bool, bar):
        self.pool, self.dest, self.fsync, self.bar = pool, dest, fsync, bar
        self.out: dict[int, _ShardOut] = {}
        self.shards = shards
        self.q_write: queue.Queue = queue.Queue()
        self.q_hash: queue.Queue = queue.Queue()
        self.write_s = 0.0
        self.hash_s = 0.0
        self.bytes_written = 0
        self.copied: list[int] = []
        self.errors: list[str] = []
        self._threads = [threading.Thread(target=self._run, args=(self.q_write, True),
                                          name="hpcddp-stage-write", daemon=True),
                         threading.Thread(target=self._run, args=(self.q_hash, False),
                                          name="hpcddp-stage-hash", daemon=True)]
        for t in self._threads:
            t.start()

    def _state(self, s: int) -> _ShardOut:
        st = self.out.get(s)
        if st is None:
            sh = self.shards[s]
            st = _ShardOut(sh, os.path.join(self.dest, sh.name),
                           os.path.join(self.dest, mf.partial_name(sh.name)))
            self.out[s] = st
        return st

    def submit(self, slot: Slot, pieces: list) -> None:
        """pieces: (shard, offset, start_in_slot, nbytes, last, reader_status)."""
        if not pieces:
            self.release(slot)
            return
        for p in pieces:
            self._state(p[0])  # create in the submitting thread: no race on self.out
        slot.refs = 2
        self.q_write.put((slot, pieces))
        self.q_hash.put((slot, pieces))

    def release(self, slot: Slot) -> None:
        with slot.lock:
            slot.refs -= 1
            free = slot.refs <= 0
        if free:
            slot.refs = 0
            self.pool.put(slot)

    def close(self) -> None:
        self.q_write.put(None)
        self.q_hash.put(None)
        for t in self._threads:
            t.join()
        for st in self.out.values():  # pieces never finished (cannot happen unless a bug)
            if st.fd >= 0:
                os.close(st.fd)

    def _run(self, q: queue.Queue, writing: bool) -> None:
        while True:
            item = q.get()
            if item is None:
                return
            slot, pieces = item
            for (s, off, start, n, last, status) in pieces:
                st = self.out[s]
                try:
                    if writing:
                        self._write(st, slot, off, start, n)
                    elif st.error is None:
                        t = time.perf_counter()
                        st.hasher.update(slot.buf[start:start + n])
                        self.hash_s += time.perf_counter() - t
                except Exception as exc:   # the shard fails; the thread keeps the slots flowing
                    what = "" if isinstance(exc, OSError) else f"{type(exc).__name__}: "
                    st.error = st.error or f"{st.shard.name}: writing {st.partial}: {what}{exc}"
                if last:
                    if status:
                        st.reader_status = status
                    self._maybe_finish(st)
            self.release(slot)

    def _write(self, st: _ShardOut, slot: Slot, off: int, start: int, n: int) -> None:
        if st.error is not None:
            return
        t = time.perf_counter()
        if st.fd < 0:
            # no posix_fallocate: on tmpfs it zeroes every page that we then overwrite; free
            # space was checked for the whole copy before it started
            # O_NOFOLLOW: a symlink planted at the partial name is refused, never written through
            st.fd = os.open(st.partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        view = memoryview(slot.buf)[start:start + n]
        pos = off
        while view:
            k = os.pwrite(st.fd, view, pos)
            view, pos = view[k:], pos + k
        st.written += n
        self.write_s += time.perf_counter() - t
        self.bytes_written += n
        if self.bar is not None:
            self.bar.update(n)

    def _maybe_finish(self, st: _ShardOut) -> None:
        with st.lock:
            st.done += 1
            if st.done < 2:
                return
        sh = st.shard
        err = st.error
        if st.fd >= 0:
            try:
                if self.fsync and err is None:
                    os.fsync(st.fd)
            except OSError as exc:
                err = err or f"{sh.name}: fsync: {exc}"
            os.close(st.fd)
            st.fd = -1
        if err is None and st.reader_status:
            err = f"{sh.name}: {st.reader_status}"
        if err is None and st.written != sh.bytes:
            err = f"{sh.name}: wrote {st.written} bytes, the manifest says {sh.bytes}"
        if err is None and not st.hasher.ok():
            err = mismatch(sh, st.hasher)
        settle(sh, st.partial, st.final, err, self.copied, self.errors)


# -- the read side ----------------------------------------------------------------------------

class _ReaderFailed:
    def __init__(self, exc: BaseException):
        self.exc = exc


class Reader(threading.Thread):
    """Reads planned pieces of source shards into pool slots, in order, one chunk ahead.

    Each item put on ``out`` is (slot, shard, offset, nbytes, last, status): status is None,
    or on the last piece of a shard a message when the shard could not be read as the
    manifest describes (the piece's bytes are then zeros, so every rank keeps in step).
    """

    def __init__(self, src: str, shards, plan: list, pool: queue.Queue, at: int):
        super().__init__(name="hpcddp-stage-read", daemon=True)
        self.src, self.shards, self.plan, self.pool, self.at = src, shards, plan, pool, at
        self.out: queue.Queue = queue.Queue()
        # at most NBUFS - 2 slots read ahead: the main thread must always find a free slot
        # for the chunks other leaders send, or a reader far ahead would deadlock the group
        self.ahead = threading.Semaphore(max(1, NBUFS - 2))
        self.bytes_read = 0
        self.read_s = 0.0
        self._status: dict[int, str] = {}

    def run(self) -> None:
        fh, cur = None, None
        try:
            for (s, off, n, last) in self.plan:
                self.ahead.acquire()
                slot = self.pool.get()
                if s != cur:
                    if fh is not None:
                        fh.close()
                    fh, cur = self._open(s), s
                view = memoryview(slot.buf)[self.at:self.at + n]
                got = self._read_into(fh, s, off, view) if fh is not None and n else 0
                if got < n:
                    view[got:] = b"\0" * (n - got)
                    self._status.setdefault(s, f"the source shard is shorter than the manifest's "
                                               f"{self.shards[s].bytes} bytes (truncated?)")
                self.out.put((slot, s, off, n, last, self._status.get(s) if last else None))
        except BaseException as exc:   # the main thread waits on `out`: it must hear of it
            self.out.put(_ReaderFailed(exc))
            raise
        finally:
            if fh is not None:
                fh.close()

    def _read_into(self, fh, s: int, off: int, view) -> int:
        got, n = 0, len(view)
        t = time.perf_counter()
        try:
            fh.seek(off)
            while got < n:
                k = fh.readinto(view[got:])
                if not k:
                    break
                got += k
        except OSError as exc:
            self._status.setdefault(s, f"reading the source shard failed: {exc}")
        self.read_s += time.perf_counter() - t
        self.bytes_read += got
        return got

    def next(self):
        """The next (slot, shard, offset, nbytes, last, status), in plan order; raises what
        ended the reading thread, if it failed (not waiting forever for an item)."""
        item = self.out.get()
        if isinstance(item, _ReaderFailed):
            raise RuntimeError(f"stage: the thread reading the source failed: "
                               f"{type(item.exc).__name__}: {item.exc}") from item.exc
        self.ahead.release()
        return item

    def _open(self, s: int):
        sh = self.shards[s]
        path = os.path.join(self.src, sh.name)
        try:
            fh = open(path, "rb", buffering=0)
        except OSError as exc:
            self._status[s] = f"cannot open the source shard {path}: {exc.strerror or exc}"
            return None
        size = os.fstat(fh.fileno()).st_size
        if size != sh.bytes:
            self._status[s] = (f"the source shard {path} has {size} bytes, the manifest says "
                               f"{sh.bytes}: the source changed since packing")
        return fh


# -- whole shards, no MPI ---------------------------------------------------------------------

def copy_local(src: str, node_dest: str, m: mf.Manifest, todo: list, chunk: int, suffix: str,
               fsync: bool, bar) -> CopyStats:
    """Copy shards straight from the source (no MPI): partition mode, one-node groups,
    every-rank. The kernel copies (``sendfile``: no pass through Python buffers, as ``cp``
    does with copy_file_range), then a second thread checksums each finished file through the
    page cache and checks it against the manifest: what is verified is what landed on disk.
    SUFFIX keeps the partial names of ranks sharing a node apart (every-rank).
    """
    stats = CopyStats()
    q: queue.Queue = queue.Queue(maxsize=2)
    verifier = threading.Thread(target=_verify_loop, args=(q, stats), name="hpcddp-stage-verify",
                                daemon=True)
    verifier.start()
    step = max(chunk, 1 << 20)
    try:
        for s in todo:
            sh = m.shards[s]
            path = os.path.join(src, sh.name)
            partial = os.path.join(node_dest, mf.partial_name(sh.name) + suffix)
            try:
                sfd = os.open(path, os.O_RDONLY)
            except OSError as exc:
                stats.errors.append(f"{sh.name}: cannot open the source shard {path}: "
                                    f"{exc.strerror or exc}")
                continue
            try:
                err = _copy_file(sh, path, sfd, partial, step, fsync, bar, stats)
            finally:
                os.close(sfd)
            q.put((sh, partial, os.path.join(node_dest, sh.name), err))
    finally:
        q.put(None)
        verifier.join()
    stats.read_s = stats.write_s  # one kernel call reads and writes
    return stats


def _copy_file(sh: mf.Shard, path: str, sfd: int, partial: str, step: int, fsync: bool, bar,
               stats: CopyStats) -> str | None:
    """Copy open source SFD to PARTIAL; None, or what went wrong."""
    err = None
    try:
        size = os.fstat(sfd).st_size
        if size != sh.bytes:
            err = (f"{sh.name}: the source shard {path} has {size} bytes, the manifest "
                   f"says {sh.bytes}: the source changed since packing")
        dfd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        try:
            off = 0
            use_sendfile = True
            while err is None and off < sh.bytes:
                t = time.perf_counter()
                k, use_sendfile = _copy_range(sfd, dfd, off, min(step, sh.bytes - off),
                                              use_sendfile)
                stats.write_s += time.perf_counter() - t
                if k == 0:
                    err = (f"{sh.name}: the source shard is shorter than the "
                           f"manifest's {sh.bytes} bytes (truncated?)")
                    break
                off += k
                stats.bytes_read += k
                stats.bytes_written += k
                if bar is not None:
                    bar.update(k)
            if fsync and err is None:
                os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError as exc:
        err = err or f"{sh.name}: copying to {partial}: {exc}"
    return err


def _copy_range(sfd: int, dfd: int, off: int, n: int, use_sendfile: bool) -> tuple[int, bool]:
    """Up to N bytes at OFF from SFD to DFD: (bytes copied, 0 at the source's end; whether
    sendfile still works). The kernel copies where it can; file systems whose sendfile refuses
    get a read and a write instead."""
    if use_sendfile:
        try:
            return os.sendfile(dfd, sfd, off, n), True
        except OSError as exc:
            if exc.errno not in (22, 38, 95):  # EINVAL/ENOSYS/EOPNOTSUPP
                raise
    data = os.pread(sfd, n, off)
    mv = memoryview(data)
    while mv:
        mv = mv[os.write(dfd, mv):]
    return len(data), False


def _verify_loop(q: queue.Queue, stats: CopyStats) -> None:
    """copy_local's second thread: checksum each copied file, then rename or remove it."""
    while True:
        item = q.get()
        if item is None:
            return
        sh, partial, final, err = item
        if err is None:
            t = time.perf_counter()
            c = mf.Checker(sh)
            try:
                mf._scan(partial, [c.update])
                if not c.ok():
                    err = mismatch(sh, c)
            except OSError as exc:
                err = f"{sh.name}: re-reading {partial}: {exc}"
            stats.hash_s += time.perf_counter() - t
        settle(sh, partial, final, err, stats.copied, stats.errors)
