"""CPU kernels of ``torch_bq::fp8_linear``, ``fp4_linear``, ``nvfp4_linear``, ``bf16_linear``, ``fp32w_linear``
and ``qdq_fp8``.

Twins of :mod:`torch_bq.reference.linear` and :func:`torch_bq.formats.qdq_fp8`:
same positional signatures, same results (qdq bit-exact; linear up to fp32
summation order). The math lives in ``kernels.cpp`` and, for NVFP4,
``nvfp4.cpp`` (see their headers for the decode / prefill layouts).
``fp8_linear`` / ``fp4_linear`` first try the one-call
entry points (``fp8_linear_op`` / ``fp4_linear_op``: bf16(x), qdq, kernel, bias and
output rounding in C++), which refuse anything unusual or invalid; then this
module checks the arguments (the named errors), prepares the operands for the
kernels itself, or falls back to the reference when the compiled kernels are
unavailable. ``direct_fp8_linear`` / ``direct_fp4_linear`` call the entry points
from eager code without the dispatcher (see there) and hand that route to the
kernel library's C functions after their first call (``_configure_c_route``). The kernels of the
ISA level :mod:`torch_bq.ops._backend` selected run; ``_backend.fast_kernels_disabled()``
switches these registrations off (torch.library's ``set_kernel_enabled``).

Tuning:

* :func:`decode_max_m`: up to this many rows the weight is decoded inside the
  dot product (the AVX-512 BF16 kernels: once per call, whatever M is); above
  it, tiles or panels of the weight are dequantized and fed to a GEMM
  (prefill). The boundary depends on which decode kernels the build runs, on
  the format and on K (``DECODE_MAX_M``: measured crossovers).
* ``PANEL_BYTES``: the fp32 panel size of the prefill path where it runs at::mm
  (the generic build, or MKLDNN switched off); the microkernel path of the
  other builds uses fixed row groups of 96 (AVX-512 BF16) or 64 weight rows and
  K chunks of 1024 (see kernels.cpp's prefill section).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ... import formats
from ...reference import linear as ref
from .. import _backend
from .. import linear as op_defs

__all__ = [
    "DECODE_MAX_M", "NVFP4_DECODE_MAX_M", "PANEL_BYTES", "decode_limits", "decode_max_m", "direct_fp8_linear", "direct_fp4_linear",
    "entry_ops",
    "fp8_linear", "fp4_linear", "nvfp4_linear", "bf16_linear", "fp32w_linear", "qdq_fp8",
]

# The decode path's largest row count, by the decode kernels of the build
# (the kernels' ``decode_isa()``) and the format: where the prefill path becomes
# faster per row, measured on 1 thread (a lower limit would put a cliff in the
# time per row); ``python -m benchmarks.ggml_side_by_side --crossover`` measures
# it (docs/benchmarks.md). "long_k" (K, M): above this K, M at most this.
# AVX-512 BF16 (Zen 5, 2026-12-01): the folded decode tiles decode the weight
# once for all rows, so their time per row is flat from M = 40 to 128; the
# vdpbf16ps prefill tiles' falls with M but stepped up after each multiple of
# their 16-row A vectors (M = 65 cost 1.2-1.3x per row what M = 64 did) until
# up to 12 rows past the last whole vector went to row-dot tiles (stop 25).
# The limit sits where decode(M) and prefill(M + 1) cost the same per row, so
# that stepping over it is no cliff. Measured with the prefill tiles that
# decode the next panel inside the current chunk's register tiles,
# prefill(M + 1) / decode(M) per row on the five benchmark shapes: fp8 1.15-1.22
# at M = 64, 0.92-1.05 at 80, 0.88-0.99 at 88; fp4 1.15-1.25, 1.00-1.11,
# 0.92-1.05 (decode is then up to 1.16x the prefill's time per row: the price
# of a flat step). Against the slower prefill tiles before those, the same
# rule gave fp8 112, fp4 96 (docs/benchmarks.md, "Cliffs"). On a Zen 4 (2026-12-07;
# 512-bit ops on 256-bit units), with the row-dot tiles, `--crossover` on the five
# shapes: decode and prefill cost the same per row at M = 48-56, the prefill is
# 0.92-0.99x of the decode at 64-96 and 0.98-1.01x at 88, so 88 is flat there too;
# a Zen 4 limit of 56 would gain at most 8% at M = 57-87 (not taken: the limit
# follows the decode kernels, not the CPU model). Not re-measured on a Zen 5.
# AVX2 (the avx2 and avx512 libraries). Zen 4, 2026-12-07 (stop 25), after the
# fp8 tiles over two weight rows (kernels.cpp, kPairTileMaxMT) and the MXFP4 int
# path's reach raised (kFp4IntMaxM, measured at 32, now 28): `--crossover --rows
# 16,20,24,28,32,36` on 4096 x 4096, 2880 x 2880, 4096 x 14336 and 4096 x 33024,
# kernel calls, ms per row. The fp8 decode's time per row is about flat from
# M = 6 on at every K (4096 x 4096: 0.51-0.54 at 16, 20, 28; 24 and 32 measured
# 0.66-0.69 once), the prefill's falls past it at M = 28-36; the MXFP4 int
# decode is flat (0.46-0.55) and the prefill passes it at 20-32. Largest M where
# decode <= prefill: fp8 28, 36, 28, 28; fp4 28, 32, 24, 20. At 28 the prefill
# just above costs about 0.93-1.12x the decode's time per row (interpolated).
# Before the pair tiles (one weight row per tile, fp8 14, fp4 16, and 8 rows
# above K = 16384, measured on a Zen 5 on 2026-12-02) the prefill just above
# the limits cost about 1.24-1.37x (fp8), 1.03-1.28x (fp4) and 1.5-2.0x (long
# K) on this Zen 4. Re-measure when either path changes.
DECODE_MAX_M = {
    "avx512_bf16": {"fp8": 88, "fp4": 88, "long_k": None},
    "avx2": {"fp8": 28, "fp4": 28, "long_k": None},
    "generic": {"fp8": 16, "fp4": 16, "long_k": None},
}
# NVFP4 (nvfp4.cpp), by the build's NVFP4 decode kernels (the kernels'
# ``nvfp4_decode_isa()``: fp32 FMA at every level, 16 lanes from AVX-512 on;
# the prefill path is the fp32 microkernel everywhere). Measured on 1 thread,
# 4096x4096 (Zen 5, 2026-12-01, a loaded machine): AVX-512 crosses over between
# M = 24 and 32, AVX2 between 8 and 16; the generic build's scalar decode loses
# to its at::mm panels (MKL's own AVX-512 here) from M = 1, so only M = 1 stays.
NVFP4_DECODE_MAX_M = {"avx512": 24, "avx2": 8, "generic": 1}
PANEL_BYTES = 4 << 20

_decode_isa: dict = {}


def decode_limits(kernels, fmt: str) -> tuple:
    """``(limit, long_k, long_k_limit)`` for format ``fmt`` (``"fp8"``/``"fp4"``) on ``kernels``: they decode
    up to ``limit`` rows, or up to ``long_k_limit`` where ``K > long_k`` (``long_k = -1``: no such rule)."""
    isa = _decode_isa.get(id(kernels))
    if isa is None:
        isa = kernels.decode_isa() if hasattr(kernels, "decode_isa") else "avx2" if kernels.vectorized() else "generic"
        _decode_isa[id(kernels)] = isa
    limits = DECODE_MAX_M.get(isa, DECODE_MAX_M["generic"])
    long_k = limits["long_k"]
    return (limits[fmt], -1, 0) if long_k is None else (limits[fmt], *long_k)


def decode_max_m(kernels, fmt: str, k: int) -> int:
    """Largest ``M`` that ``kernels`` run on the decode path for format ``fmt`` (``"fp8"``/``"fp4"``/``"nvfp4"``)
    and ``K = k``."""
    if fmt == "nvfp4":
        return NVFP4_DECODE_MAX_M[kernels.nvfp4_decode_isa()]
    limit, long_k, long_k_limit = decode_limits(kernels, fmt)
    return long_k_limit if 0 <= long_k < k else limit


_decode_max_m = decode_max_m  # the rule the C routes copy (a test that replaces decode_max_m makes them stale)


# --------------------------------------------------------------------------- #
# the one-call entry points (kernels.cpp, "public-op entry points")
# --------------------------------------------------------------------------- #
#
# ``fp8_linear_op`` / ``fp4_linear_op`` do the whole op (bf16(x), qdq, kernel,
# bias, rounding to out_dtype) in one C++ call and return None for any call they
# do not take (invalid arguments among them): then the checks below raise their
# named errors, or the general path runs. The peak's range is checked here, not
# in C++, so that its bounds live only in torch_bq.formats.


# id(kernels) -> (fp8_linear_op, fp4_linear_op), the entry points as this module's kernels
# call them: through the library's own Python module (kernels.cpp, its last section),
# which skips torch.ops' argument parsing and the dispatcher (80-100 us of a cold M = 1
# call), or where the library has none, each op's overload callable (``OpOverload._op``:
# no OpOverloadPacket frame, no overload lookup).
_entry_ops: dict = {}


def entry_ops(kernels) -> tuple:
    """``(fp8_linear_op, fp4_linear_op)`` of ``kernels``, the callables the entry path uses."""
    found = _entry_ops.get(id(kernels))
    if found is None:
        module = _backend.entry_module(kernels)
        if module is not None:
            found = (module.fp8_linear_op, module.fp4_linear_op)
        else:
            found = tuple(getattr(packet.default, "_op", packet)
                          for packet in (kernels.fp8_linear_op, kernels.fp4_linear_op))
        _entry_ops[id(kernels)] = found
    return found


def _limit(kernels, fmt: str, x) -> int:
    """``decode_max_m(kernels, fmt, K)`` for ``x [..., K]``."""
    try:
        return decode_max_m(kernels, fmt, x.shape[-1])
    except IndexError:  # 0-d x: the entry point refuses it, and the checks name it
        return 0


def _peak_ok(act_peak) -> bool:
    """The peak's range is checked here, not in C++, so that its bounds live only in torch_bq.formats."""
    return formats.MIN_ACT_PEAK <= act_peak <= formats.FP8_MAX


