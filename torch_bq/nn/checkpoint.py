"""The one checkpoint loader: find a linear layer's tensors in any supported layout and read them lazily.

Sources (anything :class:`CheckpointReader` accepts):

* a ``.safetensors`` file;
* a directory holding ``model.safetensors.index.json`` (sharded), or one or more
  ``*.safetensors`` files, and optionally ``config.json``;
* a mapping ``name -> torch.Tensor`` (e.g. a ``state_dict``).

Files are opened with ``safetensors.safe_open``; only the tensors a caller asks
for are read, and :meth:`CheckpointReader.get_slice` reads one expert of a
stacked tensor without reading the others.

Layouts recognised for a layer ``prefix`` (docs/contract.md §1 gives the math):

==================  ====================================================  =====================
layout              tensors                                               format
==================  ====================================================  =====================
``torch_bq``        ``{p}.weight`` + ``{p}.weight_scale``                 fp8 (any block) / fp4
``deepseek-v3``     ``{p}.weight`` F8_E4M3 + ``{p}.weight_scale_inv`` F32  fp8, block from
                                                                          ``config.json`` or shapes
``deepseek-v3.1``   ``{p}.weight`` + ``{p}.scale`` (e8m0)                 fp8 (any block) / fp4
``gpt-oss``         ``{p}_blocks`` U8 ``[..., N, K/32, 16]`` +            fp4 (``expert=i``
                    ``{p}_scales`` U8 ``[..., N, K/32]``                  selects a stacked one)
``dense``           ``{p}.weight`` BF16 / F32 / F16                       bf16 / fp32w
==================  ====================================================  =====================

plus ``{p}.bias`` (``{p}_bias`` for gpt-oss) when present. All scales are
*multiplied*. ``uint8`` data is fp4 when its scale grid is ``[N, K/32]`` with
``K = 2 * columns`` and fp8 otherwise (callers that know may pass ``format=``).

Every problem is found from the headers before any data is read, and raised
as :class:`CheckpointError` (a ``ValueError``) or :class:`MissingTensorError`
(also a ``KeyError``) naming the tensor, what was expected and what was found.

Typical reuse by other modules::

    with CheckpointReader(path) as ckpt:
        w = resolve_linear(ckpt, "model.layers.0.mlp.experts.gate_up_proj", expert=3)
        w.format, w.weight, w.scale, w.bias, w.block
"""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence, Union

import torch

from .. import formats
from .validation import scan_nan_codes

__all__ = [
    "CheckpointError",
    "MissingTensorError",
    "CheckpointReader",
    "LinearLayout",
    "LinearWeights",
    "open_checkpoint",
    "detect_linear",
    "read_linear",
    "resolve_linear",
    "load_linear",
    "build_module",
    "module_class_for",
    "INDEX_NAME",
]

INDEX_NAME = "model.safetensors.index.json"

Source = Union[str, os.PathLike, Mapping[str, torch.Tensor], "CheckpointReader"]

