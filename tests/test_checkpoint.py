"""from_checkpoint and the loader: every layout from a generated fixture, every error path."""

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import checkpoint_fixtures as fx
from torch_bq.checkpoint import SafetensorsFile, block_candidates
from torch_bq.testing import assert_linear_close
from torch_bq import formats
from torch_bq.nn import (
    AmbiguousLayoutError,
    BF16Linear,
    CheckpointError,
    CheckpointReader,
    FP4Linear,
    FP8Linear,
    IncompleteCheckpointError,
    MissingTensorError,
    detect_linear,
    resolve_linear,
)


def _bytes(t):
    return t.contiguous().view(torch.uint8)


def _check_forward(module, weight_f32):
    """Forward equals dequantize + F.linear (on the activation the op uses) within the derived bound."""
    x = torch.randn(3, module.in_features, generator=torch.Generator().manual_seed(7)) * 3
    a = formats.qdq_fp8(x, module.act_peak).float() if getattr(module, "act_quant", False) else x.bfloat16().float()
    y = module(x)
    assert_linear_close(y, a, weight_f32, module.bias)
    dense = module.dequantize(torch.float32)
    assert torch.equal(dense.weight, weight_f32)
    if not getattr(module, "act_quant", False):
        assert_linear_close(y, x.bfloat16().float(), dense.weight, module.bias)
    else:
        assert_linear_close(y, a, dense.weight, module.bias)
    # the F.linear of the decoded weight on the same activation, computed independently
    ref = F.linear(a.double(), weight_f32.double(), None if module.bias is None else module.bias.double())
    assert torch.allclose(y.double(), ref, rtol=2**-7, atol=1e-6)


# --------------------------------------------------------------------------- #
# layouts
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("config", [True, False], ids=["config-block", "block-argument"])
def test_deepseek_v3(tmp_path, config):
    t = fx.deepseek_v3(tmp_path / "ds", config=config)
    prefix = "model.layers.0.mlp.down_proj"
    if not config:
        # K = 260 in 3 blocks fits 96 as well as 128: without config.json nothing says which
        with pytest.raises(AmbiguousLayoutError, match=r"bk in \[96, 128\].*pass block=\(bn, bk\)") as info:
            detect_linear(tmp_path / "ds", prefix)
        assert ("fp8", (128, 128)) in info.value.candidates and info.value.argument == "block"
    layout = detect_linear(tmp_path / "ds", prefix, block=None if config else (128, 128))
    assert (layout.layout, layout.format, layout.block) == ("deepseek-v3", "fp8", (128, 128))
    module = FP8Linear.from_checkpoint(tmp_path / "ds", prefix, block=None if config else (128, 128))
    assert module.weight_scale.dtype == torch.float32 and module.block == (128, 128)
    assert torch.equal(_bytes(module.weight), _bytes(t[f"{prefix}.weight"]))
    assert torch.equal(module.weight_scale, t[f"{prefix}.weight_scale_inv"])
    w = formats.dequantize_fp8(t[f"{prefix}.weight"], t[f"{prefix}.weight_scale_inv"], (128, 128), torch.float32)
    _check_forward(module, w)


def test_deepseek_v3_config_block_disagrees_with_shapes(tmp_path):
    fx.deepseek_v3(tmp_path / "ds")
    (tmp_path / "ds" / "config.json").write_text(json.dumps({"quantization_config": {"weight_block_size": [64, 64]}}))
    with pytest.raises(CheckpointError, match=r"weight_scale_inv: expected shape \[5, 5\].*block \[64, 64\].*config.json"):
        FP8Linear.from_checkpoint(tmp_path / "ds", "model.layers.0.mlp.down_proj")


@pytest.mark.parametrize("block", [(1, 128), (128, 128), (32, 32), (1, 32)])
@pytest.mark.parametrize("storage", [torch.float8_e8m0fnu, torch.uint8])
def test_deepseek_v31_fp8_any_block(tmp_path, block, storage):
    path = tmp_path / "v31.safetensors"
    t = fx.deepseek_v31(path, block=block, scale_storage=storage)
    layout = detect_linear(path, "layers.0.ffn.w2")
    assert (layout.layout, layout.format, layout.block) == ("deepseek-v3.1", "fp8", block)
    module = FP8Linear.from_checkpoint(path, "layers.0.ffn.w2", act_quant=False)
    w = formats.dequantize_fp8(t["layers.0.ffn.w2.weight"], t["layers.0.ffn.w2.scale"], block, torch.float32)
    _check_forward(module, w)


