"""Pack samples into a sharded LMDB or HDF5 data set (``hpcddp pack`` and :func:`pack`).

Sources: a folder tree of files (key = relative path, sorted), a numpy array (one sample per
row), a dataset of an HDF5 file (one sample per row, read in blocks: a file larger than memory
packs in bounded memory), or an iterable of ``(key, value)`` / ``(key, value, label)`` where a
value is bytes or a numpy array. Samples are grouped, in order, into shards of at most
``shard_bytes`` of payload; each shard is one file (an LMDB environment with ``subdir=False``,
or an HDF5 file). The output is deterministic: the same input gives the same bytes, shard
checksums and manifest.

Inside a shard:

* LMDB: key = the sample's global index as 8 big-endian bytes, value = its payload.
* HDF5: encoding ``array`` -> dataset ``samples`` of shape ``(count, *shape)``; encodings
  ``bytes``/``npy`` -> ``data`` (uint8, the payloads end to end) and ``offsets`` (int64,
  ``count + 1``). Both contiguous and uncompressed, so a reader can map them directly.
"""
from __future__ import annotations

import io
import os
import struct
import time
from typing import Iterable, Iterator, Sequence

import numpy as np

from hpcddp.data import manifest as mf

DEFAULT_SHARD_BYTES = 128 << 20
_LMDB_TXN_BYTES = 64 << 20   # commit every ~64 MiB: keeps LMDB's dirty-page list bounded
# rows of an HDF5 source read per h5py call: what a pack holds besides its pending shard
HDF5_BLOCK_BYTES = 64 << 20


def lmdb_key(index: int) -> bytes:
    """The LMDB key of global sample ``index`` (sorts in index order, so appends are cheap)."""
    return struct.pack(">Q", index)


def _values_kind(value):
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "bytes"
    if isinstance(value, np.ndarray):
        return "array"
    if hasattr(value, "numpy") and hasattr(value, "detach"):  # a torch tensor
        return "tensor"
    return None


def _walk_folder(root: str) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames.sort()
        for fn in sorted(filenames):
            full = os.path.join(dirpath, fn)
            rel = os.path.relpath(full, root).replace(os.sep, "/")
            out.append(rel)
    out.sort()
    return out


class _Source:
    """Normalised input: an iterator of (key, value, label) plus what is known up front."""

    def __init__(self, it: Iterator, total: int | None, classes: list[str] | None,
                 encoding: str | None, dtype=None, shape=None):
        self.it, self.total, self.classes, self.encoding = it, total, classes, encoding
        self.dtype, self.shape = dtype, shape


def _folder_source(root: str, label_from_parent: bool) -> _Source:
    rels = _walk_folder(root)
    classes = None
    labels = None
    if label_from_parent:
        parents = []
        for r in rels:
            parent = r.rpartition("/")[0]
            if not parent:
                raise ValueError(f"pack: label_from_parent=True but {r!r} sits directly in "
                                 f"{root} (no parent folder to name its class); move it into a "
                                 f"class folder or pack without labels")
            parents.append(parent)
        classes = sorted(set(parents))
        cls_index = {c: i for i, c in enumerate(classes)}
        labels = [cls_index[p] for p in parents]

    def gen():
        for i, r in enumerate(rels):
            with open(os.path.join(root, r), "rb") as f:
                yield r, f.read(), (labels[i] if labels is not None else None)
    return _Source(gen(), len(rels), classes, "bytes")


def _array_source(arr: np.ndarray, labels) -> _Source:
    if arr.ndim < 1:
        raise ValueError("pack: a numpy array source needs at least one dimension (samples "
                         "along axis 0), got a 0-d array")
    lab = None if labels is None else list(labels)
    if lab is not None and len(lab) != len(arr):
        raise ValueError(f"pack: labels has {len(lab)} entries, the array has {len(arr)} samples")

    def gen():
        for i in range(len(arr)):
            # arr[i, ...]: a 0-d array for a 1-D source (arr[i] is a numpy scalar)
            yield str(i), arr[i, ...], (None if lab is None else lab[i])
    return _Source(gen(), len(arr), None, "array", arr.dtype, tuple(arr.shape[1:]))


# -- HDF5 sources ------------------------------------------------------------------------------

