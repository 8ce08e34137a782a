"""What an eager M = 1 CPU call of ``fp8_linear`` / ``fp4_linear`` costs around its kernel, by call path.

For every weight shape, in one process (so one kernel library and one decode),
from a cold last-level cache, interleaved and shuffled call by call
(``--reps`` rounds, medians of the calling thread's CPU time):

* ``torch.ops``: the one-call entry point through its ``torch.ops`` overload
  (``OpOverload._op``), the way the eager direct path called it before stop 19;
* ``module``: the same entry point through the kernel library's Python module
  (``fp8_linear_direct``), the way it calls it now;
* ``op``: the public ``torch_bq.ops.fp8_linear`` / ``fp4_linear`` (its Python
  guards, then the module's entry point);
* ``nn``: ``FP8Linear`` / ``FP4Linear`` holding the same weight, ``layer(x)``;
* ``empty``: a Python call that does nothing, the timer's own cost.

The ``16x64`` shape makes the decode negligible, so its times are the fixed
cost of each path. Prints the CPU model, the kernels' level and the load
average.

Usage::

    python -m benchmarks.call_overhead
    python -m benchmarks.call_overhead --shapes 2880x2880 --reps 101
"""

from __future__ import annotations

import argparse

from benchmarks.ggml_side_by_side import Timer, cpu_model, load

SHAPES = [(16, 64), (2880, 2880), (4096, 4096)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", help="comma-separated NxK list")
    parser.add_argument("--reps", type=int, default=61, help="interleaved rounds; the median is kept")
    args = parser.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes else SHAPES

    import torch

    from torch_bq import formats, ops
    from torch_bq import nn as bqnn
    from torch_bq.ops import _backend
    from torch_bq.ops.cpu import linear as fast

    torch.set_num_threads(1)
    kernels = _backend.cpu_kernels()
    module = None if kernels is None else _backend.entry_module(kernels)
    if module is None:
        raise RuntimeError("needs the compiled CPU kernels built with Python's headers (their Python module)")
    print(f"CPU: {cpu_model()}; torch_bq {kernels.isa()} library, {kernels.decode_isa()} decode; 1 thread; "
          f"{args.reps} rounds, medians, cold cache; load average {load()}")
    timer = Timer(args.reps)
    print("\n| N x K | format | torch.ops us | module us | op us | nn us | empty us | torch.ops - module us |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for n, k in shapes:
        torch.manual_seed(0)
        w = torch.randn(n, k, dtype=torch.bfloat16)
        x = torch.randn(1, k, dtype=torch.bfloat16)
        d8, s8 = formats.quantize_fp8(w)
        p4, s4 = formats.quantize_fp4(w)
        nn8, nn4 = bqnn.FP8Linear.from_quantized(d8, s8), bqnn.FP4Linear.from_quantized(p4, s4)
        m8, m4 = fast.decode_max_m(kernels, "fp8", k), fast.decode_max_m(kernels, "fp4", k)
        via8, via4 = kernels.fp8_linear_op.default._op, kernels.fp4_linear_op.default._op
        args8 = (x, d8, s8, None, [32, 32], True, 224.0, torch.bfloat16, m8, fast.PANEL_BYTES)
        args4 = (x, p4, s4, None, True, 224.0, torch.bfloat16, m4, fast.PANEL_BYTES)
        t = timer({
            ("fp8", "torch.ops"): lambda: via8(*args8),
            ("fp8", "module"): lambda: module.fp8_linear_direct(*args8),
            ("fp8", "op"): lambda: ops.fp8_linear(x, d8, s8),
            ("fp8", "nn"): lambda: nn8(x),
            ("fp4", "torch.ops"): lambda: via4(*args4),
            ("fp4", "module"): lambda: module.fp4_linear_direct(*args4),
            ("fp4", "op"): lambda: ops.fp4_linear(x, p4, s4),
            ("fp4", "nn"): lambda: nn4(x),
            ("-", "empty"): lambda: None,
        })
        for fmt in ("fp8", "fp4"):
            us = {path: t[(fmt, path)] * 1e6 for path in ("torch.ops", "module", "op", "nn")}
            print(f"| {n}x{k} | {fmt} | {us['torch.ops']:.0f} | {us['module']:.0f} | {us['op']:.0f} | {us['nn']:.0f} | "
                  f"{t[('-', 'empty')] * 1e6:.0f} | {us['torch.ops'] - us['module']:.0f} |", flush=True)
    print(f"\nload average after: {load()}")


if __name__ == "__main__":
    main()