@pytest.mark.parametrize("data_dtype", [torch.int8, torch.uint8])
def test_deepseek_v4_fp4(tmp_path, data_dtype):
    path = tmp_path / "v4.safetensors"
    t = fx.deepseek_v31(path, fmt="fp4", data_dtype=data_dtype, n=40, k=96)
    layout = detect_linear(path, "layers.0.ffn.w2")
    assert (layout.layout, layout.format, layout.in_features) == ("deepseek-v3.1", "fp4", 96)
    module = FP4Linear.from_checkpoint(path, "layers.0.ffn.w2")
    assert module.weight.dtype == torch.uint8 and torch.equal(_bytes(module.weight), _bytes(t["layers.0.ffn.w2.weight"]))
    w = formats.dequantize_fp4(t["layers.0.ffn.w2.weight"], t["layers.0.ffn.w2.scale"], 96, torch.float32)
    _check_forward(module, w)


@pytest.mark.parametrize("expert", [0, 2])
def test_gpt_oss_expert(tmp_path, expert):
    path = tmp_path / "gpt_oss.safetensors"
    prefix = "model.layers.0.mlp.experts.down_proj"
    t = fx.gpt_oss(path, prefix=prefix)
    module = FP4Linear.from_checkpoint(path, prefix, expert=expert)
    packed = t[f"{prefix}_blocks"][expert].reshape(64, 48)
    scale = t[f"{prefix}_scales"][expert]
    assert torch.equal(module.weight, packed) and torch.equal(module.weight_scale.view(torch.uint8), scale)
    assert torch.equal(module.bias, t[f"{prefix}_bias"][expert])
    _check_forward(module, formats.dequantize_fp4(packed, scale, 96, torch.float32))


def test_gpt_oss_expert_reads_only_that_expert(tmp_path, monkeypatch):
    path = tmp_path / "gpt_oss.safetensors"
    prefix = "e.gate_up_proj"
    fx.gpt_oss(path, prefix=prefix, experts=4)
    reader = CheckpointReader(path)
    seen = []
    real_read = SafetensorsFile.read

    def spy(self, name, index=None):
        seen.append((name, index))
        return real_read(self, name, index)

    monkeypatch.setattr(SafetensorsFile, "read", spy)
    FP4Linear.from_checkpoint(reader, prefix, expert=3)
    assert sorted(seen) == [(f"{prefix}_bias", 3), (f"{prefix}_blocks", 3), (f"{prefix}_scales", 3)]


@pytest.mark.parametrize(
    "fmt, block, scale_dtype",
    [("fp8", (32, 32), torch.float8_e8m0fnu), ("fp8", (128, 128), torch.float8_e8m0fnu),
     ("fp8", (1, 32), torch.float8_e8m0fnu), ("fp8", (32, 32), torch.float32), ("fp4", None, None)],
)
def test_torch_bq_layout(tmp_path, fmt, block, scale_dtype):
    path = tmp_path / "ours.safetensors"
    t = fx.torch_bq_layout(path, fmt=fmt, block=block, scale_dtype=scale_dtype)
    cls = FP8Linear if fmt == "fp8" else FP4Linear
    module = cls.from_checkpoint(path, "proj")
    assert torch.equal(module.bias, t["proj.bias"])
    if fmt == "fp8":
        assert module.block == block
        w = formats.dequantize_fp8(t["proj.weight"], t["proj.weight_scale"], block, torch.float32)
    else:
        w = formats.dequantize_fp4(t["proj.weight"], t["proj.weight_scale"], 100, torch.float32)
    _check_forward(module, w)


