"""Drop-in modules on block-quantized weights and the checkpoint loader.

* :class:`FP8Linear`, :class:`FP4Linear`, :class:`NVFP4Linear`, :class:`BF16Linear` — ``nn.Linear`` replacements
  (:mod:`torch_bq.nn.linear`);
* :class:`CheckpointReader`, :func:`resolve_linear` and friends — the one loader for every
  supported checkpoint layout (:mod:`torch_bq.checkpoint`, re-exported), and
  :func:`save_quantized`, which writes a recorded checkpoint (:mod:`torch_bq.nn.save`);
* :func:`quantize_`, :func:`load_quantized_`, :func:`convert_checkpoint` — whole models and
  checkpoints (:mod:`torch_bq.nn.convert`);
* :class:`DrafterConfig`, :class:`DrafterLayer`, :class:`Drafter` — the DSpark
  speculative-decoding drafter (:mod:`torch_bq.nn.drafter`), with :class:`GemmaRMSNorm`;
* :class:`FP4Experts`, :class:`FP8Experts` — mixture-of-experts layers (:mod:`torch_bq.nn.experts`).
"""

from .checkpoint import (
    AmbiguousLayoutError,
    IncompleteCheckpointError,
    NotARegularFileError,
    UnsafePathError,
    CheckpointError,
    CheckpointReader,
    LinearLayout,
    LinearWeights,
    MissingTensorError,
    build_module,
    detect_linear,
    open_checkpoint,
    read_linear,
    resolve_linear,
)
from .convert import LoadReport, QuantizeReport, convert_checkpoint, load_quantized_, quantize_
from .drafter import Drafter, DrafterLayer
from .drafter_config import DrafterConfig
from .experts import FP4Experts, FP8Experts
from .linear import BF16Linear, FP4Linear, FP8Linear, NVFP4Linear
from .norm import GemmaRMSNorm
from .save import save_quantized

__all__ = [
    "FP8Linear",
    "FP4Linear",
    "NVFP4Linear",
    "BF16Linear",
    "FP4Experts",
    "FP8Experts",
    "CheckpointError",
    "MissingTensorError",
    "AmbiguousLayoutError",
    "IncompleteCheckpointError",
    "UnsafePathError",
    "NotARegularFileError",
    "save_quantized",
    "CheckpointReader",
    "LinearLayout",
    "LinearWeights",
    "open_checkpoint",
    "build_module",
    "detect_linear",
    "read_linear",
    "resolve_linear",
    "quantize_",
    "load_quantized_",
    "convert_checkpoint",
    "QuantizeReport",
    "LoadReport",
    "DrafterConfig",
    "DrafterLayer",
    "Drafter",
    "GemmaRMSNorm",
]
