"""Stand-in for ``nki.isa``: the instructions torch_bq's kernels use, destination first.

Semantics follow the instruction docs of the NKI API: arithmetic in float32 with
a cast on write to ``dst.dtype``; bitvec operators only on integer tiles, on the
raw bit patterns; ``nc_matmul`` reads SBUF, writes fp32 PSUM, and accumulates
only into PSUM a previous matmul initialised. Every documented limit the
kernels could break raises :class:`NkiShimError` naming the instruction and the
offending shapes.
"""

from __future__ import annotations

import numpy as np

from . import _core
from . import language as nl
from ._core import MemoryRegion, NkiShimError, NkiTensor, cast_on_write, fmt_shape, is_int, to_f32
from .rules import tag
from ._dynamic import (  # noqa: F401  (run-time addressing and control; see _dynamic)
    AccessPattern,
    VirtualRegister,
    dge_mode,
    iota,
    nc_transpose,
    oob_mode,
    register_alloc,
    register_load,
    register_move,
    register_store,
)
from . import _dynamic


class engine:  # noqa: N801  (the real module's enum of engines)
    tensor = "tensor"
    vector = "vector"
    scalar = "scalar"
    gpsimd = "gpsimd"
    dma = "dma"
    sync = "sync"
    unknown = "unknown"


def _need_tensor(op: str, what: str, t) -> NkiTensor:
    if not isinstance(t, NkiTensor):
        raise NkiShimError(f"{op}: {what} must be a tensor, got {type(t).__name__}")
    return t


def _check_start_partition(op: str, t: NkiTensor) -> None:
    """rules.py hw-start-partition: where an engine access of n partitions may start."""
    n, start = t.shape[0], t.start_partition()
    allowed = (0,) if n > 64 else ((0, 64) if n > 32 else (0, 32, 64, 96))
    if start not in allowed:
        raise NkiShimError(
            f"{tag('hw-start-partition')} {op}: invalid access of {n} partitions starting at partition {start} "
            f"({fmt_shape(t)}); {n} partitions may start at {' or '.join(str(a) for a in allowed)}"
        )


def _check_on_chip(op: str, *tensors: NkiTensor) -> None:
    """Operands of a compute-engine instruction: on chip, <= 128 partitions, an allowed start partition."""
    for t in tensors:
        if not t.on_chip:
            raise NkiShimError(f"{op}: {fmt_shape(t)} must be in SBUF or PSUM, is in {t.buffer.value}")
        if t.shape[0] > _core.PMAX:
            raise NkiShimError(f"{op}: partition dim {t.shape[0]} of {fmt_shape(t)} exceeds {_core.PMAX}")
        _check_start_partition(op, t)


def _per_partition(t: NkiTensor) -> int:
    return int(np.prod(t.shape[1:], dtype=np.int64)) if t.ndim > 1 else 1


def _check_same_layout(op: str, dst: NkiTensor, *srcs: NkiTensor) -> None:
    for s in srcs:
        if s.shape[0] != dst.shape[0] or _per_partition(s) != _per_partition(dst):
            raise NkiShimError(
                f"{op}: {fmt_shape(s)} and dst {fmt_shape(dst)} differ in partitions or elements per partition"
            )


def _as_dst_shape(values: np.ndarray, dst: NkiTensor) -> np.ndarray:
    return np.asarray(values).reshape(dst.shape)