def test_state_dict_file_loads_back(tmp_path):
    # A module's own state_dict saved with safetensors is a checkpoint in our layout.
    src = FP8Linear.from_linear(torch.nn.Linear(64, 48, bias=True), block=(1, 32))
    save_file({f"head.{k}": v for k, v in src.state_dict().items()}, tmp_path / "m.safetensors")
    module = FP8Linear.from_checkpoint(tmp_path / "m.safetensors", "head")
    x = torch.randn(2, 64)
    assert module.block == (1, 32) and torch.equal(module(x), src(x))


def test_sharded_index_opens_only_the_shards_it_needs(tmp_path):
    tensors = {}
    for i in range(4):
        d, s = formats.quantize_fp8(torch.randn(32, 32), (32, 32))
        tensors[f"l{i}.weight"], tensors[f"l{i}.weight_scale"] = d, s
    fx.sharded(tmp_path / "sh", tensors, shards=4)  # round-robin: l{i}.* spread over two shards
    reader = CheckpointReader(tmp_path / "sh")
    assert reader.opened_files() == [] and len(reader.keys()) == 8
    FP8Linear.from_checkpoint(reader, "l0")
    assert sorted(Path(f).name for f in reader.opened_files()) == sorted(
        {json.loads((tmp_path / "sh" / "model.safetensors.index.json").read_text())["weight_map"][n]
         for n in ("l0.weight", "l0.weight_scale")})


def test_sharded_index_directory(tmp_path):
    tensors = {}
    for i in range(3):
        d, s = formats.quantize_fp8(torch.randn(64, 96) * (i + 1), (32, 32))
        tensors[f"layers.{i}.proj.weight"] = d
        tensors[f"layers.{i}.proj.weight_scale"] = s
    weight_map = fx.sharded(tmp_path / "sh", tensors, shards=2)
    assert len(set(weight_map.values())) == 2
    reader = CheckpointReader(tmp_path / "sh")
    assert reader.keys() == sorted(tensors) and len(reader.files()) == 2
    for i in range(3):
        module = FP8Linear.from_checkpoint(reader, f"layers.{i}.proj")
        w = formats.dequantize_fp8(tensors[f"layers.{i}.proj.weight"], tensors[f"layers.{i}.proj.weight_scale"],
                                   (32, 32), torch.float32)
        _check_forward(module, w)


def test_mapping_source_and_dense_layouts():
    torch.manual_seed(0)
    w = torch.randn(20, 48)
    sd = {"a.weight": w.bfloat16(), "b.weight": w, "b.bias": torch.randn(20), "c.weight": w.half()}
    a = BF16Linear.from_checkpoint(sd, "a")
    b = BF16Linear.from_checkpoint(sd, "b")
    c = BF16Linear.from_checkpoint(sd, "c")
    assert (a.weight.dtype, b.weight.dtype, c.weight.dtype) == (torch.bfloat16, torch.float32, torch.float32)
    for module in (a, b, c):
        _check_forward(module, module.weight.bfloat16().float())
    assert detect_linear(sd, "b").format == "fp32w"


def test_device_argument(tmp_path):
    path = tmp_path / "ours.safetensors"
    fx.torch_bq_layout(path)
    module = FP8Linear.from_checkpoint(path, "proj", device="meta")
    assert module.weight.is_meta and module.weight.dtype == torch.float8_e4m3fn


def test_resolve_linear_is_reusable():
    d, s = formats.quantize_fp8(torch.randn(256, 256), (128, 128), torch.float32)
    w = resolve_linear({"x.weight": d, "x.weight_scale_inv": s}, "x", block=(128, 128))
    assert (w.format, w.block, w.in_features, w.out_features, w.layout.layout) == ("fp8", (128, 128), 256, 256, "deepseek-v3")
    assert w.bias is None and w.weight is d


# --------------------------------------------------------------------------- #
# errors
# --------------------------------------------------------------------------- #


def test_missing_prefix_lists_looked_for_and_closest_names(tmp_path):
    fx.deepseek_v3(tmp_path / "ds")
    with pytest.raises(MissingTensorError) as info:
        FP8Linear.from_checkpoint(tmp_path / "ds", "model.layers.0.mlp.down_prj")
    msg = str(info.value)
    assert "looked for ['model.layers.0.mlp.down_prj.weight', 'model.layers.0.mlp.down_prj.weight_scale'" in msg
    assert "model.layers.0.mlp.down_prj_blocks" in msg
    assert "closest names present: ['model.layers.0.mlp.down_proj.weight'" in msg
    assert isinstance(info.value, KeyError) and isinstance(info.value, ValueError)


