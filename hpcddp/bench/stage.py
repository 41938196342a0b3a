"""``hpcddp bench stage``: staging throughput and bytes read from the source.

One job, one synthetic packed data set (LMDB, random bytes), the same destinations, and the
strategies a user could pick, in interleaved rounds whose order rotates:

``bcast``       hpcddp.data.stage: node leaders each read a disjoint range of shards once
                (scatter), then broadcast it to the other leaders
``allgather``   the same read split, exchanged with one MPI_Allgatherv per round
``ring``        the same read split, passed around a ring of leaders, several chunks in
                flight (the default for groups of up to 9 nodes)
``mpi``         not a stager: one raw MPI_Allgather of the same bytes among the node leaders
                (1/N of the data set from each), no file touched: what MPI alone does
``every-rank``  hpcddp.data.stage(strategy="every-rank"): every rank copies what its node
                needs straight from the source, no MPI traffic (the usual job-script habit)
``cp``          ``cp -r SRC DEST`` once per node (on the node leader): the shell baseline

Figures: wall time (MAX over ranks, barrier to barrier), per-node throughput (data set bytes
/ time: how soon every node holds the data), aggregate bytes written per second, and bytes
read from the source (what the shared file system pays; hpcddp counts its reads, ``cp`` reads
the whole data set once per node). Before every run the source is evicted from the page cache
(``posix_fadvise(DONTNEED)``, these files only) so reads come from the disk, and the
destination of the previous run is removed. Emulated nodes (HPCDDP_RANKS_PER_NODE) share one
disk and one page cache: the bytes-read column is exact, the times show the algorithms'
overheads on this machine, not a parallel file system's bandwidth. Across virtual nodes
(``--vcluster N --rate R``) the link's bound, (N-1)/N of the data set over R, comes with the
table and each row's fraction of it; the source sits in the shared /tmp, read beside the link
as from a parallel file system, so ``every-rank`` and ``cp`` cross no link there.

Then what the integrity checks cost on the same data set (``integrity`` in the JSON): the
destination lock's share of each stage (``phases["lock"]``); a re-stage onto a READY copy
with ``--verify auto`` (a stat per shard) against ``--verify full`` (CRC-32C of every shard);
and a dataset's first open of every shard with its CRC-32C check against ``check=False``, with
the copy in the page cache (just staged) and evicted from it (``cold``; a no-op on tmpfs).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time

STRATEGIES = ("bcast", "allgather", "ring", "every-rank", "cp", "mpi")


def _sleepy_barrier(comm) -> None:
    # a barrier that sleeps: spinning ranks would take the cores from the ranks copying
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.0005)


def _files(root: str) -> list[str]:
    out = []
    for d, _, names in os.walk(root):
        out += [os.path.join(d, n) for n in names]
    return sorted(out)


def _evict(root: str) -> int:
    """Drop ROOT's files from the page cache (clean pages only; no effect on other files)."""
    n = 0
    for path in _files(root):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += 1
        finally:
            os.close(fd)
    return n


def _tree_bytes(root: str) -> int:
    return sum(os.path.getsize(p) for p in _files(root))


