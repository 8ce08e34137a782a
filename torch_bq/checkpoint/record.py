"""What a checkpoint says about its own quantization: torch_bq's records and known families' configs.

torch_bq writes one record per quantized layer into the ``__metadata__`` of the
shard that holds the layer's weight, under the key ``"torch_bq"``, as JSON::

    {"version": 2, "layers": {"model.layers.0.mlp.down_proj":
        {"format": "fp8", "block": [96, 96], "scale_dtype": "float8_e8m0fnu",
         "in_features": 100, "out_features": 200, "unit_axis": ["weight"]}}}

``unit_axis`` (version 2) names the layer's tensors stored with one trailing
unit axis, ``weight [200, 100, 1]`` here (why, and the one place that adds and
removes it: :mod:`torch_bq.checkpoint.stored`). Version 1 records have none:
every tensor is stored in its natural shape.

and a model-wide ``quantization_config`` into ``config.json`` in the
convention Hugging Face uses (``quant_method: "torch_bq"``; see
docs/checkpoints.md for the keys). Loaders trust, in this order: the shard's
record, ``config.json``'s torch_bq ``quantization_config``, a known family's
config (DeepSeek-V3 / HF fine-grained fp8 ``weight_block_size``, gpt-oss
``mxfp4``), and only then the shapes.

Every value read here comes from a file, so every one is checked: a list where
a number belongs, ``[128, "x"]``, ``[128.7, 128]`` or ``true`` are errors that
name the file and key, never truncated or guessed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch

from .errors import CheckpointError

__all__ = [
    "LayerRecord",
    "RECORD_KEY",
    "RECORD_VERSION",
    "UNIT_AXIS_LEAVES",
    "UNIT_AXIS_FORMATS",
    "QUANT_METHOD",
    "FORMAT_NAMES",
    "SCALE_DTYPES",
    "encode_records",
    "decode_records",
    "config_record",
    "quantization_config",
    "check_block_value",
]

RECORD_KEY = "torch_bq"
#: 2: records may name tensors stored with a trailing unit axis (``unit_axis``); 1: none are.
#: A reader refuses versions above its own, so a torch_bq that knows only 1 refuses a file
#: it would misread instead of reading it.
RECORD_VERSION = 2
QUANT_METHOD = "torch_bq"

#: accepted format names -> canonical name
FORMAT_NAMES = {"fp8": "fp8", "mxfp8": "fp8", "fp4": "fp4", "mxfp4": "fp4", "nvfp4": "nvfp4", "bf16": "bf16",
                "fp32w": "fp32w"}

#: the leaf names of element-code tensors: a torch_bq linear's ``weight``, a torch_bq experts
#: module's ``gate_up_proj`` / ``down_proj`` (the only names a record's ``unit_axis`` may give)
UNIT_AXIS_LEAVES = ("weight", "gate_up_proj", "down_proj")
#: the formats whose codes torch_bq's own layout stores with a unit axis. NVFP4 is written in
#: ModelOpt's layout, as ModelOpt writes it (its packed [N, ceil(K/2)] is not [N, K] for K >= 2).
UNIT_AXIS_FORMATS = ("fp8", "fp4")

#: recorded scale dtype names -> torch dtypes
SCALE_DTYPES = {"float8_e8m0fnu": torch.float8_e8m0fnu, "float32": torch.float32, "float8_e4m3fn": torch.float8_e4m3fn}


@dataclass(frozen=True)
class LayerRecord:
    """One layer's recorded quantization.

    Attributes:
        format: canonical format name (``"fp8"``, ``"fp4"``, ``"bf16"``, ``"fp32w"``).
        block: the scale block ``(bn, bk)``, or ``None`` when not recorded (dense).
        scale_dtype: the stored scale dtype, or ``None`` when not recorded.
        in_features, out_features: ``K`` and ``N`` when recorded (fp4 with odd ``K`` needs it).
        source: where the record was read, for messages.
        default: the model-wide default of a config (not a record of this very layer), so
            a layer stored dense is simply one the config did not quantize.
        unit_axis: the leaf names (``"weight"``, ``"gate_up_proj"``, ``"down_proj"``) of the
            layer's tensors that this record's file stores with one trailing unit axis
            (record version 2; see :mod:`torch_bq.checkpoint.stored`).
    """

    format: str
    block: Optional[tuple[int, int]] = None
    scale_dtype: Optional[torch.dtype] = None
    in_features: Optional[int] = None
    out_features: Optional[int] = None
    source: str = ""
    default: bool = False
    unit_axis: tuple[str, ...] = ()

    def to_json(self) -> dict:
        out: dict[str, Any] = {"format": self.format}
        if self.block is not None:
            out["block"] = list(self.block)
        if self.scale_dtype is not None:
            out["scale_dtype"] = str(self.scale_dtype).replace("torch.", "")
        for key in ("in_features", "out_features"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.unit_axis:
            out["unit_axis"] = list(self.unit_axis)
        return out


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_block_value(value, where: str) -> tuple[int, int]:
    """``value`` as a block ``(bn, bk)``: exactly two positive ints (no floats, bools or strings)."""
    if not isinstance(value, (list, tuple)) or len(value) != 2 or not all(_is_int(v) and v >= 1 for v in value):
        raise CheckpointError(f"{where}: expected a block [bn, bk] of two positive ints, got {value!r}")
    return int(value[0]), int(value[1])


def _check_format(value, where: str) -> str:
    if not isinstance(value, str) or value.lower() not in FORMAT_NAMES:
        raise CheckpointError(f"{where}: expected a format name in {sorted(FORMAT_NAMES)}, got {value!r}")
    return FORMAT_NAMES[value.lower()]


def _check_scale_dtype(value, where: str) -> torch.dtype:
    if not isinstance(value, str) or value.replace("torch.", "") not in SCALE_DTYPES:
        raise CheckpointError(f"{where}: expected a scale dtype in {sorted(SCALE_DTYPES)}, got {value!r}")
    return SCALE_DTYPES[value.replace("torch.", "")]


def _parse_layer(value, where: str, default: bool = False) -> LayerRecord:
    if not isinstance(value, Mapping):
        raise CheckpointError(f"{where}: expected an object, got {type(value).__name__} {value!r}")
    fmt = _check_format(value.get("format"), f"{where}.format")
    block = None if value.get("block") is None else check_block_value(value["block"], f"{where}.block")
    sdt = None if value.get("scale_dtype") is None else _check_scale_dtype(value["scale_dtype"], f"{where}.scale_dtype")
    dims = {}
    for key in ("in_features", "out_features"):
        v = value.get(key)
        if v is not None and not (_is_int(v) and v >= 1):
            raise CheckpointError(f"{where}.{key}: expected a positive int, got {v!r}")
        dims[key] = v
    unit_axis = value.get("unit_axis", [])
    if not isinstance(unit_axis, list) or not all(isinstance(v, str) and v in UNIT_AXIS_LEAVES for v in unit_axis):
        raise CheckpointError(f"{where}.unit_axis: expected a list of names in {list(UNIT_AXIS_LEAVES)}, got {unit_axis!r}")
    if unit_axis and fmt not in UNIT_AXIS_FORMATS:
        raise CheckpointError(f"{where}.unit_axis: only {list(UNIT_AXIS_FORMATS)} codes are stored with a unit axis, "
                              f"the record says {fmt}")
    if fmt == "fp4" and block not in (None, (1, 32)):
        raise CheckpointError(f"{where}.block: fp4 (MXFP4) blocks are [1, 32], got {list(block)}")
    if fmt == "nvfp4" and block not in (None, (1, 16)):
        raise CheckpointError(f"{where}.block: nvfp4 blocks are [1, 16], got {list(block)}")
    return LayerRecord(fmt, block, sdt, dims["in_features"], dims["out_features"], where, default, tuple(unit_axis))


def encode_records(records: Mapping[str, LayerRecord]) -> dict[str, str]:
    """The ``__metadata__`` entries recording ``records`` (layer prefix -> record)."""
    body = {"version": RECORD_VERSION, "layers": {p: r.to_json() for p, r in sorted(records.items())}}
    return {RECORD_KEY: json.dumps(body, separators=(",", ":"))}


def decode_records(metadata: Mapping[str, str], where: str) -> dict[str, LayerRecord]:
    """The records in a file's ``__metadata__`` (``{}`` when it has none); ``where`` names the file."""
    raw = metadata.get(RECORD_KEY)
    if raw is None:
        return {}
    where = f"{where} __metadata__[{RECORD_KEY!r}]"
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise CheckpointError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(body, dict):
        # Older torch_bq (and convert before records) wrote the bare format name here.
        return {}
    version = body.get("version")
    if not _is_int(version) or version > RECORD_VERSION:
        raise CheckpointError(f"{where}: record version {version!r} is not one this torch_bq reads (<= {RECORD_VERSION})")
    layers = body.get("layers")
    if not isinstance(layers, dict):
        raise CheckpointError(f"{where}.layers: expected an object, got {type(layers).__name__}")
    records = {prefix: _parse_layer(v, f"{where}.layers[{prefix!r}]") for prefix, v in layers.items()}
    if version < 2 and any(r.unit_axis for r in records.values()):
        raise CheckpointError(f"{where}: unit_axis is a version 2 field, the record says version {version}")
    return records


