"""Staging a plain directory tree (``stage(..., files=True)``, ``hpcddp stage --files``).

A tree has no manifest: its listing takes the manifest's place. One rank per node group lists
the source (:func:`list_tree`); the listing (every directory, and every regular file's relative
path, size, mtime and permission bits, sorted) travels to the group as canonical JSON, and the
plan, the exchange and finalize run on it as on a packed data set's shards
(:class:`FileTree` answers what they ask of a manifest). What differs, and why:

* **No checksum in advance.** The rank that reads a file computes its CRC-32C from the bytes
  it read, and the CRC travels with the file's last piece; every node compares it with the
  CRC of the bytes it writes, then gives the file its final name.
* **Resume** cannot hash a present file against a manifest, so a file counts as in place
  when it has its final name (given only once verified), the source's size and the source's
  mtime (set on the copy before the rename: rsync's quick check); while a READY for the same
  listing exists, also the stat READY recorded. ``verify="full"`` copies every file again.
* **What is refused**, named, before anything is written: symbolic links, special files
  (FIFOs, sockets, devices), names that the markers or the lock take at the top of the
  tree, and names that a sibling's temporary name would take. A file whose size or mtime
  changes between the listing and the end of its read fails the stage, named.

Pure functions over the file system: no MPI here.
"""
from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass

from hpcddp.data import manifest as mf

FORMAT = "hpcddp-files"
FILES_LIST_VERSION = 1


@dataclass(frozen=True)
class FileEntry:
    """One regular file of a staged tree: what the copy phases read of a manifest's shard
    (index, name, bytes), plus what the copy keeps of the source file (mtime, mode)."""
    index: int
    name: str         # path relative to the tree's root, '/'-separated
    bytes: int
    mtime_ns: int
    mode: int         # permission bits (stat.S_IMODE)
    crc32c = None     # no checksum in advance: the reader's travels with the bytes


class FileTree:
    """A listed source tree, in the place of a packed data set's manifest."""

    def __init__(self, dirs: list[str], files: list):
        self.dirs = list(dirs)
        self.shards = [FileEntry(i, *f) for i, f in enumerate(files)]

    @classmethod
    def from_json(cls, raw: bytes) -> "FileTree":
        doc = json.loads(raw)
        return cls(doc["dirs"], [tuple(f) for f in doc["files"]])

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.shards)

    @property
    def num_samples(self) -> int:       # StageResult's count: files
        return len(self.shards)


def dumps_listing(dirs: list[str], files: list) -> bytes:
    """The listing's canonical bytes: what READY's ``manifest_sha256`` identifies."""
    return mf.dumps({"format": FORMAT, "version": FILES_LIST_VERSION, "dirs": dirs,
                     "files": [list(f) for f in files]})


