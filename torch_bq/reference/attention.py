"""Reference paged KV cache write and sliding-window attention of docs/contract.md §5 steps 4-5.

Cache layout (both caches alike)::

    k_cache, v_cache   [num_blocks, block_size, num_kv_heads, head_dim]
    slot               block_id * block_size + offset   (int64; < 0 means "do not write")
    block_table        int32 [num_requests, max_blocks]: logical block b of request r
                       lives in physical block block_table[r, b]
    positions          int64 [R], R = num_requests * rows_per_request, request-major
    seq_lens           int32 [num_requests], including this step's rows

Row ``i`` of request ``r`` at position ``p_i`` attends to the cache positions
``j`` with ``max(0, p_i - window + 1) <= j < seq_lens[r]`` (and ``j <= p_i`` when
``causal``), reading key ``j`` from ``block_table[r, j // block_size]`` at offset
``j % block_size``. Query head ``h`` uses KV head ``h // (Hq / Hkv)`` (GQA).
Scores are ``scale * q.k`` in float32, softmax in float32, output rounded once
to ``q``'s dtype.

Blocks that hold no visible position are never read, so a cache manager may
free blocks that slid out of every row's window (their table entries may hold
anything, e.g. -1).

Argument checks come in two kinds:

* :func:`check_kv_write_args` / :func:`check_attention_args` look at dtypes and
  shapes only; the ops' fake implementations run them too.
* :func:`check_paged_metadata` reads the metadata *values* (positions against
  ``seq_lens``, block-table coverage, slots inside the cache). It is data
  dependent, so it runs eagerly only; the modules call it once per step.
"""

import math
from typing import Optional

import torch

from .linear import check_devices

__all__ = [
    "paged_kv_write",
    "paged_window_attention",
    "visible_range",
    "check_kv_write_args",
    "check_attention_args",
    "check_paged_metadata",
    "check_slots",
]


# --------------------------------------------------------------------------- #
# argument checks: dtypes and shapes (shared with the fake implementations)
# --------------------------------------------------------------------------- #


