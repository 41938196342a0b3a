"""Work: the handle of an op started with ``async_op=True``.

Driven by MPI non-blocking requests (no Python thread per op): ``wait()`` waits on them and
then runs the op's finishing step (copy-out, AVG division...); ``is_completed()`` tests them.
A subclass of torch's Work, so the same object serves the direct API and torch.distributed
(DDP's reducer calls ``get_future()`` on it from C++). An irecv's is a :class:`RecvWork`,
which checks the size of the message received (:func:`check_count`).

``get_future()`` on a pending op: torch completes a Future only when someone sets its result.
By default hpcddp waits for the op there (``HPCDDP_FUTURE=wait``): correct, and on few cores
faster than a second thread spinning in MPI. ``HPCDDP_FUTURE=thread`` hands pending ops to one
progress thread (one for the process, not one per op) so the caller runs on.
"""
from __future__ import annotations

import collections
import functools
import queue
import threading

import torch
import torch.distributed as dist

from hpcddp import settings
from hpcddp.comm._mpi import MPI
from hpcddp.diagnostics import recorder as _rec

_FUTURE_MODE = settings.get().future
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
        self._finish = None               # runs once (and may be a method of this Work)
        if self._entry is not None:
            _rec.end(self._entry)

    def then_finish(self, step) -> None:
        """Run STEP after the op's own finishing step, as it completes (now, if it has)."""
        with self._lock:
            if not self._done:
                first = self._finish
                self._finish = step if first is None else _Chain(first, step)
                return
        step()

    def _block(self) -> None:
        """Wait for the requests (caller holds self._lock)."""
        if self._status is not None:
            self._requests[0].Wait(self._status)
        else:
            MPI.Request.Waitall(self._requests)

    def _poll(self) -> bool:
        """Whether the requests are complete (caller holds self._lock)."""
        if self._status is not None:
            return self._requests[0].Test(self._status)
        return MPI.Request.Testall(self._requests)

    def wait(self, timeout=None) -> bool:
        with self._lock:
            if not self._done:
                self._block()
                self._complete()
        if self._exc is not None:
            raise self._exc
        return True

    def is_completed(self) -> bool:
        with self._lock:
            if not self._done and self._poll():
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


class _Chain:
    """Two finishing steps, in order."""
    __slots__ = ("first", "then")

    def __init__(self, first, then):
        self.first, self.then = first, then

    def __call__(self) -> None:
        self.first()
        self.then()


# -- the size of a received message ------------------------------------------------------------
# MPI completes a receive whose message is shorter than the buffer as if nothing were wrong
# (the buffer's tail keeps its old contents), and one whose message is longer with a bare
# MPI_ERR_TRUNCATE. So every recv/irecv reads the size received from its status once it
# completes (no message: a status read and a compare) and raises count_error when it is not the
# tensor's. Here the size is in bytes (MPI_Get_elements_x of MPI_BYTE: no datatype to look up,
# and no int to overflow below 2**31 elements); _fastpath.c compares MPI_Get_count in the
# plan's datatype with the tensor's numel for planned receives, and builds its error with
# count_error too.
_BYTE = MPI.BYTE


def count_error(fn: str, tensor, source: int, tag: int, nbytes: int,
                truncated: bool) -> RuntimeError:
    """The error of FN's receive into TENSOR of a message of NBYTES bytes (negative: unknown)
    from group rank SOURCE with TAG, which is not TENSOR's size. TRUNCATED: MPI reported the
    message longer than the tensor (MPI_ERR_TRUNCATE)."""
    size, want = tensor.element_size(), tensor.numel()
    if truncated and (nbytes < 0 or nbytes <= want * size):
        has = f"more than {want} elements"     # an MPI that reports only what it kept
    elif nbytes < 0:
        has = "another number of elements"
    elif nbytes % size:
        has = f"{nbytes} bytes (not a whole number of {size}-byte elements)"
    else:
        has = f"{nbytes // size} elements"
    text = (f"{fn}: message from rank {source} (tag {tag}) has {has} of {tensor.dtype}, "
            f"expected {want} (the tensor's numel); the sender sent a different size (send and "
            f"recv tensors must have the same numel and dtype); ")
    if truncated:
        text += ("MPI cut it at the tensor's end (MPI_ERR_TRUNCATE) and may have written the "
                 "rest past the tensor (Open MPI 5 does above its eager limit): memory after "
                 "this tensor may be corrupt")
    elif nbytes >= 0:
        text += f"only the tensor's first {nbytes // size} elements were received"
    else:
        text += "only the tensor's first elements were received"
    return RuntimeError(text)


def check_count(fn: str, tensor, statuses, nbytes: int, tag: int) -> None:
    """Raise :func:`count_error` unless the receive into TENSOR whose pieces filled STATUSES
    (one, unless the count is over MPI's int) got NBYTES bytes in all and was not cut (an
    MPI_ERR_TRUNCATE in a status's error field: :func:`truncation` puts it there)."""
    if len(statuses) == 1:
        st = statuses[0]
        if st.Get_elements(_BYTE) == nbytes and not st.Get_error():
            return
    got = sum(st.Get_elements(_BYTE) for st in statuses)
    cut = any(MPI.Get_error_class(st.Get_error()) == MPI.ERR_TRUNCATE for st in statuses)
    if got != nbytes or cut:
        raise count_error(fn, tensor, statuses[0].Get_source(), tag, got, cut)


