"""Run-time addressing and control of the NKI stand-in: indirect DMA, virtual registers, dynamic loops.

Modelled on the NKI 0.6 API text (``aws-neuron/aws-neuron-sdk``, ``nki/api/nki/isa`` and
``nki/api/nki/language``), as far as torch_bq's attention, KV-cache and grouped kernels use it:

* ``tensor.ap(pattern=[[stride, P], [1, F], ...], offset=..., vector_offset=idx, indirect_dim=0)``
  on an **HBM** tensor: partition ``p`` addresses row ``idx[p]`` of ``indirect_dim`` (the offset is
  scaled by that dim's stride), the other pattern entries walk the free elements from ``offset``.
  ``dma_copy`` with such a view as ``src`` is a gather, as ``dst`` a scatter. An index outside the
  indexed dim raises (``oob_mode.error``, the default) or skips that partition's transfer
  (``oob_mode.skip``). ``scalar_offset`` is not modelled (``NotImplementedError``).
* ``nisa.register_alloc/move/load/store`` and ``nl.dynamic_range(reg)``: a loop whose trip count is
  read at run time. Its induction variable is a register, so the kernel cannot do Python arithmetic
  with it (the stand-in yields opaque :class:`DynamicIndex` values that refuse arithmetic). Its body
  is one copy in the instruction stream: the instruction count takes the first iteration only (a
  loop that runs no iteration counts nothing, although its body would be in the stream).
* ``nisa.iota`` (int32 pattern generator, GpSimd) and ``nisa.nc_transpose`` (Tensor Engine: SBUF
  ``[<=128, <=128]`` to PSUM; Vector Engine: ``[<=32, <=32]``), both bit-exact.
"""

from __future__ import annotations

from enum import Enum

import numpy as np

from . import _core
from ._core import MemoryRegion, NkiShimError, NkiTensor, cast_on_write, fmt_shape
from .rules import tag


class oob_mode(Enum):  # noqa: N801  (the real module's name)
    """Out-of-bounds handling of an indirect DMA."""

    error = "error"
    skip = "skip"


class dge_mode(Enum):  # noqa: N801
    unknown = "unknown"
    swdge = "swdge"
    hwdge = "hwdge"
    none = "none"


_INDEX_DTYPES = (np.dtype(np.int32), np.dtype(np.uint32))


class AccessPattern:
    """What ``tensor.ap(..., vector_offset=idx)`` returns: a per-partition row-indexed view of HBM."""

    def __init__(self, tensor: NkiTensor, pattern, offset, vector_offset, indirect_dim):
        op = "ap"
        if tensor.on_chip:
            raise NkiShimError(f"{op}: indirect access patterns index an HBM tensor, got on-chip {fmt_shape(tensor)}")
        if not isinstance(vector_offset, NkiTensor) or vector_offset.buffer != MemoryRegion.sbuf:
            raise NkiShimError(f"{op}: vector_offset must be an SBUF tensor of shape (P, 1)")
        if vector_offset.dtype not in _INDEX_DTYPES or vector_offset.size != vector_offset.shape[0]:
            raise NkiShimError(f"{op}: vector_offset must be int32/uint32 (P, 1), got {fmt_shape(vector_offset)}")
        if not 0 <= indirect_dim < tensor.ndim:
            raise NkiShimError(f"{op}: indirect_dim {indirect_dim} out of range for {fmt_shape(tensor)}")
        pattern = [tuple(int(v) for v in pair) for pair in pattern]
        if len(pattern) < 2 or any(len(pair) != 2 or pair[1] < 1 for pair in pattern):
            raise NkiShimError(f"{op}: pattern must be [[stride, count], ...], partition entry first; got {pattern}")
        itemsize = tensor.dtype.itemsize
        row_stride = tensor.arr.strides[indirect_dim] // itemsize
        if pattern[0][1] != vector_offset.shape[0]:
            raise NkiShimError(f"{op}: pattern's partition count {pattern[0][1]} != vector_offset rows "
                               f"{vector_offset.shape[0]}")
        if pattern[0][0] != row_stride:
            raise NkiShimError(f"{op}: pattern's partition stride {pattern[0][0]} must be dim {indirect_dim}'s "
                               f"stride {row_stride} of {fmt_shape(tensor)}")
        self.tensor = tensor
        self.pattern = pattern
        self.offset = 0 if offset is None else int(offset)
        self.index = vector_offset
        self.rows = tensor.shape[indirect_dim]
        self.row_stride = row_stride
        self.dtype = tensor.dtype
        self.partitions = pattern[0][1]
        self.free = int(np.prod([c for _, c in pattern[1:]], dtype=np.int64))
        # Element offsets (from the view's first element) of one partition's free elements.
        free = np.zeros(1, dtype=np.int64)
        for stride, count in pattern[1:]:
            free = (free[:, None] + stride * np.arange(count, dtype=np.int64)[None, :]).reshape(-1)
        self.free_offsets = free + self.offset
        if self.free_offsets.min() < 0:
            raise NkiShimError(f"{op}: pattern {pattern} with offset {offset} starts before {fmt_shape(tensor)}")

    def _flat(self) -> np.ndarray:
        base = self.tensor.storage.typed.reshape(-1)
        start = (self.tensor.arr.ctypes.data - self.tensor.storage.base) // self.dtype.itemsize
        return base, start

    def addresses(self, op: str, mode) -> tuple[np.ndarray, np.ndarray]:
        """``(valid partitions mask [P], element addresses [P, F] into the storage)``."""
        idx = self.index.read(op).reshape(-1).astype(np.int64)
        if self.index.dtype == np.dtype(np.uint32):
            idx = idx & 0xFFFFFFFF
        valid = (idx >= 0) & (idx < self.rows)
        if not valid.all() and mode != oob_mode.skip:
            p = int(np.flatnonzero(~valid)[0])
            raise NkiShimError(f"{tag('isa-indirect-dma')} {op}: index {int(idx[p])} at partition {p} is outside "
                               f"dim of size {self.rows} of "
                               f"{fmt_shape(self.tensor)} (oob_mode.error; pass oob_mode=nisa.oob_mode.skip to skip)")
        _, start = self._flat()
        addr = start + np.where(valid, idx, 0)[:, None] * self.row_stride + self.free_offsets[None, :]
        if addr.size and addr[valid].size and addr[valid].max() >= self.tensor.storage.typed.size:
            raise NkiShimError(f"{op}: access pattern runs past the end of {fmt_shape(self.tensor)}")
        return valid, addr


