"""One ``.safetensors`` file: its header parsed and checked, its tensors read into memory this process owns.

Why not ``safetensors.safe_open`` for the data: it maps the file, so a loaded
tensor shares pages with the file on disk. Editing the file in place then
changes a running model's weights, and truncating it turns the next forward
into a SIGBUS. Here every tensor (or slice of one) is read with ``preadv``
into a fresh ``torch.empty`` buffer: the module owns its bytes, and the page
cache is not counted twice in the loader's peak memory.

The header rules are safetensors' own (https://github.com/huggingface/safetensors,
"Format"): 8 bytes little-endian header length, a JSON object of
``name -> {"dtype", "shape", "data_offsets": [begin, end]}`` plus an optional
``"__metadata__"`` of strings, then the data, with the tensors' byte ranges
covering it exactly, in order, without gaps or overlaps. Everything is checked
before any data is read, so a truncated, padded or lying file is a
:class:`~torch_bq.checkpoint.CheckpointError` naming the file and the entry.

Only regular files are opened (a FIFO named ``*.safetensors`` would block a
reader forever): the file is opened non-blocking and checked with ``fstat`` on
the descriptor that is then used for every read.
"""

from __future__ import annotations

import json
import math
import os
import stat
import sys
import threading
from pathlib import Path
from typing import Optional, Sequence, Union

import torch

from .errors import CheckpointError, NotARegularFileError

__all__ = ["SafetensorsFile", "ST_DTYPES", "ST_BITS", "MAX_HEADER_BYTES", "open_regular"]

#: safetensors refuses headers above 100 MB; so do we (a hostile length would otherwise be read)
MAX_HEADER_BYTES = 100_000_000

#: safetensors dtype strings -> torch dtypes (``F4`` is torch's packed pair type)
ST_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
    "F4": torch.float4_e2m1fn_x2,
}

#: bits per element of every dtype string the header may carry (some have no torch dtype)
ST_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32, "C64": 64,
    "I64": 64, "U64": 64, "F64": 64,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}

_PREADV = hasattr(os, "preadv")


