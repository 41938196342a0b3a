"""The destination lock (hpcddp.data.destlock), without MPI: flock and O_EXCL modes, a holder
that died, a reused pid, a record from another host, a file system without flock."""
import errno
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from hpcddp.data import destlock
from hpcddp.data import manifest as mf


def _dead_pid() -> int:
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                       capture_output=True, text=True, timeout=60)
    return int(p.stdout)


@pytest.mark.parametrize("mode", destlock.MODES)
def test_one_holder_then_the_next(tmp_path, mode):
    a = destlock.DestLock(str(tmp_path), mode)
    b = destlock.DestLock(str(tmp_path), mode)   # another open file: excluded even in-process
    assert a.try_acquire() is None and a.held
    rec = json.loads((tmp_path / destlock.LOCK_NAME).read_text())
    assert rec["pid"] == os.getpid() and rec["host"] == socket.gethostname()
    assert rec["pid_start"] == destlock.pid_start(os.getpid()) and rec["dest"] == str(tmp_path)
    busy = b.try_acquire()
    assert busy is not None and busy["pid"] == os.getpid() and not b.held
    assert f"pid {os.getpid()} on host {socket.gethostname()}" in destlock.describe(busy)
    a.release()
    assert not (tmp_path / destlock.LOCK_NAME).exists()   # released: nothing left behind
    a.release()                                          # idempotent
    assert b.try_acquire() is None and b.took_over is None
    b.release()


_HOLD_AND_DIE = """
import os, sys
from hpcddp.data import destlock
lock = destlock.DestLock(sys.argv[1], sys.argv[2])
assert lock.try_acquire() is None
print(os.getpid(), flush=True)
os._exit(0)   # dies holding it: no release
"""


@pytest.mark.parametrize("mode", destlock.MODES)
def test_lock_of_a_dead_process_is_taken_over(tmp_path, mode):
    p = subprocess.run([sys.executable, "-c", _HOLD_AND_DIE, str(tmp_path), mode],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    dead = int(p.stdout)
    assert (tmp_path / destlock.LOCK_NAME).exists()     # its record is still there
    lock = destlock.DestLock(str(tmp_path), mode)
    assert lock.try_acquire() is None
    assert lock.took_over["pid"] == dead
    assert destlock.why_dead(lock.took_over) == f"pid {dead} is no longer running"
    assert json.loads((tmp_path / destlock.LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()


def test_excl_reused_pid_is_dead_and_other_host_is_alive(tmp_path):
    path = tmp_path / destlock.LOCK_NAME
    me = destlock.my_record(str(tmp_path))
    # this very pid, but a process started at another time: the recorded holder is gone
    path.write_text(json.dumps(dict(me, pid_start=me["pid_start"] - 1)))
    assert destlock.holder_alive(json.loads(path.read_text())) is False
    lock = destlock.DestLock(str(tmp_path), "excl")
    assert lock.try_acquire() is None and lock.took_over["pid_start"] == me["pid_start"] - 1
    assert "now belongs to another process" in destlock.why_dead(lock.took_over)
    lock.release()
    # another host's record cannot be checked: treated as alive, never taken over
    other = dict(me, host="not-" + socket.gethostname(), pid=_dead_pid())
    path.write_text(json.dumps(other))
    assert destlock.holder_alive(other) is None
    busy = destlock.DestLock(str(tmp_path), "excl").try_acquire()
    assert busy == other and path.exists()


def test_excl_empty_record_waits_then_is_stale(tmp_path):
    path = tmp_path / destlock.LOCK_NAME
    path.write_bytes(b"")   # a creator between O_EXCL and its write...
    assert destlock.DestLock(str(tmp_path), "excl").try_acquire() == {}
    old = time.time() - 2 * destlock._EMPTY_GRACE_S   # ...or one that died there
    os.utime(path, (old, old))
    lock = destlock.DestLock(str(tmp_path), "excl")
    assert lock.try_acquire() is None
    lock.release()


def test_flock_refused_by_the_file_system_falls_back_to_excl(tmp_path, monkeypatch):
    import fcntl

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(fcntl, "flock", no_flock)
    a = destlock.DestLock(str(tmp_path))
    assert a.mode == "flock" and a.try_acquire() is None and a.mode == "excl"
    b = destlock.DestLock(str(tmp_path))
    assert b.try_acquire()["pid"] == os.getpid()
    a.release()
    assert b.try_acquire() is None
    b.release()


def test_flock_mode_respects_a_live_excl_holder(tmp_path):
    a = destlock.DestLock(str(tmp_path), "excl")
    assert a.try_acquire() is None
    assert destlock.DestLock(str(tmp_path), "flock").try_acquire()["pid"] == os.getpid()
    a.release()


def test_lock_mode_env():
    assert destlock.lock_mode({}) == "flock"
    assert destlock.lock_mode({"HPCDDP_STAGE_LOCK": "EXCL"}) == "excl"
    with pytest.raises(ValueError, match=r"HPCDDP_STAGE_LOCK='fcntl': expected flock or excl"):
        destlock.lock_mode({"HPCDDP_STAGE_LOCK": "fcntl"})


def test_half_staged_message_says_whether_its_stager_runs(tmp_path):
    dead = dict(destlock.my_record(str(tmp_path)), pid=_dead_pid())
    (tmp_path / mf.STAGING).write_text(json.dumps(dead))
    with pytest.raises(mf.NotReadyError, match=rf"stager \(pid {dead['pid']} on host .*\) "
                                               r"died before finishing.*hpcddp stage"):
        mf.check_ready(str(tmp_path), "X")
    (tmp_path / mf.STAGING).write_text(json.dumps(destlock.my_record(str(tmp_path))))
    with pytest.raises(mf.NotReadyError, match="is still running"):
        mf.check_ready(str(tmp_path), "X")
