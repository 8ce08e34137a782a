"""NVIDIA NVFP4 (as in ModelOpt-exported checkpoints): quantize, decode, validate.

Storage of an ``[N, K]`` weight (the :data:`~torch_bq.formats.NVFP4` descriptor):

* ``weight`` ``uint8 [N, ceil(K/2)]``: e2m1 pairs, element ``2j`` in the low nibble
  of byte ``j`` (the MXFP4 order; an odd ``K`` pads a zero high nibble);
* ``weight_scale`` ``float8_e4m3fn [N, ceil(K/16)]``: one positive finite e4m3 scale
  per 1x16 block;
* ``weight_scale_2`` ``float32`` scalar: the per-tensor scale.

Both scales are multiplied: ``w[n, k] = (e2m1[n, k] * e4m3(weight_scale[n, k // 16])) *
weight_scale_2``. The first product is exact in float32 (2 x 4 significant bits,
exponents well inside float32's range); the second is rounded once to float32.
So a decoded NVFP4 weight is exact in float32, not always in bf16.
"""

from __future__ import annotations

from typing import Optional

import torch

from .codecs import (
    FP4_LUT,
    _check_float_matrix,
    _finite_float32,
    _round_to_e2m1,
    expand_blocks,
    pack_fp4,
    pad_to_blocks,
    unpack_fp4,
)
from .descriptor import E4M3FN, NVFP4

__all__ = ["NVFP4_BLOCK", "quantize_nvfp4", "dequantize_nvfp4", "check_nvfp4_weight", "nvfp4_tensor_scale"]

NVFP4_BLOCK = NVFP4.default_block[1]  # 16
_E2M1_MAX = NVFP4.element.max_value  # 6
_E4M3_MAX = E4M3FN.max_value  # 448
_E4M3_MIN = 2.0**-9  # smallest positive e4m3 (a subnormal)


def check_nvfp4_weight(
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_scale_2: torch.Tensor,
    in_features: Optional[int] = None,
    name: str = "weight",
) -> int:
    """Raise unless the three tensors form a valid NVFP4 weight (dtypes and shapes); return ``K``.

    Args:
        weight: ``[N, ceil(K/2)]`` ``uint8`` (``int8``/``float4_e2m1fn_x2`` are the same bytes).
        weight_scale: ``[N, ceil(K/16)]`` ``float8_e4m3fn`` (or its ``uint8`` bytes).
        weight_scale_2: ``float32`` scalar (shape ``[]`` or ``[1]``).
        in_features: ``K``; defaults to ``2 * weight.shape[1]``.
    """
    return NVFP4.check(weight, weight_scale, in_features=in_features, tensor_scale=weight_scale_2, name=name)


def _scale_values(weight_scale: torch.Tensor) -> torch.Tensor:
    return weight_scale.view(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)


def dequantize_nvfp4(
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_scale_2: torch.Tensor,
    in_features: Optional[int] = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Decode an NVFP4 weight.

    Args:
        weight: ``[N, ceil(K/2)]`` packed e2m1 (``uint8``/``int8``/``float4_e2m1fn_x2``).
        weight_scale: ``[N, ceil(K/16)]`` ``float8_e4m3fn`` (or ``uint8`` bytes), multiplied.
        weight_scale_2: ``float32`` scalar, multiplied.
        in_features: ``K``; defaults to ``2 * weight.shape[1]``.
        dtype: output dtype; float32 (the default) is exact, bf16 rounds once more.

    Returns:
        ``[N, K]`` of ``dtype`` with ``fp32(LUT[nibble] * e4m3(weight_scale)) * weight_scale_2``
        rounded once to float32 (then to ``dtype``).
    """
    k = check_nvfp4_weight(weight, weight_scale, weight_scale_2, in_features)
    values = FP4_LUT.to(weight.device)[unpack_fp4(weight, k).long()]
    block = expand_blocks(_scale_values(weight_scale), NVFP4.default_block, (weight.shape[0], k))
    out = (values * block) * weight_scale_2.reshape(()).to(torch.float32)
    return out.to(dtype)


def nvfp4_tensor_scale(w: torch.Tensor) -> torch.Tensor:
    """ModelOpt's per-tensor scale of a float weight: ``fp32(amax(|w|) / (6 * 448))``, 1 if ``w`` is zero.

    Returns a float32 0-d tensor.
    """
    amax = w.detach().abs().amax().to(torch.float32) if w.numel() else torch.zeros((), dtype=torch.float32)
    s2 = amax / torch.tensor(_E2M1_MAX * _E4M3_MAX, dtype=torch.float32)
    return torch.where(s2 > 0, s2, torch.ones_like(s2))


def quantize_nvfp4(
    w: torch.Tensor, weight_scale_2: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize a float weight to NVFP4 (the ModelOpt rule, every step rounded as stated).

    1. ``s2 = weight_scale_2`` if given (a positive finite float32 scalar), else
       :func:`nvfp4_tensor_scale` ``(w)`` = ``fp32(amax / 2688)``.
    2. Per 1x16 block: ``s = e4m3_RNE(fp32(fp32(amax_block / 6) / s2))``, clamped to
       ``[2**-9, 448]`` (the smallest positive e4m3 and the largest) so that every
       stored scale is positive and finite; an all-zero block gets ``s = 1``.
    3. Elements: ``e2m1_RNE(clamp(w / fp32(s * s2), -6, 6))`` (ties to the even code;
       the division is one float32 rounding).

    Args:
        w: ``[N, K]`` float tensor, finite.
        weight_scale_2: optional per-tensor scale to use instead of step 1 (e.g. one
            shared by fused q/k/v weights).

    Returns:
        ``(weight, weight_scale, weight_scale_2)``: ``uint8 [N, ceil(K/2)]``,
        ``float8_e4m3fn [N, ceil(K/16)]``, ``float32`` 0-d.
    """
    _check_float_matrix(w, "w")
    w32 = _finite_float32(w, "w")
    if weight_scale_2 is None:
        s2 = nvfp4_tensor_scale(w32)
    else:
        if not isinstance(weight_scale_2, torch.Tensor) or weight_scale_2.dtype != torch.float32:
            raise TypeError(f"weight_scale_2: expected a float32 tensor, got {getattr(weight_scale_2, 'dtype', weight_scale_2)!r}")
        if weight_scale_2.numel() != 1:
            raise ValueError(f"weight_scale_2: expected a scalar, got shape {list(weight_scale_2.shape)}")
        s2 = weight_scale_2.reshape(()).to(w32.device)
        if not (torch.isfinite(s2) and s2 > 0):
            raise ValueError(f"weight_scale_2: expected a positive finite value, got {s2.item()}")
    n, k = w.shape
    blocks = pad_to_blocks(w32, NVFP4.default_block).unflatten(1, (-1, NVFP4_BLOCK))
    amax = blocks.abs().amax(dim=2)  # [N, ceil(K/16)] float32
    six = torch.tensor(_E2M1_MAX, dtype=torch.float32)
    wanted = (amax / six) / s2
    scale = wanted.clamp(_E4M3_MIN, _E4M3_MAX).to(torch.float8_e4m3fn)
    # RNE to e4m3 can round a value just under 2**-9 * 1.5 down; the clamp keeps it >= 2**-9.
    scale = torch.where(amax > 0, scale, torch.ones_like(scale))
    step = _scale_values(scale) * s2  # fp32(s * s2), one rounding
    v = (w32 / expand_blocks(step, NVFP4.default_block, (n, k))).clamp(-_E2M1_MAX, _E2M1_MAX)
    weight = pack_fp4(_round_to_e2m1(v))
    return weight, scale, s2.clone()
