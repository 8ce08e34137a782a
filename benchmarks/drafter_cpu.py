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

Then, for the fp8 layer, each component against its own floor, ``max(FLOPs /
peak, bytes / bandwidth)``: the peaks are measured in the same run by the
kernels' ``peak_probe`` op (a register-only loop of the vector fp32 FMA, and of
``vdpbf16ps`` where the CPU has AVX512_BF16; per thread, times the thread
count), the bandwidth by the int64 sum above. The linears' floor uses the
bf16-dot peak where there is one (decoded fp8 weights and qdq'd activations are
exact in bf16, so a bf16 GEMM accumulating in fp32 is inside the contract) and
the fp32 one otherwise; attention's uses the fp32 FMA peak (the contract keeps
scores, softmax and P V in float32). Times are wall-clock medians and, since the
machine may be shared, also the process's CPU time (minimum over the repeats).

    OMP_WAIT_POLICY=passive python -m benchmarks.drafter_cpu [--requests 4] [--context 4096] [--repeats 3]
        [--threads N] [--floors-only]
"""

import argparse
import dataclasses
import os
import statistics
import time

import torch

from torch_bq import formats, ops
from torch_bq.ops import _backend
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


def timed_cpu(fn, repeats: int) -> tuple[float, float]:
    """``(median wall seconds, minimum process CPU seconds)`` of ``fn()`` over ``repeats`` runs after a warm-up."""
    fn()
    wall, cpu = [], []
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), min(cpu)


def cpu_model() -> str:
    """``model name`` of /proc/cpuinfo with its family and model numbers (which tell Zen 4 from Zen 5)."""
    fields = {}
    try:
        for line in open("/proc/cpuinfo"):
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
            if not line.strip():
                break
    except OSError:
        return "unknown CPU"
    name, family, model = fields.get("model name", "unknown CPU"), fields.get("cpu family", "?"), fields.get("model", "?")
    return f"{name} (family {family}, model {model})"


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def peak_flops(kind: str, repeats: int = 7, iters: int = 2_000_000, level=None) -> float:
    """FLOP/s of one thread for ``kind`` ("fp32_fma" or "bf16_dot") with the kernels of ``level``
    (default: the selected one), best of ``repeats``; 0 if unavailable."""
    kernels = _backend.cpu_kernels(level)
    if kernels is None:
        return 0.0
    best = 0.0
    for _ in range(repeats):
        # The thread's CPU time: on a shared machine wall time would count the
        # time other jobs hold the core and understate the peak.
        t0 = time.thread_time()
        flops = kernels.peak_probe(kind, iters)
        best = max(best, flops / (time.thread_time() - t0))
    return best


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


def breakdown(layer: DrafterLayer, step, repeats: int, with_split: bool, timer=timed) -> dict:
    """``timer``'s result (seconds) per component of :meth:`DrafterLayer.step`, each timed on its own real input."""
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
    times = {name: timer(fn, repeats) for name, fn in parts.items()}
    if with_split:
        times["(attention, split-K form)"] = timed(
            lambda: paged_window_attention_split(q, k_cache, v_cache, *attn_args, **attn_kw), repeats
        )
    return times


