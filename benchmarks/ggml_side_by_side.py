"""torch_bq's CPU linear kernels side by side with llama.cpp's ggml, torchao and ``F.linear``.

For every weight shape ``N x K`` and row count ``M``, in one process and one run:

* ``fp8``, ``fp4``: ``torch_bq.ops.fp8_linear`` (32x32 e8m0 blocks) and
  ``fp4_linear`` (MXFP4), bf16 activations, activation qdq included, bf16 output;
* ``fp8-module``, ``fp4-module`` (M = 1 only): ``FP8Linear`` / ``FP4Linear``
  holding the same weight, called on the same activation (``module(x)``);
* ``fp8-kernel``, ``fp4-kernel``: the compiled kernel call alone, on operands
  prepared ahead (the activation already qdq'd, fp32 output), through the kernel
  library's Python module (not ``torch.ops``) where it has one: what the op and
  the modules would cost without any Python, argument checks, qdq or output
  rounding around the kernel;
* ``q8_0``, ``mxfp4``: ggml's ``mul_mat`` on the same-size weight in its
  q8_0 / MXFP4 formats (ggml quantizes the activation to q8_0 inside the call;
  MXFP4 weights sit in ggml's CPU "repack" buffer where ggml has a repacked
  layout, as llama.cpp loads them by default);
* ``ao-int8``, ``ao-int4``: torchao's int8 / int4 weight-only CPU paths
  (``Int8WeightOnlyConfig``, ``Int4WeightOnlyConfig`` with the CPU int4 layout),
  when torchao is importable;
* ``bf16``: ``F.linear`` in bf16 on the fp8 weight dequantized ahead of time;
* ``floor4``: the MXFP4 weight's bytes over a read bandwidth measured in the same run.

ggml is built from the ``llama-cpp-python`` sdist (which vendors llama.cpp) into
a cache directory, twice: ``-march=native`` and AVX2-only (AVX2 + FMA + F16C,
no AVX-512). Each build is statically linked into its own small shared
library (``benchmarks/ggml_shim.c``) with ggml's symbols hidden, so both load
into this process. torch_bq runs at the same ISA as each ggml build: the native
comparison in this process, the AVX2 one in a child process with torch_bq's
CPU kernels capped at AVX2 (a process loads one build of the kernels).

Method: 1 thread (``OMP_NUM_THREADS=1``; ggml ``n_threads = 1``); every call
starts with its weight in memory only: before each call, untimed, a buffer twice
the last-level cache is read and every weight of the case is evicted line by
line (``benchmarks/evict.c``, built here with the system C compiler; the read
alone left much of an 8 MiB weight in a Zen 5's L3); the implementations and all row counts
of a shape are interleaved call by call, in a new order each of the ``--reps`` rounds, and
each time is the median. Times are the calling thread's CPU time
(``time.thread_time``), so a shared machine's descheduling does not enter;
memory contention from other jobs still does, hence the load average in the
header, and ratios rather than absolute times.

Pages: by default both sides' weights sit in 4 KiB pages (Linux's usual
``madvise`` THP mode gives large allocations huge pages only where asked).
``--huge-pages`` puts both on 2 MiB pages (torch's ``THP_MEM_ALLOC_ENABLE=1``
for torch_bq's tensors, ``madvise`` in the shim for ggml's), so that the two
can be compared on either kind of page.

Nothing of ggml is committed: this script downloads and builds it. Needs
``cmake`` and a C/C++ compiler; torchao is optional
(``pip install torchao==0.18.0``).

Usage::

    python -m benchmarks.ggml_side_by_side                  # both ISAs, full grid
    python -m benchmarks.ggml_side_by_side --quick          # one shape, a few M
    python -m benchmarks.ggml_side_by_side --isa native --shapes 4096x4096 --rows 1,4,16
    python -m benchmarks.ggml_side_by_side --crossover      # decode vs prefill path (DECODE_MAX_M)
    python -m benchmarks.ggml_side_by_side --cliffs --reps 11  # time per row at every M, steps above 10%
    python -m benchmarks.ggml_side_by_side --huge-pages     # both sides' weights on 2 MiB pages
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

LLAMA_CPP_PYTHON = "0.3.36"  # the sdist whose vendored llama.cpp is built
SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (2880, 2880), (5760, 2880)]
ROWS = [1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64, 65, 128]  # pairs M, M + 1 where tiles change
QUICK_ROWS = [1, 4, 16, 32]
LLC_FLUSH_BYTES = 64 << 20  # twice the 32 MiB L3 of the reference machine
ISA_CAP_ENV = "TORCH_BQ_CPU_ISA"  # torch_bq's cap on the CPU kernels' ISA
THP_ENV = "THP_MEM_ALLOC_ENABLE"  # torch's switch: large CPU allocations 2 MiB-aligned, madvise(MADV_HUGEPAGE)
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
GGML_TYPES = {"q8_0": 0, "mxfp4": 1}

SHIM_SOURCE = Path(__file__).with_name("ggml_shim.c")
CMAKE_PROJECT = """cmake_minimum_required(VERSION 3.14)
project(bq_ggml C CXX)
add_subdirectory({ggml} ggml)
add_library(bq_ggml_shim SHARED {shim})
target_link_libraries(bq_ggml_shim PRIVATE ggml)
target_link_options(bq_ggml_shim PRIVATE -Wl,--exclude-libs,ALL)
"""
GGML_BUILDS = {
    "native": ["-DGGML_NATIVE=ON"],
    "avx2": ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
             "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF", "-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_BF16=OFF",
             "-DGGML_AVX_VNNI=OFF"],
}


# --------------------------------------------------------------------------- #
# building ggml
# --------------------------------------------------------------------------- #


def default_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "torch_bq" / "ggml"


def ggml_source(cache: Path) -> Path:
    """The vendored ggml tree of the llama-cpp-python sdist, downloaded and unpacked once."""
    root = cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON}"
    ggml = root / "vendor" / "llama.cpp" / "ggml"
    if ggml.is_dir():
        return ggml
    cache.mkdir(parents=True, exist_ok=True)
    sdist = cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not sdist.exists():
        print(f"downloading the llama-cpp-python {LLAMA_CPP_PYTHON} sdist into {cache}", flush=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--no-build-isolation",
             f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(cache)],
            check=False, capture_output=True, text=True,
        )
        if not sdist.exists():  # pip prepares metadata even for a download; without build isolation that can fail
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                 f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(cache)],
                check=True,
            )
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/ggml/" in m.name]
        try:
            tar.extractall(cache, members=members, filter="data")
        except TypeError:  # Python without tarfile extraction filters
            tar.extractall(cache, members=members)
    return ggml


def build_ggml(cache: Path, isa: str) -> Path:
    """``libbq_ggml_shim.so`` for one ISA build of ggml (cmake; built once per cache)."""
    lib = cache / f"build-{isa}" / "libbq_ggml_shim.so"
    if lib.exists() and lib.stat().st_mtime >= SHIM_SOURCE.stat().st_mtime:
        return lib
    if shutil.which("cmake") is None:
        raise RuntimeError("cmake is needed to build ggml (apt-get install cmake, or pip install cmake)")
    ggml = ggml_source(cache)
    project = cache / "project"
    project.mkdir(parents=True, exist_ok=True)
    # add_subdirectory (not ggml as the top project): the sdist leaves out files a standalone ggml build wants.
    (project / "CMakeLists.txt").write_text(CMAKE_PROJECT.format(ggml=ggml.as_posix(), shim=SHIM_SOURCE.resolve().as_posix()))
    build = cache / f"build-{isa}"
    print(f"building ggml ({isa}) in {build}", flush=True)
    common = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DCMAKE_POSITION_INDEPENDENT_CODE=ON",
              "-DGGML_OPENMP=OFF", "-DGGML_CCACHE=OFF", "-DGGML_BUILD_TESTS=OFF", "-DGGML_BUILD_EXAMPLES=OFF"]
    for step in (["cmake", "-S", str(project), "-B", str(build), *common, *GGML_BUILDS[isa]],
                 ["cmake", "--build", str(build), "-j", str(os.cpu_count() or 1), "--target", "bq_ggml_shim"]):
        done = subprocess.run(step, capture_output=True, text=True)  # ggml's compiler warnings stay out of the report
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(step[:2])} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    return lib


class Ggml:
    """One ggml build, loaded through the shim."""

    FLAGS = ["avx2", "fma", "f16c", "avx512", "avx512_vnni", "avx512_bf16", "avx_vnni"]

    def __init__(self, lib_path: Path):
        lib = ctypes.CDLL(str(lib_path), mode=os.RTLD_LOCAL)
        lib.bq_create.restype = ctypes.c_void_p
        lib.bq_create.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
                                  ctypes.c_int, ctypes.c_int]
        lib.bq_run.argtypes = [ctypes.c_void_p, ctypes.c_int64]
        lib.bq_set_input.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
        lib.bq_get_output.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
        lib.bq_repacked.argtypes = [ctypes.c_void_p]
        lib.bq_huge_pages.argtypes = [ctypes.c_void_p]
        lib.bq_free.argtypes = [ctypes.c_void_p]
        lib.bq_weight_buffer.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t)]
        self.lib = lib
        bits = lib.bq_isa_flags()
        self.isa = [name for i, name in enumerate(self.FLAGS) if bits >> i & 1]

    def weight(self, kind: str, w) -> "GgmlWeight":
        return GgmlWeight(self, kind, w)


class GgmlWeight:
    def __init__(self, ggml: Ggml, kind: str, w):
        import torch

        w = w.float().contiguous()
        self.lib, self.n, self.k = ggml.lib, w.shape[0], w.shape[1]
        self.handle = self.lib.bq_create(GGML_TYPES[kind], self.n, self.k, w.data_ptr(), 1, 1, int(huge_pages()))
        self.repacked = bool(self.lib.bq_repacked(self.handle))
        if huge_pages() and not self.lib.bq_huge_pages(self.handle):
            raise RuntimeError(f"ggml shim: madvise(MADV_HUGEPAGE) refused for the {kind} weight")
        self._torch = torch

    def prepare(self, x) -> None:
        """Sets the input of the ``x.shape[0]``-row graph (each row count has its own)."""
        x = x.float().contiguous()
        self.m = x.shape[0]
        if self.lib.bq_set_input(self.handle, self.m, x.data_ptr()) != 0:
            raise RuntimeError("ggml shim: too many row counts for one weight")

    def run(self, m: int) -> None:
        """Computes the ``m``-row graph on the input ``prepare`` gave it."""
        if self.lib.bq_run(self.handle, m) != 0:
            raise RuntimeError("ggml graph compute failed")

    def region(self) -> tuple[int, int]:
        """``(address, bytes)`` of the weight's buffer."""
        base, size = ctypes.c_void_p(), ctypes.c_size_t()
        self.lib.bq_weight_buffer(self.handle, ctypes.byref(base), ctypes.byref(size))
        return base.value, size.value

    def output(self):
        y = self._torch.empty(self.m, self.n)
        self.lib.bq_get_output(self.handle, self.m, y.data_ptr())
        return y

    def __del__(self):
        if getattr(self, "handle", None):
            self.lib.bq_free(self.handle)


