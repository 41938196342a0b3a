"""torch ReduceOp -> MPI.Op, per dtype.

MPI covers SUM/PRODUCT/MIN/MAX/BAND/BOR/BXOR on ints and floats natively. The rest:
- AVG: SUM, then divide by the group size (floating types only, as NCCL).
- PREMUL_SUM(factor): scale the input by factor, then SUM (NCCL's definition).
- bool: torch treats bool SUM/MAX/BOR as "any" and PRODUCT/MIN/BAND as "all": MPI's LOR/LAND.
- bfloat16 (no MPI type) and float16 when the MPI lacks MPIX_C_FLOAT16: a user-defined MPI op
  that adds/multiplies/min/maxes the 16-bit values with torch, element by element, like gloo.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from hpcddp.comm._mpi import MPI

RedOpType = dist.ReduceOp.RedOpType

_NATIVE = {
    RedOpType.SUM: MPI.SUM, RedOpType.PRODUCT: MPI.PROD, RedOpType.MIN: MPI.MIN,
    RedOpType.MAX: MPI.MAX, RedOpType.BAND: MPI.BAND, RedOpType.BOR: MPI.BOR,
    RedOpType.BXOR: MPI.BXOR, RedOpType.AVG: MPI.SUM, RedOpType.PREMUL_SUM: MPI.SUM,
}
_BOOL = {
    RedOpType.SUM: MPI.LOR, RedOpType.MAX: MPI.LOR, RedOpType.BOR: MPI.LOR,
    RedOpType.PRODUCT: MPI.LAND, RedOpType.MIN: MPI.LAND, RedOpType.BAND: MPI.LAND,
    RedOpType.BXOR: MPI.LXOR,
}
_FLOAT_TYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64,
                torch.complex64, torch.complex128)
_BITWISE = (RedOpType.BAND, RedOpType.BOR, RedOpType.BXOR)


def _mpi_has_float16() -> bool:
    try:
        a = np.ones(1, np.float16)
        MPI.COMM_SELF.Allreduce(MPI.IN_PLACE, a, MPI.SUM)
        return True
    except Exception:
        return False


_custom: dict = {}
_has_f16: bool | None = None


def _torch_op(kind, tdtype):
    fn = {RedOpType.SUM: torch.add, RedOpType.PRODUCT: torch.mul,
          RedOpType.MIN: torch.minimum, RedOpType.MAX: torch.maximum}[kind]

    def reduce16(inbuf, outbuf, datatype):
        a = torch.from_numpy(np.frombuffer(inbuf, np.uint16)).view(tdtype)
        b = torch.from_numpy(np.frombuffer(outbuf, np.uint16)).view(tdtype)
        fn(a, b, out=b)
    return reduce16


def _custom_op(kind, tdtype):
    key = (kind, tdtype)
    op = _custom.get(key)
    if op is None:
        op = _custom[key] = MPI.Op.Create(_torch_op(kind, tdtype), commute=True)
    return op


def reduce_op_name(op) -> str:
    kind = getattr(op, "op", op)
    return str(kind).rsplit(".", 1)[-1]


def mpi_op(op, dtype: torch.dtype, fn: str):
    """(MPI.Op, kind) for torch reduce op OP on DTYPE; raise ValueError naming FN otherwise."""
    global _has_f16
    kind = getattr(op, "op", op)  # a ReduceOp object (from opts) or a RedOpType member
    if kind not in _NATIVE:
        raise ValueError(f"{fn}: op must be a torch.distributed.ReduceOp, got {op!r}")
    if dtype == torch.bool:
        if kind not in _BOOL:
            raise ValueError(f"{fn}: ReduceOp.{reduce_op_name(kind)} is not defined on bool tensors")
        return _BOOL[kind], kind
    if kind in _BITWISE and dtype in _FLOAT_TYPES:
        raise ValueError(f"{fn}: ReduceOp.{reduce_op_name(kind)} needs an integer tensor, got {dtype}")
    if kind in (RedOpType.AVG, RedOpType.PREMUL_SUM) and dtype not in _FLOAT_TYPES:
        raise ValueError(f"{fn}: ReduceOp.{reduce_op_name(kind)} needs a floating-point tensor, "
                         f"got {dtype}; use SUM and divide")
    if dtype in (torch.complex64, torch.complex128) and kind not in (
            RedOpType.SUM, RedOpType.AVG, RedOpType.PREMUL_SUM, RedOpType.PRODUCT):
        raise ValueError(f"{fn}: ReduceOp.{reduce_op_name(kind)} is not defined on complex tensors")
    if dtype == torch.bfloat16 or dtype == torch.float16:
        if dtype == torch.float16:
            if _has_f16 is None:
                _has_f16 = _mpi_has_float16()
            if _has_f16:
                return _NATIVE[kind], kind
        base = RedOpType.SUM if kind in (RedOpType.AVG, RedOpType.PREMUL_SUM) else kind
        return _custom_op(base, dtype), kind
    return _NATIVE[kind], kind
