"""Which part of a linear layer a rank holds, and building that part exactly (no communication).

A *column* shard holds output rows ``[n0, n1)`` of ``W [N, K]`` (one or several
row ranges, concatenated); a *row* shard holds input columns ``[k0, k1)``.
Shards are cut at any element, not only at scale-block boundaries, and the
shard's weight decodes to exactly the same values as that part of the full
weight:

* **fp8, block (bn, bk).** A shard whose first row ``n0`` is not a multiple of
  ``bn`` starts mid-block, and the block it starts in is shared with the rank
  before it (both keep a copy of that scale). The shard re-expresses its scales
  on a finer block ``(g, bk)`` with ``g = gcd(bn, n0, lengths of the ranges but
  the last)``: every ``g``-row group of the shard then lies inside one ``bn``-row
  block of the full weight, so each fine scale is just a copy of the coarse one
  it sits in, and the existing ``fp8_linear`` op runs the shard unchanged. For
  ``N = 96`` over 4 ranks with 32-row blocks the shards start at rows 0, 24, 48,
  72 and use blocks of 32, 8, 16 and 8 rows. Columns work the same way with
  ``g = gcd(bk, k0)``. ``g = 1`` (one scale per row) is the worst case: the scale
  grid grows by ``bn`` but stays ``1/bk`` of the weight.
* **fp4 (1x32 e8m0, packed pairs).** Row ranges are trivially exact (scales are per
  row). A column shard that starts mid-group cannot move its 1x32 scale grid, so it
  keeps the whole first group and zeroes the weight of the columns before ``k0``
  (``lead = k0 % 32`` zero columns; its input is zero-padded by ``lead`` columns).
  Nibbles of a neighbour's columns inside a shared byte are zeroed as well.
* **nvfp4 (1x16 e4m3, packed pairs, one per-tensor scale).** As fp4 with 16-column
  groups; every shard keeps the layer's ``weight_scale_2``.
* **bf16 / fp32w**: plain slices.

Row ranges are joined by :func:`torch_bq.formats.join_rows`, the one place that knows
how to re-block scale grids exactly.

The same plans serve a full module in memory and a checkpoint, where only each
tensor's covering slice is read (:func:`torch_bq.nn.checkpoint.read_linear`'s
``region``).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import nn

from .. import formats
from ..formats import cdiv
from ..nn.checkpoint import LinearLayout, read_linear
from ..nn.linear import BF16Linear, FP4Linear, FP8Linear, NVFP4Linear

__all__ = [
    "LinearSpec",
    "split_range",
    "spec_of",
    "column_regions",
    "row_region",
    "column_shard_from_tensors",
    "row_shard_from_tensors",
    "RowShard",
    "column_shard",
    "row_shard",
    "read_column_shard",
    "read_row_shard",
]

Range = tuple[int, int]


@dataclass(frozen=True)
class LinearSpec:
    """What a full linear layer is, as far as sharding needs to know.

    Attributes:
        format: a format name (:func:`torch_bq.formats.get_format`): ``"fp8"``, ``"fp4"``,
            ``"nvfp4"``, ``"bf16"`` or ``"fp32w"``.
        out_features, in_features: ``N`` and ``K``.
        block: the scale block ``(bn, bk)`` (the format's fixed one for fp4/nvfp4, ``None`` dense).
        packed_groups: fp4 data stored as ``[N, K/32, 16]`` (gpt-oss) rather than ``[N, K/2]``.
        act_quant, act_peak: the layer's activation round trip.
    """

    format: str
    out_features: int
    in_features: int
    block: Optional[tuple[int, int]]
    packed_groups: bool = False
    act_quant: bool = False
    act_peak: float = formats.DEFAULT_ACT_PEAK


def split_range(size: int, rank: int, world_size: int) -> Range:
    """``[start, stop)`` of ``rank``'s balanced share of ``size`` items (sizes differ by at most one)."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: expected a positive int, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank: expected an int in [0, {world_size}), got {rank!r}")
    if size < world_size:
        raise ValueError(f"cannot split {size} features over {world_size} ranks: a rank would hold none")
    return rank * size // world_size, (rank + 1) * size // world_size


def spec_of(linear: nn.Module) -> LinearSpec:
    """The :class:`LinearSpec` of an :class:`FP8Linear`, :class:`FP4Linear`, :class:`NVFP4Linear` or
    :class:`BF16Linear`."""
    if isinstance(linear, FP8Linear):
        return LinearSpec(linear.format.name, linear.out_features, linear.in_features, linear.block,
                          act_quant=linear.act_quant, act_peak=linear.act_peak)
    if isinstance(linear, (FP4Linear, NVFP4Linear)):
        return LinearSpec(linear.format.name, linear.out_features, linear.in_features, linear.format.default_block,
                          act_quant=linear.act_quant, act_peak=linear.act_peak)
    if isinstance(linear, BF16Linear):
        return LinearSpec(linear.format.name, linear.out_features, linear.in_features, None)
    raise TypeError(
        f"linear: expected an FP8Linear, FP4Linear, NVFP4Linear or BF16Linear, got {type(linear).__name__}"
    )


#: the module of each quantized format family (their constructors' defaults apply to shards)
_QUANTIZED_MODULES = {"fp8": FP8Linear, "fp4": FP4Linear, "nvfp4": NVFP4Linear}


def _default_act_quant(family: str) -> bool:
    return inspect.signature(_QUANTIZED_MODULES[family]).parameters["act_quant"].default


def _spec_of_layout(layout: LinearLayout, act_quant: Optional[bool], act_peak: Optional[float]) -> LinearSpec:
    # Module defaults when the caller does not say (those of FP8Linear/FP4Linear/NVFP4Linear).
    fmt = formats.get_format(layout.format)
    if not fmt.quantized and (act_quant or act_peak is not None):
        raise TypeError(f"{layout.prefix}: act_quant/act_peak do not apply to a dense (BF16Linear) layer")
    if act_quant is None:
        act_quant = fmt.quantized and _default_act_quant(fmt.family)
    return LinearSpec(
        layout.format, layout.out_features, layout.in_features, layout.block,
        packed_groups=layout.layout == "gpt-oss",
        act_quant=bool(act_quant),
        act_peak=formats.DEFAULT_ACT_PEAK if act_peak is None else float(act_peak),
    )


def _check_ranges(ranges: Sequence[Range], size: int, what: str) -> list[Range]:
    out = []
    for a, b in ranges:
        if not 0 <= a < b <= size:
            raise ValueError(f"{what}: range [{a}, {b}) is empty or outside [0, {size})")
        out.append((int(a), int(b)))
    if not out:
        raise ValueError(f"{what}: expected at least one range")
    return out


# --------------------------------------------------------------------------- #
# regions: the covering slice of each stored tensor
# --------------------------------------------------------------------------- #
# A region maps "weight" / "scale" / "bias" to an index tuple into the stored
# tensor (after an expert is selected); a kind that is absent is read whole.


def column_regions(spec: LinearSpec, ranges: Sequence[Range]) -> list[dict[str, tuple]]:
    """One region per output-row range: the rows of weight/bias and the scale rows covering them."""
    regions = []
    for a, b in _check_ranges(ranges, spec.out_features, "rows"):
        rows = (slice(a, b),)
        region = {"weight": rows, "bias": rows}
        if spec.block is not None:  # the scale rows covering rows a .. b - 1
            bn = spec.block[0]
            region["scale"] = (slice(a // bn, cdiv(b, bn)),)
        regions.append(region)
    return regions


def row_region(spec: LinearSpec, k0: int, k1: int) -> dict[str, tuple]:
    """The region of input columns ``[k0, k1)``; the bias is read whole (it is added once, after the sum)."""
    _check_ranges([(k0, k1)], spec.in_features, "columns")
    every = slice(None)
    if spec.block is None:
        return {"weight": (every, slice(k0, k1))}
    bk = spec.block[1]
    g0, g1 = k0 // bk, cdiv(k1, bk)
    per = formats.get_format(spec.format).element.per_item  # elements per stored item
    if spec.packed_groups:  # gpt-oss [N, K/32, 16]: whole groups of bk / per bytes
        weight = (every, slice(g0, g1), every)
    else:  # only the items holding columns k0 .. k1 - 1
        weight = (every, slice(k0 // per, cdiv(k1, per)))
    return {"weight": weight, "scale": (every, slice(g0, g1))}


def _first_byte(spec: LinearSpec, k0: int) -> int:
    """Global byte offset (within a row of packed fp4) where :func:`row_region`'s weight read starts."""
    bk, per = spec.block[1], formats.get_format(spec.format).element.per_item
    return (k0 // bk) * (bk // per) if spec.packed_groups else k0 // per


# --------------------------------------------------------------------------- #
# building shards from the covering tensors
# --------------------------------------------------------------------------- #


def column_shard_from_tensors(spec: LinearSpec, ranges: Sequence[Range], pieces: Sequence[dict],
                              name: str = "weight") -> nn.Module:
    """The module holding output rows ``ranges`` of ``spec``'s layer, from each range's covering tensors.

    ``pieces[i]`` holds ``weight``/``scale``/``bias`` read with :func:`column_regions` ``[i]``,
    in storage dtypes (as :class:`~torch_bq.nn.LinearWeights` gives them).
    """
    ranges = _check_ranges(ranges, spec.out_features, "rows")
    biases = [p.get("bias") for p in pieces]
    bias = None if biases[0] is None else torch.cat(biases, dim=0)
    fmt = formats.get_format(spec.format)
    # Each range is a piece starting (a % bn) rows into the first scale block it read;
    # formats.join_rows re-blocks them exactly (module docstring).
    bn = spec.block[0] if spec.block is not None else 1
    joined = formats.join_rows(fmt, [
        formats.RowPiece(_flat_rows(p["weight"], spec), p.get("scale"), spec.block, a % bn, p.get("scale_2"))
        for (a, _), p in zip(ranges, pieces)
    ], name=name)
    if fmt.family == "fp8":
        return FP8Linear.from_quantized(joined.data, joined.scale, bias, block=joined.block,
                                        act_quant=spec.act_quant, act_peak=spec.act_peak, name=name)
    if fmt.packed:
        return _packed_module(fmt, joined.data, joined.scale, joined.tensor_scale, bias, spec.in_features, spec, name)
    return BF16Linear.from_quantized(joined.data, bias, name=name)


def _packed_module(fmt, data, scale, scale_2, bias, in_features: int, spec: LinearSpec, name: str) -> nn.Module:
    """The FP4Linear / NVFP4Linear holding packed e2m1 ``data`` with ``in_features`` columns."""
    options = dict(in_features=in_features, act_quant=spec.act_quant, act_peak=spec.act_peak, name=name)
    if fmt.tensor_scale is not None:
        return NVFP4Linear.from_quantized(data, scale, scale_2, bias, **options)
    return FP4Linear.from_quantized(data, scale, bias, **options)


def _flat_rows(weight: torch.Tensor, spec: LinearSpec) -> torch.Tensor:
    """gpt-oss's ``[N, K/32, 16]`` packed groups as the ``[N, K/2]`` bytes they are."""
    return weight.reshape(weight.shape[0], -1) if spec.packed_groups else weight


@dataclass
class RowShard:
    """A rank's part of a row-split (input-split) layer.

    Attributes:
        module: the local layer over shard columns (no bias; the bias is added once after the sum).
        k0, k1: the input columns ``[k0, k1)`` of the full layer it multiplies.
        lead: zero columns the module expects in front of its ``k1 - k0`` inputs (fp4
            shards starting mid-group; 0 otherwise).
        bias: the full layer's ``bias [N]`` or ``None``.
    """

    module: nn.Module
    k0: int
    k1: int
    lead: int
    bias: Optional[torch.Tensor]


def row_shard_from_tensors(spec: LinearSpec, k0: int, k1: int, piece: dict, name: str = "weight") -> RowShard:
    """The :class:`RowShard` of input columns ``[k0, k1)``, from the tensors :func:`row_region` covers."""
    _check_ranges([(k0, k1)], spec.in_features, "columns")
    weight, bias = piece["weight"], piece.get("bias")
    fmt = formats.get_format(spec.format)
    if fmt.family == "fp8":
        bn, bk = spec.block
        fine = math.gcd(bk, k0)
        scale = formats.fine_scale(piece["scale"], 1, bk, fine, k0 % bk, k1 - k0)
        module = FP8Linear.from_quantized(weight, scale, None, block=(bn, fine), act_quant=spec.act_quant,
                                          act_peak=spec.act_peak, name=name)
        return RowShard(module, k0, k1, 0, bias)
    if fmt.packed:  # e2m1 pairs with 1 x gk scale groups: fp4 (gk = 32), nvfp4 (gk = 16)
        gk = fmt.default_block[1]
        group0 = k0 // gk * gk
        lead, width = k0 - group0, k1 - group0
        data = formats.as_fp4_bytes(weight, name).reshape(weight.shape[0], -1)
        nbytes = fmt.element.items(width)
        local = torch.zeros(data.shape[0], nbytes, dtype=torch.uint8, device=data.device)
        at = _first_byte(spec, k0) - group0 // fmt.element.per_item  # where the read bytes sit in the shard
        take = min(data.shape[1], nbytes - at)
        local[:, at:at + take] = data[:, :take]
        # Columns of the rank before (< k0) and after (>= k1) that share a group or a byte get
        # zero weight. When k1 == K the high nibble past an odd K is the format's padding and is
        # left as read, so FP4Linear's check still catches a corrupt one.
        local[:, : lead // 2] = 0
        if lead % 2:
            local[:, lead // 2] &= 0xF0
        if width % 2 and k1 < spec.in_features:
            local[:, -1] &= 0x0F
        module = _packed_module(fmt, local, piece["scale"], piece.get("scale_2"), None, width, spec, name)
        return RowShard(module, k0, k1, lead, bias)
    return RowShard(BF16Linear.from_quantized(weight, None, name=name), k0, k1, 0, bias)


# --------------------------------------------------------------------------- #
# sources: a module in memory, or a checkpoint
# --------------------------------------------------------------------------- #


def _module_piece(linear: nn.Module, region: dict[str, tuple]) -> dict[str, torch.Tensor]:
    stored = {"weight": linear.weight, "scale": getattr(linear, "weight_scale", None),
              "scale_2": getattr(linear, "weight_scale_2", None), "bias": linear.bias}
    # Copies, not views: a view would keep the whole full-size weight alive in every shard.
    return {
        kind: (t if kind not in region else t[region[kind]]).clone(memory_format=torch.contiguous_format)
        for kind, t in stored.items()
        if t is not None
    }


def column_shard(linear: nn.Module, ranges: Sequence[Range]) -> nn.Module:
    """The module holding output rows ``ranges`` of ``linear`` (an FP8/FP4/BF16Linear, possibly on ``meta``).

    The returned module's output is the concatenation of ``linear``'s output columns over
    ``ranges``, computed with the same decoded weight values and activations.
    """
    spec = spec_of(linear)
    pieces = [_module_piece(linear, r) for r in column_regions(spec, ranges)]
    return column_shard_from_tensors(spec, ranges, pieces)


def row_shard(linear: nn.Module, k0: int, k1: int) -> RowShard:
    """The :class:`RowShard` of input columns ``[k0, k1)`` of ``linear`` (possibly on ``meta``)."""
    spec = spec_of(linear)
    return row_shard_from_tensors(spec, k0, k1, _module_piece(linear, row_region(spec, k0, k1)))


def _checkpoint_piece(reader, layout: LinearLayout, region: dict[str, tuple]) -> dict[str, torch.Tensor]:
    names = {"weight": layout.weight_name, "scale": layout.scale_name, "bias": layout.bias_name}
    weights = read_linear(reader, layout, region={names[k]: idx for k, idx in region.items() if names[k]})
    stored = {"weight": weights.weight, "scale": weights.scale, "bias": weights.bias}
    return {k: v for k, v in stored.items() if v is not None}


def read_column_shard(reader, layout: LinearLayout, ranges: Sequence[Range], *,
                      act_quant: Optional[bool] = None, act_peak: Optional[float] = None) -> nn.Module:
    """:func:`column_shard` of the layer ``layout`` describes, reading only each range's covering slices."""
    spec = _spec_of_layout(layout, act_quant, act_peak)
    pieces = [_checkpoint_piece(reader, layout, r) for r in column_regions(spec, ranges)]
    return column_shard_from_tensors(spec, ranges, pieces, name=layout.weight_name)


def read_row_shard(reader, layout: LinearLayout, k0: int, k1: int, *,
                   act_quant: Optional[bool] = None, act_peak: Optional[float] = None) -> RowShard:
    """:func:`row_shard` of the layer ``layout`` describes, reading only the covering column slices."""
    spec = _spec_of_layout(layout, act_quant, act_peak)
    piece = _checkpoint_piece(reader, layout, row_region(spec, k0, k1))
    return row_shard_from_tensors(spec, k0, k1, piece, name=layout.weight_name)
