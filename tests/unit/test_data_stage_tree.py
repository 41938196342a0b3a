"""Staging a plain tree, without MPI: the listing and what it refuses, the batching of small
files into chunks, what a re-run keeps, and the reader's CRC and changed-file verdicts."""
from __future__ import annotations

import os
import pathlib
import socket
import stat
import tempfile

import pytest

from hpcddp.data import _staging_files as ft
from hpcddp.data import _staging_io as io
from hpcddp.data import manifest as mf
from hpcddp.data._staging_plan import MAX_PIECES, pack_chunks


def _tree(root):
    (root / "a" / "b" / "c" / "d").mkdir(parents=True)
    (root / "empty-dir").mkdir()
    (root / "top.bin").write_bytes(b"x" * 10)
    (root / "a" / "zero").write_bytes(b"")
    (root / "a" / "b" / "c" / "d" / "deep.bin").write_bytes(b"deep")
    os.chmod(root / "top.bin", 0o640)
    return root


# -- the listing ------------------------------------------------------------------------------

def test_list_tree_sorted_with_sizes_mtimes_modes_and_empty_dirs(tmp_path):
    root = _tree(tmp_path / "src")
    dirs, files = ft.list_tree(str(root))
    assert dirs == ["a", "a/b", "a/b/c", "a/b/c/d", "empty-dir"]
    assert [f[0] for f in files] == ["a/b/c/d/deep.bin", "a/zero", "top.bin"]
    top = files[2]
    assert top[1] == 10 and top[2] == os.stat(root / "top.bin").st_mtime_ns and top[3] == 0o640
    tree = ft.FileTree.from_json(ft.dumps_listing(dirs, files))
    assert [f.name for f in tree.shards] == [f[0] for f in files]
    assert tree.total_bytes == 14 and tree.num_samples == 3 and tree.dirs == dirs
    assert ft.dumps_listing(dirs, files) == ft.dumps_listing(*ft.list_tree(str(root)))


def test_list_tree_refuses_symlinks_naming_them(tmp_path):
    root = _tree(tmp_path / "src")
    os.symlink("../top.bin", root / "a" / "inside")
    os.symlink("/etc/hostname", root / "outside")
    with pytest.raises(ValueError) as exc:
        ft.list_tree(str(root))
    msg = str(exc.value)
    assert msg.startswith("stage: files=True: ") and "is a symbolic link" in msg
    assert "(and 1 more entries refused)" in msg and "cp -rL" in msg
    assert f"{root}/a/inside is a symbolic link (to '../top.bin')" in msg or \
        f"{root}/outside is a symbolic link (to '/etc/hostname')" in msg


def test_list_tree_refuses_special_files(tmp_path):
    root = _tree(tmp_path / "src")
    os.mkfifo(root / "a" / "pipe")
    with pytest.raises(ValueError, match=r"a/pipe is a FIFO \(named pipe\); special files"):
        ft.list_tree(str(root))
    os.remove(root / "a" / "pipe")
    # a tree under a short path: pytest's tmp_path can pass AF_UNIX's 108-byte limit
    with tempfile.TemporaryDirectory(dir="/tmp") as short, \
            socket.socket(socket.AF_UNIX) as s:
        root = _tree(pathlib.Path(short) / "src")
        s.bind(str(root / "sock"))
        with pytest.raises(ValueError, match=r"sock is a socket"):
            ft.list_tree(str(root))


@pytest.mark.parametrize("name", ["READY", "STAGING", ".hpcddp-stage.lock"])
def test_list_tree_refuses_the_markers_names_at_the_top_only(tmp_path, name):
    root = _tree(tmp_path / "src")
    (root / "a" / name).write_bytes(b"fine below the top")
    assert ft.list_tree(str(root))
    (root / name).write_bytes(b"")
    with pytest.raises(ValueError, match=f"the name '{name}' is reserved at the top"):
        ft.list_tree(str(root))


def test_list_tree_refuses_a_name_a_siblings_temporary_name_takes(tmp_path):
    root = _tree(tmp_path / "src")
    (root / "a" / ".lonely.partial").write_bytes(b"no sibling 'lonely': fine")
    assert ft.list_tree(str(root))
    (root / "a" / ".zero.partial").write_bytes(b"")
    with pytest.raises(ValueError, match=r"'\.zero\.partial' is the temporary name"):
        ft.list_tree(str(root))


