"""Reference linear math of docs/contract.md §4: slow, obvious, exact.

``y[m, n] = round_out(sum_k A[m, k] * W[n, k] (+ bias[n]))`` with
``A = qdq_fp8(x)`` or ``bf16(x)``, ``W`` the decoded weight, products and sums
in float32, one final rounding to ``out_dtype``.

These functions are the default bodies of the ``torch_bq::`` ops and share
their positional signatures with every faster kernel. The argument checks
here are also what the ops' fake implementations run.

Memory: the weight is decoded ``SLAB_BYTES`` of float32 at a time (a slab of
whole block rows, 8 MiB by default, e.g. 512 rows of a K = 4096 weight), so a
call never holds a float32 copy of the whole weight.
"""

from typing import Callable, Optional, Sequence

import torch

from .. import formats

__all__ = [
    "SLAB_BYTES",
    "slab_rows",
    "fp8_linear",
    "fp4_linear",
    "nvfp4_linear",
    "bf16_linear",
    "fp32w_linear",
    "check_fp8_linear_args",
    "check_fp4_linear_args",
    "check_nvfp4_linear_args",
    "check_dense_linear_args",
    "check_devices",
    "zero_k_linear",
    "decode_fp8_rows",
    "decode_fp4_rows",
    "decode_nvfp4_rows",
    "decode_dense_rows",
]

SLAB_BYTES = 8 << 20

_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# --------------------------------------------------------------------------- #
# argument checks (shared with the fake implementations)
# --------------------------------------------------------------------------- #


def check_devices(**tensors: Optional[torch.Tensor]) -> None:
    """Raise ``ValueError`` if some of ``tensors`` are on ``meta`` and others are not.

    A meta tensor has no data. Handed to an op next to real tensors, it sends the
    call to the op's fake implementation, which would return uninitialised memory
    (a weight left on meta by a partial load, called on a CPU input). All-meta calls
    are shape propagation and pass; under fake-tensor tracing (``torch.compile``)
    every tensor reports the device it stands for, so this never fires there.
    """
    meta = [name for name, t in tensors.items() if t is not None and t.device.type == "meta"]
    if not meta:
        return
    real = [name for name, t in tensors.items() if t is not None and t.device.type != "meta"]
    if real:
        raise ValueError(
            f"{meta[0]}: is on the meta device (it holds no data: never loaded or materialised?) while "
            f"{real[0]} is on {tensors[real[0]].device}; load every weight before calling the op"
        )


