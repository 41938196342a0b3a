"""One stager per destination: the lock a node leader holds while it writes a staged copy.

``hpcddp stage`` writes shards under temporary names, deletes stale ones and renames the
verified ones; two stagers in one directory would delete and truncate each other's files. So
the node leader that writes ``DEST`` first takes ``DEST/.hpcddp-stage.lock`` and keeps it until
:func:`hpcddp.data.stage` returns, whether the copy succeeded or failed.

The primitive is ``flock(LOCK_EX | LOCK_NB)`` on that file:

* it is atomic, and the kernel drops it when its holder dies (``kill -9``, ``scancel``, the
  OOM killer): a dead job's lock never outlives it, and no pid has to be trusted;
* the file systems staging writes to (tmpfs, ext4, xfs: node-local storage) support it, and
  so do NFS (byte-range locks underneath), GPFS, and Lustre mounted with ``-o flock``.

The file holds a record of its holder (host, pid, the pid's start time, job id, start time),
written once the lock is taken: what a waiting stager prints. It is removed on release
(unlink, then unlock; a taker checks that the file it locked is still the one at the path, so
a releasing holder and a new taker never both own the lock). A record found by a stager that
has just taken the lock was left by a holder that died holding it: reported, then replaced.

Where flock is refused (``ENOLCK``/``ENOSYS``/``EOPNOTSUPP``/``EINVAL``: Lustre without
``-o flock``, some FUSE file systems) or ``HPCDDP_STAGE_LOCK=excl``, the lock is the file's
existence: created with ``O_CREAT | O_EXCL`` and removed on release. A holder that died
leaves the file behind; it is recognised as dead when it ran on this host and its pid is gone,
or now names a process started at another time (pid reused: the start time in
``/proc/PID/stat`` differs from the record), and then taken over (renamed away, then created
anew). A record from another host cannot be checked: it is treated as alive, and the error
names the file to remove if that job is gone.

Standard library only: no MPI (the collective part is in :mod:`hpcddp.data.staging`).
"""
from __future__ import annotations

import datetime as _dt
import errno
import json
import os
import socket

from hpcddp import settings

LOCK_NAME = ".hpcddp-stage.lock"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
MODES = ("flock", "excl")
MODE_ENV = "HPCDDP_STAGE_LOCK"
# flock unsupported by this file system (as opposed to: held by someone else)
_NO_FLOCK = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL,
             getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)}
_EMPTY_GRACE_S = 60.0   # excl mode: an empty record older than this was left by a dead creator
_JOB_VARS = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid")


def lock_mode(env=None) -> str:
    """The primitive to use: ``flock`` (default) or ``excl``, from ``HPCDDP_STAGE_LOCK``."""
    return (settings.get() if env is None else settings.read(env)).stage_lock


