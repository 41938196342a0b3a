"""Tensor <-> MPI buffer adaptation: the hot path of every op.

Handing a torch tensor to mpi4py costs 8-34 us (a failed buffer-protocol lookup, then DLPack);
``Tensor.numpy()`` costs ~1 us. We instead build, once per tensor, a numpy array over the
tensor's memory that does *not* own it, and cache it by the tensor's identity (a weak
reference, so the cache never keeps a tensor alive). A hit costs ~0.15 us.

The view is only valid while the tensor lives: callers use it during a blocking call, or keep
the tensor referenced in the Work of a non-blocking one.
"""
from __future__ import annotations

import weakref

import numpy as np
import torch

from hpcddp.comm._mpi import MPI

# torch dtype -> numpy dtype of the view. bfloat16 has no numpy type: its bits travel as uint16
# and reductions use the custom MPI ops in hpcddp.comm.ops.
NUMPY_DTYPE = {
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.float16: np.float16,
    torch.bfloat16: np.uint16,
    torch.complex64: np.complex64,
    torch.complex128: np.complex128,
    torch.int8: np.int8,
    torch.int16: np.int16,
    torch.int32: np.int32,
    torch.int64: np.int64,
    torch.uint8: np.uint8,
    torch.bool: np.bool_,
}
SUPPORTED_DTYPES = tuple(NUMPY_DTYPE)
_dtype_names = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)

_MAX_CACHE = 8192
_views: dict[int, tuple] = {}


class TensorError(TypeError):
    """A tensor argument that no MPI op can take (wrong type, layout, device, dtype, memory)."""


class NotContiguous(TensorError):
    """A dense tensor whose elements are not one block of memory (a transposed or sliced
    view). The direct API refuses it (MPI needs one block); the torch backend catches it,
    before any message, and runs the op on contiguous copies (hpcddp.backend.process_group)."""


class DeviceTensor(TensorError):
    """Raised by :func:`as_array` for a CUDA tensor: its memory is not host memory. The ops
    catch it and take their device path (hpcddp.collectives.paths.device), which passes a device
    pointer only to a CUDA-aware MPI and otherwise stages through pinned host memory. Code
    that does not catch it fails here, before any message, instead of crashing MPI."""


class DevicePointerRefused(TensorError):
    """A device pointer was about to reach an MPI that is not known to be CUDA-aware."""


def check_tensor(t, fn: str, arg: str) -> None:
    """Raise TensorError naming FN and ARG unless T is a dense, contiguous CPU or CUDA tensor
    of a supported dtype. Runs on the calling rank before any message is sent."""
    if not isinstance(t, torch.Tensor):
        raise TensorError(f"{fn}: {arg} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TensorError(f"{fn}: {arg} must be a dense (strided) tensor, got layout {t.layout}; "
                          f"call .to_dense() first")
    if not t.is_cpu:
        dev = t.device.type
        if dev == "meta":
            raise TensorError(f"{fn}: {arg} is a meta tensor (it has no data); "
                              f"materialise it with .to_empty(device='cpu') first")
        if dev != "cuda":  # CUDA tensors take the device path (hpcddp.comm.cuda, docs/gpu.md)
            raise TensorError(f"{fn}: {arg} is on device {t.device}; hpcddp serves CPU and "
                              f"CUDA tensors: move it with .cpu()")
    if t.dtype not in NUMPY_DTYPE:
        raise TensorError(f"{fn}: {arg} has dtype {t.dtype}, expected one of {_dtype_names}")
    if t.is_conj() or t.is_neg():
        # lazy conjugate/negative views: the memory does not hold the values torch shows
        raise TensorError(f"{fn}: {arg} is a lazy conj/neg view; pass t.resolve_conj().resolve_neg()")
    if not t.is_contiguous():
        raise NotContiguous(f"{fn}: {arg} is not contiguous (shape {list(t.shape)}, stride "
                          f"{list(t.stride())}); MPI needs one block of memory: pass "
                          f"tensor.contiguous() and copy the result back")


def _forget(key: int, ref) -> None:
    entry = _views.get(key)
    if entry is not None and entry[0] is ref:
        del _views[key]


def cached_view(t) -> np.ndarray | None:
    """as_array's view of T if T was validated before and is unchanged since, else None."""
    entry = _views.get(id(t))
    # same object, same memory, same size, still one block, same dtype: t.resize_() to fewer
    # elements keeps data_ptr, in-place t.t_() / as_strided_() keep data_ptr and size, and
    # `t.data = t.view(torch.int32)` keeps both (torch dtypes are singletons: identity)
    if entry is not None and entry[0]() is t and entry[1] == t.data_ptr() \
            and entry[2].size == t.numel() and t.is_contiguous() and t.dtype is entry[3]:
        return entry[2]
    return None


