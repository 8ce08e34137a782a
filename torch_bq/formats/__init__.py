"""The weight and activation formats of docs/contract.md §1-3: descriptors, codecs, validation, row joins.

* :mod:`~torch_bq.formats.descriptor`: every format as one frozen :class:`WeightFormat`
  entry in a registry (:func:`get_format`, :data:`FORMATS`): element and scale
  encodings, blocks, shapes, dtype/shape checks, NaN-code scans, checkpoint suffixes;
  :class:`WeightSpec` is a format with its block and scale encoding fixed (what a
  checkpoint records). One :func:`cdiv`.
* :mod:`~torch_bq.formats.codecs`: fp8 (any block), OCP MXFP4, e8m0 and the fp8
  activation round trip (``qdq_fp8``): quantizers, decoders, packing.
* :mod:`~torch_bq.formats.nvfp4`: NVIDIA NVFP4 (ModelOpt checkpoints).
* :mod:`~torch_bq.formats.rows`: exact row slicing and joining of block-scaled weights.

Every function here is exact: quantizers produce the bytes the contract names,
decoders produce the values the contract names, and validators raise
``ValueError``/``TypeError`` naming the offending tensor.

Storage dtypes that mean the same bytes are interchangeable:

* fp8 data: ``torch.float8_e4m3fn`` or ``torch.uint8`` (raw E4M3FN bytes);
* e8m0 scales: ``torch.float8_e8m0fnu`` or ``torch.uint8`` (raw exponent codes);
* packed fp4: ``torch.uint8``, ``torch.int8`` or ``torch.float4_e2m1fn_x2``.

Scales are always *multiplied* into the data (DeepSeek's ``weight_scale_inv``
included, despite its name).
"""

from .codecs import (
    DEFAULT_ACT_PEAK,
    E8M0_BIAS,
    E8M0_NAN,
    FP4_BLOCK,
    FP4_LUT,
    FP4_MAX,
    FP8_MAX,
    MIN_ACT_PEAK,
    QDQ_BLOCK,
    as_e8m0_codes,
    as_fp4_bytes,
    as_fp8_bytes,
    check_finite,
    check_fp4_weight,
    check_fp8_weight,
    check_peak,
    check_qdq_args,
    decode_e8m0,
    dequantize_fp4,
    dequantize_fp8,
    expand_blocks,
    find_nan_codes,
    fp8_scale_shape,
    pack_fp4,
    qdq_fp8,
    quantize_fp4,
    quantize_fp8,
    unpack_fp4,
)
from .descriptor import (
    BF16,
    E2M1,
    E4M3_SCALE,
    E4M3FN,
    E8M0,
    F32_SCALE,
    FORMATS,
    FP4,
    FP8,
    FP32W,
    MAX_BLOCK,
    MXFP8,
    NVFP4,
    CheckpointSuffixes,
    ElementEncoding,
    ScaleEncoding,
    WeightFormat,
    WeightSpec,
    cdiv,
    check_block,
    format_names,
    get_format,
)
from .nvfp4 import NVFP4_BLOCK, check_nvfp4_weight, dequantize_nvfp4, nvfp4_tensor_scale, quantize_nvfp4
from .rows import RowPiece, fine_scale, join_rows, slice_rows

__all__ = [
    # constants
    "FP8_MAX",
    "MIN_ACT_PEAK",
    "MAX_BLOCK",
    "FP4_MAX",
    "FP4_LUT",
    "E8M0_NAN",
    "E8M0_BIAS",
    "DEFAULT_ACT_PEAK",
    "QDQ_BLOCK",
    "FP4_BLOCK",
    "NVFP4_BLOCK",
    # descriptors and the registry
    "ElementEncoding",
    "ScaleEncoding",
    "CheckpointSuffixes",
    "WeightFormat",
    "WeightSpec",
    "E4M3FN",
    "E2M1",
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
    "cdiv",
    "check_block",
    # codecs
    "quantize_fp8",
    "dequantize_fp8",
    "quantize_fp4",
    "dequantize_fp4",
    "quantize_nvfp4",
    "dequantize_nvfp4",
    "nvfp4_tensor_scale",
    "pack_fp4",
    "unpack_fp4",
    "decode_e8m0",
    "expand_blocks",
    "qdq_fp8",
    # validation
    "fp8_scale_shape",
    "check_fp8_weight",
    "check_fp4_weight",
    "check_nvfp4_weight",
    "check_finite",
    "check_peak",
    "check_qdq_args",
    "find_nan_codes",
    "as_e8m0_codes",
    "as_fp8_bytes",
    "as_fp4_bytes",
    # rows
    "RowPiece",
    "slice_rows",
    "join_rows",
    "fine_scale",
]
