"""Bit-exact tests of torch_bq.formats (docs/contract.md §1-2): decoders, quantizers, packing, validation."""

import math

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from torch_bq import formats
from torch_bq.testing import fp4_weights, fp8_weights


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(u8(a), u8(b))


# --------------------------------------------------------------------------- #
# decoders
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("storage", [torch.uint8, torch.float8_e8m0fnu])
def test_every_e8m0_code(storage):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(storage)
    values = formats.decode_e8m0(codes)
    assert values.dtype == torch.float32
    for c in range(255):
        assert values[c].item() == math.ldexp(1.0, c - 127), c
    assert math.isnan(values[255].item())


def test_every_e4m3fn_byte_matches_torch_and_ml_dtypes():
    data = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(8, 32)
    one = torch.full((8, 1), 127, dtype=torch.uint8)  # scale 1.0
    got = formats.dequantize_fp8(data, one, (1, 32), torch.float32)
    by_torch = data.view(torch.float8_e4m3fn).to(torch.float32)
    by_ml = torch.from_numpy(data.numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float32))
    assert torch.equal(got.isnan(), by_ml.isnan())
    assert torch.equal(got.isnan().flatten().nonzero().flatten(), torch.tensor([0x7F, 0xFF]))
    finite = ~got.isnan()
    assert bits_equal(got[finite], by_torch[finite])
    assert bits_equal(got[finite], by_ml[finite])


def test_denormal_e4m3_codes_decode_exactly():
    codes = torch.arange(1, 8, dtype=torch.uint8)[None]
    one = torch.full((1, 1), 127, dtype=torch.uint8)
    got = formats.dequantize_fp8(codes, one, (1, 32), torch.bfloat16).to(torch.float32)
    assert torch.equal(got[0], torch.arange(1, 8, dtype=torch.float32) * 2.0**-9)


def test_every_fp4_nibble_and_nibble_order():
    nibbles = torch.arange(16, dtype=torch.uint8)[None]
    packed = formats.pack_fp4(nibbles)
    # element 2j in the low nibble of byte j
    assert packed.tolist() == [[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]]
    one = torch.full((1, 1), 127, dtype=torch.uint8)
    got = formats.dequantize_fp4(packed, one, 16, torch.float32)
    expected = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    assert bits_equal(got[0], torch.tensor(expected))
    assert torch.equal(formats.unpack_fp4(packed), nibbles)


def test_scale_is_multiplied():
    data = torch.tensor([[0x38]], dtype=torch.uint8)  # e4m3 1.0
    got = formats.dequantize_fp8(data, torch.tensor([[130]], dtype=torch.uint8), (32, 32), torch.float32)
    assert got.item() == 8.0
    got = formats.dequantize_fp8(data, torch.tensor([[0.375]]), (128, 128), torch.float32)
    assert got.item() == 0.375


@pytest.mark.parametrize("shape", [(1, 1), (33, 31), (5, 33), (3, 4095), (70, 129)])
@pytest.mark.parametrize("block", [(32, 32), (128, 128), (1, 32)])
def test_fp8_partial_blocks_follow_zero_padding(shape, block):
    torch.manual_seed(0)
    w = torch.randn(shape) * torch.logspace(-3, 3, shape[1])
    data, scale = formats.quantize_fp8(w, block)
    bn, bk = block
    padded = torch.nn.functional.pad(w, (0, -shape[1] % bk, 0, -shape[0] % bn))
    pdata, pscale = formats.quantize_fp8(padded, block)
    assert bits_equal(scale, pscale)
    assert bits_equal(data, pdata[: shape[0], : shape[1]])
    deq = formats.dequantize_fp8(data, scale, block, torch.float32)
    assert bits_equal(deq, formats.dequantize_fp8(pdata, pscale, block, torch.float32)[: shape[0], : shape[1]])