def floors(layer: DrafterLayer, step, fp32_peak: float, bf16_peak: float, bandwidth: float) -> dict:
    """``{component: (FLOPs, bytes, floor seconds, roof name)}`` for the fp8 layer's step."""
    c = layer.config
    hidden, positions, k_cache, v_cache, table, slots, seq_lens = step
    rows, rpr = hidden.shape[0], c.rows_per_request
    linear_peak, linear_roof = (bf16_peak, "bf16 dot") if bf16_peak > 0 else (fp32_peak, "fp32 FMA")
    out = {}
    for name in LINEARS:
        lin = getattr(layer, name)
        flops = 2 * rows * lin.out_features * lin.in_features
        nbytes = sum(t.numel() * t.element_size() for t in lin.buffers())
        out[name] = (flops, nbytes, max(flops / linear_peak, nbytes / bandwidth), linear_roof)
    # Attention: every row reads the keys of [max(0, p - W + 1), seq_len); each request's cache once.
    d, hq, hkv = c.head_dim, c.num_attention_heads, c.num_key_value_heads
    request = torch.arange(rows) // rpr
    hi = seq_lens.to(torch.int64)[request]
    seen = hi - (positions - c.sliding_window + 1).clamp_min(0)
    if c.causal:
        seen = torch.minimum(seen, positions + 1 - (positions - c.sliding_window + 1).clamp_min(0))
    flops = int(4 * hq * d * seen.sum())
    lo = (positions.view(-1, rpr).amin(1) - c.sliding_window + 1).clamp_min(0)
    keys = int((seq_lens.to(torch.int64) - lo).sum())
    nbytes = 2 * keys * hkv * d * k_cache.element_size()
    out["attention"] = (flops, nbytes, max(flops / fp32_peak, nbytes / bandwidth), "fp32 FMA")
    nbytes = 2 * 2 * rows * hkv * d * k_cache.element_size()  # read k, v and write them
    out["kv write"] = (0, nbytes, nbytes / bandwidth, "bandwidth")
    return out


def floor_table(layer: DrafterLayer, step, repeats: int, threads: int, bandwidth: float) -> None:
    """Print each component of the fp8 layer's step against its floor (see the module docstring)."""
    fp32_peak = peak_flops("fp32_fma")
    bf16_peak = peak_flops("bf16_dot")
    print(
        f"measured per thread: fp32 FMA peak {fp32_peak / 1e9:.1f} GFLOP/s, bf16 dot peak "
        f"{bf16_peak / 1e9:.1f} GFLOP/s (peak_probe, best of 7); x {threads} threads for the floors"
    )
    limits = floors(layer, step, threads * fp32_peak, threads * bf16_peak, bandwidth)
    times = breakdown(layer, step, repeats, with_split=False, timer=timed_cpu)
    with _backend.fast_kernels_disabled("cpu"):
        c = layer.config
        hidden, positions, k_cache, v_cache, table, slots, seq_lens = step
        rows, d, hq, hkv = hidden.shape[0], c.head_dim, c.num_attention_heads, c.num_key_value_heads
        x = layer.input_layernorm(hidden)
        q = layer.qkv_proj(x)[:, : hq * d].reshape(rows, hq, d)
        kw = dict(rows_per_request=c.rows_per_request, window=c.sliding_window, causal=c.causal, scale=d**-0.5)
        times["(attention, reference body)"] = timed_cpu(
            lambda: ops.paged_window_attention(q, k_cache, v_cache, table, positions, seq_lens, **kw, validate=False),
            repeats,
        )
    print(
        f"\n{'component':28s} {'GFLOP':>7s} {'MB':>7s} {'roof':>9s} {'floor ms':>9s} {'wall ms':>9s} "
        f"{'cpu ms':>9s} {'wall/floor':>10s} {'cpu/(floor x threads)':>21s}"
    )
    for name, (wall, cpu) in times.items():
        key = name.strip("()").split(",")[0]
        if key in limits:
            flops, nbytes, floor, roof = limits[key]
            print(
                f"{name:28s} {flops / 1e9:7.2f} {nbytes / 1e6:7.1f} {roof:>9s} {1e3 * floor:9.2f} {1e3 * wall:9.2f} "
                f"{1e3 * cpu:9.2f} {wall / floor:10.2f} {cpu / (floor * threads):21.2f}"
            )
        else:
            print(f"{name:28s} {'':7s} {'':7s} {'':9s} {'':9s} {1e3 * wall:9.2f} {1e3 * cpu:9.2f}")
    total_floor = sum(v[2] for v in limits.values())
    hidden, positions, k_cache, v_cache, table, slots, seq_lens = step
    wall, cpu = timed_cpu(lambda: layer.step(hidden, positions, k_cache, v_cache, table, slots, seq_lens), repeats)
    print(
        f"{'whole step':28s} {'':7s} {'':7s} {'':9s} {1e3 * total_floor:9.2f} {1e3 * wall:9.2f} {1e3 * cpu:9.2f} "
        f"{wall / total_floor:10.2f} {cpu / (total_floor * threads):21.2f}"
    )
    attention_per_level(layer, step, repeats, threads, limits["attention"][0])