# --------------------------------------------------------------------------- #
# timing
# --------------------------------------------------------------------------- #


def huge_pages() -> bool:
    """Whether this run puts the weights on 2 MiB pages (``--huge-pages``): torch's own large
    allocations through ``THP_MEM_ALLOC_ENABLE=1`` (read by torch once, at start-up), ggml's
    weight buffers through the shim's ``madvise``."""
    return os.environ.get(THP_ENV) == "1"


def anon_huge_pages_mib() -> float:
    """This process's anonymous memory on transparent huge pages (``/proc/self/smaps_rollup``)."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def cpu_model() -> str:
    """The model name, with the CPUID family and model where ``/proc/cpuinfo`` has them (a VM's
    model name may be just "AMD EPYC": family 25 is Zen 3/4, 26 Zen 5)."""
    try:
        fields = {}
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "cpu family", "model") and key not in fields:
                fields[key] = value.strip()
            if not line.strip() and fields:
                break
        if "model name" in fields:
            extra = [f"{k} {fields[k]}" for k in ("cpu family", "model") if k in fields]
            return fields["model name"] + (f" ({', '.join(extra)})" if extra else "")
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                wanted = ["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
                          "avx512vbmi", "avx_vnni", "amx_bf16"]
                return [f for f in wanted if f in have]
    except OSError:
        pass
    return []


def load() -> str:
    return "/".join(f"{v:.2f}" for v in os.getloadavg())


class Evictor:
    """Evicts memory regions from every cache level (``benchmarks/evict.c``, built here with the
    system C compiler into ``cache``); where that cannot be built or the CPU has no user-level
    eviction, ``method`` says so and evicting does nothing."""

    SOURCE = Path(__file__).with_name("evict.c")

    def __init__(self, cache: Path):
        self.lib, self.method = None, "none"
        lib_path = cache / "libbq_evict.so"
        try:
            if not lib_path.exists() or lib_path.stat().st_mtime < self.SOURCE.stat().st_mtime:
                cache.mkdir(parents=True, exist_ok=True)
                subprocess.run([os.environ.get("CC", "cc"), "-O2", "-shared", "-fPIC", "-o", str(lib_path),
                                str(self.SOURCE)], check=True, capture_output=True, text=True)
            lib = ctypes.CDLL(str(lib_path))
            lib.bq_evict.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            probe = ctypes.create_string_buffer(64)
            if lib.bq_evict(ctypes.addressof(probe), 64):
                self.lib, self.method = lib, "every weight evicted line by line (clflush / dc civac)"
        except (OSError, subprocess.CalledProcessError) as e:
            self.method = f"none ({type(e).__name__}: cannot build benchmarks/evict.c)"

    def __call__(self, regions) -> None:
        if self.lib is not None:
            for address, size in regions:
                self.lib.bq_evict(address, size)


def regions(*objs) -> list[tuple[int, int]]:
    """``(address, bytes)`` of the memory behind tensors (tensor subclasses such as torchao's
    through ``__tensor_flatten__``), modules (their parameters and buffers) and ggml weights,
    each storage once."""
    import torch

    found = {}

    def add(obj):
        if isinstance(obj, GgmlWeight):
            address, size = obj.region()
            found[address] = size
        elif isinstance(obj, torch.nn.Module):
            for t in [*obj.parameters(), *obj.buffers()]:
                add(t)
        elif isinstance(obj, torch.Tensor):
            if type(obj) not in (torch.Tensor, torch.nn.Parameter) and hasattr(obj, "__tensor_flatten__"):
                for name in obj.__tensor_flatten__()[0]:
                    add(getattr(obj, name))
            else:
                storage = obj.untyped_storage()
                found[storage.data_ptr()] = storage.nbytes()

    for obj in objs:
        add(obj)
    return [(address, size) for address, size in found.items() if size]


class Timer:
    """Interleaved, cold-cache, median thread-CPU time of several callables.

    Before each call a buffer twice the last-level cache is read and ``cold`` (the
    regions of every weight of the case, see ``regions``) is evicted: the read alone
    left much of an 8 MiB weight in a Zen 5's L3 (``benchmarks/evict.c``). The order
    of the callables is shuffled every round (seeded): the flush empties the data
    caches but not all of the instruction cache and branch predictors, so a fixed
    order would hand each callable the leftovers of the same neighbour.
    """

    def __init__(self, reps: int, cache: Path | None = None):
        """``cache``: where ``Evictor`` builds its library; ``None``: no eviction (the read alone)."""
        import torch

        self.reps = reps
        self.evict = Evictor(cache) if cache is not None else None
        self.cold_method = self.evict.method if self.evict is not None else "a read of twice the L3 only"
        self.flush = torch.ones(LLC_FLUSH_BYTES // 4)

    def __call__(self, fns: dict, cold=()) -> dict:
        for fn in fns.values():  # warm-up: code paths, allocator, graph set-up
            fn()
        samples = {name: [] for name in fns}
        order = list(fns.items())
        for rep in range(self.reps):
            random.Random(rep).shuffle(order)
            for name, fn in order:
                self.flush.sum()
                if self.evict is not None:
                    self.evict(cold)
                start = time.thread_time()
                fn()
                samples[name].append(time.thread_time() - start)
        return {name: statistics.median(v) for name, v in samples.items()}


def read_bandwidth(reps: int = 5) -> float:
    """Bytes per second that ``sum`` reads from a 512 MiB buffer (best of ``reps``, CPU time)."""
    import torch

    buf = torch.ones(128 << 20)
    buf.sum()
    best = float("inf")
    for _ in range(reps):
        start = time.thread_time()
        buf.sum()
        best = min(best, time.thread_time() - start)
    return buf.numel() * 4 / best


def torchao_linears(w_bf16):
    """torchao weight-only int8 / int4 ``nn.Linear``s on ``w_bf16``, or a reason they are missing."""
    import torch

    try:
        import torchao
        from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_
    except Exception as e:  # torchao absent or incompatible with this torch
        return {}, f"torchao not available ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    out, notes = {}, [f"torchao {torchao.__version__}"]
    configs = {"ao-int8": [Int8WeightOnlyConfig]}
    # int4 weight-only: whichever packing this torchao can run on a CPU tensor (0.18 has none).
    configs["ao-int4"] = [lambda fmt=fmt: Int4WeightOnlyConfig(group_size=32, int4_packing_format=fmt)
                          for fmt in ("opaque", "plain", "plain_int32", "tile_packed_to_4d")]
    for name, candidates in configs.items():
        errors = []
        for config in candidates:
            lin = torch.nn.Linear(w_bf16.shape[1], w_bf16.shape[0], bias=False, dtype=torch.bfloat16)
            with torch.no_grad():
                lin.weight.copy_(w_bf16)
            try:
                quantize_(lin, config())
                lin(torch.zeros(1, w_bf16.shape[1], dtype=torch.bfloat16))
            except Exception as e:
                errors.append(f"{type(e).__name__}: {str(e).splitlines()[0][:80]}")
                continue
            out[name] = lin
            break
        if name not in out:
            notes.append(f"{name}: no CPU path ({len(errors)} packing formats tried; first: {errors[0]})")
    return out, "; ".join(notes)


def bench_isa(isa: str, ggml_lib: Path, shapes, rows, reps: int, with_torchao: bool, cache: Path) -> dict:
    """All cases at one ISA, in this process (torch_bq must already be capped to ``isa``)."""
    import torch
    import torch.nn.functional as F

    from torch_bq import formats, ops
    from torch_bq import nn as bqnn
    from torch_bq.ops import _backend

    from torch_bq.ops.cpu import linear as fast

    torch.set_num_threads(1)
    kernels = _backend.cpu_kernels()
    if kernels is None:
        raise RuntimeError("torch_bq's compiled CPU kernels are unavailable; refusing to time the reference")
    ours = f"{kernels.isa()} library, {kernels.decode_isa()} decode"
    staged = _backend.entry_module(kernels) or kernels  # the kernel calls without torch.ops where the build allows
    ggml = Ggml(ggml_lib)
    bandwidth = read_bandwidth()
    timer = Timer(reps, cache)
    meta = {"isa": isa, "torch_bq_decode": ours, "ggml_isa": ggml.isa, "bandwidth": bandwidth,
            "load_start": load(), "torch": torch.__version__, "huge_pages": huge_pages(), "cold": timer.cold_method}
    print(f"[{isa}] torch_bq decode kernels: {ours}; ggml built with {'+'.join(ggml.isa)}; "
          f"read bandwidth {bandwidth / 1e9:.1f} GB/s; cold cache: {timer.cold_method}; load {meta['load_start']}",
          flush=True)
    results = []
    ao_note = "torchao not run"
    for n, k in shapes:
        torch.manual_seed(0)
        w = torch.randn(n, k, dtype=torch.bfloat16)
        d8, s8 = formats.quantize_fp8(w)
        p4, s4 = formats.quantize_fp4(w)
        w_bf16 = formats.dequantize_fp8(d8, s8)
        q8 = ggml.weight("q8_0", w)
        mx = ggml.weight("mxfp4", w)
        ao, ao_note = torchao_linears(w_bf16) if with_torchao else ({}, ao_note)
        del w
        d8b, s8b = formats.as_fp8_bytes(d8), formats.as_e8m0_codes(s8)
        p4b, s4b = formats.as_fp4_bytes(p4), formats.as_e8m0_codes(s4)
        max8, max4 = fast.decode_max_m(kernels, "fp8", k), fast.decode_max_m(kernels, "fp4", k)
        mod8, mod4 = bqnn.FP8Linear.from_quantized(d8, s8), bqnn.FP4Linear.from_quantized(p4, s4)
        cold = regions(d8, s8, p4, s4, w_bf16, q8, mx, mod8, mod4, *ao.values())
        # Every row count of the shape in the same shuffled rounds (ggml keeps one graph per
        # row count): a change of load during the run then moves M and M + 1 alike, so the
        # steps from M to M + 1 below compare like with like.
        fns = {}
        for m in rows:
            x = torch.randn(m, k, dtype=torch.bfloat16)
            q8.prepare(x)
            mx.prepare(x)
            a = kernels.qdq_fp8(x, 224.0, True)  # the kernels' operand: qdq(x) as fp32
            fns.update({
                ("fp8", m): lambda x=x: ops.fp8_linear(x, d8, s8),
                ("fp8-kernel", m): lambda a=a: staged.fp8_linear(a, d8b, s8b, None, 32, 32, max8, fast.PANEL_BYTES),
                ("q8_0", m): lambda m=m: q8.run(m),
                ("fp4", m): lambda x=x: ops.fp4_linear(x, p4, s4),
                ("fp4-kernel", m): lambda a=a: staged.fp4_linear(a, p4b, s4b, None, max4, fast.PANEL_BYTES),
                ("mxfp4", m): lambda m=m: mx.run(m),
                ("bf16", m): lambda x=x: F.linear(x, w_bf16),
            })
            if m == 1:
                fns[("fp8-module", m)] = lambda x=x: mod8(x)
                fns[("fp4-module", m)] = lambda x=x: mod4(x)
            for name, lin in ao.items():
                fns[(name, m)] = lambda lin=lin, x=x: lin(x)
        timed = timer(fns, cold)
        for m in rows:
            t = {name: v for (name, mm), v in timed.items() if mm == m}
            t["floor4"] = (n * -(-k // 2) + n * -(-k // 32)) / bandwidth
            results.append({"n": n, "k": k, "m": m, **t})
            print(f"  [{isa}] {n}x{k} M={m}: " + ", ".join(f"{key} {v * 1e3:.3f}" for key, v in t.items())
                  + " ms", flush=True)
        meta["mxfp4_repacked"] = mx.repacked
        meta["anon_huge_pages_mib"] = max(meta.get("anon_huge_pages_mib", 0.0), anon_huge_pages_mib())
        del q8, mx, mod8, mod4
    meta["torchao"] = ao_note
    meta["load_end"] = load()
    return {"meta": meta, "results": results}


# --------------------------------------------------------------------------- #
# report
# --------------------------------------------------------------------------- #


def ratio_table(run: dict) -> str:
    rows = run["results"]
    has = {key for r in rows for key in r}
    cols = [("M", lambda r: str(r["m"])),
            ("fp8 ms", lambda r: f"{r['fp8'] * 1e3:.3f}"),
            ("fp8/q8_0", lambda r: f"{r['fp8'] / r['q8_0']:.2f}"),
            ("kernel/q8_0", lambda r: f"{r['fp8-kernel'] / r['q8_0']:.2f}"),
            ("fp4 ms", lambda r: f"{r['fp4'] * 1e3:.3f}"),
            ("fp4/mxfp4", lambda r: f"{r['fp4'] / r['mxfp4']:.2f}"),
            ("kernel/mxfp4", lambda r: f"{r['fp4-kernel'] / r['mxfp4']:.2f}"),
            ("fp4/floor", lambda r: f"{r['fp4'] / r['floor4']:.2f}"),
            ("fp8/bf16", lambda r: f"{r['fp8'] / r['bf16']:.2f}")]
    for name in ("ao-int8", "ao-int4"):
        if name in has:
            cols.append((f"fp8/{name}", lambda r, name=name: f"{r['fp8'] / r[name]:.2f}"))
    out = []
    for n, k in dict.fromkeys((r["n"], r["k"]) for r in rows):
        sub = [r for r in rows if (r["n"], r["k"]) == (n, k)]
        out.append(f"\n**{run['meta']['isa']}: N x K = {n} x {k}** (time ratios: < 1 means torch_bq is faster)\n")
        out.append("| " + " | ".join(c for c, _ in cols) + " |")
        out.append("|" + "---:|" * len(cols))
        out += ["| " + " | ".join(f(r) for _, f in cols) + " |" for r in sub]
    return "\n".join(out)


def per_row_table(run: dict) -> str:
    """Kernel-call time per row (microseconds), one column per shape and format."""
    rows = run["results"]
    shapes = list(dict.fromkeys((r["n"], r["k"]) for r in rows))
    cols = [(n, k, fmt) for n, k in shapes for fmt in ("fp8", "fp4")]
    by = {(r["n"], r["k"], r["m"]): r for r in rows}
    out = [f"\n**{run['meta']['isa']}: kernel call, microseconds per row**\n",
           "| M | " + " | ".join(f"{n}x{k} {fmt}" for n, k, fmt in cols) + " |", "|" + "---:|" * (len(cols) + 1)]
    for m in sorted({r["m"] for r in rows}):
        cells = [f"{by[(n, k, m)][fmt + '-kernel'] / m * 1e6:.1f}" if (n, k, m) in by else "" for n, k, fmt in cols]
        out.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def m1_table(run: dict) -> str:
    """M = 1 per shape: the public op, the module and the kernel call alone, each over ggml's time."""
    rows = [r for r in run["results"] if r["m"] == 1 and "fp8-module" in r]
    if not rows:
        return ""
    out = [f"| {run['meta']['isa']}, M = 1 | fp8 op/q8_0 | fp8 module/q8_0 | fp8 kernel/q8_0 | fp4 op/mxfp4 | "
           "fp4 module/mxfp4 | fp4 kernel/mxfp4 | q8_0 ms | mxfp4 ms |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['n']}x{r['k']} | {r['fp8'] / r['q8_0']:.2f} | {r['fp8-module'] / r['q8_0']:.2f} | "
                   f"{r['fp8-kernel'] / r['q8_0']:.2f} | {r['fp4'] / r['mxfp4']:.2f} | "
                   f"{r['fp4-module'] / r['mxfp4']:.2f} | {r['fp4-kernel'] / r['mxfp4']:.2f} | "
                   f"{r['q8_0'] * 1e3:.3f} | {r['mxfp4'] * 1e3:.3f} |")
    return "\n".join(out)


