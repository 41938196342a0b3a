"""hpcddp.comm.buffers: zero-copy numpy views of tensors, their cache, and tensor checks."""
from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from hpcddp.comm import buffers
from hpcddp.comm.buffers import TensorError, as_array, check_tensor, same_spec


@pytest.mark.parametrize("dtype", list(buffers.NUMPY_DTYPE))
def test_view_shares_memory(dtype):
    t = torch.zeros(6, dtype=dtype).reshape(2, 3)
    a = as_array(t, "fn", "tensor")
    assert a.ndim == 1 and a.size == 6 and a.dtype == buffers.NUMPY_DTYPE[dtype]
    a[1] = 0x3F80 if dtype == torch.bfloat16 else 1  # (1.0's bits) writes through: no copy
    assert t.reshape(-1)[1].item() == 1
    assert a.ctypes.data == t.data_ptr()


def test_cached_until_the_memory_changes():
    t = torch.zeros(4)
    a = as_array(t)
    assert as_array(t) is a  # a cache hit
    t.set_(torch.ones(8))  # new storage: a new view
    b = as_array(t)
    assert b is not a and b.size == 8 and b[0] == 1


def test_cache_never_keeps_a_tensor_alive():
    t = torch.zeros(4)
    as_array(t)
    key = id(t)
    assert key in buffers._views
    del t
    gc.collect()
    assert key not in buffers._views


def test_offset_slice_and_empty():
    base = torch.arange(10.0)
    a = as_array(base[3:7])
    assert list(a) == [3.0, 4.0, 5.0, 6.0]
    assert as_array(torch.zeros(0)).size == 0


def test_bfloat16_travels_as_bits():
    t = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    a = as_array(t)
    assert a.dtype == np.uint16
    assert torch.equal(torch.from_numpy(a.copy()).view(torch.bfloat16), t)


@pytest.mark.parametrize("make,needles", [
    (lambda: [1, 2], ["fn: arg must be a torch.Tensor", "list"]),
    (lambda: torch.zeros(2, 2).to_sparse(), ["dense (strided)", "sparse_coo", "to_dense()"]),
    (lambda: torch.zeros(2, device="meta"), ["meta tensor", "to_empty"]),
    (lambda: torch.zeros(2, dtype=torch.uint32), ["torch.uint32", "expected one of"]),
    (lambda: torch.zeros(4, 4)[:, ::2], ["not contiguous", "shape [4, 2]", "stride [4, 2]",
                                         "tensor.contiguous()"]),
    (lambda: torch.zeros(2, dtype=torch.complex64).conj(), ["conj/neg view", "resolve_conj"]),
])
def test_check_tensor_names_fn_arg_expected_received(make, needles):
    with pytest.raises(TensorError) as info:
        check_tensor(make(), "fn", "arg")
    msg = str(info.value)
    assert msg.startswith("fn: arg"), msg
    for n in needles:
        assert n in msg, (n, msg)


def test_same_spec_names_the_first_difference():
    ref = torch.zeros(3)
    with pytest.raises(TensorError, match=r"gather: gather_list\[2\] has dtype torch.float64, "
                                          r"expected torch.float32"):
        same_spec([ref, ref, ref.double()], ref, "gather", "gather_list")
    with pytest.raises(TensorError, match=r"gather: gather_list\[1\] has shape \[4\], "
                                          r"expected \[3\]"):
        same_spec([ref, torch.zeros(4)], ref, "gather", "gather_list")
    same_spec([ref, torch.zeros(4)], ref, "all_to_all", "x", same_shape=False)
