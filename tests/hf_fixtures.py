"""Tiny transformers models of four families and their checkpoints in each family's own quantized layout.

Built from configs in code (no download, no network). The quantized layouts are
written here the way the families' release tooling stores them:

* DeepSeek-V3: fp8 e4m3 ``{p}.weight`` + float32 ``{p}.weight_scale_inv`` (multiplied) in
  128x128 blocks, per-expert ``mlp.experts.{e}.{gate,up,down}_proj``, config.json
  ``quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128]}``;
  hidden 160 and q_lora_rank 96 make partial blocks.
* gpt-oss: MXFP4 experts ``mlp.experts.{gate_up,down}_proj_blocks`` ``U8 [E, N, K/32, 16]`` +
  ``_scales`` ``U8 [E, N, K/32]`` (N-major, gate/up rows interleaved), bf16 attention,
  ``{"quant_method": "mxfp4"}``.
* Qwen3-FP8 (fine-grained fp8, transformers' ``FineGrainedFP8Config`` layout): as DeepSeek's
  for every linear, tied embeddings, no MoE.
* Llama: bf16 only (quantized on load, or by ``torch_bq convert``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from torch_bq import formats

transformers = __import__("pytest").importorskip("transformers")

from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    DeepseekV3Config,
    GptOssConfig,
    LlamaConfig,
    Qwen3Config,
)

FAMILIES = ("llama", "qwen3", "deepseek_v3", "gpt_oss")


def config(family: str):
    common = dict(vocab_size=256, num_hidden_layers=2, max_position_embeddings=128, dtype="bfloat16")
    if family == "llama":
        return LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                           **common)
    if family == "qwen3":
        return Qwen3Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, tie_word_embeddings=True, **common)
    if family == "deepseek_v3":
        return DeepseekV3Config(hidden_size=160, intermediate_size=256, moe_intermediate_size=128,
                                first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
                                n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                                n_shared_experts=1, q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32,
                                qk_rope_head_dim=16, v_head_dim=32, **common)
    if family == "gpt_oss":
        return GptOssConfig(hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=32,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **common)
    raise ValueError(family)


def float_model(family: str, seed: int = 0):
    """The bf16 model with random weights scaled to a realistic range (norms at 1)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config(family), dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn_like(p, dtype=torch.float32).mul_(0.08))
            elif "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn_like(p, dtype=torch.float32).mul_(0.02))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.zero_()
    return model.eval()


def save_bf16(model, path: Path) -> Path:
    model.save_pretrained(path)
    return path


def _quantized_linear_names(state: dict, skip) -> list[str]:
    return [k for k, v in state.items() if k.endswith(".weight") and v.dim() == 2 and not skip(k)]


def _fp8_blocks_128(w: torch.Tensor):
    return formats.quantize_fp8(w.float(), (128, 128), torch.float32)


