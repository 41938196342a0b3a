"""hpcddp as a torch.distributed backend: registration, MPI-bootstrapped store, groups.

Importing hpcddp registers the backend "hpcddp" (once) without starting MPI. Then, under
mpirun/srun, or alone (``python train.py``: a world of one), with nothing else set::

    import hpcddp, torch.distributed as dist
    dist.init_process_group("hpcddp")          # or hpcddp.init_process_group()

The store torch insists on is bootstrapped through MPI (rank 0 opens a TCPStore on a free
port and broadcasts its address), so no MASTER_ADDR/MASTER_PORT is needed; explicit
``rank``/``world_size``/``store``/``init_method`` are still honoured.
"""
from __future__ import annotations

import importlib
import os
import socket
import threading
from datetime import timedelta

import torch.distributed as dist

from hpcddp import settings

BACKEND_NAME = "hpcddp"  # the name users pass to init_process_group

_registered = False
_lock = threading.Lock()
_pending_comm = threading.local()   # group_from_comm hands its communicator to the creator


def _create(opts, pg_options=None):
    """torch's creator callback (extended API): called on members of a group only."""
    from hpcddp.comm import startup as rt
    from hpcddp.comm._mpi import MPI
    from hpcddp.comm.communicator import Communicator
    world = rt.world()
    given = getattr(_pending_comm, "comm", None)
    if given is not None:
        _pending_comm.comm = None
        comm = given
        if comm.rank != opts.group_rank or comm.size != opts.group_size:
            raise RuntimeError(f"group_from_comm: communicator rank {comm.rank} of {comm.size} "
                               f"differs from torch's group rank {opts.group_rank} of "
                               f"{opts.group_size}")
    elif not opts.global_ranks_in_group:
        comm = world
        if opts.group_size != world.size or opts.group_rank != world.rank:
            raise RuntimeError(
                f"init_process_group(backend='hpcddp'): rank={opts.group_rank}, world_size="
                f"{opts.group_size} disagree with MPI (rank {world.rank} of {world.size}); leave "
                f"them unset under mpirun/srun, or launch {opts.group_size} MPI ranks")
    else:
        ranks = list(opts.global_ranks_in_group)
        group = world.mpi.Get_group().Incl(ranks)
        # MPI_Comm_create_group: only members take part (torch calls us on members only)
        tag = sum(ranks) % 4096 + 7
        sub = world.mpi.Create_group(group, tag)
        group.Free()
        comm = Communicator(sub, f"group{list(ranks)}", ranks, owned=True)
        if comm.rank != opts.group_rank:
            raise RuntimeError(f"new_group: MPI rank {comm.rank} differs from torch's group rank "
                               f"{opts.group_rank} for ranks {ranks}")
    del MPI
    comm.timeout = _group_timeout(opts.timeout)
    from hpcddp.backend.process_group import ProcessGroupHPCDDP
    return ProcessGroupHPCDDP(comm, opts.store, opts.timeout)


def _group_timeout(timeout) -> float | None:
    """The stall timeout of a new group: torch's ``timeout=`` where the caller gave one, else
    None (the job's HPCDDP_TIMEOUT). torch passes its default (30 min) when none was given,
    so that value counts as none: HPCDDP_TIMEOUT's 10 min stays the default."""
    if timeout is None or timeout == dist.default_pg_timeout:
        return None
    return timeout.total_seconds() or None


def register() -> None:
    """Register the "hpcddp" backend with torch.distributed (idempotent, starts no MPI)."""
    global _registered
    with _lock:
        if _registered or BACKEND_NAME.upper() in dist.Backend._plugins:
            _registered = True
            return
        # "cuda" too: the ops serve CUDA tensors (direct to a CUDA-aware MPI, else staged
        # through pinned host memory; docs/gpu.md). Our process group is a Python
        # ProcessGroup subclass, so torch hands it every tensor whatever this list says; the
        # list only feeds torch's BackendConfig ("hpcddp" -> "cpu:hpcddp,cuda:hpcddp"). It
        # takes no default away: a CUDA build keeps cuda -> nccl for backend-less init, and
        # CPU-only torch is unaffected (object collectives still pick "cpu").
        devices = ["cpu", "cuda"]
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=devices)
        _wrap_env_rendezvous()
        _registered = True


def _store_address(world) -> str:
    override = settings.get().store_addr
    if override:
        return override
    hosts = world.mpi.allgather(socket.gethostname())
    if len(set(hosts)) == 1:
        return "127.0.0.1"
    return hosts[0]


def bootstrap_store(timeout: timedelta = timedelta(minutes=10)):
    """A TCPStore served by rank 0 on a free port, its address broadcast through MPI.

    Collective over the world: every rank calls it.
    """
    from hpcddp.comm import startup as rt
    world = rt.world()
    addr = _store_address(world)
    if world.rank == 0:
        store = dist.TCPStore(addr if addr != "127.0.0.1" else "0.0.0.0", 0, world.size, True,
                              timeout, wait_for_workers=False)
        port = store.port
    else:
        store, port = None, None
    port = world.mpi.bcast(port, root=0)
    if world.rank != 0:
        store = dist.TCPStore(addr, port, world.size, False, timeout)
    return store