_KINDS = {stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFSOCK: "a socket",
          stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device"}
RESERVED_TOP = frozenset({mf.READY, mf.STAGING, ".hpcddp-stage.lock"})


def list_tree(src: str) -> tuple[list[str], list[tuple]]:
    """(directories, files) under ``src``, sorted by relative path; each file is
    ``(path, bytes, mtime_ns, mode)``. Raises ValueError naming the first entry refused
    (and how many more) or OSError (a directory that cannot be read)."""
    if not os.path.isdir(src):
        what = "does not exist" if not os.path.lexists(src) else "is not a directory"
        raise ValueError(f"stage: files=True: SRC {src!r} {what}; expected a directory tree")
    dirs: list[str] = []
    files: list[tuple] = []
    problems: list[str] = []
    todo = [""]
    while todo:
        rel = todo.pop()
        with os.scandir(os.path.join(src, rel)) as it:
            entries = sorted(it, key=lambda e: e.name)   # the same first problem every run
        names = {e.name for e in entries}
        for e in entries:
            path = f"{rel}/{e.name}" if rel else e.name
            st = e.stat(follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                dirs.append(path)
                todo.append(path)
            elif stat.S_ISREG(st.st_mode):
                why = _name_refused(rel, e.name, names)
                if why:
                    problems.append(f"{os.path.join(src, path)}: {why}")
                files.append((path, st.st_size, st.st_mtime_ns, stat.S_IMODE(st.st_mode)))
            elif stat.S_ISLNK(st.st_mode):
                problems.append(
                    f"{os.path.join(src, path)} is a symbolic link (to {os.readlink(e.path)!r}); "
                    f"links are refused: one pointing out of the tree would leave the nodes "
                    f"reading the shared file system, one pointing in names data staged "
                    f"anyway; replace it by what it points to (a copy made with `cp -rL`) or "
                    f"remove it")
            else:
                kind = _KINDS.get(stat.S_IFMT(st.st_mode), "not a regular file")
                problems.append(f"{os.path.join(src, path)} is {kind}; special files (FIFOs, "
                                f"sockets, devices) are refused: they hold no data to copy; "
                                f"remove it or stage a directory without it")
    if problems:
        more = f" (and {len(problems) - 1} more entries refused)" if len(problems) > 1 else ""
        raise ValueError(f"stage: files=True: {problems[0]}{more}")
    dirs.sort()
    files.sort()
    return dirs, files


def _name_refused(rel: str, name: str, siblings: set) -> str | None:
    """Why a regular file's name cannot be staged, or None."""
    if not rel and name in RESERVED_TOP:
        return (f"the name {name!r} is reserved at the top of a staged tree (the markers "
                f"{mf.READY} and {mf.STAGING}, the lock .hpcddp-stage.lock); rename it, or "
                f"stage the directory above")
    base = partial_base(name)
    if base is not None and base in siblings:
        return (f"the name {name!r} is the temporary name the stager writes {base!r} under "
                f"(a re-run removes it as a leftover); rename it")
    return None


def partial_base(name: str) -> str | None:
    """For a temporary name ``.NAME.partial`` (``.NAME.partial.rN`` with every-rank), NAME."""
    if name.startswith(".") and mf.PARTIAL_SUFFIX in name[1:]:
        base = name[1:name.index(mf.PARTIAL_SUFFIX, 1)]
        return base or None
    return None


def inspect_files(dest: str, tree: FileTree, need: list[int], verify: str, raw: bytes,
                  ready_sha: str) -> tuple[list[int], list[int], list[str], int]:
    """(have, todo, stale, reclaimable bytes) for the files ``need`` in ``dest``.

    A present file is kept when it is a regular file with the source's size and (``auto``)
    mtime, and, while a READY for this very listing (``ready_sha``) vouches for the
    destination, with the stat READY recorded: a file written since, even with its mtime
    set back, has another ctime. Leftover temporary names of listed files are stale; a file
    of the right name but wrong size/mtime too. Nothing else in ``dest`` is touched.
    """
    ready = mf.read_marker(dest, mf.READY)
    trusted = (ready is not None and mf.read_marker(dest, mf.STAGING) is None
               and ready.get("manifest_sha256") == ready_sha)
    recorded = (ready.get("shard_stats") or {}) if trusted else {}
    ready_ns = mf.marker_mtime_ns(dest, mf.READY)
    by_dir: dict[str, list[int]] = {}
    for s in need:
        by_dir.setdefault(os.path.dirname(tree.shards[s].name), []).append(s)
    have, todo, stale = [], [], []
    reclaim = 0
    for d, idx in by_dir.items():
        try:
            present = set(os.listdir(os.path.join(dest, d)))
        except (FileNotFoundError, NotADirectoryError):
            present = set()
        wanted = {os.path.basename(tree.shards[s].name) for s in idx}
        for n in present:
            if partial_base(n) in wanted:
                p = os.path.join(dest, d, n)
                stale.append(os.path.join(d, n))
                reclaim += _blocks(os.lstat(p).st_size)
        for s in idx:
            f = tree.shards[s]
            if os.path.basename(f.name) not in present:
                todo.append(s)
                continue
            p = f"{dest}/{f.name}"
            st = os.lstat(p)
            ok = stat.S_ISREG(st.st_mode) and st.st_size == f.bytes and verify != "full"
            if ok and verify == "auto":
                ok = st.st_mtime_ns == f.mtime_ns and (
                    f.name not in recorded or mf.stat_matches(p, recorded[f.name], ready_ns, st))
            if ok:
                have.append(s)
                continue
            if not stat.S_ISDIR(st.st_mode):   # a directory in a file's place: the rename says so
                stale.append(f.name)
                reclaim += _blocks(st.st_size)
            todo.append(s)
    return have, todo, stale, reclaim


def make_dirs(dest: str, dirs: list[str]) -> None:
    """Create the tree's directories under ``dest`` (parents first: ``dirs`` is sorted).
    One that exists as a symbolic link is refused: writing through it would put files
    outside ``dest`` (a link planted there by someone else)."""
    for d in dirs:
        p = os.path.join(dest, d)
        try:
            os.mkdir(p)
        except FileExistsError:
            st = os.lstat(p)
            if not stat.S_ISDIR(st.st_mode):
                kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a directory"
                raise OSError(f"{p} is {kind}, where the source has a directory; remove it "
                              f"(nothing is written through it)") from None


def dirs_present(dest: str, dirs: list[str]) -> bool:
    return all(os.path.isdir(os.path.join(dest, d)) and not os.path.islink(os.path.join(dest, d))
               for d in dirs)


def _blocks(n: int) -> int:
    return ((n + 4095) // 4096) * 4096
