"""The DSpark speculative-decoding drafter (docs/contract.md §5): ``DrafterLayer`` and ``Drafter``.

One step of one layer, rows ``h`` ``[R, H]`` (``R = requests * rows_per_request``)::

    x = input_layernorm(h)                                    Gemma RMSNorm -> bf16
    q | k | v = qkv_proj(x)                                   one fused fp8 linear
    q, k = rope(q_norm(q)), rope(k_norm(k))                   per head; NeoX, first rotary_dim dims
    paged_kv_write(k, v, k_cache, v_cache, slots)             slot < 0: padding, skipped
    a = paged_window_attention(q, caches, block_table, ...)   sliding window, GQA, fp32 softmax
    h = bf16(h + o_proj(a))
    y = post_attention_layernorm(h)
    h = bf16(h + down_proj(clamped_swiglu(gate_proj(y), up_proj(y))))

The linears are :class:`~torch_bq.nn.FP8Linear` (``weight_format`` ``"fp8"``: 32x32
e8m0 blocks; ``"mxfp8"``: 1x32) with the fp8 activation round trip, or
:class:`~torch_bq.nn.BF16Linear` (``"bf16"``). Cache layout and the visibility
rule: :mod:`torch_bq.reference.attention`.

In eager mode the step's metadata is checked once per call (see
:func:`check_step`); ``validate=False`` on the module skips that, and it is
always skipped under ``torch.compile``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from .. import formats, ops
from ..reference.attention import check_paged_metadata
from ..reference.transformer import apply_rope, clamped_swiglu, rope_cos_sin
from .checkpoint import CheckpointError, MissingTensorError, Source, build_module, open_checkpoint, resolve_linear
from .drafter_config import DrafterConfig
from .linear import BF16Linear, FP8Linear
from .norm import GemmaRMSNorm

__all__ = ["DrafterLayer", "Drafter", "check_step"]

_LINEARS = ("qkv_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_NORMS = ("input_layernorm", "q_norm", "k_norm", "post_attention_layernorm")


def _linear(config: DrafterConfig, in_features: int, out_features: int, device) -> nn.Module:
    if config.weight_format == "bf16":
        return BF16Linear(in_features, out_features, device=device)
    return FP8Linear(
        in_features,
        out_features,
        block=config.fp8_block,
        act_quant=config.act_quant,
        act_peak=config.act_peak,
        device=device,
    )


def _bf16_sum(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The residual add of docs/contract.md §5: float32 sum, one rounding to bf16."""
    return (a.to(torch.float32) + b.to(torch.float32)).to(torch.bfloat16)


def _check_cache_pair(config: DrafterConfig, k_cache: torch.Tensor, v_cache: torch.Tensor, name: str) -> None:
    for which, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(cache, torch.Tensor):
            raise TypeError(f"{name}{which}: expected a tensor, got {type(cache).__name__}")
        if not cache.dtype.is_floating_point or cache.dtype.itemsize == 1:
            raise TypeError(f"{name}{which}: expected a float16/bfloat16/float32 tensor, got {cache.dtype}")
        if cache.dim() != 4 or tuple(cache.shape[2:]) != (config.num_key_value_heads, config.head_dim):
            raise ValueError(
                f"{name}{which}: expected shape [num_blocks, block_size, {config.num_key_value_heads}, "
                f"{config.head_dim}] (num_key_value_heads, head_dim of the config), got {list(cache.shape)}"
            )
    if v_cache.dtype != k_cache.dtype or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"{name}v_cache: expected the shape and dtype of k_cache {list(k_cache.shape)} {k_cache.dtype}, "
            f"got {list(v_cache.shape)} {v_cache.dtype}"
        )


