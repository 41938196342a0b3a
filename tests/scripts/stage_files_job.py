"""`stage(..., files=True)` end to end inside one job, every rank checking its own node
(tests/test_data_stage_files.py): one launch runs every scenario, since each launch costs
seconds on a small machine and each stage here takes milliseconds.

    HPCDDP_RANKS_PER_NODE=1 mpirun -n N python tests/scripts/stage_files_job.py SRC WORK

SRC: the tree the test built (deep, empty files and directories, many small files, files
larger than the chunk); SRC-link and SRC-fifo beside it hold a symbolic link / a FIFO.
Each rank prints "[rankR] stage_files_job: ok" at the end; any failed check raises (and
hpcddp's abort on exception ends the whole job).
"""
import os
import stat
import sys

import hpcddp
from hpcddp.data import StageError, stage
from hpcddp.data import _staging_files as ft
from hpcddp.data import manifest as mf

CHUNK = 16 << 10


def same_tree(src: str, dst: str) -> None:
    """dst holds src file for file: bytes, permission bits, mtimes, empty directories;
    READY, no STAGING, no temporary names."""
    dirs, files = ft.list_tree(src)
    for d in dirs:
        assert os.path.isdir(os.path.join(dst, d)), d
    for name, size, mtime_ns, mode in files:
        p = os.path.join(dst, name)
        st = os.lstat(p)
        assert stat.S_ISREG(st.st_mode) and st.st_size == size, name
        assert st.st_mtime_ns == mtime_ns and stat.S_IMODE(st.st_mode) == mode, name
        with open(p, "rb") as a, open(os.path.join(src, name), "rb") as b:
            assert a.read() == b.read(), name
    assert os.path.exists(os.path.join(dst, mf.READY))
    assert not os.path.exists(os.path.join(dst, mf.STAGING))
    for root, _, names in os.walk(dst):
        assert not [n for n in names if ft.partial_base(n)], (root, names)


def main() -> int:
    src, work = sys.argv[1], sys.argv[2]
    rt = hpcddp.init(set_cuda_device=False, abort_on_exception=True)
    world, node, nodes = rt.world.mpi, rt.topology.node, rt.topology.num_nodes
    rank = world.Get_rank()
    dirs, files = ft.list_tree(src)
    nfiles, total = len(files), sum(f[1] for f in files)
    dest = os.path.join(work, "r-{node}")
    mine = os.path.join(work, f"r-{node}")

    # 1. replicate, ring (auto for a few nodes): every node gets everything, read once
    res = stage(src, dest, files=True, chunk_bytes=CHUNK, progress=False)
    assert res.files and res.strategy == "ring" and res.num_shards == nfiles
    assert res.bytes_read_from_source == total == res.dataset_bytes, res.as_dict()
    assert res.shards_copied == nfiles * nodes and res.bytes_written == total * nodes
    same_tree(src, mine)
    ready_ns = os.stat(os.path.join(mine, mf.READY)).st_mtime_ns

    # 2. a re-run finds everything in place: nothing read, READY left alone
    res = stage(src, dest, files=True, chunk_bytes=CHUNK, progress=False)
    assert res.shards_copied == 0 and res.shards_skipped == nfiles * nodes
    assert res.bytes_read_from_source == 0
    assert os.stat(os.path.join(mine, mf.READY)).st_mtime_ns == ready_ns

    # 3. a source file rewritten (same size, new mtime); the last node lost a file and has a
    #    truncated one, a leftover temporary file: a bcast re-run copies exactly those
    world.Barrier()
    if rank == 0:
        p = os.path.join(src, "small", "d00", "f0007.bin")
        with open(p, "r+b") as f:
            f.write(b"changed!")
        os.utime(p, ns=(10**18, 10**18))
    if node == nodes - 1:
        os.remove(os.path.join(mine, "big", "large-1.bin"))
        os.truncate(os.path.join(mine, "small", "d00", "f0001.bin"), 10)
        with open(os.path.join(mine, "small", "d00", ".f0002.bin.partial"), "wb") as f:
            f.write(b"half")
    world.Barrier()
    res = stage(src, dest, files=True, chunk_bytes=CHUNK, strategy="bcast", progress=False)
    assert res.shards_copied == nodes + 2, res.as_dict()
    same_tree(src, mine)

    # 4. partition: node j gets the j-th byte-balanced range of files; together all of them
    res = stage(src, os.path.join(work, "p-{node}"), files=True, mode="partition",
                chunk_bytes=CHUNK, progress=False)
    assert res.bytes_read_from_source == total and res.shards_copied == nfiles
    here = [f for f in files if os.path.exists(os.path.join(work, f"p-{node}", f[0]))]
    counts = world.allgather(len(here))
    assert sum(counts) == nfiles and (nodes == 1 or min(counts) > 0), counts

    # 5. refused, on every rank with the same message, nothing written: a link, a FIFO, a
    #    destination inside the tree
    for bad, what in ((src + "-link", "is a symbolic link (to '../big')"),
                      (src + "-fifo", "is a FIFO (named pipe)")):
        try:
            stage(bad, os.path.join(work, "bad-{node}"), files=True, progress=False)
            raise AssertionError(f"{bad} was staged")
        except StageError as exc:
            assert what in str(exc), str(exc)
            assert len(set(world.allgather(str(exc)))) == 1
        assert not os.path.exists(os.path.join(work, f"bad-{node}", mf.STAGING))
    try:
        stage(src, os.path.join(src, "copy-{node}"), files=True, progress=False)
        raise AssertionError("a tree was staged into itself")
    except StageError as exc:
        assert "is inside SRC" in str(exc), str(exc)
    assert not os.path.exists(os.path.join(src, f"copy-{node}"))

    # 6. a file changed between the listing and its read: named, nothing READY, then a re-run
    listing, changing = ft.list_tree, os.path.join(src, "big", "large-0.bin")

    def list_then_append(path):
        out = listing(path)
        with open(changing, "ab") as f:
            f.write(b"appended while staging")
        return out
    ft.list_tree = list_then_append
    try:
        stage(src, os.path.join(work, "c-{node}"), files=True, chunk_bytes=CHUNK, progress=False)
        raise AssertionError("a file changed during the copy was staged")
    except StageError as exc:
        assert "big/large-0.bin changed during the copy (its size went from" in str(exc), str(exc)
        assert "nothing marked READY" in str(exc)
    finally:
        ft.list_tree = listing
    assert not os.path.exists(os.path.join(work, f"c-{node}", mf.READY))
    assert not os.path.exists(os.path.join(work, f"c-{node}", "big", "large-0.bin"))
    res = stage(src, os.path.join(work, "c-{node}"), files=True, chunk_bytes=CHUNK,
                progress=False)
    same_tree(src, os.path.join(work, f"c-{node}"))

    print(f"[rank{rank}] stage_files_job: ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
