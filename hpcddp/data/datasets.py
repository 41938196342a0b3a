"""Torch datasets over packed (or staged) LMDB and HDF5 data sets, safe in DataLoader workers.

Handles are opened lazily, per process: the first ``__getitem__`` in a process (the main
process, a forked worker, a spawned worker) opens what it needs. A dataset that opened shards
and is then forked notices the new pid and reopens; pickling (spawn/forkserver workers) drops
every handle, so an open LMDB environment or file is never pickled or shared.

Read paths:

* LMDB: ``readonly=True, lock=False, readahead=False, meminit=False`` (safe because a packed or
  staged copy is never written while it is read); one read transaction per item.
* HDF5: opened once per process with ``locking=False`` only to find where the contiguous,
  uncompressed datasets lie in the file; items are then read with ``os.preadv`` straight into
  the result, with no HDF5 call (and no HDF5 handle to fork) on the hot path.

A copy that a stager has not finished (``STAGING`` present, a shard missing or of the wrong
size) is refused at construction with an error that says how to finish it.

Integrity: the first time a process opens a shard, it checks the whole file against the
manifest's CRC-32C (SHA-256 for manifests without one) before reading any sample from it, once
per shard per process (a forked or spawned worker checks again: its own first open). A byte
changed in a staged copy after it was verified raises DatasetError naming the shard, instead
of a wrong sample. ``check=False``, or ``HPCDDP_DATA_CHECK=0`` in the environment, skips it
(docs/data.md has its cost).
"""
from __future__ import annotations

import io
import os
from typing import Callable

import numpy as np
import torch

from hpcddp import settings

from hpcddp.data import manifest as mf
from hpcddp.data.packing import lmdb_key


CHECK_ENV = "HPCDDP_DATA_CHECK"


def check_default(env=None) -> bool:
    """``HPCDDP_DATA_CHECK``: 1 (default) checks each shard's CRC-32C on first open, 0 skips."""
    return (settings.get() if env is None else settings.read(env)).data_check


def _decode_default(encoding: str):
    if encoding == "npy":
        return lambda b: np.load(io.BytesIO(b), allow_pickle=False)
    return None


