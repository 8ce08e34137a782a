"""Reading checkpoints: safetensors files and sharded indexes, records, and linear-layer layouts.

This package returns data (:class:`LinearWeights`), never modules; the modules of
:mod:`torch_bq.nn` build themselves from it (``FP8Linear.from_weights``). It does
not import :mod:`torch_bq.nn`.

* :mod:`.safetensors_file` — one file: header checked, tensors read into owned memory;
* :mod:`.reader` — :class:`CheckpointReader`: files, directories, indexes, mappings;
* :mod:`.record` — what torch_bq records (``__metadata__``, ``config.json``) and known families' configs;
* :mod:`.layouts` — :func:`detect_linear` / :func:`read_linear`: layout detection -> weights record;
* :mod:`.stored` — the trailing unit axis torch_bq's own layout stores element codes with;
* :mod:`.scan` — the bounded-memory NaN-code scan.
"""

from .errors import (
    AmbiguousLayoutError,
    CheckpointError,
    IncompleteCheckpointError,
    MissingTensorError,
    NotARegularFileError,
    UnsafePathError,
)
from .layouts import (
    LAYOUT_OF_SUFFIX,
    SCALE_SUFFIXES,
    LinearLayout,
    LinearWeights,
    block_candidates,
    detect_linear,
    quantized_prefixes,
    read_linear,
    record_of,
    resolve_linear,
)
from .reader import INDEX_NAME, SHARD_PATTERN, CheckpointReader, Source, open_checkpoint, read_json
from .record import (
    QUANT_METHOD,
    RECORD_KEY,
    LayerRecord,
    config_record,
    decode_records,
    encode_records,
    quantization_config,
)
from .safetensors_file import SafetensorsFile
from .scan import scan_nan_codes
from .stored import from_stored, to_stored

__all__ = [
    "CheckpointError",
    "MissingTensorError",
    "AmbiguousLayoutError",
    "IncompleteCheckpointError",
    "UnsafePathError",
    "NotARegularFileError",
    "CheckpointReader",
    "SafetensorsFile",
    "open_checkpoint",
    "read_json",
    "Source",
    "INDEX_NAME",
    "SHARD_PATTERN",
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
    "LayerRecord",
    "RECORD_KEY",
    "QUANT_METHOD",
    "encode_records",
    "decode_records",
    "config_record",
    "quantization_config",
    "scan_nan_codes",
    "to_stored",
    "from_stored",
]
