"""Staging CUDA tensors through pinned host memory, for an MPI that is not CUDA-aware.

Two shapes of staging, both built from the same parts:

- :class:`Staged` (any op): every device tensor of the op gets a host twin in one reusable
  pinned buffer; inputs are copied device-to-host before the op's MPI call, outputs
  host-to-device after it (for ``async_op=True`` in the Work's finishing step).
- :func:`Staging.pipeline` (large blocking element-wise ops: all_reduce, broadcast, reduce):
  the tensor is cut into chunks (:func:`chunk_schedule`) that cycle through a ring of ``depth``
  pinned slots, so that the device-to-host copy of chunk i+1 and the host-to-device copy of
  chunk i-1 run on the copy stream while MPI works on chunk i.

Streams: copies run on one copy stream per device, which first waits for the stream that was
current when the op was issued (the producer), and the results are handed back by making that
stream (and the stream current when the Work is waited on) wait for the last copy; tensors
used by the copy stream are marked with ``record_stream`` for the caching allocator.

The copy functions are a :class:`Copier`: :class:`CudaCopier` on a GPU, :class:`HostCopier`
(plain synchronous copies, optionally logged) where CPU tensors stand in for device tensors in
tests, so the chunking and the buffer reuse run without a GPU. Everything here is local to
the calling rank (no MPI): the MPI calls are passed in by hpcddp.collectives.

Settings (read once per :class:`Staging`; must be equal on every rank, since they decide how
many MPI calls a large op makes): ``HPCDDP_STAGING_CHUNK_BYTES`` (default 4 MiB),
``HPCDDP_STAGING_PIPELINE_BYTES`` (tensors at least this large are pipelined; default 8 MiB;
0 turns pipelining off), ``HPCDDP_PINNED_CACHE_BYTES`` (pinned bytes kept for reuse;
default 1 GiB).
"""
from __future__ import annotations

import threading
from typing import Callable

import torch

from hpcddp import settings
from hpcddp.collectives.engine import EngineWork

_ALIGN = 256          # bytes: host twins start on this boundary (any dtype view is aligned)
_MIN_BLOCK = 1 << 16  # pinned blocks are powers of two from 64 KiB


