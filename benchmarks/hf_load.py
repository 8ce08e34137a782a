"""Loading a quantized checkpoint through transformers' ``from_pretrained``: torch_bq's quantizer vs transformers' own CPU path.

Two checkpoints are written once (random weights, each family's own release layout,
see tests/hf_fixtures.py):

* ``fp8``: a Llama-architecture model stored as fine-grained fp8 (Qwen3-FP8 /
  DeepSeek-V3 layout: e4m3 + float32 ``weight_scale_inv``, 128x128 blocks,
  ``quant_method: "fp8"``);
* ``mxfp4``: a gpt-oss model with MXFP4 experts (``_blocks``/``_scales``,
  ``quant_method: "mxfp4"``).

Each load runs in a fresh subprocess that first loads and runs a tiny checkpoint of
the same family through the same path (imports, kernels, allocator warm), then reports
the peak resident-set growth of the real load over that baseline (``VmHWM`` reset
through ``/proc/self/clear_refs``),
then greedy-decodes ``--tokens`` tokens from a 16-token prompt (batch 1, KV cache)
and reports tokens/s (after a 2-token warm-up). Paths, measured in the same run:

* ``torch_bq``: ``from_pretrained(path, quantization_config=torch_bq.hf.TorchBQConfig())``
  (torch_bq modules on the stored bytes);
* ``transformers``: ``from_pretrained(path)``, which on a CPU dequantizes both formats
  to bf16 (FineGrainedFP8 and Mxfp4 fall back to ``dequantize=True`` without a GPU /
  triton kernels). transformers' quantizers refuse to load without ``accelerate``
  (pinned in requirements-dev.txt); without it, run ``--paths torch_bq``.

``quantized bytes`` is the checkpoint's tensor bytes (what any loader must hold at least).

Usage: ``python benchmarks/hf_load.py [--formats fp8,mxfp4] [--paths torch_bq,transformers] [--tokens 32] [--threads 1]``
"""

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # hf_fixtures: the families' layouts, written once for tests and here

CHILD = r"""
import json, sys, time, warnings
import torch
torch.set_num_threads(int(sys.argv[3]))
import transformers
from transformers import AutoModelForCausalLM
transformers.logging.set_verbosity_error()
warnings.simplefilter("ignore")
mode, path, tokens, warmup = sys.argv[1], sys.argv[2], int(sys.argv[4]), sys.argv[5]
if mode == "torch_bq":
    import torch_bq.hf
    kwargs = {"quantization_config": torch_bq.hf.TorchBQConfig()}
else:
    kwargs = {}

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

# Warm-up through the same path on a tiny checkpoint of the same family: imports the
# model's module, loads torch_bq's kernels, touches the allocator, so the baseline holds them.
tiny = AutoModelForCausalLM.from_pretrained(warmup, **kwargs)
with torch.no_grad():
    tiny(torch.tensor([[1, 2, 3]]))
del tiny
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
base = status("VmRSS:")
t0 = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
load_s = time.perf_counter() - t0
peak = status("VmHWM:") - base
held = status("VmRSS:") - base
prompt = torch.arange(1, 17)[None] % model.config.vocab_size
with torch.no_grad():
    model.generate(prompt, max_new_tokens=2, do_sample=False)
    t0 = time.perf_counter()
    out = model.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    dt = time.perf_counter() - t0
print(json.dumps({"peak": peak, "held": held, "load_s": load_s, "tok_s": tokens / dt,
                  "tokens": out[0, 16:].tolist()}))
"""


def cpu_info() -> str:
    model, flags = platform.processor() or "?", set()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name") and model in ("?", ""):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    isa = [f for f in ("avx2", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile") if f in flags]
    return f"{model}; ISA: {' '.join(isa) or 'unknown'}; load average {os.getloadavg()[0]:.2f}"