def _write(path: Path, tensors: dict, model, quantization_config: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors", metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg["quantization_config"] = quantization_config
    cfg["architectures"] = [type(model).__name__]
    (path / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
    return path


def _original_state(model, tmp: Path) -> dict:
    """The state dict under the family's own checkpoint names (transformers' save format)."""
    from safetensors.torch import load_file

    model.save_pretrained(tmp)
    out = {}
    for f in sorted(tmp.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def deepseek_fp8(model, path: Path) -> Path:
    """DeepSeek-V3's own fp8 release layout (see the module docstring)."""
    state = _original_state(model, path.with_name(path.name + "_src"))
    skip = lambda k: any(s in k for s in ("embed_tokens", "lm_head", "norm", "layernorm")) or k.endswith("mlp.gate.weight")
    out = dict(state)
    for name in _quantized_linear_names(state, skip):
        data, scale = _fp8_blocks_128(state[name])
        out[name], out[name[: -len(".weight")] + ".weight_scale_inv"] = data, scale
    return _write(path, out, model, {"quant_method": "fp8", "weight_block_size": [128, 128],
                                     "activation_scheme": "dynamic", "fmt": "e4m3"})


def qwen3_fp8(model, path: Path) -> Path:
    """Fine-grained fp8 (Qwen3-FP8 / transformers' FineGrainedFP8Config layout), 128x128 blocks."""
    return deepseek_fp8(model, path)


def modelopt_nvfp4(model, path: Path) -> Path:
    """NVIDIA ModelOpt's NVFP4 layout: packed e2m1 ``weight``, e4m3 1x16 ``weight_scale``, float32 scalar
    ``weight_scale_2`` and ``input_scale``; ``quant_method: "modelopt"``, ``quant_algo: "NVFP4"``."""
    state = _original_state(model, path.with_name(path.name + "_src"))
    skip = lambda k: any(s in k for s in ("embed_tokens", "lm_head", "norm"))
    out = dict(state)
    for name in _quantized_linear_names(state, skip):
        data, scale, scale_2 = formats.quantize_nvfp4(state[name].float())
        prefix = name[: -len(".weight")]
        out[name], out[prefix + ".weight_scale"], out[prefix + ".weight_scale_2"] = data, scale, scale_2
        out[prefix + ".input_scale"] = torch.tensor(1.0)
    return _write(path, out, model, {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                                     "exclude_modules": ["lm_head"]})


def gpt_oss_mxfp4(model, path: Path) -> Path:
    """gpt-oss's MXFP4 release layout: experts only, N-major blocks, bf16 elsewhere."""
    state = _original_state(model, path.with_name(path.name + "_src"))
    out = {}
    for name, t in state.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            w = t.float().transpose(1, 2)  # transformers' [E, K, N] -> [E, N, K]
            pairs = [formats.quantize_fp4(w[e]) for e in range(w.shape[0])]
            packed = torch.stack([p[0] for p in pairs])
            scales = torch.stack([p[1] for p in pairs]).view(torch.uint8)
            e, n, half_k = packed.shape
            out[name + "_blocks"] = packed.view(e, n, half_k // 16, 16)
            out[name + "_scales"] = scales
        else:
            out[name] = t
    return _write(path, out, model, {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                "model.embed_tokens", "lm_head"]})


def dequantized_model(family: str, path: Path, dtype=torch.bfloat16):
    """A plain transformers model holding the checkpoint's weights dequantized (the reference)."""
    from torch_bq.nn import CheckpointReader

    model = AutoModelForCausalLM.from_config(config(family), dtype=dtype)
    state = {}
    with CheckpointReader(path) as r:
        keys = set(r.keys())
        for k in r.keys():
            if k.endswith(("_scale_inv", "_scales")):
                continue
            t = r.get(k)
            if k.endswith("_blocks"):
                base = k[: -len("_blocks")]
                scales = r.get(base + "_scales").view(torch.float8_e8m0fnu)
                e, n, g, _ = t.shape
                w = torch.stack([formats.dequantize_fp4(t[i].reshape(n, g * 16), scales[i]) for i in range(e)])
                state[base] = w.transpose(1, 2).to(dtype)
            elif k.endswith(".weight") and k[: -len(".weight")] + ".weight_scale_2" in keys:
                p = k[: -len(".weight")]
                state[k] = formats.dequantize_nvfp4(t, r.get(p + ".weight_scale"), r.get(p + ".weight_scale_2")).to(dtype)
            elif k.endswith((".weight_scale", ".weight_scale_2", ".input_scale")) and k.rsplit(".", 1)[0] + ".weight_scale_2" in keys:
                continue
            elif k.endswith(".weight") and k[: -len(".weight")] + ".weight_scale_inv" in keys:
                s = r.get(k[: -len(".weight")] + ".weight_scale_inv")
                state[k] = formats.dequantize_fp8(t, s, (128, 128), torch.float32).to(dtype)
            else:
                state[k] = t
    # per-expert names -> transformers' fused [E, 2I, H] / [E, H, I]
    fused = {}
    for k in list(state):
        if ".experts." in k and k.endswith(".gate_proj.weight"):
            prefix = k.split(".experts.")[0] + ".experts"
            if prefix in fused:
                continue
            e = 0
            gate_up, down = [], []
            while f"{prefix}.{e}.gate_proj.weight" in state:
                gate_up.append(torch.cat([state.pop(f"{prefix}.{e}.gate_proj.weight"),
                                          state.pop(f"{prefix}.{e}.up_proj.weight")]))
                down.append(state.pop(f"{prefix}.{e}.down_proj.weight"))
                e += 1
            fused[prefix] = True
            state[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
            state[f"{prefix}.down_proj"] = torch.stack(down)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and model.config.tie_word_embeddings)]
    assert not missing and not unexpected, (missing, unexpected)
    model.tie_weights()
    return model.eval()


def sqnr_db(test: torch.Tensor, ref: torch.Tensor) -> float:
    ref, test = ref.double(), test.double()
    return float(10 * torch.log10(ref.pow(2).sum() / (test - ref).pow(2).sum().clamp_min(1e-300)))
