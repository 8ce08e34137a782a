"""Drop-in linear modules on block-quantized weights: ``FP8Linear``, ``FP4Linear``, ``NVFP4Linear``, ``BF16Linear``.

Each module holds its weight exactly as the formats of docs/contract.md §1 store it and
calls one ``torch_bq::`` op in ``forward``; nothing is dequantized up front.

State (names as in ``state_dict``):

=============  ===================================  ======================================
module         ``weight``                           ``weight_scale`` (always multiplied)
=============  ===================================  ======================================
FP8Linear      ``float8_e4m3fn [N, K]``             e8m0 ``float8_e8m0fnu`` or ``float32``
                                                    ``[ceil(N/bn), ceil(K/bk)]``
FP4Linear      ``uint8 [N, ceil(K/2)]`` (packed)    ``float8_e8m0fnu [N, ceil(K/32)]``
NVFP4Linear    ``uint8 [N, ceil(K/2)]`` (packed)    ``float8_e4m3fn [N, ceil(K/16)]`` and
                                                    ``weight_scale_2`` ``float32`` scalar
BF16Linear     ``bfloat16`` or ``float32 [N, K]``   (none)
=============  ===================================  ======================================

plus an optional ``bias [N]``, and for ``FP8Linear`` the block ``[bn, bk]`` as the
module's ``_extra_state`` (an ``int64`` tensor), so that a state dict recorded with
one block never loads into a module with another. The shapes, dtypes and block
rules come from each format's descriptor (:mod:`torch_bq.formats.descriptor`).

The bias dtype defaults to ``torch.get_default_dtype()`` (float32), as in
``nn.Linear``, so a module built by the constructor and one built by
``from_linear`` hold the same bias; loading a bias whose values the module's bias
dtype cannot hold exactly is refused (use ``assign=True`` to take its dtype).

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
from ..checkpoint import CheckpointError, LinearLayout, LinearWeights, Source, detect_linear, open_checkpoint, read_linear
from ..checkpoint.scan import scan_nan_codes

__all__ = [
    "FP8Linear",
    "FP4Linear",
    "NVFP4Linear",
    "BF16Linear",
    "FORMAT_CLASSES",
    "module_class_for",
    "check_module_class",
    "build_module",
    "load_linear",
]

_OP_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Bound once: the eager path of an M = 1 call pays for every attribute lookup from a cold cache
# (dynamo-only, as in torch_bq/ops/linear.py: other tracing reaches the direct call with fake
# tensors under a mode, which it declines).
_dynamo_tracing = torch.compiler.is_dynamo_compiling
_fp8_linear_direct = ops.fp8_linear_direct
_fp4_linear_direct = ops.fp4_linear_direct

# Same-itemsize integer views used to hide stored dtypes from module-wide casts.
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def op_out_dtype(x: torch.Tensor) -> torch.dtype:
    """The op's ``out_dtype`` for input ``x``: the input dtype where the op can emit it."""
    return x.dtype if x.dtype in _OP_OUT_DTYPES else torch.float32


