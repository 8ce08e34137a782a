"""Capability checks: the one place torch_bq looks at its environment.

Nothing else in the package sniffs for SDKs, compilers or devices; backend
modules ask here. Neuron kernels register only when the SDK is present; the
CPU kernels always register and fall back to the reference at call time when
they cannot be built (building is deferred to the first call).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import platform
import shutil
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import torch

__all__ = ["nki_available", "neuron_available", "neuron_lnc", "cpu_kernels", "cpu_isa"]


# --------------------------------------------------------------------------- #
# Neuron (Trainium2): the real NKI and torch_neuronx
# --------------------------------------------------------------------------- #


def _spec_exists(name: str) -> bool:
    """A regular module or package ``name`` is on the path (a bare directory of that name is not)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    return spec is not None and spec.origin is not None


def _import_quietly(name: str):
    """Import ``name`` or return ``None``; never raises, never lets a warning out."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return importlib.import_module(name)
    except Exception:  # a broken or placeholder install is "not available", whatever it raises
        return None


@functools.lru_cache(maxsize=None)
def nki_available() -> bool:
    """True when the real ``nki`` package (AWS Neuron SDK) is importable.

    PyPI's ``nki`` is an empty placeholder and torch_bq's own test stand-in
    (``tests/nki_shim``) marks itself; neither counts. When no ``nki`` is on the
    path this costs one ``find_spec`` and imports nothing.
    """
    if not _spec_exists("nki"):
        return False
    nki = _import_quietly("nki")
    if nki is None or getattr(nki, "__torch_bq_stand_in__", False):
        return False
    isa = _import_quietly("nki.isa")
    language = _import_quietly("nki.language")
    return (
        callable(getattr(nki, "jit", None))
        and callable(getattr(isa, "nc_matmul", None))
        and callable(getattr(isa, "dma_transpose", None))
        and callable(getattr(language, "ndarray", None))
    )


@functools.lru_cache(maxsize=None)
def neuron_available() -> bool:
    """True when torch_bq can register NKI kernels for the ``neuron`` device.

    Needs the real ``nki`` and ``torch_neuronx`` with its ``nki_op`` custom-op
    wrapper. On a machine without them (``find_spec`` finds neither) nothing is
    imported; an empty placeholder package is imported, found wanting, and ignored.
    """
    if not (_spec_exists("torch_neuronx") and _spec_exists("nki")):
        return False
    if not nki_available():
        return False
    torch_neuronx = _import_quietly("torch_neuronx")
    return torch_neuronx is not None and callable(getattr(torch_neuronx, "nki_op", None))


def neuron_lnc() -> int:
    """The Logical NeuronCore degree the Neuron runtime was started with (1 or 2).

    A kernel must be launched with the LNC the runtime uses
    (``NEURON_LOGICAL_NC_CONFIG``); this reads it rather than choosing one.
    Unset means the Trainium2 runtime default, LNC=2.
    """
    value = os.environ.get("NEURON_LOGICAL_NC_CONFIG", "2").strip()
    return 1 if value == "1" else 2


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


def _build_cpu_kernels(isa: Optional[str] = None) -> SimpleNamespace:
    """Compile (or load from the torch extensions cache) and return ``torch.ops.torch_bq_cpu``.

    ``isa`` is ``"avx2"`` or ``"generic"`` (default: :func:`cpu_isa`); one process can load only one.
    """
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler ({compiler!r} is not on PATH)")
    flags = ["-O3", "-fopenmp"]
    name = "torch_bq_cpu_generic"
    if (isa or cpu_isa()) == "avx2":
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