def truncation(exc, requests, statuses) -> None:
    """Return when EXC, raised by waiting on or testing a receive's REQUESTS (STATUSES: theirs),
    says a message was longer than its buffer: the receive completed all the same, and
    MPI_ERR_TRUNCATE is in its status (pieces MPI left pending, MPI_ERR_PENDING, are waited
    for here) for :func:`check_count`, which names the sizes. Any other MPI error is raised
    again."""
    code = exc.Get_error_class()
    if code == MPI.ERR_TRUNCATE and len(statuses) == 1:
        statuses[0].Set_error(MPI.ERR_TRUNCATE)   # single-request calls leave it as it was
        return
    if code != MPI.ERR_IN_STATUS:
        raise exc
    errors = [MPI.Get_error_class(st.Get_error()) for st in statuses]
    if MPI.ERR_TRUNCATE not in errors \
            or any(e not in (MPI.SUCCESS, MPI.ERR_PENDING, MPI.ERR_TRUNCATE) for e in errors):
        raise exc
    for req, st, e in zip(requests, statuses, errors):
        if e == MPI.ERR_PENDING:
            st.Set_error(MPI.SUCCESS)
            try:
                req.Wait(st)
            except MPI.Exception as again:
                truncation(again, [req], [st])


class RecvWork(Work):
    """The Work of an irecv into TENSOR (numpy view ARR) over REQUESTS (one, or one per piece
    of a count over MPI's int): waits with a status per request, then checks the size of the
    message (:func:`check_count`, its finishing step); another size is this Work's exception."""

    def __init__(self, requests, tensor, arr, fn: str, tag: int, entry, keep=None):
        statuses = [MPI.Status()] if len(requests) == 1 else [MPI.Status() for _ in requests]
        super().__init__(requests, [tensor],
                         functools.partial(check_count, fn, tensor, statuses, arr.nbytes, tag),
                         entry, keep, statuses[0])
        if len(requests) > 1:
            self._statuses = statuses

    def _block(self) -> None:
        try:
            if len(self._requests) == 1:
                self._requests[0].Wait(self._status)
            else:
                MPI.Request.Waitall(self._requests, self._statuses)
        except MPI.Exception as exc:
            truncation(exc, self._requests, self._statuses if len(self._requests) > 1
                       else [self._status])

    def _poll(self) -> bool:
        try:
            if len(self._requests) == 1:
                return self._requests[0].Test(self._status)
            return MPI.Request.Testall(self._requests, self._statuses)
        except MPI.Exception as exc:
            truncation(exc, self._requests, self._statuses if len(self._requests) > 1
                       else [self._status])
            return True


class CompletedWork(Work):
    """An op that finished before returning (blocking path called with async_op=True)."""

    def __init__(self, result, exc=None):
        super().__init__([], result)
        self._done = True
        self._exc = exc


class AllWork(Work):
    """One Work over several started ops (a coalesced call): done when all of them are,
    whichever kind each is (MPI requests, the async engine's)."""

    def __init__(self, works, result):
        super().__init__([], result)
        self._works = works

    def wait(self, timeout=None) -> bool:
        for w in self._works:
            w.wait()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def exception(self):
        return next((e for e in (w.exception() for w in self._works) if e is not None), None)

    def get_future(self) -> torch.futures.Future:
        if self._future is None:
            result = self._result

            def value(all_done):
                for f in all_done.value():
                    f.wait()            # raises the first op's error
                return result
            self._future = torch.futures.collect_all(
                [w.get_future() for w in self._works]).then(value)
        return self._future


# -- futures whose failure torch's C++ side sees ----------------------------------------------
# torch's Future.set_exception stores the exception as the future's *value* and raises it only
# for Python callers; C++ readers (DDP's reducer parsing a bucket's result) get a Python object
# where they expect a tensor list, and crash. A callback that raises marks the future it returns
# failed for C++ too: so a future that may fail is handed out as SOURCE.then(_value).

def _value(source):
    return source.value()      # raises what set_exception put in SOURCE


def pending_future() -> tuple:
    """(source, future): complete SOURCE with set_result/set_exception; hand out FUTURE."""
    source = torch.futures.Future()
    return source, source.then(_value)


def completed_future(result, exc) -> torch.futures.Future:
    """A future done with RESULT, or failed with EXC (for C++ readers too)."""
    fut = torch.futures.Future()
    if exc is None:
        fut.set_result(result)
        return fut
    fut.set_exception(exc)
    return fut.then(_value)


def settle(source, result, exc) -> None:
    if exc is not None:
        source.set_exception(exc)
    else:
        source.set_result(result)


def future_of(w) -> torch.futures.Future:
    """``get_future()`` of W, a Work or a C P2PWork (both keep it in ``_future``): made once,
    completed here by waiting or, with HPCDDP_FUTURE=thread, by the progress thread."""
    fut = w._future
    if fut is not None:
        return fut
    if _FUTURE_MODE == "thread" and not w.is_completed():
        source, w._future = pending_future()
        _progress().put((w, source))
        return w._future
    try:
        w.wait()
    except BaseException:
        pass
    w._future = completed_future(w.result(), w.exception())
    return w._future


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
        return self._inner.exception()

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
                w, source = _queue.get()
                try:
                    w.wait()
                except BaseException:
                    pass
                settle(source, w.result(), w.exception())
        threading.Thread(target=loop, name="hpcddp-progress", daemon=True).start()
    return _queue
