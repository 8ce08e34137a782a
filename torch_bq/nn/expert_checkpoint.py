"""Mixture-of-experts checkpoint layouts, read through the one loader of :mod:`torch_bq.nn.checkpoint`.

Each expert projection is found and read with :func:`~torch_bq.nn.checkpoint.detect_linear`
and :func:`~torch_bq.nn.checkpoint.read_linear` (headers first, lazy reads, NaN-code
scans, the same errors as the linear loaders); this module only knows where the
experts of a layer live and how to stack them.

=============  ==============================================================  ================
``layout=``    tensors under ``prefix``                                        module
=============  ==============================================================  ================
``"gpt-oss"``  ``{p}.gate_up_proj_blocks`` ``U8 [E, 2I, H/32, 16]``,            ``FP4Experts``,
               ``{p}.gate_up_proj_scales`` ``U8 [E, 2I, H/32]``,                ``activation=
               ``{p}.gate_up_proj_bias`` ``[E, 2I]``; the same for              "gpt-oss"``
               ``down_proj`` (``[E, H, I/32, 16]``, ``[E, H, I/32]``, ``[E, H]``)
``"deepseek"`` per expert ``e``: ``{p}.{e}.w1.weight`` + ``.scale`` (or          ``FP8Experts`` or
               ``.weight_scale_inv``), ``{p}.{e}.w3.*``, ``{p}.{e}.w2.*``;        ``FP4Experts``,
               fp8 (any block) or fp4 data (whichever the module is)             ``activation=
                                                                               "swiglu"``
``"torch_bq"`` the module's own state dict, stacked: ``{p}.gate_up_proj``         ``FP8Experts`` or
               ``[E, 2I, .]`` + ``{p}.gate_up_proj_scale``, ``{p}.down_proj`` +   ``FP4Experts``
               ``{p}.down_proj_scale``, optional ``{p}.*_bias`` (what
               ``save_pretrained`` of a torch_bq model writes; files
               store the codes with a trailing unit axis, read back natural)
=============  ==============================================================  ================

gpt-oss's gate/up rows stay interleaved as stored; DeepSeek's ``w1`` and ``w3``
are stacked as ``gate_up_proj`` rows ``[w1; w3]``, ``w2`` becomes ``down_proj``.
The stacking is exact for any fp8 blocks (:func:`torch_bq.formats.join_rows`): when
``w1``'s rows are not a multiple of its scale block, or the projections' blocks
differ, every projection is re-expressed on the finest common block (``gcd``), on
which each scale is a copy of the one it came from.
Experts are copied one at a time into preallocated stacked tensors, so loading
holds the layer's quantized bytes plus one expert's.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Optional, Sequence

import torch

from .. import formats
from .checkpoint import (
    CheckpointError,
    LinearLayout,
    LinearWeights,
    detect_linear,
    open_checkpoint,
    read_linear,
)

__all__ = ["EXPERT_LAYOUTS", "DEEPSEEK_PROJECTIONS", "load_experts"]

EXPERT_LAYOUTS = ("gpt-oss", "deepseek", "torch_bq")
#: DeepSeek's names for (gate, up, down); HF DeepSeek-V3 uses ("gate_proj", "up_proj", "down_proj")
DEEPSEEK_PROJECTIONS = ("w1", "w3", "w2")


class _Stack:
    """Preallocated ``[E, ...]`` tensors filled one expert at a time, checked for uniformity."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self.tensors: dict[str, Optional[torch.Tensor]] = {}

    def put(self, key: str, e: int, value: Optional[torch.Tensor], what: str) -> None:
        if key not in self.tensors:
            self.tensors[key] = (
                None if value is None else torch.empty(self.num_experts, *value.shape, dtype=value.dtype)
            )
        stacked = self.tensors[key]
        if (stacked is None) != (value is None):
            raise CheckpointError(
                f"{what}: expert {e} {'has' if value is not None else 'lacks'} this tensor but expert 0 "
                f"{'lacks' if value is not None else 'has'} it; every expert must be stored alike"
            )
        if value is None:
            return
        if value.dtype != stacked.dtype or value.shape != stacked.shape[1:]:
            raise CheckpointError(
                f"{what}: expected {stacked.dtype} {list(stacked.shape[1:])} like expert 0, "
                f"got {value.dtype} {list(value.shape)}"
            )
        stacked[e] = value


