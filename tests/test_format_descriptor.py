"""The format descriptors and registry (torch_bq.formats.descriptor) and exact row joins (formats.rows)."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from torch_bq import formats
from torch_bq.testing import fp8_weights


# --------------------------------------------------------------------------- #
# registry and descriptors
# --------------------------------------------------------------------------- #


def test_names_and_aliases():
    assert formats.get_format("mxfp4") is formats.FP4 is formats.get_format("FP4")
    assert formats.get_format("mxfp8") is formats.MXFP8 and formats.MXFP8.family == "fp8"
    assert formats.format_names() == ("fp8", "mxfp8", "fp4", "nvfp4", "bf16", "fp32w")
    assert formats.format_names(quantized=False) == ("bf16", "fp32w")
    with pytest.raises(ValueError, match=r"format: expected one of .*'mxfp4'.*got 'int4'"):
        formats.get_format("int4")
    with pytest.raises(TypeError):
        formats.FORMATS["fp8"] = formats.FP4  # read-only
    names = [n for f in formats.FORMATS.values() for n in f.names]
    assert len(names) == len(set(names))  # one name, one format


def test_shapes_from_the_descriptors():
    assert formats.FP8.data_shape(70, 129) == (70, 129) and formats.FP8.scale_shape(70, 129) == (3, 5)
    assert formats.FP8.scale_shape(70, 129, (96, 96)) == (1, 2)
    assert formats.FP4.data_shape(3, 33) == (3, 17) and formats.FP4.scale_shape(3, 33) == (3, 2)
    assert formats.MXFP8.scale_shape(3, 33) == (3, 2)
    assert formats.BF16.scale_shape(3, 4) is None
    assert formats.cdiv(0, 4) == 0 and formats.cdiv(9, 4) == 3 and formats.cdiv(8, 4) == 2


def test_blocks():
    assert formats.FP8.resolve_block(None) == (32, 32) and formats.FP8.resolve_block([96, 48]) == (96, 48)
    with pytest.raises(ValueError, match="fixed 1x32 blocks"):
        formats.FP4.resolve_block((32, 32))
    for bad, err in (((0, 32), ValueError), ((32,), ValueError), ((32.5, 32), TypeError), ((True, 32), TypeError)):
        with pytest.raises(err, match="block: expected two positive ints"):
            formats.check_block(bad)
    assert formats.check_block((torch.tensor(4), 8)) == (4, 8)


def test_weight_spec_metadata_round_trip():
    for fmt, block, scale in (("fp8", (96, 96), torch.float8_e8m0fnu), ("fp8", (48, 32), torch.float32),
                              ("mxfp4", None, None), ("nvfp4", None, None), ("fp32w", None, None)):
        spec = formats.WeightSpec.of(fmt, block, scale)
        meta = spec.to_metadata()
        assert all(isinstance(v, str) for v in meta.values())
        assert formats.WeightSpec.from_metadata(meta) == spec
    assert formats.WeightSpec.of("fp8", (96, 96), torch.float32).to_metadata() == {
        "format": "fp8", "block": "96x96", "scale": "f32"}
    assert str(formats.FP8.spec((128, 128), "f32")) == "format=fp8, block=(128, 128), scale=f32"
    assert formats.WeightSpec.from_metadata({"format": "fp8", "block": [1, 32]}).block == (1, 32)
    with pytest.raises(ValueError, match="takes"):
        formats.WeightSpec.of("fp4", None, "f32")
    with pytest.raises(ValueError, match="BNxBK"):
        formats.WeightSpec.from_metadata({"format": "fp8", "block": "big"})


@pytest.mark.parametrize("fmt", [formats.FP8, formats.FP4])
def test_exact_codes_are_exactly_where_bf16_decoding_is_exact(fmt):
    # Brute force over every element code and every finite e8m0 code: the bf16 decode against the
    # exact value in float64; the derived range must be exactly the codes where all are exact.
    if fmt is formats.FP8:
        data = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        data = data[(data & 0x7F) != 0x7F][None].repeat(255, 1)
        elements = data.view(torch.float8_e4m3fn).double()
        via_bf16 = formats.dequantize_fp8(data, torch.arange(255, dtype=torch.int32).to(torch.uint8)[:, None],
                                          (1, data.shape[1]), torch.bfloat16)
    else:
        nibbles = torch.arange(16, dtype=torch.uint8)[None].repeat(255, 2)
        elements = formats.FP4_LUT[nibbles.long()].double()
        via_bf16 = formats.dequantize_fp4(formats.pack_fp4(nibbles),
                                          torch.arange(255, dtype=torch.int32).to(torch.uint8)[:, None], 32,
                                          torch.bfloat16)
    exact = elements * torch.exp2(torch.arange(255, dtype=torch.float64) - 127)[:, None]
    ok = [c for c in range(255) if torch.equal(via_bf16[c].double(), exact[c])]
    lo, hi = fmt.exact_codes
    assert ok == list(range(lo, hi + 1))


def test_find_nan_codes_by_format_name():
    fp8 = torch.zeros(2, 4, dtype=torch.uint8)
    fp8[1, 3] = 0x7F
    with pytest.raises(ValueError, match=r"found NaN e4m3 code 0x7F/0xFF at index \[1, 3\]"):
        formats.find_nan_codes(fp8, fmt="mxfp8")
    formats.find_nan_codes(fp8, fmt="fp4")  # any byte is a valid e2m1 pair
    with pytest.raises(ValueError, match="format: expected one of"):
        formats.find_nan_codes(fp8, fmt="int8")


# --------------------------------------------------------------------------- #
# exact row slicing and joining
# --------------------------------------------------------------------------- #


def _decode(fmt, piece, k=None):
    if fmt.family == "fp8":
        return formats.dequantize_fp8(piece.data, piece.scale, piece.block, torch.float32)
    if fmt is formats.FP4:
        return formats.dequantize_fp4(piece.data, piece.scale, k, torch.float32)
    return formats.dequantize_nvfp4(piece.data, piece.scale, piece.tensor_scale, k)


@given(weight=fp8_weights(max_n=120), data=st.data())
def test_any_row_cuts_join_back_exactly(weight, data):
    n = weight.data.shape[0]
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, n - 1)), max_size=3)) if n > 1 else []))
    bounds = [0, *cuts, n]
    pieces = [formats.slice_rows("fp8", weight.data, weight.scale, a, b, block=weight.block)
              for a, b in zip(bounds, bounds[1:])]
    # any subset in any order: the join decodes to exactly those rows
    order = data.draw(st.permutations(range(len(pieces))))
    chosen = order[: data.draw(st.integers(1, len(pieces)))]
    joined = formats.join_rows("fp8", [pieces[i] for i in chosen])
    full = weight.dequantize(torch.float32)
    expected = torch.cat([full[bounds[i]:bounds[i + 1]] for i in chosen])
    assert torch.equal(_decode(formats.FP8, joined).view(torch.int32), expected.view(torch.int32))
    assert weight.block[0] % joined.block[0] == 0 and joined.block[1] == weight.block[1]


def test_join_picks_the_coarsest_exact_block_and_mixed_scales():
    torch.manual_seed(0)
    a_data, a_scale = formats.quantize_fp8(torch.randn(64, 40), (32, 32))
    b_data, b_scale = formats.quantize_fp8(torch.randn(48, 40) * 100, (16, 8), torch.float32)
    a = formats.RowPiece(a_data, a_scale, (32, 32))
    b = formats.RowPiece(b_data.view(torch.uint8), b_scale, (16, 8))  # raw bytes join float8 data
    joined = formats.join_rows("fp8", [a, b])
    assert joined.block == (16, 8) and joined.scale.dtype == torch.float32  # e8m0 decodes exactly to f32
    expected = torch.cat([_decode(formats.FP8, a), _decode(formats.FP8, b)])
    assert torch.equal(_decode(formats.FP8, joined), expected)
    # 24 rows then more: 8-row blocks; an explicit finer block is allowed, a coarser one is refused
    c = formats.slice_rows("fp8", a_data, a_scale, 0, 24)
    assert formats.join_rows("fp8", [c, a]).block == (8, 32)
    assert formats.join_rows("fp8", [c, a], row_block=4, col_block=16).block == (4, 16)
    with pytest.raises(ValueError, match=r"row_block=16 must be a positive divisor of 8"):
        formats.join_rows("fp8", [c, a], row_block=16)


def test_join_per_row_formats_and_nvfp4_tensor_scales():
    torch.manual_seed(1)
    p1, s1 = formats.quantize_fp4(torch.randn(5, 33))
    p2, s2 = formats.quantize_fp4(torch.randn(7, 33))
    joined = formats.join_rows("mxfp4", [formats.RowPiece(p1, s1, None), formats.RowPiece(p2, s2, None)])
    assert joined.block == (1, 32) and torch.equal(joined.data, torch.cat([p1, p2]))
    shared = torch.tensor(0.01)
    n1 = formats.quantize_nvfp4(torch.randn(5, 33), shared)
    n2 = formats.quantize_nvfp4(torch.randn(7, 33), shared)
    pieces = [formats.RowPiece(w, s, None, tensor_scale=t) for w, s, t in (n1, n2)]
    joined = formats.join_rows("nvfp4", pieces)
    expected = torch.cat([formats.dequantize_nvfp4(*n, 33) for n in (n1, n2)])
    assert torch.equal(formats.dequantize_nvfp4(joined.data, joined.scale, joined.tensor_scale, 33), expected)
    own = formats.quantize_nvfp4(torch.randn(7, 33))  # its own weight_scale_2: no exact join exists
    with pytest.raises(ValueError, match="qkv_scale_2: piece 1 has per-tensor scale .* cannot be joined exactly"):
        formats.join_rows("nvfp4", [pieces[0], formats.RowPiece(own[0], own[1], None, tensor_scale=own[2])],
                          name="qkv")


def test_join_errors():
    d, s = formats.quantize_fp8(torch.randn(8, 16))
    with pytest.raises(ValueError, match="different column shapes"):
        formats.join_rows("fp8", [formats.RowPiece(d, s, (32, 32)), formats.RowPiece(d[:, :8], s, (32, 32))])
    with pytest.raises(ValueError, match="needs 1 scale rows"):
        formats.join_rows("fp8", [formats.RowPiece(d, torch.cat([s, s]), (32, 32))])
    with pytest.raises(ValueError, match="at least one piece"):
        formats.join_rows("fp8", [])
    with pytest.raises(TypeError, match=r"weight \(piece 0\): expected dtype in"):
        formats.join_rows("fp8", [formats.RowPiece(d.float(), s, (32, 32))])