def chunk_schedule(numel: int, itemsize: int, chunk_bytes: int, pipeline_bytes: int
                   ) -> list[tuple[int, int]]:
    """Element ranges [(start, stop), ...] covering NUMEL elements of ITEMSIZE bytes.

    One range (the whole tensor) below PIPELINE_BYTES (or when it is 0); otherwise ranges of
    CHUNK_BYTES (whole elements, at least one), the last one shorter. Empty for NUMEL 0. Every
    rank computes the same schedule from the same numel, dtype and settings.
    """
    if numel <= 0:
        return []
    nbytes = numel * itemsize
    if pipeline_bytes <= 0 or nbytes < pipeline_bytes or chunk_bytes <= 0:
        return [(0, numel)]
    step = max(1, chunk_bytes // itemsize)
    return [(s, min(s + step, numel)) for s in range(0, numel, step)]


class HostBuffer:
    """A block of (pinned) host memory leased from a :class:`PinnedPool`."""
    __slots__ = ("data", "capacity", "event", "pool")

    def __init__(self, data: torch.Tensor, pool):
        self.data = data                   # 1-D uint8 tensor
        self.capacity = data.numel()
        self.event = None                  # last copy reading it (released with it)
        self.pool = pool

    def view(self, offset: int, dtype: torch.dtype, shape) -> torch.Tensor:
        """A host tensor of DTYPE and SHAPE at byte OFFSET (a multiple of the element size)."""
        n = 1
        for s in shape:
            n *= s
        nbytes = n * dtype.itemsize
        return self.data[offset:offset + nbytes].view(dtype).view(shape)


class PinnedPool:
    """Reusable host buffers, pinned when CUDA is there (pin=None: auto; False: plain memory,
    the CPU stand-in). Thread-safe: DDP stages from autograd threads.

    A buffer released with an event (the host-to-device copy still reading it) is not handed
    out again before that event completes.
    """

    def __init__(self, pin: bool | None = None, max_cached_bytes: int | None = None):
        self.pin = pin
        self.max_cached_bytes = (settings.get().pinned_cache_bytes
                                 if max_cached_bytes is None else max_cached_bytes)
        self._free: dict[int, list[HostBuffer]] = {}
        self._cached = 0
        self._lock = threading.Lock()
        self.allocations = 0               # how many blocks were ever allocated (tests)

    def _pinned(self) -> bool:
        if self.pin is None:
            self.pin = torch.cuda.is_available()
        return self.pin

    @staticmethod
    def block_size(nbytes: int) -> int:
        size = _MIN_BLOCK
        while size < nbytes:
            size <<= 1
        return size

    def acquire(self, nbytes: int) -> HostBuffer:
        size = self.block_size(nbytes)
        with self._lock:
            free = self._free.get(size)
            buf = free.pop() if free else None
            if buf is not None:
                self._cached -= size
        if buf is None:
            data = torch.empty(size, dtype=torch.uint8, pin_memory=self._pinned())
            self.allocations += 1
            return HostBuffer(data, self)
        if buf.event is not None:
            buf.event.synchronize()        # the last host-to-device copy from it has finished
            buf.event = None
        return buf

    def release(self, buf: HostBuffer, event=None) -> None:
        buf.event = event
        with self._lock:
            if self._cached + buf.capacity > self.max_cached_bytes:
                return                     # dropped: torch frees (or caches) the memory
            self._free.setdefault(buf.capacity, []).append(buf)
            self._cached += buf.capacity

    def cached_bytes(self) -> int:
        return self._cached

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._cached = 0


# -- copiers --------------------------------------------------------------------------------

class Copier:
    """How bytes move between a (device) tensor and its host twin. Events may be None."""

    def begin(self, tensors) -> None:
        """Before the first copy: order the copies after the tensors' producers."""

    def d2h(self, host: torch.Tensor, dev: torch.Tensor):
        raise NotImplementedError

    def h2d(self, dev: torch.Tensor, host: torch.Tensor):
        raise NotImplementedError

    def wait(self, event) -> None:
        """Block the host until EVENT's copy is complete (before MPI reads the host twin)."""

    def end(self, event) -> None:
        """After the last copy: make the consumers of the results wait for EVENT."""


class HostCopier(Copier):
    """Synchronous copies between CPU tensors: the stand-in for tests. With a LOG list, each
    step is appended as (kind, host storage offset in bytes, numel)."""

    def __init__(self, log: list | None = None):
        self.log = log

    def _note(self, kind, host):
        if self.log is not None:
            self.log.append((kind, host.storage_offset() * host.element_size(), host.numel()))

    def d2h(self, host, dev):
        host.copy_(dev)
        self._note("d2h", host)
        return None

    def h2d(self, dev, host):
        dev.copy_(host)
        self._note("h2d", host)
        return None

    def wait(self, event):
        if self.log is not None and event is not None:
            self.log.append(("wait", event))


_copy_streams: dict = {}
_streams_lock = threading.Lock()


def copy_stream(device: torch.device):
    """hpcddp's copy stream on DEVICE (one per device, created on first use)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    s = _copy_streams.get(idx)
    if s is None:
        with _streams_lock:
            s = _copy_streams.get(idx)
            if s is None:
                s = _copy_streams[idx] = torch.cuda.Stream(device=idx)
    return s


class CudaCopier(Copier):
    """Asynchronous copies on hpcddp's copy stream of DEVICE, ordered after the stream that was
    current when the op was issued; results handed back to that stream."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = copy_stream(device)
        self.issue = torch.cuda.current_stream(device)

    def begin(self, tensors):
        self.stream.wait_stream(self.issue)
        for t in tensors:
            # the caching allocator must not reuse their memory while the copy stream uses it
            t.record_stream(self.stream)

    def _copy(self, dst, src):
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        return ev

    def d2h(self, host, dev):
        return self._copy(host, dev)

    def h2d(self, dev, host):
        return self._copy(dev, host)

    def wait(self, event):
        if event is not None:
            event.synchronize()

    def end(self, event):
        if event is None:
            return
        self.issue.wait_event(event)
        now = torch.cuda.current_stream(self.device)
        if now != self.issue:              # a Work waited on from another stream or thread
            now.wait_event(event)


# -- whole-op staging -----------------------------------------------------------------------

def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Staged:
    """Host twins for one op's tensors, in one buffer of the pool.

    ``twins([(tensor, read, write), ...])`` returns the host tensors (None stays None), with
    the READ ones already copied in; ``copy_out()`` copies the WRITE ones back and gives the
    buffer back; ``complete(work, async_op, result)`` does that now (blocking op) or in the
    Work's finishing step; ``abort()`` gives the buffer back after an error.
    """

    def __init__(self, copier: Copier, pool: PinnedPool):
        self.copier = copier
        self.pool = pool
        self.buf: HostBuffer | None = None
        self._out: list = []

    def twins(self, specs) -> list:
        offsets, total = [], 0
        for t, _, _ in specs:
            offsets.append(total)
            if t is not None:
                total += -(-_nbytes(t) // _ALIGN) * _ALIGN
        self.buf = self.pool.acquire(max(total, 1))
        devs = [t for t, _, _ in specs if t is not None]
        self.copier.begin(devs)
        hosts, last = [], None
        for (t, read, write), off in zip(specs, offsets):
            if t is None:
                hosts.append(None)
                continue
            h = self.buf.view(off, t.dtype, t.shape)
            if read and t.numel():
                last = self.copier.d2h(h, t)
            if write:
                self._out.append((t, h))
            hosts.append(h)
        self.copier.wait(last)
        return hosts

    def copy_out(self) -> None:
        buf, self.buf = self.buf, None
        if buf is None:
            return
        last = None
        for t, h in self._out:
            if t.numel():
                last = self.copier.h2d(t, h)
        self._out = []
        self.copier.end(last)
        self.pool.release(buf, last)

    def abort(self) -> None:
        buf, self.buf = self.buf, None
        self._out = []
        if buf is not None:
            self.pool.release(buf)

    def complete(self, work, async_op: bool, result):
        if not async_op:
            self.copy_out()
            return None
        if isinstance(work, EngineWork):
            # queued on the async engine, which completes its Work without a finishing step:
            # wait for it here and copy back (correct; the staged copy gives up the overlap)
            work.wait()
            self.copy_out()
            work._result = result
            return work
        if work._done:
            # The host op finished before returning: all_reduce/broadcast run the blocking MPI
            # call even for async_op (MPI never matches a blocking collective with a
            # non-blocking one), so its Work is already complete and its _finish will never run
            # again: copy back now, or the device tensor keeps its old contents.
            self.copy_out()
            work._result = result
            return work
        inner = work._finish

        def finish():
            try:
                if inner is not None:
                    inner()
            finally:
                self.copy_out()
        work._finish = finish
        work._result = result
        return work


# -- configuration: what the collectives use ------------------------------------------------

class Staging:
    """Pool, copier choice and chunking for the staging path (one default per process;
    tests make their own with small chunks and a :class:`HostCopier`).

    copier: a callable tensor -> Copier (default: CudaCopier for CUDA tensors, HostCopier for
    CPU stand-ins).
    """

    def __init__(self, *, pool: PinnedPool | None = None,
                 copier: Callable[[torch.Tensor], Copier] | None = None,
                 chunk_bytes: int | None = None, pipeline_bytes: int | None = None,
                 depth: int = 3):
        self.pool = pool or PinnedPool()
        self._copier = copier
        self.chunk_bytes = (settings.get().staging_chunk_bytes
                            if chunk_bytes is None else chunk_bytes)
        self.pipeline_bytes = (settings.get().staging_pipeline_bytes
                               if pipeline_bytes is None else pipeline_bytes)
        if depth < 2:
            raise ValueError(f"Staging: depth must be >= 2 (slots in flight), got {depth}")
        self.depth = depth

    def copier(self, t: torch.Tensor) -> Copier:
        if self._copier is not None:
            return self._copier(t)
        return CudaCopier(t.device) if t.is_cuda else HostCopier()

    def staged(self, t: torch.Tensor) -> Staged:
        return Staged(self.copier(t), self.pool)

    def schedule(self, t: torch.Tensor) -> list[tuple[int, int]]:
        return chunk_schedule(t.numel(), t.element_size(), self.chunk_bytes, self.pipeline_bytes)

    def pipelined(self, t: torch.Tensor) -> bool:
        """Is T large enough to be cut into chunks?"""
        return len(self.schedule(t)) > 1

    def pipeline(self, t: torch.Tensor, call: Callable[[torch.Tensor], None], *,
                 read: bool, write: bool) -> None:
        """Run CALL (a blocking MPI op on a host chunk) over T chunk by chunk.

        READ: copy each chunk in before CALL; WRITE: copy it back after. Chunk i+1's copy in
        is started before CALL(i), chunk i's copy back right after it, so the copy stream
        works while MPI does. Slots of the ring are reused only after their copy back ended.
        Blocking: returns once every MPI call is done and the copies back are queued (the
        issuing stream waits for them).
        """
        flat = t.view(-1)
        chunks = self.schedule(t)
        copier = self.copier(t)
        if not chunks:                     # empty tensor: the MPI call still happens
            call(torch.empty(0, dtype=t.dtype))
            return
        longest = max(e - s for s, e in chunks)
        slot = -(-longest * t.element_size() // _ALIGN) * _ALIGN
        nslots = min(self.depth, len(chunks))
        buf = self.pool.acquire(slot * nslots)
        copier.begin([t])
        d2h: list = [None] * len(chunks)
        h2d: list = [None] * len(chunks)

        def host(i):
            s, e = chunks[i]
            return buf.view((i % nslots) * slot, t.dtype, (e - s,))

        def copy_in(i):
            if i >= nslots and write:
                copier.wait(h2d[i - nslots])   # the slot's previous chunk has been copied back
            if read:
                s, e = chunks[i]
                d2h[i] = copier.d2h(host(i), flat[s:e])

        last = None
        try:
            copy_in(0)
            for i, (s, e) in enumerate(chunks):
                if i + 1 < len(chunks):
                    copy_in(i + 1)
                copier.wait(d2h[i])
                h = host(i)
                call(h)
                if write:
                    last = h2d[i] = copier.h2d(flat[s:e], h)
        finally:
            copier.end(last)
            self.pool.release(buf, last)


_default: Staging | None = None
_default_lock = threading.Lock()


def default_staging() -> Staging:
    """The process's Staging (settings read from the environment on first use)."""
    global _default
    if _default is None:
        with _default_lock:
            if _default is None:
                _default = Staging()
    return _default


__all__ = ["Copier", "CudaCopier", "HostBuffer", "HostCopier", "PinnedPool", "Staged", "Staging",
           "chunk_schedule", "copy_stream", "default_staging"]