def test_missing_scale_for_fp8_weight():
    d, _ = formats.quantize_fp8(torch.randn(32, 32))
    with pytest.raises(MissingTensorError, match=r"weight is torch.float8_e4m3fn but no scale.*'x.weight_scale_inv'"):
        FP8Linear.from_checkpoint({"x.weight": d, "x.weight_scal": torch.ones(1, 1)}, "x")


def test_gpt_oss_missing_half(tmp_path):
    t = fx.gpt_oss(tmp_path / "g.safetensors", prefix="p", bias=False)
    with pytest.raises(MissingTensorError, match=r"p_scales is missing.*looked for \['p_blocks', 'p_scales'\]"):
        FP4Linear.from_checkpoint({"p_blocks": t["p_blocks"]}, "p", expert=0)


@pytest.mark.parametrize(
    "expert, match",
    [(None, "holds 3 stacked experts.*pass expert=i"), (3, "expert=3 is out of range for 3 experts"),
     (-1, "expert=-1 is out of range")],
)
def test_gpt_oss_expert_errors(tmp_path, expert, match):
    fx.gpt_oss(tmp_path / "g.safetensors", prefix="p")
    with pytest.raises(CheckpointError, match=match):
        FP4Linear.from_checkpoint(tmp_path / "g.safetensors", "p", expert=expert)


def test_expert_on_unstacked_tensor():
    d, s = formats.quantize_fp8(torch.randn(32, 32))
    with pytest.raises(CheckpointError, match="expert=1 was given but the tensor is not stacked"):
        FP8Linear.from_checkpoint({"x.weight": d, "x.weight_scale": s}, "x", expert=1)


def test_shape_mismatches():
    d, s = formats.quantize_fp8(torch.randn(64, 64), (32, 32))
    with pytest.raises(CheckpointError, match=r"x.weight_scale: expected shape \[2, 2\].*block \[32, 32\] \(from block=\), got \[2, 3\]"):
        FP8Linear.from_checkpoint({"x.weight": d, "x.weight_scale": torch.cat([s, s[:, :1]], 1)}, "x", block=(32, 32))
    with pytest.raises(CheckpointError, match=r"shape \[2, 3\] fits no block of 1, a power of two or a multiple of 32"):
        FP8Linear.from_checkpoint({"x.weight": d, "x.weight_scale": torch.cat([s, s[:, :1]], 1)}, "x")
    with pytest.raises(CheckpointError, match=r"x.bias: expected shape \[64\]"):
        FP8Linear.from_checkpoint({"x.weight": d, "x.weight_scale": s, "x.bias": torch.zeros(63)}, "x")
    p, s4 = formats.quantize_fp4(torch.randn(8, 64))
    with pytest.raises(CheckpointError, match=r"in_features=70 needs 35 packed columns, got 32"):
        FP4Linear.from_checkpoint({"x.weight": p, "x.weight_scale": s4}, "x", in_features=70)
    blocks = p.reshape(8, 2, 16)
    with pytest.raises(CheckpointError, match=r"y_scales: expected shape \[8, 2\]"):
        FP4Linear.from_checkpoint({"y_blocks": blocks, "y_scales": s4.view(torch.uint8)[:, :1]}, "y")
    with pytest.raises(CheckpointError, match=r"y_blocks: expected shape \[..., N, K/32, 16\]"):
        FP4Linear.from_checkpoint({"y_blocks": p.reshape(8, 4, 8), "y_scales": s4.view(torch.uint8)}, "y")


