"""The ``torch_bq::`` linear and qdq ops: schema, fake implementation, reference body.

Each op is a ``torch.library.custom_op`` whose default body is the pure-torch
reference (:mod:`torch_bq.reference`); faster kernels register per device
elsewhere in :mod:`torch_bq.ops`. The public wrappers below give the ops their
keyword defaults and docstrings; ``torch.compile`` traces through them and keeps
each op as one node.
"""

from typing import Optional, Sequence

import torch

from .. import formats
from ..reference import linear as ref

__all__ = ["fp8_linear", "fp4_linear", "fp8_linear_direct", "fp4_linear_direct", "nvfp4_linear", "bf16_linear", "fp32w_linear", "qdq_fp8"]


# Whether dynamo is tracing: it folds torch.compiler.is_dynamo_compiling to True, so the
# direct call below never reaches a graph. Bound once, and the one-frame check rather than
# is_compiling (which also calls torch.jit.is_scripting): from a cold cache that second call
# and its lookups cost 7-11 us of an M = 1 call. Tracing that is not dynamo's (AOTAutograd,
# make_fx, non-strict export) runs the wrapper on fake or functional tensors under a mode, and
# the direct call declines those itself (not plain tensors; the entry point refuses modes).
_dynamo_tracing = torch.compiler.is_dynamo_compiling

#: op name -> a backend's eager direct call (``torch_bq.ops.cpu.linear.direct_fp8_linear``, ...):
#: the op's positional arguments, the result or ``None`` when the op must be called.
_direct: dict = {}


def register_direct(name: str, fn) -> None:
    """Let op ``name``'s public wrapper try ``fn`` before the dispatcher (eager calls only)."""
    _direct[name] = fn


def fp8_linear_direct(x, weight, scale, bias, block, act_quant, act_peak, out_dtype) -> Optional[torch.Tensor]:
    """The eager fast path of :func:`fp8_linear`: its result, or ``None`` where the op must be called.

    For callers that checked ``block`` and ``act_peak`` once (the modules) and are
    not traced by dynamo (check ``torch.compiler.is_dynamo_compiling()`` first).
    Positional arguments of the op; ``block`` a ``(bn, bk)`` tuple of ints.
    """
    direct = _direct.get("fp8_linear")
    return None if direct is None else direct(x, weight, scale, bias, block, act_quant, act_peak, out_dtype)


def fp4_linear_direct(x, weight, scale, bias, act_quant, act_peak, out_dtype) -> Optional[torch.Tensor]:
    """The eager fast path of :func:`fp4_linear`, or ``None``; see :func:`fp8_linear_direct`."""
    direct = _direct.get("fp4_linear")
    return None if direct is None else direct(x, weight, scale, bias, act_quant, act_peak, out_dtype)


def _out_like(x: torch.Tensor, n, out_dtype: torch.dtype) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], n), dtype=out_dtype)


# --------------------------------------------------------------------------- #
# op definitions
# --------------------------------------------------------------------------- #


# The reference functions carry the schema's annotations, so they are the op bodies as they are.
_fp8_linear = torch.library.custom_op("torch_bq::fp8_linear", ref.fp8_linear, mutates_args=())
_fp4_linear = torch.library.custom_op("torch_bq::fp4_linear", ref.fp4_linear, mutates_args=())
_nvfp4_linear = torch.library.custom_op("torch_bq::nvfp4_linear", ref.nvfp4_linear, mutates_args=())
_bf16_linear = torch.library.custom_op("torch_bq::bf16_linear", ref.bf16_linear, mutates_args=())
_fp32w_linear = torch.library.custom_op("torch_bq::fp32w_linear", ref.fp32w_linear, mutates_args=())


@_fp8_linear.register_fake
def _(x, weight, scale, bias, block, act_quant, act_peak, out_dtype):
    ref.check_fp8_linear_args(x, weight, scale, bias, block, act_quant, act_peak, out_dtype)
    return _out_like(x, weight.shape[0], out_dtype)


@_fp4_linear.register_fake
def _(x, weight, scale, bias, act_quant, act_peak, out_dtype):
    ref.check_fp4_linear_args(x, weight, scale, bias, act_quant, act_peak, out_dtype)
    return _out_like(x, weight.shape[0], out_dtype)


