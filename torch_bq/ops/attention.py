"""The ``torch_bq::`` paged KV cache ops of docs/contract.md §5: schema, fake implementation, reference body.

* ``torch_bq::paged_kv_write`` writes this step's keys and values into the paged
  caches in place (declared in ``mutates_args``, so functionalization under
  ``torch.compile`` sees the mutation).
* ``torch_bq::paged_window_attention`` is sliding-window GQA attention read
  through a block table, softmax in float32.

The cache layout and the visibility rule are documented in
:mod:`torch_bq.reference.attention`. The public wrappers add keyword defaults and
an eager-only check of the metadata values (``validate=True``), which is skipped
under ``torch.compile``.
"""

from typing import Optional

import torch

from ..reference import attention as ref

__all__ = ["paged_kv_write", "paged_window_attention"]


# The reference functions carry the schemas' annotations, so they are the op bodies as they are.
_paged_kv_write = torch.library.custom_op(
    "torch_bq::paged_kv_write", ref.paged_kv_write, mutates_args=("k_cache", "v_cache")
)
_paged_window_attention = torch.library.custom_op(
    "torch_bq::paged_window_attention", ref.paged_window_attention, mutates_args=()
)


@_paged_kv_write.register_fake
def _(k, v, k_cache, v_cache, slots):
    ref.check_kv_write_args(k, v, k_cache, v_cache, slots)


@_paged_window_attention.register_fake
def _(q, k_cache, v_cache, block_table, positions, seq_lens, *, rows_per_request, window, causal, scale):
    ref.check_attention_args(
        q, k_cache, v_cache, block_table, positions, seq_lens, rows_per_request, window, causal, scale
    )
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _eager() -> bool:
    return not torch.compiler.is_compiling()


def paged_kv_write(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    *,
    validate: bool = True,
) -> None:
    """Write each row's key and value into the paged caches, in place (docs/contract.md §5 step 4).

    ``k_cache[slot // block_size, slot % block_size] = k[row]`` (and likewise ``v``)
    for every row with ``slot >= 0``; rows with a negative slot (padding) are skipped.

    Args:
        k, v: ``[R, num_kv_heads, head_dim]``, the caches' dtype.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``; mutated.
        slots: int64 ``[R]``, ``block_id * block_size + offset`` or negative to skip.
        validate: in eager mode, first check that every slot is inside the cache and
            no slot is written twice (reads ``slots``; skipped under ``torch.compile``).
    """
    if validate and _eager():
        ref.check_kv_write_args(k, v, k_cache, v_cache, slots)
        ref.check_slots(slots, num_blocks=k_cache.shape[0], block_size=k_cache.shape[1])
    torch.ops.torch_bq.paged_kv_write(k, v, k_cache, v_cache, slots)


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
    causal: bool = False,
    scale: Optional[float] = None,
    validate: bool = True,
) -> torch.Tensor:
    """Sliding-window GQA attention over a paged KV cache (docs/contract.md §5 step 5).

    Row ``i`` of request ``r = i // rows_per_request`` at position ``p_i`` attends to
    cache positions ``j`` with ``max(0, p_i - window + 1) <= j < seq_lens[r]`` (the
    request's rows see each other both ways), and also ``j <= p_i`` when ``causal``.
    Key ``j`` is read from physical block ``block_table[r, j // block_size]``.
    Query head ``h`` uses KV head ``h // (num_heads // num_kv_heads)``.
    ``softmax(scale * q.k)`` in float32, output rounded once to ``q``'s dtype.

    Args:
        q: ``[R, num_heads, head_dim]`` float, ``R = num_requests * rows_per_request``,
            request-major.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, same dtype.
        block_table: int32 ``[num_requests, max_blocks]``; only the blocks holding visible
            positions are read.
        positions: int64 ``[R]``, each row's position in its request.
        seq_lens: int32 ``[num_requests]``, cache length of each request including this
            step's rows.
        rows_per_request: query rows per request (7 for the DSpark drafter).
        window: sliding window ``W`` in positions.
        causal: also hide keys after the row's own position.
        scale: score multiplier; ``head_dim ** -0.5`` when ``None``.
        validate: in eager mode, first check the metadata values (positions inside
            ``seq_lens``, block table long enough and inside the cache); skipped under
            ``torch.compile``. See :func:`torch_bq.reference.attention.check_paged_metadata`.

    Returns:
        ``[R, num_heads, head_dim]`` of ``q.dtype``.
    """
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if validate and _eager():
        ref.check_attention_args(
            q, k_cache, v_cache, block_table, positions, seq_lens, rows_per_request, window, causal, scale
        )
        ref.check_paged_metadata(
            positions,
            seq_lens,
            block_table,
            rows_per_request=rows_per_request,
            window=window,
            num_blocks=k_cache.shape[0],
            block_size=k_cache.shape[1],
        )
    return torch.ops.torch_bq.paged_window_attention(
        q,
        k_cache,
        v_cache,
        block_table,
        positions,
        seq_lens,
        rows_per_request=int(rows_per_request),
        window=int(window),
        causal=bool(causal),
        scale=float(scale),
    )
