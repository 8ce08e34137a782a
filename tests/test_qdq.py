"""Bit-exact tests of the activation round trip (docs/contract.md §3)."""

import math

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from torch_bq import formats, ops
from torch_bq.testing import activations


def u8(t):
    return t.contiguous().view(torch.uint8)


def qdq_float64(x: torch.Tensor, peak: float) -> torch.Tensor:
    """docs/contract.md §3 written independently: numpy/ml_dtypes, row-major loops over blocks."""
    xb = x.to(torch.bfloat16).to(torch.float64).numpy().reshape(-1, x.shape[-1])
    out = np.zeros_like(xb)
    recip_peak = float(np.float32(1.0) / np.float32(peak))
    for r in range(xb.shape[0]):
        for k0 in range(0, xb.shape[1], 32):
            block = xb[r, k0 : k0 + 32]
            amax = max(float(np.abs(block).max()), float(np.float32(1e-4)))
            t = float(np.float32(amax) * np.float32(recip_peak))
            s = 2.0 ** math.ceil(math.log2(t)) if t > 0 else 1.0
            # log2 of a float near a power of two can be off by rounding; fix it exactly
            m, e = math.frexp(t)
            s = math.ldexp(1.0, e - 1) if m == 0.5 else math.ldexp(1.0, e)
            q = (block / s).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
            out[r, k0 : k0 + 32] = q * s
    return torch.from_numpy(out).to(torch.bfloat16).reshape(x.shape)


def test_matches_independent_implementation():
    torch.manual_seed(0)
    x = torch.randn(5, 100) * torch.logspace(-6, 6, 100)
    for peak in (224.0, 448.0):
        assert torch.equal(u8(formats.qdq_fp8(x, peak)), u8(qdq_float64(x, peak)))


@pytest.mark.parametrize("peak", [224.0, 448.0])
@pytest.mark.parametrize("j", [-10, -1, 0, 1, 7])
def test_power_of_two_boundary(peak, j):
    """amax = peak * 2**j exactly, and one bf16 ulp either side.

    At the boundary t = amax * fp32(1/peak) is exactly 2**j (fp32(1/peak) * peak
    rounds to 1.0 for these peaks), so s = 2**j; one ulp above gives s = 2**(j+1).
    The element 2**(j-9) shows which: it survives at s = 2**j (e4m3's smallest
    subnormal) and is a tie that rounds to 0 at s = 2**(j+1).
    """
    boundary = peak * 2.0**j
    below = float(torch.tensor(boundary).to(torch.bfloat16).nextafter(torch.tensor(0.0, dtype=torch.bfloat16)))
    above = float(torch.tensor(boundary).to(torch.bfloat16).nextafter(torch.tensor(1e30, dtype=torch.bfloat16)))
    for amax, scale in ((boundary, 2.0**j), (below, 2.0**j), (above, 2.0 ** (j + 1))):
        x = torch.zeros(1, 32)
        x[0, 3] = amax
        x[0, 5] = 2.0 ** (j - 9)
        got = formats.qdq_fp8(x, peak).to(torch.float32)
        expected = (torch.tensor(amax) / scale).to(torch.float8_e4m3fn).to(torch.float32) * scale
        assert got[0, 3].item() == expected.item(), (amax, scale)
        assert got[0, 5].item() == (2.0 ** (j - 9) if scale == 2.0**j else 0.0), (amax, scale)
        assert torch.equal(u8(formats.qdq_fp8(x, peak)), u8(qdq_float64(x, peak)))


def test_scale_uses_the_fp32_reciprocal_of_the_peak():
    # fp32(1/12) and fp32(1/41) are inexact, so the multiply rule and an exact division
    # can pick different scales; the independent implementation follows the multiply rule
    # for every amax and peak. (Peaks below formats.MIN_ACT_PEAK = 4 are refused.)
    torch.manual_seed(6)
    for peak in (12.0, 41.0, 224.0, 240.0, 448.0):
        x = torch.randn(4, 64) * torch.logspace(-8, 8, 64)
        x[0, :32] = 0
        x[0, 0] = peak
        assert torch.equal(u8(formats.qdq_fp8(x, peak)), u8(qdq_float64(x, peak)))