# safetensors dtype strings -> torch dtypes (F4 is torch's packed pair type)
_ST_DTYPES = {
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

_E8M0 = (torch.float8_e8m0fnu, torch.uint8)
_DENSE = (torch.bfloat16, torch.float32, torch.float16)
_SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv", ".scale")


class CheckpointError(ValueError):
    """A checkpoint (or a tensor in it) is unreadable, corrupt or not what the layout needs."""


class MissingTensorError(CheckpointError, KeyError):
    """A layer's tensors are not in the checkpoint; the message lists what was looked for."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


# =========================================================================== #
# reading
# =========================================================================== #


class CheckpointReader:
    """Lazy, read-only access to the tensors of a checkpoint.

    Args:
        source: a ``.safetensors`` file, a directory (sharded index or ``*.safetensors``
            files, optional ``config.json``), or a mapping ``name -> Tensor``.

    Files are opened on first use and kept open until :meth:`close` (or the end
    of a ``with`` block). :meth:`keys`, :meth:`shape` and :meth:`dtype` read headers
    only, never tensor data; with a sharded index, a shard's header is read the
    first time one of its tensors is asked about.
    """

    def __init__(self, source: Union[str, os.PathLike, Mapping[str, torch.Tensor]]) -> None:
        self._handles: dict[str, Any] = {}
        self._config: Optional[dict] = None
        self._tensors: Optional[Mapping[str, torch.Tensor]] = None
        self._where: dict[str, str] = {}  # tensor name -> file
        self._headers: dict[str, tuple[str, list[int]]] = {}  # name -> (dtype string, shape)
        self._pending: set[str] = set()  # indexed shards whose headers are not read yet
        self._index: Optional[Path] = None
        self.root: Optional[Path] = None  # where config.json is looked for
        self.directory: Optional[Path] = None  # set when the source is a directory
        if isinstance(source, Mapping):
            for k, v in source.items():
                if not isinstance(v, torch.Tensor):
                    raise TypeError(f"source[{k!r}]: expected a torch.Tensor, got {type(v).__name__}")
            self._tensors = source
            self.description = "a mapping of tensors"
            return
        if not isinstance(source, (str, os.PathLike)):
            raise TypeError(
                f"source: expected a .safetensors path, a directory or a mapping of tensors, got {type(source).__name__}"
            )
        path = Path(source)
        self.description = str(path)
        if path.is_dir():
            self.root = self.directory = path
            self._index_directory(path)
        elif path.is_file():
            self.root = path.parent
            self._add_file(path)
        else:
            raise CheckpointError(f"source: {path} does not exist")

    # -- construction ------------------------------------------------------------

    def _index_directory(self, root: Path) -> None:
        index = root / INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                if not isinstance(weight_map, dict):
                    raise TypeError(f"weight_map is a {type(weight_map).__name__}")
            except (ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: not a safetensors index (expected a JSON 'weight_map'): {e}") from e
            for name in sorted(set(weight_map.values())):
                if not (root / name).is_file():
                    raise CheckpointError(f"{index}: names shard {name!r}, which is not in {root}")
            # Shard headers are read when a tensor of that shard is first asked about,
            # so loading one layer of a 160-shard checkpoint opens only its shards.
            self._index = index
            self._where = {tensor: str(root / file) for tensor, file in weight_map.items()}
            self._pending = set(self._where.values())
            return
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"source: {root} holds neither {INDEX_NAME} nor any *.safetensors file")
        for f in files:
            self._add_file(f)

    def _add_file(self, path: Path) -> None:
        handle = self._open(path)
        for name in handle.keys():
            if name in self._where:
                raise CheckpointError(f"{name!r} is in both {self._where[name]} and {path}")
            self._where[name] = str(path)
            sl = handle.get_slice(name)
            self._headers[name] = (sl.get_dtype(), list(sl.get_shape()))

    def _header(self, name: str) -> tuple[str, list[int]]:
        """``(safetensors dtype, shape)`` of ``name``, reading its shard's header on first use."""
        file = self._where[name]
        if file in self._pending:
            handle = self._open(Path(file))
            for key in handle.keys():
                if self._where.get(key) == file:
                    sl = handle.get_slice(key)
                    self._headers[key] = (sl.get_dtype(), list(sl.get_shape()))
            self._pending.discard(file)
        if name not in self._headers:
            raise CheckpointError(f"{self._index}: maps {name!r} to {Path(file).name!r}, but that shard does not hold it")
        return self._headers[name]

    def _open(self, path: Path):
        key = str(path)
        if key not in self._handles:
            from safetensors import safe_open

            try:
                self._handles[key] = safe_open(key, framework="pt", device="cpu")
            except Exception as e:  # safetensors raises its own error types for every kind of damage
                raise CheckpointError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from e
        return self._handles[key]

    # -- queries -----------------------------------------------------------------

    def keys(self) -> list[str]:
        """All tensor names, sorted."""
        return sorted(self._tensors.keys() if self._tensors is not None else self._where)

    def __contains__(self, name: object) -> bool:
        return name in (self._tensors if self._tensors is not None else self._where)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self._tensors if self._tensors is not None else self._where)

    def file_of(self, name: str) -> Optional[str]:
        """The file holding ``name`` (``None`` for a mapping)."""
        self._require(name)
        return self._where.get(name)

    def files(self) -> list[str]:
        """The safetensors files behind this reader (empty for a mapping)."""
        return sorted(set(self._where.values()))

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of ``name`` in torch's terms (``float4_e2m1fn_x2`` counts byte pairs), read from the header."""
        self._require(name)
        if self._tensors is not None:
            return tuple(self._tensors[name].shape)
        dtype, shape = self._header(name)
        if dtype == "F4":  # the header counts e2m1 elements, torch counts packed pairs
            shape = [*shape[:-1], shape[-1] // 2]
        return tuple(shape)

    def dtype(self, name: str) -> torch.dtype:
        """Torch dtype of ``name``, read from the header."""
        self._require(name)
        if self._tensors is not None:
            return self._tensors[name].dtype
        code = self._header(name)[0]
        if code not in _ST_DTYPES:
            raise CheckpointError(f"{name}: safetensors dtype {code} has no torch equivalent here")
        return _ST_DTYPES[code]

    def nbytes(self, name: str) -> int:
        """Size of ``name``'s data in bytes."""
        n = 1
        for d in self.shape(name):
            n *= d
        return n * self.dtype(name).itemsize

    @property
    def config(self) -> dict:
        """``config.json`` next to the checkpoint, or ``{}``."""
        if self._config is None:
            self._config = {}
            if self.root is not None and (self.root / "config.json").is_file():
                try:
                    self._config = json.loads((self.root / "config.json").read_text())
                except ValueError as e:
                    raise CheckpointError(f"{self.root / 'config.json'}: not valid JSON: {e}") from e
        return self._config

    def closest(self, name: str, n: int = 5) -> list[str]:
        """Up to ``n`` tensor names that look most like ``name`` (for error messages)."""
        keys = self.keys()
        close = difflib.get_close_matches(name, keys, n=n, cutoff=0.6)
        if len(close) < n:
            # Names sharing the longest dotted parent often explain a renamed layer.
            parts = name.split(".")
            for depth in range(len(parts) - 1, 0, -1):
                parent = ".".join(parts[:depth]) + "."
                siblings = [k for k in keys if k.startswith(parent) and k not in close]
                if siblings:
                    close += siblings[: n - len(close)]
                    break
        return close

    # -- data --------------------------------------------------------------------

    def get(self, name: str) -> torch.Tensor:
        """Read the whole tensor ``name`` (CPU)."""
        self._require(name)
        if self._tensors is not None:
            return self._tensors[name]
        self._header(name)
        try:
            return self._open(Path(self._where[name])).get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"{name}: cannot read it from {self._where[name]} ({type(e).__name__}: {e})") from e

    def get_slice(self, name: str):
        """An indexable view of ``name`` that reads only what is indexed (``sl[i]``, ``sl[a:b]``).

        For a mapping this is the tensor itself. Packed ``F4`` tensors in files are
        read whole (safetensors cannot slice them), then indexed.
        """
        self._require(name)
        if self._tensors is not None:
            return self._tensors[name]
        if self._header(name)[0] == "F4":
            return self.get(name)
        return _SafeSlice(self, name, self._open(Path(self._where[name])).get_slice(name))

    def get_index(self, name: str, index: int) -> torch.Tensor:
        """``name[index]`` along the first dim, reading only that part (one expert of a stack)."""
        n = self.shape(name)[0]
        if not -n <= index < n:
            raise CheckpointError(f"{name}: index {index} is out of range for its first dim of {n}")
        return self.get_slice(name)[index]

    def _require(self, name: str) -> None:
        if name not in self:
            near = self.closest(name)
            raise MissingTensorError(
                f"{name!r} is not in {self.description}" + (f"; closest names: {near}" if near else "")
            )

    # -- lifetime ----------------------------------------------------------------

    def close(self) -> None:
        """Release open files (tensors already read stay valid)."""
        self._handles.clear()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointReader({self.description!r}, {len(self)} tensors)"