def make_ap(tensor, pattern, offset=None, scalar_offset=None, vector_offset=None, indirect_dim=0, dtype=None):
    if scalar_offset is not None:
        raise NotImplementedError("the stand-in models vector_offset indirection only")
    if vector_offset is None:
        raise NotImplementedError("the stand-in models .ap() with vector_offset (gather/scatter) only")
    if dtype is not None and np.dtype(dtype) != tensor.dtype:
        raise NotImplementedError("the stand-in does not model dtype reinterpretation in .ap()")
    return AccessPattern(tensor, pattern, offset, vector_offset, indirect_dim)


def indirect_copy(dst, src, mode) -> None:
    """``dma_copy`` where ``src`` (gather) or ``dst`` (scatter) is an :class:`AccessPattern`."""
    op = "dma_copy"
    mode = oob_mode.error if mode is None else mode
    if isinstance(src, AccessPattern) and isinstance(dst, AccessPattern):
        raise NkiShimError(f"{op}: only one side of a DMA can be indirect")
    ap, tile = (src, dst) if isinstance(src, AccessPattern) else (dst, src)
    if not isinstance(tile, NkiTensor) or tile.buffer != MemoryRegion.sbuf:
        raise NkiShimError(f"{op}: the other side of an indirect DMA must be an SBUF tile")
    if tile.dtype != ap.dtype:
        raise NkiShimError(f"[isa-dma-no-cast] {op}: indirect DMA between {ap.dtype.name} and {fmt_shape(tile)}")
    if tile.shape[0] != ap.partitions or tile.size != ap.partitions * ap.free:
        raise NkiShimError(f"{op}: tile {fmt_shape(tile)} does not match the access pattern "
                           f"[{ap.partitions} partitions x {ap.free}]")
    valid, addr = ap.addresses(op, mode)
    flat = ap.tensor.storage.typed.reshape(-1)
    mask = ap.tensor.storage.mask.reshape(-1, ap.dtype.itemsize)
    if ap is src:  # gather: HBM rows -> tile partitions; skipped partitions keep what they held
        if not mask[addr[valid]].all():
            raise NkiShimError(f"{op}: gathers uninitialised memory of {fmt_shape(ap.tensor)}")
        rows = flat[addr]
        for p in np.flatnonzero(valid):
            part = tile[int(p)]
            part.write(op, rows[p].reshape(part.shape))
    else:  # scatter: tile partitions -> HBM rows
        data = tile.read(op).reshape(tile.shape[0], -1)
        flat[addr[valid]] = data[valid]
        mask[addr[valid]] = True


class VirtualRegister:
    """A 32-bit engine register (``nisa.register_alloc``); its value exists only at run time."""

    def __init__(self, value=None):
        self.value = None if value is None else int(value)

    def _get(self, op: str) -> int:
        if self.value is None:
            raise NkiShimError(f"{op}: reads an uninitialised register")
        return self.value

    def __index__(self):
        raise NkiShimError(f"{tag('rt-register')} a VirtualRegister has no compile-time value: use it as a "
                           "dynamic_range bound")

    __int__ = __index__

    def __bool__(self):
        raise NkiShimError(f"{tag('rt-register')} a VirtualRegister in Python control flow: use nl.dynamic_range")


def register_alloc(x=None) -> VirtualRegister:
    if x is not None and not isinstance(x, (int, np.integer)):
        raise NkiShimError(f"register_alloc: initial value must be an int, got {type(x).__name__}")
    return VirtualRegister(x)


