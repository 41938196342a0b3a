"""Data set directories someone else can write (docs/security.md, no MPI).

Someone who can write a data set (a shared project directory) can change its samples; they must
not be able to run code in the readers: an ``npy`` value holding a pickled object array is
refused by ``np.load(allow_pickle=False)``, and a manifest that names an object dtype for
``array`` values makes numpy refuse the raw copy, before any byte is read into it. Nor may a
symlink they plant at a name hpcddp writes (a temporary name, the stage lock) lead that write
into one of the user's files.
"""
import io
import json
import os

import numpy as np
import pytest

from hpcddp.data import destlock
from hpcddp.data import manifest as mf
from hpcddp.data import open_dataset, pack
from hpcddp.data.packing import lmdb_key


class Planted:
    """Unpickling it runs code (here: writes MARKER)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('planted code ran')",))


def _rewrite_manifest(d, change):
    """Apply CHANGE to the manifest document and record shard 0's new size and checksums, as
    someone who can write the data set directory would."""
    path = os.path.join(d, mf.MANIFEST)
    doc = json.loads(open(path, "rb").read())
    change(doc)
    s = doc["shards"][0]
    shard = os.path.join(d, s["name"])
    s["bytes"] = os.path.getsize(shard)
    s["sha256"], s["crc32c"] = mf.file_digests(shard)
    open(path, "wb").write(mf.dumps(doc))


def test_npy_value_holding_a_pickle_is_refused(tmp_path):
    import lmdb
    d = tmp_path / "ds"
    pack([(f"s{i}", np.arange(i + 1, dtype=np.int16)) for i in range(3)], d, format="lmdb",
         encoding="npy", progress=False)
    marker = tmp_path / "marker"
    buf = io.BytesIO()
    np.save(buf, np.array([Planted(marker)], dtype=object), allow_pickle=True)
    m = mf.load(str(d))
    env = lmdb.open(os.path.join(d, m.shards[0].name), subdir=False, lock=False)
    with env.begin(write=True) as txn:
        txn.put(lmdb_key(0), buf.getvalue())
    env.close()
    _rewrite_manifest(str(d), lambda doc: None)
    ds = open_dataset(str(d))
    assert ds[1].tolist() == [0, 1]               # the untouched samples still read
    with pytest.raises(ValueError, match="allow_pickle=False"):
        ds[0]
    assert not marker.exists()
    np.load(io.BytesIO(buf.getvalue()), allow_pickle=True)   # the plant is live: with pickles
    assert marker.exists()                                   # allowed, its code runs


def test_a_rewritten_sample_with_matching_sums_is_read(tmp_path):
    """What the checksums do not stop (docs/security.md): they catch accidents, not a writer of
    the data set, who can change a sample and record the new sums in the manifest next to it."""
    import lmdb
    d = tmp_path / "ds"
    pack([(f"s{i}", bytes([i]) * 10) for i in range(3)], d, format="lmdb", progress=False)
    m = mf.load(str(d))
    env = lmdb.open(os.path.join(d, m.shards[0].name), subdir=False, lock=False)
    with env.begin(write=True) as txn:
        txn.put(lmdb_key(1), b"poisoned")
    env.close()
    _rewrite_manifest(str(d), lambda doc: None)
    assert open_dataset(str(d), verify=True)[1] == b"poisoned"


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5"])
def test_object_dtype_in_a_manifest_is_refused(tmp_path, fmt):
    d = tmp_path / "ds"
    pack([(f"s{i}", np.full(4, i, dtype=np.int64)) for i in range(3)], d, format=fmt,
         encoding="array", progress=False)
    _rewrite_manifest(str(d), lambda doc: doc.update(dtype="|O", shape=[2]))
    ds = open_dataset(str(d))
    with pytest.raises(TypeError, match="data-type|references"):
        ds[0]


def test_write_atomic_never_writes_through_a_planted_name(tmp_path, monkeypatch):
    """READY, STAGING and manifest.json go through write_atomic: its temporary name is random
    and created with O_EXCL, so a symlink planted there fails the write, the file it points to
    untouched."""
    victim = tmp_path / "victim"
    victim.write_text("mine")
    monkeypatch.setattr(mf.secrets, "token_hex", lambda n: "guessed")
    target = tmp_path / "d" / mf.READY
    target.parent.mkdir()
    os.symlink(victim, f"{target}.tmp{os.getpid()}.guessed")
    with pytest.raises(FileExistsError):
        mf.write_atomic(str(target), b"{}")
    assert victim.read_text() == "mine" and not target.exists()
    monkeypatch.undo()
    mf.write_atomic(str(target), b"{}")             # a fresh random name: written, renamed
    assert target.read_bytes() == b"{}" and victim.read_text() == "mine"
    assert sorted(os.listdir(target.parent)) == [mf.READY, f"{mf.READY}.tmp{os.getpid()}.guessed"]


@pytest.mark.parametrize("mode", ["flock", "excl"])
def test_a_symlink_at_the_lock_name_is_not_written_through(tmp_path, mode):
    victim = tmp_path / "victim"
    victim.write_text("mine")
    dest = tmp_path / "dest"
    dest.mkdir()
    os.symlink(victim, dest / destlock.LOCK_NAME)
    lock = destlock.DestLock(str(dest), mode)
    try:
        got = lock.try_acquire()
    except OSError as exc:                           # flock: O_NOFOLLOW refuses the link
        assert mode == "flock" and "symbolic links" in str(exc)
    else:                                            # excl: O_EXCL finds the name taken
        assert mode == "excl" and got is not None and not lock.held
    assert victim.read_text() == "mine"