class _PackedDataset(torch.utils.data.Dataset):
    storage = ""

    def __init__(self, path: str, decode: Callable | None = None, *, verify: bool = False,
                 check: bool | None = None):
        """Open the packed or staged data set in directory ``path``.

        Args:
            path: a directory written by ``hpcddp pack`` or ``hpcddp stage``.
            decode: called on each stored value (bytes for encoding ``bytes``; a numpy array
                for ``array`` and ``npy``) and its result returned; must be picklable for
                spawn workers (a module-level function, not a lambda).
            verify: hash every local shard now (SHA-256, reads all bytes) and raise on a
                mismatch; by default sizes are checked here, checksums on first open.
            check: check each shard's CRC-32C when this process first opens it, before any
                of its samples is returned (raises DatasetError on a mismatch). None: the
                ``HPCDDP_DATA_CHECK`` environment variable (default 1: check).

        Items are ``value`` or, when the data set has labels, ``(value, label)``.
        """
        who = type(self).__name__
        self.path = os.fspath(path)
        if not os.path.isdir(self.path):
            raise FileNotFoundError(f"{who}: {self.path!r} is not a directory (expected a data "
                                    f"set written by `hpcddp pack` or `hpcddp stage`)")
        self.manifest = mf.load(self.path, where=f"{who}({self.path})")
        if self.manifest.storage != self.storage:
            other = {"lmdb": "LMDBDataset", "hdf5": "HDF5Dataset"}[self.manifest.storage]
            raise mf.DatasetError(f"{who}: {self.path} holds {self.manifest.storage} shards; "
                                  f"open it with {other} (or hpcddp.data.open_dataset)")
        self.ready = mf.check_ready(self.path, who, self.manifest.shards)
        local = None if self.ready is None else self.ready.get("local_shards")
        self.local_shards: frozenset | None = None
        if local is not None and self.ready.get("mode") == "partition":
            self.local_shards = frozenset(local)
        self.decode = decode
        self._default = _decode_default(self.manifest.encoding)
        self._labels = self.manifest.labels
        self.check = check_default() if check is None else bool(check)
        self._pid = -1
        self._handles: dict = {}
        self._checked: set = set()   # shard indices checked in this process (self._pid)
        if verify:
            bad = self.verify()
            if bad:
                raise mf.DatasetError(f"{who}: {len(bad)} shard(s) in {self.path} do not match "
                                      f"their manifest checksum: {bad}; re-run `hpcddp stage` "
                                      f"(it replaces bad shards) or re-pack")

    # -- the Dataset protocol ---------------------------------------------------------------
    def __len__(self) -> int:
        return self.manifest.num_samples

    def __getitem__(self, index):
        n = self.manifest.num_samples
        i = int(index)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"{type(self).__name__}: index {index} out of range for {n} samples")
        shard = self.manifest.shard_of(i)
        if self.local_shards is not None and shard.index not in self.local_shards:
            r = self.ready
            raise IndexError(
                f"{type(self).__name__}: sample {i} is in shard {shard.name}, which this node "
                f"(node {r.get('node')}) did not stage: {self.path} is a partition-mode copy "
                f"holding {len(self.local_shards)} of {len(self.manifest.shards)} shards; sample "
                f"with hpcddp.data.DistributedSampler (it keeps to local indices) or stage with "
                f"mode='replicate'")
        value = self._read(shard, i - shard.first)
        if self._default is not None:
            value = self._default(value)
        if self.decode is not None:
            value = self.decode(value)
        if self._labels is not None:
            return value, self._labels[i]
        return value

    # -- metadata ---------------------------------------------------------------------------
    @property
    def keys(self) -> list[str]:
        return self.manifest.keys

    @property
    def labels(self) -> list[int] | None:
        return self._labels

    @property
    def classes(self) -> list[str] | None:
        return self.manifest.classes

    @property
    def local_indices(self) -> np.ndarray | None:
        """Global indices staged on this node (partition mode), or None when all are here."""
        if self.local_shards is None:
            return None
        return np.asarray(self.manifest.indices_of(self.local_shards), dtype=np.int64)

    @property
    def stage_info(self) -> dict | None:
        """The READY document of a staged copy (mode, node, group, local shards), or None."""
        return self.ready

    def verify(self) -> list[str]:
        """Hash every local shard; return the names of those that do not match (empty: all good)."""
        bad = []
        for s in self.manifest.shards:
            if self.local_shards is not None and s.index not in self.local_shards:
                continue
            if mf.file_sha256(os.path.join(self.path, s.name)) != s.sha256:
                bad.append(s.name)
        return bad

    # -- handles ----------------------------------------------------------------------------
    def _handle(self, shard: mf.Shard):
        pid = os.getpid()
        if pid != self._pid:
            # inherited across fork: never use the parent's handles; release this process's
            # copies of them (the parent's stay open) and reopen
            if self._handles and self._pid != -1:
                self._drop_inherited(self._handles)
            self._handles = {}
            self._checked = set()
            self._pid = pid
        h = self._handles.get(shard.index)
        if h is None:
            path = os.path.join(self.path, shard.name)
            if self.check and shard.index not in self._checked:
                self._check_shard(path, shard)
                self._checked.add(shard.index)
            h = self._open(path, shard)
            self._handles[shard.index] = h
        return h

    def _check_shard(self, path: str, shard: mf.Shard) -> None:
        who = type(self).__name__
        try:
            c = mf.file_checker(path, shard)
        except OSError as exc:
            raise mf.DatasetError(f"{who}: cannot read shard {shard.name} of {self.path} to "
                                  f"check it: {exc}") from None
        if not c.ok():
            raise mf.DatasetError(
                f"{who}: shard {path} fails its {c.kind} check on first open: expected "
                f"{c.expected()} (manifest), got {c.hexdigest()}: the file changed after it "
                f"was written or staged; re-stage with `hpcddp stage SRC {self.path} --verify "
                f"full` (it replaces bad shards), or re-pack; no sample of it was returned")

    def close(self) -> None:
        """Close this process's handles (they reopen on the next access)."""
        if self._pid == os.getpid():
            for h in self._handles.values():
                self._close(h)
        self._handles = {}

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_handles"] = {}
        state["_pid"] = -1
        state["_checked"] = set()
        return state

    def __repr__(self) -> str:
        extra = "" if self.local_shards is None else f", local_shards={len(self.local_shards)}"
        return (f"{type(self).__name__}({self.path!r}, samples={len(self)}, "
                f"shards={len(self.manifest.shards)}{extra})")

    def _open(self, path, shard):  # pragma: no cover - abstract
        raise NotImplementedError

    def _drop_inherited(self, handles) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _close(self, h) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _read(self, shard, j):  # pragma: no cover - abstract
        raise NotImplementedError


class _LMDBRegistry:
    """This process's open LMDB environments, shared by every dataset object.

    py-lmdb refuses to open one environment file twice in a process (two dataset objects on
    one path, a pickled copy) and, after a fork, until the inherited environment is closed in
    the child. So environments are shared per file (device, inode), reference-counted, and a
    process that finds entries inherited from its parent closes its copies of them first.
    """

    def __init__(self):
        self.pid = os.getpid()
        self.envs: dict = {}   # (st_dev, st_ino) -> [env, refs]

    def _after_fork(self) -> None:
        if self.pid != os.getpid():
            for env, _ in self.envs.values():
                try:
                    env.close()  # the child's copy only: the parent's mapping is untouched
                except Exception:
                    pass
            self.envs.clear()
            self.pid = os.getpid()

    def acquire(self, path: str):
        import lmdb
        self._after_fork()
        st = os.stat(path)
        key = (st.st_dev, st.st_ino)
        ent = self.envs.get(key)
        if ent is None:
            env = lmdb.open(path, subdir=False, readonly=True, lock=False, readahead=False,
                            meminit=False, max_readers=1)
            ent = self.envs[key] = [env, 0]
        ent[1] += 1
        return key, ent[0]

    def release(self, key) -> None:
        if self.pid != os.getpid():
            return
        ent = self.envs.get(key)
        if ent is not None:
            ent[1] -= 1
            if ent[1] <= 0:
                del self.envs[key]
                ent[0].close()


