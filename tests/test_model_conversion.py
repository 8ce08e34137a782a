"""quantize_ / load_quantized_ / empty_model on whole models: fused experts, tied weights, partial loads, skeletons.

The experts modules here are written like transformers' fused ones (3-D
``gate_up_proj``/``down_proj``, ``is_transposed``, ``is_concatenated``), so these
tests need no transformers; tests/test_hf.py runs the real classes.
"""

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from torch_bq import formats
from torch_bq.nn import (
    FP4Experts,
    FP8Experts,
    FP8Linear,
    UnfilledModuleError,
    convert_checkpoint,
    empty_model,
    load_quantized_,
    quantize_,
)
from torch_bq.nn.experts import GPT_OSS_ALPHA, GPT_OSS_LIMIT, experts_spec


class SwiGLUExperts(nn.Module):
    """Like DeepseekV3Experts: [E, 2I, H] / [E, H, I], rows [gate; up], F.linear."""

    is_transposed, is_concatenated = False, True

    def __init__(self, e=4, h=64, i=32):
        super().__init__()
        self.config = type("C", (), {"hidden_act": "silu"})()
        self.gate_up_proj = nn.Parameter(torch.randn(e, 2 * i, h) * 0.1)
        self.down_proj = nn.Parameter(torch.randn(e, h, i) * 0.1)

    def forward(self, x, ids, w):
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for j in range(ids.shape[1]):
                gate, up = F.linear(x[t], self.gate_up_proj[ids[t, j]]).chunk(2)
                out[t] += w[t, j] * F.linear(F.silu(gate) * up, self.down_proj[ids[t, j]])
        return out


class ClampedExperts(nn.Module):
    """Like GptOssExperts: [E, H, 2I] / [E, I, H] (x @ w), interleaved gate/up, biases."""

    is_transposed, is_concatenated = True, False
    alpha, limit = GPT_OSS_ALPHA, GPT_OSS_LIMIT

    def __init__(self, e=4, h=64, i=32):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(e, h, 2 * i) * 0.1)
        self.gate_up_proj_bias = nn.Parameter(torch.randn(e, 2 * i) * 0.1)
        self.down_proj = nn.Parameter(torch.randn(e, i, h) * 0.1)
        self.down_proj_bias = nn.Parameter(torch.randn(e, h) * 0.1)


class MoE(nn.Module):
    def __init__(self, experts):
        super().__init__()
        self.embed_tokens = nn.Embedding(16, 64)
        self.router = nn.Linear(64, 4, bias=False)
        self.experts = experts
        self.lm_head = nn.Linear(64, 16, bias=False)

    def forward(self, ids):
        h = self.embed_tokens(ids).reshape(-1, 64)
        w, e = torch.topk(self.router(h).softmax(-1), 2)
        return self.lm_head(self.experts(h, e, w))


def test_experts_spec_reads_both_orientations_and_refuses_other_activations():
    assert experts_spec(SwiGLUExperts()) == experts_spec(SwiGLUExperts())
    s = experts_spec(SwiGLUExperts())
    assert (s.num_experts, s.hidden_size, s.intermediate_size, s.activation, s.transposed) == (4, 64, 32, "swiglu", False)
    c = experts_spec(ClampedExperts())
    assert (c.hidden_size, c.intermediate_size, c.activation, c.transposed, c.bias) == (64, 32, "gpt-oss", True, True)
    gelu = SwiGLUExperts()
    gelu.config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        experts_spec(gelu, "model.layers.0.mlp.experts")
    odd = ClampedExperts()
    odd.limit = 10.0
    with pytest.raises(ValueError, match="alpha=1.702, limit=10.0"):
        experts_spec(odd)
    assert experts_spec(nn.Linear(3, 4)) is None


def test_from_weights_takes_transformers_orientation_or_names_the_transpose():
    m = ClampedExperts()
    a = FP4Experts.from_weights(m.gate_up_proj.detach(), m.down_proj.detach(), transposed=True)
    b = FP4Experts.from_weights(m.gate_up_proj.detach().transpose(1, 2), m.down_proj.detach().transpose(1, 2))
    for key in a.state_dict():
        assert torch.equal(a.state_dict()[key].view(torch.uint8), b.state_dict()[key].view(torch.uint8)), key
    with pytest.raises(ValueError, match=r"\[E, K, N\] \(transformers' GptOssExperts layout.*pass transposed=True"):
        FP8Experts.from_weights(m.gate_up_proj.detach(), m.down_proj.detach())


@pytest.mark.parametrize("experts, fmt, cls", [(SwiGLUExperts, "fp8", FP8Experts), (ClampedExperts, "fp4", FP4Experts)])
def test_quantize_replaces_fused_experts_and_keeps_the_router(experts, fmt, cls):
    torch.manual_seed(0)
    model = MoE(experts())
    spec = experts_spec(model.experts)
    gate_up = model.experts.gate_up_proj.detach().clone()
    report = quantize_(model, fmt)
    assert isinstance(model.experts, cls) and report.experts == ["experts"]
    assert type(model.router) is nn.Linear and type(model.lm_head) is nn.Linear  # excluded by default
    assert sorted(report.skipped) == ["lm_head", "router"]
    assert model.experts.activation == spec.activation
    # the stored bytes are the quantizer's output for transformers' weights, oriented [E, N, K]
    w = gate_up.transpose(1, 2) if spec.transposed else gate_up
    q = formats.quantize_fp8(w[2]) if fmt == "fp8" else formats.quantize_fp4(w[2])
    assert torch.equal(model.experts.gate_up_proj[2].view(torch.uint8), q[0].view(torch.uint8))
    assert model(torch.tensor([[1, 2, 3]])).shape == (3, 16)