def _fp8_entry(kernels, x, weight, scale, bias, block, act_quant, act_peak, out_dtype) -> Optional[torch.Tensor]:
    if not _peak_ok(act_peak):
        return None
    return entry_ops(kernels)[0](x, weight, scale, bias, block, act_quant, act_peak, out_dtype,
                                 _limit(kernels, "fp8", x), PANEL_BYTES)


def _fp4_entry(kernels, x, weight, scale, bias, act_quant, act_peak, out_dtype) -> Optional[torch.Tensor]:
    if not _peak_ok(act_peak):
        return None
    return entry_ops(kernels)[1](x, weight, scale, bias, act_quant, act_peak, out_dtype,
                                 _limit(kernels, "fp4", x), PANEL_BYTES)


# Tensor types a direct call takes as they are (nn.Parameter overrides nothing of torch's).
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _direct_route(op, fmt: str, x, weight, scale, bias, act_quant, act_peak, out_dtype):
    """``(entry module, decode_max_m)`` for an eager direct call of ``op``, or ``None`` where it must
    go through the op.

    Taken only for plain tensors and exact Python types (anything else reaches the op, whose schema
    and checks report it in the op's own words: a numpy bool or a dtype's name would otherwise meet
    the entry point's argument parser), a peak in range, the kernel not switched off
    (:func:`torch_bq.ops._backend.direct_call_allowed`) and a kernel library with a Python module.
    Everything is looked up here in one frame: from a cold cache every Python call costs a few
    microseconds, as much as an M = 1 decode of a small weight gains from skipping the op.
    """
    if not (type(x) in _PLAIN and type(weight) in _PLAIN and type(scale) in _PLAIN
            and (bias is None or type(bias) in _PLAIN) and type(act_quant) is bool
            and type(out_dtype) is torch.dtype and _peak_ok(act_peak)
            and _backend.direct_call_allowed(op, "cpu")):
        return None
    selection = _backend.cpu_selection()
    module = selection.entry_module
    if module is None or x.dim() == 0:  # 0-d x: the op's checks name it
        return None
    return module, decode_max_m(selection.ops, fmt, x.shape[-1])


