"""Tensor-parallel DSpark drafter (docs/contract.md §5, last paragraph).

Rank ``r`` of ``P`` holds:

* query heads ``[r Hq/P, (r+1) Hq/P)`` and KV heads ``[r Hkv/P, (r+1) Hkv/P)``: rows of the
  fused ``qkv_proj`` (three row ranges, q | k | v, one column shard);
* when ``Hkv < P`` (and ``P`` is a multiple of ``Hkv``) the one KV head its query heads
  read, ``r // (P / Hkv)``, replicated on ``P / Hkv`` ranks;
* ``gate_proj``/``up_proj`` rows ``split_range(I, r, P)`` and the matching columns of
  ``down_proj``; the columns of ``o_proj`` that multiply its query heads;
* every norm whole (they act on full rows or on one head).

``o_proj`` and ``down_proj`` are row-parallel: float32 partial sums over the rank's
heads / FFN columns are summed across ranks (all-reduce, or the seed's reduce-scatter to
the row's owner then all-gather), so every rank continues with the same residual stream. Attention, RoPE, the q/k norms and the SwiGLU are per head or per element and
run unchanged on the rank's part. The result equals the single-rank layer up to the
float32 order of those two sums (and of the gemms' own blocking).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from .. import formats
from ..nn.checkpoint import CheckpointError, Source, detect_linear, open_checkpoint
from ..nn.drafter import _NORMS, Drafter, DrafterLayer, _check_format, _load_norm
from ..nn.drafter_config import DrafterConfig
from ..nn.linear import BF16Linear, FP8Linear
from .linear import RowParallelLinear, group_rank_and_size, row_parallel_over
from .sharding import column_shard, read_column_shard, read_row_shard, split_range

__all__ = ["tensor_parallel", "tensor_parallel_from_checkpoint", "local_config", "kv_head_range"]


def kv_head_range(config: DrafterConfig, rank: int, world_size: int) -> tuple[int, int]:
    """The KV heads ``[h0, h1)`` rank ``rank`` holds (one replicated head when ``Hkv < P``).

    Raises:
        ValueError: the heads cannot be split evenly over ``world_size`` ranks.
    """
    hq, hkv, p = config.num_attention_heads, config.num_key_value_heads, world_size
    if hq % p:
        raise ValueError(
            f"tensor_parallel: num_attention_heads = {hq} is not a multiple of the world size {p}; "
            "every rank must hold the same number of query heads"
        )
    if hkv >= p:
        if hkv % p:
            raise ValueError(
                f"tensor_parallel: num_key_value_heads = {hkv} is not a multiple of the world size {p}"
            )
        return rank * hkv // p, (rank + 1) * hkv // p
    if p % hkv:
        raise ValueError(
            f"tensor_parallel: num_key_value_heads = {hkv} < world size {p}, and {p} is not a multiple of "
            f"{hkv}, so KV heads cannot be replicated evenly (a rank's query heads would need two KV heads)"
        )
    head = rank // (p // hkv)
    return head, head + 1


def local_config(config: DrafterConfig, rank: int, world_size: int) -> DrafterConfig:
    """The config of rank ``rank``'s part: its query/KV head counts and FFN width."""
    h0, h1 = kv_head_range(config, rank, world_size)
    i0, i1 = split_range(config.intermediate_size, rank, world_size)
    return dataclasses.replace(
        config,
        num_attention_heads=config.num_attention_heads // world_size,
        num_key_value_heads=h1 - h0,
        intermediate_size=i1 - i0,
    )


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Rank ``rank``'s rows / columns of each drafter linear (full-layer coordinates)."""

    rank: int
    size: int
    q_rows: tuple[int, int]  # of q_proj, i.e. of the fused qkv's first Hq * d rows
    kv_rows: tuple[int, int]  # of k_proj / v_proj
    heads: list  # every rank's o_proj input columns
    ffn: list  # every rank's gate/up rows = down columns

    @classmethod
    def of(cls, config: DrafterConfig, rank: int, size: int) -> "_Plan":
        d, q_per = config.head_dim, config.num_attention_heads // size
        h0, h1 = kv_head_range(config, rank, size)
        heads = [(r * q_per * d, (r + 1) * q_per * d) for r in range(size)]
        ffn = [split_range(config.intermediate_size, r, size) for r in range(size)]
        return cls(rank, size, heads[rank], (h0 * d, h1 * d), heads, ffn)

    def qkv_rows(self, config: DrafterConfig) -> list[tuple[int, int]]:
        """The three row ranges (q | k | v) of the fused ``qkv_proj``."""
        q, (a, b) = config.num_attention_heads * config.head_dim, self.kv_rows
        kv = config.num_key_value_heads * config.head_dim
        return [self.q_rows, (q + a, q + b), (q + kv + a, q + kv + b)]


