"""Stage a packed data set to node-local storage: read the source once per node group.

Called on every rank of the job (``hpcddp stage SRC DEST`` under mpirun/srun, or
:func:`stage`). Nodes are taken ``group_nodes`` at a time (default: all nodes form one group).
Within a group, node leaders (local rank 0) split the shards into disjoint, byte-balanced
ranges and read only their own range from the shared file system (the *scatter*); every shard
then reaches every node of the group that needs it (the *broadcast*) over MPI:

* ``strategy="bcast"``: shard by shard, the leader that read a chunk broadcasts it to the
  group's leaders (``MPI_Bcast``), while a read-ahead thread fetches the next chunk;
* ``strategy="allgather"``: all leaders read a chunk each at once and exchange them with one
  ``MPI_Allgatherv`` per round;
* ``strategy="every-rank"``: the baseline the benchmark compares with: every rank copies
  what its node needs straight from the source (N reads of every byte), no MPI traffic.

``mode="replicate"`` gives every node the whole data set; ``mode="partition"`` gives node j
of a k-node group the j-th byte-balanced range of shards (each node reads its own range and
nothing travels). Each shard is streamed in chunks (data sets larger than memory work),
written under a temporary name, hashed as it is written, compared with the manifest's SHA-256
and renamed; the node's ``READY`` marker comes last, after every rank agrees that all went
well. A re-run keeps shards that are already in place and verified, so a killed stager
resumes. Free space is checked on every node before anything is written. One stager per
destination: each node leader holds its destination's lock (:mod:`hpcddp.data.destlock`)
from before it touches any file there until :func:`stage` returns.

Only the MPI layer (``hpcddp.comm``) is used: never torch.distributed.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import queue
import re
import socket
import threading
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from hpcddp.data import destlock
from hpcddp.data import manifest as mf

MODES = ("replicate", "partition")
STRATEGIES = ("auto", "bcast", "allgather", "every-rank")
DEFAULT_CHUNK_BYTES = 16 << 20
MAX_CHUNK_BYTES = 1 << 30          # MPI counts are ints; stay well clear of 2 GiB
NBUFS = 4                          # chunk buffers per leader: read-ahead + write-behind
_KILL_ENV = "HPCDDP_STAGE_KILL_AFTER_CHUNKS"   # testing: exit after N chunks written...
_KILL_RANK_ENV = "HPCDDP_STAGE_KILL_RANK"       # ...on this world rank (default 0)
_POLL_S = 0.002
DEFAULT_LOCK_WAIT_S = 1800.0       # as long as torch's default collective timeout
_LOCK_POLL_S = (0.2, 0.6)          # seconds between tries of a held lock (random in range)


class StageError(RuntimeError):
    """Staging failed; raised on every rank with the same message."""


# -- destination paths ------------------------------------------------------------------------

def resolve_dest(template: str, node: int, host: str | None = None) -> str:
    """The node-local directory for ``node``: ``{node}``/``{host}`` filled, ``$VARS`` expanded.

    Raises ValueError when a variable is unset (``$SLURM_TMPDIR`` outside a Slurm job).
    """
    host = host or socket.gethostname()
    path = template.replace("{node}", str(node)).replace("{host}", host.split(".")[0])
    path = os.path.expanduser(os.path.expandvars(path))
    left = re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", path)
    if left:
        raise ValueError(f"stage: DEST {template!r} uses ${left[0]}, which is not set on node "
                         f"{node} ({host}); {'run inside a Slurm job or ' if 'SLURM' in left[0] else ''}"
                         f"set it, or give a literal path")
    bad = re.findall(r"\{[^}]*\}", path)
    if bad:
        raise ValueError(f"stage: DEST {template!r} has placeholder {bad[0]}; the known ones are "
                         f"{{node}} (node index) and {{host}} (short host name)")
    return os.path.abspath(path)


# -- plans ------------------------------------------------------------------------------------

def split_by_bytes(sizes: list[int], parts: int) -> list[list[int]]:
    """Cut items 0..n-1 into ``parts`` contiguous, byte-balanced ranges (some may be empty).

    Item i goes to part ``floor(parts * midpoint_i / total)``, where ``midpoint_i`` is the
    running byte count at the middle of item i: contiguous, deterministic, and within one
    item of an even split.
    """
    out: list[list[int]] = [[] for _ in range(parts)]
    total = sum(sizes)
    run = 0
    for i, sz in enumerate(sizes):
        if total > 0:
            j = int(parts * (run + sz / 2) / total)
        else:
            j = int(parts * (i + 0.5) / len(sizes))
        out[min(parts - 1, j)].append(i)
        run += sz
    return out


def chunks_of(nbytes: int, chunk: int) -> list[tuple[int, int]]:
    """(offset, length) pieces of a file of ``nbytes``; a 0-byte file is one empty piece."""
    if nbytes == 0:
        return [(0, 0)]
    return [(off, min(chunk, nbytes - off)) for off in range(0, nbytes, chunk)]


@dataclass
class StageResult:
    """What :func:`stage` did, the same on every rank. Bytes are bytes; times are seconds."""
    source: str
    dest: str
    mode: str
    strategy: str
    ranks: int
    nodes: int
    group_nodes: int
    groups: int
    chunk_bytes: int
    dataset_bytes: int                 # shard files + manifest
    num_samples: int
    num_shards: int
    bytes_read_from_source: int        # counted: every read of the source, all ranks
    bytes_read_per_group: list
    read_amplification: float          # max over groups of bytes read / dataset_bytes
    bytes_written: int                 # all nodes
    bytes_written_per_node: list
    shards_copied: int                 # all nodes
    shards_skipped: int                # already in place and verified
    seconds: float                     # wall time, slowest rank
    phases: dict                       # plan / copy / finalize seconds (slowest rank)
    read_seconds: float                # leaders' time inside source reads (slowest)
    write_seconds: float               # leaders' time inside writes (slowest)
    hash_seconds: float
    write_gbps: float                  # bytes_written / seconds, aggregate (1 GB = 1e9 B)
    write_gbps_per_node: float         # bytes_written_per_node max / seconds
    read_gbps: float                   # bytes_read_from_source / copy-phase seconds
    dest_per_node: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        gb = 1e9
        lines = [
            f"staged {self.num_samples} samples, {self.num_shards} shards "
            f"({self.dataset_bytes / gb:.3f} GB) to {self.nodes} node(s) in {self.groups} "
            f"group(s) of <= {self.group_nodes}: mode={self.mode} strategy={self.strategy}",
            f"  read from source: {self.bytes_read_from_source / gb:.3f} GB "
            f"({self.read_amplification:.2f}x the data set per group)",
            f"  written: {self.bytes_written / gb:.3f} GB ({self.shards_copied} shard copies, "
            f"{self.shards_skipped} already in place)",
            f"  time: {self.seconds:.2f} s = plan {self.phases.get('plan', 0):.2f} + copy "
            f"{self.phases.get('copy', 0):.2f} + finalize {self.phases.get('finalize', 0):.2f}"
            f"; write {self.write_gbps:.2f} GB/s aggregate, {self.write_gbps_per_node:.2f} GB/s "
            f"per node; source read {self.read_gbps:.2f} GB/s",
        ]
        return "\n".join(lines)


# -- the write side: hash and write on two threads, finish shards in order ---------------------

class _Slot:
    __slots__ = ("buf", "refs", "lock")

    def __init__(self, nbytes: int):
        self.buf = np.empty(max(1, nbytes), dtype=np.uint8)
        self.refs = 0
        self.lock = threading.Lock()


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


class _Sink:
    """Writes and hashes pieces of shards in submission order; renames verified shards.

    Two threads (write, hash) take the same pieces: hashlib and os.pwrite both release the
    GIL, so they overlap with each other and with the main thread's reads and MPI calls.
    """

    def __init__(self, pool: "queue.Queue[_Slot]", dest: str, shards, partial_suffix: str,
                 fsync: bool, bar, kill_after: int | None):
        self.pool, self.dest, self.fsync, self.bar = pool, dest, fsync, bar
        self.partial_suffix = partial_suffix
        self.kill_after = kill_after
        self.out: dict[int, _ShardOut] = {}
        self.shards = shards
        self.q_write: queue.Queue = queue.Queue()
        self.q_hash: queue.Queue = queue.Queue()
        self.write_s = 0.0
        self.hash_s = 0.0
        self.bytes_written = 0
        self.chunks_written = 0
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
                           os.path.join(self.dest, mf.partial_name(sh.name) + self.partial_suffix))
            self.out[s] = st
        return st

    def submit(self, slot: _Slot, pieces: list) -> None:
        """pieces: (shard, offset, start_in_slot, nbytes, last, reader_status)."""
        if not pieces:
            self.release(slot)
            return
        for p in pieces:
            self._state(p[0])  # create in the submitting thread: no race on self.out
        slot.refs = 2
        self.q_write.put((slot, pieces))
        self.q_hash.put((slot, pieces))

    def release(self, slot: _Slot) -> None:
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
                except OSError as exc:
                    st.error = st.error or f"{st.shard.name}: writing {st.partial}: {exc}"
                if last:
                    if status:
                        st.reader_status = status
                    self._maybe_finish(st)
            self.release(slot)

    def _write(self, st: _ShardOut, slot: _Slot, off: int, start: int, n: int) -> None:
        if st.error is not None:
            return
        t = time.perf_counter()
        if st.fd < 0:
            # no posix_fallocate: on tmpfs it zeroes every page before we overwrite it (~10%
            # slower); free space was checked for the whole copy before it started
            st.fd = os.open(st.partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        view = memoryview(slot.buf)[start:start + n]
        pos = off
        while view:
            k = os.pwrite(st.fd, view, pos)
            view, pos = view[k:], pos + k
        st.written += n
        self.write_s += time.perf_counter() - t
        self.bytes_written += n
        self.chunks_written += 1
        if self.bar is not None:
            self.bar.update(n)
        if self.kill_after is not None and self.chunks_written >= self.kill_after:
            from hpcddp.comm import log
            log(f"stage: {_KILL_ENV}={self.kill_after} reached: exiting mid-copy (test kill point)")
            os._exit(137)

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
            err = _mismatch(sh, st.hasher)
        _settle(sh, st.partial, st.final, err, self.copied, self.errors)


def _mismatch(sh: mf.Shard, checker: mf.Checker) -> str:
    return (f"{sh.name}: checksum mismatch ({checker.kind} {checker.hexdigest()[:16]}, "
            f"manifest {checker.expected()[:16]}): the source shard is corrupted or changed "
            f"since packing; re-pack it or restore it, then re-run")


def _settle(sh: mf.Shard, partial: str, final: str, err: str | None, copied: list,
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


# -- the read side ----------------------------------------------------------------------------

class _Reader(threading.Thread):
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
                got = 0
                if fh is not None and n:
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
                if got < n:
                    view[got:] = b"\0" * (n - got)
                    self._status.setdefault(s, f"the source shard is shorter than the manifest's "
                                               f"{self.shards[s].bytes} bytes (truncated?)")
                self.out.put((slot, s, off, n, last, self._status.get(s) if last else None))
        finally:
            if fh is not None:
                fh.close()

    def next(self):
        """The next (slot, shard, offset, nbytes, last, status), in plan order."""
        item = self.out.get()
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


# -- the collective driver --------------------------------------------------------------------

def _agree(comm, err: str | None, what: str) -> None:
    """Every rank learns every rank's error; all raise the same StageError, or none does."""
    errs = [e for e in comm.allgather(err) if e]
    if errs:
        uniq = list(dict.fromkeys(errs))
        more = f" (and {len(uniq) - 3} more)" if len(uniq) > 3 else ""
        raise StageError(f"stage: {what}: " + "; ".join(uniq[:3]) + more)


