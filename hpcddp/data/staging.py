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
* ``strategy="ring"``: every leader passes its chunks and those it received to the next
  leader around a ring, several chunks in flight (nonblocking point-to-point): each link
  carries (N-1)/N of the data and no step waits for a leader other than the neighbours;
* ``strategy="every-rank"``: the baseline the benchmark compares with: every rank copies
  what its node needs straight from the source (N reads of every byte), no MPI traffic.

``mode="replicate"`` gives every node the whole data set; ``mode="partition"`` gives node j
of a k-node group the j-th byte-balanced range of shards (each node reads its own range and
nothing travels). Each shard is streamed in chunks (data sets larger than memory work),
written under a temporary name, checksummed as it is written, compared with the manifest and
renamed; the node's ``READY`` marker comes last, after every rank agrees that all went
well. A re-run keeps shards that are already in place and verified, so a killed stager
resumes. Free space is checked on every node before anything is written. One stager per
destination: each node leader holds its destination's lock (:mod:`hpcddp.data.destlock`)
from before it touches any file there until :func:`stage` returns.

This module is the driver; each phase has its own module:

=====================================  ===================================================
:mod:`hpcddp.data._staging_plan`       plan: manifest, destination, lock, what is missing,
                                       free space, the STAGING marker
:mod:`hpcddp.data._staging_io`         copy, file side: read-ahead, write + checksum, and
                                       the no-MPI copy of whole shards
:mod:`hpcddp.data._staging_exchange`   copy, MPI side: bcast / allgather / ring between leaders
:mod:`hpcddp.data._staging_finalize`   finalize: agree, manifest + READY, the result
=====================================  ===================================================

``files=True`` stages a plain directory tree instead, with the same guarantees: its listing
takes the manifest's place and each file's CRC-32C, computed where it was read, travels with
it (:mod:`hpcddp.data._staging_files`).

Only the MPI layer (``hpcddp.comm``) is used: never torch.distributed.
"""
from __future__ import annotations

import json
import os
import sys
import time

from hpcddp.data import manifest as mf
from hpcddp.data._comm import watched
from hpcddp.data._staging_exchange import copy_exchange
from hpcddp.data._staging_finalize import StageResult, finalize
from hpcddp.data._staging_io import CopyStats, copy_local
from hpcddp.data._staging_plan import (AUTO_RING_MAX_BYTES, NBUFS, Job, Plan, StageError,
                                       auto_strategy, chunks_of, job_layout, make_plan,
                                       resolve_dest, split_by_bytes)

__all__ = ["AUTO_RING_MAX_BYTES", "DEFAULT_CHUNK_BYTES", "DEFAULT_LOCK_WAIT_S",
           "MAX_CHUNK_BYTES", "MODES", "NBUFS", "STRATEGIES", "StageError", "StageResult",
           "auto_strategy", "chunks_of", "resolve_dest", "split_by_bytes", "stage", "write_json"]

MODES = ("replicate", "partition")
STRATEGIES = ("auto", "bcast", "allgather", "ring", "every-rank")
VERIFY = ("auto", "full", "size")
DEFAULT_CHUNK_BYTES = 16 << 20
MAX_CHUNK_BYTES = 1 << 30          # MPI counts are ints; stay well clear of 2 GiB
DEFAULT_LOCK_WAIT_S = 1800.0       # as long as torch's default collective timeout
_POLL_S = 0.002


def stage(src: str, dest: str, *, mode: str = "replicate", group_nodes: int | None = None,
          strategy: str = "auto", chunk_bytes: int = DEFAULT_CHUNK_BYTES, verify: str = "auto",
          fsync: bool = False, progress: bool = True,
          lock_wait: float = DEFAULT_LOCK_WAIT_S, files: bool = False) -> StageResult:
    """Copy the packed data set ``src`` (``files=True``: any directory tree) to node-local
    ``dest`` on every node (collective).

    Every rank of the job calls it with the same arguments; it returns the same
    :class:`StageResult` on every rank, or raises the same :class:`StageError` on every rank.

    Args:
        src: the packed data set directory (on the shared file system).
        dest: node-local directory; may use ``$VARS`` (``$SLURM_TMPDIR``), ``{node}`` (node
            index: needed when emulated nodes share one disk) and ``{host}``.
        mode: ``"replicate"`` (every node gets everything) or ``"partition"`` (node j of a
            group of k gets the j-th of k byte-balanced shard ranges).
        group_nodes: nodes per group (the source is read once per group); default all nodes.
        strategy: ``"bcast"``, ``"allgather"``, ``"ring"``, ``"every-rank"`` (baseline:
            every rank copies from the source itself) or ``"auto"`` (:func:`auto_strategy`:
            the ring for groups of up to 9 nodes, bcast beyond; docs/data.md has the numbers).
        chunk_bytes: bytes per read and per message (memory per leader: bcast 4 chunks;
            allgather 4 x group_nodes chunks; ring 21 chunks at 2 nodes, 18 to 30 up to 9:
            :func:`~hpcddp.data._staging_plan.ring_buffers`).
        verify: shards already in ``dest``: ``"auto"`` (hash them unless a READY marker for
            this very manifest vouches for them: it does for a shard whose size, mtime, ctime
            and inode are the ones it recorded), ``"full"`` (always hash), ``"size"``.
        fsync: fsync each shard before renaming it (node-local scratch rarely needs it: a
            crash that loses page-cache data usually loses the node's scratch too).
        progress: a tqdm bar of bytes written, on each node leader.
        lock_wait: seconds a node leader waits for another stager holding its destination's
            lock (:mod:`hpcddp.data.destlock`) before every rank raises StageError; 0 refuses
            at once. Rank 0 says once whom it waits for (host, pid, job).
        files: stage ``src`` as a plain directory tree, file for file (docs/data.md, "Staging
            a plain directory"): every regular file and directory, with its permission bits
            and mtime; a symbolic link or a special file anywhere in it is refused, named.
            Each file is checked against the CRC-32C computed where it was read; ``verify``:
            ``"auto"`` keeps a present file whose size and mtime are the source's (and, under
            a READY for the same listing, whose stat READY recorded), ``"size"`` one of the
            source's size, ``"full"`` none (there is no checksum in advance to compare with).
    """
    held: list = []   # the destination lock this process took, released however we leave
    try:
        return _stage(src, dest, held, mode=mode, group_nodes=group_nodes, strategy=strategy,
                      chunk_bytes=chunk_bytes, verify=verify, fsync=fsync, progress=progress,
                      lock_wait=lock_wait, files=files)
    finally:
        for lock in held:
            lock.release()


def _stage(src, dest, held, *, mode, group_nodes, strategy, chunk_bytes, verify, fsync, progress,
           lock_wait, files) -> StageResult:
    """:func:`stage`'s body, phase by phase; takes the destination lock into ``held``."""
    t_start = time.perf_counter()
    _check_args(mode, strategy, verify, chunk_bytes, group_nodes, lock_wait, files)
    src = os.path.abspath(os.fspath(src))
    job = job_layout(group_nodes, strategy, chunk_bytes)
    plan = make_plan(job, src, dest, mode, verify, lock_wait, held, files)
    t_plan = time.perf_counter()
    stats = _copy(job, plan, chunk_bytes, fsync, progress) if job.writer else CopyStats()
    t_copy_local = time.perf_counter()
    _quiet_barrier(job.world)
    t_copy = time.perf_counter()
    return finalize(job, plan, stats, dest, chunk_bytes, fsync,
                    (t_start, t_plan, t_copy_local, t_copy))


def _check_args(mode, strategy, verify, chunk_bytes, group_nodes, lock_wait, files) -> None:
    """Refuse bad arguments on the calling rank, before any message."""
    if mode not in MODES:
        raise ValueError(f"stage: mode={mode!r}, expected one of {list(MODES)}")
    if strategy not in STRATEGIES:
        raise ValueError(f"stage: strategy={strategy!r}, expected one of {list(STRATEGIES)}")
    if verify not in VERIFY:
        raise ValueError(f"stage: verify={verify!r}, expected 'auto', 'full' or 'size'")
    if not isinstance(chunk_bytes, int) or not 1 <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"stage: chunk_bytes={chunk_bytes!r}, expected an int in 1..{MAX_CHUNK_BYTES}")
    if group_nodes is not None and (not isinstance(group_nodes, int) or group_nodes < 1):
        raise ValueError(f"stage: group_nodes={group_nodes!r}, expected a positive int or None")
    if not isinstance(lock_wait, (int, float)) or not 0 <= lock_wait < float("inf"):
        raise ValueError(f"stage: lock_wait={lock_wait!r}, expected seconds >= 0 (0: refuse at once)")
    if not isinstance(files, bool):
        raise ValueError(f"stage: files={files!r}, expected True (a plain directory tree) or "
                         f"False (a packed data set)")


