"""Drop-in linear modules on block-quantized weights: ``FP8Linear``, ``FP4Linear``, ``BF16Linear``.

Each module holds its weight exactly as the formats of docs/contract.md §1 store it and
calls one ``torch_bq::`` op in ``forward``; nothing is dequantized up front.

State (names as in ``state_dict``):

=============  ===================================  ======================================
module         ``weight``                           ``weight_scale`` (always multiplied)
=============  ===================================  ======================================
FP8Linear      ``float8_e4m3fn [N, K]``             e8m0 ``float8_e8m0fnu`` or ``float32``
                                                    ``[ceil(N/bn), ceil(K/bk)]``
FP4Linear      ``uint8 [N, ceil(K/2)]`` (packed)    ``float8_e8m0fnu [N, ceil(K/32)]``
BF16Linear     ``bfloat16`` or ``float32 [N, K]``   (none)
=============  ===================================  ======================================

plus an optional ``bias [N]``.

Why buffers and not frozen ``Parameter``s: a float8/uint8 tensor can never
require grad, so as a ``Parameter`` it would only mislead optimizers, PEFT and
FSDP, which treat every parameter as trainable storage. Persistent buffers are
in the ``state_dict``, move with ``.to(device)``, are created on ``meta`` and are
replaced wholesale by ``load_state_dict(assign=True)`` and ``to_empty``. The bias
is a buffer too: the weights are frozen (only the input gets a gradient), and
adapters such as LoRA add their own trainable parameters next to the module.

Dtype casts of a whole model (``model.to(torch.bfloat16)``, ``.half()``) would
otherwise convert the float8 / float32-scale storage too (they are floating
dtypes to torch) and silently destroy the weight; :meth:`_QuantizedLinear._apply`
shields the stored weight and scale from those casts while still moving them
between devices. The bias follows the cast, as in ``nn.Linear``.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch
from torch import nn

from .. import formats, ops
from .validation import scan_nan_codes

__all__ = ["FP8Linear", "FP4Linear", "BF16Linear"]

_OP_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Same-itemsize integer views used to hide stored dtypes from module-wide casts.
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _op_out_dtype(x: torch.Tensor) -> torch.dtype:
    """The op's ``out_dtype`` for input ``x``: the input dtype where the op can emit it."""
    return x.dtype if x.dtype in _OP_OUT_DTYPES else torch.float32


