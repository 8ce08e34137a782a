"""Codecs of the fp8, MXFP4 and e8m0 formats of docs/contract.md §1-3: encode, decode, pack, validate.

Every function here is exact: quantizers produce the bytes the contract names,
decoders produce the values the contract names, and validators raise
``ValueError``/``TypeError`` naming the offending tensor.

Storage dtypes that mean the same bytes are interchangeable:

* fp8 data: ``torch.float8_e4m3fn`` or ``torch.uint8`` (raw E4M3FN bytes);
* e8m0 scales: ``torch.float8_e8m0fnu`` or ``torch.uint8`` (raw exponent codes);
* packed fp4: ``torch.uint8``, ``torch.int8`` or ``torch.float4_e2m1fn_x2``.

Scales are always *multiplied* into the data (DeepSeek's ``weight_scale_inv``
included, despite its name).
"""

from __future__ import annotations

import numbers
from typing import Optional, Sequence

import torch

from .descriptor import E2M1, E4M3FN, E8M0, FP4, FP8, check_block, dtype_error, get_format

__all__ = [
    "FP8_MAX",
    "MIN_ACT_PEAK",
    "FP4_MAX",
    "FP4_LUT",
    "E8M0_NAN",
    "E8M0_BIAS",
    "DEFAULT_ACT_PEAK",
    "QDQ_BLOCK",
    "FP4_BLOCK",
    "quantize_fp8",
    "dequantize_fp8",
    "quantize_fp4",
    "dequantize_fp4",
    "pack_fp4",
    "unpack_fp4",
    "decode_e8m0",
    "qdq_fp8",
    "fp8_scale_shape",
    "check_fp8_weight",
    "check_fp4_weight",
    "check_finite",
    "check_peak",
    "find_nan_codes",
    "as_e8m0_codes",
    "as_fp8_bytes",
    "as_fp4_bytes",
]

FP8_MAX = E4M3FN.max_value  # OCP E4M3FN largest finite value, 448
FP4_MAX = E2M1.max_value  # e2m1 largest finite value, 6
E8M0_BIAS = 127
E8M0_NAN = 255
DEFAULT_ACT_PEAK = 224.0  # Trainium2 saturates e4m3 at 240; see docs/contract.md §3
QDQ_BLOCK = 32  # activation blocks are 1x32 along K
FP4_BLOCK = FP4.default_block[1]  # MXFP4 scales cover 1x32 along K

# e2m1 values by nibble (sign * 8 + code); also gpt-oss's table.
FP4_LUT = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)
# Midpoints between consecutive e2m1 magnitudes; a tie goes to the even code.
_FP4_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


# --------------------------------------------------------------------------- #
# storage views
# --------------------------------------------------------------------------- #


def as_e8m0_codes(scale: torch.Tensor, name: str = "scale") -> torch.Tensor:
    """View e8m0 scales (``uint8`` or ``float8_e8m0fnu``) as their ``uint8`` codes."""
    if scale.dtype not in E8M0.storage:
        raise dtype_error(name, scale, E8M0.storage)
    return scale.view(torch.uint8)


def as_fp8_bytes(data: torch.Tensor, name: str = "weight") -> torch.Tensor:
    """View fp8 data (``float8_e4m3fn`` or ``uint8``) as ``uint8`` bytes."""
    if data.dtype not in E4M3FN.storage:
        raise dtype_error(name, data, E4M3FN.storage)
    return data.view(torch.uint8)


def as_fp4_bytes(packed: torch.Tensor, name: str = "weight") -> torch.Tensor:
    """View packed fp4 (``uint8``, ``int8`` or ``float4_e2m1fn_x2``) as ``uint8`` bytes."""
    if packed.dtype not in E2M1.storage:
        raise dtype_error(name, packed, E2M1.storage)
    return packed.view(torch.uint8)


# --------------------------------------------------------------------------- #
# decoding
# --------------------------------------------------------------------------- #


def decode_e8m0(codes: torch.Tensor) -> torch.Tensor:
    """e8m0 codes (``uint8`` or ``float8_e8m0fnu``) -> float32 ``2**(c - 127)``; code 255 is NaN."""
    # torch's own e8m0 conversion is exact for every code (2**-127 is an fp32 denormal).
    return as_e8m0_codes(codes).view(torch.float8_e8m0fnu).to(torch.float32)