def _configure_c_route(op, fmt: str, fallback) -> None:
    """Let the selected kernel library's ``fp8_linear_route`` / ``fp4_linear_route`` take the eager direct
    calls of ``op`` (registered with :func:`torch_bq.ops.linear.register_direct`), where it has one.

    The C route applies :func:`_direct_route`'s rules from the values given here and stays
    valid while its guards hold: the kernel selection, :func:`decode_max_m` and
    ``PANEL_BYTES`` are what they were (each an identity check of a module attribute).
    When one changes it calls ``fallback`` (this module's direct function), which
    routes the call in Python and configures the route again from the new values. Not
    configured while :func:`decode_max_m` is replaced (the route could not follow it).
    """
    selection = _backend._selection
    module = None if selection is None else selection.entry_module
    disabled = getattr(op, "_disabled_kernel", None)
    if (module is None or not hasattr(module, "configure_direct") or not isinstance(disabled, set)
            or decode_max_m is not _decode_max_m):
        return
    guards = [(vars(_backend), "_selection", selection), (globals(), "decode_max_m", decode_max_m),
              (globals(), "PANEL_BYTES", PANEL_BYTES)]
    module.configure_direct(fmt, *_PLAIN, disabled, formats.MIN_ACT_PEAK,
                            formats.FP8_MAX, *decode_limits(selection.ops, fmt), PANEL_BYTES, guards, fallback)
    op_defs.register_direct(f"{fmt}_linear", getattr(module, f"{fmt}_linear_route"))