def test_list_tree_refuses_what_is_not_a_directory(tmp_path):
    (tmp_path / "f").write_bytes(b"")
    with pytest.raises(ValueError, match=r"SRC '.*/f' is not a directory; expected a directory"):
        ft.list_tree(str(tmp_path / "f"))
    with pytest.raises(ValueError, match=r"does not exist"):
        ft.list_tree(str(tmp_path / "nope"))


def test_partial_names_nest():
    assert mf.partial_name("shard-00001.lmdb") == ".shard-00001.lmdb.partial"
    assert mf.partial_name("a/b/f.h5") == "a/b/.f.h5.partial"
    assert ft.partial_base(".f.h5.partial") == "f.h5"
    assert ft.partial_base(".f.h5.partial.r3") == "f.h5"
    assert ft.partial_base("f.h5") is None and ft.partial_base(".partial") is None


# -- batching ---------------------------------------------------------------------------------

def _check_chunks(chunks, sizes, items, chunk, max_pieces=MAX_PIECES):
    got = {s: [] for s in items}
    for c in chunks:
        assert c and len(c) <= max_pieces
        assert sum(p[3] for p in c) <= chunk
        fill = 0
        for (s, off, start, n, last) in c:
            assert start == fill          # end to end in the buffer
            fill += n
            got[s].append((off, n, last))
    for s in items:                       # each item covered exactly, once, in order
        pieces = got[s]
        assert [o for o, _, _ in pieces] == [sum(n for _, n, _ in pieces[:i]) for i in range(len(pieces))]
        assert sum(n for _, n, _ in pieces) == sizes[s]
        assert [last for *_, last in pieces] == [False] * (len(pieces) - 1) + [True]


def test_small_files_share_a_chunk():
    sizes = [1024] * 100
    chunks = pack_chunks(list(range(100)), sizes, 16 << 10)
    assert len(chunks) == 7 and [len(c) for c in chunks] == [16] * 6 + [4]
    _check_chunks(chunks, sizes, range(100), 16 << 10)


def test_large_files_span_chunks_and_empty_files_are_one_piece():
    sizes = [0, 10_000, 0, 3, 4096, 0]
    chunks = pack_chunks(list(range(6)), sizes, 4096)
    _check_chunks(chunks, sizes, range(6), 4096)
    assert len(chunks) == 4                         # 14,099 bytes in 4 KiB chunks
    assert chunks[0][0] == (0, 0, 0, 0, True)       # an empty file: one empty piece


def test_pieces_per_chunk_are_capped():
    sizes = [0] * 10 + [1] * 10
    chunks = pack_chunks(list(range(20)), sizes, 1 << 20, max_pieces=4)
    assert [len(c) for c in chunks] == [4, 4, 4, 4, 4]
    _check_chunks(chunks, sizes, range(20), 1 << 20, max_pieces=4)
    assert pack_chunks([], [], 10) == []


def test_a_subset_of_items_keeps_its_order():
    sizes = [5, 7, 9, 11]
    chunks = pack_chunks([1, 3], sizes, 8)
    _check_chunks(chunks, sizes, [1, 3], 8)
    assert [p[0] for c in chunks for p in c] == [1, 3, 3, 3]


# -- what a re-run keeps ----------------------------------------------------------------------

def _staged_copy(src, dest):
    """dest as a finished copy of src would be: same bytes, modes and mtimes."""
    dirs, files = ft.list_tree(str(src))
    tree = ft.FileTree(dirs, files)
    ft.make_dirs(str(dest), dirs)
    for f in tree.shards:
        p = dest / f.name
        p.write_bytes((src / f.name).read_bytes())
        os.utime(p, ns=(f.mtime_ns, f.mtime_ns))
    raw = ft.dumps_listing(dirs, files)
    return tree, raw


