"""Loading FP4Experts / FP8Experts from generated gpt-oss and DeepSeek-style checkpoints."""

import json

import pytest
import torch
from safetensors.torch import save_file

import checkpoint_fixtures as fx

from torch_bq.nn import CheckpointError, CheckpointReader, FP4Experts, FP8Experts, MissingTensorError

E, H = 4, 64
PREFIX = "model.layers.0.mlp.experts"


def quantized_module(cls, intermediate, *, bias=False, seed=0, **options):
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(E, 2 * intermediate, H, generator=g) * 0.2
    down = torch.randn(E, H, intermediate, generator=g) * 0.2
    biases = (torch.randn(E, 2 * intermediate, generator=g).to(torch.bfloat16),
              torch.randn(E, H, generator=g).to(torch.bfloat16)) if bias else (None, None)
    return cls.from_weights(gate_up, down, *biases, **options)


def assert_same_module(loaded, expected):
    assert type(loaded) is type(expected) and loaded.activation == expected.activation
    state, want = loaded.state_dict(), expected.state_dict()
    assert state.keys() == want.keys()
    for name, t in want.items():
        assert state[name].dtype == t.dtype, name
        assert torch.equal(state[name].view(torch.uint8), t.view(torch.uint8)), name
    hidden = torch.randn(5, H)
    ids = torch.stack([torch.randperm(E)[:2] for _ in range(5)])
    weights = torch.rand(5, 2)
    assert torch.equal(loaded(hidden, ids, weights), expected(hidden, ids, weights))


# --------------------------------------------------------------------------- #
# fixtures
# --------------------------------------------------------------------------- #


