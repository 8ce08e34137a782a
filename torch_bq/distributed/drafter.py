"""Tensor-parallel DSpark drafter (SPEC.md §5, last paragraph).

Rank ``r`` of ``P`` holds:

* query heads ``[r Hq/P, (r+1) Hq/P)`` and KV heads ``[r Hkv/P, (r+1) Hkv/P)``: rows of the
  fused ``qkv_proj`` (three row ranges, q | k | v, one column shard);
* when ``Hkv < P`` (and ``P`` is a multiple of ``Hkv``) the one KV head its query heads
  read, ``r // (P / Hkv)``, replicated on ``P / Hkv`` ranks;
* ``gate_proj``/``up_proj`` rows ``split_range(I, r, P)`` and the matching columns of
  ``down_proj``; the columns of ``o_proj`` that multiply its query heads;
* every norm whole (they act on full rows or on one head).

``o_proj`` and ``down_proj`` are row-parallel: float32 partial sums over the rank's
heads / FFN columns are all-reduced, so every rank continues with the same residual
stream. Attention, RoPE, the q/k norms and the SwiGLU are per head or per element and
run unchanged on the rank's part. The result equals the single-rank layer up to the
float32 order of those two sums (and of the gemms' own blocking).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch.distributed as dist
from torch import nn

from ..nn.drafter import Drafter, DrafterLayer
from ..nn.drafter_config import DrafterConfig
from .linear import group_rank_and_size, row_parallel_over
from .sharding import column_shard, split_range

__all__ = ["tensor_parallel", "local_config", "kv_head_range"]


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


def _shard_layer(layer: DrafterLayer, rank: int, size: int, group) -> DrafterLayer:
    c, d = layer.config, layer.config.head_dim
    hq, hkv = c.num_attention_heads, c.num_key_value_heads
    q_per = hq // size
    h0, h1 = kv_head_range(c, rank, size)
    q_rows = (rank * q_per * d, (rank + 1) * q_per * d)
    k_rows = ((hq + h0) * d, (hq + h1) * d)
    v_rows = ((hq + hkv + h0) * d, (hq + hkv + h1) * d)
    out = DrafterLayer(local_config(c, rank, size), device="meta", validate=layer.validate)
    for name in ("input_layernorm", "q_norm", "k_norm", "post_attention_layernorm"):
        setattr(out, name, getattr(layer, name))
    out.qkv_proj = column_shard(layer.qkv_proj, [q_rows, k_rows, v_rows])
    heads = [(r * q_per * d, (r + 1) * q_per * d) for r in range(size)]
    out.o_proj = row_parallel_over(layer.o_proj, heads, rank, group, input_is_parallel=True)
    ffn = [split_range(c.intermediate_size, r, size) for r in range(size)]
    out.gate_proj = column_shard(layer.gate_proj, [ffn[rank]])
    out.up_proj = column_shard(layer.up_proj, [ffn[rank]])
    out.down_proj = row_parallel_over(layer.down_proj, ffn, rank, group, input_is_parallel=True)
    out.tp_rank, out.tp_size, out.full_config = rank, size, c
    return out


def tensor_parallel(module: nn.Module, group: Optional[dist.ProcessGroup] = None) -> nn.Module:
    """This rank's shard of a full :class:`DrafterLayer` or :class:`Drafter` (possibly on ``meta``).

    The returned module is a ``DrafterLayer``/``Drafter`` whose ``config`` holds the rank's
    head counts and FFN width (``full_config`` keeps the original; ``tp_rank``/``tp_size``
    say which part it is). ``forward`` has the same signature; each rank passes caches
    ``[num_blocks, block_size, Hkv_local, head_dim]`` holding only its own KV heads
    (``Hkv / P``, or 1 replicated head when ``Hkv < P``); block tables, slots and the other
    metadata are the same on every rank. Every rank returns the full ``[R, H]`` output.
    ``forward`` is collective: call it on every rank of ``group``.

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
        return _shard_layer(module, rank, size, group)
    out = Drafter(local_config(module.config, rank, size), device="meta", validate=module.validate)
    out.layers = nn.ModuleList(_shard_layer(layer, rank, size, group) for layer in module.layers)
    out.norm = module.norm
    out.tp_rank, out.tp_size, out.full_config = rank, size, module.config
    return out
