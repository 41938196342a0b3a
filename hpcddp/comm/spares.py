"""Spare processes started with the job, waiting to replace a lost rank (HPCDDP_ELASTIC_SPARES).

A job started as ``mpirun -n N+S`` with ``HPCDDP_ELASTIC_SPARES=S`` trains on its first N
processes; the last S are spares. Every process duplicates MPI_COMM_WORLD into the *pool*;
``hpcddp.init`` splits the first N off as hpcddp's world and keeps each spare inside it,
its imports done, polling the pool for an order (:func:`wait_as_spare`). After a shrink the
survivors (hpcddp.elastic) call :func:`call_spares`: their rank 0 orders every free spare to
regroup; survivors and free spares shrink the pool (ULFM: the dead leave it), agree on which
spare takes which lost start-up rank, and split the new world off, numbered by start-up rank.
The chosen spares return from ``hpcddp.init`` as a spawned replacement does
(hpcddp.comm.spawn), with the survivors' join message; the others wait on.

Why not spawn: a spawned process starts Python and imports torch while the survivors wait
(seconds), and Open MPI's shared-memory transport does not reach it. A spare did all that
at the job's start.

At the job's end the world's rank 0 releases the free spares (:func:`release`): they finalize
MPI with the others (whose MPI_Finalize fences over every process of the job), or, after a
lost rank, exit without it as the survivors do. A spare whose whole job is gone exits too.

Standard library plus mpi4py: no torch.
"""
from __future__ import annotations

import array
import socket
import time

from hpcddp.comm import heartbeat, output as _log
from hpcddp.comm._mpi import MPI
from hpcddp.comm.failures import end_process, failed_in, is_process_failure
from hpcddp.comm.spawn import numbered_by_start_up_rank

ORDER_TAG = 30_517          # the pool carries nothing but orders to spares
POLL_S = 0.01               # a waiting spare sleeps between polls: it must not take a core
WORLD_CHECK_S = 1.0         # how often a waiting spare checks that its job is still there
RELEASE_WAIT_S = 2.0        # how long the release waits for the spares to take it

_pool = None                # every live process of the job (world and free spares), or None
_members: list = []         # MPI_COMM_WORLD rank of each pool rank
_free: list = []            # MPI_COMM_WORLD ranks of the free spares, in order
_me = -1                    # this process's MPI_COMM_WORLD rank
_node_index = 0             # its place among its node's processes, the ranks first
step = ""                   # where this process is in a regroup (a stuck recovery names it)


def node_index() -> int:
    """This process's place among the processes of its node, the ranks first (in rank order,
    as their local ranks), then the spares: the GPU a process takes. A spare that joins keeps
    the device it would have had, never one a rank of its node holds."""
    return _node_index


def started_with_spares() -> bool:
    """Whether this job was started with spares (all may be taken by now)."""
    return _pool is not None


def split_off(everyone, spares: int):
    """Collective over EVERYONE (a duplicate of MPI_COMM_WORLD): the world of the first
    size - SPARES processes, or COMM_NULL on a spare. Without spares, EVERYONE itself."""
    global _pool, _members, _free, _me, _node_index
    size = everyone.Get_size()
    # every process must split alike: a launcher that did not pass the variable to every
    # node would leave the two sides in different collectives
    bounds = array.array("q", [spares, -spares])
    everyone.Allreduce(MPI.IN_PLACE, [bounds, MPI.INT64_T], op=MPI.MAX)
    high, low = bounds[0], -bounds[1]
    if low != high:
        raise ValueError(f"hpcddp.init: HPCDDP_ELASTIC_SPARES differs between the job's "
                         f"processes ({low} to {high}; here {spares}): export it to every "
                         f"process (mpirun -x HPCDDP_ELASTIC_SPARES)")
    if spares <= 0:
        return everyone
    if spares >= size:
        raise ValueError(f"hpcddp.init: HPCDDP_ELASTIC_SPARES={spares} leaves no process to "
                         f"train: the job has {size}; start it with more processes than spares")
    everyone.Set_errhandler(MPI.ERRORS_RETURN)
    _pool, _me = everyone, everyone.Get_rank()
    _members, _free = list(range(size)), list(range(size - spares, size))
    # the spares are the last ranks: on each node they come after its ranks
    node = everyone.Split_type(MPI.COMM_TYPE_SHARED, key=_me)
    _node_index = node.Get_rank()
    node.Free()
    return everyone.Split(MPI.UNDEFINED if _me >= size - spares else 0, _me)


def wait_as_spare():
    """A spare's life: wait for orders until chosen -> (world communicator, its start-up
    ranks, this process's start-up rank, the join message); released: this process ends."""
    _log.log("hpcddp: spare process (HPCDDP_ELASTIC_SPARES): waits to replace a lost rank")
    _warm_up()
    while True:
        order = _next_order()
        if order["what"] == "release":
            _leave(order["finalize"])
        joined = _regroup(None, [], None)
        if joined is not None:
            return joined


def call_spares(shrunk, missing: list, start_up_rank: int, message: dict):
    """Collective over SHRUNK (the survivors): free spares take the start-up ranks in MISSING.
    -> (world communicator, its start-up ranks, [(start-up rank, host)] of those taken), or
    None where no spare is free. Raises MPI.Exception when a process is lost meanwhile."""
    global step
    if not _free:
        return None
    if shrunk.Get_rank() == 0:
        step = "sending the free spares their order to join"
        for spare in _free:
            try:
                _pool.send({"what": "join"}, dest=_members.index(spare), tag=ORDER_TAG)
            except MPI.Exception:
                pass              # a dead spare: the pool's shrink leaves it out
    world, ranks, _mine, joined = _regroup(start_up_rank, missing,
                                           message if shrunk.Get_rank() == 0 else None)
    return world, ranks, joined["taken"]