def check_step(
    config: DrafterConfig,
    hidden: torch.Tensor,
    positions: torch.Tensor,
    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    block_table: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    """Raise ``ValueError``/``TypeError`` if a step's inputs are inconsistent (eager only).

    Checks ``hidden`` ``[R, hidden_size]`` float with ``R`` a multiple of
    ``rows_per_request``; every cache ``[num_blocks, block_size, Hkv, d]`` and all of
    one shape; and the metadata values (:func:`torch_bq.reference.attention.check_paged_metadata`:
    positions inside ``seq_lens``, block tables long enough and inside the cache,
    slots inside the cache and where the table puts each row's position).
    """
    if not isinstance(hidden, torch.Tensor) or not hidden.dtype.is_floating_point or hidden.dtype.itemsize == 1:
        raise TypeError(f"hidden: expected a float16/bfloat16/float32 tensor, got {getattr(hidden, 'dtype', hidden)}")
    if hidden.dim() != 2 or hidden.shape[1] != config.hidden_size:
        raise ValueError(f"hidden: expected shape [R, {config.hidden_size}] (hidden_size), got {list(hidden.shape)}")
    rows = hidden.shape[0]
    if rows % config.rows_per_request:
        raise ValueError(
            f"hidden: R = {rows} rows is not a multiple of rows_per_request = {config.rows_per_request}"
        )
    for name, t, dtype in (("positions", positions, torch.int64), ("slots", slots, torch.int64)):
        if t.dtype != dtype:
            raise TypeError(f"{name}: expected dtype {dtype}, got {t.dtype}")
        if tuple(t.shape) != (rows,):
            raise ValueError(f"{name}: expected shape [{rows}] (one per row of hidden), got {list(t.shape)}")
    if not kv_caches:
        raise ValueError("kv_caches: expected one (k_cache, v_cache) pair per layer, got none")
    k0 = kv_caches[0][0]
    for i, (k_cache, v_cache) in enumerate(kv_caches):
        name = f"kv_caches[{i}]." if len(kv_caches) > 1 else ""
        _check_cache_pair(config, k_cache, v_cache, name)
        if k_cache.shape != k0.shape:
            raise ValueError(
                f"{name}k_cache: every layer's cache must have the shape of layer 0's {list(k0.shape)} "
                f"(they share one block table), got {list(k_cache.shape)}"
            )
    check_paged_metadata(
        positions,
        seq_lens,
        block_table,
        rows_per_request=config.rows_per_request,
        window=config.sliding_window,
        num_blocks=k0.shape[0],
        block_size=k0.shape[1],
        slots=slots,
    )


def _validating(flag: bool) -> bool:
    return flag and not torch.compiler.is_compiling()


class DrafterLayer(nn.Module):
    """One DSpark drafter layer (docs/contract.md §5) on torch_bq linears.

    Args:
        config: the layer's shape and weight format.
        device: where to allocate (``"meta"`` allocates nothing; load with
            ``load_state_dict(..., assign=True)`` or :meth:`Drafter.from_checkpoint`).
        validate: check each step's inputs in eager mode (:func:`check_step`).

    Submodules (state dict keys ``qkv_proj.weight``, ``qkv_proj.weight_scale``,
    ``input_layernorm.weight``, ...): ``input_layernorm``, ``qkv_proj``
    (``[(Hq + 2 Hkv) d, H]``, rows q | k | v), ``q_norm``, ``k_norm`` (over ``head_dim``),
    ``o_proj``, ``post_attention_layernorm``, ``gate_proj``, ``up_proj``, ``down_proj``.
    Norms store Gemma's ``w`` (scale ``1 + w``).
    """

    def __init__(self, config: DrafterConfig, *, device=None, validate: bool = True) -> None:
        super().__init__()
        if not isinstance(config, DrafterConfig):
            raise TypeError(f"config: expected a DrafterConfig, got {type(config).__name__}")
        self.config = config
        self.validate = validate
        c = config
        h, d = c.hidden_size, c.head_dim
        self.input_layernorm = GemmaRMSNorm(h, c.rms_norm_eps, device=device)
        self.qkv_proj = _linear(c, h, c.qkv_size, device)
        self.q_norm = GemmaRMSNorm(d, c.rms_norm_eps, device=device)
        self.k_norm = GemmaRMSNorm(d, c.rms_norm_eps, device=device)
        self.o_proj = _linear(c, c.num_attention_heads * d, h, device)
        self.post_attention_layernorm = GemmaRMSNorm(h, c.rms_norm_eps, device=device)
        self.gate_proj = _linear(c, h, c.intermediate_size, device)
        self.up_proj = _linear(c, h, c.intermediate_size, device)
        self.down_proj = _linear(c, c.intermediate_size, h, device)

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_table: torch.Tensor,
        slots: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> torch.Tensor:
        """One step: ``hidden`` ``[R, H]`` -> ``[R, H]`` bfloat16; writes this step's K/V into the caches.

        Args:
            hidden: ``[R, hidden_size]`` float, request-major, ``rows_per_request`` rows each.
            positions: int64 ``[R]``.
            k_cache, v_cache: ``[num_blocks, block_size, num_key_value_heads, head_dim]``
                (bfloat16 normally); mutated at ``slots``.
            block_table: int32 ``[num_requests, max_blocks]``.
            slots: int64 ``[R]``; negative for padded rows (no write).
            seq_lens: int32 ``[num_requests]``, including this step's rows.
        """
        if _validating(self.validate):
            check_step(self.config, hidden, positions, [(k_cache, v_cache)], block_table, slots, seq_lens)
        return self.step(hidden, positions, k_cache, v_cache, block_table, slots, seq_lens)

    def step(self, hidden, positions, k_cache, v_cache, block_table, slots, seq_lens) -> torch.Tensor:
        """:meth:`forward` without the input checks (the :class:`Drafter` checks once for all layers)."""
        c = self.config
        rows, d = hidden.shape[0], c.head_dim
        hq, hkv = c.num_attention_heads, c.num_key_value_heads
        x = self.input_layernorm(hidden)
        q, k, v = self.qkv_proj(x).split([hq * d, hkv * d, hkv * d], dim=-1)
        cos, sin = rope_cos_sin(positions, c.rotary_dim, c.rope_theta)
        q = apply_rope(self.q_norm(q.reshape(rows, hq, d)), cos, sin)
        k = apply_rope(self.k_norm(k.reshape(rows, hkv, d)), cos, sin)
        v = v.reshape(rows, hkv, d)
        ops.paged_kv_write(
            k.to(k_cache.dtype), v.to(v_cache.dtype), k_cache, v_cache, slots, validate=False
        )
        attn = ops.paged_window_attention(
            q.to(k_cache.dtype),
            k_cache,
            v_cache,
            block_table,
            positions,
            seq_lens,
            rows_per_request=c.rows_per_request,
            window=c.sliding_window,
            causal=c.causal,
            scale=d**-0.5,
            validate=False,
        )
        h = _bf16_sum(hidden, self.o_proj(attn.reshape(rows, hq * d).to(torch.bfloat16)))
        y = self.post_attention_layernorm(h)
        a = clamped_swiglu(self.gate_proj(y), self.up_proj(y), c.swiglu_alpha, c.swiglu_limit)
        return _bf16_sum(h, self.down_proj(a))

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"hidden={c.hidden_size}, heads={c.num_attention_heads}/{c.num_key_value_heads}x{c.head_dim}, "
            f"window={c.sliding_window}, ffn={c.intermediate_size}, weights={c.weight_format}"
        )


