"""Checkpoints for jobs that get preempted or requeued: save on a signal, resume from the latest.

A requeued Slurm job starts again from the top of its script with the same job id. The pattern
(jobs/train_tiny.py, docs/jobs.md)::

    ckpt = Checkpointer(os.environ["CKPT_DIR"])       # every rank; installs USR1/TERM handlers
    start, state = 0, None
    found = ckpt.load_latest()                         # every rank: the same file everywhere
    if found:
        start, state = found.step + 1, found.state
        model.load_state_dict(state["model"]); opt.load_state_dict(state["opt"])
    for step in range(start, steps):
        train_one_step()
        if ckpt.should_save(step, every=100):          # every rank, same place in the loop
            ckpt.save({"model": model.state_dict(), "opt": opt.state_dict()}, step)
        if ckpt.preempted:
            sys.exit(0)                                # the job script requeues the job

Signals only set a flag: the handler never writes files (it may interrupt anything, including a
collective). ``should_save`` turns one rank's flag into every rank's decision with one small
collective, because srun delivers a signal to each task at a slightly different moment and ranks
that decide on their own would take different branches and hang.

Rank 0 alone writes (DDP keeps the replicas identical), to a temporary name in the same
directory, flushed and fsync'ed, then ``os.replace``'d into place: a job killed mid-write leaves
the previous checkpoint intact and never a half-written "latest". ``load_latest`` lets rank 0
choose the file and broadcasts its name, so ranks never disagree on which step they resume from
even while a save races with the listing. The directory must be visible to every rank (shared
filesystem), not node-local scratch, which a requeue wipes.

Which ranks talk: ``comm`` may be an mpi4py communicator or an hpcddp Communicator; without one,
torch.distributed's default group is used when it is initialised, else the process is alone.
"""
from __future__ import annotations

import os
import re
import signal as _signal
import sys
from dataclasses import dataclass
from typing import Any, Iterable, Optional

__all__ = ["Checkpoint", "Checkpointer", "find_latest", "list_checkpoints"]

_NAME = re.compile(r"^(?P<prefix>.+)-(?P<step>\d{9})\.pt$")


@dataclass(frozen=True)
class Checkpoint:
    """What ``load_latest`` found: the step it was saved at, its path, the loaded object."""
    step: int
    path: str
    state: Any


def list_checkpoints(directory: str, prefix: str = "ckpt") -> list[tuple[int, str]]:
    """``(step, path)`` of every complete checkpoint in DIRECTORY, oldest first. Local, no messages.

    Temporary files of an interrupted save (``.ckpt-...tmp``) are not checkpoints.
    """
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        m = _NAME.match(name)
        if m and m.group("prefix") == prefix:
            found.append((int(m.group("step")), os.path.join(directory, name)))
    return sorted(found)


def find_latest(directory: str, prefix: str = "ckpt") -> Optional[tuple[int, str]]:
    """``(step, path)`` of the newest checkpoint in DIRECTORY, or None. Local, no messages."""
    found = list_checkpoints(directory, prefix)
    return found[-1] if found else None


class _Sync:
    """The three collectives a checkpointer needs, over mpi4py, torch.distributed or nothing."""

    def __init__(self, comm=None):
        self.mpi = None
        self.dist = None
        if comm is not None:
            mpi = getattr(comm, "mpi", comm)  # an hpcddp Communicator wraps an mpi4py comm
            for attr in ("Get_rank", "bcast", "allgather"):
                if not hasattr(mpi, attr):
                    raise TypeError(
                        f"Checkpointer: comm must be an mpi4py communicator or an hpcddp "
                        f"Communicator (with Get_rank, bcast, allgather), got "
                        f"{type(comm).__name__}")
            self.mpi = mpi
            self.rank = mpi.Get_rank()
            self.size = mpi.Get_size()
        else:
            try:
                import torch.distributed as dist
                if dist.is_available() and dist.is_initialized():
                    self.dist = dist
            except ImportError:
                pass
            self.rank = self.dist.get_rank() if self.dist else 0
            self.size = self.dist.get_world_size() if self.dist else 1

    def any(self, flag: bool) -> bool:
        if self.mpi is not None:
            return any(self.mpi.allgather(bool(flag)))
        if self.dist is not None:
            import torch
            t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self._device())
            self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
            return bool(t.item())
        return bool(flag)

    def bcast(self, obj):
        if self.mpi is not None:
            return self.mpi.bcast(obj, root=0)
        if self.dist is not None:
            box = [obj]
            self.dist.broadcast_object_list(box, src=0)
            return box[0]
        return obj

    def barrier(self) -> None:
        if self.mpi is not None:
            self.mpi.Barrier() if hasattr(self.mpi, "Barrier") else self.mpi.barrier()
        elif self.dist is not None:
            self.dist.barrier()

    def _device(self):
        # NCCL groups only take CUDA tensors; every other backend takes CPU ones.
        try:
            if self.dist.get_backend() == "nccl":
                import torch
                return torch.device("cuda", torch.cuda.current_device())
        except Exception:  # noqa: BLE001 - a device map or an unknown backend: CPU works
            pass
        return "cpu"


