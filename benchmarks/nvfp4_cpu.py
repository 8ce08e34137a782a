"""CPU NVFP4 benchmark: ``torch_bq.ops.nvfp4_linear``'s fast kernel against MXFP4 and its own reference body.

For every weight shape ``N x K`` and ``M`` in ``--rows``, one run times,
interleaved (A, B, C, then again, ``--reps`` rounds; medians), bf16 in and out,
activations not quantized (W4A16, both formats):

* ``nvfp4``: ``torch_bq.ops.nvfp4_linear`` (the fast CPU kernel, nvfp4.cpp);
* ``fp4``: ``torch_bq.ops.fp4_linear`` (MXFP4, kernels.cpp), ``act_quant=False``;
* ``nvfp4 ref``: the same op with the fast kernels switched off
  (``fast_kernels_disabled``): the reference body, a slab decode to float32
  then an fp32 GEMM, which is what ran on CPU before the fast kernel;
* ``F.bf16``: ``F.linear`` on the dequantized weight in bf16 (context).

and prints ratios (> 1: nvfp4 is faster). The CPU model, the kernels' ISA
level, the thread count and the load average are printed with the numbers.

``--clock thread`` (the default with one thread) times the calling thread's CPU
time (``time.thread_time``): with one thread every kernel runs on the caller, and
a thread the OS has descheduled for another process accumulates none, so on a
shared machine the medians track the work rather than the wait (memory and cache
contention still show). ``--clock wall`` times wall time.

Usage::

    python -m benchmarks.nvfp4_cpu                      # 4096x4096 and 14336x4096, M = 1, 8, 32, 128, 1 thread
    python -m benchmarks.nvfp4_cpu --rows 1 16 --reps 9
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import argparse  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.ggml_side_by_side import cpu_model  # noqa: E402
from benchmarks.prefill_cpu import interleaved_medians, load_average  # noqa: E402
from torch_bq import formats, ops  # noqa: E402
from torch_bq.ops import _backend  # noqa: E402
from torch_bq.ops.cpu import linear as fast  # noqa: E402

SHAPES = [(4096, 4096), (14336, 4096)]
CLOCKS = {"thread": time.thread_time, "wall": time.perf_counter}


def bench_shape(n: int, k: int, rows: list, reps: int, clock) -> list:
    torch.manual_seed(0)
    w = torch.randn(n, k, dtype=torch.bfloat16)
    p, s, s2 = formats.quantize_nvfp4(w)
    p4, s4 = formats.quantize_fp4(w)
    del w
    w_bf16 = formats.dequantize_nvfp4(p, s, s2, dtype=torch.bfloat16)
    results = []
    for m in rows:
        x = torch.randn(m, k, dtype=torch.bfloat16)
        before = load_average()

        def reference():
            with ops.fast_kernels_disabled("cpu"):
                return ops.nvfp4_linear(x, p, s, s2)

        t = interleaved_medians(
            {
                "nvfp4": lambda: ops.nvfp4_linear(x, p, s, s2),
                "fp4": lambda: ops.fp4_linear(x, p4, s4, act_quant=False),
                "nvfp4 ref": reference,
                "F.bf16": lambda: F.linear(x, w_bf16),
            },
            reps,
            clock,
        )
        path = "decode" if m <= fast.decode_max_m(_backend.cpu_kernels(), "nvfp4", k) else "prefill"
        results.append({"n": n, "k": k, "m": m, "path": path, "load": f"{before} -> {load_average()}", **t})
        print(f"  {n}x{k} M={m} ({path}): " + ", ".join(f"{key} {v * 1e3:.2f}" for key, v in t.items())
              + f" ms (load {results[-1]['load']})", flush=True)
    return results


def table(results: list) -> str:
    head = ("| N x K | M | nvfp4 path | nvfp4 ms | fp4 ms | nvfp4 ref ms | F.bf16 ms | fp4/nvfp4 | ref/nvfp4 | "
            "F.bf16/nvfp4 | load avg |")
    lines = [head, "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in results:
        lines.append(
            f"| {r['n']}x{r['k']} | {r['m']} | {r['path']} | {r['nvfp4'] * 1e3:.2f} | {r['fp4'] * 1e3:.2f} | "
            f"{r['nvfp4 ref'] * 1e3:.1f} | {r['F.bf16'] * 1e3:.2f} | {r['fp4'] / r['nvfp4']:.2f} | "
            f"{r['nvfp4 ref'] / r['nvfp4']:.1f} | {r['F.bf16'] / r['nvfp4']:.2f} | {r['load']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (torch_bq uses as many)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--reps", type=int, default=5, help="interleaved rounds; medians are reported")
    parser.add_argument("--shape", type=int, nargs=2, metavar=("N", "K"), help="this shape only")
    parser.add_argument("--clock", choices=list(CLOCKS), default=None,
                        help="thread CPU time or wall time (default: thread with 1 thread, else wall)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = args.clock or ("thread" if args.threads == 1 else "wall")
    info = ops.backend_info()["cpu"]
    print(f"CPU: {cpu_model()}; supports {', '.join(info['supported'])}; torch_bq kernels: {info['kernels']} at "
          f"{info['isa']} ({info['source']}); torch {torch.__version__}; {torch.get_num_threads()} threads, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}; {clock} clock; load average {load_average()}")
    results = []
    for n, k in [tuple(args.shape)] if args.shape else SHAPES:
        results += bench_shape(n, k, args.rows, args.reps, CLOCKS[clock])
    print()
    print(table(results))


if __name__ == "__main__":
    main()