class Drafter(nn.Module):
    """The DSpark drafter: ``num_layers`` :class:`DrafterLayer` s sharing the step's metadata,
    each with its own KV cache, then a final Gemma RMSNorm ``norm``.

    Args:
        config: shape and weight format.
        device: where to allocate (``"meta"`` allocates nothing).
        validate: check each step's inputs once per call in eager mode.

    State dict keys: ``layers.{i}.<DrafterLayer keys>``, ``norm.weight``.
    """

    def __init__(self, config: DrafterConfig, *, device=None, validate: bool = True) -> None:
        super().__init__()
        if not isinstance(config, DrafterConfig):
            raise TypeError(f"config: expected a DrafterConfig, got {type(config).__name__}")
        self.config = config
        self.validate = validate
        self.layers = nn.ModuleList(
            DrafterLayer(config, device=device, validate=False) for _ in range(config.num_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, device=device)

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        block_table: torch.Tensor,
        slots: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> torch.Tensor:
        """One draft step through every layer: ``hidden`` ``[R, H]`` -> normed ``[R, H]`` bfloat16.

        ``kv_caches`` holds one ``(k_cache, v_cache)`` per layer, all of one shape (they
        share ``block_table`` and ``slots``); other arguments as in :meth:`DrafterLayer.forward`.
        """
        if _validating(self.validate):
            if len(kv_caches) != len(self.layers):
                raise ValueError(
                    f"kv_caches: expected one (k_cache, v_cache) pair per layer ({len(self.layers)}), "
                    f"got {len(kv_caches)}"
                )
            check_step(self.config, hidden, positions, kv_caches, block_table, slots, seq_lens)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            hidden = layer.step(hidden, positions, k_cache, v_cache, block_table, slots, seq_lens)
        return self.norm(hidden)

    def new_kv_caches(
        self, num_blocks: int, block_size: int, *, dtype: torch.dtype = torch.bfloat16, device=None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Zeroed ``(k_cache, v_cache)`` per layer, ``[num_blocks, block_size, Hkv, d]`` each."""
        shape = (num_blocks, block_size, self.config.num_key_value_heads, self.config.head_dim)
        return [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in self.layers
        ]

    @classmethod
    def from_checkpoint(
        cls,
        source: Source,
        prefix: str = "",
        *,
        config: Optional[DrafterConfig] = None,
        device="cpu",
        validate: bool = True,
    ) -> "Drafter":
        """Load a drafter from a checkpoint (any source :class:`torch_bq.nn.CheckpointReader` takes).

        Reads ``{prefix}layers.{i}.{qkv_proj,o_proj,gate_proj,up_proj,down_proj}`` in any
        layout the linear loader knows (ours, DeepSeek ``weight_scale_inv``/``scale``, dense
        bf16), the norms' ``{prefix}layers.{i}.{input_layernorm,q_norm,k_norm,
        post_attention_layernorm}.weight`` and ``{prefix}norm.weight``. Instead of a fused
        ``qkv_proj``, separate ``q_proj``/``k_proj``/``v_proj`` are accepted and fused
        exactly (:func:`torch_bq.formats.join_rows`: when a part's rows are not a multiple of
        its scale block, the fused weight uses a finer row block).

        Args:
            source: ``.safetensors`` file, directory, mapping of tensors or reader.
            prefix: prepended to every name, e.g. ``"model.mtp."``.
            config: the drafter's config (default: :class:`DrafterConfig` ()); its
                ``weight_format`` must match the checkpoint's (fp8 blocks included).
            device: where the weights end up.
            validate: the module's ``validate``.

        Raises:
            CheckpointError / MissingTensorError: a tensor is missing, misshapen, in another
                format than ``config.weight_format`` or corrupt; nothing is returned half-loaded.
        """
        config = DrafterConfig() if config is None else config
        drafter = cls(config, device="meta", validate=validate)
        with open_checkpoint(source) as reader:
            for i, layer in enumerate(drafter.layers):
                base = f"{prefix}layers.{i}."
                for name in _LINEARS:
                    separate = f"{base}qkv_proj.weight" not in reader and f"{base}q_proj.weight" in reader
                    if name == "qkv_proj" and separate:
                        module = _load_fused_qkv(reader, base, config, device)
                    else:
                        module = _load_linear(reader, base + name, config, device)
                    _check_linear_shape(module, getattr(layer, name), base + name)
                    setattr(layer, name, module)
                for name in _NORMS:
                    _load_norm(reader, base + name, getattr(layer, name), device)
            _load_norm(reader, f"{prefix}norm", drafter.norm, device)
        return drafter


# --------------------------------------------------------------------------- #
# checkpoint helpers
# --------------------------------------------------------------------------- #


def _check_format(weights, config: DrafterConfig, prefix: str) -> None:
    want = "bf16" if config.weight_format == "bf16" else "fp8"
    got = "bf16" if weights.format in ("bf16", "fp32w") else weights.format
    if got != want or (want == "fp8" and tuple(weights.block) != config.fp8_block):
        held = f"{weights.format} block {weights.block}" if weights.format == "fp8" else weights.format
        raise CheckpointError(
            f"{prefix}: the checkpoint holds {held} weights, but config.weight_format={config.weight_format!r} "
            f"expects {want}" + (f" block {config.fp8_block}" if want == "fp8" else "")
        )


def _build(weights, config: DrafterConfig, device) -> nn.Module:
    if config.weight_format == "bf16":
        return build_module(weights, device=device)
    return build_module(weights, device=device, act_quant=config.act_quant, act_peak=config.act_peak)


def _resolve(reader, prefix: str, config: DrafterConfig):
    try:
        weights = resolve_linear(reader, prefix, block=config.fp8_block)
    except MissingTensorError:
        raise
    except CheckpointError as e:
        raise CheckpointError(f"{e} (config.weight_format={config.weight_format!r})") from None
    _check_format(weights, config, prefix)
    return weights


def _load_linear(reader, prefix: str, config: DrafterConfig, device) -> nn.Module:
    weights = _resolve(reader, prefix, config)
    return _build(weights, config, device)


def _load_fused_qkv(reader, base: str, config: DrafterConfig, device) -> nn.Module:
    parts = [_resolve(reader, f"{base}{p}_proj", config) for p in "qkv"]
    for p, w in zip("qkv", parts):
        if w.bias is not None:
            raise CheckpointError(f"{base}{p}_proj.bias: the drafter's qkv projection has no bias")
    if len({w.in_features for w in parts}) != 1:
        raise CheckpointError(
            f"{base}q_proj/k_proj/v_proj: in_features differ ({[w.in_features for w in parts]}); cannot fuse"
        )
    if config.weight_format == "bf16":
        weight = torch.cat([w.weight for w in parts], dim=0)
        return BF16Linear.from_quantized(weight.to(torch.bfloat16), name=f"{base}qkv_proj.weight").to(device)
    # A part whose rows are not a multiple of the scale block puts the next part's blocks at
    # unaligned rows; join_rows re-blocks to a finer row block on which the fusion is exact
    # (and mixed e8m0 / float32 scales become float32, also exactly).
    fmt = formats.get_format(parts[0].format)
    joined = formats.join_rows(fmt, [formats.RowPiece(w.weight, w.scale, w.block) for w in parts],
                               name=f"{base}qkv_proj.weight")
    module = FP8Linear.from_quantized(
        joined.data, joined.scale, block=joined.block, act_quant=config.act_quant, act_peak=config.act_peak,
        name=f"{base}qkv_proj.weight",
    )
    return module.to(device)


def _check_linear_shape(module: nn.Module, like: nn.Module, prefix: str) -> None:
    got, want = (module.out_features, module.in_features), (like.out_features, like.in_features)
    if got != want:
        raise CheckpointError(
            f"{prefix}.weight: expected a [{want[0]}, {want[1]}] layer for this config, got [{got[0]}, {got[1]}]"
        )


def _load_norm(reader, prefix: str, norm: GemmaRMSNorm, device) -> None:
    name = f"{prefix}.weight"
    w = reader.get(name)
    if tuple(w.shape) != (norm.dim,):
        raise CheckpointError(f"{name}: expected shape [{norm.dim}], got {list(w.shape)}")
    if not w.dtype.is_floating_point or w.dtype.itemsize == 1:
        raise CheckpointError(f"{name}: expected a float16/bfloat16/float32 tensor, got {w.dtype}")
    norm.weight = nn.Parameter(w.to(device=device), requires_grad=False)
