"""Input gradients for the ``torch_bq::`` linear ops (weights are frozen).

``y = A @ W.T + bias`` with ``A = qdq(x)`` or ``bf16(x)``. The backward treats
the activation rounding as the identity (straight-through, as every
quantization-aware adapter does) and the weight as a constant:

    grad_x    = grad_y @ W          # [M, N] x [N, K]
    grad_bias = grad_y.sum(rows)    # only when a bias requires grad

``W`` is decoded ``SLAB_BYTES`` of float32 at a time (the forward's slab size,
:mod:`torch_bq.reference.linear`), so a backward never holds a float32 copy of
the whole weight. Products and sums run in float32, or float64 when ``x`` or
``grad_y`` is float64 (so ``gradcheck`` sees an exact linear map); ``grad_x``
is returned in ``x``'s dtype and shape. Weight and scale never get gradients.

Importing this module registers the ops ``torch_bq::fp8_linear_grad_input``,
``fp4_linear_grad_input``, ``nvfp4_linear_grad_input`` and ``dense_linear_grad_input``
(reference bodies, fake implementations) and the backward of ``fp8_linear``,
``fp4_linear``, ``nvfp4_linear``, ``bf16_linear`` and ``fp32w_linear`` through them.
"""

from typing import Callable, Sequence

import torch

from ..reference import linear as ref
from . import linear as _ops  # noqa: F401  (defines the ops registered below)

__all__ = [
    "linear_grad_input",
    "fp8_linear_grad_input",
    "fp4_linear_grad_input",
    "nvfp4_linear_grad_input",
    "dense_linear_grad_input",
]


def linear_grad_input(
    grad: torch.Tensor,
    n: int,
    k: int,
    slab_rows: int,
    decode: Callable[[int, int], torch.Tensor],
    x_dtype: torch.dtype,
) -> torch.Tensor:
    """``grad [..., N] @ W [N, K] -> [..., K]`` of ``x_dtype``, ``W[n0:n1]`` from ``decode(n0, n1)``."""
    acc_dtype = torch.float64 if torch.float64 in (grad.dtype, x_dtype) else torch.float32
    g = grad.reshape(grad.shape[:-1].numel(), n).to(acc_dtype)
    out = torch.zeros(g.shape[0], k, dtype=acc_dtype, device=grad.device)
    for n0 in range(0, n, slab_rows):
        n1 = min(n, n0 + slab_rows)
        out += g[:, n0:n1] @ decode(n0, n1).to(acc_dtype)
    return out.to(x_dtype).reshape(*grad.shape[:-1], k)


def _bias_grad(ctx, grad: torch.Tensor, bias_index: int):
    if not ctx.needs_input_grad[bias_index]:
        return None
    return grad.reshape(grad.shape[:-1].numel(), grad.shape[-1]).to(torch.float32).sum(0).to(ctx.bias_dtype)


def _save_common(ctx, x, bias) -> None:
    ctx.x_dtype = x.dtype
    ctx.bias_dtype = None if bias is None else bias.dtype


# -- the grad-input ops ---------------------------------------------------------
#
# The input gradients are ops of their own (reference body + fake), not plain
# torch code inside ``backward``: AOTAutograd then keeps each as one node
# instead of unrolling the slab loop into the compiled backward graph, and a
# backend can register a faster kernel for them like for the forward ops.


def _grad_out_like(grad: torch.Tensor, k: int, x_dtype: torch.dtype) -> torch.Tensor:
    return grad.new_empty((*grad.shape[:-1], k), dtype=x_dtype)


@torch.library.custom_op("torch_bq::fp8_linear_grad_input", mutates_args=())
def fp8_linear_grad_input(
    grad: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: Sequence[int], x_dtype: torch.dtype
) -> torch.Tensor:
    """``grad [..., N] @ W [N, K]`` for an fp8 weight (see :func:`torch_bq.ops.fp8_linear`)."""
    n, k = weight.shape

    def decode(n0: int, n1: int) -> torch.Tensor:
        return ref.decode_fp8_rows(weight, scale, block, n0, n1)

    return linear_grad_input(grad, n, k, ref.slab_rows(k, block[0]), decode, x_dtype)


@fp8_linear_grad_input.register_fake
def _(grad, weight, scale, block, x_dtype):
    ref.check_devices(grad=grad, weight=weight, weight_scale=scale)
    return _grad_out_like(grad, weight.shape[1], x_dtype)


@torch.library.custom_op("torch_bq::fp4_linear_grad_input", mutates_args=())
def fp4_linear_grad_input(
    grad: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, in_features: int, x_dtype: torch.dtype
) -> torch.Tensor:
    """``grad [..., N] @ W [N, K]`` for an MXFP4 weight with ``K = in_features``."""
    n, k = weight.shape[0], in_features

    def decode(n0: int, n1: int) -> torch.Tensor:
        return ref.decode_fp4_rows(weight, scale, k, n0, n1)

    return linear_grad_input(grad, n, k, ref.slab_rows(k, 1), decode, x_dtype)


@fp4_linear_grad_input.register_fake
def _(grad, weight, scale, in_features, x_dtype):
    ref.check_devices(grad=grad, weight=weight, weight_scale=scale)
    return _grad_out_like(grad, in_features, x_dtype)