def cliffs(run: dict) -> list[str]:
    """Consecutive row counts M -> M + 1 where the time per row rises by more than 10% (op and kernel call)."""
    found = []
    rows = run["results"]
    for n, k in dict.fromkeys((r["n"], r["k"]) for r in rows):
        sub = sorted((r for r in rows if (r["n"], r["k"]) == (n, k)), key=lambda r: r["m"])
        for a, b in zip(sub, sub[1:]):
            if b["m"] != a["m"] + 1:
                continue
            for fmt in ("fp8", "fp8-kernel", "fp4", "fp4-kernel"):
                rise = (b[fmt] / b["m"]) / (a[fmt] / a["m"])
                if rise > 1.10:
                    found.append(f"{run['meta']['isa']} {n}x{k} {fmt}: M={a['m']}->{b['m']} time/row x{rise:.2f}")
    return found


def summary(run: dict) -> str:
    """How many cases meet the issue's targets, for the public op and for the kernel call alone."""
    rows = run["results"]
    lines = [f"| {run['meta']['isa']} | fp8 op <= q8_0 | fp8 kernel <= q8_0 | fp4 op <= mxfp4 | "
             "fp4 kernel <= mxfp4 | fp4 op <= 1.5x floor | fp4 kernel <= 1.5x floor |", "|---|---|---|---|---|---|---|"]
    for label, pick in (("M = 1", lambda m: m == 1), ("M = 2-32", lambda m: 2 <= m <= 32), ("M > 32", lambda m: m > 32)):
        sub = [r for r in rows if pick(r["m"])]
        if not sub:
            continue

        def cell(ours, theirs):
            hits = sum(1 for r in sub if r[ours] <= r[theirs])
            worst = max(r[ours] / r[theirs] for r in sub)
            return f"{hits}/{len(sub)} (worst {worst:.2f})"

        def floor(ours):
            hits = sum(1 for r in sub if r[ours] <= 1.5 * r["floor4"])
            return f"{hits}/{len(sub)} (worst {max(r[ours] / r['floor4'] for r in sub):.2f}x)"

        lines.append(f"| {label} | {cell('fp8', 'q8_0')} | {cell('fp8-kernel', 'q8_0')} | {cell('fp4', 'mxfp4')} | "
                     f"{cell('fp4-kernel', 'mxfp4')} | {floor('fp4')} | {floor('fp4-kernel')} |")
    return "\n".join(lines)


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys((r["n"], r["k"]) for r in runs[0]["results"]))
    fig, axes = plt.subplots(len(runs), len(shapes), figsize=(4 * len(shapes), 3.6 * len(runs)), squeeze=False)
    series = [("torch_bq fp8 (op)", "fp8", "o-"), ("torch_bq fp8 (kernel call)", "fp8-kernel", "o-."),
              ("ggml q8_0", "q8_0", "o--"), ("torch_bq fp4 (op)", "fp4", "s-"),
              ("torch_bq fp4 (kernel call)", "fp4-kernel", "s-."), ("ggml mxfp4", "mxfp4", "s--"),
              ("F.linear bf16", "bf16", "^:"), ("torchao int8", "ao-int8", "x:"), ("torchao int4", "ao-int4", "+:"),
              ("fp4 bandwidth floor", "floor4", "k-")]
    for row, run in enumerate(runs):
        for col, (n, k) in enumerate(shapes):
            ax = axes[row][col]
            sub = [r for r in run["results"] if (r["n"], r["k"]) == (n, k)]
            ms = [r["m"] for r in sub]
            for label, key, style in series:
                if all(key in r for r in sub):
                    ax.plot(ms, [r[key] * 1e3 for r in sub], style, label=label, markersize=3)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{run['meta']['isa']}: {n} x {k}", fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
            ax.set_xlabel("M (rows)")
            if col == 0:
                ax.set_ylabel("ms per call (1 thread)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=5, fontsize=8)
    flags = " ".join(f for f in cpu_flags() if f.startswith("avx"))
    fig.suptitle(f"{cpu_model()}, {os.cpu_count()} logical CPUs; {flags}; cold weights, 1 thread", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 0.97))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    print(f"plot written to {path}")