def _check_same_layer(first: LinearLayout, other: LinearLayout, what: str,
                      fields=("format", "layout", "out_features", "in_features", "block")) -> None:
    for field in fields:
        a, b = getattr(first, field), getattr(other, field)
        if a != b:
            raise CheckpointError(f"{what}: {field} is {b!r} but expert 0 has {a!r}; every expert must be stored alike")


def _format_of(cls) -> str:
    return cls.format_name


def _load_gpt_oss(reader, cls, prefix: str, *, block) -> tuple[_Stack, tuple, dict]:
    if _format_of(cls) != "fp4":
        raise CheckpointError(
            f"{prefix}: the gpt-oss layout holds MXFP4 experts; load them with FP4Experts, not {cls.__name__}"
        )
    if block is not None:
        raise TypeError("block: gpt-oss experts are MXFP4 (1x32 blocks); block applies to fp8 only")
    layouts = {}
    for proj in ("gate_up_proj", "down_proj"):
        layouts[proj] = detect_linear(reader, f"{prefix}.{proj}", expert=0, format="fp4")
        if layouts[proj].layout != "gpt-oss":
            raise CheckpointError(
                f"{prefix}.{proj}: expected gpt-oss _blocks/_scales tensors, found the {layouts[proj].layout} layout; "
                f"pass layout='deepseek' for per-expert tensors"
            )
    gate_up, down = layouts["gate_up_proj"], layouts["down_proj"]
    num_experts = gate_up.num_experts
    sizes = _sizes(prefix, gate_up, down, num_experts, down.num_experts)
    stack = _Stack(num_experts)
    for proj, layout in layouts.items():
        for e in range(num_experts):
            try:
                w = read_linear(reader, dataclasses.replace(layout, expert=e))
            except CheckpointError as error:
                # The stacked tensor's name alone does not say which expert is bad.
                raise CheckpointError(f"expert {e} of {error}") from None
            _put_weights(stack, proj, e, w, f"{layout.weight_name}[{e}]")
    return stack, sizes, {}


def _deepseek_expert_count(reader, prefix: str, gate: str) -> int:
    pattern = re.compile(re.escape(prefix) + r"\.(\d+)\." + re.escape(gate) + r"\.weight$")
    found = [int(m.group(1)) for m in map(pattern.match, reader.keys()) if m]
    return max(found) + 1 if found else 0