def direct_fp8_linear(x, weight, scale, bias, block, act_quant, act_peak, out_dtype) -> Optional[torch.Tensor]:
    """:func:`fp8_linear` called without the ``torch_bq::`` dispatcher, or ``None`` when it must not be.

    For eager calls of the public op (:func:`torch_bq.ops.fp8_linear`, the modules),
    never traced by dynamo (the caller checks ``torch.compiler.is_dynamo_compiling()``
    first) and with ``block`` already checked: the custom-op layers cost more than a
    whole M = 1 kernel call on small weights from a cold cache. Taken where
    :func:`_direct_route` allows, through the kernel library's Python module, whose
    ``fp8_linear_direct`` refuses while a TorchFunctionMode, a TorchScript trace or a
    functorch transform is on; the entry point itself refuses dispatch modes and anything
    autograd must record. ``None``: call the op.

    The first such call also hands the route to the library's C function
    (:func:`_configure_c_route`), so that later calls reach the kernel without this
    function; it is their fallback when the kernel selection or the tuning changes.
    """
    route = _direct_route(op_defs._fp8_linear, "fp8", x, weight, scale, bias, act_quant, act_peak, out_dtype)
    if route is None:
        return None
    _configure_c_route(op_defs._fp8_linear, "fp8", direct_fp8_linear)
    return route[0].fp8_linear_direct(x, weight, scale, bias, block, act_quant, act_peak, out_dtype, route[1],
                                      PANEL_BYTES)


