"""``neuron`` kernels for the KV-cache, attention and grouped (MoE) ``torch_bq::`` ops.

Called by :func:`torch_bq.ops.nki.register.register_neuron_kernels` once the Neuron stack is
known to be there, and registered the same way as the linears (TorchNeuron's contract, see
that module): one private ``torch_bq_nki::<op>`` per kernel made with ``nki_op`` whose body
calls ``wrap_nki(kernel)`` and is also its fake kernel; a ``neuron`` kernel for the public op
(checks and layout from :mod:`.paged_launch` / :mod:`.grouped_launch`, the reference where a
kernel cannot serve); and a ``FunctionalTensorMode`` rule that traces the same path under
``torch.compile``, where data-dependent checks become device-side asserts.

``paged_kv_write`` mutates the caches: its kernel returns the written caches and the public
op copies them back (``copy_``, which functionalization turns into a write-back under
compile). Not yet exercised on Trainium hardware: see docs/nki.md.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...reference import attention as ref_attention
from ...reference import grouped as ref_grouped
from .. import _backend
from . import grouped_launch, paged_launch
from .launch import INSTRUCTION_BUDGET

__all__ = ["PAGED_OPS", "register"]

# The public ops that get a neuron kernel here.
PAGED_OPS = ("paged_kv_write", "paged_window_attention", "fp8_grouped_linear", "fp4_grouped_linear")


def _assert_guards(launch) -> None:
    for ok, message in launch.guards:
        torch._assert_async(ok, message)


def register(nki_op, wrap_nki, trace_on_neuron, functional_mode) -> None:
    """Define the private ops and register the public ops' ``neuron`` kernels and compile rules."""
    from . import attention as attention_kernels
    from . import grouped as grouped_kernels
    from . import kv_cache as kv_kernels

    def launcher(kernel, lnc: int):
        call = wrap_nki(kernel)
        return call if lnc == 1 else call[(lnc,)]

    @nki_op("torch_bq_nki::paged_kv_write", mutates_args={})
    def nki_paged_kv_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           slots: torch.Tensor, lnc: int) -> tuple[torch.Tensor, torch.Tensor]:
        return launcher(kv_kernels.paged_kv_write_kernel, lnc)(k, v, k_cache, v_cache, slots)

    @nki_op("torch_bq_nki::paged_window_attention", mutates_args={})
    def nki_paged_window_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                   key_rows: torch.Tensor, key_pos: torch.Tensor, row_bounds: torch.Tensor,
                                   scale: float, rows_per_request: int, lnc: int) -> torch.Tensor:
        return launcher(attention_kernels.paged_window_attention_kernel, lnc)(
            q, k_cache, v_cache, key_rows, key_pos, row_bounds, scale, rows_per_request)

    @nki_op("torch_bq_nki::fp8_grouped_linear", mutates_args={})
    def nki_fp8_grouped_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bounds: torch.Tensor,
                               y: torch.Tensor, bias: Optional[torch.Tensor], act_quant: bool, act_peak: float,
                               block_rows: int, block_cols: int, n_begin: int, n_end: int, lnc: int) -> torch.Tensor:
        return launcher(grouped_kernels.fp8_grouped_linear_kernel, lnc)(
            x, weight, scale, bounds, y, bias, act_quant, act_peak, block_rows, block_cols, n_begin, n_end)

    @nki_op("torch_bq_nki::fp4_grouped_linear", mutates_args={})
    def nki_fp4_grouped_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bounds: torch.Tensor,
                               y: torch.Tensor, bias: Optional[torch.Tensor], act_quant: bool, act_peak: float,
                               n_begin: int, n_end: int, lnc: int) -> torch.Tensor:
        return launcher(grouped_kernels.fp4_grouped_linear_kernel, lnc)(
            x, weight, scale, bounds, y, bias, act_quant, act_peak, n_begin, n_end)

    def grouped(op, launch):
        _assert_guards(launch)
        lnc = _backend.neuron_lnc()
        return grouped_launch.run_grouped(lambda *args: op(*args, lnc), launch, INSTRUCTION_BUDGET)

    def call(op, launch):
        _assert_guards(launch)
        # The runtime's LNC, read per call (a kernel must launch with it).
        return op(*launch.tensors, *launch.options.values(), _backend.neuron_lnc())

    def paged_kv_write(k, v, k_cache, v_cache, slots, tracing=False):
        launch = paged_launch.prepare_kv_write(k, v, k_cache, v_cache, slots, tracing)
        if launch.fallback is not None:
            return ref_attention.paged_kv_write(k, v, k_cache, v_cache, slots)
        if launch.kernel is None:  # no rows (or an empty cache): nothing to write
            return None
        new_k, new_v = call(nki_paged_kv_write, launch)
        k_cache.copy_(new_k.view(k_cache.shape))
        v_cache.copy_(new_v.view(v_cache.shape))
        return None

    def paged_window_attention(q, k_cache, v_cache, block_table, positions, seq_lens, *, rows_per_request, window,
                               causal, scale, tracing=False):
        launch = paged_launch.prepare_attention(q, k_cache, v_cache, block_table, positions, seq_lens,
                                                rows_per_request, window, causal, scale, tracing)
        if launch.fallback is not None:
            return ref_attention.paged_window_attention(
                q, k_cache, v_cache, block_table, positions, seq_lens, rows_per_request=rows_per_request,
                window=window, causal=causal, scale=scale)
        if launch.kernel is None:
            return torch.empty_like(q, memory_format=torch.contiguous_format)
        _assert_guards(launch)
        lnc = _backend.neuron_lnc()
        return paged_launch.run_attention(lambda *args: nki_paged_window_attention(*args, lnc), launch, lnc)

    def fp8_grouped_linear(x, weight, scale, offsets, bias, block, act_quant, act_peak, out_dtype, tracing=False):
        launch = grouped_launch.prepare_fp8_grouped(x, weight, scale, offsets, bias, block, act_quant, act_peak,
                                                    out_dtype, tracing)
        if launch.fallback is not None:
            return ref_grouped.fp8_grouped_linear(x, weight, scale, offsets, bias, block, act_quant, act_peak,
                                                  out_dtype)
        if launch.kernel is None:
            return x.new_empty(launch.out_shape, dtype=out_dtype)
        return grouped(nki_fp8_grouped_linear, launch)

    def fp4_grouped_linear(x, weight, scale, offsets, bias, act_quant, act_peak, out_dtype, tracing=False):
        launch = grouped_launch.prepare_fp4_grouped(x, weight, scale, offsets, bias, act_quant, act_peak, out_dtype,
                                                    tracing)
        if launch.fallback is not None:
            return ref_grouped.fp4_grouped_linear(x, weight, scale, offsets, bias, act_quant, act_peak, out_dtype)
        if launch.kernel is None:
            return x.new_empty(launch.out_shape, dtype=out_dtype)
        return grouped(nki_fp4_grouped_linear, launch)

    from .. import attention as public_attention
    from .. import grouped as public_grouped

    impls = {"paged_kv_write": (public_attention._paged_kv_write, paged_kv_write),
             "paged_window_attention": (public_attention._paged_window_attention, paged_window_attention),
             "fp8_grouped_linear": (public_grouped._fp8_grouped_linear, fp8_grouped_linear),
             "fp4_grouped_linear": (public_grouped._fp4_grouped_linear, fp4_grouped_linear)}
    # As register.py does: through the backend selector's registration where it exists.
    register_kernel = getattr(_backend, "register_fast_kernel", None)
    for name in PAGED_OPS:
        op, impl = impls[name]
        if register_kernel is not None:
            register_kernel(op, "neuron", impl)
        else:
            op.register_kernel("neuron")(impl)
        op.register_torch_dispatch(functional_mode, trace_on_neuron(impl))