class _SafeSlice:
    """A safetensors slice whose read errors become :class:`CheckpointError`."""

    def __init__(self, reader: CheckpointReader, name: str, sl) -> None:
        self._reader, self._name, self._sl = reader, name, sl

    @property
    def shape(self) -> tuple[int, ...]:
        return self._reader.shape(self._name)

    def __getitem__(self, index) -> torch.Tensor:
        try:
            return self._sl[index]
        except Exception as e:
            raise CheckpointError(
                f"{self._name}: cannot read {index!r} from {self._reader.file_of(self._name)} ({type(e).__name__}: {e})"
            ) from e


class open_checkpoint:
    """``with open_checkpoint(source) as reader``: a :class:`CheckpointReader` for ``source``.

    A reader passed in is used as is and left open; anything else is opened and closed.
    """

    def __init__(self, source: Source) -> None:
        self._owned = not isinstance(source, CheckpointReader)
        self._reader = CheckpointReader(source) if self._owned else source

    def __enter__(self) -> CheckpointReader:
        return self._reader

    def __exit__(self, *exc) -> None:
        if self._owned:
            self._reader.close()


# =========================================================================== #
# layout detection (headers only)
# =========================================================================== #


@dataclass(frozen=True)
class LinearLayout:
    """Where and how one linear layer is stored, as found from headers only.

    Attributes:
        prefix: the layer's name in the checkpoint.
        layout: ``"torch_bq"``, ``"deepseek-v3"``, ``"deepseek-v3.1"``, ``"gpt-oss"`` or ``"dense"``.
        format: ``"fp8"``, ``"fp4"``, ``"bf16"`` or ``"fp32w"``.
        weight_name, scale_name, bias_name: checkpoint keys (``scale``/``bias`` may be ``None``).
        out_features, in_features: ``N`` and ``K`` of the layer.
        block: the fp8 scale block ``(bn, bk)``; ``(1, 32)`` for fp4; ``None`` for dense.
        expert: the index selected from stacked tensors, or ``None``.
        num_experts: length of the stacked dim, or ``None`` when not stacked.
    """

    prefix: str
    layout: str
    format: str
    weight_name: str
    scale_name: Optional[str]
    bias_name: Optional[str]
    out_features: int
    in_features: int
    block: Optional[tuple[int, int]]
    expert: Optional[int] = None
    num_experts: Optional[int] = None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n in (self.weight_name, self.scale_name, self.bias_name) if n is not None)


