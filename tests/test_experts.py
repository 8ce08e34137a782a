"""FP4Experts / FP8Experts against a token-by-token loop over experts using the dense reference linears."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from torch_bq import formats, reference
from torch_bq.nn import FP4Experts, FP8Experts
from torch_bq.nn.experts import _gated_activation

U32 = 2.0**-24  # float32 unit roundoff
E, H, I = 6, 64, 48  # I is not a multiple of 32: partial scale blocks in down_proj

KINDS = {
    "fp4-gpt-oss-bias": (FP4Experts, {"activation": "gpt-oss"}, True),
    "fp4-swiglu": (FP4Experts, {"activation": "swiglu"}, False),
    "fp8-32x32-swiglu": (FP8Experts, {"activation": "swiglu", "block": (32, 32)}, False),
    "fp8-128x128-f32-gpt-oss-bias": (
        FP8Experts, {"activation": "gpt-oss", "block": (128, 128), "scale_dtype": torch.float32}, True),
}


def make_module(kind, seed=0, **extra):
    cls, options, bias = KINDS[kind]
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(E, 2 * I, H, generator=g) * 0.2
    down = torch.randn(E, H, I, generator=g) * 0.2
    biases = (torch.randn(E, 2 * I, generator=g), torch.randn(E, H, generator=g)) if bias else (None, None)
    return cls.from_weights(gate_up, down, *biases, **options, **extra)


def dense_linear(module, proj, e, x):
    """One expert's projection through the dense reference linear, float32 out."""
    w, s = getattr(module, proj)[e], getattr(module, f"{proj}_scale")[e]
    b = getattr(module, f"{proj}_bias")
    b = None if b is None else b[e]
    if isinstance(module, FP4Experts):
        return reference.fp4_linear(x, w, s, b, module.act_quant, module.act_peak, torch.float32)
    return reference.fp8_linear(x, w, s, b, module.block, module.act_quant, module.act_peak, torch.float32)


def down_magnitude(module, e, a):
    """``|A| @ |W|^T + |b|`` in float64 for the down projection of expert ``e`` (the GEMM error scale)."""
    a = (formats.qdq_fp8(a, module.act_peak) if module.act_quant else a.to(torch.bfloat16)).to(torch.float64)
    w, s = module.down_proj[e], module.down_proj_scale[e]
    if isinstance(module, FP4Experts):
        w = formats.dequantize_fp4(w, s, I, torch.float64)
    else:
        w = formats.dequantize_fp8(w, s, module.block, torch.float64)
    b = module.down_proj_bias
    return a.abs() @ w.abs().T + (0 if b is None else b[e].abs().to(torch.float64))


def loop_reference(module, hidden, expert_ids, routing_weights):
    """float64 ``[T, H]`` plus two float64 error scales per element (for the bound):
    the sum of ``|w y|`` and the sum of ``|w| (|A| @ |W_down|^T + |b|)``."""
    out = torch.zeros(hidden.shape[0], H, dtype=torch.float64)
    magnitude = torch.zeros_like(out)
    gemm_scale = torch.zeros_like(out)
    for t in range(hidden.shape[0]):
        for j in range(expert_ids.shape[1]):
            e = int(expert_ids[t, j])
            h = dense_linear(module, "gate_up_proj", e, hidden[t : t + 1])
            if module.activation == "gpt-oss":  # interleaved rows, clamped, (up + 1)
                gate, up = h[:, 0::2].clamp(max=7.0), h[:, 1::2].clamp(-7.0, 7.0)
                a = gate * torch.sigmoid(1.702 * gate) * (up + 1)
            else:  # [w1; w3] halves
                a = F.silu(h[:, :I]) * h[:, I:]
            y = dense_linear(module, "down_proj", e, a)[0].to(torch.float64)
            term = float(routing_weights[t, j]) * y
            out[t] += term
            magnitude[t] += term.abs()
            gemm_scale[t] += abs(float(routing_weights[t, j])) * down_magnitude(module, e, a)[0]
    return out, magnitude, gemm_scale


