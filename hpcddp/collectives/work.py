"""Work: the handle of an op started with ``async_op=True``.

Driven by MPI non-blocking requests (no Python thread per op): ``wait()`` waits on them and
then runs the op's finishing step (copy-out, AVG division...); ``is_completed()`` tests them.
A subclass of torch's Work, so the same object serves the direct API and torch.distributed
(DDP's reducer calls ``get_future()`` on it from C++).

``get_future()`` on a pending op: torch completes a Future only when someone sets its result.
By default hpcddp waits for the op there (``HPCDDP_FUTURE=wait``): correct, and on few cores
faster than a second thread spinning in MPI. ``HPCDDP_FUTURE=thread`` hands pending ops to one
progress thread (one for the process, not one per op) so the caller runs on.
"""
from __future__ import annotations

import collections
import os
import queue
import threading

import torch
import torch.distributed as dist

from hpcddp.comm._mpi import MPI
from hpcddp.diagnostics import recorder as _rec

_FUTURE_MODE = os.environ.get("HPCDDP_FUTURE", "wait")
# torch may hold only the C++ side of a Work returned to it (DDP's reducer); keep the Python
# side of recent Works alive so its overrides (get_future, wait) stay reachable.
_keepalive: collections.deque = collections.deque(maxlen=1024)


class Work(dist._Work):
    def __init__(self, requests, result, finish=None, entry=None, keep=None, status=None):
        super().__init__()
        self._status = status              # MPI.Status of a recv (source_rank)
        self._requests = requests          # list of MPI.Request
        self._result = result              # list of output tensors (the future's value)
        self._finish = finish              # callable run once after the requests complete
        self._entry = entry                # flight-recorder entry
        self._keep = keep                  # buffers that must outlive the requests
        self._done = False
        self._exc = None
        self._future = None
        self._lock = threading.Lock()
        _keepalive.append(self)

    def _complete(self) -> None:
        # caller holds self._lock
        if self._done:
            return
        try:
            if self._finish is not None:
                self._finish()
        except BaseException as exc:  # keep it for exception(); re-raised by wait()
            self._exc = exc
        self._done = True
        self._keep = None
        if self._entry is not None:
            _rec.end(self._entry)

    def wait(self, timeout=None) -> bool:
        with self._lock:
            if not self._done:
                if self._status is not None:
                    self._requests[0].Wait(self._status)
                else:
                    MPI.Request.Waitall(self._requests)
                self._complete()
        if self._exc is not None:
            raise self._exc
        return True

    def is_completed(self) -> bool:
        with self._lock:
            if not self._done and (self._requests[0].Test(self._status) if self._status is not None
                                   else MPI.Request.Testall(self._requests)):
                self._complete()
            return self._done

    def is_success(self) -> bool:
        return self.is_completed() and self._exc is None

    def exception(self):
        return self._exc

    def result(self):
        return self._result

    def source_rank(self) -> int:
        if self._status is None:
            raise RuntimeError("source_rank: only a recv has a source rank")
        self.wait()
        return self._status.Get_source()

    _source_rank = source_rank

    def get_future(self) -> torch.futures.Future:
        return future_of(self)

    def synchronize(self) -> None:
        self.wait()


class CompletedWork(Work):
    """An op that finished before returning (blocking path called with async_op=True)."""

    def __init__(self, result, exc=None):
        super().__init__([], result)
        self._done = True
        self._exc = exc


def future_of(w) -> torch.futures.Future:
    """``get_future()`` of W, a Work or a C P2PWork (both keep it in ``_future``): made once,
    completed here by waiting or, with HPCDDP_FUTURE=thread, by the progress thread."""
    fut = w._future
    if fut is not None:
        return fut
    fut = w._future = torch.futures.Future()
    if _FUTURE_MODE == "thread" and not w.is_completed():
        _progress().put(w)
        return fut
    try:
        w.wait()
    except BaseException:
        pass
    _settle(w)
    return fut


def _settle(w) -> None:
    exc = w.exception()
    if exc is not None:
        w._future.set_exception(exc)
    else:
        w._future.set_result(w.result())


class TorchP2PWork(dist._Work):
    """A torch Work over a C P2PWork: what the backend hands torch for ``dist.isend``/``irecv``
    (torch's C++ side takes only its own Work type; the direct API returns the P2PWork)."""

    def __init__(self, inner):
        super().__init__()
        self._inner = inner
        _keepalive.append(self)

    def wait(self, timeout=None) -> bool:
        return self._inner.wait()

    def is_completed(self) -> bool:
        return self._inner.is_completed()

    def is_success(self) -> bool:
        return self._inner.is_success()

    def exception(self):
        return None

    def result(self):
        return self._inner.result()

    def source_rank(self) -> int:
        return self._inner.source_rank()

    _source_rank = source_rank

    def get_future(self) -> torch.futures.Future:
        return self._inner.get_future()

    def synchronize(self) -> None:
        self._inner.wait()


_queue: queue.Queue | None = None


def _progress() -> queue.Queue:
    global _queue
    if _queue is None:
        _queue = queue.Queue()

        def loop():
            while True:
                w = _queue.get()
                try:
                    w.wait()
                except BaseException:
                    pass
                _settle(w)
        threading.Thread(target=loop, name="hpcddp-progress", daemon=True).start()
    return _queue
