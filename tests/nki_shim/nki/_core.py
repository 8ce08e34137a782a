"""Storage, tensor views, launches and casts of the NKI stand-in.

Every on-chip or HBM buffer is a :class:`Storage`: raw bytes plus a per-byte
"written" mask, so that reading memory nobody wrote raises instead of silently
using garbage (fresh float buffers are also NaN-filled, as the issue asks).
:class:`NkiTensor` is a NumPy view into a storage; all view operations
(slicing, ``.view(dtype)``, ``.reshape``, ``.broadcast``) are NumPy views of the
same bytes, and the written mask of any view is derived from its byte offset
and strides, so reinterpretation and strided views stay consistent.

Budgets are tracked per program instance of a launch: live SBUF bytes per
partition (<= ``SBUF_BYTES[target]``) and live PSUM banks (<= 8 of 2 KiB), and the
ISA instructions issued (<= the kernel's instruction budget).
A buffer stops being live when the last view of it is garbage-collected, which
in CPython is the moment a loop rebinds the name holding it.
"""

from __future__ import annotations

import os
import weakref
from enum import Enum

import ml_dtypes
import numpy as np
from numpy.lib.stride_tricks import as_strided

PMAX = 128
PSUM_BANK_BYTES = 2048
PSUM_BANKS = 8
# SBUF per partition by target (rules.py hw-sbuf): Trn1 24 MiB, Trn2 28 MiB, Trn3 32 MiB over 128 partitions.
SBUF_BYTES = {"trn1": 192 * 1024, "trn2": 224 * 1024, "trn3": 256 * 1024}
_TARGET_NAMES = {"trn1": "trn1", "gen2": "trn1", "trn2": "trn2", "gen3": "trn2", "trn3": "trn3", "gen4": "trn3"}
DEFAULT_TARGET = "trn2"  # the kernels are written for Trainium2

# ISA instructions one program may issue (rules.py isa-instruction-budget). Tests set it from
# torch_bq's own budget (torch_bq/ops/nki/launch.py INSTRUCTION_BUDGET); per kernel in instruction_budgets.
DEFAULT_INSTRUCTION_BUDGET = 100_000
instruction_budgets: dict = {}

# rules.py hw-denormal-flush: when True, engines flush denormal inputs and results to zero.
FLUSH_DENORMALS = os.environ.get("NKI_STAND_IN_FLUSH_DENORMALS", "") == "1"


def target() -> str:
    """The NeuronCore generation modelled: NEURON_PLATFORM_TARGET_OVERRIDE as nki.simulate reads it, else trn2."""
    value = os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE", "").strip().lower()
    if not value:
        return DEFAULT_TARGET
    if value not in _TARGET_NAMES:
        raise NkiShimError(f"NEURON_PLATFORM_TARGET_OVERRIDE={value!r}: expected one of {sorted(_TARGET_NAMES)}")
    return _TARGET_NAMES[value]
GEMM_STATIONARY_FMAX = 128
GEMM_MOVING_FMAX = 512

FP8_E4M3_MAX = 240.0  # Trainium2's native e4m3 (IEEE-like, bias 7), saturating
FP8_E4M3FN_MAX = 448.0


class NkiShimError(Exception):
    """A kernel broke a documented NKI limit (or read memory nobody wrote)."""


class MemoryRegion(Enum):
    sbuf = "sbuf"
    psum = "psum"
    private_hbm = "private_hbm"
    shared_hbm = "shared_hbm"


ON_CHIP = (MemoryRegion.sbuf, MemoryRegion.psum)

# dtypes are NumPy dtypes; ml_dtypes supplies the narrow floats.
bfloat16 = np.dtype(ml_dtypes.bfloat16)
float8_e4m3 = np.dtype(ml_dtypes.float8_e4m3)
float8_e4m3fn = np.dtype(ml_dtypes.float8_e4m3fn)
float8_e5m2 = np.dtype(ml_dtypes.float8_e5m2)
FLOAT_DTYPES = {np.dtype(np.float32), np.dtype(np.float16), bfloat16, float8_e4m3, float8_e4m3fn, float8_e5m2}
INT_DTYPES = {np.dtype(t) for t in (np.int8, np.int16, np.int32, np.uint8, np.uint16, np.uint32)}