def assert_close_to_loop(actual, module, hidden, expert_ids, routing_weights):
    expected, magnitude, gemm_scale = loop_reference(module, hidden, expert_ids, routing_weights)
    k = expert_ids.shape[1]
    # Both sides run the same reference math per expert row, but the module hands
    # BLAS many rows at once and the loop one, so float32 sums come in another
    # order: each down output may differ by 2 * (I + 1) * u32 * (|A| @ |W|^T + |b|)
    # (the bias add is one more rounding). The gate_up difference of the same kind
    # is absorbed by the qdq of the down input (it moves no e4m3 rounding here).
    # Mixing: the module forms w * y in float32 (one rounding each) and adds k
    # terms in float32, (k + 1) * u32 * sum|w y| at most, then rounds once to the
    # output dtype (u32 for float32, 2**-8 for bfloat16: 8 significant bits).
    out_rounding = U32 if actual.dtype == torch.float32 else 2.0**-8
    bound = (2 * (I + 1) * U32 * gemm_scale + (k + 1) * U32 * magnitude) * (1 + out_rounding) \
        + out_rounding * expected.abs()
    err = (actual.to(torch.float64) - expected).abs()
    assert bool((err <= bound).all()), f"worst excess {float((err - bound).max())}"


def routing(kind, tokens, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    if kind == "random":
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)]) if tokens else \
            torch.zeros(0, k, dtype=torch.int64)
    elif kind == "one-expert-takes-all":
        ids = torch.full((tokens, k), 4, dtype=torch.int64)
    elif kind == "some-experts-empty":  # experts 0, 2, 3, 5 get nothing
        ids = torch.randint(0, 2, (tokens, k), generator=g) * 3 + 1
    else:
        raise ValueError(kind)
    weights = torch.rand(tokens, k, generator=g).softmax(-1) if tokens else torch.zeros(0, k)
    return ids, weights


# --------------------------------------------------------------------------- #
# numerics
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("route, top_k", [("random", 1), ("random", 4), ("one-expert-takes-all", 4),
                                          ("some-experts-empty", 2)])
def test_matches_loop_over_experts(kind, route, top_k):
    module = make_module(kind)
    hidden = torch.randn(7, H, generator=torch.Generator().manual_seed(1)) * 2
    ids, weights = routing(route, 7, top_k)
    out = module(hidden, ids, weights)
    assert out.dtype == torch.float32 and out.shape == (7, H)
    assert_close_to_loop(out, module, hidden, ids, weights)


def test_bfloat16_hidden_and_routing_weights():
    module = make_module("fp4-gpt-oss-bias")
    hidden = torch.randn(5, H, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    ids, weights = routing("random", 5, 4, seed=3)
    weights = weights.to(torch.bfloat16)
    out = module(hidden, ids, weights)
    assert out.dtype == torch.bfloat16
    assert_close_to_loop(out, module, hidden, ids, weights)


@pytest.mark.slow
@settings(max_examples=20)  # each example is a token-by-token loop of dense reference calls
@given(
    kind=st.sampled_from(list(KINDS)),
    tokens=st.integers(0, 6),
    top_k=st.integers(1, 4),
    seed=st.integers(0, 2**16),
    repeat=st.booleans(),
)
def test_matches_loop_over_experts_property(kind, tokens, top_k, seed, repeat):
    module = make_module(kind)
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, H, generator=g) * 4
    if repeat:  # the same expert may appear twice in a row: both slots count
        ids = torch.randint(0, E, (tokens, top_k), generator=g)
    else:
        ids, _ = routing("random", tokens, top_k, seed)
    weights = torch.rand(tokens, top_k, generator=g)
    out = module(hidden, ids, weights)
    assert_close_to_loop(out, module, hidden, ids, weights)


def test_no_tokens():
    module = make_module("fp8-32x32-swiglu")
    out = module(torch.zeros(0, H, dtype=torch.bfloat16), torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, 2))
    assert out.shape == (0, H) and out.dtype == torch.bfloat16


def test_gpt_oss_activation_by_hand():
    # Rows interleave (gate, up): gate 10 clamps to 7 from above only; up clamps to [-7, 7].
    gate_up = torch.tensor([[10.0, -9.0, -20.0, 8.0, 0.5, 0.25]])
    expected = [7 * _sigmoid(1.702 * 7) * (-7 + 1), -20 * _sigmoid(1.702 * -20) * (7 + 1),
                0.5 * _sigmoid(1.702 * 0.5) * 1.25]
    got = _gated_activation(gate_up, "gpt-oss")[0].tolist()
    assert got == pytest.approx(expected, rel=1e-6, abs=1e-12)


def test_swiglu_activation_by_hand():
    # Rows are [w1 | w3] halves, unclamped: silu(gate) * up.
    gate_up = torch.tensor([[10.0, -2.0, 0.5, 9.0, 3.0, -4.0]])
    expected = [10 * _sigmoid(10) * 9, -2 * _sigmoid(-2) * 3, 0.5 * _sigmoid(0.5) * -4]
    assert _gated_activation(gate_up, "swiglu")[0].tolist() == pytest.approx(expected, rel=1e-6)


