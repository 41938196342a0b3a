"""`hpcddp pack`: files, a .npy/.npz array or an HDF5 dataset -> a sharded LMDB or HDF5 data set."""
import argparse
import os

DESCRIPTION = """\
Pack a folder tree of files (key = relative path; --labels parent for ImageFolder-style class
labels), a .npy/.npz array or a dataset of an HDF5 file (one sample per row; an HDF5 file is
read in blocks, so one larger than memory packs) into a data set directory of LMDB or HDF5
shards plus manifest.json (format version, key order, shard sizes and SHA-256 checksums).
The same input always gives the same bytes. Runs in one process; no MPI.

    hpcddp pack ./images /lustre/me/images.lmdb --format lmdb --labels parent
    hpcddp pack features.npy /lustre/me/feats.h5 --format hdf5 --shard-size 256M
    hpcddp pack data.npz /lustre/me/d --array x --label-array y
    hpcddp pack data.h5 /lustre/me/d --array grp/images --label-array labels

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
    parser.add_argument("source", help="a folder of files, a .npy/.npz file or an HDF5 file")
    parser.add_argument("out", help="the data set directory to create")
    parser.add_argument("--format", choices=("lmdb", "hdf5"), default="lmdb",
                        help="shard storage (default lmdb)")
    parser.add_argument("--shard-size", type=parse_size, default="128M", metavar="SIZE",
                        help="payload bytes per shard, e.g. 64M, 1G (default 128M)")
    parser.add_argument("--labels", choices=("none", "parent"), default="none",
                        help="folder sources: 'parent' labels each file by its parent folder")
    parser.add_argument("--array", metavar="NAME",
                        help=".npz sources: the array holding the samples (default: the first); "
                             "HDF5 sources: the dataset's path, e.g. grp/images (default: the "
                             "file's one dataset of ndim >= 1)")
    parser.add_argument("--label-array", metavar="NAME",
                        help=".npz/HDF5 sources: an array or dataset of int labels")
    parser.add_argument("--encoding", choices=("bytes", "array", "npy"),
                        help="override the value encoding (default: from the source)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing data set in OUT")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--json", metavar="PATH",
                        help="write a summary (samples, shards, bytes, seconds) as JSON; - is stdout")


def _load(args):
    """(samples, labels) from a .npy/.npz SOURCE, (SOURCE, None) for an HDF5 file (pack reads
    it), or the refusal's text (a str)."""
    import numpy as np
    source = args.source
    kind = os.path.splitext(source)[1].lower()
    if kind not in (".npy", ".npz"):
        from hpcddp.data.packing import is_hdf5
        if not is_hdf5(source):
            return (f"SOURCE {source!r} is a file that is not .npy or .npz, nor HDF5; give a "
                    f"folder of files (one sample each), a .npy/.npz array or an HDF5 file "
                    f"(one sample per row)")
        if args.labels == "parent":
            return "--labels parent labels the files of a folder; SOURCE is an HDF5 file"
        return source, None
    if args.labels == "parent":
        return "--labels parent labels the files of a folder; SOURCE is an array file"
    if kind == ".npy" and (args.array or args.label_array):
        return (f"--array/--label-array name arrays of a .npz file; {source!r} is a .npy "
                f"file (one array)")
    try:
        if kind == ".npy":
            return np.load(source, mmap_mode="r", allow_pickle=False), None
        with np.load(source, allow_pickle=False) as z:
            names = list(z.files)
            for option, name in (("--array", args.array or (names[0] if names else None)),
                                 ("--label-array", args.label_array)):
                if name is not None and name not in names:
                    return f"{source} has no array {name!r} ({option}); it has {names}"
            if not names:
                return f"{source} holds no arrays"
            data = z[args.array or names[0]]
            labels = z[args.label_array].tolist() if args.label_array else None
            return data, labels
    except (ValueError, OSError, EOFError) as exc:
        return f"cannot read {source!r} as a {kind} array: {exc}"


def run(args) -> int:
    import json
    import sys

    from hpcddp.cli._errors import refuse
    source, labels = args.source, None
    if not os.path.exists(source):
        return refuse("pack", f"SOURCE {source!r} does not exist")
    if os.path.isdir(source):
        if args.array or args.label_array:
            return refuse("pack", "--array/--label-array are for .npz sources and HDF5 "
                                  "files; a folder's labels come from --labels parent")
        if not any(files for _, _, files in os.walk(source)):
            return refuse("pack", f"SOURCE {source!r} holds no files: nothing to pack")
    else:
        loaded = _load(args)
        if isinstance(loaded, str):
            return refuse("pack", loaded)
        source, labels = loaded
    hdf5 = isinstance(source, str) and os.path.isfile(source)
    from hpcddp.data.packing import pack
    try:
        m = pack(source, args.out, format=args.format, shard_bytes=args.shard_size,
                 labels=labels, label_from_parent=args.labels == "parent",
                 encoding=args.encoding, overwrite=args.overwrite,
                 progress=not args.no_progress,
                 array=args.array if hdf5 else None,
                 label_array=args.label_array if hdf5 else None)
    except (ValueError, TypeError, FileExistsError, FileNotFoundError) as exc:
        return refuse("pack", exc)
    except OSError as exc:    # a read or write that failed midway: nothing is left behind
        return refuse("pack", f"failed reading SOURCE {args.source!r} or writing OUT "
                              f"{args.out!r}: {exc}", status=1)
    summary = {"out": os.path.abspath(args.out), "format": m.storage, "encoding": m.encoding,
               "num_samples": m.num_samples, "num_shards": len(m.shards),
               "bytes": m.total_bytes, "seconds": round(getattr(m, "pack_seconds", 0.0), 3)}
    # the one line a log gets; with --json - stdout is the JSON alone, so it goes to stderr
    print(f"packed {m.num_samples} samples into {len(m.shards)} {m.storage} shard(s), "
          f"{m.total_bytes / 1e6:.1f} MB, in {summary['seconds']:.2f} s: {summary['out']}",
          file=sys.stderr if args.json == "-" else sys.stdout, flush=True)
    if args.json:
        text = json.dumps(summary, indent=2)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    return 0
