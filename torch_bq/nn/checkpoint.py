"""Compatibility names for checkpoint loading (the old ``torch_bq.nn.checkpoint`` module).

Reading (files, indexes, records, layouts) lives in :mod:`torch_bq.checkpoint`,
which returns a :class:`~torch_bq.checkpoint.LinearWeights`; modules build
themselves from it with ``from_weights``, and the format -> class registry
(:data:`FORMAT_CLASSES`, :func:`load_linear`, :func:`build_module`) lives with the
classes in :mod:`torch_bq.nn.linear`. Both are re-exported here so
``torch_bq.nn.checkpoint.CheckpointReader`` etc. keep working.

Typical reuse by other modules::

    with CheckpointReader(path) as ckpt:
        w = resolve_linear(ckpt, "model.layers.0.mlp.experts.gate_up_proj", expert=3)
        w.format, w.weight, w.scale, w.bias, w.block
"""

from __future__ import annotations

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
