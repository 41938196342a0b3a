"""Staging, phase 3: finalize. Every rank reports; any failed shard copy anywhere fails the
stage on every rank with nothing marked READY; otherwise each node gets the manifest and, last
of all, READY (with the stat of every local shard, so a re-run can trust them without
hashing). The :class:`StageResult` is built from all ranks' reports, the same on every rank.
"""
from __future__ import annotations

import datetime as _dt
import os
import time
from dataclasses import asdict, dataclass, field

from hpcddp.data import manifest as mf
from hpcddp.data._comm import watched
from hpcddp.data._staging_io import CopyStats
from hpcddp.data._staging_plan import Job, Plan, StageError, agree


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
    # a plain tree (files=True): num_samples and num_shards count its files, shards_copied
    # and shards_skipped its file copies; dataset_bytes is the files' bytes
    files: bool = False

    def as_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        gb = 1e9
        what = (f"{self.num_shards} files" if self.files else
                f"{self.num_samples} samples, {self.num_shards} shards")
        unit = "file" if self.files else "shard"
        lines = [
            f"staged {what} "
            f"({self.dataset_bytes / gb:.3f} GB) to {self.nodes} node(s) in {self.groups} "
            f"group(s) of <= {self.group_nodes}: mode={self.mode} strategy={self.strategy}",
            f"  read from source: {self.bytes_read_from_source / gb:.3f} GB "
            f"({self.read_amplification:.2f}x the data set per group)",
            f"  written: {self.bytes_written / gb:.3f} GB ({self.shards_copied} {unit} copies, "
            f"{self.shards_skipped} already in place)",
            f"  time: {self.seconds:.2f} s = plan {self.phases.get('plan', 0):.2f} + copy "
            f"{self.phases.get('copy', 0):.2f} + finalize {self.phases.get('finalize', 0):.2f}"
            f"; write {self.write_gbps:.2f} GB/s aggregate, {self.write_gbps_per_node:.2f} GB/s "
            f"per node; source read {self.read_gbps:.2f} GB/s",
        ]
        return "\n".join(lines)


def finalize(job: Job, plan: Plan, st: CopyStats, dest: str, chunk: int, fsync: bool,
             times: tuple) -> StageResult:
    """Phase 3, on all ranks. TIMES: perf_counter at start, end of plan, end of this rank's
    copy, end of the copy on every rank."""
    t_start, t_plan, t_copy_local, t_copy = times
    report = {"rank": job.rank, "node": job.topo.node, "group": job.groups.group_rank,
              "leader": job.topo.is_leader, "writer": job.writer,
              "bytes_read": plan.manifest_bytes_read + st.bytes_read,
              "bytes_written": st.bytes_written,
              "copied": len(st.copied), "skipped": len(plan.have), "errors": st.errors,
              "read_s": st.read_s, "write_s": st.write_s, "hash_s": st.hash_s,
              "dest": plan.node_dest, "plan_s": t_plan - t_start,
              "copy_s": t_copy_local - t_plan, "lock_s": plan.lock_s}
    with watched(job.world, "stage:allgather:reports"):
        reports = job.world.allgather(report)
    _fail_on_copy_errors(reports)
    err = _write_markers(job, plan, fsync) if job.marks and not plan.keep else None
    agree(job.world, err, "finalize")
    t_end = time.perf_counter()
    with watched(job.world, "stage:allgather:times"):
        spans = job.world.allgather((t_plan - t_start, t_copy - t_plan, t_end - t_copy,
                                     t_end - t_start))
    return _result(job, plan, os.fspath(dest), chunk, reports, spans)


def _fail_on_copy_errors(reports: list) -> None:
    errors = [f"node {r['node']} (rank {r['rank']}): {e}" for r in reports for e in r["errors"]]
    if errors:
        more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
        raise StageError(f"stage: {len(errors)} copies failed, nothing marked {mf.READY}: "
                         + "; ".join(errors[:5]) + more)


def _write_markers(job: Job, plan: Plan, fsync: bool) -> str | None:
    """The manifest, then READY replacing STAGING; None, or what went wrong."""
    node_dest = plan.node_dest
    try:
        mpath = os.path.join(node_dest, mf.MANIFEST)
        # a tree keeps no listing file: READY's manifest_sha256 identifies the listing
        if not plan.files and not _holds(mpath, plan.raw):
            mf.write_atomic(mpath, plan.raw, fsync)
        ready = dict(plan.layout, staged=_now(), source=plan.src, strategy=job.strategy,
                     host=job.topo.hostname,
                     shard_stats=mf.shard_stats(node_dest, plan.manifest, plan.mine))
        mf.write_atomic(os.path.join(node_dest, mf.READY), mf.dumps(ready), fsync)
        os.remove(os.path.join(node_dest, mf.STAGING))
    except OSError as exc:
        return f"node {job.topo.node}: writing markers in {node_dest}: {exc}"
    return None


def _holds(path: str, data: bytes) -> bool:
    """Does PATH exist with exactly DATA? (A re-run leaves an identical manifest alone.)"""
    if not os.path.exists(path):
        return False
    with open(path, "rb") as f:
        return f.read() == data


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _result(job: Job, plan: Plan, dest: str, chunk: int, reports: list, spans: list
            ) -> StageResult:
    m, topo, ngroups = plan.manifest, job.topo, job.groups.group_ws
    dataset_bytes = m.total_bytes + (0 if plan.files else len(plan.raw))
    per_group = [0] * ngroups
    per_node = [0] * topo.num_nodes
    dests = [""] * topo.num_nodes
    for r in reports:
        per_group[r["group"]] += r["bytes_read"]
        per_node[r["node"]] += r["bytes_written"]
        if r["writer"]:
            dests[r["node"]] = r["dest"]
    seconds = max(t[3] for t in spans)
    phases = {"plan": max(t[0] for t in spans), "copy": max(t[1] for t in spans),
              "finalize": max(t[2] for t in spans),
              "lock": max(r["lock_s"] for r in reports)}  # inside plan: waiting included
    total_read = sum(per_group)
    written = sum(per_node)
    lead = [r for r in reports if r["writer"]]
    return StageResult(
        source=plan.src, dest=dest, mode=plan.mode, strategy=job.strategy, ranks=len(reports),
        nodes=topo.num_nodes, group_nodes=job.group_nodes, groups=ngroups, chunk_bytes=chunk,
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
        dest_per_node=dests, files=plan.files)