def _copy(job: Job, plan: Plan, chunk: int, fsync: bool, progress: bool) -> CopyStats:
    """Phase 2 on a rank that writes: over MPI between the group's leaders when shards must
    travel (replicate, groups of several nodes), else straight from the source."""
    topo, m = job.topo, plan.manifest
    bar = None
    # a bar only on a terminal: in a batch log each \r update would be one more line
    if progress and sys.stderr.isatty() and (topo.is_leader or job.every and topo.local_rank == 0):
        from tqdm import tqdm
        bar = tqdm(total=sum(m.shards[s].bytes for s in plan.todo), unit="B", unit_scale=True,
                   mininterval=1.0, desc=f"[rank{job.rank}] stage node{topo.node}", leave=False)
    gl = job.groups.group_leader_comm             # None off-leader
    suffix = f".r{job.rank}" if job.every else ""
    try:
        if not job.every and plan.mode == "replicate" and gl is not None and gl.Get_size() > 1:
            return copy_exchange(gl, job.strategy, plan.src, plan.node_dest, m, plan.todo,
                                 chunk, fsync, bar, plan.files)
        if plan.files:
            # nothing travels, but a tree still wants its small files batched and each file's
            # CRC-32C taken where it was read: the same pipeline, over this rank alone
            from hpcddp.comm import MPI
            return copy_exchange(MPI.COMM_SELF, "bcast", plan.src, plan.node_dest, m, plan.todo,
                                 chunk, fsync, bar, True, suffix)
        return copy_local(plan.src, plan.node_dest, m, plan.todo, chunk, suffix, fsync, bar)
    finally:
        if bar is not None:
            bar.close()


def _quiet_barrier(comm) -> None:
    """A barrier that sleeps instead of spinning, leaving the cores to ranks still copying."""
    with watched(comm, "stage:barrier"):
        req = comm.Ibarrier()
        while not req.Test():
            time.sleep(_POLL_S)


def write_json(result: StageResult, path: str) -> None:
    """Write the summary for machines (``--json``): ``-`` is stdout."""
    text = json.dumps(result.as_dict(), indent=2, sort_keys=True)
    if path == "-":
        print(text, flush=True)
    else:
        mf.write_atomic(path, (text + "\n").encode())