def is_int(dtype) -> bool:
    return np.dtype(dtype) in INT_DTYPES


def fmt_shape(t) -> str:
    return f"{getattr(t, 'name', '') or 'tensor'}{list(t.shape)} {np.dtype(t.dtype).name}"


# --------------------------------------------------------------------------- #
# launches (one per kernel call; LNC2 runs two program instances in sequence)
# --------------------------------------------------------------------------- #


class _Program:
    """Per-program-instance state: the core's id, its on-chip budgets and its instruction count."""

    def __init__(self, launch: "Launch", pid: int):
        self.launch = launch
        self.pid = pid
        self.sbuf_live = 0
        self.sbuf_peak = 0
        self.psum_banks_live = 0
        self.shared_ordinal = 0
        self.instructions = 0

    def issue(self, op: str) -> None:
        """Count one ISA instruction; refuse the one past the budget."""
        self.instructions += 1
        self.launch.instructions_by_op[op] = self.launch.instructions_by_op.get(op, 0) + 1
        self.launch.instructions = max(self.launch.instructions, self.instructions)
        if self.instructions > self.launch.instruction_budget:
            from .rules import tag

            raise NkiShimError(
                f"{tag('isa-instruction-budget')} {self.launch.kernel_name}: program {self.pid} issues more than "
                f"{self.launch.instruction_budget} ISA instructions (every loop is unrolled); split the work"
            )


class Launch:
    """A kernel call: ``nprog`` program instances sharing ``shared_hbm`` allocations."""

    current: "_Program | None" = None

    def __init__(self, nprog: int, kernel_name: str = "kernel"):
        self.nprog = nprog
        self.kernel_name = kernel_name
        self.shared: list[Storage] = []
        self.sbuf_peak = 0
        self.target = target()
        self.sbuf_budget = SBUF_BYTES[self.target]
        self.instruction_budget = instruction_budgets.get(kernel_name, DEFAULT_INSTRUCTION_BUDGET)
        self.instructions = 0  # the most any one program issued
        self.instructions_by_op: dict = {}  # summed over programs


def current_program() -> _Program:
    if Launch.current is None:
        raise NkiShimError("NKI call outside a kernel launch (use nki.simulate(kernel)(...))")
    return Launch.current


# --------------------------------------------------------------------------- #
# storage and tensors
# --------------------------------------------------------------------------- #


class Storage:
    """Raw bytes of one allocation, with a per-byte written mask."""

    def __init__(self, shape, dtype, buffer: MemoryRegion, name: str, data: np.ndarray | None = None):
        self.dtype = np.dtype(dtype)
        self.buffer = buffer
        self.name = name
        self.shape = tuple(int(s) for s in shape)
        nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        self.raw = np.empty(nbytes, dtype=np.uint8)
        self.mask = np.zeros(nbytes, dtype=bool)
        typed = self.raw.view(self.dtype).reshape(self.shape)
        if data is not None:
            typed[...] = data
            self.mask[:] = True
        elif self.dtype in FLOAT_DTYPES:
            typed[...] = np.nan  # reading before writing shows up as NaN too
        else:
            self.raw[:] = 0xA5
        self.matmul_written = np.zeros(nbytes, dtype=bool) if buffer == MemoryRegion.psum else None
        self.typed = typed

    @property
    def base(self) -> int:
        return self.raw.ctypes.data