def _scale_values(scale: torch.Tensor, name: str = "scale") -> torch.Tensor:
    """Scales as float32 multipliers: e8m0 codes are decoded, float32 passes through."""
    if scale.dtype == torch.float32:
        return scale
    if scale.dtype in E8M0.storage:
        return decode_e8m0(scale)
    raise dtype_error(name, scale, (*E8M0.storage, torch.float32))


def expand_blocks(scale: torch.Tensor, block: Sequence[int], shape: Sequence[int]) -> torch.Tensor:
    """Broadcast a ``[ceil(N/bn), ceil(K/bk)]`` scale grid to ``[N, K]`` (partial blocks share)."""
    bn, bk = block
    n, k = shape
    return scale.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]


def dequantize_fp8(
    data: torch.Tensor,
    scale: torch.Tensor,
    block: Sequence[int] = FP8.default_block,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Decode block-scaled fp8 weights.

    Args:
        data: ``[N, K]`` ``float8_e4m3fn`` (or its ``uint8`` bytes).
        scale: ``[ceil(N/bn), ceil(K/bk)]`` e8m0 codes (``float8_e8m0fnu``/``uint8``)
            or ``float32`` multipliers (DeepSeek-V3 ``weight_scale_inv``).
        block: ``(bn, bk)``; ``(1, 32)`` is MXFP8.
        dtype: output dtype. ``float32`` holds every value exactly; bf16 too except at
            extreme scale codes (docs/contract.md §1).

    Returns:
        ``[N, K]`` tensor of ``dtype`` with ``e4m3(data[n, k]) * scale[n // bn, k // bk]``
        (the product formed in float32).
    """
    block = check_block(block)
    check_fp8_weight(data, scale, block)
    values = as_fp8_bytes(data).view(torch.float8_e4m3fn).to(torch.float32)
    out = values * expand_blocks(_scale_values(scale), block, tuple(data.shape))
    return out.to(dtype)


def unpack_fp4(packed: torch.Tensor, in_features: int | None = None) -> torch.Tensor:
    """Split packed fp4 bytes ``[N, ceil(K/2)]`` into nibbles ``[N, K]`` (``uint8``, 0..15).

    Element ``2j`` is the low nibble of byte ``j``, element ``2j + 1`` the high nibble.
    """
    b = as_fp4_bytes(packed)
    nib = torch.stack((b & 0x0F, b >> 4), dim=-1).flatten(-2)
    k = nib.shape[-1] if in_features is None else in_features
    return nib[..., :k]


def pack_fp4(nibbles: torch.Tensor) -> torch.Tensor:
    """Pack nibbles ``[N, K]`` (``uint8``, 0..15) into ``[N, ceil(K/2)]`` bytes, low nibble first.

    An odd ``K`` is padded with a zero nibble in the last byte's high half.
    """
    if nibbles.dtype != torch.uint8:
        raise TypeError(f"nibbles: expected dtype torch.uint8, got {nibbles.dtype}")
    if nibbles.shape[-1] % 2:
        nibbles = torch.nn.functional.pad(nibbles, (0, 1))
    pairs = nibbles.unflatten(-1, (-1, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def dequantize_fp4(
    packed: torch.Tensor,
    scale: torch.Tensor,
    in_features: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Decode OCP MXFP4 weights.

    Args:
        packed: ``[N, ceil(K/2)]`` bytes (``uint8``/``int8``/``float4_e2m1fn_x2``), two
            e2m1 values per byte, element ``2j`` in the low nibble.
        scale: ``[N, ceil(K/32)]`` e8m0 codes (``float8_e8m0fnu``/``uint8``).
        in_features: ``K``; defaults to ``2 * packed.shape[1]``. Must be that or one less.
        dtype: output dtype. ``float32`` holds every value exactly; bf16 too except at
            extreme scale codes (docs/contract.md §1).

    Returns:
        ``[N, K]`` tensor of ``dtype`` with ``LUT[nibble] * 2**(scale - 127)``.
    """
    k = 2 * packed.shape[-1] if in_features is None else in_features
    check_fp4_weight(packed, scale, k)
    values = FP4_LUT.to(packed.device)[unpack_fp4(packed, k).long()]
    out = values * expand_blocks(decode_e8m0(scale), (1, FP4_BLOCK), (packed.shape[0], k))
    return out.to(dtype)


# --------------------------------------------------------------------------- #
# quantizers (docs/contract.md §2)
# --------------------------------------------------------------------------- #


def _ceil_log2(x: torch.Tensor) -> torch.Tensor:
    """Exact ``ceil(log2(x))`` for positive float64 ``x``, as int32."""
    mantissa, exponent = torch.frexp(x)  # x = m * 2**e with m in [0.5, 1)
    return (exponent - (mantissa == 0.5).to(exponent.dtype)).to(torch.int32)


def _floor_log2(x: torch.Tensor) -> torch.Tensor:
    """Exact ``floor(log2(x))`` for positive float64 ``x``, as int32."""
    _, exponent = torch.frexp(x)
    return (exponent - 1).to(torch.int32)


def _exp2i(exponent: torch.Tensor) -> torch.Tensor:
    """Exact float32 ``2**e`` for int ``e`` in ``[-127, 127]`` (through the e8m0 decoder)."""
    return decode_e8m0((exponent + E8M0_BIAS).to(torch.uint8))


def pad_to_blocks(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    bn, bk = block
    n, k = w.shape
    return torch.nn.functional.pad(w, (0, -k % bk, 0, -n % bn))


def quantize_fp8(
    w: torch.Tensor,
    block: Sequence[int] = FP8.default_block,
    scale_dtype: torch.dtype = torch.float8_e8m0fnu,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a float weight to block-scaled fp8 (docs/contract.md §2).

    Each ``bn x bk`` block gets the power-of-two scale ``2**ceil(log2(amax / 448))``
    (never saturates; an all-zero block gets 1.0) and its elements are rounded
    to nearest-even E4M3FN. A weight that is already representable round-trips
    bit-exactly.

    Args:
        w: ``[N, K]`` float tensor, finite.
        block: ``(bn, bk)``, e.g. ``(32, 32)``, ``(128, 128)`` or ``(1, 32)``.
        scale_dtype: ``torch.float8_e8m0fnu`` or ``torch.uint8`` for e8m0 codes,
            ``torch.float32`` for DeepSeek-V3-style multiplied scales (still powers of two).

    Returns:
        ``(data, scale)``: ``data`` ``[N, K]`` ``float8_e4m3fn``;
        ``scale`` ``[ceil(N/bn), ceil(K/bk)]`` of ``scale_dtype``.
    """
    block = check_block(block)
    _check_float_matrix(w, "w")
    FP8.scale_encoding(scale_dtype, "scale_dtype")
    w32 = _finite_float32(w, "w")
    n, k = w.shape
    bn, bk = block
    blocks = pad_to_blocks(w32, block).unflatten(0, (-1, bn)).unflatten(2, (-1, bk))
    amax = blocks.abs().amax(dim=(1, 3)).to(torch.float64)  # [N/bn, K/bk]
    exponent = torch.where(
        amax > 0, _ceil_log2(amax / FP8_MAX), torch.zeros_like(amax, dtype=torch.int32)
    ).clamp(-E8M0_BIAS, E8M0_BIAS)
    # w * 2**-e is exact in float32 (a power-of-two rescale that stays in range or
    # underflows to a value that rounds to zero in e4m3 anyway).
    inv = _exp2i(-exponent)
    data = (w32 * expand_blocks(inv, block, (n, k))).to(torch.float8_e4m3fn)
    if scale_dtype == torch.float32:
        scale = _exp2i(exponent)
    else:
        scale = (exponent + E8M0_BIAS).to(torch.uint8).view(scale_dtype)
    return data, scale


def _round_to_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Round float32 values already in ``[-6, 6]`` to e2m1 nibbles, ties to the even code."""
    mag = v.abs()
    code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for i, mid in enumerate(_FP4_MIDPOINTS):
        # At a midpoint between code i and i+1 the even one wins.
        code += (mag > mid) if i % 2 == 0 else (mag >= mid)
    return code | (torch.signbit(v).to(torch.uint8) << 3)


def quantize_fp4(w: torch.Tensor, rounding: str = "ceil") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a float weight to OCP MXFP4 (1x32 blocks, e8m0 scales; docs/contract.md §2).

    Args:
        w: ``[N, K]`` float tensor, finite.
        rounding: ``"ceil"`` (default): ``scale = 2**ceil(log2(amax / 6))``, never clips.
            ``"floor"``: the OCP rule ``scale = 2**(floor(log2(amax)) - 2)``;
            elements saturate at +-6.

    Returns:
        ``(packed, scale)``: ``packed`` ``[N, ceil(K/2)]`` ``uint8`` (element ``2j`` in the
        low nibble of byte ``j``; an odd ``K`` leaves a zero high nibble at the end);
        ``scale`` ``[N, ceil(K/32)]`` ``float8_e8m0fnu``. All-zero blocks get scale 1.0.
    """
    if rounding not in ("ceil", "floor"):
        raise ValueError(f"rounding: expected 'ceil' or 'floor', got {rounding!r}")
    _check_float_matrix(w, "w")
    w32 = _finite_float32(w, "w")
    n, k = w.shape
    blocks = pad_to_blocks(w32, (1, FP4_BLOCK)).unflatten(1, (-1, FP4_BLOCK))
    amax = blocks.abs().amax(dim=2).to(torch.float64)  # [N, K/32]
    positive = amax > 0
    safe = torch.where(positive, amax, torch.ones_like(amax))
    if rounding == "ceil":
        exponent = _ceil_log2(safe / FP4_MAX)
    else:
        exponent = _floor_log2(safe) - 2
    exponent = torch.where(positive, exponent, torch.zeros_like(exponent))
    exponent = exponent.clamp(-E8M0_BIAS, E8M0_BIAS)
    inv = _exp2i(-exponent)
    v = (w32 * expand_blocks(inv, (1, FP4_BLOCK), (n, k))).clamp(-FP4_MAX, FP4_MAX)
    packed = pack_fp4(_round_to_e2m1(v))
    scale = (exponent + E8M0_BIAS).to(torch.uint8).view(torch.float8_e8m0fnu)
    return packed, scale


# --------------------------------------------------------------------------- #
# activation quant-dequant (docs/contract.md §3)
# --------------------------------------------------------------------------- #


def qdq_fp8(x: torch.Tensor, peak: float = DEFAULT_ACT_PEAK) -> torch.Tensor:
    """Round-trip activations through fp8 E4M3FN in 1x32 blocks with power-of-two scales.

    For each row and each 32-wide block along the last dim (a partial last block
    is zero-padded): ``amax = max(max|bf16(x)|, 1e-4)``, ``t = amax * fp32(1/peak)``,
    ``s = 2**ceil(log2(t))`` (exact, from t's bits), ``q = e4m3fn_RNE(bf16(x) / s)``,
    result ``bf16(q * s)``.

    Args:
        x: ``[..., K]`` float tensor (any float dtype).
        peak: largest magnitude a block may use; 224 (the default) matches
            Trainium2's fp8, 448 is DeepSeek's ``act_quant`` rule.

    Returns:
        ``[..., K]`` ``bfloat16``.
    """
    check_qdq_args(x, peak)
    k = x.shape[-1]
    xb = x.to(torch.bfloat16).to(torch.float32)
    blocks = torch.nn.functional.pad(xb, (0, -k % QDQ_BLOCK)).unflatten(-1, (-1, QDQ_BLOCK))
    amax = blocks.abs().amax(dim=-1, keepdim=True).clamp_min(1e-4)
    recip_peak = torch.tensor(1.0 / peak, dtype=torch.float32)  # fp32(1/peak), rounded once
    t = amax * recip_peak
    # ceil(log2 t) from the bits: bump the exponent unless the mantissa is zero.
    # t >= 1e-4 / 448 is a normal float, so exponent - 127 is exact.
    bits = t.view(torch.int32)
    biased = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    scale = (biased << 23).view(torch.float32)
    recip = ((254 - biased) << 23).view(torch.float32)
    q = (blocks * recip).to(torch.float8_e4m3fn)
    out = (q.to(torch.float32) * scale).to(torch.bfloat16)
    return out.flatten(-2)[..., :k].contiguous()


# --------------------------------------------------------------------------- #
# validation
# --------------------------------------------------------------------------- #




def _check_float_matrix(w: torch.Tensor, name: str) -> None:
    if not w.dtype.is_floating_point or w.dtype.itemsize == 1:
        raise TypeError(f"{name}: expected a float16/bfloat16/float32/float64 tensor, got {w.dtype}")
    if w.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D [N, K] tensor, got shape {tuple(w.shape)}")


def fp8_scale_shape(shape: Sequence[int], block: Sequence[int]) -> tuple[int, int]:
    """``[ceil(N/bn), ceil(K/bk)]`` for an ``[N, K]`` weight (``FP8.scale_shape``)."""
    n, k = shape
    return FP8.scale_shape(n, k, block)


def check_fp8_weight(
    data: torch.Tensor, scale: torch.Tensor, block: Sequence[int], name: str = "weight"
) -> None:
    """Raise unless ``data``/``scale`` form a valid block-scaled fp8 weight (dtypes and shapes).

    Does not scan values; use :func:`find_nan_codes` for that.
    """
    FP8.check(data, scale, block=block, name=name)


def check_fp4_weight(
    packed: torch.Tensor, scale: torch.Tensor, in_features: int, name: str = "weight"
) -> None:
    """Raise unless ``packed``/``scale`` form a valid MXFP4 weight with ``in_features`` columns."""
    FP4.check(packed, scale, in_features=in_features, name=name)


#: The smallest qdq peak: with ``peak >= 4`` every finite bf16 block (amax below 2**128)
#: gets a scale ``s <= 2**126`` whose reciprocal, which qdq multiplies by, is a normal
#: float32 (and an e8m0 code). A smaller peak turns large activations into zeros or
#: NaN, and a tiny one (1e-30) flushes every ``q`` below e4m3's smallest subnormal.
MIN_ACT_PEAK = 4.0


def check_peak(peak: float, name: str = "act_peak") -> None:
    """Raise unless ``4 <= peak <= 448`` (the qdq peak of docs/contract.md §3; see :data:`MIN_ACT_PEAK`)."""
    short = name.rsplit(".", 1)[-1]
    if isinstance(peak, bool) or not isinstance(peak, numbers.Real):
        raise TypeError(f"{name}: expected a float, got {type(peak).__name__}")
    if not MIN_ACT_PEAK <= peak <= FP8_MAX:
        raise ValueError(
            f"{name}: expected {MIN_ACT_PEAK:g} <= {short} <= {FP8_MAX:g} (smaller peaks push the block "
            f"scales out of float32/e8m0 range), got {peak}"
        )


def check_qdq_args(x: torch.Tensor, peak: float) -> None:
    """Raise on a non-float or 0-d ``x`` or a peak outside ``[4, 448]`` (``qdq_fp8``'s arguments)."""
    if not x.dtype.is_floating_point:
        raise TypeError(f"x: expected a floating-point dtype, got {x.dtype}")
    check_peak(peak, "peak")
    if x.dim() == 0:
        raise ValueError("x: expected shape [..., K] (at least one dim), got a 0-d tensor")


def _finite_float32(w: torch.Tensor, name: str) -> torch.Tensor:
    """``w`` as float32, raising if it holds NaN/inf or (float64) values beyond float32's range."""
    check_finite(w, name)
    w32 = w.to(torch.float32)
    if w.dtype == torch.float64:
        check_finite(w32, f"{name} (as float32; float64 values beyond float32's range)")
    return w32


def check_finite(x: torch.Tensor, name: str) -> None:
    """Raise ``ValueError`` naming the first non-finite element of ``x``."""
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        index = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{name}: expected finite values, got {x[index].item()} at index {list(index)}")


def find_nan_codes(
    data: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    *,
    name: str = "weight",
    fmt: str = "fp8",
    in_features: int | None = None,
    tensor_scale: Optional[torch.Tensor] = None,
) -> None:
    """Raise ``ValueError`` if a weight holds NaN codes (docs/contract.md §1: corruption, not a weight).

    ``fmt`` is any format name (:func:`torch_bq.formats.get_format`); the checks are
    :meth:`WeightFormat.find_nan_codes`: e8m0 scale codes 255, fp8 data bytes 0x7F/0xFF,
    float32/e4m3 scales that are not positive and finite, and for the packed formats
    with odd ``in_features`` the padding nibble (must be 0). The message names the
    tensor and the first bad index.
    """
    get_format(fmt).find_nan_codes(data, scale, in_features=in_features, tensor_scale=tensor_scale, name=name)