def _lock_destination(world, topo, node_dest: str, held: list, wait_s: float) -> float:
    """Every node leader takes its destination's lock (:mod:`hpcddp.data.destlock`); called
    by all ranks; returns the seconds it took (waiting included), or raises StageError on all.

    All or none: each round, every leader tries its lock without blocking; if any is held
    elsewhere, the ones taken this round are released and every rank sleeps and tries again.
    So two jobs whose nodes share destinations never each hold a part and wait for the rest.
    Rank 0 says once whom it waits for; past ``wait_s`` seconds (the same round on every rank:
    the verdict travels in the allgather) every rank raises the same StageError.
    """
    import random

    from hpcddp.comm import log
    t0 = time.monotonic()
    lock, told = None, False
    while True:
        busy = err = None
        if topo.is_leader:
            try:
                lock = lock or destlock.DestLock(node_dest)
                os.makedirs(node_dest, exist_ok=True)
                busy = lock.try_acquire()
            except (OSError, ValueError) as exc:
                err = f"node {topo.node}: locking {os.path.join(node_dest, destlock.LOCK_NAME)}: {exc}"
            if lock is not None and lock.took_over is not None:
                log(f"stage: {node_dest}: taking over the lock left by "
                    f"{destlock.describe(lock.took_over)}: {destlock.why_dead(lock.took_over)}")
                lock.took_over = None
        expired = time.monotonic() - t0 >= wait_s
        states = world.allgather((busy, err, expired, topo.node, topo.hostname, node_dest))
        errs = [s[1] for s in states if s[1]]
        blocked = [s for s in states if s[0] is not None]
        if lock is not None and lock.held and (errs or blocked):
            lock.release()
        if errs:
            raise StageError("stage: lock: " + "; ".join(list(dict.fromkeys(errs))[:3]))
        if not blocked:
            if lock is not None:
                held.append(lock)
            if told and world.Get_rank() == 0:
                log(f"stage: got the destination lock after {time.monotonic() - t0:.1f} s")
            return time.monotonic() - t0
        holder, _, _, node, host, path = blocked[0]
        who = (f"{path} on node {node} ({host}) is being staged by another stager: "
               f"{destlock.describe(holder)} (lock file {os.path.join(path, destlock.LOCK_NAME)})"
               + (f", and {len(blocked) - 1} more destination(s)" if len(blocked) > 1 else ""))
        if any(s[2] for s in states):
            waited = ("lock_wait=0: refusing instead of waiting" if wait_s == 0 else
                      f"still held after waiting lock_wait={wait_s:g} s")
            raise StageError(f"stage: DEST {who}; {waited}: let that job finish (a re-run then "
                             f"finds its verified shards in place), stage to another directory, "
                             f"or raise --lock-wait")
        if not told and world.Get_rank() == 0:
            log(f"stage: waiting for the destination lock: {who}; waiting up to {wait_s:g} s "
                f"(--lock-wait)")
        told = True
        time.sleep(random.uniform(*_LOCK_POLL_S))


