"""Tensor-parallel linears over ``torch.distributed``: column- and row-parallel FP8/FP4/BF16 layers.

With ``P`` ranks in ``group`` and rank ``r``:

* :func:`column_parallel` keeps output rows ``split_range(N, r, P)``; each rank computes
  its output columns from the full input, and with ``gather_output`` an all-gather
  hands every rank the full ``[..., N]``. Every output element is computed by one rank
  exactly as the full layer computes it.
* :func:`row_parallel` keeps input columns ``split_range(K, r, P)``; each rank computes a
  float32 partial sum over its columns, the partials are summed across ranks
  (all-reduce, or the seed's reduce-scatter to the row's owner ``row % P`` then
  all-gather), the bias is added in float32 and the result rounded once — the
  docs/contract.md §4 linear with its K sum taken in another order.

Activation quantization with a K split (docs/contract.md §3): a 1x32 qdq block cut by a
rank boundary must use the amax of the *whole* block. When any boundary falls
inside a block, every rank computes its part of each block's amax and the
maxima are exchanged with one all-reduce(MAX) of ``[M, ceil(K/32)]`` floats;
each rank then quantizes its columns with the block's true amax, so the
quantized activations are bit-identical to the single-rank ones.

The same layers load straight from a checkpoint, each rank reading only its
slices: :func:`column_parallel_from_checkpoint`, :func:`row_parallel_from_checkpoint`.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .. import formats, ops
from ..nn.checkpoint import CheckpointError, detect_linear, module_class_for, open_checkpoint
from ..nn.linear import BF16Linear, FP4Linear, FP8Linear, NVFP4Linear, finish_output, op_out_dtype
from .sharding import (
    RowShard,
    column_shard,
    read_column_shard,
    read_row_shard,
    row_shard,
    spec_of,
    split_range,
)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "column_parallel",
    "row_parallel",
    "column_parallel_from_checkpoint",
    "row_parallel_from_checkpoint",
    "row_parallel_over",
    "block_amax",
    "qdq_with_block_amax",
    "group_rank_and_size",
    "REDUCTIONS",
]

#: how a row-parallel layer sums its partials: ``"all_reduce"``, or ``"scatter_gather"``
#: (reduce-scatter each output row to its owner rank ``row % P``, which adds the bias and
#: rounds, then all-gather the rounded rows: the seed's pattern, half the bytes gathered).
REDUCTIONS = ("all_reduce", "scatter_gather")

# torch 2.13 renamed the flat-tensor collectives (the old names warn); older releases only
# have the old ones. Both take (output, input, ...) with outputs concatenated along dim 0.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_rank_and_size(group: Optional[dist.ProcessGroup] = None) -> tuple[int, int]:
    """This process's rank in ``group`` (default: the world) and the group's size.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialized.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized: call torch.distributed.init_process_group first "
            "(torchrun sets up the environment it needs)"
        )
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("group: this process is not a member of the given process group")
    return rank, dist.get_world_size(group)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


