"""Small checkpoint files in each layout the loader recognises, written with safetensors.

Each writer returns the tensors it wrote (so tests can compare bytes) and is
what docs/checkpoints.md's examples mirror.
"""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from torch_bq import formats


def _weight(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.05


def deepseek_v3(root: Path, prefix="model.layers.0.mlp.down_proj", n=300, k=260, config=True, seed=0):
    """DeepSeek-V3/R1: F8_E4M3 weight + F32 ``weight_scale_inv`` on 128x128 blocks (+ config.json)."""
    root.mkdir(parents=True, exist_ok=True)
    data, scale = formats.quantize_fp8(_weight(n, k, seed), (128, 128), torch.float32)
    tensors = {f"{prefix}.weight": data, f"{prefix}.weight_scale_inv": scale,
               "model.embed_tokens.weight": torch.zeros(4, 8, dtype=torch.bfloat16)}
    save_file(tensors, root / "model.safetensors")
    if config:
        (root / "config.json").write_text(json.dumps(
            {"model_type": "deepseek_v3", "quantization_config": {
                "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}}
        ))
    return tensors


def deepseek_v31(path: Path, prefix="layers.0.ffn.w2", fmt="fp8", n=96, k=128, block=(1, 128),
                 scale_storage=torch.float8_e8m0fnu, data_dtype=None, seed=0):
    """DeepSeek-V3.1/V4 style: ``weight`` + e8m0 ``scale``; fp8 on any block or packed fp4 on 1x32."""
    w = _weight(n, k, seed)
    if fmt == "fp8":
        data, scale = formats.quantize_fp8(w, block)
    else:
        data, scale = formats.quantize_fp4(w)
        data = data.view(data_dtype or torch.int8)
    scale = scale.view(torch.uint8) if scale_storage == torch.uint8 else scale
    tensors = {f"{prefix}.weight": data, f"{prefix}.scale": scale}
    save_file(tensors, path)
    return tensors


def gpt_oss(path: Path, prefix="model.layers.0.mlp.experts.down_proj", experts=3, n=64, k=96, bias=True, seed=0):
    """gpt-oss MXFP4: ``{p}_blocks`` U8 ``[E, N, K/32, 16]``, ``{p}_scales`` U8 ``[E, N, K/32]``, ``{p}_bias``."""
    packed, scale = formats.quantize_fp4(_weight(experts * n, k, seed))
    tensors = {
        f"{prefix}_blocks": packed.reshape(experts, n, k // 32, 16),
        f"{prefix}_scales": scale.view(torch.uint8).reshape(experts, n, k // 32),
    }
    if bias:
        tensors[f"{prefix}_bias"] = torch.randn(experts, n, generator=torch.Generator().manual_seed(seed + 1)).bfloat16()
    save_file(tensors, path)
    return tensors


def torch_bq_layout(path: Path, prefix="proj", fmt="fp8", n=70, k=100, block=(32, 32),
                    scale_dtype=torch.float8_e8m0fnu, bias=True, seed=0):
    """Our own layout: ``weight`` + ``weight_scale`` (+ ``bias``), as ``state_dict`` writes it."""
    w = _weight(n, k, seed)
    if fmt == "fp8":
        data, scale = formats.quantize_fp8(w, block, scale_dtype)
    else:
        data, scale = formats.quantize_fp4(w)
    tensors = {f"{prefix}.weight": data, f"{prefix}.weight_scale": scale}
    if bias:
        tensors[f"{prefix}.bias"] = torch.randn(n, generator=torch.Generator().manual_seed(seed + 1))
    save_file(tensors, path)
    return tensors


def sharded(root: Path, tensors: dict, shards: int = 2):
    """Write ``tensors`` round-robin into ``shards`` files plus ``model.safetensors.index.json``."""
    root.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: tensors[name] for name in names[s::shards]}
        save_file(part, root / file)
        weight_map.update({name: file for name in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )
    return weight_map
