"""Capability checks: the one place torch_bq looks at its environment.

Nothing else in the package sniffs for SDKs, compilers, CPU features or
devices; backend modules ask here, and the selector here decides which kernels
serve each device and reports it (:func:`backend_info`, and once at INFO on the
``torch_bq`` logger). Neuron kernels register only when the SDK is present; the
CPU kernels always register and run the best ISA level the CPU has (chosen at
load time from the CPU's own feature flags, capped by ``$TORCH_BQ_CPU_ISA`` or
:func:`set_cpu_isa_cap`), falling back to the reference at call time when they
cannot be loaded or built.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import importlib
import importlib.metadata
import importlib.util
import itertools
import logging
import os
import platform
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Optional

import torch

__all__ = [
    "nki_available",
    "nki_version",
    "neuron_available",
    "neuron_unavailable_reason",
    "neuron_device_present",
    "neuron_lnc",
    "backend_info",
    "cpu_features",
    "supported_cpu_isas",
    "set_cpu_isa_cap",
    "cpu_isa",
    "cpu_selection",
    "cpu_kernels",
    "register_fast_kernel",
    "report_backend",
    "fast_kernels_disabled",
    "direct_call_allowed",
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
# CPU: the compiled kernels of torch_bq/ops/cpu/kernels.cpp, one library per ISA level
# --------------------------------------------------------------------------- #

CPU_KERNEL_SOURCE = Path(__file__).parent / "cpu" / "kernels.cpp"
# Where setup.py puts the libraries it builds at install time (next to the source).
INSTALLED_DIR = CPU_KERNEL_SOURCE.parent

ISA_ENV = "TORCH_BQ_CPU_ISA"  # cap: the highest level the CPU kernels may use
REQUIRE_ENV = "TORCH_BQ_REQUIRE_FAST_KERNELS"  # "1": failing to load the best level is an error (CI)
BUILD_TIMEOUT_ENV = "TORCH_BQ_BUILD_TIMEOUT"  # seconds to wait for another process's JIT build
DEFAULT_BUILD_TIMEOUT = 600.0

_log = logging.getLogger("torch_bq")


def _isa_table():
    from .cpu import isa  # imports nothing; deferred because the cpu package imports this module

    return isa


@functools.lru_cache(maxsize=None)
def cpu_features() -> frozenset:
    """The CPU's feature flags as Linux names them (``avx2``, ``avx512_bf16``, ...).

    Read from ``/proc/cpuinfo``, where the kernel lists only what both the CPU
    (CPUID) and the OS (saved vector state) support; elsewhere from PyTorch's
    cpuinfo-based CPUID probes. Never from the flags torch itself was built with.
    """
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    probes = {
        "avx2": ("avx2", "fma", "f16c"),  # every AVX2 CPU has FMA and F16C
        "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
        "avx512_bf16": ("avx512_bf16",),
        "vnni": ("avx512_vnni",),
    }
    found = set()
    for probe, names in probes.items():
        check = getattr(torch.cpu, f"_is_{probe}_supported", None)
        if check is not None and check():
            found.update(names)
    return frozenset(found)


def supported_cpu_isas() -> tuple:
    """The ISA levels this CPU can run, lowest first (always starts with ``"generic"``)."""
    isa = _isa_table()
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    features = cpu_features()
    return tuple(
        level
        for level in isa.LEVELS
        if (x86 or level not in isa.X86_ONLY) and all(f in features for f in isa.required_features(level))
    )


_isa_cap: Optional[str] = None  # set_cpu_isa_cap's value; None: the environment's, else no cap


def set_cpu_isa_cap(level: Optional[str]) -> Optional[str]:
    """Cap the CPU kernels at ISA ``level`` (``"generic"``, ``"avx2"``, ``"avx512"``, ``"avx512_bf16"``).

    The kernels then use the highest level the CPU supports that is not above
    ``level``; ``None`` restores the default (``$TORCH_BQ_CPU_ISA``, else no cap).
    Takes effect at the next op call. Returns the previous cap.
    """
    global _isa_cap, _selection
    if level is not None:
        _isa_table().op_namespace(level)  # raises ValueError naming the levels
    previous, _isa_cap = _isa_cap, level
    _selection = None
    return previous


def _effective_cap() -> Optional[str]:
    if _isa_cap is not None:
        return _isa_cap
    value = os.environ.get(ISA_ENV, "").strip().lower()
    if not value:
        return None
    if value not in _isa_table().LEVELS:
        raise ValueError(f"${ISA_ENV}: expected one of {', '.join(_isa_table().LEVELS)}, got {value!r}")
    return value


def cpu_isa() -> str:
    """The ISA level the CPU kernels are meant to run at: the CPU's best, capped by :func:`set_cpu_isa_cap`.

    Whether that level's library loaded is :func:`backend_info`'s to say.
    """
    levels = supported_cpu_isas()
    cap = _effective_cap()
    if cap is not None:
        order = _isa_table().LEVELS
        levels = tuple(level for level in levels if order.index(level) <= order.index(cap))
    return levels[-1]


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _installed_library(level: str) -> Optional[Path]:
    """The library setup.py built for ``level`` against the running torch, if it is there."""
    stem = _isa_table().module_name(level, torch.__version__)
    candidates = sorted(INSTALLED_DIR.glob(f"{stem}.*so")) + sorted(INSTALLED_DIR.glob(f"{stem}.*pyd"))
    return candidates[0] if candidates else None


@contextlib.contextmanager
def _exclusive(lock_path: Path, timeout: float):
    """Hold an exclusive ``flock`` on ``lock_path``, waiting at most ``timeout`` seconds.

    Yields whether the lock was taken. The OS drops the lock when its holder
    dies, however it dies, so a killed build can never leave it held.
    """
    try:
        import fcntl
    except ImportError:  # not POSIX: torch's own build lock is all there is
        yield True
        return
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as handle:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    yield False
                    return
                time.sleep(0.1)
        try:
            yield True
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _build_timeout() -> float:
    value = os.environ.get(BUILD_TIMEOUT_ENV, "").strip()
    try:
        return float(value) if value else DEFAULT_BUILD_TIMEOUT
    except ValueError:
        raise ValueError(f"${BUILD_TIMEOUT_ENV}: expected seconds, got {value!r}") from None


def _jit_paths(level: str) -> tuple:
    """``(build directory, torch_bq's lock file)`` of the JIT build of ``level``."""
    from torch.utils import cpp_extension

    name = _isa_table().op_namespace(level)
    tag = f"torch_bq-torch{torch.__version__}-py{sys.version_info.major}{sys.version_info.minor}"
    # torch's own builder reads TORCH_EXTENSIONS_DIR the same way.
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()) / tag
    return root / name, root / f"{name}.lock"