@torch.library.custom_op("torch_bq::nvfp4_linear_grad_input", mutates_args=())
def nvfp4_linear_grad_input(
    grad: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_scale_2: torch.Tensor,
    in_features: int,
    x_dtype: torch.dtype,
) -> torch.Tensor:
    """``grad [..., N] @ W [N, K]`` for an NVFP4 weight with ``K = in_features``."""
    n, k = weight.shape[0], in_features

    def decode(n0: int, n1: int) -> torch.Tensor:
        return ref.decode_nvfp4_rows(weight, weight_scale, weight_scale_2, k, n0, n1)

    return linear_grad_input(grad, n, k, ref.slab_rows(k, 1), decode, x_dtype)


@nvfp4_linear_grad_input.register_fake
def _(grad, weight, weight_scale, weight_scale_2, in_features, x_dtype):
    ref.check_devices(grad=grad, weight=weight, weight_scale=weight_scale, weight_scale_2=weight_scale_2)
    return _grad_out_like(grad, in_features, x_dtype)


@torch.library.custom_op("torch_bq::dense_linear_grad_input", mutates_args=())
def dense_linear_grad_input(grad: torch.Tensor, weight: torch.Tensor, x_dtype: torch.dtype) -> torch.Tensor:
    """``grad [..., N] @ bf16(W) [N, K]`` for a bf16 or float32 (fp32w) weight."""
    n, k = weight.shape

    def decode(n0: int, n1: int) -> torch.Tensor:
        # fp32w narrows its weight to bf16 in the forward, so the backward does too.
        return ref.decode_dense_rows(weight, n0, n1)

    return linear_grad_input(grad, n, k, ref.slab_rows(k, 1), decode, x_dtype)


@dense_linear_grad_input.register_fake
def _(grad, weight, x_dtype):
    ref.check_devices(grad=grad, weight=weight)
    return _grad_out_like(grad, weight.shape[1], x_dtype)


# -- autograd registration ------------------------------------------------------


def _fp8_setup(ctx, inputs, output) -> None:
    x, weight, scale, bias, block, *_ = inputs
    ctx.save_for_backward(weight, scale)
    ctx.block = [int(b) for b in block]
    _save_common(ctx, x, bias)


def _fp8_backward(ctx, grad):
    weight, scale = ctx.saved_tensors
    grad_x = None
    if ctx.needs_input_grad[0]:
        grad_x = torch.ops.torch_bq.fp8_linear_grad_input(grad, weight, scale, ctx.block, ctx.x_dtype)
    return grad_x, None, None, _bias_grad(ctx, grad, 3), None, None, None, None


def _fp4_setup(ctx, inputs, output) -> None:
    x, weight, scale, bias, *_ = inputs
    ctx.save_for_backward(weight, scale)
    ctx.k = x.shape[-1]
    _save_common(ctx, x, bias)


def _fp4_backward(ctx, grad):
    weight, scale = ctx.saved_tensors
    grad_x = None
    if ctx.needs_input_grad[0]:
        grad_x = torch.ops.torch_bq.fp4_linear_grad_input(grad, weight, scale, ctx.k, ctx.x_dtype)
    return grad_x, None, None, _bias_grad(ctx, grad, 3), None, None, None


def _nvfp4_setup(ctx, inputs, output) -> None:
    x, weight, weight_scale, weight_scale_2, bias, *_ = inputs
    ctx.save_for_backward(weight, weight_scale, weight_scale_2)
    ctx.k = x.shape[-1]
    _save_common(ctx, x, bias)


def _nvfp4_backward(ctx, grad):
    weight, weight_scale, weight_scale_2 = ctx.saved_tensors
    grad_x = None
    if ctx.needs_input_grad[0]:
        grad_x = torch.ops.torch_bq.nvfp4_linear_grad_input(
            grad, weight, weight_scale, weight_scale_2, ctx.k, ctx.x_dtype
        )
    return grad_x, None, None, None, _bias_grad(ctx, grad, 4), None, None, None


def _dense_setup(ctx, inputs, output) -> None:
    x, weight, bias, _ = inputs
    ctx.save_for_backward(weight)
    _save_common(ctx, x, bias)


def _dense_backward(ctx, grad):
    (weight,) = ctx.saved_tensors
    grad_x = None
    if ctx.needs_input_grad[0]:
        grad_x = torch.ops.torch_bq.dense_linear_grad_input(grad, weight, ctx.x_dtype)
    return grad_x, None, _bias_grad(ctx, grad, 2), None


torch.library.register_autograd("torch_bq::fp8_linear", _fp8_backward, setup_context=_fp8_setup)
torch.library.register_autograd("torch_bq::fp4_linear", _fp4_backward, setup_context=_fp4_setup)
torch.library.register_autograd("torch_bq::nvfp4_linear", _nvfp4_backward, setup_context=_nvfp4_setup)
torch.library.register_autograd("torch_bq::bf16_linear", _dense_backward, setup_context=_dense_setup)
torch.library.register_autograd("torch_bq::fp32w_linear", _dense_backward, setup_context=_dense_setup)
