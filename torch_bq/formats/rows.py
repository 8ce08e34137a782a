"""Exact row slicing and joining of block-scaled weights (the one place that knows how).

A scale block of ``bn`` rows cannot be cut or moved: rows ``[a, b)`` of a weight
whose blocks start at multiples of ``bn`` start mid-block when ``a % bn != 0``,
and two weights joined along N put the second one's blocks at row offsets that
need not be multiples of its ``bn``. Both are still *exact* on a finer row block
``g`` that divides ``bn``, every piece's offset into its first block, and every
piece's length but the last: each ``g``-row group of the result then lies inside
one ``bn``-row block of the piece it came from, so its scale is a copy of that
block's scale, and the result decodes to exactly the rows it was made of. The
scale grid grows by ``bn / g`` rows (at worst one scale per row, still ``1/bk``
of the weight). Columns re-block the same way (``gcd`` of the pieces' ``bk``).

Formats whose blocks are one row (MXFP4, MXFP8, NVFP4) slice and join by plain
concatenation; NVFP4 pieces must share their per-tensor scale, since two
different ``weight_scale_2`` cannot be merged exactly (a merged block scale
would have to be an e4m3 value that no longer exists in general).

Used by tensor-parallel sharding (:mod:`torch_bq.distributed.sharding`), the
experts' gate/up fusion (:mod:`torch_bq.nn.expert_checkpoint`) and the drafter's
q/k/v fusion (:mod:`torch_bq.nn.drafter`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from .codecs import decode_e8m0
from .descriptor import E8M0, WeightFormat, cdiv, check_block, get_format

__all__ = ["RowPiece", "slice_rows", "join_rows", "fine_scale"]


@dataclass(frozen=True)
class RowPiece:
    """Consecutive rows of a weight together with the scales covering them.

    Attributes:
        data: ``[n, C]`` stored data (``C`` = ``K`` or ``ceil(K/2)`` for packed formats).
        scale: the scale rows covering the piece: ``[ceil((offset + n) / bn), ceil(K/bk)]``
            (``None`` for dense formats).
        block: ``(bn, bk)`` of ``scale`` (``None`` for dense formats).
        offset: rows of the first scale block that precede ``data``'s first row
            (``0 <= offset < bn``; 0 for a whole weight).
        tensor_scale: NVFP4's per-tensor ``weight_scale_2``, else ``None``.
    """

    data: torch.Tensor
    scale: Optional[torch.Tensor]
    block: Optional[tuple[int, int]]
    offset: int = 0
    tensor_scale: Optional[torch.Tensor] = None

    @property
    def rows(self) -> int:
        return self.data.shape[0]


def fine_scale(scale: torch.Tensor, dim: int, coarse: int, fine: int, offset: int, length: int) -> torch.Tensor:
    """Scales on ``fine``-element blocks along ``dim`` for a run of ``length`` elements.

    ``scale`` covers the run on ``coarse``-element blocks, the run starting ``offset``
    elements into its first block; ``fine`` must divide ``coarse`` and ``offset``. Each
    fine scale is a copy of the coarse scale its block lies in (no arithmetic: exact).
    """
    if coarse % fine or offset % fine:
        raise ValueError(f"fine_scale: a {fine}-element block must divide the block {coarse} and the offset {offset}")
    index = [(offset + j) // coarse for j in range(0, length, fine)]
    if index == list(range(scale.shape[dim])):
        return scale
    return scale.index_select(dim, torch.tensor(index, dtype=torch.long, device=scale.device))


def slice_rows(
    fmt: Union[str, WeightFormat],
    data: torch.Tensor,
    scale: Optional[torch.Tensor],
    start: int,
    stop: int,
    *,
    block: Optional[Sequence[int]] = None,
    tensor_scale: Optional[torch.Tensor] = None,
) -> RowPiece:
    """Rows ``[start, stop)`` of a whole weight as a :class:`RowPiece` (views, no copy).

    Args:
        fmt: the format (name, alias or :class:`WeightFormat`).
        data, scale: the whole weight's stored tensors.
        block: ``(bn, bk)`` (default: the format's).
        tensor_scale: NVFP4's ``weight_scale_2``.
    """
    fmt = get_format(fmt)
    n = data.shape[0]
    if not 0 <= start < stop <= n:
        raise ValueError(f"rows: [{start}, {stop}) is empty or outside [0, {n})")
    block = fmt.resolve_block(block)
    if block is None:
        return RowPiece(data[start:stop], None, None)
    bn = block[0]
    return RowPiece(data[start:stop], scale[start // bn: cdiv(stop, bn)], block, start % bn, tensor_scale)


def join_rows(
    fmt: Union[str, WeightFormat],
    pieces: Sequence[RowPiece],
    *,
    row_block: Optional[int] = None,
    col_block: Optional[int] = None,
    name: str = "weight",
) -> RowPiece:
    """Concatenate ``pieces`` along N into one weight that decodes to exactly their rows.

    The result's block is ``(g, gk)``: ``g = gcd`` of every piece's ``bn``, its offset
    and every length but the last; ``gk = gcd`` of the pieces' ``bk``. ``row_block`` /
    ``col_block`` ask for a finer block (they must divide ``g`` / ``gk``), e.g. so that
    two projections of one module share a block. Mixed e8m0 and float32 scales give
    float32 scales (e8m0 decodes exactly). One piece re-blocks a weight.

    Returns:
        A :class:`RowPiece` with ``offset`` 0 (a whole weight).

    Raises:
        ValueError: pieces with different ``K`` (stored columns), a ``row_block`` or
            ``col_block`` that does not divide the exact block, NVFP4 pieces with
            different per-tensor scales, or a scale that does not cover its piece.
    """
    fmt = get_format(fmt)
    if not pieces:
        raise ValueError(f"{name}: expected at least one piece to join")
    cols = {p.data.shape[1:] for p in pieces}
    if len(cols) != 1:
        raise ValueError(f"{name}: the pieces have different column shapes {[list(p.data.shape[1:]) for p in pieces]}")
    for i, p in enumerate(pieces):
        fmt.check_data_dtype(p.data, f"{name} (piece {i})")
    # byte-equivalent storage dtypes (uint8 next to float8_e4m3fn) concatenate as the stored one
    datas = [p.data.view(fmt.element.dtype) for p in pieces]
    data = datas[0] if len(datas) == 1 else torch.cat(datas, dim=0)
    if not fmt.quantized:
        return RowPiece(data, None, None)
    blocks = [check_block(p.block if p.block is not None else fmt.default_block, f"{name}: block") for p in pieces]
    k = data.shape[1] * fmt.element.per_item  # a bound for K; scale columns are checked below
    g = math.gcd(*(b[0] for b in blocks), *(p.offset for p in pieces), *(p.rows for p in pieces[:-1]))
    gk = math.gcd(*(b[1] for b in blocks))
    for want, have, what in ((row_block, g, "row_block"), (col_block, gk, "col_block")):
        if want is not None and (not isinstance(want, int) or want < 1 or have % want):
            raise ValueError(
                f"{name}: {what}={want!r} must be a positive divisor of {have}, the finest block that joins "
                f"these pieces exactly"
            )
    g = row_block or g
    gk = col_block or gk
    fmt.resolve_block((g, gk), f"{name}: joined block")  # a fixed-block format must keep its block
    tensor_scale = _common_tensor_scale(fmt, pieces, name)
    encodings = {fmt.scale_encoding(p.scale, f"{name}_scale") for p in pieces}
    mixed = len(encodings) > 1
    scales = []
    for i, (p, (bn, bk)) in enumerate(zip(pieces, blocks)):
        if not 0 <= p.offset < bn:
            raise ValueError(f"{name}: piece {i} has offset {p.offset}, expected 0 <= offset < bn = {bn}")
        want_rows = cdiv(p.offset + p.rows, bn)
        if p.scale.dim() != 2 or p.scale.shape[0] != want_rows:
            raise ValueError(
                f"{name}_scale: piece {i} ({p.rows} rows from offset {p.offset}, block {bn}) needs {want_rows} "
                f"scale rows, got shape {list(p.scale.shape)}"
            )
        s = p.scale
        if mixed and fmt.scale_encoding(s) is E8M0:
            s = decode_e8m0(s)  # exact: every e8m0 code is a float32 power of two (or NaN)
        s = fine_scale(s, 0, bn, g, p.offset, p.rows)
        s = fine_scale(s, 1, bk, gk, 0, min(k, s.shape[1] * bk))
        scales.append(s)
    dtypes = {s.dtype for s in scales}
    if len(dtypes) > 1:  # e8m0 as uint8 next to float8_e8m0fnu: the same codes
        scales = [s.view(torch.uint8) if s.dtype != torch.float32 else s for s in scales]
    scale = scales[0] if len(scales) == 1 else torch.cat(scales, dim=0)
    return RowPiece(data, scale, (g, gk), 0, tensor_scale)


def _common_tensor_scale(fmt: WeightFormat, pieces: Sequence[RowPiece], name: str) -> Optional[torch.Tensor]:
    if fmt.tensor_scale is None:
        for p in pieces:
            if p.tensor_scale is not None:
                raise TypeError(f"{name}_scale_2: the {fmt.name} format has no per-tensor scale")
        return None
    if any(p.tensor_scale is None for p in pieces):
        raise TypeError(f"{name}_scale_2: every {fmt.name} piece needs its per-tensor scale")
    first = pieces[0].tensor_scale.reshape(())
    for i, p in enumerate(pieces[1:], 1):
        if not torch.equal(p.tensor_scale.reshape(()).view(torch.int32), first.view(torch.int32)):
            raise ValueError(
                f"{name}_scale_2: piece {i} has per-tensor scale {p.tensor_scale.item()!r} but piece 0 has "
                f"{first.item()!r}; {fmt.name} weights with different per-tensor scales cannot be joined exactly "
                f"(requantize them with one shared weight_scale_2, or keep them as separate layers)"
            )
    return pieces[0].tensor_scale
