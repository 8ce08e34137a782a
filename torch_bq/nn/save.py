"""``save_quantized``: write a module or model holding torch_bq layers as a recorded, sharded checkpoint.

The output is what :func:`~torch_bq.nn.convert_checkpoint` writes: ``safetensors``
shards named ``model-XXXXX-of-XXXXX.safetensors``, ``model.safetensors.index.json``,
and, for a Hugging Face model (one with ``model.config.to_dict()``), ``config.json``
with torch_bq's ``quantization_config``. Each shard's ``__metadata__`` records the
format, block, scale dtype and ``[N, K]`` of every torch_bq linear (and experts
module) whose weight it holds, and stores their codes with the trailing unit axis
of :mod:`torch_bq.checkpoint.stored`, so :meth:`FP8Linear.from_checkpoint`, :func:`load_quantized_` and
``inspect`` read them back instead of inferring them from shapes. Nothing is
pickled. The directory appears all at once (written beside it, then renamed).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Union

import torch
from torch import nn

from ..checkpoint import INDEX_NAME, LayerRecord, quantization_config, to_stored
from ..checkpoint.record import UNIT_AXIS_LEAVES as _LEAVES
from ._staging import StagedDirectory
from .linear import BF16Linear, FP4Linear, FP8Linear, NVFP4Linear

__all__ = ["save_quantized", "layer_records", "DEFAULT_MAX_SHARD_BYTES"]

#: shard size transformers uses by default (5 GB)
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9


def layer_records(model: nn.Module) -> dict[str, LayerRecord]:
    """``{module name: LayerRecord}`` for every torch_bq linear and experts module in ``model``."""
    from .experts import FP4Experts, FP8Experts

    records = {}
    for name, m in model.named_modules():
        if isinstance(m, FP8Experts):
            rec = LayerRecord("fp8", tuple(m.block), m.scale_dtype)
        elif isinstance(m, FP4Experts):
            rec = LayerRecord("fp4", (1, 32), torch.float8_e8m0fnu)
        elif isinstance(m, FP8Linear):
            rec = LayerRecord("fp8", tuple(m.block), m.weight_scale.dtype, m.in_features, m.out_features)
        elif isinstance(m, FP4Linear):
            rec = LayerRecord("fp4", (1, 32), torch.float8_e8m0fnu, m.in_features, m.out_features)
        elif isinstance(m, NVFP4Linear):
            rec = LayerRecord("nvfp4", (1, 16), torch.float8_e4m3fn, m.in_features, m.out_features)
        elif isinstance(m, BF16Linear):
            fmt = "fp32w" if m.weight.dtype == torch.float32 else "bf16"
            rec = LayerRecord(fmt, None, None, m.in_features, m.out_features)
        else:
            continue
        records[name] = rec
    return records


def _state_tensors(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The state dict as contiguous CPU tensors, each storage once; ``aliases`` maps dropped tied names to kept ones."""
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[tuple, str] = {}
    aliases: dict[str, str] = {}
    for name, t in model.state_dict().items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: state dict entry is a {type(t).__name__}; only tensors can be saved (no pickle)")
        if t.is_meta:
            raise ValueError(f"{name}: is on the meta device; there is nothing to save")
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype) \
            if t.numel() else None
        if key is not None and key in seen:
            aliases[name] = seen[key]  # tied weights (e.g. lm_head = embed_tokens): stored once
            continue
        if key is not None:
            seen[key] = name
        tensors[name] = t.detach().to("cpu").contiguous()
    return tensors, aliases


def save_quantized(
    model: nn.Module,
    directory: Union[str, os.PathLike],
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> dict:
    """Save ``model`` (any module holding torch_bq layers) as a recorded safetensors checkpoint.

    Args:
        model: the model (any module holding torch_bq layers as submodules).
        directory: output directory (created; must be absent or empty unless ``overwrite``,
            which replaces it as a whole).
        max_shard_bytes: start a new shard once one holds this many bytes.
        overwrite: replace a non-empty ``directory``.

    Returns:
        ``{"files": [...], "records": {prefix: {...}}, "bytes": int, "tied": {alias: kept}}``.

    Load it back with ``FP8Linear.from_checkpoint(directory, prefix)`` per layer or
    :func:`~torch_bq.nn.load_quantized_` into a skeleton.
    """
    from safetensors.torch import save_file

    if not isinstance(max_shard_bytes, int) or isinstance(max_shard_bytes, bool) or max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes: expected a positive int, got {max_shard_bytes!r}")
    dst = Path(directory)
    if dst.exists() and not dst.is_dir():
        raise NotADirectoryError(f"directory: {dst} exists and is not a directory")
    if dst.is_dir() and any(dst.iterdir()) and not overwrite:
        raise FileExistsError(f"directory: {dst} exists and is not empty; pass overwrite=True to replace it")
    records = layer_records(model)
    if "" in records:
        raise TypeError(
            f"model: is itself a {type(model).__name__}; checkpoints name layers by prefix, so save a model "
            f"that holds it (e.g. torch.nn.ModuleDict({{'proj': layer}}), loaded back with prefix 'proj')"
        )
    tensors, aliases = _state_tensors(model)
    groups: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if groups[-1] and size + n > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    weight_map: dict[str, str] = {}
    files = []
    with StagedDirectory(dst) as stage:
        for i, names in enumerate(groups):
            file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            held = {p: r for p, r in records.items() if any(f"{p}.{leaf}" in names for leaf in _LEAVES)}
            stored, meta = to_stored({n: tensors[n] for n in names}, held)
            save_file(stored, stage.path / file, metadata={"format": "pt", **meta})
            weight_map.update({n: file for n in names})
            files.append(file)
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index_meta = {"total_size": total}
        if aliases:  # read back by CheckpointReader: a tied name reads the stored tensor
            index_meta["torch_bq_tied"] = dict(sorted(aliases.items()))
        (stage.path / INDEX_NAME).write_text(json.dumps(
            {"metadata": index_meta, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
        config = getattr(model, "config", None)
        if config is not None and callable(getattr(config, "to_dict", None)) and records:
            (stage.path / "config.json").write_text(json.dumps(
                {**config.to_dict(), "quantization_config": _model_config(records)}, indent=2, default=str))
        stage.commit()
    return {"files": files, "records": {p: r.to_json() for p, r in records.items()}, "bytes": total, "tied": aliases}


def _model_config(records: dict[str, LayerRecord]) -> dict:
    """torch_bq's ``quantization_config``: the most common quantized format as default, the others listed."""
    quantized = [r for r in records.values() if r.format in ("fp8", "fp4", "nvfp4")] or list(records.values())
    counts: dict[tuple, int] = {}
    for r in quantized:
        counts[(r.format, r.block, r.scale_dtype)] = counts.get((r.format, r.block, r.scale_dtype), 0) + 1
    fmt, block, sdt = max(counts, key=counts.get)
    return quantization_config(fmt, block, sdt, layers=records)
