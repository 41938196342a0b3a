"""MPI start-up and shutdown, written down in one place.

``init()`` starts MPI (asking for MPI_THREAD_MULTIPLE: DDP runs collectives from autograd
threads), duplicates COMM_WORLD into hpcddp's private world (our traffic never collides with
the user's), resolves local rank and nodes, picks the CUDA device by local rank, and runs
what the layers above start with MPI (the diagnostics' watchdog, abort-on-exception: named in
``hpcddp.ON_MPI_START``, so that comm imports none of those layers). It is idempotent and safe
when mpi4py already initialised MPI.
"""
from __future__ import annotations

import atexit
import importlib
import os
import sys
import threading
from dataclasses import dataclass, field

import hpcddp
from hpcddp import settings
from hpcddp.comm import output as _log
from hpcddp.comm import heartbeat, spares
from hpcddp.comm import _mpi
from hpcddp.comm._mpi import MPI
from hpcddp.comm.communicator import Communicator
from hpcddp.comm.failures import end_process, lost_rank_named, lost_ranks, ranks_text
from hpcddp.comm.topology import Topology, build_topology, emulated_ranks_per_node
from hpcddp.launch import process
from hpcddp.launch.env import fault_tolerant_job
from hpcddp.launch.mpirun import SURVIVOR_LEFT_LINE, WITHOUT_FINALIZE_LINE
from hpcddp.launch.torchrun_env import export_after_start

THREAD_LEVELS = {
    "single": MPI.THREAD_SINGLE, "funneled": MPI.THREAD_FUNNELED,
    "serialized": MPI.THREAD_SERIALIZED, "multiple": MPI.THREAD_MULTIPLE,
}
_LEVEL_NAMES = {v: k for k, v in THREAD_LEVELS.items()}


@dataclass
class Runtime:
    """What init() found: one per process."""
    world: Communicator
    topology: Topology
    thread_level: str                  # granted
    thread_level_requested: str
    launch: object                     # hpcddp.launch.LaunchInfo or None (singleton)
    local_rank_source: str             # "emulated", "mpi-shared-memory" or "launcher"
    mpi_library: str
    mpi_version: str
    we_initialized: bool
    cuda_device: int | None = None
    notes: list = field(default_factory=list)
    joined: dict | None = None         # a replacement rank: what the survivors handed over


_runtime: Runtime | None = None
_lock = threading.Lock()


def _mpi_library() -> tuple[str, str]:
    text = MPI.Get_library_version().strip("\x00 \n").splitlines()[0].strip()
    lower = text.lower()
    for key, name in (("open mpi", "Open MPI"), ("cray mpich", "Cray MPICH"),
                      ("mvapich", "MVAPICH"), ("mpich", "MPICH"), ("intel", "Intel MPI")):
        if key in lower:
            return name, text
    return text.split(",")[0], text


def init(*, abort_on_exception: bool | None = None,
         set_cuda_device: bool = True, timeout: float | None = None) -> Runtime:
    """Start MPI (if needed) and hpcddp's world. Idempotent; call on every rank.

    MPI is asked for MPI_THREAD_MULTIPLE (``HPCDDP_THREAD_LEVEL`` asks for another level);
    what was granted is in ``Runtime.thread_level``, with a warning if it is lower.
    abort_on_exception: True: an uncaught exception on any rank (in any thread) prints its
        traceback with the rank prefix and aborts the whole job (MPI_Abort) at once instead of
        leaving the others waiting. None (default): ``HPCDDP_ABORT_ON_EXCEPTION``, by default
        ``auto``: with more than one rank, a rank whose script ends with an uncaught exception
        aborts the job at its exit instead of waiting in MPI's finalize. False: neither (the
        watchdog reports the others' wait after the timeout; docs/hangs.md).
    set_cuda_device: with CUDA, ``torch.cuda.set_device(local_rank % device_count)``.
    timeout: seconds before a stalled op is reported (HPCDDP_TIMEOUT, default 600; 0 turns
        the watchdog off; docs/hangs.md).
    """
    global _runtime
    with _lock:
        if _runtime is None:
            _runtime = _start(settings.get().thread_level)
        rt = _runtime
    if timeout is not None:   # what every later reader of HPCDDP_TIMEOUT sees
        settings.set_from_init(timeout=settings.timeout_from(timeout))
    # e.g. the watchdog (stall reports): started by the first init on every rank (a
    # collective), later calls only change its timeout
    _run_hooks(hpcddp.ON_MPI_START, rt, timeout=timeout, abort_on_exception=abort_on_exception)
    _mpi.started()      # the watchdog runs: the start-up guard's watch is over
    if set_cuda_device and rt.cuda_device is None:
        spare = rt.joined is not None and rt.joined.get("spare")
        # a spare joins a node whose ranks hold their devices: it takes the one it was given
        rt.cuda_device = _pick_cuda_device(spares.node_index() if spare else
                                           rt.topology.local_rank)
    return rt


