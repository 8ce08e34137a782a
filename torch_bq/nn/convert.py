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
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence, TextIO

import torch
from torch import nn

from .. import formats
from ..checkpoint.layouts import SCALE_SUFFIXES
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
    open_checkpoint,
    quantization_config,
    read_json,
    read_linear,
    to_stored,
)
from .linear import BF16Linear, FP4Linear, FP8Linear, build_module, module_class_for
from .selection import DEFAULT_EXCLUDE, experts_layout, quantized_layout, set_submodule, tied_groups

__all__ = [
    "QuantizeReport",
    "LoadReport",
    "quantize_",
    "load_quantized_",
    "convert_checkpoint",
    "DEFAULT_EXCLUDE",
    "UnfilledModuleError",
]

_TORCH_BQ_MODULES = (FP8Linear, FP4Linear, BF16Linear)


def _state_bytes(module: nn.Module) -> int:
    # Tensors held, not state_dict entries: an FP8Linear's recorded block (_extra_state) is not weight bytes.
    held = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in held)


# =========================================================================== #
# shared: bytes, progress, transformers models
# =========================================================================== #


def _unique_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


def _module_bytes(module: nn.Module) -> int:
    return _unique_bytes([*module.parameters(), *module.buffers()])


def _progress(progress: Optional[bool], total: int, what: str) -> _Progress:
    """The library's progress line: on stderr when ``progress`` (``None``: only on a terminal, for long work)."""
    if progress is None:
        progress = total >= 32 and bool(getattr(sys.stderr, "isatty", lambda: False)())
    return _Progress(sys.stderr if progress else None, max(total, 1), what)


def _hf_for(model: nn.Module):
    """:mod:`torch_bq.hf` when ``model`` is a transformers ``PreTrainedModel`` it can give a quantizer, else ``None``.

    transformers is the optional ``hf`` extra: no model can be a ``PreTrainedModel``
    unless transformers is already loaded, so it is never imported here. Raises
    ``ValueError`` (before the caller changes anything) if the model carries
    another transformers quantizer.
    """
    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(model, transformers.PreTrainedModel):
        return None
    try:
        from .. import hf
    except ImportError as e:  # a transformers torch_bq.hf cannot plug into
        warnings.warn(
            f"{e}. Without it, transformers' save_pretrained of this model writes torch_bq's fp8/fp4 codes "
            f"as plain tensors that transformers reads back as bf16 values; save it with "
            f"torch_bq.nn.save_quantized instead",
            stacklevel=3,
        )
        return None
    hf.check_attachable(model)
    return hf


def _excluded(name: str, exclude: Optional[re.Pattern]) -> bool:
    # The same regex as convert_checkpoint's, which sees tensor names: match "<module>.weight".
    return exclude is not None and bool(exclude.search(name + ".weight"))


# =========================================================================== #
# quantize_
# =========================================================================== #


@dataclass
class QuantizeReport:
    """What :func:`quantize_` did.

    ``converted``: module names replaced (linears and experts); ``experts``: the
    experts modules among them; ``skipped``: linears and experts left as they were,
    with ``skip_reasons[name]`` saying why; ``bytes_before``/``bytes_after``: bytes of the
    converted modules' tensors, each tensor counted once (tied weights are one tensor).
    """

    format: str
    converted: list[str] = field(default_factory=list)
    experts: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    skip_reasons: dict[str, str] = field(default_factory=dict)
    bytes_before: int = 0
    bytes_after: int = 0

    def __str__(self) -> str:
        ratio = self.bytes_after / self.bytes_before if self.bytes_before else 1.0
        layers = len(self.converted) - len(self.experts)
        experts = f" and {len(self.experts)} experts modules" if self.experts else ""
        return (
            f"quantize_ -> {self.format}: {layers} linear layers{experts} converted, "
            f"{len(self.skipped)} skipped; {self.bytes_before / 2**20:.2f} MiB -> "
            f"{self.bytes_after / 2**20:.2f} MiB ({ratio:.2f}x)"
        )


_EXPERT_OPTIONS = {"fp8": ("block", "scale_dtype", "act_quant", "act_peak"),
                   "fp4": ("rounding", "act_quant", "act_peak")}


