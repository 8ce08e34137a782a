"""The ops and modules under hostile arguments: named errors, never garbage (docs/reliability.md).

Each case here failed before its fix: weights left on ``meta`` returned
uninitialised memory, ``block=(1.5, 32)`` was truncated, ``K = 0`` raised a raw
reshape error, ``act_peak=1e-30`` gave zeros, ``scale=inf`` NaN attention, and
``paged_kv_write(validate=False)`` wrote half of a step before failing.
"""

import math
import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import event, given
from hypothesis import strategies as st

from torch_bq import formats, ops
from torch_bq.nn import BF16Linear, FP4Linear, FP8Linear, NVFP4Linear
from torch_bq.reference import linear as ref
from torch_bq.testing import assert_linear_close

IMPLS = ["fast", "reference"]


@pytest.fixture(params=IMPLS)
def impl(request):
    if request.param == "reference":
        with ops.fast_kernels_disabled("cpu"):  # the ops' reference bodies, through dispatch
            yield request.param
    else:
        yield request.param


def _fp8(n=16, k=64, block=(32, 32)):
    return formats.quantize_fp8(torch.randn(n, k), block)


def _fp4(n=16, k=64):
    return formats.quantize_fp4(torch.randn(n, k))


def _linear_calls(device_of):
    """Every linear op called with its tensors placed by ``device_of(name)``."""
    d = lambda name, t: t.to(device_of(name))  # noqa: E731
    x = torch.randn(3, 64)
    w8, s8 = _fp8()
    w4, s4 = _fp4()
    wn, sn, sn2 = formats.quantize_nvfp4(torch.randn(16, 64))
    wb = torch.randn(16, 64)
    bias = torch.randn(16)
    off = torch.tensor([1, 3], dtype=torch.int32)
    return {
        "fp8_linear": lambda: ops.fp8_linear(d("x", x), d("weight", w8), d("scale", s8), d("bias", bias)),
        "fp4_linear": lambda: ops.fp4_linear(d("x", x), d("weight", w4), d("scale", s4), d("bias", bias)),
        "nvfp4_linear": lambda: ops.nvfp4_linear(d("x", x), d("weight", wn), d("scale", sn), d("scale_2", sn2),
                                                 d("bias", bias)),
        "bf16_linear": lambda: ops.bf16_linear(d("x", x), d("weight", wb.bfloat16()), d("bias", bias)),
        "fp32w_linear": lambda: ops.fp32w_linear(d("x", x), d("weight", wb), d("bias", bias)),
        "fp8_grouped_linear": lambda: ops.fp8_grouped_linear(
            d("x", x), d("weight", torch.stack([w8, w8])), d("scale", torch.stack([s8, s8])), d("offsets", off), None),
        "fp4_grouped_linear": lambda: ops.fp4_grouped_linear(
            d("x", x), d("weight", torch.stack([w4, w4])), d("scale", torch.stack([s4, s4])), d("offsets", off), None),
    }


# --------------------------------------------------------------------------- #
# weights left on meta (finding 7)
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("op", list(_linear_calls(lambda n: "cpu")))
def test_meta_weight_with_real_input_is_refused(op, impl):
    call = _linear_calls(lambda name: "meta" if name == "weight" else "cpu")[op]
    with pytest.raises(ValueError, match=r"weight: is on the meta device .* while x is on cpu"):
        call()
    # all on meta is shape propagation and still works
    assert _linear_calls(lambda name: "meta")[op]().device.type == "meta"


@pytest.mark.parametrize("cls", [FP8Linear, FP4Linear, NVFP4Linear, BF16Linear])
def test_module_still_on_meta_is_refused(cls):
    # Before: returned uninitialised memory (values like 1e34).
    with torch.device("meta"):
        m = cls(64, 16, bias=True)
    with pytest.raises(ValueError, match="is on the meta device"):
        m(torch.randn(2, 64))


def test_meta_cache_is_refused():
    k = torch.randn(2, 2, 8)
    cache = torch.zeros(3, 4, 2, 8, device="meta")
    with pytest.raises(ValueError, match="k_cache: is on the meta device"):
        ops.paged_kv_write(k, k, cache, cache, torch.tensor([0, 1]), validate=False)