def _account(storage: Storage) -> None:
    """Charge an on-chip allocation to the current program's budget; refund on collection."""
    if storage.buffer not in ON_CHIP:
        return
    prog = current_program()
    per_partition = int(np.prod(storage.shape[1:], dtype=np.int64)) * storage.dtype.itemsize
    if storage.buffer == MemoryRegion.sbuf:
        limit = prog.launch.sbuf_budget
        if prog.sbuf_live + per_partition > limit:
            raise NkiShimError(
                f"[hw-sbuf] ndarray: SBUF budget exceeded allocating {storage.name}{list(storage.shape)} "
                f"{storage.dtype.name} ({per_partition} B/partition) with {prog.sbuf_live} B/partition live; "
                f"limit {limit} B/partition on {prog.launch.target}"
            )
        prog.sbuf_live += per_partition
        prog.sbuf_peak = max(prog.sbuf_peak, prog.sbuf_live)
        prog.launch.sbuf_peak = max(prog.launch.sbuf_peak, prog.sbuf_peak)

        def refund(p=prog, n=per_partition):
            p.sbuf_live -= n

    else:
        banks = -(-per_partition // PSUM_BANK_BYTES)
        if prog.psum_banks_live + banks > PSUM_BANKS:
            raise NkiShimError(
                f"ndarray: PSUM exhausted allocating {storage.name}{list(storage.shape)} {storage.dtype.name} "
                f"({banks} bank(s) of {PSUM_BANK_BYTES} B) with {prog.psum_banks_live} of {PSUM_BANKS} banks live"
            )
        prog.psum_banks_live += banks

        def refund(p=prog, n=banks):
            p.psum_banks_live -= n

    weakref.finalize(storage, refund)


def allocate(shape, dtype, buffer, name: str = "") -> "NkiTensor":
    """``nl.ndarray``: a fresh (NaN-filled, unwritten) tensor on ``buffer``."""
    buffer = MemoryRegion(buffer.value if isinstance(buffer, MemoryRegion) else buffer)
    shape = tuple(int(s) for s in shape)
    if any(s <= 0 for s in shape):
        raise NkiShimError(f"ndarray: shape must be positive, got {list(shape)} for {name or 'tensor'}")
    if buffer in ON_CHIP and shape[0] > PMAX:
        raise NkiShimError(
            f"ndarray: partition dim {shape[0]} > {PMAX} for on-chip tensor {name or 'tensor'}{list(shape)}"
        )
    prog = current_program()
    if buffer == MemoryRegion.shared_hbm:
        # Every program of an LNC launch runs the same code; the k-th shared_hbm
        # allocation is one tensor visible to all of them.
        shared = prog.launch.shared
        k = prog.shared_ordinal
        prog.shared_ordinal += 1
        if k < len(shared):
            st = shared[k]
            if st.shape != shape or st.dtype != np.dtype(dtype):
                raise NkiShimError(
                    f"ndarray: program {prog.pid} allocated shared_hbm #{k} as {list(shape)} {np.dtype(dtype).name}, "
                    f"program 0 as {list(st.shape)} {st.dtype.name}"
                )
            return NkiTensor(st, st.typed)
        st = Storage(shape, dtype, buffer, name or f"shared{k}")
        shared.append(st)
        return NkiTensor(st, st.typed)
    st = Storage(shape, dtype, buffer, name or buffer.value)
    _account(st)
    return NkiTensor(st, st.typed)


def wrap_input(array: np.ndarray, name: str) -> "NkiTensor":
    """A kernel argument: an initialised ``shared_hbm`` tensor holding a copy of ``array``."""
    st = Storage(array.shape, array.dtype, MemoryRegion.shared_hbm, name, data=array)
    return NkiTensor(st, st.typed)


class NkiTensor:
    """A view of a :class:`Storage` (the stand-in's ``nl.NkiTensor``)."""

    def __init__(self, storage: Storage, arr: np.ndarray):
        self.storage = storage
        self.arr = arr

    # --- metadata ---------------------------------------------------------
    @property
    def shape(self):
        return tuple(self.arr.shape)

    @property
    def dtype(self):
        return self.arr.dtype

    @property
    def buffer(self) -> MemoryRegion:
        return self.storage.buffer

    @property
    def name(self) -> str:
        return self.storage.name

    @property
    def ndim(self) -> int:
        return self.arr.ndim

    @property
    def size(self) -> int:
        return int(self.arr.size)

    @property
    def on_chip(self) -> bool:
        return self.storage.buffer in ON_CHIP

    def __repr__(self) -> str:
        return f"NkiTensor({fmt_shape(self)}, {self.buffer.value})"

    # --- views ------------------------------------------------------------
    def _derive(self, arr: np.ndarray, what: str) -> "NkiTensor":
        if not np.shares_memory(arr, self.storage.raw) and arr.size:
            raise NkiShimError(f"{what}: layout of {fmt_shape(self)} does not allow this view without a copy")
        return NkiTensor(self.storage, arr)

    def __getitem__(self, key) -> "NkiTensor":
        if not isinstance(key, tuple):
            key = (key,)
        if self.on_chip and key and isinstance(key[0], (int, np.integer)):
            # On-chip tensors keep the partition dim: an integer selects a size-1 slice.
            i = int(key[0])
            key = (slice(i, i + 1),) + key[1:]
        if Ellipsis not in key:
            for d, k in enumerate(key):
                if isinstance(k, slice) and (k.step or 1) <= 0:
                    raise NkiShimError(f"slice: step must be positive on {fmt_shape(self)}")
                if isinstance(k, slice) and k.stop is not None and k.stop > self.arr.shape[d]:
                    raise NkiShimError(f"slice: {k} out of bounds on dim {d} of {fmt_shape(self)}")
                if isinstance(k, (int, np.integer)) and not -self.arr.shape[d] <= int(k) < self.arr.shape[d]:
                    raise NkiShimError(f"index: {int(k)} out of bounds on dim {d} of {fmt_shape(self)}")
        arr = self.arr[key]
        if arr.size == 0:
            raise NkiShimError(f"slice: empty view {key} of {fmt_shape(self)}")
        return self._derive(arr, "getitem")

    def view(self, dtype) -> "NkiTensor":
        """Reinterpret the bytes; the last dim scales by the itemsize ratio (must be contiguous)."""
        dtype = np.dtype(dtype)
        if self.arr.strides[-1] != self.arr.dtype.itemsize and self.arr.shape[-1] != 1:
            raise NkiShimError(f"view: last dim of {fmt_shape(self)} is not contiguous")
        if (self.arr.shape[-1] * self.arr.dtype.itemsize) % dtype.itemsize:
            raise NkiShimError(f"view: last dim of {fmt_shape(self)} does not divide into {dtype.name}")
        return self._derive(self.arr.view(dtype), "view")

    reinterpret_cast = view

    def ap(self, pattern, offset=None, scalar_offset=None, vector_offset=None, indirect_dim=0, dtype=None):
        """Explicit access pattern; the stand-in models the indirect (gather/scatter) form only (see _dynamic)."""
        from ._dynamic import make_ap

        return make_ap(self, pattern, offset, scalar_offset, vector_offset, indirect_dim, dtype)

    def reshape(self, shape) -> "NkiTensor":
        shape = tuple(int(s) for s in shape)
        if self.on_chip and shape[0] != self.arr.shape[0]:
            raise NkiShimError(f"reshape: partition dim of on-chip {fmt_shape(self)} cannot become {shape[0]}")
        arr = self.arr.reshape(shape)
        if not np.shares_memory(arr, self.storage.raw):
            raise NkiShimError(f"reshape: {fmt_shape(self)} -> {list(shape)} needs a copy (non-contiguous)")
        return NkiTensor(self.storage, arr)

    def expand_dim(self, dim: int) -> "NkiTensor":
        if self.on_chip and dim == 0:
            raise NkiShimError(f"expand_dim: cannot insert before the partition dim of {fmt_shape(self)}")
        return NkiTensor(self.storage, np.expand_dims(self.arr, dim))

    def broadcast(self, dim: int, size: int) -> "NkiTensor":
        """Repeat a size-1 dim ``size`` times (stride 0; no copy)."""
        if self.arr.shape[dim] != 1:
            raise NkiShimError(f"broadcast: dim {dim} of {fmt_shape(self)} is not 1")
        if self.on_chip and dim == 0:
            raise NkiShimError(f"broadcast: cannot broadcast the partition dim of on-chip {fmt_shape(self)}")
        shape = list(self.arr.shape)
        strides = list(self.arr.strides)
        shape[dim] = int(size)
        strides[dim] = 0
        return NkiTensor(self.storage, as_strided(self.arr, shape=shape, strides=strides))

    def start_partition(self) -> int:
        """The first partition an on-chip view touches (its byte offset over the storage's partition stride)."""
        stride = int(np.prod(self.storage.shape[1:], dtype=np.int64)) * self.storage.dtype.itemsize
        return int(self.arr.ctypes.data - self.storage.base) // max(stride, 1)

    # --- the written mask -------------------------------------------------
    def _mask(self, which: str = "mask") -> np.ndarray:
        base = getattr(self.storage, which)
        offset = self.arr.ctypes.data - self.storage.base
        itemsize = self.arr.dtype.itemsize
        return as_strided(base[offset:], shape=self.arr.shape + (itemsize,), strides=self.arr.strides + (1,))

    def read(self, op: str) -> np.ndarray:
        """The values, after checking every byte was written."""
        if not self._mask().all():
            raise NkiShimError(f"{op}: reads uninitialised memory of {fmt_shape(self)} ({self.buffer.value})")
        return self.arr

    def write(self, op: str, values: np.ndarray, *, from_matmul: bool = False) -> None:
        if 0 in self.arr.strides[1:] or (self.arr.ndim and self.arr.strides[0] == 0 and self.arr.shape[0] > 1):
            raise NkiShimError(f"{op}: cannot write through a broadcast view {fmt_shape(self)}")
        self.arr[...] = values
        self._mask()[...] = True
        if self.storage.matmul_written is not None:
            self._mask("matmul_written")[...] = from_matmul

    def matmul_initialised(self) -> bool:
        return bool(self._mask("matmul_written").all()) if self.storage.matmul_written is not None else False


# --------------------------------------------------------------------------- #
# numerics: fp32 compute, cast on write
# --------------------------------------------------------------------------- #


_SMALLEST_NORMAL = {np.dtype(np.float32): 2.0**-126, bfloat16: 2.0**-126, np.dtype(np.float16): 2.0**-14}


def flush(values: np.ndarray, dtype) -> np.ndarray:
    """Denormals of ``dtype`` in ``values`` become signed zeros (only in the flush mode)."""
    tiny = _SMALLEST_NORMAL.get(np.dtype(dtype))
    if not FLUSH_DENORMALS or tiny is None:
        return values
    values = np.array(values, dtype=np.float32, copy=True)
    small = (values != 0) & (np.abs(values) < tiny)
    values[small] = np.copysign(0.0, values[small])
    return values


def to_f32(arr: np.ndarray) -> np.ndarray:
    """What an engine computes with: every input converted to float32 (denormals kept unless flushing)."""
    out = arr.astype(np.float32)
    if FLUSH_DENORMALS and arr.dtype in _SMALLEST_NORMAL:
        out = flush(out, arr.dtype)
    return out


def cast_on_write(values: np.ndarray, dtype) -> np.ndarray:
    """Convert float32 results to ``dtype`` the way the engines do (RNE; fp8 and ints saturate)."""
    dtype = np.dtype(dtype)
    values = np.asarray(values)
    if dtype in FLOAT_DTYPES:
        values = values.astype(np.float32)
        if FLUSH_DENORMALS and dtype in _SMALLEST_NORMAL:
            return flush(values.astype(dtype).astype(np.float32), dtype).astype(dtype)
        if dtype == float8_e4m3:
            values = np.clip(values, -FP8_E4M3_MAX, FP8_E4M3_MAX)  # NaN passes through clip
        elif dtype == float8_e4m3fn:
            values = np.clip(values, -FP8_E4M3FN_MAX, FP8_E4M3FN_MAX)
        return values.astype(dtype)
    if np.issubdtype(values.dtype, np.floating):
        if np.isnan(values).any():
            raise NkiShimError(f"cast: NaN written to integer dtype {dtype.name}")
        info = np.iinfo(dtype)
        return np.clip(np.rint(values.astype(np.float64)), info.min, info.max).astype(dtype)
    return values.astype(dtype)  # integer -> integer: keep the low bits