def _quantize_experts(module: nn.Module, spec, format: str, options: dict, name: str) -> nn.Module:
    from .experts import FP4Experts, FP8Experts

    if format not in _EXPERT_OPTIONS:
        raise ValueError(f"{name}: experts quantize to 'fp8' or 'fp4' only, not {format!r}; exclude it or pick a format")
    cls = FP8Experts if format == "fp8" else FP4Experts
    opts = {k: v for k, v in options.items() if k in _EXPERT_OPTIONS[format]}
    bias = (module.gate_up_proj_bias.detach(), module.down_proj_bias.detach()) if spec.bias else (None, None)
    if any(t.is_meta for t in (module.gate_up_proj, module.down_proj)):
        raise ValueError(f"{name}: its weights are on the meta device; there is nothing to quantize")
    new = cls.from_weights(module.gate_up_proj.detach(), module.down_proj.detach(), *bias,
                           transposed=spec.transposed, activation=spec.activation, **opts)
    if spec.bias:
        new.gate_up_proj_bias, new.down_proj_bias = (b.clone() for b in bias)
    return new


def quantize_(
    model: nn.Module,
    format: str = "fp8",
    filter_fn: Optional[Callable[[nn.Module, str], bool]] = None,
    *,
    exclude: Optional[str] = DEFAULT_EXCLUDE,
    experts: bool = True,
    progress: Optional[bool] = None,
    **options,
) -> QuantizeReport:
    """Replace the ``nn.Linear`` layers and float experts of ``model`` with torch_bq modules, in place.

    Args:
        model: any module; ``model`` itself is never replaced, only its children.
        format: ``"fp8"`` (:class:`FP8Linear`), ``"fp4"`` (:class:`FP4Linear`),
            ``"bf16"`` (:class:`BF16Linear`, weights rounded to bf16) or ``"fp32w"``
            (:class:`BF16Linear` keeping float32 weights).
        filter_fn: ``filter_fn(module, fully_qualified_name) -> bool``; ``None`` converts
            every candidate that ``exclude`` does not name. A module it selects is
            converted even if ``exclude`` names it or its weight is tied.
        exclude: regular expression on ``"<module name>.weight"``, the same default as
            :func:`convert_checkpoint` (embeddings, ``lm_head``, norms, routers stay in
            their float dtype); ``None`` excludes nothing.
        experts: also replace float stacked-experts modules (transformers'
            ``DeepseekV3Experts``, ``GptOssExperts``, ...; see
            :func:`torch_bq.nn.experts.experts_spec`) by :class:`FP8Experts` /
            :class:`FP4Experts`, keeping the router and everything around them.
        progress: a progress line on stderr (``None``: only on a terminal, for 32+ modules).
        options: passed to ``from_linear`` / ``from_weights`` (``block``, ``scale_dtype``,
            ``act_quant``, ``act_peak``, ``rounding``, ``keep_fp32``); experts take
            the ones that apply to them.

    Returns:
        A :class:`QuantizeReport`; ``str(report)`` is a one-line summary.

    A linear whose weight is tied to another tensor (an output embedding tied to
    the input one) is skipped unless ``filter_fn`` selects it, so that ties stay
    tied. Every selected module is quantized before the first one is swapped in,
    so an error (a non-finite weight, a layer on ``meta``) leaves the model unchanged.

    A transformers ``PreTrainedModel`` also gets torch_bq's transformers quantizer
    (:func:`torch_bq.hf.attach_quantizer`): its ``save_pretrained`` then writes a
    ``quantization_config`` and torch_bq's stored layout, exactly as if the model had
    been loaded with ``from_pretrained(..., quantization_config=TorchBQConfig(format=...))``,
    so the directory reloads bit-exactly and plain transformers refuses it. A model
    carrying another transformers quantizer is refused (``ValueError``).
    """
    from .experts import experts_spec

    cls = module_class_for(format)
    hf = _hf_for(model)  # before anything changes: it may refuse the model
    if format in ("bf16", "fp32w"):
        options.setdefault("keep_fp32", format == "fp32w")
    exclude_re = _compile_regex(exclude, "exclude")
    tied = {name for group in tied_groups(model) for name in group}
    report = QuantizeReport(format)
    candidates: list[tuple[str, nn.Module, object]] = []
    for name, module in model.named_modules():
        if not name:
            continue
        if any(name.startswith(c + ".") for c, _, _ in candidates):
            continue
        spec = experts_spec(module, name) if experts else None
        if type(module) is not nn.Linear and spec is None:
            continue
        if filter_fn is not None:
            if not filter_fn(module, name):
                report.skipped.append(name)
                report.skip_reasons[name] = "filter_fn"
                continue
        elif _excluded(name, exclude_re):
            report.skipped.append(name)
            report.skip_reasons[name] = "exclude"
            continue
        elif spec is None and f"{name}.weight" in tied:
            report.skipped.append(name)
            report.skip_reasons[name] = "tied (quantizing it would untie it)"
            continue
        candidates.append((name, module, spec))

    bar = _progress(progress, len(candidates), "quantize_")
    replacements: list[tuple[str, nn.Module, bool]] = []
    for name, module, spec in candidates:
        try:
            if spec is not None:
                new = _quantize_experts(module, spec, format, options, name)
            else:
                new = cls.from_linear(module, **options)
        except (ValueError, TypeError) as e:
            raise type(e)(f"{name}: {e}") from None
        replacements.append((name, new, spec is not None))
        bar.step(name)
    before = _unique_bytes([t for _, m, _ in candidates for t in (*m.parameters(), *m.buffers())])
    for name, new, is_experts in replacements:
        set_submodule(model, name, new)
        report.converted.append(name)
        if is_experts:
            report.experts.append(name)
    report.bytes_before = before
    report.bytes_after = _unique_bytes([t for _, m, _ in replacements for t in m.buffers()])
    if hf is not None and replacements:
        hf.attach_quantizer(model, hf.TorchBQConfig(
            exclude=exclude if filter_fn is None else None, quantize_experts=experts,
            **{k: options[k] for k in ("rounding", "act_quant", "act_peak") if k in options}))
    return report


