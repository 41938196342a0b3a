"""Peak memory of `hpcddp pack FILE.h5 OUT` against the size of FILE.h5.

    python scripts/hdf5_pack_peak.py --gib 0.25 1 2 [--format lmdb] [--dir /tmp/h5peak]

For each size, writes DIR/in.h5 (a chunked, gzip-compressed `images` dataset of uint8
(N, 4, 32, 32) samples, 4 KiB each, plus int64 `labels`; written slab by slab, so this process
stays small too), runs `hpcddp pack DIR/in.h5 DIR/out --array images --label-array labels`
as a child process and reports its peak resident set (getrusage RUSAGE_CHILDREN in a parent of
its own: the kernel's VmHWM of the child, in KiB), then removes both. docs/data.md ("Packing
an HDF5 file") quotes the table it prints.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time

import h5py
import numpy as np

SAMPLE = (4, 32, 32)            # 4 KiB of uint8
SLAB = 4096                     # rows per write while making the file (16 MiB)
PEAK = ("import resource, subprocess, sys; "
        "subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")


def make(path: str, n: int) -> None:
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        images = f.create_dataset("images", (n, *SAMPLE), dtype=np.uint8,
                                  chunks=(256, *SAMPLE), compression="gzip", compression_opts=1)
        for start in range(0, n, SLAB):
            stop = min(n, start + SLAB)
            # 4 bits of noise: compressible, so the file is quick to write, not trivially so
            images[start:stop] = rng.integers(0, 16, (stop - start, *SAMPLE), dtype=np.uint8)
        f.create_dataset("labels", data=np.arange(n, dtype=np.int64) % 1000)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, nargs="+", default=[0.25, 1.0],
                    help="payload sizes of the input file, GiB")
    ap.add_argument("--format", choices=("lmdb", "hdf5"), default="lmdb")
    ap.add_argument("--dir", default="/tmp/h5peak")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    src, out = os.path.join(args.dir, "in.h5"), os.path.join(args.dir, "out")
    row = int(np.prod(SAMPLE))
    print(f"{'payload':>9} {'samples':>9} {'file':>9} {'pack s':>7} {'peak RSS':>9}  "
          f"(--format {args.format}, default --shard-size 128M, blocks of 64 MiB)")
    for gib in args.gib:
        n = int(gib * (1 << 30)) // row
        make(src, n)
        shutil.rmtree(out, ignore_errors=True)
        argv = [sys.executable, "-m", "hpcddp", "pack", src, out, "--array", "images",
                "--label-array", "labels", "--format", args.format, "--no-progress"]
        t0 = time.perf_counter()
        # RUSAGE_CHILDREN is the max over every child waited for: a fresh parent per size
        res = subprocess.run([sys.executable, "-c", PEAK, *argv], check=True, timeout=3600,
                             capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        peak_kib = int(res.stdout.split()[-1])
        print(f"{n * row / (1 << 30):7.2f}Gi {n:9d} {os.path.getsize(src) / (1 << 20):7.0f}Mi "
              f"{seconds:7.1f} {peak_kib / 1024:7.0f}Mi", flush=True)
        os.remove(src)
        shutil.rmtree(out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
