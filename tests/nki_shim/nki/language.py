"""Stand-in for ``nki.language``: dtypes, buffers, tile sizes, ALU/activation ops, allocation, SPMD ids.

Only what torch_bq's kernels use is implemented; anything else raises
``AttributeError`` so a kernel cannot silently depend on an unchecked API.
"""

from __future__ import annotations

import numpy as np

from . import _core
from ._core import MemoryRegion, NkiTensor  # noqa: F401  (re-exported like the real module)

# --- dtypes ------------------------------------------------------------------
int8 = np.dtype(np.int8)
int16 = np.dtype(np.int16)
int32 = np.dtype(np.int32)
uint8 = np.dtype(np.uint8)
uint16 = np.dtype(np.uint16)
uint32 = np.dtype(np.uint32)
float16 = np.dtype(np.float16)
float32 = np.dtype(np.float32)
bfloat16 = _core.bfloat16
float8_e4m3 = _core.float8_e4m3  # Trainium2's e4m3: max 240, saturating
float8_e4m3fn = _core.float8_e4m3fn  # OCP e4m3fn: max 448 (NeuronCore-v4 matmul only)
float8_e5m2 = _core.float8_e5m2

# --- memory regions ------------------------------------------------------------
sbuf = MemoryRegion.sbuf
psum = MemoryRegion.psum
private_hbm = MemoryRegion.private_hbm
hbm = MemoryRegion.private_hbm
shared_hbm = MemoryRegion.shared_hbm


class _TileSize:
    pmax = _core.PMAX
    psum_bank_fmax = _core.PSUM_BANK_BYTES // 4
    psum_fmax = psum_bank_fmax
    psum_bank_fmax_bytes = _core.PSUM_BANK_BYTES
    gemm_stationary_fmax = _core.GEMM_STATIONARY_FMAX
    gemm_moving_fmax = _core.GEMM_MOVING_FMAX
    psum_num_banks = _core.PSUM_BANKS

    @property
    def sbuf_fmax_bytes(self):
        return _core.SBUF_BYTES[_core.target()]


tile_size = _TileSize()


# --- operators -----------------------------------------------------------------


class _Op:
    """An ALU or activation operator: ``kind`` is "arith", "bitvec" or "unary"."""

    def __init__(self, name: str, kind: str, fn):
        self.name = name
        self.kind = kind
        self.fn = fn

    def __repr__(self) -> str:
        return f"nl.{self.name}"


def _logical_right_shift(a, b):
    # Shifts see bit patterns: shift the unsigned view of the same width.
    a = np.asarray(a)
    unsigned = np.dtype(f"u{a.dtype.itemsize}") if a.dtype.kind == "i" else a.dtype
    return (a.astype(unsigned) >> np.asarray(b).astype(unsigned)).astype(a.dtype)


add = _Op("add", "arith", np.add)
subtract = _Op("subtract", "arith", np.subtract)
multiply = _Op("multiply", "arith", np.multiply)
maximum = _Op("maximum", "arith", np.maximum)
minimum = _Op("minimum", "arith", np.minimum)
equal = _Op("equal", "arith", lambda a, b: (a == b).astype(np.float32))
not_equal = _Op("not_equal", "arith", lambda a, b: (a != b).astype(np.float32))
bitwise_and = _Op("bitwise_and", "bitvec", np.bitwise_and)
bitwise_or = _Op("bitwise_or", "bitvec", np.bitwise_or)
bitwise_xor = _Op("bitwise_xor", "bitvec", np.bitwise_xor)
left_shift = _Op("left_shift", "bitvec", lambda a, b: np.left_shift(a, np.asarray(b).astype(a.dtype)))
right_shift = _Op("right_shift", "bitvec", _logical_right_shift)
greater_equal = _Op("greater_equal", "arith", lambda a, b: (a >= b).astype(np.float32))
less = _Op("less", "arith", lambda a, b: (a < b).astype(np.float32))
divide = _Op("divide", "arith", np.divide)
exp = _Op("exp", "unary", np.exp)  # the Scalar Engine's exp; the stand-in computes it in fp32 with NumPy
abs = _Op("abs", "unary", np.abs)  # noqa: A001  (the real module shadows the builtin too)
copy = _Op("copy", "unary", lambda a: a)


# --- allocation and SPMD ----------------------------------------------------------


def ndarray(shape, dtype, buffer=sbuf, name: str = "", address=None) -> NkiTensor:
    """A fresh tensor; on-chip ones are charged to the program's SBUF/PSUM budget."""
    if address is not None:
        raise NotImplementedError("the stand-in does not model manual addresses")
    return _core.allocate(shape, dtype, buffer, name)


def zeros(shape, dtype, buffer=sbuf, name: str = "") -> NkiTensor:
    t = _core.allocate(shape, dtype, buffer, name)
    t.write("zeros", np.zeros(t.shape, dtype=t.dtype))
    return t


def program_id(axis: int = 0) -> int:
    if axis != 0:
        raise _core.NkiShimError(f"program_id: only axis 0 (the LNC core) is modelled, got axis {axis}")
    return _core.current_program().pid


def num_programs(axes: int = 0) -> int:
    return _core.current_program().launch.nprog


def affine_range(start, stop=None, step=1):
    return range(start, stop, step) if stop is not None else range(start)


static_range = affine_range
sequential_range = affine_range


from ._dynamic import dynamic_range  # noqa: E402,F401  (a loop with run-time bounds; see _dynamic)