def _finish(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # float64 inputs (gradcheck, numerics tests) come back as float64; the op
    # itself computes in float32 and rounds once, so this cast adds nothing.
    return y if y.dtype == x.dtype else y.to(x.dtype)


def _check_features(in_features: int, out_features: int) -> None:
    for name, value in (("in_features", in_features), ("out_features", out_features)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")


def _bias_buffer(bias: bool, out_features: int, device, dtype) -> Optional[torch.Tensor]:
    return torch.zeros(out_features, device=device, dtype=dtype) if bias else None


class _QuantizedLinear(nn.Module):
    """Shared plumbing: cast-proof storage, alias-aware state-dict loading, validation."""

    in_features: int
    out_features: int
    #: buffers whose dtype is part of the format and must survive module-wide casts
    _stored = ("weight", "weight_scale")
    #: checkpoint names accepted by ``load_state_dict`` for each buffer
    _aliases: Mapping[str, Sequence[str]] = {}

    # -- dtype-cast shielding -------------------------------------------------

    def _apply(self, fn, recurse=True):
        hidden = {}
        for name in self._stored:
            t = self._buffers.get(name)
            if t is not None:
                hidden[name] = t.dtype
                self._buffers[name] = t.view(_INT_VIEW[t.element_size()])
        try:
            return super()._apply(fn, recurse)
        finally:
            for name, dtype in hidden.items():
                self._buffers[name] = self._buffers[name].view(dtype)

    # -- state dict ------------------------------------------------------------

    def _normalize(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Map an incoming tensor to this module's storage dtype where the bytes mean the same."""
        return tensor

    def _validate_loaded(self, tensors: dict[str, torch.Tensor], assign: bool) -> None:
        """Raise ``ValueError``/``TypeError`` if ``tensors`` cannot become this module's state."""

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        assign = bool(local_metadata.get("assign_to_params_buffers", False))
        try:
            for canonical, aliases in self._aliases.items():
                present = [a for a in aliases if prefix + a in state_dict]
                if not present:
                    continue
                if prefix + canonical in state_dict or len(present) > 1:
                    names = [prefix + n for n in (canonical, *present) if prefix + n in state_dict]
                    raise ValueError(f"{canonical}: the state dict holds more than one name for it: {names}")
                state_dict[prefix + canonical] = state_dict.pop(prefix + present[0])
            incoming = {}
            for name in (*self._stored, "bias"):
                if prefix + name in state_dict:
                    incoming[name] = self._normalize(name, state_dict[prefix + name])
                    state_dict[prefix + name] = incoming[name]
            self._validate_loaded(incoming, assign)
        except (ValueError, TypeError) as e:
            # Nothing of this module is assigned when its state is invalid; messages
            # start with the local tensor name, so the prefix makes them global.
            error_msgs.append(f"{prefix}{e}")
            return
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def _check_scale_dtype_change(self, incoming: dict[str, torch.Tensor], assign: bool) -> None:
        new = incoming.get("weight_scale")
        old = self._buffers.get("weight_scale")
        if new is not None and old is not None and new.dtype != old.dtype and not assign:
            raise TypeError(
                f"weight_scale: this module stores {old.dtype} scales but the state dict holds "
                f"{new.dtype}; build the module with scale_dtype={new.dtype} or load with assign=True"
            )

    # -- helpers ---------------------------------------------------------------

    @staticmethod
    def _bias_from(bias: Optional[torch.Tensor], out_features: int) -> Optional[torch.Tensor]:
        if bias is None:
            return None
        if not bias.dtype.is_floating_point:
            raise TypeError(f"bias: expected a floating-point dtype, got {bias.dtype}")
        if tuple(bias.shape) != (out_features,):
            raise ValueError(f"bias: expected shape [{out_features}], got {list(bias.shape)}")
        return bias

    def _bias_repr(self) -> str:
        return f"bias={self.bias is not None}"


def _check_linear(linear: nn.Module) -> None:
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"linear: expected a torch.nn.Linear, got {type(linear).__name__}")
    if linear.weight.is_meta:
        raise ValueError("linear: its weight is on the meta device; there is nothing to quantize")


def _act_repr(act_quant: bool, act_peak: float) -> str:
    return f"act_quant=fp8(peak={act_peak:g})" if act_quant else "act_quant=off"


# =========================================================================== #
# FP8Linear
# =========================================================================== #


class FP8Linear(_QuantizedLinear):
    """``nn.Linear`` with a block-scaled fp8 e4m3 weight (docs/contract.md §1, §4).

    ``forward(x)``: ``x`` ``[..., K]`` any float dtype -> ``[..., N]`` of ``x.dtype``,
    computed by :func:`torch_bq.ops.fp8_linear` (activations round-tripped through
    fp8 in 1x32 blocks when ``act_quant``).

    Args:
        in_features: ``K``.
        out_features: ``N``.
        bias: whether the module holds a ``bias [N]`` (of ``dtype``).
        block: scale block ``(bn, bk)``: ``(32, 32)`` (default), ``(128, 128)`` (DeepSeek-V3),
            ``(1, 32)`` (MXFP8) or any other.
        scale_dtype: ``torch.float8_e8m0fnu`` (power-of-two codes) or ``torch.float32``
            (DeepSeek-V3's ``weight_scale_inv``, multiplied despite the name).
        act_quant: quantize activations to fp8 before the matmul.
        act_peak: the activation qdq peak (224 default: Trainium2's fp8; up to 448).
        device: where to allocate; ``"meta"`` allocates nothing.
        dtype: dtype of ``bias``.

    A freshly built module holds a zero weight with unit scales; fill it with
    :meth:`from_linear`, :meth:`from_quantized`, :meth:`from_checkpoint` or
    ``load_state_dict``.
    """

    _aliases = {"weight_scale": ("weight_scale_inv", "scale")}

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        block: Sequence[int] = (32, 32),
        scale_dtype: torch.dtype = torch.float8_e8m0fnu,
        act_quant: bool = True,
        act_peak: float = formats.DEFAULT_ACT_PEAK,
        device=None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__()
        _check_features(in_features, out_features)
        if scale_dtype == torch.uint8:
            scale_dtype = torch.float8_e8m0fnu  # the same bytes
        if scale_dtype not in (torch.float8_e8m0fnu, torch.float32):
            raise TypeError(f"scale_dtype: expected torch.float8_e8m0fnu or torch.float32, got {scale_dtype}")
        formats.check_peak(act_peak)
        self.in_features = in_features
        self.out_features = out_features
        self.block = formats._check_block(block)
        self.act_quant = bool(act_quant)
        self.act_peak = float(act_peak)
        scale_shape = formats.fp8_scale_shape((out_features, in_features), self.block)
        weight = torch.zeros(out_features, in_features, device=device, dtype=torch.float8_e4m3fn)
        if scale_dtype == torch.float32:
            scale = torch.ones(scale_shape, device=device, dtype=torch.float32)
        else:
            code = torch.full(scale_shape, formats.E8M0_BIAS, device=device, dtype=torch.uint8)
            scale = code.view(torch.float8_e8m0fnu)
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", scale)
        self.register_buffer("bias", _bias_buffer(bias, out_features, device, dtype))

    @property
    def scale_dtype(self) -> torch.dtype:
        return self.weight_scale.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = ops.fp8_linear(
            x,
            self.weight,
            self.weight_scale,
            self.bias,
            block=self.block,
            act_quant=self.act_quant,
            act_peak=self.act_peak,
            out_dtype=_op_out_dtype(x),
        )
        return _finish(y, x)

    def extra_repr(self) -> str:
        scale = "e8m0" if self.weight_scale.dtype == torch.float8_e8m0fnu else "f32"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, {self._bias_repr()}, "
            f"format=fp8, block={self.block}, scale={scale}, {_act_repr(self.act_quant, self.act_peak)}"
        )

    # -- construction ------------------------------------------------------------

    @classmethod
    def from_quantized(
        cls,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: Optional[torch.Tensor] = None,
        *,
        block: Sequence[int] = (32, 32),
        act_quant: bool = True,
        act_peak: float = formats.DEFAULT_ACT_PEAK,
        name: str = "weight",
    ) -> "FP8Linear":
        """Wrap existing fp8 storage (no copy) after checking dtypes, shapes and NaN codes.

        Args:
            weight: ``[N, K]`` ``float8_e4m3fn`` or its ``uint8`` bytes.
            weight_scale: ``[ceil(N/bn), ceil(K/bk)]`` e8m0 (``float8_e8m0fnu``/``uint8``) or
                ``float32``, multiplied.
            bias: ``[N]`` float or ``None``.
            block: ``(bn, bk)`` the scales cover.
            name: the tensor's name in error messages (e.g. its checkpoint key).
        """
        block = formats._check_block(block)
        formats.check_fp8_weight(weight, weight_scale, block, name=name)
        if not weight.is_meta:
            scan_nan_codes(weight, weight_scale, name=name, fmt="fp8")
        n, k = weight.shape
        bias = cls._bias_from(bias, n)
        scale_dtype = torch.float32 if weight_scale.dtype == torch.float32 else torch.float8_e8m0fnu
        module = cls(
            k, n, bias is not None, block=block, scale_dtype=scale_dtype, act_quant=act_quant,
            act_peak=act_peak, device="meta", dtype=bias.dtype if bias is not None else torch.bfloat16,
        )
        module.weight = formats.as_fp8_bytes(weight, name).view(torch.float8_e4m3fn)
        module.weight_scale = weight_scale if scale_dtype == torch.float32 else weight_scale.view(torch.float8_e8m0fnu)
        module.bias = bias
        return module

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        block: Sequence[int] = (32, 32),
        scale_dtype: torch.dtype = torch.float8_e8m0fnu,
        act_quant: bool = True,
        act_peak: float = formats.DEFAULT_ACT_PEAK,
    ) -> "FP8Linear":
        """Quantize an ``nn.Linear`` (docs/contract.md §2 fp8 quantizer); the bias is kept as is."""
        _check_linear(linear)
        data, scale = formats.quantize_fp8(linear.weight.detach(), block, scale_dtype)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        module = cls.from_quantized(data, scale, bias, block=block, act_quant=act_quant, act_peak=act_peak)
        return module

    @classmethod
    def from_checkpoint(cls, source, prefix: str, *, device="cpu", **options: Any) -> "FP8Linear":
        """Load ``prefix`` from a checkpoint; see :func:`torch_bq.nn.checkpoint.load_linear`.

        ``options`` are ``block`` (when the checkpoint cannot say), ``expert``,
        ``rows``/``cols`` (a tensor-parallel shard), ``act_quant`` and ``act_peak``.
        """
        from .checkpoint import load_linear

        return load_linear(cls, source, prefix, device=device, **options)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> nn.Linear:
        """An ``nn.Linear`` of ``dtype`` holding the decoded weight and the bias.

        With e8m0 scales the decoded weight is exact in bf16 except at extreme scale codes
        (docs/contract.md §1); float32 scales that are
        not powers of two (DeepSeek-V3's ``weight_scale_inv``) give products that bf16
        rounds, so ask for ``dtype=torch.float32`` to get the values the op uses.
        It computes ``F.linear`` without activation quantization, so it matches this
        module (up to summation order) only when ``act_quant=False``.
        """
        w = formats.dequantize_fp8(self.weight, self.weight_scale, self.block, dtype=dtype)
        return _dense_linear(w, self.bias, dtype)

    # -- loading -----------------------------------------------------------------

    def _normalize(self, name, tensor):
        if name == "weight" and tensor.dtype == torch.uint8:
            return tensor.view(torch.float8_e4m3fn)
        if name == "weight_scale" and tensor.dtype == torch.uint8:
            return tensor.view(torch.float8_e8m0fnu)
        return tensor

    def _validate_loaded(self, incoming, assign):
        self._check_scale_dtype_change(incoming, assign)
        weight = incoming.get("weight", self.weight)
        scale = incoming.get("weight_scale", self.weight_scale)
        # The weight against the module first: checking the scale against a wrong weight
        # would blame the (correct) scale.
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"weight: expected shape [{self.out_features}, {self.in_features}], got {list(weight.shape)}"
            )
        formats.check_fp8_weight(weight, scale, self.block)
        if not weight.is_meta and not scale.is_meta:
            scan_nan_codes(weight if "weight" in incoming else None,
                           scale if "weight_scale" in incoming else None, fmt="fp8")


