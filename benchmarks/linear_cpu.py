"""CPU linear benchmark: torch_bq's fp8 / fp4 kernels against the usual ways to run such a layer.

For every weight shape ``N x K`` and row count ``M``, in one run:

* ``fp8``, ``fp4``: ``torch_bq.ops.fp8_linear`` (32x32 e8m0 blocks) and
  ``fp4_linear`` (MXFP4), activation qdq included, bf16 output;
* ``bf16``, ``fp32``: ``F.linear`` on a weight dequantized once, ahead of time;
* ``deq+bf16``: dequantize the fp8 (resp. fp4) weight to bf16 on every call,
  then ``F.linear`` in bf16: what a CPU user of the common fp8 / MXFP4 model
  loaders gets today;
* ``floor``: the compressed weight's bytes (data + scales) divided by a read
  bandwidth measured in the same run (best of several ``sum`` passes over a
  buffer much larger than the last-level cache).

Every timed call starts with a cold last-level cache (a buffer twice its size
is read, untimed, before each call), so the weight streams from memory as it
would in a model too big for the cache. Each time is the best of ``--reps``
calls (the machine may be shared; the minimum is the least disturbed run).

Prints a table per shape with times and ratios, and writes a plot (time vs M
per format, with the baselines and the floor) to ``--plot``.

Usage::

    python -m benchmarks.linear_cpu            # full grid (several minutes on 2 cores)
    python -m benchmarks.linear_cpu --quick    # one shape, M in {1, 16, 512}
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from torch_bq import formats, ops
from torch_bq.ops import _backend

SHAPES = [(4096, 4096), (9216, 6144), (6144, 8192), (12288, 6144), (6144, 12288)]
ROWS = [1, 4, 16, 128, 512]
LLC_FLUSH_BYTES = 64 << 20  # twice the 32 MiB L3 of the reference machine
BANDWIDTH_BYTES = 512 << 20


def read_bandwidth(reps: int = 5) -> float:
    """Bytes per second that ``sum`` reads from a buffer far larger than the caches (best of ``reps``)."""
    buf = torch.ones(BANDWIDTH_BYTES // 4)
    buf.sum()
    best = min(_timed(buf.sum) for _ in range(reps))
    return BANDWIDTH_BYTES / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class ColdTimer:
    """Best-of-``reps`` wall time of ``fn()`` with the last-level cache flushed before each call."""

    def __init__(self, reps: int):
        self.reps = reps
        self.flush = torch.ones(LLC_FLUSH_BYTES // 4)

    def __call__(self, fn) -> float:
        self.flush.sum()
        first = _timed(fn)  # also the warm-up: code paths, allocator, thread pool
        if first > 2.0:  # a slow baseline: two samples, first-call costs are small next to it
            self.flush.sum()
            return min(first, _timed(fn))
        best = float("inf")
        for _ in range(self.reps):
            self.flush.sum()
            best = min(best, _timed(fn))
        return best


def weight_bytes(fmt: str, n: int, k: int) -> int:
    if fmt == "fp8":
        return n * k + -(-n // 32) * -(-k // 32)
    return n * -(-k // 2) + n * -(-k // 32)


def bench_shape(n: int, k: int, rows: list[int], timer: ColdTimer, bandwidth: float) -> list[dict]:
    torch.manual_seed(0)
    w = torch.randn(n, k, dtype=torch.bfloat16)
    d8, s8 = formats.quantize_fp8(w)
    p4, s4 = formats.quantize_fp4(w)
    del w
    w_bf16 = formats.dequantize_fp8(d8, s8)
    w_fp32 = w_bf16.float()
    results = []
    for m in rows:
        x = torch.randn(m, k, dtype=torch.bfloat16)
        x32 = x.float()
        t = {
            "fp8": timer(lambda: ops.fp8_linear(x, d8, s8)),
            "fp4": timer(lambda: ops.fp4_linear(x, p4, s4)),
            "bf16": timer(lambda: F.linear(x, w_bf16)),
            "fp32": timer(lambda: F.linear(x32, w_fp32)),
            "deq8+bf16": timer(lambda: F.linear(x, formats.dequantize_fp8(d8, s8))),
            "deq4+bf16": timer(lambda: F.linear(x, formats.dequantize_fp4(p4, s4, k))),
            "floor8": weight_bytes("fp8", n, k) / bandwidth,
            "floor4": weight_bytes("fp4", n, k) / bandwidth,
        }
        results.append({"n": n, "k": k, "m": m, **t})
        print(f"  {n}x{k} M={m}: " + ", ".join(f"{key} {v * 1e3:.2f}" for key, v in t.items()) + " ms", flush=True)
    return results


COLUMNS = [
    ("M", lambda r: f"{r['m']}"),
    ("fp8 ms", lambda r: f"{r['fp8'] * 1e3:.2f}"),
    ("fp4 ms", lambda r: f"{r['fp4'] * 1e3:.2f}"),
    ("fp8/floor", lambda r: f"{r['fp8'] / r['floor8']:.2f}"),
    ("fp4/floor", lambda r: f"{r['fp4'] / r['floor4']:.2f}"),
    ("bf16/fp8", lambda r: f"{r['bf16'] / r['fp8']:.2f}"),
    ("bf16/fp4", lambda r: f"{r['bf16'] / r['fp4']:.2f}"),
    ("fp32/fp8", lambda r: f"{r['fp32'] / r['fp8']:.2f}"),
    ("fp32/fp4", lambda r: f"{r['fp32'] / r['fp4']:.2f}"),
    ("deq+bf16/fp8", lambda r: f"{r['deq8+bf16'] / r['fp8']:.1f}"),
    ("deq+bf16/fp4", lambda r: f"{r['deq4+bf16'] / r['fp4']:.1f}"),
]


def table(results: list[dict]) -> str:
    """Markdown table: our times, time/floor (lower is better, 1 = at the bandwidth floor), and
    baseline time / our time (higher is better, > 1 = we are faster)."""
    lines = []
    for n, k in dict.fromkeys((r["n"], r["k"]) for r in results):
        rows = [r for r in results if (r["n"], r["k"]) == (n, k)]
        floor8, floor4 = rows[0]["floor8"] * 1e3, rows[0]["floor4"] * 1e3
        lines.append(f"\n**N x K = {n} x {k}** (floor: fp8 {floor8:.2f} ms, fp4 {floor4:.2f} ms)\n")
        lines.append("| " + " | ".join(name for name, _ in COLUMNS) + " |")
        lines.append("|" + "---:|" * len(COLUMNS))
        for r in rows:
            lines.append("| " + " | ".join(cell(r) for _, cell in COLUMNS) + " |")
    return "\n".join(lines)


def targets(results: list[dict]) -> str:
    """Issue 6's targets, checked on these results: how many shapes meet each."""

    def count(rows, ok) -> str:
        hits = sum(1 for r in rows if ok(r))
        return f"{hits}/{len(rows)}"

    m1 = [r for r in results if r["m"] == 1]
    m_max = max(r["m"] for r in results)
    big = [r for r in results if r["m"] == m_max]
    lines = ["| target | fp8 | fp4 |", "|---|---|---|"]
    rows = [
        ("M = 1: within 2x of the bandwidth floor", lambda f, d: lambda r: r[f] <= 2 * r[f"floor{d}"], m1),
        ("M = 1: faster than bf16 F.linear (pre-dequantized)", lambda f, d: lambda r: r[f] < r["bf16"], m1),
        (f"M = {m_max}: >= 0.8x fp32 F.linear throughput", lambda f, d: lambda r: r["fp32"] >= 0.8 * r[f], big),
        ("every M: >= 10x faster than dequantize + F.linear", lambda f, d: lambda r: r[f"deq{d}+bf16"] >= 10 * r[f], results),
    ]
    for name, rule, subset in rows:
        lines.append(f"| {name} | {count(subset, rule('fp8', '8'))} | {count(subset, rule('fp4', '4'))} |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys((r["n"], r["k"]) for r in results))
    fig, axes = plt.subplots(2, len(shapes), figsize=(4 * len(shapes), 7), squeeze=False, sharex=True)
    for col, (n, k) in enumerate(shapes):
        rows = [r for r in results if (r["n"], r["k"]) == (n, k)]
        ms = [r["m"] for r in rows]
        for row, fmt in enumerate(("fp8", "fp4")):
            ax = axes[row][col]
            digit = fmt[-1]
            series = [
                (f"torch_bq {fmt}", fmt, "o-"),
                ("F.linear bf16 (pre-dequantized)", "bf16", "s--"),
                ("F.linear fp32 (pre-dequantized)", "fp32", "^--"),
                (f"dequantize {fmt} + F.linear bf16", f"deq{digit}+bf16", "x:"),
                ("bandwidth floor", f"floor{digit}", "k-"),
            ]
            for label, key, style in series:
                ax.plot(ms, [r[key] * 1e3 for r in rows], style, label=label)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{fmt}  N x K = {n} x {k}", fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
            if col == 0:
                ax.set_ylabel("ms per call")
            if row == 1:
                ax.set_xlabel("M (rows)")
    handles, labels = [], []
    for ax in (axes[0][0], axes[1][0]):
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one shape (4096x4096), M in {1, 16, 512}")
    parser.add_argument("--reps", type=int, default=5, help="calls per case; the best is kept")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--plot", type=Path, default=Path("docs/linear_cpu.png"), help="where to write the plot")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = SHAPES[:1] if args.quick else SHAPES
    rows = [1, 16, 512] if args.quick else ROWS
    if _backend.cpu_kernels() is None:
        print("WARNING: compiled CPU kernels unavailable; timing the reference kernels")
    # First calls of the ops pay one-time dispatch setup; keep that out of the table.
    w8, s8 = formats.quantize_fp8(torch.randn(64, 64))
    ops.fp8_linear(torch.randn(1, 64), w8, s8)
    ops.fp4_linear(torch.randn(1, 64), *formats.quantize_fp4(torch.randn(64, 64)))
    bandwidth = read_bandwidth()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"CPU kernels: {_backend.cpu_isa()}; read bandwidth {bandwidth / 1e9:.2f} GB/s")
    timer = ColdTimer(args.reps)
    results = []
    for n, k in shapes:
        results += bench_shape(n, k, rows, timer, bandwidth)
    print(table(results))
    print("\nTargets met (cases meeting / cases):\n")
    print(targets(results))
    if not args.no_plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