def _operand(op: str, operand, data: NkiTensor, kind: str):
    """A scalar, or a ``[P, 1]`` tile broadcast along the free dims."""
    if operand is None:
        return None
    if isinstance(operand, NkiTensor):
        if operand.shape[0] != data.shape[0] or _per_partition(operand) != 1:
            raise NkiShimError(f"{op}: operand {fmt_shape(operand)} must be [{data.shape[0]}, 1] for {fmt_shape(data)}")
        if kind == "arith" and operand.dtype != nl.float32:
            raise NkiShimError(f"{op}: arithmetic operand {fmt_shape(operand)} must be float32")
        vals = operand.read(op).reshape((data.shape[0],) + (1,) * (data.ndim - 1))
        return to_f32(vals) if kind == "arith" else vals
    if kind == "arith":
        return np.float32(operand)
    if not isinstance(operand, (int, np.integer)):
        raise NkiShimError(f"{op}: bitvec operand must be an integer, got {operand!r}")
    info = np.iinfo(data.dtype)
    if not info.min <= int(operand) <= max(info.max, (1 << (8 * data.dtype.itemsize)) - 1):
        raise NkiShimError(f"{op}: operand {operand:#x} does not fit {data.dtype.name}")
    return np.array(int(operand) & ((1 << (8 * data.dtype.itemsize)) - 1)).astype(
        np.dtype(f"u{data.dtype.itemsize}")
    ).view(data.dtype)


def _apply(op: str, alu, a, b, reverse: bool):
    if alu.kind == "unary":
        if b not in (None, 0) and not (isinstance(b, np.floating) and b == 0):
            raise NkiShimError(f"{op}: unary operator {alu} takes no operand")
        return alu.fn(a)
    return alu.fn(b, a) if reverse else alu.fn(a, b)


def _check_kinds(op: str, dst: NkiTensor, ops, tensors) -> str:
    kinds = {o.kind for o in ops if o is not None}
    if "bitvec" in kinds:
        if kinds - {"bitvec"}:
            raise NkiShimError(f"{op}: bitvec and arithmetic operators cannot be mixed ({ops})")
        for t in (dst, *tensors):
            if not is_int(t.dtype):
                raise NkiShimError(f"{op}: bitvec operator needs integer tiles, got {fmt_shape(t)}")
        return "bitvec"
    return "arith"


def _native_int(dst: NkiTensor, tensors) -> bool:
    """int32/uint32-only arithmetic runs natively on GpSimd (exact), per tensor_tensor's docs."""
    allowed = (nl.int32, nl.uint32)
    return all(t.dtype in allowed for t in (dst, *tensors))


# --------------------------------------------------------------------------- #
# data movement
# --------------------------------------------------------------------------- #


def dma_copy(dst, src, priority=None, oob_mode=None, dge_mode=None, engine=None, name=None):
    """``dst = src`` between HBM and SBUF; same element count; same dtype (rules.py isa-dma-no-cast)."""
    op = "dma_copy"
    if isinstance(dst, AccessPattern) or isinstance(src, AccessPattern):
        _dynamic.indirect_copy(dst, src, oob_mode)
        return
    dst, src = _need_tensor(op, "dst", dst), _need_tensor(op, "src", src)
    if dst.size != src.size:
        raise NkiShimError(f"{op}: element counts differ: src {fmt_shape(src)} vs dst {fmt_shape(dst)}")
    if MemoryRegion.psum in (dst.buffer, src.buffer):
        raise NkiShimError(f"{op}: DMA cannot access PSUM ({fmt_shape(src)} -> {fmt_shape(dst)})")
    for t in (dst, src):
        if t.on_chip and t.shape[0] > _core.PMAX:
            raise NkiShimError(f"{op}: partition dim of {fmt_shape(t)} exceeds {_core.PMAX}")
    if src.dtype != dst.dtype:
        raise NkiShimError(
            f"{tag('isa-dma-no-cast')} {op}: src {fmt_shape(src)} and dst {fmt_shape(dst)} differ in dtype; the "
            "stand-in does not let a DMA cast (cast on an engine, e.g. tensor_copy)"
        )
    dst.write(op, _as_dst_shape(src.read(op), dst))


