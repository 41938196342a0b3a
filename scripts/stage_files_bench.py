"""`hpcddp stage --files` beside packed staging and `cp -r`, on the same data (not run in CI).

    python scripts/stage_files_bench.py --files 100000 --size 1K --rounds 5 --dest /dev/shm/sfb
    python scripts/stage_files_bench.py --files 64 --size 4M --rounds 5 --dest /dev/shm/sfb

The source lives in the work directory (--dir; a disk), the copies under --dest (default: the
work directory too; node-local storage is often a tmpfs such as /dev/shm, and creating a
file costs far more on some disks than on tmpfs, for cp as for the stager).

Builds a tree of FILES random files of SIZE bytes (100 files per directory), packs it once
(`hpcddp pack`, timed apart: a one-time cost), then in interleaved rounds whose order rotates,
each after evicting the source from the page cache (posix_fadvise DONTNEED, as `hpcddp bench
stage` does) and removing the previous copies:

  files   HPCDDP_RANKS_PER_NODE=1 mpirun -n NP hpcddp stage --files SRC 'DEST/files-{node}'
  packed  the same without --files, from the packed copy
  cp      NP `cp -r SRC DEST/cp-N` at once (each emulated node copying for itself)

Reports the median over rounds (the first discarded) with quartiles: the stage call's own
seconds (`seconds` of --json: what a job waits for once MPI runs), the command's wall time
(with mpirun's and Python's start-up, which `cp` does not pay), files per second per node,
and the bytes read from the source. Emulated nodes share one disk and one page cache: the
times show overheads on this machine, not a parallel file system's bandwidth.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from hpcddp.launch.mpirun import run_mpi

HPCDDP = [sys.executable, "-m", "hpcddp"]


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)


def make_tree(root: str, files: int, size: int, per_dir: int = 100) -> None:
    rng = random.Random(0)
    for i in range(files):
        d = os.path.join(root, f"d{i // per_dir:04d}")
        if i % per_dir == 0:
            os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"f{i:06d}.bin"), "wb") as f:
            f.write(rng.randbytes(size))


def evict(root: str) -> None:
    """Drop ROOT's files from the page cache (clean pages only; other files untouched)."""
    for d, _, names in os.walk(root):
        for n in names:
            fd = os.open(os.path.join(d, n), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def tree_stats(root: str) -> tuple[int, int]:
    n = b = 0
    for d, _, names in os.walk(root):
        for name in names:
            if name in ("READY", "STAGING", ".hpcddp-stage.lock"):
                continue
            n += 1
            b += os.path.getsize(os.path.join(d, name))
    return n, b


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", HPCDDP_RANKS_PER_NODE="1")


def run_stage(np_: int, argv: list, out: str) -> tuple[float, float, dict]:
    t = time.perf_counter()
    res = run_mpi(np_, HPCDDP + ["stage"] + argv + ["--no-progress", "--quiet", "--json", out],
                  timeout=1800, env=_env())
    wall = time.perf_counter() - t
    if res.returncode != 0:
        raise SystemExit(f"stage failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
    with open(out) as f:
        summary = json.load(f)
    return summary["seconds"], wall, summary


def run_cp(np_: int, src: str, dest: str) -> float:
    t = time.perf_counter()
    procs = [subprocess.Popen(["cp", "-r", src, f"{dest}/cp-{n}"]) for n in range(np_)]
    if any(p.wait(timeout=1800) for p in procs):
        raise SystemExit("cp -r failed")
    return time.perf_counter() - t


def quart(xs: list) -> str:
    if len(xs) < 2:
        return f"{xs[0]:.2f}"
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return f"{statistics.median(xs):.2f} ({q[0]:.2f}–{q[2]:.2f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, default=100_000)
    ap.add_argument("--size", type=_size, default="1K", help="bytes per file (1K, 4M, ...)")
    ap.add_argument("--np", type=int, default=2, help="ranks = emulated nodes (default 2)")
    ap.add_argument("--rounds", type=int, default=5, help="the first is discarded")
    ap.add_argument("--dir", help="work directory (default: a new one under /tmp, removed)")
    ap.add_argument("--dest", help="where the copies go (default: DIR/dest), removed after")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    work = args.dir or tempfile.mkdtemp(prefix="stage-files-bench-")
    src, packed = os.path.join(work, "src"), os.path.join(work, "packed")
    dest = args.dest or os.path.join(work, "dest")
    try:
        t = time.perf_counter()
        make_tree(src, args.files, args.size)
        print(f"made {args.files} files of {args.size} B in {time.perf_counter() - t:.1f} s",
              flush=True)
        t = time.perf_counter()
        subprocess.run(HPCDDP + ["pack", src, packed, "--format", "lmdb", "--no-progress"],
                       check=True, timeout=3600, env=_env(), stdout=subprocess.DEVNULL)
        pack_s = time.perf_counter() - t
        nfiles, nbytes = tree_stats(src)
        methods = ("files", "packed", "cp")
        secs = {m: [] for m in methods}
        walls = {m: [] for m in methods}
        read = {}
        for r in range(args.rounds):
            for m in methods[r % 3:] + methods[:r % 3]:
                shutil.rmtree(dest, ignore_errors=True)
                os.makedirs(dest)
                evict(src if m != "packed" else packed)
                if m == "cp":
                    s = w = run_cp(args.np, src, dest)
                    read[m] = nbytes * args.np
                else:
                    argv = (["--files", src] if m == "files" else [packed]) + [f"{dest}/{m}-{{node}}"]
                    s, w, summary = run_stage(args.np, argv, os.path.join(work, "s.json"))
                    read[m] = summary["bytes_read_from_source"]
                secs[m].append(s)
                walls[m].append(w)
                print(f"round {r + 1}/{args.rounds} {m}: {s:.2f} s (command {w:.2f} s)", flush=True)
                if r == args.rounds - 1 and m != "packed":      # the copy is whole
                    for n in range(args.np):
                        got = tree_stats(f"{dest}/{m}-{n}")
                        assert got == (nfiles, nbytes), (m, n, got, nfiles, nbytes)
        rows = []
        print(f"\n{nfiles} files of {args.size} B ({nbytes / 1e6:.1f} MB) from {work} to "
              f"{args.np} emulated nodes in {dest}; load average {os.getloadavg()[0]:.1f}; "
              f"`hpcddp pack` once: {pack_s:.1f} s\n")
        print("| method | seconds (stage call) | seconds (command) | files/s per node | MB/s per node | read from source | x data set |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for m in methods:
            kept = secs[m][1:] or secs[m]
            med = statistics.median(kept)
            row = {"method": m, "seconds": kept, "command_seconds": walls[m][1:] or walls[m],
                   "files_per_s_per_node": nfiles / med, "bytes_read_from_source": read[m]}
            rows.append(row)
            print(f"| {m} | {quart(kept)} | {quart(row['command_seconds'])} | "
                  f"{nfiles / med:,.0f} | {nbytes / med / 1e6:.0f} | {read[m] / 1e6:.1f} MB | "
                  f"{read[m] / nbytes:.2f} |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"files": nfiles, "bytes": nbytes, "np": args.np, "pack_s": pack_s,
                           "rows": rows}, f, indent=2)
    finally:
        shutil.rmtree(dest, ignore_errors=True)
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