def write_checkpoints(root: Path, which) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, GptOssConfig, LlamaConfig

    import hf_fixtures as fx

    paths = {}
    torch.manual_seed(0)
    if "fp8" in which:
        config = LlamaConfig(vocab_size=16384, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
                             num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=512,
                             dtype="bfloat16")
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        _randomize(model)
        paths["fp8"] = fx.deepseek_fp8(model, root / "fp8")
        paths["fp8-warmup"] = fx.deepseek_fp8(fx.float_model("llama"), root / "fp8-warmup")
    if "mxfp4" in which:
        config = GptOssConfig(vocab_size=16384, hidden_size=512, intermediate_size=512, num_hidden_layers=4,
                              num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_local_experts=16,
                              num_experts_per_tok=4, sliding_window=128, max_position_embeddings=512,
                              rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, dtype="bfloat16")
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        _randomize(model)
        paths["mxfp4"] = fx.gpt_oss_mxfp4(model, root / "mxfp4")
        paths["mxfp4-warmup"] = fx.gpt_oss_mxfp4(fx.float_model("gpt_oss"), root / "mxfp4-warmup")
    return paths


def _randomize(model):
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.03)
            elif "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02)


def checkpoint_bytes(path: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                sl = h.get_slice(k)
                n = 1
                for d in sl.get_shape():
                    n *= d
                total += n * {"F8_E4M3": 1, "U8": 1, "BF16": 2, "F32": 4, "F16": 2}[sl.get_dtype()]
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="fp8,mxfp4")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--paths", default="torch_bq,transformers",
                    help="which loaders to measure (transformers' needs accelerate)")
    args = ap.parse_args()
    which = args.formats.split(",")
    modes = args.paths.split(",")
    if set(modes) - {"torch_bq", "transformers"}:
        raise SystemExit(f"--paths: expected torch_bq and/or transformers, got {args.paths!r}")
    if "transformers" in modes and importlib.util.find_spec("accelerate") is None:
        # transformers' FineGrainedFP8 / Mxfp4 quantizers raise ImportError without it, after minutes of setup
        raise SystemExit("the transformers path needs accelerate (its fp8 and mxfp4 quantizers refuse to load "
                         "without it): python -m pip install accelerate==1.15.0 (as requirements-dev.txt pins "
                         "it), or measure torch_bq alone with --paths torch_bq")
    print(f"# {cpu_info()}; {args.threads} thread(s)")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_checkpoints(Path(tmp), which)
        for fmt, path in paths.items():
            if fmt.endswith("-warmup"):
                continue
            qbytes = checkpoint_bytes(path)
            runs = {}
            for mode in modes:
                out = subprocess.run([sys.executable, "-c", CHILD, mode, str(path), str(args.threads), str(args.tokens),
                                      str(paths[f"{fmt}-warmup"])],
                                     capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
                if out.returncode != 0:
                    raise SystemExit(f"{fmt} {mode} failed:\n{out.stderr[-3000:]}")
                runs[mode] = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"\n{fmt}: quantized bytes {qbytes / 2**20:.1f} MiB")
            print(f"{'path':<14}{'peak RSS':>12}{'/ quantized':>13}{'held':>11}{'load s':>9}{'tok/s':>9}")
            for mode, r in runs.items():
                print(f"{mode:<14}{r['peak'] / 2**20:>9.1f} MiB{r['peak'] / qbytes:>12.2f}x"
                      f"{r['held'] / 2**20:>7.1f} MiB{r['load_s']:>9.2f}{r['tok_s']:>9.1f}")
            if len(runs) == 2:
                same = runs["torch_bq"]["tokens"] == runs["transformers"]["tokens"]
                agree = sum(a == b for a, b in zip(runs["torch_bq"]["tokens"], runs["transformers"]["tokens"]))
                print(f"torch_bq / transformers: tok/s {runs['torch_bq']['tok_s'] / runs['transformers']['tok_s']:.2f}x, "
                      f"peak RSS {runs['torch_bq']['peak'] / runs['transformers']['peak']:.2f}x; "
                      f"greedy tokens equal in {agree}/{args.tokens} positions{' (all)' if same else ''}")
            results.append({"format": fmt, "quantized_bytes": qbytes, **{m: {k: v for k, v in r.items() if k != 'tokens'}
                                                                           for m, r in runs.items()}})
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