def direct_fp4_linear(x, weight, scale, bias, act_quant, act_peak, out_dtype) -> Optional[torch.Tensor]:
    """:func:`fp4_linear` without the ``torch_bq::`` dispatcher, or ``None``; see :func:`direct_fp8_linear`."""
    route = _direct_route(op_defs._fp4_linear, "fp4", x, weight, scale, bias, act_quant, act_peak, out_dtype)
    if route is None:
        return None
    _configure_c_route(op_defs._fp4_linear, "fp4", direct_fp4_linear)
    return route[0].fp4_linear_direct(x, weight, scale, bias, act_quant, act_peak, out_dtype, route[1], PANEL_BYTES)


# --------------------------------------------------------------------------- #
# the general path (and the dispatcher's kernels)
# --------------------------------------------------------------------------- #


def _activation(kernels, x: torch.Tensor, act_quant: bool, act_peak: float) -> torch.Tensor:
    """``A`` of docs/contract.md §4 as contiguous float32 ``[M, K]``."""
    x2 = x.reshape(x.shape[:-1].numel(), x.shape[-1]).to(torch.bfloat16).contiguous()
    if act_quant:
        return kernels.qdq_fp8(x2, float(act_peak), True)
    return x2.to(torch.float32)


def _bias(bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if bias is None else bias.to(torch.float32).contiguous()


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: Optional[torch.Tensor],
    block: Sequence[int],
    act_quant: bool,
    act_peak: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``[..., K] x fp8 [N, K] -> [..., N]``; see :func:`torch_bq.ops.fp8_linear`."""
    kernels = _backend.cpu_kernels()
    if kernels is None:
        return ref.fp8_linear(x, weight, scale, bias, block, act_quant, act_peak, out_dtype)
    y = _fp8_entry(kernels, x, weight, scale, bias, block, act_quant, act_peak, out_dtype)
    if y is not None:
        return y
    ref.check_fp8_linear_args(x, weight, scale, bias, block, act_quant, act_peak, out_dtype)
    if weight.shape[1] == 0:
        return ref.zero_k_linear(x, weight.shape[0], bias, out_dtype)
    bn, bk = (int(b) for b in block)
    codes = scale if scale.dtype == torch.float32 else formats.as_e8m0_codes(scale)
    y = kernels.fp8_linear(
        _activation(kernels, x, act_quant, act_peak),
        formats.as_fp8_bytes(weight).contiguous(),
        codes.contiguous(),
        _bias(bias),
        bn,
        bk,
        decode_max_m(kernels, "fp8", x.shape[-1]),
        PANEL_BYTES,
    )
    return y.to(out_dtype).reshape(*x.shape[:-1], weight.shape[0])


def fp4_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: Optional[torch.Tensor],
    act_quant: bool,
    act_peak: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``[..., K] x fp4 [N, ceil(K/2)] -> [..., N]``; see :func:`torch_bq.ops.fp4_linear`."""
    kernels = _backend.cpu_kernels()
    if kernels is None:
        return ref.fp4_linear(x, weight, scale, bias, act_quant, act_peak, out_dtype)
    y = _fp4_entry(kernels, x, weight, scale, bias, act_quant, act_peak, out_dtype)
    if y is not None:
        return y
    ref.check_fp4_linear_args(x, weight, scale, bias, act_quant, act_peak, out_dtype)
    if x.shape[-1] == 0:
        return ref.zero_k_linear(x, weight.shape[0], bias, out_dtype)
    y = kernels.fp4_linear(
        _activation(kernels, x, act_quant, act_peak),
        formats.as_fp4_bytes(weight).contiguous(),
        formats.as_e8m0_codes(scale).contiguous(),
        _bias(bias),
        decode_max_m(kernels, "fp4", x.shape[-1]),
        PANEL_BYTES,
    )
    return y.to(out_dtype).reshape(*x.shape[:-1], weight.shape[0])


def nvfp4_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_scale_2: torch.Tensor,
    bias: Optional[torch.Tensor],
    act_quant: bool,
    act_peak: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``[..., K] x nvfp4 [N, ceil(K/2)] -> [..., N]``; see :func:`torch_bq.ops.nvfp4_linear`."""
    kernels = _backend.cpu_kernels()
    if kernels is None:
        return ref.nvfp4_linear(x, weight, weight_scale, weight_scale_2, bias, act_quant, act_peak, out_dtype)
    ref.check_nvfp4_linear_args(x, weight, weight_scale, weight_scale_2, bias, act_quant, act_peak, out_dtype)
    if x.shape[-1] == 0:
        return ref.zero_k_linear(x, weight.shape[0], bias, out_dtype)
    y = kernels.nvfp4_linear(
        _activation(kernels, x, act_quant, act_peak),
        formats.as_fp4_bytes(weight).contiguous(),
        weight_scale.view(torch.uint8).contiguous(),  # the E4M3FN bytes
        weight_scale_2.reshape(1),
        _bias(bias),
        decode_max_m(kernels, "nvfp4", x.shape[-1]),
        PANEL_BYTES,
    )
    return y.to(out_dtype).reshape(*x.shape[:-1], weight.shape[0])


def _dense_linear(x, weight, bias, out_dtype, weight_dtype, reference):
    kernels = _backend.cpu_kernels()
    if kernels is None:
        return reference(x, weight, bias, out_dtype)
    ref.check_dense_linear_args(x, weight, bias, out_dtype, weight_dtype)
    if x.shape[-1] == 0:
        return ref.zero_k_linear(x, weight.shape[0], bias, out_dtype)
    entry = getattr(kernels, "dense_linear_op", None)  # one C++ call: staging, kernel, bias, rounding
    if entry is not None:
        y = entry(x, weight, bias, out_dtype, PANEL_BYTES)
        if y is not None:
            return y
    a = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).to(torch.float32).contiguous()
    y = kernels.dense_linear(a, weight.contiguous(), _bias(bias), PANEL_BYTES)
    return y.to(out_dtype).reshape(*x.shape[:-1], weight.shape[0])


def bf16_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], out_dtype: torch.dtype
) -> torch.Tensor:
    """``[..., K] x bf16 [N, K] -> [..., N]``; see :func:`torch_bq.ops.bf16_linear`."""
    return _dense_linear(x, weight, bias, out_dtype, torch.bfloat16, ref.bf16_linear)


def fp32w_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], out_dtype: torch.dtype
) -> torch.Tensor:
    """``[..., K] x fp32 [N, K] -> [..., N]`` (weight narrowed to bf16); see :func:`torch_bq.ops.fp32w_linear`."""
    return _dense_linear(x, weight, bias, out_dtype, torch.float32, ref.fp32w_linear)


def qdq_fp8(x: torch.Tensor, peak: float) -> torch.Tensor:
    """``[..., K]`` float -> ``[..., K]`` bfloat16, bit-exact with :func:`torch_bq.formats.qdq_fp8`."""
    formats.check_qdq_args(x, peak)
    kernels = _backend.cpu_kernels()
    if kernels is None:
        return formats.qdq_fp8(x, peak)
    x2 = x.reshape(x.shape[:-1].numel(), x.shape[-1]).to(torch.bfloat16).contiguous()
    return kernels.qdq_fp8(x2, float(peak), False).reshape(x.shape)


_backend.register_fast_kernel(op_defs._fp8_linear, "cpu", fp8_linear)
op_defs.register_direct("fp8_linear", direct_fp8_linear)
op_defs.register_direct("fp4_linear", direct_fp4_linear)
_backend.register_fast_kernel(op_defs._fp4_linear, "cpu", fp4_linear)
_backend.register_fast_kernel(op_defs._nvfp4_linear, "cpu", nvfp4_linear)
_backend.register_fast_kernel(op_defs._qdq_fp8, "cpu", qdq_fp8)
_backend.register_fast_kernel(op_defs._bf16_linear, "cpu", bf16_linear)
_backend.register_fast_kernel(op_defs._fp32w_linear, "cpu", fp32w_linear)
