"""Staging, phase 2's file side: read source shards, write and check their copies.

* :class:`Reader` reads one leader's planned chunks (pieces of source shards or files, small
  ones batched: :func:`~hpcddp.data._staging_plan.pack_chunks`) into buffer slots, one chunk
  ahead of the MPI exchange (:mod:`hpcddp.data._staging_exchange`); for a plain tree it also
  computes each file's CRC-32C and checks the file did not change while it was read;
* :class:`Sink` writes and checksums the pieces a node keeps, on two threads, and renames each
  shard once it is complete and matches the manifest (a tree's file: the reader's CRC-32C);
* :func:`copy_local` copies whole shards straight from the source with no MPI (partition
  mode, one-node groups, every-rank): the kernel copies, a second thread checks.

Every shard goes to a temporary name first and gets its final name only once verified, so
a killed stager leaves partial files that the next run's plan recognises and removes.
"""
from __future__ import annotations

import os
import queue
import stat
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
    """One chunk buffer of a pool (HOME, where it returns once written); REFS counts the
    threads (write, hash) still using it."""
    __slots__ = ("buf", "refs", "lock", "home")

    def __init__(self, nbytes: int, home: "queue.Queue[Slot]"):
        self.buf = np.empty(max(1, nbytes), dtype=np.uint8)
        self.refs = 0
        self.lock = threading.Lock()
        self.home = home


def slot_pool(nbytes: int, count: int = NBUFS) -> "queue.Queue[Slot]":
    """COUNT slots of NBYTES: with the ring's receive slots, all the buffer memory one
    leader's copy uses."""
    pool: queue.Queue = queue.Queue()
    for _ in range(count):
        pool.put(Slot(nbytes, pool))
    return pool


class _ShardOut:
    __slots__ = ("shard", "final", "partial", "fd", "hasher", "written", "error", "done",
                 "lock", "reader_status", "sent_crc")

    def __init__(self, shard: mf.Shard, final: str, partial: str, files: bool):
        self.shard, self.final, self.partial = shard, final, partial
        self.fd = -1
        # a tree's file has no checksum in advance: CRC-32C, compared with the reader's
        self.hasher = mf.Checker(None if files else shard)
        self.written = 0
        self.error: str | None = None
        self.done = 0
        self.lock = threading.Lock()
        self.reader_status: str | None = None
        self.sent_crc: str | None = None


class Sink:
    """Writes and hashes pieces of shards in submission order; renames verified shards.

    Two threads (write, hash) take the same pieces: hashlib and os.pwrite both release the
    GIL, so they overlap with each other and with the main thread's reads and MPI calls.
    """

    def __init__(self, dest: str, shards, fsync: bool, bar, files: bool = False,
                 suffix: str = ""):
        self.dest, self.fsync, self.bar = dest, fsync, bar
        self.files, self.suffix = files, suffix
        self.out: dict[int, _ShardOut] = {}
        self.shards = shards
        self.q_write: queue.Queue = queue.Queue()
        self.q_hash: queue.Queue = queue.Queue()
        self.write_s = 0.0
        self.hash_s = 0.0
        self.bytes_written = 0
        self.copied: list[int] = []
        self.errors: list[str] = []
        self.backlog = 0         # chunks submitted and not yet written and hashed
        self._backlog_lock = threading.Lock()
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
            # string joins, not os.path: this runs once per file on the thread that feeds
            # MPI, and a tree may have 100,000 files (names are relative, never absolute)
            head, _, base = sh.name.rpartition("/")
            partial = f"{self.dest}/{head}/.{base}{mf.PARTIAL_SUFFIX}{self.suffix}" if head \
                else f"{self.dest}/.{base}{mf.PARTIAL_SUFFIX}{self.suffix}"
            st = _ShardOut(sh, f"{self.dest}/{sh.name}", partial, self.files)
            self.out[s] = st
        return st

    def submit(self, slot: Slot, pieces: list) -> None:
        """pieces: (shard, offset, start_in_slot, nbytes, last, reader_status, reader_crc);
        the last two only on a shard's last piece (the CRC for a tree's files only)."""
        if not pieces:          # nothing of this chunk is kept here
            slot.refs = 0
            slot.home.put(slot)
            return
        for p in pieces:
            self._state(p[0])  # create in the submitting thread: no race on self.out
        with self._backlog_lock:
            self.backlog += 1
        slot.refs = 2
        self.q_write.put((slot, pieces))
        self.q_hash.put((slot, pieces))

    def release(self, slot: Slot) -> None:
        with slot.lock:
            slot.refs -= 1
            free = slot.refs <= 0
        if free:
            slot.refs = 0
            with self._backlog_lock:
                self.backlog -= 1
            slot.home.put(slot)

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
            for (s, off, start, n, last, status, crc) in pieces:
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
                    st.sent_crc = crc
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
        if err is None and st.reader_status:
            err = f"{sh.name}: {st.reader_status}"
        if err is None and st.written != sh.bytes:
            err = (f"{sh.name}: wrote {st.written} bytes, the "
                   f"{'listing' if self.files else 'manifest'} says {sh.bytes}")
        if err is None and self.files and st.hasher.hexdigest() != st.sent_crc:
            err = (f"{sh.name}: the bytes written have CRC-32C {st.hasher.hexdigest()}, the "
                   f"bytes read from the source {st.sent_crc}: corrupted on the way (network, "
                   f"memory); re-run")
        elif err is None and not self.files and not st.hasher.ok():
            err = mismatch(sh, st.hasher)
        if st.fd >= 0:
            try:
                if self.files and err is None:
                    # the source's permission bits and mtime: what a re-run's quick check
                    # (size and mtime equal the source's) finds; set before the rename, so a
                    # file with its final name always carries them
                    os.fchmod(st.fd, sh.mode)
                    os.utime(st.fd, ns=(sh.mtime_ns, sh.mtime_ns))
                if self.fsync and err is None:
                    os.fsync(st.fd)
            except OSError as exc:
                err = err or f"{sh.name}: {exc}"
            os.close(st.fd)
            st.fd = -1
        settle(sh, st.partial, st.final, err, self.copied, self.errors)


