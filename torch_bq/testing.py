"""Test helpers for torch_bq and for people property-testing models built on it.

* Hypothesis strategies that draw *valid* quantized weights of every format
  (any shape, including ones that are not block multiples) and activations with
  a wide dynamic range.
* :func:`assert_linear_close`, which checks a linear op's output against an
  exact float64 computation with an error bound derived from ``K`` and the
  dtypes, and reports the worst element.

Requires ``hypothesis`` (the ``test`` extra); importing :mod:`torch_bq` does not
import this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from hypothesis import strategies as st

from . import formats

__all__ = [
    "FP8Weight",
    "FP4Weight",
    "NVFP4Weight",
    "fp8_weights",
    "fp4_weights",
    "nvfp4_weights",
    "activations",
    "linear_error_bound",
    "assert_linear_close",
]

# Unit roundoff (half an ulp at 1.0) and half the smallest subnormal, per dtype.
_UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
_HALF_TINY = {torch.float32: 2.0**-150, torch.bfloat16: 2.0**-134, torch.float16: 2.0**-25}


@dataclass(frozen=True)
class FP8Weight:
    """A valid block-scaled fp8 weight: ``data [N, K]`` e4m3fn, ``scale`` per ``block``."""

    data: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return formats.dequantize_fp8(self.data, self.scale, self.block, dtype)


@dataclass(frozen=True)
class FP4Weight:
    """A valid MXFP4 weight: ``packed [N, ceil(K/2)]`` uint8, ``scale [N, ceil(K/32)]`` e8m0."""

    packed: torch.Tensor
    scale: torch.Tensor
    in_features: int

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return formats.dequantize_fp4(self.packed, self.scale, self.in_features, dtype)


@dataclass(frozen=True)
class NVFP4Weight:
    """A valid NVFP4 weight: ``packed [N, ceil(K/2)]`` uint8, ``scale [N, ceil(K/16)]`` e4m3,
    ``scale_2`` float32 scalar."""

    packed: torch.Tensor
    scale: torch.Tensor
    scale_2: torch.Tensor
    in_features: int

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return formats.dequantize_nvfp4(self.packed, self.scale, self.scale_2, self.in_features, dtype)


def _generator(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def _scale_codes(shape: Sequence[int], spread: int, g: torch.Generator) -> torch.Tensor:
    """e8m0 codes around 1.0 (``127 +- spread``): products stay well inside bf16's range."""
    return torch.randint(127 - spread, 127 + spread + 1, tuple(shape), generator=g, dtype=torch.int32).to(
        torch.uint8
    )


@st.composite
def fp8_weights(
    draw,
    blocks: Sequence[tuple[int, int]] = (formats.FP8.default_block, (128, 128), formats.MXFP8.default_block, (16, 8)),
    scale_dtypes: Sequence[torch.dtype] = (torch.float8_e8m0fnu, torch.uint8, torch.float32),
    max_n: int = 96,
    max_k: int = 160,
    scale_spread: int = 16,
) -> FP8Weight:
    """Strategy for valid fp8 weights: no NaN codes, any ``N``/``K`` up to the maxima.

    float32 scales are arbitrary positive values (DeepSeek-V3 style), e8m0 scales
    are codes ``127 +- scale_spread``.
    """
    n = draw(st.integers(1, max_n))
    k = draw(st.integers(1, max_k))
    block = draw(st.sampled_from(list(blocks)))
    scale_dtype = draw(st.sampled_from(list(scale_dtypes)))
    g = _generator(draw(st.integers(0, 2**32 - 1)))
    data = torch.randint(0, 256, (n, k), generator=g, dtype=torch.int32).to(torch.uint8)
    data = torch.where((data & 0x7F) == 0x7F, data & 0xF0, data)  # no NaN codes
    shape = formats.FP8.scale_shape(n, k, block)
    codes = _scale_codes(shape, scale_spread, g)
    if scale_dtype == torch.float32:
        mantissa = 1.0 + torch.rand(shape, generator=g)
        scale = formats.decode_e8m0(codes) * mantissa
    else:
        scale = codes.view(scale_dtype)
    return FP8Weight(data.view(torch.float8_e4m3fn), scale, block)


@st.composite
def fp4_weights(draw, max_n: int = 96, max_k: int = 160, scale_spread: int = 16) -> FP4Weight:
    """Strategy for valid MXFP4 weights, odd ``K`` included (its padding nibble is zero)."""
    n = draw(st.integers(1, max_n))
    k = draw(st.integers(1, max_k))
    g = _generator(draw(st.integers(0, 2**32 - 1)))
    nibbles = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32).to(torch.uint8)
    scale = _scale_codes(formats.FP4.scale_shape(n, k), scale_spread, g)
    return FP4Weight(formats.pack_fp4(nibbles), scale.view(torch.float8_e8m0fnu), k)


@st.composite
def nvfp4_weights(draw, max_n: int = 96, max_k: int = 160) -> NVFP4Weight:
    """Strategy for valid NVFP4 weights: every positive finite e4m3 block scale (0x01..0x7E,
    subnormals included), a per-tensor scale that is not a power of two, odd ``K`` included."""
    n = draw(st.integers(1, max_n))
    k = draw(st.integers(1, max_k))
    g = _generator(draw(st.integers(0, 2**32 - 1)))
    nibbles = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32).to(torch.uint8)
    scale = torch.randint(1, 0x7F, formats.NVFP4.scale_shape(n, k), generator=g, dtype=torch.int32).to(torch.uint8)
    scale_2 = (torch.rand((), generator=g) + 0.5) * 2.0 ** draw(st.integers(-12, 4))
    return NVFP4Weight(formats.pack_fp4(nibbles), scale.view(torch.float8_e4m3fn), scale_2.to(torch.float32), k)


