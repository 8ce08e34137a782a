"""Reference grouped (mixture-of-experts) linear math: one docs/contract.md §4 linear per expert.

Rows of ``x`` are sorted by expert. ``offsets`` follows ``torch._grouped_mm``:
an ``int32 [E]`` tensor of cumulative *end* offsets, so expert ``e`` owns rows
``offsets[e-1]:offsets[e]`` (``offsets[-1]`` taken as 0). Each expert's rows go
through the dense reference linear of :mod:`torch_bq.reference.linear` with that
expert's slice of the stacked weight, scales and bias, so the grouped result is
bit-identical to a loop of dense calls. An expert with no rows is skipped: its
weights are never decoded.

Activation qdq is per row (1x32 blocks along K), so applying it expert by
expert is the same as applying it to all of ``x`` at once.
"""

from typing import Callable, Optional, Sequence

import torch

from . import linear

__all__ = [
    "fp8_grouped_linear",
    "fp4_grouped_linear",
    "check_fp8_grouped_args",
    "check_fp4_grouped_args",
    "check_offsets_values",
    "by_expert",
]


# --------------------------------------------------------------------------- #
# argument checks (shapes and dtypes: shared with the fake implementations)
# --------------------------------------------------------------------------- #


def _check_stacked(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    offsets: torch.Tensor,
    bias: Optional[torch.Tensor],
) -> int:
    """Checks common to both formats; returns the number of experts ``E``."""
    if x.dim() != 2:
        raise ValueError(f"x: expected a 2-D [T, K] tensor of rows sorted by expert, got shape {list(x.shape)}")
    if weight.dim() != 3:
        raise ValueError(f"weight: expected a 3-D stacked [E, N, ...] tensor, got shape {list(weight.shape)}")
    num_experts = weight.shape[0]
    if num_experts < 1:
        raise ValueError(f"weight: expected at least one expert, got shape {list(weight.shape)}")
    if scale.dim() != 3 or scale.shape[0] != num_experts:
        raise ValueError(
            f"scale: expected a 3-D stacked [{num_experts}, ...] tensor (one scale grid per expert), "
            f"got shape {list(scale.shape)}"
        )
    if offsets.dtype != torch.int32:
        raise TypeError(f"offsets: expected dtype torch.int32 (as torch._grouped_mm), got {offsets.dtype}")
    if tuple(offsets.shape) != (num_experts,):
        raise ValueError(
            f"offsets: expected shape [{num_experts}] (one cumulative end offset per expert), "
            f"got {list(offsets.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (num_experts, weight.shape[1]):
        raise ValueError(
            f"bias: expected a 2-D [{num_experts}, N] = [{num_experts}, {weight.shape[1]}] per-expert tensor, "
            f"got shape {list(bias.shape)}"
        )
    return num_experts


def check_fp8_grouped_args(x, weight, scale, offsets, bias, block, act_quant, act_peak, out_dtype) -> None:
    """Raise on dtype/shape/device errors in ``fp8_grouped_linear``'s arguments (values are not read)."""
    linear.check_devices(x=x, weight=weight, weight_scale=scale, offsets=offsets, bias=bias)
    _check_stacked(x, weight, scale, offsets, bias)
    expert_bias = None if bias is None else bias[0]
    linear.check_fp8_linear_args(x, weight[0], scale[0], expert_bias, block, act_quant, act_peak, out_dtype)


def check_fp4_grouped_args(x, weight, scale, offsets, bias, act_quant, act_peak, out_dtype) -> None:
    """Raise on dtype/shape/device errors in ``fp4_grouped_linear``'s arguments (values are not read)."""
    linear.check_devices(x=x, weight=weight, weight_scale=scale, offsets=offsets, bias=bias)
    _check_stacked(x, weight, scale, offsets, bias)
    expert_bias = None if bias is None else bias[0]
    linear.check_fp4_linear_args(x, weight[0], scale[0], expert_bias, act_quant, act_peak, out_dtype)


def check_offsets_values(offsets: torch.Tensor, num_rows: int) -> list:
    """Raise unless ``offsets`` is non-decreasing, starts at ``>= 0`` and ends at ``num_rows``.

    Returns the offsets as a Python list of ints.
    """
    ends = [int(v) for v in offsets.tolist()]
    previous = 0
    for e, end in enumerate(ends):
        if end < previous:
            raise ValueError(
                f"offsets: expected non-decreasing cumulative end offsets starting at >= 0, "
                f"got offsets[{e}] = {end} after {previous}"
            )
        previous = end
    if ends[-1] != num_rows:
        raise ValueError(
            f"offsets: expected the last offset to equal the number of rows T = {num_rows}, got {ends[-1]}"
        )
    return ends


# --------------------------------------------------------------------------- #
# the math
# --------------------------------------------------------------------------- #


def by_expert(
    x: torch.Tensor,
    offsets: torch.Tensor,
    n: int,
    out_dtype: torch.dtype,
    expert_linear: Callable[[int, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``[T, n]`` whose rows ``offsets[e-1]:offsets[e]`` are ``expert_linear(e, x[those rows])``.

    Checks the offsets' values first; experts without rows are never called.
    """
    out = torch.empty(x.shape[0], n, dtype=out_dtype, device=x.device)
    start = 0
    for e, end in enumerate(check_offsets_values(offsets, x.shape[0])):
        if end > start:  # an expert without rows is never decoded
            out[start:end] = expert_linear(e, x[start:end])
        start = end
    return out


def fp8_grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    offsets: torch.Tensor,
    bias: Optional[torch.Tensor],
    block: Sequence[int],
    act_quant: bool,
    act_peak: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``[T, K]`` sorted by expert x fp8 ``[E, N, K]`` -> ``[T, N]``; see :func:`torch_bq.ops.fp8_grouped_linear`."""
    check_fp8_grouped_args(x, weight, scale, offsets, bias, block, act_quant, act_peak, out_dtype)

    def expert_linear(e: int, rows: torch.Tensor) -> torch.Tensor:
        b = None if bias is None else bias[e]
        return linear.fp8_linear(rows, weight[e], scale[e], b, block, act_quant, act_peak, out_dtype)

    return by_expert(x, offsets, weight.shape[1], out_dtype, expert_linear)


def fp4_grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    offsets: torch.Tensor,
    bias: Optional[torch.Tensor],
    act_quant: bool,
    act_peak: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``[T, K]`` sorted by expert x fp4 ``[E, N, ceil(K/2)]`` -> ``[T, N]``.

    See :func:`torch_bq.ops.fp4_grouped_linear`.
    """
    check_fp4_grouped_args(x, weight, scale, offsets, bias, act_quant, act_peak, out_dtype)

    def expert_linear(e: int, rows: torch.Tensor) -> torch.Tensor:
        b = None if bias is None else bias[e]
        return linear.fp4_linear(rows, weight[e], scale[e], b, act_quant, act_peak, out_dtype)

    return by_expert(x, offsets, weight.shape[1], out_dtype, expert_linear)
