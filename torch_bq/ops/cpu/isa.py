"""The instruction-set levels the CPU kernels are built for: one table.

``kernels.cpp`` is compiled once per level, each time with that level's
compiler flags, into its own library registering its own op namespace
(``torch.ops.torch_bq_cpu_<level>``), so one process can load several (the
tests run every level the CPU has). Which one runs is chosen at load time
from the CPU's own feature flags (:mod:`torch_bq.ops._backend`).

This module imports nothing: ``setup.py`` reads it to build the same levels at
install time that the JIT fallback builds at run time.
"""

from __future__ import annotations

# The C++ sources of one level's library, in this directory: kernels.cpp defines
# the op library, the others add fragments to it (TORCH_BQ_LIBRARY_FRAGMENT).
SOURCES = ("kernels.cpp", "attention.cpp", "nvfp4.cpp")

# Lowest first. A level needs every CPU feature of the levels below it.
LEVELS = ("generic", "avx2", "avx512", "avx512_bf16")

# CPU features (Linux /proc/cpuinfo names) each level adds to the one below.
_ADDED_FEATURES = {
    "generic": (),
    "avx2": ("avx2", "fma", "f16c"),
    # F/BW/VL/DQ: every AVX-512 CPU with BW and VL (Skylake-X on, Zen 4 on) has DQ too.
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    # vdpbf16ps (bf16 dot products), vpdpbusd (int8 dot products) and vpermi2b (the
    # fp8 decoder's byte table lookup): Sapphire Rapids and Zen 4 on (Cooper Lake
    # has no VBMI and runs the avx512 level).
    "avx512_bf16": ("avx512_bf16", "avx512_vnni", "avx512vbmi"),
}

# Compiler flags each level adds to the one below (GCC and Clang spellings agree).
_ADDED_FLAGS = {
    "generic": (),
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"),
    "avx512_bf16": ("-mavx512bf16", "-mavx512vnni", "-mavx512vbmi"),
}

# Flags of every level. Inline functions stay private to each library, so two
# levels loaded into one process never share a copy compiled for the other.
# -fno-wrapv: setup.py's build puts Python's own CFLAGS first, and those carry
# -fwrapv; with it GCC may not fold offsets into addresses, and the fp8 5-row
# decode tile ran out of registers (its loop counter on the stack): 1.1-1.25x
# the time per call of the same source built without it (Zen 5, 2026-12-02).
COMMON_FLAGS = ("-O3", "-fno-wrapv", "-fopenmp", "-fvisibility-inlines-hidden")
LINK_FLAGS = ("-fopenmp",)

# Levels that only x86-64 compilers accept.
X86_ONLY = frozenset(LEVELS[1:])


def _cumulative(table: dict, level: str) -> tuple:
    if level not in LEVELS:
        raise ValueError(f"CPU ISA level: expected one of {', '.join(LEVELS)}, got {level!r}")
    out: list = []
    for name in LEVELS[: LEVELS.index(level) + 1]:
        out.extend(table[name])
    return tuple(out)


def required_features(level: str) -> tuple:
    """The CPU features (``/proc/cpuinfo`` names) ``level`` needs."""
    return _cumulative(_ADDED_FEATURES, level)


def compile_flags(level: str) -> list:
    """The C++ compiler flags that build ``kernels.cpp`` for ``level``."""
    return list(COMMON_FLAGS) + list(_cumulative(_ADDED_FLAGS, level))


def module_name(level: str, torch_version: str) -> str:
    """File stem of the library setup.py builds for ``level`` against ``torch_version``.

    The torch release is part of the name (``_kernels_avx2_torch2_13_0``): a C++
    extension only loads into the torch it was compiled against, so a library
    built for another one is never picked up.
    """
    _cumulative(_ADDED_FLAGS, level)
    release = torch_version.split("+")[0].replace(".", "_")
    return f"_kernels_{level}_torch{release}"


def op_namespace(level: str) -> str:
    """The ``torch.ops`` namespace the library of ``level`` registers (must match kernels.cpp)."""
    _cumulative(_ADDED_FLAGS, level)
    return f"torch_bq_cpu_{level}"