@pytest.mark.parametrize("k", [1, 31, 33, 63, 4095])
def test_fp4_odd_and_partial_k_follow_zero_padding(k):
    torch.manual_seed(1)
    w = torch.randn(3, k)
    packed, scale = formats.quantize_fp4(w)
    assert packed.shape == (3, -(-k // 2)) and scale.shape == (3, -(-k // 32))
    padded = torch.nn.functional.pad(w, (0, -k % 64))
    ppacked, pscale = formats.quantize_fp4(padded)
    assert bits_equal(scale, pscale[:, : scale.shape[1]])
    assert torch.equal(formats.unpack_fp4(packed, k), formats.unpack_fp4(ppacked, k))
    if k % 2:
        assert (packed[:, -1] >> 4).eq(0).all()  # padding nibble is zero
    deq = formats.dequantize_fp4(packed, scale, k, torch.float32)
    assert bits_equal(deq, formats.dequantize_fp4(ppacked, pscale, k + (-k % 64), torch.float32)[:, :k])


def test_storage_dtypes_are_interchangeable():
    torch.manual_seed(2)
    w = torch.randn(40, 70)
    data, scale = formats.quantize_fp8(w)
    ref = formats.dequantize_fp8(data, scale)
    assert bits_equal(formats.dequantize_fp8(u8(data), u8(scale)), ref)
    packed, s4 = formats.quantize_fp4(w)
    ref4 = formats.dequantize_fp4(packed, s4)
    assert bits_equal(formats.dequantize_fp4(packed.view(torch.float4_e2m1fn_x2), u8(s4)), ref4)
    assert bits_equal(formats.dequantize_fp4(packed.view(torch.int8), s4), ref4)


# --------------------------------------------------------------------------- #
# quantizers
# --------------------------------------------------------------------------- #


def test_fp8_zero_block_gets_scale_one():
    data, scale = formats.quantize_fp8(torch.zeros(40, 40))
    assert u8(scale).eq(127).all() and u8(data).eq(0).all()


@pytest.mark.parametrize("j", [-20, -1, 0, 3, 40])
def test_fp8_scale_at_power_of_two_boundary(j):
    amax = 448.0 * 2.0**j
    w = torch.zeros(1, 32)
    w[0, 5] = amax
    _, scale = formats.quantize_fp8(w, (1, 32))
    assert u8(scale).item() == 127 + j  # exactly 448 * 2**j: no bump
    w[0, 5] = float(np.nextafter(np.float32(amax), np.float32(np.inf)))
    data, scale = formats.quantize_fp8(w, (1, 32))
    assert u8(scale).item() == 128 + j  # one ulp above: next power of two, never saturates
    assert u8(data)[0, 5].item() == 0x76  # 224 = amax / 2**(j+1), rounded


def test_fp8_ties_round_to_even():
    w = torch.zeros(1, 32)
    w[0, 0] = 448.0  # scale 1.0
    # midpoints between consecutive e4m3 values: even mantissa wins
    w[0, 1:7] = torch.tensor([1.0625, 1.1875, 17.0, 19.0, 3 * 2.0**-10, 2.0**-10])
    data, _ = formats.quantize_fp8(w, (1, 32))
    got = data.to(torch.float32)[0, 1:7].tolist()
    assert got == [1.0, 1.25, 16.0, 20.0, 2.0**-8, 0.0]
    by_ml = w.numpy().astype(ml_dtypes.float8_e4m3fn)
    assert torch.equal(u8(data), torch.from_numpy(by_ml.view(np.uint8)))


def test_fp4_ties_round_to_even_code():
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    w = torch.zeros(1, 32)
    w[0, 0] = 6.0  # ceil rule: scale 1.0
    w[0, 1:8] = mids
    w[0, 8:15] = -mids
    packed, scale = formats.quantize_fp4(w)
    assert u8(scale).item() == 127
    got = formats.dequantize_fp4(packed, scale, 32, torch.float32)[0]
    expected = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0])
    assert torch.equal(got[1:8], expected)
    assert torch.equal(got[8:15], -expected)


