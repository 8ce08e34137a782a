"""Whole models and whole checkpoints: ``quantize_``, ``load_quantized_``, ``convert_checkpoint``.

* :func:`quantize_` swaps every selected ``nn.Linear`` of a live model for an
  ``FP8Linear``/``FP4Linear``/``BF16Linear`` in place;
* :func:`load_quantized_` fills a model skeleton (typically built on ``meta``)
  from a checkpoint, installing a torch_bq module wherever the checkpoint holds
  a quantized linear and loading everything else as usual;
* :func:`convert_checkpoint` quantizes a bf16/fp32 safetensors checkpoint shard
  by shard into our layout plus an index.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence, TextIO

import torch
from torch import nn

from .. import formats
from ._staging import StagedDirectory
from ..checkpoint import (
    INDEX_NAME,
    SCALE_SUFFIXES,
    CheckpointError,
    CheckpointReader,
    LayerRecord,
    MissingTensorError,
    Source,
    detect_linear,
    encode_records,
    open_checkpoint,
    quantization_config,
    read_json,
    read_linear,
)
from .linear import BF16Linear, FP4Linear, FP8Linear, build_module, module_class_for

__all__ = [
    "QuantizeReport",
    "LoadReport",
    "quantize_",
    "load_quantized_",
    "convert_checkpoint",
    "DEFAULT_EXCLUDE",
]

_TORCH_BQ_MODULES = (FP8Linear, FP4Linear, BF16Linear)

#: tensors ``convert_checkpoint`` leaves in high precision unless told otherwise
DEFAULT_EXCLUDE = r"(embed|lm_head|norm|router|\.gate\.weight$)"


def _state_bytes(module: nn.Module) -> int:
    # Tensors held, not state_dict entries: an FP8Linear's recorded block (_extra_state) is not weight bytes.
    held = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in held)


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


# =========================================================================== #
# quantize_
# =========================================================================== #


@dataclass
class QuantizeReport:
    """What :func:`quantize_` did: converted layer names and weight bytes before/after."""

    format: str
    converted: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    bytes_before: int = 0
    bytes_after: int = 0

    def __str__(self) -> str:
        ratio = self.bytes_after / self.bytes_before if self.bytes_before else 1.0
        return (
            f"quantize_ -> {self.format}: {len(self.converted)} linear layers converted, "
            f"{len(self.skipped)} skipped; {self.bytes_before / 2**20:.2f} MiB -> "
            f"{self.bytes_after / 2**20:.2f} MiB ({ratio:.2f}x)"
        )


def quantize_(
    model: nn.Module,
    format: str = "fp8",
    filter_fn: Optional[Callable[[nn.Module, str], bool]] = None,
    **options,
) -> QuantizeReport:
    """Replace the ``nn.Linear`` layers of ``model`` with torch_bq modules, in place.

    Args:
        model: any module; ``model`` itself is never replaced, only its children.
        format: ``"fp8"`` (:class:`FP8Linear`), ``"fp4"`` (:class:`FP4Linear`),
            ``"bf16"`` (:class:`BF16Linear`, weights rounded to bf16) or ``"fp32w"``
            (:class:`BF16Linear` keeping float32 weights).
        filter_fn: ``filter_fn(module, fully_qualified_name) -> bool``; ``None`` converts
            every ``nn.Linear``.
        options: passed to the class's ``from_linear`` (``block``, ``scale_dtype``,
            ``act_quant``, ``act_peak``, ``rounding``, ``keep_fp32``).

    Returns:
        A :class:`QuantizeReport`; ``str(report)`` is a one-line summary.

    Every selected layer is quantized before the first one is swapped in, so an
    error (a non-finite weight, a layer on ``meta``) leaves the model unchanged.
    """
    cls = module_class_for(format)
    if format in ("bf16", "fp32w"):
        options.setdefault("keep_fp32", format == "fp32w")
    report = QuantizeReport(format)
    replacements: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if not name or type(module) is not nn.Linear:
            continue
        if filter_fn is not None and not filter_fn(module, name):
            report.skipped.append(name)
            continue
        try:
            new = cls.from_linear(module, **options)
        except (ValueError, TypeError) as e:
            raise type(e)(f"{name}: {e}") from None
        report.bytes_before += _state_bytes(module)
        report.bytes_after += _state_bytes(new)
        replacements.append((name, new))
    for name, new in replacements:
        _set_submodule(model, name, new)
        report.converted.append(name)
    return report


# =========================================================================== #
# load_quantized_
# =========================================================================== #


@dataclass
class LoadReport:
    """What :func:`load_quantized_` did."""

    quantized: dict[str, str] = field(default_factory=dict)  # module name -> "fp8 (deepseek-v3)"
    dense: list[str] = field(default_factory=list)  # state-dict keys loaded as usual
    missing: list[str] = field(default_factory=list)  # model keys the checkpoint lacks (strict=False)

    def __str__(self) -> str:
        kinds: dict[str, int] = {}
        for v in self.quantized.values():
            kinds[v] = kinds.get(v, 0) + 1
        parts = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) or "none"
        return (
            f"load_quantized_: {len(self.quantized)} quantized linear layers ({parts}), "
            f"{len(self.dense)} other tensors, {len(self.missing)} missing"
        )


def load_quantized_(
    model: nn.Module,
    source: Source,
    *,
    device="cpu",
    strict: bool = True,
    act_quant: Optional[bool] = None,
    act_peak: Optional[float] = None,
) -> LoadReport:
    """Load ``source`` into ``model``, installing torch_bq modules for quantized linears.

    For every ``nn.Linear`` (or torch_bq linear) named ``p`` in ``model`` whose
    checkpoint weights under ``p`` are fp8 or fp4 in any layout
    :func:`~torch_bq.nn.checkpoint.detect_linear` knows, the module is replaced
    by a loaded :class:`FP8Linear`/:class:`FP4Linear`. Every other entry of
    ``model.state_dict()`` is read from the checkpoint under its own name, cast
    to the model's floating dtype where both are floating, and assigned
    (``load_state_dict(assign=True)``), so a skeleton built on ``meta`` ends up
    fully materialised on ``device``.

    Args:
        model: the model or skeleton (e.g. ``with torch.device("meta"): Model(config)``).
        source: checkpoint file, directory, mapping or :class:`CheckpointReader`.
        device: where loaded tensors go.
        strict: raise if the checkpoint lacks any of the model's tensors.
        act_quant, act_peak: options for the installed quantized modules.

    Returns:
        A :class:`LoadReport`.

    Everything is read and validated before the model is touched; on any
    error (missing tensors, bad shapes, NaN codes) the model is unchanged.
    """
    with open_checkpoint(source) as reader:
        loaded: dict[str, nn.Module] = {}
        report = LoadReport()
        for name, module in model.named_modules():
            if not name or not (type(module) is nn.Linear or isinstance(module, _TORCH_BQ_MODULES)):
                continue
            if any(name.startswith(p + ".") for p in loaded):
                continue
            layout = _quantized_layout(reader, name)
            if layout is None:
                continue
            expected = (module.out_features, module.in_features)
            if (layout.out_features, layout.in_features) != expected:
                raise CheckpointError(
                    f"{name}: the model expects a [{expected[0]}, {expected[1]}] linear, the checkpoint's "
                    f"{layout.weight_name} is [{layout.out_features}, {layout.in_features}]"
                )
            if (module.bias is not None) != (layout.bias_name is not None):
                raise CheckpointError(
                    f"{name}: the model's linear {'has' if module.bias is not None else 'has no'} bias, "
                    f"the checkpoint {'has' if layout.bias_name else 'has no'} {name}.bias"
                )
            weights = read_linear(reader, layout)
            loaded[name] = build_module(weights, device=device, act_quant=act_quant, act_peak=act_peak)
            report.quantized[name] = f"{layout.format} ({layout.layout})"

        dense: dict[str, torch.Tensor] = {}
        targets = model.state_dict(keep_vars=True)
        for key, target in targets.items():
            if any(key.startswith(p + ".") for p in loaded):
                continue
            if key not in reader:
                report.missing.append(key)
                continue
            t = reader.get(key)
            if tuple(t.shape) != tuple(target.shape):
                raise CheckpointError(f"{key}: the model expects shape {list(target.shape)}, the checkpoint has {list(t.shape)}")
            if t.dtype.is_floating_point and target.dtype.is_floating_point and t.dtype != target.dtype:
                t = t.to(target.dtype)
            dense[key] = t.to(device)
            report.dense.append(key)
        if report.missing and strict:
            near = sorted({c for k in report.missing[:5] for c in reader.closest(k, 2)})
            raise MissingTensorError(
                f"the checkpoint lacks {len(report.missing)} of the model's tensors: {report.missing[:10]}"
                + ("..." if len(report.missing) > 10 else "")
                + (f"; closest names present: {near[:10]}" if near else "")
                + "; pass strict=False to load the rest"
            )

    for name, module in loaded.items():
        _set_submodule(model, name, module)
    model.load_state_dict(dense, strict=False, assign=True)
    return report


def _quantized_layout(reader: CheckpointReader, prefix: str):
    """The layout of ``prefix`` if the checkpoint holds it quantized, else ``None``."""
    names = [prefix + s for s in (".weight_scale", ".weight_scale_inv", ".scale")] + [f"{prefix}_blocks"]
    if not any(n in reader for n in names):
        return None
    layout = detect_linear(reader, prefix)
    return layout if layout.format in ("fp8", "fp4", "nvfp4") else None


# =========================================================================== #
# convert_checkpoint
# =========================================================================== #


class Progress:
    """Progress on ``stream``: one line rewritten in place on a terminal, else one line per percent."""

    def __init__(self, stream: Optional[TextIO], total: int, what: str) -> None:
        self.stream, self.total, self.what, self.done = stream, total, what, 0
        self.tty = bool(stream is not None and getattr(stream, "isatty", lambda: False)())

    def step(self, label: str) -> None:
        self.done += 1
        if self.stream is None:
            return
        line = f"{self.what} [{self.done}/{self.total}] {label}"
        if self.tty:
            self.stream.write("\r\x1b[K" + line)
            if self.done == self.total:
                self.stream.write("\n")
        elif self.done == self.total or self.done * 100 // self.total != (self.done - 1) * 100 // self.total:
            self.stream.write(line + "\n")  # a log file gets at most ~100 lines
        self.stream.flush()


_Progress = Progress  # the old private name


def _compile_regex(pattern: Optional[str], name: str) -> Optional[re.Pattern]:
    if pattern is None:
        return None
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ValueError(f"{name}: not a valid regular expression ({e}): {pattern!r}") from None


def _should_quantize(name: str, t_shape, t_dtype, include: Optional[re.Pattern], exclude: Optional[re.Pattern]) -> bool:
    if len(t_shape) != 2 or not name.endswith(".weight") or t_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    if include is not None and not include.search(name):
        return False
    return not (exclude and exclude.search(name))


def _source_paths(reader: CheckpointReader) -> list[Path]:
    """Every file ``convert_checkpoint`` reads from a path source (empty for a mapping)."""
    paths = [Path(f) for f in reader.files()]
    if reader.directory is not None:
        paths += [p for p in reader.directory.iterdir() if p.is_file()]
    return paths


def _check_destination(reader: CheckpointReader, dst: Path, overwrite: bool) -> None:
    """Refuse, before anything is written, a destination that is a file, is not empty, or overlaps the source.

    ``dst`` inside the source directory is allowed: the output is a new
    subdirectory, which no source file can be.
    """
    if os.path.lexists(dst) and not dst.is_dir():
        raise NotADirectoryError(f"dst: {dst} exists and is not a directory")
    if dst.is_dir() and any(dst.iterdir()) and not overwrite:
        raise FileExistsError(f"dst: {dst} exists and is not empty; pass overwrite=True to replace it")
    real_dst = dst.resolve()
    if reader.directory is not None and (
        real_dst == reader.directory.resolve() or (dst.exists() and os.path.samefile(dst, reader.directory))
    ):
        raise ValueError(f"dst: {dst} is the source directory; convert writes a new checkpoint, choose another dst")
    for p in _source_paths(reader):
        if p.resolve().is_relative_to(real_dst):
            raise ValueError(
                f"dst: {dst} contains the source file {p}; replacing dst would delete the source, choose another dst"
            )


def _plan(reader: CheckpointReader, format: str, include, exclude) -> dict[str, bool]:
    """``{tensor name: quantize?}`` from the headers alone, refusing outputs that would be wrong.

    Raises :class:`CheckpointError` for a weight to be quantized whose prefix
    already holds a scale tensor: the new ``{p}.weight_scale`` would collide with
    (or sit beside) the old one, and whether the float weight is already scaled
    by it cannot be told from the file, so neither dropping nor keeping the old
    scale is safe.
    """
    plan: dict[str, bool] = {}
    for name in reader.keys():
        shape, dtype = reader.shape(name), reader.dtype(name)
        plan[name] = _should_quantize(name, shape, dtype, include, exclude)
        if not plan[name]:
            continue
        prefix = name[: -len(".weight")]
        present = [prefix + s for s in SCALE_SUFFIXES if prefix + s in reader]
        if present:
            raise CheckpointError(
                f"{name}: the source already holds {present} next to this {dtype} weight, so quantizing it "
                f"would mix the old scale with the new one; remove the old scale tensors from the source "
                f"(if the weight is already dequantized) or keep the layer in high precision with exclude="
            )
    return plan


def _record_config(path: Path, qc: dict) -> None:
    """Replace ``quantization_config`` in the copied ``config.json`` (any other family's is stale now)."""
    config = read_json(path, "config.json")
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got a {type(config).__name__}")
    config["quantization_config"] = qc
    path.write_text(json.dumps(config, indent=2))


def _save_shard(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """Write one output shard (the one place convert writes tensor data).

    safetensors reports a failed write (disk full, file too large) as a
    ``SafetensorError`` carrying the OS error number; it is raised here as the
    ``OSError`` it is, so callers can tell an I/O failure from a bad tensor.
    """
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(tensors, path, metadata=metadata)
    except SafetensorError as e:
        code = re.search(r"os error (\d+)", str(e))
        if code is None:
            raise
        err = int(code.group(1))
        raise OSError(err, os.strerror(err), str(path)) from e


def convert_checkpoint(
    src: Source,
    dst,
    format: str = "fp8",
    *,
    block: Sequence[int] = (32, 32),
    scale_dtype: torch.dtype = torch.float8_e8m0fnu,
    rounding: str = "ceil",
    include: Optional[str] = None,
    exclude: Optional[str] = DEFAULT_EXCLUDE,
    overwrite: bool = False,
    progress: Optional[TextIO] = sys.stderr,
) -> dict:
    """Quantize a bf16/fp16/fp32 safetensors checkpoint into our layout, one shard at a time, atomically.

    Each 2-D floating ``*.weight`` whose name matches ``include`` (default: all) and
    not ``exclude`` becomes ``{p}.weight`` + ``{p}.weight_scale`` (docs/contract.md §2
    quantizers); every other tensor is copied unchanged. Output shard ``i`` holds
    the converted tensors of input shard ``i``, so at most one input shard's
    worth of quantized tensors plus one float tensor is in memory. ``dst`` gets
    ``model-XXXXX-of-XXXXX.safetensors`` files, ``model.safetensors.index.json``,
    and copies of the source directory's other files (``config.json`` etc.).

    Atomic: the output is built in a temporary sibling of ``dst`` and renamed
    into place only once every file is written and fsynced (see
    :mod:`torch_bq.nn._staging`). On any error (a NaN weight, a full disk, an
    interrupt) ``dst`` is left exactly as it was, and a process killed at any
    moment leaves either the previous ``dst`` (or none) or the complete new one.
    The source is only read.

    Args:
        src: input file, directory or mapping.
        dst: output directory (created; must be absent or empty unless ``overwrite``,
            which replaces it as a whole; may lie inside the source directory but
            must not be it or contain any source file).
        format: ``"fp8"``, ``"fp4"`` (MXFP4) or ``"nvfp4"`` (NVIDIA's, in ModelOpt's layout:
            ``{p}.weight``, ``{p}.weight_scale`` e4m3 1x16, ``{p}.weight_scale_2``).
        block, scale_dtype: fp8 options (see :func:`torch_bq.formats.quantize_fp8`); any
            block: each shard records every layer's format, block, scale dtype and
            ``[N, K]`` in its ``__metadata__``, and a copied ``config.json`` gets
            torch_bq's ``quantization_config``, so loaders read them back instead of
            guessing from shapes (docs/checkpoints.md).
        rounding: fp4 scale rule, ``"ceil"`` or ``"floor"``.
        include, exclude: regular expressions on tensor names.
        overwrite: replace a non-empty ``dst``.
        progress: stream for progress lines (``None``: silent).

    Returns:
        A summary dict: ``{"quantized": [...], "copied": [...], "bytes_in": int, "bytes_out": int, "files": [...]}``.

    Raises:
        ValueError: bad arguments (format, block, regex), ``dst`` overlapping the source.
        CheckpointError: an unreadable source, a weight that cannot be converted
            faithfully (non-finite values, an old scale beside it).
        FileExistsError / NotADirectoryError: ``dst`` is not empty / is a file.
        OSError: writing failed (read-only, disk full); nothing was changed.
    """
    if format not in ("fp8", "fp4", "nvfp4"):
        raise ValueError(f"format: expected 'fp8', 'fp4' or 'nvfp4', got {format!r}")
    block = formats.check_block(block)
    out_block = tuple(block) if format == "fp8" else tuple(formats.get_format(format).default_block)
    out_scale_dtype = scale_dtype if format == "fp8" else formats.get_format(format).scales[0].dtype
    include_re, exclude_re = _compile_regex(include, "include"), _compile_regex(exclude or None, "exclude")
    dst = Path(dst)
    if dst.is_symlink() and dst.is_dir():
        dst = dst.resolve()  # replace the directory it names, keeping the link (renaming onto a link replaces the link)
    summary = {"quantized": [], "copied": [], "bytes_in": 0, "bytes_out": 0, "files": []}
    with open_checkpoint(src) as reader:
        _check_destination(reader, dst, overwrite)
        plan = _plan(reader, format, include_re, exclude_re)
        files = reader.files()
        groups: list[list[str]] = (
            [[k for k in reader.keys() if reader.file_of(k) == f] for f in files] if files else [reader.keys()]
        )
        extras = [p for p in _source_paths(reader) if p.suffix != ".safetensors" and p.name != INDEX_NAME]
        bar = Progress(progress, len(reader), "convert")
        weight_map: dict[str, str] = {}
        with StagedDirectory(dst) as stage:
            for i, names in enumerate(groups):
                out_name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
                out: dict[str, torch.Tensor] = {}
                records: dict[str, LayerRecord] = {}
                for name in names:
                    t = reader.get(name)
                    summary["bytes_in"] += t.numel() * t.element_size()
                    if plan[name]:
                        prefix = name[: -len(".weight")]
                        try:
                            if format == "fp8":
                                data, scale = formats.quantize_fp8(t, block, scale_dtype)
                            elif format == "nvfp4":
                                data, scale, scale_2 = formats.quantize_nvfp4(t)
                                out[f"{prefix}.weight_scale_2"] = scale_2
                            else:
                                data, scale = formats.quantize_fp4(t, rounding)
                        except ValueError as e:
                            raise CheckpointError(f"{name}: {e}") from None
                        out[f"{prefix}.weight"], out[f"{prefix}.weight_scale"] = data, scale
                        records[prefix] = LayerRecord(
                            format, out_block, out_scale_dtype,
                            in_features=int(t.shape[1]), out_features=int(t.shape[0]),
                        )
                        summary["quantized"].append(name)
                    else:
                        out[name] = t
                        summary["copied"].append(name)
                    del t
                    bar.step(name)
                _save_shard(out, stage.path / out_name, {"format": "pt", **encode_records(records)})
                summary["bytes_out"] += sum(v.numel() * v.element_size() for v in out.values())
                weight_map.update({k: out_name for k in out})
                summary["files"].append(out_name)
                del out
            (stage.path / INDEX_NAME).write_text(json.dumps(
                {"metadata": {"total_size": summary["bytes_out"], "torch_bq": {
                    "format": format, "block": list(out_block),
                    "scale_dtype": str(out_scale_dtype).replace("torch.", "")}},
                 "weight_map": dict(sorted(weight_map.items()))}, indent=2))
            for extra in sorted(extras):
                shutil.copy2(extra, stage.path / extra.name)
            if (stage.path / "config.json").is_file():
                _record_config(stage.path / "config.json", quantization_config(
                    format, out_block, out_scale_dtype,
                    modules_to_not_convert=sorted(n[: -len(".weight")] for n in summary["copied"] if n.endswith(".weight")),
                ))
            stage.commit()
    return summary