# =========================================================================== #
# load_quantized_
# =========================================================================== #


@dataclass
class LoadReport:
    """What :func:`load_quantized_` did.

    ``unfilled``: modules (``strict=False``) that still hold ``meta`` tensors because
    the checkpoint lacks them; calling one raises ``RuntimeError`` naming it.
    """

    quantized: dict[str, str] = field(default_factory=dict)  # module name -> "fp8 (deepseek-v3)"
    experts: dict[str, str] = field(default_factory=dict)  # experts module name -> "fp4 (gpt-oss)"
    dense: list[str] = field(default_factory=list)  # state-dict keys loaded as usual
    missing: list[str] = field(default_factory=list)  # model keys the checkpoint lacks (strict=False)
    unfilled: list[str] = field(default_factory=list)  # modules left (partly) on meta (strict=False)

    def __str__(self) -> str:
        kinds: dict[str, int] = {}
        for v in self.quantized.values():
            kinds[v] = kinds.get(v, 0) + 1
        parts = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) or "none"
        experts = f", {len(self.experts)} experts modules" if self.experts else ""
        unfilled = (f"; {len(self.unfilled)} modules left unfilled on meta (calling them raises): "
                    f"{self.unfilled[:5]}{'...' if len(self.unfilled) > 5 else ''}") if self.unfilled else ""
        return (
            f"load_quantized_: {len(self.quantized)} quantized linear layers ({parts}){experts}, "
            f"{len(self.dense)} other tensors, {len(self.missing)} missing{unfilled}"
        )


class UnfilledModuleError(RuntimeError):
    """A module is called while tensors of it are still on ``meta`` (a partial load left them there)."""


def _refuse_while_unfilled(module: nn.Module, name: str) -> None:
    """Make calling ``module`` raise while any of its tensors is on meta (the op would read garbage)."""

    def hook(mod, args):
        meta = [k for k, t in mod.state_dict().items() if t.is_meta]
        if meta:
            raise UnfilledModuleError(
                f"{name}: not loaded: {meta[:4]}{'...' if len(meta) > 4 else ''} still on the meta device "
                f"(load_quantized_(strict=False) found no checkpoint tensors for them); load them before calling it"
            )
        handle.remove()  # filled since: the module works as usual from now on

    handle = module.register_forward_pre_hook(hook)


