"""torch_bq::fp4_grouped_linear / fp8_grouped_linear against dense per-expert references."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from torch_bq import formats, ops, reference
from torch_bq.testing import assert_linear_close

# --------------------------------------------------------------------------- #
# fixtures: stacked quantized expert weights
# --------------------------------------------------------------------------- #

FP8_VARIANTS = {
    "fp8-32x32-e8m0": ((32, 32), torch.float8_e8m0fnu),
    "fp8-128x128-f32": ((128, 128), torch.float32),
    "fp8-1x32-e8m0": ((1, 32), torch.float8_e8m0fnu),
}
FORMATS = ["fp4", *FP8_VARIANTS]


def make_experts(fmt, e, n, k, seed=0, bias=False):
    """Stacked quantized weights of ``e`` experts plus the per-expert call of the dense reference."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(e, n, k, generator=g)
    b = torch.randn(e, n, generator=g) if bias else None
    if fmt == "fp4":
        data, scale = zip(*(formats.quantize_fp4(w[i]) for i in range(e)))
        stacked = (torch.stack(data), torch.stack(scale))
        kwargs = {}

        def dense(x, i, impl="reference", **kw):
            fn = reference.fp4_linear if impl == "reference" else torch.ops.torch_bq.fp4_linear
            return fn(x, stacked[0][i], stacked[1][i], None if b is None else b[i],
                      kw.get("act_quant", True), kw.get("act_peak", 224.0), kw.get("out_dtype", torch.bfloat16))

        def decoded(i):
            return formats.dequantize_fp4(stacked[0][i], stacked[1][i], k, torch.float64)
    else:
        block, scale_dtype = FP8_VARIANTS[fmt]
        data, scale = zip(*(formats.quantize_fp8(w[i], block, scale_dtype) for i in range(e)))
        stacked = (torch.stack(data), torch.stack(scale))
        kwargs = {"block": block}

        def dense(x, i, impl="reference", **kw):
            fn = reference.fp8_linear if impl == "reference" else torch.ops.torch_bq.fp8_linear
            return fn(x, stacked[0][i], stacked[1][i], None if b is None else b[i], list(block),
                      kw.get("act_quant", True), kw.get("act_peak", 224.0), kw.get("out_dtype", torch.bfloat16))

        def decoded(i):
            return formats.dequantize_fp8(stacked[0][i], stacked[1][i], block, torch.float64)

    return stacked, b, kwargs, dense, decoded


def grouped(fmt):
    return ops.fp4_grouped_linear if fmt == "fp4" else ops.fp8_grouped_linear


def reference_grouped(fmt):
    """The reference with the wrappers' keyword signature."""

    def call(x, weight, scale, offsets, bias=None, *, block=(32, 32), act_quant=True, act_peak=224.0,
             out_dtype=torch.bfloat16):
        if fmt == "fp4":
            return reference.fp4_grouped_linear(x, weight, scale, offsets, bias, act_quant, act_peak, out_dtype)
        return reference.fp8_grouped_linear(x, weight, scale, offsets, bias, block, act_quant, act_peak, out_dtype)

    return call


def offsets_of(counts):
    return torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)


# --------------------------------------------------------------------------- #
# equality with a loop of dense calls: the reference against the dense reference,
# the op (whatever kernel the device registers) against the dense op. Exact: each
# expert's rows go through the same dense math with the same row count.
# --------------------------------------------------------------------------- #

IMPLS = ["op", "reference"]