def dma_transpose(dst, src, axes=None, priority=None, dge_mode=None, oob_mode=None, name=None):
    """2-D transpose by DMA: only 2-byte dtypes, ``src.shape[-1] <= 128``, dst in SBUF."""
    op = "dma_transpose"
    dst, src = _need_tensor(op, "dst", dst), _need_tensor(op, "src", src)
    if src.dtype.itemsize != 2:
        raise NkiShimError(f"{op}: only 2-byte dtypes can be transposed by DMA, got {fmt_shape(src)}")
    if src.dtype != dst.dtype:
        raise NkiShimError(f"{op}: src {fmt_shape(src)} and dst {fmt_shape(dst)} must share a dtype")
    if src.ndim != 2 or axes not in (None, (1, 0), [1, 0]):
        raise NkiShimError(f"{op}: the stand-in models 2-D transposes only, got {fmt_shape(src)} axes={axes}")
    if dst.buffer != MemoryRegion.sbuf or src.buffer == MemoryRegion.psum:
        raise NkiShimError(f"{op}: dst must be SBUF and src HBM/SBUF, got {src.buffer.value} -> {dst.buffer.value}")
    if src.shape[-1] > _core.PMAX:
        raise NkiShimError(f"{op}: src free dim {src.shape[-1]} exceeds {_core.PMAX} ({fmt_shape(src)})")
    if dst.shape != src.shape[::-1]:
        raise NkiShimError(f"{op}: dst {fmt_shape(dst)} is not the transpose of src {fmt_shape(src)}")
    dst.write(op, src.read(op).T)


def tensor_copy(dst, src, engine=None, name=None):
    """On-chip copy; a dtype change goes through float32 (RNE on narrowing)."""
    op = "tensor_copy"
    _check_on_chip(op, dst, src)
    _check_same_layout(op, dst, src)
    values = src.read(op)
    if src.dtype != dst.dtype:
        values = cast_on_write(to_f32(values), dst.dtype)
    dst.write(op, _as_dst_shape(values, dst))


def memset(dst, value, engine=None, name=None):
    op = "memset"
    _check_on_chip(op, dst)
    dst.write(op, cast_on_write(np.full(dst.shape, value, dtype=np.float32), dst.dtype))


# --------------------------------------------------------------------------- #
# Tensor Engine
# --------------------------------------------------------------------------- #

_MATMUL_DTYPES = {nl.bfloat16, nl.float16, nl.float32, nl.float8_e4m3, nl.float8_e5m2}


def nc_matmul(dst, stationary, moving, is_stationary_onezero=False, is_moving_onezero=False,
              is_transpose=False, accumulate=None, tile_position=(), tile_size=(), perf_mode=None, name=None):
    """``dst[M, N] (+)= stationary[K, M].T @ moving[K, N]`` in fp32 PSUM (Trainium2 limits)."""
    op = "nc_matmul"
    for what, t in (("dst", dst), ("stationary", stationary), ("moving", moving)):
        _need_tensor(op, what, t)
    shapes = f"stationary {fmt_shape(stationary)}, moving {fmt_shape(moving)}, dst {fmt_shape(dst)}"
    if stationary.buffer != MemoryRegion.sbuf or moving.buffer != MemoryRegion.sbuf:
        raise NkiShimError(f"{op}: operands must be in SBUF ({shapes})")
    if dst.buffer != MemoryRegion.psum or dst.dtype != nl.float32:
        raise NkiShimError(f"{op}: dst must be a float32 PSUM tile on Trainium2 ({shapes})")
    if stationary.ndim != 2 or moving.ndim != 2 or dst.ndim != 2:
        raise NkiShimError(f"{op}: the stand-in models 2-D tiles only ({shapes})")
    k, m = stationary.shape
    k2, n = moving.shape
    if k != k2 or k > _core.PMAX:
        raise NkiShimError(f"{op}: contraction (partition) dims must match and be <= {_core.PMAX} ({shapes})")
    if m > _core.GEMM_STATIONARY_FMAX:
        raise NkiShimError(f"{op}: stationary free dim {m} > {_core.GEMM_STATIONARY_FMAX} ({shapes})")
    if n > _core.GEMM_MOVING_FMAX:
        raise NkiShimError(f"{op}: moving free dim {n} > {_core.GEMM_MOVING_FMAX} ({shapes})")
    if dst.shape != (m, n):
        raise NkiShimError(f"{op}: dst must be [{m}, {n}] ({shapes})")
    for t in (stationary, moving, dst):
        _check_start_partition(op, t)
    if n * 4 > _core.PSUM_BANK_BYTES:
        raise NkiShimError(f"{op}: dst row of {n * 4} B does not fit one {_core.PSUM_BANK_BYTES} B PSUM bank")
    for t in (stationary, moving):
        if t.dtype not in _MATMUL_DTYPES:
            raise NkiShimError(f"{op}: dtype {t.dtype.name} is not a Trainium2 matmul input ({shapes})")
    if (stationary.dtype == nl.float32) != (moving.dtype == nl.float32):
        raise NkiShimError(f"{op}: float32 can only be multiplied with float32 ({shapes})")
    if accumulate is None:
        accumulate = dst.matmul_initialised()
    if accumulate and not dst.matmul_initialised():
        raise NkiShimError(f"{op}: accumulate=True into PSUM no matmul initialised ({shapes})")
    # fp32 products and sums, as the PE array accumulates in fp32. einsum's own loops
    # rather than BLAS: on a busy 2-core CI machine a threaded BLAS is many times slower
    # for tiles this small.
    result = np.einsum("km,kn->mn", to_f32(stationary.read(op)), to_f32(moving.read(op)))
    if accumulate:
        result = dst.read(op) + result
    dst.write(op, result.astype(np.float32), from_matmul=True)


