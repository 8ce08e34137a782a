"""Argument preparation for the paged KV-cache NKI kernels (:mod:`.kv_cache`, :mod:`.attention`), plain torch.

Shared by the ``neuron`` registration and the tests, like :mod:`.launch` for the linears.
Nothing here imports ``nki``. The preparation is metadata work in ATen ops (no host sync
when ``tracing``): the caches are viewed as ``[S, Hkv * d]`` rows (``S = num_blocks *
block_size`` slots), negative slots become the out-of-bounds row ``S``, and for the
attention each request's span of cache positions is looked up in the block table once,
so the kernel gathers rows by index.

Where the kernels cannot serve (a float64 tensor, a non-contiguous cache, ``head_dim >
128`` or a query tile of more than 128 rows, positions beyond fp32's exact integers), the
launch names a ``fallback`` and the reference runs. Metadata the reference would refuse
(a slot outside the cache, a block-table entry outside the cache for a visible position)
raises here eagerly; when ``tracing`` it becomes a device-side assert in ``guards``.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...reference import attention as ref
from .launch import INSTRUCTION_BUDGET, KernelLaunch

__all__ = ["SPLIT", "prepare_kv_write", "prepare_attention", "attention_span", "attention_instructions",
           "run_attention"]

SPLIT = 512  # cache positions per split of the attention kernel (attention.CHUNK)
_PT = 128
_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_EXACT_INT_FP32 = 2**24
_ROW_BYTES = 64 * 1024  # one [128, Hkv * d] row tile per partition, at most


def _not_served(tensors: dict) -> Optional[str]:
    for name, t in tensors.items():
        if t.dtype not in _KERNEL_DTYPES:
            return f"{name} is {t.dtype} (the NKI kernels take bfloat16, float16 or float32)"
    return None


def _check(bad: torch.Tensor, message: str, tracing: bool, guards: list) -> None:
    """Raise ``ValueError(message)`` if ``bad.any()`` (one host sync); when tracing, a device assert."""
    if tracing:
        guards.append((torch.logical_not(bad.any()), message))
    elif bool(bad.any()):
        raise ValueError(message)


def prepare_kv_write(k, v, k_cache, v_cache, slots, tracing: bool = False) -> KernelLaunch:
    """Check and lay out ``paged_kv_write``'s arguments for ``paged_kv_write_kernel``.

    Tensors: ``k``, ``v`` as ``[R, Hkv * d]``, the caches as ``[S, Hkv * d]`` views (they must
    be contiguous: the kernel's result is copied back into them), slots as int32 ``[R, 1]``
    with negative slots mapped to ``S``. A slot ``>= S`` raises (eagerly) like the reference's
    indexing would, instead of being skipped silently.
    """
    ref.check_kv_write_args(k, v, k_cache, v_cache, slots)
    num_blocks, block_size, hkv, d = k_cache.shape
    s, f, rows = num_blocks * block_size, hkv * d, k.shape[0]
    launch = KernelLaunch("paged_kv_write_kernel", (), out_shape=tuple(k_cache.shape), out_dtype=k_cache.dtype)
    reason = _not_served({"k_cache": k_cache})
    if reason is None and not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        reason = "a non-contiguous cache (the kernel writes [slots, Hkv * d] rows)"
    if reason is None and (s >= 2**31 or f * k_cache.dtype.itemsize > _ROW_BYTES):
        reason = f"{s} slots of {f} elements (the kernel needs < 2**31 slots and rows <= 64 KiB)"
    if reason is not None:
        launch.kernel, launch.fallback = None, reason
        return launch
    if rows == 0 or s == 0:
        launch.kernel = None
        return launch
    _check(slots >= s, f"paged_kv_write: a slot is >= the cache's {num_blocks} blocks x {block_size} = {s} slots",
           tracing, launch.guards)
    slots32 = torch.where(slots < 0, torch.full_like(slots, s), slots).to(torch.int32).reshape(rows, 1)
    launch.tensors = (k.reshape(rows, f).contiguous(), v.reshape(rows, f).contiguous(),
                      k_cache.view(s, f), v_cache.view(s, f), slots32)
    return launch


def attention_span(need: int, window: int, rows_per_request: int, capacity: int, tracing: bool) -> int:
    """Cache positions per request the attention kernel walks (a multiple of :data:`SPLIT`).

    Eagerly: the longest visible range ``need``, rounded up to a multiple of ``SPLIT`` (at
    most ``ceil((window + rows - 1) / 512)`` distinct compiled kernels per shape when the
    rows are their requests' last positions; 9 for the full-size drafter). Traced, the data
    cannot be read: the range a request's rows can see when they are its last positions,
    ``window + rows - 1``, capped by the block table's capacity; a request that needs more
    trips a device assert.
    """
    if tracing:
        need = min(window + rows_per_request - 1, capacity)
    return max(SPLIT, -(-need // SPLIT) * SPLIT)


def attention_instructions(kv_heads: int, span: int) -> int:
    """An upper estimate of the attention kernel's instructions per request (per core).

    Per KV head ~14 for the query tile and the merge plus ~66 per 512-position split; fitted
    above the stand-in's counts (313 for 4 KV heads and 1 split, 2,393 for 4 and 9).
    """
    return 2 + kv_heads * (14 + 66 * (span // SPLIT))


def run_attention(call, launch: KernelLaunch, lnc: int, budget: int = INSTRUCTION_BUDGET) -> torch.Tensor:
    """Run a prepared attention launch as kernel calls over groups of requests, each within ``budget``.

    ``call(*tensors, *options)`` runs one kernel; under LNC ``lnc`` the cores take alternate
    requests, so a launch holds ``lnc`` times the requests one core's budget allows.
    """
    q, k_cache, v_cache, key_rows, key_pos, row_bounds = launch.tensors
    rpr = launch.options["rows_per_request"]
    n_requests, span = key_rows.shape
    per_core = max(1, (budget - 8) // attention_instructions(k_cache.shape[1] // q.shape[2], span))
    group = per_core * lnc
    if group >= n_requests:
        return call(*launch.tensors, *launch.options.values())
    outs = []
    for r0 in range(0, n_requests, group):
        r1 = min(n_requests, r0 + group)
        outs.append(call(q[r0 * rpr:r1 * rpr], k_cache, v_cache, key_rows[r0:r1], key_pos[r0:r1],
                         row_bounds[r0 * rpr:r1 * rpr], *launch.options.values()))
    return torch.cat(outs)


def prepare_attention(q, k_cache, v_cache, block_table, positions, seq_lens, rows_per_request, window, causal,
                      scale, tracing: bool = False) -> KernelLaunch:
    """Check and lay out ``paged_window_attention``'s arguments for ``paged_window_attention_kernel``.

    Tensors: ``q`` ``[R, Hq, d]``; the caches as ``[S, Hkv * d]``; ``key_rows`` int32 and
    ``key_pos`` fp32 ``[num_requests, span]`` (cache row and position of each span position,
    row ``S`` past the request's end); ``row_bounds`` fp32 ``[R, 2]``, each row's visible
    ``[lo, hi)``. Options: ``scale``, ``rows_per_request``.
    """
    ref.check_attention_args(q, k_cache, v_cache, block_table, positions, seq_lens, rows_per_request, window,
                             causal, scale)
    rows, hq, d = q.shape
    num_blocks, block_size, hkv, _ = k_cache.shape
    s, f = num_blocks * block_size, hkv * d
    n_requests, max_blocks = block_table.shape
    capacity = max_blocks * block_size
    launch = KernelLaunch("paged_window_attention_kernel", (), out_shape=tuple(q.shape), out_dtype=q.dtype)
    reason = _not_served({"q": q, "k_cache": k_cache})
    if reason is None and not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        reason = "a non-contiguous cache"
    if reason is None and (d > _PT or rows_per_request * (hq // hkv) > _PT):
        reason = f"head_dim {d} or rows_per_request x heads per KV head {rows_per_request * (hq // hkv)} > 128"
    if reason is None and (capacity >= _EXACT_INT_FP32 or s >= 2**31):
        reason = f"a block table of {capacity} positions (the kernel's fp32 positions are exact below 2**24)"
    if reason is not None:
        launch.kernel, launch.fallback = None, reason
        return launch
    if rows == 0 or hq == 0 or d == 0:
        launch.kernel = None
        return launch

    lo, hi = ref.visible_range(positions, seq_lens, rows_per_request, window)
    need = 0 if tracing else int((hi - lo).max())
    span = attention_span(need, window, rows_per_request, capacity, tracing)
    if attention_instructions(hkv, span) + 8 > INSTRUCTION_BUDGET:
        launch.kernel, launch.fallback = None, (
            f"a span of {span} cache positions: one request alone would exceed the kernel's instruction budget")
        return launch
    if tracing:
        _check(hi - lo > span, f"paged_window_attention on neuron under torch.compile: a request sees more than "
               f"{span} cache positions (window + rows_per_request - 1, rounded up to {SPLIT}); run it eagerly",
               tracing, launch.guards)
    j = lo[:, None] + torch.arange(span, device=lo.device)[None, :]  # [n_requests, span]
    inside = j < hi[:, None]
    column = torch.clamp(torch.div(j, block_size, rounding_mode="floor"), max=max_blocks - 1)
    block = block_table.gather(1, column).to(torch.int64)
    _check(inside & ((block < 0) | (block >= num_blocks)),
           f"paged_window_attention: a visible position maps to a block outside the cache's [0, {num_blocks})",
           tracing, launch.guards)
    key_rows = torch.where(inside, block * block_size + j % block_size, torch.full_like(j, s)).to(torch.int32)
    row_lo = torch.clamp(positions - window + 1, min=0)
    row_hi = seq_lens.to(torch.int64).repeat_interleave(rows_per_request)
    if causal:
        row_hi = torch.minimum(row_hi, positions + 1)
    row_bounds = torch.stack([row_lo, row_hi], dim=1).to(torch.float32)
    launch.tensors = (q.contiguous(), k_cache.view(s, f), v_cache.view(s, f), key_rows.contiguous(),
                      j.to(torch.float32).contiguous(), row_bounds)
    launch.options = {"scale": float(scale), "rows_per_request": int(rows_per_request)}
    return launch