def report(runs: list[dict]) -> None:
    print(f"\nCPU: {cpu_model()}; flags: {' '.join(cpu_flags())}; {os.cpu_count()} logical CPUs")
    for run in runs:
        meta = run["meta"]
        print(f"\n### {meta['isa']}: torch_bq decode kernels {meta['torch_bq_decode']}, ggml "
              f"{'+'.join(meta['ggml_isa'])} (MXFP4 repacked: {meta.get('mxfp4_repacked')}), {meta['torchao']}; "
              f"torch {meta['torch']}; read bandwidth {meta['bandwidth'] / 1e9:.1f} GB/s; "
              f"load average {meta['load_start']} -> {meta['load_end']}; pages: "
              + (f"2 MiB for the weights on both sides (this process's AnonHugePages up to "
                 f"{meta.get('anon_huge_pages_mib', 0.0):.0f} MiB)" if meta.get("huge_pages") else "4 KiB (no THP advice)"))
        print(ratio_table(run))
        print()
        print(m1_table(run))
        print()
        print(summary(run))
        print(per_row_table(run))
        found = cliffs(run)
        print("\ncliffs (time per row up > 10% from M to M + 1): " + ("; ".join(found) if found else "none"))


CROSSOVER_ROWS = [16, 24, 32, 48, 64, 96, 128]