def test_zero_and_tiny_blocks_use_the_amax_floor():
    x = torch.zeros(2, 40)
    x[1, 35] = 1e-30
    got = formats.qdq_fp8(x)
    assert u8(got[0]).eq(0).all()
    # amax floored to 1e-4 -> s = 2**ceil(log2(1e-4 / 224)) = 2**-21; 1e-30 / s rounds to 0.
    assert got[1, 35].item() == 0.0
    # A block whose amax is below the floor but not negligible: 3e-9 / 2**-21 = 3.2 * 2**-9,
    # an e4m3 subnormal that rounds to 3 * 2**-9, so the result is 3 * 2**-30. Without the
    # floor (s = 2**-36) or with another one (1e-5: s = 2**-24) it would keep more bits.
    x = torch.zeros(1, 32)
    x[0, 7] = 3e-9
    assert formats.qdq_fp8(x)[0, 7].item() == 3 * 2.0**-30


@pytest.mark.parametrize("k", [1, 31, 33, 64, 95])
def test_partial_last_block_is_zero_padded(k):
    torch.manual_seed(k)
    x = torch.randn(3, k) * 10
    padded = torch.nn.functional.pad(x, (0, -k % 32))
    assert torch.equal(u8(formats.qdq_fp8(x)), u8(formats.qdq_fp8(padded)[:, :k]))


def test_leading_dims_and_empty():
    torch.manual_seed(4)
    x = torch.randn(2, 3, 70)
    assert torch.equal(u8(formats.qdq_fp8(x)), u8(formats.qdq_fp8(x.reshape(6, 70)).reshape(2, 3, 70)))
    assert formats.qdq_fp8(torch.zeros(0, 70)).shape == (0, 70)


def test_op_matches_function():
    torch.manual_seed(5)
    x = torch.randn(4, 96, dtype=torch.float16)
    assert torch.equal(u8(ops.qdq_fp8(x, 448.0)), u8(formats.qdq_fp8(x, 448.0)))


def _e4m3_half_ulp(v: torch.Tensor) -> torch.Tensor:
    """Half the e4m3 spacing at |v| (subnormal spacing 2**-9 below 2**-6)."""
    exponent = torch.floor(torch.log2(v.abs().clamp_min(2.0**-6)))
    return torch.exp2(exponent - 3) / 2


@given(st.integers(1, 100).flatmap(lambda k: activations(k)), st.sampled_from([224.0, 448.0]))
def test_properties(x, peak):
    y = formats.qdq_fp8(x, peak)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    # idempotent
    assert torch.equal(u8(formats.qdq_fp8(y, peak)), u8(y))
    # each element within half an e4m3 ulp (at its block scale) of bf16(x)
    k = x.shape[-1]
    xb = x.to(torch.bfloat16).to(torch.float64)
    blocks = torch.nn.functional.pad(xb, (0, -k % 32)).unflatten(-1, (-1, 32))
    amax = blocks.abs().amax(-1, keepdim=True).clamp_min(1e-4).to(torch.float32)
    t = (amax * torch.tensor(1 / peak, dtype=torch.float32)).to(torch.float64)
    mantissa, exponent = torch.frexp(t)
    s = torch.ldexp(torch.ones_like(t), exponent - (mantissa == 0.5).long())
    s = s.expand_as(blocks).flatten(-2)[..., :k]
    err = (y.to(torch.float64) - xb).abs()
    assert bool((err <= _e4m3_half_ulp(xb / s) * s * (1 + 2.0**-20)).all())
    # no element exceeds the peak at its scale
    assert bool(((y.to(torch.float64) / s).abs() <= peak).all())