def _sigmoid(v):
    return 1.0 / (1.0 + math.exp(-v))


# --------------------------------------------------------------------------- #
# torch.compile
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("kind", ["fp4-gpt-oss-bias", "fp8-32x32-swiglu"])
def test_compile_fullgraph_matches_eager_without_recompiling(kind):
    from torch._dynamo.testing import CompileCounterWithBackend

    module = make_module(kind)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(module, fullgraph=True, dynamic=True, backend=counter)
    frames = []
    for tokens in (3, 9, 5):
        hidden = torch.randn(tokens, H, dtype=torch.bfloat16)
        ids, weights = routing("random", tokens, 4, seed=tokens)
        assert torch.equal(compiled(hidden, ids, weights), module(hidden, ids, weights))
        frames.append(counter.frame_count)
    # Compiled by the first call; new token counts reuse it.
    assert frames[0] >= 1 and frames[1:] == [frames[0]] * 2


# --------------------------------------------------------------------------- #
# gradients (inputs only; the weights are frozen)
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("kind", ["fp4-gpt-oss-bias", "fp8-32x32-swiglu"])
def test_routing_weight_gradient_and_compiled_backward(kind):
    module = make_module(kind)
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(5, H, generator=g).requires_grad_()
    ids, w = routing("random", 5, 3, seed=4)
    weights = w.clone().requires_grad_()
    out = module(hidden, ids, weights)
    grad = torch.randn(out.shape, generator=g)
    out.backward(grad)
    # out is linear in the routing weights: out = sum_j w_j y_j, and y_j is the
    # output with one-hot weights on slot j (exact: the other terms are zeros).
    # d(out . grad) / d w[t, j] = sum_h grad[t, h] y_j[t, h]; the module sums H
    # float32 products: bound H * u32 * sum|grad y| (plus a rounding of each product).
    for j in range(3):
        one_hot = torch.zeros(5, 3)
        one_hot[:, j] = 1
        y = module(hidden.detach(), ids, one_hot).double()
        expected = (grad.double() * y).sum(-1)
        bound = (H + 1) * U32 * (grad.double() * y).abs().sum(-1)
        assert bool(((weights.grad[:, j].double() - expected).abs() <= bound).all())
    assert hidden.grad is not None and bool(hidden.grad.abs().sum() > 0)

    compiled = torch.compile(module, fullgraph=True, dynamic=True, backend="aot_eager")
    hidden_c = hidden.detach().clone().requires_grad_()
    weights_c = w.clone().requires_grad_()
    compiled(hidden_c, ids, weights_c).backward(grad)
    assert torch.equal(hidden_c.grad, hidden.grad) and torch.equal(weights_c.grad, weights.grad)


# --------------------------------------------------------------------------- #
# state and construction
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("kind", ["fp4-gpt-oss-bias", "fp8-128x128-f32-gpt-oss-bias"])
def test_meta_build_then_load_state_dict_assign(kind):
    module = make_module(kind)
    cls, options, bias = KINDS[kind]
    empty = cls(E, H, I, bias, device="meta", **options)
    assert all(t.is_meta for t in empty.buffers())
    empty.load_state_dict(module.state_dict(), assign=True)
    hidden = torch.randn(4, H)
    ids, weights = routing("random", 4, 2)
    assert torch.equal(empty(hidden, ids, weights), module(hidden, ids, weights))


def test_state_dict_round_trip_through_safetensors(tmp_path):
    from safetensors.torch import load_file, save_file

    module = make_module("fp8-32x32-swiglu")
    save_file(module.state_dict(), tmp_path / "experts.safetensors")
    fresh = FP8Experts(E, H, I, block=(32, 32))
    fresh.load_state_dict(load_file(tmp_path / "experts.safetensors"))
    for name, t in module.state_dict().items():
        assert torch.equal(fresh.state_dict()[name].view(torch.uint8), t.view(torch.uint8)), name


def test_dtype_cast_keeps_quantized_storage():
    module = make_module("fp4-gpt-oss-bias")
    hidden = torch.randn(3, H)
    ids, weights = routing("random", 3, 2)
    # What the cast may change: the biases (float32 -> float16), nothing else.
    expected = FP4Experts.from_quantized(
        module.gate_up_proj.clone(), module.gate_up_proj_scale.clone(), module.down_proj.clone(),
        module.down_proj_scale.clone(), module.gate_up_proj_bias.half(), module.down_proj_bias.half(),
    )(hidden, ids, weights)
    module.to(torch.float16)
    assert module.gate_up_proj.dtype == torch.uint8
    assert module.down_proj_scale.dtype == torch.float8_e8m0fnu
    assert module.gate_up_proj_bias.dtype == torch.float16
    assert torch.equal(module(hidden, ids, weights), expected)