def test_inspect_keeps_files_with_the_sources_size_and_mtime(tmp_path):
    src, dest = _tree(tmp_path / "src"), tmp_path / "dst"
    dest.mkdir()
    tree, raw = _staged_copy(src, dest)
    everything = list(range(len(tree.shards)))
    have, todo, stale, _ = ft.inspect_files(str(dest), tree, everything, "auto", raw, "sha")
    assert (have, todo, stale) == (everything, [], [])
    # a copy whose mtime differs from the source's, a leftover temporary file, a missing file
    os.utime(dest / "top.bin", ns=(1, 1))
    (dest / "a" / ".zero.partial.r1").write_bytes(b"half")
    os.remove(dest / "a" / "b" / "c" / "d" / "deep.bin")
    have, todo, stale, reclaim = ft.inspect_files(str(dest), tree, everything, "auto", raw, "sha")
    names = {f.name: f.index for f in tree.shards}
    assert have == [names["a/zero"]]
    assert sorted(todo) == sorted([names["top.bin"], names["a/b/c/d/deep.bin"]])
    assert sorted(stale) == ["a/.zero.partial.r1", "top.bin"] and reclaim == 8192
    # size only: the mtime is not looked at; full: nothing is kept (no checksum in advance)
    have, *_ = ft.inspect_files(str(dest), tree, everything, "size", raw, "sha")
    assert sorted(have) == sorted([names["a/zero"], names["top.bin"]])
    have, todo, *_ = ft.inspect_files(str(dest), tree, everything, "full", raw, "sha")
    assert have == [] and len(todo) == 3


def test_make_dirs_refuses_a_planted_link(tmp_path):
    dest = tmp_path / "dst"
    dest.mkdir()
    os.symlink(tmp_path, dest / "a")
    with pytest.raises(OSError, match=r"/dst/a is a symbolic link, where the source has a directory"):
        ft.make_dirs(str(dest), ["a", "a/b"])
    assert not ft.dirs_present(str(dest), ["a"])


# -- the reader: the CRC travels, a changed file is named ------------------------------------

def _read_all(src, tree, chunk):
    chunks = pack_chunks(list(range(len(tree.shards))), [f.bytes for f in tree.shards], chunk)
    pool = io.slot_pool(chunk, 4)
    reader = io.Reader(str(src), tree.shards, chunks, pool, 0, files=True)
    reader.start()
    verdicts, data = [], {}
    for pieces in chunks:
        slot, v = reader.next()
        verdicts += v
        for (s, off, start, n, last) in pieces:
            data.setdefault(s, bytearray()).extend(bytes(slot.buf[start:start + n]))
        pool.put(slot)
    reader.join(timeout=10)
    return verdicts, data


def test_reader_sends_each_files_crc_and_names_a_changed_file(tmp_path):
    src = _tree(tmp_path / "src")
    (src / "big").write_bytes(os.urandom(10_000))
    tree = ft.FileTree(*ft.list_tree(str(src)))
    verdicts, data = _read_all(src, tree, 4096)
    for f, (status, crc) in zip(tree.shards, verdicts):
        body = (src / f.name).read_bytes()
        assert status is None and bytes(data[f.index]) == body
        c = mf.Checker(None)
        c.update(body)
        assert crc == c.hexdigest()
    # changed after listing: grown, or same size with another mtime
    with open(src / "big", "ab") as fh:
        fh.write(b"more")
    os.utime(src / "top.bin", ns=(5, 5))
    verdicts, _ = _read_all(src, tree, 4096)
    by_name = {f.name: v for f, v in zip(tree.shards, verdicts)}
    assert "big changed during the copy (its size went from 10000 to 10004 bytes" in by_name["big"][0]
    assert "top.bin changed during the copy (its mtime changed" in by_name["top.bin"][0]
    assert by_name["a/zero"][0] is None
    # replaced by a FIFO since the listing: named, and never a blocked open
    os.remove(src / "a" / "zero")
    os.mkfifo(src / "a" / "zero")
    verdicts, _ = _read_all(src, tree, 4096)
    status = {f.name: v for f, v in zip(tree.shards, verdicts)}["a/zero"][0]
    assert "a/zero is no longer a regular file" in status
    assert stat.S_ISFIFO(os.lstat(src / "a" / "zero").st_mode)