def quantization_config(
    format: str, block, scale_dtype, *, layers: Optional[Mapping[str, LayerRecord]] = None,
    modules_to_not_convert=None, act_quant: Optional[bool] = None, act_peak: Optional[float] = None,
) -> dict:
    """The ``config.json`` ``quantization_config`` torch_bq writes (HF convention, ``quant_method: "torch_bq"``).

    ``layers`` lists only the layers whose record differs from the model-wide
    ``format``/``block``/``scale_dtype``.
    """
    out: dict[str, Any] = {"quant_method": QUANT_METHOD, "version": RECORD_VERSION, "format": format}
    if block is not None:
        out["block"] = list(block)
    if scale_dtype is not None:
        out["scale_dtype"] = str(scale_dtype).replace("torch.", "")
    if act_quant is not None:
        out["act_quant"] = bool(act_quant)
    if act_peak is not None:
        out["act_peak"] = float(act_peak)
    if modules_to_not_convert is not None:
        out["modules_to_not_convert"] = list(modules_to_not_convert)
    if layers:
        default = (format, None if block is None else tuple(block), scale_dtype)
        diff = {p: r.to_json() for p, r in sorted(layers.items()) if (r.format, r.block, r.scale_dtype) != default}
        if diff:
            out["layers"] = diff
    return out


