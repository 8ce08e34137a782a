"""One full-size DSpark drafter layer on CPU: fp8 weights vs bf16 weights, with a breakdown.

Runs one draft step (default 4 requests x 7 rows, context 4096, window 4096) of a
``DrafterLayer`` with the default config, once with fp8 (32x32 e8m0) weights and
once with the same weights in bf16, and prints per-component times, the fp8/bf16
ratio, and the memory-bandwidth floor: the layer's weight bytes divided by a
read bandwidth measured in the same run (``int64`` sum over a buffer larger than
the caches). Everything runs through the ops' default (reference) bodies unless a
faster CPU kernel is registered.

Memory: ~0.35 GB of fp8 weights, ~0.7 GB of bf16, ~1.3 GB of float32 temporaries
while building them, and a 1 GiB bandwidth probe.

    python -m benchmarks.drafter_cpu [--requests 4] [--context 4096] [--repeats 3]
"""

import argparse
import dataclasses
import statistics
import time

import torch

from torch_bq import formats, ops
from torch_bq.nn import BF16Linear, DrafterConfig, DrafterLayer, FP8Linear
from torch_bq.reference.flash_decoding import paged_window_attention_split
from torch_bq.reference.transformer import apply_rope, clamped_swiglu, rope_cos_sin

LINEARS = ("qkv_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def timed(fn, repeats: int) -> float:
    """Median wall time of ``fn()`` in seconds over ``repeats`` runs after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def read_bandwidth(nbytes: int = 1 << 30, repeats: int = 3) -> float:
    """Bytes per second for streaming reads (a vectorised int64 sum over ``nbytes``)."""
    buf = torch.ones(nbytes // 8, dtype=torch.int64)
    seconds = timed(lambda: buf.sum(), repeats)
    del buf
    return nbytes / seconds


def random_fp8_layer(config: DrafterConfig, gen: torch.Generator) -> DrafterLayer:
    """A full-size layer with random finite fp8 codes and scales near 2**-7 (no NaN codes)."""
    layer = DrafterLayer(config, device="meta")
    for name in LINEARS:
        old = getattr(layer, name)
        n, k = old.out_features, old.in_features
        magnitude = torch.randint(0, 0x7F, (n, k), dtype=torch.uint8, generator=gen)  # 0x7F is NaN
        sign = torch.randint(0, 2, (n, k), dtype=torch.uint8, generator=gen) << 7
        grid = formats.fp8_scale_shape((n, k), config.fp8_block)
        codes = torch.randint(118, 122, grid, dtype=torch.uint8, generator=gen)
        setattr(layer, name, FP8Linear.from_quantized(magnitude | sign, codes, block=config.fp8_block))
    for norm in (layer.input_layernorm, layer.q_norm, layer.k_norm, layer.post_attention_layernorm):
        w = (0.1 * torch.randn(norm.dim, generator=gen)).to(torch.bfloat16)
        norm.weight = torch.nn.Parameter(w, requires_grad=False)
    return layer


def bf16_copy(layer: DrafterLayer) -> DrafterLayer:
    """The same layer with every linear decoded to bf16 (exact) and run by ``bf16_linear``."""
    config = dataclasses.replace(layer.config, weight_format="bf16")
    out = DrafterLayer(config, device="meta")
    for name in LINEARS:
        src = getattr(layer, name)
        w = formats.dequantize_fp8(src.weight, src.weight_scale, src.block, torch.bfloat16)
        setattr(out, name, BF16Linear.from_quantized(w))
    for name in ("input_layernorm", "q_norm", "k_norm", "post_attention_layernorm"):
        getattr(out, name).weight = getattr(layer, name).weight
    return out


def weight_bytes(layer: DrafterLayer) -> int:
    total = 0
    for name in LINEARS:
        for t in getattr(layer, name).buffers():
            total += t.numel() * t.element_size()
    return total


def make_step(config: DrafterConfig, requests: int, context: int, block_size: int, gen: torch.Generator):
    """Caches holding ``context`` random positions per request; this step's rows follow them."""
    rpr = config.rows_per_request
    seq_len = context + rpr
    blocks_per_request = -(-seq_len // block_size)
    num_blocks = requests * blocks_per_request
    table = torch.randperm(num_blocks, generator=gen).to(torch.int32).view(requests, blocks_per_request)
    shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    k_cache = torch.randn(shape, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(shape, generator=gen).to(torch.bfloat16)
    positions = torch.arange(context, seq_len).repeat(requests)
    request = torch.arange(requests).repeat_interleave(rpr)
    slots = table[request, positions // block_size].to(torch.int64) * block_size + positions % block_size
    seq_lens = torch.full((requests,), seq_len, dtype=torch.int32)
    hidden = torch.randn(requests * rpr, config.hidden_size, generator=gen).to(torch.bfloat16)
    return hidden, positions, k_cache, v_cache, table, slots, seq_lens


def breakdown(layer: DrafterLayer, step, repeats: int, with_split: bool) -> dict[str, float]:
    """Seconds per component of :meth:`DrafterLayer.step`, each timed on its own real input."""
    c = layer.config
    hidden, positions, k_cache, v_cache, table, slots, seq_lens = step
    rows, d, hq, hkv = hidden.shape[0], c.head_dim, c.num_attention_heads, c.num_key_value_heads
    x = layer.input_layernorm(hidden)
    q, k, v = layer.qkv_proj(x).split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.reshape(rows, hq, d), k.reshape(rows, hkv, d), v.reshape(rows, hkv, d)
    attn_args = (table, positions, seq_lens)
    attn_kw = dict(rows_per_request=c.rows_per_request, window=c.sliding_window, causal=c.causal, scale=d**-0.5)
    attn = ops.paged_window_attention(q, k_cache, v_cache, *attn_args, **attn_kw, validate=False)
    y = layer.post_attention_layernorm(hidden)
    g, u = layer.gate_proj(y), layer.up_proj(y)
    a = clamped_swiglu(g, u, c.swiglu_alpha, c.swiglu_limit)

    def rope():
        cos, sin = rope_cos_sin(positions, c.rotary_dim, c.rope_theta)
        apply_rope(layer.q_norm(q), cos, sin), apply_rope(layer.k_norm(k), cos, sin)

    parts = {
        "norms (in + post)": lambda: (layer.input_layernorm(hidden), layer.post_attention_layernorm(hidden)),
        "qkv_proj": lambda: layer.qkv_proj(x),
        "q/k norm + rope": rope,
        "kv write": lambda: ops.paged_kv_write(k, v, k_cache, v_cache, slots, validate=False),
        "attention": lambda: ops.paged_window_attention(q, k_cache, v_cache, *attn_args, **attn_kw, validate=False),
        "o_proj": lambda: layer.o_proj(attn.reshape(rows, hq * d)),
        "gate_proj": lambda: layer.gate_proj(y),
        "up_proj": lambda: layer.up_proj(y),
        "swiglu": lambda: clamped_swiglu(g, u, c.swiglu_alpha, c.swiglu_limit),
        "down_proj": lambda: layer.down_proj(a),
    }
    times = {name: timed(fn, repeats) for name, fn in parts.items()}
    if with_split:
        times["(attention, split-K form)"] = timed(
            lambda: paged_window_attention_split(q, k_cache, v_cache, *attn_args, **attn_kw), repeats
        )
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    config = DrafterConfig()
    bandwidth = read_bandwidth()
    fp8_layer = random_fp8_layer(config, gen)
    bf16_layer = bf16_copy(fp8_layer)
    step = make_step(config, args.requests, args.context, args.block_size, gen)

    results = {}
    for label, layer in (("fp8", fp8_layer), ("bf16", bf16_layer)):
        layer.validate = False
        hidden, positions, k_cache, v_cache, table, slots, seq_lens = step
        full = timed(lambda: layer.step(hidden, positions, k_cache, v_cache, table, slots, seq_lens), args.repeats)
        parts = breakdown(layer, step, args.repeats, with_split=label == "fp8")
        results[label] = (full, parts, weight_bytes(layer))

    rows = args.requests * config.rows_per_request
    print(
        f"DrafterLayer (full size: H={config.hidden_size}, heads {config.num_attention_heads}/"
        f"{config.num_key_value_heads}x{config.head_dim}, I={config.intermediate_size}), {args.requests} requests x "
        f"{config.rows_per_request} rows = {rows} rows, context {args.context}, window {config.sliding_window}, "
        f"block_size {args.block_size}, torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(f"measured read bandwidth: {bandwidth / 1e9:.2f} GB/s\n")
    fp8_full, fp8_parts, fp8_bytes = results["fp8"]
    bf16_full, bf16_parts, bf16_bytes = results["bf16"]
    print(f"{'component':28s} {'fp8 ms':>10s} {'bf16 ms':>10s} {'fp8/bf16':>9s}")
    for name in fp8_parts:
        b = bf16_parts.get(name)
        b_text = f"{1e3 * b:10.2f}" if b is not None else f"{'':>10s}"
        ratio = f"{fp8_parts[name] / b:9.2f}" if b is not None else ""
        print(f"{name:28s} {1e3 * fp8_parts[name]:10.2f} {b_text} {ratio}")
    summed = lambda parts: sum(v for k, v in parts.items() if not k.startswith("("))  # noqa: E731
    print(f"{'sum of components':28s} {1e3 * summed(fp8_parts):10.2f} {1e3 * summed(bf16_parts):10.2f}")
    print(f"{'whole step':28s} {1e3 * fp8_full:10.2f} {1e3 * bf16_full:10.2f} {fp8_full / bf16_full:9.2f}")
    print()
    for label, full, nbytes in (("fp8", fp8_full, fp8_bytes), ("bf16", bf16_full, bf16_bytes)):
        floor = nbytes / bandwidth
        print(
            f"{label:5s} weights {nbytes / 1e6:8.1f} MB: bandwidth floor {1e3 * floor:8.2f} ms, "
            f"step / floor = {full / floor:6.1f}x"
        )


if __name__ == "__main__":
    main()