def gpt_oss_tensors(module):
    """gpt-oss's names and shapes: ``_blocks [E, N, K/32, 16]``, ``_scales [E, N, K/32]``, ``_bias``."""
    out = {}
    for proj in ("gate_up_proj", "down_proj"):
        data = getattr(module, proj)
        e, n, half_k = data.shape
        out[f"{PREFIX}.{proj}_blocks"] = data.reshape(e, n, half_k // 16, 16).contiguous()
        out[f"{PREFIX}.{proj}_scales"] = getattr(module, f"{proj}_scale").view(torch.uint8).contiguous()
        if getattr(module, f"{proj}_bias") is not None:
            out[f"{PREFIX}.{proj}_bias"] = getattr(module, f"{proj}_bias").contiguous()
    return out


def deepseek_tensors(module, names=("w1", "w3", "w2"), scale_suffix="scale"):
    """Per-expert ``{p}.{e}.w1/w3/w2.weight`` + scale, split from a fused swiglu module."""
    i = module.intermediate_size
    rows = module.block[0] if isinstance(module, FP8Experts) else 1
    out = {}
    for e in range(E):
        gu, gu_scale = module.gate_up_proj[e], module.gate_up_proj_scale[e]
        parts = {
            names[0]: (gu[:i], gu_scale[: i // rows]),
            names[1]: (gu[i:], gu_scale[i // rows :]),
            names[2]: (module.down_proj[e], module.down_proj_scale[e]),
        }
        for name, (w, s) in parts.items():
            out[f"{PREFIX}.{e}.{name}.weight"] = w.contiguous()
            out[f"{PREFIX}.{e}.{name}.{scale_suffix}"] = s.contiguous()
    return out


# --------------------------------------------------------------------------- #
# loading
# --------------------------------------------------------------------------- #


def test_gpt_oss_sharded_directory(tmp_path):
    expected = quantized_module(FP4Experts, 64, bias=True, activation="gpt-oss")
    tensors = gpt_oss_tensors(expected)
    tensors["model.embed_tokens.weight"] = torch.randn(10, H).to(torch.bfloat16)
    fx.sharded(tmp_path, tensors)
    loaded = FP4Experts.from_checkpoint(tmp_path, PREFIX, layout="gpt-oss")
    assert_same_module(loaded, expected)


def test_gpt_oss_reads_only_the_layer(tmp_path, monkeypatch):
    expected = quantized_module(FP4Experts, 32, bias=True)
    tensors = gpt_oss_tensors(expected)
    tensors["model.layers.1.mlp.experts.gate_up_proj_blocks"] = tensors[f"{PREFIX}.gate_up_proj_blocks"].clone()
    save_file(tensors, tmp_path / "model.safetensors")
    read = []
    for method in ("get", "get_slice"):
        original = getattr(CheckpointReader, method)

        def spy(self, name, *args, _original=original):
            read.append(name)
            return _original(self, name, *args)

        monkeypatch.setattr(CheckpointReader, method, spy)
    FP4Experts.from_checkpoint(tmp_path / "model.safetensors", PREFIX)
    assert read and all(name.startswith(PREFIX + ".") for name in read), sorted(set(read))


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_deepseek_per_expert_scale_layout(tmp_path, fmt):
    if fmt == "fp8":
        expected = quantized_module(FP8Experts, 64, activation="swiglu", block=(32, 32))
    else:
        expected = quantized_module(FP4Experts, 64, activation="swiglu")
    tensors = deepseek_tensors(expected)
    if fmt == "fp4":  # DeepSeek-V4 style stores packed fp4 as int8 and scales as F8_E8M0
        tensors = {k: v.view(torch.int8) if k.endswith(".weight") else v for k, v in tensors.items()}
    cls = FP8Experts if fmt == "fp8" else FP4Experts
    fx.sharded(tmp_path, tensors, shards=3)
    loaded = cls.from_checkpoint(tmp_path, PREFIX, layout="deepseek")
    assert_same_module(loaded, expected)


def test_deepseek_v3_names_with_weight_scale_inv_and_config_block(tmp_path):
    expected = quantized_module(FP8Experts, 128, activation="swiglu", block=(128, 128), scale_dtype=torch.float32)
    tensors = deepseek_tensors(expected, ("gate_proj", "up_proj", "down_proj"), "weight_scale_inv")
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"weight_block_size": [128, 128]}}))
    loaded = FP8Experts.from_checkpoint(tmp_path, PREFIX, layout="deepseek",
                                        projections=("gate_proj", "up_proj", "down_proj"))
    assert loaded.block == (128, 128) and loaded.scale_dtype == torch.float32
    assert_same_module(loaded, expected)


def test_deepseek_from_mapping_with_num_experts_and_options():
    expected = quantized_module(FP8Experts, 64, activation="swiglu", block=(32, 32))
    loaded = FP8Experts.from_checkpoint(deepseek_tensors(expected), PREFIX, num_experts=2, act_quant=False,
                                        act_peak=448.0, device="meta")
    assert loaded.num_experts == 2 and not loaded.act_quant and loaded.act_peak == 448.0
    assert loaded.gate_up_proj.is_meta


# --------------------------------------------------------------------------- #
# errors
# --------------------------------------------------------------------------- #


@pytest.fixture
def gpt_oss_file(tmp_path):
    save_file(gpt_oss_tensors(quantized_module(FP4Experts, 32, bias=True)), tmp_path / "model.safetensors")
    return tmp_path / "model.safetensors"


@pytest.fixture
def deepseek_fp8():
    return deepseek_tensors(quantized_module(FP8Experts, 64, activation="swiglu", block=(32, 32)))


def test_missing_prefix_lists_closest_names(gpt_oss_file, deepseek_fp8):
    with pytest.raises(MissingTensorError, match=r"looked for .*closest names present: .*gate_up_proj_blocks"):
        FP4Experts.from_checkpoint(gpt_oss_file, "model.layers.0.mlp.expert")
    with pytest.raises(MissingTensorError, match=r"model.layers.0.mlp.expert.0.w1: no weight found"):
        FP8Experts.from_checkpoint(deepseek_fp8, "model.layers.0.mlp.expert")


def test_missing_expert_projection(deepseek_fp8):
    del deepseek_fp8[f"{PREFIX}.2.w3.weight"]
    with pytest.raises(MissingTensorError, match=rf"{PREFIX}\.2\.w3: no weight found"):
        FP8Experts.from_checkpoint(deepseek_fp8, PREFIX)


def test_wrong_module_class(gpt_oss_file, deepseek_fp8):
    with pytest.raises(CheckpointError, match=r"gpt-oss layout holds MXFP4 experts; load them with FP4Experts"):
        FP8Experts.from_checkpoint(gpt_oss_file, PREFIX, layout="gpt-oss")
    with pytest.raises(CheckpointError, match=r"0\.w1\.weight: holds fp8 data"):
        FP4Experts.from_checkpoint(deepseek_fp8, PREFIX, layout="deepseek")


def test_expert_with_another_shape(deepseek_fp8):
    other = deepseek_tensors(quantized_module(FP8Experts, 96, activation="swiglu", block=(32, 32)))
    for name in ("w1", "w3"):
        for suffix in ("weight", "scale"):
            deepseek_fp8[f"{PREFIX}.1.{name}.{suffix}"] = other[f"{PREFIX}.1.{name}.{suffix}"]
    with pytest.raises(CheckpointError, match=rf"{PREFIX}\.1\.w1\.weight: out_features is 96 but expert 0 has 64"):
        FP8Experts.from_checkpoint(deepseek_fp8, PREFIX)


def test_down_projection_that_does_not_fit(tmp_path):
    tensors = gpt_oss_tensors(quantized_module(FP4Experts, 32))
    wrong = gpt_oss_tensors(quantized_module(FP4Experts, 64))
    for suffix in ("_blocks", "_scales"):
        tensors[f"{PREFIX}.down_proj{suffix}"] = wrong[f"{PREFIX}.down_proj{suffix}"]
    with pytest.raises(CheckpointError, match=r"down_proj_blocks: expected a \[64, 32\] projection .* got \[64, 64\]"):
        FP4Experts.from_checkpoint(tensors, PREFIX)


def test_nan_scale_code_in_one_expert(tmp_path):
    tensors = gpt_oss_tensors(quantized_module(FP4Experts, 32, bias=True))
    tensors[f"{PREFIX}.down_proj_scales"][3, 7, 0] = 255
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"expert 3 of .*down_proj_scales: found NaN e8m0 code 255 at index \[7, 0\]"):
        FP4Experts.from_checkpoint(tmp_path / "model.safetensors", PREFIX)


