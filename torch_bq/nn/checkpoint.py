"""The nn side of checkpoint loading: which module class holds which format, and ``load_linear``.

Reading (files, indexes, records, layouts) lives in :mod:`torch_bq.checkpoint`,
which returns a :class:`~torch_bq.checkpoint.LinearWeights`; modules build
themselves from it with ``from_weights``. The reader's public names are
re-exported here so ``torch_bq.nn.checkpoint.CheckpointReader`` etc. keep working.

Typical reuse by other modules::

    with CheckpointReader(path) as ckpt:
        w = resolve_linear(ckpt, "model.layers.0.mlp.experts.gate_up_proj", expert=3)
        w.format, w.weight, w.scale, w.bias, w.block
"""

from __future__ import annotations

from typing import Optional, Sequence

from ..checkpoint import (  # noqa: F401  (re-exported)
    INDEX_NAME,
    AmbiguousLayoutError,
    CheckpointError,
    CheckpointReader,
    IncompleteCheckpointError,
    LinearLayout,
    LinearWeights,
    MissingTensorError,
    NotARegularFileError,
    Source,
    UnsafePathError,
    detect_linear,
    open_checkpoint,
    read_linear,
    resolve_linear,
)
from .linear import FORMAT_CLASSES, build_module, check_module_class, load_linear, module_class_for  # noqa: F401

__all__ = [
    "CheckpointError",
    "MissingTensorError",
    "AmbiguousLayoutError",
    "IncompleteCheckpointError",
    "UnsafePathError",
    "NotARegularFileError",
    "CheckpointReader",
    "LinearLayout",
    "LinearWeights",
    "open_checkpoint",
    "detect_linear",
    "read_linear",
    "resolve_linear",
    "load_linear",
    "build_module",
    "module_class_for",
    "check_module_class",
    "FORMAT_CLASSES",
    "INDEX_NAME",
]
