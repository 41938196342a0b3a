"""The async engine: collectives called with ``async_op=True`` run on a communication thread.

MPI's non-blocking collectives move bytes only while some thread is inside MPI, and a blocking
collective on one rank never matches a non-blocking one on another (torch's Join mixes
``async_op`` across ranks), so hpcddp runs every collective as the blocking call of its path
(the arena, CMA, hierarchical, point-to-point lists, MPI). An async call therefore needs a
thread of its own to make progress while the caller computes: as torch's ProcessGroupMPI does
(one worker thread per process group), each group has a lane, one ordered queue and one thread
that runs its calls in issue order. Order within a group is what keeps ranks matched: a
blocking call issued while async calls are still queued joins its group's queue and waits for
its turn; an idle engine lets it run on the caller's thread at once (no hand-off: 12-27 us
saved per call). Groups do not wait for each other: threads of the script that run
collectives on different groups (a checkpoint thread beside the training loop) may issue them
in a different order on each rank, which one queue for all groups turned into a deadlock.
Point-to-point ops post their MPI requests at once on the caller's thread, calls queued or not
(MPI orders them among themselves, never against collectives); calls on CUDA tensors keep the
caller's thread (its current stream) and wait for their group's queue to empty first
(hpcddp.collectives.call.take).

The engine is on for jobs whose ranks span several nodes (a collective there waits on the
network, long enough to hide compute behind), off on one node, where the caller's thread is
measurably faster (docs/ddp.md, "How async ops progress"): ``HPCDDP_ASYNC_ENGINE`` (0, auto,
force) overrides, and it needs MPI_THREAD_MULTIPLE. Ranks may differ in it: each rank keeps
its own issue order either way.
"""
from __future__ import annotations

import queue
import threading
import traceback

import torch

from hpcddp import settings
from hpcddp.collectives.work import Work, completed_future, pending_future, settle

pending = 0                      # calls queued or running, all groups (read without the lock)
_on: bool | None = None          # decided at the first question (on())
_why = ""
_lock = threading.Condition()


class _Lane:
    """One group's queue and communication thread (kept with the group: Communicator.attached,
    closed when its state is released; a later call makes a new one)."""

    def __init__(self, comm):
        self.pending = 0
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=_loop, args=(self,), daemon=True,
                                       name=f"hpcddp-engine-{comm.name}")
        self.thread.start()

    def close(self) -> None:
        self.queue.put(None)         # the thread ends after the calls queued before


def on() -> bool:
    """Whether async collectives run on the engine (decided once per process)."""
    if _on is None:
        _decide()
    return _on


def state() -> str:
    """``on``/``off`` and why, for ``hpcddp info`` and the bench header."""
    on()
    return f"{'on' if _on else 'off'} ({_why})"


def _decide() -> None:
    global _on, _why
    from hpcddp.comm import startup
    mode = settings.get().async_engine
    rt = startup.runtime()
    if mode == "0":
        _on, _why = False, "HPCDDP_ASYNC_ENGINE=0"
    elif rt.thread_level != "multiple":
        _on, _why = False, f"MPI granted thread level {rt.thread_level!r}, not 'multiple'"
    elif mode == "force":
        _on, _why = True, "HPCDDP_ASYNC_ENGINE=force"
    elif rt.topology.num_nodes > 1:
        _on, _why = True, f"the job spans {rt.topology.num_nodes} nodes"
    else:
        _on, _why = False, "one node: the caller's thread is faster"


class EngineWork(Work):
    """The Work of a call queued on the engine: done when the engine has run it; its future
    is completed by the engine thread (DDP's reducer reads it without waiting)."""

    def __init__(self):
        super().__init__([], None)
        self._event = threading.Event()
        self._source = None           # what the engine completes; _future: what is handed out

    def _settle(self, result, exc) -> None:          # the engine thread
        with self._lock:
            self._result, self._exc, self._done = result, exc, True
            source = self._source
        self._event.set()
        if source is not None:
            settle(source, result, exc)

    def wait(self, timeout=None) -> bool:
        if not self._event.is_set():
            self._event.wait()
        if self._exc is not None:
            raise self._exc
        return True

    def is_completed(self) -> bool:
        return self._event.is_set()

    def get_future(self) -> torch.futures.Future:
        with self._lock:
            if self._future is None:
                if self._done:
                    self._future = completed_future(self._result, self._exc)
                else:
                    self._source, self._future = pending_future()
            return self._future


def submit(run, call) -> EngineWork:
    """Queue RUN(CALL) (a path's runner; CALL.async_op is set, so it returns a Work or a
    completed one) behind every call issued before on its group; its Work."""
    global pending
    call.async_op = True
    work = EngineWork()
    lane = call.comm.attached("engine", _Lane)
    with _lock:
        pending += 1
        lane.pending += 1
    lane.queue.put((run, call, work))
    return work


def in_order(run, call):
    """Run RUN(CALL) for a blocking caller behind the queued calls; what a blocking call
    returns (None)."""
    submit(run, call).wait()


def drain(comm=None) -> None:
    """Wait until every call queued on COMM's group (every group: None) has run (before a call
    on it that does not take the queue)."""
    if pending:
        lane = None if comm is None else comm.kept("engine")
        with _lock:
            while (lane.pending if lane is not None else pending if comm is None else 0):
                _lock.wait()


def _loop(lane: _Lane) -> None:
    global pending
    while True:
        item = lane.queue.get()
        if item is None:
            return
        run, call, work = item
        result = exc = inner = None
        try:
            inner = run(call)
            if inner is not None:
                inner.wait()
                result = inner.result()
        except BaseException as e:   # the caller's wait() (or the future) raises it
            exc = e
        with _lock:
            pending -= 1
            lane.pending -= 1
            if not lane.pending:
                _lock.notify_all()
        try:
            work._settle(result, exc)
        except BaseException:        # never let one Work's future stop the engine
            traceback.print_exc()
        del item, run, call, work, inner   # the call's tensors are not kept alive here
