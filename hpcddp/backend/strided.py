"""Strided tensors: torch's ops take non-contiguous views (a transposed tensor, a column of a
matrix), as gloo does; MPI needs one contiguous buffer. hpcddp's ops refuse a view before any
message (``NotContiguous``), and the backend runs the op again on contiguous copies, copying
them back into the caller's views when the op has completed (its Work's ``wait``)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from hpcddp.collectives.work import _keepalive


def contiguous_copies(x, staged: list):
    """X with every non-contiguous tensor in it replaced by a contiguous copy (noted in STAGED
    as (view, copy) pairs); lists and tuples are walked, other values kept."""
    if isinstance(x, torch.Tensor):
        if x.layout == torch.strided and not x.is_contiguous():
            copy = x.contiguous()
            staged.append((x, copy))
            return copy
        return x
    if isinstance(x, (list, tuple)):
        return type(x)(contiguous_copies(v, staged) for v in x)
    return x


class StagedWork(dist._Work):
    """The Work of an op run on contiguous copies: its wait() copies them back into the
    caller's strided views (copy_ writes only the view's own elements)."""

    def __init__(self, inner, staged, result):
        super().__init__()
        self._inner, self._staged, self._result = inner, staged, result
        _keepalive.append(self)     # torch may keep only the C++ side (see work.py)

    def wait(self, timeout=None) -> bool:
        if self._staged is not None:
            self._inner.wait()
            _copy_back(self._staged)
            self._staged = None
        return True

    def is_completed(self) -> bool:
        return self._staged is None or self._inner.is_completed()

    def result(self):
        return self._result

    def source_rank(self) -> int:
        self.wait()
        return self._inner._source_rank()

    _source_rank = source_rank

    def get_future(self):
        self.wait()
        fut = torch.futures.Future()
        fut.set_result(self._result)
        return fut


def _copy_back(staged) -> None:
    # an input's copy holds what it held (MPI does not write send buffers): copying every
    # staged tensor back is right for inputs and outputs alike
    for view, copy in staged:
        view.copy_(copy)


def through_contiguous(method, self, args):
    """Run METHOD on contiguous copies of ARGS' strided tensors, as gloo accepts them."""
    staged: list = []
    args = contiguous_copies(args, staged)
    if not staged:
        raise RuntimeError(f"{method.__name__}: hpcddp found a non-contiguous tensor but none "
                           f"among the arguments")
    work = method(self, *args)
    originals = [v for v, _ in staged]
    if work is None:             # a blocking call has completed
        _copy_back(staged)
        return None
    return StagedWork(work, staged, originals)

