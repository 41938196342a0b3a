"""The on-disk layout of a packed data set, and its manifest.

A packed data set is a directory::

    DATASET/
      manifest.json          what is here: format version, samples, key order, shards
      shard-00000.lmdb       one LMDB environment per shard (subdir=False: one file), or
      shard-00001.lmdb       shard-00000.h5 ... (one HDF5 file per shard)
      ...

A staged copy (``hpcddp stage``) holds the same files, byte for byte, plus markers:

      STAGING                present while a stager works here (the copy is incomplete)
      .shard-00003.lmdb.partial   a shard being written; renamed once its checksum matches
      READY                  written last, once every shard of this node is verified

Shards are the unit of packing, staging, verification and resume: a shard is one file with a
known size, SHA-256 and CRC-32C, holding the samples ``first .. first + count - 1`` in key order.

This module needs no MPI and no torch (json, hashlib, crc32c): the stager, the datasets and
the CLI all read manifests, and a DataLoader worker must not import MPI to do so.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import os
import re
import secrets
from dataclasses import dataclass
from typing import Iterable, Sequence

from crc32c import crc32c as _crc32c  # hardware CRC-32C; a software fallback where absent

FORMAT = "hpcddp-dataset"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
READY = "READY"
STAGING = "STAGING"
PARTIAL_SUFFIX = ".partial"
# what a data set directory holds besides its shards: never a shard's name
RESERVED_NAMES = frozenset({MANIFEST, READY, STAGING})
STORAGES = ("lmdb", "hdf5")
SHARD_EXT = {"lmdb": ".lmdb", "hdf5": ".h5"}
# bytes: raw values; array: one dtype and shape for every sample (raw C-order bytes);
# npy: each value is a .npy file's bytes (arrays whose shapes or dtypes vary)
ENCODINGS = ("bytes", "array", "npy")
HASH_BLOCK = 8 << 20


class DatasetError(RuntimeError):
    """A data set directory is missing, malformed, half-staged or corrupted."""


class NotReadyError(DatasetError):
    """A staged copy is incomplete: a stager is running here, or died before finishing."""


@dataclass(frozen=True)
class Shard:
    index: int
    name: str        # file name inside the data set directory
    first: int       # global index of its first sample
    count: int       # samples in it
    bytes: int       # file size in bytes
    sha256: str      # hex digest of the file: its identity (Dataset.verify, re-packing)
    crc32c: str | None = None  # 8 hex digits: the fast check the stager runs on every copy

    def to_json(self) -> dict:
        d = {"name": self.name, "first": self.first, "count": self.count,
             "bytes": self.bytes, "sha256": self.sha256}
        if self.crc32c is not None:
            d["crc32c"] = self.crc32c
        return d


def shard_name(index: int, storage: str) -> str:
    return f"shard-{index:05d}{SHARD_EXT[storage]}"


def partial_name(name: str) -> str:
    """The temporary name a shard (or a staged file: ``name`` may be a relative path
    ``a/b/f``) is written under, in the same directory, before it is verified and renamed."""
    head, base = os.path.split(name)
    return os.path.join(head, f".{base}{PARTIAL_SUFFIX}")


class Manifest:
    """A parsed ``manifest.json``. Build one with :func:`load` or :meth:`from_json`."""

    def __init__(self, doc: dict, raw: bytes | None = None):
        self.doc = doc
        self.raw = raw
        self.storage: str = doc["storage"]
        self.encoding: str = doc["encoding"]
        self.num_samples: int = int(doc["num_samples"])
        self.keys: list[str] = list(doc["keys"])
        self.labels: list[int] | None = doc.get("labels")
        self.classes: list[str] | None = doc.get("classes")
        self.dtype: str | None = doc.get("dtype")
        self.shape: tuple | None = tuple(doc["shape"]) if doc.get("shape") is not None else None
        self.shards: list[Shard] = [Shard(i, **s) for i, s in enumerate(doc["shards"])]
        self._firsts = [s.first for s in self.shards]

    # -- construction -----------------------------------------------------------------------
    @classmethod
    def from_json(cls, raw: bytes | str, where: str = "manifest") -> "Manifest":
        if isinstance(raw, str):
            raw = raw.encode()
        try:
            doc = json.loads(raw)
        except ValueError as exc:
            raise DatasetError(f"{where}: not valid JSON ({exc}); the file is truncated or not "
                               f"an hpcddp manifest") from None
        validate(doc, where)
        return cls(doc, raw)

    def dumps(self) -> bytes:
        return dumps(self.doc)

    # -- queries ----------------------------------------------------------------------------
    @property
    def total_bytes(self) -> int:
        """Bytes of all shard files (the manifest itself not included)."""
        return sum(s.bytes for s in self.shards)

    def shard_of(self, index: int) -> Shard:
        """The shard holding global sample ``index``."""
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample index {index} out of range for a data set of "
                             f"{self.num_samples} samples")
        return self.shards[bisect.bisect_right(self._firsts, index) - 1]

    def indices_of(self, shards: Iterable[int]) -> list[int]:
        """Global sample indices held by the given shard indices, ascending."""
        out: list[int] = []
        for s in sorted(set(shards)):
            sh = self.shards[s]
            out.extend(range(sh.first, sh.first + sh.count))
        return out

    def __repr__(self) -> str:
        return (f"Manifest(storage={self.storage!r}, encoding={self.encoding!r}, "
                f"samples={self.num_samples}, shards={len(self.shards)}, bytes={self.total_bytes})")


def dumps(doc: dict) -> bytes:
    """Canonical JSON: sorted keys, fixed separators, trailing newline (deterministic bytes)."""
    return (json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True) + "\n").encode()


def validate(doc, where: str = "manifest") -> None:
    """Check a manifest document's shape; raise DatasetError naming the first problem."""
    def bad(msg):
        raise DatasetError(f"{where}: {msg}")
    if not isinstance(doc, dict):
        bad(f"expected a JSON object, got {type(doc).__name__}")
    if doc.get("format") != FORMAT:
        bad(f"format is {doc.get('format')!r}, expected {FORMAT!r}: not an hpcddp data set "
            f"(make one with `hpcddp pack`)")
    v = doc.get("format_version")
    if v != FORMAT_VERSION:
        bad(f"format_version is {v!r}; this hpcddp reads version {FORMAT_VERSION}: re-pack the "
            f"data set with this hpcddp or use the hpcddp that wrote it")
    if doc.get("storage") not in STORAGES:
        bad(f"storage is {doc.get('storage')!r}, expected one of {list(STORAGES)}")
    if doc.get("encoding") not in ENCODINGS:
        bad(f"encoding is {doc.get('encoding')!r}, expected one of {list(ENCODINGS)}")
    n = doc.get("num_samples")
    if not isinstance(n, int) or n < 0:
        bad(f"num_samples is {n!r}, expected a non-negative int")
    keys = doc.get("keys")
    if not isinstance(keys, list) or len(keys) != n:
        bad(f"keys has {len(keys) if isinstance(keys, list) else keys!r} entries, expected {n}")
    labels = doc.get("labels")
    if labels is not None and (not isinstance(labels, list) or len(labels) != n):
        bad(f"labels has {len(labels) if isinstance(labels, list) else labels!r} entries, "
            f"expected {n} (or null)")
    if doc["encoding"] == "array" and (doc.get("dtype") is None or doc.get("shape") is None):
        bad("encoding 'array' needs dtype and shape")
    shards = doc.get("shards")
    if not isinstance(shards, list):
        bad("shards is missing or not a list")
    expect_first = 0
    for i, s in enumerate(shards):
        need = ("name", "first", "count", "bytes", "sha256")
        if not isinstance(s, dict) or any(k not in s for k in need):
            bad(f"shards[{i}] must have {list(need)}, got {s!r}")
        if s["first"] != expect_first or s["count"] < 1 or s["bytes"] < 0:
            bad(f"shards[{i}] covers samples {s['first']}..{s['first'] + s['count'] - 1} with "
                f"{s['bytes']} bytes; expected to start at {expect_first} with count >= 1")
        # Names become paths under the source and the destination (staging writes DEST/name
        # and DEST/.name.partial): a name that leaves the directory or takes the place of the
        # manifest or a marker is refused before anything is read or written.
        name = s["name"]
        if (not isinstance(name, str) or not name or os.path.basename(name) != name
                or name.startswith(".") or "\0" in name or name in RESERVED_NAMES):
            bad(f"shards[{i}].name {name!r} must be a plain file name (no '/', not starting "
                f"with '.', not one of {sorted(RESERVED_NAMES)})")
        c = s.get("crc32c")
        if c is not None and not (isinstance(c, str) and re.fullmatch(r"[0-9a-f]{8}", c)):
            bad(f"shards[{i}].crc32c is {c!r}, expected 8 lowercase hex digits")
        expect_first += s["count"]
    if expect_first != n:
        bad(f"shards hold {expect_first} samples, num_samples says {n}")