def _quiet_barrier(comm) -> None:
    """A barrier that sleeps instead of spinning, leaving the cores to ranks still copying."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(_POLL_S)


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _blocks(n: int) -> int:
    return ((n + 4095) // 4096) * 4096


def _inspect(dest: str, m: mf.Manifest, need: list[int], verify: str, src_raw: bytes
             ) -> tuple[list[int], list[int], list[str], int]:
    """What of ``need`` is already in ``dest`` and verified; what to delete; reclaimable bytes."""
    have, todo, stale = [], [], []
    reclaim = 0
    ready = mf.read_marker(dest, mf.READY)
    trusted = (verify == "auto" and ready is not None and mf.read_marker(dest, mf.STAGING) is None
               and ready.get("manifest_sha256") == _sha(src_raw))
    # READY vouches for a shard only while its stat is the one recorded when READY was
    # written: a shard written, replaced or touched since is hashed again
    stats = (ready.get("shard_stats") or {}) if trusted else {}
    ready_ns = mf.marker_mtime_ns(dest, mf.READY)
    try:
        names = os.listdir(dest)
    except FileNotFoundError:
        names = []
    for n in names:
        if n.startswith(".") and mf.PARTIAL_SUFFIX in n:
            stale.append(n)
            reclaim += _blocks(os.path.getsize(os.path.join(dest, n)))
    present = set(names)
    for s in need:
        sh = m.shards[s]
        if sh.name in present:
            p = os.path.join(dest, sh.name)
            size = os.path.getsize(p)
            ok = size == sh.bytes
            if ok and verify != "size" and not mf.stat_matches(p, stats.get(sh.name), ready_ns):
                ok = mf.file_matches(p, sh)
            if ok:
                have.append(s)
                continue
            stale.append(sh.name)
            reclaim += _blocks(size)
        todo.append(s)
    return have, todo, stale, reclaim


def _layout(raw: bytes, mode: str, topo, groups, mine: list[int]) -> dict:
    """What READY says about where this node's copy sits (the markers' comparable part)."""
    return {"manifest_sha256": _sha(raw), "mode": mode, "node": topo.node,
            "group": groups.group_rank, "num_groups": groups.group_ws,
            "nodes_in_group": groups.nodes, "node_in_group": groups.node_in_group,
            "local_shards": sorted(mine)}


def _ready_holds(dest: str, raw: bytes, layout: dict, m: mf.Manifest, mine: list[int]) -> bool:
    """Does ``dest``'s READY already say what this run would write: same manifest, same
    layout, every local shard's stat unchanged since? A run with nothing to copy then leaves
    the markers alone, so a job reading the copy meanwhile never finds it half-staged."""
    ready = mf.read_marker(dest, mf.READY)
    if not ready or mf.read_marker(dest, mf.STAGING) is not None:
        return False
    if any(ready.get(k) != v for k, v in layout.items()):
        return False
    stats = ready.get("shard_stats") or {}
    ready_ns = mf.marker_mtime_ns(dest, mf.READY)
    if not all(mf.stat_matches(os.path.join(dest, m.shards[i].name), stats.get(m.shards[i].name),
                               ready_ns) for i in mine):
        return False
    try:
        with open(os.path.join(dest, mf.MANIFEST), "rb") as f:
            return f.read() == raw
    except OSError:
        return False


def _sha(raw: bytes) -> str:
    import hashlib
    return hashlib.sha256(raw).hexdigest()


# allgather keeps NBUFS slots of group_nodes chunks per leader; beyond this it uses bcast
AUTO_ALLGATHER_MAX_BYTES = 512 << 20


def auto_strategy(group_nodes: int, chunk_bytes: int) -> str:
    """What ``strategy="auto"`` runs for a group of ``group_nodes`` nodes.

    allgather where its buffers (NBUFS x group_nodes x chunk_bytes per leader) stay within
    512 MiB, i.e. groups of up to 8 nodes at the default 16 MiB chunk; bcast beyond, whose
    buffers do not grow with the group. Measured on 2 emulated nodes with the source's cache
    cold (docs/data.md): allgather took 0.78x bcast's time, since every leader reads and
    sends at once instead of one leader at a time.
    """
    if NBUFS * group_nodes * chunk_bytes <= AUTO_ALLGATHER_MAX_BYTES:
        return "allgather"
    return "bcast"


def stage(src: str, dest: str, *, mode: str = "replicate", group_nodes: int | None = None,
          strategy: str = "auto", chunk_bytes: int = DEFAULT_CHUNK_BYTES, verify: str = "auto",
          fsync: bool = False, progress: bool = True,
          lock_wait: float = DEFAULT_LOCK_WAIT_S) -> StageResult:
    """Copy the packed data set ``src`` to node-local ``dest`` on every node (collective).

    Every rank of the job calls it with the same arguments; it returns the same
    :class:`StageResult` on every rank, or raises the same :class:`StageError` on every rank.

    Args:
        src: the packed data set directory (on the shared file system).
        dest: node-local directory; may use ``$VARS`` (``$SLURM_TMPDIR``), ``{node}`` (node
            index: needed when emulated nodes share one disk) and ``{host}``.
        mode: ``"replicate"`` (every node gets everything) or ``"partition"`` (node j of a
            group of k gets the j-th of k byte-balanced shard ranges).
        group_nodes: nodes per group (the source is read once per group); default all nodes.
        strategy: ``"bcast"``, ``"allgather"``, ``"every-rank"`` (baseline: every rank copies
            from the source itself) or ``"auto"`` (:func:`auto_strategy`: allgather for
            groups of up to 8 nodes, bcast beyond; docs/data.md has the numbers).
        chunk_bytes: bytes per read and per message (memory per leader: 4 chunks; allgather:
            4 x group_nodes chunks).
        verify: shards already in ``dest``: ``"auto"`` (hash them unless a READY marker for
            this very manifest vouches for them: it does for a shard whose size, mtime, ctime
            and inode are the ones it recorded), ``"full"`` (always hash), ``"size"``.
        fsync: fsync each shard before renaming it (node-local scratch rarely needs it: a
            crash that loses page-cache data usually loses the node's scratch too).
        progress: a tqdm bar of bytes written, on each node leader.
        lock_wait: seconds a node leader waits for another stager holding its destination's
            lock (:mod:`hpcddp.data.destlock`) before every rank raises StageError; 0 refuses
            at once. Rank 0 says once whom it waits for (host, pid, job).
    """
    held: list = []   # the destination lock this process took, released however we leave
    try:
        return _stage(src, dest, held, mode=mode, group_nodes=group_nodes, strategy=strategy,
                      chunk_bytes=chunk_bytes, verify=verify, fsync=fsync, progress=progress,
                      lock_wait=lock_wait)
    finally:
        for lock in held:
            lock.release()


def _stage(src, dest, held, *, mode, group_nodes, strategy, chunk_bytes, verify, fsync, progress,
           lock_wait) -> StageResult:
    """:func:`stage`'s body; takes the destination lock into ``held``."""
    t_start = time.perf_counter()
    if mode not in MODES:
        raise ValueError(f"stage: mode={mode!r}, expected one of {list(MODES)}")
    if strategy not in STRATEGIES:
        raise ValueError(f"stage: strategy={strategy!r}, expected one of {list(STRATEGIES)}")
    if verify not in ("auto", "full", "size"):
        raise ValueError(f"stage: verify={verify!r}, expected 'auto', 'full' or 'size'")
    if not isinstance(chunk_bytes, int) or not 1 <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"stage: chunk_bytes={chunk_bytes!r}, expected an int in 1..{MAX_CHUNK_BYTES}")
    if group_nodes is not None and (not isinstance(group_nodes, int) or group_nodes < 1):
        raise ValueError(f"stage: group_nodes={group_nodes!r}, expected a positive int or None")
    if not isinstance(lock_wait, (int, float)) or not 0 <= lock_wait < float("inf"):
        raise ValueError(f"stage: lock_wait={lock_wait!r}, expected seconds >= 0 (0: refuse at once)")
    src = os.path.abspath(os.fspath(src))

    import hpcddp.comm as hc
    rt = hc.init()
    world = rt.world.mpi
    topo = rt.topology
    k = min(group_nodes or topo.num_nodes, topo.num_nodes)
    if strategy == "auto":
        strategy = auto_strategy(k, chunk_bytes)
    groups = topo.node_groups(k)
    gcomm = groups.group_comm
    gl = groups.group_leader_comm             # None off-leader
    is_leader = topo.is_leader
    every = strategy == "every-rank"
    writer = every or is_leader               # ranks that touch the destination
    rank = world.Get_rank()
    kill_after = None
    if os.environ.get(_KILL_ENV) and int(os.environ.get(_KILL_RANK_ENV, "0")) == rank:
        kill_after = int(os.environ[_KILL_ENV])

    # -- plan: manifest, destination, what is missing, free space ---------------------------
    bytes_read = 0
    err = None
    raw = None
    if every or gcomm.Get_rank() == 0:
        try:
            with open(os.path.join(src, mf.MANIFEST), "rb") as f:
                raw = f.read()
            bytes_read += len(raw)
            mf.Manifest.from_json(raw, os.path.join(src, mf.MANIFEST))
        except (OSError, mf.DatasetError) as exc:
            raw, err = None, (f"cannot read the source manifest: {exc}" if isinstance(exc, OSError)
                              else str(exc))
    if not every:
        raw, err = gcomm.bcast((raw, err), root=0)
    _agree(world, err, "source")
    m = mf.Manifest.from_json(raw, os.path.join(src, mf.MANIFEST))
    sizes = [s.bytes for s in m.shards]

    err, node_dest = None, None
    try:
        node_dest = resolve_dest(os.fspath(dest), topo.node, topo.hostname)
    except ValueError as exc:
        err = str(exc)
    _agree(world, err, "destination")
    if is_leader:
        seen = topo.leader_comm.allgather((topo.hostname, os.path.realpath(node_dest), topo.node))
        where: dict = {}
        for host, path, node in seen:
            where.setdefault((host, path), []).append(node)
        clash = [(h, p, ns) for (h, p), ns in where.items() if len(ns) > 1]
        if clash:
            h, p, ns = clash[0]
            err = (f"nodes {ns} all resolve DEST to {p} on host {h}: they would overwrite each "
                   f"other; put {{node}} in DEST (e.g. /dev/shm/data-{{node}})")
    _agree(world, err, "destination")
    lock_s = _lock_destination(world, topo, node_dest, held, lock_wait)

    gsize = gl.Get_size() if gl is not None else 0
    g_index = gl.Get_rank() if gl is not None else -1
    if mode == "partition":
        nodes_in_group = groups.nodes
        mine = split_by_bytes(sizes, nodes_in_group)[groups.node_in_group]
    else:
        mine = list(range(len(m.shards)))

    err, have, todo, stale, need_bytes, free = None, [], [], [], 0, 0
    suffix = f".r{rank}" if every else ""
    if writer:
        try:
            os.makedirs(node_dest, exist_ok=True)
            have, todo, stale, reclaim = _inspect(node_dest, m, mine, verify, raw)
            need_bytes = sum(_blocks(sizes[s]) for s in todo) + _blocks(len(raw)) + 8192
            if every:
                need_bytes *= topo.local_size  # every rank of the node holds a partial copy
            free = _free_bytes(node_dest) + reclaim
            if need_bytes > free:
                err = (f"not enough space on node {topo.node} ({topo.hostname}) in {node_dest}: "
                       f"needs {need_bytes / 1e9:.3f} GB ({need_bytes} bytes; {len(todo)} of "
                       f"{len(mine)} shards to copy), {free / 1e9:.3f} GB free ({free} bytes); "
                       f"free space, stage to another directory, or use mode='partition' / more "
                       f"nodes per group")
        except OSError as exc:
            err = f"node {topo.node}: preparing {node_dest}: {exc}"
    _agree(world, err, "plan")

    # nothing is written before this point (but the directory): now mark the copy as in progress
    layout = _layout(raw, mode, topo, groups, mine)
    keep = writer and not todo and not stale and _ready_holds(node_dest, raw, layout, m, mine)
    if writer and (not every or topo.local_rank == 0) and not keep:
        try:
            if os.path.exists(os.path.join(node_dest, mf.READY)):
                os.remove(os.path.join(node_dest, mf.READY))
            mf.write_atomic(os.path.join(node_dest, mf.STAGING), mf.dumps(
                dict(destlock.my_record(node_dest), source=src, mode=mode, strategy=strategy)))
        except OSError as exc:
            err = f"node {topo.node}: {exc}"
    if writer and (not every or topo.local_rank == 0):
        for n in stale:
            try:
                os.remove(os.path.join(node_dest, n))
            except FileNotFoundError:
                pass
    _agree(world, err, "plan")
    t_plan = time.perf_counter()

    # -- copy -------------------------------------------------------------------------------
    read_s = write_s = hash_s = 0.0
    copied: list[int] = []
    errors: list[str] = []
    bytes_written = 0
    chunk = chunk_bytes
    if writer:
        bar = None
        if progress and (is_leader or every and topo.local_rank == 0):
            from tqdm import tqdm
            total = sum(sizes[s] for s in todo)
            bar = tqdm(total=total, unit="B", unit_scale=True, mininterval=1.0,
                       desc=f"[rank{rank}] stage node{topo.node}", leave=False)
        exchange = (not every) and mode == "replicate" and gsize > 1
        try:
            if exchange:
                st = _copy_exchange(gl, strategy, src, node_dest, m, todo, chunk, gsize, g_index,
                                    fsync, bar, kill_after)
            else:
                st = _copy_local(src, node_dest, m, todo, chunk, suffix, fsync, bar, kill_after)
        finally:
            if bar is not None:
                bar.close()
        bytes_read += st.bytes_read
        read_s, write_s, hash_s = st.read_s, st.write_s, st.hash_s
        copied, errors, bytes_written = st.copied, st.errors, st.bytes_written
    t_copy_local = time.perf_counter()
    _quiet_barrier(world)
    t_copy = time.perf_counter()

    # -- finalize: agree, then manifest + READY on every node --------------------------------
    report = {"rank": rank, "node": topo.node, "group": groups.group_rank, "leader": is_leader,
              "writer": writer, "bytes_read": bytes_read,
              "bytes_written": bytes_written,
              "copied": len(copied), "skipped": len(have), "errors": errors,
              "read_s": read_s, "write_s": write_s, "hash_s": hash_s, "dest": node_dest,
              "plan_s": t_plan - t_start, "copy_s": t_copy_local - t_plan, "lock_s": lock_s}
    reports = world.allgather(report)
    all_errors = [f"node {r['node']} (rank {r['rank']}): {e}" for r in reports for e in r["errors"]]
    if all_errors:
        more = f" (and {len(all_errors) - 5} more)" if len(all_errors) > 5 else ""
        raise StageError(f"stage: {len(all_errors)} shard copies failed, nothing marked {mf.READY}: "
                         + "; ".join(all_errors[:5]) + more)
    err = None
    if writer and (not every or topo.local_rank == 0) and not keep:
        try:
            mpath = os.path.join(node_dest, mf.MANIFEST)
            if not (os.path.exists(mpath) and open(mpath, "rb").read() == raw):
                mf.write_atomic(mpath, raw, fsync)
            ready = dict(layout, staged=_now(), source=src, strategy=strategy, host=topo.hostname,
                         shard_stats=mf.shard_stats(node_dest, m, mine))
            mf.write_atomic(os.path.join(node_dest, mf.READY), mf.dumps(ready), fsync)
            os.remove(os.path.join(node_dest, mf.STAGING))
        except OSError as exc:
            err = f"node {topo.node}: writing markers in {node_dest}: {exc}"
    _agree(world, err, "finalize")
    t_end = time.perf_counter()
    times = world.allgather((t_plan - t_start, t_copy - t_plan, t_end - t_copy, t_end - t_start))
    return _result(src, os.fspath(dest), mode, strategy, topo, k, groups.group_ws, chunk, m, raw,
                   reports, times)