@dataclass
class LinearWeights:
    """The tensors of one linear layer, read and validated, on CPU, in our storage dtypes.

    ``weight``: fp8 ``float8_e4m3fn [N, K]``; fp4 ``uint8 [N, ceil(K/2)]``; dense ``bfloat16``/``float32 [N, K]``.
    ``scale``: fp8 ``float8_e8m0fnu`` or ``float32 [ceil(N/bn), ceil(K/bk)]``; fp4
    ``float8_e8m0fnu [N, ceil(K/32)]``; ``None`` for dense. Always multiplied.
    ``bias``: ``[N]`` as stored, or ``None``.
    """

    layout: LinearLayout
    weight: torch.Tensor
    scale: Optional[torch.Tensor]
    bias: Optional[torch.Tensor] = None
    extra: dict = field(default_factory=dict)

    @property
    def format(self) -> str:
        return self.layout.format

    @property
    def block(self) -> Optional[tuple[int, int]]:
        return self.layout.block

    @property
    def in_features(self) -> int:
        return self.layout.in_features

    @property
    def out_features(self) -> int:
        return self.layout.out_features


def _looked_for(prefix: str) -> list[str]:
    return [f"{prefix}.weight", *(prefix + s for s in _SCALE_SUFFIXES), f"{prefix}_blocks", f"{prefix}_scales"]


def _missing(reader: CheckpointReader, prefix: str, what: str, looked: Sequence[str]) -> MissingTensorError:
    near: list[str] = []
    for name in looked:
        for c in reader.closest(name):
            if c not in near:
                near.append(c)
    return MissingTensorError(
        f"{prefix}: {what} in {reader.description}; looked for {list(looked)}"
        + (f"; closest names present: {near[:8]}" if near else "; the checkpoint has no similar names")
    )


def _stack_dims(reader: CheckpointReader, name: str, base_ndim: int, expert: Optional[int]) -> tuple[tuple[int, ...], Optional[int]]:
    """The per-layer shape of ``name`` and its stack length, checking ``expert`` against it."""
    shape = reader.shape(name)
    if len(shape) == base_ndim:
        if expert is not None:
            raise CheckpointError(
                f"{name}: expert={expert} was given but the tensor is not stacked (shape {list(shape)})"
            )
        return shape, None
    if len(shape) == base_ndim + 1:
        e = shape[0]
        if expert is None:
            raise CheckpointError(
                f"{name}: holds {e} stacked experts (shape {list(shape)}); pass expert=i to pick one"
            )
        if not 0 <= expert < e:
            raise CheckpointError(f"{name}: expert={expert} is out of range for {e} experts")
        return shape[1:], e
    raise CheckpointError(
        f"{name}: expected {base_ndim} dims (or {base_ndim + 1} with a leading expert dim), got shape {list(shape)}"
    )


