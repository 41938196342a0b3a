"""`hpcddp pack`: files or a .npy array -> a sharded LMDB or HDF5 data set."""
import argparse

DESCRIPTION = """\
Pack a folder tree of files (key = relative path; --labels parent for ImageFolder-style class
labels) or a .npy/.npz array (one sample per row) into a data set directory of LMDB or HDF5
shards plus manifest.json (format version, key order, shard sizes and SHA-256 checksums).
The same input always gives the same bytes. Runs in one process; no MPI.

    hpcddp pack ./images /lustre/me/images.lmdb --format lmdb --labels parent
    hpcddp pack features.npy /lustre/me/feats.h5 --format hdf5 --shard-size 256M
    hpcddp pack data.npz /lustre/me/d --array x --label-array y

Then stage it to node-local storage inside your job: `hpcddp stage SRC DEST` (docs/data.md).
"""

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """'128M', '1.5G', '4096' -> bytes (powers of 1024)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1] if t and t[-1] in _UNITS else ""
    num = t[:-1] if unit else t
    try:
        value = float(num)
    except ValueError:
        raise argparse.ArgumentTypeError(f"size {text!r}: expected a number with an optional "
                                         f"K/M/G/T suffix, e.g. 128M") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size {text!r}: must be positive")
    return int(value * _UNITS[unit])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="a folder of files, or a .npy/.npz file")
    parser.add_argument("out", help="the data set directory to create")
    parser.add_argument("--format", choices=("lmdb", "hdf5"), default="lmdb",
                        help="shard storage (default lmdb)")
    parser.add_argument("--shard-size", type=parse_size, default="128M", metavar="SIZE",
                        help="payload bytes per shard, e.g. 64M, 1G (default 128M)")
    parser.add_argument("--labels", choices=("none", "parent"), default="none",
                        help="folder sources: 'parent' labels each file by its parent folder")
    parser.add_argument("--array", metavar="NAME",
                        help=".npz sources: the array holding the samples (default: the first)")
    parser.add_argument("--label-array", metavar="NAME", help=".npz sources: an array of labels")
    parser.add_argument("--encoding", choices=("bytes", "array", "npy"),
                        help="override the value encoding (default: from the source)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing data set in OUT")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--json", metavar="PATH",
                        help="write a summary (samples, shards, bytes, seconds) as JSON; - is stdout")


def run(args) -> int:
    import json
    import os
    import sys

    from hpcddp.data.packing import pack
    source, labels = args.source, None
    if os.path.isfile(source):
        import numpy as np
        if source.endswith(".npz"):
            with np.load(source, allow_pickle=False) as z:
                names = list(z.files)
                name = args.array or names[0]
                if name not in names:
                    print(f"hpcddp pack: {source} has no array {name!r} (it has {names})",
                          file=sys.stderr)
                    return 2
                data = z[name]
                if args.label_array:
                    labels = z[args.label_array].tolist()
        else:
            data = np.load(source, mmap_mode="r", allow_pickle=False)
        source = data
    try:
        m = pack(source, args.out, format=args.format, shard_bytes=args.shard_size,
                 labels=labels, label_from_parent=args.labels == "parent",
                 encoding=args.encoding, overwrite=args.overwrite,
                 progress=not args.no_progress)
    except (ValueError, TypeError, FileExistsError, FileNotFoundError) as exc:
        print(f"hpcddp pack: {exc}", file=sys.stderr)
        return 2
    summary = {"out": os.path.abspath(args.out), "format": m.storage, "encoding": m.encoding,
               "num_samples": m.num_samples, "num_shards": len(m.shards),
               "bytes": m.total_bytes, "seconds": round(getattr(m, "pack_seconds", 0.0), 3)}
    print(f"packed {m.num_samples} samples into {len(m.shards)} {m.storage} shard(s), "
          f"{m.total_bytes / 1e6:.1f} MB, in {summary['seconds']:.2f} s: {summary['out']}")
    if args.json:
        text = json.dumps(summary, indent=2)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    return 0
