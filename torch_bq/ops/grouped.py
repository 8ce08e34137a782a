"""The ``torch_bq::`` grouped (mixture-of-experts) linear ops: schema, fake, reference body.

A grouped linear runs one block-quantized linear per expert over rows that are
already sorted by expert, with ``offsets`` in the ``torch._grouped_mm``
convention (``int32 [E]`` cumulative end offsets). The offsets are a tensor
argument, so a caller under ``torch.compile(fullgraph=True)`` never branches on
routing data: the op is one graph node whose output shape ``[T, N]`` depends
only on shapes.

Gradients: the dense ops' input-gradient backward (:mod:`torch_bq.ops.autograd`),
applied per expert; weights and scales never get gradients.
"""

from typing import Optional, Sequence

import torch

from .. import formats
from ..reference import grouped as ref
from ..reference import linear as ref_linear
from .autograd import linear_grad_input

__all__ = ["fp8_grouped_linear", "fp4_grouped_linear"]


# --------------------------------------------------------------------------- #
# op definitions
# --------------------------------------------------------------------------- #


# The reference functions carry the schema's annotations, so they are the op bodies as they are.
_fp8_grouped_linear = torch.library.custom_op("torch_bq::fp8_grouped_linear", ref.fp8_grouped_linear, mutates_args=())
_fp4_grouped_linear = torch.library.custom_op("torch_bq::fp4_grouped_linear", ref.fp4_grouped_linear, mutates_args=())


@_fp8_grouped_linear.register_fake
def _(x, weight, scale, offsets, bias, block, act_quant, act_peak, out_dtype):
    ref.check_fp8_grouped_args(x, weight, scale, offsets, bias, block, act_quant, act_peak, out_dtype)
    return x.new_empty((x.shape[0], weight.shape[1]), dtype=out_dtype)


@_fp4_grouped_linear.register_fake
def _(x, weight, scale, offsets, bias, act_quant, act_peak, out_dtype):
    ref.check_fp4_grouped_args(x, weight, scale, offsets, bias, act_quant, act_peak, out_dtype)
    return x.new_empty((x.shape[0], weight.shape[1]), dtype=out_dtype)


# Per-device kernels: each expert's rows through the dense op of the same format, so
# the grouped op runs on whatever dense kernel the device has registered (a fast CPU
# kernel where one is built). With the reference dense ops this is the reference,
# bit for bit.


@_fp8_grouped_linear.register_kernel("cpu")
def _(x, weight, scale, offsets, bias, block, act_quant, act_peak, out_dtype):
    ref.check_fp8_grouped_args(x, weight, scale, offsets, bias, block, act_quant, act_peak, out_dtype)

    def expert_linear(e, rows):
        b = None if bias is None else bias[e]
        return torch.ops.torch_bq.fp8_linear(rows, weight[e], scale[e], b, block, act_quant, act_peak, out_dtype)

    return ref.by_expert(x, offsets, weight.shape[1], out_dtype, expert_linear)


@_fp4_grouped_linear.register_kernel("cpu")
def _(x, weight, scale, offsets, bias, act_quant, act_peak, out_dtype):
    ref.check_fp4_grouped_args(x, weight, scale, offsets, bias, act_quant, act_peak, out_dtype)

    def expert_linear(e, rows):
        b = None if bias is None else bias[e]
        return torch.ops.torch_bq.fp4_linear(rows, weight[e], scale[e], b, act_quant, act_peak, out_dtype)

    return ref.by_expert(x, offsets, weight.shape[1], out_dtype, expert_linear)


# --------------------------------------------------------------------------- #
# input gradients (weights frozen; activation rounding straight-through), per expert
# exactly as torch_bq.ops.autograd does for the dense ops
# --------------------------------------------------------------------------- #


# The per-expert loop reads the offsets' values, so the input gradient is an op of
# its own: autograd (and AOT tracing of the backward) sees one node with a fake.


def _grouped_grad_input(grad, weight, offsets, k, x_dtype, row_multiple, decode_expert_rows) -> torch.Tensor:
    n = weight.shape[1]

    def expert_grad(e, g_rows):
        return linear_grad_input(g_rows, n, k, ref_linear.slab_rows(k, row_multiple),
                                 lambda n0, n1: decode_expert_rows(e, n0, n1), x_dtype)

    return ref.by_expert(grad, offsets, k, x_dtype, expert_grad)