# -- the read side ----------------------------------------------------------------------------

class _ReaderFailed:
    def __init__(self, exc: BaseException):
        self.exc = exc


class Reader(threading.Thread):
    """Reads planned chunks of source shards (or a tree's files) into pool slots, in order,
    one chunk ahead.

    CHUNKS: :func:`~hpcddp.data._staging_plan.pack_chunks`'s lists of pieces ``(shard,
    offset, start, nbytes, last)``. Each item put on ``out`` is (slot, verdicts): one
    ``(status, crc)`` per piece that ends a shard, in order. status is None, or a message when
    the shard could not be read as the manifest (the listing) describes: its bytes are then
    zeros, so every rank keeps in step and fails it. crc: with ``files``, the CRC-32C of the
    bytes read, computed here, on the node that read them; else None (the manifest has it).
    """

    def __init__(self, src: str, shards, chunks: list, pool: queue.Queue, at: int,
                 files: bool = False):
        super().__init__(name="hpcddp-stage-read", daemon=True)
        self.src, self.shards, self.chunks, self.pool, self.at = src, shards, chunks, pool, at
        self.files = files
        self.out: queue.Queue = queue.Queue()
        # at most NBUFS - 2 slots read ahead: the main thread must always find a free slot
        # for the chunks other leaders send, or a reader far ahead would deadlock the group
        self.ahead = threading.Semaphore(max(1, NBUFS - 2))
        self.bytes_read = 0
        self.read_s = 0.0
        self._status: dict[int, str] = {}

    def run(self) -> None:
        fh, cur, crc = None, None, None
        try:
            for pieces in self.chunks:
                self.ahead.acquire()
                slot = self.pool.get()
                verdicts = []
                for (s, off, start, n, last) in pieces:
                    if s != cur:
                        if fh is not None:
                            fh.close()
                        fh, cur = self._open(s), s
                        crc = mf.Checker(None) if self.files else None
                    view = memoryview(slot.buf)[self.at + start:self.at + start + n]
                    got = self._read_into(fh, s, off, view) if fh is not None and n else 0
                    if got < n:
                        view[got:] = b"\0" * (n - got)
                        self._status.setdefault(s, f"the source {self._what} is shorter than "
                                                   f"the {self._says} {self.shards[s].bytes} "
                                                   f"bytes (truncated?)")
                    if crc is not None:
                        crc.update(view)
                    if last:
                        if self.files and fh is not None:
                            self._check_unchanged(s, fh)
                        verdicts.append((self._status.get(s),
                                         crc.hexdigest() if crc is not None else None))
                        if fh is not None:
                            fh.close()
                        fh, cur = None, None
                self.out.put((slot, verdicts))
        except BaseException as exc:   # the main thread waits on `out`: it must hear of it
            self.out.put(_ReaderFailed(exc))
            raise
        finally:
            if fh is not None:
                fh.close()

    @property
    def _what(self) -> str:
        return "file" if self.files else "shard"

    @property
    def _says(self) -> str:
        return "listing's" if self.files else "manifest's"

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
            self._status.setdefault(s, f"reading the source {self._what} failed: {exc}")
        self.read_s += time.perf_counter() - t
        self.bytes_read += got
        return got

    def ready(self) -> bool:
        """Whether :meth:`next` would return at once (the ring polls MPI meanwhile)."""
        return not self.out.empty()

    def next(self):
        """The next (slot, verdicts), in plan order; raises what ended the reading thread,
        if it failed (not waiting forever for an item)."""
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
            if self.files:
                # a tree's entry may have changed since it was listed: never follow a link
                # put in its place, never block opening a FIFO put there
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
                fh = open(fd, "rb", buffering=0)
            else:
                fh = open(path, "rb", buffering=0)
        except OSError as exc:
            self._status[s] = f"cannot open the source {self._what} {path}: {exc.strerror or exc}"
            return None
        st = os.fstat(fh.fileno())
        if self.files:
            if not stat.S_ISREG(st.st_mode):
                self._status[s] = (f"{path} is no longer a regular file (replaced since it "
                                   f"was listed)")
            else:
                self._check_unchanged(s, fh, st)
        elif st.st_size != sh.bytes:
            self._status[s] = (f"the source shard {path} has {st.st_size} bytes, the manifest "
                               f"says {sh.bytes}: the source changed since packing")
        return fh

    def _check_unchanged(self, s: int, fh, st=None) -> None:
        """A tree's file must keep the size and mtime it was listed with until its last byte
        is read: else the copy would match neither version. Checked at open and at the end."""
        sh = self.shards[s]
        st = st or os.fstat(fh.fileno())
        if (st.st_size, st.st_mtime_ns) != (sh.bytes, sh.mtime_ns) and s not in self._status:
            what = (f"its size went from {sh.bytes} to {st.st_size} bytes"
                    if st.st_size != sh.bytes else "its mtime changed")
            self._status[s] = (f"{os.path.join(self.src, sh.name)} changed during the copy "
                               f"({what} since it was listed): not staged, since the copy "
                               f"could match neither version; re-run once nothing writes to "
                               f"the source")


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
