"""NVFP4 (docs/formats.md): bit-exact decoding against hand-written tables, the quantizer,
validation, the ``torch_bq::nvfp4_linear`` op (the reference and the fast CPU kernel of
torch_bq/ops/cpu/nvfp4.cpp at every ISA level this CPU has) and ``NVFP4Linear``."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from torch import nn

from torch_bq import formats, ops, reference
from torch_bq.nn import NVFP4Linear
from torch_bq.ops import _backend
from torch_bq.ops.cpu import linear as fast
from torch_bq.testing import activations, assert_linear_close, nvfp4_weights

# The fast kernels of each ISA level, run with that level selected (fails, never falls back, when it did not build).
from test_cpu_kernels import HAS_COMPILER, LEVELS, at_level  # noqa: E402


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32),
                                                                    b.contiguous().view(torch.int32))


def e4m3_bytes(*values: int) -> torch.Tensor:
    return torch.tensor([values], dtype=torch.uint8).view(torch.float8_e4m3fn)


NIBBLES = torch.arange(16, dtype=torch.uint8)[None]  # one row, every nibble; K = 16 is one block


# --------------------------------------------------------------------------- #
# decoding: hand-written tables (values worked out by hand / exact rationals)
# --------------------------------------------------------------------------- #


def test_every_nibble_times_a_fractional_block_scale():
    # weight_scale byte 0x31 = 2**-1 * 1.125 = 0.5625; weight_scale_2 = 2.0: value = e2m1 * 1.125.
    got = formats.dequantize_nvfp4(formats.pack_fp4(NIBBLES), e4m3_bytes(0x31), torch.tensor(2.0))
    expected = [0.0, 0.5625, 1.125, 1.6875, 2.25, 3.375, 4.5, 6.75,
                -0.0, -0.5625, -1.125, -1.6875, -2.25, -3.375, -4.5, -6.75]
    assert bits_equal(got[0], torch.tensor(expected))  # -0.0 keeps its sign


def test_second_product_is_rounded_once_to_float32():
    # 0x7E = 448; weight_scale_2 = fp32(0.1) = 13421773 * 2**-27. Each value is the exact
    # rational e2m1 * 448 * 13421773 / 2**27 rounded once to float32 (e.g. 6 * 448 * s2 =
    # 268.8000040054... -> 268.8000183105469, the nearer of its two float32 neighbours).
    got = formats.dequantize_nvfp4(formats.pack_fp4(NIBBLES), e4m3_bytes(0x7E), torch.tensor(0.1))
    positive = [0.0, 22.399999618530273, 44.79999923706055, 67.20000457763672, 89.5999984741211,
                134.40000915527344, 179.1999969482422, 268.8000183105469]
    expected = positive + [-v for v in positive]
    assert bits_equal(got[0], torch.tensor(expected))


def test_subnormal_scales_and_float32_subnormal_results_are_exact():
    # 0x01 is the smallest e4m3 (2**-9); 0.5 * 2**-9 * 2**-120 = 2**-130 is a float32 subnormal.
    got = formats.dequantize_nvfp4(formats.pack_fp4(NIBBLES), e4m3_bytes(0x01), torch.tensor(2.0**-120))
    assert got[0, 1].item() == 2.0**-130 and got[0, 7].item() == 6 * 2.0**-129
    assert got[0, 15].item() == -6 * 2.0**-129


def test_blocks_of_sixteen_odd_k_and_storage_aliases():
    # K = 17: elements 0..15 use scale 0, element 16 uses scale 1; the 9th byte's high nibble is padding.
    nibbles = torch.tensor([[2] * 16 + [7]], dtype=torch.uint8)  # 1.0 x 16, then 6.0
    packed = formats.pack_fp4(nibbles)
    assert packed.shape == (1, 9) and packed[0, 8].item() == 0x07
    scale = torch.tensor([[0x40, 0x30]], dtype=torch.uint8)  # 2.0 and 0.5, as raw bytes
    for data in (packed, packed.view(torch.int8), packed.view(torch.float4_e2m1fn_x2)):
        got = formats.dequantize_nvfp4(data, scale, torch.tensor([3.0]), in_features=17)
        assert got.tolist() == [[6.0] * 16 + [9.0]]
    assert formats.dequantize_nvfp4(packed, scale, torch.tensor(3.0), 17, torch.bfloat16).dtype == torch.bfloat16


def test_decoder_matches_an_independent_float64_decode():
    g = torch.Generator().manual_seed(1)
    nib = torch.randint(0, 16, (7, 50), generator=g).to(torch.uint8)
    scale = torch.randint(1, 0x7F, (7, 4), generator=g).to(torch.uint8)
    s2 = torch.tensor(0.0123)
    got = formats.dequantize_nvfp4(formats.pack_fp4(nib), scale, s2, 50)
    lut = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    e4m3 = {b: torch.tensor([b], dtype=torch.uint8).view(torch.float8_e4m3fn).double().item() for b in range(1, 0x7F)}
    for n in range(7):
        for k in range(50):
            v = nib[n, k].item()
            value = (-1 if v & 8 else 1) * lut[v & 7] * e4m3[scale[n, k // 16].item()] * s2.double().item()
            assert got[n, k].item() == torch.tensor(value, dtype=torch.float64).float().item(), (n, k)


# --------------------------------------------------------------------------- #
# validation
# --------------------------------------------------------------------------- #


def test_descriptor_shapes_and_checks():
    fmt = formats.get_format("NVFP4")
    assert fmt is formats.NVFP4 and fmt.data_shape(5, 33) == (5, 17) and fmt.scale_shape(5, 33) == (5, 3)
    packed = torch.zeros(5, 17, dtype=torch.uint8)
    scale = torch.ones(5, 3).to(torch.float8_e4m3fn)
    assert formats.check_nvfp4_weight(packed, scale, torch.tensor(1.0), 33) == 33
    with pytest.raises(ValueError, match=r"weight_scale: expected shape \[5, 3\]"):
        formats.check_nvfp4_weight(packed, scale[:, :2], torch.tensor(1.0), 33)
    with pytest.raises(TypeError, match=r"weight_scale: expected dtype in \(torch.float8_e4m3fn, torch.uint8\)"):
        formats.check_nvfp4_weight(packed, scale.float(), torch.tensor(1.0), 33)
    with pytest.raises(TypeError, match=r"weight_scale_2: expected dtype"):
        formats.check_nvfp4_weight(packed, scale, torch.tensor(1.0, dtype=torch.float64), 33)
    with pytest.raises(ValueError, match=r"weight_scale_2: expected a scalar"):
        formats.check_nvfp4_weight(packed, scale, torch.ones(2), 33)
    with pytest.raises(ValueError, match=r"weight: expected shape \[N, 16\]"):
        formats.check_nvfp4_weight(packed, scale, torch.tensor(1.0), 31)
    with pytest.raises(ValueError, match="fixed 1x16 blocks"):
        fmt.resolve_block((1, 32))


@pytest.mark.parametrize("byte, what", [(0x7F, "NaN"), (0xFF, "NaN"), (0x00, "zero"), (0xB8, "negative"),
                                        (0x80, "negative")])
def test_corrupt_block_scales_are_found(byte, what):
    scale = torch.full((3, 2), 0x38, dtype=torch.uint8)
    scale[2, 1] = byte
    with pytest.raises(ValueError, match=r"weight_scale: found a zero, negative or NaN e4m3 scale at index \[2, 1\]"):
        formats.find_nan_codes(None, scale.view(torch.float8_e4m3fn), fmt="nvfp4")
    with pytest.raises(ValueError, match=r"index \[2, 1\]"):
        NVFP4Linear.from_quantized(torch.zeros(3, 16, dtype=torch.uint8), scale, torch.tensor(1.0))


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_corrupt_tensor_scale_is_found(bad):
    with pytest.raises(ValueError, match="weight_scale_2: found a non-finite or non-positive per-tensor scale"):
        NVFP4Linear.from_quantized(torch.zeros(3, 16, dtype=torch.uint8), torch.ones(3, 2).to(torch.float8_e4m3fn),
                                   torch.tensor(bad))


def test_padding_nibble_must_be_zero():
    packed = torch.zeros(2, 3, dtype=torch.uint8)
    packed[1, 2] = 0x10
    with pytest.raises(ValueError, match=r"non-zero padding nibble .* at index \[1, 2\]"):
        NVFP4Linear.from_quantized(packed, torch.ones(2, 1).to(torch.float8_e4m3fn), torch.tensor(1.0), in_features=5)


# --------------------------------------------------------------------------- #
# the quantizer
# --------------------------------------------------------------------------- #


def test_quantizer_follows_the_stated_rule():
    torch.manual_seed(0)
    w = torch.randn(6, 40) * 3
    w[2, 16:32] = 0.0  # an all-zero block
    packed, scale, s2 = formats.quantize_nvfp4(w)
    assert packed.dtype == torch.uint8 and packed.shape == (6, 20)
    assert scale.dtype == torch.float8_e4m3fn and scale.shape == (6, 3)
    assert s2.dtype == torch.float32 and s2.shape == ()
    assert s2.item() == (w.abs().amax() / torch.tensor(2688.0)).item()
    b = scale.view(torch.uint8)
    assert bool(((b >= 0x01) & (b <= 0x7E)).all())  # positive finite
    assert b[2, 1].item() == 0x38  # the zero block's scale is 1.0
    amax = torch.nn.functional.pad(w, (0, 8)).unflatten(1, (3, 16)).abs().amax(2)
    wanted = ((amax / torch.tensor(6.0)) / s2).clamp(2.0**-9, 448.0).to(torch.float8_e4m3fn)
    nonzero = amax > 0
    assert torch.equal(b[nonzero], wanted.view(torch.uint8)[nonzero])
    # elements: nearest e2m1 of w / fp32(s * s2), so the error is at most half a step of the grid
    deq = formats.dequantize_nvfp4(packed, scale, s2, 40)
    step = (scale.float() * s2).repeat_interleave(16, 1)[:, :40]
    assert bool(((deq - w).abs() <= step * 1.0 + 1e-30).all())  # e2m1 spacing is at most 2 steps


def test_quantizer_ties_go_to_the_even_code_and_representable_weights_round_trip():
    # One block with amax 6 and s2 chosen so that s = 1 exactly: w / (1 * s2) are the values themselves.
    s2 = torch.tensor(1.0)
    w = torch.tensor([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, 1.0, 1.5, 2.0, 3.0, 4.0, 0.5, 0.0]])
    packed, scale, out_s2 = formats.quantize_nvfp4(w, weight_scale_2=s2)
    assert scale.view(torch.uint8).item() == 0x38 and out_s2.item() == 1.0
    # midpoints: 0.25->0 (code 0), 0.75->1.0 (code 2), 1.25->1.0, 1.75->2.0, 2.5->2.0, 3.5->4.0, 5.0->4.0
    assert formats.unpack_fp4(packed, 16).tolist() == [[0, 2, 2, 4, 4, 6, 6, 7, 8, 2, 3, 4, 5, 6, 1, 0]]
    exact = torch.tensor([[6.0, -4.0, 3.0, 0.5, -0.0, 1.5, 2.0, 1.0, 6.0, 6.0, -6.0, 4.0, 0.5, 0.5, 1.0, 2.0]])
    p2, s_2, t2 = formats.quantize_nvfp4(exact, weight_scale_2=s2)
    assert bits_equal(formats.dequantize_nvfp4(p2, s_2, t2, 16), exact)


def test_quantizer_rejects_bad_input():
    with pytest.raises(ValueError, match=r"w: expected finite values, got nan at index \[0, 1\]"):
        formats.quantize_nvfp4(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="weight_scale_2: expected a positive finite value"):
        formats.quantize_nvfp4(torch.ones(2, 16), weight_scale_2=torch.tensor(0.0))
    z, s, s2 = formats.quantize_nvfp4(torch.zeros(2, 16))
    assert s2.item() == 1.0 and not bool(z.any())


# --------------------------------------------------------------------------- #
# the op
# --------------------------------------------------------------------------- #

# "op" dispatches (the fast kernel at the best level, where it built); each level runs its own kernels.
IMPLS = {
    "reference": reference.nvfp4_linear,
    "op": torch.ops.torch_bq.nvfp4_linear,
    **{level: at_level(level, fast.nvfp4_linear) for level in LEVELS},
}


def operand(x, act_quant):
    return formats.qdq_fp8(x, 224.0) if act_quant else x.to(torch.bfloat16)


@pytest.mark.parametrize("impl", list(IMPLS))
@given(weight=nvfp4_weights(), act_quant=st.booleans(), with_bias=st.booleans(),
       out_dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.float16]), data=st.data())
def test_nvfp4_linear_matches_float64(impl, weight, act_quant, with_bias, out_dtype, data):
    """Row counts on both sides of the fast kernel's decode / prefill boundary (``decode_max_m``)."""
    n = weight.packed.shape[0]
    x = data.draw(activations(weight.in_features, max_rows=24, max_exponent=4))
    bias = torch.randn(n) if with_bias else None
    y = IMPLS[impl](x, weight.packed, weight.scale, weight.scale_2, bias, act_quant, 224.0, out_dtype)
    assert y.dtype == out_dtype and y.shape == (x.shape[0], n)
    # W is the float32 decode (exact), not a bf16 rounding of it
    assert_linear_close(y, operand(x, act_quant), weight.dequantize(torch.float32), bias)