# =========================================================================== #
# FP4Linear
# =========================================================================== #


class FP4Linear(_QuantizedLinear):
    """``nn.Linear`` with an OCP MXFP4 weight: e2m1 pairs packed in bytes, 1x32 e8m0 scales.

    ``forward(x)``: ``x`` ``[..., K]`` any float dtype -> ``[..., N]`` of ``x.dtype``,
    computed by :func:`torch_bq.ops.fp4_linear` (W4A8 when ``act_quant``, the default).

    Args:
        in_features: ``K`` (may be odd: the last high nibble is zero padding).
        out_features: ``N``.
        bias: whether the module holds a ``bias [N]`` (of ``dtype``).
        act_quant: quantize activations to fp8 before the matmul.
        act_peak: the activation qdq peak.
        device: where to allocate; ``"meta"`` allocates nothing.
        dtype: dtype of ``bias``.
    """

    _aliases = {"weight_scale": ("scale",)}

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        act_quant: bool = True,
        act_peak: float = formats.DEFAULT_ACT_PEAK,
        device=None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__()
        _check_features(in_features, out_features)
        formats.check_peak(act_peak)
        self.in_features = in_features
        self.out_features = out_features
        self.act_quant = bool(act_quant)
        self.act_peak = float(act_peak)
        weight = torch.zeros(out_features, -(-in_features // 2), device=device, dtype=torch.uint8)
        code = torch.full(
            (out_features, -(-in_features // formats.FP4_BLOCK)), formats.E8M0_BIAS, device=device, dtype=torch.uint8
        )
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", code.view(torch.float8_e8m0fnu))
        self.register_buffer("bias", _bias_buffer(bias, out_features, device, dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = ops.fp4_linear(
            x,
            self.weight,
            self.weight_scale,
            self.bias,
            act_quant=self.act_quant,
            act_peak=self.act_peak,
            out_dtype=_op_out_dtype(x),
        )
        return _finish(y, x)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, {self._bias_repr()}, "
            f"format=mxfp4, block=(1, 32), {_act_repr(self.act_quant, self.act_peak)}"
        )

    @classmethod
    def from_quantized(
        cls,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: Optional[torch.Tensor] = None,
        *,
        in_features: Optional[int] = None,
        act_quant: bool = True,
        act_peak: float = formats.DEFAULT_ACT_PEAK,
        name: str = "weight",
    ) -> "FP4Linear":
        """Wrap existing MXFP4 storage (no copy) after checking dtypes, shapes and NaN codes.

        Args:
            weight: ``[N, ceil(K/2)]`` packed bytes (``uint8``/``int8``/``float4_e2m1fn_x2``).
            weight_scale: ``[N, ceil(K/32)]`` e8m0 (``float8_e8m0fnu``/``uint8``).
            bias: ``[N]`` float or ``None``.
            in_features: ``K``; defaults to ``2 * weight.shape[1]``.
            name: the tensor's name in error messages.
        """
        k = 2 * weight.shape[-1] if in_features is None else in_features
        formats.check_fp4_weight(weight, weight_scale, k, name=name)
        if not weight.is_meta:
            scan_nan_codes(weight, weight_scale, name=name, fmt="fp4", in_features=k)
        n = weight.shape[0]
        bias = cls._bias_from(bias, n)
        module = cls(
            k, n, bias is not None, act_quant=act_quant, act_peak=act_peak, device="meta",
            dtype=bias.dtype if bias is not None else torch.bfloat16,
        )
        module.weight = formats.as_fp4_bytes(weight, name)
        module.weight_scale = formats.as_e8m0_codes(weight_scale, f"{name}_scale").view(torch.float8_e8m0fnu)
        module.bias = bias
        return module

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        rounding: str = "ceil",
        act_quant: bool = True,
        act_peak: float = formats.DEFAULT_ACT_PEAK,
    ) -> "FP4Linear":
        """Quantize an ``nn.Linear`` (docs/contract.md §2 MXFP4 quantizer, ``rounding`` "ceil" or "floor")."""
        _check_linear(linear)
        packed, scale = formats.quantize_fp4(linear.weight.detach(), rounding)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls.from_quantized(
            packed, scale, bias, in_features=linear.in_features, act_quant=act_quant, act_peak=act_peak
        )

    @classmethod
    def from_checkpoint(cls, source, prefix: str, *, device="cpu", **options: Any) -> "FP4Linear":
        """Load ``prefix`` from a checkpoint; see :func:`torch_bq.nn.checkpoint.load_linear`.

        ``options`` are ``expert`` (gpt-oss stacked experts), ``in_features``,
        ``rows``/``cols`` (a tensor-parallel shard), ``act_quant`` and ``act_peak``.
        """
        from .checkpoint import load_linear

        return load_linear(cls, source, prefix, device=device, **options)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> nn.Linear:
        """An ``nn.Linear`` of ``dtype`` holding the decoded weight and the bias.

        The weight is exact in bf16 except at extreme scale codes (docs/contract.md §1).

        It computes ``F.linear`` without activation quantization, so it equals this
        module exactly only when ``act_quant=False``.
        """
        w = formats.dequantize_fp4(self.weight, self.weight_scale, self.in_features, dtype=dtype)
        return _dense_linear(w, self.bias, dtype)

    def _normalize(self, name, tensor):
        if name == "weight" and tensor.dtype in (torch.int8, torch.float4_e2m1fn_x2):
            return tensor.view(torch.uint8)
        if name == "weight_scale" and tensor.dtype == torch.uint8:
            return tensor.view(torch.float8_e8m0fnu)
        return tensor

    def _validate_loaded(self, incoming, assign):
        weight = incoming.get("weight", self.weight)
        scale = incoming.get("weight_scale", self.weight_scale)
        if tuple(weight.shape) != (self.out_features, -(-self.in_features // 2)):
            raise ValueError(
                f"weight: expected shape [{self.out_features}, {-(-self.in_features // 2)}], got {list(weight.shape)}"
            )
        formats.check_fp4_weight(weight, scale, self.in_features)
        if not weight.is_meta and not scale.is_meta:
            scan_nan_codes(weight if "weight" in incoming else None,
                           scale if "weight_scale" in incoming else None,
                           fmt="fp4", in_features=self.in_features)


# =========================================================================== #
# BF16Linear
# =========================================================================== #


class BF16Linear(_QuantizedLinear):
    """``nn.Linear`` on a bf16 weight through :func:`torch_bq.ops.bf16_linear`.

    A float32 weight is kept as float32 and narrowed to bf16 inside
    :func:`torch_bq.ops.fp32w_linear` (docs/contract.md §1 ``fp32w``). Activations are
    rounded to bf16, never quantized.

    Args:
        in_features: ``K``.
        out_features: ``N``.
        bias: whether the module holds a ``bias [N]``.
        device: where to allocate; ``"meta"`` allocates nothing.
        dtype: the weight's storage, ``torch.bfloat16`` (default) or ``torch.float32``;
            also the bias dtype.
    """

    _stored = ("weight",)

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, device=None,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        _check_features(in_features, out_features)
        if dtype not in (torch.bfloat16, torch.float32):
            raise TypeError(f"dtype: expected torch.bfloat16 or torch.float32, got {dtype}")
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features, device=device, dtype=dtype))
        self.register_buffer("bias", _bias_buffer(bias, out_features, device, dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        op = ops.fp32w_linear if self.weight.dtype == torch.float32 else ops.bf16_linear
        return _finish(op(x, self.weight, self.bias, out_dtype=_op_out_dtype(x)), x)

    def extra_repr(self) -> str:
        fmt = "fp32w" if self.weight.dtype == torch.float32 else "bf16"
        return f"in_features={self.in_features}, out_features={self.out_features}, {self._bias_repr()}, format={fmt}"

    @classmethod
    def from_quantized(cls, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                       name: str = "weight") -> "BF16Linear":
        """Wrap a ``bfloat16`` or ``float32`` ``[N, K]`` weight (no copy)."""
        if weight.dtype not in (torch.bfloat16, torch.float32):
            raise TypeError(f"{name}: expected dtype torch.bfloat16 or torch.float32, got {weight.dtype}")
        if weight.dim() != 2:
            raise ValueError(f"{name}: expected a 2-D [N, K] tensor, got shape {list(weight.shape)}")
        n, k = weight.shape
        bias = cls._bias_from(bias, n)
        module = cls(k, n, bias is not None, device="meta", dtype=weight.dtype)
        module.weight = weight
        module.bias = bias
        return module

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, keep_fp32: bool = False) -> "BF16Linear":
        """Wrap an ``nn.Linear``'s weight (copied), rounded to bf16 (``bf16_linear``).

        ``keep_fp32=True`` stores it as float32 instead (float16 widens exactly) and runs
        ``fp32w_linear``, which narrows to bf16 inside the op: the same results for twice
        the bytes. Float32 weights loaded with :meth:`from_checkpoint` or
        :meth:`from_quantized` stay float32 (``fp32w``).
        """
        _check_linear(linear)
        w = linear.weight.detach().to(torch.float32 if keep_fp32 else torch.bfloat16, copy=True)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls.from_quantized(w, bias)

    @classmethod
    def from_checkpoint(cls, source, prefix: str, *, device="cpu", **options: Any) -> "BF16Linear":
        """Load a dense ``prefix.weight`` (bf16, or float32 kept as fp32w; fp16 widens to float32)."""
        from .checkpoint import load_linear

        return load_linear(cls, source, prefix, device=device, **options)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> nn.Linear:
        """An ``nn.Linear`` of ``dtype`` with the weight rounded to bf16 (what the op computes with)."""
        return _dense_linear(self.weight.to(torch.bfloat16), self.bias, dtype)

    def _validate_loaded(self, incoming, assign):
        weight = incoming.get("weight")
        if weight is not None and weight.dtype not in (torch.bfloat16, torch.float32):
            raise TypeError(f"weight: expected dtype torch.bfloat16 or torch.float32, got {weight.dtype}")


def _dense_linear(weight: torch.Tensor, bias: Optional[torch.Tensor], dtype: torch.dtype) -> nn.Linear:
    n, k = weight.shape
    linear = nn.Linear(k, n, bias=bias is not None, device="meta", dtype=dtype)
    linear.weight = nn.Parameter(weight.to(dtype))
    if bias is not None:
        linear.bias = nn.Parameter(bias.detach().to(dtype).clone())
    return linear

