"""Argument preparation for the NKI kernels: checks and layout, in plain torch.

Shared by the ``neuron`` registration and the tests, so that what the tests
launch through the NKI stand-in (or ``nki.simulate``) is exactly what the
device gets. Nothing here imports ``nki``.

What crosses into a kernel:

* ``x``: ``[M, K]`` ``bfloat16`` (every op starts with ``bf16(x)``, docs/contract.md §3-4);
* fp8 weight: ``[N, K]`` ``uint8`` bytes (Trainium2's compiler rejects
  ``F8E4M3FN`` tensors) and ``[ceil(N/bn), K/bk]`` ``uint8`` e8m0 codes;
* fp4 weight: ``[N, K/2]`` ``uint8`` packed nibbles and ``[N, K/32]`` ``uint8`` codes;
* bf16 / fp32 weight: ``[N, K]`` as given;
* bias: ``[1, N]`` ``float32`` (added in fp32 before the one rounding) or ``None``;
* options: ``act_quant``, ``act_peak``, ``out_dtype`` as a dtype *name*, and for
  fp8 the block shape as ``block_rows``/``block_cols``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from ... import formats
from ...reference import linear as ref

__all__ = [
    "TRN2_FP8_MAX",
    "MAX_K",
    "FP8_EXACT_CODES",
    "FP4_EXACT_CODES",
    "KernelLaunch",
    "check_act_peak",
    "prepare_fp8_linear",
    "prepare_fp4_linear",
    "prepare_dense_linear",
    "prepare_qdq_fp8",
]

TRN2_FP8_MAX = 240.0  # Trainium2's native e4m3 saturates here (not 448)
# The kernels stage a group of M tiles K-major in SBUF (2 bytes x K per partition
# per tile); K <= 32768 keeps one staged tile within 64 KiB of the 192 KiB budget.
MAX_K = 32768

# e8m0 codes whose weights the kernels' bf16 decode represents exactly (derived in
# decode.py's docstring); a weight with a code outside is served by the reference.
FP8_EXACT_CODES = (3, 134)  # scales 2**-124 .. 2**7
FP4_EXACT_CODES = (27, 160)  # scales 2**-100 .. 2**33

_OUT_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


@dataclass
class KernelLaunch:
    """One kernel call: which kernel, its tensor arguments, its compile-time options.

    ``kernel`` is ``None`` when there is nothing to compute (``M == 0`` or ``N == 0``);
    ``fallback`` names why the reference must serve instead (a layout the kernels
    do not implement), else ``None``.
    """

    kernel: Optional[str]
    tensors: tuple
    options: dict = field(default_factory=dict)
    out_shape: tuple = ()
    out_dtype: torch.dtype = torch.bfloat16
    fallback: Optional[str] = None


def check_act_peak(act_quant: bool, act_peak: float) -> None:
    """Refuse a qdq peak Trainium2's fp8 cannot honour (docs/contract.md §3: never silently changed)."""
    if act_quant and not formats.MIN_ACT_PEAK <= act_peak <= TRN2_FP8_MAX:
        raise ValueError(
            f"act_peak: the NKI kernels need {formats.MIN_ACT_PEAK:g} <= act_peak <= {TRN2_FP8_MAX} because Trainium2's fp8 e4m3 "
            f"saturates at {TRN2_FP8_MAX}; got {act_peak}. Use the default 224, or run the 448 rule on a CPU backend."
        )


def _check_k(k: int, multiple: int, op: str) -> None:
    if k <= 0 or k % multiple or k > MAX_K:
        raise ValueError(
            f"{op}: the NKI kernel needs K (in features) a positive multiple of {multiple} and <= {MAX_K}, got K={k}"
        )


def _x2d(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[:-1].numel(), x.shape[-1]).to(torch.bfloat16).contiguous()


