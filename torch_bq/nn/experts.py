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


class _Experts(nn.Module):
    """Shared forward, state layout and checks of :class:`FP4Experts` and :class:`FP8Experts`.

    Subclasses define the weight storage (``_weight_shapes``) and the grouped op call
    (``_grouped_linear``).
    """

    format_name = ""

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
            if int(value) < 1:
                raise ValueError(f"{name}: expected a positive int, got {value}")
        self.num_experts = int(num_experts)
        self.hidden_size = int(hidden_size)
        self.intermediate_size = int(intermediate_size)
        self.activation = activation
        self.act_quant = bool(act_quant)
        self.act_peak = float(act_peak)
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        for proj, (n, k) in (("gate_up_proj", (2 * i, h)), ("down_proj", (h, i))):
            (data_shape, data_dtype), (scale_shape, scale_dtype) = self._weight_shapes(n, k)
            self.register_parameter(proj, _frozen(torch.empty(e, *data_shape, dtype=data_dtype, device=device)))
            self.register_parameter(
                f"{proj}_scale", _frozen(torch.empty(e, *scale_shape, dtype=scale_dtype, device=device))
            )
            b = _frozen(torch.zeros(e, n, dtype=dtype, device=device)) if bias else None
            self.register_parameter(f"{proj}_bias", b)

    # -- format hooks ----------------------------------------------------------

    def _weight_shapes(self, n: int, k: int):
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
            routing_weights: ``[T, k]`` float mixing weights (used as given: apply
                softmax/normalisation before calling).

        Returns:
            ``[T, H]`` of ``hidden.dtype``.
        """
        _check_routing(hidden, expert_ids, routing_weights, self.hidden_size)
        if not torch.compiler.is_compiling():
            self._check_expert_ids(expert_ids)
        tokens, top_k = expert_ids.shape
        flat_ids = expert_ids.reshape(-1).long()
        # Stable sort keeps each expert's rows in token order (deterministic results).
        order = torch.argsort(flat_ids, stable=True)
        token_of_row = order // top_k
        rows = hidden.index_select(0, token_of_row)
        # Counting by scatter_add (not bincount) keeps the shape static: [E].
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
        return (
            f"num_experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}, "
            f"format={self._format_repr()}, activation={self.activation}, "
            f"bias={self.gate_up_proj_bias is not None}, act_quant={self.act_quant}"
        )

    def _format_repr(self) -> str:
        return self.format_name


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class FP4Experts(_Experts):
    """Experts with OCP MXFP4 weights (W4A8 by default): gpt-oss's expert layer.

    State (``E`` experts, hidden ``H``, intermediate ``I``):

    * ``gate_up_proj`` ``uint8 [E, 2I, ceil(H/2)]`` packed e2m1, ``gate_up_proj_scale``
      e8m0 ``[E, 2I, ceil(H/32)]``, ``gate_up_proj_bias`` ``[E, 2I]`` (if ``bias``);
    * ``down_proj`` ``uint8 [E, H, ceil(I/2)]``, ``down_proj_scale`` ``[E, H, ceil(I/32)]``,
      ``down_proj_bias`` ``[E, H]`` (if ``bias``).

    Row layout of ``gate_up_proj`` depends on ``activation`` (see :mod:`torch_bq.nn.experts`).

    Args:
        num_experts, hidden_size, intermediate_size: ``E``, ``H``, ``I``.
        bias: keep per-expert biases (gpt-oss has them; DeepSeek does not).
        activation: ``"gpt-oss"`` (clamped SwiGLU, interleaved rows) or ``"swiglu"``.
        act_quant, act_peak: activation qdq of both linears (SPEC.md §3).
        device: where to allocate (``"meta"`` works).
        dtype: dtype of the biases.
    """

    format_name = "fp4"

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

    def _weight_shapes(self, n: int, k: int):
        return ((n, -(-k // 2)), torch.uint8), ((n, -(-k // formats.FP4_BLOCK)), torch.float8_e8m0fnu)

    def _grouped_linear(self, rows, weight, scale, offsets, bias) -> torch.Tensor:
        return ops.fp4_grouped_linear(rows, weight, scale, offsets, bias, act_quant=self.act_quant,
                                      act_peak=self.act_peak, out_dtype=torch.float32)

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
        """Quantize float expert weights (``[E, 2I, H]`` and ``[E, H, I]``, rows laid out
        for ``options["activation"]``) to MXFP4 with :func:`torch_bq.formats.quantize_fp4`."""
        module = _from_weights_shell(cls, gate_up_proj, down_proj, gate_up_proj_bias, down_proj_bias, options)
        for proj, w in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
            packed, scale = zip(*(formats.quantize_fp4(w[e], rounding) for e in range(w.shape[0])))
            setattr(module, proj, _frozen(torch.stack(packed)))
            setattr(module, f"{proj}_scale", _frozen(torch.stack(scale)))
        return module


class FP8Experts(_Experts):
    """Experts with block-scaled fp8 weights.

    State as :class:`FP4Experts` with ``gate_up_proj`` ``float8_e4m3fn [E, 2I, H]``,
    ``gate_up_proj_scale`` ``[E, ceil(2I/bn), ceil(H/bk)]``, ``down_proj``
    ``float8_e4m3fn [E, H, I]``, ``down_proj_scale`` ``[E, ceil(H/bn), ceil(I/bk)]``;
    scales are e8m0 or float32 (``scale_dtype``), always multiplied.

    Args:
        num_experts, hidden_size, intermediate_size, bias, activation, act_quant,
        act_peak, device, dtype: as :class:`FP4Experts`.
        block: ``(bn, bk)`` of every expert weight, e.g. ``(32, 32)``, ``(128, 128)``.
        scale_dtype: ``torch.float8_e8m0fnu`` (default) or ``torch.float32``.
    """

    format_name = "fp8"

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = False,
        *,
        activation: str = "swiglu",
        block: Sequence[int] = (32, 32),
        scale_dtype: torch.dtype = torch.float8_e8m0fnu,
        act_quant: bool = True,
        act_peak: float = formats.DEFAULT_ACT_PEAK,
        device=None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        if len(block) != 2 or any(int(b) < 1 for b in block):
            raise ValueError(f"block: expected two positive ints (bn, bk), got {tuple(block)}")
        if scale_dtype not in (torch.float8_e8m0fnu, torch.uint8, torch.float32):
            raise TypeError(f"scale_dtype: expected torch.float8_e8m0fnu, torch.uint8 or torch.float32, "
                            f"got {scale_dtype}")
        self.block: Tuple[int, int] = (int(block[0]), int(block[1]))
        self.scale_dtype = scale_dtype
        super().__init__(num_experts, hidden_size, intermediate_size, bias, activation, act_quant, act_peak,
                         device, dtype)

    def _weight_shapes(self, n: int, k: int):
        return ((n, k), torch.float8_e4m3fn), (formats.fp8_scale_shape((n, k), self.block), self.scale_dtype)

    def _grouped_linear(self, rows, weight, scale, offsets, bias) -> torch.Tensor:
        return ops.fp8_grouped_linear(rows, weight, scale, offsets, bias, block=self.block,
                                      act_quant=self.act_quant, act_peak=self.act_peak, out_dtype=torch.float32)

    def _format_repr(self) -> str:
        return f"fp8 {self.block[0]}x{self.block[1]}"

    @classmethod
    def from_weights(
        cls,
        gate_up_proj: torch.Tensor,
        down_proj: torch.Tensor,
        gate_up_proj_bias: Optional[torch.Tensor] = None,
        down_proj_bias: Optional[torch.Tensor] = None,
        **options,
    ) -> "FP8Experts":
        """Quantize float expert weights (``[E, 2I, H]`` and ``[E, H, I]``, rows laid out
        for ``options["activation"]``) with :func:`torch_bq.formats.quantize_fp8`."""
        module = _from_weights_shell(cls, gate_up_proj, down_proj, gate_up_proj_bias, down_proj_bias, options)
        for proj, w in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
            data, scale = zip(*(formats.quantize_fp8(w[e], module.block, module.scale_dtype)
                                for e in range(w.shape[0])))
            setattr(module, proj, _frozen(torch.stack(data)))
            setattr(module, f"{proj}_scale", _frozen(torch.stack(scale)))
        return module


def _from_weights_shell(cls, gate_up_proj, down_proj, gate_up_proj_bias, down_proj_bias, options):
    """A module sized from float expert weights, built on ``meta``, biases already installed.

    The caller installs the quantized weights; every tensor ends up on ``gate_up_proj.device``.
    """
    if gate_up_proj.dim() != 3 or gate_up_proj.shape[1] % 2:
        raise ValueError(f"gate_up_proj: expected shape [E, 2I, H], got {list(gate_up_proj.shape)}")
    e, two_i, h = gate_up_proj.shape
    if tuple(down_proj.shape) != (e, h, two_i // 2):
        raise ValueError(f"down_proj: expected shape {[e, h, two_i // 2]} ([E, H, I]), got {list(down_proj.shape)}")
    if "device" in options:
        raise TypeError("device: from_weights keeps the weights' device; move the module with .to() afterwards")
    has_bias = gate_up_proj_bias is not None or down_proj_bias is not None
    module = cls(e, h, two_i // 2, has_bias, device="meta", **options)
    if has_bias:
        dtype = options.get("dtype", torch.bfloat16)
        for proj, b, n in (("gate_up_proj", gate_up_proj_bias, two_i), ("down_proj", down_proj_bias, h)):
            b = torch.zeros(e, n, dtype=dtype, device=gate_up_proj.device) if b is None else b
            if tuple(b.shape) != (e, n):
                raise ValueError(f"{proj}_bias: expected shape {[e, n]}, got {list(b.shape)}")
            setattr(module, f"{proj}_bias", _frozen(b.to(dtype)))
    return module