def _start(thread_level: str) -> Runtime:
    if thread_level not in THREAD_LEVELS:
        raise ValueError(f"init: thread_level must be one of {sorted(THREAD_LEVELS)}, "
                         f"got {thread_level!r}")
    from hpcddp.launch import detect
    launch = detect()  # raises LaunchEnvError on contradictory variables, before MPI starts
    from hpcddp.comm._mpi import STARTED_HERE
    we_init = STARTED_HERE
    if MPI.Is_finalized():
        raise RuntimeError("init: MPI was already finalized in this process; it cannot restart")
    if not MPI.Is_initialized():  # someone set mpi4py.rc.initialize = False: start it now
        MPI.Init_thread(THREAD_LEVELS[thread_level])
        we_init = True
    # also where the user's script started MPI first (mpi4py then finalizes it at exit, after
    # this): a rank that outlived a lost one must not reach MPI_Finalize
    atexit.register(_finalize_at_exit, we_init)
    process.own()     # hpcddp's hooks act in this process only, never in its forked children
    granted = _LEVEL_NAMES.get(MPI.Query_thread(), str(MPI.Query_thread()))
    world, joined, launch_key, stray_warning = _world(launch)
    _log.set_rank(world.world_ranks[world.rank])
    notes = []
    if stray_warning and world.rank == 0:   # inherited by every rank alike: one line says it
        notes.append(stray_warning)
    if spares.started_with_spares() and world.rank == 0 and not fault_tolerant_job():
        notes.append(f"HPCDDP_ELASTIC_SPARES={settings.get().elastic_spares} but this job "
                     f"runs without fault tolerance (mpirun --with-ft ulfm): a lost rank ends "
                     f"the whole job, and the spare processes only wait for its end")
    if THREAD_LEVELS[granted] < THREAD_LEVELS[thread_level]:
        notes.append(f"MPI granted thread level {granted!r}, asked for {thread_level!r}: "
                     f"DDP's autograd-thread collectives are serialised by hpcddp")
    rpn = emulated_ranks_per_node()
    with lost_rank_named("hpcddp.init", world.mpi):
        topo = build_topology(world, rpn, launch_key)
    # torchrun's variables (RANK, LOCAL_RANK, GROUP_RANK...) with what only MPI knows
    export_after_start(launch, world.rank, world.size, topo.local_rank, topo.local_size,
                       topo.node, topo.num_nodes)
    if rpn:
        source = "emulated"
    else:
        source = "mpi-shared-memory"
        if launch_key is not None and launch_key != topo.local_rank:
            # MPI's shared-memory split is what the hardware is; a launcher can be configured
            # to describe something else (e.g. a wrapper script re-numbering tasks).
            notes.append(f"launcher {launch.launcher} says local rank {launch.local_rank}, MPI's "
                         f"shared-memory split says {topo.local_rank}: using MPI's (it is what "
                         f"shares memory)")
    lib, ver = _mpi_library()
    rt = Runtime(world=world, topology=topo, thread_level=granted,
                 thread_level_requested=thread_level, launch=launch, local_rank_source=source,
                 mpi_library=lib, mpi_version=ver, we_initialized=we_init, notes=notes,
                 joined=joined)
    for n in notes:
        _log.log(f"hpcddp.init: {n}")
    if launch is not None:
        process.watch_launcher(say=_log.log)   # a rank outliving its mpirun ends itself
    return rt


def _world(launch):
    """hpcddp's world for this process -> (Communicator, the join message of a replacement or
    None, the launcher's local rank where it orders the node's ranks or None, a warning for
    stray launcher variables or None)."""
    from hpcddp.launch import check_world
    parent = MPI.Comm.Get_parent()
    if parent != MPI.COMM_NULL:
        # hpcddp.elastic spawned this process to replace a lost rank: its world is the job's,
        # joined through the parent intercommunicator (its own COMM_WORLD is a world of one;
        # its launcher numbers the spawned job, not the node)
        from hpcddp.comm.spawn import join_as_replacement
        comm, ranks, _me, joined = join_as_replacement(parent)
        return Communicator(comm, "WORLD", ranks), joined, None, None
    # raises LaunchWorldError (a RuntimeError) for torchrun's workers and for an MPI that
    # did not connect to its launcher; returns a warning for a stray WORLD_SIZE or RANK
    stray_warning = check_world(launch, MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size(),
                                sys.argv)
    _log.set_rank(MPI.COMM_WORLD.Get_rank())
    with lost_rank_named("hpcddp.init", MPI.COMM_WORLD):
        comm = spares.split_off(MPI.COMM_WORLD.Dup(), settings.get().elastic_spares)
    if comm != MPI.COMM_NULL:
        # the launcher numbers the spares among the ranks of a node: its local rank is not
        # the world's there
        key = launch.local_rank if launch is not None and not spares.started_with_spares() \
            else None
        return (Communicator(comm, "WORLD", list(range(comm.Get_size()))), None, key,
                stray_warning)
    # a spare (HPCDDP_ELASTIC_SPARES): here until it replaces a lost rank, then on as a
    # spawned replacement goes on; or released at the job's end
    if launch is not None:
        process.watch_launcher(say=_log.log)
    comm, ranks, _me, joined = spares.wait_as_spare()
    return Communicator(comm, "WORLD", ranks), joined, None, stray_warning


