"""torch_bq as a transformers quantizer: one ``quantization_config`` loads, quantizes and saves.

Importing this module registers ``quant_method: "torch_bq"`` with transformers'
plugin API (``register_quantization_config`` / ``register_quantizer``), so that::

    import torch_bq.hf
    from transformers import AutoModelForCausalLM

    # a pre-quantized checkpoint: DeepSeek-V3 fp8, Qwen3-FP8, gpt-oss MXFP4, torch_bq's own
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=torch_bq.hf.TorchBQConfig())
    # a bf16 checkpoint, quantized shard by shard as it loads
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=torch_bq.hf.TorchBQConfig(format="fp8"))
    model.save_pretrained(out)  # reloads bit-exactly with a plain from_pretrained(out)

Every linear the checkpoint holds quantized becomes an ``FP8Linear``/``FP4Linear``
and every fused experts module an ``FP8Experts``/``FP4Experts`` (the router is
the model's own), straight from the checkpoint's bytes: nothing is dequantized.
The checkpoint conventions (``weight_scale_inv``, ``_blocks``/``_scales``,
per-expert tensors, torch_bq's own names) are those of :mod:`torch_bq.nn.checkpoint`
and :mod:`torch_bq.nn.expert_checkpoint`; this module only wires them into
transformers' loading steps:

1. ``_process_model_before_weight_loading`` reads the checkpoint's *headers*
   and swaps, on the meta skeleton, each module the checkpoint holds quantized
   (or, quantizing on load, each selected float module) for an empty torch_bq module;
2. transformers reads each tensor once; the conversion ops below hand the
   tensors of one module to torch_bq's loader (checks, NaN-code scans) or
   quantizer and install the result; dense tensors load as transformers loads them;
3. ``_process_model_after_weight_loading`` refuses a model with a torch_bq module
   the checkpoint did not fill, and records every quantized module in
   ``model.config.quantization_config.layers`` so ``save_pretrained`` writes it;
4. ``save_pretrained`` writes the state dict through ``get_state_dict_and_metadata``
   in torch_bq's own layout (shard records, codes with a trailing unit axis, see
   :mod:`torch_bq.checkpoint.stored`), which transformers without this module refuses
   (a size mismatch) instead of reading fp8 codes as bf16 values.

A transformers model quantized outside ``from_pretrained`` (``torch_bq.nn.quantize_``,
``torch_bq.nn.load_quantized_``) is given this quantizer by :func:`attach_quantizer`,
so its ``save_pretrained`` takes step 4 too.

transformers is imported by this module only (the ``hf`` extra: ``pip install torch_bq[hf]``).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from torch import nn

try:
    import transformers
    from transformers.core_model_loading import ConversionOps, WeightConverter
    from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
    from transformers.quantizers.auto import AutoHfQuantizer
    from transformers.utils.quantization_config import QuantizationConfigMixin
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "torch_bq.hf needs transformers >= 5 (the 'hf' extra): pip install 'torch_bq[hf]'"
    ) from e

from . import formats
from .checkpoint import from_stored, to_stored
from .nn.checkpoint import CheckpointError, CheckpointReader, build_module, detect_linear, read_linear
from .nn.selection import DEFAULT_EXCLUDE, experts_layout, quantized_layout, set_submodule, tied_groups
from .nn.expert_checkpoint import load_experts
from .nn.experts import FP4Experts, FP8Experts, QuantizedExperts, experts_spec
from .nn.linear import BF16Linear, FP4Linear, FP8Linear, NVFP4Linear

__all__ = ["QUANT_METHOD", "TorchBQConfig", "TorchBQQuantizer", "attach_quantizer", "check_attachable", "model_from_config"]

QUANT_METHOD = "torch_bq"

_SCALE_DTYPES = {"float8_e8m0fnu": torch.float8_e8m0fnu, "float32": torch.float32}
_FORMATS = ("fp8", "fp4", "nvfp4")  # nvfp4: ModelOpt checkpoints only (loaded, not produced)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# =========================================================================== #
# the config
# =========================================================================== #


@register_quantization_config(QUANT_METHOD)
class TorchBQConfig(QuantizationConfigMixin):
    """``quantization_config`` for torch_bq (``quant_method: "torch_bq"`` in ``config.json``).

    Args:
        format: ``None`` to load a pre-quantized checkpoint as it is stored (fp8 or
            fp4, per layer); ``"fp8"`` or ``"fp4"`` to quantize a bf16/fp32 checkpoint
            on load (a pre-quantized checkpoint must then hold that format).
        block: fp8 block ``(bn, bk)`` when quantizing (default ``(32, 32)``).
        scale_dtype: ``"float8_e8m0fnu"`` (default) or ``"float32"``, fp8 scales when quantizing.
        rounding: fp4 scale rule when quantizing, ``"ceil"`` (default) or ``"floor"``.
        act_quant, act_peak: options of every installed module (default: the modules' own).
        modules_to_not_convert: module names (or name prefixes) left in their float dtype
            when quantizing on load; adds to ``exclude``.
        exclude: regular expression on ``"<module>.weight"`` names left in float when
            quantizing on load; the default is :data:`torch_bq.nn.DEFAULT_EXCLUDE`, the
            same as ``quantize_`` and ``convert`` (embeddings, ``lm_head``, norms, routers).
        quantize_experts: also quantize fused experts modules on load (default ``True``).
        layers: filled on load with one record per quantized module
            (``{"format", "block", "scale_dtype"}``, plus ``"experts"`` and ``"activation"``
            for experts); ``save_pretrained`` writes it, a reload follows it.

    The keys are the ones ``torch_bq.nn.convert_checkpoint`` writes, so a converted
    directory and a ``save_pretrained`` one load the same way.
    """

    def __init__(
        self,
        format: Optional[str] = None,
        block: Optional[Sequence[int]] = None,
        scale_dtype: Optional[str] = None,
        rounding: str = "ceil",
        act_quant: Optional[bool] = None,
        act_peak: Optional[float] = None,
        modules_to_not_convert: Optional[Sequence[str]] = None,
        exclude: Optional[str] = DEFAULT_EXCLUDE,
        quantize_experts: bool = True,
        layers: Optional[dict] = None,
        version: Optional[int] = None,
        **kwargs: Any,
    ) -> None:
        self.quant_method = QUANT_METHOD
        from .checkpoint.record import RECORD_VERSION

        if version is not None and (not isinstance(version, int) or version > RECORD_VERSION):
            raise ValueError(f"version: this torch_bq reads quantization_config versions <= {RECORD_VERSION}, got {version!r}")
        self.version = RECORD_VERSION
        if format is not None and format not in _FORMATS:
            raise ValueError(f"format: expected None, 'fp8', 'fp4' or 'nvfp4' (ModelOpt checkpoints), got {format!r}")
        if isinstance(scale_dtype, torch.dtype):
            scale_dtype = _dtype_name(scale_dtype)
        if scale_dtype is not None and scale_dtype not in _SCALE_DTYPES:
            raise ValueError(f"scale_dtype: expected one of {sorted(_SCALE_DTYPES)}, got {scale_dtype!r}")
        if rounding not in ("ceil", "floor"):
            raise ValueError(f"rounding: expected 'ceil' or 'floor', got {rounding!r}")
        if act_peak is not None:
            formats.check_peak(act_peak)
        self.format = format
        self.block = list(formats.check_block(block)) if block is not None else None
        self.scale_dtype = scale_dtype
        self.rounding = rounding
        self.act_quant = act_quant
        self.act_peak = act_peak
        self.modules_to_not_convert = list(modules_to_not_convert) if modules_to_not_convert else None
        if exclude is not None:
            try:
                re.compile(exclude)
            except re.error as e:
                raise ValueError(f"exclude: not a valid regular expression ({e}): {exclude!r}") from None
        self.exclude = exclude
        self.quantize_experts = bool(quantize_experts)
        self.layers = dict(layers) if layers else {}
        # What the checkpoint's own config.json said (e.g. {"quant_method": "fp8", ...}) when
        # this config took over loading it; informational, not written back.
        self.source_quantization_config = kwargs.pop("source_quantization_config", None)
        unknown = sorted(set(kwargs) - {"quant_method"})
        if unknown:
            raise TypeError(f"TorchBQConfig: unknown options {unknown}")

    def to_dict(self) -> dict[str, Any]:
        d = {k: copy.deepcopy(v) for k, v in self.__dict__.items() if k != "source_quantization_config"}
        return d

    # -- what quantizing on load uses ------------------------------------------

    def module_options(self, fmt: str) -> dict:
        """``from_linear``/``from_weights`` options for quantizing to ``fmt``."""
        opts: dict[str, Any] = {}
        if fmt == "fp8":
            opts["block"] = tuple(self.block) if self.block else (32, 32)
            opts["scale_dtype"] = _SCALE_DTYPES[self.scale_dtype or "float8_e8m0fnu"]
        else:
            opts["rounding"] = self.rounding
        return opts

    def runtime_options(self) -> dict:
        return {k: v for k, v in (("act_quant", self.act_quant), ("act_peak", self.act_peak)) if v is not None}

    def excludes(self, name: str) -> bool:
        if self.modules_to_not_convert and any(
            name == m or name.startswith(m + ".") for m in self.modules_to_not_convert
        ):
            return True
        return self.exclude is not None and re.search(self.exclude, name + ".weight") is not None


# A user's TorchBQConfig for a checkpoint whose config.json names another quant_method
# ("fp8", "mxfp4", ...): transformers would refuse the mix ("The model is quantized with
# FineGrainedFP8Config but you are passing a TorchBQConfig"). Its plugin API has no hook
# for "load this known format with another quantizer", so the one merge step is wrapped:
# only when the caller passed a TorchBQConfig, which then loads the checkpoint itself.
_original_merge = AutoHfQuantizer.merge_quantization_configs.__func__


def _merge_quantization_configs(cls, quantization_config, quantization_config_from_args):
    if isinstance(quantization_config_from_args, TorchBQConfig):
        stored = quantization_config if isinstance(quantization_config, dict) else quantization_config.to_dict()
        if stored.get("quant_method") == QUANT_METHOD:
            merged = TorchBQConfig.from_dict({k: v for k, v in stored.items() if k != "quant_method"})
            for key, value in quantization_config_from_args.runtime_options().items():
                setattr(merged, key, value)
            return merged
        merged = copy.deepcopy(quantization_config_from_args)
        merged.source_quantization_config = copy.deepcopy(stored)
        return merged
    return _original_merge(cls, quantization_config, quantization_config_from_args)


AutoHfQuantizer.merge_quantization_configs = classmethod(_merge_quantization_configs)


# =========================================================================== #
# conversion ops: one module's tensors -> torch_bq's loader / quantizer
# =========================================================================== #


_LINEAR_FORMATS = {FP8Linear: "fp8", FP4Linear: "fp4", NVFP4Linear: "nvfp4"}
_QUANTIZED_LINEARS = tuple(_LINEAR_FORMATS)


class _Op(ConversionOps):
    """An op bound to the quantizer whose plan it follows.

    transformers deep-copies a converter for every layer it matches; the copies
    must share the one quantizer (its plan and its record of filled modules).
    """

    def __init__(self, hf_quantizer: "TorchBQQuantizer") -> None:
        self.hf_quantizer = hf_quantizer

    def __deepcopy__(self, memo):
        return self


def _owned(t: torch.Tensor) -> torch.Tensor:
    """``t`` in memory of its own (a copy unless ``t`` already owns its whole storage)."""
    if t.untyped_storage().nbytes() == t.numel() * t.element_size() and t.is_contiguous() and not _file_backed(t):
        return t
    return t.clone()


def _file_backed(t: torch.Tensor) -> bool:
    # A storage transformers' safetensors mmap created has no allocator context of torch's own:
    # its data pointer lies in a file mapping. Checked via /proc/self/maps only on Linux.
    try:
        ptr = t.untyped_storage().data_ptr()
        with open("/proc/self/maps") as f:
            for line in f:
                if ".safetensors" in line:
                    a, b = (int(x, 16) for x in line.split()[0].split("-"))
                    if a <= ptr < b:
                        return True
    except OSError:
        return True  # cannot tell: copy
    return False


def _first(v):
    return v[0] if isinstance(v, list) else v


def _discard(missing_keys, module: nn.Module, prefix: str) -> None:
    if missing_keys is None:
        return
    for key in module.state_dict():
        missing_keys.discard(f"{prefix}.{key}")


def _mark_initialized(module: nn.Module) -> None:
    module._is_hf_initialized = True
    for t in module.buffers():
        t._is_hf_initialized = True


class _LoadLinear(_Op):
    """``{".weight": [t], ".weight_scale_inv": [s], ...}`` of one module -> an installed torch_bq linear.

    Dense modules (norms, embeddings) get their tensor back, cast to the parameter's dtype.
    """

    def convert(self, input_dict, model=None, full_layer_name=None, missing_keys=None, **kwargs):
        prefix = full_layer_name.removesuffix(".weight")
        module = model.get_submodule(prefix)
        tensors = self.hf_quantizer.natural(
            {prefix + pattern.replace("\\", ""): _first(v) for pattern, v in input_dict.items()})
        if not isinstance(module, _QUANTIZED_LINEARS):
            if len(tensors) != 1 or f"{prefix}.weight" not in tensors:
                raise CheckpointError(
                    f"{prefix}: the checkpoint holds {sorted(tensors)} but the model's {type(module).__name__} "
                    f"is not a quantized linear"
                )
            weight = tensors[f"{prefix}.weight"]
            target = getattr(module, "weight")
            if target.dtype.is_floating_point and target.dtype.itemsize > 1 and weight.dtype.itemsize == 1:
                # fp8/fp4 bytes without their scale: casting them would load the codes as values.
                raise CheckpointError(
                    f"{prefix}.weight: holds {weight.dtype} data but the checkpoint has no scale for it "
                    f"(looked for {prefix}.weight_scale_inv / .weight_scale / .scale); refusing to read the codes as "
                    f"{target.dtype} values"
                )
            if weight.dtype.is_floating_point and target.dtype.is_floating_point and weight.dtype != target.dtype:
                weight = weight.to(target.dtype)
            return {f"{prefix}.weight": weight}
        quantizer = self.hf_quantizer
        with CheckpointReader(tensors) as reader:
            fmt = _LINEAR_FORMATS[type(module)]
            layout = detect_linear(reader, prefix, format=fmt, block=module.block if fmt == "fp8" else None,
                                   in_features=module.in_features if fmt != "fp8" else None)
            weights = read_linear(reader, layout)
        built = build_module(weights, **quantizer.quantization_config.runtime_options())
        for name in module._stored:
            # transformers hands over views of its mmap of the file; a torch_bq module owns
            # its bytes (an edit or truncation of the file must not reach a loaded model).
            setattr(module, name, _owned(getattr(built, name)))
        module.act_quant, module.act_peak = built.act_quant, built.act_peak
        _mark_initialized(module)
        for key in (*module._stored, "_extra_state"):  # _extra_state: the block, set with the module
            if missing_keys is not None:
                missing_keys.discard(f"{prefix}.{key}")
        quantizer._filled.add(prefix)
        return {}


class _LoadExperts(_Op):
    """Every checkpoint tensor of one experts module -> an installed ``FP8Experts``/``FP4Experts``."""

    def convert(self, input_dict, model=None, full_layer_name=None, missing_keys=None, **kwargs):
        prefix = full_layer_name.rsplit(".", 1)[0]  # "...mlp.experts.gate_up_proj" -> "...mlp.experts"
        quantizer = self.hf_quantizer
        plan = quantizer._plan.get(prefix)
        skeleton = model.get_submodule(prefix)
        if plan is None or not isinstance(skeleton, QuantizedExperts):
            raise CheckpointError(f"{prefix}: the checkpoint holds quantized experts the model did not plan for")
        layout, options = plan["layout"], dict(plan["options"])
        tensors: dict[str, torch.Tensor] = {}
        for pattern, values in input_dict.items():
            rest = pattern.replace("\\", "").split(".experts.", 1)[1]
            if rest.startswith("*."):  # per-expert tensors, in expert order (transformers sorts keys naturally)
                values = values if isinstance(values, list) else [values]
                if len(values) != skeleton.num_experts:
                    raise CheckpointError(
                        f"{prefix}: the checkpoint holds {len(values)} tensors matching {pattern!r}, "
                        f"the model has {skeleton.num_experts} experts"
                    )
                for e, t in enumerate(values):
                    tensors[f"{prefix}.{e}.{rest[2:]}"] = t
            else:
                tensors[f"{prefix}.{rest}"] = _first(values)
        tensors = quantizer.natural(tensors)
        if isinstance(skeleton, FP8Experts):
            options["block"] = skeleton.block
        cls = type(skeleton)
        built = load_experts(cls, tensors, prefix, layout=layout, activation=skeleton.activation,
                             **options, **quantizer.quantization_config.runtime_options())
        got = (built.num_experts, built.hidden_size, built.intermediate_size, built.gate_up_proj_bias is not None)
        want = (skeleton.num_experts, skeleton.hidden_size, skeleton.intermediate_size,
                skeleton.gate_up_proj_bias is not None)
        if got != want:
            raise CheckpointError(f"{prefix}: the model expects experts (E, H, I, bias) = {want}, the checkpoint's are {got}")
        for name, t in built._buffers.items():
            if t is not None:
                built._buffers[name] = _owned(t)  # see _LoadLinear
        _mark_initialized(built)
        set_submodule(model, prefix, built)
        _discard(missing_keys, built, prefix)
        quantizer._filled.add(prefix)
        return {}


class _Quantize(_Op):
    """A float weight (linear ``[N, K]`` or one stacked experts projection) -> torch_bq storage, installed."""

    def convert(self, input_dict, model=None, full_layer_name=None, missing_keys=None, **kwargs):
        (key, value), = input_dict.items()
        weight = _first(value)
        prefix, _, leaf = key.rpartition(".")
        module = model.get_submodule(prefix)
        config = self.hf_quantizer.quantization_config
        if isinstance(module, QuantizedExperts):
            plan = self.hf_quantizer._plan[prefix]
            if plan["transposed"]:
                weight = weight.transpose(1, 2)
            fmt = module.format_name
            opts = config.module_options(fmt)
            try:
                if fmt == "fp8":
                    pairs = [formats.quantize_fp8(weight[e], opts["block"], opts["scale_dtype"]) for e in range(weight.shape[0])]
                else:
                    pairs = [formats.quantize_fp4(weight[e], opts["rounding"]) for e in range(weight.shape[0])]
            except ValueError as e:
                raise ValueError(f"{key}: {e}") from None
            data, scale = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
            want = module._buffers[leaf]
            if tuple(data.shape) != tuple(want.shape):
                raise CheckpointError(f"{key}: expected a quantized shape {list(want.shape)}, got {list(data.shape)}")
            setattr(module, leaf, data)
            setattr(module, f"{leaf}_scale", scale)
            names = (leaf, f"{leaf}_scale")
        else:
            fmt = "fp8" if isinstance(module, FP8Linear) else "fp4"
            opts = config.module_options(fmt)
            if tuple(weight.shape) != (module.out_features, module.in_features):
                raise CheckpointError(
                    f"{key}: the model expects [{module.out_features}, {module.in_features}], "
                    f"the checkpoint has {list(weight.shape)}"
                )
            try:
                if fmt == "fp8":
                    data, scale = formats.quantize_fp8(weight, opts["block"], opts["scale_dtype"])
                else:
                    data, scale = formats.quantize_fp4(weight, opts["rounding"])
            except ValueError as e:
                raise ValueError(f"{key}: {e}") from None
            module.weight, module.weight_scale = data, scale
            names = ("weight", "weight_scale")
        _mark_initialized(module)
        for name in (*names, "_extra_state"):
            if missing_keys is not None:
                missing_keys.discard(f"{prefix}.{name}")
        self.hf_quantizer._quantized_parts.setdefault(prefix, set()).update(names)
        if isinstance(module, QuantizedExperts):
            if {"gate_up_proj", "down_proj"} <= self.hf_quantizer._quantized_parts[prefix]:
                self.hf_quantizer._filled.add(prefix)
        else:
            self.hf_quantizer._filled.add(prefix)
        return {}


# =========================================================================== #
# the quantizer
# =========================================================================== #


def _checkpoint_reader(checkpoint_files) -> CheckpointReader:
    files = [Path(f) for f in checkpoint_files or []]
    if not files or any(f.suffix != ".safetensors" for f in files):
        raise CheckpointError(f"torch_bq loads safetensors checkpoints only, got {[str(f) for f in files]}")
    return CheckpointReader(files[0] if len(files) == 1 else files[0].parent)


def _experts_skeleton(fmt: str, sizes, *, bias_dtype, block=None, scale_dtype=None, runtime=None):
    """An empty (meta) experts module; ``sizes`` = ``(E, H, I, bias, activation)``."""
    runtime = runtime or {}
    e, h, i, bias, activation = sizes
    if fmt == "fp8":
        return FP8Experts(e, h, i, bias, activation=activation, block=block, scale_dtype=scale_dtype,
                          device="meta", dtype=bias_dtype, **runtime)
    return FP4Experts(e, h, i, bias, activation=activation, device="meta", dtype=bias_dtype, **runtime)


@register_quantizer(QUANT_METHOD)
class TorchBQQuantizer(HfQuantizer):
    """transformers' ``HfQuantizer`` for torch_bq (see the module docstring for the steps)."""

    requires_calibration = False
    quantization_config: TorchBQConfig

    def __init__(self, quantization_config: TorchBQConfig, **kwargs) -> None:
        super().__init__(quantization_config, **kwargs)
        self._plan: dict[str, dict] = {}  # module name -> what it becomes
        self._filled: set[str] = set()
        self._quantized_parts: dict[str, set] = {}
        self._unit_axis: set[str] = set()  # checkpoint tensors stored with torch_bq's unit axis

    def natural(self, tensors: dict) -> dict:
        """Checkpoint tensors as transformers hands them over (as stored) -> natural shapes."""
        return {k: from_stored(k, t) if k in self._unit_axis else t for k, t in tensors.items()}

    # -- environment ---------------------------------------------------------------

    def validate_environment(self, *args, device_map=None, **kwargs) -> None:
        if isinstance(device_map, dict):
            devices = {str(d) for d in device_map.values()}
            if devices - {"cpu"}:
                raise ValueError(
                    f"device_map: torch_bq loads onto the CPU (its modules then move with .to()), got devices {sorted(devices)}"
                )
        elif device_map not in (None, "cpu"):
            raise ValueError(f"device_map: torch_bq loads onto the CPU, got {device_map!r}")

    # -- step 1: the skeleton ---------------------------------------------------------

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        runtime = self.quantization_config.runtime_options()
        float_dtype = next((p.dtype for p in model.parameters() if p.dtype.is_floating_point), torch.bfloat16)
        tied = {n for group in tied_groups(model) for n in group}
        # transformers builds the skeleton under `with torch.device("meta")`; the checkpoint
        # reader's own buffers (headers, records) must still be real.
        with torch.device("cpu"):
            return self._plan_and_swap(model, checkpoint_files, runtime, float_dtype, tied)

    def _plan_and_swap(self, model, checkpoint_files, runtime, float_dtype, tied):
        reader = _checkpoint_reader(checkpoint_files)
        if not self.pre_quantized:
            # config.json names no quantization, but the tensors may still be quantized
            # (a torch_bq directory written before config records, a hand-made one): the
            # headers decide, never a cast of fp8 codes to floats.
            from .checkpoint import quantized_prefixes

            if quantized_prefixes(reader.keys()) or any(k.endswith("_scale") and k[: -len("_scale")] in reader
                                                        for k in reader.keys()):
                self.pre_quantized = True
            elif self.quantization_config.format is None:
                reader.close()
                raise ValueError(
                    "TorchBQConfig: the checkpoint is not quantized; pass format='fp8' or format='fp4' to quantize "
                    "it on load"
                )
            else:
                reader.close()
                reader = None
        try:
            if reader is not None:
                self._unit_axis = {k for k in reader.keys() if reader.unit_axis(k)}
            swaps: list[tuple[str, nn.Module]] = []
            for name, module in model.named_modules():
                if not name or any(name.startswith(p + ".") for p, _ in swaps):
                    continue
                spec = experts_spec(module, name)
                if spec is not None:
                    new = self._plan_experts(name, spec, reader, float_dtype, runtime)
                elif type(module) is nn.Linear:
                    new = self._plan_linear(name, module, reader, tied, runtime)
                else:
                    continue
                if new is not None:
                    swaps.append((name, new))
            for name, new in swaps:
                set_submodule(model, name, new)
        finally:
            if reader is not None:
                reader.close()
        return model

    def _check_format(self, name: str, fmt: str) -> None:
        want = self.quantization_config.format
        if want is not None and want != fmt:
            raise CheckpointError(f"{name}: the checkpoint holds {fmt} weights, but TorchBQConfig(format={want!r}) was asked for")

    def _plan_linear(self, name, module, reader, tied, runtime):
        bias = module.bias is not None
        dtype = module.weight.dtype
        layer = self.quantization_config.layers.get(name, {})
        if reader is not None:
            block = layer.get("block")
            if block is not None and quantized_layout(reader, name) is not None:
                layout = detect_linear(reader, name, block=block)
            else:
                layout = quantized_layout(reader, name)
            if layout is None:
                return None
            self._check_format(name, layout.format)
            if (layout.out_features, layout.in_features) != (module.out_features, module.in_features):
                raise CheckpointError(
                    f"{name}: the model expects a [{module.out_features}, {module.in_features}] linear, the "
                    f"checkpoint's {layout.weight_name} is [{layout.out_features}, {layout.in_features}]"
                )
            fmt, block = layout.format, layout.block
            scale_dtype = reader.dtype(layout.scale_name)
            scale_dtype = torch.float32 if scale_dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float8_e8m0fnu
            self._plan[name] = {"kind": "linear", "format": fmt, "layout": layout.layout}
        else:
            if self.quantization_config.excludes(name) or f"{name}.weight" in tied:
                return None
            fmt = self.quantization_config.format
            if fmt == "nvfp4":
                raise ValueError("TorchBQConfig(format='nvfp4') loads ModelOpt NVFP4 checkpoints; it does not quantize "
                                 "a float checkpoint (use 'fp8' or 'fp4')")
            opts = self.quantization_config.module_options(fmt)
            block, scale_dtype = opts.get("block"), opts.get("scale_dtype")
            self._plan[name] = {"kind": "linear", "format": fmt, "layout": "quantized on load"}
        if fmt == "fp8":
            return FP8Linear(module.in_features, module.out_features, bias, block=block, scale_dtype=scale_dtype,
                             device="meta", dtype=dtype, **runtime)
        if fmt == "nvfp4":
            return NVFP4Linear(module.in_features, module.out_features, bias, device="meta", dtype=dtype, **runtime)
        return FP4Linear(module.in_features, module.out_features, bias, device="meta", dtype=dtype, **runtime)

    def _plan_experts(self, name, spec, reader, float_dtype, runtime):
        sizes = (spec.num_experts, spec.hidden_size, spec.intermediate_size, spec.bias, spec.activation)
        layer = self.quantization_config.layers.get(name, {})
        if reader is not None:
            found = experts_layout(reader, name)
            if found is None:
                return None
            layout, fmt, options = found
            self._check_format(name, fmt)
            block = scale_dtype = None
            if fmt == "fp8":
                if layout == "deepseek":
                    first = detect_linear(reader, f"{name}.0.{options['projections'][0]}", format="fp8",
                                          block=layer.get("block"))
                    block = first.block
                    scale_dtype = reader.dtype(first.scale_name)
                else:
                    from .nn.expert_checkpoint import stacked_experts_block

                    block = stacked_experts_block(reader, name, layer.get("block"))
                    scale_dtype = reader.dtype(f"{name}.gate_up_proj_scale")
                    options = {**options, "block": block}
                scale_dtype = torch.float32 if scale_dtype == torch.float32 else torch.float8_e8m0fnu
            if layout == "torch_bq" and fmt == "fp8":
                options.pop("block", None)
            self._plan[name] = {"kind": "experts", "format": fmt, "layout": layout, "options": options,
                                "transposed": spec.transposed}
        else:
            if not self.quantization_config.quantize_experts or self.quantization_config.excludes(name):
                return None
            fmt = self.quantization_config.format
            opts = self.quantization_config.module_options(fmt)
            block, scale_dtype = opts.get("block"), opts.get("scale_dtype")
            self._plan[name] = {"kind": "experts", "format": fmt, "layout": "quantized on load", "options": {},
                                "transposed": spec.transposed}
        return _experts_skeleton(fmt, sizes, bias_dtype=float_dtype, block=block, scale_dtype=scale_dtype,
                                 runtime=runtime)

    # -- step 2: which op loads which tensors ------------------------------------------

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        if self.pre_quantized:
            return False
        prefix, _, leaf = param_name.rpartition(".")
        plan = self._plan.get(prefix)
        if plan is None:
            return False
        return leaf == "weight" if plan["kind"] == "linear" else leaf in ("gate_up_proj", "down_proj")

    def get_quantize_ops(self):
        return _Quantize(self)

    def get_new_dtype(self, converter, param, dtype):
        # Our ops cast what they pass through themselves; quantized bytes and float32
        # scales must reach them exactly as stored.
        if any(isinstance(op, (_LoadLinear, _LoadExperts)) for op in getattr(converter, "operations", ())):
            return None
        return super().get_new_dtype(converter, param, dtype)

    def update_weight_conversions(self, weight_conversions, model):
        if not self.pre_quantized:
            return weight_conversions
        ours = []
        experts_layouts = {p["layout"]: p for p in self._plan.values() if p["kind"] == "experts"}
        if "deepseek" in experts_layouts:
            projections = experts_layouts["deepseek"]["options"]["projections"]
            sources = [rf"\.experts\.*.{proj}\.{suffix}" for proj in projections
                       for suffix in ("weight", "weight_scale_inv", "weight_scale", "scale", "bias")]
            ours.append(WeightConverter(sources, r"\.experts\.gate_up_proj", [_LoadExperts(self)]))
        if "gpt-oss" in experts_layouts:
            sources = [rf"\.experts\.{proj}{suffix}" for proj in ("gate_up_proj", "down_proj")
                       for suffix in ("_blocks", "_scales", "_bias")]
            ours.append(WeightConverter(sources, r"\.experts\.gate_up_proj", [_LoadExperts(self)]))
        if "torch_bq" in experts_layouts:
            sources = [rf"\.experts\.{proj}{suffix}" for proj in ("gate_up_proj", "down_proj")
                       for suffix in ("", "_scale", "_bias")]
            ours.append(WeightConverter(sources, r"\.experts\.gate_up_proj", [_LoadExperts(self)]))
        # Every ".weight" goes through _LoadLinear, quantized layers or not: it also refuses
        # quantized bytes that arrive without a scale instead of letting them load as values.
        linear_layouts = {p["layout"] for p in self._plan.values() if p["kind"] == "linear"}
        sources = [r"\.weight", r"\.weight_scale_inv", r"\.weight_scale"]
        if "modelopt" in linear_layouts or any(p["format"] == "nvfp4" for p in self._plan.values()):
            # ModelOpt: the per-tensor scale, and a static activation scale that is checked and ignored
            sources += [r"\.weight_scale_2", r"\.input_scale"]
        if "deepseek-v3.1" in linear_layouts:
            sources.append(r"\.scale")
        ours.append(WeightConverter(sources, r"\.weight", [_LoadLinear(self)]))
        if experts_layouts:
            # The model's own per-expert merges (qwen2_moe's gate_proj + up_proj -> gate_up_proj)
            # would stack fp8 bytes without their scales; our converter takes those tensors.
            weight_conversions = [
                c for c in weight_conversions
                if not (isinstance(c, WeightConverter)
                        and any(re.search(r"experts\.(gate_up_proj|down_proj)$", t) for t in c._original_target_patterns))
            ]
        # Ours first: transformers applies the first converter that matches a key.
        return ours + list(weight_conversions)

    # -- step 3: check and record ---------------------------------------------------------

    def _process_model_after_weight_loading(self, model, **kwargs):
        unfilled = sorted(set(self._plan) - self._filled)
        if unfilled:
            raise CheckpointError(
                f"the checkpoint did not fill {len(unfilled)} torch_bq modules (left as uninitialised memory by "
                f"transformers' loader, so refused): {unfilled[:8]}{'...' if len(unfilled) > 8 else ''}"
            )
        _record_layers(self.quantization_config, model)
        # save_pretrained writes the in-memory names (torch_bq modules' own), which this
        # quantizer and torch_bq's loaders read back; the model's checkpoint renamings
        # (per-expert splits) do not apply to quantized experts.
        model._weight_conversions = []
        return model

    # -- save_pretrained -------------------------------------------------------------------

    def get_state_dict_and_metadata(self, model):
        """What ``save_pretrained`` writes: the state dict in torch_bq's stored layout and its records.

        The records (and the codes' trailing unit axis, :mod:`torch_bq.checkpoint.stored`) are
        what ``convert_checkpoint`` and ``save_quantized`` write; transformers puts the same
        ``__metadata__`` into every shard.
        """
        from .nn.save import layer_records

        return to_stored(model.state_dict(), layer_records(model))

    # -- capabilities ---------------------------------------------------------------------

    def is_serializable(self) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return False

    @property
    def is_compileable(self) -> bool:
        return True



def _record_layers(config: TorchBQConfig, model: nn.Module) -> None:
    """Fill ``config`` from the torch_bq modules ``model`` holds: what ``save_pretrained`` writes."""
    config.layers = {}
    seen_formats = []
    for name, module in model.named_modules():
        record = _layer_record(module)
        if record is not None:
            config.layers[name] = record
            seen_formats.append(record["format"])
    if config.format is None and len(set(seen_formats)) == 1:
        # one format for the whole model only when every layer has it (a reload checks
        # each layer against it); a mixed model says so per layer only
        config.format = seen_formats[0]
    if config.format == "fp8" and config.block is None:
        blocks = [tuple(r["block"]) for r in config.layers.values() if r["format"] == "fp8"]
        if blocks:
            config.block = list(max(set(blocks), key=blocks.count))
            scales = [r["scale_dtype"] for r in config.layers.values() if r["format"] == "fp8"]
            config.scale_dtype = max(set(scales), key=scales.count)
    config.modules_to_not_convert = sorted(
        name for name, m in model.named_modules() if type(m) is nn.Linear or isinstance(m, nn.Embedding)
    ) or None


def _layer_record(module: nn.Module) -> Optional[dict]:
    if isinstance(module, FP8Linear):
        return {"format": "fp8", "block": list(module.block), "scale_dtype": _dtype_name(module.weight_scale.dtype)}
    if isinstance(module, FP4Linear):
        return {"format": "fp4", "block": [1, 32], "scale_dtype": "float8_e8m0fnu"}
    if isinstance(module, NVFP4Linear):
        return {"format": "nvfp4", "block": [1, 16], "scale_dtype": "float8_e4m3fn"}
    if isinstance(module, FP8Experts):
        return {"format": "fp8", "block": list(module.block), "scale_dtype": _dtype_name(module.scale_dtype),
                "experts": module.num_experts, "activation": module.activation}
    if isinstance(module, FP4Experts):
        return {"format": "fp4", "block": [1, 32], "scale_dtype": "float8_e8m0fnu",
                "experts": module.num_experts, "activation": module.activation}
    return None


# =========================================================================== #
# models quantized outside from_pretrained (quantize_, load_quantized_)
# =========================================================================== #


def check_attachable(model: nn.Module) -> None:
    """Raise ``ValueError`` if ``model`` carries a transformers quantizer other than torch_bq's.

    ``save_pretrained`` writes what that quantizer says; torch_bq modules swapped in
    beside its own would be saved in its layout, which it cannot read back.
    """
    current = getattr(model, "hf_quantizer", None)
    if current is not None and not isinstance(current, TorchBQQuantizer):
        method = getattr(current.quantization_config, "quant_method", None)
        raise ValueError(
            f"the model was loaded with transformers' {type(current).__name__} (quant_method "
            f"{getattr(method, 'value', method)!r}); torch_bq modules added to it would be saved in that "
            f"quantizer's layout. Load it in float (or with torch_bq.hf.TorchBQConfig) first"
        )


def attach_quantizer(model: nn.Module, config: TorchBQConfig) -> Optional[TorchBQQuantizer]:
    """Make a transformers model that torch_bq quantized in place save as if ``from_pretrained`` had.

    :func:`torch_bq.nn.quantize_` and :func:`torch_bq.nn.load_quantized_` call this on a
    ``PreTrainedModel``: without a quantizer, transformers' ``save_pretrained`` would
    write fp8/fp4 codes in their natural shapes with no ``quantization_config``, and
    transformers would later read them back as bf16 values. With it, the model is what
    ``from_pretrained(..., quantization_config=config)`` returns: ``model.hf_quantizer``
    is a :class:`TorchBQQuantizer`, ``model.config.quantization_config`` is ``config``
    with every torch_bq module recorded in ``layers`` (format, block, scale dtype) and
    the float ones in ``modules_to_not_convert``, and ``save_pretrained`` writes torch_bq's
    stored layout (records, codes with a unit axis), which ``from_pretrained`` reloads
    bit-exactly with this module imported and plain transformers refuses.

    A model that already has torch_bq's quantizer keeps it, its records redone from
    the modules; ``config`` is then unused. Returns the quantizer, or ``None`` when the
    model holds no torch_bq quantized module (nothing to protect: e.g. ``quantize_(..., "bf16")``).
    """
    check_attachable(model)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None:
        if not any(_layer_record(m) is not None for m in model.modules()):
            return None
        quantizer = TorchBQQuantizer(config, pre_quantized=True)
    else:
        # re-derived from the modules: a second quantize_ may have changed them
        quantizer.quantization_config.format = quantizer.quantization_config.block = None
        quantizer.quantization_config.scale_dtype = None
    model.hf_quantizer = quantizer
    # what transformers' preprocess_model sets on a model it quantizes (.half()/.float() refuse it)
    model.is_quantized = True
    model.quantization_method = QUANT_METHOD
    quantizer.postprocess_model(model)  # config.quantization_config, then _process_model_after_weight_loading
    return quantizer


def model_from_config(config, *args, dtype: Optional[torch.dtype] = None, **kwargs) -> nn.Module:
    """``AutoModelForCausalLM.from_config(config)`` (used by :func:`torch_bq.nn.empty_model`)."""
    if dtype is not None:
        kwargs["dtype"] = dtype
    model = transformers.AutoModelForCausalLM.from_config(config, *args, **kwargs)
    # from_pretrained keeps some tensors in float32 whatever the dtype (DeepSeek's
    # e_score_correction_bias: _keep_in_fp32_modules_strict); a skeleton must agree.
    plan = model._get_dtype_plan(model.dtype) if hasattr(model, "_get_dtype_plan") else {}
    if plan:
        for module_name, module in model.named_modules():
            for store in (module._parameters, module._buffers):
                for leaf, t in list(store.items()):
                    full = f"{module_name}.{leaf}" if module_name else leaf
                    for key, want in plan.items():
                        if t is not None and t.is_floating_point() and re.search(rf"(^|\.){re.escape(key)}(\.|$)", full):
                            cast = t.to(want)
                            store[leaf] = nn.Parameter(cast, t.requires_grad) if isinstance(t, nn.Parameter) else cast
                            break
    return model
