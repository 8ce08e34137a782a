"""The NKI kernels, run through ``nki.simulate`` (stand-in or real SDK), against the CPU reference.

qdq is compared bit for bit; GEMMs within the bound derived in
``nki_testing.assert_linear_close``. Default shapes cover every M in
{1, 7, 128, 300}, K in {64, 2048, 6144} and N in {32, 320, 4096} at least once
while staying small; the large products are marked slow.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nki_testing import activation, assert_linear_close, bits, launch
from torch_bq import formats
from torch_bq.ops.nki import launch as prep
from torch_bq.reference import linear as ref

# (M, K, N): each value of the grid appears at least once.
DEFAULT_SHAPES = [(1, 6144, 32), (7, 2048, 320), (128, 64, 4096), (300, 64, 320)]
SLOW_SHAPES = [(300, 6144, 4096), (128, 2048, 4096), (7, 6144, 4096)]


def _inputs(m, k, n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 2.0
    w = torch.randn(n, k, generator=g) * 0.05
    bias = torch.randn(n, generator=g)
    return x, w, bias


# --------------------------------------------------------------------------- #
# qdq: bit-exact
# --------------------------------------------------------------------------- #


def _qdq(kernels, x, peak=224.0, lnc=1):
    return launch(kernels.qdq.qdq_fp8_kernel, prep.prepare_qdq_fp8(x, peak), lnc)


@pytest.mark.parametrize("m,k", [(1, 64), (7, 2048), (128, 64), (300, 2048), (7, 6144)])
@pytest.mark.parametrize("lnc", [1, 2])
def test_qdq_bit_exact(kernels, m, k, lnc):
    g = torch.Generator().manual_seed(m * 7 + k)
    # Per-row magnitudes over ~40 binades so blocks get very different scales.
    x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-20, 20, (m, 1), generator=g).float())
    assert torch.equal(bits(_qdq(kernels, x, lnc=lnc)), bits(formats.qdq_fp8(x)))


@pytest.mark.parametrize("peak", [224.0, 240.0, 100.0])
def test_qdq_power_of_two_boundary(kernels, peak):
    # amax = peak * 2**j exactly, and one fp32 ulp either side: the ceil flips here,
    # decided by multiplying with fp32(1/peak) rather than dividing.
    rows = []
    for j in (-10, 0, 3):
        amax = torch.tensor(peak * 2.0**j, dtype=torch.float32)
        for v in (torch.nextafter(amax, torch.tensor(0.0)), amax, torch.nextafter(amax, torch.tensor(1e30))):
            row = torch.linspace(-1, 1, 64) * v
            row[5] = -v
            rows.append(row)
    x = torch.stack(rows).bfloat16()
    assert torch.equal(bits(_qdq(kernels, x, peak)), bits(formats.qdq_fp8(x, peak)))


def test_qdq_edge_values(kernels):
    x = torch.zeros(4, 96)
    x[1, :32] = 1e-6  # below the 1e-4 amax floor
    x[1, 32:64] = -0.0
    x[2, :] = torch.tensor(2.0**-133)  # bf16 denormal input
    x[3, :32] = 3.0e38  # near bf16 max
    x[3, 32:64] = torch.linspace(-5, 5, 32) * 2.0**-30  # values rounding to e4m3 subnormals
    assert torch.equal(bits(_qdq(kernels, x)), bits(formats.qdq_fp8(x)))


@given(
    m=st.integers(1, 140),
    nb=st.integers(1, 20),
    shift=st.integers(-60, 60),
    seed=st.integers(0, 2**16),
)
def test_qdq_bit_exact_property(kernels, m, nb, shift, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, 32 * nb, generator=g) * torch.exp2(
        torch.randint(-8, 8, (m, nb), generator=g).float().repeat_interleave(32, 1) + shift
    )
    assert torch.equal(bits(_qdq(kernels, x)), bits(formats.qdq_fp8(x)))


# --------------------------------------------------------------------------- #
# GEMMs: within the derived bound of the reference
# --------------------------------------------------------------------------- #


def _check_fp8(kernels, m, k, n, lnc, act_quant=True, with_bias=True, out_dtype=torch.bfloat16, seed=0,
               block=(32, 32)):
    x, w, bias = _inputs(m, k, n, seed)
    bias = bias if with_bias else None
    data, scale = formats.quantize_fp8(w, block=block)
    args = (x, data, scale, bias, block, act_quant, 224.0, out_dtype)
    y = launch(kernels.linear.fp8_linear_kernel, prep.prepare_fp8_linear(*args), lnc)
    w_bf16 = formats.dequantize_fp8(data, scale, block, torch.float32)
    assert_linear_close(y, ref.fp8_linear(*args), activation(x, act_quant), w_bf16, bias, out_dtype)
    return y


def _check_fp4(kernels, m, k, n, lnc, act_quant=True, with_bias=True, out_dtype=torch.bfloat16, seed=0):
    x, w, bias = _inputs(m, k, n, seed)
    bias = bias if with_bias else None
    packed, scale = formats.quantize_fp4(w)
    args = (x, packed, scale, bias, act_quant, 224.0, out_dtype)
    y = launch(kernels.linear.fp4_linear_kernel, prep.prepare_fp4_linear(*args), lnc)
    w_dec = formats.dequantize_fp4(packed, scale, k, torch.float32)
    assert_linear_close(y, ref.fp4_linear(*args), activation(x, act_quant), w_dec, bias, out_dtype)
    return y


def _check_dense(kernels, m, k, n, lnc, weight_dtype, with_bias=True, out_dtype=torch.bfloat16, seed=0):
    x, w, bias = _inputs(m, k, n, seed)
    bias = bias if with_bias else None
    w = w.to(weight_dtype)
    if weight_dtype == torch.bfloat16:
        kernel, reference = kernels.linear.bf16_linear_kernel, ref.bf16_linear
    else:
        kernel, reference = kernels.linear.fp32w_linear_kernel, ref.fp32w_linear
    y = launch(kernel, prep.prepare_dense_linear(x, w, bias, out_dtype, weight_dtype), lnc)
    w_bf16 = w.to(torch.bfloat16).float()
    assert_linear_close(y, reference(x, w, bias, out_dtype), activation(x, False), w_bf16, bias, out_dtype)
    return y


_VARIANTS = {
    "fp8": lambda kn, m, k, n, lnc, **kw: _check_fp8(kn, m, k, n, lnc, **kw),
    "fp8_noqdq": lambda kn, m, k, n, lnc, **kw: _check_fp8(kn, m, k, n, lnc, act_quant=False, **kw),
    "fp4": lambda kn, m, k, n, lnc, **kw: _check_fp4(kn, m, k, n, lnc, **kw),
    "bf16": lambda kn, m, k, n, lnc, **kw: _check_dense(kn, m, k, n, lnc, torch.bfloat16, **kw),
    "fp32w": lambda kn, m, k, n, lnc, **kw: _check_dense(kn, m, k, n, lnc, torch.float32, **kw),
}


@pytest.mark.parametrize("variant", list(_VARIANTS))
@pytest.mark.parametrize("m,k,n", DEFAULT_SHAPES)
def test_linear_matches_reference(kernels, variant, m, k, n):
    _VARIANTS[variant](kernels, m, k, n, 1)


@pytest.mark.parametrize(
    "variant,m,k,n", [(v, 7, 2048, 320) for v in _VARIANTS] + [("fp8", 300, 64, 320), ("fp4", 1, 64, 32)]
)
def test_linear_lnc2_matches_lnc1_bit_for_bit(kernels, variant, m, k, n):
    # Splitting N between cores must not change any element's arithmetic.
    y1 = _VARIANTS[variant](kernels, m, k, n, 1)
    y2 = _VARIANTS[variant](kernels, m, k, n, 2)
    assert torch.equal(bits(y1), bits(y2))


@pytest.mark.parametrize("variant", list(_VARIANTS))
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_linear_out_dtype_without_bias(kernels, variant, out_dtype):
    _VARIANTS[variant](kernels, 33, 128, 96, 2, with_bias=False, out_dtype=out_dtype, seed=3)


@settings(max_examples=12)  # each example is a kernel run; shapes vary more than values
@given(
    variant=st.sampled_from(list(_VARIANTS)),
    m=st.integers(1, 200),
    k64=st.integers(1, 6),
    n=st.integers(1, 300),
    lnc=st.sampled_from([1, 2]),
    with_bias=st.booleans(),
)
def test_linear_property_any_m_n(kernels, variant, m, k64, n, lnc, with_bias):
    # Any M and N (partial M tiles, partial 32-row scale blocks, a core with an empty span).
    _VARIANTS[variant](kernels, m, 64 * k64, n, lnc, with_bias=with_bias, seed=m + n)


@pytest.mark.parametrize("block", [(1, 32), (128, 128), (64, 64), (256, 512), (8, 256)])
def test_fp8_other_e8m0_blocks(kernels, block):
    # MXFP8 (1x32) and other e8m0 block shapes; N = 200 leaves a partial block row.
    _check_fp8(kernels, 5, 1024, 200, 2, block=block)


def test_linear_partial_scale_block_rows(kernels):
    # N = 77: the last 32x32 scale row covers 13 rows; LNC2 splits N at 128.
    _check_fp8(kernels, 9, 96, 77, 2)
    _check_fp8(kernels, 9, 96, 200, 2)


@pytest.mark.slow
@pytest.mark.parametrize(
    "variant,m,k,n,lnc",
    [("fp8", *SLOW_SHAPES[0], 2), ("fp4", *SLOW_SHAPES[1], 1), ("fp8_noqdq", *SLOW_SHAPES[2], 1),
     ("bf16", *SLOW_SHAPES[1], 2), ("fp32w", *SLOW_SHAPES[2], 2)],
)
def test_linear_large_shapes(kernels, variant, m, k, n, lnc):
    _VARIANTS[variant](kernels, m, k, n, lnc)


# --------------------------------------------------------------------------- #
# exact weight decode: one product per output element
# --------------------------------------------------------------------------- #


def _identity_rows(k):
    return torch.eye(k, dtype=torch.bfloat16)  # y[m, n] = W[n, m]: a single exact product


def test_fp8_decode_every_byte_and_scale_extremes_exactly(kernels):
    k, n = 64, 64
    codes = torch.arange(256, dtype=torch.int32).repeat(16).reshape(n, k)
    codes[(codes & 0x7F) == 0x7F] = 0x3C  # NaN codes are corruption, not weights
    data = codes.to(torch.uint8)
    # 3 and 134 are the ends of the exact range: 134 is the largest code the bf16 factor
    # (c + 120) << 7 can carry, below 3 the e4m3 subnormals underflow bf16.
    scale = torch.tensor([[3, 127], [134, 120]], dtype=torch.uint8)
    x = _identity_rows(k)
    args = (x, data, scale, None, (32, 32), False, 224.0, torch.float32)
    y = launch(kernels.linear.fp8_linear_kernel, prep.prepare_fp8_linear(*args))
    assert torch.equal(y, formats.dequantize_fp8(data, scale, (32, 32), torch.float32).T)


def test_fp4_decode_every_nibble_and_scale_extremes_exactly(kernels):
    k, n = 64, 16
    nibbles = torch.arange(16, dtype=torch.uint8).repeat(n * k // 16).reshape(n, k)
    packed = formats.pack_fp4(nibbles)
    # 27 and 160 are the ends of the exact range of the split 2**(c-33) x 2**32 factor.
    scale = torch.tensor([[27, 160]] * 8 + [[127, 100]] * 8, dtype=torch.uint8)
    x = _identity_rows(k)
    args = (x, packed, scale, None, False, 224.0, torch.float32)
    y = launch(kernels.linear.fp4_linear_kernel, prep.prepare_fp4_linear(*args))
    assert torch.equal(y, formats.dequantize_fp4(packed, scale, k, torch.float32).T)


# --------------------------------------------------------------------------- #
# refusals before launch
# --------------------------------------------------------------------------- #


def test_peak_448_refused_before_launch_and_by_the_kernel(kernels):
    x, w, _ = _inputs(4, 64, 32, 0)
    data, scale = formats.quantize_fp8(w)
    with pytest.raises(ValueError, match=r"act_peak.*240.*448"):
        prep.prepare_fp8_linear(x, data, scale, None, (32, 32), True, 448.0, torch.bfloat16)
    packed, s4 = formats.quantize_fp4(w)
    with pytest.raises(ValueError, match=r"act_peak.*240"):
        prep.prepare_fp4_linear(x, packed, s4, None, True, 448.0, torch.bfloat16)
    with pytest.raises(ValueError, match=r"act_peak.*240"):
        prep.prepare_qdq_fp8(x, 448.0)
    # Without act_quant the peak is unused, so nothing to refuse.
    assert prep.prepare_fp8_linear(x, data, scale, None, (32, 32), False, 448.0, torch.bfloat16).kernel
    # The kernel refuses on its own too, for callers that bypass the preparation.
    ok = prep.prepare_fp8_linear(x, data, scale, None, (32, 32), True, 224.0, torch.bfloat16)
    ok.options["act_peak"] = 448.0
    with pytest.raises(Exception, match="240"):
        launch(kernels.linear.fp8_linear_kernel, ok)


@pytest.mark.parametrize("k", [48, 33, 16])
def test_fp8_and_dense_k_not_multiple_of_32_refused(k):
    x = torch.randn(3, k)
    w = torch.randn(32, k)
    data, scale = formats.quantize_fp8(w)
    with pytest.raises(ValueError, match=rf"multiple of 32.*K={k}"):
        prep.prepare_fp8_linear(x, data, scale, None, (32, 32), True, 224.0, torch.bfloat16)
    with pytest.raises(ValueError, match=rf"bf16_linear.*multiple of 32.*K={k}"):
        prep.prepare_dense_linear(x, w.bfloat16(), None, torch.bfloat16, torch.bfloat16)
    with pytest.raises(ValueError, match=rf"fp32w_linear.*multiple of 32.*K={k}"):
        prep.prepare_dense_linear(x, w, None, torch.bfloat16, torch.float32)


@pytest.mark.parametrize("k", [32, 96, 65])
def test_fp4_k_not_multiple_of_64_refused(k):
    x = torch.randn(3, k)
    packed, scale = formats.quantize_fp4(torch.randn(32, k))
    with pytest.raises(ValueError, match=rf"fp4_linear.*multiple of 64.*K={k}"):
        prep.prepare_fp4_linear(x, packed, scale, None, True, 224.0, torch.bfloat16)


def test_k_above_staging_limit_refused():
    k = prep.MAX_K + 32
    with pytest.raises(ValueError, match=str(prep.MAX_K)):
        prep.prepare_dense_linear(torch.randn(1, k), torch.randn(2, k), None, torch.bfloat16, torch.float32)


@pytest.mark.parametrize(
    "block,scale_dtype,k",
    [((128, 128), torch.float32, 256), ((128, 128), torch.float8_e8m0fnu, 320), ((48, 32), torch.uint8, 256),
     ((32, 96), torch.uint8, 288)],
)
def test_other_fp8_layouts_fall_back_to_the_reference(block, scale_dtype, k):
    # float32 (DeepSeek) scales need not be powers of two; other shapes do not tile.
    x = torch.randn(2, k)
    data, scale = formats.quantize_fp8(torch.randn(128, k), block=block, scale_dtype=scale_dtype)
    launch_args = prep.prepare_fp8_linear(x, data, scale, None, block, True, 224.0, torch.bfloat16)
    assert launch_args.kernel is None and str(block) in launch_args.fallback


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_scale_codes_the_kernel_cannot_decode_exactly_fall_back(fmt):
    # Legal weights (docs/contract.md §1) whose bf16 decode factor would leave bf16's range:
    # the reference must serve them rather than the kernel returning NaN or 0.
    k = 64
    x = torch.randn(2, k)
    lo, hi = prep.FP8_EXACT_CODES if fmt == "fp8" else prep.FP4_EXACT_CODES
    for code, served_by_kernel in ((lo, True), (hi, True), (lo - 1, False), (hi + 1, False)):
        if fmt == "fp8":
            data, scale = formats.quantize_fp8(torch.randn(32, k))
            scale = formats.as_e8m0_codes(scale).clone()
            scale[0, 1] = code
            args = prep.prepare_fp8_linear(x, data, scale, None, (32, 32), True, 224.0, torch.bfloat16)
        else:
            packed, scale = formats.quantize_fp4(torch.randn(32, k))
            scale = formats.as_e8m0_codes(scale).clone()
            scale[3, 1] = code
            args = prep.prepare_fp4_linear(x, packed, scale, None, True, 224.0, torch.bfloat16)
        if served_by_kernel:
            assert args.fallback is None and args.kernel is not None, code
        else:
            assert args.kernel is None and f"outside {lo}..{hi}" in args.fallback, code


def test_empty_inputs_launch_nothing():
    w = torch.randn(32, 64)
    data, scale = formats.quantize_fp8(w)
    launch_args = prep.prepare_fp8_linear(torch.randn(0, 64), data, scale, None, (32, 32), True, 224.0,
                                          torch.bfloat16)
    assert launch_args.kernel is None and launch_args.out_shape == (0, 32)


def test_leading_dims_and_input_dtype_are_flattened_like_the_op(kernels):
    x = torch.randn(2, 3, 64, dtype=torch.float16)
    w = torch.randn(40, 64)
    data, scale = formats.quantize_fp8(w)
    args = (x, data, scale, None, (32, 32), True, 224.0, torch.bfloat16)
    y = launch(kernels.linear.fp8_linear_kernel, prep.prepare_fp8_linear(*args))
    assert y.shape == (2, 3, 40)
    w_dec = formats.dequantize_fp8(data, scale, (32, 32), torch.float32)
    assert_linear_close(y.reshape(6, 40), ref.fp8_linear(*args).reshape(6, 40), activation(x, True), w_dec,
                        None, torch.bfloat16)


# --------------------------------------------------------------------------- #
# budgets (the stand-in's bookkeeping) match the kernel docstrings
# --------------------------------------------------------------------------- #

_DOCUMENTED_SBUF_BOUND = 80 * 1024  # linear.py's budget table: <= ~80 KiB a partition


def test_sbuf_peak_within_documented_budget(kernels, shim_only):
    # 300 rows = a group of 3 staged M tiles at K = 6144 (12 KiB each).
    _check_fp8(kernels, 300, 6144, 32, 1)
    assert 36 * 1024 < shim_only.last_launch.sbuf_peak <= _DOCUMENTED_SBUF_BOUND


@pytest.mark.slow
def test_sbuf_peak_at_max_k_within_documented_budget(kernels, shim_only):
    # K = MAX_K: one 64 KiB staged tile per group, two groups in sequence.
    _check_dense(kernels, 130, prep.MAX_K, 32, 1, torch.bfloat16)
    assert 64 * 1024 < shim_only.last_launch.sbuf_peak <= _DOCUMENTED_SBUF_BOUND