def _wrap_env_rendezvous() -> None:
    """Let env:// (torch's default init_method) bootstrap through MPI when MASTER_ADDR is unset.

    Only when this process was started by an MPI launcher and torch's own variables are
    missing; otherwise torch's handler runs unchanged. This is what makes a plain
    ``dist.init_process_group("hpcddp")`` (or "gloo") work under mpirun/srun.
    """
    rdzv = importlib.import_module("torch.distributed.rendezvous")
    original = rdzv._rendezvous_handlers.get("env")
    if original is None or getattr(original, "_hpcddp", False):
        return

    def env_or_mpi(url, timeout=timedelta(minutes=10), **kwargs):
        from hpcddp.launch import detect
        # before torch's handler too: a WORLD_SIZE contradicting mpirun's would otherwise have
        # rank 0's TCPStore wait for ranks that never come (torch's timeout, 30 min)
        launch = detect()
        if launch is None and not _torch_env_given(url):
            # `python train.py` alone: no launcher and none of torch's variables, which torch
            # would refuse ("RANK expected"); MPI starts as a singleton, a world of one
            pass
        elif "MASTER_ADDR" in os.environ or launch is None or launch.launcher == "torchrun":
            yield from original(url, timeout=timeout, **kwargs)
            return
        from hpcddp.comm import startup as rt
        world = rt.world()      # start-up also fills torchrun's variables MPI knows
        store = bootstrap_store(timeout)
        yield (store, world.rank, world.size)

    env_or_mpi._hpcddp = True

    def _torch_env_given(url) -> bool:
        # what torch's env:// handler reads (the url's ?rank=&world_size= too)
        return any(k in os.environ for k in ("MASTER_ADDR", "MASTER_PORT", "RANK",
                                             "WORLD_SIZE")) or "rank=" in str(url)
    rdzv._rendezvous_handlers["env"] = env_or_mpi


def init_process_group(backend: str | None = None, *, timeout: timedelta | None = None,
                       device: str | None = None, **kwargs):
    """``dist.init_process_group`` over MPI, with nothing to set under mpirun/srun.

    backend: "hpcddp" (default), or a device map like "cpu:hpcddp,cuda:nccl". With
    ``device="cuda"`` and no backend, the best available combination is chosen and printed
    (hpcddp for CPU tensors, NCCL for CUDA tensors where NCCL exists).
    Returns the default process group. Collective: every rank calls it.
    """
    from hpcddp.comm import output as log, startup as rt
    rtm = rt.init()
    register()
    if backend is None:
        backend = BACKEND_NAME
        if device == "cuda":
            import torch
            if torch.cuda.is_available() and dist.is_nccl_available():
                backend = f"cpu:{BACKEND_NAME},cuda:nccl"
            if rtm.world.rank == 0:
                log.log(f"init_process_group: device='cuda' -> backend {backend!r}")
    if dist.is_initialized():
        # torch's own words and type: a second init is a bug, never a silent no-op that
        # hands back a group of another backend than the one asked for
        raise ValueError(f"init_process_group: trying to initialize the default process group "
                         f"twice! (it is initialised with backend "
                         f"{dist.get_backend()!r}; call dist.destroy_process_group() first)")
    kw = dict(kwargs)
    if "store" not in kw and "init_method" not in kw:
        kw["store"] = bootstrap_store(timeout or timedelta(minutes=10))
    kw.setdefault("rank", rtm.world.rank)
    kw.setdefault("world_size", rtm.world.size)
    if timeout is not None:
        kw["timeout"] = timeout
    dist.init_process_group(backend, **kw)
    return dist.group.WORLD


def group_from_comm(comm, name: str | None = None):
    """A torch.distributed group over COMM (an mpi4py Intracomm or hpcddp Communicator).

    Only COMM's members call it (no collective over the world), and ranks need not be
    contiguous. The result works with every ``dist.*`` op (``group=``) and with DDP
    (``process_group=``).
    """
    from hpcddp.comm.communicator import Communicator
    if not isinstance(comm, Communicator):
        comm = Communicator(comm, name or "")
    ranks = list(comm.world_ranks)
    if ranks != sorted(ranks):
        # torch numbers a group's ranks in world order (new_group sorts the list it is given):
        # renumber a duplicate of COMM the same way, or the group rank torch computes for a
        # world rank would name another process here. Collective over COMM's members only.
        comm = Communicator(comm.mpi.Split(0, ranks[comm.rank]), comm.name, sorted(ranks),
                            owned=True)
    if not dist.is_initialized():
        raise RuntimeError("group_from_comm: call hpcddp.init_process_group() (or "
                           "dist.init_process_group('hpcddp')) first")
    _pending_comm.comm = comm
    # torch numbers ranks as hpcddp's world does now; after hpcddp.elastic shrank the world
    # that is no longer MPI_COMM_WORLD's numbering, which world_ranks keep
    from hpcddp.comm import startup as rt
    now = {w: i for i, w in enumerate(rt.world().world_ranks)}
    try:
        return dist.new_group([now[r] for r in comm.world_ranks], backend=BACKEND_NAME,
                              use_local_synchronization=True)
    finally:
        _pending_comm.comm = None


def topology_groups() -> dict:
    """The topology's communicators as torch groups: {"node", "leaders", "cross"}.

    Collective over the world (every rank calls it); "leaders" is None off node leaders.
    """
    from hpcddp.comm import startup as rt
    topo = rt.get_topology()
    return {k: (None if c is None else group_from_comm(c))
            for k, c in topo.communicators().items()}


def __getattr__(name):
    # the process group class imports the MPI layer: only load it when asked
    if name == "ProcessGroupHPCDDP":
        from hpcddp.backend.process_group import ProcessGroupHPCDDP
        return ProcessGroupHPCDDP
    raise AttributeError(name)


__all__ = ["ProcessGroupHPCDDP", "bootstrap_store", "group_from_comm", "init_process_group",
           "register", "topology_groups"]