_LMDB = _LMDBRegistry()


class LMDBDataset(_PackedDataset):
    """A packed LMDB data set (one environment per shard), opened lazily in each process."""

    storage = "lmdb"

    def _open(self, path, shard):
        return _LMDB.acquire(path)

    def _close(self, h) -> None:
        _LMDB.release(h[0])

    def _drop_inherited(self, handles) -> None:
        pass  # the registry closes inherited environments on its first use in this process

    def _read(self, shard, j):
        env = self._handle(shard)[1]
        key = lmdb_key(shard.first + j)
        with env.begin(buffers=True) as txn:
            buf = txn.get(key)
            if buf is None:
                raise mf.DatasetError(f"LMDBDataset: key for sample {shard.first + j} missing "
                                      f"from {shard.name} in {self.path}: corrupted shard")
            if self.manifest.encoding == "array":
                out = np.empty(self.manifest.shape, dtype=np.dtype(self.manifest.dtype))
                out.reshape(-1).view(np.uint8)[:] = np.frombuffer(buf, dtype=np.uint8)
                return out
            return bytes(buf)


class _H5Layout:
    __slots__ = ("fd", "base", "offsets", "item", "file")

    def __init__(self, fd, base, offsets, item, file=None):
        self.fd, self.base, self.offsets, self.item, self.file = fd, base, offsets, item, file


class HDF5Dataset(_PackedDataset):
    """A packed HDF5 data set (one file per shard), opened lazily in each process."""

    storage = "hdf5"

    def _open(self, path, shard):
        import h5py
        enc = self.manifest.encoding
        f = h5py.File(path, "r", locking=False)
        try:
            name = "samples" if enc == "array" else "data"
            dset = f[name]
            base = dset.id.get_offset()
            plain = dset.chunks is None  # contiguous: no chunking, so no filters either
            offsets = None if enc == "array" else np.asarray(f["offsets"][()], dtype=np.int64)
            item = None
            if enc == "array":
                item = int(np.dtype(self.manifest.dtype).itemsize * int(np.prod(self.manifest.shape)))
            if base is None or not plain:
                if base is None and dset.size == 0:
                    f.close()
                    return _H5Layout(-1, 0, offsets, item)
                # not a layout we can map (written by another tool): read through h5py
                return _H5Layout(-1, None, offsets, item, f)
        except Exception:
            f.close()
            raise
        f.close()
        fd = os.open(path, os.O_RDONLY)
        return _H5Layout(fd, int(base), offsets, item)

    def _close(self, h) -> None:
        if h.file is not None:
            h.file.close()
        if h.fd >= 0:
            os.close(h.fd)

    def _drop_inherited(self, handles) -> None:
        for h in handles.values():
            if h.fd >= 0:
                try:
                    os.close(h.fd)  # this process's copy of the descriptor
                except OSError:
                    pass

    def _read(self, shard, j):
        h = self._handle(shard)
        m = self.manifest
        if m.encoding == "array":
            out = np.empty(m.shape, dtype=np.dtype(m.dtype))
            if h.file is not None:
                out[...] = h.file["samples"][j]
                return out
            if h.item:
                self._pread(h, out.reshape(-1).view(np.uint8), h.base + j * h.item, shard)
            return out
        lo, hi = int(h.offsets[j]), int(h.offsets[j + 1])
        if h.file is not None:
            return h.file["data"][lo:hi].tobytes()
        if hi == lo:
            return b""
        buf = bytearray(hi - lo)
        self._pread(h, buf, h.base + lo, shard)
        return bytes(buf)

    def _pread(self, h, buf, offset, shard):
        n = os.preadv(h.fd, [buf], offset)
        want = len(buf) if not isinstance(buf, np.ndarray) else buf.nbytes
        if n != want:
            raise mf.DatasetError(f"HDF5Dataset: short read in {shard.name} of {self.path} "
                                  f"({n} of {want} bytes at offset {offset}): truncated shard")


def open_dataset(path: str, decode: Callable | None = None, **kwargs):
    """An LMDBDataset or HDF5Dataset, whichever the manifest in ``path`` names."""
    m = mf.load(os.fspath(path))
    cls = LMDBDataset if m.storage == "lmdb" else HDF5Dataset
    return cls(path, decode, **kwargs)