def _load_deepseek(reader, cls, prefix: str, *, block, num_experts, projections) -> tuple[_Stack, tuple, dict]:
    if len(projections) != 3:
        raise ValueError(f"projections: expected three names (gate, up, down), got {tuple(projections)}")
    gate_name, up_name, down_name = projections
    fmt = _format_of(cls)
    if num_experts is None:
        num_experts = _deepseek_expert_count(reader, prefix, gate_name)
        if num_experts == 0:
            # detect_linear raises the loader's usual "looked for / closest names" error.
            detect_linear(reader, f"{prefix}.0.{gate_name}", format=fmt, block=block)
    elif not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts: expected a positive int, got {num_experts!r}")
    first: dict[str, LinearLayout] = {}
    stack = _Stack(num_experts)
    for e in range(num_experts):
        layouts = {}
        for role, name in (("gate", gate_name), ("up", up_name), ("down", down_name)):
            layout = detect_linear(reader, f"{prefix}.{e}.{name}", format=fmt, block=block)
            if layout.format != fmt:
                raise CheckpointError(
                    f"{layout.weight_name}: holds {layout.format} weights; load them with "
                    f"{'FP8Experts' if layout.format == 'fp8' else 'FP4Experts'}, not {cls.__name__}"
                )
            if e == 0:
                first[role] = layout
            _check_same_layer(first[role], layout, layout.weight_name)
            layouts[role] = layout
        if e == 0:
            gate, up = layouts["gate"], layouts["up"]
            # gate and up are one fused layer; their blocks may differ (join_rows re-blocks)
            _check_same_layer(gate, up, up.weight_name, ("format", "layout", "out_features", "in_features"))
            module_block = _common_block(fmt, gate, up, layouts["down"])
        weights = {role: read_linear(reader, layout) for role, layout in layouts.items()}
        # gate_up_proj rows are [w1; w3], every projection on the one block of the module.
        pieces = [formats.RowPiece(weights[r].weight, weights[r].scale, weights[r].block) for r in ("gate", "up")]
        fused = formats.join_rows(fmt, pieces, row_block=module_block and module_block[0],
                                  col_block=module_block and module_block[1], name=f"{prefix}.{e}.{gate_name}/{up_name}")
        gate_up = LinearWeights(
            dataclasses.replace(layouts["gate"], block=fused.block), fused.data, fused.scale,
            _cat_optional(weights["gate"].bias, weights["up"].bias, layouts["gate"].prefix),
        )
        down = weights["down"]
        if module_block is not None:
            reblocked = formats.join_rows(fmt, [formats.RowPiece(down.weight, down.scale, down.block)],
                                          row_block=module_block[0], col_block=module_block[1],
                                          name=layouts["down"].weight_name)
            down = LinearWeights(dataclasses.replace(down.layout, block=reblocked.block), reblocked.data,
                                 reblocked.scale, down.bias)
        _put_weights(stack, "gate_up_proj", e, gate_up, f"{prefix}.{e}.{gate_name}/{up_name}")
        _put_weights(stack, "down_proj", e, down, layouts["down"].weight_name)
    gate, down = first["gate"], first["down"]
    fused_layout = dataclasses.replace(gate, out_features=2 * gate.out_features)
    sizes = _sizes(prefix, fused_layout, down, num_experts, num_experts)
    options = {} if module_block is None else {"block": module_block}
    return stack, sizes, options


def _common_block(fmt: str, gate: LinearLayout, up: LinearLayout, down: LinearLayout) -> Optional[tuple[int, int]]:
    """The one block of the module: the finest that holds [w1; w3] and w2 exactly (``None`` when the
    format's block is fixed, as MXFP4's 1x32: plain concatenation is exact then).

    Rows: w3 starts at row I of gate_up, so the block must divide I besides every
    projection's own row block; columns: every projection's column block.
    """
    if formats.get_format(fmt).block_fixed:
        return None
    rows = math.gcd(gate.block[0], up.block[0], down.block[0], gate.out_features)
    cols = math.gcd(gate.block[1], up.block[1], down.block[1])
    return rows, cols


def _cat_optional(a, b, what) -> Optional[torch.Tensor]:
    if (a is None) != (b is None):
        raise CheckpointError(f"{what}: only one of the gate and up projections has a bias")
    return None if a is None else torch.cat((a, b))


def _put_weights(stack: _Stack, proj: str, e: int, w: LinearWeights, what: str) -> None:
    stack.put(proj, e, w.weight, what)
    stack.put(f"{proj}_scale", e, w.scale, f"{what} scale")
    stack.put(f"{proj}_bias", e, w.bias, f"{what} bias")


