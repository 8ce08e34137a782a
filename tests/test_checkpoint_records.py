"""Recorded, never guessed: what convert_checkpoint / save_quantized / a state dict record, and how loaders use it."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from torch_bq import cli, formats
from torch_bq.checkpoint import RECORD_KEY, CheckpointError, decode_records, detect_linear
from torch_bq.nn import (
    AmbiguousLayoutError,
    FP4Linear,
    FP8Linear,
    convert_checkpoint,
    load_quantized_,
    quantize_,
    save_quantized,
)

# every fp8 block the issue names plus the usual ones, each with both scale dtypes
FP8_CASES = [(b, sd) for b in [(96, 96), (48, 32), (32, 32), (128, 128), (1, 32), (1, 128), (64, 16), (3, 5)]
             for sd in (torch.float8_e8m0fnu, torch.float32)]


def _u8(t):
    return t.contiguous().view(torch.uint8)


def _weight(n=200, k=100, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.mark.parametrize("block, scale_dtype", FP8_CASES)
def test_fp8_round_trip_through_convert_is_bit_exact(tmp_path, block, scale_dtype):
    w = _weight()
    save_file({"p.weight": w}, tmp_path / "src.safetensors")
    convert_checkpoint(tmp_path / "src.safetensors", tmp_path / "out", "fp8", block=block, scale_dtype=scale_dtype,
                       exclude=None, progress=None)
    m = FP8Linear.from_checkpoint(tmp_path / "out", "p")
    data, scale = formats.quantize_fp8(w, block, scale_dtype)
    assert m.block == block and m.weight_scale.dtype == scale_dtype
    assert torch.equal(_u8(m.weight), _u8(data)) and torch.equal(_u8(m.weight_scale), _u8(scale))
    assert torch.equal(m.dequantize(torch.float32).weight, formats.dequantize_fp8(data, scale, block, torch.float32))
    rows, _ = cli.inspect_checkpoint(tmp_path / "out")
    scale = "e8m0" if scale_dtype == torch.float8_e8m0fnu else "f32"
    assert (rows[0].block, rows[0].scale, rows[0].source, rows[0].status) == (block, scale, "record", "ok")


@pytest.mark.parametrize("block, scale_dtype", FP8_CASES)
def test_fp8_round_trip_through_save_quantized_is_bit_exact(tmp_path, block, scale_dtype):
    lin = torch.nn.Linear(100, 200, bias=True)
    model = torch.nn.ModuleDict({"proj": FP8Linear.from_linear(lin, block=block, scale_dtype=scale_dtype)})
    save_quantized(model, tmp_path / "q")
    m = FP8Linear.from_checkpoint(tmp_path / "q", "proj")
    src = model["proj"]
    assert m.block == block and m.weight_scale.dtype == scale_dtype
    for name in ("weight", "weight_scale", "bias"):
        assert torch.equal(_u8(getattr(m, name)), _u8(getattr(src, name))), name
    x = torch.randn(3, 100)
    assert torch.equal(m(x), src(x))


@pytest.mark.parametrize("k", [100, 99, 33, 1])
def test_fp4_round_trip_records_odd_k(tmp_path, k):
    w = _weight(40, k)
    save_file({"p.weight": w}, tmp_path / "src.safetensors")
    convert_checkpoint(tmp_path / "src.safetensors", tmp_path / "out", "fp4", exclude=None, progress=None)
    m = FP4Linear.from_checkpoint(tmp_path / "out", "p")
    packed, scale = formats.quantize_fp4(w)
    assert m.in_features == k and torch.equal(m.weight, packed) and torch.equal(_u8(m.weight_scale), _u8(scale))
    skeleton = torch.nn.ModuleDict({"p": torch.nn.Linear(k, 40, bias=False)})
    load_quantized_(skeleton, tmp_path / "out")
    assert isinstance(skeleton["p"], FP4Linear) and skeleton["p"].in_features == k


def test_the_96_block_bug_of_the_issue(tmp_path):
    # FP8Linear(block=(96, 96)) saved through its state dict without any record used to
    # reload silently as (64, 64) blocks (127x error on some rows).
    m = FP8Linear.from_linear(torch.nn.Linear(100, 100), block=(96, 96))
    sd = {f"p.{k}": v for k, v in m.state_dict().items() if k != "_extra_state"}
    save_file(sd, tmp_path / "bare.safetensors")
    with pytest.raises(AmbiguousLayoutError, match=r"bn in \[64, 96\], bk in \[64, 96\].*pass block=\(bn, bk\)") as e:
        FP8Linear.from_checkpoint(tmp_path / "bare.safetensors", "p")
    assert ("fp8", (96, 96)) in e.value.candidates and ("fp8", (64, 64)) in e.value.candidates
    rows, totals = cli.inspect_checkpoint(tmp_path / "bare.safetensors")
    assert totals["invalid"] == 1 and "admits more than one block" in rows[0].status  # inspect no longer says ok
    assert FP8Linear.from_checkpoint(tmp_path / "bare.safetensors", "p", block=(96, 96)).block == (96, 96)
    # the module's own record of its block, as FP8Linear state dicts carry it
    sd["p._extra_state"] = torch.tensor([96, 96], dtype=torch.int64)
    save_file(sd, tmp_path / "sd.safetensors")
    r = FP8Linear.from_checkpoint(tmp_path / "sd.safetensors", "p")
    x = torch.randn(2, 100)
    assert r.block == (96, 96) and torch.equal(r(x), m(x))
    with pytest.raises(CheckpointError, match=r"block=\[64, 64\] was passed but p._extra_state records block \[96, 96\]"):
        FP8Linear.from_checkpoint(tmp_path / "sd.safetensors", "p", block=(64, 64))


def test_records_are_in_the_shard_metadata_and_config(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 64))
    save_file({k: v.detach() for k, v in model.state_dict().items()}, tmp_path / "in.safetensors")
    (tmp_path / "cfg").mkdir()
    save_file({k: v.detach() for k, v in model.state_dict().items()}, tmp_path / "cfg" / "model.safetensors")
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(
        {"model_type": "x", "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}))
    convert_checkpoint(tmp_path / "cfg", tmp_path / "out", "fp8", block=(96, 96), exclude=None, progress=None)
    with safe_open(str(tmp_path / "out" / "model-00001-of-00001.safetensors"), "pt") as f:
        records = decode_records(f.metadata(), "shard")
    assert {p: (r.format, r.block, r.scale_dtype, r.out_features, r.in_features) for p, r in records.items()} == {
        "0": ("fp8", (96, 96), torch.float8_e8m0fnu, 96, 64), "1": ("fp8", (96, 96), torch.float8_e8m0fnu, 64, 96)}
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    # the stale family config of the source is replaced: it no longer describes the tensors
    assert qc["quant_method"] == "torch_bq" and qc["block"] == [96, 96] and "weight_block_size" not in qc
    assert detect_linear(tmp_path / "out", "1").source == "record"


def test_config_json_records_a_layer_when_shards_carry_none(tmp_path):
    # torch_bq.hf's save_pretrained wrote no shard records before record version 2; config.json lists its layers
    m = FP8Linear.from_linear(torch.nn.Linear(100, 100), block=(96, 96))
    (tmp_path / "d").mkdir()
    save_file({"p.weight": m.weight, "p.weight_scale": m.weight_scale}, tmp_path / "d" / "model.safetensors")
    qc = {"quant_method": "torch_bq", "format": "fp8", "block": [32, 32], "scale_dtype": "float8_e8m0fnu",
          "layers": {"p": {"format": "fp8", "block": [96, 96], "scale_dtype": "float8_e8m0fnu"}}}
    (tmp_path / "d" / "config.json").write_text(json.dumps({"quantization_config": qc}))
    layout = detect_linear(tmp_path / "d", "p")
    assert (layout.block, layout.source) == ((96, 96), "record")
    del qc["layers"]
    (tmp_path / "d" / "config.json").write_text(json.dumps({"quantization_config": qc}))
    with pytest.raises(CheckpointError, match=r"expected shape \[4, 4\] .* block \[32, 32\] \(from recorded in .*config.json"):
        detect_linear(tmp_path / "d", "p")  # the model-wide default contradicts the tensors: not loaded


def test_record_and_data_disagree(tmp_path):
    d, s = formats.quantize_fp8(_weight(64, 64), (32, 32))
    meta = {"format": "pt", RECORD_KEY: json.dumps({"version": 1, "layers": {"p": {"format": "fp4", "block": [1, 32]}}})}
    save_file({"p.weight": d, "p.weight_scale": s}, tmp_path / "a.safetensors", metadata=meta)
    with pytest.raises(CheckpointError, match=r"records fp4, but the data is torch.float8_e4m3fn"):
        FP8Linear.from_checkpoint(tmp_path / "a.safetensors", "p")
    meta[RECORD_KEY] = json.dumps({"version": 1, "layers": {"p": {"format": "fp8", "block": [64, 64]}}})
    save_file({"p.weight": d, "p.weight_scale": s}, tmp_path / "b.safetensors", metadata=meta)
    with pytest.raises(CheckpointError, match=r"expected shape \[1, 1\].*block \[64, 64\] \(from recorded in"):
        FP8Linear.from_checkpoint(tmp_path / "b.safetensors", "p")


def test_quantize_then_save_quantized_then_load_quantized(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(100, 96), torch.nn.ReLU(), torch.nn.Linear(96, 40))
    quantize_(model, "fp8", block=(96, 96))
    save_quantized(model, tmp_path / "q", max_shard_bytes=5000)
    assert len(list((tmp_path / "q").glob("*.safetensors"))) > 1
    skeleton = torch.nn.Sequential(torch.nn.Linear(100, 96), torch.nn.ReLU(), torch.nn.Linear(96, 40))
    load_quantized_(skeleton, tmp_path / "q")
    x = torch.randn(4, 100)
    assert skeleton[0].block == (96, 96) and torch.equal(skeleton(x), model(x))


def test_fp8_linear_on_an_fp4_layer_says_so():
    # No 0x7F byte in this packed fp4 data: it used to load as an FP8Linear with 1x16 blocks.
    packed, scale = formats.quantize_fp4(torch.full((4, 64), 0.5))
    assert not bool(((packed & 0x7F) == 0x7F).any())
    with pytest.raises(CheckpointError, match=r"holds fp4 weights .*load them with FP4Linear, not FP8Linear"):
        FP8Linear.from_checkpoint({"p.weight": packed, "p.weight_scale": scale}, "p")


@pytest.mark.parametrize(
    "value, match",
    [([128, "x"], r"weight_block_size: expected a block \[bn, bk\] of two positive ints, got \[128, 'x'\]"),
     ([128.7, 128], r"got \[128.7, 128\]"), ([[128], 128], r"got \[\[128\], 128\]"), (128, r"got 128"),
     ([True, 128], r"got \[True, 128\]"), ([0, 128], r"got \[0, 128\]"), ([128, 128, 1], r"got \[128, 128, 1\]")],
)
def test_hostile_config_block_values_are_named(tmp_path, value, match):
    d, s = formats.quantize_fp8(_weight(256, 256), (128, 128), torch.float32)
    (tmp_path / "d").mkdir()
    save_file({"p.weight": d, "p.weight_scale_inv": s}, tmp_path / "d" / "model.safetensors")
    (tmp_path / "d" / "config.json").write_text(json.dumps({"quantization_config": {"weight_block_size": value}}))
    with pytest.raises(CheckpointError, match=r"config.json quantization_config.weight_block_size: .*" + match[:0]):
        FP8Linear.from_checkpoint(tmp_path / "d", "p")
    with pytest.raises(CheckpointError, match=match):
        FP8Linear.from_checkpoint(tmp_path / "d", "p")


@pytest.mark.parametrize("config", ['[1, 2]', '{"quantization_config": [128]}', '"x"',
                                    '{"quantization_config": {"quant_method": "torch_bq", "format": 7}}',
                                    '{"quantization_config": {"quant_method": "torch_bq", "format": "fp8", "block": "96x96"}}'])
def test_hostile_config_shapes_are_named(tmp_path, config):
    d, s = formats.quantize_fp8(_weight(256, 256), (128, 128), torch.float32)
    (tmp_path / "d").mkdir()
    save_file({"p.weight": d, "p.weight_scale_inv": s}, tmp_path / "d" / "model.safetensors")
    (tmp_path / "d" / "config.json").write_text(config)
    with pytest.raises(CheckpointError, match="config.json"):
        FP8Linear.from_checkpoint(tmp_path / "d", "p")


@pytest.mark.parametrize("bad", [3e38, float("inf"), float("nan"), 0.0, -1.0])
def test_float32_scales_out_of_range_are_rejected(bad):
    d, s = formats.quantize_fp8(_weight(256, 256), (128, 128), torch.float32)
    s = s.clone()
    s[1, 0] = bad
    with pytest.raises(CheckpointError, match=r"x.weight_scale_inv: found .* at index \[1, 0\]"):
        FP8Linear.from_checkpoint({"x.weight": d, "x.weight_scale_inv": s}, "x", block=(128, 128))


# --------------------------------------------------------------------------- #
# NVFP4 (ModelOpt layout)
# --------------------------------------------------------------------------- #


def _modelopt_dir(root, n=48, k=100, bias=True, config=True):
    from torch_bq.formats import quantize_nvfp4

    w = _weight(n, k, seed=3)
    data, scale, scale_2 = quantize_nvfp4(w)
    tensors = {"m.weight": data, "m.weight_scale": scale, "m.weight_scale_2": scale_2,
               "m.input_scale": torch.tensor(0.5)}
    if bias:
        tensors["m.bias"] = torch.randn(n, generator=torch.Generator().manual_seed(4)).bfloat16()
    root.mkdir()
    save_file(tensors, root / "model.safetensors")
    if config:
        (root / "config.json").write_text(json.dumps({"quantization_config": {
            "quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}}))
    return tensors


def test_modelopt_nvfp4_layout_loads_bit_exactly(tmp_path):
    from torch_bq.nn import NVFP4Linear

    t = _modelopt_dir(tmp_path / "mo")
    layout = detect_linear(tmp_path / "mo", "m")
    assert (layout.layout, layout.format, layout.block, layout.source) == ("modelopt", "nvfp4", (1, 16), "config")
    m = NVFP4Linear.from_checkpoint(tmp_path / "mo", "m")
    assert torch.equal(m.weight, t["m.weight"]) and torch.equal(_u8(m.weight_scale), _u8(t["m.weight_scale"]))
    assert torch.equal(m.weight_scale_2, t["m.weight_scale_2"].reshape(())) and torch.equal(m.bias, t["m.bias"])
    expected = formats.dequantize_nvfp4(t["m.weight"], t["m.weight_scale"], t["m.weight_scale_2"], 100)
    assert torch.equal(m.dequantize(torch.float32).weight, expected)
    with pytest.raises(CheckpointError, match="load them with NVFP4Linear, not FP4Linear"):
        FP4Linear.from_checkpoint(tmp_path / "mo", "m")
    skeleton = torch.nn.ModuleDict({"m": torch.nn.Linear(100, 48)})
    load_quantized_(skeleton, tmp_path / "mo")
    assert isinstance(skeleton["m"], NVFP4Linear)
    rows, totals = cli.inspect_checkpoint(tmp_path / "mo")
    assert (rows[0].format, rows[0].block, rows[0].status, totals["invalid"]) == ("nvfp4", (1, 16), "ok", 0)


def test_modelopt_nvfp4_errors(tmp_path):
    from torch_bq.nn import NVFP4Linear

    t = _modelopt_dir(tmp_path / "a", config=False)
    (tmp_path / "a" / "config.json").write_text(json.dumps({"quantization_config": {"quant_algo": "NVFP4", "group_size": 32}}))
    with pytest.raises(CheckpointError, match="NVFP4 uses 1x16 blocks, the config says 32"):
        NVFP4Linear.from_checkpoint(tmp_path / "a", "m")
    bad = dict(t)
    bad["m.weight_scale_2"] = torch.tensor(float("inf"))
    with pytest.raises(CheckpointError, match="weight_scale_2"):
        NVFP4Linear.from_checkpoint(bad, "m")
    bad["m.weight_scale_2"] = torch.tensor(3e38)
    with pytest.raises(CheckpointError, match="m.weight_scale_2: found scale 3e\\+38"):
        NVFP4Linear.from_checkpoint(bad, "m")
    bad = dict(t)
    bad["m.weight_scale"] = t["m.weight_scale"][:, :3]
    with pytest.raises(CheckpointError, match=r"m.weight_scale: expected shape \[48, 7\]"):
        NVFP4Linear.from_checkpoint(bad, "m")


def test_convert_to_nvfp4_round_trips(tmp_path):
    from torch_bq.nn import NVFP4Linear

    w = _weight(40, 99)
    save_file({"p.weight": w}, tmp_path / "src.safetensors")
    assert cli.convert_main([str(tmp_path / "src.safetensors"), str(tmp_path / "out"), "--format", "nvfp4", "-q",
                             "--exclude", ""]) == 0
    m = NVFP4Linear.from_checkpoint(tmp_path / "out", "p")
    data, scale, scale_2 = formats.quantize_nvfp4(w)
    assert m.in_features == 99 and torch.equal(m.weight, data) and torch.equal(_u8(m.weight_scale), _u8(scale))
    assert torch.equal(m.weight_scale_2, scale_2.reshape(())) and detect_linear(tmp_path / "out", "p").source == "record"


def test_one_nan_scan_and_one_class_check_per_load(tmp_path, monkeypatch):
    import torch_bq.checkpoint.layouts as layouts
    import torch_bq.nn.linear as linear

    calls = {"scan": 0, "check": 0}
    real_scan, real_check = layouts.scan_nan_codes, linear.check_module_class

    def scan(*a, **k):
        calls["scan"] += 1
        return real_scan(*a, **k)

    def check(*a, **k):
        calls["check"] += 1
        return real_check(*a, **k)

    monkeypatch.setattr(layouts, "scan_nan_codes", scan)
    monkeypatch.setattr(linear, "scan_nan_codes", scan)
    monkeypatch.setattr(linear, "check_module_class", check)
    model = torch.nn.ModuleDict({"p": FP8Linear.from_linear(torch.nn.Linear(64, 64))})
    save_quantized(model, tmp_path / "q")
    calls.update(scan=0, check=0)
    FP8Linear.from_checkpoint(tmp_path / "q", "p")
    assert calls == {"scan": 1, "check": 1}


def test_modelopt_per_tensor_fp8_loads_bit_exactly(tmp_path):
    # ModelOpt FP8: e4m3 data, ONE float32 weight_scale, input_scale (static, ignored)
    w = _weight(48, 100)
    scale = (w.abs().max() / 448).reshape(())
    data = (w / scale).to(torch.float8_e4m3fn)
    (tmp_path / "mo").mkdir()
    save_file({"m.weight": data, "m.weight_scale": scale, "m.input_scale": torch.tensor(0.25)},
              tmp_path / "mo" / "model.safetensors")
    (tmp_path / "mo" / "config.json").write_text(json.dumps(
        {"quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8"}}))
    layout = detect_linear(tmp_path / "mo", "m")
    assert (layout.layout, layout.format, layout.block) == ("modelopt", "fp8", (48, 100))
    m = FP8Linear.from_checkpoint(tmp_path / "mo", "m")
    assert torch.equal(m.dequantize(torch.float32).weight, data.float() * scale)
    skeleton = torch.nn.ModuleDict({"m": torch.nn.Linear(100, 48, bias=False)})
    load_quantized_(skeleton, tmp_path / "mo")
    x = torch.randn(2, 100)
    assert isinstance(skeleton["m"], FP8Linear) and torch.equal(skeleton["m"](x), m(x))
    with pytest.raises(CheckpointError, match="a scalar scale is ModelOpt's per-tensor FP8 and needs F8_E4M3 data"):
        FP8Linear.from_checkpoint({"m.weight": data.view(torch.uint8), "m.weight_scale": scale}, "m")


class _Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 64)
        self.proj = torch.nn.Linear(64, 64)
        self.head = torch.nn.Linear(64, 50, bias=False)
        self.head.weight = self.embed.weight  # tied, as lm_head = embed_tokens


def test_tied_weights_are_stored_once_and_read_back_under_both_names(tmp_path):
    from torch_bq.checkpoint import CheckpointReader

    torch.manual_seed(0)
    model = _Tied()
    quantize_(model, "fp8", filter_fn=lambda m, name: name == "proj")
    summary = save_quantized(model, tmp_path / "q")
    assert summary["tied"] == {"head.weight": "embed.weight"}
    reader = CheckpointReader(tmp_path / "q")
    assert "head.weight" in reader and "head.weight" not in reader.keys()
    assert torch.equal(reader.get("head.weight"), model.embed.weight.detach())
    skeleton = _Tied()
    load_quantized_(skeleton, tmp_path / "q")  # strict: every model tensor is found
    x = torch.randint(0, 50, (3,))
    assert torch.equal(skeleton.head(skeleton.proj(skeleton.embed(x))), model.head(model.proj(model.embed(x))))


# --------------------------------------------------------------------------- #
# the trailing unit axis on element codes (record version 2, torch_bq.checkpoint.stored)
# --------------------------------------------------------------------------- #


def _quantized_modules(fmt):
    from torch_bq.nn import FP4Experts, FP8Experts

    g = torch.Generator().manual_seed(3)
    lin = torch.nn.Linear(64, 40)
    experts = (FP8Experts if fmt == "fp8" else FP4Experts).from_weights(
        torch.randn(3, 96, 64, generator=g) * 0.05, torch.randn(3, 64, 48, generator=g) * 0.05)
    proj = FP8Linear.from_linear(lin, block=(32, 32)) if fmt == "fp8" else FP4Linear.from_linear(lin)
    return torch.nn.ModuleDict({"proj": proj, "experts": experts})


def _header(path):
    """``(name -> shape as stored, the record body)`` from the file's own header."""
    with safe_open(str(path), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}, json.loads(f.metadata()[RECORD_KEY])