def _check_common(x: torch.Tensor, n: int, k: int, bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> None:
    if not x.dtype.is_floating_point or x.dtype.itemsize == 1:
        raise TypeError(f"x: expected a float16/bfloat16/float32/float64 tensor, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"x: expected shape [..., {k}] (K of the weight), got {list(x.shape)}")
    if bias is not None:
        if not bias.dtype.is_floating_point:
            raise TypeError(f"bias: expected a floating-point dtype, got {bias.dtype}")
        if tuple(bias.shape) != (n,):
            raise ValueError(f"bias: expected shape [{n}] (N of the weight), got {list(bias.shape)}")
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"out_dtype: expected one of {_OUT_DTYPES}, got {out_dtype}")


def check_fp8_linear_args(x, weight, scale, bias, block, act_quant, act_peak, out_dtype) -> None:
    """Raise on dtype/shape/device errors in ``fp8_linear``'s arguments."""
    check_devices(x=x, weight=weight, weight_scale=scale, bias=bias)
    formats.check_fp8_weight(weight, scale, block)
    _check_common(x, weight.shape[0], weight.shape[1], bias, out_dtype)
    formats.check_peak(act_peak)


def check_fp4_linear_args(x, weight, scale, bias, act_quant, act_peak, out_dtype) -> None:
    """Raise on dtype/shape/device errors in ``fp4_linear``'s arguments (K is ``x.shape[-1]``)."""
    check_devices(x=x, weight=weight, weight_scale=scale, bias=bias)
    if x.dim() < 1:
        raise ValueError(f"x: expected shape [..., K], got {list(x.shape)}")
    formats.check_fp4_weight(weight, scale, x.shape[-1])
    _check_common(x, weight.shape[0], x.shape[-1], bias, out_dtype)
    formats.check_peak(act_peak)


def check_nvfp4_linear_args(x, weight, weight_scale, weight_scale_2, bias, act_quant, act_peak, out_dtype) -> None:
    """Raise on dtype/shape/device errors in ``nvfp4_linear``'s arguments (K is ``x.shape[-1]``)."""
    check_devices(x=x, weight=weight, weight_scale=weight_scale, weight_scale_2=weight_scale_2, bias=bias)
    if x.dim() < 1:
        raise ValueError(f"x: expected shape [..., K], got {list(x.shape)}")
    formats.check_nvfp4_weight(weight, weight_scale, weight_scale_2, x.shape[-1])
    _check_common(x, weight.shape[0], x.shape[-1], bias, out_dtype)
    formats.check_peak(act_peak)


def check_dense_linear_args(x, weight, bias, out_dtype, weight_dtype: torch.dtype) -> None:
    """Raise on dtype/shape/device errors in ``bf16_linear``/``fp32w_linear``'s arguments."""
    check_devices(x=x, weight=weight, bias=bias)
    if weight.dtype != weight_dtype:
        raise TypeError(f"weight: expected dtype {weight_dtype}, got {weight.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"weight: expected a 2-D [N, K] tensor, got shape {list(weight.shape)}")
    _check_common(x, weight.shape[0], weight.shape[1], bias, out_dtype)


# --------------------------------------------------------------------------- #
# the math
# --------------------------------------------------------------------------- #


def _activation(x: torch.Tensor, act_quant: bool, act_peak: float) -> torch.Tensor:
    """``A`` of docs/contract.md §4 as float32 ``[M, K]``."""
    x2 = x.reshape(x.shape[:-1].numel(), x.shape[-1])  # not -1: K may be 0
    a = formats.qdq_fp8(x2, act_peak) if act_quant else x2.to(torch.bfloat16)
    return a.to(torch.float32)


def decode_fp8_rows(weight: torch.Tensor, scale: torch.Tensor, block: Sequence[int], n0: int, n1: int) -> torch.Tensor:
    """Rows ``n0:n1`` of an fp8 weight decoded to float32; ``n0`` must be a multiple of ``bn``
    (slabs are whole block rows), so the slab's scales start at row ``n0 // bn``."""
    bn, bk = block
    return formats.dequantize_fp8(weight[n0:n1], scale[n0 // bn : formats.cdiv(n1, bn)], (bn, bk), torch.float32)


def decode_fp4_rows(weight: torch.Tensor, scale: torch.Tensor, k: int, n0: int, n1: int) -> torch.Tensor:
    """Rows ``n0:n1`` of an MXFP4 weight with ``K = k`` decoded to float32 (scales are per row)."""
    return formats.dequantize_fp4(weight[n0:n1], scale[n0:n1], k, torch.float32)


def decode_nvfp4_rows(
    weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor, k: int, n0: int, n1: int
) -> torch.Tensor:
    """Rows ``n0:n1`` of an NVFP4 weight with ``K = k`` decoded to float32 (exact; scales are per row)."""
    return formats.dequantize_nvfp4(weight[n0:n1], weight_scale[n0:n1], weight_scale_2, k, torch.float32)


def decode_dense_rows(weight: torch.Tensor, n0: int, n1: int) -> torch.Tensor:
    """Rows ``n0:n1`` of a bf16 or float32 (fp32w) weight as the op uses them: bf16 values in float32."""
    return weight[n0:n1].to(torch.bfloat16).to(torch.float32)


def zero_k_linear(
    x: torch.Tensor, n: int, bias: Optional[torch.Tensor], out_dtype: torch.dtype
) -> torch.Tensor:
    """The result of any of the linears when ``K = 0``: the empty sum plus ``bias``, as ``F.linear`` gives."""
    acc = torch.zeros(*x.shape[:-1], n, dtype=torch.float32, device=x.device)
    if bias is not None:
        acc += bias.to(torch.float32)
    return acc.to(out_dtype)


def slab_rows(k: int, row_multiple: int) -> int:
    """Rows of a ``K = k`` weight decoded at a time: ``SLAB_BYTES`` of float32, a multiple of
    ``row_multiple`` (whole scale-block rows), at least one."""
    rows = max(1, SLAB_BYTES // (4 * max(k, 1)))
    return max(row_multiple, rows // row_multiple * row_multiple)


def _slabbed_linear(
    a: torch.Tensor,
    n: int,
    slab_rows: int,
    decode: Callable[[int, int], torch.Tensor],
    bias: Optional[torch.Tensor],
    out_shape: Sequence[int],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``round_out(a @ W.T + bias)`` with ``W[n0:n1]`` produced by ``decode(n0, n1)`` in float32."""
    acc = torch.empty(a.shape[0], n, dtype=torch.float32, device=a.device)
    for n0 in range(0, n, slab_rows):
        n1 = min(n, n0 + slab_rows)
        acc[:, n0:n1] = a @ decode(n0, n1).T
    if bias is not None:
        acc += bias.to(torch.float32)
    return acc.to(out_dtype).reshape(*out_shape, n)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: Optional[torch.Tensor],
    block: Sequence[int],
    act_quant: bool,
    act_peak: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``[..., K] x fp8 [N, K] -> [..., N]``; see :func:`torch_bq.ops.fp8_linear`."""
    check_fp8_linear_args(x, weight, scale, bias, block, act_quant, act_peak, out_dtype)
    n = weight.shape[0]
    if weight.shape[1] == 0:
        return zero_k_linear(x, n, bias, out_dtype)

    def decode(n0: int, n1: int) -> torch.Tensor:
        return decode_fp8_rows(weight, scale, block, n0, n1)

    a = _activation(x, act_quant, act_peak)
    return _slabbed_linear(a, n, slab_rows(weight.shape[1], block[0]), decode, bias, x.shape[:-1], out_dtype)


def fp4_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: Optional[torch.Tensor],
    act_quant: bool,
    act_peak: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``[..., K] x fp4 [N, ceil(K/2)] -> [..., N]``; see :func:`torch_bq.ops.fp4_linear`."""
    check_fp4_linear_args(x, weight, scale, bias, act_quant, act_peak, out_dtype)
    k = x.shape[-1]
    n = weight.shape[0]
    if k == 0:
        return zero_k_linear(x, n, bias, out_dtype)

    def decode(n0: int, n1: int) -> torch.Tensor:
        return decode_fp4_rows(weight, scale, k, n0, n1)

    a = _activation(x, act_quant, act_peak)
    return _slabbed_linear(a, n, slab_rows(k, 1), decode, bias, x.shape[:-1], out_dtype)


def nvfp4_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_scale_2: torch.Tensor,
    bias: Optional[torch.Tensor],
    act_quant: bool,
    act_peak: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``[..., K] x nvfp4 [N, ceil(K/2)] -> [..., N]``; see :func:`torch_bq.ops.nvfp4_linear`."""
    check_nvfp4_linear_args(x, weight, weight_scale, weight_scale_2, bias, act_quant, act_peak, out_dtype)
    k = x.shape[-1]
    n = weight.shape[0]
    if k == 0:
        return zero_k_linear(x, n, bias, out_dtype)

    def decode(n0: int, n1: int) -> torch.Tensor:
        return decode_nvfp4_rows(weight, weight_scale, weight_scale_2, k, n0, n1)

    a = _activation(x, act_quant, act_peak)
    return _slabbed_linear(a, n, slab_rows(k, 1), decode, bias, x.shape[:-1], out_dtype)


def _dense_linear(x, weight, bias, out_dtype) -> torch.Tensor:
    n, k = weight.shape
    if k == 0:
        return zero_k_linear(x, n, bias, out_dtype)

    def decode(n0: int, n1: int) -> torch.Tensor:
        return decode_dense_rows(weight, n0, n1)

    a = _activation(x, False, formats.DEFAULT_ACT_PEAK)
    return _slabbed_linear(a, n, slab_rows(k, 1), decode, bias, x.shape[:-1], out_dtype)


def bf16_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], out_dtype: torch.dtype
) -> torch.Tensor:
    """``[..., K] x bf16 [N, K] -> [..., N]``; see :func:`torch_bq.ops.bf16_linear`."""
    check_dense_linear_args(x, weight, bias, out_dtype, torch.bfloat16)
    return _dense_linear(x, weight, bias, out_dtype)


def fp32w_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], out_dtype: torch.dtype
) -> torch.Tensor:
    """``[..., K] x fp32 [N, K] -> [..., N]`` with the weight narrowed to bf16 inside."""
    check_dense_linear_args(x, weight, bias, out_dtype, torch.float32)
    return _dense_linear(x, weight, bias, out_dtype)