def _load_experts_module(reader: CheckpointReader, name: str, module: nn.Module, spec, found, device,
                         act_quant, act_peak) -> nn.Module:
    from .expert_checkpoint import load_experts
    from .experts import FP4Experts, FP8Experts, QuantizedExperts

    layout, fmt, options = found
    cls = FP8Experts if fmt == "fp8" else FP4Experts
    if isinstance(module, QuantizedExperts):
        want = (module.num_experts, module.hidden_size, module.intermediate_size)
        activation, bias = module.activation, module.gate_up_proj_bias is not None
    else:
        want = (spec.num_experts, spec.hidden_size, spec.intermediate_size)
        activation, bias = spec.activation, spec.bias
    new = load_experts(cls, reader, name, layout=layout, device=device, activation=activation,
                       act_quant=act_quant, act_peak=act_peak, **options)
    got = (new.num_experts, new.hidden_size, new.intermediate_size)
    if got != want:
        raise CheckpointError(
            f"{name}: the model expects {want[0]} experts of hidden {want[1]}, intermediate {want[2]}; "
            f"the checkpoint's are {got[0]}, {got[1]}, {got[2]}"
        )
    if bias != (new.gate_up_proj_bias is not None):
        raise CheckpointError(
            f"{name}: the model's experts {'have' if bias else 'have no'} biases, the checkpoint's "
            f"{'have none' if bias else 'have'}"
        )
    return new


def load_quantized_(
    model: nn.Module,
    source: Source,
    *,
    device="cpu",
    strict: bool = True,
    act_quant: Optional[bool] = None,
    act_peak: Optional[float] = None,
    progress: Optional[bool] = None,
) -> LoadReport:
    """Load ``source`` into ``model``, installing torch_bq modules for quantized linears and experts.

    For every ``nn.Linear`` (or torch_bq linear) named ``p`` in ``model`` whose
    checkpoint weights under ``p`` are fp8 or fp4 in any layout
    :func:`~torch_bq.nn.checkpoint.detect_linear` knows, the module is replaced
    by a loaded :class:`FP8Linear`/:class:`FP4Linear`. Every stacked-experts
    module (transformers' fused experts, see :func:`~torch_bq.nn.experts.experts_spec`,
    or a torch_bq experts module) whose checkpoint experts are quantized (gpt-oss
    ``_blocks``/``_scales``, DeepSeek per-expert ``{p}.{e}.gate_proj``/``w1``..., or
    torch_bq's stacked tensors) is replaced by a loaded :class:`FP8Experts` /
    :class:`FP4Experts` with the model's activation; the router is untouched.
    Every other entry of ``model.state_dict()`` is read from the checkpoint under
    its own name, cast to the model's floating dtype where both are floating, and
    assigned (``load_state_dict(assign=True)``), so a skeleton built on ``meta``
    (:func:`torch_bq.nn.empty_model`) ends up fully materialised on ``device``.
    Tied tensors (``lm_head.weight`` is ``embed_tokens.weight``) are read once,
    under whichever of their names the checkpoint holds, and stay tied.

    Args:
        model: the model or skeleton (e.g. ``torch_bq.nn.empty_model(config)``).
        source: checkpoint file, directory, mapping or :class:`CheckpointReader`.
        device: where loaded tensors go.
        strict: raise if the checkpoint lacks any of the model's tensors. With
            ``strict=False`` the report lists them (``missing``) and the modules left
            on ``meta`` (``unfilled``); calling such a module raises
            :class:`UnfilledModuleError` until it is loaded, and a warning says so.
        act_quant, act_peak: options for the installed quantized modules.
        progress: a progress line on stderr (``None``: only on a terminal, for 32+ layers).

    Returns:
        A :class:`LoadReport`.

    Everything is read and validated before the model is touched; on any
    error (missing tensors, bad shapes, NaN codes) the model is unchanged.
    A transformers ``PreTrainedModel`` that receives quantized modules gets
    torch_bq's transformers quantizer, as in :func:`quantize_`, so that its
    ``save_pretrained`` writes a directory transformers cannot misread.
    """
    from .experts import QuantizedExperts, experts_spec

    hf = _hf_for(model)  # before anything changes: it may refuse the model
    with open_checkpoint(source) as reader:
        loaded: dict[str, nn.Module] = {}
        report = LoadReport()
        jobs = []
        for name, module in model.named_modules():
            if not name or any(name.startswith(p + ".") for p, _ in jobs):
                continue
            spec = experts_spec(module, name) if not isinstance(module, QuantizedExperts) else None
            if spec is not None or isinstance(module, QuantizedExperts):
                found = experts_layout(reader, name)
                if found is not None:
                    jobs.append((name, ("experts", module, spec, found)))
                continue
            if not (type(module) is nn.Linear or isinstance(module, _TORCH_BQ_MODULES)):
                continue
            layout = quantized_layout(reader, name)
            if layout is not None:
                jobs.append((name, ("linear", module, layout)))
        bar = _progress(progress, len(jobs), "load_quantized_")
        for name, job in jobs:
            if job[0] == "experts":
                _, module, spec, found = job
                loaded[name] = _load_experts_module(reader, name, module, spec, found, device, act_quant, act_peak)
                report.experts[name] = f"{found[1]} ({found[0]})"
                bar.step(name)
                continue
            _, module, layout = job
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
            bar.step(name)

        # A tied tensor is satisfied by any of its names; it is read once.
        tie_of = {n: group for group in tied_groups(model) for n in group}
        dense: dict[str, torch.Tensor] = {}
        read_ties: dict[int, str] = {}
        targets = model.state_dict(keep_vars=True)
        for key, target in targets.items():
            if any(key.startswith(p + ".") for p in loaded):
                continue
            group = tie_of.get(key, [key])
            if id(target) in read_ties:
                continue
            present = [k for k in group if k in reader]
            if not present:
                report.missing.append(key)
                continue
            t = reader.get(present[0])
            if tuple(t.shape) != tuple(target.shape):
                raise CheckpointError(f"{present[0]}: the model expects shape {list(target.shape)}, the checkpoint has {list(t.shape)}")
            if t.dtype.is_floating_point and target.dtype.is_floating_point and t.dtype != target.dtype:
                t = t.to(target.dtype)
            dense[key] = t.to(device)
            read_ties[id(target)] = key
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
        set_submodule(model, name, module)
    model.load_state_dict(dense, strict=False, assign=True)
    _retie(model, tie_of, dense)
    if not strict:
        _mark_unfilled(model, report)
    if hf is not None and loaded:
        hf.attach_quantizer(model, hf.TorchBQConfig(act_quant=act_quant, act_peak=act_peak))
    return report