# --------------------------------------------------------------------------- #
# blocks, peaks, K = 0 (finding 9)
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("block, error, match", [
    ((1.5, 32), TypeError, r"block: expected two positive ints \(bn, bk\), got \(1.5, 32\)"),
    ((32.0, 32), TypeError, "block: expected two positive ints"),
    ((True, 32), TypeError, "block: expected two positive ints"),
    ((2**63, 32), ValueError, "at most 2147483647"),
    ((0, 32), ValueError, "block: expected two positive ints"),
    ((32,), ValueError, "block: expected two positive ints"),
])
def test_bad_blocks_are_named_errors(block, error, match):
    w, s = _fp8(block=(1, 32))
    with pytest.raises(error, match=match):
        ops.fp8_linear(torch.randn(2, 64), w, s, block=block)
    with pytest.raises(error, match=match):
        FP8Linear(64, 16, block=block)
    with pytest.raises(error, match=match):
        ops.fp8_grouped_linear(torch.randn(2, 64), w[None], s[None], torch.tensor([2], dtype=torch.int32), None,
                               block=block)


def _linear_k0(bias):
    x = torch.randn(3, 0)
    return x, {
        "fp8_linear": lambda: ops.fp8_linear(x, torch.zeros(5, 0, dtype=torch.float8_e4m3fn),
                                             torch.zeros(1, 0, dtype=torch.float8_e8m0fnu), bias),
        "fp8_linear act_quant=False": lambda: ops.fp8_linear(
            x, torch.zeros(5, 0, dtype=torch.float8_e4m3fn), torch.zeros(1, 0, dtype=torch.float8_e8m0fnu), bias,
            act_quant=False),
        "fp4_linear": lambda: ops.fp4_linear(x, torch.zeros(5, 0, dtype=torch.uint8), torch.zeros(5, 0, dtype=torch.uint8),
                                             bias),
        "nvfp4_linear": lambda: ops.nvfp4_linear(x, *formats.quantize_nvfp4(torch.zeros(5, 0)), bias),
        "bf16_linear": lambda: ops.bf16_linear(x, torch.zeros(5, 0, dtype=torch.bfloat16), bias),
        "fp32w_linear": lambda: ops.fp32w_linear(x, torch.zeros(5, 0), bias),
        "fp8_grouped_linear": lambda: ops.fp8_grouped_linear(
            x, torch.zeros(1, 5, 0, dtype=torch.float8_e4m3fn), torch.zeros(1, 1, 0, dtype=torch.float8_e8m0fnu),
            torch.tensor([3], dtype=torch.int32), None if bias is None else bias[None]),
        "fp4_grouped_linear": lambda: ops.fp4_grouped_linear(
            x, torch.zeros(1, 5, 0, dtype=torch.uint8), torch.zeros(1, 5, 0, dtype=torch.uint8),
            torch.tensor([3], dtype=torch.int32), None if bias is None else bias[None]),
        "FP8Linear": lambda: _module_k0(FP8Linear, bias)(x),
        "FP4Linear": lambda: _module_k0(FP4Linear, bias)(x),
        "NVFP4Linear": lambda: _module_k0(NVFP4Linear, bias)(x),
        "BF16Linear": lambda: _module_k0(BF16Linear, bias)(x),
    }


def _module_k0(cls, bias):
    lin = torch.nn.Linear(0, 5, bias=bias is not None)
    if bias is not None:
        with torch.no_grad():
            lin.bias.copy_(bias)
    return cls.from_linear(lin)


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("op", list(_linear_k0(None)[1]))
def test_k_zero_gives_the_bias_like_f_linear(op, with_bias, impl):
    # Before: "cannot reshape tensor of 0 elements".
    bias = torch.randn(5) if with_bias else None
    x, calls = _linear_k0(bias)
    y = calls[op]()
    expected = F.linear(x, torch.zeros(5, 0), bias)
    assert y.shape == (3, 5)
    assert torch.equal(y.float(), expected.to(y.dtype).float())


def test_qdq_of_empty_rows():
    assert ops.qdq_fp8(torch.randn(3, 0)).shape == (3, 0)


