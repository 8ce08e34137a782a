"""CPU kernels of ``torch_bq::paged_window_attention`` and ``torch_bq::paged_kv_write``.

Twins of :mod:`torch_bq.reference.attention` (docs/contract.md §5 steps 4-5):
the KV write copies the same bytes; the attention is the split-K form of
:mod:`torch_bq.reference.flash_decoding` (float32 scores and softmax, the
contract's merge rule), so it differs from the reference only by float32
summation order. The math lives in ``attention.cpp``, compiled into the same
per-ISA libraries as ``kernels.cpp``; the level :mod:`torch_bq.ops._backend`
selected runs. Argument errors are the reference's own checks (including the
ones its bodies run even with ``validate=False``), raised before the kernel
runs; the C++ code checks table entries and slots once more (IndexError) so it
never reads or writes outside the caches. Without the compiled kernels the
reference runs.

Tuning: ``CHUNK_SIZE`` cache positions per split (one task of the thread pool
per request x KV head x split; its float32 K and V copies are ``2 * CHUNK_SIZE
* head_dim * 4`` bytes, 256 KiB at 256 x 128, so a task stays in L2).
"""

from __future__ import annotations

from collections import Counter

import torch

from ...reference import attention as ref
from .. import _backend
from .. import attention as op_defs

__all__ = ["CHUNK_SIZE", "paged_kv_write", "paged_window_attention", "kernel_calls"]

CHUNK_SIZE = 256

# ISA level -> how many calls went to the compiled kernels (counted before their
# argument checks; tests check that the level they asked for really ran, rather
# than the reference).
kernel_calls: Counter = Counter()


def paged_kv_write(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """In-place paged KV write; see :func:`torch_bq.ops.paged_kv_write`."""
    kernels = _backend.cpu_kernels()
    if kernels is None:
        return ref.paged_kv_write(k, v, k_cache, v_cache, slots)
    kernel_calls[_backend.cpu_isa()] += 1
    ref.check_kv_write_args(k, v, k_cache, v_cache, slots)
    # The reference body's always-on check (validate=False included), same errors.
    ref.check_slot_bounds(slots, num_blocks=k_cache.shape[0], block_size=k_cache.shape[1])
    kernels.paged_kv_write(k, v, k_cache, v_cache, slots)


def paged_window_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    positions: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    rows_per_request: int,
    window: int,
    causal: bool,
    scale: float,
) -> torch.Tensor:
    """``[R, Hq, d]`` paged sliding-window attention; see :func:`torch_bq.ops.paged_window_attention`."""
    kernels = _backend.cpu_kernels()
    kw = dict(rows_per_request=rows_per_request, window=window, causal=causal, scale=scale)
    if kernels is None:
        return ref.paged_window_attention(q, k_cache, v_cache, block_table, positions, seq_lens, **kw)
    kernel_calls[_backend.cpu_isa()] += 1
    ref.check_attention_args(q, k_cache, v_cache, block_table, positions, seq_lens, **kw)
    # The reference body's always-on check (validate=False included): the blocks read exist.
    lo, hi = ref.visible_range(positions, seq_lens, rows_per_request, window)
    ref.check_table_reads(block_table, lo, hi, num_blocks=k_cache.shape[0], block_size=k_cache.shape[1])
    # q in float32 (as the reference computes), the result rounded once to q's dtype.
    out = kernels.paged_window_attention(
        q.to(torch.float32),
        k_cache,
        v_cache,
        block_table,
        positions,
        seq_lens,
        int(rows_per_request),
        int(window),
        bool(causal),
        float(scale),
        CHUNK_SIZE,
    )
    return out.to(q.dtype)


_backend.register_fast_kernel(op_defs._paged_kv_write, "cpu", paged_kv_write)
_backend.register_fast_kernel(op_defs._paged_window_attention, "cpu", paged_window_attention)
