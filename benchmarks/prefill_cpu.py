"""CPU prefill (M >= 128) benchmark: torch_bq's linear ops against ``F.linear`` on the dequantized weight.

For every weight shape ``N x K`` of issue 14 and ``M`` in ``--rows``, one run
times, interleaved (A, B, C, ... then again, ``--reps`` rounds; medians):

* ``fp8``, ``fp4``: ``torch_bq.ops.fp8_linear`` (32x32 e8m0 blocks, activation
  qdq) and ``fp4_linear`` (MXFP4, activation qdq), bf16 in and out;
* ``bf16w``: ``torch_bq.ops.bf16_linear`` on the dequantized bf16 weight;
* ``F.bf16``, ``F.fp32``: ``F.linear`` on that weight in bf16 / fp32, the
  baselines (oneDNN bf16 GEMM, MKL fp32 GEMM);

and prints throughput ratios baseline time / our time (> 1: we are faster).
The CPU model, its ISA, the kernels' ISA level, the thread count and the load
average (before and after each shape) are printed with the numbers: on a
shared machine they say how much to trust them.

``OMP_WAIT_POLICY`` defaults to ``passive`` here (set before torch loads) so
torch's OpenMP threads in the baselines do not spin on cores other processes
need; torch_bq's own worker threads always wait passively.

Usage::

    python -m benchmarks.prefill_cpu --threads 1
    python -m benchmarks.prefill_cpu --threads 2 --rows 128 512
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import argparse  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.ggml_side_by_side import cpu_model  # noqa: E402
from torch_bq import formats, ops  # noqa: E402

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (2880, 2880), (5760, 2880)]


def load_average() -> str:
    try:
        return " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        return "n/a"


def interleaved_medians(calls: dict, reps: int, clock=time.perf_counter) -> dict:
    """Median ``clock`` seconds per call of each entry, the entries called in turn ``reps`` times (after one warm-up each)."""
    for fn in calls.values():
        fn()
    times = {name: [] for name in calls}
    for _ in range(reps):
        for name, fn in calls.items():
            start = clock()
            fn()
            times[name].append(clock() - start)
    return {name: statistics.median(samples) for name, samples in times.items()}


def bench_shape(n: int, k: int, rows: list, reps: int, clock=time.perf_counter) -> list:
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
        before = load_average()
        t = interleaved_medians(
            {
                "fp8": lambda: ops.fp8_linear(x, d8, s8),
                "fp4": lambda: ops.fp4_linear(x, p4, s4),
                "bf16w": lambda: ops.bf16_linear(x, w_bf16),
                "F.bf16": lambda: F.linear(x, w_bf16),
                "F.fp32": lambda: F.linear(x32, w_fp32),
            },
            reps,
            clock,
        )
        results.append({"n": n, "k": k, "m": m, "load": f"{before} -> {load_average()}", **t})
        print(f"  {n}x{k} M={m}: " + ", ".join(f"{key} {v * 1e3:.1f}" for key, v in t.items())
              + f" ms (load {results[-1]['load']})", flush=True)
    return results


def table(results: list) -> str:
    head = ("| N x K | M | fp8 ms | fp4 ms | bf16w ms | F.bf16 ms | F.fp32 ms | F.bf16/fp8 | F.bf16/fp4 | "
            "F.bf16/bf16w | F.fp32/fp8 | load avg |")
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in results:
        lines.append(
            f"| {r['n']}x{r['k']} | {r['m']} | {r['fp8'] * 1e3:.1f} | {r['fp4'] * 1e3:.1f} | {r['bf16w'] * 1e3:.1f} | "
            f"{r['F.bf16'] * 1e3:.1f} | {r['F.fp32'] * 1e3:.1f} | {r['F.bf16'] / r['fp8']:.2f} | "
            f"{r['F.bf16'] / r['fp4']:.2f} | {r['F.bf16'] / r['bf16w']:.2f} | {r['F.fp32'] / r['fp8']:.2f} | {r['load']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (torch_bq uses as many)")
    parser.add_argument("--rows", type=int, nargs="+", default=[128, 256, 512, 1024])
    parser.add_argument("--reps", type=int, default=5, help="interleaved rounds; medians are reported")
    parser.add_argument("--shapes", type=int, default=len(SHAPES), help="the first N shapes only")
    parser.add_argument("--shape", type=int, nargs=2, metavar=("N", "K"), help="this shape only")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time each call by the process's CPU time, not wall time (with --threads 1: "
                             "robust to other jobs time-slicing the core, not to their cache traffic)")
    parser.add_argument("--busy", type=int, default=0,
                        help="start this many busy-looping processes for the run (cores shared with others)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        run(args)
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()


def run(args) -> None:
    info = ops.backend_info()["cpu"] if hasattr(ops, "backend_info") else {}  # older torch_bq: no selector
    print(f"CPU: {cpu_model()}; supports {', '.join(info.get('supported', ['?']))}; torch_bq kernels: "
          f"{info.get('kernels')} at {info.get('isa')} ({info.get('source')}); torch {torch.__version__} "
          f"(capability {torch.backends.cpu.get_cpu_capability()}); {torch.get_num_threads()} threads, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}; {args.busy} busy processes started; "
          f"{'CPU' if args.cpu_time else 'wall'} time; "
          f"load average {load_average()}")
    results = []
    for n, k in [tuple(args.shape)] if args.shape else SHAPES[: args.shapes]:
        results += bench_shape(n, k, args.rows, args.reps, time.process_time if args.cpu_time else time.perf_counter)
    print()
    print(table(results))


if __name__ == "__main__":
    main()