def test_a_bf16_rounded_weight_would_fail_the_bound():
    # The bound is tight enough to tell the float32 weight from its bf16 rounding.
    torch.manual_seed(3)
    w = torch.randn(32, 256)
    packed, scale, s2 = formats.quantize_nvfp4(w, weight_scale_2=torch.tensor(0.0123))
    x = torch.randn(4, 256)
    w32 = formats.dequantize_nvfp4(packed, scale, s2)
    wrong = torch.nn.functional.linear(x.to(torch.bfloat16).float(), w32.to(torch.bfloat16).float())
    with pytest.raises(AssertionError, match="exceed the derived bound"):
        assert_linear_close(wrong, x.to(torch.bfloat16), w32)
    assert_linear_close(ops.nvfp4_linear(x, packed, scale, s2, out_dtype=torch.float32), x.to(torch.bfloat16), w32)


def test_opcheck_and_leading_dims():
    torch.manual_seed(0)
    packed, scale, s2 = formats.quantize_nvfp4(torch.randn(24, 37))
    bias = torch.randn(24, dtype=torch.bfloat16)
    # opcheck's test_schema compares inputs with ops float8 lacks on CPU: the full list runs on the
    # (equally valid) uint8 bytes of the scales, the float8 storage on the other checks.
    for x, b, aq in ((torch.randn(2, 3, 37), bias, False), (torch.randn(0, 37), None, True),
                     (torch.randn(5, 37, dtype=torch.bfloat16), None, True)):
        args = (x, packed, scale.view(torch.uint8), s2, b, aq, 224.0, torch.bfloat16)
        torch.library.opcheck(torch.ops.torch_bq.nvfp4_linear, args)
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    args = (torch.randn(3, 37), packed.view(torch.float4_e2m1fn_x2), scale, s2.reshape(1), None, False, 224.0,
            torch.float32)
    torch.library.opcheck(torch.ops.torch_bq.nvfp4_linear, args, test_utils=utils)
    y = ops.nvfp4_linear(torch.randn(2, 3, 37), packed, scale, s2, bias)
    assert y.shape == (2, 3, 24) and y.dtype == torch.bfloat16


