"""CPU kernels of ``torch_bq::fp8_linear``, ``fp4_linear`` and ``qdq_fp8``.

Twins of :mod:`torch_bq.reference.linear` and :func:`torch_bq.formats.qdq_fp8`:
same positional signatures, same results (qdq bit-exact; linear up to fp32
summation order). The math lives in ``kernels.cpp`` (see its header for the
decode / prefill layouts); this module prepares the operands and falls back
to the reference when the compiled kernels are unavailable.

Tuning:

* ``DECODE_MAX_M``: up to this many rows the weight is decoded inside the dot
  product (memory-bound decode); above it, panels of the weight are dequantized
  and fed to a GEMM (compute-bound prefill).
* ``PANEL_BYTES``: the fp32 panel size of the prefill path, the only extra
  memory a call needs besides its activation and output (independent of N x K).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ... import formats
from ...reference import linear as ref
from .. import _backend

__all__ = ["DECODE_MAX_M", "PANEL_BYTES", "fp8_linear", "fp4_linear", "qdq_fp8"]

DECODE_MAX_M = 32
PANEL_BYTES = 4 << 20


def _activation(kernels, x: torch.Tensor, act_quant: bool, act_peak: float) -> torch.Tensor:
    """``A`` of SPEC.md §4 as contiguous float32 ``[M, K]``."""
    x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
    if act_quant:
        return kernels.qdq_fp8(x2, float(act_peak), True)
    return x2.to(torch.float32)


def _bias(bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if bias is None else bias.to(torch.float32).contiguous()


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
    kernels = _backend.cpu_kernels()
    if kernels is None:
        return ref.fp8_linear(x, weight, scale, bias, block, act_quant, act_peak, out_dtype)
    ref.check_fp8_linear_args(x, weight, scale, bias, block, act_quant, act_peak, out_dtype)
    bn, bk = (int(b) for b in block)
    codes = scale if scale.dtype == torch.float32 else formats.as_e8m0_codes(scale)
    y = kernels.fp8_linear(
        _activation(kernels, x, act_quant, act_peak),
        formats.as_fp8_bytes(weight).contiguous(),
        codes.contiguous(),
        _bias(bias),
        bn,
        bk,
        DECODE_MAX_M,
        PANEL_BYTES,
    )
    return y.to(out_dtype).reshape(*x.shape[:-1], weight.shape[0])


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
    kernels = _backend.cpu_kernels()
    if kernels is None:
        return ref.fp4_linear(x, weight, scale, bias, act_quant, act_peak, out_dtype)
    ref.check_fp4_linear_args(x, weight, scale, bias, act_quant, act_peak, out_dtype)
    y = kernels.fp4_linear(
        _activation(kernels, x, act_quant, act_peak),
        formats.as_fp4_bytes(weight).contiguous(),
        formats.as_e8m0_codes(scale).contiguous(),
        _bias(bias),
        DECODE_MAX_M,
        PANEL_BYTES,
    )
    return y.to(out_dtype).reshape(*x.shape[:-1], weight.shape[0])


def qdq_fp8(x: torch.Tensor, peak: float) -> torch.Tensor:
    """``[..., K]`` float -> ``[..., K]`` bfloat16, bit-exact with :func:`torch_bq.formats.qdq_fp8`."""
    kernels = _backend.cpu_kernels()
    if kernels is None or not x.dtype.is_floating_point or not 0.0 < peak <= formats.FP8_MAX:
        # The reference raises the argument errors.
        return formats.qdq_fp8(x, peak)
    if x.dim() == 0:
        return formats.qdq_fp8(x, peak)
    x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
    return kernels.qdq_fp8(x2, float(peak), False).reshape(x.shape)


torch.library.register_kernel("torch_bq::fp8_linear", "cpu", fp8_linear)
torch.library.register_kernel("torch_bq::fp4_linear", "cpu", fp4_linear)
torch.library.register_kernel("torch_bq::qdq_fp8", "cpu", qdq_fp8)