@dataclass
class _CopyStats:
    bytes_read: int = 0
    bytes_written: int = 0
    read_s: float = 0.0
    write_s: float = 0.0
    hash_s: float = 0.0
    copied: list = field(default_factory=list)
    errors: list = field(default_factory=list)


def _copy_exchange(gl, strategy, src, node_dest, m, todo, chunk, gsize, g_index, fsync, bar,
                   kill_after) -> _CopyStats:
    """Replicate within a group of several nodes: leaders read disjoint ranges, MPI moves them."""
    sizes = [s.bytes for s in m.shards]
    width = gsize if strategy == "allgather" else 1
    pool: queue.Queue = queue.Queue()
    for _ in range(NBUFS):
        pool.put(_Slot(chunk * width))
    sink = _Sink(pool, node_dest, m.shards, "", fsync, bar, kill_after)
    try:
        needs = gl.allgather(todo)
        union = sorted(set().union(*map(set, needs)))
        readers = split_by_bytes([sizes[s] for s in union], gsize)
        reader_of = {}
        for j, part in enumerate(readers):
            for i in part:
                reader_of[union[i]] = j
        my_plan = []
        for s in union:
            if reader_of[s] == g_index:
                pieces = chunks_of(sizes[s], chunk)
                for i, (off, n) in enumerate(pieces):
                    my_plan.append((s, off, n, i == len(pieces) - 1))
        at = g_index * chunk if strategy == "allgather" else 0
        reader = _Reader(src, m.shards, my_plan, pool, at)
        reader.start()
        want = set(todo)
        if strategy == "bcast":
            _run_bcast(gl, union, reader_of, sizes, chunk, g_index, reader, pool, sink, want)
        else:
            _run_allgather(gl, union, reader_of, sizes, chunk, g_index, reader, pool, sink, want)
        reader.join()
    finally:
        sink.close()
    return _CopyStats(reader.bytes_read, sink.bytes_written, reader.read_s, sink.write_s,
                      sink.hash_s, sink.copied, sink.errors)