def lost_spares() -> list[int]:
    """MPI_COMM_WORLD ranks of the free spares MPI reported failed (ULFM): the job's
    MPI_Finalize would wait for them, as for a lost rank."""
    if not _free:
        return []
    return sorted(set(_failed_members()) & set(_free))


def release(world_rank: int, finalize: bool) -> None:
    """At the job's end, the world's rank 0 (WORLD_RANK) lets the free spares go: they
    MPI_Finalize with everyone (FINALIZE), or exit without it after a lost rank."""
    global _free
    if _pool is None or world_rank != 0:
        return
    sent = []
    for spare in _free:
        try:       # synchronous: done once the spare has it (an exit may follow at once)
            sent.append(_pool.issend({"what": "release", "finalize": finalize},
                                     dest=_members.index(spare), tag=ORDER_TAG))
        except MPI.Exception:
            pass
    deadline = time.monotonic() + RELEASE_WAIT_S
    while sent and time.monotonic() < deadline:
        try:
            sent = [req for req in sent if not req.Test()]
        except MPI.Exception:     # a spare lost meanwhile: it needs no release
            break
        time.sleep(POLL_S)
    _free = []


def _regroup(start_up_rank, missing: list, message):
    """Collective over the live pool: survivors (START_UP_RANK set; the leader with MESSAGE
    and MISSING) and free spares (None) shrink it, a free spare per missing rank joins.
    -> (world, start-up ranks, this process's start-up rank, the join message: the leader's
    MESSAGE with "lost", "taken" [(start-up rank, host)] and "spare") for the new world's
    members, None for a spare left free."""
    global _pool, _members, _free, step
    step = f"in MPI_Comm_shrink of the {_pool.Get_size()} processes of the pool"
    pool = _pool.Shrink()
    pool.Set_errhandler(MPI.ERRORS_RETURN)
    step = f"in the allgather over the {pool.Get_size()} processes left in the pool"
    info = pool.allgather((_me, start_up_rank, missing, message, socket.gethostname()))
    _pool, _members = pool, [launch for launch, *_ in info]
    spares = [launch for launch, rank, *_ in info if rank is None and launch in _free]
    missing = next(m for _, rank, m, msg, _ in info if msg is not None)
    message = next(msg for *_, msg, _ in info if msg is not None)
    chosen = dict(zip(spares, missing))             # spare's launch rank -> start-up rank
    _free = [s for s in spares if s not in chosen]
    mine = start_up_rank if start_up_rank is not None else chosen.get(_me)
    step = "in MPI_Comm_split of the new world off the pool"
    world = pool.Split(MPI.UNDEFINED if mine is None else 0, mine or 0)
    step = ""
    if mine is None:
        return None
    ranks = numbered_by_start_up_rank(world, mine)
    hosts = {launch: host for launch, *_, host in info}
    taken = [(rank, hosts[launch]) for launch, rank in chosen.items()]
    return world, ranks, mine, dict(message, lost=list(missing), taken=taken, spare=True)


def _next_order() -> dict:
    """Poll the pool for an order, sleeping between polls; end this process if every rank
    of its job is gone (nobody left to release it)."""
    req = _pool.irecv(source=MPI.ANY_SOURCE, tag=ORDER_TAG)
    checked = time.monotonic()
    while True:
        try:
            done, order = req.test()
        except MPI.Exception as exc:       # ULFM: a process failed while the receive waited
            if not is_process_failure(exc):
                raise
            # the receive from any source stays pending, but matches nothing until the
            # failures are acknowledged (seen: a spare missed its order for good)
            _pool.Ack_failed()
            done, order = False, None
        if done:
            return order
        if time.monotonic() - checked > WORLD_CHECK_S:
            checked = time.monotonic()
            if _job_gone():
                end_process("hpcddp: spare process: every rank of its job is gone: it exits", 1)
        time.sleep(POLL_S)


def _job_gone() -> bool:
    return set(_members) - set(_free) - {_me} <= set(_failed_members())


def _failed_members() -> list[int]:
    """MPI_COMM_WORLD ranks of the pool's processes known here to have failed."""
    def launch_ranks(failed):
        pool_ranks = MPI.Group.Translate_ranks(failed, list(range(failed.Get_size())),
                                               _pool.Get_group())
        return [_members[r] for r in pool_ranks if r != MPI.UNDEFINED]
    return failed_in(_pool, launch_ranks)


def _leave(finalize: bool) -> None:
    _log.log("hpcddp: spare process not needed: released at the job's end")
    if finalize and MPI.Is_initialized() and not MPI.Is_finalized():
        heartbeat.stop()
        MPI.Finalize()
    end_process(None, 0)


def _warm_up() -> None:
    """Import now what a replacement would import once it joins (torch, and torch._dynamo,
    which the first optimizer or DDP imports: seconds together), while nothing waits for it.
    Spares serve elastic training, which runs on torch."""
    try:
        import torch._dynamo  # noqa: F401
    except Exception:
        pass