def test_dtype_mismatches():
    d, s = formats.quantize_fp8(torch.randn(64, 64))
    with pytest.raises(CheckpointError, match=r"x.weight: expected quantized data .* got torch.bfloat16"):
        FP8Linear.from_checkpoint({"x.weight": torch.zeros(64, 64, dtype=torch.bfloat16), "x.weight_scale": s}, "x")
    with pytest.raises(CheckpointError, match=r"x.scale: expected dtype in .* got torch.int32"):
        FP8Linear.from_checkpoint({"x.weight": d, "x.scale": s.view(torch.uint8).int()}, "x")
    p, s4 = formats.quantize_fp4(torch.randn(8, 64))
    with pytest.raises(CheckpointError, match=r"x.scale: expected e8m0 scales .* got torch.float32"):
        FP4Linear.from_checkpoint({"x.weight": p.view(torch.int8), "x.scale": formats.decode_e8m0(s4)}, "x")
    with pytest.raises(CheckpointError, match=r"y_blocks: expected dtype torch.uint8, got torch.int8"):
        FP4Linear.from_checkpoint({"y_blocks": p.view(torch.int8).reshape(8, 2, 16), "y_scales": s4.view(torch.uint8)}, "y")
    with pytest.raises(CheckpointError, match=r"x.bias: expected a float16/bfloat16/float32 bias, got torch.int64"):
        FP8Linear.from_checkpoint({"x.weight": d, "x.weight_scale": s, "x.bias": torch.zeros(64, dtype=torch.long)}, "x")


def test_wrong_module_class_and_ambiguous_scales():
    p, s4 = formats.quantize_fp4(torch.randn(8, 64))
    with pytest.raises(CheckpointError, match=r"holds fp4 weights .*load them with FP4Linear, not FP8Linear"):
        FP8Linear.from_checkpoint({"x.weight": p.view(torch.int8), "x.scale": s4}, "x")
    with pytest.raises(CheckpointError, match=r"holds fp4 data .* but fp8 was asked for"):
        FP8Linear.from_checkpoint({"x.weight": p.view(torch.int8), "x.scale": s4}, "x", format="fp8")
    d, s = formats.quantize_fp8(torch.randn(64, 64))
    with pytest.raises(CheckpointError, match="load them with FP8Linear, not BF16Linear"):
        BF16Linear.from_checkpoint({"x.weight": d, "x.weight_scale": s}, "x")
    with pytest.raises(CheckpointError, match=r"more than one scale tensor present: \['x.weight_scale', 'x.scale'\]"):
        FP8Linear.from_checkpoint({"x.weight": d, "x.weight_scale": s, "x.scale": s}, "x")


def test_uint8_data_is_settled_by_scale_shape_or_module():
    d, s = formats.quantize_fp8(torch.randn(64, 64), (1, 32))
    sd = {"x.weight": d.view(torch.uint8), "x.scale": s}
    assert detect_linear(sd, "x").format == "fp8"
    FP8Linear.from_checkpoint(sd, "x")
    p, s4 = formats.quantize_fp4(torch.randn(64, 128))
    assert detect_linear({"x.weight": p, "x.scale": s4}, "x").format == "fp4"


@pytest.mark.parametrize("where", ["data", "scale"])
def test_nan_codes_rejected_with_tensor_and_index(tmp_path, where):
    path = tmp_path / "v31.safetensors"
    t = fx.deepseek_v31(path, block=(128, 128), n=300, k=260)
    if where == "data":
        bad = t["layers.0.ffn.w2.weight"].view(torch.uint8).clone()
        bad[299, 259] = 0xFF
        t["layers.0.ffn.w2.weight"] = bad.view(torch.float8_e4m3fn)
        match = r"layers.0.ffn.w2.weight: found NaN e4m3 code 0x7F/0xFF at index \[299, 259\]"
    else:
        bad = t["layers.0.ffn.w2.scale"].view(torch.uint8).clone()
        bad[2, 1] = 255
        t["layers.0.ffn.w2.scale"] = bad.view(torch.float8_e8m0fnu)
        match = r"layers.0.ffn.w2.scale: found NaN e8m0 code 255 at index \[2, 1\]"
    save_file(t, path)
    with pytest.raises(CheckpointError, match=match):
        FP8Linear.from_checkpoint(path, "layers.0.ffn.w2", block=(128, 128))