@_nvfp4_linear.register_fake
def _(x, weight, weight_scale, weight_scale_2, bias, act_quant, act_peak, out_dtype):
    ref.check_nvfp4_linear_args(x, weight, weight_scale, weight_scale_2, bias, act_quant, act_peak, out_dtype)
    return _out_like(x, weight.shape[0], out_dtype)


@_bf16_linear.register_fake
def _(x, weight, bias, out_dtype):
    ref.check_dense_linear_args(x, weight, bias, out_dtype, torch.bfloat16)
    return _out_like(x, weight.shape[0], out_dtype)


@_fp32w_linear.register_fake
def _(x, weight, bias, out_dtype):
    ref.check_dense_linear_args(x, weight, bias, out_dtype, torch.float32)
    return _out_like(x, weight.shape[0], out_dtype)


@torch.library.custom_op("torch_bq::qdq_fp8", mutates_args=())
def _qdq_fp8(x: torch.Tensor, peak: float) -> torch.Tensor:
    return formats.qdq_fp8(x, peak)


@_qdq_fp8.register_fake
def _(x, peak):
    formats.check_qdq_args(x, peak)
    return torch.empty_like(x, dtype=torch.bfloat16)


# --------------------------------------------------------------------------- #
# public wrappers
# --------------------------------------------------------------------------- #


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    block: Sequence[int] = formats.FP8.default_block,
    act_quant: bool = True,
    act_peak: float = formats.DEFAULT_ACT_PEAK,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Linear layer with a block-scaled fp8 weight (docs/contract.md §4).

    ``y = round_out(A @ W.T + bias)`` with ``A = qdq_fp8(x, act_peak)`` if
    ``act_quant`` else ``bf16(x)``, ``W[n, k] = e4m3(weight[n, k]) * scale[n // bn, k // bk]``,
    products and sums in float32.

    Args:
        x: ``[..., K]`` any float dtype; the leading dims may be empty or 0.
        weight: ``[N, K]`` ``float8_e4m3fn`` (or ``uint8`` bytes).
        scale: ``[ceil(N/bn), ceil(K/bk)]`` e8m0 (``float8_e8m0fnu``/``uint8``) or float32,
            always multiplied.
        bias: ``[N]`` any float dtype, added in float32, or ``None``.
        block: ``(bn, bk)``: ``(32, 32)``, ``(128, 128)``, ``(1, 32)`` or any other.
        act_quant: round-trip ``x`` through fp8 in 1x32 blocks first.
        act_peak: the qdq peak, 224 (Trainium2-compatible) or up to 448.
        out_dtype: ``bfloat16`` (default), ``float16`` or ``float32``.

    Returns:
        ``[..., N]`` of ``out_dtype``.
    """
    if block is not formats.FP8.default_block:  # the default needs no check
        block = formats.check_block(block)
    act_peak = float(act_peak)
    # Eager CPU calls go straight to the kernel where that is safe (see register_direct):
    # the custom-op layers cost more than an M = 1 kernel call on small weights.
    direct = None if _dynamo_tracing() else _direct.get("fp8_linear")
    if direct is not None:
        y = direct(x, weight, scale, bias, block, act_quant, act_peak, out_dtype)
        if y is not None:
            return y
    return torch.ops.torch_bq.fp8_linear(x, weight, scale, bias, list(block), act_quant, act_peak, out_dtype)


def fp4_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    act_quant: bool = True,
    act_peak: float = formats.DEFAULT_ACT_PEAK,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Linear layer with an OCP MXFP4 weight (W4A8 by default; docs/contract.md §4).

    Args:
        x: ``[..., K]`` any float dtype; ``K`` may be odd.
        weight: ``[N, ceil(K/2)]`` packed e2m1 (``uint8``/``int8``/``float4_e2m1fn_x2``),
            element ``2j`` in the low nibble of byte ``j``.
        scale: ``[N, ceil(K/32)]`` e8m0 codes (``float8_e8m0fnu``/``uint8``).
        bias: ``[N]`` any float dtype, or ``None``.
        act_quant: round-trip ``x`` through fp8 first (default ``True``).
        act_peak: the qdq peak.
        out_dtype: ``bfloat16`` (default), ``float16`` or ``float32``.

    Returns:
        ``[..., N]`` of ``out_dtype``.
    """
    act_peak = float(act_peak)
    direct = None if _dynamo_tracing() else _direct.get("fp4_linear")
    if direct is not None:
        y = direct(x, weight, scale, bias, act_quant, act_peak, out_dtype)
        if y is not None:
            return y
    return torch.ops.torch_bq.fp4_linear(x, weight, scale, bias, act_quant, act_peak, out_dtype)


def nvfp4_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_scale_2: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    act_quant: bool = False,
    act_peak: float = formats.DEFAULT_ACT_PEAK,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Linear layer with an NVIDIA NVFP4 weight (W4A16 by default, W4A8 with ``act_quant``).

    ``y = round_out(A @ W.T + bias)``, ``A = qdq_fp8(x, act_peak)`` if ``act_quant``
    else ``bf16(x)``, ``W[n, k] = fp32(e2m1[n, k] * e4m3(weight_scale[n, k // 16])) *
    weight_scale_2`` rounded once to float32 (exact float32 values, not always bf16),
    products and sums in float32. Activations are never quantized to NVFP4.

    Args:
        x: ``[..., K]`` any float dtype; ``K`` may be odd.
        weight: ``[N, ceil(K/2)]`` packed e2m1 (``uint8``/``int8``/``float4_e2m1fn_x2``),
            element ``2j`` in the low nibble of byte ``j``.
        weight_scale: ``[N, ceil(K/16)]`` ``float8_e4m3fn`` (or ``uint8`` bytes), positive
            and finite (not scanned here; loaders scan), multiplied.
        weight_scale_2: ``float32`` scalar (shape ``[]`` or ``[1]``), multiplied.
        bias: ``[N]`` any float dtype, or ``None``.
        act_quant: round-trip ``x`` through fp8 first (default ``False``: bf16 activations).
        act_peak: the qdq peak.
        out_dtype: ``bfloat16`` (default), ``float16`` or ``float32``.

    Returns:
        ``[..., N]`` of ``out_dtype``.
    """
    return torch.ops.torch_bq.nvfp4_linear(
        x, weight, weight_scale, weight_scale_2, bias, act_quant, float(act_peak), out_dtype
    )


def bf16_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Linear layer with a bf16 weight: ``round_out(bf16(x) @ weight.T + bias)`` in float32.

    Args:
        x: ``[..., K]`` any float dtype (rounded to bf16 first; never quantized).
        weight: ``[N, K]`` ``bfloat16``.
        bias: ``[N]`` any float dtype, or ``None``.
        out_dtype: ``bfloat16`` (default), ``float16`` or ``float32``.

    Returns:
        ``[..., N]`` of ``out_dtype``.
    """
    return torch.ops.torch_bq.bf16_linear(x, weight, bias, out_dtype)


def fp32w_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Linear layer with a float32 weight narrowed to bf16 inside the op.

    Same math as :func:`bf16_linear` with ``W = bf16(weight)``.

    Args:
        x: ``[..., K]`` any float dtype.
        weight: ``[N, K]`` ``float32``.
        bias: ``[N]`` any float dtype, or ``None``.
        out_dtype: ``bfloat16`` (default), ``float16`` or ``float32``.

    Returns:
        ``[..., N]`` of ``out_dtype``.
    """
    return torch.ops.torch_bq.fp32w_linear(x, weight, bias, out_dtype)


def qdq_fp8(x: torch.Tensor, peak: float = formats.DEFAULT_ACT_PEAK) -> torch.Tensor:
    """The activation round trip of docs/contract.md §3 as an op; see :func:`torch_bq.formats.qdq_fp8`.

    Args:
        x: ``[..., K]`` any float dtype.
        peak: the largest magnitude a 1x32 block may use (224 default, up to 448).

    Returns:
        ``[..., K]`` ``bfloat16``.
    """
    return torch.ops.torch_bq.qdq_fp8(x, float(peak))