def _pick_cuda_device(local_rank: int):
    import sys
    if "torch" not in sys.modules and os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return None
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    dev = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(dev)
    return dev


def runtime() -> Runtime:
    """The Runtime, starting MPI on first use."""
    return _runtime if _runtime is not None else init()


def is_initialized() -> bool:
    return _runtime is not None


def world() -> Communicator:
    """hpcddp's private duplicate of MPI_COMM_WORLD (starting MPI on first use)."""
    rt = _runtime
    return rt.world if rt is not None else init().world


def get_topology() -> Topology:
    return runtime().topology


_recovered = [False]      # hpcddp.elastic recovered from a lost process in this job


def note_recovery() -> None:
    """hpcddp.elastic recovered from a lost process: the job's MPI_Finalize would wait for
    it (the rebuilt world no longer shows it), so no rank of the job reaches MPI_Finalize."""
    _recovered[0] = True


def finalize() -> None:
    """Free hpcddp's communicators and finalize MPI if hpcddp started it. Call on every rank."""
    global _runtime
    with _lock:
        rt = _runtime
    if rt is None:
        return
    if _recovered[0] or lost_ranks(rt.world.mpi) or spares.lost_spares():
        # MPI_Finalize would wait for the lost: the exit handler ends this rank without it
        spares.release(rt.world.rank, finalize=False)
        return
    with _lock:
        _runtime = None
    _drain_async_engine()
    _run_hooks(hpcddp.ON_MPI_FINALIZE)
    spares.release(rt.world.rank, finalize=True)
    if rt.we_initialized and MPI.Is_initialized() and not MPI.Is_finalized():
        heartbeat.stop()
        MPI.Finalize()


def _finalize_at_exit(finalize_mpi: bool = True) -> None:
    if not process.in_rank_process():     # a forked child exiting: MPI is its parent's
        return
    if MPI.Is_initialized() and not MPI.Is_finalized():
        _end_without_finalize_if_ranks_lost()
        rt = _runtime
        if rt is not None:
            spares.release(rt.world.rank, finalize=True)
        if finalize_mpi:
            _drain_async_engine()
            _run_hooks(hpcddp.ON_MPI_FINALIZE)
            heartbeat.stop()
            MPI.Finalize()
        # (else the script started MPI, and mpi4py's own exit handler, which runs after this
        # one, finalizes it)
        if rt is not None and fault_tolerant_job():
            # under ULFM Open MPI's launcher exits 0 whatever its processes did (killed or
            # crashed alike): `hpcddp launch` fails a job in which no rank said it ended
            _log.log(SURVIVOR_LEFT_LINE.format(rank=rt.world.rank, size=rt.world.size,
                                               code=_exit_code_so_far()))


def _exit_code_so_far() -> int:
    """At exit: 1 after an uncaught exception, else 0 (sys.exit's own code is not known)."""
    return 1 if getattr(sys, "last_value", None) is not None else 0


def _end_without_finalize_if_ranks_lost() -> None:
    """Under ULFM, MPI_Finalize after a lost rank waits for it (across nodes: until the job's
    time limit, seen): end this rank with a line naming the lost one(s) instead, exit 1
    after an uncaught exception, else 0. The same for a lost spare process (the others
    trained on: no rank was lost). hpcddp.elastic installs its own exit once it recovered;
    this one serves start-up, jobs outside elastic mode and scripts that never reached
    elastic.State."""
    rt = _runtime
    lost = lost_ranks(rt.world.mpi if rt is not None else MPI.COMM_WORLD)
    lost_spares = spares.lost_spares() if not lost else []
    if not lost and not lost_spares:
        return
    code = _exit_code_so_far()
    if rt is not None:
        spares.release(rt.world.rank, finalize=False)
    who = (ranks_text(lost) + " of the job" if lost else
           f"spare process{'es' if len(lost_spares) > 1 else ''} "
           f"{', '.join(map(str, lost_spares))} of the launch")
    them = "them" if len(lost or lost_spares) > 1 else "it"
    end_process(f"hpcddp: {who} lost: this rank exits (exit {code}) {WITHOUT_FINALIZE_LINE} "
                f"{them}", code)


def _drain_async_engine() -> None:
    """Let async calls still queued on the engine's thread finish before MPI does (the
    watchdog still runs: a call that cannot finish ends in its stall report). Looked up, not
    imported: a process that never ran a collective (the stager) never loads torch for it."""
    engine = sys.modules.get("hpcddp.collectives.engine")
    if engine is not None:
        engine.drain()


def _run_hooks(names, *args, **kwargs) -> None:
    """Call each "module:function" of NAMES (hpcddp.ON_MPI_START / ON_MPI_FINALIZE)."""
    for name in names:
        module, function = name.split(":")
        getattr(importlib.import_module(module), function)(*args, **kwargs)
