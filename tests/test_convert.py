"""quantize_, load_quantized_ and convert_checkpoint on small models."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

import checkpoint_fixtures as fx
from torch_bq.testing import assert_linear_close
from torch_bq import formats
from torch_bq.nn import (
    BF16Linear,
    CheckpointError,
    FP4Linear,
    FP8Linear,
    MissingTensorError,
    convert_checkpoint,
    load_quantized_,
    quantize_,
)


class Tiny(nn.Module):
    def __init__(self, bias=True):
        super().__init__()
        self.embed_tokens = nn.Embedding(11, 64)
        self.up = nn.Linear(64, 96, bias=bias)
        self.down = nn.Linear(96, 64, bias=False)
        self.norm = nn.LayerNorm(64)
        self.lm_head = nn.Linear(64, 11, bias=False)

    def forward(self, ids):
        h = self.embed_tokens(ids)
        h = h + self.down(torch.relu(self.up(h)))
        return self.lm_head(self.norm(h))


def _tiny(seed=0, **kw):
    torch.manual_seed(seed)
    return Tiny(**kw)


# --------------------------------------------------------------------------- #
# quantize_
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("fmt, cls", [("fp8", FP8Linear), ("fp4", FP4Linear), ("bf16", BF16Linear)])
def test_quantize_replaces_linears_and_reports_bytes(fmt, cls):
    model = _tiny()
    originals = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    report = quantize_(model, fmt, filter_fn=lambda m, name: name != "lm_head")
    assert report.converted == ["up", "down"] and report.skipped == ["lm_head"]
    assert isinstance(model.up, cls) and isinstance(model.down, cls) and type(model.lm_head) is nn.Linear
    # fp32 weights + fp32 bias before; after: data + scales + the kept bias
    assert report.bytes_before == (64 * 96 + 96 + 96 * 64) * 4
    expected_after = {"fp8": 64 * 96 * 2 + 2 * 3 * 2 + 96 * 4, "fp4": 2 * 96 * 32 + 96 * 2 + 64 * 3 + 96 * 4,
                      "bf16": 2 * 64 * 96 * 2 + 96 * 4}[fmt]
    assert report.bytes_after == expected_after
    assert f"2 linear layers converted, 1 skipped" in str(report)
    # the installed weight is the quantizer's output for the original weight
    if fmt == "fp8":
        data, scale = formats.quantize_fp8(originals["up"])
        assert torch.equal(model.up.weight.view(torch.uint8), data.view(torch.uint8))
    ids = torch.tensor([[1, 2, 3]])
    assert model(ids).shape == (1, 3, 11)


def test_quantize_passes_options_and_is_all_or_nothing():
    model = _tiny()
    quantize_(model, "fp8", block=(128, 128), scale_dtype=torch.float32, act_quant=False)
    assert model.up.block == (128, 128) and model.up.weight_scale.dtype == torch.float32 and not model.up.act_quant
    model = _tiny()
    with torch.no_grad():
        model.down.weight[3, 4] = float("inf")
    with pytest.raises(ValueError, match=r"down: w: expected finite values, got inf at index \[3, 4\]"):
        quantize_(model, "fp4")
    assert type(model.up) is nn.Linear  # converted before the failure, but not swapped in
    with pytest.raises(ValueError, match="format"):
        quantize_(_tiny(), "int4")


# --------------------------------------------------------------------------- #
# load_quantized_
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_convert_then_load_into_meta_skeleton(tmp_path, fmt):
    model = _tiny()
    save_file(model.state_dict(), tmp_path / "float.safetensors")
    summary = convert_checkpoint(tmp_path / "float.safetensors", tmp_path / "q", fmt, progress=None)
    assert sorted(summary["quantized"]) == ["down.weight", "up.weight"]  # embed, norm, lm_head excluded
    with torch.device("meta"):
        skeleton = Tiny()
    report = load_quantized_(skeleton, tmp_path / "q")
    assert set(report.quantized) == {"up", "down"} and all(v.startswith(fmt) for v in report.quantized.values())
    assert not any(t.is_meta for t in skeleton.state_dict().values())
    # equals quantize_ applied to the float model, bit for bit
    reference = _tiny()
    quantize_(reference, fmt, filter_fn=lambda m, name: name != "lm_head")
    ids = torch.tensor([[0, 5, 10, 2]])
    assert torch.equal(skeleton(ids), reference(ids))


def test_load_quantized_deepseek_layout_with_dense_rest(tmp_path):
    t = fx.deepseek_v3(tmp_path / "ds", prefix="proj", n=256, k=384)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = nn.ModuleDict({"embed_tokens": nn.Embedding(4, 8, dtype=torch.bfloat16)})
            self.proj = nn.Linear(384, 256, bias=False, dtype=torch.bfloat16)

    with torch.device("meta"):
        m = M()
    report = load_quantized_(m, tmp_path / "ds")
    assert report.quantized == {"proj": "fp8 (deepseek-v3)"} and report.dense == ["model.embed_tokens.weight"]
    assert isinstance(m.proj, FP8Linear) and m.proj.block == (128, 128)
    x = torch.randn(2, 384)
    w = formats.dequantize_fp8(t["proj.weight"], t["proj.weight_scale_inv"], (128, 128), torch.float32)
    assert_linear_close(m.proj(x), formats.qdq_fp8(x).float(), w)


def test_load_quantized_errors_leave_model_unchanged(tmp_path):
    model = _tiny()
    save_file(model.state_dict(), tmp_path / "float.safetensors")
    convert_checkpoint(tmp_path / "float.safetensors", tmp_path / "q", "fp8", progress=None)
    shard = tmp_path / "q" / "model-00001-of-00001.safetensors"
    tensors = load_file(shard)  # as stored: the codes carry the unit axis their records name
    with safe_open(shard, "pt") as f:
        records = f.metadata()

    def save(tensors, path):  # an edited shard keeps its records
        save_file(tensors, path, metadata=records)

    def fresh():
        with torch.device("meta"):
            return Tiny()

    # a missing dense tensor (the index must agree, or the reader rejects the directory)
    save({k: v for k, v in tensors.items() if k != "norm.weight"}, shard)
    index_path = tmp_path / "q" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    full_map = dict(index["weight_map"])
    del index["weight_map"]["norm.weight"]
    index_path.write_text(json.dumps(index))
    m = fresh()
    with pytest.raises(MissingTensorError, match=r"lacks 1 of the model's tensors: \['norm.weight'\].*strict=False"):
        load_quantized_(m, tmp_path / "q")
    assert type(m.up) is nn.Linear and m.up.weight.is_meta
    report = load_quantized_(m, tmp_path / "q", strict=False)
    assert report.missing == ["norm.weight"] and isinstance(m.up, FP8Linear)
    # a NaN code in the last layer: nothing installed
    bad = dict(tensors)
    data = bad["up.weight"].view(torch.uint8).clone()
    data[95, 63] = 0x7F
    bad["up.weight"] = data.view(torch.float8_e4m3fn)
    save(bad, shard)
    index["weight_map"] = full_map
    index_path.write_text(json.dumps(index))
    m = fresh()
    with pytest.raises(CheckpointError, match=r"up.weight: found NaN e4m3 code .* \[95, 63\]"):
        load_quantized_(m, tmp_path / "q")
    assert type(m.up) is nn.Linear and type(m.down) is nn.Linear and m.embed_tokens.weight.is_meta
    # shape mismatch between the model and the checkpoint
    save(tensors, shard)
    with torch.device("meta"):
        small = Tiny()
        small.up = nn.Linear(64, 80)
    with pytest.raises(CheckpointError, match=r"up: the model expects a \[80, 64\] linear.*\[96, 64\]"):
        load_quantized_(small, tmp_path / "q")
    with torch.device("meta"):
        nobias = Tiny(bias=False)
    with pytest.raises(CheckpointError, match="up: the model's linear has no bias, the checkpoint has up.bias"):
        load_quantized_(nobias, tmp_path / "q")


# --------------------------------------------------------------------------- #
# convert_checkpoint
# --------------------------------------------------------------------------- #


def test_convert_sharded_directory_keeps_shards_and_copies_config(tmp_path):
    model = _tiny()
    fx.sharded(tmp_path / "in", {k: v.bfloat16() for k, v in model.state_dict().items()}, shards=3)
    (tmp_path / "in" / "config.json").write_text('{"hidden_size": 64}')
    summary = convert_checkpoint(tmp_path / "in", tmp_path / "out", "fp8", block=(1, 32), progress=None)
    assert summary["files"] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["torch_bq"] == {"format": "fp8", "block": [1, 32], "scale_dtype": "float8_e8m0fnu"}
    assert index["weight_map"]["up.weight_scale"] == index["weight_map"]["up.weight"]
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["hidden_size"] == 64 and config["quantization_config"]["quant_method"] == "torch_bq"
    m = FP8Linear.from_checkpoint(tmp_path / "out", "up")
    data, scale = formats.quantize_fp8(model.up.weight.detach().bfloat16(), (1, 32))
    assert torch.equal(m.weight.view(torch.uint8), data.view(torch.uint8)) and m.block == (1, 32)
    assert summary["bytes_out"] < summary["bytes_in"]


def test_convert_include_exclude_progress_and_errors(tmp_path, capsys):
    import io

    model = _tiny()
    save_file(model.state_dict(), tmp_path / "f.safetensors")
    stream = io.StringIO()
    summary = convert_checkpoint(tmp_path / "f.safetensors", tmp_path / "o", "fp4", include=r"^up\.", exclude=None,
                                 progress=stream)
    assert summary["quantized"] == ["up.weight"]
    lines = stream.getvalue().splitlines()
    assert lines[-1] == "convert [7/7] up.weight" and len(lines) == 7  # 7 tensors, sorted
    with pytest.raises(FileExistsError, match="not empty"):
        convert_checkpoint(tmp_path / "f.safetensors", tmp_path / "o", "fp4", progress=None)
    with pytest.raises(ValueError, match="format"):
        convert_checkpoint(tmp_path / "f.safetensors", tmp_path / "o2", "int4", progress=None)
    sd = model.state_dict()
    sd["up.weight"] = sd["up.weight"].clone()
    sd["up.weight"][0, 0] = float("nan")
    save_file(sd, tmp_path / "nan.safetensors")
    with pytest.raises(CheckpointError, match=r"up.weight: w: expected finite values, got nan at index \[0, 0\]"):
        convert_checkpoint(tmp_path / "nan.safetensors", tmp_path / "o3", "fp8", progress=None)