def _sizes(prefix, gate_up: LinearLayout, down: LinearLayout, e_gate_up, e_down) -> tuple[int, int, int]:
    """``(E, H, I)``, checking that gate_up ``[2I, H]`` and down ``[H, I]`` describe one layer."""
    if e_gate_up != e_down:
        raise CheckpointError(f"{prefix}: gate_up_proj holds {e_gate_up} experts but down_proj holds {e_down}")
    h, two_i = gate_up.in_features, gate_up.out_features
    if two_i % 2 or (down.out_features, down.in_features) != (h, two_i // 2):
        raise CheckpointError(
            f"{down.weight_name}: expected a [{h}, {two_i // 2}] projection (hidden {h}, intermediate "
            f"{two_i // 2} from {gate_up.weight_name}), got [{down.out_features}, {down.in_features}]"
        )
    return e_gate_up, h, two_i // 2


_STACKED = ("gate_up_proj", "down_proj")


def stacked_experts_format(reader, prefix: str) -> Optional[str]:
    """``"fp8"``/``"fp4"`` if ``prefix`` holds torch_bq's stacked expert tensors, else ``None`` (headers only)."""
    if f"{prefix}.gate_up_proj" not in reader or f"{prefix}.gate_up_proj_scale" not in reader:
        return None
    dtype = reader.dtype(f"{prefix}.gate_up_proj")
    if dtype == torch.float8_e4m3fn:
        return "fp8"
    if dtype in (torch.uint8, torch.int8, torch.float4_e2m1fn_x2):
        return "fp4"
    raise CheckpointError(
        f"{prefix}.gate_up_proj: expected fp8 (F8_E4M3) or packed fp4 (U8) data next to "
        f"{prefix}.gate_up_proj_scale, got {dtype}"
    )


def stacked_experts_block(reader, prefix: str, block=None) -> tuple[int, int]:
    """The fp8 block of torch_bq stacked experts under ``prefix``: recorded > ``block`` > shapes (headers only).

    The record is the loader's (:func:`torch_bq.checkpoint.record_of` on
    ``{prefix}.gate_up_proj``: shard metadata, the module's ``_extra_state``, config.json);
    shape inference must leave exactly one candidate for both projections.
    """
    from ..checkpoint import AmbiguousLayoutError, block_candidates, record_of
    from ..checkpoint.record import check_block_value

    record = record_of(reader, prefix, f"{prefix}.gate_up_proj")
    given = None if block is None else check_block_value(block, "block")
    if record is not None and record.block is not None:
        if given is not None and given != record.block:
            raise CheckpointError(f"{prefix}: block={list(given)} was passed but {record.source} records {list(record.block)}")
        return record.block
    if given is not None:
        return given
    options = None
    for proj in _STACKED:
        n, k = reader.shape(f"{prefix}.{proj}")[1:]
        grid = reader.shape(f"{prefix}.{proj}_scale")[1:]
        found = {(a, b) for a in block_candidates(n, grid[0]) for b in block_candidates(k, grid[1])}
        options = found if options is None else options & found
    if options is None or len(options) != 1:
        raise AmbiguousLayoutError(
            f"{prefix}.gate_up_proj_scale: the scale shapes of both projections admit blocks "
            f"{sorted(options or [])} and the checkpoint records none; pass block=(bn, bk)",
            [("fp8", b) for b in sorted(options or [])], "block",
        )
    return options.pop()


def _load_stacked(reader, cls, prefix: str, *, block, hidden_size=None, intermediate_size=None):
    fmt = stacked_experts_format(reader, prefix)
    if fmt is None:
        raise CheckpointError(
            f"{prefix}: expected torch_bq stacked experts ({prefix}.gate_up_proj + {prefix}.gate_up_proj_scale)"
        )
    if fmt != _format_of(cls):
        raise CheckpointError(
            f"{prefix}.gate_up_proj: holds {fmt} experts; load them with "
            f"{'FP8Experts' if fmt == 'fp8' else 'FP4Experts'}, not {cls.__name__}"
        )
    names = [f"{prefix}.{proj}{suffix}" for proj in _STACKED for suffix in ("", "_scale", "_bias")]
    tensors = {}
    for proj in _STACKED:
        for suffix in ("", "_scale", "_bias"):
            name = f"{prefix}.{proj}{suffix}"
            if name in reader:
                tensors[f"{proj}{suffix}"] = reader.get(name)
            elif suffix != "_bias":
                raise CheckpointError(f"{name} is missing; torch_bq stacked experts need all of {names[:2] + names[3:5]}")
    e, two_i = tensors["gate_up_proj"].shape[:2]
    h = tensors["down_proj"].shape[1]
    options = {}
    if fmt == "fp8":
        block = stacked_experts_block(reader, prefix, block)
        return cls.from_quantized(**tensors, block=block, name=prefix), options
    if block is not None:
        raise TypeError("block: fp4 experts are MXFP4 (1x32 blocks); block applies to fp8 only")
    return cls.from_quantized(**tensors, hidden_size=hidden_size, intermediate_size=intermediate_size,
                              name=prefix), options


def load_experts(
    cls,
    source,
    prefix: str,
    *,
    layout: str,
    device="cpu",
    num_experts: Optional[int] = None,
    projections: Sequence[str] = DEEPSEEK_PROJECTIONS,
    block: Optional[Sequence[int]] = None,
    activation: Optional[str] = None,
    act_quant: Optional[bool] = None,
    act_peak: Optional[float] = None,
):
    """Build a ``cls`` (:class:`FP4Experts` / :class:`FP8Experts`) from the experts under ``prefix``.

    Args:
        cls: the module class; must match the checkpoint's format.
        source: a ``.safetensors`` file, a directory (sharded index or files), a mapping of
            tensors, or a :class:`~torch_bq.nn.checkpoint.CheckpointReader`.
        prefix: e.g. ``"model.layers.0.mlp.experts"``.
        layout: ``"gpt-oss"`` or ``"deepseek"`` (table in the module docstring).
        device: where the module's tensors end up (read on CPU, then moved).
        num_experts: DeepSeek layout: how many experts to read (default: every
            ``{prefix}.{e}.{gate}.weight`` present, which must be numbered from 0 without gaps).
        projections: DeepSeek layout: names of the (gate, up, down) projections.
        block: fp8 block when the checkpoint cannot say.
        activation: default ``"gpt-oss"`` for the gpt-oss layout, ``"swiglu"`` for DeepSeek.
        act_quant, act_peak: module options (default: the module's defaults).

    Raises:
        MissingTensorError: a projection or expert is missing (lists what was looked for
            and the closest names present).
        CheckpointError: wrong format for ``cls``, shapes or blocks that differ between
            experts or do not make one layer, NaN codes, unreadable files.
    """
    if layout not in EXPERT_LAYOUTS:
        raise ValueError(f"layout: expected one of {EXPERT_LAYOUTS}, got {layout!r}")
    if layout == "torch_bq":
        if num_experts is not None or tuple(projections) != DEEPSEEK_PROJECTIONS:
            raise TypeError("num_experts, projections: apply to layout='deepseek' only")
        options = {k: v for k, v in (("activation", activation), ("act_quant", act_quant), ("act_peak", act_peak))
                   if v is not None}
        with open_checkpoint(source) as reader:
            module, _ = _load_stacked(reader, cls, prefix, block=block)
        # from_quantized validated every tensor; rebuild with the options (same storage, no copy).
        if options:
            module = _with_options(module, options)
        return module.to(device)
    with open_checkpoint(source) as reader:
        if layout == "gpt-oss":
            if num_experts is not None or tuple(projections) != DEEPSEEK_PROJECTIONS:
                raise TypeError("num_experts, projections: apply to layout='deepseek' only")
            stack, sizes, options = _load_gpt_oss(reader, cls, prefix, block=block)
        else:
            stack, sizes, options = _load_deepseek(
                reader, cls, prefix, block=block, num_experts=num_experts, projections=projections
            )
    options["activation"] = activation if activation is not None else ("gpt-oss" if layout == "gpt-oss" else "swiglu")
    if act_quant is not None:
        options["act_quant"] = act_quant
    if act_peak is not None:
        options["act_peak"] = act_peak
    if _format_of(cls) == "fp8":
        options["scale_dtype"] = stack.tensors["gate_up_proj_scale"].dtype
    # read_linear has scanned every tensor for NaN codes already.
    module = cls._from_stacked(stack.tensors, name=prefix, scan_codes=False, sizes=sizes, **options)
    return module.to(device)


def _with_options(module, options: dict):
    """``module``'s storage in a new module of the same class built with ``options``."""
    kwargs = dict(activation=module.activation, act_quant=module.act_quant, act_peak=module.act_peak)
    if hasattr(module, "block"):
        kwargs.update(block=module.block, scale_dtype=module.scale_dtype)
    kwargs.update(options)
    bias = module.gate_up_proj_bias is not None
    new = type(module)(module.num_experts, module.hidden_size, module.intermediate_size, bias, device="meta",
                       dtype=module.gate_up_proj_bias.dtype if bias else torch.bfloat16, **kwargs)
    for name, t in module.named_buffers():
        setattr(new, name, t)
    return new