@torch.library.custom_op("torch_bq::fp8_grouped_linear_grad_input", mutates_args=())
def _fp8_grouped_grad_input(
    grad: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    offsets: torch.Tensor,
    block: Sequence[int],
    x_dtype: torch.dtype,
) -> torch.Tensor:
    """``grad [T, N]`` -> ``[T, K]``: rows of expert ``e`` times its decoded weight ``[N, K]``."""
    block = tuple(block)
    return _grouped_grad_input(grad, weight, offsets, weight.shape[2], x_dtype, block[0],
                               lambda e, n0, n1: ref_linear.decode_fp8_rows(weight[e], scale[e], block, n0, n1))


@torch.library.custom_op("torch_bq::fp4_grouped_linear_grad_input", mutates_args=())
def _fp4_grouped_grad_input(
    grad: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    offsets: torch.Tensor,
    in_features: int,
    x_dtype: torch.dtype,
) -> torch.Tensor:
    """``grad [T, N]`` -> ``[T, K]``: rows of expert ``e`` times its decoded weight ``[N, K]``."""
    return _grouped_grad_input(
        grad, weight, offsets, in_features, x_dtype, 1,
        lambda e, n0, n1: ref_linear.decode_fp4_rows(weight[e], scale[e], in_features, n0, n1),
    )


@_fp8_grouped_grad_input.register_fake
def _(grad, weight, scale, offsets, block, x_dtype):
    return grad.new_empty((grad.shape[0], weight.shape[2]), dtype=x_dtype)


@_fp4_grouped_grad_input.register_fake
def _(grad, weight, scale, offsets, in_features, x_dtype):
    return grad.new_empty((grad.shape[0], in_features), dtype=x_dtype)


def _grouped_bias_grad(ctx, grad, offsets, num_experts):
    """Per-expert sums of ``grad`` rows, ``[E, N]``, with static shapes (traceable)."""
    rows = torch.arange(grad.shape[0], device=grad.device, dtype=torch.int32)
    expert_of_row = torch.searchsorted(offsets, rows, right=True)
    out = torch.zeros(num_experts, grad.shape[1], dtype=torch.float32, device=grad.device)
    return out.index_add(0, expert_of_row, grad.to(torch.float32)).to(ctx.bias_dtype)


def _grouped_setup(ctx, x, weight, scale, offsets, bias) -> None:
    ctx.save_for_backward(weight, scale, offsets)
    ctx.x_dtype = x.dtype
    ctx.k = x.shape[-1]
    ctx.bias_dtype = None if bias is None else bias.dtype


def _fp8_grouped_setup(ctx, inputs, output) -> None:
    x, weight, scale, offsets, bias, block, *_ = inputs
    _grouped_setup(ctx, x, weight, scale, offsets, bias)
    ctx.block = [int(b) for b in block]


def _fp8_grouped_backward(ctx, grad):
    weight, scale, offsets = ctx.saved_tensors
    grad_x = torch.ops.torch_bq.fp8_grouped_linear_grad_input(grad, weight, scale, offsets, ctx.block, ctx.x_dtype)
    grad_bias = _grouped_bias_grad(ctx, grad, offsets, weight.shape[0]) if ctx.needs_input_grad[4] else None
    return grad_x, None, None, None, grad_bias, None, None, None, None


def _fp4_grouped_setup(ctx, inputs, output) -> None:
    x, weight, scale, offsets, bias, *_ = inputs
    _grouped_setup(ctx, x, weight, scale, offsets, bias)


def _fp4_grouped_backward(ctx, grad):
    weight, scale, offsets = ctx.saved_tensors
    grad_x = torch.ops.torch_bq.fp4_grouped_linear_grad_input(grad, weight, scale, offsets, ctx.k, ctx.x_dtype)
    grad_bias = _grouped_bias_grad(ctx, grad, offsets, weight.shape[0]) if ctx.needs_input_grad[4] else None
    return grad_x, None, None, None, grad_bias, None, None, None