class ColumnParallelLinear(nn.Module):
    """A rank's output rows of a linear layer (see :func:`column_parallel`).

    ``forward(x)``: ``x`` ``[..., K]`` (the full input, the same on every rank) ->
    ``[..., N]`` with ``gather_output`` or ``[..., n1 - n0]`` (this rank's columns)
    without; dtype as the wrapped module's.

    Attributes:
        local: the FP8/FP4/BF16Linear holding rows ``[n0, n1)``.
        out_features, in_features: of the full layer.
        ranges: every rank's ``(n0, n1)``, by rank.
    """

    def __init__(self, local: nn.Module, ranges: Sequence[tuple[int, int]], *, gather_output: bool,
                 group: Optional[dist.ProcessGroup], rank: int) -> None:
        super().__init__()
        self.local = local
        self.ranges = [tuple(r) for r in ranges]
        self.rank, self.world_size = rank, len(self.ranges)
        self.in_features = local.in_features
        self.out_features = self.ranges[-1][1]
        self.gather_output = bool(gather_output)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.local(x)
        if not self.gather_output or self.world_size == 1:
            return y
        if y.numel() == 0 and y.shape[-1] > 0:  # no rows: same on every rank, nothing to exchange
            return y.new_empty(*y.shape[:-1], self.out_features)
        widths = [b - a for a, b in self.ranges]
        mine = _rows(y)
        wide = max(widths)
        # gloo's all-gather wants equal sizes; shards differ by at most one row.
        padded = F.pad(mine, (0, wide - mine.shape[1])).contiguous()
        gathered = torch.empty(self.world_size * padded.shape[0], wide, dtype=padded.dtype, device=padded.device)
        _all_gather_flat(gathered, padded, group=self.group)
        gathered = gathered.reshape(self.world_size, -1, wide)
        out = torch.cat([gathered[r, :, :w] for r, w in enumerate(widths)], dim=-1)
        return out.reshape(*y.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        n0, n1 = self.ranges[self.rank]
        return (
            f"rank={self.rank}/{self.world_size}, rows=[{n0}, {n1}) of {self.out_features}, "
            f"gather_output={self.gather_output}"
        )


def _partial_linear(module: nn.Module, a: torch.Tensor) -> torch.Tensor:
    """``module``'s product without bias, act quant or output rounding: float32 ``[M, N]``."""
    if isinstance(module, FP8Linear):
        return ops.fp8_linear(a, module.weight, module.weight_scale, None, block=module.block,
                              act_quant=False, act_peak=module.act_peak, out_dtype=torch.float32)
    if isinstance(module, FP4Linear):
        return ops.fp4_linear(a, module.weight, module.weight_scale, None, act_quant=False,
                              act_peak=module.act_peak, out_dtype=torch.float32)
    if isinstance(module, NVFP4Linear):
        return ops.nvfp4_linear(a, module.weight, module.weight_scale, module.weight_scale_2, None, act_quant=False,
                                act_peak=module.act_peak, out_dtype=torch.float32)
    op = ops.fp32w_linear if module.weight.dtype == torch.float32 else ops.bf16_linear
    return op(a, module.weight, None, out_dtype=torch.float32)


class RowParallelLinear(nn.Module):
    """A rank's input columns of a linear layer, partial sums reduced across ranks (see :func:`row_parallel`).

    ``forward(x)``: ``x`` ``[..., K]`` (full input) or, with ``input_is_parallel``,
    ``[..., k1 - k0]`` (this rank's columns, e.g. the output of a column-parallel layer
    without gather) -> ``[..., N]`` on every rank, bitwise the same on all of them.

    Attributes:
        local: the FP8/FP4/BF16Linear over this rank's columns (bias-free).
        bias: the full layer's bias (added once, after the reduction), or ``None``.
        ranges: every rank's ``(k0, k1)``, by rank.
        act_quant, act_peak: the activation round trip, done here over the whole K.
        exchange_amax: whether some rank boundary cuts a 32-wide qdq block, so block
            maxima are all-reduced before quantizing.
    """

    def __init__(self, shard: RowShard, ranges: Sequence[tuple[int, int]], *, out_features: int,
                 act_quant: bool, act_peak: float, input_is_parallel: bool, reduce: str,
                 group: Optional[dist.ProcessGroup], rank: int) -> None:
        super().__init__()
        if reduce not in REDUCTIONS:
            raise ValueError(f"reduce: expected one of {REDUCTIONS}, got {reduce!r}")
        self.local = shard.module
        self.register_buffer("bias", shard.bias)
        self.ranges = [tuple(r) for r in ranges]
        self.rank, self.world_size = rank, len(self.ranges)
        self.k0, self.k1 = self.ranges[rank]
        self.lead = shard.lead
        self.in_features = self.ranges[-1][1]
        self.out_features = out_features
        self.act_quant, self.act_peak = bool(act_quant), float(act_peak)
        self.input_is_parallel = bool(input_is_parallel)
        self.reduce = reduce
        self.group = group
        # The same decision on every rank, or the collectives would not match up.
        self.exchange_amax = self.act_quant and any(k0 % formats.QDQ_BLOCK for k0, _ in self.ranges[1:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width = self.k1 - self.k0
        if self.input_is_parallel:
            if x.shape[-1] != width:
                raise ValueError(
                    f"x: expected shape [..., {width}] (rank {self.rank}'s columns [{self.k0}, {self.k1}) "
                    f"of K = {self.in_features}; input_is_parallel=True), got {list(x.shape)}"
                )
        else:
            if x.shape[-1] != self.in_features:
                raise ValueError(f"x: expected shape [..., {self.in_features}] (K), got {list(x.shape)}")
            x = x[..., self.k0:self.k1]
        lead_shape = x.shape[:-1]
        a = _rows(x)
        if self.act_quant:
            a = self._quantize(a)
        if self.lead:
            a = F.pad(a, (self.lead, 0))
        partial = _partial_linear(self.local, a)
        out_dtype = op_out_dtype(x)
        if self.world_size == 1:
            y = self._finish_rows(partial, out_dtype)
        elif self.reduce == "all_reduce":
            dist.all_reduce(partial, group=self.group)
            y = self._finish_rows(partial, out_dtype)
        else:
            y = self._scatter_gather(partial, out_dtype)
        return finish_output(y.reshape(*lead_shape, self.out_features), x)

    def _finish_rows(self, acc: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        if self.bias is not None:
            acc = acc + self.bias.to(torch.float32)
        return acc.to(out_dtype)

    def _scatter_gather(self, partial: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        p, (m, n) = self.world_size, partial.shape
        if m == 0:  # the same on every rank: nothing to exchange
            return self._finish_rows(partial, out_dtype)
        per = formats.cdiv(m, p)
        # Row i goes to rank i % P: reorder [per * P, N] so rank r's rows are the r-th block.
        padded = F.pad(partial, (0, 0, 0, per * p - m))
        by_owner = padded.reshape(per, p, n).transpose(0, 1).reshape(p * per, n).contiguous()
        owned = torch.empty(per, n, dtype=torch.float32, device=partial.device)
        _reduce_scatter_flat(owned, by_owner, group=self.group)
        done = self._finish_rows(owned, out_dtype).contiguous()
        gathered = torch.empty(p * per, n, dtype=out_dtype, device=partial.device)
        _all_gather_flat(gathered, done, group=self.group)
        return gathered.reshape(p, per, n).transpose(0, 1).reshape(per * p, n)[:m]

    def _quantize(self, a: torch.Tensor) -> torch.Tensor:
        """qdq of this rank's columns ``a`` ``[M, k1 - k0]`` with the full blocks' scales (bf16)."""
        if not self.exchange_amax:
            return ops.qdq_fp8(a, self.act_peak)
        blk = formats.QDQ_BLOCK
        b0 = self.k0 // blk
        mine = block_amax(a, self.k0)
        amax = torch.zeros(a.shape[0], formats.cdiv(self.in_features, blk), dtype=torch.float32, device=a.device)
        amax[:, b0:b0 + mine.shape[1]] = mine
        if a.shape[0]:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.group)
        return qdq_with_block_amax(a, self.k0, amax[:, b0:b0 + mine.shape[1]], self.act_peak)

    def extra_repr(self) -> str:
        return (
            f"rank={self.rank}/{self.world_size}, columns=[{self.k0}, {self.k1}) of {self.in_features}, "
            f"out_features={self.out_features}, reduce={self.reduce}, input_is_parallel={self.input_is_parallel}, "
            f"exchange_amax={self.exchange_amax}"
        )


def block_amax(a: torch.Tensor, k0: int) -> torch.Tensor:
    """Per-row maxima of ``|bf16(a)|`` over each 32-wide qdq block of the full row that ``a`` overlaps.

    Args:
        a: ``[M, w]`` columns ``[k0, k0 + w)`` of the full activation.
        k0: where ``a`` starts in the full row.

    Returns:
        float32 ``[M, ceil((k0 + w) / 32) - k0 // 32]``: column ``j`` is full block ``k0 // 32 + j``,
        over ``a``'s part of it only (the max over all ranks' parts is the block's amax).
    """
    blk = formats.QDQ_BLOCK
    lead, trail = k0 % blk, -(k0 + a.shape[1]) % blk
    # Align to the full row's blocks; the padding holds zeros, which never raise an amax.
    padded = F.pad(a.to(torch.bfloat16).to(torch.float32), (lead, trail))
    return padded.reshape(a.shape[0], padded.shape[1] // blk, blk).abs().amax(dim=-1)


def qdq_with_block_amax(a: torch.Tensor, k0: int, amax: torch.Tensor, peak: float) -> torch.Tensor:
    """docs/contract.md §3 qdq of columns ``[k0, k0 + w)`` of a row whose blocks' amax is ``amax``.

    Args:
        a: ``[M, w]`` the columns.
        k0: where ``a`` starts in the full row.
        amax: ``[M, nb]`` the full blocks' ``max |bf16(x)|`` (as :func:`block_amax` lays them out,
            maximized over every part of each block).
        peak: the qdq peak.

    Returns:
        ``[M, w]`` bfloat16, bitwise ``qdq_fp8(x, peak)[:, k0:k0 + w]`` of the full row ``x``.
    """
    blk = formats.QDQ_BLOCK
    lead, trail = k0 % blk, -(k0 + a.shape[1]) % blk
    padded = F.pad(a.to(torch.bfloat16).to(torch.float32), (lead, trail))
    # qdq_fp8 takes each block's amax from its elements, so one padding slot of each block cut
    # at the edges gets the block's true amax (a bf16 value, unchanged by qdq's own bf16
    # rounding); the columns then quantize exactly as in the full row, with the same op.
    if lead:
        padded[:, 0] = amax[:, 0]
    if trail:
        padded[:, -1] = amax[:, -1]
    return ops.qdq_fp8(padded, peak)[:, lead:lead + a.shape[1]]


def _sizes_ranges(size: int, world_size: int) -> list[tuple[int, int]]:
    return [split_range(size, r, world_size) for r in range(world_size)]


def column_parallel(linear: nn.Module, group: Optional[dist.ProcessGroup] = None,
                    gather_output: bool = True) -> ColumnParallelLinear:
    """This rank's output-row shard of ``linear`` (FP8Linear, FP4Linear or BF16Linear, possibly on ``meta``).

    Rank ``r`` of ``P`` keeps rows ``[r N // P, (r + 1) N // P)`` (any ``N >= P``; shards
    need not fall on scale-block boundaries, see :mod:`torch_bq.distributed.sharding`).

    Args:
        linear: the full layer, the same on every rank.
        group: the process group to split over (default: the world).
        gather_output: all-gather so every rank returns the full ``[..., N]``; if false each
            rank returns its own ``[..., n1 - n0]`` columns.

    Returns:
        A :class:`ColumnParallelLinear`; its ``forward`` is collective (call it on every rank).
    """
    rank, size = group_rank_and_size(group)
    ranges = _sizes_ranges(spec_of(linear).out_features, size)
    return ColumnParallelLinear(column_shard(linear, [ranges[rank]]), ranges, gather_output=gather_output,
                                group=group, rank=rank)


def row_parallel(linear: nn.Module, group: Optional[dist.ProcessGroup] = None, *,
                 input_is_parallel: bool = False, reduce: str = "all_reduce") -> RowParallelLinear:
    """This rank's input-column shard of ``linear``; partial sums are reduced so every rank returns ``[..., N]``.

    Rank ``r`` of ``P`` keeps columns ``[r K // P, (r + 1) K // P)``. With activation
    quantization and a boundary inside a 32-wide block the block maxima are exchanged,
    so the result never depends on the split beyond float32 summation order.

    Args:
        linear: the full layer (FP8Linear, FP4Linear or BF16Linear, possibly on ``meta``).
        group: the process group to split over (default: the world).
        input_is_parallel: ``forward`` receives only this rank's columns (the output of a
            column-parallel layer without gather); otherwise the full input.
        reduce: ``"all_reduce"`` or ``"scatter_gather"`` (see :data:`REDUCTIONS`).

    Returns:
        A :class:`RowParallelLinear`; its ``forward`` is collective.
    """
    rank, size = group_rank_and_size(group)
    ranges = _sizes_ranges(spec_of(linear).in_features, size)
    return row_parallel_over(linear, ranges, rank, group, input_is_parallel=input_is_parallel, reduce=reduce)


def row_parallel_over(linear: nn.Module, ranges: Sequence[tuple[int, int]], rank: int,
                      group: Optional[dist.ProcessGroup], *, input_is_parallel: bool,
                      reduce: str = "all_reduce") -> RowParallelLinear:
    """:func:`row_parallel` with explicit column ranges (``ranges[r] = (k0, k1)`` of rank ``r``, covering K)."""
    spec = spec_of(linear)
    if ranges[0][0] != 0 or ranges[-1][1] != spec.in_features or any(
        a[1] != b[0] for a, b in zip(ranges, ranges[1:])
    ):
        raise ValueError(f"ranges: expected consecutive ranges covering [0, {spec.in_features}), got {list(ranges)}")
    shard = row_shard(linear, *ranges[rank])
    return RowParallelLinear(shard, ranges, out_features=spec.out_features, act_quant=spec.act_quant,
                             act_peak=spec.act_peak, input_is_parallel=input_is_parallel, reduce=reduce,
                             group=group, rank=rank)


def _detect(reader, prefix: str, cls, options: dict[str, Any]):
    hint = {FP8Linear: "fp8", FP4Linear: "fp4"}.get(cls)
    layout = detect_linear(reader, prefix, format=hint, **options)
    if cls is not None and module_class_for(layout.format) is not cls:
        raise CheckpointError(
            f"{prefix}: the checkpoint holds {layout.format} weights ({layout.layout} layout); "
            f"load them with {module_class_for(layout.format).__name__}, not {cls.__name__}"
        )
    return layout


def _split_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    allowed = {"expert", "block", "in_features", "act_quant", "act_peak"}
    unknown = set(options) - allowed
    if unknown:
        raise TypeError(f"unexpected options {sorted(unknown)}; expected some of {sorted(allowed)}")
    module = {k: options[k] for k in ("act_quant", "act_peak") if k in options}
    return {k: v for k, v in options.items() if k not in module}, module


def column_parallel_from_checkpoint(source, prefix: str, *, group: Optional[dist.ProcessGroup] = None,
                                    gather_output: bool = True, cls=None, device="cpu",
                                    **options: Any) -> ColumnParallelLinear:
    """:func:`column_parallel` of layer ``prefix`` of a checkpoint, reading only this rank's rows.

    Args:
        source: a ``.safetensors`` file, a directory, a mapping or a
            :class:`~torch_bq.nn.CheckpointReader` (any layout the loader knows).
        prefix: the layer's name, as for :meth:`FP8Linear.from_checkpoint`.
        group, gather_output: as for :func:`column_parallel`.
        cls: ``FP8Linear``/``FP4Linear``/``BF16Linear`` to insist on (default: what the checkpoint holds).
        device: where the shard ends up (read on CPU, then moved).
        options: ``expert``, ``block``, ``in_features`` (as for ``from_checkpoint``), ``act_quant``, ``act_peak``.

    Only the weight rows ``[n0, n1)``, the scale rows covering them and ``bias[n0:n1]`` are
    read (``safetensors`` slices). Packed ``F4``-typed tensors are the exception: safetensors
    cannot slice them, so they are read whole.
    """
    rank, size = group_rank_and_size(group)
    find, module_opts = _split_options(options)
    with open_checkpoint(source) as reader:
        layout = _detect(reader, prefix, cls, find)
        ranges = _sizes_ranges(layout.out_features, size)
        local = read_column_shard(reader, layout, [ranges[rank]], **module_opts)
    return ColumnParallelLinear(local.to(device), ranges, gather_output=gather_output, group=group, rank=rank)


def row_parallel_from_checkpoint(source, prefix: str, *, group: Optional[dist.ProcessGroup] = None,
                                 input_is_parallel: bool = False, reduce: str = "all_reduce", cls=None,
                                 device="cpu", **options: Any) -> RowParallelLinear:
    """:func:`row_parallel` of layer ``prefix`` of a checkpoint, reading only this rank's columns.

    Reads weight columns ``[k0, k1)`` (fp4: the bytes holding them; gpt-oss: the 16-byte
    groups holding them), the scale columns covering them and the whole (small) bias.
    Arguments as for :func:`column_parallel_from_checkpoint` and :func:`row_parallel`.
    """
    rank, size = group_rank_and_size(group)
    find, module_opts = _split_options(options)
    with open_checkpoint(source) as reader:
        layout = _detect(reader, prefix, cls, find)
        ranges = _sizes_ranges(layout.in_features, size)
        shard = read_row_shard(reader, layout, *ranges[rank], **module_opts)
    spec_module = shard.module
    act_quant = getattr(spec_module, "act_quant", False)
    act_peak = getattr(spec_module, "act_peak", formats.DEFAULT_ACT_PEAK)
    shard = RowShard(shard.module.to(device), shard.k0, shard.k1, shard.lead,
                     None if shard.bias is None else shard.bias.to(device))
    return RowParallelLinear(shard, ranges, out_features=layout.out_features, act_quant=act_quant,
                             act_peak=act_peak, input_is_parallel=input_is_parallel, reduce=reduce,
                             group=group, rank=rank)