def pid_start(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot (``/proc/PID/stat`` field
    22), or None where /proc cannot tell (no such process, not Linux)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        # the command name (field 2) may hold spaces and parentheses: count after the last ')'
        return int(stat[stat.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def my_record(dest: str) -> dict:
    """What a holder writes: who holds ``dest``'s lock, and since when."""
    pid = os.getpid()
    job = next((f"{v}={os.environ[v]}" for v in _JOB_VARS if os.environ.get(v)), None)
    return {"host": socket.gethostname(), "pid": pid, "pid_start": pid_start(pid), "job": job,
            "started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "dest": dest}


def holder_alive(record: dict) -> bool | None:
    """Is the process a record names still running? None: cannot tell (another host, no pid).

    Dead: on this host, its pid is gone, or the pid now belongs to a process started at
    another time than the one recorded (the pid was reused).
    """
    pid = record.get("pid")
    if not isinstance(pid, int) or record.get("host") != socket.gethostname():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
    recorded = record.get("pid_start")
    if recorded is not None:
        now = pid_start(pid)
        if now is not None and now != recorded:
            return False
    return True


def describe(record: dict | None) -> str:
    """``pid 123 on host cn01 (job SLURM_JOB_ID=77, since 2026-...)`` for messages."""
    if not record or "pid" not in record:
        return "another stager (its record is not written yet)"
    extra = [record["job"]] if record.get("job") else []
    if record.get("started"):
        extra.append(f"since {record['started']}")
    tail = f" ({', '.join(extra)})" if extra else ""
    return f"pid {record['pid']} on host {record.get('host', '?')}{tail}"


def why_dead(record: dict) -> str:
    """Why a left-over record's holder no longer holds the lock, for the take-over message."""
    alive = holder_alive(record)
    if alive is False:
        pid = record.get("pid")
        return (f"pid {pid} is no longer running" if pid_start(pid) is None
                else f"pid {pid} now belongs to another process (started later)")
    return "it ended without releasing it (killed?)"


def _parse(raw: bytes) -> dict:
    try:
        doc = json.loads(raw or b"{}")
    except ValueError:
        return {}  # being written right now, or garbage: nothing to report
    return doc if isinstance(doc, dict) else {}


class DestLock:
    """The lock on one destination directory, held by one process (its node leader).

    :meth:`try_acquire` never blocks: it returns None once the lock is held, else the holder's
    record (``{}`` when the holder has not written it yet). Waiting, with a bound and a
    message, is the caller's (:func:`hpcddp.data.staging` polls all nodes' locks together).
    After an acquire, ``took_over`` is the record a dead holder left (None: there was none).
    """

    def __init__(self, directory: str, mode: str | None = None):
        self.directory = directory
        self.path = os.path.join(directory, LOCK_NAME)
        self.mode = mode or lock_mode()
        self.fd = -1
        self.held = False
        self.took_over: dict | None = None
        self._record: bytes = b""

    # -- acquire ------------------------------------------------------------------------------
    def try_acquire(self) -> dict | None:
        if self.held:
            return None
        self.took_over = None
        if self.mode == "flock":
            return self._try_flock()
        return self._try_excl()

    def _try_flock(self) -> dict | None:
        import fcntl
        while True:
            created = False
            try:
                # O_NOFOLLOW: the lock file is written (our record); a symlink planted at its
                # name by someone who can write DEST must not lead that write to another file
                fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC | _NOFOLLOW)
            except FileNotFoundError:
                try:
                    fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                                 0o644)
                    created = True
                except FileExistsError:
                    continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                record = _parse(os.pread(fd, 1 << 16, 0))
                os.close(fd)
                return record
            except OSError as exc:
                os.close(fd)
                if exc.errno in _NO_FLOCK:
                    # this file system has no flock: the portable way, without the empty file
                    # we just made (an excl taker would read it as a holder)
                    if created:
                        os.remove(self.path)
                    self.mode = "excl"
                    return self._try_excl()
                raise
            try:
                same = os.stat(self.path)
                mine = os.fstat(fd)
                current = (same.st_dev, same.st_ino) == (mine.st_dev, mine.st_ino)
            except FileNotFoundError:
                current = False
            if not current:  # locked a file its holder had just released and removed
                os.close(fd)
                continue
            left = _parse(os.pread(fd, 1 << 16, 0))
            if left and holder_alive(left):
                # a live holder that does not use flock (HPCDDP_STAGE_LOCK=excl elsewhere)
                os.close(fd)
                return left
            self.took_over = left or None
            self._record = json.dumps(my_record(self.directory), sort_keys=True).encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, self._record, 0)
            self.fd, self.held = fd, True
            return None

    def _try_excl(self) -> dict | None:
        record = my_record(self.directory)
        self._record = json.dumps(record, sort_keys=True).encode()
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            except FileExistsError:
                found, raw = self._read_excl()
                if raw is None:
                    continue  # removed between our open and our read: try again
                if not self._stale(found):
                    self.took_over = None   # another taker got there first: nothing taken
                    return found
                if not self._take_over(raw):
                    continue
                self.took_over = found or None
                continue
            try:
                os.write(fd, self._record)
            finally:
                os.close(fd)
            self.held = True
            return None
        found, _ = self._read_excl()
        self.took_over = None
        return found or {}

    def _read_excl(self) -> tuple[dict, bytes | None]:
        try:
            with open(self.path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return {}, None
        return _parse(raw), raw

    def _stale(self, record: dict) -> bool:
        if not record:  # a creator that died between O_EXCL and its write, or is writing now
            try:
                import time
                return time.time() - os.stat(self.path).st_mtime > _EMPTY_GRACE_S
            except FileNotFoundError:
                return False
        return holder_alive(record) is False

    def _take_over(self, raw: bytes) -> bool:
        """Move a dead holder's file away, atomically; False if someone else changed it first."""
        aside = f"{self.path}.stale.{os.getpid()}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False
        try:
            with open(aside, "rb") as f:
                moved = f.read()
            if moved != raw:
                # another taker replaced it between our read and our rename: put theirs back
                try:
                    os.link(aside, self.path)
                except FileExistsError:
                    pass
                return False
            return True
        finally:
            try:
                os.remove(aside)
            except FileNotFoundError:
                pass

    # -- release ------------------------------------------------------------------------------
    def release(self) -> None:
        """Remove the lock file and drop the lock (idempotent; safe after a failed stage)."""
        if not self.held:
            return
        self.held = False
        if self.mode == "flock":
            try:
                os.remove(self.path)  # before the unlock: a taker checks the path's inode
            except FileNotFoundError:
                pass
            os.close(self.fd)  # closing drops the flock
            self.fd = -1
            return
        try:
            with open(self.path, "rb") as f:
                mine = f.read() == self._record
        except FileNotFoundError:
            mine = False
        if mine:
            os.remove(self.path)

    def __repr__(self) -> str:
        return f"DestLock({self.path!r}, mode={self.mode!r}, held={self.held})"
