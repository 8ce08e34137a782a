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

__all__ = ["prepare_fp8_grouped", "prepare_fp4_grouped", "plan_launches", "estimated_instructions", "run_grouped"]

_MAX_ROWS = 2**24  # row indices pass through the engines' fp32 math: exact below 2**24
_N_TILE, _K_CHUNK = 512, 512


def estimated_instructions(experts: int, n: int, k: int) -> int:
    """An upper estimate of one launch's instruction count (per core) for ``experts`` experts, ``N = n``.

    The kernel emits its row-tile body once per expert: staging and qdq per 512-column chunk of
    K, a decode and transposes per (512-column N tile, K chunk). Fitted above the stand-in's
    counts (957 for 8 experts, N = K = 512; 6,557 for 8 experts, N = 1024, K = 2048).
    """
    chunks, tiles = -(-k // _K_CHUNK), -(-n // _N_TILE)
    return 16 + experts * (20 + 30 * chunks + 90 * tiles * chunks)


def plan_launches(experts: int, n: int, k: int, budget: int) -> list:
    """``[(e0, e1, n0, n1), ...]``: launches covering every (expert, column) once, each within ``budget``.

    Experts are grouped as many per launch as fit; an expert whose full N does not fit gets its
    N split into ranges of whole 512-column tiles, one launch each.
    """
    per_expert = estimated_instructions(1, n, k)
    if per_expert <= budget:
        group = max(1, (budget - 16) // (per_expert - 16))
        return [(e0, min(experts, e0 + group), 0, n) for e0 in range(0, experts, group)]
    chunks = -(-k // _K_CHUNK)
    tiles = max(1, (budget - 36 - 30 * chunks) // (90 * chunks))
    width = tiles * _N_TILE
    return [(e, e + 1, n0, min(n, n0 + width)) for e in range(experts) for n0 in range(0, n, width)]


def run_grouped(call, launch: KernelLaunch, budget: int) -> torch.Tensor:
    """Run a prepared grouped launch as the chain of kernel calls :func:`plan_launches` gives.

    ``call(x, weight, scale, bounds, y, bias, *options, n_begin, n_end)`` runs one kernel (the
    private op on neuron, ``nki.simulate`` in the tests) and returns ``y`` with its experts' rows
    written in columns ``n_begin:n_end``; the first call gets an uninitialised ``y``, and the plan
    covers every row and column, so the last returns the whole product.
    """
    x, weight, scale, bounds, bias = launch.tensors
    n = weight.shape[1]
    y = x.new_empty((x.shape[0], n), dtype=launch.out_dtype)
    for e0, e1, n0, n1 in plan_launches(weight.shape[0], n, x.shape[1], budget):
        y = call(x, weight[e0:e1], scale[e0:e1], bounds[:, e0:e1].contiguous(), y,
                 None if bias is None else bias[e0:e1], *launch.options.values(), n0, n1)
    return y.reshape(launch.out_shape)


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
    del launch.options["out_dtype"]  # the kernel writes into y, allocated with launch.out_dtype
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
    del launch.options["out_dtype"]  # the kernel writes into y, allocated with launch.out_dtype
    launch.guards = guards
    return launch