def _check_dtype(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    if t.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {t.dtype}")


def _check_shape(name: str, t: torch.Tensor, shape, meaning: str) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {list(shape)} ({meaning}), got {list(t.shape)}")


def _check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if not k_cache.dtype.is_floating_point or k_cache.dtype.itemsize == 1:
        raise TypeError(f"k_cache: expected a float16/bfloat16/float32/float64 tensor, got {k_cache.dtype}")
    if k_cache.dim() != 4:
        raise ValueError(
            "k_cache: expected a 4-D [num_blocks, block_size, num_kv_heads, head_dim] tensor, "
            f"got shape {list(k_cache.shape)}"
        )
    _check_dtype("v_cache", v_cache, k_cache.dtype)
    _check_shape("v_cache", v_cache, k_cache.shape, "the shape of k_cache")


def check_kv_write_args(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """Raise on dtype/shape/device errors in ``paged_kv_write``'s arguments."""
    check_devices(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slots=slots)
    _check_caches(k_cache, v_cache)
    _, _, hkv, d = k_cache.shape
    if k.dim() != 3:
        raise ValueError(f"k: expected a 3-D [R, num_kv_heads, head_dim] tensor, got shape {list(k.shape)}")
    rows = k.shape[0]
    _check_shape("k", k, (rows, hkv, d), "[R, num_kv_heads, head_dim] of the cache")
    _check_dtype("k", k, k_cache.dtype)
    _check_shape("v", v, k.shape, "the shape of k")
    _check_dtype("v", v, k_cache.dtype)
    _check_dtype("slots", slots, torch.int64)
    _check_shape("slots", slots, (rows,), "one slot per row of k")


def check_attention_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    positions: torch.Tensor,
    seq_lens: torch.Tensor,
    rows_per_request: int,
    window: int,
    causal: bool,
    scale: float,
) -> None:
    """Raise on dtype/shape/device errors in ``paged_window_attention``'s arguments."""
    check_devices(q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table, positions=positions,
                  seq_lens=seq_lens)
    _check_caches(k_cache, v_cache)
    _, _, hkv, d = k_cache.shape
    if not q.dtype.is_floating_point or q.dtype.itemsize == 1:
        raise TypeError(f"q: expected a float16/bfloat16/float32/float64 tensor, got {q.dtype}")
    if q.dim() != 3 or q.shape[2] != d:
        raise ValueError(f"q: expected a 3-D [R, num_heads, {d}] tensor (head_dim of the cache), got {list(q.shape)}")
    if q.shape[1] % hkv:
        raise ValueError(
            f"q: num_heads ({q.shape[1]}) must be a multiple of the cache's num_kv_heads ({hkv}) for GQA"
        )
    if rows_per_request < 1:
        raise ValueError(f"rows_per_request: expected >= 1, got {rows_per_request}")
    if window < 1:
        raise ValueError(f"window: expected >= 1, got {window}")
    if not (scale > 0.0 and math.isfinite(scale)):  # inf gives inf * 0 = NaN scores
        raise ValueError(f"scale: expected a finite float > 0, got {scale}")
    rows = q.shape[0]
    if rows % rows_per_request:
        raise ValueError(f"q: R = {rows} rows is not a multiple of rows_per_request = {rows_per_request}")
    num_requests = rows // rows_per_request
    _check_dtype("block_table", block_table, torch.int32)
    if block_table.dim() != 2 or block_table.shape[0] != num_requests:
        raise ValueError(
            f"block_table: expected a 2-D [{num_requests}, max_blocks] tensor (one row per request), "
            f"got {list(block_table.shape)}"
        )
    _check_dtype("positions", positions, torch.int64)
    _check_shape("positions", positions, (rows,), "one position per row of q")
    _check_dtype("seq_lens", seq_lens, torch.int32)
    _check_shape("seq_lens", seq_lens, (num_requests,), "one length per request")


# --------------------------------------------------------------------------- #
# metadata values (eager only)
# --------------------------------------------------------------------------- #


def visible_range(positions: torch.Tensor, seq_lens: torch.Tensor, rows_per_request: int, window: int):
    """Per-request span of cache positions any of its rows may read.

    Returns ``(lo, hi)``, int64 ``[num_requests]`` each: ``lo = max(0, min_i p_i - window + 1)``,
    ``hi = seq_lens``. Only the blocks ``lo // block_size .. (hi - 1) // block_size`` are read.
    """
    lowest = positions.view(-1, rows_per_request).amin(dim=1)
    lo = (lowest - window + 1).clamp_min(0)
    return lo, seq_lens.to(torch.int64)


def _first(bad: torch.Tensor) -> Optional[int]:
    return int(bad.nonzero()[0, 0]) if bool(bad.any()) else None


def check_paged_metadata(
    positions: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    rows_per_request: int,
    window: int,
    num_blocks: int,
    block_size: int,
    slots: Optional[torch.Tensor] = None,
) -> None:
    """Raise ``ValueError`` if the step's metadata would make the ops read or write garbage.

    Checks (dtypes and shapes first, then values):

    * ``R`` (rows of ``positions``) is a multiple of ``rows_per_request``;
    * every ``seq_len >= 1`` and every position lies in ``[0, seq_len)`` of its request;
    * each request's ``block_table`` row covers its visible range and the entries it
      will read are physical blocks in ``[0, num_blocks)``;
    * with ``slots``: each slot is ``< 0`` (skip) or below ``num_blocks * block_size``,
      and is where the row's position lives (``block_table[r, p // block_size] * block_size
      + p % block_size``), so the attention reads back what this step wrote; no two rows
      write one slot.

    Reads tensor values (one host sync per check), so call it eagerly, not under compile.
    """
    rows = positions.shape[0]
    if rows % rows_per_request:
        raise ValueError(f"positions: R = {rows} rows is not a multiple of rows_per_request = {rows_per_request}")
    num_requests = rows // rows_per_request
    _check_dtype("positions", positions, torch.int64)
    _check_dtype("seq_lens", seq_lens, torch.int32)
    _check_shape("seq_lens", seq_lens, (num_requests,), "one length per request")
    _check_dtype("block_table", block_table, torch.int32)
    if block_table.dim() != 2 or block_table.shape[0] != num_requests:
        raise ValueError(
            f"block_table: expected a 2-D [{num_requests}, max_blocks] tensor, got {list(block_table.shape)}"
        )
    if num_requests == 0:
        return

    r = _first(seq_lens < 1)
    if r is not None:
        raise ValueError(f"seq_lens: request {r} has seq_len {int(seq_lens[r])}; expected >= 1")
    request_of_row = torch.arange(rows, device=positions.device) // rows_per_request
    row_len = seq_lens.to(torch.int64)[request_of_row]
    i = _first((positions < 0) | (positions >= row_len))
    if i is not None:
        raise ValueError(
            f"positions: row {i} (request {i // rows_per_request}) has position {int(positions[i])}, "
            f"outside [0, seq_len = {int(row_len[i])})"
        )

    lo, hi = visible_range(positions, seq_lens, rows_per_request, window)
    check_table_reads(block_table, lo, hi, num_blocks=num_blocks, block_size=block_size)

    if slots is None:
        return
    check_slots(slots, num_blocks=num_blocks, block_size=block_size)
    _check_shape("slots", slots, (rows,), "one slot per row")
    # Every position lies in its request's visible range, so its table entry was checked above.
    home = block_table[request_of_row, positions // block_size].to(torch.int64) * block_size + positions % block_size
    i = _first((slots >= 0) & (slots != home))
    if i is not None:
        raise ValueError(
            f"slots: row {i} (request {i // rows_per_request}, position {int(positions[i])}) writes slot "
            f"{int(slots[i])}, but the block table places that position at slot {int(home[i])}"
        )


def check_table_reads(block_table: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, *,
                       num_blocks: int, block_size: int) -> None:
    """Raise unless each request's table row covers ``[lo, hi)`` with physical blocks inside the cache.

    Cheap (one pass over the table), so the attention op runs it on every call,
    ``validate=False`` included: an entry of -1 must not read the last block.
    """
    if hi.numel() == 0:
        return
    nonempty = hi > lo
    first_block, last_block = lo // block_size, (hi - 1).clamp_min(0) // block_size
    max_blocks = block_table.shape[1]
    r = _first(nonempty & (last_block >= max_blocks))
    if r is not None:
        raise ValueError(
            f"block_table: request {r} has seq_len {int(hi[r])}, which needs {int(last_block[r]) + 1} blocks "
            f"of {block_size}, but the table has only {max_blocks} columns"
        )
    col = torch.arange(max_blocks, device=block_table.device)
    read = nonempty[:, None] & (col >= first_block[:, None]) & (col <= last_block[:, None])
    bad = read & ((block_table < 0) | (block_table >= num_blocks))
    if bool(bad.any()):
        r, b = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"block_table: request {r}, logical block {b} maps to physical block {int(block_table[r, b])}, "
            f"outside the cache's [0, {num_blocks})"
        )


def check_slot_bounds(slots: torch.Tensor, *, num_blocks: int, block_size: int) -> None:
    """Raise unless every slot is ``< 0`` (skip) or inside the cache (one pass; always run by the write op)."""
    capacity = num_blocks * block_size
    i = _first(slots >= capacity)
    if i is not None:
        raise ValueError(
            f"slots: row {i} writes slot {int(slots[i])}, outside the cache's "
            f"{num_blocks} blocks x {block_size} = {capacity} slots"
        )


def check_slots(slots: torch.Tensor, *, num_blocks: int, block_size: int) -> None:
    """Raise ``ValueError`` unless every slot is ``< 0`` (skip) or inside the cache, and no
    two rows write one slot (which one would win is unspecified). Eager only."""
    _check_dtype("slots", slots, torch.int64)
    check_slot_bounds(slots, num_blocks=num_blocks, block_size=block_size)
    kept = slots[slots >= 0]
    values, counts = kept.unique(return_counts=True)
    if bool((counts > 1).any()):
        raise ValueError(f"slots: slot {int(values[counts > 1][0])} is written by more than one row")


# --------------------------------------------------------------------------- #
# the math
# --------------------------------------------------------------------------- #


def paged_kv_write(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """Write rows of ``k``/``v`` into the caches in place; see :func:`torch_bq.ops.paged_kv_write`."""
    check_kv_write_args(k, v, k_cache, v_cache, slots)
    block_size = k_cache.shape[1]
    # Checked before either cache is touched, whatever ``validate`` says: an
    # out-of-range slot would otherwise fail half-way, after part of k_cache was written.
    check_slot_bounds(slots, num_blocks=k_cache.shape[0], block_size=block_size)
    keep = slots >= 0
    kept = slots[keep]
    # Index by (block, offset) rather than through a flattened view so that caches
    # with any strides are written in place.
    k_cache[kept // block_size, kept % block_size] = k[keep]
    v_cache[kept // block_size, kept % block_size] = v[keep]


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
    """``[R, Hq, d]`` attention over the paged cache; see :func:`torch_bq.ops.paged_window_attention`.

    One request at a time: gather its visible keys into a dense ``[L, Hkv, d]``
    array, mask per row, plain float32 softmax. Query heads are viewed as
    ``[Hkv, group]`` so each KV head is read once, not once per query head.
    """
    check_attention_args(q, k_cache, v_cache, block_table, positions, seq_lens, rows_per_request, window, causal, scale)
    rows, hq, d = q.shape
    _, block_size, hkv, _ = k_cache.shape
    group = hq // hkv
    out = torch.empty(rows, hkv, group, d, dtype=torch.float32, device=q.device)
    lo, hi = visible_range(positions, seq_lens, rows_per_request, window)
    # Always checked (cheap): a table entry of -1 would otherwise read the cache's last block.
    check_table_reads(block_table, lo, hi, num_blocks=k_cache.shape[0], block_size=block_size)
    for r in range(rows // rows_per_request):
        mine = slice(r * rows_per_request, (r + 1) * rows_per_request)
        j = torch.arange(int(lo[r]), int(hi[r]), device=q.device)  # cache positions read
        block = block_table[r, j // block_size].to(torch.int64)
        k = k_cache[block, j % block_size].to(torch.float32)  # [L, Hkv, d]
        v = v_cache[block, j % block_size].to(torch.float32)
        p = positions[mine, None]
        visible = j[None, :] >= p - window + 1  # [rows, L]; j < seq_len holds by construction
        if causal:
            visible = visible & (j[None, :] <= p)
        qr = q[mine].to(torch.float32).view(rows_per_request, hkv, group, d)
        scores = torch.einsum("rkgd,lkd->kgrl", qr, k) * scale
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        out[mine] = torch.einsum("kgrl,lkd->rkgd", probs, v)
    return out.view(rows, hq, d).to(q.dtype)