def one_thread_kernels(header: str):
    """torch_bq's compiled CPU kernels on one thread (refusing to time the reference), after
    printing the CPU, the kernels' level, ``header`` and the load average."""
    import torch

    from torch_bq.ops import _backend

    torch.set_num_threads(1)
    kernels = _backend.cpu_kernels()
    if kernels is None:
        raise RuntimeError("torch_bq's compiled CPU kernels are unavailable")
    print(f"CPU: {cpu_model()}; torch_bq {kernels.isa()} library, {kernels.decode_isa()} decode; "
          f"{header} {load()}", flush=True)
    return kernels


def quantized_weights(n: int, k: int):
    """A seeded random ``[n, k]`` weight as ``(fp8, e8m0 scale, fp4, e8m0 scale)``, the op's
    tensors followed by the same four as the kernels' raw byte views."""
    import torch

    from torch_bq import formats

    torch.manual_seed(0)
    w = torch.randn(n, k, dtype=torch.bfloat16)
    d8, s8 = formats.quantize_fp8(w)
    p4, s4 = formats.quantize_fp4(w)
    raw = formats.as_fp8_bytes(d8), formats.as_e8m0_codes(s8), formats.as_fp4_bytes(p4), formats.as_e8m0_codes(s4)
    return (d8, s8, p4, s4), raw