def make_source(path: str, size_mb: float, files: int, seed: int = 0) -> int:
    """Pack SIZE_MB MiB of random bytes into about FILES LMDB shards at PATH (one process).
    Returns the data set's bytes on disk."""
    import numpy as np

    from hpcddp.data import pack
    sample = 1 << 20
    n = max(files, int(size_mb * (1 << 20)) // sample)
    data = np.random.default_rng(seed).integers(0, 256, size=(n, sample), dtype=np.uint8)
    pack(data, path, format="lmdb", shard_bytes=max(1, n // files) * sample, progress=False)
    return _tree_bytes(path)


def run(dir=None, size_mb: float = 256.0, files: int = 16, rounds: int = 3,
        strategies=STRATEGIES, cold: bool = True, progress=None,
        link_bytes_per_s: float | None = None, group_nodes: int | None = None) -> dict | None:
    """Run the staging benchmark; collective over the world. The result on rank 0."""
    import hpcddp
    from hpcddp.bench import machine, protocol
    from hpcddp.comm import MPI
    bad = [s for s in strategies if s not in STRATEGIES]
    if bad:
        raise ValueError(f"bench stage: unknown strategy {bad}; valid: {', '.join(STRATEGIES)}")
    if rounds < 2:
        raise ValueError(f"bench stage: rounds must be >= 2 (round 1 is discarded), got {rounds}")
    rt = hpcddp.init(abort_on_exception=True)
    ctl = MPI.COMM_WORLD.Dup()
    rank, topo = ctl.Get_rank(), rt.topology
    own = dir is None
    work = ctl.bcast(tempfile.mkdtemp(prefix="hpcddp-bench-stage-") if own and rank == 0
                     else dir, root=0)
    src = os.path.join(work, "source")
    err = None
    if rank == 0:
        try:
            if os.path.isdir(src):
                shutil.rmtree(src)
            os.makedirs(work, exist_ok=True)
            make_source(src, size_mb, files)
        except Exception as exc:  # every rank raises, not only this one
            err = f"{type(exc).__name__}: {exc}"
    err = ctl.bcast(err, root=0)
    if err:
        raise RuntimeError(f"bench stage: making the source data set in {work} failed: {err}")
    dataset = _tree_bytes(src)
    setup = machine.describe(ctl, ctl.Get_size(), extra={
        "nodes_emulated": topo.emulated, "ranks_per_node": topo.local_size,
        "workdir": work, "filesystem": _fs_type(work), "cache": "cold" if cold else "warm"})
    # the mpi row's communicator: the leaders of this node's staging group
    groups_of = min(group_nodes or topo.num_nodes, topo.num_nodes)
    peers = topo.leader_comm.Split(topo.node // groups_of, topo.node) if topo.is_leader else None
    meter = machine.LoadMeter(ctl)
    meter.start()
    times = {s: [] for s in strategies}
    read = {s: [] for s in strategies}
    written = {s: [] for s in strategies}
    ok = {s: True for s in strategies}
    lock_s: list = []
    for r in range(rounds):
        shift = r % len(strategies)
        for s in list(strategies[shift:]) + list(strategies[:shift]):
            dt, n_read, n_written, good, lock = _time_strategy(
                s, ctl, topo, work, src, dataset, peers, cold, group_nodes)
            if lock is not None:
                lock_s.append(lock)
            times[s].append(dt)
            read[s].append(n_read)
            written[s].append(n_written)
            ok[s] &= good
            if progress and rank == 0:
                progress(f"round {r + 1}/{rounds} {s}: {dt:.2f} s")
    integrity = _integrity_costs(ctl, topo, src, work, max(3, rounds - 1), progress)
    integrity["lock_s_median"] = protocol.median(lock_s) if lock_s else None
    integrity["lock_s_max"] = max(lock_s, default=None)
    _sleepy_barrier(ctl)
    if rank == 0:
        shutil.rmtree(os.path.join(work, "dest"), ignore_errors=True)
        if own:
            shutil.rmtree(work, ignore_errors=True)
    load = meter.stop()
    if rank != 0:
        return None
    config = {"size_mb": size_mb, "files": files, "rounds": rounds, "discarded_rounds": 1,
              "strategies": list(strategies), "ranks": ctl.Get_size(), "nodes": topo.num_nodes,
              "cache": "cold" if cold else "warm", "link_bytes_per_s": link_bytes_per_s,
              "group_nodes": groups_of}
    return _summary(setup, load, config, dataset, times, read, written, ok, integrity)


def _summary(setup, load, config, dataset, times, read, written, ok, integrity) -> dict:
    """The benchmark's result: one row per strategy (round 1 discarded), paired ratios."""
    from hpcddp.bench import protocol
    strategies, k, link = config["strategies"], config["group_nodes"], config["link_bytes_per_s"]
    rows = []
    for s in strategies:
        kept = times[s][1:]
        t = protocol.median(kept)
        rows.append({"strategy": s, "times_s": times[s], "seconds": t,
                     "q1_s": protocol.quantile(kept, 0.25), "q3_s": protocol.quantile(kept, 0.75),
                     "node_gbps": dataset / t / 1e9, "written_gbps": written[s][-1] / t / 1e9,
                     "bytes_read_from_source": read[s][-1], "bytes_written": written[s][-1],
                     "read_amplification": read[s][-1] / dataset, "correct": ok[s]})
    ratios = {}
    if "bcast" in times:
        for s in strategies:
            if s != "bcast":
                ratios[f"{s}/bcast"] = protocol.spread(protocol.paired(times[s][1:],
                                                                       times["bcast"][1:]))
    if "cp" in times:  # each strategy's write throughput as a fraction of cp -r's
        for s in strategies:
            if s != "cp":
                ratios[f"cp/{s}"] = protocol.spread(protocol.paired(times["cp"][1:],
                                                                    times[s][1:]))
    return {"kind": "hpcddp-bench-stage", "version": 1, "setup": setup, "load": load,
            "config": config,
            "bound_s": (k - 1) / k * dataset / link if link and k > 1 else None,
            "dataset_bytes": dataset, "strategies": rows, "ratios": ratios,
            "integrity": integrity, "correct": all(ok.values())}


def _time_strategy(s: str, ctl, topo, work: str, src: str, dataset: int, peers, cold: bool,
                   group_nodes) -> tuple:
    """One timed run of strategy S (the source evicted first where COLD) -> (seconds, bytes
    read from the source, bytes written, whether the copy is right, the lock's seconds)."""
    from hpcddp.bench import protocol
    from hpcddp.comm import MPI
    from hpcddp.data.staging import stage
    dest = os.path.join(work, "dest", s, "node{node}")
    rank = ctl.Get_rank()
    if rank == 0:
        shutil.rmtree(os.path.join(work, "dest"), ignore_errors=True)
        if cold:
            _evict(src)
    _sleepy_barrier(ctl)
    t0 = time.perf_counter()
    good, lock = True, None
    if s == "mpi":
        n_read = n_written = 0
        good = _raw_allgather(peers, dataset)
    elif s == "cp":
        n_read = n_written = 0
        if topo.is_leader:
            node_dest = dest.replace("{node}", str(topo.node))
            os.makedirs(os.path.dirname(node_dest), exist_ok=True)
            proc = subprocess.run(["cp", "-r", src, node_dest], capture_output=True,
                                  text=True, timeout=3600)
            good = proc.returncode == 0
            n_read = n_written = dataset
    else:
        res = stage(src, dest, strategy=s, group_nodes=group_nodes, progress=False)
        n_read, n_written = res.bytes_read_from_source, res.bytes_written
        lock = res.phases["lock"]
    _sleepy_barrier(ctl)
    dt = protocol.allmax(ctl, time.perf_counter() - t0)
    if s == "cp":
        if topo.is_leader:   # outside timing: the copy is complete and the right size
            good = good and _tree_bytes(dest.replace("{node}", str(topo.node))) == dataset
        n_read = ctl.allreduce(n_read, op=MPI.SUM)
        n_written = ctl.allreduce(n_written, op=MPI.SUM)
    good = bool(ctl.allreduce(1 if good else 0, op=MPI.MIN))
    return dt, n_read, n_written, good, lock


def _raw_allgather(lc, dataset: int) -> bool:
    """One MPI_Allgather among the node leaders of a staging group (LC; None off the leaders),
    1/N of DATASET bytes from each; whether every leader got every other's bytes (a byte at
    each end of each block: enough to catch a wrong displacement)."""
    import numpy as np
    if lc is None:
        return True
    n, me = lc.Get_size(), lc.Get_rank()
    per = -(-dataset // n)
    mine = np.full(per, me % 251, dtype=np.uint8)
    got = np.empty(per * n, dtype=np.uint8)
    lc.Allgather(mine, got)
    return all(got[j * per] == j % 251 and got[(j + 1) * per - 1] == j % 251 for j in range(n))


def _read_all(root: str) -> None:
    """Bring ROOT's files into the page cache."""
    for path in _files(root):
        with open(path, "rb", buffering=0) as f:
            while f.read(1 << 22):
                pass


def _open_every_shard(node_dest: str, check: bool) -> float:
    """Seconds for a new dataset object to return the first sample of every shard: each
    shard's first open in this process (with its CRC-32C check when ``check``)."""
    from hpcddp.data import open_dataset
    t0 = time.perf_counter()
    ds = open_dataset(node_dest, check=check)
    for sh in ds.manifest.shards:
        ds[sh.first]
    dt = time.perf_counter() - t0
    ds.close()
    return dt


def _integrity_costs(ctl, topo, src: str, work: str, repeats: int, progress=None) -> dict:
    """What the checks after READY cost here (collective; figures are MAX over ranks).

    Re-stage onto a READY copy: ``verify="auto"`` stats each shard against READY's record,
    ``"full"`` computes every shard's CRC-32C. First open: on each node leader, a new dataset
    object reads one sample of every shard, with and without the CRC-32C check on first open,
    the copy in the page cache (``warm``: just staged) or evicted (``cold``).
    """
    from hpcddp.bench import protocol
    from hpcddp.data.staging import stage
    dest = os.path.join(work, "dest", "integrity", "node{node}")
    node_dest = dest.replace("{node}", str(topo.node))
    stage(src, dest, progress=False)
    restage = {"auto": [], "full": []}
    for _ in range(repeats):
        for verify in ("auto", "full"):
            _sleepy_barrier(ctl)
            t0 = time.perf_counter()
            res = stage(src, dest, verify=verify, progress=False)
            _sleepy_barrier(ctl)
            restage[verify].append(protocol.allmax(ctl, time.perf_counter() - t0))
            if res.shards_copied:
                raise RuntimeError(f"bench stage: a re-stage with verify={verify!r} onto a READY "
                                   f"copy copied {res.shards_copied} shards, expected 0")
    opened = {k: [] for k in ("warm_check", "warm_nocheck", "cold_check", "cold_nocheck")}
    for _ in range(repeats):
        for key in opened:
            if topo.is_leader:
                if key.startswith("cold"):
                    _evict(node_dest)
                else:   # a cold run before left the shards out of the page cache
                    _read_all(node_dest)
            _sleepy_barrier(ctl)
            dt = _open_every_shard(node_dest, key.endswith("_check")) if topo.is_leader else 0.0
            opened[key].append(protocol.allmax(ctl, dt))
    if progress and ctl.Get_rank() == 0:
        progress("integrity: re-stage auto/full, first open with/without the check")
    from hpcddp.data import manifest as mf
    shard_bytes = mf.load(src).total_bytes
    out = {"repeats": repeats, "shard_bytes": shard_bytes,
           "fs": _fs_type(node_dest)}
    for k, xs in list(restage.items()):
        out[f"restage_{k}_s"] = protocol.median(xs)
    for k, xs in opened.items():
        out[f"open_{k}_s"] = protocol.median(xs)
    for c in ("warm", "cold"):
        extra = out[f"open_{c}_check_s"] - out[f"open_{c}_nocheck_s"]
        out[f"check_{c}_s"] = extra
        out[f"check_{c}_gbps"] = shard_bytes / extra / 1e9 if extra > 0 else None
    return out


def _fs_type(path: str) -> str:
    try:
        out = subprocess.run(["df", "-T", path], capture_output=True, text=True, timeout=20)
        return out.stdout.splitlines()[-1].split()[1]
    except (OSError, IndexError, subprocess.TimeoutExpired):
        return ""


def text(result: dict, markdown: bool = False) -> str:
    from hpcddp.bench.report import _num, _render, setup_lines
    cfg = result["config"]
    header = ["strategy", "seconds", "GB/s per node", "GB/s written (all nodes)",
              "read from source", "x data set", "time vs bcast", "throughput vs cp", "check"]
    bound = result.get("bound_s")
    if bound:
        header.insert(2, "of the link's bound")

    def cell(ratio, same):
        if ratio:
            return f"{_num(ratio['median'])} ({_num(ratio['q1'])}–{_num(ratio['q3'])})"
        return "1" if same else "-"

    rows = []
    for row in result["strategies"]:
        s = row["strategy"]
        rows.append([s, f"{_num(row['seconds'])} ({_num(row['q1_s'])}–"
                     f"{_num(row['q3_s'])})", _num(row["node_gbps"]), _num(row["written_gbps"]),
                     f"{row['bytes_read_from_source'] / 1e6:.0f} MB" if s != "mpi" else "-",
                     f"{row['read_amplification']:.2f}" if s != "mpi" else "-",
                     cell(result["ratios"].get(f"{s}/bcast"), s == "bcast"),
                     cell(result["ratios"].get(f"cp/{s}"), s == "cp"),
                     "ok" if row["correct"] else "FAILED"])
        if bound:
            rows[-1].insert(2, f"{_num(bound / row['seconds'])} ({_num(bound / row['q3_s'])}–"
                               f"{_num(bound / row['q1_s'])})")
    title = (f"staging {result['dataset_bytes'] / 1e6:.0f} MB ({cfg['files']} shards) to "
             f"{cfg['nodes']} node(s), {cfg['ranks']} ranks, {cfg['cache']} source cache: "
             f"median over rounds (quartiles), MAX over ranks; GB = 1e9 B")
    if bound:
        if cfg.get("group_nodes", cfg["nodes"]) < cfg["nodes"]:
            title += f"; groups of {cfg['group_nodes']} nodes"
        title += (f"; the link's bound: (K-1)/K of the data set (K nodes per group) at "
                  f"{cfg['link_bytes_per_s'] / 1e6:.0f} MB/s = {_num(bound)} s")
    parts = [_render(title, header, rows, markdown)]
    if result.get("integrity"):
        parts.append(integrity_text(result))
    return "\n\n".join(parts + ["\n".join(setup_lines(result))])


def integrity_text(result: dict) -> str:
    """The integrity checks' costs, in words (medians; seconds are MAX over ranks)."""
    g = result["integrity"]

    def ms(x):
        return f"{x * 1e3:.1f} ms"

    def rate(x):
        return f"{x:.1f} GB/s" if x else "within noise"
    lock = ("" if g.get("lock_s_median") is None else
            f"destination lock: {ms(g['lock_s_median'])} per stage (median; max "
            f"{ms(g['lock_s_max'])})\n")
    return (f"{lock}re-stage onto a READY copy ({g['shard_bytes'] / 1e6:.0f} MB of shards): "
            f"--verify auto {ms(g['restage_auto_s'])} (a stat per shard), --verify full "
            f"{ms(g['restage_full_s'])} (CRC-32C of every shard)\n"
            f"first open of every shard by one process, {g.get('fs') or '?'}: page cache warm "
            f"{ms(g['open_warm_check_s'])} with the CRC-32C check, "
            f"{ms(g['open_warm_nocheck_s'])} without ({rate(g['check_warm_gbps'])}); cold "
            f"{ms(g['open_cold_check_s'])} with, {ms(g['open_cold_nocheck_s'])} without "
            f"({rate(g['check_cold_gbps'])}); medians of {g['repeats']}")


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["strategies"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.2))
    names = [r["strategy"] for r in rows]
    a.bar(names, [r["node_gbps"] for r in rows], color="tab:blue")
    if result.get("bound_s"):      # the link's bound as a rate per node
        a.axhline(result["dataset_bytes"] / result["bound_s"] / 1e9, color="k", ls="--", lw=1,
                  label="link's bound")
        a.legend(fontsize=8)
    a.set_ylabel("GB/s per node")
    a.set_title("staging throughput", fontsize=10)
    b.bar(names, [r["read_amplification"] for r in rows], color="tab:red")
    b.set_ylabel("bytes read / data set")
    b.set_title("reads of the source", fontsize=10)
    fig.suptitle(f"hpcddp bench stage: {result['dataset_bytes'] / 1e6:.0f} MB, "
                 f"{result['config']['nodes']} nodes", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
