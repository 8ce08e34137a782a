"""Decode step of a gpt-oss-20b-sized expert layer on CPU: FP4Experts vs dequantize-per-call.

Layer: 32 experts, top-4, hidden 2880, intermediate 2880 (gate_up_proj [32, 5760, 2880],
down_proj [32, 2880, 2880], MXFP4 with biases, gpt-oss clamped SwiGLU). Weights are
random bytes with scale codes near 2**-7 (the timing does not depend on values).

Variants, each measured in the same run:

* ``dequant-routed`` (the baseline): per call, decode the routed experts' weights to
  bf16 with ``torch_bq.formats.dequantize_fp4`` and run ``F.linear`` in bf16;
* ``dequant-all`` (``--all-experts``): per call, decode every expert first, as a
  stacked-``bmm`` implementation over a quantized checkpoint would;
* ``FP4Experts``: the module (grouped ops; only routed experts are decoded, in slabs).

Usage::

    python -m benchmarks.moe_cpu                 # T = 1 decode step, 3 timed calls each
    python -m benchmarks.moe_cpu --tokens 1 8 --all-experts --threads 1

Prints a table of wall-clock and process-CPU milliseconds per call (medians) and
each one's speedup over the baseline (> 1 is faster).
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from torch_bq import formats
from torch_bq.nn import FP4Experts
from torch_bq.nn.experts import GPT_OSS_ALPHA, GPT_OSS_LIMIT


def random_layer(experts: int, hidden: int, intermediate: int, seed: int = 0) -> FP4Experts:
    g = torch.Generator().manual_seed(seed)

    def packed(n, k):
        return torch.randint(0, 256, (experts, n, k // 2), dtype=torch.uint8, generator=g)

    def codes(n, k):
        return torch.randint(118, 123, (experts, n, k // 32), dtype=torch.uint8, generator=g)

    return FP4Experts.from_quantized(
        packed(2 * intermediate, hidden), codes(2 * intermediate, hidden),
        packed(hidden, intermediate), codes(hidden, intermediate),
        torch.randn(experts, 2 * intermediate, generator=g).to(torch.bfloat16),
        torch.randn(experts, hidden, generator=g).to(torch.bfloat16),
        activation="gpt-oss",
    )


def dequantize_per_call(layer: FP4Experts, hidden, expert_ids, routing_weights, all_experts: bool):
    """The baseline: decode weights to bf16 inside the call, then plain bf16 matmuls."""
    h, i = layer.hidden_size, layer.intermediate_size
    needed = range(layer.num_experts) if all_experts else expert_ids.unique().tolist()
    decoded = {
        e: (formats.dequantize_fp4(layer.gate_up_proj[e], layer.gate_up_proj_scale[e], h),
            formats.dequantize_fp4(layer.down_proj[e], layer.down_proj_scale[e], i))
        for e in needed
    }
    x = hidden.to(torch.bfloat16)
    out = torch.zeros(hidden.shape[0], h, dtype=torch.float32)
    for e in expert_ids.unique().tolist():
        token, slot = (expert_ids == e).nonzero(as_tuple=True)
        w_gate_up, w_down = decoded[e]
        gate_up = F.linear(x[token], w_gate_up, layer.gate_up_proj_bias[e]).float()
        gate = gate_up[:, 0::2].clamp(max=GPT_OSS_LIMIT)
        up = gate_up[:, 1::2].clamp(-GPT_OSS_LIMIT, GPT_OSS_LIMIT)
        act = (gate * torch.sigmoid(GPT_OSS_ALPHA * gate) * (up + 1)).to(torch.bfloat16)
        y = F.linear(act, w_down, layer.down_proj_bias[e]).float()
        out.index_add_(0, token, y * routing_weights[token, slot, None].float())
    return out.to(hidden.dtype)


def median_ms(fn, reps: int, warm_up: bool = True) -> tuple[float, float]:
    """Median wall-clock and process CPU milliseconds per call.

    CPU time (all threads) is the steadier figure on a shared machine, where
    wall time also counts the time other processes hold the cores.
    """
    if warm_up:  # first-call allocations
        fn()
    wall, cpu = [], []
    for _ in range(reps):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
    return 1e3 * statistics.median(wall), 1e3 * statistics.median(cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2880)
    parser.add_argument("--intermediate", type=int, default=2880)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--all-experts", action="store_true", help="also time the decode-every-expert baseline")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's); 1 is steadier on a shared machine")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    layer = random_layer(args.experts, args.hidden, args.intermediate)
    quant_bytes = sum(t.numel() * t.element_size() for t in layer.state_dict().values())
    print(f"layer: {args.experts} experts, top-{args.top_k}, hidden {args.hidden}, intermediate "
          f"{args.intermediate}; MXFP4 state {quant_bytes / 2**20:.0f} MiB; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; median of {args.reps} calls")
    print(f"{'T':>4} {'variant':<16} {'wall ms':>10} {'speedup':>8} {'cpu ms':>10} {'speedup':>8}")
    g = torch.Generator().manual_seed(1)
    for tokens in args.tokens:
        hidden = torch.randn(tokens, args.hidden, generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(args.experts, generator=g)[: args.top_k] for _ in range(tokens)])
        weights = torch.rand(tokens, args.top_k, generator=g).softmax(-1).to(torch.bfloat16)
        variants = {
            "dequant-routed": lambda: dequantize_per_call(layer, hidden, ids, weights, all_experts=False),
            "FP4Experts": lambda: layer(hidden, ids, weights),
        }
        if args.all_experts:
            variants["dequant-all"] = lambda: dequantize_per_call(layer, hidden, ids, weights, all_experts=True)
        with torch.inference_mode():
            # dequant-all is slow enough that one cold call says what it costs.
            results = {name: median_ms(fn, 1, warm_up=False) if name == "dequant-all" else median_ms(fn, args.reps)
                       for name, fn in variants.items()}
        base_wall, base_cpu = results["dequant-routed"]
        for name, (wall, cpu) in results.items():
            print(f"{tokens:>4} {name:<16} {wall:>10.1f} {base_wall / wall:>7.2f}x {cpu:>10.1f} {base_cpu / cpu:>7.2f}x")


if __name__ == "__main__":
    main()
