"""Capability checks: the one place torch_bq looks at its environment.

Nothing else in the package sniffs for SDKs, compilers or devices; backend
modules ask here. Neuron kernels register only when the SDK is present; the
CPU kernels always register and fall back to the reference at call time when
they cannot be built (building is deferred to the first call).
"""

from __future__ import annotations

import functools
import glob
import importlib
import importlib.metadata
import importlib.util
import itertools
import os
import platform
import shutil
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import torch

__all__ = [
    "nki_available",
    "nki_version",
    "neuron_available",
    "neuron_unavailable_reason",
    "neuron_device_present",
    "neuron_lnc",
    "cpu_kernels",
    "cpu_isa",
]


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


# `.broadcast(dim, size)` on tensors, which the kernels use, arrived in NKI 0.5.0 (Neuron SDK
# 2.31.0; the SDK's NKI release notes and migration guide's version table).
NKI_MIN_VERSION = (0, 5)


def _version_tuple(text: str) -> Optional[tuple]:
    parts = []
    for piece in str(text).split("."):
        digits = "".join(itertools.takewhile(str.isdigit, piece))
        if not digits:
            break
        parts.append(int(digits))
        if len(parts) == 2:
            break
    return tuple(parts) if len(parts) == 2 else None


def nki_version(nki=None) -> Optional[tuple]:
    """``(major, minor)`` of the installed NKI (``nki.__version__``, else its distribution's metadata), or ``None``."""
    if nki is not None and getattr(nki, "__version__", None):
        return _version_tuple(nki.__version__)
    try:
        return _version_tuple(importlib.metadata.version("nki"))
    except Exception:  # not installed as a distribution, or no metadata
        return None


@functools.lru_cache(maxsize=None)
def nki_unavailable_reason() -> Optional[str]:
    """Why the real NKI cannot be used here (``None`` when it can); see :func:`nki_available`."""
    if not _spec_exists("nki"):
        return "no `nki` package (AWS Neuron SDK) is installed"
    nki = _import_quietly("nki")
    if nki is None:
        return "`nki` fails to import"
    if getattr(nki, "__torch_bq_stand_in__", False):
        return "`nki` is torch_bq's test stand-in"
    isa = _import_quietly("nki.isa")
    language = _import_quietly("nki.language")
    if not (
        callable(getattr(nki, "jit", None))
        and callable(getattr(isa, "nc_matmul", None))
        and callable(getattr(isa, "dma_transpose", None))
        and callable(getattr(language, "ndarray", None))
    ):
        return "`nki` lacks jit / isa.nc_matmul / isa.dma_transpose / language.ndarray (a placeholder package?)"
    version = nki_version(nki)
    floor = ".".join(str(v) for v in NKI_MIN_VERSION)
    if version is not None and version < NKI_MIN_VERSION:
        return f"NKI {version[0]}.{version[1]} is older than {floor} (Neuron SDK 2.31), which the kernels need"
    if version is None and not callable(getattr(getattr(language, "NkiTensor", None), "broadcast", None)):
        return f"cannot tell the NKI version, and nki.language.NkiTensor has no .broadcast (NKI >= {floor})"
    return None


def nki_available() -> bool:
    """True when the real ``nki`` package (AWS Neuron SDK), NKI >= 0.5, is importable.

    PyPI's ``nki`` is an empty placeholder and torch_bq's own test stand-in
    (``tests/nki_shim``) marks itself; neither counts. An NKI older than
    ``NKI_MIN_VERSION`` (0.5, Neuron SDK 2.31: ``NkiTensor.broadcast``) does not
    count either. When no ``nki`` is on the path this costs one ``find_spec``
    and imports nothing.
    """
    return nki_unavailable_reason() is None


@functools.lru_cache(maxsize=None)
def neuron_unavailable_reason() -> Optional[str]:
    """Why the ``neuron`` kernels cannot register (``None`` when they can); see :func:`neuron_available`."""
    if not _spec_exists("torch_neuronx"):
        return "no `torch_neuronx` (TorchNeuron) is installed"
    reason = nki_unavailable_reason()
    if reason is not None:
        return reason
    torch_neuronx = _import_quietly("torch_neuronx")
    if torch_neuronx is None:
        return "`torch_neuronx` fails to import"
    if getattr(torch_neuronx, "__torch_bq_stand_in__", False):
        return "`torch_neuronx` is torch_bq's test stand-in"
    if not (callable(getattr(torch_neuronx, "nki_op", None)) and callable(getattr(torch_neuronx, "wrap_nki", None))):
        return ("`torch_neuronx` has no nki_op / wrap_nki: the torch-xla flavour of torch-neuronx cannot register "
                "custom ops on the native `neuron` device (that needs TorchNeuron)")
    return None


def neuron_available() -> bool:
    """True when torch_bq can register NKI kernels for the ``neuron`` device.

    Needs the real ``nki`` (>= 0.5) and TorchNeuron's ``torch_neuronx`` with its
    ``nki_op`` / ``wrap_nki`` custom-op API. On a machine without them
    (``find_spec`` finds neither) nothing is imported; an empty placeholder
    package is imported, found wanting, and ignored.
    """
    return neuron_unavailable_reason() is None


def neuron_device_present() -> bool:
    """True on a machine with a Neuron device (``/dev/neuron*``) or where PrivateUse1 is named ``neuron``."""
    return bool(glob.glob("/dev/neuron[0-9]*")) or torch._C._get_privateuse1_backend_name() == "neuron"


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