def load(path: str, where: str | None = None) -> Manifest:
    """Read ``DIR/manifest.json`` (or a manifest file given directly)."""
    mpath = os.path.join(path, MANIFEST) if os.path.isdir(path) else path
    where = where or mpath
    try:
        with open(mpath, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        d = os.path.dirname(mpath)
        if os.path.exists(os.path.join(d, STAGING)):
            raise NotReadyError(
                f"{where}: no {MANIFEST} yet: {d} is a half-staged copy ({STAGING} present, no "
                f"{READY}): a stager is still running or died before finishing; re-run `hpcddp "
                f"stage SRC {d}` to complete it (verified shards are kept)") from None
        hint = "; make a data set with `hpcddp pack`" if os.path.isdir(d) else ""
        raise DatasetError(f"{where}: no {MANIFEST}{hint}") from None
    return Manifest.from_json(raw, where)


def write_atomic(path: str, data: bytes, fsync: bool = False) -> None:
    """Write ``data`` to ``path`` through a temporary name and a rename.

    The temporary name is random and created with ``O_EXCL``: a name someone planted in a
    directory they can write (a symlink to one of your files) is never written through
    (docs/security.md). Its mode is what open() gives (0666 less the umask).
    """
    tmp = f"{path}.tmp{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def _scan(path: str, fns, block: int = HASH_BLOCK) -> None:
    """Feed the file's bytes to each fn, ``block`` bytes at a time.

    Through a read-only mapping (no copy out of the page cache: checking a just-written
    shard costs the checksum alone); read() where a file cannot be mapped.
    """
    import mmap
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return
        try:
            mm = mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                           prot=mmap.PROT_READ)
        except (OSError, ValueError, AttributeError):
            mm = None
        if mm is not None:
            view = memoryview(mm)
            try:
                for off in range(0, size, block):
                    # each slice is released explicitly: a slice left to the garbage collector
                    # keeps an export on the mapping, and mmap.close() then raises BufferError
                    part = view[off:off + block]
                    try:
                        for fn in fns:
                            fn(part)
                    finally:
                        part.release()
            finally:
                view.release()
                try:
                    mm.close()
                except BufferError:  # still exported somewhere: unmapped when last freed
                    pass
            return
        buf = bytearray(block)
        view = memoryview(buf)
        while True:
            n = f.readinto(buf)
            if not n:
                break
            for fn in fns:
                fn(view[:n])