def _retie(model: nn.Module, tie_of: dict[str, list[str]], loaded: dict[str, torch.Tensor]) -> None:
    """``assign=True`` replaced one name of each tied group; point the others at the same tensor."""
    for key in loaded:
        for other in tie_of.get(key, ()):
            if other == key:
                continue
            parent, _, leaf = other.rpartition(".")
            try:
                owner = model.get_submodule(parent) if parent else model
            except AttributeError:
                continue  # the module holding it was replaced by a quantized one
            source_parent, _, source_leaf = key.rpartition(".")
            value = getattr(model.get_submodule(source_parent) if source_parent else model, source_leaf)
            if leaf in owner._parameters:
                owner._parameters[leaf] = value
            elif leaf in owner._buffers:
                owner._buffers[leaf] = value


def _mark_unfilled(model: nn.Module, report: LoadReport) -> None:
    """Modules whose own tensors are still on meta: list them, warn, and make calling them raise."""
    for name, module in model.named_modules():
        own = [*module._parameters.values(), *module._buffers.values()]
        if any(t is not None and t.is_meta for t in own):
            report.unfilled.append(name or "<root>")
            _refuse_while_unfilled(module, name or "<root>")
    if report.unfilled:
        warnings.warn(
            f"load_quantized_(strict=False): {len(report.unfilled)} modules are left on the meta device and raise "
            f"when called: {report.unfilled[:8]}{'...' if len(report.unfilled) > 8 else ''}",
            stacklevel=3,
        )


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


#: plan values for stacked float experts ``{p}.gate_up_proj`` / ``{p}.down_proj``: stored [E, N, K] or [E, K, N]
_EXPERTS_PLANS = ("experts", "experts_transposed")