def attention_per_level(layer: DrafterLayer, step, repeats: int, threads: int, flops: int) -> None:
    """The attention kernel of every ISA level this CPU has, each against the fp32 FMA floor of its own level."""
    c = layer.config
    hidden, positions, k_cache, v_cache, table, slots, seq_lens = step
    rows, d, hq = hidden.shape[0], c.head_dim, c.num_attention_heads
    q = torch.randn(rows, hq, d, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    kw = dict(rows_per_request=c.rows_per_request, window=c.sliding_window, causal=c.causal, scale=d**-0.5)
    print(f"\nattention per ISA level ({flops / 1e9:.2f} GFLOP; floor = FLOPs / (that level's fp32 FMA peak x threads))")
    print(f"{'level':12s} {'peak GFLOP/s':>13s} {'floor ms':>9s} {'wall ms':>9s} {'cpu ms':>9s} {'cpu/(floor x threads)':>21s}")
    for level in _backend.supported_cpu_isas():
        if _backend.cpu_kernels(level) is None:
            print(f"{level:12s} (did not load)")
            continue
        previous = _backend.set_cpu_isa_cap(level)
        try:
            peak = peak_flops("fp32_fma", level=level)
            floor = flops / (peak * threads)
            wall, cpu = timed_cpu(
                lambda: ops.paged_window_attention(
                    q, k_cache, v_cache, table, positions, seq_lens, **kw, validate=False
                ),
                repeats,
            )
        finally:
            _backend.set_cpu_isa_cap(previous)
        print(f"{level:12s} {peak / 1e9:13.1f} {1e3 * floor:9.2f} {1e3 * wall:9.2f} {1e3 * cpu:9.2f} "
              f"{cpu / (floor * threads):21.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--floors-only", action="store_true", help="only the fp8 layer against its floors")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    config = DrafterConfig()
    info = ops.backend_info()["cpu"]
    print(
        f"CPU: {cpu_model()}; supports {', '.join(info['supported'])}; torch_bq kernels: {info['kernels']} at "
        f"{info['isa']}; torch {torch.__version__} (capability {torch.backends.cpu.get_cpu_capability()}); "
        f"{torch.get_num_threads()} threads, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}; "
        f"load average {load_average()}"
    )
    bandwidth = read_bandwidth()
    fp8_layer = random_fp8_layer(config, gen)
    step = make_step(config, args.requests, args.context, args.block_size, gen)
    rows = args.requests * config.rows_per_request
    print(
        f"DrafterLayer (full size), {args.requests} requests x {config.rows_per_request} rows = {rows} rows, "
        f"context {args.context}, window {config.sliding_window}, block_size {args.block_size}; "
        f"measured read bandwidth {bandwidth / 1e9:.2f} GB/s"
    )
    fp8_layer.validate = False
    floor_table(fp8_layer, step, args.repeats, torch.get_num_threads(), bandwidth)
    print(f"load average after: {load_average()}\n")
    if args.floors_only:
        return
    bf16_layer = bf16_copy(fp8_layer)

    results = {}
    for label, layer in (("fp8", fp8_layer), ("bf16", bf16_layer)):
        layer.validate = False
        hidden, positions, k_cache, v_cache, table, slots, seq_lens = step
        full = timed(lambda: layer.step(hidden, positions, k_cache, v_cache, table, slots, seq_lens), args.repeats)
        parts = breakdown(layer, step, args.repeats, with_split=label == "fp8")
        results[label] = (full, parts, weight_bytes(layer))

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