ROUTINGS = {
    "some-empty": [0, 3, 0, 5],
    "one-takes-all": [0, 0, 7, 0],
    "no-rows": [0, 0, 0, 0],
    "every-expert": [1, 2, 3, 2],
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("bias", [False, True])
def test_equals_loop_of_dense_calls(impl, fmt, routing, bias):
    counts = ROUTINGS[routing]
    n, k = 40, 70  # neither a multiple of 32
    (weight, scale), b, kw, dense, _ = make_experts(fmt, len(counts), n, k, bias=bias)
    x = torch.randn(sum(counts), k) * 3
    fn = grouped(fmt) if impl == "op" else reference_grouped(fmt)
    out = fn(x, weight, scale, offsets_of(counts), b, **kw)
    assert out.shape == (sum(counts), n) and out.dtype == torch.bfloat16
    start = 0
    for i, c in enumerate(counts):
        expected = dense(x[start : start + c], i, impl)
        assert torch.equal(out[start : start + c].view(torch.uint16), expected.view(torch.uint16)), (i, c)
        start += c


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt", ["fp4", "fp8-32x32-e8m0"])
def test_options_reach_every_expert(impl, fmt):
    counts = [2, 0, 3]
    (weight, scale), b, kw, dense, _ = make_experts(fmt, 3, 33, 64, seed=1, bias=True)
    x = torch.randn(5, 64, dtype=torch.float16)
    fn = grouped(fmt) if impl == "op" else reference_grouped(fmt)
    out = fn(x, weight, scale, offsets_of(counts), b, act_quant=False, act_peak=448.0, out_dtype=torch.float32, **kw)
    expected = torch.cat([dense(x[:2], 0, impl, act_quant=False, out_dtype=torch.float32),
                          dense(x[2:], 2, impl, act_quant=False, out_dtype=torch.float32)])
    assert torch.equal(out, expected)


# --------------------------------------------------------------------------- #
# an independent float64 computation (derived bound)
# --------------------------------------------------------------------------- #


@given(
    impl=st.sampled_from(IMPLS),
    fmt=st.sampled_from(FORMATS),
    counts=st.lists(st.integers(0, 4), min_size=1, max_size=5),
    n=st.integers(1, 40),
    k=st.integers(1, 80),
    act_quant=st.booleans(),
    out_dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    seed=st.integers(0, 2**16),
)
def test_matches_float64_within_derived_bound(impl, fmt, counts, n, k, act_quant, out_dtype, seed):
    (weight, scale), b, kw, _, decoded = make_experts(fmt, len(counts), n, k, seed=seed, bias=True)
    x = torch.randn(sum(counts), k, generator=torch.Generator().manual_seed(seed + 1)) * 10
    fn = grouped(fmt) if impl == "op" else reference_grouped(fmt)
    out = fn(x, weight, scale, offsets_of(counts), b, act_quant=act_quant, out_dtype=out_dtype, **kw)
    a = formats.qdq_fp8(x) if act_quant else x.to(torch.bfloat16)
    start = 0
    for i, c in enumerate(counts):
        # The bound of docs/contract.md §4 per expert (K + 1 float32 roundings, one output rounding).
        assert_linear_close(out[start : start + c], a[start : start + c], decoded(i), b[i], msg=f"expert {i}")
        start += c


# --------------------------------------------------------------------------- #
# experts without rows are never decoded
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("fmt", ["fp4", "fp8-32x32-e8m0"])
def test_experts_without_rows_are_not_decoded(fmt, monkeypatch):
    counts = [0, 2, 0, 0, 1, 0]
    (weight, scale), _, kw, _, _ = make_experts(fmt, len(counts), 32, 64)
    name = "dequantize_fp4" if fmt == "fp4" else "dequantize_fp8"
    decoded_rows = []
    original = getattr(formats, name)

    def spy(data, *args, **kwargs):
        decoded_rows.append(data.data_ptr())
        return original(data, *args, **kwargs)

    monkeypatch.setattr(formats, name, spy)
    reference_grouped(fmt)(torch.randn(3, 64), weight, scale, offsets_of(counts), **kw)
    expert_of_ptr = {weight[i].data_ptr(): i for i in range(len(counts))}
    assert sorted({expert_of_ptr[p] for p in decoded_rows}) == [1, 4]


# --------------------------------------------------------------------------- #
# argument errors
# --------------------------------------------------------------------------- #


def _fp4_args(e=3, n=8, k=64, t=4):
    (weight, scale), b, _, _, _ = make_experts("fp4", e, n, k, bias=True)
    return torch.randn(t, k), weight, scale, offsets_of([1, 1, t - 2]), b


@pytest.mark.parametrize(
    "offsets, match",
    [
        (torch.tensor([1, 1, 4], dtype=torch.int64), r"offsets: expected dtype torch.int32"),
        (torch.tensor([1, 4], dtype=torch.int32), r"offsets: expected shape \[3\]"),
        (torch.tensor([3, 1, 4], dtype=torch.int32), r"offsets: expected non-decreasing .* offsets\[1\] = 1 after 3"),
        (torch.tensor([-1, 1, 4], dtype=torch.int32), r"offsets\[0\] = -1 after 0"),
        (torch.tensor([1, 2, 3], dtype=torch.int32), r"last offset to equal the number of rows T = 4, got 3"),
        (torch.tensor([1, 2, 5], dtype=torch.int32), r"T = 4, got 5"),
    ],
)
def test_bad_offsets_raise(offsets, match):
    x, weight, scale, _, b = _fp4_args()
    error = TypeError if offsets.dtype != torch.int32 else ValueError
    with pytest.raises(error, match=match):
        ops.fp4_grouped_linear(x, weight, scale, offsets, b)


def test_bad_shapes_raise():
    x, weight, scale, offsets, b = _fp4_args()
    with pytest.raises(ValueError, match=r"x: expected a 2-D \[T, K\]"):
        ops.fp4_grouped_linear(x[None], weight, scale, offsets)
    with pytest.raises(ValueError, match=r"weight: expected a 3-D stacked"):
        ops.fp4_grouped_linear(x, weight[0], scale, offsets)
    with pytest.raises(ValueError, match=r"scale: expected a 3-D stacked \[3, \.\.\.\]"):
        ops.fp4_grouped_linear(x, weight, scale[:2], offsets)
    with pytest.raises(ValueError, match=r"bias: expected a 2-D \[3, N\]"):
        ops.fp4_grouped_linear(x, weight, scale, offsets, b[0])
    with pytest.raises(ValueError, match=r"bias: expected a 2-D \[3, N\] = \[3, 8\] per-expert tensor, got shape \[3, 4\]"):
        ops.fp4_grouped_linear(x, weight, scale, offsets, b[:, :4])
    with pytest.raises(ValueError, match=r"weight: expected shape \[N, 16\]"):
        ops.fp4_grouped_linear(torch.randn(4, 32), weight, scale, offsets)
    with pytest.raises(TypeError, match=r"weight: expected dtype"):
        ops.fp4_grouped_linear(x, weight.float(), scale, offsets)
    (w8, s8), _, _, _, _ = make_experts("fp8-32x32-e8m0", 3, 8, 64)
    with pytest.raises(ValueError, match=r"weight_scale: expected shape \[1, 1\]"):
        ops.fp8_grouped_linear(x, w8, s8, offsets, block=(128, 128))


# --------------------------------------------------------------------------- #
# torch.library and torch.compile
# --------------------------------------------------------------------------- #


def _opcheck_samples():
    samples = []
    for fmt, op in (("fp4", torch.ops.torch_bq.fp4_grouped_linear), ("fp8", torch.ops.torch_bq.fp8_grouped_linear)):
        name = "fp4" if fmt == "fp4" else "fp8-32x32-e8m0"
        for counts, k, bias in (([2, 0, 3], 70, True), ([0, 0, 0], 64, False), ([0, 4, 0], 33, False)):
            (weight, scale), b, _, _, _ = make_experts(name, 3, 24, k, bias=bias)
            x = torch.randn(sum(counts), k)
            # opcheck's schema test does arithmetic on every input, which float8_e8m0fnu
            # and float8_e4m3fn lack; uint8 is the same bytes and an accepted storage.
            weight, scale = weight.view(torch.uint8), scale.view(torch.uint8)
            tail = (True, 224.0, torch.bfloat16)
            if fmt == "fp4":
                samples.append((op, (x, weight, scale, offsets_of(counts), b, *tail)))
            else:
                samples.append((op, (x, weight, scale, offsets_of(counts), b, [32, 32], *tail)))
            if bias:  # the same with gradients wanted (checks the autograd registration)
                args = list(samples[-1][1])
                args[0], args[4] = x.clone().requires_grad_(), b.clone().requires_grad_()
                samples.append((op, tuple(args)))
    for fmt, op in (("fp4", torch.ops.torch_bq.fp4_grouped_linear_grad_input),
                    ("fp8", torch.ops.torch_bq.fp8_grouped_linear_grad_input)):
        name = "fp4" if fmt == "fp4" else "fp8-32x32-e8m0"
        (weight, scale), _, _, _, _ = make_experts(name, 3, 24, 70)
        weight, scale = weight.view(torch.uint8), scale.view(torch.uint8)
        grad = torch.randn(5, 24)
        extra = 70 if fmt == "fp4" else [32, 32]
        samples.append((op, (grad, weight, scale, offsets_of([2, 0, 3]), extra, torch.float32)))
    return samples


@pytest.mark.parametrize("op, args", _opcheck_samples())
def test_opcheck(op, args):
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("fmt", ["fp4", "fp8-128x128-f32"])
def test_compile_fullgraph_matches_eager(fmt):
    (weight, scale), b, kw, _, _ = make_experts(fmt, 4, 48, 96, bias=True)
    fn = grouped(fmt)

    def f(x, offsets):
        return fn(x, weight, scale, offsets, b, **kw)

    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    for counts in ([1, 0, 2, 3], [0, 9, 0, 2]):
        x = torch.randn(sum(counts), 96)
        assert torch.equal(compiled(x, offsets_of(counts)), f(x, offsets_of(counts)))



# --------------------------------------------------------------------------- #
# input gradients
# --------------------------------------------------------------------------- #


def _integer_experts(fmt, e, n, k, seed=0):
    """Experts quantized from weights k/16 (|k| <= 6) and their decoded float64 weights.

    Decoded values are multiples of 1/32 below 1: products with small integers and
    their sums are exact in float32.
    """
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(-6, 7, (e, n, k), generator=g) / 16
    if fmt == "fp4":
        data, scale = zip(*(formats.quantize_fp4(w[i]) for i in range(e)))
        kw = {}
    else:
        block, scale_dtype = FP8_VARIANTS[fmt]
        data, scale = zip(*(formats.quantize_fp8(w[i], block, scale_dtype) for i in range(e)))
        kw = {"block": block}
    if fmt == "fp4":
        decoded = [formats.dequantize_fp4(data[i], scale[i], k, torch.float64) for i in range(e)]
    else:
        decoded = [formats.dequantize_fp8(data[i], scale[i], kw["block"], torch.float64) for i in range(e)]
    return torch.stack(data), torch.stack(scale), torch.stack(decoded), kw, g


@pytest.mark.parametrize("fmt", FORMATS)
def test_input_and_bias_gradients_are_exact(fmt):
    # grad_x rows of expert e = grad rows @ W_e (straight through the activation
    # rounding); grad_bias[e] = the sum of expert e's grad rows. With integer grads
    # and these decoded weights every float32 product and sum is exact: compare exactly.
    weight, scale, w, kw, g = _integer_experts(fmt, 4, 24, 70)
    counts = [3, 0, 2, 4]
    x = torch.randn(9, 70, generator=g).requires_grad_()
    bias = torch.randn(4, 24, generator=g).requires_grad_()
    y = grouped(fmt)(x, weight, scale, offsets_of(counts), bias, out_dtype=torch.float32, **kw)
    grad = torch.randint(-8, 9, y.shape, generator=g).to(torch.float32)
    y.backward(grad)
    start = 0
    for i, c in enumerate(counts):
        rows = grad[start : start + c].double()
        assert torch.equal(x.grad[start : start + c].double(), rows @ w[i])
        assert torch.equal(bias.grad[i].double(), rows.sum(0))
        start += c
    assert x.grad.dtype == x.dtype and bias.grad.dtype == bias.dtype


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["fp4", "fp8-32x32-e8m0"])
def test_gradcheck_input_and_bias_float64(fmt):
    # Integer inputs keep qdq exact (also at +-1), and float32 sums of these products
    # are exact, so the forward is exactly the dequantized matmul and gradcheck's
    # eps = 1 central differences are exact: atol = rtol = 0. Expert 1 has no rows.
    weight, scale, _, kw, g = _integer_experts(fmt, 3, 4, 40)  # K = 40: a full and a partial block
    offsets = offsets_of([1, 0, 2])
    x = torch.randint(-7, 8, (3, 40), dtype=torch.float64, generator=g).requires_grad_()
    bias = (torch.randint(-6, 7, (3, 4), generator=g) / 4).double().requires_grad_()

    def f(x, bias):
        return grouped(fmt)(x, weight, scale, offsets, bias, out_dtype=torch.float32, **kw)

    assert torch.autograd.gradcheck(f, (x, bias), eps=1.0, atol=0.0, rtol=0.0)