def crossover(shapes, rows, reps: int, cache: Path) -> None:
    """Decode path forced vs prefill path forced, kernel calls at the selected ISA level: the
    measurements behind ``torch_bq.ops.cpu.linear.DECODE_MAX_M`` (the decode path should run up to
    the largest M where it is not slower per row)."""
    import torch

    from torch_bq.ops.cpu import linear as fast

    kernels = one_thread_kernels("load average")
    timer = Timer(reps, cache)
    print(f"cold cache: {timer.cold_method}")
    print("| shape | M | fp8 decode | fp8 prefill | fp4 decode | fp4 prefill |  (kernel call, ms per row)")
    print("|---|---:|---:|---:|---:|---:|")
    for n, k in shapes:
        _, (d8b, s8b, p4b, s4b) = quantized_weights(n, k)
        cold = regions(d8b, s8b, p4b, s4b)
        last = {"fp8": 0, "fp4": 0}
        for m in rows:
            a = kernels.qdq_fp8(torch.randn(m, k, dtype=torch.bfloat16), 224.0, True)
            t = timer({
                "fp8 decode": lambda: kernels.fp8_linear(a, d8b, s8b, None, 32, 32, 1 << 30, fast.PANEL_BYTES),
                "fp8 prefill": lambda: kernels.fp8_linear(a, d8b, s8b, None, 32, 32, 0, fast.PANEL_BYTES),
                "fp4 decode": lambda: kernels.fp4_linear(a, p4b, s4b, None, 1 << 30, fast.PANEL_BYTES),
                "fp4 prefill": lambda: kernels.fp4_linear(a, p4b, s4b, None, 0, fast.PANEL_BYTES),
            }, cold)
            for fmt in last:
                if t[f"{fmt} decode"] <= t[f"{fmt} prefill"]:
                    last[fmt] = m
            print(f"| {n} x {k} | {m} | " + " | ".join(f"{v / m * 1e3:.3f}" for v in t.values()) + " |", flush=True)
        print(f"|  {n} x {k}: largest M where decode <= prefill: fp8 {last['fp8']}, fp4 {last['fp4']} |")
    print(f"load average after: {load()}")


