"""Split-K ("flash-decoding") paged sliding-window attention: the shape of the NKI kernel.

Same contract and signature as :func:`torch_bq.reference.attention.paged_window_attention`
(plus ``chunk_size``); the result differs only by float32 summation order.

Each request's visible range ``[lo, seq_len)`` is cut into chunks of ``chunk_size``
cache positions aligned to multiples of ``chunk_size`` (with ``chunk_size`` a
multiple of ``block_size``, a chunk is a run of whole block-table entries). The
query rows that share a KV head form one tile, and each chunk yields a partial
``(m, l, o)`` per query row::

    for request r:
        Q[g] = q[rows of r, heads of KV head g]        # [rows*group, d]; 7*16 = 112 at full size
        for chunk c:                                    # independent: split across cores
            K, V = cache rows of the chunk's blocks      # [C, Hkv, d]
            S = scale * Q[g] @ K[:, g].T, masked         # [rows*group, C] float32
            m_c = rowmax(S)       (-inf if nothing in the chunk is visible to the row)
            P = exp(S - m_c)      (exp(-inf) = 0; m_c = -inf is replaced by 0 here)
            l_c = rowsum(P);  o_c = P @ V[:, g]         # unnormalised
        out = merge_partials(m, l, o)

The merge is docs/contract.md §5's: ``M = max m_c``, ``L = sum l_c e^(m_c - M)``,
``out = sum o_c e^(m_c - M) / L``. A chunk a row cannot see (outside its window,
past ``seq_len``, or after it under ``causal``) has ``m = -inf, l = 0, o = 0`` and
contributes exactly nothing, never NaN.
"""

import torch

from .attention import check_table_reads, check_attention_args, visible_range

__all__ = ["DEFAULT_CHUNK_SIZE", "attention_partials", "merge_partials", "paged_window_attention_split"]

DEFAULT_CHUNK_SIZE = 512

_NEG_INF = float("-inf")


def _finite_or_zero(m: torch.Tensor) -> torch.Tensor:
    # A max over nothing visible is -inf; subtracting it would give -inf - -inf = NaN.
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def attention_partials(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk's partial softmax statistics, per KV head.

    Args:
        q: ``[Hkv, T, d]`` float32 query tile (``T`` = rows x heads per KV head).
        k, v: ``[Hkv, C, d]`` float32 keys and values of the chunk.
        visible: ``[T, C]`` bool, which keys each query row may see.
        scale: score multiplier, ``head_dim ** -0.5``.

    Returns:
        ``(m, l, o)``: row max ``[Hkv, T]`` (``-inf`` where nothing is visible),
        ``l = sum exp(s - m)`` ``[Hkv, T]`` and unnormalised ``o = exp(s - m) @ v``
        ``[Hkv, T, d]``, all float32.
    """
    s = torch.matmul(q, k.transpose(1, 2)) * scale
    s = s.masked_fill(~visible, _NEG_INF)
    m = s.amax(dim=-1)
    p = torch.exp(s - _finite_or_zero(m)[..., None])
    return m, p.sum(dim=-1), torch.matmul(p, v)


def merge_partials(m: torch.Tensor, l: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """Combine split partials (docs/contract.md §5): ``sum_s o_s e^(m_s - M) / sum_s l_s e^(m_s - M)``.

    Args:
        m, l: ``[S, ...]`` float32 per-split row max and exp-sum.
        o: ``[S, ..., d]`` float32 per-split unnormalised outputs.

    Returns:
        ``[..., d]`` float32. Splits with ``m = -inf`` weigh zero; a row with no
        visible key in any split gives 0, not NaN.
    """
    big_m = _finite_or_zero(m.amax(dim=0))
    weight = torch.exp(m - big_m)  # exactly 0 for the empty splits
    big_l = (l * weight).sum(dim=0)
    acc = (o * weight[..., None]).sum(dim=0)
    safe_l = torch.where(big_l > 0, big_l, torch.ones_like(big_l))
    return torch.where(big_l[..., None] > 0, acc / safe_l[..., None], torch.zeros_like(acc))


def paged_window_attention_split(
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
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> torch.Tensor:
    """``paged_window_attention`` computed chunk by chunk and merged; ``[R, Hq, d]`` of ``q.dtype``.

    Args are those of :func:`torch_bq.ops.paged_window_attention`, plus ``chunk_size``:
    cache positions per split (best a multiple of the cache's ``block_size``).
    """
    check_attention_args(q, k_cache, v_cache, block_table, positions, seq_lens, rows_per_request, window, causal, scale)
    if chunk_size < 1:
        raise ValueError(f"chunk_size: expected >= 1, got {chunk_size}")
    rows, hq, d = q.shape
    _, block_size, hkv, _ = k_cache.shape
    group = hq // hkv
    out = torch.empty(rows, hq, d, dtype=torch.float32, device=q.device)
    lo, hi = visible_range(positions, seq_lens, rows_per_request, window)
    check_table_reads(block_table, lo, hi, num_blocks=k_cache.shape[0], block_size=block_size)
    for r in range(rows // rows_per_request):
        mine = slice(r * rows_per_request, (r + 1) * rows_per_request)
        # Query tile per KV head: row t = (request row i, head-in-group g) -> [Hkv, rows*group, d].
        tile = q[mine].to(torch.float32).view(rows_per_request, hkv, group, d)
        tile = tile.permute(1, 0, 2, 3).reshape(hkv, rows_per_request * group, d)
        p = positions[mine].repeat_interleave(group)[:, None]  # position of each tile row
        partials = []
        first, last = int(lo[r]) // chunk_size, (int(hi[r]) - 1) // chunk_size
        for c in range(first, last + 1):
            j = torch.arange(c * chunk_size, (c + 1) * chunk_size, device=q.device)
            in_range = (j >= lo[r]) & (j < hi[r])
            # Positions outside the request's range are never looked up: read them
            # from a valid table entry of this chunk and mask them out.
            j_read = torch.where(in_range, j, j[in_range][0])
            block = block_table[r, j_read // block_size].to(torch.int64)
            k = k_cache[block, j_read % block_size].to(torch.float32).permute(1, 0, 2)  # [Hkv, C, d]
            v = v_cache[block, j_read % block_size].to(torch.float32).permute(1, 0, 2)
            visible = in_range[None, :] & (j[None, :] >= p - window + 1)
            if causal:
                visible = visible & (j[None, :] <= p)
            partials.append(attention_partials(tile, k, v, visible, scale))
        m, l, o = (torch.stack(parts) for parts in zip(*partials))
        merged = merge_partials(m, l, o)  # [Hkv, rows*group, d]
        out[mine] = merged.view(hkv, rows_per_request, group, d).permute(1, 0, 2, 3).reshape(-1, hq, d)
    return out.to(q.dtype)
