"""The device paths: a call on CUDA tensors through a CUDA-aware MPI (device pointers) or
through pinned host copies (host staging); hpcddp.collectives._device runs both. The table
asks them first, and only for a call on CUDA tensors."""
from __future__ import annotations

from hpcddp.collectives import _device


class DevicePath:
    """Every op on CUDA tensors, on the device path VIA (_device.DIRECT or _device.STAGING)."""
    min_bytes = 0
    OPS = frozenset({"all_reduce", "reduce", "reduce_scatter_tensor", "reduce_scatter",
                     "broadcast", "all_gather_into_tensor", "all_gather", "gather", "scatter",
                     "all_to_all_single", "all_to_all", "isend", "send", "irecv", "recv"})

    def __init__(self, name: str, via: str, applies=None, state=None):
        self.name, self.via, self.applies = name, via, applies
        self.state = state or (lambda comm, op: "open")

    def _ctx(self):
        return _device.row_ctx(self.via)

    def all_reduce(self, c):
        return _device.all_reduce(c.tensor, c.op, c.comm, c.async_op, self._ctx())

    def reduce(self, c):
        return _device.reduce(c.tensor, c.root, c.op, c.comm, c.async_op, self._ctx())

    def reduce_scatter_tensor(self, c):
        return _device.reduce_scatter_tensor(c.tensor, c.input, c.op, c.comm, c.async_op,
                                             self._ctx())

    def reduce_scatter(self, c):
        return _device.reduce_scatter(c.tensor, c.tensors, c.op, c.comm, c.async_op,
                                      self._ctx())

    def broadcast(self, c):
        return _device.broadcast(c.tensor, c.root, c.comm, c.async_op, self._ctx())

    def all_gather_into_tensor(self, c):
        return _device.all_gather_into_tensor(c.output, c.input, c.comm, c.async_op,
                                              self._ctx())

    def all_gather(self, c):
        return _device.all_gather(c.tensors, c.tensor, c.comm, c.async_op, self._ctx())

    def gather(self, c):
        return _device.gather(c.tensor, c.tensors, c.root, c.comm, c.async_op, self._ctx())

    def scatter(self, c):
        return _device.scatter(c.tensor, c.tensors, c.root, c.comm, c.async_op, self._ctx())

    def all_to_all_single(self, c):
        return _device.all_to_all_single(c.output, c.input, *c.splits, c.comm, c.async_op,
                                         self._ctx())

    def all_to_all(self, c):
        return _device.all_to_all(c.output, c.input, c.comm, c.async_op, self._ctx())

    def isend(self, c):
        return _device.isend(c.tensor, c.root, c.comm, c.tag, self._ctx())

    def send(self, c):
        return _device.send(c.tensor, c.root, c.comm, c.tag, self._ctx())

    def irecv(self, c):
        return _device.irecv(c.tensor, c.root, c.comm, c.tag, self._ctx())

    def recv(self, c):
        return _device.recv(c.tensor, c.root, c.comm, c.tag, self._ctx())


def _cuda_aware_state(comm, op) -> str:
    from hpcddp.comm.cuda import cuda_awareness
    try:
        found = cuda_awareness()
    except Exception as e:  # detection must never break the report
        return f"closed (detection failed: {e})"
    return "open" if found.aware is True else \
        f"closed (this MPI is not known to be CUDA-aware: {found.status()})"


CUDA_AWARE = DevicePath("CUDA-aware MPI", _device.DIRECT, _device.cuda_aware,
                        _cuda_aware_state)
STAGED = DevicePath("host staging", _device.STAGING)