# --------------------------------------------------------------------------- #
# Vector / Scalar / GpSimd engines
# --------------------------------------------------------------------------- #


def _elementwise(op, dst, data, ops, operands, reverses, tensor_operands=(), integer_engine=False):
    """``integer_engine``: tensor_tensor's all-int32/uint32 case runs on GpSimd in exact integer math;
    every other arithmetic form is fp32 math (rules.py isa-tensor-scalar-fp32)."""
    _check_on_chip(op, dst, data, *tensor_operands)
    _check_same_layout(op, dst, data, *tensor_operands)
    kind = _check_kinds(op, dst, ops, (data, *tensor_operands))
    native = kind == "bitvec" or (integer_engine and _native_int(dst, (data, *tensor_operands)))
    values = data.read(op)
    values = values.reshape(dst.shape) if values.shape != dst.shape else values
    if not native:
        values = to_f32(values)
    for alu, operand, reverse in zip(ops, operands, reverses):
        if alu is None:
            continue
        if isinstance(operand, NkiTensor) and any(operand is t for t in tensor_operands):  # a full tile
            b = operand.read(op).reshape(dst.shape)
            b = b if native else to_f32(b)
        else:
            b = _operand(op, operand, data, "bitvec" if kind == "bitvec" else "arith")
            if b is not None and b.ndim:
                b = b.reshape((dst.shape[0],) + (1,) * (len(dst.shape) - 1))
            if native and kind != "bitvec" and b is not None:
                b = np.asarray(b).astype(values.dtype)
        values = _apply(op, alu, values, b, reverse)
        if not native:
            values = np.asarray(values, dtype=np.float32)
    dst.write(op, cast_on_write(values, dst.dtype))


def tensor_tensor(dst, data1, data2, op, engine=None, name=None):
    """``dst = data1 <op> data2`` elementwise (fp32 math; bitvec on integer tiles only)."""
    if data1.buffer == MemoryRegion.psum and data2.buffer == MemoryRegion.psum:
        raise NkiShimError(f"tensor_tensor: {fmt_shape(data1)} and {fmt_shape(data2)} cannot both be in PSUM")
    # GpSimd (exact int32) cannot access PSUM: with a PSUM operand the Vector Engine's fp32 math runs.
    in_psum = MemoryRegion.psum in (dst.buffer, data1.buffer, data2.buffer)
    _elementwise("tensor_tensor", dst, data1, [op], [data2], [False], (data2,), integer_engine=not in_psum)


