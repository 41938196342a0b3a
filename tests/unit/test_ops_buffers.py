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


def test_in_place_layout_change_ends_the_cache_hit():
    # t.t_() and as_strided_() keep the object, its data_ptr and its size: the cached view
    # (memory in the old order) must not be handed out for a tensor now non-contiguous
    t = torch.arange(6.).reshape(2, 3)
    as_array(t)
    t.t_()
    with pytest.raises(TensorError, match=r"fn: tensor is not contiguous \(shape \[3, 2\]"):
        as_array(t, "fn", "tensor")
    u = torch.zeros(4)
    as_array(u)
    u.as_strided_((2, 2), (1, 2))
    with pytest.raises(TensorError, match="not contiguous"):
        as_array(u, "fn", "tensor")


def test_same_spec_checks_tensors_seen_before_too():
    # same_spec skips the full check for CPU tensors as_array validated (the list ops' hot
    # path); what can still change on such a tensor is still refused
    ref = torch.zeros(3)
    lst = [torch.zeros(3), torch.zeros(3)]
    for t in lst:
        as_array(t)
    same_spec(lst, ref, "all_gather", "tensor_list")
    lst[1].data = torch.zeros(3, dtype=torch.float64)   # new memory and dtype: a cache miss
    with pytest.raises(TensorError, match=r"all_gather: tensor_list\[1\] has dtype "
                                          r"torch.float64, expected torch.float32"):
        same_spec(lst, ref, "all_gather", "tensor_list")
    lst[1] = torch.zeros(3)
    as_array(lst[1])
    lst[1].resize_(4)
    with pytest.raises(TensorError, match=r"tensor_list\[1\] has shape \[4\], expected \[3\]"):
        same_spec(lst, ref, "all_gather", "tensor_list")
    lst[1] = torch.zeros(3, 2)
    as_array(lst[1])
    lst[1].t_()
    with pytest.raises(TensorError, match=r"tensor_list\[1\] is not contiguous"):
        same_spec(lst, ref, "all_gather", "tensor_list", same_shape=False)
    with pytest.raises(TensorError, match=r"tensor_list\[0\] must be a torch.Tensor, got int"):
        same_spec([3, lst[0]], ref, "all_gather", "tensor_list")
    with pytest.raises(TensorError, match=r"tensor_list\[1\] is a meta tensor"):
        same_spec([lst[0], torch.zeros(3, device="meta")], ref, "all_gather", "tensor_list")