def _assert_same_buffers(a, b):
    sa, sb = dict(a.named_buffers()), dict(b.named_buffers())
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(_u8(sa[k]), _u8(sb[k])), k


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_save_quantized_stores_codes_with_a_recorded_unit_axis_and_reads_them_back(tmp_path, fmt):
    from torch_bq.nn.expert_checkpoint import load_experts

    model = _quantized_modules(fmt)
    save_quantized(model, tmp_path / "q")
    shapes, body = _header(tmp_path / "q" / "model-00001-of-00001.safetensors")
    state = model.state_dict()
    for name in ("proj.weight", "experts.gate_up_proj", "experts.down_proj"):
        assert shapes[name] == (*state[name].shape, 1), name  # no reader can take it for [N, K]
    for name in ("proj.weight_scale", "experts.gate_up_proj_scale", "proj.bias"):
        assert shapes[name] == tuple(state[name].shape), name
    assert body["version"] == 2
    assert body["layers"]["proj"]["unit_axis"] == ["weight"]
    assert body["layers"]["experts"]["unit_axis"] == ["gate_up_proj", "down_proj"]
    # in memory the shapes are natural again, bit for bit
    cls = FP8Linear if fmt == "fp8" else FP4Linear
    _assert_same_buffers(cls.from_checkpoint(tmp_path / "q", "proj"), model["proj"])
    _assert_same_buffers(load_experts(type(model["experts"]), tmp_path / "q", "experts", layout="torch_bq"),
                         model["experts"])


