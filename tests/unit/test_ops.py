"""hpcddp.comm.ops: torch ReduceOp -> MPI.Op per dtype, and the 16-bit user-defined ops.

One process (MPI starts as a singleton): the mapping is checked entry by entry, and the custom
bfloat16/float16 ops are run through MPI's own ``Reduce_local`` against torch's element-wise
results. The ops across ranks are in tests/mpi/test_collectives.py.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from hpcddp.comm import ops
from hpcddp.comm._mpi import MPI

R = dist.ReduceOp
INTS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
FLOATS = (torch.float32, torch.float64)
COMPLEX = (torch.complex64, torch.complex128)


@pytest.mark.parametrize("dtype", INTS + FLOATS)
@pytest.mark.parametrize("name,mpi", [("SUM", "SUM"), ("PRODUCT", "PROD"), ("MIN", "MIN"),
                                      ("MAX", "MAX")])
def test_native_ops(dtype, name, mpi):
    op, kind = ops.mpi_op(getattr(R, name), dtype, "all_reduce")
    assert op == getattr(MPI, mpi) and kind == getattr(R, name)


@pytest.mark.parametrize("dtype", INTS)
@pytest.mark.parametrize("name,mpi", [("BAND", "BAND"), ("BOR", "BOR"), ("BXOR", "BXOR")])
def test_bitwise_on_integers(dtype, name, mpi):
    assert ops.mpi_op(getattr(R, name), dtype, "all_reduce")[0] == getattr(MPI, mpi)


@pytest.mark.parametrize("name,mpi", [("SUM", "LOR"), ("MAX", "LOR"), ("BOR", "LOR"),
                                      ("PRODUCT", "LAND"), ("MIN", "LAND"), ("BAND", "LAND"),
                                      ("BXOR", "LXOR")])
def test_bool_is_logical(name, mpi):
    """torch's bool semantics: SUM/MAX/BOR = any, PRODUCT/MIN/BAND = all, BXOR = parity."""
    assert ops.mpi_op(getattr(R, name), torch.bool, "all_reduce")[0] == getattr(MPI, mpi)


@pytest.mark.parametrize("dtype", FLOATS + COMPLEX + (torch.float16, torch.bfloat16))
def test_avg_and_premul_sum_are_sums(dtype):
    op, kind = ops.mpi_op(R.AVG, dtype, "all_reduce")
    assert kind == R.AVG
    premul = dist._make_nccl_premul_sum(0.5)
    op2, kind2 = ops.mpi_op(premul, dtype, "all_reduce")
    assert kind2 == R.PREMUL_SUM and op2 == op  # the same SUM; scaling happens around it
    if dtype not in (torch.float16, torch.bfloat16):
        assert op == MPI.SUM


@pytest.mark.parametrize("op,dtype,needles", [
    (R.AVG, torch.int32, ["AVG", "floating-point", "torch.int32", "use SUM and divide"]),
    (R.AVG, torch.uint8, ["AVG", "torch.uint8"]),
    (R.AVG, torch.bool, ["AVG", "bool"]),
    (R.BAND, torch.float32, ["BAND", "integer", "torch.float32"]),
    (R.BXOR, torch.bfloat16, ["BXOR", "integer", "torch.bfloat16"]),
    (R.BOR, torch.complex64, ["BOR", "torch.complex64"]),
    (R.MAX, torch.complex128, ["MAX", "complex"]),
    (R.MIN, torch.complex64, ["MIN", "complex"]),
    ("sum", torch.float32, ["op must be a torch.distributed.ReduceOp", "'sum'"]),
    (None, torch.float32, ["op must be", "None"]),
])
def test_refused_with_the_reason(op, dtype, needles):
    with pytest.raises(ValueError) as info:
        ops.mpi_op(op, dtype, "reduce_scatter")
    msg = str(info.value)
    assert msg.startswith("reduce_scatter: "), msg
    for n in needles:
        assert n in msg, (n, msg)


def test_premul_sum_refused_on_ints():
    with pytest.raises(ValueError, match="PREMUL_SUM needs a floating-point tensor"):
        ops.mpi_op(dist._make_nccl_premul_sum(2.0), torch.int64, "all_reduce")


def test_complex_product_is_mpis():
    """MPI defines PRODUCT on complex numbers (torch's all_reduce refuses it before us)."""
    assert ops.mpi_op(R.PRODUCT, torch.complex64, "reduce")[0] == MPI.PROD


def test_bfloat16_uses_a_user_op_and_caches_it():
    op, _ = ops.mpi_op(R.SUM, torch.bfloat16, "all_reduce")
    assert op not in (MPI.SUM, MPI.PROD, MPI.MIN, MPI.MAX)
    assert ops.mpi_op(R.SUM, torch.bfloat16, "all_reduce")[0] is op
    assert ops.mpi_op(R.MAX, torch.bfloat16, "all_reduce")[0] is not op


def test_reduce_op_name():
    assert ops.reduce_op_name(R.BXOR) == "BXOR"
    assert ops.reduce_op_name(dist._make_nccl_premul_sum(2.0)) == "PREMUL_SUM"


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint16).numpy().copy()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name,fn", [("SUM", torch.add), ("PRODUCT", torch.mul),
                                     ("MIN", torch.minimum), ("MAX", torch.maximum)])
def test_16bit_user_ops_through_mpi(dtype, name, fn):
    """The user-defined op as MPI runs it (Reduce_local on uint16 buffers) equals torch's
    element-wise op in the dtype, including infinities, signed zeros and rounding."""
    g = torch.Generator().manual_seed(3)
    a = (torch.randn(1001, generator=g) * 100).to(dtype)
    b = (torch.randn(1001, generator=g) * 100).to(dtype)
    a[:4] = torch.tensor([float("inf"), -0.0, 1e-3, 65504.0]).to(dtype)
    b[:4] = torch.tensor([1.0, 0.0, 1e-3, 65504.0]).to(dtype)
    op = ops._custom_op(getattr(R, name), dtype)  # the user op, whatever the MPI has natively
    inbuf, inout = _bits(a), _bits(b)
    op.Reduce_local(inbuf, inout)
    got = torch.from_numpy(inout).view(dtype)
    want = fn(a, b)
    assert torch.equal(got.view(torch.uint16), want.view(torch.uint16)) or \
        torch.equal(got, want), f"{name} {dtype}"


def test_float16_native_or_user_op():
    """float16 reduces natively where the MPI has MPIX_C_FLOAT16, else through the user op."""
    op, _ = ops.mpi_op(R.SUM, torch.float16, "all_reduce")
    if ops._mpi_has_float16():
        assert op == MPI.SUM
    else:
        assert op is ops._custom_op(R.SUM, torch.float16)
