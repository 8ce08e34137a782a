"""``python -m torch_bq demo``: quantize a layer, run every linear op, print error and speed."""

from __future__ import annotations

import argparse
import time

import torch

from . import formats, ops


def sqnr_db(actual: torch.Tensor, exact: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of ``actual`` against ``exact``, in dB."""
    exact = exact.to(torch.float64)
    noise = (actual.to(torch.float64) - exact).pow(2).sum()
    return float(10 * torch.log10(exact.pow(2).sum() / noise))


def _time_per_call(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def run(n: int = 4096, k: int = 4096, m: int = 16, repeats: int = 5, seed: int = 0) -> list[dict]:
    """Quantize a Gaussian ``[n, k]`` bf16 layer to fp8 and fp4 and run the four linear ops.

    Returns one row per op: name, SQNR (dB) against the bf16 layer computed in
    float64, weight bytes, and median seconds per call on ``m`` Gaussian rows.
    """
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=g).to(torch.bfloat16)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    exact = x.to(torch.float64) @ weight.to(torch.float64).T

    fp8_data, fp8_scale = formats.quantize_fp8(weight)
    fp4_data, fp4_scale = formats.quantize_fp4(weight)
    weight_fp32 = weight.to(torch.float32)
    cases = [
        ("fp8 e4m3, 32x32 e8m0, act qdq", fp8_data, fp8_scale, lambda: ops.fp8_linear(x, fp8_data, fp8_scale)),
        ("fp4 e2m1, 1x32 e8m0, act qdq", fp4_data, fp4_scale, lambda: ops.fp4_linear(x, fp4_data, fp4_scale)),
        ("bf16", weight, None, lambda: ops.bf16_linear(x, weight)),
        ("fp32 weight (bf16 inside)", weight_fp32, None, lambda: ops.fp32w_linear(x, weight_fp32)),
    ]
    rows = []
    for name, data, scale, fn in cases:
        nbytes = data.numel() * data.element_size() + (0 if scale is None else scale.numel() * scale.element_size())
        rows.append(
            {
                "op": name,
                "sqnr_db": sqnr_db(fn(), exact),
                "weight_mib": nbytes / 2**20,
                "ms_per_call": 1e3 * _time_per_call(fn, repeats),
            }
        )
    return rows


def format_table(rows: list[dict]) -> str:
    header = f"{'op':32} {'SQNR vs bf16 (dB)':>18} {'weight (MiB)':>13} {'ms / call':>10}"
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(f"{r['op']:32} {r['sqnr_db']:18.1f} {r['weight_mib']:13.2f} {r['ms_per_call']:10.2f}")
    return "\n".join(lines)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("demo", help="quantize a layer to fp8 and fp4, run every linear op, print error and speed")
    p.add_argument("--n", type=int, default=4096, help="out features (default 4096)")
    p.add_argument("--k", type=int, default=4096, help="in features (default 4096)")
    p.add_argument("--m", type=int, default=16, help="input rows (default 16)")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per op; the median is shown")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> None:
    print(f"torch_bq demo: Gaussian {args.n}x{args.k} bf16 layer, {args.m} Gaussian input rows, "
          f"{torch.get_num_threads()} threads")
    rows = run(args.n, args.k, args.m, args.repeats, args.seed)
    print(format_table(rows))
