"""Mixture-of-experts layers on block-quantized expert weights: ``FP4Experts``, ``FP8Experts``.

``forward(hidden [T, H], expert_ids [T, k], routing_weights [T, k]) -> [T, H]``:

1. sort the ``T * k`` (token, expert) pairs by expert (stable) and count rows per
   expert into ``int32`` cumulative offsets, all with static shapes;
2. ``gate_up = grouped_linear(rows, gate_up_proj)`` (``[T*k, 2I]``, float32 out);
3. the gated activation (float32) gives ``[T*k, I]``;
4. ``down = grouped_linear(act, down_proj)`` (``[T*k, H]``, float32 out);
5. ``out[t] = sum_j routing_weights[t, j] * down[pair (t, j)]`` in float32, rounded
   once to ``hidden.dtype``.

Both linears are the ``torch_bq::`` grouped ops (activation qdq on by default), so
the whole forward is free of data-dependent Python control flow and compiles with
``torch.compile(fullgraph=True)``.

Activations (``activation=``):

* ``"gpt-oss"``: gpt-oss's clamped SwiGLU. ``gate_up_proj`` rows are *interleaved*
  (row ``2i`` is gate ``i``, row ``2i + 1`` is up ``i``);
  ``g = min(gate, 7)``, ``u = clamp(up, -7, 7)``, ``a = g * sigmoid(1.702 g) * (u + 1)``.
* ``"swiglu"``: plain SwiGLU (DeepSeek ``w1``/``w3``). ``gate_up_proj`` rows are
  *concatenated*: rows ``[0, I)`` are ``w1`` (gate), rows ``[I, 2I)`` are ``w3`` (up);
  ``a = silu(gate) * up``. ``down_proj`` is ``w2``.
"""

from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .. import formats, ops
from ..checkpoint.scan import scan_nan_codes
from .linear import _QuantizedLinear, _RecordsBlock

__all__ = ["FP4Experts", "FP8Experts", "ACTIVATIONS", "GPT_OSS_ALPHA", "GPT_OSS_LIMIT"]

ACTIVATIONS = ("gpt-oss", "swiglu")
GPT_OSS_ALPHA = 1.702
GPT_OSS_LIMIT = 7.0


def _gated_activation(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """``[R, 2I]`` float32 gate/up rows -> ``[R, I]`` float32 (layouts in the module docstring)."""
    if activation == "gpt-oss":
        gate = gate_up[:, 0::2].clamp(max=GPT_OSS_LIMIT)
        up = gate_up[:, 1::2].clamp(-GPT_OSS_LIMIT, GPT_OSS_LIMIT)
        return gate * torch.sigmoid(GPT_OSS_ALPHA * gate) * (up + 1.0)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _check_routing(
    hidden: torch.Tensor, expert_ids: torch.Tensor, routing_weights: torch.Tensor, hidden_size: int
) -> None:
    if not hidden.dtype.is_floating_point or hidden.dim() != 2 or hidden.shape[1] != hidden_size:
        raise ValueError(
            f"hidden: expected a float [T, {hidden_size}] tensor, got {hidden.dtype} {list(hidden.shape)}"
        )
    if expert_ids.dtype.is_floating_point or expert_ids.dtype.is_complex or expert_ids.dtype == torch.bool:
        raise TypeError(f"expert_ids: expected an integer dtype, got {expert_ids.dtype}")
    if expert_ids.dim() != 2 or expert_ids.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"expert_ids: expected shape [T, k] with T = {hidden.shape[0]} (rows of hidden), "
            f"got {list(expert_ids.shape)}"
        )
    if not routing_weights.dtype.is_floating_point:
        raise TypeError(f"routing_weights: expected a floating-point dtype, got {routing_weights.dtype}")
    if routing_weights.shape != expert_ids.shape:
        raise ValueError(
            f"routing_weights: expected shape {list(expert_ids.shape)} (as expert_ids), "
            f"got {list(routing_weights.shape)}"
        )


