"""Layouts: how one linear layer is stored, found from headers and records, then read as a weights record.

Layouts recognised for a layer ``prefix`` (docs/checkpoints.md has the table with
examples; the math is in the formats' docs):

==================  ====================================================  =====================
layout              tensors                                               format
==================  ====================================================  =====================
``torch_bq``        ``{p}.weight`` + ``{p}.weight_scale``                 fp8 (any block) / fp4
``deepseek-v3``     ``{p}.weight`` F8_E4M3 + ``{p}.weight_scale_inv`` F32  fp8
``deepseek-v3.1``   ``{p}.weight`` + ``{p}.scale`` (e8m0)                 fp8 (any block) / fp4
``gpt-oss``         ``{p}_blocks`` U8 ``[..., N, K/32, 16]`` +            fp4 (``expert=i``
                    ``{p}_scales`` U8 ``[..., N, K/32]``                  selects a stacked one)
``dense``           ``{p}.weight`` BF16 / F32 / F16                       bf16 / fp32w
==================  ====================================================  =====================

plus ``{p}.bias`` (``{p}_bias`` for gpt-oss) when present. All scales are *multiplied*.
Shapes here are natural: the trailing unit axis torch_bq's own files store codes
with is removed by the reader (:mod:`.stored`).

**Recorded, never guessed.** The format and block come from, in order: the
record torch_bq wrote into the shard's ``__metadata__``; ``config.json``'s
``quantization_config`` (torch_bq's own, then a known family's
``weight_block_size``); an explicit ``block=``/``format=`` argument; and only
then the shapes. A record and an argument that disagree are an error. Shape
inference that admits more than one block raises :class:`AmbiguousLayoutError`
with the candidates and the argument that picks one. ``uint8`` data is packed
fp4 when its scale grid fits fp4's ``[N, ceil(2*cols/32)]`` (fp8 data is stored
as F8_E4M3); pass ``format="fp8"`` for e4m3 bytes stored as U8.

Every problem is found from the headers before any data is read.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping, Optional, Sequence

import torch

from .. import formats
from .errors import AmbiguousLayoutError, CheckpointError, MissingTensorError
from .reader import CheckpointReader, Source, open_checkpoint
from .record import LayerRecord, check_block_value, config_record, family_block
from .scan import check_scale_range, scan_nan_codes

__all__ = [
    "LinearLayout",
    "LinearWeights",
    "SCALE_SUFFIXES",
    "LAYOUT_OF_SUFFIX",
    "detect_linear",
    "read_linear",
    "resolve_linear",
    "record_of",
    "block_candidates",
    "quantized_prefixes",
]

_E8M0 = (torch.float8_e8m0fnu, torch.uint8)
_DENSE = (torch.bfloat16, torch.float32, torch.float16)

#: scale tensor suffix -> layout name
LAYOUT_OF_SUFFIX = {".weight_scale": "torch_bq", ".weight_scale_inv": "deepseek-v3", ".scale": "deepseek-v3.1"}
SCALE_SUFFIXES = tuple(LAYOUT_OF_SUFFIX)

#: block lengths shape inference considers: powers of two and multiples of 32. Every block a
#: known family uses is a power of two (MXFP 32, DeepSeek 128); multiples of 32 are there so
#: that a non-power-of-two block such as 96 is reported as ambiguous instead of being read as
#: the one power of two that fits (64). With them torch_bq's default 32 is still never
#: ambiguous: for ceil(n/32) = g > 1 no other multiple of 32 gives the same g. Any other
#: block (48, 3x5) must be recorded or passed.
_INFER_MULTIPLE = 32


@dataclass(frozen=True)
class LinearLayout:
    """Where and how one linear layer is stored, as found from headers and records only.

    Attributes:
        prefix: the layer's name in the checkpoint.
        layout: ``"torch_bq"``, ``"deepseek-v3"``, ``"deepseek-v3.1"``, ``"gpt-oss"`` or ``"dense"``.
        format: ``"fp8"``, ``"fp4"``, ``"bf16"`` or ``"fp32w"``.
        weight_name, scale_name, bias_name: checkpoint keys (``scale``/``bias`` may be ``None``).
        out_features, in_features: ``N`` and ``K`` of the layer.
        block: the scale block ``(bn, bk)``; ``(1, 32)`` for fp4; ``None`` for dense.
        expert: the index selected from stacked tensors, or ``None``.
        num_experts: length of the stacked dim, or ``None`` when not stacked.
        source: where format and block came from: ``"record"`` (torch_bq's metadata),
            ``"config"`` (config.json), ``"argument"`` (``block=``/``format=``), ``"shapes"``
            (inferred, unique), ``"layout"`` (fixed by the layout, e.g. gpt-oss).
    """

    prefix: str
    layout: str
    format: str
    weight_name: str
    scale_name: Optional[str]
    bias_name: Optional[str]
    out_features: int
    in_features: int
    block: Optional[tuple[int, int]]
    expert: Optional[int] = None
    num_experts: Optional[int] = None
    source: str = "shapes"
    tensor_scale_name: Optional[str] = None  # NVFP4's per-tensor ``weight_scale_2``

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n in (self.weight_name, self.scale_name, self.tensor_scale_name, self.bias_name)
                     if n is not None)


@dataclass
class LinearWeights:
    """The tensors of one linear layer, read and validated, on CPU, in our storage dtypes.

    ``weight``: fp8 ``float8_e4m3fn [N, K]``; fp4 ``uint8 [N, ceil(K/2)]``; dense ``bfloat16``/``float32 [N, K]``.
    ``scale``: fp8 ``float8_e8m0fnu`` or ``float32 [ceil(N/bn), ceil(K/bk)]``; fp4
    ``float8_e8m0fnu [N, ceil(K/32)]``; ``None`` for dense. Always multiplied.
    ``bias``: ``[N]`` as stored, or ``None``.
    ``scanned``: the NaN-code scan already ran on these exact tensors (modules skip it).
    """

    layout: LinearLayout
    weight: torch.Tensor
    scale: Optional[torch.Tensor]
    bias: Optional[torch.Tensor] = None
    extra: dict = field(default_factory=dict)
    scanned: bool = False
    tensor_scale: Optional[torch.Tensor] = None  # NVFP4's float32 ``weight_scale_2`` (0-d)

    @property
    def format(self) -> str:
        return self.layout.format

    @property
    def block(self) -> Optional[tuple[int, int]]:
        return self.layout.block

    @property
    def in_features(self) -> int:
        return self.layout.in_features

    @property
    def out_features(self) -> int:
        return self.layout.out_features


def quantized_prefixes(keys: Sequence[str]) -> list[str]:
    """The layer prefixes whose tensors look quantized (a scale next to a weight, or gpt-oss blocks)."""
    keyset = set(keys)
    prefixes = set()
    for k in keys:
        if k.endswith("_blocks") or k.endswith("_scales"):
            prefixes.add(k[: -len("_blocks")])
            continue
        for suffix in SCALE_SUFFIXES:
            if k.endswith(suffix) and k[: -len(suffix)] + ".weight" in keyset:
                prefixes.add(k[: -len(suffix)])
    return sorted(prefixes)


def record_of(reader: CheckpointReader, prefix: str, weight_name: str) -> Optional[LayerRecord]:
    """The record for ``prefix``, or ``None``.

    In order: the weight's shard ``__metadata__``; the module's own
    ``{prefix}._extra_state`` (an ``FP8Linear`` state dict saved as is records its
    block there: int64 ``[bn, bk]``); config.json's torch_bq ``quantization_config``.
    """
    if weight_name in reader:
        records = reader.records(weight_name)
        if prefix in records:
            return records[prefix]
    extra = f"{prefix}._extra_state" if prefix else "_extra_state"
    if extra in reader:
        if reader.dtype(extra) != torch.int64 or reader.shape(extra) != (2,):
            raise CheckpointError(
                f"{extra}: expected the module's recorded block, int64 [bn, bk], got {reader.dtype(extra)} "
                f"{list(reader.shape(extra))}"
            )
        value = reader.get(extra).tolist()  # 16 bytes: the one data read before the layout is known
        return LayerRecord("fp8", check_block_value(value, extra), None, source=extra)
    return config_record(reader.config, prefix, str(reader.root / "config.json") if reader.root else "config.json")


def _looked_for(prefix: str) -> list[str]:
    return [f"{prefix}.weight", *(prefix + s for s in SCALE_SUFFIXES), f"{prefix}_blocks", f"{prefix}_scales"]


def _missing(reader: CheckpointReader, prefix: str, what: str, looked: Sequence[str]) -> MissingTensorError:
    near: list[str] = []
    for name in looked:
        for c in reader.closest(name):
            if c not in near:
                near.append(c)
    return MissingTensorError(
        f"{prefix}: {what} in {reader.description}; looked for {list(looked)}"
        + (f"; closest names present: {near[:8]}" if near else "; the checkpoint has no similar names")
    )


def _stack_dims(reader: CheckpointReader, name: str, base_ndim: int, expert: Optional[int]) -> tuple[tuple[int, ...], Optional[int]]:
    """The per-layer shape of ``name`` and its stack length, checking ``expert`` against it."""
    shape = reader.shape(name)
    if len(shape) == base_ndim:
        if expert is not None:
            raise CheckpointError(
                f"{name}: expert={expert} was given but the tensor is not stacked (shape {list(shape)})"
            )
        return shape, None
    if len(shape) == base_ndim + 1:
        e = shape[0]
        if expert is None:
            hint = ("; or, ending in a unit axis, it is torch_bq codes whose file lost its __metadata__ records "
                    "(rewritten without metadata=?)" if shape[-1] == 1 else "")
            raise CheckpointError(
                f"{name}: holds {e} stacked experts (shape {list(shape)}); pass expert=i to pick one{hint}"
            )
        if isinstance(expert, bool) or not isinstance(expert, int) or not 0 <= expert < e:
            raise CheckpointError(f"{name}: expert={expert!r} is out of range for {e} experts")
        return shape[1:], e
    raise CheckpointError(
        f"{name}: expected {base_ndim} dims (or {base_ndim + 1} with a leading expert dim), got shape {list(shape)}"
    )


def block_candidates(size: int, grid: int, limit: int = 8) -> list[int]:
    """The block lengths ``b`` shape inference admits for ``ceil(size / b) == grid`` (at most ``limit``).

    ``grid == size`` admits only 1. ``grid == 1`` admits every ``b >= size``, which
    all decode alike; the smallest power of two is returned. Otherwise ``b`` lies in
    ``[ceil(size/grid), ceil(size/(grid-1)) - 1]``, and powers of two and multiples of
    32 in that range are the candidates (any other block must be recorded or passed).
    """
    if grid == size:
        return [1]
    if size == 0 or grid < 1 or grid > size:
        return []
    if grid == 1:
        return [1 << (size - 1).bit_length()]
    lo, hi = -(-size // grid), -(-size // (grid - 1)) - 1
    found = set()
    b = -(-lo // _INFER_MULTIPLE) * _INFER_MULTIPLE
    while b <= hi and len(found) < limit:
        found.add(b)
        b += _INFER_MULTIPLE
    p = 1 << max(0, (lo - 1).bit_length())
    while p <= hi and len(found) < 2 * limit:
        found.add(p)
        p <<= 1
    return sorted(found)[:limit]


def _fp8_block(reader: CheckpointReader, scale_name: str, n: int, k: int, grid: tuple[int, ...],
               record: Optional[LayerRecord], block: Optional[Sequence[int]]) -> tuple[tuple[int, int], str]:
    """The fp8 block and where it came from: record > argument > family config > shapes."""
    given = None if block is None else check_block_value(block, "block")
    if record is not None and record.block is not None:
        if given is not None and given != record.block:
            raise CheckpointError(
                f"{scale_name}: block={list(given)} was passed but {record.source} records block {list(record.block)}"
            )
        chosen, source, label = record.block, "record", f"recorded in {record.source}"
    elif given is not None:
        chosen, source, label = given, "argument", "block="
    elif (fam := family_block(reader.config)) is not None:
        (chosen, label), source = fam, "config"
    else:
        bn, bk = block_candidates(n, grid[0]), block_candidates(k, grid[1])
        if len(bn) == 1 and len(bk) == 1:
            return (bn[0], bk[0]), "shapes"
        if not bn or not bk:
            raise CheckpointError(
                f"{scale_name}: shape {list(grid)} fits no block of 1, a power of two or a multiple of 32 for a "
                f"{[n, k]} fp8 weight, and the checkpoint records none; pass block=(bn, bk)"
            )
        candidates = [("fp8", (a, b)) for a in bn for b in bk]
        raise AmbiguousLayoutError(
            f"{scale_name}: shape {list(grid)} for a {[n, k]} fp8 weight admits more than one block "
            f"(bn in {bn}{'...' if len(bn) == 8 else ''}, bk in {bk}{'...' if len(bk) == 8 else ''}) and the "
            f"checkpoint records none; pass block=(bn, bk). torch_bq.nn.save_quantized and convert_checkpoint "
            f"record it.",
            candidates, "block",
        )
    expected = formats.fp8_scale_shape((n, k), chosen)
    if tuple(grid) != expected:
        raise CheckpointError(
            f"{scale_name}: expected shape {list(expected)} for a {[n, k]} weight with block {list(chosen)} "
            f"(from {label}), got {list(grid)}"
        )
    return chosen, source


def detect_linear(
    source: Source,
    prefix: str,
    *,
    expert: Optional[int] = None,
    block: Optional[Sequence[int]] = None,
    in_features: Optional[int] = None,
    format: Optional[str] = None,
) -> LinearLayout:
    """Find how layer ``prefix`` is stored, from headers and records only (no tensor data is read).

    Args:
        source: anything :class:`CheckpointReader` accepts, or a reader.
        prefix: the layer's name, e.g. ``"model.layers.0.mlp.down_proj"`` or, for
            gpt-oss, ``"model.layers.0.mlp.experts.down_proj"`` (the part before ``_blocks``).
        expert: index into a stacked (``[E, ...]``) tensor; required when stacked.
        block: the fp8 block when the checkpoint records none (must agree with a record).
        in_features: ``K`` for fp4 with odd ``K`` when not recorded (default ``2 * columns``).
        format: ``"fp8"`` or ``"fp4"`` to settle ``uint8`` data when not recorded.

    Raises:
        MissingTensorError: nothing usable under ``prefix`` (lists what was looked for
            and the closest names present).
        AmbiguousLayoutError: unrecorded shapes admit more than one block.
        CheckpointError: wrong dtypes or shapes, records that contradict the tensors or
            the arguments, ambiguous names, a bad ``expert``.
    """
    if format not in (None, "fp8", "fp4", "nvfp4", "bf16", "fp32w"):
        raise ValueError(f"format: expected 'fp8', 'fp4', 'nvfp4', 'bf16', 'fp32w' or None, got {format!r}")
    if in_features is not None and (isinstance(in_features, bool) or not isinstance(in_features, int) or in_features < 1):
        raise ValueError(f"in_features: expected a positive int, got {in_features!r}")
    with open_checkpoint(source) as reader:
        if f"{prefix}_blocks" in reader or f"{prefix}_scales" in reader:
            return _detect_gpt_oss(reader, prefix, expert)
        weight_name = f"{prefix}.weight"
        if weight_name not in reader:
            raise _missing(reader, prefix, "no weight found", _looked_for(prefix))
        if any(prefix + s in reader for s in formats.NVFP4.suffixes.tensor_scale):
            return _detect_nvfp4(reader, prefix, expert, in_features, format)
        scales = [prefix + s for s in SCALE_SUFFIXES if prefix + s in reader]
        if len(scales) > 1:
            raise CheckpointError(f"{prefix}: more than one scale tensor present: {scales}; expected exactly one")
        bias_name = f"{prefix}.bias" if f"{prefix}.bias" in reader else None
        wdtype = reader.dtype(weight_name)
        record = record_of(reader, prefix, weight_name)
        if not scales:
            if wdtype not in _DENSE:
                raise _missing(
                    reader, prefix, f"the weight is {wdtype} but no scale tensor is present",
                    [prefix + s for s in SCALE_SUFFIXES],
                )
            if record is not None and not record.default and record.format in ("fp8", "fp4"):
                raise CheckpointError(f"{weight_name}: {record.source} records {record.format} but no scale tensor is stored")
            shape, e = _stack_dims(reader, weight_name, 2, expert)
            _check_bias(reader, bias_name, shape[0], expert)
            fmt = "bf16" if wdtype == torch.bfloat16 else "fp32w"
            return LinearLayout(prefix, "dense", fmt, weight_name, None, bias_name, shape[0], shape[1], None, expert, e,
                                "layout")
        scale_name = scales[0]
        layout = LAYOUT_OF_SUFFIX[scale_name[len(prefix):]]
        if reader.shape(scale_name) in ((), (1,)) and len(reader.shape(weight_name)) == 2:
            return _detect_per_tensor_fp8(reader, prefix, scale_name, bias_name, block, format)
        shape, e = _stack_dims(reader, weight_name, 2, expert)
        grid, e2 = _stack_dims(reader, scale_name, 2, expert)
        if e != e2:
            raise CheckpointError(
                f"{prefix}: {weight_name} and {scale_name} disagree on stacking ({e} vs {e2} experts)"
            )
        if record is not None and record.format not in ("fp8", "fp4"):
            raise CheckpointError(f"{weight_name}: {record.source} records {record.format}, but a scale tensor is stored")
        sdtype = reader.dtype(scale_name)
        n, cols = shape
        fmt, fmt_source = _data_format(wdtype, n, cols, grid, format, record, weight_name)
        if record is not None and record.scale_dtype is not None and fmt == "fp8":
            stored = torch.float8_e8m0fnu if sdtype in _E8M0 else sdtype
            if stored != record.scale_dtype and not (layout == "deepseek-v3" and stored in _DENSE):
                raise CheckpointError(
                    f"{scale_name}: {record.source} records scale dtype {record.scale_dtype}, the tensor is {sdtype}"
                )
        if fmt == "fp8":
            if layout == "deepseek-v3":
                allowed = (torch.float32, torch.bfloat16, torch.float16, *_E8M0)
            else:
                allowed = (*_E8M0, torch.float32)
            if sdtype not in allowed:
                raise CheckpointError(f"{scale_name}: expected dtype in {allowed} for an fp8 weight, got {sdtype}")
            if record is not None:
                _check_record_dims(record, weight_name, n, cols)
            blk, source = _fp8_block(reader, scale_name, n, cols, grid, record, block)
            _check_bias(reader, bias_name, n, expert)
            return LinearLayout(prefix, layout, "fp8", weight_name, scale_name, bias_name, n, cols, blk, expert, e,
                                source)
        if layout == "deepseek-v3":
            raise CheckpointError(f"{weight_name}: a weight_scale_inv layout holds fp8 data, got {wdtype}")
        if sdtype not in _E8M0:
            raise CheckpointError(f"{scale_name}: expected e8m0 scales (F8_E8M0 or U8) for fp4, got {sdtype}")
        if block is not None and check_block_value(block, "block") != (1, 32):
            raise CheckpointError(f"{weight_name}: holds fp4 (MXFP4, 1x32 blocks) data; block={tuple(block)} does not apply")
        k = in_features
        if record is not None and record.in_features is not None:
            if in_features is not None and in_features != record.in_features:
                raise CheckpointError(
                    f"{weight_name}: in_features={in_features} was passed but {record.source} records {record.in_features}"
                )
            k = record.in_features
        k = _fp4_in_features(weight_name, cols, k)
        if record is not None:
            _check_record_dims(record, weight_name, n, k)
        expected = (n, -(-k // formats.FP4_BLOCK))
        if tuple(grid) != expected:
            raise CheckpointError(
                f"{scale_name}: expected shape {list(expected)} for fp4 data {[n, cols]} (K={k}, 1x32 blocks), "
                f"got {list(grid)}"
            )
        _check_bias(reader, bias_name, n, expert)
        return LinearLayout(prefix, layout, "fp4", weight_name, scale_name, bias_name, n, k, (1, 32), expert, e,
                            fmt_source)


def _detect_per_tensor_fp8(reader: CheckpointReader, prefix: str, scale_name: str, bias_name: Optional[str],
                           block, format: Optional[str]) -> LinearLayout:
    """ModelOpt's FP8: F8_E4M3 ``weight`` with ONE float32 ``weight_scale`` (``[]`` or ``[1]``), multiplied.

    One scale for the whole tensor is the fp8 format with the block ``(N, K)``: its
    scale grid is ``[1, 1]``. ``input_scale`` (a static activation scale) is checked
    and ignored, as for NVFP4.
    """
    weight_name = f"{prefix}.weight"
    wdtype, sdtype = reader.dtype(weight_name), reader.dtype(scale_name)
    if wdtype != torch.float8_e4m3fn or sdtype != torch.float32:
        raise CheckpointError(
            f"{scale_name}: a scalar scale is ModelOpt's per-tensor FP8 and needs F8_E4M3 data with a float32 "
            f"scale, got {wdtype} data and a {sdtype} scale"
        )
    if format not in (None, "fp8"):
        raise CheckpointError(f"{weight_name}: holds fp8 data (per-tensor scale), but {format} was asked for")
    n, k = reader.shape(weight_name)
    if block is not None and check_block_value(block, "block") != (n, k):
        raise CheckpointError(f"{scale_name}: one scale covers the whole [{n}, {k}] weight; block={tuple(block)} does not")
    input_scale = f"{prefix}.input_scale"
    if input_scale in reader and (reader.dtype(input_scale) != torch.float32 or reader.shape(input_scale) not in ((), (1,))):
        raise CheckpointError(f"{input_scale}: expected a float32 scalar, got {reader.dtype(input_scale)} "
                              f"{list(reader.shape(input_scale))}")
    _check_bias(reader, bias_name, n, None)
    return LinearLayout(prefix, "modelopt", "fp8", weight_name, scale_name, bias_name, n, k, (n, k), None, None, "layout")


def _modelopt_group_size(reader: CheckpointReader) -> Optional[tuple[int, str]]:
    """ModelOpt's NVFP4 group size from ``config.json`` or ``hf_quant_config.json``, with where it was read."""
    for file, get in (("config.json", lambda c: c.get("quantization_config")),
                      ("hf_quant_config.json", lambda c: c.get("quantization"))):
        qc = get(reader.side_file(file))
        if isinstance(qc, Mapping) and str(qc.get("quant_algo", "")).upper() == "NVFP4":
            g = qc.get("group_size", 16)
            if isinstance(g, bool) or not isinstance(g, int):
                raise CheckpointError(f"{file}: group_size must be an int, got {g!r}")
            return g, f"{file} group_size"
    return None


def _detect_nvfp4(reader: CheckpointReader, prefix: str, expert: Optional[int], in_features: Optional[int],
                  format: Optional[str]) -> LinearLayout:
    """The ModelOpt NVFP4 layout: ``weight`` packed e2m1, ``weight_scale`` e4m3 1x16, ``weight_scale_2`` f32 scalar."""
    fmt = formats.NVFP4
    weight_name = prefix + fmt.suffixes.weight
    scale_name = prefix + fmt.suffixes.scale[0]
    ts_name = next(prefix + s for s in fmt.suffixes.tensor_scale if prefix + s in reader)
    if scale_name not in reader:
        raise _missing(reader, prefix, f"{ts_name} is present (NVFP4) but its block scale is missing", [scale_name])
    if format not in (None, "nvfp4"):
        raise CheckpointError(f"{weight_name}: holds nvfp4 data ({ts_name} is present), but {format} was asked for")
    if expert is not None:
        raise CheckpointError(f"{weight_name}: expert={expert} was given but NVFP4 tensors are not stacked here")
    record = record_of(reader, prefix, weight_name)
    if record is not None and not record.default and record.format != "nvfp4":
        raise CheckpointError(f"{weight_name}: {record.source} records {record.format}, but {ts_name} marks nvfp4 data")
    wdtype, sdtype, tdtype = reader.dtype(weight_name), reader.dtype(scale_name), reader.dtype(ts_name)
    if wdtype not in fmt.element.storage:
        raise CheckpointError(f"{weight_name}: expected NVFP4 packed data ({fmt.element.storage}), got {wdtype}")
    if sdtype not in fmt.scales[0].storage:
        raise CheckpointError(f"{scale_name}: expected e4m3 block scales ({fmt.scales[0].storage}), got {sdtype}")
    if tdtype != torch.float32 or reader.shape(ts_name) not in ((), (1,)):
        raise CheckpointError(f"{ts_name}: expected a float32 scalar ([] or [1]), got {tdtype} {list(reader.shape(ts_name))}")
    for s in fmt.suffixes.ignored:  # activation scales: validated when read, never used (no NVFP4 activations)
        if prefix + s in reader and (reader.dtype(prefix + s) != torch.float32 or reader.shape(prefix + s) not in ((), (1,))):
            raise CheckpointError(f"{prefix + s}: expected a float32 scalar, got {reader.dtype(prefix + s)} "
                                  f"{list(reader.shape(prefix + s))}")
    shape, grid = reader.shape(weight_name), reader.shape(scale_name)
    if len(shape) != 2 or len(grid) != 2:
        raise CheckpointError(f"{weight_name}: expected 2-D NVFP4 data and scales, got {list(shape)} and {list(grid)}")
    n, cols = shape
    source = "layout"
    group = _modelopt_group_size(reader)
    if group is not None:
        if group[0] != fmt.default_block[1]:
            raise CheckpointError(f"{group[1]}: NVFP4 uses 1x{fmt.default_block[1]} blocks, the config says {group[0]}")
        source = "config"
    k = in_features
    if record is not None and not record.default:
        source = "record"
        if record.in_features is not None:
            if in_features is not None and in_features != record.in_features:
                raise CheckpointError(f"{weight_name}: in_features={in_features} was passed but {record.source} "
                                      f"records {record.in_features}")
            k = record.in_features
    k = _fp4_in_features(weight_name, cols, k)
    expected = fmt.scale_shape(n, k)
    if tuple(grid) != tuple(expected):
        raise CheckpointError(f"{scale_name}: expected shape {list(expected)} for NVFP4 data {[n, cols]} (K={k}, "
                              f"1x16 blocks), got {list(grid)}")
    bias_name = f"{prefix}.bias" if f"{prefix}.bias" in reader else None
    _check_bias(reader, bias_name, n, None)
    return LinearLayout(prefix, "modelopt", "nvfp4", weight_name, scale_name, bias_name, n, k,
                        tuple(fmt.default_block), None, None, source, ts_name)


def _check_record_dims(record: LayerRecord, weight_name: str, n: int, k: int) -> None:
    for what, rec, got in (("out_features", record.out_features, n), ("in_features", record.in_features, k)):
        if rec is not None and rec != got:
            raise CheckpointError(f"{weight_name}: {record.source} records {what}={rec}, the tensors hold {got}")


def _data_format(wdtype, n, cols, grid, hint, record, weight_name) -> tuple[str, str]:
    if wdtype == torch.float8_e4m3fn:
        fmt = "fp8"
    elif wdtype in (torch.int8, torch.float4_e2m1fn_x2):
        fmt = "fp4"
    elif wdtype == torch.uint8:
        if record is not None:
            fmt = record.format
        elif hint in ("fp8", "fp4"):
            return hint, "argument"
        else:
            # Packed fp4 has one e8m0 per 16 bytes of a row; fp8 is stored as F8_E4M3.
            fmt = "fp4" if tuple(grid) == (n, -(-2 * cols // formats.FP4_BLOCK)) else "fp8"
    else:
        raise CheckpointError(
            f"{weight_name}: expected quantized data (F8_E4M3, U8, I8 or F4) next to a scale tensor, got {wdtype}"
        )
    if record is not None and record.format != fmt:
        raise CheckpointError(f"{weight_name}: {record.source} records {record.format}, but the data is {wdtype} ({fmt})")
    if hint in ("fp8", "fp4") and hint != fmt:
        raise CheckpointError(
            f"{weight_name}: holds {fmt} data ({wdtype}"
            + (", recorded" if record is not None else "")
            + f"), but {hint} was asked for"
        )
    return fmt, ("record" if record is not None else "layout" if wdtype != torch.uint8 else "shapes")


def _fp4_in_features(weight_name: str, cols: int, in_features: Optional[int]) -> int:
    if in_features is None:
        return 2 * cols
    if -(-in_features // 2) != cols:
        raise CheckpointError(
            f"{weight_name}: in_features={in_features} needs {-(-in_features // 2)} packed columns, got {cols}"
        )
    return in_features


def _check_bias(reader: CheckpointReader, bias_name: Optional[str], n: int, expert: Optional[int]) -> None:
    if bias_name is None:
        return
    dtype = reader.dtype(bias_name)
    if not dtype.is_floating_point or dtype.itemsize == 1:
        raise CheckpointError(f"{bias_name}: expected a float16/bfloat16/float32 bias, got {dtype}")
    shape = reader.shape(bias_name)
    if len(shape) == 2:
        if expert is None:
            raise CheckpointError(f"{bias_name}: holds {shape[0]} stacked experts; pass expert=i to pick one")
        if not 0 <= expert < shape[0]:
            raise CheckpointError(f"{bias_name}: expert={expert} is out of range for {shape[0]} experts")
        shape = shape[1:]
    if tuple(shape) != (n,):
        raise CheckpointError(f"{bias_name}: expected shape [{n}] (N of the weight), got {list(reader.shape(bias_name))}")


def _detect_gpt_oss(reader: CheckpointReader, prefix: str, expert: Optional[int]) -> LinearLayout:
    blocks, scales = f"{prefix}_blocks", f"{prefix}_scales"
    for name in (blocks, scales):
        if name not in reader:
            raise _missing(reader, prefix, f"{name} is missing (gpt-oss MXFP4 needs both)", [blocks, scales])
    for name in (blocks, scales):
        if reader.dtype(name) != torch.uint8:
            raise CheckpointError(f"{name}: expected dtype torch.uint8, got {reader.dtype(name)}")
    bshape, e = _stack_dims(reader, blocks, 3, expert)
    sshape, e2 = _stack_dims(reader, scales, 2, expert)
    if bshape[2] != 16:
        raise CheckpointError(f"{blocks}: expected shape [..., N, K/32, 16] (16 bytes per 32 values), got {list(reader.shape(blocks))}")
    if tuple(sshape) != tuple(bshape[:2]) or e != e2:
        raise CheckpointError(
            f"{scales}: expected shape {list(reader.shape(blocks)[:-1])} to match {blocks}, got {list(reader.shape(scales))}"
        )
    bias_name = f"{prefix}_bias" if f"{prefix}_bias" in reader else None
    n, groups = bshape[0], bshape[1]
    _check_bias(reader, bias_name, n, expert)
    return LinearLayout(prefix, "gpt-oss", "fp4", blocks, scales, bias_name, n, groups * formats.FP4_BLOCK, (1, 32),
                        expert, e, "layout")


# =========================================================================== #
# reading (data)
# =========================================================================== #


def _check_span(span, size: int, step: int, what: str, prefix: str) -> tuple[int, int]:
    """``span = (start, stop)`` within ``size`` whose ends fall on multiples of ``step`` (or ``size``)."""
    if span is None:
        return 0, size
    if len(span) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in span):
        raise CheckpointError(f"{prefix}: {what}={span!r} must be a pair of ints (start, stop)")
    start, stop = span
    if not 0 <= start < stop <= size:
        raise CheckpointError(f"{prefix}: {what}=({start}, {stop}) is not a non-empty range within [0, {size}]")
    if start % step or (stop % step and stop != size):
        raise CheckpointError(
            f"{prefix}: {what}=({start}, {stop}) must start and end on multiples of the {step}-wide scale "
            f"block (or end at {size}), so that every scale belongs to one shard"
        )
    return start, stop


def read_linear(
    source: Source,
    layout: LinearLayout,
    *,
    rows: Optional[Sequence[int]] = None,
    cols: Optional[Sequence[int]] = None,
    region: Optional[Mapping[str, tuple]] = None,
) -> LinearWeights:
    """Read and validate the tensors ``layout`` names; nothing else is read.

    Args:
        source: anything :class:`CheckpointReader` accepts, or a reader.
        layout: from :func:`detect_linear`.
        rows: ``(n0, n1)``: read only output rows ``n0:n1`` (a column-parallel shard).
        cols: ``(k0, k1)``: read only input columns ``k0:k1`` (a row-parallel shard).
            Both must fall on scale-block boundaries (fp4: multiples of 32 along K).
            Only the selected bytes are read. The bias follows ``rows``; with
            ``cols`` the whole bias is returned and the caller decides which shard adds it.
        region: the low-level form, instead of ``rows``/``cols``: ``tensor name -> index
            tuple`` into the stored tensor (after ``layout.expert`` is selected); only
            that part is read, tensors not named are read whole, ``layout`` is returned
            unchanged, and a region on fp4 data skips the odd-``K`` padding-nibble check
            (only the reader of the last columns can make it). For shards that do not
            fall on block boundaries (:mod:`torch_bq.distributed`).

    Returns:
        CPU tensors in our storage dtypes, owned by the caller (see :class:`LinearWeights`),
        scanned once for NaN codes (``scanned=True``); with ``rows``/``cols`` its
        ``layout`` carries the shard's ``out_features``/``in_features``.

    Raises:
        CheckpointError: a tensor is unreadable, holds NaN codes or out-of-range float32
            scales, or a shard boundary splits a scale block.
    """
    if region is not None and (rows is not None or cols is not None):
        raise ValueError("read_linear: pass rows/cols or region, not both")
    region = {} if region is None else dict(region)
    n, k = layout.out_features, layout.in_features
    bn, bk = layout.block if layout.block is not None else (1, 1)
    n0, n1 = _check_span(rows, n, bn, "rows", layout.prefix)
    k0, k1 = _check_span(cols, k, bk, "cols", layout.prefix)
    sharded = (n0, n1, k0, k1) != (0, n, 0, k)
    with open_checkpoint(source) as reader:
        def read(name: Optional[str], base_ndim: int, index: tuple) -> Optional[torch.Tensor]:
            if name is None:
                return None
            stacked = layout.expert is not None and len(reader.shape(name)) == base_ndim + 1
            if region:
                index = region.get(name)
            elif not sharded:
                index = None
            if index is None:
                return reader.get_index(name, layout.expert) if stacked else reader.get(name)
            return reader.get_slice(name)[((layout.expert,) if stacked else ()) + tuple(index)]

        row_sl = slice(n0, n1)
        if layout.format == "fp8" and reader.shape(layout.scale_name) in ((), (1,)):  # ModelOpt per-tensor
            weight = read(layout.weight_name, 2, (row_sl, slice(k0, k1)))
            scale = reader.get(layout.scale_name).reshape(1, 1)
        elif layout.format == "fp8":
            weight = read(layout.weight_name, 2, (row_sl, slice(k0, k1)))
            scale = read(layout.scale_name, 2, (slice(n0 // bn, -(-n1 // bn)), slice(k0 // bk, -(-k1 // bk))))
        elif layout.format == "nvfp4":
            bk = layout.block[1]
            scale = read(layout.scale_name, 2, (row_sl, slice(k0 // bk, -(-k1 // bk))))
            weight = read(layout.weight_name, 2, (row_sl, slice(k0 // 2, -(-k1 // 2))))
        elif layout.format == "fp4":
            scale = read(layout.scale_name, 2, (row_sl, slice(k0 // 32, -(-k1 // 32))))
            if layout.layout == "gpt-oss":
                weight = read(layout.weight_name, 3, (row_sl, slice(k0 // 32, -(-k1 // 32))))
            else:
                weight = read(layout.weight_name, 2, (row_sl, slice(k0 // 2, -(-k1 // 2))))
        else:
            weight, scale = read(layout.weight_name, 2, (row_sl, slice(k0, k1))), None
        bias = read(layout.bias_name, 1, (row_sl,))
        if sharded:
            layout = replace(layout, out_features=n1 - n0, in_features=k1 - k0)
        if layout.format == "fp8":
            weight = weight.view(torch.float8_e4m3fn) if weight.dtype == torch.uint8 else weight
            if scale.dtype == torch.uint8:
                scale = scale.view(torch.float8_e8m0fnu)
            elif scale.dtype in (torch.bfloat16, torch.float16):
                scale = scale.to(torch.float32)  # exact widening; the op takes float32 multipliers
            fmt_name = "fp8"
        elif layout.format == "nvfp4":
            weight = formats.as_fp4_bytes(weight, layout.weight_name)
            scale = scale.view(formats.NVFP4.scales[0].dtype)
            fmt_name = "nvfp4"
        elif layout.format == "fp4":
            if layout.layout == "gpt-oss":
                weight = weight.reshape(weight.shape[0], -1)  # [N, K/32, 16] -> [N, K/2], same byte order
            weight = formats.as_fp4_bytes(weight, layout.weight_name)
            scale = scale.view(torch.float8_e8m0fnu)
            fmt_name = "fp4"
        else:
            if weight.dtype == torch.float16:
                weight = weight.to(torch.float32)  # exact; runs as fp32w
            fmt_name = None
        tensor_scale = None
        if layout.tensor_scale_name is not None:
            tensor_scale = reader.get(layout.tensor_scale_name).reshape(())
        if fmt_name is not None:
            try:
                k_check = None if layout.weight_name in region else layout.in_features
                if fmt_name == "nvfp4":
                    formats.NVFP4.find_nan_codes(None, scale, tensor_scale=tensor_scale, name=layout.weight_name)
                    check_scale_range(tensor_scale, name=layout.tensor_scale_name,
                                      limit=torch.finfo(torch.float32).max / (6.0 * formats.FP8_MAX))
                    scan_nan_codes(weight, None, name=layout.weight_name, fmt=fmt_name, in_features=k_check)
                else:
                    scan_nan_codes(weight, scale, name=layout.weight_name, fmt=fmt_name, in_features=k_check)
            except ValueError as e:
                # formats names a scale "<weight>_scale"; say the checkpoint's own name instead
                msg = str(e)
                if msg.startswith(f"{layout.weight_name}_scale:"):
                    msg = layout.scale_name + msg[len(layout.weight_name) + len("_scale"):]
                if sharded:
                    msg += f" (index within rows {n0}:{n1}, cols {k0}:{k1})"
                raise CheckpointError(msg) from None
        return LinearWeights(layout, weight, scale, bias, {"rows": (n0, n1), "cols": (k0, k1)}, scanned=True,
                             tensor_scale=tensor_scale)


def resolve_linear(
    source: Source,
    prefix: str,
    *,
    expert: Optional[int] = None,
    block: Optional[Sequence[int]] = None,
    in_features: Optional[int] = None,
    format: Optional[str] = None,
    rows: Optional[Sequence[int]] = None,
    cols: Optional[Sequence[int]] = None,
) -> LinearWeights:
    """:func:`detect_linear` then :func:`read_linear`: the layer's validated tensors (or a shard of them)."""
    with open_checkpoint(source) as reader:
        layout = detect_linear(reader, prefix, expert=expert, block=block, in_features=in_features, format=format)
        return read_linear(reader, layout, rows=rows, cols=cols)