def _copy_local(src, node_dest, m, todo, chunk, suffix, fsync, bar, kill_after) -> _CopyStats:
    """Copy shards straight from the source (no MPI): partition mode, one-node groups,
    every-rank. The kernel copies (``sendfile``: no pass through Python buffers, as ``cp``
    does with copy_file_range), then a second thread checksums each finished file through a read-only mapping of the page
    cache and checks it against the manifest: what is verified is what landed on disk.
    """
    stats = _CopyStats()
    q: queue.Queue = queue.Queue(maxsize=2)
    step = max(chunk, 1 << 20)
    chunks = 0

    def verify_loop():
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
                        err = _mismatch(sh, c)
                except OSError as exc:
                    err = f"{sh.name}: re-reading {partial}: {exc}"
                stats.hash_s += time.perf_counter() - t
            _settle(sh, partial, final, err, stats.copied, stats.errors)

    verifier = threading.Thread(target=verify_loop, name="hpcddp-stage-verify", daemon=True)
    verifier.start()
    try:
        for s in todo:
            sh = m.shards[s]
            path = os.path.join(src, sh.name)
            final = os.path.join(node_dest, sh.name)
            partial = os.path.join(node_dest, mf.partial_name(sh.name) + suffix)
            err = None
            try:
                sfd = os.open(path, os.O_RDONLY)
            except OSError as exc:
                stats.errors.append(f"{sh.name}: cannot open the source shard {path}: "
                                    f"{exc.strerror or exc}")
                continue
            try:
                size = os.fstat(sfd).st_size
                if size != sh.bytes:
                    err = (f"{sh.name}: the source shard {path} has {size} bytes, the manifest "
                           f"says {sh.bytes}: the source changed since packing")
                dfd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    off = 0
                    use_sendfile = True
                    while err is None and off < sh.bytes:
                        n = min(step, sh.bytes - off)
                        t = time.perf_counter()
                        k = 0
                        if use_sendfile:
                            try:
                                k = os.sendfile(dfd, sfd, off, n)
                            except OSError as exc:
                                if exc.errno not in (22, 38, 95):  # EINVAL/ENOSYS/EOPNOTSUPP
                                    raise
                                use_sendfile = False
                        if not use_sendfile:
                            data = os.pread(sfd, n, off)
                            k = len(data)
                            mv = memoryview(data)
                            while mv:
                                mv = mv[os.write(dfd, mv):]
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
                        chunks += 1
                        if kill_after is not None and chunks >= kill_after:
                            from hpcddp.comm import log
                            log(f"stage: {_KILL_ENV}={kill_after} reached: exiting mid-copy "
                                f"(test kill point)")
                            os._exit(137)
                    if fsync and err is None:
                        os.fsync(dfd)
                finally:
                    os.close(dfd)
            except OSError as exc:
                err = err or f"{sh.name}: copying to {partial}: {exc}"
            finally:
                os.close(sfd)
            q.put((sh, partial, final, err))
    finally:
        q.put(None)
        verifier.join()
    stats.read_s = stats.write_s  # one kernel call reads and writes
    return stats


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
    plans = [[] for _ in range(g)]
    for s in union:
        pieces = chunks_of(sizes[s], chunk)
        for i, (off, n) in enumerate(pieces):
            plans[reader_of[s]].append((s, off, n, i == len(pieces) - 1))
    rounds = max((len(p) for p in plans), default=0)
    for r in range(rounds):
        if r < len(plans[me]):
            slot, s, off, n, last, status = reader.next()
            hdr = (s, off, n, last, status)
        else:
            slot, hdr = pool.get(), None
        hdrs = gl.allgather(hdr)
        counts = [h[2] if h else 0 for h in hdrs]
        displs = [j * chunk for j in range(g)]
        gl.Allgatherv(MPI.IN_PLACE, [slot.buf, (counts, displs), MPI.BYTE])
        pieces = [(h[0], h[1], j * chunk, h[2], h[3], h[4]) for j, h in enumerate(hdrs)
                  if h is not None and h[0] in want]
        sink.submit(slot, pieces)