def test_nan_fp8_code_in_one_expert(deepseek_fp8):
    deepseek_fp8[f"{PREFIX}.3.w2.weight"].view(torch.uint8)[5, 9] = 0xFF
    with pytest.raises(CheckpointError, match=rf"{PREFIX}\.3\.w2\.weight: found NaN e4m3 code .* at index \[5, 9\]"):
        FP8Experts.from_checkpoint(deepseek_fp8, PREFIX)


def test_truncated_file(gpt_oss_file):
    data = gpt_oss_file.read_bytes()
    gpt_oss_file.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError):
        FP4Experts.from_checkpoint(gpt_oss_file, PREFIX)


def test_fp8_block_that_splits_the_fused_gate_up_is_reblocked_exactly():
    # I = 96 rows with 128-row scale blocks: w1's one scale row would also cover w3's rows if the
    # grids were simply stacked (this was refused before). The module uses 32x128 blocks, on which
    # [w1; w3] and w2 decode to exactly the stored values.
    from torch_bq import formats

    g = torch.Generator().manual_seed(5)
    tensors, decoded = {}, {}
    for e in range(E):
        for proj, shape in (("w1", (96, H)), ("w3", (96, H)), ("w2", (H, 96))):
            data, scale = formats.quantize_fp8(torch.randn(shape, generator=g) * (1 + e), (128, 128))
            tensors[f"{PREFIX}.{e}.{proj}.weight"] = data
            tensors[f"{PREFIX}.{e}.{proj}.scale"] = scale.view(torch.uint8)
            decoded[e, proj] = formats.dequantize_fp8(data, scale, (128, 128), torch.float32)
    module = FP8Experts.from_checkpoint(tensors, PREFIX, block=(128, 128))
    assert module.block == (32, 128) and module.intermediate_size == 96
    for e in range(E):
        gate_up = formats.dequantize_fp8(module.gate_up_proj[e], module.gate_up_proj_scale[e], module.block,
                                         torch.float32)
        assert torch.equal(gate_up, torch.cat([decoded[e, "w1"], decoded[e, "w3"]]))
        down = formats.dequantize_fp8(module.down_proj[e], module.down_proj_scale[e], module.block, torch.float32)
        assert torch.equal(down, decoded[e, "w2"])


def test_bad_options(gpt_oss_file):
    with pytest.raises(ValueError, match=r"layout: expected one of \('gpt-oss', 'deepseek'\)"):
        FP4Experts.from_checkpoint(gpt_oss_file, PREFIX, layout="mixtral")
    with pytest.raises(TypeError, match=r"num_experts, projections: apply to layout='deepseek' only"):
        FP4Experts.from_checkpoint(gpt_oss_file, PREFIX, num_experts=2)
    with pytest.raises(ValueError, match=r"num_experts: expected a positive int"):
        FP8Experts.from_checkpoint(gpt_oss_file, PREFIX, num_experts=0)