def cliff_check(shapes, rows, reps: int, cache: Path) -> None:
    """Time per row at every M of ``rows``, the public ops and the kernel calls (decode/prefill
    boundary as selected), with all row counts of a shape in the same shuffled rounds, so that a
    change of load during the run moves M and M + 1 alike; then each step M -> M + 1 whose time
    per row rises by more than 10% (the issue's "no cliffs"). Without ``rows``: M = 1-40 and, per
    format, the decode limit and the two row counts above it."""
    import torch

    from torch_bq import ops
    from torch_bq.ops import _backend
    from torch_bq.ops.cpu import linear as fast

    kernels = one_thread_kernels(f"{reps} rounds, medians; load average")
    staged = _backend.entry_module(kernels) or kernels
    timer = Timer(reps, cache)
    print(f"cold cache: {timer.cold_method}")
    flagged = []
    for n, k in shapes:
        (d8, s8, p4, s4), (d8b, s8b, p4b, s4b) = quantized_weights(n, k)
        max8, max4 = fast.decode_max_m(kernels, "fp8", k), fast.decode_max_m(kernels, "fp4", k)
        cold = regions(d8, s8, p4, s4)
        ms = rows or sorted(set(range(1, 41)) | {max8, max8 + 1, max8 + 2, max4, max4 + 1, max4 + 2})
        fns = {}
        for m in ms:
            x = torch.randn(m, k, dtype=torch.bfloat16)
            a = kernels.qdq_fp8(x, 224.0, True)
            fns[("fp8", m)] = lambda x=x: ops.fp8_linear(x, d8, s8)
            fns[("fp8-kernel", m)] = lambda a=a: staged.fp8_linear(a, d8b, s8b, None, 32, 32, max8, fast.PANEL_BYTES)
            fns[("fp4", m)] = lambda x=x: ops.fp4_linear(x, p4, s4)
            fns[("fp4-kernel", m)] = lambda a=a: staged.fp4_linear(a, p4b, s4b, None, max4, fast.PANEL_BYTES)
        t = timer(fns, cold)
        cols = ("fp8", "fp8-kernel", "fp4", "fp4-kernel")
        print(f"\n{n} x {k} (decode up to M = {max8} fp8, {max4} fp4): microseconds per row, and the rise "
              "over the row count before\n")
        print("| M | " + " | ".join(cols) + " | " + " | ".join(f"{c} rise" for c in cols) + " |")
        print("|---:|" + "---:|" * (2 * len(cols)))
        for i, m in enumerate(ms):
            per_row = [t[(c, m)] / m * 1e6 for c in cols]
            rises = []
            for c in cols:
                if i and ms[i - 1] == m - 1:
                    rise = (t[(c, m)] / m) / (t[(c, m - 1)] / (m - 1))
                    rises.append(f"{rise:.2f}" + (" !" if rise > 1.10 else ""))
                    if rise > 1.10:
                        flagged.append(f"{n}x{k} {c}: M={m - 1}->{m} x{rise:.2f}")
                else:
                    rises.append("")
            print(f"| {m} | " + " | ".join(f"{v:.1f}" for v in per_row) + " | " + " | ".join(rises) + " |", flush=True)
    print(f"\ncliffs (time per row up > 10% from M to M + 1): {'; '.join(flagged) or 'none'}")
    print(f"load average after: {load()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--isa", choices=["both", "native", "avx2"], default="both")
    parser.add_argument("--quick", action="store_true", help=f"4096x4096 only, M in {QUICK_ROWS}")
    parser.add_argument("--shapes", help="comma-separated NxK list")
    parser.add_argument("--rows", help="comma-separated M list")
    parser.add_argument("--reps", type=int, default=5, help="interleaved rounds; the median is kept")
    parser.add_argument("--cache", type=Path, default=default_cache(), help="where ggml is downloaded and built")
    parser.add_argument("--no-torchao", action="store_true")
    parser.add_argument("--json", type=Path, help="write the raw results here")
    parser.add_argument("--plot", type=Path, default=Path("docs/ggml_side_by_side.png"))
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--crossover", action="store_true",
                        help=f"time the decode path against the prefill path instead (no ggml; M default {CROSSOVER_ROWS})")
    parser.add_argument("--cliffs", action="store_true",
                        help="time per row at every M (ops and kernel calls, no ggml), all M of a shape interleaved; "
                             "M default 1-40 and each format's decode limit + 0, 1, 2")
    parser.add_argument("--huge-pages", action="store_true",
                        help=f"weights on 2 MiB pages on both sides: torch's {THP_ENV}=1 (the script restarts itself "
                             "with it) and madvise(MADV_HUGEPAGE) on ggml's weight buffers")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.huge_pages and not huge_pages():
        mode = THP_MODE.read_text().strip() if THP_MODE.exists() else "absent"
        if "[never]" in mode or mode == "absent":
            parser.error(f"--huge-pages: transparent huge pages are off here ({THP_MODE}: {mode})")
        # torch reads the switch once, at its first large allocation: restart with it set.
        os.execve(sys.executable, [sys.executable, "-m", "benchmarks.ggml_side_by_side", *sys.argv[1:]],
                  {**os.environ, THP_ENV: "1"})
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes else (
        SHAPES[:1] if args.quick else SHAPES)
    if args.crossover:
        crossover(shapes, [int(v) for v in args.rows.split(",")] if args.rows else CROSSOVER_ROWS, args.reps,
                  args.cache)
        return
    if args.cliffs:
        cliff_check(shapes, [int(v) for v in args.rows.split(",")] if args.rows else None, args.reps, args.cache)
        return
    rows = [int(v) for v in args.rows.split(",")] if args.rows else (QUICK_ROWS if args.quick else ROWS)
    if os.environ.get("OMP_NUM_THREADS") != "1":
        print("note: set OMP_NUM_THREADS=1 for this benchmark (it times one thread)")
    isas = ["native", "avx2"] if args.isa == "both" else [args.isa]
    libs = {isa: build_ggml(args.cache, isa) for isa in isas}
    runs = []
    for isa in isas:
        if isa == "native" and not args.child:
            runs.append(bench_isa(isa, libs[isa], shapes, rows, args.reps, not args.no_torchao, args.cache))
            continue
        if args.child:  # already capped by the parent
            print(json.dumps(bench_isa(isa, libs[isa], shapes, rows, args.reps, not args.no_torchao, args.cache)))
            return
        child = [sys.executable, "-m", "benchmarks.ggml_side_by_side", "--child", "--isa", isa, "--reps", str(args.reps),
                 "--cache", str(args.cache), "--shapes", ",".join(f"{n}x{k}" for n, k in shapes),
                 "--rows", ",".join(map(str, rows))] + (["--no-torchao"] if args.no_torchao else [])
        env = {**os.environ, ISA_CAP_ENV: isa, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(child, env=env, stdout=subprocess.PIPE, text=True, check=True)
        lines = proc.stdout.strip().splitlines()
        print("\n".join(lines[:-1]), flush=True)
        runs.append(json.loads(lines[-1]))
    report(runs)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    if not args.no_plot:
        plot(runs, args.plot)


if __name__ == "__main__":
    main()
