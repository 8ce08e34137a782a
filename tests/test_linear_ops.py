"""The torch_bq:: linear ops (docs/contract.md §4): math vs float64, opcheck, compile, errors.

Every math test runs over two implementations that share one signature: the
reference body (torch_bq.reference) and whatever the op dispatches to on CPU.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import torch_bq
from torch_bq import formats, ops, reference
from torch_bq.testing import activations, assert_linear_close, fp4_weights, fp8_weights

IMPLS = {
    "fp8": {"reference": reference.fp8_linear, "op": torch.ops.torch_bq.fp8_linear},
    "fp4": {"reference": reference.fp4_linear, "op": torch.ops.torch_bq.fp4_linear},
    "bf16": {"reference": reference.bf16_linear, "op": torch.ops.torch_bq.bf16_linear},
    "fp32w": {"reference": reference.fp32w_linear, "op": torch.ops.torch_bq.fp32w_linear},
}
impl_names = pytest.mark.parametrize("impl", ["reference", "op"])


def operand(x, act_quant, peak=224.0):
    return formats.qdq_fp8(x, peak) if act_quant else x.to(torch.bfloat16)


# --------------------------------------------------------------------------- #
# math against float64
# --------------------------------------------------------------------------- #


@impl_names
@given(
    weight=fp8_weights(),
    act_quant=st.booleans(),
    peak=st.sampled_from([224.0, 448.0]),
    out_dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.float16]),
    with_bias=st.booleans(),
    data=st.data(),
)
def test_fp8_linear_matches_float64(impl, weight, act_quant, peak, out_dtype, with_bias, data):
    n, k = weight.data.shape
    x = data.draw(activations(k, max_exponent=6))
    bias = torch.randn(n, dtype=torch.bfloat16) if with_bias else None
    y = IMPLS["fp8"][impl](x, weight.data, weight.scale, bias, list(weight.block), act_quant, peak, out_dtype)
    assert y.dtype == out_dtype and y.shape == (x.shape[0], n)
    assert_linear_close(y, operand(x, act_quant, peak), weight.dequantize(), bias)


@impl_names
@given(weight=fp4_weights(), act_quant=st.booleans(), with_bias=st.booleans(), data=st.data())
def test_fp4_linear_matches_float64(impl, weight, act_quant, with_bias, data):
    n = weight.packed.shape[0]
    x = data.draw(activations(weight.in_features, max_exponent=6))
    bias = torch.randn(n) if with_bias else None
    y = IMPLS["fp4"][impl](x, weight.packed, weight.scale, bias, act_quant, 224.0, torch.bfloat16)
    assert_linear_close(y, operand(x, act_quant), weight.dequantize(), bias)


@impl_names
@pytest.mark.parametrize("fmt", ["bf16", "fp32w"])
@given(n=st.integers(1, 70), k=st.integers(1, 130), with_bias=st.booleans(), data=st.data())
def test_dense_linear_matches_float64(impl, fmt, n, k, with_bias, data):
    x = data.draw(activations(k))
    w = torch.randn(n, k, dtype=torch.bfloat16 if fmt == "bf16" else torch.float32)
    bias = torch.randn(n, dtype=torch.float64) if with_bias else None
    y = IMPLS[fmt][impl](x, w, bias, torch.bfloat16)
    assert_linear_close(y, x.to(torch.bfloat16), w.to(torch.bfloat16), bias)


def test_bound_catches_a_wrong_answer():
    torch.manual_seed(0)
    x, w = torch.randn(4, 64), torch.randn(8, 64, dtype=torch.bfloat16)
    y = ops.bf16_linear(x, w)
    assert_linear_close(y, x.to(torch.bfloat16), w)
    wrong = y.clone()
    wrong[2, 5] = wrong[2, 5].float().nextafter(torch.tensor(1e9)).to(torch.bfloat16) * 1.02
    with pytest.raises(AssertionError, match=r"worst at \[2, 5\]"):
        assert_linear_close(wrong, x.to(torch.bfloat16), w)
    # Forgetting the activation round trip is caught too.
    d, s = formats.quantize_fp8(w.float())
    with pytest.raises(AssertionError):
        assert_linear_close(ops.fp8_linear(x, d, s), x.to(torch.bfloat16), formats.dequantize_fp8(d, s))


_W = torch.randn(48, 80, generator=torch.Generator().manual_seed(1))
_FP8 = formats.quantize_fp8(_W)
_FP4 = formats.quantize_fp4(_W)


@impl_names
@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
@given(lead=st.lists(st.integers(0, 4), max_size=3), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_result_is_independent_of_leading_dims(impl, fmt, lead, dtype):
    m = 1
    for d in lead:
        m *= d
    x = torch.randn(m, 80, generator=torch.Generator().manual_seed(m)).to(dtype)
    if fmt == "fp8":
        run = lambda t: IMPLS[fmt][impl](t, *_FP8, None, [32, 32], True, 224.0, torch.bfloat16)  # noqa: E731
    else:
        run = lambda t: IMPLS[fmt][impl](t, *_FP4, None, True, 224.0, torch.bfloat16)  # noqa: E731
    y = run(x.reshape(*lead, 80))
    assert y.shape == (*lead, 48)
    assert torch.equal(y.reshape(m, 48).view(torch.int16), run(x).view(torch.int16))


@pytest.mark.parametrize("k", [1, 31, 33, 4095])
def test_odd_k_and_zero_rows(k):
    torch.manual_seed(k)
    w = torch.randn(40, k)
    d, s = formats.quantize_fp8(w, (128, 128), torch.float32)
    x = torch.randn(3, k)
    assert_linear_close(ops.fp8_linear(x, d, s, block=(128, 128)), formats.qdq_fp8(x), formats.dequantize_fp8(d, s, (128, 128), torch.float32))
    p, s4 = formats.quantize_fp4(w)
    assert_linear_close(ops.fp4_linear(x, p, s4), formats.qdq_fp8(x), formats.dequantize_fp4(p, s4, k))
    empty = ops.fp4_linear(torch.zeros(0, 5, k), p, s4)
    assert empty.shape == (0, 5, 40) and empty.dtype == torch.bfloat16


def test_reference_decodes_in_slabs(monkeypatch):
    """A wide weight crosses several slabs; the answer must not depend on the slab size."""
    torch.manual_seed(2)
    w = torch.randn(200, 96)
    d, s = formats.quantize_fp8(w)
    x = torch.randn(3, 96)
    whole = ops.fp8_linear(x, d, s)
    monkeypatch.setattr(reference.linear, "SLAB_BYTES", 32 * 96 * 4)  # one 32-row block a slab
    assert reference.linear.slab_rows(96, 32) == 32
    assert torch.equal(reference.fp8_linear(x, d, s, None, [32, 32], True, 224.0, torch.bfloat16), whole)
    p, s4 = formats.quantize_fp4(w)
    assert torch.equal(reference.fp4_linear(x, p, s4, None, True, 224.0, torch.bfloat16), ops.fp4_linear(x, p, s4))


# --------------------------------------------------------------------------- #
# opcheck, compile
# --------------------------------------------------------------------------- #


def _samples():
    torch.manual_seed(3)
    w = torch.randn(40, 70)
    d8, s8 = formats.quantize_fp8(w)
    d128, s128 = formats.quantize_fp8(w, (128, 128), torch.float32)
    p4, s4 = formats.quantize_fp4(w)
    bias = torch.randn(40)
    # opcheck's test_schema compares inputs with ops float8 dtypes lack on CPU, so most
    # samples pass the (equally valid) uint8 bytes; test_opcheck_float8_storage covers the rest.
    d8, s8, s128, s4 = (t.view(torch.uint8) if t.dtype.itemsize == 1 else t for t in (d8, s8, s128, s4))
    d128 = d128.view(torch.uint8)
    out = []
    for x in (torch.randn(0, 70), torch.randn(2, 3, 70, dtype=torch.bfloat16), torch.randn(5, 70)):
        for b in (None, bias):
            out += [
                (torch.ops.torch_bq.fp8_linear, (x, d8, s8, b, [32, 32], True, 224.0, torch.bfloat16)),
                (torch.ops.torch_bq.fp8_linear, (x, d128, s128, b, [128, 128], False, 224.0, torch.float32)),
                (torch.ops.torch_bq.fp4_linear, (x, p4, s4, b, True, 448.0, torch.bfloat16)),
                (torch.ops.torch_bq.bf16_linear, (x, w.to(torch.bfloat16), b, torch.bfloat16)),
                (torch.ops.torch_bq.fp32w_linear, (x, w, b, torch.float16)),
            ]
        out.append((torch.ops.torch_bq.qdq_fp8, (x, 224.0)))
    return out


@pytest.mark.parametrize("op, args", _samples(), ids=lambda v: getattr(v, "__name__", None))
def test_opcheck(op, args):
    torch.library.opcheck(op, args)


def test_opcheck_float8_storage():
    w = torch.randn(40, 70)
    d, s = formats.quantize_fp8(w)
    p, s4 = formats.quantize_fp4(w)
    x = torch.randn(3, 70)
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.torch_bq.fp8_linear, (x, d, s, None, [32, 32], True, 224.0, torch.bfloat16), test_utils=utils)
    args = (x, p.view(torch.float4_e2m1fn_x2), s4, None, True, 224.0, torch.bfloat16)
    torch.library.opcheck(torch.ops.torch_bq.fp4_linear, args, test_utils=utils)


def _compile_cases():
    torch.manual_seed(4)
    w = torch.randn(64, 96)
    d8, s8 = formats.quantize_fp8(w)
    p4, s4 = formats.quantize_fp4(w)
    bias = torch.randn(64)
    return {
        "fp8": lambda x: ops.fp8_linear(x, d8, s8, bias),
        "fp4": lambda x: ops.fp4_linear(x, p4, s4),
        "bf16": lambda x: ops.bf16_linear(x, w.to(torch.bfloat16), bias),
        "fp32w": lambda x: ops.fp32w_linear(x, w, out_dtype=torch.float32),
        "qdq": lambda x: ops.qdq_fp8(x, 448.0),
    }


@pytest.mark.parametrize("name", ["fp8", "fp4", "bf16", "fp32w", "qdq"])
def test_compile_fullgraph_matches_eager(name):
    fn = _compile_cases()[name]
    compiled = torch.compile(fn, fullgraph=True)
    x = torch.randn(2, 5, 96)
    assert torch.equal(compiled(x), fn(x))


def test_compile_dynamic_does_not_recompile_when_m_changes():
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    fn = _compile_cases()["fp8"]
    counter = CompileCounter()
    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend=counter)
    for m in (5, 9, 20, 64):  # avoid 2 and 3: duck sizing would tie M to the scale grid
        x = torch.randn(m, 96)
        assert torch.equal(compiled(x), fn(x))
    assert counter.frame_count == 1


# --------------------------------------------------------------------------- #
# errors
# --------------------------------------------------------------------------- #


def test_errors_name_the_argument():
    w = torch.randn(40, 70)
    d, s = formats.quantize_fp8(w)
    p, s4 = formats.quantize_fp4(w)
    x = torch.randn(3, 70)
    with pytest.raises(ValueError, match=r"x: expected shape \[\.\.\., 70\] .*got \[3, 64\]"):
        ops.fp8_linear(torch.randn(3, 64), d, s)
    with pytest.raises(TypeError, match="x: expected a float"):
        ops.fp8_linear(x.to(torch.int32), d, s)
    with pytest.raises(ValueError, match=r"weight_scale: expected shape \[1, 1\]"):
        ops.fp8_linear(x, d, s, block=(128, 128))
    with pytest.raises(ValueError, match=r"bias: expected shape \[40\]"):
        ops.fp8_linear(x, d, s, torch.randn(41))
    with pytest.raises(TypeError, match="out_dtype"):
        ops.fp8_linear(x, d, s, out_dtype=torch.int32)
    with pytest.raises(ValueError, match="act_peak"):
        ops.fp8_linear(x, d, s, act_peak=449.0)
    with pytest.raises(ValueError, match=r"weight: expected shape \[N, 36\] \(ceil\(K/2\)\) for K=71, got \[40, 35\]"):
        ops.fp4_linear(torch.randn(3, 71), p, s4)
    with pytest.raises(TypeError, match="weight: expected dtype torch.bfloat16"):
        ops.bf16_linear(x, w)
    with pytest.raises(TypeError, match="weight: expected dtype torch.float32"):
        ops.fp32w_linear(x, w.to(torch.bfloat16))
    # the same checks run under fake tensors (compile / meta)
    with pytest.raises(ValueError, match=r"x: expected shape"):
        ops.fp8_linear(torch.randn(3, 64, device="meta"), d.to("meta"), s.to("meta"))


def test_package_imports_cleanly():
    assert torch_bq.__version__
    assert hasattr(torch.ops.torch_bq, "fp8_linear")