def test_fp4_rounding_modes():
    w = torch.zeros(2, 32)
    w[0, 0], w[0, 1] = 7.0, 1.0
    w[1, 0] = 8.0
    packed, scale = formats.quantize_fp4(w, "floor")
    # floor: 2**(floor(log2 amax) - 2) -> amax 7 gives 1.0 (7 saturates to 6), amax 8 gives 2.0
    assert u8(scale)[:, 0].tolist() == [127, 128]
    got = formats.dequantize_fp4(packed, scale, 32, torch.float32)
    assert got[0, :2].tolist() == [6.0, 1.0] and got[1, 0].item() == 8.0
    packed, scale = formats.quantize_fp4(w, "ceil")
    # ceil: 2**ceil(log2(amax / 6)) -> 7/6 gives 2.0, never clips
    assert u8(scale)[:, 0].tolist() == [128, 128]
    got = formats.dequantize_fp4(packed, scale, 32, torch.float32)
    assert got[0, :2].tolist() == [8.0, 1.0]
    packed, scale = formats.quantize_fp4(torch.zeros(1, 5))
    assert u8(scale).item() == 127 and u8(packed).eq(0).all()


def test_fp8_float32_scales_match_e8m0():
    torch.manual_seed(3)
    w = torch.randn(130, 260)
    data, codes = formats.quantize_fp8(w, (128, 128))
    data32, scale32 = formats.quantize_fp8(w, (128, 128), torch.float32)
    assert bits_equal(data, data32)
    assert bits_equal(scale32, formats.decode_e8m0(codes))


@given(fp8_weights(scale_dtypes=(torch.float8_e8m0fnu, torch.uint8)))
def test_fp8_quantize_dequantize_identity(weight):
    values = weight.dequantize(torch.bfloat16)
    data, scale = formats.quantize_fp8(values, weight.block)
    assert bits_equal(formats.dequantize_fp8(data, scale, weight.block), values)
    # Quantizing twice is stable to the byte.
    again = formats.quantize_fp8(formats.dequantize_fp8(data, scale, weight.block), weight.block)
    assert bits_equal(again[0], data) and bits_equal(again[1], scale)


@given(fp4_weights(), st.sampled_from(["ceil", "floor"]))
def test_fp4_quantize_dequantize_identity(weight, rounding):
    values = weight.dequantize(torch.bfloat16)
    packed, scale = formats.quantize_fp4(values, rounding)
    assert bits_equal(formats.dequantize_fp4(packed, scale, weight.in_features), values)


# --------------------------------------------------------------------------- #
# validation errors
# --------------------------------------------------------------------------- #


def test_wrong_dtypes_are_named():
    with pytest.raises(TypeError, match=r"weight: expected dtype in .*got torch.float16"):
        formats.dequantize_fp8(torch.zeros(4, 4, dtype=torch.float16), torch.zeros(1, 1, dtype=torch.uint8))
    with pytest.raises(TypeError, match=r"weight_scale: expected dtype in .*got torch.int32"):
        formats.dequantize_fp8(torch.zeros(4, 4, dtype=torch.uint8), torch.zeros(1, 1, dtype=torch.int32))
    with pytest.raises(TypeError, match="weight: expected dtype in"):
        formats.dequantize_fp4(torch.zeros(4, 4, dtype=torch.float32), torch.zeros(4, 1, dtype=torch.uint8))
    with pytest.raises(TypeError, match="weight_scale"):
        formats.dequantize_fp4(torch.zeros(4, 4, dtype=torch.uint8), torch.zeros(4, 1))
    with pytest.raises(TypeError, match="w: expected a float"):
        formats.quantize_fp8(torch.zeros(4, 4, dtype=torch.int32))
    with pytest.raises(TypeError, match="scale_dtype"):
        formats.quantize_fp8(torch.zeros(4, 4), scale_dtype=torch.float16)
    with pytest.raises(TypeError, match="x: expected a floating-point dtype"):
        formats.qdq_fp8(torch.zeros(4, dtype=torch.int64))