@st.composite
def activations(
    draw,
    k: int,
    max_rows: int = 9,
    dtypes: Sequence[torch.dtype] = (torch.float32, torch.bfloat16, torch.float16),
    max_exponent: int = 12,
) -> torch.Tensor:
    """Strategy for ``[M, k]`` activations with a wide dynamic range.

    Each 8-element group gets its own magnitude ``2**e`` with ``|e| <= max_exponent``
    (so 32-blocks mix scales), some groups are exactly zero, ``M`` may be 0.
    """
    m = draw(st.integers(0, max_rows))
    dtype = draw(st.sampled_from(list(dtypes)))
    g = _generator(draw(st.integers(0, 2**32 - 1)))
    groups = formats.cdiv(k, 8)
    exponents = torch.randint(-max_exponent, max_exponent + 1, (m, groups), generator=g).to(torch.float32)
    zero = torch.rand(m, groups, generator=g) < 0.1
    magnitude = torch.where(zero, 0.0, torch.exp2(exponents)).repeat_interleave(8, dim=1)[:, :k]
    x = torch.randn(m, k, generator=g) * magnitude
    if dtype == torch.float16:
        x = x.clamp(-60000.0, 60000.0)
    return x.to(dtype)


def linear_error_bound(
    a: torch.Tensor,
    w: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact ``y = a @ w.T + bias`` in float64 and a per-element error bound for a backend.

    docs/contract.md §4 allows any summation order in float32, then one rounding to
    ``out_dtype``. For a dot product of length ``K`` plus a bias, every term
    passes through at most ``K + 1`` float32 roundings in any order, so
    (Higham, *Accuracy and Stability*, §3.1) the float32 sum ``s`` satisfies
    ``|s - y| <= gamma(K + 1) * (sum_k |a_k w_k| + |bias|)`` with
    ``gamma(n) = n u / (1 - n u)``, ``u = 2**-24``. The final rounding adds at most
    ``u_out * |s| + eta_out`` (``u_out`` = 2**-8 for bf16, 2**-11 for fp16, 2**-24 for
    fp32; ``eta_out`` half the smallest subnormal). A bias given in float64 adds
    one more float32 rounding of ``|bias|``.

    Args:
        a: ``[M, K]`` the activation operand exactly as the op uses it (after qdq).
        w: ``[N, K]`` the decoded weight (exact, any float dtype).
        bias: ``[N]`` or ``None``.
        out_dtype: the op's output dtype.

    Returns:
        ``(y, bound)``, both float64 ``[M, N]``.
    """
    a64 = a.to(torch.float64).reshape(a.shape[:-1].numel(), a.shape[-1])  # not -1: K may be 0
    w64 = w.to(torch.float64)
    y = a64 @ w64.T
    magnitude = a64.abs() @ w64.abs().T
    k = a64.shape[-1]
    if bias is not None:
        b64 = bias.to(torch.float64)
        y = y + b64
        magnitude = magnitude + b64.abs() * (2 if bias.dtype == torch.float64 else 1)
    u = _UNIT_ROUNDOFF[torch.float32]
    gamma = (k + 1) * u / (1 - (k + 1) * u)
    accumulated = gamma * magnitude
    u_out = _UNIT_ROUNDOFF[out_dtype]
    bound = accumulated + u_out * (y.abs() + accumulated) + _HALF_TINY[out_dtype]
    return y, bound


def assert_linear_close(
    actual: torch.Tensor,
    a: torch.Tensor,
    w: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    msg: str = "",
) -> None:
    """Assert that a linear op's output is within :func:`linear_error_bound` of the exact result.

    Args:
        actual: ``[..., N]`` the op's output; its dtype is taken as the op's ``out_dtype``.
        a: ``[..., K]`` the activation operand as the op uses it (``qdq_fp8(x)`` or ``bf16(x)``).
        w: ``[N, K]`` the decoded weight.
        bias: ``[N]`` or ``None``.
        msg: prefix for the failure message.

    Raises:
        AssertionError: naming the worst element (index, actual, exact, bound).
    """
    y, bound = linear_error_bound(a, w, bias, actual.dtype)
    got = actual.to(torch.float64).reshape(y.shape)
    err = (got - y).abs()
    # Rounding past the output dtype's largest finite value must give inf of the right sign.
    limit = torch.finfo(actual.dtype).max
    overflow = torch.isinf(got) & (y.abs() + bound >= limit) & (torch.sign(got) == torch.sign(y))
    err = torch.where(overflow, 0.0, err)
    err = torch.where(torch.isnan(got), torch.inf, err)
    if err.numel() == 0:
        return
    excess = err / bound
    worst = int(excess.argmax())
    if excess.flatten()[worst] > 1:
        row, col = divmod(worst, y.shape[1])
        raise AssertionError(
            f"{msg + ': ' if msg else ''}{int((excess > 1).sum())} of {err.numel()} elements exceed the "
            f"derived bound; worst at [{row}, {col}]: actual {got[row, col].item()!r}, exact "
            f"{y[row, col].item()!r}, error {err[row, col].item():.3g} > bound {bound[row, col].item():.3g} "
            f"(K = {a.shape[-1]})"
        )