def test_convert_stores_codes_with_a_recorded_unit_axis_in_every_shard_that_holds_them(tmp_path):
    g = torch.Generator().manual_seed(4)
    src = {"p.weight": torch.randn(40, 64, generator=g), "e.gate_up_proj": torch.randn(3, 96, 64, generator=g) * 0.1,
           "e.down_proj": torch.randn(3, 64, 48, generator=g) * 0.1}
    save_file({"e.gate_up_proj": src["e.gate_up_proj"]}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({"p.weight": src["p.weight"], "e.down_proj": src["e.down_proj"]},
              tmp_path / "model-00002-of-00002.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "e.gate_up_proj": "model-00001-of-00002.safetensors", "p.weight": "model-00002-of-00002.safetensors",
        "e.down_proj": "model-00002-of-00002.safetensors"}}))
    convert_checkpoint(tmp_path, tmp_path / "out", "fp4", exclude=None, progress=None)
    first, body1 = _header(tmp_path / "out" / "model-00001-of-00002.safetensors")
    second, body2 = _header(tmp_path / "out" / "model-00002-of-00002.safetensors")
    assert first["e.gate_up_proj"] == (3, 96, 32, 1) and body1["layers"]["e"]["unit_axis"] == ["gate_up_proj"]
    assert second["e.down_proj"] == (3, 64, 24, 1) and second["p.weight"] == (40, 32, 1)
    assert body2["layers"]["e"]["unit_axis"] == ["down_proj"] and body2["layers"]["p"]["unit_axis"] == ["weight"]
    m = FP4Linear.from_checkpoint(tmp_path / "out", "p")
    data, scale = formats.quantize_fp4(src["p.weight"])
    assert torch.equal(_u8(m.weight), _u8(data)) and torch.equal(_u8(m.weight_scale), _u8(scale))


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_a_file_written_before_the_unit_axis_loads_bit_exactly(tmp_path, fmt):
    # torch_bq <= record version 1: natural shapes, records without unit_axis
    from torch_bq.nn.expert_checkpoint import load_experts
    from torch_bq.nn.save import layer_records

    model = _quantized_modules(fmt)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    layers = {p: r.to_json() for p, r in layer_records(model).items()}
    assert not any("unit_axis" in r for r in layers.values())
    save_file(tensors, tmp_path / "old.safetensors",
              metadata={"format": "pt", RECORD_KEY: json.dumps({"version": 1, "layers": layers})})
    cls = FP8Linear if fmt == "fp8" else FP4Linear
    _assert_same_buffers(cls.from_checkpoint(tmp_path / "old.safetensors", "proj"), model["proj"])
    _assert_same_buffers(load_experts(type(model["experts"]), tmp_path / "old.safetensors", "experts",
                                      layout="torch_bq"), model["experts"])
    skeleton = _quantized_modules(fmt)
    load_quantized_(skeleton, tmp_path / "old.safetensors")
    _assert_same_buffers(skeleton, model)


