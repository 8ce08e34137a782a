"""Weight formats as data: one frozen :class:`WeightFormat` per format, in one registry.

Every rule that depends on the format lives in its entry: the element encoding
and how elements pack into storage, the scale encodings and the scale block,
an optional second-level (per-tensor) scale, the range of scale codes whose
decoded products are exact in bf16, the canonical name and its aliases, and the
checkpoint tensor suffixes. Code that needs a shape, a dtype check, a block
default, a NaN-code scan or a display string asks the entry
(:func:`get_format`) instead of restating the rule::

    fmt = get_format("mxfp4")                  # the "fp4" entry
    fmt.data_shape(n, k)                       # (n, ceil(k / 2))
    fmt.scale_shape(n, k)                      # (n, ceil(k / 32))
    fmt.check(packed, scale, in_features=k)    # dtypes and shapes, named errors
    fmt.find_nan_codes(packed, scale, in_features=k)

The math of each format (docs/formats.md) is implemented by the codecs next to
this module; this module holds no tensor math beyond shape and dtype checks and
the NaN-code scan.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping, Optional, Sequence, Union

import torch

__all__ = [
    "cdiv",
    "MAX_BLOCK",
    "check_block",
    "ElementEncoding",
    "ScaleEncoding",
    "CheckpointSuffixes",
    "WeightFormat",
    "WeightSpec",
    "E4M3FN",
    "E2M1",
    "BF16_ELEMENT",
    "F32_ELEMENT",
    "E8M0",
    "F32_SCALE",
    "E4M3_SCALE",
    "FORMATS",
    "FP8",
    "MXFP8",
    "FP4",
    "NVFP4",
    "BF16",
    "FP32W",
    "get_format",
    "format_names",
    "dtype_error",
]


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints, ``b > 0`` (the one ceil division of torch_bq)."""
    return -(-a // b)


#: The largest block length: the ops pass blocks as int64 and the kernels compute
#: ``n + bn - 1`` in 64 bits, so lengths stay far below 2**63 (which was a schema error).
MAX_BLOCK = 2**31 - 1


def check_block(block: Sequence[int], name: str = "block") -> tuple[int, int]:
    """``block`` as ``(bn, bk)`` of ints in ``[1, MAX_BLOCK]``, or ``ValueError``/``TypeError`` naming ``name``."""
    try:
        parts = tuple(block)
    except TypeError:
        raise TypeError(f"{name}: expected two positive ints (bn, bk), got {block!r}") from None
    if len(parts) != 2:
        raise ValueError(f"{name}: expected two positive ints (bn, bk), got {parts}")
    out = []
    for b in parts:
        try:
            v = operator.index(b)  # ints and integer scalars; not floats, not bools
        except TypeError:
            v = None
        if v is None or isinstance(b, bool):
            raise TypeError(f"{name}: expected two positive ints (bn, bk), got {parts}")
        if v < 1:
            raise ValueError(f"{name}: expected two positive ints (bn, bk), got {parts}")
        if v > MAX_BLOCK:
            raise ValueError(f"{name}: expected two positive ints (bn, bk) of at most {MAX_BLOCK}, got {parts}")
        out.append(v)
    return out[0], out[1]


def dtype_error(name: str, tensor: torch.Tensor, allowed: Sequence[torch.dtype]) -> TypeError:
    """The ``TypeError`` for ``tensor`` (called ``name``) having none of the ``allowed`` dtypes."""
    names = ", ".join(str(d) for d in allowed)
    return TypeError(f"{name}: expected dtype in ({names}), got {tensor.dtype}")


# --------------------------------------------------------------------------- #
# encodings
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class ElementEncoding:
    """How one weight element is encoded and stored.

    Attributes:
        name: ``"e4m3"`` (OCP E4M3FN), ``"e2m1"``, ``"bf16"`` or ``"f32"``.
        bits: bits per element.
        storage: dtypes accepted for the data tensor (all the same bytes); the first
            is what modules store.
        per_item: elements per stored item along K (2 for e2m1 pairs in a byte, else 1).
        nibble_order: ``"low-first"``: element ``2j`` in the low nibble of byte ``j``
            (``None`` when an element fills its item).
        max_value: largest finite magnitude, or ``None`` for bf16/f32.
        lowest_bit_exp: ``e`` such that every finite value is a multiple of ``2**e``
            (2**-9 for e4m3fn's subnormals, 2**-1 for e2m1's 0.5); ``None`` for bf16/f32.
        nan_bytes: byte values that are NaN (``(0x7F, 0xFF)`` for e4m3fn), i.e. corruption.
    """

    name: str
    bits: int
    storage: tuple[torch.dtype, ...]
    per_item: int = 1
    nibble_order: Optional[str] = None
    max_value: Optional[float] = None
    lowest_bit_exp: Optional[int] = None
    nan_bytes: tuple[int, ...] = ()

    @property
    def dtype(self) -> torch.dtype:
        """The storage dtype modules hold."""
        return self.storage[0]

    def items(self, k: int) -> int:
        """Stored items holding ``k`` elements: ``ceil(k / per_item)``."""
        return cdiv(k, self.per_item)


@dataclass(frozen=True)
class ScaleEncoding:
    """How a scale is encoded; every scale of torch_bq is *multiplied* into the data.

    Attributes:
        name: ``"e8m0"`` (power-of-two codes ``2**(c - 127)``, 255 NaN), ``"f32"``
            (float32 multipliers, positive and finite) or ``"e4m3"`` (float8_e4m3fn,
            positive and finite, NVFP4's block scale).
        storage: accepted dtypes (the same meaning); the first is what modules store.
        power_of_two: every finite value is a power of two.
    """

    name: str
    storage: tuple[torch.dtype, ...]
    power_of_two: bool

    @property
    def dtype(self) -> torch.dtype:
        return self.storage[0]


E4M3FN = ElementEncoding(
    "e4m3", 8, (torch.float8_e4m3fn, torch.uint8), max_value=448.0, lowest_bit_exp=-9, nan_bytes=(0x7F, 0xFF)
)
E2M1 = ElementEncoding(
    "e2m1", 4, (torch.uint8, torch.int8, torch.float4_e2m1fn_x2), per_item=2, nibble_order="low-first",
    max_value=6.0, lowest_bit_exp=-1,
)
BF16_ELEMENT = ElementEncoding("bf16", 16, (torch.bfloat16,))
F32_ELEMENT = ElementEncoding("f32", 32, (torch.float32,))

E8M0 = ScaleEncoding("e8m0", (torch.float8_e8m0fnu, torch.uint8), power_of_two=True)
F32_SCALE = ScaleEncoding("f32", (torch.float32,), power_of_two=False)
E4M3_SCALE = ScaleEncoding("e4m3", (torch.float8_e4m3fn, torch.uint8), power_of_two=False)

_E8M0_BIAS = 127
_BF16_MAX_EXP = 127  # bf16 max = (2 - 2**-7) * 2**127
_BF16_MIN_EXP = -133  # smallest bf16 subnormal 2**-133


@dataclass(frozen=True)
class CheckpointSuffixes:
    """Tensor names of a layer ``p`` in checkpoints: ``p + suffix``.

    Attributes:
        weight: the data tensor.
        scale: the block-scale tensor, preferred name first (aliases after it).
        tensor_scale: the second-level per-tensor scale (NVFP4's ``weight_scale_2``).
        ignored: tensors that may sit next to the weight and are validated, then not
            used (NVFP4's ``input_scale``: torch_bq does not quantize activations to NVFP4).
        bias: the bias.
    """

    weight: str = ".weight"
    scale: tuple[str, ...] = ()
    tensor_scale: tuple[str, ...] = ()
    ignored: tuple[str, ...] = ()
    bias: str = ".bias"


# --------------------------------------------------------------------------- #
# the descriptor
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class WeightFormat:
    """One weight format. Frozen: entries are shared, compared by identity and hashed.

    Attributes:
        name: canonical name (``"fp8"``, ``"mxfp8"``, ``"fp4"``, ``"nvfp4"``, ``"bf16"``, ``"fp32w"``).
        aliases: other accepted names (``"mxfp4"`` for ``"fp4"``).
        family: the format whose ops and module run this one (``"mxfp8"`` runs as ``"fp8"``
            with block ``(1, 32)``); ``name`` itself for the others.
        element: the data's :class:`ElementEncoding`.
        scales: accepted block-scale encodings, the default first; ``()`` for dense formats.
        default_block: ``(bn, bk)`` when none is given; ``None`` for dense formats.
        block_fixed: the block is part of the format (MXFP4 1x32, NVFP4 1x16, MXFP8 1x32);
            otherwise any block is allowed (fp8).
        tensor_scale: encoding of the second-level per-tensor scale (NVFP4: float32
            scalar, multiplied after the block scale), or ``None``.
        suffixes: checkpoint tensor names.
        exact_dtype: a dtype that holds every decoded value exactly (for scale codes in
            :attr:`exact_codes`): bf16 for power-of-two scales, float32 for NVFP4.
        description: one line for docs and errors.
    """

    name: str
    aliases: tuple[str, ...]
    family: str
    element: ElementEncoding
    scales: tuple[ScaleEncoding, ...]
    default_block: Optional[tuple[int, int]]
    block_fixed: bool
    tensor_scale: Optional[ScaleEncoding] = None
    suffixes: CheckpointSuffixes = field(default_factory=CheckpointSuffixes)
    exact_dtype: torch.dtype = torch.bfloat16
    description: str = ""

    # -- basic properties --------------------------------------------------------

    @property
    def quantized(self) -> bool:
        """Whether the format has block scales (fp8, mxfp8, fp4, nvfp4)."""
        return bool(self.scales)

    @property
    def names(self) -> tuple[str, ...]:
        """The canonical name and the aliases."""
        return (self.name, *self.aliases)

    @property
    def packed(self) -> bool:
        """More than one element per stored item (the data has ``ceil(K / per_item)`` columns)."""
        return self.element.per_item > 1

    @property
    def exact_codes(self) -> Optional[tuple[int, int]]:
        """The e8m0 scale codes ``(lo, hi)``, inclusive, for which every element times the
        scale is exact in bf16; ``None`` when the scales are not e8m0.

        Below ``lo`` the element's lowest bit falls under bf16's smallest subnormal
        (2**-133); above ``hi`` the largest element overflows bf16. Derived from the
        element encoding: fp8 gives (3, 246), fp4 (0, 252). A kernel that decodes to
        bf16 serves codes outside this range some other exact way (or falls back).
        """
        if E8M0 not in self.scales or self.element.max_value is None:
            return None
        lo = max(0, _BF16_MIN_EXP - self.element.lowest_bit_exp + _E8M0_BIAS)
        top_exp = math.frexp(self.element.max_value)[1] - 1  # max = m * 2**top_exp, 1 <= m < 2
        mantissa = self.element.max_value / 2.0**top_exp
        hi = _BF16_MAX_EXP - top_exp + _E8M0_BIAS
        if mantissa > 2 - 2.0**-7:  # pragma: no cover - no element of ours rounds past bf16's max mantissa
            hi -= 1
        return lo, min(hi, 254)

    # -- blocks ------------------------------------------------------------------

    def resolve_block(self, block: Optional[Sequence[int]] = None, name: str = "block") -> Optional[tuple[int, int]]:
        """The block to use: ``default_block`` when ``block`` is ``None``; a fixed-block
        format refuses any other block (``ValueError``); dense formats return ``None``."""
        if not self.quantized:
            if block is not None:
                raise TypeError(f"{name}: the {self.name} format has no scale block, got {tuple(block)}")
            return None
        if block is None:
            return self.default_block
        block = check_block(block, name)
        if self.block_fixed and block != self.default_block:
            raise ValueError(
                f"{name}: the {self.name} format has fixed {self.default_block[0]}x{self.default_block[1]} "
                f"blocks, got {block}"
            )
        return block

    # -- shapes ------------------------------------------------------------------

    def data_shape(self, n: int, k: int) -> tuple[int, int]:
        """Shape of the data tensor of an ``[N, K]`` weight: ``[N, ceil(K / per_item)]``."""
        return n, self.element.items(k)

    def scale_shape(self, n: int, k: int, block: Optional[Sequence[int]] = None) -> Optional[tuple[int, int]]:
        """Shape of the block-scale tensor: ``[ceil(N / bn), ceil(K / bk)]`` (``None`` for dense)."""
        block = self.resolve_block(block)
        if block is None:
            return None
        return cdiv(n, block[0]), cdiv(k, block[1])

    def in_features_of(self, data: torch.Tensor, in_features: Optional[int] = None, name: str = "weight") -> int:
        """``K`` of a data tensor ``[N, C]``: ``in_features`` checked against ``C``, or ``C * per_item``."""
        cols = data.shape[-1]
        if in_features is None:
            return cols * self.element.per_item
        if self.element.items(in_features) != cols:
            raise ValueError(
                f"{name}: expected shape [N, {self.element.items(in_features)}] "
                f"(ceil(K/{self.element.per_item})) for K={in_features}, got {list(data.shape)}"
            )
        return in_features

    # -- dtypes ------------------------------------------------------------------

    def check_data_dtype(self, data: torch.Tensor, name: str = "weight") -> None:
        if data.dtype not in self.element.storage:
            raise dtype_error(name, data, self.element.storage)

    def scale_encoding(self, scale: Union[torch.Tensor, torch.dtype], name: str = "weight_scale") -> ScaleEncoding:
        """The :class:`ScaleEncoding` of a scale tensor (or dtype), or ``TypeError``."""
        dtype = scale if isinstance(scale, torch.dtype) else scale.dtype
        for enc in self.scales:
            if dtype in enc.storage:
                return enc
        allowed = tuple(d for enc in self.scales for d in enc.storage)
        if not allowed:
            raise TypeError(f"{name}: the {self.name} format has no scales")
        names = ", ".join(str(d) for d in allowed)
        raise TypeError(f"{name}: expected dtype in ({names}), got {dtype}")

    # -- validation ----------------------------------------------------------------

    def check(
        self,
        data: torch.Tensor,
        scale: Optional[torch.Tensor] = None,
        *,
        block: Optional[Sequence[int]] = None,
        in_features: Optional[int] = None,
        tensor_scale: Optional[torch.Tensor] = None,
        name: str = "weight",
    ) -> int:
        """Raise unless ``data``/``scale``/``tensor_scale`` form a valid weight; return ``K``.

        Checks dtypes and shapes only (no values; :meth:`find_nan_codes` scans).
        ``block`` defaults to the format's; ``in_features`` to ``columns * per_item``.
        Scale errors name ``{name}_scale`` and ``{name}_scale_2``.
        """
        self.check_data_dtype(data, name)
        if data.dim() != 2:
            what = "[N, K]" if not self.packed else f"[N, ceil(K/{self.element.per_item})]"
            raise ValueError(f"{name}: expected a 2-D {what} tensor, got shape {tuple(data.shape)}")
        k = self.in_features_of(data, in_features, name)
        if not self.quantized:
            if scale is not None:
                raise TypeError(f"{name}_scale: the {self.name} format has no scales")
            return k
        if scale is None:
            raise TypeError(f"{name}_scale: the {self.name} format needs a scale tensor, got None")
        self.scale_encoding(scale, f"{name}_scale")
        block = self.resolve_block(block)
        expected = self.scale_shape(data.shape[0], k, block)
        if tuple(scale.shape) != expected:
            raise ValueError(
                f"{name}_scale: expected shape {list(expected)} for a {[data.shape[0], k]} {self.name} weight "
                f"with block {list(block)}, got {list(scale.shape)}"
            )
        if self.tensor_scale is not None:
            if tensor_scale is None:
                raise TypeError(f"{name}_scale_2: the {self.name} format needs a per-tensor scale, got None")
            if tensor_scale.dtype not in self.tensor_scale.storage:
                raise dtype_error(f"{name}_scale_2", tensor_scale, self.tensor_scale.storage)
            if tensor_scale.numel() != 1 or tensor_scale.dim() > 1:
                raise ValueError(
                    f"{name}_scale_2: expected a scalar (shape [] or [1]), got shape {list(tensor_scale.shape)}"
                )
        elif tensor_scale is not None:
            raise TypeError(f"{name}_scale_2: the {self.name} format has no per-tensor scale")
        return k

    def find_nan_codes(
        self,
        data: Optional[torch.Tensor] = None,
        scale: Optional[torch.Tensor] = None,
        *,
        in_features: Optional[int] = None,
        tensor_scale: Optional[torch.Tensor] = None,
        name: str = "weight",
    ) -> None:
        """Raise ``ValueError`` naming the tensor and the first bad index if a value is corrupt.

        Corrupt: e8m0 code 255; e4m3 NaN bytes (data or NVFP4 block scales); a float32
        or e4m3 scale that is not positive and finite (a zero NVFP4 block scale would
        make its 16 values zero whatever the data says); an odd ``K``'s non-zero padding
        nibble; a non-positive or non-finite per-tensor scale.
        """
        if scale is not None:
            enc = self.scale_encoding(scale, f"{name}_scale")
            if enc is E8M0:
                _raise_first(scale.view(torch.uint8) == 255, f"{name}_scale", "NaN e8m0 code 255")
            elif enc is E4M3_SCALE:
                # Positive finite e4m3: bytes 0x01..0x7E (sign bit clear, not zero, not NaN).
                b = scale.view(torch.uint8)
                _raise_first((b == 0) | (b >= 0x7F), f"{name}_scale", "a zero, negative or NaN e4m3 scale")
            else:
                _raise_first(~torch.isfinite(scale) | (scale <= 0), f"{name}_scale", "a non-finite or non-positive scale")
        if tensor_scale is not None:
            bad = ~torch.isfinite(tensor_scale) | (tensor_scale <= 0)
            _raise_first(bad.reshape(-1), f"{name}_scale_2", "a non-finite or non-positive per-tensor scale")
        if data is None:
            return
        self.check_data_dtype(data, name)
        if self.element.nan_bytes:
            b = data.view(torch.uint8)
            bad = torch.zeros_like(b, dtype=torch.bool)
            for v in self.element.nan_bytes:
                bad |= b == v
            codes = "/".join(f"0x{v:02X}" for v in self.element.nan_bytes)
            _raise_first(bad, name, f"NaN {self.element.name} code {codes}")
        if self.packed and in_features is not None and in_features % self.element.per_item:
            packed = data.view(torch.uint8)
            pad = packed[..., -1:] >> 4
            # Index into the packed tensor, not into the one-column slice scanned.
            last = [0] * (packed.dim() - 1) + [packed.shape[-1] - 1]
            _raise_first(pad != 0, name, f"a non-zero padding nibble (K={in_features} is odd)", offset=last)

    # -- display -----------------------------------------------------------------

    def describe(self, block: Optional[Sequence[int]] = None, scale: Optional[ScaleEncoding] = None) -> str:
        """``"format=fp8, block=(32, 32), scale=e8m0"``: the one-line form ``extra_repr`` shows."""
        parts = [f"format={self.name}"]
        block = self.resolve_block(block)
        if block is not None:
            parts.append(f"block={block}")
        if self.quantized and len(self.scales) > 1:
            parts.append(f"scale={(scale or self.scales[0]).name}")
        return ", ".join(parts)

    def spec(self, block: Optional[Sequence[int]] = None, scale: Union[None, str, torch.dtype, ScaleEncoding] = None) -> "WeightSpec":
        """The :class:`WeightSpec` of this format with ``block`` and ``scale`` resolved."""
        return WeightSpec.of(self, block, scale)

    def __repr__(self) -> str:
        return f"WeightFormat({self.name!r})"


def _raise_first(bad: torch.Tensor, name: str, what: str, offset: Sequence[int] = ()) -> None:
    if bool(bad.any()):
        index = [int(i) for i in bad.nonzero()[0]]
        index = [i + o for i, o in zip(index, offset)] + index[len(offset):]
        raise ValueError(f"{name}: found {what} at index {index}; the tensor is corrupt")


# --------------------------------------------------------------------------- #
# a concrete weight's format: format + block + scale encoding
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class WeightSpec:
    """What one quantized layer holds: a format with its block and scale encoding fixed.

    This is what a checkpoint records (:meth:`to_metadata`) and what a loader reads
    back (:meth:`from_metadata`) instead of guessing from shapes.

    Attributes:
        format: the :class:`WeightFormat`.
        block: ``(bn, bk)``, or ``None`` for dense formats.
        scale: the block-scale :class:`ScaleEncoding`, or ``None`` for dense formats.
    """

    format: WeightFormat
    block: Optional[tuple[int, int]]
    scale: Optional[ScaleEncoding]

    @classmethod
    def of(cls, fmt: Union[str, WeightFormat], block=None, scale=None) -> "WeightSpec":
        """Resolve ``fmt`` (a name or alias), ``block`` (default: the format's) and ``scale``
        (a name ``"e8m0"``/``"f32"``/``"e4m3"``, a dtype or an encoding; default: the format's first)."""
        fmt = get_format(fmt)
        block = fmt.resolve_block(block)
        if not fmt.quantized:
            if scale is not None:
                raise TypeError(f"scale: the {fmt.name} format has no scales, got {scale!r}")
            return cls(fmt, None, None)
        if scale is None:
            enc = fmt.scales[0]
        elif isinstance(scale, ScaleEncoding):
            if scale not in fmt.scales:
                raise ValueError(f"scale: the {fmt.name} format takes {[s.name for s in fmt.scales]}, got {scale.name}")
            enc = scale
        elif isinstance(scale, str):
            found = [s for s in fmt.scales if s.name == scale]
            if not found:
                raise ValueError(f"scale: the {fmt.name} format takes {[s.name for s in fmt.scales]}, got {scale!r}")
            enc = found[0]
        else:
            enc = fmt.scale_encoding(scale, "scale_dtype")
        return cls(fmt, block, enc)

    def to_metadata(self) -> dict[str, str]:
        """String metadata (safetensors ``__metadata__`` values are strings):
        ``{"format": "fp8", "block": "96x96", "scale": "e8m0"}`` (dense: format only)."""
        out = {"format": self.format.name}
        if self.block is not None:
            out["block"] = f"{self.block[0]}x{self.block[1]}"
        if self.scale is not None:
            out["scale"] = self.scale.name
        return out

    @classmethod
    def from_metadata(cls, meta: Mapping[str, object]) -> "WeightSpec":
        """Inverse of :meth:`to_metadata`; ``block`` may also be a list ``[bn, bk]``."""
        if "format" not in meta:
            raise ValueError(f"metadata: expected a 'format' entry, got {dict(meta)}")
        block = meta.get("block")
        if isinstance(block, str):
            try:
                block = tuple(int(v) for v in block.lower().split("x"))
            except ValueError:
                raise ValueError(f"metadata: block {block!r} is not of the form BNxBK") from None
        return cls.of(str(meta["format"]), block, meta.get("scale"))

    def describe(self) -> str:
        """``"format=fp8, block=(32, 32), scale=e8m0"``."""
        return self.format.describe(self.block, self.scale)

    def __str__(self) -> str:
        return self.describe()


# --------------------------------------------------------------------------- #
# the registry
# --------------------------------------------------------------------------- #

_FP8_SUFFIXES = CheckpointSuffixes(scale=(".weight_scale", ".weight_scale_inv", ".scale"))

FP8 = WeightFormat(
    name="fp8",
    aliases=("float8", "fp8_e4m3"),
    family="fp8",
    element=E4M3FN,
    scales=(E8M0, F32_SCALE),
    default_block=(32, 32),
    block_fixed=False,
    suffixes=_FP8_SUFFIXES,
    description="float8_e4m3fn data, one scale per (bn x bk) block (e8m0 or float32, multiplied)",
)
MXFP8 = WeightFormat(
    name="mxfp8",
    aliases=(),
    family="fp8",
    element=E4M3FN,
    scales=(E8M0,),
    default_block=(1, 32),
    block_fixed=True,
    suffixes=_FP8_SUFFIXES,
    description="OCP MXFP8: float8_e4m3fn data, one e8m0 scale per 1x32 block (runs as fp8)",
)
FP4 = WeightFormat(
    name="fp4",
    aliases=("mxfp4",),
    family="fp4",
    element=E2M1,
    scales=(E8M0,),
    default_block=(1, 32),
    block_fixed=True,
    suffixes=CheckpointSuffixes(scale=(".weight_scale", ".scale")),
    description="OCP MXFP4: e2m1 pairs (low nibble first), one e8m0 scale per 1x32 block",
)
NVFP4 = WeightFormat(
    name="nvfp4",
    aliases=(),
    family="nvfp4",
    element=E2M1,
    scales=(E4M3_SCALE,),
    default_block=(1, 16),
    block_fixed=True,
    tensor_scale=F32_SCALE,
    suffixes=CheckpointSuffixes(scale=(".weight_scale",), tensor_scale=(".weight_scale_2",), ignored=(".input_scale",)),
    exact_dtype=torch.float32,
    description="NVIDIA NVFP4: e2m1 pairs, one e4m3 scale per 1x16 block, times a float32 per-tensor scale",
)
BF16 = WeightFormat(
    name="bf16", aliases=("bfloat16",), family="bf16", element=BF16_ELEMENT, scales=(), default_block=None,
    block_fixed=True, description="bfloat16 weights",
)
FP32W = WeightFormat(
    name="fp32w", aliases=(), family="bf16", element=F32_ELEMENT, scales=(), default_block=None,
    block_fixed=True, exact_dtype=torch.float32, description="float32 weights, narrowed to bf16 inside the op",
)

#: canonical name -> :class:`WeightFormat`
FORMATS: Mapping[str, WeightFormat] = MappingProxyType({f.name: f for f in (FP8, MXFP8, FP4, NVFP4, BF16, FP32W)})
_BY_NAME = {n: f for f in FORMATS.values() for n in f.names}


def get_format(name: Union[str, WeightFormat]) -> WeightFormat:
    """The :class:`WeightFormat` for a canonical name or alias (case-insensitive), or ``ValueError``."""
    if isinstance(name, WeightFormat):
        return name
    if isinstance(name, str):
        fmt = _BY_NAME.get(name.lower())
        if fmt is not None:
            return fmt
    raise ValueError(f"format: expected one of {sorted(_BY_NAME)}, got {name!r}")


def format_names(*, quantized: Optional[bool] = None) -> tuple[str, ...]:
    """Canonical names, optionally only the quantized (or only the dense) ones."""
    return tuple(f.name for f in FORMATS.values() if quantized is None or f.quantized == quantized)
