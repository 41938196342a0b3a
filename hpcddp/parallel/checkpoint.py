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
directory (random, created with O_EXCL: never a symlink someone planted there), flushed and fsync'ed, then ``os.replace``'d into place: a job killed mid-write leaves
the previous checkpoint intact and never a half-written "latest". ``load_latest`` lets rank 0
choose the file and broadcasts its name, so ranks never disagree on which step they resume from
even while a save races with the listing. The directory must be visible to every rank (shared
filesystem), not node-local scratch, which a requeue wipes.

Which ranks talk: ``comm`` may be an mpi4py communicator or an hpcddp Communicator; without one,
torch.distributed's default group is used when it is initialised, else the process is alone.

Loading is ``torch.load(weights_only=True)``: tensors, plain Python values and the types torch
allows (what ``model``, optimizer and scheduler ``state_dict()`` hold). A checkpoint directory
usually sits on a file system a whole group can write, and a pickle can run any code when it
is loaded, so a file that needs any other global is refused, on every rank, naming the file and
the global, and nothing older is loaded in its place (docs/security.md says why). The user's own
types are let through with ``load_latest(safe_globals=[MyType])`` (or torch's
``torch.serialization.add_safe_globals``); ``load_latest(trust_pickle=True)`` loads any pickle,
for directories only you (and people you trust with your account) can write.
"""
from __future__ import annotations

import os
import pickle
import re
import secrets
import signal as _signal
import sys
from dataclasses import dataclass
from typing import Any, Iterable, Optional

__all__ = ["Checkpoint", "Checkpointer", "UnsafeCheckpointError", "find_latest",
           "list_checkpoints"]

_NAME = re.compile(r"^(?P<prefix>.+)-(?P<step>\d{9})\.pt$")


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint that ``torch.load(weights_only=True)`` refused: it needs a global (a class or
    a function) that is neither torch's nor in ``safe_globals``. Nothing in it ran.

    ``path``: the file; ``global_name``: what it asked for (None where torch did not say).
    """

    def __init__(self, message: str, path: str, global_name: Optional[str]):
        super().__init__(message)
        self.path = path
        self.global_name = global_name


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
                self._prune(path)
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
        tmp = os.path.join(self.directory, f".{os.path.basename(path)}.tmp.{os.getpid()}."
                                           f"{secrets.token_hex(4)}")
        # O_EXCL (and a random name): a name planted in a shared directory, such as a symlink
        # to one of your files, fails the save instead of being written through. The mode is
        # what open() would give (0666 less the umask).
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)  # atomic on POSIX: readers see the old set or the new file
        finally:
            if os.path.lexists(tmp):
                os.unlink(tmp)
        try:  # make the rename itself durable
            fd = os.open(self.directory, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:
            pass

    def _prune(self, saved: str) -> None:
        """Delete all but the KEEP newest checkpoints, never SAVED (the file just written): a
        file with a higher step left by an earlier run, or put there by someone else, must not
        make a save delete itself."""
        if not self.keep:
            return
        for _, old in list_checkpoints(self.directory, self.prefix)[:-self.keep]:
            if old == saved:
                continue
            try:
                os.unlink(old)
            except FileNotFoundError:
                pass

    def latest(self) -> Optional[tuple[int, str]]:
        """``(step, path)`` of the newest checkpoint as this rank sees it. Local, no messages."""
        return find_latest(self.directory, self.prefix)

    def load_latest(self, map_location: Any = "cpu", *, safe_globals: Iterable = (),
                    trust_pickle: bool = False) -> Optional[Checkpoint]:
        """Load the newest checkpoint, or return None when there is none. Collective.

        Rank 0 picks the file and broadcasts its name; every rank then loads that same file
        with ``torch.load(path, map_location=MAP_LOCATION, weights_only=True)``: tensors,
        plain Python values (dict, list, tuple, set, str, bytes, int, float, bool, None) and
        the types torch allows, which is everything a model's, an optimizer's and an LR
        scheduler's ``state_dict()`` holds. Then one small collective: if any rank could not
        load the file, every rank raises (none goes on to train alone).

        safe_globals: your own classes or functions the file holds (a dataclass, an enum),
            added to torch's list for this load only (``torch.serialization.safe_globals``);
            ``torch.serialization.add_safe_globals([...])`` adds them for the whole process.
            Simpler where you can: save plain values (``dataclasses.asdict(cfg)``, a numpy
            array as ``torch.from_numpy(a)``).
        trust_pickle: load with ``weights_only=False``: any pickle, including one that runs
            code when loaded. Only for a directory that nobody but you can write (rank 0
            prints a line saying it is on). ``TORCH_FORCE_WEIGHTS_ONLY_LOAD=1`` overrides it.

        A file that needs a global outside those lists raises :class:`UnsafeCheckpointError`
        on every rank, naming the file, the global and the options. No older checkpoint is
        loaded instead: a job that resumed quietly from an older step would lose the work
        after it, and a file someone else wrote into the directory needs a look before any
        resume (docs/security.md, "Checkpoints").
        """
        import torch
        if not isinstance(trust_pickle, bool):
            raise TypeError(f"Checkpointer.load_latest: trust_pickle must be True or False, got "
                            f"{trust_pickle!r}")
        allowed = _check_safe_globals(safe_globals)
        if trust_pickle and allowed:
            raise ValueError("Checkpointer.load_latest: pass safe_globals or trust_pickle=True, "
                             "not both (trust_pickle loads every global; safe_globals is for "
                             "loading with weights_only=True)")
        chosen = self._sync.bcast(self.latest() if self.rank == 0 else None)
        if chosen is None:
            return None
        step, path = chosen
        state, error = None, None
        try:
            if not os.path.exists(path):
                raise FileNotFoundError(
                    f"Checkpointer.load_latest: rank 0 chose {path} but rank {self.rank} cannot "
                    f"see it; the checkpoint directory must be on a filesystem every node shares")
            if trust_pickle:
                if self.rank == 0:
                    _say(f"loading checkpoint {path} with trust_pickle=True (weights_only=False): "
                         f"code in the file runs; only for a directory nobody else can write")
                state = torch.load(path, map_location=map_location, weights_only=False)
            else:
                with torch.serialization.safe_globals(allowed):
                    state = torch.load(path, map_location=map_location, weights_only=True)
        except FileNotFoundError as exc:
            error = exc
        except Exception as exc:  # noqa: BLE001 - every rank raises below, this one with its own
            if isinstance(exc, pickle.UnpicklingError) and not trust_pickle:
                error = self._refused(path, exc)
            else:
                error = RuntimeError(f"Checkpointer.load_latest: rank {self.rank} could not load "
                                     f"{path}: {type(exc).__name__}: {exc}")
                error.__cause__ = exc
        # One rank that cannot load must not leave the others training alone (they would wait
        # in their first collective): all learn it here and raise together.
        if self._sync.any(error is not None):
            if error is not None:
                raise error
            raise RuntimeError(f"Checkpointer.load_latest: another rank could not load {path} "
                               f"(its error is in its output); not resuming on any rank")
        if self.rank == 0:
            _say(f"resuming from checkpoint step {step} ({path})")
        return Checkpoint(step=step, path=path, state=state)

    def _refused(self, path: str, exc: Exception) -> UnsafeCheckpointError:
        """The error for a file weights_only loading refused: the file, the global, the fixes."""
        text = str(exc)
        m = re.search(r"GLOBAL (\S+) (?:was not an allowed global|whose module)", text)
        name = m.group(1) if m else None
        older = [os.path.basename(p) for _, p in list_checkpoints(self.directory, self.prefix)
                 if p != path]
        tail = (f"Nothing older was loaded instead"
                f"{' (older here: ' + ', '.join(older[-3:]) + ')' if older else ''}; "
                f"docs/security.md, \"Checkpoints\"")
        if name is None:
            # torch's reason sits between its advice and its closing pointer to the docs
            why = re.search(r"WeightsUnpickler error:\s*(.*?)\s*(?:Check the documentation|$)",
                            text, re.S)
            reason = " ".join((why.group(1) if why else text).split()) or "no reason given"
            return UnsafeCheckpointError(
                f"Checkpointer.load_latest: refused {path}: torch.load(weights_only=True) "
                f"cannot read it ({reason}): a damaged file, one not written by torch.save, or "
                f"pickle instructions weights_only loading does not run. {tail}.", path, None)
        if "whose module" in m.group(0):   # torch blocks the module (os, subprocess, ...)
            return UnsafeCheckpointError(
                f"Checkpointer.load_latest: refused {path}: it calls {name}, from a module torch "
                f"never lets weights_only loading touch: no checkpoint written by torch.save of "
                f"a state_dict does that. Someone else can write into {self.directory}: look at "
                f"the file (do not load it) and remove it. {tail}.", path, name)
        short = name.rsplit(".", 1)[-1]
        return UnsafeCheckpointError(
            f"Checkpointer.load_latest: refused {path}: it needs the global {name}, which "
            f"torch.load(weights_only=True) does not load without your say-so (a pickle can run "
            f"any code). If your own job wrote it and {name} is yours, pass "
            f"load_latest(safe_globals=[{short}]) (or torch.serialization.add_safe_globals); if "
            f"nobody but you can write {self.directory}, load_latest(trust_pickle=True) loads any "
            f"pickle. If you did not write it, someone else can write into your checkpoint "
            f"directory: look at the file (do not load it) and remove it. {tail}.", path, name)


def _check_safe_globals(safe_globals) -> list:
    """SAFE_GLOBALS as torch.serialization.safe_globals takes it, or TypeError naming the item."""
    if isinstance(safe_globals, (str, bytes)) or not hasattr(safe_globals, "__iter__"):
        raise TypeError(f"Checkpointer.load_latest: safe_globals must be a list of classes or "
                        f"functions (or (obj, 'module.name') pairs), got {safe_globals!r}")
    out = list(safe_globals)
    for item in out:
        ok = callable(item) or (isinstance(item, tuple) and len(item) == 2
                                and callable(item[0]) and isinstance(item[1], str))
        if not ok:
            raise TypeError(f"Checkpointer.load_latest: safe_globals holds {item!r}; expected a "
                            f"class or function (or a (obj, 'module.name') pair), e.g. "
                            f"safe_globals=[MyConfig]")
    return out


def _say(msg: str) -> None:
    """One line on stderr with the rank prefix (called on rank 0 of the checkpoint's group)."""
    try:
        from hpcddp.comm import log
    except ImportError:  # comm not importable (no mpi4py): prefix by hand
        print(f"[rank0] {msg}", file=sys.stderr, flush=True)
        return
    log(msg)