def test_nan_scan_finds_absolute_index_past_first_chunk(monkeypatch):
    from torch_bq.nn import validation

    monkeypatch.setattr(validation, "SCAN_CHUNK_BYTES", 64 * 10)  # 10 rows per chunk
    d, s = formats.quantize_fp8(torch.randn(64, 64))
    bad = d.view(torch.uint8).clone()
    bad[37, 5] = 0x7F
    with pytest.raises(CheckpointError, match=r"index \[37, 5\]"):
        FP8Linear.from_checkpoint({"x.weight": bad, "x.weight_scale": s}, "x")


def test_non_finite_float32_scale_rejected():
    d, s = formats.quantize_fp8(torch.randn(256, 256), (128, 128), torch.float32)
    s = s.clone()
    s[1, 0] = float("inf")
    with pytest.raises(CheckpointError, match=r"x.weight_scale_inv: found a non-finite or non-positive scale at index \[1, 0\]"):
        FP8Linear.from_checkpoint({"x.weight": d, "x.weight_scale_inv": s}, "x", block=(128, 128))


def test_truncated_and_corrupt_files(tmp_path):
    path = tmp_path / "ours.safetensors"
    fx.torch_bq_layout(path)
    blob = path.read_bytes()
    (tmp_path / "trunc.safetensors").write_bytes(blob[:-64])
    with pytest.raises(CheckpointError, match=r"trunc.safetensors: not a valid safetensors file: .*\(truncated\)"):
        FP8Linear.from_checkpoint(tmp_path / "trunc.safetensors", "proj")
    (tmp_path / "junk.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{notjson")
    with pytest.raises(CheckpointError, match=r"junk.safetensors: not a valid safetensors file: header is not UTF-8 JSON"):
        FP8Linear.from_checkpoint(tmp_path / "junk.safetensors", "proj")
    (tmp_path / "empty.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="not a valid safetensors file: 0 bytes, shorter than the 8-byte header"):
        CheckpointReader(tmp_path / "empty.safetensors")


def test_bad_sources(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        CheckpointReader(tmp_path / "nope.safetensors")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="holds neither model.safetensors.index.json nor any"):
        CheckpointReader(tmp_path / "empty")
    with pytest.raises(TypeError, match="source"):
        CheckpointReader(42)
    with pytest.raises(TypeError, match=r"source\['a'\]: expected a torch.Tensor"):
        CheckpointReader({"a": [1, 2]})


def test_index_errors(tmp_path):
    d, s = formats.quantize_fp8(torch.randn(32, 32))
    fx.sharded(tmp_path / "sh", {"x.bias": torch.zeros(32), "x.weight": d, "x.weight_scale": s}, shards=2)
    index = tmp_path / "sh" / "model.safetensors.index.json"
    content = json.loads(index.read_text())
    content["weight_map"]["x.weight"] = "model-00009-of-00009.safetensors"
    index.write_text(json.dumps(content))
    with pytest.raises(IncompleteCheckpointError, match=r"incomplete: names shard\(s\) \['model-00009-of-00009.safetensors'\] that are not in"):
        CheckpointReader(tmp_path / "sh")
    content["weight_map"]["x.weight"] = "model-00002-of-00002.safetensors"
    content["weight_map"]["x.weight_scale"] = "model-00002-of-00002.safetensors"  # it is in shard 1
    index.write_text(json.dumps(content))
    reader = CheckpointReader(tmp_path / "sh")  # shard headers are read on first use
    with pytest.raises(CheckpointError, match="maps 'x.weight_scale' to .* but that shard does not hold it"):
        FP8Linear.from_checkpoint(reader, "x")
    index.write_text("{")
    with pytest.raises(CheckpointError, match="model.safetensors.index.json: not valid JSON"):
        CheckpointReader(tmp_path / "sh")


def test_reader_reads_headers_only_until_asked(tmp_path):
    path = tmp_path / "ours.safetensors"
    fx.torch_bq_layout(path, n=64, k=64)
    reader = CheckpointReader(path)
    assert reader.shape("proj.weight") == (64, 64) and reader.dtype("proj.weight") == torch.float8_e4m3fn
    assert reader.nbytes("proj.weight") == 64 * 64
    with pytest.raises(MissingTensorError, match=r"'proj.wieght' is not in .*closest names: \['proj.weight'"):
        reader.get("proj.wieght")


# --------------------------------------------------------------------------- #
# tensor-parallel shards and packed-F4 files
# --------------------------------------------------------------------------- #


def test_fp8_row_and_column_shards_tile_the_weight(tmp_path):
    t = fx.deepseek_v3(tmp_path / "ds", prefix="p", n=300, k=384)
    full = formats.dequantize_fp8(t["p.weight"], t["p.weight_scale_inv"], (128, 128), torch.float32)
    row_parts = [FP8Linear.from_checkpoint(tmp_path / "ds", "p", rows=r) for r in ((0, 128), (128, 256), (256, 300))]
    assert [m.out_features for m in row_parts] == [128, 128, 44]
    assert torch.equal(torch.cat([m.dequantize(torch.float32).weight for m in row_parts]), full)
    col_parts = [FP8Linear.from_checkpoint(tmp_path / "ds", "p", cols=c) for c in ((0, 128), (128, 384))]
    assert torch.equal(torch.cat([m.dequantize(torch.float32).weight for m in col_parts], 1), full)
    # row-parallel: partial outputs of the column shards sum to the full layer (up to fp32 order)
    x = torch.randn(2, 384)
    y = sum(m(x[:, slice(*c)].contiguous()).double() for m, c in zip(col_parts, ((0, 128), (128, 384))))
    assert_linear_close(y.float(), torch.cat([formats.qdq_fp8(x[:, :128]), formats.qdq_fp8(x[:, 128:])], 1).float(), full)


def test_gpt_oss_expert_shard(tmp_path):
    path = tmp_path / "g.safetensors"
    t = fx.gpt_oss(path, prefix="e", experts=3, n=64, k=128)
    m = FP4Linear.from_checkpoint(path, "e", expert=1, rows=(16, 48), cols=(32, 96))
    packed = t["e_blocks"][1].reshape(64, 64)[16:48, 16:48]
    assert torch.equal(m.weight, packed) and m.in_features == 64 and m.out_features == 32
    assert torch.equal(m.weight_scale.view(torch.uint8), t["e_scales"][1, 16:48, 1:3])
    assert torch.equal(m.bias, t["e_bias"][1, 16:48])


def test_v4_fp4_column_shard_and_dense_shard():
    p, s = formats.quantize_fp4(torch.randn(8, 96))
    m = FP4Linear.from_checkpoint({"x.weight": p.view(torch.int8), "x.scale": s}, "x", cols=(32, 96))
    assert torch.equal(m.weight, p[:, 16:48]) and torch.equal(_bytes(m.weight_scale), _bytes(s[:, 1:3]))
    w = torch.randn(10, 20)
    d = BF16Linear.from_checkpoint({"x.weight": w, "x.bias": torch.arange(10.0)}, "x", rows=(2, 5), cols=(4, 9))
    assert torch.equal(d.weight, w[2:5, 4:9]) and torch.equal(d.bias, torch.arange(2.0, 5.0))


@pytest.mark.parametrize(
    "rows, cols, match",
    [((0, 100), None, r"rows=\(0, 100\) must start and end on multiples of the 128-wide scale block \(or end at 300\)"),
     (None, (64, 384), r"cols=\(64, 384\) must start and end"),
     ((0, 0), None, r"rows=\(0, 0\) is not a non-empty range within \[0, 300\]"),
     (None, (0, 400), r"cols=\(0, 400\) is not a non-empty range")],
)
def test_shard_errors(tmp_path, rows, cols, match):
    fx.deepseek_v3(tmp_path / "ds", prefix="p", n=300, k=384)
    with pytest.raises(CheckpointError, match=match):
        FP8Linear.from_checkpoint(tmp_path / "ds", "p", rows=rows, cols=cols)


def test_packed_f4_file_loads(tmp_path):
    # torch's float4_e2m1fn_x2 is saved as safetensors "F4" (shape counted in e2m1 elements)
    path = tmp_path / "f4.safetensors"
    t = fx.deepseek_v31(path, fmt="fp4", data_dtype=torch.float4_e2m1fn_x2, n=16, k=64)
    reader = CheckpointReader(path)
    assert reader.dtype("layers.0.ffn.w2.weight") == torch.float4_e2m1fn_x2
    assert reader.shape("layers.0.ffn.w2.weight") == (16, 32)
    m = FP4Linear.from_checkpoint(reader, "layers.0.ffn.w2")
    assert torch.equal(m.weight, t["layers.0.ffn.w2.weight"].view(torch.uint8))


# --------------------------------------------------------------------------- #
# property: any shape, any supported layout, decodes bit-exactly
# --------------------------------------------------------------------------- #


@given(
    n=st.integers(1, 300),
    k=st.integers(1, 300),
    layout=st.sampled_from(["torch_bq", "deepseek-v3", "deepseek-v3.1"]),
    block=st.sampled_from([(32, 32), (128, 128), (1, 32), (1, 128), (64, 16)]),
    seed=st.integers(0, 2**16),
)
def test_loaded_fp8_weight_decodes_exactly_for_any_shape(n, k, layout, block, seed):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    scale_dtype = torch.float32 if layout == "deepseek-v3" else torch.float8_e8m0fnu
    data, scale = formats.quantize_fp8(w, block, scale_dtype)
    suffix = {"torch_bq": "weight_scale", "deepseek-v3": "weight_scale_inv", "deepseek-v3.1": "scale"}[layout]
    sd = {"p.weight": data, f"p.{suffix}": scale}
    expected = formats.dequantize_fp8(data, scale, block, torch.float32)
    try:
        module = FP8Linear.from_checkpoint(sd, "p")
    except AmbiguousLayoutError as e:
        # never a guess: the true block is among the candidates, and passing it loads exactly
        assert any(torch.equal(formats.dequantize_fp8(data, scale, cand, torch.float32), expected)
                   for _, cand in e.candidates), (block, e.candidates)
        module = FP8Linear.from_checkpoint(sd, "p", block=block)
    # the inferred block may differ where the grid has one entry, but the decoded weight may not
    assert torch.equal(module.dequantize(torch.float32).weight, expected)


@given(n=st.integers(1, 40), k=st.integers(1, 200), experts=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_loaded_fp4_weight_decodes_exactly_for_any_shape(n, k, experts, seed):
    w = torch.randn(experts * n, k, generator=torch.Generator().manual_seed(seed))
    packed, scale = formats.quantize_fp4(w)
    sd = {"p.weight": packed.view(torch.int8).reshape(experts, n, -1), "p.scale": scale.reshape(experts, n, -1)}
    e = experts - 1
    module = FP4Linear.from_checkpoint(sd, "p", expert=e, in_features=k)
    expected = formats.dequantize_fp4(packed[e * n:(e + 1) * n], scale[e * n:(e + 1) * n], k, torch.float32)
    assert torch.equal(module.dequantize(torch.float32).weight, expected)


def test_read_linear_region_reads_arbitrary_slices(tmp_path):
    from torch_bq.nn import read_linear

    path = tmp_path / "g.safetensors"
    t = fx.gpt_oss(path, prefix="e", experts=2, n=64, k=96)
    layout = detect_linear(path, "e", expert=1)
    w = read_linear(path, layout, region={"e_blocks": (slice(10, 20),), "e_scales": (slice(10, 20),)})
    assert torch.equal(w.weight, t["e_blocks"][1, 10:20].reshape(10, 48))
    assert torch.equal(w.bias, t["e_bias"][1]) and w.layout is layout  # not named: read whole
    with pytest.raises(ValueError, match="rows/cols or region, not both"):
        read_linear(path, layout, rows=(0, 32), region={"e_blocks": (slice(0, 1),)})


@pytest.mark.parametrize(
    "size, grid, expected",
    [(300, 3, [128]), (64, 2, [32]), (100, 1, [128]), (70000, 1, [131072]), (300, 300, [1]), (1, 1, [1]),
     (300, 5, [64]), (300, 7, []), (100, 2, [64, 96]), (260, 3, [96, 128]), (256, 2, [128, 160, 192, 224]),
     (7168, 56, [128]), (96, 3, [32]), (100, 3, [])],
)
def test_block_inference_by_hand(size, grid, expected):
    assert block_candidates(size, grid) == expected