def _new_layer(config: DrafterConfig, plan: _Plan, validate: bool) -> DrafterLayer:
    out = DrafterLayer(local_config(config, plan.rank, plan.size), device="meta", validate=validate)
    out.tp_rank, out.tp_size, out.full_config = plan.rank, plan.size, config
    return out


def _shard_layer(layer: DrafterLayer, rank: int, size: int, group, reduce: str) -> DrafterLayer:
    c = layer.config
    plan = _Plan.of(c, rank, size)
    out = _new_layer(c, plan, layer.validate)
    for name in _NORMS:
        setattr(out, name, getattr(layer, name))
    out.qkv_proj = column_shard(layer.qkv_proj, plan.qkv_rows(c))
    out.o_proj = row_parallel_over(layer.o_proj, plan.heads, rank, group, input_is_parallel=True, reduce=reduce)
    out.gate_proj = column_shard(layer.gate_proj, [plan.ffn[rank]])
    out.up_proj = column_shard(layer.up_proj, [plan.ffn[rank]])
    out.down_proj = row_parallel_over(layer.down_proj, plan.ffn, rank, group, input_is_parallel=True,
                                      reduce=reduce)
    return out


def tensor_parallel(module: nn.Module, group: Optional[dist.ProcessGroup] = None, *,
                    reduce: str = "all_reduce") -> nn.Module:
    """This rank's shard of a full :class:`DrafterLayer` or :class:`Drafter` (possibly on ``meta``).

    The returned module is a ``DrafterLayer``/``Drafter`` whose ``config`` holds the rank's
    head counts and FFN width (``full_config`` keeps the original; ``tp_rank``/``tp_size``
    say which part it is). ``forward`` has the same signature; each rank passes caches
    ``[num_blocks, block_size, Hkv_local, head_dim]`` holding only its own KV heads
    (``Hkv / P``, or 1 replicated head when ``Hkv < P``); block tables, slots and the other
    metadata are the same on every rank. Every rank returns the full ``[R, H]`` output.
    ``forward`` is collective: call it on every rank of ``group``.

    ``reduce`` picks how o_proj and down_proj sum their partials: ``"all_reduce"`` or
    ``"scatter_gather"`` (the seed's reduce-scatter to row owner ``row % P``, then
    all-gather; see :data:`torch_bq.distributed.REDUCTIONS`).

    Raises:
        TypeError: ``module`` is neither a ``DrafterLayer`` nor a ``Drafter``.
        ValueError: the heads do not split over the group (see :func:`kv_head_range`).
        RuntimeError: ``torch.distributed`` is not initialized.
    """
    if not isinstance(module, (Drafter, DrafterLayer)):
        raise TypeError(f"module: expected a DrafterLayer or a Drafter, got {type(module).__name__}")
    rank, size = group_rank_and_size(group)
    kv_head_range(module.config, rank, size)  # refuse before building anything
    if isinstance(module, DrafterLayer):
        return _shard_layer(module, rank, size, group, reduce)
    out = Drafter(local_config(module.config, rank, size), device="meta", validate=module.validate)
    out.layers = nn.ModuleList(_shard_layer(layer, rank, size, group, reduce) for layer in module.layers)
    out.norm = module.norm
    out.tp_rank, out.tp_size, out.full_config = rank, size, module.config
    return out


# --------------------------------------------------------------------------- #
# straight from a checkpoint
# --------------------------------------------------------------------------- #