def test_quantize_matches_the_float_experts_forward():
    torch.manual_seed(1)
    float_experts = SwiGLUExperts()
    model = MoE(float_experts)
    x, ids, w = torch.randn(5, 64), torch.randint(0, 4, (5, 2)), torch.rand(5, 2)
    ref = float_experts(x, ids, w)
    quantize_(model, "fp8", act_quant=False)
    got = model.experts(x, ids, w)
    # fp8 weights with 32x32 e8m0 blocks: relative error per weight <= 2^-4; the output's
    # error is far below its norm (SQNR of a few hundred times, > 20 dB)
    assert (got - ref).norm() < 0.1 * ref.norm()


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(32, 64)
        self.proj = nn.Linear(64, 64)
        self.lm_head = nn.Linear(64, 32, bias=False)
        self.lm_head.weight = self.embed_tokens.weight

    def forward(self, ids):
        return self.lm_head(torch.relu(self.proj(self.embed_tokens(ids))))


def test_quantize_keeps_ties_and_counts_unique_bytes():
    model = Tied()
    report = quantize_(model, "fp8", exclude=None)  # nothing excluded by name: the tie still holds lm_head back
    assert report.converted == ["proj"] and report.skip_reasons["lm_head"].startswith("tied")
    assert model.lm_head.weight is model.embed_tokens.weight
    # a filter_fn that names lm_head quantizes it (and unties it): its bytes count once
    model = Tied()
    report = quantize_(model, "fp8", filter_fn=lambda m, n: True)
    assert isinstance(model.lm_head, FP8Linear) and type(model.embed_tokens) is nn.Embedding
    assert report.bytes_before == (64 * 64 + 64 + 32 * 64) * 4


def test_load_quantized_fills_tied_weights_once(tmp_path):
    model = Tied()
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # as HF saves a tied model
    save_file(state, tmp_path / "float.safetensors")
    convert_checkpoint(tmp_path / "float.safetensors", tmp_path / "q", "fp8", progress=None)
    skeleton = empty_model(Tied)
    assert skeleton.lm_head.weight is skeleton.embed_tokens.weight and skeleton.proj.weight.is_meta
    report = load_quantized_(skeleton, tmp_path / "q")
    assert report.missing == [] and isinstance(skeleton.proj, FP8Linear)
    assert skeleton.lm_head.weight is skeleton.embed_tokens.weight
    assert torch.equal(skeleton.lm_head.weight, model.embed_tokens.weight)


def test_partial_load_lists_unfilled_modules_and_calling_them_raises(tmp_path):
    model = Tied()
    state = {k: v for k, v in model.state_dict().items() if not k.startswith(("proj.", "lm_head."))}
    save_file(state, tmp_path / "part.safetensors")
    skeleton = empty_model(Tied)
    with pytest.warns(UserWarning, match=r"1 modules are left on the meta device and raise when called: \['proj'\]"):
        report = load_quantized_(skeleton, tmp_path / "part.safetensors", strict=False)
    assert report.unfilled == ["proj"] and sorted(report.missing) == ["proj.bias", "proj.weight"]
    assert "1 modules left unfilled" in str(report)
    with pytest.raises(UnfilledModuleError, match=r"proj: not loaded: \['weight', 'bias'\] still on the meta device"):
        skeleton(torch.tensor([[1, 2]]))
    # filling it later makes it work again
    skeleton.proj.load_state_dict(model.proj.state_dict(), assign=True)
    assert torch.equal(skeleton(torch.tensor([[1, 2]])), model(torch.tensor([[1, 2]])))


class Rotary(nn.Module):
    """A computed (non-persistent) buffer next to weights, like transformers' rotary embedding."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16), persistent=False)
        self.register_buffer("offset", torch.zeros(8))  # persistent: comes from the checkpoint
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x * self.inv_freq + self.offset)


def test_empty_model_computes_non_persistent_buffers_and_puts_weights_on_meta():
    skeleton = empty_model(Rotary)
    assert not skeleton.inv_freq.is_meta and torch.equal(skeleton.inv_freq, Rotary().inv_freq)
    assert skeleton.offset.is_meta and skeleton.proj.weight.is_meta
    # the documented torch.device("meta") recipe leaves it on meta, which is why empty_model exists
    with torch.device("meta"):
        assert Rotary().inv_freq.is_meta
    with pytest.raises(TypeError, match="config_or_class"):
        empty_model(42)


def test_empty_model_then_load_quantized_runs(tmp_path):
    model = Rotary()
    save_file(model.state_dict(), tmp_path / "m.safetensors")
    skeleton = empty_model(Rotary)
    load_quantized_(skeleton, tmp_path / "m.safetensors")
    x = torch.randn(3, 8)
    assert torch.equal(skeleton(x), model(x))


def test_progress_lines_when_asked(tmp_path, capsys):
    model = Tied()
    quantize_(model, "fp8", progress=True)
    assert "quantize_ [1/1] proj" in capsys.readouterr().err
    save_file({k: v for k, v in Tied().state_dict().items() if k != "lm_head.weight"}, tmp_path / "m.safetensors")
    convert_checkpoint(tmp_path / "m.safetensors", tmp_path / "q", "fp8", progress=None)
    load_quantized_(empty_model(Tied), tmp_path / "q", progress=True)
    assert "load_quantized_ [1/1] proj" in capsys.readouterr().err
    quantize_(Tied(), "fp8")  # default: only on a terminal, for long work
    assert capsys.readouterr().err == ""