def _bias_row(bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if bias is None else bias.to(torch.float32).reshape(1, -1).contiguous()


def _launch(kernel, x, n, tensors, options, out_dtype) -> KernelLaunch:
    out_shape = (*x.shape[:-1], n)
    m = x.numel() // max(x.shape[-1], 1)
    if m == 0 or n == 0:
        kernel = None
    options = {**options, "out_dtype": _OUT_DTYPE_NAMES[out_dtype]}
    return KernelLaunch(kernel, tensors, options, out_shape, out_dtype)


def _codes_outside(codes: torch.Tensor, exact: tuple[int, int]) -> Optional[str]:
    """Why the kernel cannot decode these e8m0 codes exactly, or ``None`` if it can.

    Reads the scale grid's min and max: one small host sync per call, the price of
    never returning a silently wrong product for a legal weight.
    """
    if codes.numel() == 0:
        return None
    lo, hi = int(codes.min()), int(codes.max())
    if exact[0] <= lo and hi <= exact[1]:
        return None
    return f"e8m0 scale codes {lo}..{hi} outside {exact[0]}..{exact[1]}, which the kernel decodes exactly"


def prepare_fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: Optional[torch.Tensor],
    block: Sequence[int],
    act_quant: bool,
    act_peak: float,
    out_dtype: torch.dtype,
) -> KernelLaunch:
    """Check and lay out ``fp8_linear``'s arguments for ``fp8_linear_kernel``.

    Raises ``ValueError`` for ``act_peak > 240`` (with ``act_quant``) and for ``K``
    not a multiple of 32. The kernel takes e8m0 scales with ``bn`` dividing 128 or a
    multiple of it (1x32 MXFP8, 32x32, 128x128, ...) and ``bk`` in {32, 64, 128, 256,
    512} dividing ``K``; float32 (DeepSeek) scales or other blocks are served by the
    reference (``fallback`` set): a float32 scale need not be a power of two, so the
    decoded weight would not be exact in bf16. So are scale codes outside
    ``FP8_EXACT_CODES``.
    """
    ref.check_fp8_linear_args(x, weight, scale, bias, block, act_quant, act_peak, out_dtype)
    check_act_peak(act_quant, act_peak)
    n, k = weight.shape
    _check_k(k, 32, "fp8_linear")
    bn, bk = (int(b) for b in block)
    rows_ok = (bn <= 128 and 128 % bn == 0) or bn % 128 == 0
    cols_ok = bk in (32, 64, 128, 256, 512) and k % bk == 0
    if scale.dtype == torch.float32 or not (rows_ok and cols_ok):
        launch = _launch(None, x, n, (), {}, out_dtype)
        launch.fallback = f"fp8 block {(bn, bk)} with {scale.dtype} scales for K={k}"
        return launch
    out_of_range = _codes_outside(formats.as_e8m0_codes(scale), FP8_EXACT_CODES)
    if out_of_range is not None:
        launch = _launch(None, x, n, (), {}, out_dtype)
        launch.fallback = out_of_range
        return launch
    tensors = (
        _x2d(x),
        formats.as_fp8_bytes(weight).contiguous(),
        formats.as_e8m0_codes(scale).contiguous(),
        _bias_row(bias),
    )
    options = {"act_quant": bool(act_quant), "act_peak": float(act_peak)}
    launch = _launch("fp8_linear_kernel", x, n, tensors, options, out_dtype)
    launch.options.update(block_rows=bn, block_cols=bk)
    return launch


def prepare_fp4_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: Optional[torch.Tensor],
    act_quant: bool,
    act_peak: float,
    out_dtype: torch.dtype,
) -> KernelLaunch:
    """Check and lay out ``fp4_linear``'s arguments; ``K`` must be a multiple of 64.

    Scale codes outside ``FP4_EXACT_CODES`` are served by the reference (``fallback`` set).
    """
    ref.check_fp4_linear_args(x, weight, scale, bias, act_quant, act_peak, out_dtype)
    check_act_peak(act_quant, act_peak)
    k = x.shape[-1]
    _check_k(k, 64, "fp4_linear")
    out_of_range = _codes_outside(formats.as_e8m0_codes(scale), FP4_EXACT_CODES)
    if out_of_range is not None:
        launch = _launch(None, x, weight.shape[0], (), {}, out_dtype)
        launch.fallback = out_of_range
        return launch
    tensors = (
        _x2d(x),
        formats.as_fp4_bytes(weight).contiguous(),
        formats.as_e8m0_codes(scale).contiguous(),
        _bias_row(bias),
    )
    options = {"act_quant": bool(act_quant), "act_peak": float(act_peak)}
    return _launch("fp4_linear_kernel", x, weight.shape[0], tensors, options, out_dtype)


def prepare_dense_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    out_dtype: torch.dtype,
    weight_dtype: torch.dtype,
) -> KernelLaunch:
    """Check and lay out ``bf16_linear`` (``weight_dtype=bfloat16``) or ``fp32w_linear`` (``float32``) arguments."""
    ref.check_dense_linear_args(x, weight, bias, out_dtype, weight_dtype)
    n, k = weight.shape
    op = "fp32w_linear" if weight_dtype == torch.float32 else "bf16_linear"
    _check_k(k, 32, op)
    tensors = (_x2d(x), weight.contiguous(), _bias_row(bias))
    return _launch(f"{op}_kernel", x, n, tensors, {}, out_dtype)


def prepare_qdq_fp8(x: torch.Tensor, peak: float) -> KernelLaunch:
    """Check and lay out ``qdq_fp8``'s arguments; ``K`` must be a multiple of 32."""
    if not x.dtype.is_floating_point:
        raise TypeError(f"x: expected a floating-point dtype, got {x.dtype}")
    check_act_peak(True, peak)
    _check_k(x.shape[-1], 32, "qdq_fp8")
    launch = _launch("qdq_fp8_kernel", x, x.shape[-1], (_x2d(x),), {"peak": float(peak)}, torch.bfloat16)
    launch.options.pop("out_dtype")
    return launch