def test_shape_mismatches_are_named():
    with pytest.raises(ValueError, match=r"weight_scale: expected shape \[2, 3\] .* block \[32, 32\], got \[2, 2\]"):
        formats.dequantize_fp8(torch.zeros(33, 65, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"weight_scale: expected shape \[4, 2\]"):
        formats.dequantize_fp4(torch.zeros(4, 20, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"weight: expected shape \[N, 3\]"):
        formats.dequantize_fp4(torch.zeros(4, 20, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.uint8), 5)
    with pytest.raises(ValueError, match="block: expected two positive ints"):
        formats.quantize_fp8(torch.zeros(4, 4), (0, 32))
    with pytest.raises(ValueError, match=r"w: expected a 2-D \[N, K\] tensor"):
        formats.quantize_fp4(torch.zeros(4))
    with pytest.raises(ValueError, match="rounding"):
        formats.quantize_fp4(torch.zeros(4, 4), "nearest")
    with pytest.raises(ValueError, match="peak"):
        formats.qdq_fp8(torch.zeros(4), 500.0)
    with pytest.raises(ValueError, match=r"x: expected shape \[\.\.\., K\]"):
        formats.qdq_fp8(torch.tensor(1.0))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("quantize", [formats.quantize_fp8, formats.quantize_fp4])
def test_quantizers_reject_non_finite_input(bad, quantize):
    w = torch.zeros(3, 40)
    w[2, 17] = bad
    with pytest.raises(ValueError, match=r"w: expected finite values, got .* at index \[2, 17\]"):
        quantize(w)


@pytest.mark.parametrize("quantize", [formats.quantize_fp8, formats.quantize_fp4])
def test_quantizers_reject_float64_beyond_float32_range(quantize):
    w = torch.zeros(2, 40, dtype=torch.float64)
    w[1, 3] = 1e39
    with pytest.raises(ValueError, match=r"w \(as float32; .*\): expected finite values, got inf at index \[1, 3\]"):
        quantize(w)


def test_qdq_checks_run_under_fake_tensors():
    with pytest.raises(ValueError, match="peak"):
        torch.ops.torch_bq.qdq_fp8(torch.zeros(2, 32, device="meta"), 500.0)
    with pytest.raises(ValueError, match="0-d"):
        torch.ops.torch_bq.qdq_fp8(torch.zeros((), device="meta"), 224.0)


def test_nan_codes_are_found_with_their_index():
    data = torch.zeros(4, 64, dtype=torch.uint8)
    scale = torch.full((1, 2), 127, dtype=torch.uint8)
    formats.find_nan_codes(data, scale)  # valid: no error
    data[2, 40] = 0xFF
    with pytest.raises(ValueError, match=r"weight: found NaN e4m3 code 0x7F/0xFF at index \[2, 40\]"):
        formats.find_nan_codes(data, scale)
    data[2, 40] = 0x7F
    with pytest.raises(ValueError, match=r"index \[2, 40\]"):
        formats.find_nan_codes(data, scale, name="model.layers.0.mlp.up_proj.weight")
    scale[0, 1] = 255
    with pytest.raises(ValueError, match=r"w_scale: found NaN e8m0 code 255 at index \[0, 1\]"):
        formats.find_nan_codes(data, scale.view(torch.float8_e8m0fnu), name="w")
    with pytest.raises(ValueError, match=r"weight_scale: found a non-finite or non-positive scale at index \[0, 0\]"):
        formats.find_nan_codes(None, torch.tensor([[float("nan")]]))
    # float32 multipliers must be positive too: a zero or negative scale is not a DeepSeek scale
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match=r"non-positive scale at index \[1, 0\]"):
            formats.find_nan_codes(None, torch.tensor([[1.0, 2.0], [bad, 1.0]]))
    packed = torch.zeros(2, 3, dtype=torch.uint8)
    packed[1, 2] = 0x10
    with pytest.raises(ValueError, match=r"non-zero padding nibble .* at index \[1, 2\]"):
        formats.find_nan_codes(packed, torch.full((2, 1), 127, dtype=torch.uint8), fmt="fp4", in_features=5)
