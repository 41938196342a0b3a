"""Staging, phase 1: the plan. Who this rank is in the job, what the source holds, where this
node's copy goes, what of it is already there, and whether it fits.

Every step that can fail on some ranks ends in :func:`agree`, so all ranks raise the same
:class:`StageError` or none does; nothing is written before the last check has passed on
every node (but the destination directory and its lock file). The pure pieces (byte-balanced
splits, chunking, the auto strategy) are here too: the copy phases take their plan from them.
"""
from __future__ import annotations

import os
import re
import socket
import time
from dataclasses import dataclass

from hpcddp.data import _staging_files as ft
from hpcddp.data import destlock
from hpcddp.data._comm import watched
from hpcddp.data import manifest as mf

# Chunk buffers per leader: one being read ahead, one on the wire, two being written and
# hashed; the pool size bounds the memory a leader holds whatever the data set's size.
NBUFS = 4
# ring: chunks in flight on each link, all streams together: Open MPI's TCP transport idles
# between messages it has not been given yet (docs/data.md measures 4 against 8)
RING_IN_FLIGHT = 8
# auto runs the ring while its buffers (ring_buffers) stay within this; bcast beyond
AUTO_RING_MAX_BYTES = 512 << 20
# pieces (files or parts of files) per chunk at most: bounds the header of checksums and
# verdicts that travels with each chunk, and the work per round, for trees of tiny files
MAX_PIECES = 4096
_LOCK_POLL_S = (0.2, 0.6)          # seconds between tries of a held lock (random in range)


class StageError(RuntimeError):
    """Staging failed; raised on every rank with the same message."""


def agree(comm, err: str | None, what: str) -> None:
    """Every rank learns every rank's error; all raise the same StageError, or none does."""
    with watched(comm, f"stage:agree:{what}"):
        errs = [e for e in comm.allgather(err) if e]
    if errs:
        uniq = list(dict.fromkeys(errs))
        more = f" (and {len(uniq) - 3} more)" if len(uniq) > 3 else ""
        raise StageError(f"stage: {what}: " + "; ".join(uniq[:3]) + more)


# -- pure plans -------------------------------------------------------------------------------

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


def pack_chunks(items: list[int], sizes: list[int], chunk: int,
                max_pieces: int = MAX_PIECES) -> list[list[tuple[int, int, int, int, bool]]]:
    """Items (files or shards, in order) cut into chunks: what one read-ahead buffer holds and
    one message carries. Each chunk is a list of pieces ``(item, offset, start, nbytes, last)``:
    bytes ``offset .. offset + nbytes`` of the item sit at ``start`` in the chunk's buffer, and
    ``last`` marks the item's final piece.

    Items are laid end to end, so a chunk holds many small files (one MPI round for a few
    thousand 1 KiB files, not one each) and a file larger than the chunk spans several. A
    chunk holds at most ``chunk`` bytes and ``max_pieces`` pieces (bounding the per-chunk
    header of checksums and verdicts); an empty item is one piece of 0 bytes.
    """
    chunks: list[list] = []
    cur: list = []
    fill = 0
    for s in items:
        size, off = sizes[s], 0
        while True:
            if fill == chunk or len(cur) == max_pieces:
                chunks.append(cur)
                cur, fill = [], 0
            n = min(size - off, chunk - fill)
            cur.append((s, off, fill, n, off + n == size))
            fill += n
            off += n
            if off == size:
                break
    if cur:
        chunks.append(cur)
    return chunks