def _infer_block_dim(size: int, grid: int) -> Optional[int]:
    """The block length ``b`` with ``ceil(size / b) == grid``: 1, else the power of two that fits.

    With ``grid > 1`` at most one power of two fits; with ``grid == 1`` every
    ``b >= size`` decodes the same, and the smallest power of two is returned.
    """
    if grid == size:
        return 1
    b = 1
    while b < 2 * size:  # past 2 * size every b gives grid 1, which b <= next_pow2(size) already did
        if -(-size // b) == grid:
            return b
        b <<= 1
    return None


def _fp8_block(reader: CheckpointReader, layout: str, weight_name: str, scale_name: str,
               n: int, k: int, grid: tuple[int, ...], block: Optional[Sequence[int]]) -> tuple[int, int]:
    if block is not None:
        block = formats._check_block(block)
        source = "block="
    elif layout == "deepseek-v3" and reader.config.get("quantization_config", {}).get("weight_block_size"):
        block = formats._check_block(reader.config["quantization_config"]["weight_block_size"])
        source = "config.json quantization_config.weight_block_size"
    else:
        bn, bk = _infer_block_dim(n, grid[0]), _infer_block_dim(k, grid[1])
        if bn is None or bk is None:
            raise CheckpointError(
                f"{scale_name}: shape {list(grid)} fits no power-of-two block for a {[n, k]} weight; pass block=(bn, bk)"
            )
        return bn, bk
    expected = formats.fp8_scale_shape((n, k), block)
    if tuple(grid) != expected:
        raise CheckpointError(
            f"{scale_name}: expected shape {list(expected)} for a {[n, k]} weight with block {list(block)} "
            f"(from {source}), got {list(grid)}"
        )
    return block


def detect_linear(
    source: Source,
    prefix: str,
    *,
    expert: Optional[int] = None,
    block: Optional[Sequence[int]] = None,
    in_features: Optional[int] = None,
    format: Optional[str] = None,
) -> LinearLayout:
    """Find how layer ``prefix`` is stored, from headers only (no tensor data is read).

    Args:
        source: anything :class:`CheckpointReader` accepts, or a reader.
        prefix: the layer's name, e.g. ``"model.layers.0.mlp.down_proj"`` or, for
            gpt-oss, ``"model.layers.0.mlp.experts.down_proj"`` (the part before ``_blocks``).
        expert: index into a stacked (``[E, ...]``) tensor; required when stacked.
        block: the fp8 block when neither the checkpoint nor its shapes say.
        in_features: ``K`` for fp4 with odd ``K`` (default ``2 * columns``).
        format: ``"fp8"`` or ``"fp4"`` to settle ``uint8`` data that could be either.

    Raises:
        MissingTensorError: nothing usable under ``prefix`` (lists what was looked for
            and the closest names present).
        CheckpointError: wrong dtypes or shapes, ambiguous names, a bad ``expert``.
    """
    if format not in (None, "fp8", "fp4", "bf16", "fp32w"):
        raise ValueError(f"format: expected 'fp8', 'fp4', 'bf16', 'fp32w' or None, got {format!r}")
    with open_checkpoint(source) as reader:
        if f"{prefix}_blocks" in reader or f"{prefix}_scales" in reader:
            return _detect_gpt_oss(reader, prefix, expert)
        weight_name = f"{prefix}.weight"
        if weight_name not in reader:
            raise _missing(reader, prefix, "no weight found", _looked_for(prefix))
        scales = [prefix + s for s in _SCALE_SUFFIXES if prefix + s in reader]
        if len(scales) > 1:
            raise CheckpointError(f"{prefix}: more than one scale tensor present: {scales}; expected exactly one")
        bias_name = f"{prefix}.bias" if f"{prefix}.bias" in reader else None
        wdtype = reader.dtype(weight_name)
        if not scales:
            if wdtype not in _DENSE:
                raise _missing(
                    reader, prefix, f"the weight is {wdtype} but no scale tensor is present",
                    [prefix + s for s in _SCALE_SUFFIXES],
                )
            shape, e = _stack_dims(reader, weight_name, 2, expert)
            _check_bias(reader, bias_name, shape[0], expert)
            fmt = "bf16" if wdtype == torch.bfloat16 else "fp32w"
            return LinearLayout(prefix, "dense", fmt, weight_name, None, bias_name, shape[0], shape[1], None, expert, e)
        scale_name = scales[0]
        layout = {".weight_scale": "torch_bq", ".weight_scale_inv": "deepseek-v3", ".scale": "deepseek-v3.1"}[
            scale_name[len(prefix):]
        ]
        shape, e = _stack_dims(reader, weight_name, 2, expert)
        grid, e2 = _stack_dims(reader, scale_name, 2, expert)
        if e != e2:
            raise CheckpointError(
                f"{prefix}: {weight_name} and {scale_name} disagree on stacking ({e} vs {e2} experts)"
            )
        sdtype = reader.dtype(scale_name)
        n, cols = shape
        fmt = _data_format(wdtype, n, cols, grid, format, weight_name)
        if fmt == "fp8":
            if layout == "deepseek-v3":
                allowed = (torch.float32, torch.bfloat16, torch.float16, *_E8M0)
            else:
                allowed = (*_E8M0, torch.float32)
            if sdtype not in allowed:
                raise CheckpointError(f"{scale_name}: expected dtype in {allowed} for an fp8 weight, got {sdtype}")
            blk = _fp8_block(reader, layout, weight_name, scale_name, n, cols, grid, block)
            _check_bias(reader, bias_name, n, expert)
            return LinearLayout(prefix, layout, "fp8", weight_name, scale_name, bias_name, n, cols, blk, expert, e)
        if layout == "deepseek-v3":
            raise CheckpointError(f"{weight_name}: a weight_scale_inv layout holds fp8 data, got {wdtype}")
        if sdtype not in _E8M0:
            raise CheckpointError(f"{scale_name}: expected e8m0 scales (F8_E8M0 or U8) for fp4, got {sdtype}")
        k = _fp4_in_features(weight_name, cols, in_features)
        expected = (n, -(-k // formats.FP4_BLOCK))
        if tuple(grid) != expected:
            raise CheckpointError(
                f"{scale_name}: expected shape {list(expected)} for fp4 data {[n, cols]} (K={k}, 1x32 blocks), "
                f"got {list(grid)}"
            )
        _check_bias(reader, bias_name, n, expert)
        return LinearLayout(prefix, layout, "fp4", weight_name, scale_name, bias_name, n, k, (1, 32), expert, e)


def _data_format(wdtype, n, cols, grid, hint, weight_name) -> str:
    if wdtype == torch.float8_e4m3fn:
        fmt = "fp8"
    elif wdtype in (torch.int8, torch.float4_e2m1fn_x2):
        fmt = "fp4"
    elif wdtype == torch.uint8:
        if hint in ("fp8", "fp4"):
            return hint
        # Packed fp4 has one e8m0 per 16 bytes of a row; fp8 bytes never do for K > 32.
        fmt = "fp4" if tuple(grid) == (n, -(-2 * cols // formats.FP4_BLOCK)) else "fp8"
    else:
        raise CheckpointError(
            f"{weight_name}: expected quantized data (F8_E4M3, U8, I8 or F4) next to a scale tensor, got {wdtype}"
        )
    if hint in ("fp8", "fp4") and hint != fmt:
        raise CheckpointError(f"{weight_name}: holds {fmt} data ({wdtype}), but {hint} was asked for")
    return fmt


def _fp4_in_features(weight_name: str, cols: int, in_features: Optional[int]) -> int:
    if in_features is None:
        return 2 * cols
    if -(-in_features // 2) != cols:
        raise CheckpointError(
            f"{weight_name}: in_features={in_features} needs {-(-in_features // 2)} packed columns, got {cols}"
        )
    return in_features


def _check_bias(reader: CheckpointReader, bias_name: Optional[str], n: int, expert: Optional[int]) -> None:
    if bias_name is None:
        return
    dtype = reader.dtype(bias_name)
    if not dtype.is_floating_point or dtype.itemsize == 1:
        raise CheckpointError(f"{bias_name}: expected a float16/bfloat16/float32 bias, got {dtype}")
    shape = reader.shape(bias_name)
    if len(shape) == 2:
        if expert is None:
            raise CheckpointError(f"{bias_name}: holds {shape[0]} stacked experts; pass expert=i to pick one")
        if not 0 <= expert < shape[0]:
            raise CheckpointError(f"{bias_name}: expert={expert} is out of range for {shape[0]} experts")
        shape = shape[1:]
    if tuple(shape) != (n,):
        raise CheckpointError(f"{bias_name}: expected shape [{n}] (N of the weight), got {list(reader.shape(bias_name))}")


def _detect_gpt_oss(reader: CheckpointReader, prefix: str, expert: Optional[int]) -> LinearLayout:
    blocks, scales = f"{prefix}_blocks", f"{prefix}_scales"
    for name in (blocks, scales):
        if name not in reader:
            raise _missing(reader, prefix, f"{name} is missing (gpt-oss MXFP4 needs both)", [blocks, scales])
    for name in (blocks, scales):
        if reader.dtype(name) != torch.uint8:
            raise CheckpointError(f"{name}: expected dtype torch.uint8, got {reader.dtype(name)}")
    bshape, e = _stack_dims(reader, blocks, 3, expert)
    sshape, e2 = _stack_dims(reader, scales, 2, expert)
    if bshape[2] != 16:
        raise CheckpointError(f"{blocks}: expected shape [..., N, K/32, 16] (16 bytes per 32 values), got {list(reader.shape(blocks))}")
    if tuple(sshape) != tuple(bshape[:2]) or e != e2:
        raise CheckpointError(
            f"{scales}: expected shape {list(reader.shape(blocks)[:-1])} to match {blocks}, got {list(reader.shape(scales))}"
        )
    bias_name = f"{prefix}_bias" if f"{prefix}_bias" in reader else None
    n, groups = bshape[0], bshape[1]
    _check_bias(reader, bias_name, n, expert)
    return LinearLayout(prefix, "gpt-oss", "fp4", blocks, scales, bias_name, n, groups * formats.FP4_BLOCK, (1, 32), expert, e)


# =========================================================================== #
# reading (data)
# =========================================================================== #


def _check_span(span, size: int, step: int, what: str, prefix: str) -> tuple[int, int]:
    """``span = (start, stop)`` within ``size`` whose ends fall on multiples of ``step`` (or ``size``)."""
    if span is None:
        return 0, size
    start, stop = (int(v) for v in span)
    if not 0 <= start < stop <= size:
        raise CheckpointError(f"{prefix}: {what}=({start}, {stop}) is not a non-empty range within [0, {size}]")
    if start % step or (stop % step and stop != size):
        raise CheckpointError(
            f"{prefix}: {what}=({start}, {stop}) must start and end on multiples of the {step}-wide scale "
            f"block (or end at {size}), so that every scale belongs to one shard"
        )
    return start, stop


def read_linear(
    source: Source,
    layout: LinearLayout,
    *,
    rows: Optional[Sequence[int]] = None,
    cols: Optional[Sequence[int]] = None,
    region: Optional[Mapping[str, tuple]] = None,
) -> LinearWeights:
    """Read and validate the tensors ``layout`` names; nothing else is read.

    Args:
        source: anything :class:`CheckpointReader` accepts, or a reader.
        layout: from :func:`detect_linear`.
        rows: ``(n0, n1)``: read only output rows ``n0:n1`` (a column-parallel shard).
        cols: ``(k0, k1)``: read only input columns ``k0:k1`` (a row-parallel shard).
            Both must fall on scale-block boundaries (fp4: multiples of 32 along K).
            Only the selected bytes are read. The bias follows ``rows``; with
            ``cols`` the whole bias is returned and the caller decides which shard adds it.
        region: the low-level form, instead of ``rows``/``cols``: ``tensor name -> index
            tuple`` into the stored tensor (after ``layout.expert`` is selected); only
            that part is read, tensors not named are read whole, ``layout`` is returned
            unchanged, and a region on fp4 data skips the odd-``K`` padding-nibble check
            (only the reader of the last columns can make it). For shards that do not
            fall on block boundaries (:mod:`torch_bq.distributed`).

    Returns:
        CPU tensors in our storage dtypes (see :class:`LinearWeights`); with
        ``rows``/``cols`` its ``layout`` carries the shard's ``out_features``/``in_features``.

    Raises:
        CheckpointError: a tensor is unreadable or holds NaN codes (docs/contract.md §1), or a
            shard boundary splits a scale block.
    """
    if region is not None and (rows is not None or cols is not None):
        raise ValueError("read_linear: pass rows/cols or region, not both")
    region = {} if region is None else dict(region)
    n, k = layout.out_features, layout.in_features
    bn, bk = layout.block if layout.block is not None else (1, 1)
    n0, n1 = _check_span(rows, n, bn, "rows", layout.prefix)
    k0, k1 = _check_span(cols, k, bk, "cols", layout.prefix)
    sharded = (n0, n1, k0, k1) != (0, n, 0, k)
    with open_checkpoint(source) as reader:
        def read(name: Optional[str], base_ndim: int, index: tuple) -> Optional[torch.Tensor]:
            if name is None:
                return None
            stacked = layout.expert is not None and len(reader.shape(name)) == base_ndim + 1
            if region:
                index = region.get(name)
            elif not sharded:
                index = None
            if index is None:
                return reader.get_index(name, layout.expert) if stacked else reader.get(name)
            return reader.get_slice(name)[((layout.expert,) if stacked else ()) + tuple(index)]

        row_sl = slice(n0, n1)
        if layout.format == "fp8":
            weight = read(layout.weight_name, 2, (row_sl, slice(k0, k1)))
            scale = read(layout.scale_name, 2, (slice(n0 // bn, -(-n1 // bn)), slice(k0 // bk, -(-k1 // bk))))
        elif layout.format == "fp4":
            scale = read(layout.scale_name, 2, (row_sl, slice(k0 // 32, -(-k1 // 32))))
            if layout.layout == "gpt-oss":
                weight = read(layout.weight_name, 3, (row_sl, slice(k0 // 32, -(-k1 // 32))))
            else:
                weight = read(layout.weight_name, 2, (row_sl, slice(k0 // 2, -(-k1 // 2))))
        else:
            weight, scale = read(layout.weight_name, 2, (row_sl, slice(k0, k1))), None
        bias = read(layout.bias_name, 1, (row_sl,))
        if sharded:
            layout = replace(layout, out_features=n1 - n0, in_features=k1 - k0)
        if layout.format == "fp8":
            weight = weight.view(torch.float8_e4m3fn) if weight.dtype == torch.uint8 else weight
            if scale.dtype == torch.uint8:
                scale = scale.view(torch.float8_e8m0fnu)
            elif scale.dtype in (torch.bfloat16, torch.float16):
                scale = scale.to(torch.float32)  # exact widening; the op takes float32 multipliers
            fmt_name = "fp8"
        elif layout.format == "fp4":
            if layout.layout == "gpt-oss":
                weight = weight.reshape(weight.shape[0], -1)  # [N, K/32, 16] -> [N, K/2], same byte order
            weight = formats.as_fp4_bytes(weight, layout.weight_name)
            scale = scale.view(torch.float8_e8m0fnu)
            fmt_name = "fp4"
        else:
            if weight.dtype == torch.float16:
                weight = weight.to(torch.float32)  # exact; runs as fp32w
            fmt_name = None
        if fmt_name is not None:
            try:
                k_check = None if layout.weight_name in region else layout.in_features
                scan_nan_codes(weight, scale, name=layout.weight_name, fmt=fmt_name, in_features=k_check)
            except ValueError as e:
                # formats names a scale "<weight>_scale"; say the checkpoint's own name instead
                msg = str(e)
                if msg.startswith(f"{layout.weight_name}_scale:"):
                    msg = layout.scale_name + msg[len(layout.weight_name) + len("_scale"):]
                if sharded:
                    msg += f" (index within rows {n0}:{n1}, cols {k0}:{k1})"
                raise CheckpointError(msg) from None
        return LinearWeights(layout, weight, scale, bias, {"rows": (n0, n1), "cols": (k0, k1)})


def resolve_linear(
    source: Source,
    prefix: str,
    *,
    expert: Optional[int] = None,
    block: Optional[Sequence[int]] = None,
    in_features: Optional[int] = None,
    format: Optional[str] = None,
    rows: Optional[Sequence[int]] = None,
    cols: Optional[Sequence[int]] = None,
) -> LinearWeights:
    """:func:`detect_linear` then :func:`read_linear`: the layer's validated tensors (or a shard of them)."""
    with open_checkpoint(source) as reader:
        layout = detect_linear(reader, prefix, expert=expert, block=block, in_features=in_features, format=format)
        return read_linear(reader, layout, rows=rows, cols=cols)


def module_class_for(fmt: str):
    """The torch_bq module class for a format name."""
    from .linear import BF16Linear, FP4Linear, FP8Linear

    classes = {"fp8": FP8Linear, "fp4": FP4Linear, "bf16": BF16Linear, "fp32w": BF16Linear}
    if fmt not in classes:
        raise ValueError(f"format: expected one of {sorted(classes)}, got {fmt!r}")
    return classes[fmt]


def build_module(weights: LinearWeights, cls=None, *, device="cpu", act_quant: Optional[bool] = None,
                 act_peak: Optional[float] = None):
    """A torch_bq module holding ``weights`` (moved to ``device``); ``cls`` defaults from the format."""
    from .linear import BF16Linear, FP4Linear, FP8Linear

    cls = module_class_for(weights.format) if cls is None else cls
    expected = module_class_for(weights.format)
    if cls is not expected:
        raise CheckpointError(
            f"{weights.layout.prefix}: the checkpoint holds {weights.format} weights "
            f"({weights.layout.layout} layout); load them with {expected.__name__}, not {cls.__name__}"
        )
    opts = {}
    if act_quant is not None:
        opts["act_quant"] = act_quant
    if act_peak is not None:
        opts["act_peak"] = act_peak
    name = weights.layout.weight_name
    if cls is FP8Linear:
        module = FP8Linear.from_quantized(weights.weight, weights.scale, weights.bias, block=weights.block, name=name, **opts)
    elif cls is FP4Linear:
        module = FP4Linear.from_quantized(
            weights.weight, weights.scale, weights.bias, in_features=weights.in_features, name=name, **opts
        )
    else:
        if opts:
            raise TypeError(f"{name}: act_quant/act_peak do not apply to a dense (BF16Linear) layer")
        module = BF16Linear.from_quantized(weights.weight, weights.bias, name=name)
    return module.to(device)


def load_linear(cls, source: Source, prefix: str, *, device="cpu", expert: Optional[int] = None,
                block: Optional[Sequence[int]] = None, in_features: Optional[int] = None,
                rows: Optional[Sequence[int]] = None, cols: Optional[Sequence[int]] = None,
                act_quant: Optional[bool] = None, act_peak: Optional[float] = None):
    """Build a ``cls`` module from layer ``prefix`` of ``source`` (the body of ``from_checkpoint``).

    Args:
        cls: ``FP8Linear``, ``FP4Linear`` or ``BF16Linear``; must match what the checkpoint holds.
        source: a ``.safetensors`` file, a directory (index or files; ``config.json``), a mapping,
            or a :class:`CheckpointReader`.
        prefix: the layer's name in the checkpoint.
        device: where the module's tensors end up (read on CPU, then moved).
        expert: pick one expert of stacked tensors (gpt-oss ``_blocks``/``_scales``).
        block: fp8 block when the checkpoint cannot say.
        in_features: ``K`` for fp4 with odd ``K``.
        rows, cols: load only a tensor-parallel shard (see :func:`read_linear`).
        act_quant, act_peak: module options (default: the module's defaults).
    """
    from .linear import BF16Linear, FP4Linear, FP8Linear

    hint = {FP8Linear: "fp8", FP4Linear: "fp4"}.get(cls)
    with open_checkpoint(source) as reader:
        layout = detect_linear(reader, prefix, expert=expert, block=block, in_features=in_features, format=hint)
        expected = module_class_for(layout.format)
        if cls is not expected:
            raise CheckpointError(
                f"{prefix}: the checkpoint holds {layout.format} weights ({layout.layout} layout); "
                f"load them with {expected.__name__}, not {cls.__name__}"
            )
        weights = read_linear(reader, layout, rows=rows, cols=cols)
    return build_module(weights, cls, device=device, act_quant=act_quant, act_peak=act_peak)