def test_a_recorded_unit_axis_must_be_there_and_be_recorded_right(tmp_path):
    d, s = formats.quantize_fp8(_weight(64, 64), (32, 32))

    def write(name, tensors, body):
        save_file(tensors, tmp_path / name, metadata={RECORD_KEY: json.dumps(body)})
        return tmp_path / name

    layer = {"format": "fp8", "block": [32, 32], "unit_axis": ["weight"]}
    path = write("natural.safetensors", {"p.weight": d, "p.weight_scale": s}, {"version": 2, "layers": {"p": layer}})
    with pytest.raises(CheckpointError, match=r"'p.weight' is recorded .* trailing unit axis, but its shape is \[64, 64\]"):
        FP8Linear.from_checkpoint(path, "p")
    path = write("v1.safetensors", {"p.weight": d[..., None], "p.weight_scale": s}, {"version": 1, "layers": {"p": layer}})
    with pytest.raises(CheckpointError, match="unit_axis is a version 2 field, the record says version 1"):
        FP8Linear.from_checkpoint(path, "p")
    for bad, match in (({**layer, "unit_axis": ["weight_scale"]}, r"unit_axis: expected a list of names in"),
                       ({**layer, "unit_axis": "weight"}, r"unit_axis: expected a list"),
                       ({"format": "bf16", "unit_axis": ["weight"]}, r"only \['fp8', 'fp4'\] codes")):
        path = write("bad.safetensors", {"p.weight": d[..., None], "p.weight_scale": s},
                     {"version": 2, "layers": {"p": bad}})
        with pytest.raises(CheckpointError, match=match):
            FP8Linear.from_checkpoint(path, "p")
    # a torch_bq file rewritten without its records: the error says what the trailing 1 may be
    path = write("lost.safetensors", {"p.weight": d[..., None], "p.weight_scale": s}, {"version": 2, "layers": {}})
    with pytest.raises(CheckpointError, match=r"ending in a unit axis, it is torch_bq codes whose file lost its"):
        FP8Linear.from_checkpoint(path, "p")
    # and a version this torch_bq does not know yet is refused, not guessed at
    path = write("v3.safetensors", {"p.weight": d, "p.weight_scale": s}, {"version": 3, "layers": {}})
    with pytest.raises(CheckpointError, match=r"record version 3 is not one this torch_bq reads \(<= 2\)"):
        FP8Linear.from_checkpoint(path, "p")