def finish_output(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The op's output ``y`` in the input's dtype (a module's output follows its input)."""
    # float64 inputs (gradcheck, numerics tests) come back as float64; the op
    # itself computes in float32 and rounds once, so this cast adds nothing.
    return y if y.dtype == x.dtype else y.to(x.dtype)


def _quantized_tensors(module: nn.Module) -> tuple:
    """``(weight, weight_scale, bias)`` of a quantized linear module, read from its ``_buffers``:
    ``module.weight`` is a ``Module.__getattr__`` call, which costs microseconds from a cold cache.
    Where one of them has been moved out of the buffers (made a parameter, say), the attributes."""
    buffers = module._buffers
    try:
        return buffers["weight"], buffers["weight_scale"], buffers["bias"]
    except KeyError:
        return module.weight, module.weight_scale, module.bias


def _check_features(in_features: int, out_features: int) -> None:
    for name, value in (("in_features", in_features), ("out_features", out_features)):
        # 0 is allowed, as for nn.Linear: K = 0 gives the bias (or zeros), N = 0 an empty output
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name}: expected a non-negative int, got {value!r}")


def _bias_buffer(bias: bool, out_features: int, device, dtype) -> Optional[torch.Tensor]:
    # nn.Linear's default: the bias of from_linear(nn.Linear(...)) has this dtype too.
    dtype = torch.get_default_dtype() if dtype is None else dtype
    return torch.zeros(out_features, device=device, dtype=dtype) if bias else None


def _check_bias_exact(incoming: torch.Tensor, current: torch.Tensor) -> None:
    """Refuse to copy a bias into a dtype that would round it (``load_state_dict`` copies in place)."""
    if incoming.dtype == current.dtype or incoming.is_meta:
        return
    back = incoming.to(current.dtype).to(incoming.dtype)
    same = (back == incoming) | (torch.isnan(back) & torch.isnan(incoming))
    if not bool(same.all()):
        raise TypeError(
            f"bias: this module stores a {current.dtype} bias but the state dict holds {incoming.dtype} values "
            f"that {current.dtype} cannot hold exactly; build the module with dtype={incoming.dtype} or load "
            f"with assign=True"
        )


class _QuantizedLinear(nn.Module):
    """Shared plumbing: cast-proof storage, alias-aware state-dict loading, validation."""

    in_features: int
    out_features: int
    #: buffers whose dtype is part of the format and must survive module-wide casts
    _stored = ("weight", "weight_scale")
    #: checkpoint names accepted by ``load_state_dict`` for each buffer
    _aliases: Mapping[str, Sequence[str]] = {}
    #: the weight format (a :class:`torch_bq.formats.WeightFormat`)
    format: formats.WeightFormat

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
            self._check_recorded_block(state_dict, prefix)
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
            if "bias" in incoming and self._buffers.get("bias") is not None and not assign:
                _check_bias_exact(incoming["bias"], self._buffers["bias"])
        except (ValueError, TypeError) as e:
            # Nothing of this module is assigned when its state is invalid; messages
            # start with the local tensor name, so the prefix makes them global.
            error_msgs.append(f"{prefix}{e}")
            return
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    # -- the block as extra state (modules with a free block: see _RecordsBlock) --

    #: whether the block is part of the state dict (formats whose block is not fixed)
    _records_block = False

    def _check_recorded_block(self, state_dict, prefix: str) -> None:
        key = prefix + "_extra_state"
        if not self._records_block:
            return
        if key not in state_dict:
            # A state dict that does not record a block (an older file, another library's
            # checkpoint): shapes are all there is to check, as before.
            state_dict[key] = self.get_extra_state()
            return
        recorded = state_dict[key]
        if not isinstance(recorded, torch.Tensor) or recorded.dtype.is_floating_point or recorded.numel() != 2:
            raise TypeError(f"_extra_state: expected the block as two ints [bn, bk], got {recorded!r}")
        block = tuple(int(v) for v in recorded.reshape(-1).tolist())
        if block != tuple(self.block):
            raise ValueError(
                f"_extra_state: the state dict was saved with block {block} but this module has block "
                f"{tuple(self.block)}; its scales would be applied to the wrong elements. Build the module "
                f"with block={block}"
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


class _RecordsBlock:
    """Mixin: the module's ``block`` is saved in its state dict as ``_extra_state`` (``int64 [bn, bk]``).

    ``load_state_dict`` compares it with the module's block before anything is
    assigned (:meth:`_QuantizedLinear._check_recorded_block`): scales of one block
    shape applied on another decode a different weight, silently, whenever the
    scale grids happen to have the same shape (``(96, 96)`` and ``(64, 64)`` on a
    128 x 128 weight both give 2 x 2).
    """

    _records_block = True

    def get_extra_state(self) -> torch.Tensor:
        return torch.tensor(self.block, dtype=torch.int64)

    def set_extra_state(self, state) -> None:
        # Already compared with self.block before any tensor was assigned.
        pass


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


class FP8Linear(_RecordsBlock, _QuantizedLinear):
    """``nn.Linear`` with a block-scaled fp8 e4m3 weight (docs/contract.md §1, §4).

    ``forward(x)``: ``x`` ``[..., K]`` any float dtype -> ``[..., N]`` of ``x.dtype``,
    computed by :func:`torch_bq.ops.fp8_linear` (activations round-tripped through
    fp8 in 1x32 blocks when ``act_quant``).

    Args:
        in_features: ``K``.
        out_features: ``N``.
        bias: whether the module holds a ``bias [N]`` (of ``dtype``).
        block: scale block ``(bn, bk)``: ``(32, 32)`` (default), ``(128, 128)`` (DeepSeek-V3),
            ``(1, 32)`` (MXFP8) or any other. Recorded in the state dict (``_extra_state``).
        scale_dtype: ``torch.float8_e8m0fnu`` (power-of-two codes) or ``torch.float32``
            (DeepSeek-V3's ``weight_scale_inv``, multiplied despite the name).
        act_quant: quantize activations to fp8 before the matmul.
        act_peak: the activation qdq peak (224 default: Trainium2's fp8; up to 448).
        device: where to allocate; ``"meta"`` allocates nothing.
        dtype: dtype of ``bias`` (default ``torch.get_default_dtype()``, as ``nn.Linear``).

    A freshly built module holds a zero weight with unit scales; fill it with
    :meth:`from_linear`, :meth:`from_quantized`, :meth:`from_checkpoint` or
    ``load_state_dict``.
    """

    format = formats.FP8
    _aliases = {"weight_scale": tuple(s.lstrip(".") for s in formats.FP8.suffixes.scale[1:])}

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        block: Sequence[int] = formats.FP8.default_block,
        scale_dtype: torch.dtype = torch.float8_e8m0fnu,
        act_quant: bool = True,
        act_peak: float = formats.DEFAULT_ACT_PEAK,
        device=None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        _check_features(in_features, out_features)
        scale_dtype = formats.FP8.scale_encoding(scale_dtype, "scale_dtype").dtype  # uint8 -> e8m0
        formats.check_peak(act_peak)
        self.in_features = in_features
        self.out_features = out_features
        self.block = formats.FP8.resolve_block(block)
        self.act_quant = bool(act_quant)
        self.act_peak = float(act_peak)
        weight = torch.zeros(out_features, in_features, device=device, dtype=torch.float8_e4m3fn)
        scale = _unit_scale(formats.FP8.scale_shape(out_features, in_features, self.block), scale_dtype, device)
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", scale)
        self.register_buffer("bias", _bias_buffer(bias, out_features, device, dtype))

    @property
    def scale_dtype(self) -> torch.dtype:
        return self.weight_scale.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        # op_out_dtype / finish_output inlined, and the op's eager fast path tried first: at M = 1
        # every Python call and tensor attribute read costs microseconds from a cold cache.
        out_dtype = dtype if dtype in _OP_OUT_DTYPES else torch.float32
        y = None
        if not _dynamo_tracing():
            weight, scale, bias = _quantized_tensors(self)
            y = _fp8_linear_direct(x, weight, scale, bias, self.block, self.act_quant, self.act_peak, out_dtype)
        if y is None:
            y = ops.fp8_linear(
                x,
                self.weight,
                self.weight_scale,
                self.bias,
                block=self.block,
                act_quant=self.act_quant,
                act_peak=self.act_peak,
                out_dtype=out_dtype,
            )
        return y if out_dtype == dtype else y.to(dtype)

    def extra_repr(self) -> str:
        spec = self.format.describe(self.block, self.format.scale_encoding(self.weight_scale))
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, {self._bias_repr()}, "
            f"{spec}, {_act_repr(self.act_quant, self.act_peak)}"
        )

    # -- construction ------------------------------------------------------------

    @classmethod
    def from_quantized(
        cls,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: Optional[torch.Tensor] = None,
        *,
        block: Sequence[int] = formats.FP8.default_block,
        act_quant: bool = True,
        act_peak: float = formats.DEFAULT_ACT_PEAK,
        name: str = "weight",
        scan_codes: bool = True,
    ) -> "FP8Linear":
        """Wrap existing fp8 storage (no copy) after checking dtypes, shapes and NaN codes.

        Args:
            weight: ``[N, K]`` ``float8_e4m3fn`` or its ``uint8`` bytes.
            weight_scale: ``[ceil(N/bn), ceil(K/bk)]`` e8m0 (``float8_e8m0fnu``/``uint8``) or
                ``float32``, multiplied.
            bias: ``[N]`` float or ``None``.
            block: ``(bn, bk)`` the scales cover.
            name: the tensor's name in error messages (e.g. its checkpoint key).
            scan_codes: scan for NaN codes (``False`` only for tensors already scanned,
                as :meth:`from_weights` does for a loader's :class:`LinearWeights`).
        """
        fmt = cls.format
        block = fmt.resolve_block(block)
        fmt.check(weight, weight_scale, block=block, name=name)
        if scan_codes and not weight.is_meta:
            scan_nan_codes(weight, weight_scale, name=name, fmt=fmt.name)
        n, k = weight.shape
        bias = cls._bias_from(bias, n)
        scale_dtype = fmt.scale_encoding(weight_scale).dtype
        module = cls(
            k, n, bias is not None, block=block, scale_dtype=scale_dtype, act_quant=act_quant,
            act_peak=act_peak, device="meta", dtype=bias.dtype if bias is not None else None,
        )
        module.weight = weight.view(fmt.element.dtype)
        module.weight_scale = weight_scale.view(scale_dtype)
        module.bias = bias
        return module

    @classmethod
    def from_weights(cls, weights: LinearWeights, *, act_quant: Optional[bool] = None,
                     act_peak: Optional[float] = None, checked: bool = False) -> "FP8Linear":
        """Build from a loader's :class:`~torch_bq.checkpoint.LinearWeights` (no copy, no second NaN scan).

        ``checked=True`` says the caller already ran :func:`check_module_class` on the layout.
        """
        if not checked:
            check_module_class(cls, weights.layout)
        return cls.from_quantized(
            weights.weight, weights.scale, weights.bias, block=weights.block, name=weights.layout.weight_name,
            scan_codes=not weights.scanned, **_module_options(act_quant, act_peak),
        )

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        block: Sequence[int] = formats.FP8.default_block,
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
        """Load ``prefix`` from a checkpoint; see :func:`load_linear`.

        ``options`` are ``block`` (when the checkpoint records none), ``format="fp8"``
        (e4m3 bytes stored as uint8), ``expert``, ``rows``/``cols`` (a tensor-parallel
        shard), ``act_quant`` and ``act_peak``.
        """
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
        return _normalize_stored(self.format, name, tensor)

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
        self.format.check(weight, scale, block=self.block)
        if not weight.is_meta and not scale.is_meta:
            scan_nan_codes(weight if "weight" in incoming else None,
                           scale if "weight_scale" in incoming else None, fmt=self.format.name)


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
        dtype: dtype of ``bias`` (default ``torch.get_default_dtype()``, as ``nn.Linear``).
    """

    format = formats.FP4
    _aliases = {"weight_scale": tuple(s.lstrip(".") for s in formats.FP4.suffixes.scale[1:])}

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        act_quant: bool = True,
        act_peak: float = formats.DEFAULT_ACT_PEAK,
        device=None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        _check_features(in_features, out_features)
        formats.check_peak(act_peak)
        self.in_features = in_features
        self.out_features = out_features
        self.act_quant = bool(act_quant)
        self.act_peak = float(act_peak)
        fmt = self.format
        weight = torch.zeros(fmt.data_shape(out_features, in_features), device=device, dtype=fmt.element.dtype)
        scale = _unit_scale(fmt.scale_shape(out_features, in_features), fmt.scales[0].dtype, device)
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", scale)
        self.register_buffer("bias", _bias_buffer(bias, out_features, device, dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        out_dtype = dtype if dtype in _OP_OUT_DTYPES else torch.float32
        y = None
        if not _dynamo_tracing():
            weight, scale, bias = _quantized_tensors(self)
            y = _fp4_linear_direct(x, weight, scale, bias, self.act_quant, self.act_peak, out_dtype)
        if y is None:
            y = ops.fp4_linear(
                x,
                self.weight,
                self.weight_scale,
                self.bias,
                act_quant=self.act_quant,
                act_peak=self.act_peak,
                out_dtype=out_dtype,
            )
        return y if out_dtype == dtype else y.to(dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, {self._bias_repr()}, "
            f"{self.format.describe()}, {_act_repr(self.act_quant, self.act_peak)}"
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
        scan_codes: bool = True,
    ) -> "FP4Linear":
        """Wrap existing MXFP4 storage (no copy) after checking dtypes, shapes and NaN codes.

        Args:
            weight: ``[N, ceil(K/2)]`` packed bytes (``uint8``/``int8``/``float4_e2m1fn_x2``).
            weight_scale: ``[N, ceil(K/32)]`` e8m0 (``float8_e8m0fnu``/``uint8``).
            bias: ``[N]`` float or ``None``.
            in_features: ``K``; defaults to ``2 * weight.shape[1]``.
            name: the tensor's name in error messages.
            scan_codes: scan for NaN codes (``False`` only for tensors already scanned).
        """
        fmt = cls.format
        k = fmt.check(weight, weight_scale, in_features=in_features, name=name)
        if scan_codes and not weight.is_meta:
            scan_nan_codes(weight, weight_scale, name=name, fmt=fmt.name, in_features=k)
        n = weight.shape[0]
        bias = cls._bias_from(bias, n)
        module = cls(
            k, n, bias is not None, act_quant=act_quant, act_peak=act_peak, device="meta",
            dtype=bias.dtype if bias is not None else None,
        )
        module.weight = weight.view(fmt.element.dtype)
        module.weight_scale = weight_scale.view(fmt.scales[0].dtype)
        module.bias = bias
        return module

    @classmethod
    def from_weights(cls, weights: LinearWeights, *, act_quant: Optional[bool] = None,
                     act_peak: Optional[float] = None, checked: bool = False) -> "FP4Linear":
        """Build from a loader's :class:`~torch_bq.checkpoint.LinearWeights` (no copy, no second NaN scan)."""
        if not checked:
            check_module_class(cls, weights.layout)
        return cls.from_quantized(
            weights.weight, weights.scale, weights.bias, in_features=weights.in_features,
            name=weights.layout.weight_name, scan_codes=not weights.scanned, **_module_options(act_quant, act_peak),
        )

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
        """Load ``prefix`` from a checkpoint; see :func:`load_linear`.

        ``options`` are ``expert`` (gpt-oss stacked experts), ``in_features``,
        ``rows``/``cols`` (a tensor-parallel shard), ``act_quant`` and ``act_peak``.
        """
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
        return _normalize_stored(self.format, name, tensor)

    def _validate_loaded(self, incoming, assign):
        weight = incoming.get("weight", self.weight)
        scale = incoming.get("weight_scale", self.weight_scale)
        expected = self.format.data_shape(self.out_features, self.in_features)
        if tuple(weight.shape) != expected:
            raise ValueError(f"weight: expected shape {list(expected)}, got {list(weight.shape)}")
        self.format.check(weight, scale, in_features=self.in_features)
        if not weight.is_meta and not scale.is_meta:
            scan_nan_codes(weight if "weight" in incoming else None,
                           scale if "weight_scale" in incoming else None,
                           fmt=self.format.name, in_features=self.in_features)



# =========================================================================== #
# NVFP4Linear
# =========================================================================== #


class NVFP4Linear(_QuantizedLinear):
    """``nn.Linear`` with an NVIDIA NVFP4 weight (ModelOpt checkpoints): e2m1 pairs, 1x16 e4m3
    block scales and a float32 per-tensor scale, both multiplied.

    ``forward(x)``: ``x`` ``[..., K]`` any float dtype -> ``[..., N]`` of ``x.dtype``, computed
    by :func:`torch_bq.ops.nvfp4_linear`: W4A16 by default (bf16 activations), W4A8 with
    ``act_quant=True`` (the fp8 round trip of the contract). NVFP4 activation quantization
    (ModelOpt's ``input_scale``) is not implemented: an ``input_scale`` in a state dict is
    validated (float32 scalar, positive, finite) and ignored.

    A class of its own rather than an option of :class:`FP4Linear`: its state differs
    (an e4m3 scale grid of 1x16 blocks plus ``weight_scale_2``), so one class per format
    keeps ``load_state_dict``, the loader's format -> class mapping and ``extra_repr``
    free of mode switches.

    Args:
        in_features: ``K`` (may be odd: the last high nibble is zero padding).
        out_features: ``N``.
        bias: whether the module holds a ``bias [N]`` (of ``dtype``).
        act_quant: round-trip activations through fp8 before the matmul (default off).
        act_peak: the activation qdq peak.
        device: where to allocate; ``"meta"`` allocates nothing.
        dtype: dtype of ``bias`` (default ``torch.get_default_dtype()``).
    """

    format = formats.NVFP4
    _stored = ("weight", "weight_scale", "weight_scale_2")
    _ignored = tuple(s.lstrip(".") for s in formats.NVFP4.suffixes.ignored)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        act_quant: bool = False,
        act_peak: float = formats.DEFAULT_ACT_PEAK,
        device=None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        _check_features(in_features, out_features)
        formats.check_peak(act_peak)
        self.in_features = in_features
        self.out_features = out_features
        self.act_quant = bool(act_quant)
        self.act_peak = float(act_peak)
        fmt = self.format
        weight = torch.zeros(fmt.data_shape(out_features, in_features), device=device, dtype=fmt.element.dtype)
        scale = torch.ones(fmt.scale_shape(out_features, in_features), device=device, dtype=torch.float32)
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", scale.to(fmt.scales[0].dtype))
        self.register_buffer("weight_scale_2", torch.ones((), device=device, dtype=fmt.tensor_scale.dtype))
        self.register_buffer("bias", _bias_buffer(bias, out_features, device, dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = ops.nvfp4_linear(
            x,
            self.weight,
            self.weight_scale,
            self.weight_scale_2,
            self.bias,
            act_quant=self.act_quant,
            act_peak=self.act_peak,
            out_dtype=op_out_dtype(x),
        )
        return finish_output(y, x)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, {self._bias_repr()}, "
            f"{self.format.describe()}, {_act_repr(self.act_quant, self.act_peak)}"
        )

    @classmethod
    def from_quantized(
        cls,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        weight_scale_2: torch.Tensor,
        bias: Optional[torch.Tensor] = None,
        *,
        in_features: Optional[int] = None,
        act_quant: bool = False,
        act_peak: float = formats.DEFAULT_ACT_PEAK,
        name: str = "weight",
        scan_codes: bool = True,
    ) -> "NVFP4Linear":
        """Wrap existing NVFP4 storage (no copy) after checking dtypes, shapes and corrupt codes.

        Args:
            weight: ``[N, ceil(K/2)]`` packed bytes (``uint8``/``int8``/``float4_e2m1fn_x2``).
            weight_scale: ``[N, ceil(K/16)]`` ``float8_e4m3fn`` (or ``uint8`` bytes), positive finite.
            weight_scale_2: ``float32`` scalar (shape ``[]`` or ``[1]``), positive finite.
            bias: ``[N]`` float or ``None``.
            in_features: ``K``; defaults to ``2 * weight.shape[1]``.
            name: the tensor's name in error messages.
            scan_codes: scan for corrupt codes (``False`` only for tensors already scanned).
        """
        fmt = cls.format
        k = fmt.check(weight, weight_scale, in_features=in_features, tensor_scale=weight_scale_2, name=name)
        if scan_codes and not weight.is_meta:
            fmt.find_nan_codes(None, weight_scale, tensor_scale=weight_scale_2, name=name)
            scan_nan_codes(weight, None, name=name, fmt=fmt.name, in_features=k)
        n = weight.shape[0]
        bias = cls._bias_from(bias, n)
        module = cls(k, n, bias is not None, act_quant=act_quant, act_peak=act_peak, device="meta",
                     dtype=bias.dtype if bias is not None else None)
        module.weight = weight.view(fmt.element.dtype)
        module.weight_scale = weight_scale.view(fmt.scales[0].dtype)
        module.weight_scale_2 = weight_scale_2.reshape(())
        module.bias = bias
        return module

    @classmethod
    def from_weights(cls, weights: LinearWeights, *, act_quant: Optional[bool] = None,
                     act_peak: Optional[float] = None, checked: bool = False) -> "NVFP4Linear":
        """Build from a loader's :class:`~torch_bq.checkpoint.LinearWeights` (no copy, no second scan)."""
        if not checked:
            check_module_class(cls, weights.layout)
        return cls.from_quantized(
            weights.weight, weights.scale, weights.tensor_scale, weights.bias, in_features=weights.in_features,
            name=weights.layout.weight_name, scan_codes=not weights.scanned, **_module_options(act_quant, act_peak),
        )

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        weight_scale_2: Optional[torch.Tensor] = None,
        act_quant: bool = False,
        act_peak: float = formats.DEFAULT_ACT_PEAK,
    ) -> "NVFP4Linear":
        """Quantize an ``nn.Linear`` with :func:`torch_bq.formats.quantize_nvfp4`; the bias is kept as is."""
        _check_linear(linear)
        weight, scale, scale_2 = formats.quantize_nvfp4(linear.weight.detach(), weight_scale_2)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls.from_quantized(weight, scale, scale_2, bias, in_features=linear.in_features,
                                  act_quant=act_quant, act_peak=act_peak)

    @classmethod
    def from_checkpoint(cls, source, prefix: str, *, device="cpu", **options: Any) -> "NVFP4Linear":
        """Load ``prefix`` (the ModelOpt NVFP4 layout) from a checkpoint; see :func:`load_linear`."""
        return load_linear(cls, source, prefix, device=device, **options)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> nn.Linear:
        """An ``nn.Linear`` of ``dtype`` holding the decoded weight (exact in float32, the default).

        It computes ``F.linear`` without rounding activations, so it matches this module
        only up to the op's bf16 activation rounding and summation order.
        """
        w = formats.dequantize_nvfp4(self.weight, self.weight_scale, self.weight_scale_2, self.in_features,
                                     dtype=dtype)
        return _dense_linear(w, self.bias, dtype)

    def _normalize(self, name, tensor):
        if name == "weight_scale_2" and tensor.dim() == 1 and tensor.numel() == 1:
            return tensor.reshape(())  # ModelOpt files hold [] ; some exporters [1]
        return _normalize_stored(self.format, name, tensor)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        for name in self._ignored:
            t = state_dict.get(prefix + name)
            if t is None:
                continue
            try:
                _check_ignored_scale(t, name)
            except (ValueError, TypeError) as e:
                error_msgs.append(f"{prefix}{e}")
                return
            del state_dict[prefix + name]
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def _validate_loaded(self, incoming, assign):
        weight = incoming.get("weight", self.weight)
        scale = incoming.get("weight_scale", self.weight_scale)
        scale_2 = incoming.get("weight_scale_2", self.weight_scale_2)
        expected = self.format.data_shape(self.out_features, self.in_features)
        if tuple(weight.shape) != expected:
            raise ValueError(f"weight: expected shape {list(expected)}, got {list(weight.shape)}")
        self.format.check(weight, scale, in_features=self.in_features, tensor_scale=scale_2)
        if not any(t.is_meta for t in (weight, scale, scale_2)):
            self.format.find_nan_codes(None, scale if "weight_scale" in incoming else None,
                                       tensor_scale=scale_2 if "weight_scale_2" in incoming else None)
            scan_nan_codes(weight if "weight" in incoming else None, None, fmt=self.format.name,
                           in_features=self.in_features)


def _check_ignored_scale(t: torch.Tensor, name: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.numel() != 1:
        raise TypeError(f"{name}: expected a float32 scalar, got {getattr(t, 'dtype', type(t))} "
                        f"{list(getattr(t, 'shape', []))}")
    if not t.is_meta and not (torch.isfinite(t).all() and (t > 0).all()):
        raise ValueError(f"{name}: expected a positive finite scale, got {t.reshape(-1)[0].item()}")


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
        if dtype not in _DENSE_FORMATS:
            raise TypeError(f"dtype: expected torch.bfloat16 or torch.float32, got {dtype}")
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features, device=device, dtype=dtype))
        self.register_buffer("bias", _bias_buffer(bias, out_features, device, dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        op = ops.fp32w_linear if self.weight.dtype == torch.float32 else ops.bf16_linear
        return finish_output(op(x, self.weight, self.bias, out_dtype=op_out_dtype(x)), x)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, {self._bias_repr()}, "
            f"{self.format.describe()}"
        )

    @property
    def format(self) -> formats.WeightFormat:
        """``formats.FP32W`` for a float32 weight, else ``formats.BF16``."""
        return _DENSE_FORMATS[self.weight.dtype]

    @classmethod
    def from_quantized(cls, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                       name: str = "weight") -> "BF16Linear":
        """Wrap a ``bfloat16`` or ``float32`` ``[N, K]`` weight (no copy)."""
        if weight.dtype not in _DENSE_FORMATS:
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
    def from_weights(cls, weights: LinearWeights, *, act_quant: Optional[bool] = None,
                     act_peak: Optional[float] = None, checked: bool = False) -> "BF16Linear":
        """Build from a loader's dense :class:`~torch_bq.checkpoint.LinearWeights` (no copy)."""
        if not checked:
            check_module_class(cls, weights.layout)
        if act_quant is not None or act_peak is not None:
            raise TypeError(f"{weights.layout.weight_name}: act_quant/act_peak do not apply to a dense (BF16Linear) layer")
        return cls.from_quantized(weights.weight, weights.bias, name=weights.layout.weight_name)

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
        return load_linear(cls, source, prefix, device=device, **options)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> nn.Linear:
        """An ``nn.Linear`` of ``dtype`` with the weight rounded to bf16 (what the op computes with)."""
        return _dense_linear(self.weight.to(torch.bfloat16), self.bias, dtype)

    def _validate_loaded(self, incoming, assign):
        weight = incoming.get("weight")
        if weight is not None and weight.dtype not in _DENSE_FORMATS:
            raise TypeError(f"weight: expected dtype torch.bfloat16 or torch.float32, got {weight.dtype}")


#: the dense formats by the weight's storage dtype
_DENSE_FORMATS = {f.element.dtype: f for f in (formats.BF16, formats.FP32W)}


def _unit_scale(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """Scales of 1.0 in ``dtype`` (e8m0 code 127, or float32 1.0)."""
    if dtype == torch.float8_e8m0fnu:
        return torch.full(shape, formats.E8M0_BIAS, device=device, dtype=torch.uint8).view(dtype)
    return torch.ones(shape, device=device, dtype=torch.float32).to(dtype)


def _normalize_stored(fmt: formats.WeightFormat, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Byte-equivalent storage dtypes (``uint8`` e8m0 codes, ``int8`` fp4 pairs, ...) -> the module's."""
    if name == "weight" and tensor.dtype in fmt.element.storage:
        return tensor.view(fmt.element.dtype)
    if name == "weight_scale":
        for enc in fmt.scales:
            if tensor.dtype in enc.storage and tensor.dtype.itemsize == enc.dtype.itemsize:
                return tensor.view(enc.dtype)
    return tensor


def _dense_linear(weight: torch.Tensor, bias: Optional[torch.Tensor], dtype: torch.dtype) -> nn.Linear:
    n, k = weight.shape
    linear = nn.Linear(k, n, bias=bias is not None, device="meta", dtype=dtype)
    linear.weight = nn.Parameter(weight.to(dtype))
    if bias is not None:
        linear.bias = nn.Parameter(bias.detach().to(dtype).clone())
    return linear



def _module_options(act_quant: Optional[bool], act_peak: Optional[float]) -> dict:
    opts = {}
    if act_quant is not None:
        opts["act_quant"] = act_quant
    if act_peak is not None:
        opts["act_peak"] = act_peak
    return opts


# =========================================================================== #
# format -> class registry and checkpoint loading
# =========================================================================== #

#: format name -> the torch_bq module class that holds it (the one registry)
FORMAT_CLASSES = {"fp8": FP8Linear, "fp4": FP4Linear, "nvfp4": NVFP4Linear, "bf16": BF16Linear, "fp32w": BF16Linear}


def module_class_for(fmt: str):
    """The torch_bq module class for a format name."""
    if fmt not in FORMAT_CLASSES:
        raise ValueError(f"format: expected one of {sorted(FORMAT_CLASSES)}, got {fmt!r}")
    return FORMAT_CLASSES[fmt]


def check_module_class(cls, layout: LinearLayout) -> None:
    """Raise :class:`~torch_bq.checkpoint.CheckpointError` unless ``cls`` holds ``layout.format``.

    The one class check of every loading path (``from_checkpoint``, ``from_weights``,
    :func:`build_module`, ``load_quantized_``); it runs on the layout, before data is read.
    """
    expected = module_class_for(layout.format)
    if cls is not expected:
        hint = ""
        if layout.format == "fp4" and layout.source != "record" and cls is FP8Linear:
            hint = " (if these uint8 bytes are fp8 e4m3 codes, pass format='fp8')"
        raise CheckpointError(
            f"{layout.prefix}: the checkpoint holds {layout.format} weights ({layout.layout} layout"
            + (", recorded" if layout.source == "record" else "")
            + f"); load them with {expected.__name__}, not {cls.__name__}{hint}"
        )


def build_module(weights: LinearWeights, cls=None, *, device="cpu", act_quant: Optional[bool] = None,
                 act_peak: Optional[float] = None):
    """A torch_bq module holding ``weights`` (moved to ``device``); ``cls`` defaults from the format."""
    cls = module_class_for(weights.format) if cls is None else cls
    return cls.from_weights(weights, act_quant=act_quant, act_peak=act_peak).to(device)


def load_linear(cls, source: Source, prefix: str, *, device="cpu", expert: Optional[int] = None,
                block: Optional[Sequence[int]] = None, in_features: Optional[int] = None,
                format: Optional[str] = None,
                rows: Optional[Sequence[int]] = None, cols: Optional[Sequence[int]] = None,
                act_quant: Optional[bool] = None, act_peak: Optional[float] = None):
    """Build a ``cls`` module from layer ``prefix`` of ``source`` (the body of ``from_checkpoint``).

    Args:
        cls: ``FP8Linear``, ``FP4Linear`` or ``BF16Linear``; must match what the checkpoint holds.
        source: a ``.safetensors`` file, a directory (index or files; ``config.json``), a mapping,
            or a :class:`~torch_bq.checkpoint.CheckpointReader`.
        prefix: the layer's name in the checkpoint.
        device: where the module's tensors end up (read on CPU, then moved).
        expert: pick one expert of stacked tensors (gpt-oss ``_blocks``/``_scales``).
        block: fp8 block when the checkpoint records none (it must agree with a record).
        in_features: ``K`` for fp4 with odd ``K`` when not recorded.
        format: ``"fp8"`` for e4m3 bytes stored as uint8 in an unrecorded checkpoint.
        rows, cols: load only a tensor-parallel shard (see :func:`~torch_bq.checkpoint.read_linear`).
        act_quant, act_peak: module options (default: the module's defaults).
    """
    with open_checkpoint(source) as reader:
        layout = detect_linear(reader, prefix, expert=expert, block=block, in_features=in_features, format=format)
        check_module_class(cls, layout)  # from the headers, before any data is read
        weights = read_linear(reader, layout, rows=rows, cols=cols)
    return cls.from_weights(weights, act_quant=act_quant, act_peak=act_peak, checked=True).to(device)
