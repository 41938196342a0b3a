"""The stager's plans, without MPI: who reads what, in which pieces, to where, by which strategy."""
import pytest

from hpcddp.data import manifest as mf
from hpcddp.data._staging_plan import (AUTO_RING_MAX_BYTES, RING_IN_FLIGHT, ring_buffers,
                                      ring_share)
from hpcddp.data.staging import (NBUFS, auto_strategy, chunks_of,
                                 resolve_dest, split_by_bytes)


@pytest.mark.parametrize("sizes,parts", [
    ([10] * 8, 2), ([10] * 8, 3), ([1, 100, 1, 1, 100, 1], 2), ([5], 4), ([], 3),
    ([0, 0, 0], 2), ([7, 3, 9, 1, 4, 4, 8], 5)])
def test_split_by_bytes_is_a_contiguous_balanced_partition(sizes, parts):
    out = split_by_bytes(sizes, parts)
    assert len(out) == parts
    flat = [i for part in out for i in part]
    assert flat == list(range(len(sizes)))          # every item once, in order: contiguous
    total = sum(sizes)
    if total:
        biggest = max(sizes)
        for part in out:                             # within one item of an even share
            assert sum(sizes[i] for i in part) <= total / parts + biggest


def test_chunks_cover_the_file_exactly():
    for n, c in [(0, 4), (1, 4), (4, 4), (10, 4), (16, 3)]:
        pieces = chunks_of(n, c)
        assert sum(k for _, k in pieces) == n
        assert [o for o, _ in pieces] == [sum(k for _, k in pieces[:i]) for i in range(len(pieces))]
        assert all(0 < k <= c for _, k in pieces) or n == 0


def test_resolve_dest(monkeypatch):
    monkeypatch.setenv("SLURM_TMPDIR", "/scratch/job7")
    assert resolve_dest("$SLURM_TMPDIR/d-{node}", 3, "cn042.cluster") == "/scratch/job7/d-3"
    assert resolve_dest("/tmp/{host}/d", 0, "cn042.cluster") == "/tmp/cn042/d"
    monkeypatch.delenv("SLURM_TMPDIR")
    with pytest.raises(ValueError, match=r"\$SLURM_TMPDIR.*not set.*Slurm job"):
        resolve_dest("$SLURM_TMPDIR/d", 0, "h")
    with pytest.raises(ValueError, match=r"placeholder \{rank\}"):
        resolve_dest("/tmp/{rank}", 0, "h")


def test_auto_strategy_ring_while_its_buffers_fit():
    chunk = 16 << 20
    assert ring_share(2) == RING_IN_FLIGHT and ring_share(3) == 4 and ring_share(64) == 2
    assert ring_buffers(2, chunk) == (NBUFS + 8 + 9) * chunk      # 336 MiB
    fits = max(n for n in range(1, 100) if ring_buffers(n, chunk) <= AUTO_RING_MAX_BYTES)
    assert fits == 9                                 # the documented group size at 16 MiB
    assert auto_strategy(1, chunk) == "ring"
    assert auto_strategy(fits, chunk) == "ring"
    assert auto_strategy(fits + 1, chunk) == "bcast"
    assert auto_strategy(64, 1 << 20) == "ring"      # small chunks: big groups fit


def test_checker_crc32c_and_sha256(tmp_path):
    p = tmp_path / "shard"
    p.write_bytes(bytes(range(256)) * 1000)
    sha, crc = mf.file_digests(str(p))
    shard = mf.Shard(index=0, name="shard", first=0, count=1, bytes=256000, sha256=sha, crc32c=crc)
    assert mf.file_matches(str(p), shard)
    assert mf.Checker(shard).kind == "crc32c"
    old = mf.Shard(index=0, name="shard", first=0, count=1, bytes=256000, sha256=sha)
    assert mf.Checker(old).kind == "sha256" and mf.file_matches(str(p), old)
    p.write_bytes(bytes(range(256)) * 999 + bytes(255) + b"\x01")
    assert not mf.file_matches(str(p), shard)
    assert not mf.file_matches(str(p), old)
