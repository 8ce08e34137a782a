"""Peak memory of loading one large quantized layer with ``from_checkpoint`` and running one forward.

For each format (fp8 32x32 e8m0, fp8 DeepSeek 128x128 float32 ``weight_scale_inv``,
MXFP4) a ``N x K`` layer (16384 x 16384 by default) is written to a temporary
safetensors file, then a fresh subprocess loads it with ``from_checkpoint``,
keeps it, and runs one forward with ``M = 1``. The subprocess reports its peak
resident set growth over its own baseline (after imports and a 64 x 64 warm-up
layer through the same path), from Linux's
``VmHWM`` reset through ``/proc/self/clear_refs`` (``ru_maxrss`` otherwise).

Baselines measured in the same run, each in its own subprocess:

* ``quantized bytes``: data + scales, the least any loader can hold;
* ``safetensors load_file``: reading the same file's tensors whole with
  ``safetensors.torch.load_file`` (what a naive loader does first);
* ``bf16 weight``: materialising the weight as a bf16 tensor (what
  "dequantize on load" would cost at least).

The target is growth <= 1.5x the quantized bytes.

Usage: ``python benchmarks/load_memory.py [--n 16384] [--k 16384] [--formats fp8,fp8-ds,fp4]``
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, os, resource, sys, time
import torch

def rss_kib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])

def reset_peak():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False

def peak_kib(reset_ok):
    if reset_ok:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

mode, path, fmt, k = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
import torch_bq.nn as bnn
from safetensors import safe_open  # noqa: F401  (imported before the baseline, like the loader's own code)
from safetensors.torch import load_file
x = torch.randn(1, k, dtype=torch.bfloat16)
torch.set_num_threads(1)
# One-time initialisation (op registration paths, allocator pools) is not proportional
# to the weight, so it happens before the baseline: a 64 x 64 layer through the same path.
cls = bnn.FP4Linear if fmt == "fp4" else bnn.FP8Linear
warm = cls.from_linear(torch.nn.Linear(64, 64))
warm(torch.randn(1, 64, dtype=torch.bfloat16))
bnn.FP8Linear.from_checkpoint({"w.weight": warm.weight, "w.weight_scale": warm.weight_scale}, "w") if fmt != "fp4" else None
base = rss_kib()
ok = reset_peak()
t0 = time.perf_counter()
if mode == "from_checkpoint":
    layer = cls.from_checkpoint(path, "layer")
    t_load = time.perf_counter() - t0
    y = layer(x)
    keep = layer
elif mode == "load_file":
    keep = load_file(path)
    t_load = time.perf_counter() - t0
elif mode == "bf16":
    keep = torch.ones(int(sys.argv[5]), k, dtype=torch.bfloat16)
    t_load = time.perf_counter() - t0
t_total = time.perf_counter() - t0
print(json.dumps({"growth_bytes": (peak_kib(ok) - base) * 1024, "reset": ok,
                  "load_s": t_load, "total_s": t_total}))
"""


def write_layer(path: Path, fmt: str, n: int, k: int) -> int:
    """A random valid layer written without ever holding a float copy; returns its quantized bytes."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    if fmt == "fp4":
        data = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
        scale = torch.randint(118, 125, (n, k // 32), dtype=torch.uint8, generator=g).view(torch.float8_e8m0fnu)
        tensors = {"layer.weight": data, "layer.weight_scale": scale}
    else:
        data = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=g)
        data[(data & 0x7F) == 0x7F] = 0  # no NaN codes
        data = data.view(torch.float8_e4m3fn)
        if fmt == "fp8-ds":
            exps = torch.randint(-12, -6, (-(-n // 128), -(-k // 128)), generator=g).float()
            tensors = {"layer.weight": data, "layer.weight_scale_inv": torch.pow(2.0, exps)}
        else:
            scale = torch.randint(115, 122, (-(-n // 32), -(-k // 32)), dtype=torch.uint8, generator=g)
            tensors = {"layer.weight": data, "layer.weight_scale": scale.view(torch.float8_e8m0fnu)}
    save_file(tensors, path)
    return sum(t.numel() * t.element_size() for t in tensors.values())


def run_child(*args) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", CHILD, *map(str, args)], capture_output=True, text=True, env=env)
    if out.returncode:
        raise RuntimeError(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def machine() -> str:
    """CPU model, the ISA extensions that matter here, load average, torch version (one line)."""
    import platform

    import torch

    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name") and model in ("", platform.machine()):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    isa = [f for f in ("avx2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16") if f in flags]
    load = os.getloadavg() if hasattr(os, "getloadavg") else ("?",) * 3
    return (f"{model}; ISA: {' '.join(isa) or 'baseline'}; load average {' '.join(f'{v:.2f}' for v in load)}; "
            f"torch {torch.__version__}, {os.cpu_count()} CPUs")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--k", type=int, default=16384)
    ap.add_argument("--formats", default="fp8,fp8-ds,fp4")
    args = ap.parse_args()
    mib = 2**20
    print(machine())
    print(f"layer {args.n} x {args.k}; peak RSS growth over each subprocess's baseline")
    print(f"{'format':<8} {'quantized':>10} {'from_checkpoint+fwd':>20} {'ratio':>6} "
          f"{'load_file':>10} {'ratio':>6} {'bf16 weight':>12} {'ratio':>6} {'load s':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in args.formats.split(","):
            path = Path(tmp) / f"{fmt}.safetensors"
            qbytes = write_layer(path, fmt, args.n, args.k)
            ours = run_child("from_checkpoint", path, fmt, args.k)
            naive = run_child("load_file", path, fmt, args.k)
            dense = run_child("bf16", path, fmt, args.k, args.n)
            print(f"{fmt:<8} {qbytes / mib:>8.1f}Mi {ours['growth_bytes'] / mib:>18.1f}Mi "
                  f"{ours['growth_bytes'] / qbytes:>6.2f} {naive['growth_bytes'] / mib:>8.1f}Mi "
                  f"{naive['growth_bytes'] / qbytes:>6.2f} {dense['growth_bytes'] / mib:>10.1f}Mi "
                  f"{dense['growth_bytes'] / qbytes:>6.2f} {ours['load_s']:>7.2f}")
            path.unlink()
    print("ratio = growth / quantized bytes (target <= 1.5 for from_checkpoint+fwd)")


if __name__ == "__main__":
    main()
