"""The backend's one layer in front of hpcddp's ops: an op whose tensors the group's device
map gives to another backend (``cpu:hpcddp,cuda:nccl``: CUDA tensors to NCCL) goes there;
an op on strided views runs again on contiguous copies (:mod:`hpcddp.backend.strided`)."""
from __future__ import annotations

from hpcddp.backend.strided import through_contiguous
from hpcddp.comm.buffers import NotContiguous


def _first_tensor(x):
    while isinstance(x, (list, tuple)):
        if not x:
            return None
        x = x[0]
    return x


def routed(method, name: str | None = None):
    """Send the op to another device's backend where the group's device map says so
    (``cpu:hpcddp,cuda:nccl``: CUDA tensors go to NCCL); hpcddp's own op otherwise, on
    contiguous copies where a tensor is a strided view (the ops refuse those before any
    message, so the retry sends nothing twice)."""
    name = name or method.__name__

    def op(self, *args):     # torch passes positional arguments only
        if self._others:   # a device map with other backends (or not yet read: the first op reads it)
            others = self._other_backends()
            t = _first_tensor(args[0]) if args else None
            if t is not None and not t.is_cpu and t.device.type in others:
                return getattr(others[t.device.type], name)(*args)
        try:
            return method(self, *args)
        except NotContiguous:
            return through_contiguous(method, self, args)
    op.__name__ = op.__qualname__ = name
    op.__doc__ = method.__doc__
    op.__wrapped__ = method
    return op