def open_regular(path: Union[str, os.PathLike], what: str = "file") -> int:
    """An ``O_RDONLY`` descriptor of ``path``, refusing anything but a regular file without blocking."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        st = os.stat(path)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read this {what} ({e.strerror or e})") from e
    if not stat.S_ISREG(st.st_mode):
        raise NotARegularFileError(f"{path}: expected a regular {what}, found {_kind(st.st_mode)}; it was not opened")
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot open this {what} ({e.strerror or e})") from e
    # The path could have been swapped between stat and open: check what was opened.
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise NotARegularFileError(f"{path}: expected a regular {what}, it changed into something else while opening")
    return fd


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "a non-regular file"


class SafetensorsFile:
    """A parsed ``.safetensors`` file: header on construction, data on request.

    Attributes:
        path: the file.
        metadata: the header's ``__metadata__`` (``str -> str``), ``{}`` when absent.
        entries: ``name -> (dtype string, shape, begin, end)``; offsets relative to the data start.
    """

    def __init__(self, path: Union[str, os.PathLike]) -> None:
        self.path = Path(path)
        self._fd: Optional[int] = open_regular(path, "safetensors file")
        self._lock = threading.Lock()
        try:
            self._parse()
        except BaseException:
            self.close()
            raise

    # -- header ----------------------------------------------------------------

    def _error(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: not a valid safetensors file: {what}")

    def _parse(self) -> None:
        size = os.fstat(self._fd).st_size
        if size < 8:
            raise self._error(f"{size} bytes, shorter than the 8-byte header length")
        n = int.from_bytes(self._pread(8, 0), "little")
        if n > MAX_HEADER_BYTES:
            raise self._error(f"header length {n} exceeds {MAX_HEADER_BYTES} bytes")
        if 8 + n > size:
            raise self._error(f"header length {n} runs past the end of the {size}-byte file (truncated?)")
        raw = self._pread(n, 8)
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise self._error(f"header is not UTF-8 JSON ({e})") from None
        if not isinstance(header, dict):
            raise self._error(f"header is a JSON {type(header).__name__}, expected an object")
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
            raise self._error("__metadata__ must map strings to strings")
        self.metadata: dict[str, str] = meta
        self._data_start = 8 + n
        data_len = size - self._data_start
        entries = {}
        for name, info in header.items():
            if not isinstance(info, dict) or set(info) - {"dtype", "shape", "data_offsets"}:
                raise self._error(f"entry {name!r} is not {{dtype, shape, data_offsets}}")
            dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
            if dtype not in ST_BITS:
                raise self._error(f"{name!r} has unknown dtype {dtype!r}")
            if not isinstance(shape, list) or not all(_is_index(d) for d in shape):
                raise self._error(f"{name!r} has shape {shape!r}, expected a list of non-negative ints")
            if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_index(o) for o in offsets)):
                raise self._error(f"{name!r} has data_offsets {offsets!r}, expected [begin, end]")
            begin, end = offsets
            bits = math.prod(shape) * ST_BITS[dtype]
            if bits % 8:
                raise self._error(f"{name!r}: {shape} x {dtype} is not a whole number of bytes")
            if end - begin != bits // 8:
                raise self._error(
                    f"{name!r}: data_offsets {offsets} hold {end - begin} bytes, but {dtype} {shape} needs {bits // 8}"
                )
            entries[name] = (dtype, tuple(shape), begin, end)
        # The byte ranges must tile the data exactly: no gaps, overlaps or trailing bytes.
        pos = 0
        for name, (_, _, begin, end) in sorted(entries.items(), key=lambda kv: (kv[1][2], kv[1][3])):
            if begin != pos:
                raise self._error(
                    f"{name!r} starts at data byte {begin}, expected {pos} (tensors must cover the data without gaps or overlaps)"
                )
            pos = end
        if pos != data_len:
            raise self._error(
                f"the tensors cover {pos} data bytes but the file holds {data_len} after the header "
                + ("(truncated)" if data_len < pos else "(trailing bytes)")
            )
        self.entries = entries

    # -- data ------------------------------------------------------------------

    def _pread(self, n: int, offset: int, into: Optional[memoryview] = None) -> bytes:
        """Read exactly ``n`` bytes at ``offset`` (into ``into`` when given), or raise."""
        if self._fd is None:
            raise CheckpointError(f"{self.path}: read after close()")
        buf = memoryview(bytearray(n)) if into is None else into
        done = 0
        while done < n:
            if _PREADV:
                got = os.preadv(self._fd, [buf[done:]], offset + done)
            else:  # no preadv (Windows): seek + readinto under a lock
                with self._lock:
                    os.lseek(self._fd, offset + done, os.SEEK_SET)
                    got = os.readv(self._fd, [buf[done:]])
            if got == 0:
                raise CheckpointError(
                    f"{self.path}: ended after {offset + done} bytes while reading {n} bytes at {offset} "
                    f"(was the file truncated after it was opened?)"
                )
            done += got
        return buf.obj if into is None else b""

    def torch_shape(self, name: str) -> tuple[int, ...]:
        """``name``'s shape in torch's terms (``F4`` counts packed pairs along the last dim)."""
        dtype, shape, _, _ = self.entries[name]
        if dtype == "F4":
            if not shape or shape[-1] % 2:
                raise CheckpointError(f"{self.path}: {name!r} is F4 with shape {list(shape)}; packed pairs need an even last dim")
            return (*shape[:-1], shape[-1] // 2)
        return shape

    def torch_dtype(self, name: str) -> torch.dtype:
        code = self.entries[name][0]
        if code not in ST_DTYPES:
            raise CheckpointError(f"{self.path}: {name!r} has safetensors dtype {code}, which has no torch dtype")
        return ST_DTYPES[code]

    def read(self, name: str, index: Optional[tuple] = None) -> torch.Tensor:
        """``name`` (or ``name[index]`` for leading ints/unit-step slices) as a new CPU tensor this process owns."""
        dtype = self.torch_dtype(name)
        shape = self.torch_shape(name)
        _, _, begin, _ = self.entries[name]
        ranges, squeeze = _normalize_index(index, shape, name)
        out_shape = [b - a for a, b in ranges]
        item = dtype.itemsize
        out = torch.empty(math.prod(out_shape) * item, dtype=torch.uint8)
        if out.numel():
            view = memoryview(out.numpy())
            # The trailing dims read whole form one contiguous run per index of the others.
            t = len(shape)
            while t > 0 and ranges[t - 1] == (0, shape[t - 1]):
                t -= 1
            inner = math.prod(shape[t:]) * item
            if t == 0:
                self._pread(len(view), self._data_start + begin, view)
            else:
                strides = [math.prod(shape[d + 1:]) * item for d in range(len(shape))]
                run = (ranges[t - 1][1] - ranges[t - 1][0]) * inner
                outer = [range(a, b) for a, b in ranges[: t - 1]]
                pos = 0
                for idx in _product(outer):
                    off = sum(i * s for i, s in zip(idx, strides)) + ranges[t - 1][0] * strides[t - 1]
                    self._pread(run, self._data_start + begin + off, view[pos:pos + run])
                    pos += run
        if sys.byteorder != "little" and item > 1:
            out = out.view(-1, item).flip(1).reshape(-1)  # safetensors stores little-endian
        result = out.view(dtype).reshape(out_shape)
        if squeeze:
            result = result[tuple(0 if d in squeeze else slice(None) for d in range(len(out_shape)))]
        return result

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def _is_index(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _product(ranges: Sequence[range]):
    if not ranges:
        yield ()
        return
    for i in ranges[0]:
        for rest in _product(ranges[1:]):
            yield (i, *rest)


def _normalize_index(index, shape: Sequence[int], name: str) -> tuple[list[tuple[int, int]], set[int]]:
    """``(start, stop)`` per dim and the dims indexed by an int (dropped from the result)."""
    if index is None:
        index = ()
    if not isinstance(index, tuple):
        index = (index,)
    if len(index) > len(shape):
        raise IndexError(f"{name}: {len(index)} indices for a {len(shape)}-d tensor")
    ranges, squeeze = [], set()
    for d, size in enumerate(shape):
        ix = index[d] if d < len(index) else slice(None)
        if isinstance(ix, slice):
            start, stop, step = ix.indices(size)
            if step != 1:
                raise IndexError(f"{name}: only unit-step slices can be read, got {ix}")
            ranges.append((start, max(start, stop)))
        elif isinstance(ix, int) and not isinstance(ix, bool):
            i = ix + size if ix < 0 else ix
            if not 0 <= i < size:
                raise IndexError(f"{name}: index {ix} is out of range for dim {d} of size {size}")
            ranges.append((i, i + 1))
            squeeze.add(d)
        else:
            raise IndexError(f"{name}: expected ints and slices, got {ix!r}")
    return ranges, squeeze