def tensor_scalar(dst, data, op0, operand0, reverse0=False, op1=None, operand1=None, reverse1=False,
                  engine=None, name=None):
    """``dst = (data <op0> operand0) <op1> operand1`` with scalar or ``[P, 1]`` operands."""
    if (op1 is None) != (operand1 is None):
        raise NkiShimError("tensor_scalar: op1 and operand1 must be given together")
    _elementwise("tensor_scalar", dst, data, [op0, op1], [operand0, operand1], [reverse0, reverse1])


def scalar_tensor_tensor(dst, data, op0, operand0, op1, operand1, reverse0=False, reverse1=False, name=None):
    """``dst = (data <op0> operand0) <op1> operand1``: operand0 scalar/``[P, 1]``, operand1 a full tile."""
    op = "scalar_tensor_tensor"
    if "bitvec" in (op0.kind, op1.kind):
        raise NkiShimError(f"{op}: bitvec operators are not supported ({op0}, {op1})")
    if data.buffer == MemoryRegion.psum and operand1.buffer == MemoryRegion.psum:
        raise NkiShimError(f"{op}: data {fmt_shape(data)} and operand1 cannot both be in PSUM")
    _elementwise(op, dst, data, [op0, op1], [operand0, operand1], [reverse0, reverse1], (operand1,))


def tensor_reduce(dst, op, data, axis, negate=False, keepdims=False, name=None):
    """Reduce the trailing free axes of ``data`` (fp32 math for arithmetic operators)."""
    name_ = "tensor_reduce"
    _check_on_chip(name_, dst, data)
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    if 0 in axes or sorted(axes) != list(range(data.ndim - len(axes), data.ndim)):
        raise NkiShimError(f"{name_}: axis {axis} must be the trailing free dims of {fmt_shape(data)}")
    if op.kind != "arith":
        raise NkiShimError(f"{name_}: the stand-in models arithmetic reductions only, got {op}")
    reducer = {"maximum": np.max, "minimum": np.min, "add": np.sum}.get(op.name)
    if reducer is None:
        raise NkiShimError(f"{name_}: unsupported reduction {op}")
    values = reducer(to_f32(data.read(name_)), axis=axes, keepdims=keepdims)
    if negate:
        values = -values
    if values.size != dst.size or dst.shape[0] != data.shape[0]:
        raise NkiShimError(f"{name_}: dst {fmt_shape(dst)} does not match the reduction of {fmt_shape(data)}")
    dst.write(name_, cast_on_write(values.reshape(dst.shape), dst.dtype))


def activation(dst, op, data, bias=None, scale=1.0, reduce_op=None, reduce_res=None, reduce_cmd=None, name=None):
    """``dst = op(data * scale + bias)`` on the Scalar Engine, fp32 math, cast on write."""
    name_ = "activation"
    _check_on_chip(name_, dst, data)
    _check_same_layout(name_, dst, data)
    if op.kind != "unary":
        raise NkiShimError(f"{name_}: {op} is not an activation function")
    if reduce_op is not None or reduce_res is not None:
        raise NotImplementedError("the stand-in does not model activation reductions")
    values = to_f32(data.read(name_)).reshape(dst.shape)
    values = values * _operand(name_, scale, dst, "arith")
    if bias is not None:
        values = values + _operand(name_, bias, dst, "arith")
    dst.write(name_, cast_on_write(op.fn(values.astype(np.float32)), dst.dtype))


# --------------------------------------------------------------------------- #
# instruction counting (rules.py isa-instruction-budget)
# --------------------------------------------------------------------------- #


def _counted(name, fn):
    def instruction(*args, **kwargs):
        _core.current_program().issue(name)
        return fn(*args, **kwargs)

    instruction.__name__ = name
    instruction.__doc__ = fn.__doc__
    instruction.__wrapped__ = fn
    return instruction


for _name in ("dma_copy", "dma_transpose", "tensor_copy", "memset", "nc_matmul", "tensor_tensor", "tensor_scalar",
              "scalar_tensor_tensor", "tensor_reduce", "activation", "iota", "nc_transpose", "register_load",
              "register_store"):
    globals()[_name] = _counted(_name, globals()[_name])
del _name