def ring_share(group_nodes: int) -> int:
    """Chunks of one stream (one origin's chunks) in flight on a link: the link's
    RING_IN_FLIGHT shared by the group_nodes - 1 streams that cross it, at least 2."""
    return max(2, -(-RING_IN_FLIGHT // max(1, group_nodes - 1)))


def ring_buffers(group_nodes: int, chunk_bytes: int) -> int:
    """Bytes of chunk buffers one leader holds in the ring: its reader's (read ahead, and its
    own stream's share in flight) and every other stream's (its share and one being written)."""
    share = ring_share(group_nodes)
    return (NBUFS + share + (group_nodes - 1) * (share + 1)) * chunk_bytes


def auto_strategy(group_nodes: int, chunk_bytes: int) -> str:
    """What ``strategy="auto"`` runs for a group of ``group_nodes`` nodes.

    The ring where its buffers (:func:`ring_buffers`) stay within 512 MiB per leader, i.e.
    groups of up to 9 nodes at the default 16 MiB chunk: it was the fastest strategy at 2, 3
    and 4 virtual nodes on a 1 Gbit/s link and on one node (docs/data.md has the
    measurements). bcast beyond: its buffers do not grow with the group.
    """
    if ring_buffers(group_nodes, chunk_bytes) <= AUTO_RING_MAX_BYTES:
        return "ring"
    return "bcast"


# -- who this rank is -------------------------------------------------------------------------

@dataclass
class Job:
    """This rank's place in the staging job (the same strategy and group size on every rank)."""
    world: object             # the world's mpi4py communicator
    topo: object              # hpcddp.comm topology: nodes, leaders
    groups: object            # topo.node_groups(group_nodes)
    group_nodes: int
    strategy: str             # never "auto"
    rank: int

    @property
    def every(self) -> bool:
        return self.strategy == "every-rank"

    @property
    def writer(self) -> bool:
        """Ranks that touch the destination: node leaders, or every rank for every-rank."""
        return self.every or self.topo.is_leader

    @property
    def marks(self) -> bool:
        """The one rank per node that writes the node's markers (STAGING, manifest, READY)."""
        return self.writer and (not self.every or self.topo.local_rank == 0)


def job_layout(group_nodes: int | None, strategy: str, chunk_bytes: int) -> Job:
    """Start MPI if needed; the node groups and the strategy "auto" stands for (all ranks)."""
    import hpcddp.comm as hc
    # no CUDA device picked here: that imports torch, which staging never needs (a training
    # script's own later hpcddp.init() or init_process_group picks it)
    rt = hc.init(set_cuda_device=False)
    topo = rt.topology
    k = min(group_nodes or topo.num_nodes, topo.num_nodes)
    if strategy == "auto":
        strategy = auto_strategy(k, chunk_bytes)
    return Job(rt.world.mpi, topo, topo.node_groups(k), k, strategy, rt.world.mpi.Get_rank())


# -- the plan ---------------------------------------------------------------------------------

@dataclass
class Plan:
    """What phase 1 found, for the copy and finalize phases of this rank."""
    src: str                  # absolute source directory
    mode: str
    raw: bytes                # the manifest's bytes, as read from the source (files: the listing)
    manifest: mf.Manifest     # files=True: a FileTree, its files in the place of shards
    node_dest: str            # this node's destination directory
    mine: list                # shard indices this node holds when done
    have: list                # ... of which already in place and verified
    todo: list                # ... of which to copy
    layout: dict              # what READY will say about the copy (see :func:`_layout`)
    keep: bool                # READY already says all this: leave the markers alone
    manifest_bytes_read: int  # this rank's reads of the source so far
    lock_s: float             # seconds taken by the destination lock, waiting included
    files: bool = False       # a plain tree (:mod:`hpcddp.data._staging_files`), not a pack


def make_plan(job: Job, src: str, dest: str, mode: str, verify: str, lock_wait: float,
              held: list, files: bool = False) -> Plan:
    """Phase 1, on all ranks: read the manifest (files: list the tree), resolve and lock the
    destination, find what is missing and check it fits; then mark the copy in progress.
    Takes the lock into HELD."""
    if files:
        raw, nread = _read_tree(job, src)
        m = ft.FileTree.from_json(raw)
    else:
        raw, nread = _read_manifest(job, src)
        m = mf.Manifest.from_json(raw, os.path.join(src, mf.MANIFEST))
    node_dest = _node_destination(job, dest)
    if files:
        _dest_outside_tree(job, src, node_dest)
    lock_s = lock_destination(job.world, job.topo, node_dest, held, lock_wait)
    if mode == "partition":
        sizes = [s.bytes for s in m.shards]
        mine = split_by_bytes(sizes, job.groups.nodes)[job.groups.node_in_group]
    else:
        mine = list(range(len(m.shards)))
    have, todo, stale = _what_is_missing(job, node_dest, m, mine, verify, raw, files)
    layout = _layout(raw, mode, job.topo, job.groups, mine, files)
    keep = job.writer and not todo and not stale and _ready_holds(node_dest, raw, layout, m, mine,
                                                                  files)
    _mark_in_progress(job, node_dest, src, mode, keep, stale, m.dirs if files else [])
    return Plan(src, mode, raw, m, node_dest, mine, have, todo, layout, keep, nread, lock_s,
                files)


def _read_manifest(job: Job, src: str) -> tuple[bytes, int]:
    """One read per group (every rank's own for every-rank), checked, then shared."""
    raw = err = None
    nread = 0
    gcomm = job.groups.group_comm
    if job.every or gcomm.Get_rank() == 0:
        try:
            with open(os.path.join(src, mf.MANIFEST), "rb") as f:
                raw = f.read()
            nread = len(raw)
            mf.Manifest.from_json(raw, os.path.join(src, mf.MANIFEST))
        except (OSError, mf.DatasetError) as exc:
            raw, err = None, (f"cannot read the source manifest: {exc}" if isinstance(exc, OSError)
                              else str(exc))
    if not job.every:
        with watched(gcomm, "stage:bcast:manifest"):
            raw, err = gcomm.bcast((raw, err), root=0)
    agree(job.world, err, "source")
    return raw, nread


def _read_tree(job: Job, src: str) -> tuple[bytes, int]:
    """One listing per group (every rank's own for every-rank), shared as canonical JSON;
    a refused entry (a link, a special file, a reserved name) fails every rank, named."""
    raw = err = None
    gcomm = job.groups.group_comm
    if job.every or gcomm.Get_rank() == 0:
        try:
            raw = ft.dumps_listing(*ft.list_tree(src))
        except ValueError as exc:
            err = str(exc).removeprefix("stage: ")
        except OSError as exc:
            err = f"files=True: cannot list the source tree: {exc}"
    if not job.every:
        with watched(gcomm, "stage:bcast:listing"):
            raw, err = gcomm.bcast((raw, err), root=0)
    agree(job.world, err, "source")
    return raw, 0     # a listing reads metadata, no file bytes


def _dest_outside_tree(job: Job, src: str, node_dest: str) -> None:
    """A tree staged into itself would list its own copy on the next run: refused on all."""
    real_src, real_dest = os.path.realpath(src), os.path.realpath(node_dest)
    err = None
    if real_dest == real_src or real_dest.startswith(real_src.rstrip(os.sep) + os.sep):
        err = (f"files=True: DEST {node_dest} on node {job.topo.node} is inside SRC {src}: the "
               f"copy would become part of the tree it copies; stage to a directory outside it")
    agree(job.world, err, "destination")


def _node_destination(job: Job, dest: str) -> str:
    """DEST resolved on this node; refused on all ranks if two nodes would share a directory."""
    topo = job.topo
    err, node_dest = None, None
    try:
        node_dest = resolve_dest(os.fspath(dest), topo.node, topo.hostname)
    except ValueError as exc:
        err = str(exc)
    agree(job.world, err, "destination")
    if topo.is_leader:
        with watched(topo.leader_comm, "stage:allgather:destinations"):
            seen = topo.leader_comm.allgather((topo.hostname, os.path.realpath(node_dest),
                                               topo.node))
        where: dict = {}
        for host, path, node in seen:
            where.setdefault((host, path), []).append(node)
        clash = [(h, p, ns) for (h, p), ns in where.items() if len(ns) > 1]
        if clash:
            h, p, ns = clash[0]
            err = (f"nodes {ns} all resolve DEST to {p} on host {h}: they would overwrite each "
                   f"other; put {{node}} in DEST (e.g. /dev/shm/data-{{node}})")
    agree(job.world, err, "destination")
    return node_dest


def lock_destination(world, topo, node_dest: str, held: list, wait_s: float) -> float:
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
        lock, busy, err = _try_lock(topo, node_dest, lock) if topo.is_leader else (None, None, None)
        expired = time.monotonic() - t0 >= wait_s
        with watched(world, "stage:allgather:lock"):
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
        who = _who_holds(blocked)
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


def _try_lock(topo, node_dest: str, lock):
    """A node leader's try, without blocking: (lock, holder record or None, error or None)."""
    from hpcddp.comm import log
    busy = err = None
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
    return lock, busy, err


def _who_holds(blocked: list) -> str:
    holder, _, _, node, host, path = blocked[0]
    return (f"{path} on node {node} ({host}) is being staged by another stager: "
            f"{destlock.describe(holder)} (lock file {os.path.join(path, destlock.LOCK_NAME)})"
            + (f", and {len(blocked) - 1} more destination(s)" if len(blocked) > 1 else ""))


def _what_is_missing(job: Job, node_dest: str, m: mf.Manifest, mine: list, verify: str,
                     raw: bytes, files: bool = False) -> tuple[list, list, list]:
    """(have, todo, stale) on writers (empty elsewhere); refused on all ranks if the copy
    does not fit in the free space (stale files' space counted as free)."""
    topo = job.topo
    err, have, todo, stale = None, [], [], []
    if job.writer:
        try:
            os.makedirs(node_dest, exist_ok=True)
            if files:
                have, todo, stale, reclaim = ft.inspect_files(node_dest, m, mine, verify, raw,
                                                              sha256(raw))
            else:
                have, todo, stale, reclaim = _inspect(node_dest, m, mine, verify, raw)
            need = (sum(_blocks(m.shards[s].bytes) for s in todo) + _blocks(len(raw)) + 8192
                    + 4096 * len(getattr(m, "dirs", ())))
            if job.every:
                need *= topo.local_size  # every rank of the node holds a partial copy
            free = _free_bytes(node_dest) + reclaim
            if need > free:
                err = (f"not enough space on node {topo.node} ({topo.hostname}) in {node_dest}: "
                       f"needs {need / 1e9:.3f} GB ({need} bytes; {len(todo)} of "
                       f"{len(mine)} shards to copy), {free / 1e9:.3f} GB free ({free} bytes); "
                       f"free space, stage to another directory, or use mode='partition' / more "
                       f"nodes per group")
        except OSError as exc:
            err = f"node {topo.node}: preparing {node_dest}: {exc}"
    agree(job.world, err, "plan")
    return have, todo, stale


def _mark_in_progress(job: Job, node_dest: str, src: str, mode: str, keep: bool,
                      stale: list, dirs: list) -> None:
    """The first write: READY goes, STAGING (who stages, from where) comes, stale files go,
    a tree's directories come. A reader that finds STAGING knows the copy is half-made,
    whatever else is there."""
    err = None
    if job.marks and not keep:
        try:
            if os.path.exists(os.path.join(node_dest, mf.READY)):
                os.remove(os.path.join(node_dest, mf.READY))
            mf.write_atomic(os.path.join(node_dest, mf.STAGING), mf.dumps(
                dict(destlock.my_record(node_dest), source=src, mode=mode,
                     strategy=job.strategy)))
            # every node makes every directory (empty ones too), before any rank copies: the
            # agree below orders it before the copy on every-rank's other ranks
            ft.make_dirs(node_dest, dirs)
        except OSError as exc:
            err = f"node {job.topo.node}: {exc}"
    if job.marks:
        for n in stale:
            try:
                os.remove(os.path.join(node_dest, n))
            except FileNotFoundError:
                pass
    agree(job.world, err, "plan")


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
               and ready.get("manifest_sha256") == sha256(src_raw))
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


def _layout(raw: bytes, mode: str, topo, groups, mine: list[int], files: bool = False) -> dict:
    """What READY says about where this node's copy sits (the markers' comparable part).
    A tree's READY names its local files ``local_files``: the datasets read ``local_shards``
    as shard indices of a manifest, which a file index is not."""
    return {"manifest_sha256": sha256(raw), "mode": mode, "node": topo.node,
            "group": groups.group_rank, "num_groups": groups.group_ws,
            "nodes_in_group": groups.nodes, "node_in_group": groups.node_in_group,
            ("local_files" if files else "local_shards"): sorted(mine)}


def _ready_holds(dest: str, raw: bytes, layout: dict, m: mf.Manifest, mine: list[int],
                 files: bool = False) -> bool:
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
    if files:       # no manifest file in a staged tree: READY's listing hash stands for it
        return ft.dirs_present(dest, m.dirs)
    try:
        with open(os.path.join(dest, mf.MANIFEST), "rb") as f:
            return f.read() == raw
    except OSError:
        return False


def sha256(raw: bytes) -> str:
    import hashlib
    return hashlib.sha256(raw).hexdigest()
