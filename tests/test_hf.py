"""torch_bq.hf: transformers' from_pretrained / save_pretrained / generate / compile on tiny models of four families.

Checkpoints are written by tests/hf_fixtures.py in each family's own release layout
(DeepSeek-V3 fp8 with partial 128x128 blocks and per-expert tensors, Qwen3 fine-grained
fp8 with tied embeddings, gpt-oss MXFP4 fused experts) or in bf16 (Llama and all four,
quantized on load), from transformers configs; nothing is downloaded.
"""

import json
import logging
import re
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

transformers = pytest.importorskip("transformers")

import hf_fixtures as fx  # noqa: E402
import torch_bq.hf as tbh  # noqa: E402
from torch_bq.nn import (  # noqa: E402
    CheckpointError,
    FP4Experts,
    FP4Linear,
    FP8Experts,
    FP8Linear,
    convert_checkpoint,
    empty_model,
    load_quantized_,
    quantize_,
)
from torch_bq.nn.selection import DEFAULT_EXCLUDE  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

PREQUANTIZED = {"deepseek_v3": fx.deepseek_fp8, "qwen3": fx.qwen3_fp8, "gpt_oss": fx.gpt_oss_mxfp4}
PROMPT = torch.tensor([[1, 5, 9, 200, 17, 3, 42, 7]])

# transformers' reference rounds every activation to bf16 (relative error <= 2^-9, about
# 54 dB per rounding) while torch_bq's ops keep float32 inside and round once; over two
# layers of ~10 roundings each the two stay above 30 dB apart. A wrong scale, block,
# orientation or expert order costs far more (each measured below 12 dB when injected).
SQNR_FLOOR_DB = 30.0


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """``ckpt(kind, family)``: the path of a checkpoint, written on first use."""
    root = tmp_path_factory.mktemp("hf")
    cache = {}

    def get(kind, family):
        key = (kind, family)
        if key not in cache:
            model = fx.float_model(family)
            path = root / f"{kind}_{family}"
            cache[key] = fx.save_bf16(model, path) if kind == "bf16" else PREQUANTIZED[family](model, path)
        return cache[key]

    return get


def _load(path, **config):
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=tbh.TorchBQConfig(**config))


def _bytes(t):
    return t.view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)


def _assert_same_state(a: nn.Module, b: nn.Module):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys(), sorted(sa.keys() ^ sb.keys())
    for k in sa:
        assert sa[k].dtype == sb[k].dtype, (k, sa[k].dtype, sb[k].dtype)
        assert torch.equal(_bytes(sa[k]), _bytes(sb[k])), k


def _no_act_quant(model):
    for m in model.modules():
        if hasattr(m, "act_quant") and isinstance(m, (FP8Linear, FP4Linear, FP8Experts, FP4Experts)):
            m.act_quant = False
    return model


# --------------------------------------------------------------------------- #
# pre-quantized checkpoints of the families' own layouts
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("family", sorted(PREQUANTIZED))
def test_prequantized_checkpoint_loads_into_torch_bq_modules(ckpt, family):
    path = ckpt("q", family)
    model = _load(path)
    stored = load_file(path / "model.safetensors")
    quantized = {k.rsplit(".", 1)[0] for k in stored if k.endswith(".weight_scale_inv")}
    quantized_experts = {k.rsplit(".", 1)[0] for k in stored if k.endswith("_blocks")}
    modules = dict(model.named_modules())
    linears = {n for n in quantized if ".experts." not in n}
    assert linears == {n for n, m in modules.items() if isinstance(m, (FP8Linear, FP4Linear))}
    experts = {n for n, m in modules.items() if isinstance(m, (FP8Experts, FP4Experts))}
    want_experts = quantized_experts | {
        n.split(".experts.")[0] + ".experts" for n in quantized if ".experts." in n}
    assert experts == want_experts and (experts or family == "qwen3")
    # embeddings and lm_head stay as stored (bf16), routers are the model's own
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight.dtype == torch.bfloat16
    if family == "deepseek_v3":
        assert type(model.model.layers[1].mlp.gate).__name__ == "DeepseekV3TopkRouter"
        assert model.model.layers[1].self_attn.q_a_proj.block == (128, 128)  # [96, 160]: partial blocks
    if family == "gpt_oss":
        assert type(model.model.layers[0].mlp.router).__name__ == "GptOssTopKRouter"
        assert model.model.layers[0].mlp.experts.activation == "gpt-oss"
    if family == "qwen3":
        assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("family", sorted(PREQUANTIZED))