@pytest.mark.parametrize("peak", [1e-30, 3.99, 0.0, -1.0, float("nan"), float("inf"), 449.0])
def test_peaks_outside_the_scale_range_are_refused(peak):
    # Before: 1e-30 was accepted and gave all-zero or all-NaN outputs.
    w, s = _fp8()
    with pytest.raises(ValueError, match=r"act_peak: expected 4 <= act_peak <= 448"):
        ops.fp8_linear(torch.randn(2, 64), w, s, act_peak=peak)
    with pytest.raises(ValueError, match="act_peak: expected 4 <= act_peak <= 448"):
        FP4Linear(64, 16, act_peak=peak)
    with pytest.raises(ValueError, match=r"peak: expected 4 <= peak <= 448"):
        ops.qdq_fp8(torch.randn(2, 64), peak)


def test_smallest_peak_keeps_every_bf16_block_finite():
    # amax just below bf16's largest finite value: s = 2**126 and its reciprocal is a normal float.
    x = torch.full((1, 32), 3.0e38)
    y = formats.qdq_fp8(x, formats.MIN_ACT_PEAK)
    assert torch.isfinite(y).all() and abs(y[0, 0].item() / 3.0e38 - 1) < 0.07


def test_peak_type_is_checked():
    with pytest.raises(TypeError, match="act_peak: expected a float"):
        formats.check_peak("224")


# --------------------------------------------------------------------------- #
# paged attention and the KV write (findings 9 and 11)
# --------------------------------------------------------------------------- #


def _attention_args(block_table=None):
    torch.manual_seed(0)
    q = torch.randn(2, 4, 8)
    cache = torch.randn(4, 4, 2, 8)
    table = torch.tensor([[0, 1]], dtype=torch.int32) if block_table is None else block_table
    return (q, cache, cache.clone(), table, torch.tensor([5, 6]), torch.tensor([7], dtype=torch.int32))


@pytest.mark.parametrize("scale", [float("inf"), float("-inf"), float("nan"), 0.0, -0.5])
@pytest.mark.parametrize("validate", [True, False])
def test_attention_scale_must_be_finite_and_positive(scale, validate):
    # Before: scale=inf gave all-NaN output.
    with pytest.raises(ValueError, match=r"scale: expected a finite float > 0"):
        ops.paged_window_attention(*_attention_args(), rows_per_request=2, window=8, scale=scale, validate=validate)