def file_sha256(path: str, block: int = HASH_BLOCK) -> str:
    h = hashlib.sha256()
    _scan(path, [h.update], block)
    return h.hexdigest()


def file_digests(path: str) -> tuple[str, str]:
    """(sha256, crc32c) of a file in one read."""
    h = hashlib.sha256()
    c = Checker(None)
    _scan(path, [h.update, c.update])
    return h.hexdigest(), c.hexdigest()


class Checker:
    """Running checksum of a shard as it is copied: CRC-32C when the manifest has one, else
    SHA-256 (manifests written without it).

    CRC-32C (Castagnoli) because CPUs compute it in hardware (SSE4.2 ``crc32``, ARMv8 CRC):
    the ``crc32c`` package measured 12.7 GB/s here, against 3.2 GB/s for zlib's CRC-32 and
    1.8 GB/s for SHA-256. Every staged byte is checked on the node that writes it, so the
    check's speed is the stager's speed on a node with one core to spare (docs/data.md).
    SHA-256 stays in the manifest as the data set's identity (``Dataset.verify``).
    """

    __slots__ = ("shard", "_crc", "_sha")

    def __init__(self, shard: "Shard | None"):
        self.shard = shard
        self._crc = 0
        self._sha = None
        if shard is not None and shard.crc32c is None:
            self._sha = hashlib.sha256()

    @property
    def kind(self) -> str:
        return "sha256" if self._sha is not None else "crc32c"

    def update(self, data) -> None:
        if self._sha is not None:
            self._sha.update(data)
        else:
            self._crc = _crc32c(data, self._crc)

    def hexdigest(self) -> str:
        return self._sha.hexdigest() if self._sha is not None else f"{self._crc & 0xFFFFFFFF:08x}"

    def expected(self) -> str:
        return self.shard.sha256 if self._sha is not None else self.shard.crc32c

    def ok(self) -> bool:
        return self.hexdigest() == self.expected()