def as_array(t: torch.Tensor, fn: str = "hpcddp", arg: str = "tensor") -> np.ndarray:
    """A 1-D numpy array over T's memory (no copy, no ownership), validated and cached.

    CPU tensors only: a CUDA tensor raises :class:`DeviceTensor` (never a view of device
    memory), which the ops catch to take their device path."""
    entry = _views.get(id(t))      # cached_view, inline: every op's first step
    if entry is not None and entry[0]() is t and entry[1] == t.data_ptr() \
            and entry[2].size == t.numel() and t.is_contiguous() and t.dtype is entry[3]:
        return entry[2]
    check_tensor(t, fn, arg)
    if not t.is_cpu:
        # only on this cache-miss path: CPU tensors never pay for the CUDA branch
        raise DeviceTensor(f"{fn}: {arg} is on {t.device}: device memory is not a host "
                           f"buffer (the ops route CUDA tensors through hpcddp.comm.cuda)")
    n = t.numel()
    np_dtype = NUMPY_DTYPE[t.dtype]
    if n == 0:
        return np.empty(0, np_dtype)
    nbytes = n * t.element_size()
    arr = np.frombuffer(MPI.buffer.fromaddress(t.data_ptr(), nbytes), dtype=np_dtype)
    if len(_views) >= _MAX_CACHE:
        _views.clear()
    key = id(t)
    ref = weakref.ref(t, lambda r, k=key: _forget(k, r))
    _views[key] = (ref, t.data_ptr(), arr, t.dtype)
    return arr


def _like(t, i: int, ref: torch.Tensor, fn: str, arg: str, same_shape: bool) -> None:
    if t.dtype is not ref.dtype:
        raise TensorError(f"{fn}: {arg}[{i}] has dtype {t.dtype}, expected {ref.dtype} "
                          f"(all tensors of one op share a dtype)")
    if same_shape and t.shape != ref.shape:
        raise TensorError(f"{fn}: {arg}[{i}] has shape {list(t.shape)}, expected "
                          f"{list(ref.shape)}")


def same_spec(tensors, ref: torch.Tensor, fn: str, arg: str, *, same_shape: bool = True) -> None:
    """Check every tensor in a list has REF's dtype (and shape), naming the first that differs."""
    ref_cpu = ref.is_cpu
    for i, t in enumerate(tensors):
        # a CPU tensor as_array validated before is still valid (same object, memory, size):
        # list ops pass the same tensors every step, and these checks were a large part of a
        # small list all_gather's or all_to_all's time (docs/benchmarks.md)
        if not ref_cpu or cached_view(t) is None:
            check_tensor(t, fn, f"{arg}[{i}]")
            if t.device != ref.device:
                raise TensorError(f"{fn}: {arg}[{i}] is on {t.device}, expected {ref.device} "
                                  f"(all tensors of one op are on one device)")
        _like(t, i, ref, fn, arg, same_shape)


def one_device(fn: str, *named) -> None:
    """Check the tensors NAMED [(arg, tensor), ...] of a call on device memory (their op met
    one CUDA tensor) and that they share one device, naming the first that differs."""
    ref_arg, ref = None, None
    for arg, t in named:
        check_tensor(t, fn, arg)
        if ref is None:
            ref_arg, ref = arg, t
        elif t.device != ref.device:
            raise TensorError(f"{fn}: {arg} is on {t.device} but {ref_arg} is on {ref.device}; "
                              f"all tensors of one op must be on one device")


def as_arrays(tensors, ref: torch.Tensor, fn: str, arg: str, *,
              same_shape: bool = True) -> list:
    """same_spec for a list of CPU tensors (REF: the op's CPU tensor) that also hands back
    every tensor's as_array view: the list ops check each tensor once and use the views,
    where same_spec and then as_array per tensor looked each one up twice."""
    views = []
    for i, t in enumerate(tensors):
        arr = cached_view(t)
        if arr is None:
            check_tensor(t, fn, f"{arg}[{i}]")
            if not t.is_cpu:
                raise TensorError(f"{fn}: {arg}[{i}] is on {t.device}, expected {ref.device} "
                                  f"(all tensors of one op are on one device)")
            arr = as_array(t, fn, f"{arg}[{i}]")
        _like(t, i, ref, fn, arg, same_shape)
        views.append(arr)
    return views