def register_move(dst, src) -> None:
    if not isinstance(dst, VirtualRegister):
        raise NkiShimError("register_move: dst must be a VirtualRegister")
    dst.value = src._get("register_move") if isinstance(src, VirtualRegister) else int(src)


def register_load(dst, src) -> None:
    op = "register_load"
    if not isinstance(dst, VirtualRegister):
        raise NkiShimError(f"{op}: dst must be a VirtualRegister")
    if not isinstance(src, NkiTensor) or src.size != 1 or src.dtype.itemsize > 4 or not _core.is_int(src.dtype):
        raise NkiShimError(f"{op}: src must be a one-element integer tensor of <= 32 bits, got {src!r}")
    dst.value = int(src.read(op).reshape(-1)[0])


def register_store(dst, src) -> None:
    op = "register_store"
    if not isinstance(dst, NkiTensor) or dst.size != 1:
        raise NkiShimError(f"{op}: dst must be a one-element tensor")
    dst.write(op, np.full(dst.shape, src._get(op), dtype=dst.dtype))


class DynamicIndex:
    """A dynamic loop's induction variable: a register, so no Python arithmetic or indexing with it."""

    def __index__(self):
        raise NkiShimError(f"{tag('rt-register')} the induction variable of nl.dynamic_range is a register, "
                           "not a Python int")

    __int__ = __index__
    __add__ = __radd__ = __mul__ = __rmul__ = __sub__ = __rsub__ = __floordiv__ = lambda self, other: self.__index__()


def dynamic_range(start, stop=None, step=1):
    """``nl.dynamic_range``: bounds may be registers; the step is a compile-time positive int."""
    if isinstance(step, VirtualRegister) or int(step) < 1:
        raise NkiShimError("dynamic_range: step must be a compile-time positive integer")
    if stop is None:
        start, stop = 0, start
    lo = start._get("dynamic_range") if isinstance(start, VirtualRegister) else int(start)
    hi = stop._get("dynamic_range") if isinstance(stop, VirtualRegister) else int(stop)
    # The body is emitted once, not unrolled (rules.py isa-instruction-budget): every iteration
    # after the first is run but not counted again towards the program's instruction stream.
    prog = _core.current_program()
    before = prog.instructions
    for i in range(lo, hi, int(step)):
        if i != lo:
            prog.instructions = before
        yield DynamicIndex()


def iota(dst, pattern, offset=0, channel_multiplier=0, name=None) -> None:
    """``dst[c, ...] = offset + c * channel_multiplier + sum_i k_i * step_i`` in int32, cast on write."""
    op = "iota"
    if not isinstance(dst, NkiTensor) or dst.buffer != MemoryRegion.sbuf:
        raise NkiShimError(f"{op}: dst must be an SBUF tile")
    pattern = [tuple(int(v) for v in pair) for pair in pattern]
    if not 1 <= len(pattern) <= 4:
        raise NkiShimError(f"{op}: pattern has 1 to 4 [step, num] entries, got {pattern}")
    values = np.zeros(1, dtype=np.int64)
    for step, num in pattern:
        values = (values[:, None] + step * np.arange(num, dtype=np.int64)[None, :]).reshape(-1)
    per_partition = dst.size // dst.shape[0]
    if values.size != per_partition:
        raise NkiShimError(f"{op}: pattern gives {values.size} elements per partition, dst {fmt_shape(dst)} has "
                           f"{per_partition}")
    channels = np.arange(dst.shape[0], dtype=np.int64)[:, None] * int(channel_multiplier)
    result = (int(offset) + channels + values[None, :]).astype(np.int32)
    dst.write(op, cast_on_write(result, dst.dtype).reshape(dst.shape))


def nc_transpose(dst, data, engine=None, name=None) -> None:
    """Partition <-> free transpose (free axes flattened), bit-exact; dst has data's dtype."""
    op = "nc_transpose"
    from .isa import engine as engines

    for what, t in (("dst", dst), ("data", data)):
        if not isinstance(t, NkiTensor) or not t.on_chip:
            raise NkiShimError(f"{op}: {what} must be an on-chip tile")
    if dst.dtype != data.dtype:
        raise NkiShimError(f"{op}: dst {fmt_shape(dst)} must have data's dtype {data.dtype.name}")
    p, f = data.shape[0], data.size // data.shape[0]
    limit = 32 if engine == engines.vector else _core.PMAX
    if p > limit or f > limit:
        raise NkiShimError(f"{op}: {fmt_shape(data)} exceeds [{limit}, {limit}] for this engine")
    if engine != engines.vector and (data.buffer != MemoryRegion.sbuf or dst.buffer != MemoryRegion.psum):
        raise NkiShimError(f"{op}: the Tensor Engine transpose reads SBUF and writes PSUM")
    if dst.shape[0] != f or dst.size != p * f:
        raise NkiShimError(f"{op}: dst {fmt_shape(dst)} is not the [{f}, {p}] transpose of {fmt_shape(data)}")
    dst.write(op, data.read(op).reshape(p, f).T.reshape(dst.shape))
