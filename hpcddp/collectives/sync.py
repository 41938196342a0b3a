"""Synchronisation: barrier and monitored_barrier (names the ranks that never arrived)."""
from __future__ import annotations

import time
from datetime import timedelta

from hpcddp.collectives._common import finish_or_work, record, record_end, resolve
from hpcddp.comm._mpi import MPI


def barrier(group=None, async_op=False):
    """Return once every rank of the group has called barrier."""
    comm = resolve(group, "barrier")
    entry = record(comm, "barrier")
    return finish_or_work(async_op, entry, [comm.mpi.Ibarrier()], [])


class BarrierTimeout(RuntimeError):
    pass


def monitored_barrier(group=None, timeout=None, wait_all_ranks: bool = False) -> None:
    """A barrier that fails after TIMEOUT naming the ranks that did not arrive.

    Rank 0 of the group waits for a message from every other rank, then releases them. If some
    never come within TIMEOUT (seconds or timedelta; default HPCDDP_TIMEOUT or 300 s), rank 0
    raises naming them (all of them with wait_all_ranks=True, else the first), and the others
    raise when rank 0's release does not come.
    """
    import os
    comm = resolve(group, "monitored_barrier")
    if timeout is None:
        timeout = float(os.environ.get("HPCDDP_TIMEOUT", "300"))
    if isinstance(timeout, timedelta):
        timeout = timeout.total_seconds()
    entry = record(comm, "monitored_barrier")
    tag = 32000 + (entry[0] % 700)  # per-call tag: a late rank's message never matches a later call
    mpi = comm.mpi
    deadline = time.monotonic() + timeout
    world = comm.world_ranks
    if comm.rank == 0:
        pending = {r: mpi.irecv(source=r, tag=tag) for r in range(1, comm.size)}
        while pending and time.monotonic() < deadline:
            for r in [r for r, q in pending.items() if q.Test()]:
                del pending[r]
            if pending:
                time.sleep(0.001)
        if pending:
            missing = sorted(pending)
            for q in pending.values():
                q.Cancel()
            shown = missing if wait_all_ranks else missing[:1]
            raise BarrierTimeout(
                f"monitored_barrier: rank(s) {', '.join(map(str, shown))} (world rank(s) "
                f"{', '.join(str(world[r]) for r in shown)}) of group {comm.name!r} did not reach "
                f"the barrier within {timeout:.1f} s (set by timeout= or HPCDDP_TIMEOUT)")
        reqs = [mpi.isend(True, dest=r, tag=tag) for r in range(1, comm.size)]
        MPI.Request.Waitall(reqs)
    else:
        mpi.isend(True, dest=0, tag=tag).Wait()
        release = mpi.irecv(source=0, tag=tag)
        while not release.Test():
            if time.monotonic() > deadline:
                release.Cancel()
                raise BarrierTimeout(
                    f"monitored_barrier: rank 0 (world rank {world[0]}) of group {comm.name!r} did "
                    f"not release the barrier within {timeout:.1f} s: another rank is missing "
                    f"(rank 0 names it)")
            time.sleep(0.001)
    record_end(entry)
    return None