def _stacked_experts(reader: CheckpointReader, name: str, include, exclude):
    """``"experts"``/``"experts_transposed"`` for a stacked float experts tensor to quantize, else ``False``.

    transformers saves fused experts as ``{p}.gate_up_proj`` + ``{p}.down_proj``, 3-D, either
    ``[E, 2I, H]`` / ``[E, H, I]`` (``F.linear`` orientation, DeepSeek/Qwen-MoE) or
    ``[E, H, 2I]`` / ``[E, I, H]`` (``x @ w``, gpt-oss). The pair tells which: only one
    orientation makes the two shapes one layer (``down``'s dims would have to equal
    both ``2I`` and ``I`` otherwise).
    """
    prefix, _, leaf = name.rpartition(".")
    if leaf not in ("gate_up_proj", "down_proj") or reader.dtype(name) not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    gate_up, down = f"{prefix}.gate_up_proj", f"{prefix}.down_proj"
    if gate_up not in reader or down not in reader:
        return False
    g, d = reader.shape(gate_up), reader.shape(down)
    if len(g) != 3 or len(d) != 3 or g[0] != d[0]:
        return False
    if include is not None and not include.search(name):
        return False
    if exclude is not None and exclude.search(name):
        return False
    if g[1] % 2 == 0 and tuple(d[1:]) == (g[2], g[1] // 2):
        return "experts"
    if g[2] % 2 == 0 and tuple(d[1:]) == (g[2] // 2, g[1]):
        return "experts_transposed"
    raise CheckpointError(
        f"{gate_up} {list(g)} and {down} {list(d)} are stacked experts but form no [E, 2I, H] / [E, H, I] "
        f"layer in either orientation"
    )


def _quantize_stacked(t: torch.Tensor, transposed: bool, format: str, block, scale_dtype, rounding, name: str):
    """``[E, N, K]`` quantized data and scales of a stacked float experts tensor, one expert at a time."""
    w = t.transpose(1, 2) if transposed else t
    try:
        if format == "fp8":
            pairs = [formats.quantize_fp8(w[e], block, scale_dtype) for e in range(w.shape[0])]
        else:
            pairs = [formats.quantize_fp4(w[e], rounding) for e in range(w.shape[0])]
    except ValueError as e:
        raise CheckpointError(f"{name}: {e}") from None
    return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])


def _plan(reader: CheckpointReader, format: str, include, exclude) -> dict[str, object]:
    """``{tensor name: quantize?}`` from the headers alone, refusing outputs that would be wrong.

    The value is ``True`` for a 2-D weight, one of ``_EXPERTS_PLANS`` for a stacked
    float experts tensor (quantized per expert into torch_bq's stacked ``[E, N, K]``
    layout: ``{p}.gate_up_proj`` + ``{p}.gate_up_proj_scale``), ``False`` to copy.

    Raises :class:`CheckpointError` for a weight to be quantized whose prefix
    already holds a scale tensor: the new ``{p}.weight_scale`` would collide with
    (or sit beside) the old one, and whether the float weight is already scaled
    by it cannot be told from the file, so neither dropping nor keeping the old
    scale is safe.
    """
    plan: dict[str, object] = {}
    for name in reader.keys():
        shape, dtype = reader.shape(name), reader.dtype(name)
        plan[name] = _should_quantize(name, shape, dtype, include, exclude) or _stacked_experts(
            reader, name, include, exclude)
        if not plan[name]:
            continue
        if plan[name] in _EXPERTS_PLANS:
            if f"{name}_scale" in reader:
                raise CheckpointError(
                    f"{name}: the source already holds {name}_scale next to these float experts, so quantizing "
                    f"them would mix the old scale with the new one; exclude= them or remove the old scale"
                )
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
    quantizers); stacked float experts (transformers' fused ``{p}.gate_up_proj`` /
    ``{p}.down_proj``, 3-D, in either orientation) become torch_bq's stacked
    ``[E, N, K]`` data + ``{p}.gate_up_proj_scale`` / ``{p}.down_proj_scale``, quantized
    per expert; every other tensor is copied unchanged. The codes are stored with
    the trailing unit axis their records name (``[N, K, 1]``, ``[E, N, K, 1]``; see
    :mod:`torch_bq.checkpoint.stored`), so that no reader unaware of torch_bq takes
    them for the dense weights; torch_bq's loaders read them in natural shapes. Output shard ``i`` holds
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
                    if plan[name] in _EXPERTS_PLANS:
                        prefix = name.rpartition(".")[0]
                        out[name], out[f"{name}_scale"] = _quantize_stacked(
                            t, plan[name] == "experts_transposed", format, block, scale_dtype, rounding, name)
                        # in every shard holding either projection: its codes are stored per its record
                        if prefix not in records:
                            records[prefix] = LayerRecord(
                                format, tuple(block) if format == "fp8" else (1, 32),
                                scale_dtype if format == "fp8" else torch.float8_e8m0fnu,
                            )
                        summary["quantized"].append(name)
                    elif plan[name]:
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
                summary["bytes_out"] += sum(v.numel() * v.element_size() for v in out.values())
                stored, meta = to_stored(out, records)
                _save_shard(stored, stage.path / out_name, {"format": "pt", **meta})
                del stored
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