def tensor_parallel_from_checkpoint(
    source: Source,
    prefix: str = "",
    *,
    config: Optional[DrafterConfig] = None,
    group: Optional[dist.ProcessGroup] = None,
    device="cpu",
    validate: bool = True,
    reduce: str = "all_reduce",
) -> Drafter:
    """This rank's :func:`tensor_parallel` shard of a drafter checkpoint, reading only its slices.

    Same names and layouts as :meth:`torch_bq.nn.Drafter.from_checkpoint` (a fused
    ``qkv_proj`` or separate ``q_proj``/``k_proj``/``v_proj``); each linear is read
    with ``safetensors`` slicing (the rank's rows or columns and the scale blocks
    covering them), the norms whole. The result is the module :func:`tensor_parallel`
    returns for the full drafter, bit for bit.

    Args:
        source: ``.safetensors`` file, directory, mapping of tensors or reader.
        prefix: prepended to every name, e.g. ``"model.mtp."``.
        config: the full drafter's config (default: :class:`DrafterConfig` ()).
        group: the process group to split over (default: the world).
        device: where the shard's tensors end up.
        validate: the module's ``validate``.
        reduce: as for :func:`tensor_parallel`.

    Raises:
        CheckpointError / MissingTensorError: as :meth:`Drafter.from_checkpoint`.
        ValueError: the heads do not split over the group.
    """
    config = DrafterConfig() if config is None else config
    rank, size = group_rank_and_size(group)
    plan = _Plan.of(config, rank, size)
    out = Drafter(local_config(config, rank, size), device="meta", validate=validate)
    out.tp_rank, out.tp_size, out.full_config = rank, size, config
    opts = {} if config.weight_format == "bf16" else dict(act_quant=config.act_quant, act_peak=config.act_peak)
    c, d = config, config.head_dim
    shapes = dict(qkv_proj=(c.qkv_size, c.hidden_size), o_proj=(c.hidden_size, c.num_attention_heads * d),
                  gate_proj=(c.intermediate_size, c.hidden_size), up_proj=(c.intermediate_size, c.hidden_size),
                  down_proj=(c.hidden_size, c.intermediate_size), q_proj=(c.num_attention_heads * d, c.hidden_size),
                  k_proj=(c.num_key_value_heads * d, c.hidden_size), v_proj=(c.num_key_value_heads * d, c.hidden_size))

    def layout(reader, name: str, base: str):
        found = detect_linear(reader, base + name, block=config.fp8_block)
        _check_format(found, config, base + name)
        if (found.out_features, found.in_features) != shapes[name]:
            raise CheckpointError(
                f"{base}{name}.weight: expected a {list(shapes[name])} layer for this config, "
                f"got {[found.out_features, found.in_features]}"
            )
        return found

    def row(reader, name: str, base: str, ranges) -> RowParallelLinear:
        shard = read_row_shard(reader, layout(reader, name, base), *ranges[rank], **opts)
        return RowParallelLinear(shard, ranges, out_features=c.hidden_size, act_quant=opts.get("act_quant", False),
                                 act_peak=getattr(shard.module, "act_peak", c.act_peak), input_is_parallel=True,
                                 reduce=reduce, group=group, rank=rank)

    with open_checkpoint(source) as reader:
        layers = []
        for i in range(config.num_layers):
            base = f"{prefix}layers.{i}."
            layer = _new_layer(config, plan, validate=False)
            if f"{base}qkv_proj.weight" not in reader and f"{base}q_proj.weight" in reader:
                parts = [read_column_shard(reader, layout(reader, f"{p}_proj", base), [rows], **opts)
                         for p, rows in zip("qkv", (plan.q_rows, plan.kv_rows, plan.kv_rows))]
                layer.qkv_proj = _stack_rows(parts, f"{base}q_proj/k_proj/v_proj")
            else:
                layer.qkv_proj = read_column_shard(reader, layout(reader, "qkv_proj", base), plan.qkv_rows(c), **opts)
            layer.o_proj = row(reader, "o_proj", base, plan.heads)
            for name in ("gate_proj", "up_proj"):
                setattr(layer, name, read_column_shard(reader, layout(reader, name, base), [plan.ffn[rank]], **opts))
            layer.down_proj = row(reader, "down_proj", base, plan.ffn)
            for name in _NORMS:
                _load_norm(reader, base + name, getattr(layer, name), device)
            layers.append(layer.to(device))
        out.layers = nn.ModuleList(layers)
        _load_norm(reader, f"{prefix}norm", out.norm, device)
    return out


def _stack_rows(parts: list, name: str) -> nn.Module:
    """One module whose output is the concatenation of ``parts``' outputs (q | k | v shards).

    fp8 parts may carry different row blocks (each re-expressed for where its shard
    starts) and scale dtypes; :func:`torch_bq.formats.join_rows` brings them to an exact
    common block (and float32 scales where e8m0 and float32 meet).
    """
    if isinstance(parts[0], BF16Linear):
        return BF16Linear.from_quantized(torch.cat([p.weight for p in parts]), name=name)
    first = parts[0]
    joined = formats.join_rows(first.format, [formats.RowPiece(p.weight, p.weight_scale, p.block) for p in parts],
                               name=name)
    return FP8Linear.from_quantized(joined.data, joined.scale, block=joined.block, act_quant=first.act_quant,
                                    act_peak=first.act_peak, name=name)