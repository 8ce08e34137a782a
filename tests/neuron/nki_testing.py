"""Helpers for the NKI kernel tests: launch a prepared call through ``nki.simulate``, compare with a bound."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

from torch_bq import formats

_UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}
_SMALLEST = {torch.bfloat16: 2.0**-133, torch.float16: 2.0**-24, torch.float32: 2.0**-149}


def to_numpy(t):
    """torch -> NumPy with the same bytes (bf16 through ml_dtypes)."""
    if t is None:
        return None
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def to_torch(a: np.ndarray) -> torch.Tensor:
    a = np.ascontiguousarray(a)
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def launch(kernel, launch_args, lnc: int = 1) -> torch.Tensor:
    """Run a :class:`torch_bq.ops.nki.launch.KernelLaunch` through ``nki.simulate``, LNC ``lnc``."""
    import nki

    assert launch_args.kernel is not None and launch_args.fallback is None
    target = kernel if lnc == 1 else kernel[lnc]
    out = nki.simulate(target)(*[to_numpy(t) for t in launch_args.tensors], **launch_args.options)
    y = to_torch(np.asarray(out))
    assert y.dtype == launch_args.out_dtype, (y.dtype, launch_args.out_dtype)
    return y.reshape(launch_args.out_shape)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def assert_linear_close(actual, reference, a, w, bias, out_dtype):
    """``actual`` equals ``reference`` up to fp32 summation order plus one rounding each.

    Both compute ``sum_k a[m,k] w[n,k]`` with exact products (bf16 x bf16 fits fp32)
    and fp32 sums in some order, so each is within ``gamma_K * S`` of the exact sum,
    ``S = sum_k |a w| (+ |bias|)``, ``gamma_K = K u / (1 - K u)``, ``u = 2**-24``
    (Higham, Thm 3.1). Each then rounds once to ``out_dtype``, with relative error at
    most its unit roundoff ``u_out`` (``2**-8`` bf16, ``2**-11`` fp16, ``2**-24`` fp32).
    Hence ``|actual - reference| <= 2 gamma_K S + 2 u_out (|reference| + 2 gamma_K S) + tiny``,
    ``tiny`` twice the dtype's smallest subnormal (underflow).
    """
    k = a.shape[-1]
    u = 2.0**-24
    gamma = k * u / (1 - k * u)
    s = a.abs().double() @ w.abs().double().T
    if bias is not None:
        s = s + bias.abs().double()
    eps = _UNIT_ROUNDOFF[out_dtype]
    ref64 = reference.double()
    bound = 2 * gamma * s + 2 * eps * (ref64.abs() + 2 * gamma * s) + 2 * _SMALLEST[out_dtype]
    err = (actual.double() - ref64).abs()
    assert actual.shape == reference.shape and actual.dtype == reference.dtype
    assert torch.isfinite(actual).all(), "kernel produced non-finite values"
    worst = int(torch.argmax(err - bound))
    idx = np.unravel_index(worst, err.shape)
    assert bool((err <= bound).all()), (
        f"worst element {tuple(int(i) for i in idx)}: |{actual[idx].item()} - {reference[idx].item()}| = "
        f"{err[idx].item():.3e} > bound {bound[idx].item():.3e} (K={k})"
    )


def activation(x, act_quant, peak=formats.DEFAULT_ACT_PEAK):
    """``A`` of docs/contract.md §4 for a 2-D view of ``x``, as float32."""
    x2 = x.reshape(-1, x.shape[-1])
    return (formats.qdq_fp8(x2, peak) if act_quant else x2.to(torch.bfloat16)).float()