def file_matches(path: str, shard: "Shard") -> bool:
    """Does the file hold this shard (fast checksum: CRC-32C when recorded, else SHA-256)?"""
    return file_checker(path, shard).ok()


def file_checker(path: str, shard: "Shard") -> Checker:
    """A :class:`Checker` fed the whole file: ``.ok()``, ``.hexdigest()``, ``.expected()``."""
    c = Checker(shard)
    _scan(path, [c.update])
    return c


def _stat_of(path: str, st: os.stat_result | None = None) -> dict:
    st = st or os.stat(path)
    return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns,
            "ino": st.st_ino}


def shard_stats(directory: str, m: "Manifest", indices: Iterable[int]) -> dict:
    """{shard name: its size, mtime, ctime and inode} for the given shards in ``directory``:
    what READY records, so that a later ``--verify auto`` hashes the shards changed since."""
    return {m.shards[i].name: _stat_of(os.path.join(directory, m.shards[i].name))
            for i in sorted(indices)}


def stat_matches(path: str, recorded: dict | None, before_ns: int | None = None,
                 st: os.stat_result | None = None) -> bool:
    """Is the file's stat still the one recorded (False when none was)?

    Any write changes mtime and ctime (ctime cannot be set back by ``touch``/``os.utime``);
    a replaced file has another inode. ``before_ns``: the recording's own time (READY's
    mtime); a file whose recorded mtime is not older than it is not vouched for, because
    file times tick coarsely (a jiffy on many kernels) and a write within the same tick as
    the recording would leave them unchanged (git's "racily clean" rule). ``st``: the file's
    stat when the caller has it already (a tree of 100,000 files is stat'ed once, not twice).
    """
    if not recorded:
        return False
    if before_ns is not None and recorded.get("mtime_ns", before_ns) >= before_ns:
        return False
    try:
        return _stat_of(path, st) == recorded
    except OSError:
        return False


def marker_mtime_ns(path: str, name: str) -> int | None:
    """The mtime of marker ``name`` in directory ``path`` (ns), or None if absent."""
    try:
        return os.stat(os.path.join(path, name)).st_mtime_ns
    except OSError:
        return None


def read_marker(path: str, name: str) -> dict | None:
    """The JSON content of marker ``name`` in directory ``path``, or None if absent."""
    try:
        with open(os.path.join(path, name), "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    try:
        return json.loads(raw or b"{}")
    except ValueError:
        return {}


def _stager_state(staging: dict) -> str:
    """What the STAGING marker's writer is doing now, as far as this host can tell."""
    from hpcddp.data.destlock import describe, holder_alive
    alive = holder_alive(staging)
    if alive is None:
        return (f"the stager ({describe(staging)}) is still running or died before finishing"
                if "pid" in staging else "a stager is still running or died before finishing")
    if alive:
        return f"its stager ({describe(staging)}) is still running"
    return f"its stager ({describe(staging)}) died before finishing"


def check_ready(path: str, who: str, shards: Sequence[Shard] | None = None) -> dict | None:
    """Refuse a half-staged copy; return the READY document of a staged copy (None: a pack).

    A directory is usable when no stager is working in it (no ``STAGING``) and the shards
    it should hold are present with their recorded sizes (a stat each; no hashing).
    """
    staging = read_marker(path, STAGING)
    if staging is not None:
        since = staging.get("started", "?")
        raise NotReadyError(
            f"{who}: {path} is a half-staged copy ({STAGING} marker from {since}, no {READY}): "
            f"{_stager_state(staging)}; re-run `hpcddp stage SRC {path}` to complete it "
            f"(verified shards are kept), or read the source instead")
    ready = read_marker(path, READY)
    if shards is not None:
        local = None if ready is None or ready.get("local_shards") is None else set(ready["local_shards"])
        for s in shards:
            if local is not None and s.index not in local:
                continue
            fp = os.path.join(path, s.name)
            try:
                size = os.stat(fp).st_size
            except FileNotFoundError:
                raise DatasetError(
                    f"{who}: shard {s.name} is missing from {path} (manifest lists "
                    f"{len(shards)} shards): an incomplete copy; re-run `hpcddp stage` or "
                    f"re-pack") from None
            if size != s.bytes:
                raise DatasetError(
                    f"{who}: shard {s.name} in {path} has {size} bytes, the manifest says "
                    f"{s.bytes}: a truncated or corrupted copy; re-run `hpcddp stage` (it "
                    f"re-verifies and replaces bad shards)")
    return ready
