"""Argument preparation for the grouped (MoE) NKI kernels of :mod:`.grouped`, plain torch.

Shared by the ``neuron`` registration and the tests, like :mod:`.launch` for the dense linears,
whose rules (qdq peak, K multiple, supported fp8 blocks, exactly decodable scale codes) apply
to every expert here. The offsets (``torch._grouped_mm``'s cumulative ends) become ``bounds``
``[2, E]`` int32 (start and end row of each expert); their values are checked eagerly as the
reference checks them, and become a device-side assert when ``tracing``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ... import formats
from ...reference import grouped as ref
from . import launch as dense
from .launch import FP4_EXACT_CODES, FP8_EXACT_CODES, KernelLaunch

__all__ = ["prepare_fp8_grouped", "prepare_fp4_grouped"]

_MAX_ROWS = 2**24  # row indices pass through the engines' fp32 math: exact below 2**24


def _fallback(x, n, out_dtype, reason) -> KernelLaunch:
    launch = dense._launch(None, x, n, (), {}, out_dtype)
    launch.fallback = reason
    return launch


def _bounds(offsets: torch.Tensor, rows: int, tracing: bool, guards: list) -> torch.Tensor:
    """``[2, E]`` int32: row 0 the experts' first rows, row 1 their ends."""
    ends = offsets.to(torch.int64)
    ok = (torch.cat([ends.new_zeros(1), ends[:-1]]) <= ends).all() & (ends[-1] == rows)
    if tracing:
        guards.append((ok, "grouped linear on neuron under torch.compile: offsets must be non-decreasing cumulative "
                           f"ends from >= 0 to T = {rows}"))
    elif not bool(ok):  # one host sync; then the reference's own check names the bad offset
        ref.check_offsets_values(torch.tensor([int(v) for v in offsets], dtype=torch.int64), rows)
    ends = offsets.to(torch.int32)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    return torch.stack([starts, ends]).contiguous()


def _codes_guard(codes: torch.Tensor, exact, op: str, tracing: bool, guards: list) -> Optional[str]:
    if tracing:
        ok = torch.logical_and(codes >= exact[0], codes <= exact[1]).all()
        guards.append((ok, f"torch_bq {op} on neuron under torch.compile: e8m0 scale codes outside "
                           f"{exact[0]}..{exact[1]}, which the NKI kernel cannot decode exactly; run it eagerly"))
        return None
    return dense._codes_outside(codes, exact)


def _bias(bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if bias is None else bias.to(torch.float32).contiguous()


def prepare_fp8_grouped(x, weight, scale, offsets, bias, block: Sequence[int], act_quant: bool, act_peak: float,
                        out_dtype: torch.dtype, tracing: bool = False) -> KernelLaunch:
    """Check and lay out ``fp8_grouped_linear``'s arguments for ``fp8_grouped_linear_kernel``.

    As :func:`.launch.prepare_fp8_linear` per expert: float32 scales, unsupported blocks and
    codes outside ``FP8_EXACT_CODES`` (any expert) are served by the reference (``fallback``).
    """
    ref.check_fp8_grouped_args(x, weight, scale, offsets, bias, block, act_quant, act_peak, out_dtype)
    dense.check_act_peak(act_quant, act_peak)
    _, n, k = weight.shape
    dense._check_k(k, 32, "fp8_grouped_linear")
    bn, bk = (int(b) for b in block)
    rows_ok = (bn <= 128 and 128 % bn == 0) or bn % 128 == 0
    cols_ok = bk in (32, 64, 128, 256, 512) and k % bk == 0
    if scale.dtype == torch.float32 or not (rows_ok and cols_ok):
        return _fallback(x, n, out_dtype, f"fp8 block {(bn, bk)} with {scale.dtype} scales for K={k}")
    if x.shape[0] >= _MAX_ROWS:
        return _fallback(x, n, out_dtype, f"T = {x.shape[0]} rows (the kernel's row indices need T < 2**24)")
    guards: list = []
    codes = formats.as_e8m0_codes(scale).contiguous()
    reason = _codes_guard(codes, FP8_EXACT_CODES, "fp8_grouped_linear", tracing, guards)
    if reason is not None:
        return _fallback(x, n, out_dtype, reason)
    tensors = (dense._x2d(x), formats.as_fp8_bytes(weight).contiguous(), codes,
               _bounds(offsets, x.shape[0], tracing, guards), _bias(bias))
    options = {"act_quant": bool(act_quant), "act_peak": float(act_peak)}
    launch = dense._launch("fp8_grouped_linear_kernel", x, n, tensors, options, out_dtype)
    launch.options.update(block_rows=bn, block_cols=bk)
    launch.guards = guards
    return launch


def prepare_fp4_grouped(x, weight, scale, offsets, bias, act_quant: bool, act_peak: float, out_dtype: torch.dtype,
                        tracing: bool = False) -> KernelLaunch:
    """Check and lay out ``fp4_grouped_linear``'s arguments; ``K`` a multiple of 64, codes in ``FP4_EXACT_CODES``."""
    ref.check_fp4_grouped_args(x, weight, scale, offsets, bias, act_quant, act_peak, out_dtype)
    dense.check_act_peak(act_quant, act_peak)
    n, k = weight.shape[1], x.shape[-1]
    dense._check_k(k, 64, "fp4_grouped_linear")
    if x.shape[0] >= _MAX_ROWS:
        return _fallback(x, n, out_dtype, f"T = {x.shape[0]} rows (the kernel's row indices need T < 2**24)")
    guards: list = []
    codes = formats.as_e8m0_codes(scale).contiguous()
    reason = _codes_guard(codes, FP4_EXACT_CODES, "fp4_grouped_linear", tracing, guards)
    if reason is not None:
        return _fallback(x, n, out_dtype, reason)
    tensors = (dense._x2d(x), formats.as_fp4_bytes(weight).contiguous(), codes,
               _bounds(offsets, x.shape[0], tracing, guards), _bias(bias))
    options = {"act_quant": bool(act_quant), "act_peak": float(act_peak)}
    launch = dense._launch("fp4_grouped_linear_kernel", x, n, tensors, options, out_dtype)
    launch.guards = guards
    return launch
