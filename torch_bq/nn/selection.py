"""What gets quantized: the default exclusions, tied tensors, and which modules a checkpoint holds quantized.

Shared by :mod:`torch_bq.nn.convert` (``quantize_``, ``load_quantized_``,
``convert_checkpoint``) and :mod:`torch_bq.hf` (transformers' loading steps), so
that both pick the same modules; it imports neither of them.
"""

from __future__ import annotations

from torch import nn

from ..checkpoint import SCALE_SUFFIXES, CheckpointReader, detect_linear
from .expert_checkpoint import stacked_experts_format

__all__ = ["DEFAULT_EXCLUDE", "experts_layout", "quantized_layout", "set_submodule", "tied_groups"]

#: tensors ``quantize_``, ``convert_checkpoint`` and ``torch_bq.hf`` leave in high precision unless told otherwise
DEFAULT_EXCLUDE = r"(embed|lm_head|norm|router|\.gate\.weight$)"


def set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    """Replace the submodule at dotted ``name`` of ``model`` by ``module``."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def tied_groups(model: nn.Module) -> list[list[str]]:
    """Names of parameters/buffers that are one tensor under several names (tied embeddings), per tensor."""
    groups: dict[int, list[str]] = {}
    for name, t in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(t), []).append(name)
    for name, t in model.named_buffers(remove_duplicate=False):
        if t is not None:
            groups.setdefault(id(t), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def quantized_layout(reader: CheckpointReader, prefix: str):
    """The layout of ``prefix`` if the checkpoint holds it quantized, else ``None``."""
    names = [prefix + s for s in SCALE_SUFFIXES] + [f"{prefix}_blocks"]
    if not any(n in reader for n in names):
        return None
    layout = detect_linear(reader, prefix)
    return layout if layout.format in ("fp8", "fp4", "nvfp4") else None


def experts_layout(reader: CheckpointReader, prefix: str):
    """``(layout, format, options)`` of the experts stored under ``prefix``, or ``None`` if not quantized experts."""
    if f"{prefix}.gate_up_proj_blocks" in reader:
        return "gpt-oss", "fp4", {}
    fmt = stacked_experts_format(reader, prefix)
    if fmt is not None:
        return "torch_bq", fmt, {}
    for projections in (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")):
        gate = f"{prefix}.0.{projections[0]}"
        layout = quantized_layout(reader, gate)
        if layout is not None:
            return "deepseek", layout.format, {"projections": projections}
    return None