def _result(src, dest, mode, strategy, topo, k, ngroups, chunk, m, raw, reports, times):
    dataset_bytes = m.total_bytes + len(raw)
    per_group = [0] * ngroups
    per_node = [0] * topo.num_nodes
    dests = [""] * topo.num_nodes
    for r in reports:
        per_group[r["group"]] += r["bytes_read"]
        per_node[r["node"]] += r["bytes_written"]
        if r["writer"]:
            dests[r["node"]] = r["dest"]
    seconds = max(t[3] for t in times)
    phases = {"plan": max(t[0] for t in times), "copy": max(t[1] for t in times),
              "finalize": max(t[2] for t in times),
              "lock": max(r["lock_s"] for r in reports)}  # inside plan: waiting included
    total_read = sum(per_group)
    written = sum(per_node)
    lead = [r for r in reports if r["writer"]]
    return StageResult(
        source=src, dest=dest, mode=mode, strategy=strategy, ranks=len(reports),
        nodes=topo.num_nodes, group_nodes=k, groups=ngroups, chunk_bytes=chunk,
        dataset_bytes=dataset_bytes, num_samples=m.num_samples, num_shards=len(m.shards),
        bytes_read_from_source=total_read, bytes_read_per_group=per_group,
        read_amplification=(max(per_group) / dataset_bytes) if dataset_bytes else 0.0,
        bytes_written=written, bytes_written_per_node=per_node,
        shards_copied=sum(r["copied"] for r in reports),
        shards_skipped=sum(r["skipped"] for r in lead if r["leader"]),
        seconds=seconds, phases=phases,
        read_seconds=max((r["read_s"] for r in lead), default=0.0),
        write_seconds=max((r["write_s"] for r in lead), default=0.0),
        hash_seconds=max((r["hash_s"] for r in lead), default=0.0),
        write_gbps=written / seconds / 1e9 if seconds else 0.0,
        write_gbps_per_node=max(per_node, default=0) / seconds / 1e9 if seconds else 0.0,
        read_gbps=total_read / phases["copy"] / 1e9 if phases["copy"] else 0.0,
        dest_per_node=dests)


def write_json(result: StageResult, path: str) -> None:
    """Write the summary for machines (``--json``): ``-`` is stdout."""
    text = json.dumps(result.as_dict(), indent=2, sort_keys=True)
    if path == "-":
        print(text, flush=True)
    else:
        mf.write_atomic(path, (text + "\n").encode())