torch.library.register_autograd(
    "torch_bq::fp8_grouped_linear", _fp8_grouped_backward, setup_context=_fp8_grouped_setup
)
torch.library.register_autograd(
    "torch_bq::fp4_grouped_linear", _fp4_grouped_backward, setup_context=_fp4_grouped_setup
)


# --------------------------------------------------------------------------- #
# public wrappers
# --------------------------------------------------------------------------- #


def fp8_grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    offsets: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    block: Sequence[int] = formats.FP8.default_block,
    act_quant: bool = True,
    act_peak: float = formats.DEFAULT_ACT_PEAK,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """One block-scaled fp8 linear per expert over rows sorted by expert.

    Rows ``offsets[e-1]:offsets[e]`` of ``x`` (``offsets[-1]`` taken as 0) give rows
    of the output computed exactly as :func:`torch_bq.ops.fp8_linear` with
    ``weight[e]``, ``scale[e]`` and ``bias[e]``. Experts with no rows are skipped.

    Args:
        x: ``[T, K]`` any float dtype, rows sorted by expert; ``T`` may be 0.
        weight: ``[E, N, K]`` ``float8_e4m3fn`` (or ``uint8`` bytes).
        scale: ``[E, ceil(N/bn), ceil(K/bk)]`` e8m0 (``float8_e8m0fnu``/``uint8``) or
            float32, always multiplied.
        offsets: ``[E]`` ``int32`` cumulative end offsets (``torch._grouped_mm``
            convention): non-decreasing, ``offsets[E-1] == T``.
        bias: ``[E, N]`` any float dtype, or ``None``.
        block: ``(bn, bk)`` of every expert's weight.
        act_quant: round-trip ``x`` through fp8 in 1x32 blocks first.
        act_peak: the qdq peak, 224 (Trainium2-compatible) or up to 448.
        out_dtype: ``bfloat16`` (default), ``float16`` or ``float32``.

    Returns:
        ``[T, N]`` of ``out_dtype``.

    Raises:
        ValueError/TypeError: on shape/dtype mismatches, and (when the op runs) on
        offsets that decrease or do not end at ``T``.
    """
    return torch.ops.torch_bq.fp8_grouped_linear(
        x, weight, scale, offsets, bias, list(formats.check_block(block)), act_quant, float(act_peak), out_dtype
    )


def fp4_grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    offsets: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    act_quant: bool = True,
    act_peak: float = formats.DEFAULT_ACT_PEAK,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """One OCP MXFP4 linear per expert over rows sorted by expert (W4A8 by default).

    Rows ``offsets[e-1]:offsets[e]`` of ``x`` (``offsets[-1]`` taken as 0) give rows
    of the output computed exactly as :func:`torch_bq.ops.fp4_linear` with
    ``weight[e]``, ``scale[e]`` and ``bias[e]``. Experts with no rows are skipped.

    Args:
        x: ``[T, K]`` any float dtype, rows sorted by expert; ``T`` may be 0, ``K`` odd.
        weight: ``[E, N, ceil(K/2)]`` packed e2m1 (``uint8``/``int8``/``float4_e2m1fn_x2``),
            element ``2j`` in the low nibble of byte ``j``.
        scale: ``[E, N, ceil(K/32)]`` e8m0 codes (``float8_e8m0fnu``/``uint8``).
        offsets: ``[E]`` ``int32`` cumulative end offsets (``torch._grouped_mm``
            convention): non-decreasing, ``offsets[E-1] == T``.
        bias: ``[E, N]`` any float dtype, or ``None``.
        act_quant: round-trip ``x`` through fp8 first (default ``True``).
        act_peak: the qdq peak.
        out_dtype: ``bfloat16`` (default), ``float16`` or ``float32``.

    Returns:
        ``[T, N]`` of ``out_dtype``.

    Raises:
        ValueError/TypeError: on shape/dtype mismatches, and (when the op runs) on
        offsets that decrease or do not end at ``T``.
    """
    return torch.ops.torch_bq.fp4_grouped_linear(
        x, weight, scale, offsets, bias, act_quant, float(act_peak), out_dtype
    )
