"""``neuron``-device kernels for the ``torch_bq::`` ops, registered only where the Neuron stack is.

When :func:`torch_bq.ops._backend.neuron_available` says yes, each NKI kernel
is wrapped once with torch_neuronx's documented custom-op decorator
(``torch_neuronx.nki_op``) as a private ``torch_bq_nki::`` op, and the public
``torch_bq::`` op gets a ``neuron`` kernel that checks and lays out its
arguments (:mod:`.launch`) and calls that op. Everywhere else this module does
nothing: no import of ``nki`` or ``torch_neuronx``, no warning.

Not yet exercised on Trainium hardware: see docs/nki.md.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...reference import linear as ref
from .. import _backend
from . import launch as prep

__all__ = ["register_neuron_kernels", "registered"]

registered = False


def _run(launch: prep.KernelLaunch, nki_call, reference, x: torch.Tensor) -> torch.Tensor:
    if launch.fallback is not None:
        return reference()
    if launch.kernel is None:  # M == 0 or N == 0: nothing to launch
        return x.new_empty(launch.out_shape, dtype=launch.out_dtype)
    y = nki_call(*launch.tensors, *launch.options.values())
    return y.reshape(launch.out_shape)


def register_neuron_kernels() -> bool:
    """Register the ``neuron`` kernels if the Neuron stack is importable; return whether it is."""
    global registered
    if registered:
        return True
    if not _backend.neuron_available():
        return False

    from torch_neuronx import nki_op

    from . import linear as kernels
    from . import qdq as qdq_kernels

    def launcher(kernel):
        lnc = _backend.neuron_lnc()
        return kernel if lnc == 1 else kernel[lnc]

    @nki_op("torch_bq_nki::fp8_linear", mutates_args={})
    def nki_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor],
                       act_quant: bool, act_peak: float, out_dtype: str, block_rows: int,
                       block_cols: int) -> torch.Tensor:
        return launcher(kernels.fp8_linear_kernel)(x, weight, scale, bias, act_quant=act_quant, act_peak=act_peak,
                                                   out_dtype=out_dtype, block_rows=block_rows,
                                                   block_cols=block_cols)

    @nki_op("torch_bq_nki::fp4_linear", mutates_args={})
    def nki_fp4_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor],
                       act_quant: bool, act_peak: float, out_dtype: str) -> torch.Tensor:
        return launcher(kernels.fp4_linear_kernel)(x, weight, scale, bias, act_quant=act_quant,
                                                   act_peak=act_peak, out_dtype=out_dtype)

    @nki_op("torch_bq_nki::bf16_linear", mutates_args={})
    def nki_bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                        out_dtype: str) -> torch.Tensor:
        return launcher(kernels.bf16_linear_kernel)(x, weight, bias, out_dtype=out_dtype)

    @nki_op("torch_bq_nki::fp32w_linear", mutates_args={})
    def nki_fp32w_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         out_dtype: str) -> torch.Tensor:
        return launcher(kernels.fp32w_linear_kernel)(x, weight, bias, out_dtype=out_dtype)

    @nki_op("torch_bq_nki::qdq_fp8", mutates_args={})
    def nki_qdq_fp8(x: torch.Tensor, peak: float) -> torch.Tensor:
        return launcher(qdq_kernels.qdq_fp8_kernel)(x, peak=peak)

    @torch.library.register_kernel("torch_bq::fp8_linear", "neuron")
    def _(x, weight, scale, bias, block, act_quant, act_peak, out_dtype):
        launch = prep.prepare_fp8_linear(x, weight, scale, bias, block, act_quant, act_peak, out_dtype)
        return _run(launch, nki_fp8_linear, lambda: ref.fp8_linear(
            x, weight, scale, bias, block, act_quant, act_peak, out_dtype), x)

    @torch.library.register_kernel("torch_bq::fp4_linear", "neuron")
    def _(x, weight, scale, bias, act_quant, act_peak, out_dtype):
        launch = prep.prepare_fp4_linear(x, weight, scale, bias, act_quant, act_peak, out_dtype)
        return _run(launch, nki_fp4_linear, None, x)

    @torch.library.register_kernel("torch_bq::bf16_linear", "neuron")
    def _(x, weight, bias, out_dtype):
        return _run(prep.prepare_dense_linear(x, weight, bias, out_dtype, torch.bfloat16), nki_bf16_linear, None, x)

    @torch.library.register_kernel("torch_bq::fp32w_linear", "neuron")
    def _(x, weight, bias, out_dtype):
        return _run(prep.prepare_dense_linear(x, weight, bias, out_dtype, torch.float32), nki_fp32w_linear, None, x)

    @torch.library.register_kernel("torch_bq::qdq_fp8", "neuron")
    def _(x, peak):
        launch = prep.prepare_qdq_fp8(x, peak)
        if launch.kernel is None:
            return torch.empty_like(x, dtype=torch.bfloat16)
        return nki_qdq_fp8(*launch.tensors, *launch.options.values()).reshape(x.shape)

    registered = True
    return True


register_neuron_kernels()