def test_from_quantized_wraps_storage_exactly():
    module = make_module("fp4-gpt-oss-bias")
    wrapped = FP4Experts.from_quantized(
        module.gate_up_proj.view(torch.int8), module.gate_up_proj_scale.view(torch.uint8),
        module.down_proj, module.down_proj_scale, module.gate_up_proj_bias, module.down_proj_bias,
    )
    assert wrapped.gate_up_proj.data_ptr() == module.gate_up_proj.data_ptr()
    hidden = torch.randn(4, H)
    ids, weights = routing("random", 4, 3)
    assert torch.equal(wrapped(hidden, ids, weights), module(hidden, ids, weights))


def test_extra_repr_is_one_line():
    text = repr(make_module("fp8-128x128-f32-gpt-oss-bias"))
    assert "\n" not in text and "block=(128, 128)" in text and "activation=gpt-oss" in text


# --------------------------------------------------------------------------- #
# errors
# --------------------------------------------------------------------------- #


def test_forward_argument_errors():
    module = make_module("fp4-swiglu")
    hidden = torch.randn(3, H)
    ids, weights = routing("random", 3, 2)
    with pytest.raises(ValueError, match=r"hidden: expected a float \[T, 64\]"):
        module(hidden[:, :32], ids, weights)
    with pytest.raises(TypeError, match=r"expert_ids: expected an integer dtype"):
        module(hidden, ids.float(), weights)
    with pytest.raises(ValueError, match=r"expert_ids: expected shape \[T, k\] with T = 3"):
        module(hidden, ids[:2], weights)
    with pytest.raises(ValueError, match=r"routing_weights: expected shape \[3, 2\]"):
        module(hidden, ids, weights[:, :1])
    with pytest.raises(TypeError, match=r"routing_weights: expected a floating-point"):
        module(hidden, ids, ids)
    bad = ids.clone()
    bad[2, 1] = E
    with pytest.raises(ValueError, match=r"expert_ids: expected values in \[0, 6\), got 6 at index \[2, 1\]"):
        module(hidden, bad, weights)
    bad[2, 1] = -1
    with pytest.raises(ValueError, match=r"got -1 at index \[2, 1\]"):
        module(hidden, bad, weights)


def test_constructor_errors():
    with pytest.raises(ValueError, match=r"activation: expected one of"):
        FP4Experts(E, H, I, activation="gelu")
    with pytest.raises(ValueError, match=r"intermediate_size: expected a positive int"):
        FP8Experts(E, H, 0)
    with pytest.raises(TypeError, match=r"scale_dtype"):
        FP8Experts(E, H, I, scale_dtype=torch.float16)


def test_from_quantized_errors_assign_nothing():
    module = make_module("fp4-gpt-oss-bias")
    args = [module.gate_up_proj, module.gate_up_proj_scale, module.down_proj, module.down_proj_scale]
    with pytest.raises(ValueError, match=r"experts.down_proj_scale: expected shape \[6, 64, 2\], got \[6, 64, 1\]"):
        FP4Experts.from_quantized(*args[:3], args[3][:, :, :1])
    with pytest.raises(TypeError, match=r"experts.gate_up_proj: expected dtype in"):
        FP4Experts.from_quantized(args[0].float(), *args[1:])
    bad_scale = args[3].view(torch.uint8).clone()
    bad_scale[2, 5, 1] = 255
    with pytest.raises(ValueError, match=r"down_proj\[2\]_scale: found NaN e8m0 code 255 at index \[5, 1\]"):
        FP4Experts.from_quantized(*args[:3], bad_scale)
    with pytest.raises(ValueError, match=r"gate_up_proj_bias: expected shape \[6, 96\]"):
        FP4Experts.from_quantized(*args, module.gate_up_proj_bias[:, :3], module.down_proj_bias)


def test_load_state_dict_rejects_nan_codes_before_assigning():
    module = make_module("fp8-32x32-swiglu")
    target = make_module("fp8-32x32-swiglu", seed=5)
    state = module.state_dict()
    state["down_proj"] = state["down_proj"].view(torch.uint8).clone()
    state["down_proj"][3, 10, 7] = 0x7F
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"down_proj\[3\]: found NaN e4m3 code 0x7F/0xFF at index \[10, 7\]"):
        target.load_state_dict(state)
    for name, t in target.state_dict().items():
        assert torch.equal(t.view(torch.uint8), before[name].view(torch.uint8)), name
