"""FP8Linear / FP4Linear / BF16Linear: numerics, construction, state dicts, gradients."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from torch import nn

from torch_bq.testing import assert_linear_close
from torch_bq import formats
from torch_bq.nn import BF16Linear, FP4Linear, FP8Linear

FP8_OPTIONS = [
    dict(block=(32, 32)),
    dict(block=(128, 128), scale_dtype=torch.float32),
    dict(block=(1, 32)),
]


def _linear(k, n, bias=True, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.mul_(3.0)  # a spread of block scales
    return lin


def _decoded(module):
    """The weight the op multiplies, decoded independently of the module."""
    if isinstance(module, FP8Linear):
        return formats.dequantize_fp8(module.weight, module.weight_scale, module.block, torch.float32)
    if isinstance(module, FP4Linear):
        return formats.dequantize_fp4(module.weight, module.weight_scale, module.in_features, torch.float32)
    return module.weight.to(torch.bfloat16).float()


def _activation(module, x):
    if getattr(module, "act_quant", False):
        return formats.qdq_fp8(x, module.act_peak).float()
    return x.to(torch.bfloat16).float()


def _bytes(t):
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t.contiguous().view(torch.uint8)


# --------------------------------------------------------------------------- #
# numerics
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("act_quant", [True, False])
@pytest.mark.parametrize(
    "make",
    [
        *[lambda lin, aq, o=o: FP8Linear.from_linear(lin, act_quant=aq, **o) for o in FP8_OPTIONS],
        lambda lin, aq: FP4Linear.from_linear(lin, act_quant=aq),
        lambda lin, aq: BF16Linear.from_linear(lin),
        lambda lin, aq: BF16Linear.from_linear(lin, keep_fp32=True),
    ],
    ids=["fp8-32x32", "fp8-128x128-f32", "fp8-1x32", "fp4", "bf16", "fp32w"],
)
def test_forward_matches_fp64_reference(make, act_quant):
    lin = _linear(133, 45)  # K, N not block multiples
    module = make(lin, act_quant)
    x = torch.randn(2, 5, 133) * 4
    y = module(x)
    assert y.dtype == x.dtype and y.shape == (2, 5, 45)
    assert_linear_close(y, _activation(module, x), _decoded(module), module.bias)


@pytest.mark.parametrize("cls", [FP8Linear, FP4Linear])
def test_forward_equals_dequantize_plus_f_linear(cls):
    # Without activation quantization the module is exactly a linear on the decoded weight.
    lin = _linear(96, 40)
    module = cls.from_linear(lin, act_quant=False)
    dense = module.dequantize()
    assert isinstance(dense, nn.Linear) and dense.weight.dtype == torch.bfloat16
    x = torch.randn(7, 96)
    y = module(x)
    assert_linear_close(y, x.bfloat16().float(), dense.weight.float(), module.bias)
    # the decoded weight is the exact dequantization, bit for bit; the bf16 Linear's bias is rounded
    assert torch.equal(dense.weight.float(), _decoded(module))
    assert torch.equal(dense.bias, module.bias.bfloat16())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("cls", [FP8Linear, FP4Linear, BF16Linear])
def test_output_dtype_follows_input(cls, dtype):
    module = cls.from_linear(_linear(64, 16))
    x = torch.randn(3, 64, dtype=dtype)
    y = module(x)
    assert y.dtype == dtype
    # the float64 path is the float32 op result widened, not a different computation
    if dtype == torch.float64:
        assert torch.equal(y, module(x.float()).double())


def test_zero_rows_and_odd_k_fp4():
    lin = _linear(33, 8)
    module = FP4Linear.from_linear(lin)
    assert module.in_features == 33 and module.weight.shape == (8, 17)
    assert module(torch.randn(0, 33)).shape == (0, 8)
    x = torch.randn(4, 33)
    assert_linear_close(module(x), _activation(module, x), _decoded(module), module.bias)


@given(
    k=st.integers(1, 80),
    n=st.integers(1, 40),
    m=st.integers(0, 4),
    fmt=st.sampled_from(["fp8", "fp8-1x32", "fp4"]),
    seed=st.integers(0, 2**16),
)
def test_forward_property(k, n, m, fmt, seed):
    lin = _linear(k, n, seed=seed)
    module = (
        FP4Linear.from_linear(lin) if fmt == "fp4"
        else FP8Linear.from_linear(lin, block=(1, 32) if fmt == "fp8-1x32" else (32, 32))
    )
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 10
    assert_linear_close(module(x), _activation(module, x), _decoded(module), module.bias)


# --------------------------------------------------------------------------- #
# construction, devices, casts
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("cls", [FP8Linear, FP4Linear, BF16Linear])
def test_meta_construction_then_assign_load(cls):
    real = cls.from_linear(_linear(70, 30))
    with torch.device("meta"):
        skeleton = cls(70, 30, bias=True)
    assert skeleton.weight.is_meta
    skeleton.load_state_dict(real.state_dict(), assign=True)
    assert not skeleton.weight.is_meta
    x = torch.randn(3, 70)
    assert torch.equal(skeleton(x), real(x))


def test_meta_to_empty_keeps_storage_dtypes():
    module = FP8Linear(64, 64, device="meta", scale_dtype=torch.float32)
    module.to_empty(device="cpu")
    assert module.weight.dtype == torch.float8_e4m3fn and module.weight_scale.dtype == torch.float32


@pytest.mark.parametrize("cls", [FP8Linear, FP4Linear])
def test_fresh_module_is_zero_weight_unit_scale(cls):
    module = cls(40, 8, bias=True)
    assert torch.equal(_decoded(module), torch.zeros(8, 40))
    assert torch.equal(module(torch.randn(2, 40)), torch.zeros(2, 8))


@pytest.mark.parametrize("cast", ["to-bf16", "half", "float", "double"])
def test_module_wide_casts_leave_quantized_storage_alone(cast):
    model = nn.Sequential(
        FP8Linear.from_linear(_linear(64, 32), block=(128, 128), scale_dtype=torch.float32),
        FP4Linear.from_linear(_linear(32, 16)),
    )
    before = {k: v.clone() for k, v in model.state_dict().items()}
    {"to-bf16": lambda: model.to(torch.bfloat16), "half": model.half, "float": model.float, "double": model.double}[cast]()
    after = model.state_dict()
    for key in ("0.weight", "0.weight_scale", "1.weight", "1.weight_scale"):
        assert after[key].dtype == before[key].dtype
        assert torch.equal(_bytes(after[key]), _bytes(before[key]))
    # the bias follows the cast, as in nn.Linear
    assert after["0.bias"].dtype == {"to-bf16": torch.bfloat16, "half": torch.float16, "float": torch.float32,
                                     "double": torch.float64}[cast]


def test_bf16_module_storage_and_casts():
    assert BF16Linear.from_linear(_linear(16, 4)).weight.dtype == torch.bfloat16
    assert BF16Linear.from_linear(_linear(16, 4).half(), keep_fp32=True).weight.dtype == torch.float32
    module = BF16Linear.from_linear(_linear(16, 4), keep_fp32=True)
    module.half()
    assert module.weight.dtype == torch.float32
    assert "fp32w" in repr(module)


@pytest.mark.parametrize(
    "module, expected",
    [
        (FP8Linear(64, 32), "format=fp8, block=(32, 32), scale=e8m0, act_quant=fp8(peak=224)"),
        (FP8Linear(64, 32, block=(128, 128), scale_dtype=torch.float32, act_quant=False),
         "format=fp8, block=(128, 128), scale=f32, act_quant=off"),
        (FP4Linear(64, 32, act_peak=448.0), "format=fp4, block=(1, 32), act_quant=fp8(peak=448)"),
        (BF16Linear(64, 32), "format=bf16"),
    ],
)
def test_extra_repr_is_one_short_line(module, expected):
    r = module.extra_repr()
    assert "\n" not in r and r.endswith(expected) and r.startswith("in_features=64, out_features=32")


def test_buffers_not_parameters():
    module = FP8Linear.from_linear(_linear(32, 8))
    assert list(module.parameters()) == []
    assert set(module.state_dict()) == {"weight", "weight_scale", "bias", "_extra_state"}


# --------------------------------------------------------------------------- #
# constructor errors
# --------------------------------------------------------------------------- #


def test_constructor_errors():
    with pytest.raises(ValueError, match="in_features"):
        FP8Linear(-1, 4)  # 0 is allowed, as for nn.Linear
    with pytest.raises(TypeError, match="scale_dtype"):
        FP8Linear(32, 4, scale_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="act_peak"):
        FP4Linear(32, 4, act_peak=500.0)
    with pytest.raises(TypeError, match="dtype"):
        BF16Linear(32, 4, dtype=torch.float16)
    with pytest.raises(ValueError, match="block"):
        FP8Linear(32, 4, block=(0, 32))


def test_from_linear_errors():
    with pytest.raises(TypeError, match="nn.Linear"):
        FP8Linear.from_linear(nn.Conv1d(3, 3, 1))
    with pytest.raises(ValueError, match="meta"):
        FP4Linear.from_linear(nn.Linear(8, 8, device="meta"))
    lin = _linear(32, 4)
    with torch.no_grad():
        lin.weight[1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"w: expected finite values, got nan at index \[1, 2\]"):
        FP8Linear.from_linear(lin)


def test_from_quantized_rejects_nan_codes_with_index():
    data, scale = formats.quantize_fp8(torch.randn(64, 64))
    bad = data.view(torch.uint8).clone()
    bad[40, 3] = 0x7F
    with pytest.raises(ValueError, match=r"layer.w: found NaN e4m3 code 0x7F/0xFF at index \[40, 3\]"):
        FP8Linear.from_quantized(bad, scale, name="layer.w")
    bad_scale = scale.view(torch.uint8).clone()
    bad_scale[1, 0] = 255
    with pytest.raises(ValueError, match=r"weight_scale: found NaN e8m0 code 255 at index \[1, 0\]"):
        FP8Linear.from_quantized(data, bad_scale)
    packed, s4 = formats.quantize_fp4(torch.randn(4, 33))
    packed = packed.clone()
    packed[2, -1] |= 0x30  # the padding nibble of odd K
    with pytest.raises(ValueError, match=r"padding nibble .* at index \[2, 16\]"):
        FP4Linear.from_quantized(packed, s4, in_features=33)


def test_from_quantized_shape_and_dtype_errors():
    data, scale = formats.quantize_fp8(torch.randn(64, 64))
    with pytest.raises(ValueError, match=r"weight_scale: expected shape \[1, 1\]"):
        FP8Linear.from_quantized(data, scale, block=(64, 64 * 2))
    with pytest.raises(TypeError, match="weight: expected dtype"):
        FP8Linear.from_quantized(data.float(), scale)
    with pytest.raises(ValueError, match=r"bias: expected shape \[64\]"):
        FP8Linear.from_quantized(data, scale, torch.zeros(3))
    packed, s4 = formats.quantize_fp4(torch.randn(4, 64))
    with pytest.raises(ValueError, match="weight_scale: expected shape"):
        FP4Linear.from_quantized(packed, s4[:, :1])


# --------------------------------------------------------------------------- #
# state dicts
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    "module",
    [
        FP8Linear.from_linear(_linear(100, 36)),
        FP8Linear.from_linear(_linear(100, 36), block=(128, 128), scale_dtype=torch.float32),
        FP8Linear.from_linear(_linear(100, 130), block=(96, 96)),
        FP8Linear.from_linear(_linear(100, 130), block=(48, 32), scale_dtype=torch.float32),
        FP4Linear.from_linear(_linear(101, 36)),
        BF16Linear.from_linear(_linear(100, 36)),
    ],
    ids=["fp8", "fp8-f32", "fp8-96x96", "fp8-48x32-f32", "fp4", "bf16"],
)
def test_state_dict_round_trip_through_safetensors_is_exact(module, tmp_path):
    save_file(module.state_dict(), tmp_path / "m.safetensors")
    loaded = load_file(tmp_path / "m.safetensors")
    fresh = type(module)(
        module.in_features, module.out_features, True, device="meta",
        **({"block": module.block, "scale_dtype": module.weight_scale.dtype} if isinstance(module, FP8Linear) else {}),
    )
    fresh.load_state_dict(loaded, assign=True)
    for key, value in module.state_dict().items():
        got = fresh.state_dict()[key]
        assert got.dtype == value.dtype and torch.equal(_bytes(got), _bytes(value)), key
    x = torch.randn(3, module.in_features)
    assert torch.equal(fresh(x), module(x))


@pytest.mark.parametrize("alias", ["weight_scale_inv", "scale"])
def test_fp8_state_dict_aliases(alias):
    src = FP8Linear.from_linear(_linear(256, 256), block=(128, 128), scale_dtype=torch.float32)
    sd = {"weight": src.weight.view(torch.uint8), alias: src.weight_scale, "bias": src.bias}
    dst = FP8Linear(256, 256, bias=True, block=(128, 128), scale_dtype=torch.float32)
    dst.load_state_dict(sd)  # copy into existing storage, uint8 bytes accepted
    assert torch.equal(dst.weight.view(torch.uint8), src.weight.view(torch.uint8))
    assert torch.equal(dst.weight_scale, src.weight_scale)


def test_fp4_state_dict_accepts_int8_data_and_uint8_scale_alias():
    src = FP4Linear.from_linear(_linear(64, 8))
    sd = {"weight": src.weight.view(torch.int8), "scale": src.weight_scale.view(torch.uint8), "bias": src.bias}
    dst = FP4Linear(64, 8, bias=True)
    dst.load_state_dict(sd)
    assert torch.equal(dst.weight, src.weight) and dst.weight_scale.dtype == torch.float8_e8m0fnu
    assert torch.equal(dst.weight_scale.view(torch.uint8), src.weight_scale.view(torch.uint8))


def test_state_dict_errors_leave_module_untouched():
    src = FP8Linear.from_linear(_linear(64, 64))
    dst = FP8Linear.from_linear(_linear(64, 64, seed=1))
    before = {k: _bytes(v).clone() for k, v in dst.state_dict().items()}

    def unchanged():
        return all(torch.equal(_bytes(v), before[k]) for k, v in dst.state_dict().items())

    # two names for the scale
    sd = {"weight": src.weight, "weight_scale": src.weight_scale, "scale": src.weight_scale, "bias": src.bias}
    with pytest.raises(RuntimeError, match="more than one name"):
        dst.load_state_dict(sd)
    assert unchanged()
    # NaN code in the weight: reported with its index, nothing assigned (not even the bias)
    bad = src.weight.view(torch.uint8).clone()
    bad[5, 6] = 0xFF
    with pytest.raises(RuntimeError, match=r"found NaN e4m3 code 0x7F/0xFF at index \[5, 6\]"):
        dst.load_state_dict({"weight": bad, "weight_scale": src.weight_scale, "bias": src.bias * 2})
    assert unchanged()
    # float32 scales into an e8m0 module without assign
    f32 = formats.decode_e8m0(src.weight_scale)
    with pytest.raises(RuntimeError, match="scale_dtype=torch.float32 or load with assign=True"):
        dst.load_state_dict({"weight": src.weight, "weight_scale": f32, "bias": src.bias})
    assert unchanged()
    # wrong scale shape
    with pytest.raises(RuntimeError, match="weight_scale: expected shape"):
        dst.load_state_dict({"weight": src.weight, "weight_scale": src.weight_scale[:1], "bias": src.bias})
    assert unchanged()
    # wrong weight shape with the module's (right) scale: the weight is named, not the scale
    with pytest.raises(RuntimeError, match=r"\tweight: expected shape \[64, 64\], got \[32, 64\]"):
        dst.load_state_dict({"weight": src.weight[:32], "weight_scale": src.weight_scale, "bias": src.bias})
    assert unchanged()
    fp4 = FP4Linear.from_linear(_linear(64, 64))
    with pytest.raises(RuntimeError, match=r"\tweight: expected shape \[64, 32\], got \[32, 32\]"):
        fp4.load_state_dict({"weight": fp4.weight[:32], "weight_scale": fp4.weight_scale})


def test_assign_load_may_change_scale_dtype():
    src = FP8Linear.from_linear(_linear(64, 64))
    dst = FP8Linear(64, 64, bias=True, device="meta")
    f32 = formats.decode_e8m0(src.weight_scale)
    dst.load_state_dict({"weight": src.weight, "weight_scale": f32, "bias": src.bias}, assign=True)
    assert dst.weight_scale.dtype == torch.float32
    x = torch.randn(2, 64)
    assert torch.equal(dst(x), src(x))


# --------------------------------------------------------------------------- #
# gradients
# --------------------------------------------------------------------------- #


def _integer_linear(k, n):
    # Weights j/16 and biases j/4 with |j| <= 6 are exact in e4m3, e2m1 * e8m0 and bf16,
    # so with small-integer inputs every forward sum is exact in float32 and qdq is
    # the identity around each point (|x| <= 8 keeps x / 2**-4 an e4m3 value). The
    # forward is then exactly the dequantized matmul, and gradcheck's central
    # differences with eps = 1 are exact: atol = rtol = 0.
    torch.manual_seed(0)
    lin = nn.Linear(k, n)
    with torch.no_grad():
        lin.weight.copy_(torch.randint(-6, 7, (n, k)) / 16)
        lin.bias.copy_(torch.randint(-6, 7, (n,)) / 4)
    return lin


@pytest.mark.parametrize(
    "make",
    [
        lambda lin: FP8Linear.from_linear(lin),
        lambda lin: FP4Linear.from_linear(lin),
        lambda lin: BF16Linear.from_linear(lin),
    ],
    ids=["fp8", "fp4", "bf16"],
)
def test_gradcheck_input_gradient_float64(make):
    module = make(_integer_linear(40, 12))  # K = 40: one full and one partial 32-block
    x = torch.randint(-7, 8, (1, 2, 40), dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(module, (x,), eps=1.0, atol=0.0, rtol=0.0)


@pytest.mark.parametrize(
    "make",
    [
        lambda lin: FP8Linear.from_linear(lin),
        lambda lin: FP8Linear.from_linear(lin, block=(128, 128), scale_dtype=torch.float32),
        lambda lin: FP4Linear.from_linear(lin),
        lambda lin: BF16Linear.from_linear(lin),
        lambda lin: BF16Linear.from_linear(lin, keep_fp32=True),
    ],
    ids=["fp8", "fp8-f32", "fp4", "bf16", "fp32w"],
)
def test_input_gradient_is_grad_times_dequantized_weight(make, monkeypatch):
    from torch_bq.reference import linear as ref

    monkeypatch.setattr(ref, "SLAB_BYTES", 128 * 150 * 4)  # several slabs (128 rows each) in the backward
    module = make(_linear(150, 300))
    x = torch.randn(4, 150, requires_grad=True)
    y = module(x)
    g = torch.randn_like(y)
    y.backward(g)
    w = _decoded(module).double()
    expected = g.double() @ w
    # float32 sum of N products per element: bound (N + 1) * 2**-24 * (|g| @ |W|)
    bound = (w.shape[0] + 1) * 2.0**-24 * (g.double().abs() @ w.abs()) + 2.0**-126
    assert x.grad.dtype == torch.float32
    assert bool(((x.grad.double() - expected).abs() <= bound).all())


def test_bias_gradient_when_requested_and_weights_never_get_one():
    module = FP8Linear.from_linear(_linear(64, 8))
    bias = module.bias.clone().requires_grad_()
    x = torch.randn(5, 64, requires_grad=True)
    from torch_bq import ops

    y = ops.fp8_linear(x, module.weight, module.weight_scale, bias, out_dtype=torch.float32)
    y.sum().backward()
    assert torch.allclose(bias.grad, torch.full((8,), 5.0))
    assert not module.weight.requires_grad


def test_lora_style_adapter_trains_on_top():
    torch.manual_seed(0)
    base = FP4Linear.from_linear(_linear(32, 16))
    lora_a = nn.Linear(32, 4, bias=False)
    lora_b = nn.Linear(4, 16, bias=False)
    x = torch.randn(8, 32, requires_grad=True)
    loss = (base(x) + lora_b(lora_a(x))).square().sum()
    loss.backward()
    assert lora_a.weight.grad is not None and lora_b.weight.grad is not None
    assert x.grad is not None and bool(x.grad.abs().sum() > 0)


def test_state_dict_errors_name_the_submodule():
    model = nn.Sequential(nn.Identity(), FP8Linear(64, 64))
    sd = {"1.weight": torch.zeros(64, 64, dtype=torch.float8_e4m3fn), "1.weight_scale": torch.zeros(1, 1, dtype=torch.uint8)}
    with pytest.raises(RuntimeError, match=r"1.weight_scale: expected shape \[2, 2\]"):
        model.load_state_dict(sd)


# --------------------------------------------------------------------------- #
# the block is part of the state; bias dtypes agree
# --------------------------------------------------------------------------- #


def test_state_dict_from_another_block_fails_loudly():
    # 128 x 128 gives a 2 x 2 scale grid with 96x96 and with 64x64 blocks alike, so shapes
    # alone cannot tell; before the block was recorded this loaded and decoded another weight.
    src = FP8Linear.from_linear(_linear(128, 128), block=(96, 96))
    state = src.state_dict()
    assert state["_extra_state"].tolist() == [96, 96]
    for assign in (False, True):
        dst = FP8Linear(128, 128, bias=True, block=(64, 64))
        before = {k: _bytes(v).clone() for k, v in dst.state_dict().items() if k != "_extra_state"}
        with pytest.raises(RuntimeError, match=r"saved with block \(96, 96\) but this module has block \(64, 64\)"):
            dst.load_state_dict(state, assign=assign)
        assert all(torch.equal(_bytes(dst.state_dict()[k]), v) for k, v in before.items())
    same = FP8Linear(128, 128, bias=True, block=(96, 96))
    same.load_state_dict(state)
    x = torch.randn(3, 128)
    assert torch.equal(same(x), src(x))


def test_block_survives_safetensors_and_old_state_dicts_still_load(tmp_path):
    src = FP8Linear.from_linear(_linear(128, 96), block=(96, 96))
    save_file(src.state_dict(), tmp_path / "m.safetensors")
    loaded = load_file(tmp_path / "m.safetensors")
    with pytest.raises(RuntimeError, match="saved with block"):
        FP8Linear(128, 96, bias=True, block=(64, 64)).load_state_dict(loaded)
    # A state dict without the record (another library's, or written before it existed) loads on shapes.
    del loaded["_extra_state"]
    dst = FP8Linear(128, 96, bias=True, block=(96, 96))
    dst.load_state_dict(loaded)
    assert torch.equal(_bytes(dst.weight_scale), _bytes(src.weight_scale))


def test_experts_record_their_block():
    from torch_bq.nn import FP8Experts

    g = torch.Generator().manual_seed(0)
    # H = 128, I = 64: both blocks give [2, 2, 2] gate_up and [2, 2, 1] down scale grids.
    src = FP8Experts.from_weights(torch.randn(2, 128, 128, generator=g), torch.randn(2, 128, 64, generator=g),
                                  block=(96, 96))
    dst = FP8Experts(2, 128, 64, block=(64, 64))
    assert dst.gate_up_proj_scale.shape == src.gate_up_proj_scale.shape
    with pytest.raises(RuntimeError, match=r"saved with block \(96, 96\)"):
        dst.load_state_dict(src.state_dict())


@pytest.mark.parametrize("cls", [FP8Linear, FP4Linear])
def test_constructor_and_from_linear_agree_on_the_bias(cls):
    lin = _linear(96, 40)  # float32 bias whose values bf16 cannot hold
    built = cls.from_linear(lin)
    fresh = cls(96, 40, bias=True)
    assert fresh.bias.dtype == built.bias.dtype == torch.float32
    fresh.load_state_dict(built.state_dict())
    x = torch.randn(5, 96)
    assert torch.equal(fresh(x), built(x))


def test_loading_a_bias_the_module_would_round_is_refused():
    built = FP8Linear.from_linear(_linear(96, 40))
    narrow = FP8Linear(96, 40, bias=True, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="bias: this module stores a torch.bfloat16 bias"):
        narrow.load_state_dict(built.state_dict())
    narrow.load_state_dict(built.state_dict(), assign=True)  # assign takes the float32 bias as is
    assert narrow.bias.dtype == torch.float32
    exact = {k: v for k, v in built.state_dict().items()}
    exact["bias"] = exact["bias"].to(torch.bfloat16).to(torch.float32)  # representable: copied
    FP8Linear(96, 40, bias=True, dtype=torch.bfloat16).load_state_dict(exact)