def test_prequantized_logits_match_the_dequantized_model(ckpt, family):
    path = ckpt("q", family)
    model, reference = _load(path), fx.dequantized_model(family, path)
    with torch.no_grad():
        ref = reference(PROMPT).logits
        with_act_quant = model(PROMPT).logits
        exact_weights = _no_act_quant(model)(PROMPT).logits
    sqnr = fx.sqnr_db(exact_weights, ref)
    assert sqnr > SQNR_FLOOR_DB, f"{family}: {sqnr:.1f} dB against the dequantized bf16 model"
    # with fp8 activations (the default) the output moves, but stays a model's output
    assert torch.isfinite(with_act_quant).all() and fx.sqnr_db(with_act_quant, ref) > 5.0


@pytest.mark.parametrize("family", sorted(PREQUANTIZED))
def test_save_pretrained_round_trip_is_bit_exact(ckpt, family, tmp_path):
    model = _load(ckpt("q", family))
    model.save_pretrained(tmp_path / "saved")
    qc = json.loads((tmp_path / "saved" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "torch_bq" and qc["format"] in ("fp8", "fp4") and qc["layers"]
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")  # the config says torch_bq
    _assert_same_state(model, again)
    with torch.no_grad():
        assert torch.equal(model(PROMPT).logits, again(PROMPT).logits)


@pytest.mark.parametrize("family", fx.FAMILIES)
def test_greedy_generate_equals_the_eager_loop(ckpt, family):
    kind = "q" if family in PREQUANTIZED else "bf16"
    model = _load(ckpt(kind, family), **({} if kind == "q" else {"format": "fp8"}))
    out = model.generate(PROMPT, max_new_tokens=8, do_sample=False)
    ids = PROMPT
    with torch.no_grad():
        for _ in range(8):  # no cache: every step recomputes the whole sequence
            ids = torch.cat([ids, model(ids, use_cache=False).logits[:, -1:].argmax(-1)], dim=1)
    assert out.tolist() == ids.tolist()


# --------------------------------------------------------------------------- #
# quantize on load, convert output
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("family, fmt", [("llama", "fp8"), ("qwen3", "fp4"), ("deepseek_v3", "fp8"), ("gpt_oss", "fp4")])
def test_quantize_on_load_equals_quantize_and_round_trips(ckpt, family, fmt, tmp_path):
    path = ckpt("bf16", family)
    model = _load(path, format=fmt)
    reference = AutoModelForCausalLM.from_pretrained(path)
    report = quantize_(reference, fmt)
    assert report.experts == ([] if family in ("llama", "qwen3") else
                              [n for n, m in model.named_modules() if isinstance(m, (FP8Experts, FP4Experts))])
    _assert_same_state(model, reference)
    if family == "qwen3":
        assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(tmp_path / "saved")
    _assert_same_state(model, AutoModelForCausalLM.from_pretrained(tmp_path / "saved"))


@pytest.mark.parametrize("family, fmt", [("llama", "fp8"), ("gpt_oss", "fp4"), ("deepseek_v3", "fp8")])
def test_convert_output_loads_with_a_plain_from_pretrained(ckpt, family, fmt, tmp_path):
    src = ckpt("bf16", family)
    summary = convert_checkpoint(src, tmp_path / "q", fmt, progress=None)
    if family == "gpt_oss":  # the 3-D experts are quantized too
        assert any(n.endswith("experts.gate_up_proj") for n in summary["quantized"])
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "torch_bq" and qc["format"] == fmt
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    reference = AutoModelForCausalLM.from_pretrained(src)
    quantize_(reference, fmt)
    _assert_same_state(model, reference)


# --------------------------------------------------------------------------- #
# refusals
# --------------------------------------------------------------------------- #


@pytest.fixture
def hf_log(caplog, monkeypatch):
    """``caplog`` with transformers' records in it. transformers hands them to the root logger
    (where caplog listens) only when ``$CI`` is set; otherwise its handler writes them to the
    stderr it found at import, which neither caplog nor capfd sees."""
    monkeypatch.setattr(logging.getLogger("transformers"), "propagate", True)
    return caplog


def test_quantized_bytes_without_a_scale_are_refused(ckpt, tmp_path, hf_log):
    path = ckpt("q", "qwen3")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight_scale_inv"]
    (tmp_path / "bad").mkdir()
    save_file(tensors, tmp_path / "bad" / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "bad" / "config.json").write_text((path / "config.json").read_text())
    # transformers collects errors of conversion ops into its load report and raises after it
    with pytest.raises(RuntimeError, match="issues during automatic conversion"):
        _load(tmp_path / "bad")
    assert "down_proj.weight: holds torch.float8_e4m3fn data but the checkpoint has no scale" in hf_log.text


def test_a_missing_expert_is_refused(ckpt, tmp_path, hf_log):
    path = ckpt("q", "deepseek_v3")
    tensors = {k: v for k, v in load_file(path / "model.safetensors").items() if ".experts.3." not in k}
    (tmp_path / "bad").mkdir()
    save_file(tensors, tmp_path / "bad" / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "bad" / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(RuntimeError, match="issues during automatic conversion"):
        _load(tmp_path / "bad")
    assert "the checkpoint holds 3 tensors matching" in hf_log.text


def test_a_format_the_checkpoint_does_not_hold_is_refused(ckpt):
    with pytest.raises(CheckpointError, match=r"holds fp4 weights, but TorchBQConfig\(format='fp8'\)"):
        _load(ckpt("q", "gpt_oss"), format="fp8")


def test_a_bf16_checkpoint_needs_a_format(ckpt):
    with pytest.raises(ValueError, match="not quantized; pass format='fp8' or format='fp4'"):
        _load(ckpt("bf16", "llama"))


def test_config_round_trips_and_checks_its_arguments():
    config = tbh.TorchBQConfig(format="fp8", block=(128, 128), scale_dtype=torch.float32, act_peak=448.0)
    d = config.to_dict()
    assert d["quant_method"] == "torch_bq" and d["block"] == [128, 128] and d["scale_dtype"] == "float32"
    assert tbh.TorchBQConfig.from_dict(d).to_dict() == d
    with pytest.raises(ValueError, match="format"):
        tbh.TorchBQConfig(format="int4")
    with pytest.raises(ValueError, match="scale_dtype"):
        tbh.TorchBQConfig(scale_dtype="float16")
    with pytest.raises(TypeError, match=r"unknown options \['blocks'\]"):
        tbh.TorchBQConfig(blocks=(1, 32))


def test_transformers_is_imported_only_by_torch_bq_hf():
    code = "import sys, torch_bq, torch_bq.nn, torch_bq.cli; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# --------------------------------------------------------------------------- #
# compile
# --------------------------------------------------------------------------- #


@pytest.mark.slow
@pytest.mark.parametrize("family", fx.FAMILIES)
def test_forward_compiles_fullgraph_dynamic(ckpt, family):
    kind = "q" if family in PREQUANTIZED else "bf16"
    model = _load(ckpt(kind, family), **({} if kind == "q" else {"format": "fp4"}))
    for act_quant in (True, False):
        if not act_quant:
            _no_act_quant(model)
        torch._dynamo.reset()
        compiled = torch.compile(model.forward, fullgraph=True, dynamic=True)  # raises on any graph break
        with torch.no_grad():
            for n in (5, 8):  # two lengths: one dynamic graph
                ids = PROMPT[:, :n]
                eager = model(ids, use_cache=False).logits
                got = compiled(ids, use_cache=False).logits
                # Inductor keeps float32 where eager rounds each op to bf16; without activation
                # quantization that is the reference argument above (> 30 dB). With it, an ulp of
                # difference can move an activation across an fp8 rounding boundary (one e4m3 step,
                # 2^-4 relative) in a few elements, so the floor is lower.
                floor = 20.0 if act_quant else SQNR_FLOOR_DB
                assert fx.sqnr_db(got, eager) > floor, (family, act_quant, n)


# --------------------------------------------------------------------------- #
# the manual recipe: empty_model + load_quantized_
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("family", fx.FAMILIES)
def test_empty_model_and_load_quantized_give_the_from_pretrained_model(ckpt, family, tmp_path):
    from torch_bq.nn import empty_model, load_quantized_

    if family in PREQUANTIZED:
        path = ckpt("q", family)
    else:
        path = tmp_path / "q"
        convert_checkpoint(ckpt("bf16", family), path, "fp8", progress=None)
    skeleton = empty_model(fx.config(family), dtype=torch.bfloat16)
    assert not skeleton.model.rotary_emb.inv_freq.is_meta
    report = load_quantized_(skeleton, path)
    assert report.missing == [] and report.unfilled == []
    assert bool(report.experts) == (family in ("deepseek_v3", "gpt_oss"))
    if family == "qwen3":
        assert skeleton.lm_head.weight is skeleton.model.embed_tokens.weight
    loaded = _load(path)
    _assert_same_state(skeleton, loaded)
    with torch.no_grad():
        assert torch.equal(skeleton(PROMPT).logits, loaded(PROMPT).logits)


def test_a_quantized_directory_without_quantization_config_loads_from_its_tensors(ckpt, tmp_path):
    # e.g. torch_bq convert output from before config records: the headers say it is quantized
    src = tmp_path / "q"
    convert_checkpoint(ckpt("bf16", "llama"), src, "fp8", progress=None)
    config = json.loads((src / "config.json").read_text())
    del config["quantization_config"]
    (src / "config.json").write_text(json.dumps(config))
    model = _load(src)
    assert isinstance(model.model.layers[0].mlp.up_proj, FP8Linear)
    reference = AutoModelForCausalLM.from_pretrained(ckpt("bf16", "llama"))
    quantize_(reference, "fp8")
    _assert_same_state(model, reference)


# --------------------------------------------------------------------------- #
# models quantized in place (quantize_, load_quantized_), saved by transformers
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("family, fmt", [("llama", "fp8"), ("gpt_oss", "fp4"), ("deepseek_v3", "fp8")])
def test_quantize_on_a_plainly_loaded_model_saves_what_from_pretrained_reloads(ckpt, family, fmt, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(ckpt("bf16", family))  # no quantization_config: no quantizer
    assert getattr(model, "hf_quantizer", None) is None
    report = quantize_(model, fmt)
    assert isinstance(model.hf_quantizer, tbh.TorchBQQuantizer)
    model.save_pretrained(tmp_path / "saved")
    qc = json.loads((tmp_path / "saved" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "torch_bq" and qc["format"] == fmt
    assert qc["exclude"] == DEFAULT_EXCLUDE and qc["modules_to_not_convert"] == ["lm_head", "model.embed_tokens"]
    assert sorted(qc["layers"]) == sorted(report.converted)
    if fmt == "fp8":
        assert (qc["block"], qc["scale_dtype"]) == ([32, 32], "float8_e8m0fnu")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    _assert_same_state(model, reloaded)
    # the same directory as quantizing on load writes
    on_load = _load(ckpt("bf16", family), format=fmt)
    on_load.save_pretrained(tmp_path / "on_load")
    assert json.loads((tmp_path / "on_load" / "config.json").read_text())["quantization_config"]["layers"] == qc["layers"]
    _assert_same_state(on_load, reloaded)


def test_a_second_quantize_with_another_format_is_recorded_per_layer(ckpt, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(ckpt("bf16", "llama"))
    quantize_(model, "fp8")
    quantize_(model, "fp4", filter_fn=lambda m, name: name == "lm_head")
    assert isinstance(model.lm_head, FP4Linear)
    model.save_pretrained(tmp_path / "saved")
    qc = json.loads((tmp_path / "saved" / "config.json").read_text())["quantization_config"]
    # one model-wide format would make the reload refuse the layers of the other one
    assert qc["format"] is None and qc["layers"]["lm_head"]["format"] == "fp4"
    assert qc["layers"]["model.layers.0.mlp.up_proj"]["format"] == "fp8"
    _assert_same_state(model, AutoModelForCausalLM.from_pretrained(tmp_path / "saved"))


def test_load_quantized_into_a_skeleton_saves_what_from_pretrained_reloads(ckpt, tmp_path):
    convert_checkpoint(ckpt("bf16", "gpt_oss"), tmp_path / "q", "fp4", progress=None)
    skeleton = empty_model(fx.config("gpt_oss"), dtype=torch.bfloat16)
    load_quantized_(skeleton, tmp_path / "q")
    skeleton.save_pretrained(tmp_path / "saved")
    qc = json.loads((tmp_path / "saved" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "torch_bq" and qc["format"] == "fp4"
    _assert_same_state(skeleton, AutoModelForCausalLM.from_pretrained(tmp_path / "saved"))


def test_a_float_quantize_attaches_no_quantizer(ckpt):
    model = AutoModelForCausalLM.from_pretrained(ckpt("bf16", "llama"))
    quantize_(model, "bf16")  # BF16Linear: plain bf16 weights, which transformers reads correctly
    assert getattr(model, "hf_quantizer", None) is None


def test_a_model_with_another_transformers_quantizer_is_refused_unchanged(ckpt):
    from types import SimpleNamespace

    model = AutoModelForCausalLM.from_pretrained(ckpt("bf16", "llama"))
    model.hf_quantizer = SimpleNamespace(quantization_config=SimpleNamespace(quant_method="bitsandbytes"))
    with pytest.raises(ValueError, match="loaded with transformers' SimpleNamespace.*'bitsandbytes'"):
        quantize_(model, "fp8")
    assert not any(isinstance(m, (FP8Linear, FP4Linear)) for m in model.modules())


def test_without_a_usable_torch_bq_hf_quantize_warns_that_save_pretrained_is_unprotected(ckpt, monkeypatch):
    import torch_bq

    # what a transformers torch_bq.hf cannot plug into (4.x) looks like: importing it raises ImportError
    monkeypatch.delattr(torch_bq, "hf")
    monkeypatch.setitem(sys.modules, "torch_bq.hf", None)
    model = AutoModelForCausalLM.from_pretrained(ckpt("bf16", "llama"))
    with pytest.warns(UserWarning, match="reads back as bf16 values; save it with torch_bq.nn.save_quantized"):
        quantize_(model, "fp8")
    assert isinstance(model.model.layers[0].mlp.up_proj, FP8Linear)
    assert getattr(model, "hf_quantizer", None) is None


# Loads each directory with transformers alone (no torch_bq import), printing a marker, transformers'
# own load report (logged to stderr) and what from_pretrained raised.
_PLAIN_LOAD = """
import sys
from transformers import AutoModelForCausalLM
for path in sys.argv[1:]:
    print("=== " + path, file=sys.stderr, flush=True)
    try:
        AutoModelForCausalLM.from_pretrained(path)
        print("LOADED", file=sys.stderr, flush=True)
    except Exception as e:
        print("RAISED " + type(e).__name__ + ": " + str(e), file=sys.stderr, flush=True)
"""


def test_plain_transformers_refuses_every_torch_bq_directory(ckpt, tmp_path):
    # transformers 5.23 only warns about an unknown quant_method, and casts codes of another dtype to
    # bf16; what it refuses is a checkpoint tensor whose shape is not the parameter's. torch_bq's layout
    # stores every fp8/fp4 code tensor with a trailing unit axis for that (torch_bq.checkpoint.stored).
    dirs = {}
    model = _load(ckpt("bf16", "llama"), format="fp8")
    model.save_pretrained(dirs.setdefault("llama fp8 save_pretrained", tmp_path / "saved_llama"))
    for family, fmt in (("llama", "fp8"), ("llama", "fp4"), ("gpt_oss", "fp4"), ("deepseek_v3", "fp8")):
        convert_checkpoint(ckpt("bf16", family), dirs.setdefault(f"{family} {fmt} convert", tmp_path / f"{family}_{fmt}"),
                           fmt, progress=None)
    _load(ckpt("q", "deepseek_v3")).save_pretrained(dirs.setdefault("deepseek_v3 fp8 save_pretrained",
                                                                    tmp_path / "saved_deepseek"))
    # a model loaded plainly (bf16) and quantized in place, saved with transformers' own save_pretrained
    for family, fmt in (("llama", "fp8"), ("gpt_oss", "fp4"), ("deepseek_v3", "fp8")):
        plain = AutoModelForCausalLM.from_pretrained(ckpt("bf16", family))
        quantize_(plain, fmt)
        plain.save_pretrained(dirs.setdefault(f"{family} {fmt} quantize_", tmp_path / f"quantize_{family}"))
    # a skeleton filled by load_quantized_, saved the same way
    skeleton = empty_model(fx.config("llama"), dtype=torch.bfloat16)
    load_quantized_(skeleton, dirs["llama fp4 convert"])
    skeleton.save_pretrained(dirs.setdefault("llama fp4 load_quantized_", tmp_path / "load_quantized_llama"))
    # the parameter each directory must be refused on and the stored code tensor behind it:
    # (family, parameter, checkpoint key). transformers' save_pretrained of DeepSeek-V3 writes
    # per-expert names, which convert quantizes one by one and transformers merges on load.
    codes = {"llama fp8 save_pretrained": ("llama", "model.layers.0.mlp.down_proj.weight", None),
             "llama fp8 convert": ("llama", "model.layers.1.self_attn.q_proj.weight", None),
             "llama fp4 convert": ("llama", "model.layers.0.mlp.up_proj.weight", None),
             "gpt_oss fp4 convert": ("gpt_oss", "model.layers.0.mlp.experts.gate_up_proj", None),
             "deepseek_v3 fp8 convert": ("deepseek_v3", "model.layers.1.mlp.experts.gate_up_proj",
                                         "model.layers.1.mlp.experts.2.up_proj.weight"),
             "deepseek_v3 fp8 save_pretrained": ("deepseek_v3", "model.layers.1.mlp.experts.gate_up_proj", None),
             "llama fp8 quantize_": ("llama", "model.layers.1.self_attn.o_proj.weight", None),
             "gpt_oss fp4 quantize_": ("gpt_oss", "model.layers.1.mlp.experts.down_proj", None),
             "deepseek_v3 fp8 quantize_": ("deepseek_v3", "model.layers.1.mlp.experts.gate_up_proj", None),
             "llama fp4 load_quantized_": ("llama", "model.layers.0.self_attn.k_proj.weight", None)}
    out = subprocess.run([sys.executable, "-c", _PLAIN_LOAD, *map(str, dirs.values())], capture_output=True,
                         text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    sections = dict(part.split("\n", 1) for part in out.stderr.split("=== ")[1:])
    shapes = {f: {k: list(v.shape) for k, v in fx.float_model(f).state_dict().items()}
              for f in {family for family, _, _ in codes.values()}}
    for what, path in dirs.items():
        log = sections[str(path)]
        assert "RAISED RuntimeError: You set `ignore_mismatched_sizes` to `False`" in log, (what, log[-2000:])
        family, key, stored_key = codes[what]
        dense = shapes[family][key]
        with safe_open(str(next(path.glob("*.safetensors"))), "pt") as f:
            stored = f.get_slice(stored_key or key).get_shape()
        assert len(stored) == len(dense if stored_key is None else dense[1:]) + 1 and stored[-1] == 1, (what, stored)
        # what transformers compares with the parameter: the stored tensor, or (fp8) the per-expert ones merged
        compared = stored if stored_key is None else [*dense, 1]
        # the load report names the quantized tensor and both shapes (layer indices may be folded: {0, 1})
        leaf = key.split(".", 3)[3]
        row = (rf"{re.escape(leaf)}\s*\|\s*MISMATCH\s*\|\s*Reinit due to size mismatch - ckpt: "
               rf"torch\.Size\({re.escape(str(compared))}\) vs model:torch\.Size\({re.escape(str(dense))}\)")
        assert re.search(row, log), (what, row, log[-3000:])


@pytest.mark.parametrize("family, fmt", [("llama", "fp8"), ("gpt_oss", "fp4")])
def test_a_torch_bq_directory_written_before_the_unit_axis_loads_bit_exactly(ckpt, tmp_path, family, fmt):
    from torch_bq.checkpoint import RECORD_KEY, CheckpointReader, decode_records

    new = tmp_path / "new"
    convert_checkpoint(ckpt("bf16", family), new, fmt, progress=None)
    # the same directory as torch_bq wrote it with record version 1: natural shapes, no unit_axis
    old = tmp_path / "old"
    old.mkdir()
    for f in new.iterdir():
        if f.suffix != ".safetensors":
            (old / f.name).write_bytes(f.read_bytes())
            continue
        with safe_open(str(f), "pt") as h:
            layers = {p: {k: v for k, v in r.to_json().items() if k != "unit_axis"}
                      for p, r in decode_records(h.metadata(), f.name).items()}
        with CheckpointReader(f) as reader:
            natural = {k: reader.get(k) for k in reader.keys()}
        assert any(load_file(f)[k].dim() == v.dim() + 1 for k, v in natural.items())
        save_file(natural, old / f.name, metadata={"format": "pt", RECORD_KEY: json.dumps({"version": 1, "layers": layers})})
    loaded = AutoModelForCausalLM.from_pretrained(new)
    _assert_same_state(AutoModelForCausalLM.from_pretrained(old), loaded)
    _assert_same_state(_load(old), loaded)


def test_modelopt_nvfp4_checkpoint_loads_into_nvfp4_linears(tmp_path):
    from torch_bq.nn import NVFP4Linear

    path = fx.modelopt_nvfp4(fx.float_model("llama"), tmp_path / "nvfp4")
    model = _load(path)
    linears = [m for m in model.modules() if isinstance(m, NVFP4Linear)]
    assert len(linears) == 14 and type(model.lm_head) is nn.Linear
    reference = fx.dequantized_model("llama", path)
    with torch.no_grad():
        sqnr = fx.sqnr_db(model(PROMPT).logits, reference(PROMPT).logits)  # W4A16: no activation qdq
    assert sqnr > SQNR_FLOOR_DB, sqnr
    model.save_pretrained(tmp_path / "saved")
    _assert_same_state(model, AutoModelForCausalLM.from_pretrained(tmp_path / "saved"))
