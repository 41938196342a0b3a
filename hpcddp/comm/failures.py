"""Lost processes, as MPI reports them where ULFM is on (``mpirun --with-ft ulfm``).

Without ULFM, mpirun ends the whole job when a rank dies. With it, the job goes on and each
survivor's next call on a communicator holding the dead rank fails with MPI_ERR_PROC_FAILED
(or MPI_ERR_REVOKED once another survivor revoked it): hpcddp.elastic recovers from that;
everywhere else (start-up, a job outside elastic mode, the exit) the rank must end and
say which rank was lost, never wait for it (docs/hangs.md, "A rank killed from outside").
Importing it does not start MPI (hpcddp.elastic imports it).
"""
from __future__ import annotations

import contextlib
import os
import sys
import time

# how the error reads once torch or DDP wrapped it in a RuntimeError holding its text
FAILURE_MARKERS = ("MPI_ERR_PROC_FAILED", "MPI_ERR_REVOKED", "PROC_FAILED", "REVOKED")


class LostRankError(RuntimeError):
    """A rank of the job died where hpcddp cannot go on without it (start-up)."""


def is_process_failure(exc: BaseException, comm=None) -> bool:
    """Whether EXC comes from a lost process (ULFM error classes), looking through torch's
    wrappers (DDP re-raises the Work's error as a RuntimeError holding its text); with COMM,
    also whether COMM is revoked or knows a failed process."""
    from hpcddp.comm._mpi import MPI
    classes = {MPI.ERR_PROC_FAILED, MPI.ERR_REVOKED,
               getattr(MPI, "ERR_PROC_FAILED_PENDING", MPI.ERR_PROC_FAILED)}
    seen = set()
    e = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, MPI.Exception):
            try:
                code = e.Get_error_class()
            except Exception:
                code = None
            if code in classes:
                return True
            if code == MPI.ERR_IN_STATUS and comm is None:
                # a Waitall over requests of which one failed names only "error code in
                # status" (the class is in a status the caller may not have kept): a process
                # of the job known failed here is the cause where ULFM is on
                comm = MPI.COMM_WORLD
        if any(m in str(e) for m in FAILURE_MARKERS):
            return True
        e = e.__cause__ or e.__context__
    if comm is not None:
        try:
            if comm.Is_revoked():
                return True
            return bool(failed_world_ranks(comm))
        except Exception:
            return False
    return False


def failed_world_ranks(comm) -> list[int]:
    """World ranks (start-up numbering) of COMM's processes known here to have failed."""
    from hpcddp.comm.communicator import translate_group_to_world
    return sorted(failed_in(comm, translate_group_to_world))


def failed_in(comm, translate) -> list:
    """TRANSLATE(the group of COMM's processes known here to have failed), or [] where none
    is (or the MPI has no ULFM: nothing is ever reported failed)."""
    from hpcddp.comm._mpi import MPI
    try:
        failed = comm.Get_failed()
    except (MPI.Exception, NotImplementedError, AttributeError):
        return []
    try:
        return list(translate(failed)) if failed.Get_size() else []
    finally:
        failed.Free()


def lost_ranks(comm) -> list[int]:
    """World ranks of COMM that MPI reported lost, where ULFM is on (elsewhere a lost rank
    ends the whole job, and nothing is asked)."""
    from hpcddp.launch.env import fault_tolerant_job
    return failed_world_ranks(comm) if fault_tolerant_job() else []


def ranks_text(ranks) -> str:
    """"rank 3", "ranks 1, 2", or "a rank" when MPI has not said which."""
    ranks = list(ranks)
    if not ranks:
        return "a rank"
    return f"rank{'s' if len(ranks) != 1 else ''} {', '.join(map(str, ranks))}"


@contextlib.contextmanager
def lost_rank_named(where: str, comm):
    """Turn a lost process's MPI error inside the block into a LostRankError naming the rank
    (MPI's own says "Process Failure" and no more)."""
    try:
        yield
    except Exception as exc:
        if not is_process_failure(exc, comm):
            raise
        who = ranks_text(failed_world_ranks(comm))
        raise LostRankError(
            f"{where}: {who} of the job died during start-up ("
            f"{str(exc)[:80]}): the job cannot start without it and this rank ends; look at "
            f"{who}'s output and the launcher's for why (a crash in MPI's start-up, the OOM "
            f"killer, a node lost)") from exc


# the launcher forwards a line written just before os._exit only if the process lingers
OUTPUT_GRACE_S = 0.2


def end_process(line: str | None, code: int) -> None:
    """Print LINE (rank-prefixed), flush, and end this process with CODE without MPI_Finalize
    (it would wait for the lost ranks)."""
    from hpcddp.comm import output as _log
    if line:
        _log.log(line)
    flush_output()
    time.sleep(OUTPUT_GRACE_S)
    os._exit(code)


def flush_output() -> None:
    """Flush stdout and stderr before an os._exit (which skips Python's own flush)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
