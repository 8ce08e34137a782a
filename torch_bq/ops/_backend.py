"""What this machine can run: the one place in torch_bq that inspects the environment.

Kernels ask here instead of probing compilers, CPU flags or SDKs themselves.
Each backend has its own section.
"""

from __future__ import annotations

import os
import platform
import shutil
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import torch

__all__ = ["cpu_kernels", "cpu_isa"]

# --------------------------------------------------------------------------- #
# CPU: the compiled kernels of torch_bq/ops/cpu/kernels.cpp
# --------------------------------------------------------------------------- #

CPU_KERNEL_SOURCE = Path(__file__).parent / "cpu" / "kernels.cpp"

_NOT_PROBED = object()
# The loaded kernel namespace (``torch.ops.torch_bq_cpu``), ``None`` when the
# kernels cannot be built here, or ``_NOT_PROBED`` before the first use. Tests
# set it to ``None`` to exercise the reference fallback.
cpu_kernel_ops = _NOT_PROBED


def cpu_isa() -> str:
    """``"avx2"`` when the CPU has AVX2, FMA and F16C (what the vector kernels use), else ``"generic"``."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "generic"
    # torch reports AVX2 only when the CPU also has FMA; F16C ships with every AVX2 CPU.
    return "avx2" if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") else "generic"


def _build_cpu_kernels() -> SimpleNamespace:
    """Compile (or load from the torch extensions cache) and return ``torch.ops.torch_bq_cpu``."""
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler ({compiler!r} is not on PATH)")
    flags = ["-O3", "-fopenmp"]
    name = "torch_bq_cpu_generic"
    if cpu_isa() == "avx2":
        flags += ["-mavx2", "-mfma", "-mf16c", "-DTORCH_BQ_AVX2"]
        name = "torch_bq_cpu_avx2"
    # A plain shared library registering TORCH_LIBRARY ops: no pybind11 module,
    # so Python's development headers are not needed.
    cpp_extension.load(
        name=name,
        sources=[str(CPU_KERNEL_SOURCE)],
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        verbose=False,
    )
    return torch.ops.torch_bq_cpu


def cpu_kernels() -> Optional[SimpleNamespace]:
    """The compiled CPU kernels (``torch.ops.torch_bq_cpu``), or ``None`` if they cannot be built.

    Built on first use with ``torch.utils.cpp_extension`` and cached in torch's
    extensions directory, so later processes only load the library. Without a
    compiler, or when the build fails, this warns once (one line) and every
    CPU op runs the reference kernels instead.
    """
    global cpu_kernel_ops
    if cpu_kernel_ops is _NOT_PROBED:
        try:
            cpu_kernel_ops = _build_cpu_kernels()
        except Exception as error:  # any build failure means: use the reference
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            warnings.warn(
                f"torch_bq: fast CPU kernels unavailable ({reason}); using the reference kernels",
                RuntimeWarning,
                stacklevel=2,
            )
            cpu_kernel_ops = None
    return cpu_kernel_ops