def _jit_build(level: str) -> Path:
    """Build ``level``'s library with torch.utils.cpp_extension (or reuse its cache) and return its path.

    The fallback for source checkouts where setup.py did not build the kernels.
    The build runs under torch_bq's own lock (:func:`_exclusive`): a process
    waits at most ``$TORCH_BQ_BUILD_TIMEOUT`` seconds (default 600) for another
    one's build and then gives up; and since the holder of that lock is the only
    process in the build directory, a ``lock`` file torch's builder left there
    (its builder was killed mid-build) is stale and is removed, instead of
    making every later process wait for it forever.
    """
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler ({compiler!r} is not on PATH)")
    isa = _isa_table()
    name = isa.op_namespace(level)
    build_dir, lock = _jit_paths(level)
    timeout = _build_timeout()
    with _exclusive(lock, timeout) as acquired:
        if not acquired:
            raise TimeoutError(f"another process has been building the {level} kernels for over {timeout:.0f} s")
        build_dir.mkdir(parents=True, exist_ok=True)
        (build_dir / "lock").unlink(missing_ok=True)  # left by a killed build; we hold the only lock
        # A shared library registering TORCH_LIBRARY ops; with Python's headers
        # (optional) it is an extension module as well (_import_entry_module).
        path = cpp_extension.load(
            name=name,
            sources=[str(CPU_KERNEL_SOURCE.parent / source) for source in isa.SOURCES],
            extra_cflags=isa.compile_flags(level),
            extra_ldflags=list(isa.LINK_FLAGS),
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
    return Path(path)


# level -> (the loaded op namespace, where it came from), or the exception loading it raised
_loaded: dict = {}
# id(op namespace) -> that library's Python module (its entry points without torch.ops), or None
_entry_modules: dict = {}


def _import_entry_module(library: Path, level: str):
    """The Python module of a loaded kernel library, or ``None`` where it has none.

    kernels.cpp makes each library an extension module too when Python's headers
    were there at build time, named as the build named the file (the stem before
    the first dot). Importing it opens the same file again, so nothing registers twice.
    """
    import importlib.machinery

    name = library.name.split(".")[0]
    loader = importlib.machinery.ExtensionFileLoader(name, str(library))
    spec = importlib.util.spec_from_file_location(name, library, loader=loader)
    try:
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except ImportError:  # built without Python's headers: no module init in the file
        return None
    if getattr(module, "isa", None) != level:
        raise RuntimeError(f"{library.name}'s Python module holds the {getattr(module, 'isa', None)} kernels, not {level}")
    return module


def entry_module(kernels):
    """The Python module of the kernel library behind ``kernels`` (a ``torch.ops.torch_bq_cpu_<level>``
    namespace), with the entry points ``fp8_linear_op`` / ``fp4_linear_op`` callable without
    ``torch.ops``; ``None`` where the library was built without Python's headers."""
    return _entry_modules.get(id(kernels))


def _load_level(level: str):
    """``torch.ops.torch_bq_cpu_<level>`` and its source ("installed" or "built"); raises if it cannot be had."""
    if level not in _loaded:
        try:
            library = _installed_library(level)
            source = "installed"
            if library is None:
                library, source = _jit_build(level), "built"
            else:
                torch.ops.load_library(str(library))
            ops = getattr(torch.ops, _isa_table().op_namespace(level))
            built_for = ops.isa()
            if built_for != level:
                raise RuntimeError(f"{library.name} holds the {built_for} kernels, not {level}")
            _entry_modules[id(ops)] = _import_entry_module(library, level)
            _loaded[level] = (ops, source)
        except Exception as error:  # any failure to build or load means: not this level
            _loaded[level] = error
    result = _loaded[level]
    if isinstance(result, Exception):
        raise result
    return result


@dataclasses.dataclass(frozen=True)
class CpuSelection:
    """What runs the ``torch_bq::`` ops on CPU tensors (see :func:`backend_info`)."""

    kernels: str  # "fast" or "reference"
    isa: Optional[str]  # ISA level of the fast kernels; None for the reference
    source: Optional[str]  # "installed" (built by setup.py), "built" (JIT, cached), None
    wanted: str  # the level cpu_isa() asked for
    reason: str  # one line: why this choice
    ops: object = dataclasses.field(default=None, repr=False, compare=False)
    # the library's Python module (entry points without torch.ops; see entry_module), or None
    entry_module: object = dataclasses.field(default=None, repr=False, compare=False)


_selection: Optional[CpuSelection] = None


def _select_cpu() -> CpuSelection:
    """Load the best CPU kernels allowed; on failure try the levels below, else the reference."""
    wanted = cpu_isa()
    levels = supported_cpu_isas()
    failures = []
    for level in reversed(levels[: levels.index(wanted) + 1]):
        try:
            ops, source = _load_level(level)
        except Exception as error:
            failures.append(f"{level}: {_first_line(error)}")
            continue
        reason = "the best level this CPU has" if level == levels[-1] else f"capped at {wanted}"
        if failures:
            reason = f"{wanted} unavailable ({failures[0]})"
        return CpuSelection("fast", level, source, wanted, reason, ops, entry_module(ops))
    return CpuSelection("reference", None, None, wanted, failures[0] if failures else "no CPU kernels", None)


def _require_fast() -> bool:
    return os.environ.get(REQUIRE_ENV, "").strip() not in ("", "0")


def cpu_selection() -> CpuSelection:
    """The CPU kernel choice, made (kernels loaded or built) on the first call and after a cap change.

    Says what it chose once, at INFO on the ``torch_bq`` logger; when the fast
    kernels cannot be had it also warns once (one line) and the ops run the
    reference. With ``$TORCH_BQ_REQUIRE_FAST_KERNELS=1`` (CI) anything but the
    level :func:`cpu_isa` asked for raises ``RuntimeError`` instead.
    """
    global _selection
    if _selection is None:
        selection = _select_cpu()
        if _require_fast() and selection.isa != selection.wanted:
            raise RuntimeError(
                f"torch_bq: ${REQUIRE_ENV} is set but the {selection.wanted} CPU kernels are unavailable "
                f"({selection.reason})"
            )
        if selection.kernels == "fast":
            _log.info("torch_bq: CPU ops run the fast kernels at %s (%s library; %s)", selection.isa,
                      selection.source, selection.reason)
        else:
            _log.info("torch_bq: CPU ops run the reference kernels (%s)", selection.reason)
            warnings.warn(
                f"torch_bq: fast CPU kernels unavailable ({selection.reason}); using the reference kernels",
                RuntimeWarning,
                stacklevel=3,
            )
        _selection = selection
    return _selection


def cpu_kernels(level: Optional[str] = None):
    """The compiled CPU kernels (``torch.ops.torch_bq_cpu_<level>``), or ``None`` when the reference runs.

    Without ``level``: those :func:`cpu_selection` chose. With ``level``: that
    level's kernels, or ``None`` if they cannot be loaded or built.
    """
    if level is None:
        return cpu_selection().ops
    try:
        return _load_level(level)[0]
    except Exception:
        return None


# --------------------------------------------------------------------------- #
# the selector's report, and switching fast kernels off
# --------------------------------------------------------------------------- #

# (custom op, device type) of every fast kernel registered through register_fast_kernel
_fast_kernels: list = []
_reported: dict = {}  # device type -> the dict backend_info() shows for it


def register_fast_kernel(op, device_type: str, kernel) -> None:
    """Register ``kernel`` as ``op``'s (a ``torch.library.CustomOpDef``) kernel for ``device_type``.

    Recorded so :func:`fast_kernels_disabled` can switch it off again.
    """
    op.register_kernel(device_type)(kernel)
    _fast_kernels.append((op, device_type))


def report_backend(device_type: str, **info) -> None:
    """Record (and log once, at INFO) which kernels serve ``device_type``; :func:`backend_info` shows it.

    For backends that decide at registration (NKI); the CPU choice reports itself.
    """
    if _reported.get(device_type) != info:
        _reported[device_type] = dict(info)
        _log.info("torch_bq: %s ops: %s", device_type,
                  ", ".join(f"{key}={value}" for key, value in info.items()))


@contextlib.contextmanager
def fast_kernels_disabled(device_type: str = "cpu"):
    """Inside the block, ``torch_bq::`` ops on ``device_type`` run their reference bodies.

    Uses torch.library's own switch (``CustomOpDef.set_kernel_enabled``) on each
    registered fast kernel, so dispatch, not a flag in torch_bq, decides.
    """
    with contextlib.ExitStack() as stack:
        for op, device in _fast_kernels:
            if device == device_type:
                stack.enter_context(op.set_kernel_enabled(device, False))
        yield


def direct_call_allowed(op, device_type: str) -> bool:
    """Whether an eager call of ``op`` (a ``CustomOpDef``) may run its ``device_type`` fast kernel directly.

    Not where the kernel is switched off (:func:`fast_kernels_disabled`,
    ``set_kernel_enabled``: read from torch.library's record of switched-off
    kernels, ``CustomOpDef._disabled_kernel``; without that record, never
    allowed). What else a direct call must not skip (TorchFunctionModes, TorchScript
    traces, functorch transforms, dispatch modes, autograd, tensor subclasses) its
    callers and the compiled entry points refuse themselves
    (torch_bq/ops/cpu/linear.py, ``direct_fp8_linear``); callers check
    ``torch.compiler.is_dynamo_compiling()`` first, so that dynamo never traces one.
    """
    disabled = getattr(op, "_disabled_kernel", None)
    return disabled is not None and device_type not in disabled


def backend_info() -> dict:
    """Which kernels run the ``torch_bq::`` ops, per device type.

    ``"cpu"``: ``kernels`` (``"fast"`` or ``"reference"``), ``isa`` (the level
    running, e.g. ``"avx512_bf16"``), ``source`` (``"installed"``: built by
    setup.py; ``"built"``: JIT-built and cached), ``supported`` (the levels this
    CPU has), ``cap`` and ``reason``. Loads (or builds) the CPU kernels if that
    has not happened yet. Other device types appear once their backend reported.
    """
    selection = cpu_selection()
    info = {
        "cpu": {
            "kernels": selection.kernels,
            "isa": selection.isa,
            "source": selection.source,
            "supported": list(supported_cpu_isas()),
            "cap": _effective_cap(),
            "reason": selection.reason,
        }
    }
    info.update({device: dict(entry) for device, entry in _reported.items()})
    return info