def _default_signals_in_child() -> None:
    for sig in (_signal.SIGUSR1, _signal.SIGTERM):
        handler = _signal.getsignal(sig)
        if isinstance(getattr(handler, "__self__", None), Checkpointer):
            _signal.signal(sig, _signal.SIG_DFL)


class Checkpointer:
    """Save on preemption signals and resume from the latest checkpoint. Every rank makes one.

    directory: where checkpoints go, on a filesystem every rank sees (created by rank 0).
    comm: an mpi4py communicator or hpcddp Communicator; default: torch.distributed's world
        group if initialised, else this process alone.
    signals: signals that request a checkpoint (default SIGUSR1, which ``#SBATCH
        --signal=USR1@...`` sends before the time limit, and SIGTERM, which Slurm sends on
        preemption, ``scontrol requeue`` and scancel, KillWait seconds before SIGKILL).
        Pass ``()`` to install no handler (call :meth:`request` yourself).
    keep: how many checkpoints to keep (older ones are deleted after a save); 0 keeps all.
    prefix: file names are ``PREFIX-<step, 9 digits>.pt``.
    """

    def __init__(self, directory: str, *, comm=None,
                 signals: Iterable[int] = (_signal.SIGUSR1, _signal.SIGTERM),
                 keep: int = 2, prefix: str = "ckpt"):
        if not directory:
            raise ValueError("Checkpointer: directory is empty; pass a path on a shared "
                             "filesystem (e.g. $SLURM_SUBMIT_DIR/checkpoints/$SLURM_JOB_ID)")
        if keep < 0:
            raise ValueError(f"Checkpointer: keep must be >= 0 (0 keeps all), got {keep}")
        if "/" in prefix or not prefix:
            raise ValueError(f"Checkpointer: prefix must be a plain file-name prefix, got {prefix!r}")
        self.directory = os.path.abspath(directory)
        self.keep = keep
        self.prefix = prefix
        self._sync = _Sync(comm)
        self.rank = self._sync.rank
        self._requested = False   # set by a signal on this rank
        self.preempted = False    # agreed by every rank in should_save()
        self.signal_name: Optional[str] = None
        self._previous = {}
        for sig in signals:
            self._previous[sig] = _signal.signal(sig, self._on_signal)
        if self._previous:
            # a forked child (a DataLoader worker) dies of SIGTERM as Python's default says;
            # with this handler it would wait for Slurm's SIGKILL, KillWait seconds later
            from hpcddp.launch import process
            process.on_fork_child(_default_signals_in_child)

    # --- signals -------------------------------------------------------------------------
    def _on_signal(self, signum, frame) -> None:
        # Only a flag: a handler may run in the middle of anything (an MPI call, a write).
        self._requested = True
        self.signal_name = _signal.Signals(signum).name

    def request(self) -> None:
        """Ask for a checkpoint at the next :meth:`should_save` (as a signal would). Local."""
        self._requested = True

    @property
    def requested(self) -> bool:
        """True once this rank received a checkpoint signal (local; not agreed across ranks)."""
        return self._requested

    def restore_signals(self) -> None:
        """Put back the signal handlers that were installed before this Checkpointer."""
        for sig, prev in self._previous.items():
            _signal.signal(sig, prev if prev is not None else _signal.SIG_DFL)
        self._previous = {}

    # --- decisions -------------------------------------------------------------------------
    def should_save(self, step: Optional[int] = None, *, every: int = 0) -> bool:
        """Whether to save now: a signal reached any rank, or STEP is a multiple of EVERY.

        Collective: every rank calls it at the same point (a small all-reduce of the signal
        flags), so all ranks take the same branch. After a signal it also sets
        :attr:`preempted` on every rank: save, then exit so the job can be requeued.
        """
        if self._sync.any(self._requested):
            self.preempted = True
            if self.rank == 0:
                _say(f"checkpoint requested by {self.signal_name or 'a signal on another rank'}"
                     f"{'' if step is None else f' at step {step}'}")
            return True
        return bool(every) and step is not None and step > 0 and step % every == 0

    # --- save / load -----------------------------------------------------------------------
    def path_for(self, step: int) -> str:
        return os.path.join(self.directory, f"{self.prefix}-{int(step):09d}.pt")

    def save(self, state: Any, step: int) -> str:
        """Write STATE as the checkpoint of STEP; returns its path. Collective.

        Rank 0 writes (``torch.save``) to a temporary file, fsyncs it and renames it into
        place; the others wait at a barrier so that, on return, every rank can rely on the
        file being complete. STATE only matters on rank 0.
        """
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"Checkpointer.save: step must be an int >= 0, got {step!r}")
        path = self.path_for(step)
        error = None
        if self.rank == 0:
            try:
                self._write(state, path)
                self._prune()
            except Exception as exc:  # noqa: BLE001 - reported on every rank below
                error = f"{type(exc).__name__}: {exc}"
        # Every rank learns whether rank 0's write worked, instead of resuming later from a
        # checkpoint that is not there.
        error = self._sync.bcast(error)
        if error:
            raise RuntimeError(f"Checkpointer.save: rank 0 could not write {path}: {error}")
        if self.rank == 0:
            _say(f"saved checkpoint step {step} -> {path}")
        return path

    def _write(self, state: Any, path: str) -> None:
        import torch
        os.makedirs(self.directory, exist_ok=True)
        tmp = os.path.join(self.directory, f".{os.path.basename(path)}.tmp.{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)  # atomic on POSIX: readers see the old set or the new file
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        try:  # make the rename itself durable
            fd = os.open(self.directory, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:
            pass

    def _prune(self) -> None:
        if not self.keep:
            return
        for _, old in list_checkpoints(self.directory, self.prefix)[:-self.keep]:
            try:
                os.unlink(old)
            except FileNotFoundError:
                pass

    def latest(self) -> Optional[tuple[int, str]]:
        """``(step, path)`` of the newest checkpoint as this rank sees it. Local, no messages."""
        return find_latest(self.directory, self.prefix)

    def load_latest(self, map_location: Any = "cpu") -> Optional[Checkpoint]:
        """Load the newest checkpoint, or return None when there is none. Collective.

        Rank 0 picks the file and broadcasts its name; every rank then loads that same file
        (``torch.load(..., weights_only=False)``: checkpoints hold optimizer state and plain
        Python values; load only files your own jobs wrote).
        """
        import torch
        chosen = self._sync.bcast(self.latest() if self.rank == 0 else None)
        if chosen is None:
            return None
        step, path = chosen
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"Checkpointer.load_latest: rank 0 chose {path} but rank {self.rank} cannot see "
                f"it; the checkpoint directory must be on a filesystem every node shares")
        state = torch.load(path, map_location=map_location, weights_only=False)
        if self.rank == 0:
            _say(f"resuming from checkpoint step {step} ({path})")
        return Checkpoint(step=step, path=path, state=state)


def _say(msg: str) -> None:
    """One line on stderr with the rank prefix (called on rank 0 of the checkpoint's group)."""
    try:
        from hpcddp.comm import log
    except ImportError:  # comm not importable (no mpi4py): prefix by hand
        print(f"[rank0] {msg}", file=sys.stderr, flush=True)
        return
    log(msg)