def is_hdf5(path) -> bool:
    """Whether the file at ``path`` starts with HDF5's signature (reads a few bytes)."""
    import h5py
    try:
        return bool(h5py.is_hdf5(os.fspath(path)))
    except OSError:
        return False


def hdf5_datasets(f) -> list[str]:
    """Sorted paths (``"grp/images"``) of every dataset in the open h5py file or group ``f``."""
    import h5py
    names: list[str] = []
    f.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
    return sorted(names)


def hdf5_block_rows(ds, block_bytes: int | None = None) -> int:
    """Rows of ``ds`` to read per call: about ``block_bytes`` (default ``HDF5_BLOCK_BYTES``), a
    whole number of chunks along axis 0 when ``ds`` is chunked (no chunk is decompressed
    twice), at least one chunk or row."""
    if block_bytes is None:
        block_bytes = HDF5_BLOCK_BYTES
    row = ds.dtype.itemsize * int(np.prod(ds.shape[1:], dtype=np.int64))
    rows = max(1, block_bytes // max(1, row))
    if ds.chunks:
        c = ds.chunks[0]
        rows = max(c, rows // c * c)
    return rows


def _hdf5_dataset(f, path: str, name: str, option: str):
    import h5py
    obj = f.get(name)
    if obj is None:
        raise ValueError(f"pack: {path} has no dataset {name!r} ({option}); it has "
                         f"{hdf5_datasets(f)}")
    if not isinstance(obj, h5py.Dataset):
        raise ValueError(f"pack: {name!r} in {path} is a {type(obj).__name__.lower()}, not a "
                         f"dataset ({option}); the file's datasets: {hdf5_datasets(f)}")
    if obj.shape is None or len(obj.shape) == 0:
        raise ValueError(f"pack: dataset {name!r} in {path} ({option}) is a scalar (0-d, shape "
                         f"{obj.shape}); it needs one sample per row along axis 0")
    return obj


def _default_hdf5_array(f, path: str, label_array: str | None) -> str:
    """The one dataset of ndim >= 1 other than the labels; refuse when there are several."""
    names = hdf5_datasets(f)
    label = None if label_array is None else label_array.strip("/")
    rows = [n for n in names if n != label and f[n].shape]   # () scalar, None empty: not rows
    if len(rows) == 1:
        return rows[0]
    if not rows:
        raise ValueError(f"pack: {path} holds no dataset of one or more dimensions to pack "
                         f"(its datasets: {names})")
    raise ValueError(f"pack: {path} holds {len(rows)} datasets that could be the samples "
                     f"({rows}); name one with --array NAME (array=NAME from Python)")


def _hdf5_source(path: str, array: str | None, label_array: str | None, labels) -> _Source:
    """Rows of dataset ``array`` of the HDF5 file ``path``, read in chunk-aligned blocks."""
    import h5py
    if labels is not None and label_array is not None:
        raise ValueError("pack: labels given both as labels= and as label_array=; use one")
    try:
        f = h5py.File(path, "r")
    except OSError as exc:
        raise ValueError(f"pack: cannot open {path!r} as an HDF5 file: {exc}") from None
    try:
        name = array if array is not None else _default_hdf5_array(f, path, label_array)
        ds = _hdf5_dataset(f, path, name, "--array")
        labels_what = "labels"
        if label_array is not None:
            lds = _hdf5_dataset(f, path, label_array, "--label-array")
            if len(lds.shape) != 1 or lds.dtype.kind not in "iub":
                raise ValueError(f"pack: label dataset {label_array!r} in {path} is "
                                 f"{lds.dtype}{list(lds.shape)}; labels are one integer per "
                                 f"sample, shape ({ds.shape[0]},)")
            labels, labels_what = lds, f"label dataset {label_array!r}"
        return _h5_rows_source(ds, f"dataset {name!r} in {path}", labels, labels_what, f.close)
    except BaseException:
        f.close()
        raise


def _is_h5_dataset(obj) -> bool:
    if not type(obj).__module__.startswith("h5py"):
        return False    # h5py is not imported for sources that cannot be one of its datasets
    import h5py
    return isinstance(obj, h5py.Dataset)


def _h5_rows_source(ds, what: str, labels, labels_what: str = "labels",
                    close=None) -> _Source:
    """The rows of the open h5py dataset ``ds``, read ``hdf5_block_rows(ds)`` at a time;
    ``close`` (the file's) runs when the rows end or the pack stops early."""
    import h5py
    if ds.shape is None or len(ds.shape) == 0:
        raise ValueError(f"pack: {what} is a scalar (0-d, shape {ds.shape}); it needs one "
                         f"sample per row along axis 0")
    if ds.dtype.hasobject:
        raise ValueError(f"pack: {what} has variable-length values (h5py dtype "
                         f"{h5py.check_dtype(vlen=ds.dtype) or ds.dtype}); only fixed-size "
                         f"values can be packed")
    n = ds.shape[0]
    if _is_h5_dataset(labels):
        labels = labels[()]          # one read, not one per label
    lab = None if labels is None else np.asarray(labels).tolist()
    if lab is not None and len(lab) != n:
        raise ValueError(f"pack: {labels_what} has {len(lab)} entries, {what} has {n} samples "
                         f"(rows along axis 0)")
    # a compound dtype keeps its field names only in .npy bytes ("array" stores dtype.str)
    encoding = "npy" if ds.dtype.names else "array"
    step = hdf5_block_rows(ds)

    def gen():
        try:
            for start in range(0, n, step):
                block = ds[start:start + step]
                for j in range(len(block)):
                    i = start + j
                    yield str(i), block[j, ...], (None if lab is None else lab[i])
        finally:
            if close is not None:
                close()
    return _Source(gen(), n, None, encoding, ds.dtype, tuple(ds.shape[1:]))


def _iterable_source(items: Iterable, labels) -> _Source:
    lab = None if labels is None else list(labels)
    total = len(items) if hasattr(items, "__len__") else None
    if lab is not None and total is not None and len(lab) != total:
        raise ValueError(f"pack: labels has {len(lab)} entries, the source has {total} samples")

    def gen():
        for i, item in enumerate(items):
            if not isinstance(item, (tuple, list)) or len(item) not in (2, 3):
                raise ValueError(f"pack: item {i} of the iterable is {type(item).__name__}; "
                                 f"expected (key, value) or (key, value, label)")
            key, value = item[0], item[1]
            label = item[2] if len(item) == 3 else None
            if lab is not None:
                if label is not None:
                    raise ValueError("pack: labels given both as an argument and inside the "
                                     "items; use one")
                if i >= len(lab):
                    raise ValueError(f"pack: labels has {len(lab)} entries, the source has more")
                label = lab[i]
            yield key, value, label
    return _Source(gen(), total, None, None)


def _normalise(source, labels, label_from_parent, array=None, label_array=None) -> _Source:
    if isinstance(source, (str, os.PathLike)):
        root = os.fspath(source)
        if os.path.isfile(root):
            if not is_hdf5(root):
                raise ValueError(f"pack: source {root!r} is a file that is not HDF5 (no HDF5 "
                                 f"signature); give a folder tree of files, an HDF5 file or a "
                                 f"numpy array")
            if label_from_parent:
                raise ValueError("pack: label_from_parent=True needs a folder source; an HDF5 "
                                 "file's labels come from label_array=")
            return _hdf5_source(root, array, label_array, labels)
        if not os.path.isdir(root):
            raise FileNotFoundError(f"pack: source {root!r} is not a directory (a folder tree "
                                    f"of files to pack) or an HDF5 file")
        if labels is not None or label_array is not None:
            raise ValueError("pack: labels= and label_array= are for array, HDF5 and iterable "
                             "sources; a folder takes label_from_parent=True")
        if array is not None:
            raise ValueError("pack: array= names a dataset of an HDF5 file; the source is a "
                             "folder")
        return _folder_source(root, label_from_parent)
    if array is not None or label_array is not None:
        raise ValueError("pack: array= and label_array= name datasets of an HDF5 file; the "
                         "source is not one")
    if label_from_parent:
        raise ValueError("pack: label_from_parent=True needs a folder source")
    if isinstance(source, np.ndarray):
        return _array_source(source, labels)
    if _is_h5_dataset(source):
        return _h5_rows_source(source, f"dataset {source.name!r} in {source.file.filename}",
                               labels)
    if hasattr(source, "numpy") and hasattr(source, "detach"):
        return _array_source(source.detach().cpu().numpy(), labels)
    if isinstance(source, (bytes, bytearray, dict)) or not hasattr(source, "__iter__"):
        raise TypeError(f"pack: source must be a folder path, a numpy array or an iterable of "
                        f"(key, value) pairs, got {type(source).__name__}")
    return _iterable_source(source, labels)


class _Encoder:
    """Turns values into payload bytes; fixes the encoding from the first value when unset."""

    def __init__(self, encoding: str | None):
        if encoding is not None and encoding not in mf.ENCODINGS:
            raise ValueError(f"pack: encoding={encoding!r}, expected one of {list(mf.ENCODINGS)}")
        self.encoding = encoding
        self.dtype: np.dtype | None = None
        self.shape: tuple | None = None

    def __call__(self, i: int, key: str, value) -> bytes | np.ndarray:
        kind = _values_kind(value)
        if kind == "tensor":
            value, kind = value.detach().cpu().numpy(), "array"
        if kind is None:
            raise TypeError(f"pack: sample {i} ({key!r}) is {type(value).__name__}; values must "
                            f"be bytes or numpy arrays")
        if self.encoding is None:
            self.encoding = "bytes" if kind == "bytes" else "array"
        enc = self.encoding
        if enc == "bytes":
            if kind != "bytes":
                raise TypeError(f"pack: sample {i} ({key!r}) is an array but the encoding is "
                                f"'bytes'; pass encoding='npy' for arrays of varying shapes")
            return bytes(value)
        if kind != "array":
            raise TypeError(f"pack: sample {i} ({key!r}) is bytes but the encoding is {enc!r}")
        if value.dtype.hasobject:
            raise TypeError(f"pack: sample {i} ({key!r}) has dtype object; only plain numeric "
                            f"arrays can be packed")
        if enc == "npy":
            buf = io.BytesIO()
            np.save(buf, np.ascontiguousarray(value), allow_pickle=False)
            return buf.getvalue()
        if self.dtype is None:
            self.dtype, self.shape = value.dtype, tuple(value.shape)
        elif value.dtype != self.dtype or tuple(value.shape) != self.shape:
            raise ValueError(f"pack: sample {i} ({key!r}) is {value.dtype}{list(value.shape)}, "
                             f"earlier samples are {self.dtype}{list(self.shape)}; encoding "
                             f"'array' needs one dtype and shape: pass encoding='npy' to allow "
                             f"them to vary")
        return np.ascontiguousarray(value)


def _nbytes(v) -> int:
    return v.nbytes if isinstance(v, np.ndarray) else len(v)


# -- shard writers -----------------------------------------------------------------------------

def _lmdb_map_size(values) -> int:
    est = 1 << 20
    for v in values:
        n = _nbytes(v)
        # small values share leaf pages; large ones take whole overflow pages
        est += (n + 64) if n < 2000 else ((n + 16 + 4095) // 4096) * 4096
    est = int(est * 1.5)
    return ((est + (1 << 20) - 1) >> 20) << 20


def _write_lmdb(path: str, first: int, values: Sequence) -> None:
    import lmdb
    map_size = _lmdb_map_size(values)
    while True:
        for p in (path, path + "-lock"):
            if os.path.exists(p):
                os.remove(p)
        env = lmdb.open(path, subdir=False, map_size=map_size, lock=False, sync=False,
                        metasync=False, meminit=True, readahead=False, max_dbs=0)
        try:
            i, n = 0, len(values)
            while i < n:
                pending = 0
                with env.begin(write=True) as txn:
                    while i < n and pending < _LMDB_TXN_BYTES:
                        v = values[i]
                        txn.put(lmdb_key(first + i), v if isinstance(v, bytes) else v.tobytes(),
                                append=True)
                        pending += _nbytes(v)
                        i += 1
            env.close()
            return
        except lmdb.MapFullError:
            env.close()
            map_size *= 2  # deterministic: the same input takes the same retries


def _write_hdf5(path: str, first: int, values: Sequence, encoding: str) -> None:
    import h5py
    if os.path.exists(path):
        os.remove(path)
    with h5py.File(path, "w", libver="earliest", track_order=False) as f:
        f.attrs["first"] = np.int64(first)
        f.attrs["count"] = np.int64(len(values))
        f.attrs["encoding"] = encoding
        if encoding == "array":
            arr = np.stack(values) if values else np.zeros((0,))
            f.create_dataset("samples", data=arr, track_times=False)
        else:
            offsets = np.zeros(len(values) + 1, dtype=np.int64)
            np.cumsum([len(v) for v in values], out=offsets[1:])
            data = np.frombuffer(b"".join(values), dtype=np.uint8)
            f.create_dataset("data", data=data, track_times=False)
            f.create_dataset("offsets", data=offsets, track_times=False)


def pack(source, out: str, *, format: str = "lmdb", shard_bytes: int = DEFAULT_SHARD_BYTES,
         labels: Sequence[int] | None = None, label_from_parent: bool = False,
         encoding: str | None = None, overwrite: bool = False, progress: bool = True,
         array: str | None = None, label_array: str | None = None) -> mf.Manifest:
    """Pack ``source`` into the data set directory ``out``; return its manifest.

    Args:
        source: a folder (every file below it is a sample, key = its relative path, in sorted
            order), a numpy array or tensor (samples along axis 0, keys "0", "1", ...), an
            HDF5 file (the rows of its dataset ``array``, keys "0", "1", ... as for an array;
            read ``HDF5_BLOCK_BYTES`` at a time, in whole chunks) or an open h5py dataset
            (the same, the caller keeps the file open until pack returns), or an iterable of
            ``(key, value)`` or ``(key, value, label)`` with bytes or array values.
        out: the directory to create. It must not exist or be empty, unless ``overwrite``.
        format: ``"lmdb"`` or ``"hdf5"``.
        shard_bytes: target payload bytes per shard: a shard takes samples in order while
            they fit (a sample larger than this gets a shard of its own). Files are a little
            larger than their payload (LMDB pages, HDF5 headers).
        labels: one int label per sample (array and iterable sources).
        label_from_parent: folder sources: label = index of the file's parent folder in the
            sorted list of parent folders (ImageFolder-style; names kept as ``classes``).
        encoding: ``"bytes"``, ``"array"`` (one dtype and shape) or ``"npy"`` (arrays that
            vary); default: from the first value.
        progress: show a tqdm bar (on stderr, and only when stderr is a terminal).
        array: HDF5 sources: the path of the samples' dataset in the file (``"grp/images"``);
            default: the file's one dataset of one or more dimensions (other than
            ``label_array``), refused when there are several.
        label_array: HDF5 sources: the path of a dataset of int labels, one per sample.

    Memory: an HDF5 source holds one block of rows and the shard being filled (up to
    ``shard_bytes``; twice that while an HDF5 shard is written), plus the keys and labels of
    every sample for the manifest: not the file.

    Called by one process; needs no MPI.
    """
    if format not in mf.STORAGES:
        raise ValueError(f"pack: format={format!r}, expected one of {list(mf.STORAGES)}")
    if not isinstance(shard_bytes, int) or shard_bytes < 1:
        raise ValueError(f"pack: shard_bytes={shard_bytes!r}, expected a positive int (bytes)")
    out = os.fspath(out)
    # a source that cannot be read fails here, before OUT is created or cleared
    src = _normalise(source, labels, label_from_parent, array, label_array)
    enc = _Encoder(encoding or src.encoding)
    if enc.encoding == "array" and src.dtype is not None:
        enc.dtype, enc.shape = src.dtype, src.shape
    if os.path.isdir(out) and os.listdir(out):
        if not overwrite:
            raise FileExistsError(f"pack: output directory {out!r} is not empty; choose a new "
                                  f"path or pass overwrite=True (--overwrite)")
        _clear_dataset_dir(out)
    created = not os.path.exists(out)
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as exc:   # under a file, on a read-only filesystem, no permission
        raise ValueError(f"pack: output directory {out!r} cannot be created: "
                         f"{exc.strerror or exc}") from None
    try:
        return _write(src, enc, out, format, shard_bytes, progress)
    except BaseException:
        if created:   # a failed pack leaves nothing behind: no half data set, no empty folder
            import shutil
            shutil.rmtree(out, ignore_errors=True)
        raise


def _write(src: _Source, enc: _Encoder, out: str, format: str, shard_bytes: int,
           progress: bool) -> mf.Manifest:
    """Write the shards and then the manifest of ``pack`` into the existing folder OUT."""
    import sys

    from tqdm import tqdm
    # a bar only on a terminal: redirected to a log (a Slurm job's), its \r updates would
    # fill it; the caller prints one line when the pack is done
    bar = tqdm(total=src.total, unit="sample", desc=f"pack {os.path.basename(out) or out}",
               disable=not (progress and sys.stderr.isatty()), mininterval=0.5)
    keys: list[str] = []
    seen: set[str] = set()
    all_labels: list = []
    shards: list[dict] = []
    pending: list = []
    pending_bytes = 0
    t0 = time.perf_counter()

    def flush():
        nonlocal pending, pending_bytes
        if not pending:
            return
        idx = len(shards)
        name = mf.shard_name(idx, format)
        path = os.path.join(out, name)
        first = len(keys) - len(pending)
        # written under a partial name and renamed: a pack killed mid-shard leaves no shard
        # under its final name that is not whole (the manifest, written last, lists them)
        partial = path + mf.PARTIAL_SUFFIX
        if format == "lmdb":
            _write_lmdb(partial, first, pending)
        else:
            _write_hdf5(partial, first, pending, enc.encoding)
        os.replace(partial, path)
        count = len(pending)
        # the payloads go before the checksum maps the shard: the two never add up in memory
        pending, pending_bytes = [], 0
        sha, crc = mf.file_digests(path)
        shards.append({"name": name, "first": first, "count": count,
                       "bytes": os.path.getsize(path), "sha256": sha, "crc32c": crc})

    try:
        for i, (key, value, label) in enumerate(src.it):
            key = str(key)
            if key in seen:
                raise ValueError(f"pack: key {key!r} appears twice (samples must have unique keys)")
            seen.add(key)
            payload = enc(i, key, value)
            if pending and pending_bytes + _nbytes(payload) > shard_bytes:
                flush()
            keys.append(key)
            all_labels.append(label)
            pending.append(payload)
            pending_bytes += _nbytes(payload)
            if pending_bytes >= shard_bytes:
                flush()
            bar.update(1)
        flush()
    finally:
        bar.close()

    m = _write_manifest(src, enc, out, format, shard_bytes, keys, all_labels, shards)
    m.pack_seconds = time.perf_counter() - t0
    return m


def _write_manifest(src: _Source, enc: _Encoder, out: str, format: str, shard_bytes: int,
                    keys: list, all_labels: list, shards: list) -> mf.Manifest:
    """Write the manifest (last: a pack is complete once it exists) of the SHARDS written."""
    have = [lab is not None for lab in all_labels]
    if any(have) and not all(have):
        raise ValueError(f"pack: {have.count(False)} of {len(have)} samples have no label; give "
                         f"every sample a label or none")
    doc = {
        "format": mf.FORMAT, "format_version": mf.FORMAT_VERSION, "storage": format,
        "encoding": enc.encoding or "bytes", "num_samples": len(keys), "keys": keys,
        "labels": [int(x) for x in all_labels] if keys and all(have) else None,
        "classes": src.classes,
        "dtype": None if enc.dtype is None else enc.dtype.str,
        "shape": None if enc.shape is None else list(enc.shape),
        "shard_bytes_target": shard_bytes, "checksums": ["sha256", "crc32c"], "shards": shards,
        "total_bytes": sum(s["bytes"] for s in shards),
    }
    if doc["encoding"] == "array" and doc["dtype"] is None:
        doc["encoding"] = "bytes"  # empty array source: nothing to describe
    mf.validate(doc, f"pack({out})")
    raw = mf.dumps(doc)
    mf.write_atomic(os.path.join(out, mf.MANIFEST), raw)
    return mf.Manifest(doc, raw)


def _clear_dataset_dir(out: str) -> None:
    """Remove what a previous pack wrote (manifest, shards, markers); refuse anything else."""
    names = os.listdir(out)
    ours = [n for n in names if n in (mf.MANIFEST, mf.READY, mf.STAGING)
            or (n.startswith("shard-") and n.endswith((".lmdb", ".h5", ".lmdb-lock")))
            or n.endswith(mf.PARTIAL_SUFFIX)]
    others = sorted(set(names) - set(ours))
    if others:
        raise FileExistsError(f"pack: overwrite=True but {out!r} holds files that are not a "
                              f"packed data set ({others[:5]}{'...' if len(others) > 5 else ''}); "
                              f"refusing to delete them")
    for n in ours:
        os.remove(os.path.join(out, n))