def test_op_argument_errors_also_under_fake_tensors():
    packed = torch.zeros(4, 8, dtype=torch.uint8)
    scale = torch.ones(4, 1).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"x: expected shape \[\.\.\., 16\]|weight: expected shape \[N, 9\]"):
        ops.nvfp4_linear(torch.zeros(2, 17), packed, scale, torch.tensor(1.0))
    with pytest.raises(TypeError, match="weight_scale_2"):
        ops.nvfp4_linear(torch.zeros(2, 16, device="meta"), packed.to("meta"), scale.to("meta"),
                         torch.tensor(1.0, dtype=torch.float64, device="meta"))


def test_input_gradient():
    torch.manual_seed(0)
    packed, scale, s2 = formats.quantize_nvfp4(torch.randn(12, 40))
    # float64 x and grad: the input gradient is the exact linear map grad @ W (straight-through
    # the activation rounding), accumulated in float64
    x = torch.randn(3, 40, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(12, dtype=torch.float64, requires_grad=True)
    y = ops.nvfp4_linear(x, packed, scale, s2, bias, out_dtype=torch.float32)
    g = torch.randn(3, 12, dtype=torch.float64)
    grad_x, grad_b = torch.autograd.grad(y, (x, bias), g.float())
    w = formats.dequantize_nvfp4(packed, scale, s2).double()
    torch.testing.assert_close(grad_x, g.float().double() @ w, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad_b, g.float().sum(0).double(), rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- #
# the fast CPU kernel (torch_bq/ops/cpu/nvfp4.cpp) against the reference, every level
# --------------------------------------------------------------------------- #

TWINS = ["reference", *LEVELS]
twins = pytest.mark.parametrize("impl", TWINS)
ROW_COUNTS = [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 23, 24, 25, 33, 40, 64, 65]


@pytest.fixture(params=["decode", "prefill", "auto"])
def path(request, monkeypatch):
    """Every M on the decode path, every M on the prefill path, or the boundary left to decode_max_m."""
    if request.node.callspec.params.get("impl") == "reference" and request.param != "auto":
        pytest.skip("the reference has no decode / prefill paths")
    if request.param == "decode":
        monkeypatch.setattr(fast, "decode_max_m", lambda kernels, fmt, k: 1 << 30)
    elif request.param == "prefill":
        monkeypatch.setattr(fast, "decode_max_m", lambda kernels, fmt, k: 0)
    return request.param


@twins
# K: whole 16-blocks, one block, a partial last block, odd K (a padding nibble), K < 16, K = 1.
@pytest.mark.parametrize("k", [128, 16, 97, 130, 15, 1])
def test_fast_every_row_count(impl, path, k):
    torch.manual_seed(k)
    n = 21  # odd: not a multiple of the 4- or 2-row tiles or the 16-row tasks
    packed, scale, s2 = formats.quantize_nvfp4(torch.randn(n, k))
    w = formats.dequantize_nvfp4(packed, scale, s2, k)
    x = torch.randn(max(ROW_COUNTS), k) * 4.0
    for m in ROW_COUNTS:
        for act_quant in (True, False):
            y = IMPLS[impl](x[:m], packed, scale, s2, None, act_quant, 224.0, torch.float32)
            assert_linear_close(y, operand(x[:m], act_quant), w, msg=f"{path} M={m} act_quant={act_quant}")


@twins
@pytest.mark.parametrize("rows", [(0,), (1,), (3,), (2, 9), (40,)], ids=str)
def test_fast_bias_out_dtypes_and_activation_dtypes(impl, rows):
    torch.manual_seed(len(rows) + rows[0])
    n, k = 37, 70
    packed, scale, s2 = formats.quantize_nvfp4(torch.randn(n, k) * 3.0)
    w = formats.dequantize_nvfp4(packed, scale, s2, k)
    x = torch.randn(*rows, k)
    cases = [(x, None, False, torch.bfloat16), (x.to(torch.bfloat16), torch.randn(n, dtype=torch.float16), True,
             torch.float32), (x.to(torch.float16), torch.randn(n, dtype=torch.bfloat16), False, torch.float16),
             (x.double(), torch.randn(n, dtype=torch.float64), True, torch.float32)]
    for xi, bias, act_quant, out_dtype in cases:
        y = IMPLS[impl](xi, packed.view(torch.int8), scale, s2.reshape(1), bias, act_quant, 448.0, out_dtype)
        assert y.dtype == out_dtype and y.shape == (*rows, n)
        a = formats.qdq_fp8(xi, 448.0) if act_quant else xi.to(torch.bfloat16)
        assert_linear_close(y, a, w, bias, msg=f"{xi.dtype} act_quant={act_quant} {out_dtype}")


EXTREME_CODES = (0x01, 0x02, 0x07, 0x08, 0x09, 0x7E, 0x77, 0x38, 0x06, 0x7D)
SUBNORMAL_CODES = (0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x01, 0x07, 0x03)


def extreme_weight(s2: float, n: int = 10, k: int = 160, codes=EXTREME_CODES) -> tuple:
    """Every nibble against every extreme e4m3 scale byte (default: the subnormals 0x01..0x07, the
    smallest normals, 0x7E = 448, the top of a binade); blocks of one row mix them."""
    codes = torch.tensor(codes, dtype=torch.uint8)
    scale = torch.stack([codes.roll(i) for i in range(n)])
    g = torch.Generator().manual_seed(n)
    nibbles = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32).to(torch.uint8)
    nibbles[:, :16] = torch.arange(16, dtype=torch.uint8)  # every nibble at every code (the roll)
    return formats.pack_fp4(nibbles), scale.view(torch.float8_e4m3fn), torch.tensor(s2, dtype=torch.float32)


@twins
@pytest.mark.parametrize("m", [1, 3, 5, 40])
@pytest.mark.parametrize("codes, s2", [
    (EXTREME_CODES, 2.0**-120), (EXTREME_CODES, 0.1 * 2.0**-118), (EXTREME_CODES, 1.0), (EXTREME_CODES, 0.0123),
    (SUBNORMAL_CODES, 0.1 * 2.0**-135), (SUBNORMAL_CODES, 2.0**-140),
], ids=["2^-120", "0.1x2^-118", "1", "0.0123", "subnormal codes, 0.1x2^-135", "subnormal codes, 2^-140"])
def test_fast_subnormal_scales_and_float32_subnormal_weights(impl, m, codes, s2, path):
    """e4m3 subnormal block scales, and per-tensor scales that make fp32(e2m1 * e4m3) * s2 an fp32
    subnormal. With only subnormal block scales and s2 of 0.1 x 2**-135 (itself an fp32 subnormal) or
    2**-140, every weight is at most about 2**6 quanta of 2**-149, so the reference's rounding of
    each one to that grid changes it by up to a third: a kernel that formed the weights otherwise
    (s2 factored out of the sum, a bf16 rounding, a flushed subnormal) misses the bound. Activations
    near 2**100 keep every product a normal float."""
    packed, scale, s2_t = extreme_weight(s2, codes=codes)
    w = formats.dequantize_nvfp4(packed, scale, s2_t)
    if s2 < 1e-30:
        assert bool(((w != 0) & (w.abs() < torch.finfo(torch.float32).tiny)).any())  # there are subnormal weights
    torch.manual_seed(m)
    x = torch.randn(m, w.shape[1]) * (2.0**100 if s2 < 1e-30 else 1.0)
    y = IMPLS[impl](x, packed, scale, s2_t, None, False, 224.0, torch.float32)
    assert_linear_close(y, x.to(torch.bfloat16), w)


@twins
@pytest.mark.parametrize("m", [1, 3, 4, 33])
@pytest.mark.parametrize("exponent", [-110, -125, -131])
def test_fast_tiny_activations(impl, m, exponent, path):
    """bf16 activations near and below the normal range (subnormal at 2**-131) against large
    weights: fp32 FMAs keep them (a kernel built on vdpbf16ps would read them as zero)."""
    torch.manual_seed(-exponent)
    x = (torch.randn(m, 96) * 2.0**exponent).to(torch.bfloat16)
    packed, scale, s2 = formats.quantize_nvfp4(torch.randn(20, 96) * 2.0**40)
    y = IMPLS[impl](x, packed, scale, s2, None, False, 224.0, torch.float32)
    assert_linear_close(y, x, formats.dequantize_nvfp4(packed, scale, s2))


@twins
@pytest.mark.parametrize("m", [1, 4, 40])
def test_fast_weights_that_overflow_to_inf(impl, m, path):
    """With s2 = 2**120, 2 x 448 x s2 rounds to inf (as the reference decodes it), 0.5 x 448 x s2 stays
    finite. With positive activations, weight row 0 (infs of both signs) gives NaN, row 1 (non-negative
    nibbles) +inf, rows 5-9 (scale 1.0: finite weights) finite values: whatever the summation order."""
    packed, scale, s2 = extreme_weight(2.0**120)
    k = 160
    nibbles = formats.unpack_fp4(packed, k)
    nibbles[1] &= 7
    packed = formats.pack_fp4(nibbles)
    scale = scale.view(torch.uint8).clone()
    scale[5:] = 0x38
    w = formats.dequantize_nvfp4(packed, scale, s2)
    assert bool(torch.isinf(w[:5]).any()) and bool(torch.isfinite(w[5:]).all())
    torch.manual_seed(m)
    x = torch.randn(m, k).abs() * 2.0**-100
    got = IMPLS[impl](x, packed, scale, s2, None, False, 224.0, torch.float32)
    assert bool(torch.isnan(got[:, 0]).all()) and bool((got[:, 1] == torch.inf).all())
    want = reference.nvfp4_linear(x, packed, scale, s2, None, False, 224.0, torch.float32)
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.equal(torch.isinf(got), torch.isinf(want))
    inf = torch.isinf(want)
    assert torch.equal(got[inf], want[inf])
    assert_linear_close(got[:, 5:], x.to(torch.bfloat16), w[5:])


@pytest.mark.skipif(not HAS_COMPILER, reason="needs the compiled kernels")
@pytest.mark.parametrize("level", LEVELS)
def test_fast_decode_kernels_boundary_and_prefill_gemm_per_level(level):
    """AVX-512 levels run 16-lane decode tiles, avx2 8-lane ones, generic scalar ones; the boundary
    follows them. The prefill path runs kernels.cpp's fp32 microkernel (at::mm panels on generic),
    never the bf16 one: an NVFP4 weight is not exact in bf16."""
    kernels = _backend.cpu_kernels(level)
    assert kernels is not None, f"{level} did not load"
    isa = kernels.nvfp4_decode_isa()
    assert isa == {"generic": "generic", "avx2": "avx2", "avx512": "avx512", "avx512_bf16": "avx512"}[level]
    assert fast.decode_max_m(kernels, "nvfp4", 4096) == fast.NVFP4_DECODE_MAX_M[isa]
    torch.manual_seed(2)
    packed, scale, s2 = formats.quantize_nvfp4(torch.randn(130, 96), weight_scale_2=torch.tensor(1.0))  # bf16-exact
    x = torch.randn(fast.NVFP4_DECODE_MAX_M[isa] + 1, 96)
    before = torch.tensor(kernels.prefill_counts())
    y = IMPLS[level](x, packed, scale, s2, None, False, 224.0, torch.float32)
    grown = torch.tensor(kernels.prefill_counts()) - before
    expected = 2 if level == "generic" else 1  # [bf16 tiles, fp32 tiles, at::mm panels]
    assert grown[expected] > 0 and grown.sum() == grown[expected], grown
    assert_linear_close(y, x.to(torch.bfloat16), formats.dequantize_nvfp4(packed, scale, s2))


@pytest.mark.parametrize("impl", LEVELS)
@pytest.mark.parametrize("m", [1, 5, 40])
def test_fast_threads_and_determinism(impl, m):
    """Decode rows are each summed by one task in a fixed order: the same bits at 1 and 2 threads."""
    torch.manual_seed(m)
    n, k = 300, 520
    packed, scale, s2 = formats.quantize_nvfp4(torch.randn(n, k))
    x = torch.randn(m, k)
    before = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            y = IMPLS[impl](x, packed, scale, s2, None, True, 224.0, torch.float32)
            assert torch.equal(y, IMPLS[impl](x, packed, scale, s2, None, True, 224.0, torch.float32))
            assert_linear_close(y, operand(x, True), formats.dequantize_nvfp4(packed, scale, s2))
            results.append(y)
    finally:
        torch.set_num_threads(before)
    if m <= fast.decode_max_m(_backend.cpu_kernels(impl), "nvfp4", k):
        assert torch.equal(results[0].view(torch.int32), results[1].view(torch.int32))


@pytest.mark.skipif(not HAS_COMPILER, reason="needs the compiled kernels")
def test_op_dispatches_to_the_fast_kernel_and_set_kernel_enabled_switches_it_off(monkeypatch):
    torch.manual_seed(0)
    packed, scale, s2 = formats.quantize_nvfp4(torch.randn(40, 64))
    x = torch.randn(3, 64)
    kernels, calls = _backend.cpu_kernels(), []
    monkeypatch.setattr(_backend, "cpu_kernels", lambda: calls.append(1) or kernels)
    y = ops.nvfp4_linear(x, packed, scale, s2)
    assert len(calls) == 1
    with ops.fast_kernels_disabled("cpu"):
        y_ref = ops.nvfp4_linear(x, packed, scale, s2)
    assert len(calls) == 1  # the reference body ran
    assert torch.equal(y_ref, reference.nvfp4_linear(x, packed, scale, s2, None, False, 224.0, torch.bfloat16))
    assert_linear_close(y, x.to(torch.bfloat16), formats.dequantize_nvfp4(packed, scale, s2))
    ops.nvfp4_linear(x, packed, scale, s2)
    assert len(calls) == 2


@pytest.mark.skipif(not HAS_COMPILER, reason="needs the compiled kernels")
@pytest.mark.parametrize("level", LEVELS)
def test_opcheck_runs_the_fast_kernel_of_each_level(level):
    """opcheck (schema, fake tensors, autograd registration, AOT dispatch) with the op dispatching to
    the fast kernel of ``level``, on both sides of its decode / prefill boundary."""
    torch.manual_seed(1)
    packed, scale, s2 = formats.quantize_nvfp4(torch.randn(20, 45))
    previous = _backend.set_cpu_isa_cap(level)
    try:
        kernels = _backend.cpu_selection().ops
        assert _backend.cpu_selection().isa == level and kernels is not None
        limit = fast.decode_max_m(kernels, "nvfp4", 45)
        for m, act_quant in ((1, False), (limit + 1, True)):
            x = torch.randn(m, 45, dtype=torch.bfloat16)
            torch.library.opcheck(torch.ops.torch_bq.nvfp4_linear,
                                  (x, packed, scale.view(torch.uint8), s2, None, act_quant, 224.0, torch.float32))
    finally:
        _backend.set_cpu_isa_cap(previous)


def test_fast_kernel_raises_the_reference_errors():
    packed, scale, s2 = formats.quantize_nvfp4(torch.randn(8, 40))
    with pytest.raises(ValueError, match=r"weight: expected shape \[N, 21\]"):
        fast.nvfp4_linear(torch.randn(2, 41), packed, scale, s2, None, False, 224.0, torch.bfloat16)
    with pytest.raises(TypeError, match="weight_scale_2"):
        fast.nvfp4_linear(torch.randn(2, 40), packed, scale, s2.double(), None, False, 224.0, torch.bfloat16)
    with pytest.raises(ValueError, match=r"bias: expected shape \[8\]"):
        fast.nvfp4_linear(torch.randn(2, 40), packed, scale, s2, torch.zeros(9), False, 224.0, torch.bfloat16)


# --------------------------------------------------------------------------- #
# the module
# --------------------------------------------------------------------------- #


def _linear(k, n, bias=True):
    torch.manual_seed(0)
    return nn.Linear(k, n, bias=bias)


def test_module_from_linear_forward_and_repr():
    lin = _linear(40, 24)
    m = NVFP4Linear.from_linear(lin)
    assert m.extra_repr() == "in_features=40, out_features=24, bias=True, format=nvfp4, block=(1, 16), act_quant=off"
    x = torch.randn(5, 40)
    y = m(x)
    assert y.dtype == torch.float32
    assert_linear_close(y, x.to(torch.bfloat16), m.dequantize().weight, m.bias)
    m8 = NVFP4Linear.from_linear(lin, act_quant=True)
    assert_linear_close(m8(x), formats.qdq_fp8(x), m8.dequantize().weight, m8.bias)


def test_module_state_dict_round_trip_and_input_scale(tmp_path):
    m = NVFP4Linear.from_linear(_linear(33, 20))
    assert set(m.state_dict()) == {"weight", "weight_scale", "weight_scale_2", "bias"}
    save_file(m.state_dict(), tmp_path / "m.safetensors")
    state = load_file(tmp_path / "m.safetensors")
    state["input_scale"] = torch.tensor(0.02)  # ModelOpt writes it; validated, then ignored
    fresh = NVFP4Linear(33, 20, bias=True)
    fresh.load_state_dict(state)
    for k, v in m.state_dict().items():
        assert torch.equal(fresh.state_dict()[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), k
    x = torch.randn(3, 33)
    assert torch.equal(fresh(x), m(x))
    state["input_scale"] = torch.tensor(-1.0)
    with pytest.raises(RuntimeError, match="input_scale: expected a positive finite scale"):
        NVFP4Linear(33, 20, bias=True).load_state_dict(state)
    state["input_scale"] = torch.tensor(1.0)
    state["weight_scale_2"] = torch.tensor([float("nan")])  # [1]-shaped, as some exporters write it
    with pytest.raises(RuntimeError, match="weight_scale_2: found a non-finite"):
        NVFP4Linear(33, 20, bias=True).load_state_dict(state)


def test_module_casts_and_meta():
    m = NVFP4Linear.from_linear(_linear(32, 16))
    m2 = nn.Sequential(m).to(torch.bfloat16)[0]
    assert m2.weight_scale_2.dtype == torch.float32 and m2.weight_scale.dtype == torch.float8_e4m3fn
    assert m2.bias.dtype == torch.bfloat16
    skeleton = NVFP4Linear(32, 16, bias=True, device="meta")
    skeleton.load_state_dict(m.state_dict(), assign=True)
    x = torch.randn(2, 32)
    assert torch.equal(skeleton(x), m(x))


@pytest.mark.slow
def test_module_compiles_fullgraph():
    torch._dynamo.reset()
    m = NVFP4Linear.from_linear(_linear(48, 24), act_quant=True)
    compiled = torch.compile(m, fullgraph=True, dynamic=True)
    for batch in (2, 5):
        x = torch.randn(batch, 48, dtype=torch.bfloat16)
        assert torch.equal(compiled(x), m(x))


def test_exact_codes_and_dtype():
    assert formats.NVFP4.exact_codes is None and formats.NVFP4.exact_dtype == torch.float32
    assert formats.FP8.exact_codes == (3, 246) and formats.FP4.exact_codes == (0, 252)
    # the bf16 range edges the codes stand for (contract §1: e4m3 subnormal x 2**-127 underflows)
    assert math.ldexp(1, 3 - 127 - 9) == 2.0**-133


def test_tensor_parallel_shards_of_an_nvfp4_layer_decode_exactly():
    # Shards cut anywhere (not on 16-column groups, odd widths): each decodes to exactly its part
    # of the full weight; the per-tensor scale is shared, so row pieces join by concatenation.
    from torch_bq.distributed.sharding import column_shard, row_shard

    m = NVFP4Linear.from_linear(_linear(71, 45), act_quant=True)
    full = m.dequantize().weight.detach()
    for ranges in ([(0, 20)], [(7, 30)], [(0, 5), (30, 45)]):
        shard = column_shard(m, ranges)
        assert isinstance(shard, NVFP4Linear) and shard.act_quant
        expected = torch.cat([full[a:b] for a, b in ranges])
        assert bits_equal(shard.dequantize().weight.detach(), expected)
        assert torch.equal(shard.bias, torch.cat([m.bias[a:b] for a, b in ranges]))
    for k0, k1 in ((0, 16), (5, 37), (33, 71)):
        rs = row_shard(m, k0, k1)
        w = rs.module.dequantize().weight.detach()
        assert w.shape == (45, rs.lead + k1 - k0) and rs.lead == k0 % 16
        assert not bool(w[:, : rs.lead].any()) and bits_equal(w[:, rs.lead:].contiguous(), full[:, k0:k1].contiguous())