def config_record(config: Mapping, prefix: str, where: str = "config.json") -> Optional[LayerRecord]:
    """The record ``config.json``'s torch_bq ``quantization_config`` gives ``prefix``, or ``None``.

    Layers listed under ``layers`` get their own entry; every other layer gets
    the model-wide ``format``/``block``/``scale_dtype`` (which the caller checks
    against the tensors: a layer stored dense is simply not quantized).
    """
    qc = config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, Mapping):
        raise CheckpointError(f"{where}: quantization_config must be an object, got {type(qc).__name__}")
    if qc.get("quant_method") != QUANT_METHOD:
        return None
    where = f"{where} quantization_config"
    layers = qc.get("layers", {})
    if not isinstance(layers, Mapping):
        raise CheckpointError(f"{where}.layers: expected an object, got {type(layers).__name__}")
    if prefix in layers:
        return _parse_layer(layers[prefix], f"{where}.layers[{prefix!r}]")
    if qc.get("format") is None:
        return None
    return _parse_layer({k: qc.get(k) for k in ("format", "block", "scale_dtype")}, where, default=True)


def family_block(config: Mapping, where: str = "config.json") -> Optional[tuple[tuple[int, int], str]]:
    """``(block, source)`` from a known family's ``quantization_config`` (DeepSeek-V3 / HF fp8), or ``None``."""
    qc = config.get("quantization_config")
    if not isinstance(qc, Mapping) or qc.get("quant_method") == QUANT_METHOD:
        return None
    value = qc.get("weight_block_size")
    if value is None:
        return None
    key = f"{where} quantization_config.weight_block_size"
    return check_block_value(value, key), key
