"""Synchronisation: barrier and monitored_barrier (names the ranks that never arrived)."""
from __future__ import annotations

import time
from datetime import timedelta

from hpcddp import settings
from hpcddp.collectives import engine as _engine
from hpcddp.collectives._common import finish_or_work, record, record_end, resolve
from hpcddp.collectives.paths import Call
from hpcddp.comm._mpi import MPI
from hpcddp.diagnostics import recorder as _rec


def barrier(group=None, async_op=False):
    """Return once every rank of the group has called barrier."""
    comm = resolve(group, "barrier")
    entry = record(comm, "barrier")
    if _engine.pending or async_op and _engine.on():   # in issue order (collectives.engine)
        call = Call()
        call.comm, call.entry = comm, entry
        if async_op:
            return _engine.submit(_barrier, call)
        return _engine.in_order(_barrier, call)
    return finish_or_work(async_op, entry, [comm.mpi.Ibarrier()], [])


def _barrier(c):
    return finish_or_work(True, c.entry, [c.comm.mpi.Ibarrier()], [])


class BarrierTimeout(RuntimeError):
    """monitored_barrier timed out; the message names the ranks that did not arrive."""


def _where(world_ranks, wait: float = 2.0) -> dict:
    """{world rank: 'in Python at train.py:88 (in step)'} through the diagnostics watchdogs."""
    from hpcddp.diagnostics import query_ranks
    from hpcddp.diagnostics.report import _status
    try:
        got = query_ranks(world_ranks, wait)
    except Exception:  # a report aid: never let it hide the timeout itself
        return {}
    if got is None:
        return {}
    snaps, gone = got
    return {r: _status(snaps.get(r), gone.get(r)) for r in world_ranks}


def _missing_text(comm, shown, world, timeout, where) -> str:
    parts = []
    for r in shown:
        w = world[r]
        place = f": {where[w]}" if w in where else ""
        parts.append(f"rank {r}{'' if w == r else f' (world rank {w})'}{place}")
    return (f"monitored_barrier: {len(shown)} rank(s) of group {comm.name!r} did not reach the "
            f"barrier within {timeout:.1f} s (its timeout=, else the group's, else "
            f"HPCDDP_TIMEOUT): " + "; ".join(parts))


def monitored_barrier(group=None, timeout=None, wait_all_ranks: bool = False) -> None:
    """A barrier that fails after TIMEOUT naming the ranks that did not arrive, and where they are.

    Rank 0 of the group waits for a message from every other rank, then releases them. If some
    never come within TIMEOUT (seconds or timedelta; default: the group's torch ``timeout=``,
    else HPCDDP_TIMEOUT, else 600 s), rank 0
    raises :class:`BarrierTimeout` naming them (all of them with wait_all_ranks=True, else the
    first) and where each one is (through the diagnostics watchdog: "in Python at
    train.py:88"); the ranks that did arrive raise the same error. If rank 0 itself never
    comes, the others raise after TIMEOUT + 2 s saying so. Called by every member of the group.
    Not checked by HPCDDP_DEBUG=detail (the check is itself a collective that would wait).
    """
    comm = resolve(group, "monitored_barrier")
    if timeout is None and comm.timeout:
        timeout = comm.timeout          # the group's torch timeout= (init_process_group/new_group)
    if timeout is None:
        timeout = settings.get().timeout or settings.DEFAULT_TIMEOUT
    if isinstance(timeout, timedelta):
        timeout = timeout.total_seconds()
    entry = _rec.start(comm, "monitored_barrier")
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
            text = _missing_text(comm, shown, world, timeout, _where([world[r] for r in shown]))
            arrived = [r for r in range(1, comm.size) if r not in pending]
            MPI.Request.Waitall([mpi.isend(text, dest=r, tag=tag) for r in arrived])
            record_end(entry)
            raise BarrierTimeout(text)
        MPI.Request.Waitall([mpi.isend(None, dest=r, tag=tag) for r in range(1, comm.size)])
    else:
        mpi.isend(True, dest=0, tag=tag).Wait()
        release = mpi.irecv(source=0, tag=tag)
        deadline += 2.0    # rank 0's own deadline may start a little after ours
        while True:
            done, msg = release.test()
            if done:
                break
            if time.monotonic() > deadline:
                release.Cancel()
                where = _where([world[0]]).get(world[0])
                record_end(entry)
                raise BarrierTimeout(
                    f"monitored_barrier: rank 0 (world rank {world[0]}) of group {comm.name!r} "
                    f"did not release the barrier within {timeout + 2:.1f} s: it has not reached "
                    f"it" + (f" ({where})" if where else " (or it is dead)"))
            time.sleep(0.001)
        if msg is not None:
            record_end(entry)
            raise BarrierTimeout(msg)
    record_end(entry)
    return None