class _Experts(_QuantizedLinear):
    """Shared forward, state, construction and checks of :class:`FP4Experts` and :class:`FP8Experts`.

    State is held in persistent buffers, as in :mod:`torch_bq.nn.linear` (same
    reasons: the quantized storage can never train). The linear modules' base
    class supplies the plumbing both need: the stored weights and scales survive
    module-wide dtype casts, and ``load_state_dict`` validates everything before
    assigning anything (:meth:`_normalize`, :meth:`_validate_loaded` below).
    Subclasses define the storage of one stacked weight (``_empty_weight``,
    ``_normalize_weight``) and the grouped op call (``_grouped_linear``).
    """

    format_name = ""
    #: buffers whose dtype is part of the format and must survive ``model.to(dtype)``
    _stored = ("gate_up_proj", "gate_up_proj_scale", "down_proj", "down_proj_scale")

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        bias: bool,
        activation: str,
        act_quant: bool,
        act_peak: float,
        device,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
        for name, value in (("num_experts", num_experts), ("hidden_size", hidden_size),
                            ("intermediate_size", intermediate_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        formats.check_peak(act_peak)
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.activation = activation
        self.act_quant = bool(act_quant)
        self.act_peak = float(act_peak)
        for proj, (n, k) in self._projection_shapes().items():
            data, scale = self._empty_weight(n, k, device)
            self.register_buffer(proj, data)
            self.register_buffer(f"{proj}_scale", scale)
            b = torch.zeros(num_experts, n, dtype=dtype, device=device) if bias else None
            self.register_buffer(f"{proj}_bias", b)

    def _projection_shapes(self) -> dict:
        """``{projection: (N, K)}`` of one expert."""
        h, i = self.hidden_size, self.intermediate_size
        return {"gate_up_proj": (2 * i, h), "down_proj": (h, i)}

    # -- format hooks ----------------------------------------------------------

    def _empty_weight(self, n: int, k: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
        """Zero data and unit scales of ``num_experts`` stacked ``[N, K]`` weights."""
        raise NotImplementedError

    def _normalize_weight(self, data: torch.Tensor, scale: torch.Tensor, name: str):
        """Byte-equivalent storage dtypes -> this module's, or ``TypeError``."""
        raise NotImplementedError

    def _grouped_linear(self, rows, weight, scale, offsets, bias) -> torch.Tensor:
        raise NotImplementedError

    # -- forward ----------------------------------------------------------------

    def forward(
        self, hidden: torch.Tensor, expert_ids: torch.Tensor, routing_weights: torch.Tensor
    ) -> torch.Tensor:
        """Route each token to its ``k`` experts and mix their outputs.

        Args:
            hidden: ``[T, H]`` any float dtype (the output has the same dtype).
            expert_ids: ``[T, k]`` integer expert indices in ``[0, E)``; a token may
                name the same expert twice (both slots are computed).
            routing_weights: ``[T, k]`` float mixing weights, used as given (apply the
                router's softmax / normalisation before calling).

        Returns:
            ``[T, H]`` of ``hidden.dtype``.
        """
        _check_routing(hidden, expert_ids, routing_weights, self.hidden_size)
        if not torch.compiler.is_compiling():
            # A data-dependent check: eager only, so compiled graphs stay whole.
            self._check_expert_ids(expert_ids)
        tokens, top_k = expert_ids.shape
        flat_ids = expert_ids.reshape(-1).long()
        # A stable sort keeps each expert's rows in token order (deterministic results).
        order = torch.argsort(flat_ids, stable=True)
        token_of_row = order // top_k
        rows = hidden.index_select(0, token_of_row)
        # Counting with scatter_add (not bincount) keeps the shape static: [E].
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=hidden.device)
        counts = counts.scatter_add(0, flat_ids, torch.ones_like(flat_ids))
        offsets = counts.cumsum(0).to(torch.int32)

        gate_up = self._grouped_linear(rows, self.gate_up_proj, self.gate_up_proj_scale, offsets,
                                       self.gate_up_proj_bias)
        act = _gated_activation(gate_up, self.activation)
        down = self._grouped_linear(act, self.down_proj, self.down_proj_scale, offsets, self.down_proj_bias)

        weights = routing_weights.reshape(-1).index_select(0, order).to(torch.float32)
        out = torch.zeros(tokens, self.hidden_size, dtype=torch.float32, device=hidden.device)
        out = out.index_add(0, token_of_row, down * weights[:, None])
        return out.to(hidden.dtype)

    def _check_expert_ids(self, expert_ids: torch.Tensor) -> None:
        bad = (expert_ids < 0) | (expert_ids >= self.num_experts)
        if bool(bad.any()):
            index = [int(v) for v in bad.nonzero()[0]]
            raise ValueError(
                f"expert_ids: expected values in [0, {self.num_experts}), "
                f"got {int(expert_ids[tuple(index)])} at index {index}"
            )

    def extra_repr(self) -> str:
        act = f"fp8(peak={self.act_peak:g})" if self.act_quant else "off"
        return (
            f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
            f"intermediate_size={self.intermediate_size}, bias={self.gate_up_proj_bias is not None}, "
            f"format={self._format_repr()}, activation={self.activation}, act_quant={act}"
        )

    def _format_repr(self) -> str:
        return self.format_name

    # -- state dict (hooks of the base class) --------------------------------------

    def _normalize(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name in self._projection_shapes():
            return self._normalize_weight(tensor, self._buffers[f"{name}_scale"], name)[0]
        if name.endswith("_scale"):
            return self._normalize_weight(self._buffers[name[: -len("_scale")]], tensor, name[: -len("_scale")])[1]
        return tensor

    def _validate_loaded(self, incoming: dict, assign: bool) -> None:
        for key, t in incoming.items():
            want = self._buffers[key]
            if tuple(t.shape) != tuple(want.shape):
                raise ValueError(f"{key}: expected shape {list(want.shape)}, got {list(t.shape)}")
            if key.endswith("_scale") and t.dtype != want.dtype and not assign:
                raise TypeError(f"{key}: this module stores {want.dtype} scales but the state dict holds {t.dtype}")
        for proj, (n, k) in self._projection_shapes().items():
            data, scale = incoming.get(proj), incoming.get(f"{proj}_scale")
            for e in range(self.num_experts):
                if (data is None or data.is_meta) and (scale is None or scale.is_meta):
                    break
                scan_nan_codes(None if data is None or data.is_meta else data[e],
                               None if scale is None or scale.is_meta else scale[e],
                               name=f"{proj}[{e}]", fmt=self.format_name, in_features=k)

    # -- construction ------------------------------------------------------------

    def _install(self, tensors: dict, name: str, scan_codes: bool) -> None:
        """Check ``{buffer: tensor}`` against this (meta) module's buffers, then assign them all.

        Nothing is assigned unless every tensor fits.
        """
        ready = {}
        for proj, (n, k) in self._projection_shapes().items():
            data, scale = self._normalize_weight(tensors[proj], tensors[f"{proj}_scale"], f"{name}.{proj}")
            for key, t in ((proj, data), (f"{proj}_scale", scale)):
                want = self._buffers[key]
                if tuple(t.shape) != tuple(want.shape):
                    raise ValueError(f"{name}.{key}: expected shape {list(want.shape)}, got {list(t.shape)}")
            if scan_codes and not data.is_meta:
                for e in range(self.num_experts):
                    scan_nan_codes(data[e], scale[e], name=f"{name}.{proj}[{e}]", fmt=self.format_name,
                                   in_features=k)
            ready[proj], ready[f"{proj}_scale"] = data, scale
            bias = tensors.get(f"{proj}_bias")
            if (bias is None) != (self._buffers[f"{proj}_bias"] is None):
                raise ValueError(f"{name}.{proj}_bias: expected {'a' if bias is None else 'no'} bias tensor")
            if bias is not None:
                if not bias.dtype.is_floating_point:
                    raise TypeError(f"{name}.{proj}_bias: expected a floating-point dtype, got {bias.dtype}")
                if tuple(bias.shape) != (self.num_experts, n):
                    raise ValueError(
                        f"{name}.{proj}_bias: expected shape {[self.num_experts, n]}, got {list(bias.shape)}"
                    )
                ready[f"{proj}_bias"] = bias
        for key, t in ready.items():
            setattr(self, key, t)

    @classmethod
    def _from_stacked(cls, tensors: dict, *, name: str, scan_codes: bool, sizes: Tuple[int, int, int],
                      **options) -> "_Experts":
        e, h, i = sizes
        given = [b for b in (tensors.get("gate_up_proj_bias"), tensors.get("down_proj_bias")) if b is not None]
        bias = bool(given)
        if bias:
            # Only one of the two biases given: the other is zero.
            ref = given[0]
            tensors = dict(tensors)
            for proj, n in (("gate_up_proj", 2 * i), ("down_proj", h)):
                if tensors.get(f"{proj}_bias") is None:
                    tensors[f"{proj}_bias"] = torch.zeros(e, n, dtype=ref.dtype, device=ref.device)
            options.setdefault("dtype", ref.dtype)
        module = cls(e, h, i, bias, device="meta", **options)
        module._install(tensors, name, scan_codes)
        return module


class FP4Experts(_Experts):
    """Experts with OCP MXFP4 weights (W4A8 by default): gpt-oss's expert layer.

    State (``E`` experts, hidden ``H``, intermediate ``I``), all buffers:

    * ``gate_up_proj`` ``uint8 [E, 2I, ceil(H/2)]`` packed e2m1, ``gate_up_proj_scale``
      ``float8_e8m0fnu [E, 2I, ceil(H/32)]``, ``gate_up_proj_bias`` ``[E, 2I]`` (if ``bias``);
    * ``down_proj`` ``uint8 [E, H, ceil(I/2)]``, ``down_proj_scale`` ``[E, H, ceil(I/32)]``,
      ``down_proj_bias`` ``[E, H]`` (if ``bias``).

    Row layout of ``gate_up_proj`` depends on ``activation`` (see :mod:`torch_bq.nn.experts`).
    A fresh module holds zero weights with unit scales; fill it with :meth:`from_weights`,
    :meth:`from_quantized`, :meth:`from_checkpoint` or ``load_state_dict``.

    Args:
        num_experts: ``E``.
        hidden_size: ``H``.
        intermediate_size: ``I``.
        bias: hold per-expert biases (gpt-oss has them; DeepSeek does not).
        activation: ``"gpt-oss"`` (clamped SwiGLU, interleaved rows; default) or ``"swiglu"``.
        act_quant, act_peak: activation qdq of both linears (docs/contract.md §3).
        device: where to allocate (``"meta"`` allocates nothing).
        dtype: dtype of the biases.
    """

    format = formats.FP4
    format_name = format.name

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = False,
        *,
        activation: str = "gpt-oss",
        act_quant: bool = True,
        act_peak: float = formats.DEFAULT_ACT_PEAK,
        device=None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__(num_experts, hidden_size, intermediate_size, bias, activation, act_quant, act_peak,
                         device, dtype)

    def _empty_weight(self, n, k, device):
        fmt, e = self.format, self.num_experts
        data = torch.zeros(e, *fmt.data_shape(n, k), dtype=fmt.element.dtype, device=device)
        code = torch.full((e, *fmt.scale_shape(n, k)), formats.E8M0_BIAS, dtype=torch.uint8, device=device)
        return data, code.view(fmt.scales[0].dtype)

    def _normalize_weight(self, data, scale, name):
        fmt = self.format
        fmt.check_data_dtype(data, name)
        fmt.scale_encoding(scale, f"{name}_scale")
        return data.view(fmt.element.dtype), scale.view(fmt.scales[0].dtype)

    def _grouped_linear(self, rows, weight, scale, offsets, bias) -> torch.Tensor:
        return ops.fp4_grouped_linear(rows, weight, scale, offsets, bias, act_quant=self.act_quant,
                                      act_peak=self.act_peak, out_dtype=torch.float32)

    @classmethod
    def from_quantized(
        cls,
        gate_up_proj: torch.Tensor,
        gate_up_proj_scale: torch.Tensor,
        down_proj: torch.Tensor,
        down_proj_scale: torch.Tensor,
        gate_up_proj_bias: Optional[torch.Tensor] = None,
        down_proj_bias: Optional[torch.Tensor] = None,
        *,
        hidden_size: Optional[int] = None,
        intermediate_size: Optional[int] = None,
        name: str = "experts",
        **options,
    ) -> "FP4Experts":
        """Wrap stacked MXFP4 storage (no copy) after checking dtypes, shapes and NaN codes.

        Args:
            gate_up_proj: ``[E, 2I, ceil(H/2)]`` packed (``uint8``/``int8``/``float4_e2m1fn_x2``).
            gate_up_proj_scale: ``[E, 2I, ceil(H/32)]`` e8m0 (``float8_e8m0fnu``/``uint8``).
            down_proj, down_proj_scale: ``[E, H, ceil(I/2)]`` and ``[E, H, ceil(I/32)]``.
            gate_up_proj_bias, down_proj_bias: ``[E, 2I]`` / ``[E, H]`` or ``None``.
            hidden_size, intermediate_size: ``H``/``I`` when odd (default: from the shapes).
            name: prefix for error messages (e.g. the checkpoint prefix).
            options: ``activation``, ``act_quant``, ``act_peak`` as in the constructor.
        """
        _check_stacked(gate_up_proj, down_proj)
        sizes = (
            gate_up_proj.shape[0],
            2 * gate_up_proj.shape[2] if hidden_size is None else hidden_size,
            2 * down_proj.shape[2] if intermediate_size is None else intermediate_size,
        )
        tensors = dict(gate_up_proj=gate_up_proj, gate_up_proj_scale=gate_up_proj_scale, down_proj=down_proj,
                       down_proj_scale=down_proj_scale, gate_up_proj_bias=gate_up_proj_bias,
                       down_proj_bias=down_proj_bias)
        return cls._from_stacked(tensors, name=name, scan_codes=True, sizes=sizes, **options)

    @classmethod
    def from_weights(
        cls,
        gate_up_proj: torch.Tensor,
        down_proj: torch.Tensor,
        gate_up_proj_bias: Optional[torch.Tensor] = None,
        down_proj_bias: Optional[torch.Tensor] = None,
        *,
        rounding: str = "ceil",
        **options,
    ) -> "FP4Experts":
        """Quantize float expert weights with :func:`torch_bq.formats.quantize_fp4`.

        Args:
            gate_up_proj: ``[E, 2I, H]`` float, rows laid out for ``options["activation"]``.
            down_proj: ``[E, H, I]`` float.
            gate_up_proj_bias, down_proj_bias: ``[E, 2I]`` / ``[E, H]`` or ``None`` (kept as is).
            rounding: the fp4 scale rule, ``"ceil"`` or ``"floor"``.
            options: constructor options (``activation``, ``act_quant``, ...).
        """
        tensors = {"gate_up_proj_bias": gate_up_proj_bias, "down_proj_bias": down_proj_bias}
        sizes = _float_sizes(gate_up_proj, down_proj)
        for proj, w in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
            data, scale = zip(*(formats.quantize_fp4(w[e], rounding) for e in range(w.shape[0])))
            tensors[proj], tensors[f"{proj}_scale"] = torch.stack(data), torch.stack(scale)
        return cls._from_stacked(tensors, name="experts", scan_codes=False, sizes=sizes, **options)

    @classmethod
    def from_checkpoint(cls, source, prefix: str, *, layout: str = "gpt-oss", device="cpu", **options):
        """Load experts from a checkpoint; see :func:`torch_bq.nn.expert_checkpoint.load_experts`."""
        from .expert_checkpoint import load_experts

        return load_experts(cls, source, prefix, layout=layout, device=device, **options)


class FP8Experts(_RecordsBlock, _Experts):
    """Experts with block-scaled fp8 weights.

    State as :class:`FP4Experts` with ``gate_up_proj`` ``float8_e4m3fn [E, 2I, H]``,
    ``gate_up_proj_scale`` ``[E, ceil(2I/bn), ceil(H/bk)]``, ``down_proj``
    ``float8_e4m3fn [E, H, I]``, ``down_proj_scale`` ``[E, ceil(H/bn), ceil(I/bk)]``;
    scales are e8m0 or float32 (``scale_dtype``), always multiplied. With
    ``activation="swiglu"`` (the default here) and ``I % bn != 0`` the last scale
    block row of ``w1`` would also cover ``w3``'s first rows, so build such layers
    with ``bn`` dividing ``I``.

    Args:
        num_experts, hidden_size, intermediate_size, bias, activation, act_quant,
        act_peak, device, dtype: as :class:`FP4Experts` (``activation`` defaults to ``"swiglu"``).
        block: ``(bn, bk)`` of every expert weight, e.g. ``(32, 32)`` or ``(128, 128)``.
        scale_dtype: ``torch.float8_e8m0fnu`` (default) or ``torch.float32``.
    """

    format = formats.FP8
    format_name = format.name

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = False,
        *,
        activation: str = "swiglu",
        block: Sequence[int] = formats.FP8.default_block,
        scale_dtype: torch.dtype = torch.float8_e8m0fnu,
        act_quant: bool = True,
        act_peak: float = formats.DEFAULT_ACT_PEAK,
        device=None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        scale_dtype = formats.FP8.scale_encoding(scale_dtype, "scale_dtype").dtype  # uint8 -> e8m0
        self.block: Tuple[int, int] = formats.FP8.resolve_block(block)
        self.scale_dtype = scale_dtype
        super().__init__(num_experts, hidden_size, intermediate_size, bias, activation, act_quant, act_peak,
                         device, dtype)

    def _empty_weight(self, n, k, device):
        e = self.num_experts
        data = torch.zeros(e, n, k, dtype=self.format.element.dtype, device=device)
        grid = self.format.scale_shape(n, k, self.block)
        if self.scale_dtype == torch.float32:
            return data, torch.ones(e, *grid, dtype=torch.float32, device=device)
        code = torch.full((e, *grid), formats.E8M0_BIAS, dtype=torch.uint8, device=device)
        return data, code.view(torch.float8_e8m0fnu)

    def _normalize_weight(self, data, scale, name):
        fmt = self.format
        fmt.check_data_dtype(data, name)
        if fmt.scale_encoding(scale, f"{name}_scale").dtype != self.scale_dtype:
            raise TypeError(f"{name}_scale: expected dtype {self.scale_dtype} (scale_dtype), got {scale.dtype}")
        return data.view(fmt.element.dtype), scale.view(self.scale_dtype)

    def _grouped_linear(self, rows, weight, scale, offsets, bias) -> torch.Tensor:
        return ops.fp8_grouped_linear(rows, weight, scale, offsets, bias, block=self.block,
                                      act_quant=self.act_quant, act_peak=self.act_peak, out_dtype=torch.float32)

    def _format_repr(self) -> str:
        return self.format.describe(self.block, self.format.scale_encoding(self.scale_dtype)).removeprefix("format=")

    @classmethod
    def from_quantized(
        cls,
        gate_up_proj: torch.Tensor,
        gate_up_proj_scale: torch.Tensor,
        down_proj: torch.Tensor,
        down_proj_scale: torch.Tensor,
        gate_up_proj_bias: Optional[torch.Tensor] = None,
        down_proj_bias: Optional[torch.Tensor] = None,
        *,
        block: Sequence[int] = formats.FP8.default_block,
        name: str = "experts",
        **options,
    ) -> "FP8Experts":
        """Wrap stacked fp8 storage (no copy) after checking dtypes, shapes and NaN codes.

        Args:
            gate_up_proj: ``[E, 2I, H]`` ``float8_e4m3fn`` (or ``uint8`` bytes).
            gate_up_proj_scale: ``[E, ceil(2I/bn), ceil(H/bk)]`` e8m0 or float32.
            down_proj, down_proj_scale: ``[E, H, I]`` and ``[E, ceil(H/bn), ceil(I/bk)]``.
            gate_up_proj_bias, down_proj_bias: ``[E, 2I]`` / ``[E, H]`` or ``None``.
            block: ``(bn, bk)`` the scales cover.
            name: prefix for error messages.
            options: ``activation``, ``act_quant``, ``act_peak`` as in the constructor.
        """
        _check_stacked(gate_up_proj, down_proj)
        sizes = (gate_up_proj.shape[0], gate_up_proj.shape[2], down_proj.shape[2])
        scale_dtype = formats.FP8.scale_encoding(gate_up_proj_scale, "gate_up_proj_scale").dtype
        tensors = dict(gate_up_proj=gate_up_proj, gate_up_proj_scale=gate_up_proj_scale, down_proj=down_proj,
                       down_proj_scale=down_proj_scale, gate_up_proj_bias=gate_up_proj_bias,
                       down_proj_bias=down_proj_bias)
        return cls._from_stacked(tensors, name=name, scan_codes=True, sizes=sizes, block=block,
                                 scale_dtype=scale_dtype, **options)

    @classmethod
    def from_weights(
        cls,
        gate_up_proj: torch.Tensor,
        down_proj: torch.Tensor,
        gate_up_proj_bias: Optional[torch.Tensor] = None,
        down_proj_bias: Optional[torch.Tensor] = None,
        *,
        block: Sequence[int] = formats.FP8.default_block,
        scale_dtype: torch.dtype = torch.float8_e8m0fnu,
        **options,
    ) -> "FP8Experts":
        """Quantize float expert weights with :func:`torch_bq.formats.quantize_fp8`.

        Args:
            gate_up_proj: ``[E, 2I, H]`` float, rows laid out for ``options["activation"]``.
            down_proj: ``[E, H, I]`` float.
            gate_up_proj_bias, down_proj_bias: ``[E, 2I]`` / ``[E, H]`` or ``None`` (kept as is).
            block, scale_dtype: the fp8 block and scale storage.
            options: constructor options (``activation``, ``act_quant``, ...).
        """
        tensors = {"gate_up_proj_bias": gate_up_proj_bias, "down_proj_bias": down_proj_bias}
        sizes = _float_sizes(gate_up_proj, down_proj)
        for proj, w in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
            data, scale = zip(*(formats.quantize_fp8(w[e], block, scale_dtype) for e in range(w.shape[0])))
            tensors[proj], tensors[f"{proj}_scale"] = torch.stack(data), torch.stack(scale)
        return cls._from_stacked(tensors, name="experts", scan_codes=False, sizes=sizes, block=block,
                                 scale_dtype=scale_dtype, **options)

    @classmethod
    def from_checkpoint(cls, source, prefix: str, *, layout: str = "deepseek", device="cpu", **options):
        """Load experts from a checkpoint; see :func:`torch_bq.nn.expert_checkpoint.load_experts`."""
        from .expert_checkpoint import load_experts

        return load_experts(cls, source, prefix, layout=layout, device=device, **options)


def _check_stacked(gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> None:
    for name, t in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
        if t.dim() != 3:
            raise ValueError(f"{name}: expected a stacked 3-D [E, N, .] tensor, got shape {list(t.shape)}")


def _float_sizes(gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> Tuple[int, int, int]:
    """``(E, H, I)`` of float weights ``[E, 2I, H]`` / ``[E, H, I]``, checking they agree."""
    if gate_up_proj.dim() != 3 or gate_up_proj.shape[1] % 2:
        raise ValueError(f"gate_up_proj: expected shape [E, 2I, H], got {list(gate_up_proj.shape)}")
    e, two_i, h = gate_up_proj.shape
    if tuple(down_proj.shape) != (e, h, two_i // 2):
        raise ValueError(f"down_proj: expected shape {[e, h, two_i // 2]} ([E, H, I]), got {list(down_proj.shape)}")
    return e, h, two_i // 2