def test_attention_table_too_short_without_validate():
    args = _attention_args(block_table=torch.tensor([[0]], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"block_table: request 0 has seq_len 7, which needs 2 blocks"):
        ops.paged_window_attention(*args, rows_per_request=2, window=8, validate=False)


@pytest.mark.parametrize("slots", [[0, 12], [13, 1], [2**40, 0]])
def test_kv_write_out_of_range_slot_writes_nothing(slots):
    # Before (validate=False): k_cache was partly written, then an IndexError, v_cache untouched.
    k, v = torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    k_cache, v_cache = torch.zeros(3, 4, 2, 8), torch.zeros(3, 4, 2, 8)
    with pytest.raises(ValueError, match=r"slots: row \d writes slot \d+, outside the cache's 3 blocks x 4 = 12"):
        ops.paged_kv_write(k, v, k_cache, v_cache, torch.tensor(slots), validate=False)
    assert not k_cache.any() and not v_cache.any()


def test_kv_write_without_validate_still_writes_valid_slots():
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    k_cache, v_cache = torch.zeros(3, 4, 2, 8), torch.zeros(3, 4, 2, 8)
    ops.paged_kv_write(k, v, k_cache, v_cache, torch.tensor([5, -1, 11]), validate=False)
    assert torch.equal(k_cache[1, 1], k[0]) and torch.equal(v_cache[2, 3], v[2])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 2


# --------------------------------------------------------------------------- #
# fuzz: every call either matches the reference or raises a named TypeError/ValueError
# --------------------------------------------------------------------------- #

_ARG = re.compile(r"^(x|weight|weight_scale|scale|bias|block|act_peak|out_dtype|offsets|w)\b[^:]*:")
def _mostly(valid, invalid):
    """Valid values four times as often as hostile ones, so about a quarter of the calls succeed."""
    return st.sampled_from(list(valid) * 4 + list(invalid))


_X_DTYPES = _mostly([torch.float32, torch.bfloat16, torch.float16, torch.float64], [torch.int32, torch.float8_e4m3fn])
_W_DTYPES = _mostly([torch.float8_e4m3fn, torch.uint8], [torch.int8, torch.float32, torch.bfloat16])
_S_DTYPES = _mostly([torch.float8_e8m0fnu, torch.uint8, torch.float32], [torch.bfloat16, torch.int32])
_BLOCK_DIMS = st.one_of(_mostly([1, 2, 32, 128], [0, -1, 1.5, 32.0, 2**63, True]), st.integers(1, 300))
_PEAKS = st.one_of(_mostly([224.0, 448.0, 4.0], [1e-30, 3.99, 0.0, 449.0, float("nan"), float("inf")]),
                   st.floats(4.0, 448.0), st.floats(allow_nan=True, allow_infinity=True))
_LIE = _mostly([False], [True])
_OUT = _mostly([torch.bfloat16, torch.float32, torch.float16], [torch.int8, torch.float64])


def _outcome(call):
    try:
        return call()
    except (TypeError, ValueError) as e:
        assert _ARG.match(str(e)), f"{type(e).__name__} does not name its argument: {e}"
        return type(e)


@given(data=st.data())
def test_fp8_linear_arguments_fuzz(data):
    m = data.draw(st.integers(0, 5), label="M")
    n = data.draw(st.integers(0, 40), label="N")
    k = data.draw(st.integers(0, 70), label="K")
    block = (data.draw(_BLOCK_DIMS, label="bn"), data.draw(_BLOCK_DIMS, label="bk"))
    good = all(type(b) is int and 1 <= b <= formats.MAX_BLOCK for b in block)
    qblock = block if good else (32, 32)
    w, s = formats.quantize_fp8(torch.randn(n, k), qblock)
    # hostile changes: dtypes, a lying scale shape, a wrong x width, bias shape, peak, out_dtype
    x_dtype = data.draw(_X_DTYPES, label="x dtype")
    x = torch.randn(m, k + data.draw(_mostly([0], [1, -1]), label="K lie") if k else k)
    x = x.to(x_dtype)
    w_dtype = data.draw(_W_DTYPES, label="w dtype")
    w = w.view(w_dtype) if w_dtype.itemsize == 1 else w.to(torch.float32).to(w_dtype)
    s_dtype = data.draw(_S_DTYPES, label="s dtype")
    if s_dtype != s.dtype:
        s = s.view(torch.uint8) if s_dtype == torch.uint8 and s.dtype.itemsize == 1 else s.to(s_dtype)
    if data.draw(_LIE, label="scale shape lie") and s.dim() == 2:
        s = s[:, :-1] if s.shape[1] else torch.cat([s, s[:, :1].expand(-1, 1)], 1) if s.shape[0] else s.new_zeros(1, 1)
    bias = data.draw(_mostly([None, "ok"], ["short", "int"]), label="bias")
    bias = {None: None, "ok": torch.randn(n), "short": torch.randn(n + 1), "int": torch.zeros(n, dtype=torch.int32)}[bias]
    peak = data.draw(_PEAKS, label="peak")
    out_dtype = data.draw(_OUT, label="out")
    act_quant = data.draw(st.booleans(), label="act_quant")

    kwargs = dict(block=block, act_quant=act_quant, act_peak=peak, out_dtype=out_dtype)
    fast = _outcome(lambda: ops.fp8_linear(x, w, s, bias, **kwargs))

    def reference():
        formats.check_block(block)
        return ref.fp8_linear(x, w, s, bias, list(block), act_quant, float(peak), out_dtype)

    expected = _outcome(reference)
    event(f"fp8_linear: {expected.__name__ if isinstance(expected, type) else 'result'}")
    if isinstance(expected, type):
        assert fast is expected
    else:
        assert isinstance(fast, torch.Tensor), f"fast raised {fast}, the reference returned"
        assert fast.shape == expected.shape and fast.dtype == expected.dtype
        # correct, not just equal to the reference: within the derived bound of the exact product
        a = (formats.qdq_fp8(x, peak) if act_quant else x.to(torch.bfloat16)).to(torch.float32)
        decoded = formats.dequantize_fp8(w, s, block, torch.float32)
        assert_linear_close(fast, a, decoded, bias)
        assert_linear_close(expected, a, decoded, bias)


@given(data=st.data())
def test_fp4_linear_arguments_fuzz(data):
    m = data.draw(st.integers(0, 4), label="M")
    n = data.draw(st.integers(0, 24), label="N")
    k = data.draw(st.integers(0, 80), label="K")
    packed, scale = formats.quantize_fp4(torch.randn(n, k))
    x = torch.randn(m, max(0, k + data.draw(_mostly([0], [1, -1, 2]), label="K lie")))
    x = x.to(data.draw(_X_DTYPES, label="x dtype"))
    packed = packed.view(data.draw(_mostly([torch.uint8, torch.int8], [torch.float8_e4m3fn]), label="w dtype"))
    if data.draw(_LIE, label="f32 scale"):
        scale = scale.view(torch.uint8).to(torch.float32)
    if data.draw(_LIE, label="scale shape lie") and n:
        scale = scale[:-1]
    bias = data.draw(_mostly([None, "ok"], ["long"]), label="bias")
    bias = {None: None, "ok": torch.randn(n), "long": torch.randn(n + 1)}[bias]
    peak = data.draw(_PEAKS, label="peak")
    out_dtype = data.draw(_OUT, label="out")
    act_quant = data.draw(st.booleans(), label="act_quant")

    fast = _outcome(lambda: ops.fp4_linear(x, packed, scale, bias, act_quant=act_quant, act_peak=peak,
                                           out_dtype=out_dtype))
    expected = _outcome(lambda: ref.fp4_linear(x, packed, scale, bias, act_quant, float(peak), out_dtype))
    event(f"fp4_linear: {expected.__name__ if isinstance(expected, type) else 'result'}")
    if isinstance(expected, type):
        assert fast is expected
        return
    assert isinstance(fast, torch.Tensor), f"fast raised {fast}, the reference returned"
    a = (formats.qdq_fp8(x, peak) if act_quant else x.to(torch.bfloat16)).to(torch.float32)
    decoded = formats.dequantize_fp4(packed, scale, x.shape[-1], torch.float32)
    assert_linear_close(fast, a, decoded, bias)
    assert_linear_close(expected, a, decoded, bias)


@given(data=st.data())
def test_grouped_offsets_fuzz(data):
    experts = data.draw(st.integers(1, 4), label="E")
    rows = data.draw(st.integers(0, 9), label="T")
    offsets = data.draw(st.lists(_mostly([None], [-1, rows + 1]), min_size=experts,
                                 max_size=experts), label="lies")
    # sorted cuts of [0, T] ending at T, then maybe a lie: a negative, a decrease, an end past T
    cuts = sorted(data.draw(st.lists(st.integers(0, rows), min_size=experts - 1, max_size=experts - 1), label="cuts"))
    ends = [*cuts, rows]
    ends = [e if lie is None else lie for e, lie in zip(ends, offsets)]
    x = torch.randn(rows, 64)
    w, s = zip(*(formats.quantize_fp8(torch.randn(8, 64)) for _ in range(experts)))
    w, s = torch.stack(w), torch.stack(s)
    off = torch.tensor(ends, dtype=torch.int32)
    valid = all(b >= a for a, b in zip([0, *ends], ends)) and ends[-1] == rows
    try:
        y = ops.fp8_grouped_linear(x, w, s, off)
    except ValueError as e:
        assert not valid and str(e).startswith("offsets: "), str(e)
        return
    assert valid, f"offsets {ends} for T = {rows} were accepted"
    start = 0
    for e, end in enumerate(ends):
        assert torch.equal(y[start:end], ops.fp8_linear(x[start:end], w[e], s[e]))
        start = end


@given(data=st.data())
def test_attention_arguments_fuzz(data):
    # Finite scales up to 1e30 keep the float32 scores of these unit-size q, k finite (a
    # larger one overflows them, as it would in any float32 softmax); the rest is hostile.
    scale = data.draw(st.one_of(st.none(), st.floats(-1e30, 1e30),
                                st.sampled_from([float("inf"), float("-inf"), float("nan"), 0.0])), label="scale")
    window = data.draw(st.integers(-1, 12), label="window")
    entry = data.draw(st.integers(-3, 6), label="table entry")
    table = torch.tensor([[0, entry]], dtype=torch.int32)
    validate = data.draw(st.booleans(), label="validate")
    args = _attention_args(block_table=table)

    def call():
        return ops.paged_window_attention(*args, rows_per_request=2, window=window, scale=scale, validate=validate)

    try:
        out = call()
    except ValueError as e:
        assert re.match(r"^(scale|window|block_table|positions|seq_lens)\b", str(e)), str(e)
        return
    assert torch.isfinite(out).all()
    assert 0 <= entry < 4 and window >= 1 and (scale is None or (math.isfinite(scale) and scale > 0))
