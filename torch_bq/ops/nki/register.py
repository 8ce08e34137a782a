"""``neuron``-device kernels for the ``torch_bq::`` ops, registered only where the Neuron stack is.

The registration follows TorchNeuron's custom-op contract (its ``nki_op`` / ``wrap_nki``,
``torch_neuronx/nki_hop.py``), for eager mode and for ``torch.compile(backend="neuron")``:

* each NKI kernel gets one private op, ``torch_bq_nki::<op>``, made with
  ``@torch_neuronx.nki_op``. Its body calls ``wrap_nki(kernel)`` (``[(lnc,)]`` for LNC=2)
  and returns the kernel's output. ``nki_op`` registers that body as the op's fake kernel
  too, so the body only reads shapes and dtypes: it must trace with fake tensors.
* the public ``torch_bq::<op>`` gets a ``neuron`` kernel (eager): argument checks and layout
  (:mod:`.launch`), the reference where the kernel cannot serve, else the private op.
* for ``torch.compile`` the public op must not stay an opaque node (a custom op with a Python
  ``neuron`` kernel, which the Neuron backend cannot lower): a ``FunctionalTensorMode`` rule on
  it traces the same path into the graph for ``neuron`` tensors, so the graph holds ATen ops
  and ``wrap_nki`` kernel calls only. The host-side scale-range check cannot run on traced
  tensors; it becomes a device-side ``_assert_async`` (an error, never a wrong product).
  Non-``neuron`` tensors are handed back to the mode unchanged.

Where the Neuron stack is missing nothing happens: no import of ``nki`` or ``torch_neuronx``,
no warning. Where a Neuron device is present but the kernels cannot register (e.g. the
torch-xla flavour of torch-neuronx, which has no ``nki_op``), one ``RuntimeWarning`` says why.

Not yet exercised on Trainium hardware: see docs/nki.md.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch

from ...reference import linear as ref
from .. import _backend
from . import launch as prep

__all__ = ["register_neuron_kernels", "registered", "NEURON_OPS"]

registered = False
_warned = False

# The public ops that get a neuron kernel here (and register_paged.PAGED_OPS: KV cache, attention, grouped).
NEURON_OPS = ("fp8_linear", "fp4_linear", "bf16_linear", "fp32w_linear", "qdq_fp8")


def _guard(launch: prep.KernelLaunch) -> None:
    """Device-side form of the scale-range check, for traced arguments (no host sync)."""
    for codes, (lo, hi), op in launch.guards:
        ok = torch.logical_and(codes >= lo, codes <= hi).all()
        torch._assert_async(
            ok,
            f"torch_bq {op} on neuron under torch.compile: e8m0 scale codes outside {lo}..{hi}, which the NKI "
            f"kernel cannot decode exactly; run this layer eagerly, where the reference serves such weights",
        )


def _run(launch: prep.KernelLaunch, nki_call, reference, x: torch.Tensor) -> torch.Tensor:
    if launch.fallback is not None:
        return reference()
    if launch.kernel is None:  # M == 0 or N == 0: nothing to launch
        return x.new_empty(launch.out_shape, dtype=launch.out_dtype)
    _guard(launch)
    y = nki_call(*launch.tensors, *launch.options.values())
    return y.reshape(launch.out_shape)


def _warn_once(reason: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            f"torch_bq: a Neuron device is present but the NKI kernels cannot register ({reason}); "
            "torch_bq ops on it run the reference bodies",
            RuntimeWarning,
            stacklevel=3,
        )


def _on_neuron(args) -> bool:
    return any(isinstance(a, torch.Tensor) and a.device.type == "neuron" for a in args)


def _trace_on_neuron(impl):
    """A ``FunctionalTensorMode`` rule: trace ``impl`` into the graph for neuron tensors, else the default."""

    def rule(mode, func, types, args, kwargs):
        if _on_neuron(args):
            with mode:
                return impl(*args, **kwargs, tracing=True)
        return mode.__torch_dispatch__(func, types, args, kwargs)

    return rule


def register_neuron_kernels() -> bool:
    """Register the ``neuron`` kernels if the Neuron stack is importable; return whether they are registered."""
    global registered
    if registered:
        return True
    if not _backend.neuron_available():
        if _backend.neuron_device_present():
            _warn_once(_backend.neuron_unavailable_reason() or "unknown reason")
        return False

    from torch._subclasses.functional_tensor import FunctionalTensorMode
    from torch_neuronx import nki_op, wrap_nki

    from . import linear as kernels
    from . import qdq as qdq_kernels

    def launcher(kernel, lnc: int):
        call = wrap_nki(kernel)
        return call if lnc == 1 else call[(lnc,)]

    @nki_op("torch_bq_nki::fp8_linear", mutates_args={})
    def nki_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor],
                       act_quant: bool, act_peak: float, out_dtype: str, block_rows: int, block_cols: int,
                       lnc: int) -> torch.Tensor:
        return launcher(kernels.fp8_linear_kernel, lnc)(x, weight, scale, bias, act_quant, act_peak, out_dtype,
                                                         block_rows, block_cols)

    @nki_op("torch_bq_nki::fp4_linear", mutates_args={})
    def nki_fp4_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor],
                       act_quant: bool, act_peak: float, out_dtype: str, lnc: int) -> torch.Tensor:
        return launcher(kernels.fp4_linear_kernel, lnc)(x, weight, scale, bias, act_quant, act_peak, out_dtype)

    @nki_op("torch_bq_nki::bf16_linear", mutates_args={})
    def nki_bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], out_dtype: str,
                        lnc: int) -> torch.Tensor:
        return launcher(kernels.bf16_linear_kernel, lnc)(x, weight, bias, out_dtype)

    @nki_op("torch_bq_nki::fp8_dequant", mutates_args={})
    def nki_fp8_dequant(weight: torch.Tensor, scale: torch.Tensor, block_rows: int, block_cols: int,
                        lnc: int) -> torch.Tensor:
        return launcher(kernels.fp8_dequant_kernel, lnc)(weight, scale, block_rows, block_cols)

    @nki_op("torch_bq_nki::fp4_dequant", mutates_args={})
    def nki_fp4_dequant(weight: torch.Tensor, scale: torch.Tensor, lnc: int) -> torch.Tensor:
        return launcher(kernels.fp4_dequant_kernel, lnc)(weight, scale)

    @nki_op("torch_bq_nki::fp32w_linear", mutates_args={})
    def nki_fp32w_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], out_dtype: str,
                         lnc: int) -> torch.Tensor:
        return launcher(kernels.fp32w_linear_kernel, lnc)(x, weight, bias, out_dtype)

    @nki_op("torch_bq_nki::qdq_fp8", mutates_args={})
    def nki_qdq_fp8(x: torch.Tensor, peak: float, lnc: int) -> torch.Tensor:
        return launcher(qdq_kernels.qdq_fp8_kernel, lnc)(x, peak)

    def with_lnc(op):
        lnc = _backend.neuron_lnc()  # the runtime's LNC, read per call (a kernel must launch with it)
        return lambda *args: op(*args, lnc)

    def decode_once_gemm(launch, w16):
        """Large M: qdq once, then the bf16 GEMM over the decoded weight in launches of gemm_chunks() each."""
        x2, bias = launch.tensors[0], launch.tensors[3]
        opts = launch.options
        a = with_lnc(nki_qdq_fp8)(x2, opts["act_peak"]) if opts["act_quant"] else x2
        gemm = with_lnc(nki_bf16_linear)
        rows, cols = prep.gemm_chunks(w16.shape[0], w16.shape[1])
        row_blocks = []
        for m0 in range(0, a.shape[0], rows):
            chunk = a[m0:m0 + rows].contiguous()
            parts = []
            for n0 in range(0, w16.shape[0], cols):
                b = None if bias is None else bias[:, n0:n0 + cols].contiguous()
                parts.append(gemm(chunk, w16[n0:n0 + cols].contiguous(), b, opts["out_dtype"]))
            row_blocks.append(torch.cat(parts, dim=1) if len(parts) > 1 else parts[0])
        return torch.cat(row_blocks) if len(row_blocks) > 1 else row_blocks[0]

    def dequant(op, launch, *options):
        """The weight decoded once into HBM, dequant_rows(K) weight rows per launch (each within the budget)."""
        weight, codes = launch.tensors[1], launch.tensors[2]
        k = launch.tensors[0].shape[1]
        step = prep.dequant_rows(k)
        bn = options[0] if options else 1  # weight rows per scale row (fp8 block_rows; fp4: 1x32)
        step = -(-step // bn) * bn  # chunks start on a scale row
        parts = []
        for r0 in range(0, weight.shape[0], step):
            rows = weight[r0:r0 + step].contiguous()
            part_codes = codes[r0 // bn:-(-(r0 + step) // bn)].contiguous() if bn > 1 else codes[r0:r0 + step]
            parts.append(with_lnc(op)(rows, part_codes.contiguous(), *options))
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def fused(op, launch, bn):
        """The fused kernel over column chunks of fused_cols() each (one launch when N fits)."""
        x2, weight, codes, bias = launch.tensors
        cols = prep.fused_cols(x2.shape[0], x2.shape[1], bn)
        if weight.shape[0] <= cols:
            return _run(launch, with_lnc(op), None, x2)
        _guard(launch)
        parts = []
        for n0 in range(0, weight.shape[0], cols):
            part_codes = codes[n0 // bn:-(-(n0 + cols) // bn)] if bn > 1 else codes[n0:n0 + cols]
            b = None if bias is None else bias[:, n0:n0 + cols].contiguous()
            parts.append(with_lnc(op)(x2, weight[n0:n0 + cols].contiguous(), part_codes.contiguous(), b,
                                      *launch.options.values()))
        return torch.cat(parts, dim=1).reshape(launch.out_shape)

    def fp8_call(launch):
        if not prep.decode_once(launch):
            return fused(nki_fp8_linear, launch, launch.options["block_rows"])
        _guard(launch)
        opts = launch.options
        w16 = dequant(nki_fp8_dequant, launch, opts["block_rows"], opts["block_cols"])
        return decode_once_gemm(launch, w16).reshape(launch.out_shape)

    def fp4_call(launch):
        if not prep.decode_once(launch):
            return fused(nki_fp4_linear, launch, 1)
        _guard(launch)
        w16 = dequant(nki_fp4_dequant, launch)
        return decode_once_gemm(launch, w16).reshape(launch.out_shape)

    def fp8_linear(x, weight, scale, bias, block, act_quant, act_peak, out_dtype, tracing=False):
        launch = prep.prepare_fp8_linear(x, weight, scale, bias, block, act_quant, act_peak, out_dtype, tracing)
        if launch.fallback is not None or launch.kernel is None:
            return _run(launch, None, lambda: ref.fp8_linear(
                x, weight, scale, bias, block, act_quant, act_peak, out_dtype), x)
        return fp8_call(launch)

    def fp4_linear(x, weight, scale, bias, act_quant, act_peak, out_dtype, tracing=False):
        launch = prep.prepare_fp4_linear(x, weight, scale, bias, act_quant, act_peak, out_dtype, tracing)
        if launch.fallback is not None or launch.kernel is None:
            return _run(launch, None, lambda: ref.fp4_linear(
                x, weight, scale, bias, act_quant, act_peak, out_dtype), x)
        return fp4_call(launch)

    def bf16_linear(x, weight, bias, out_dtype, tracing=False):
        launch = prep.prepare_dense_linear(x, weight, bias, out_dtype, torch.bfloat16)
        return _run(launch, with_lnc(nki_bf16_linear), lambda: ref.bf16_linear(x, weight, bias, out_dtype), x)

    def fp32w_linear(x, weight, bias, out_dtype, tracing=False):
        launch = prep.prepare_dense_linear(x, weight, bias, out_dtype, torch.float32)
        return _run(launch, with_lnc(nki_fp32w_linear), lambda: ref.fp32w_linear(x, weight, bias, out_dtype), x)

    def qdq_fp8(x, peak, tracing=False):
        launch = prep.prepare_qdq_fp8(x, peak)
        if launch.kernel is None:
            return torch.empty_like(x, dtype=torch.bfloat16)
        return with_lnc(nki_qdq_fp8)(*launch.tensors, *launch.options.values()).reshape(x.shape)

    from .. import linear as public

    impls = {"fp8_linear": (public._fp8_linear, fp8_linear), "fp4_linear": (public._fp4_linear, fp4_linear),
             "bf16_linear": (public._bf16_linear, bf16_linear), "fp32w_linear": (public._fp32w_linear, fp32w_linear),
             "qdq_fp8": (public._qdq_fp8, qdq_fp8)}
    # The backend selector's registration (switchable by fast_kernels_disabled) where it exists.
    register_kernel = getattr(_backend, "register_fast_kernel", None)
    for name in NEURON_OPS:
        op, impl = impls[name]
        if register_kernel is not None:
            register_kernel(op, "neuron", impl)
        else:
            op.register_kernel("neuron")(impl)
        op.register_torch_dispatch(FunctionalTensorMode, _trace_on_neuron(impl))
    report = getattr(_backend, "report_backend", None)
    if report is not None:
        report("neuron", kernels="nki", lnc=_backend.neuron_lnc(), ops=list(NEURON_OPS))

    # The KV-cache, attention and grouped (MoE) kernels, registered the same way (register_paged).
    from . import register_paged

    register_paged.register(nki_op, wrap_nki, _trace_on_neuron, FunctionalTensorMode)

    registered = True
    return True


register_neuron_kernels()
