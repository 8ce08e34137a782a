"""``CheckpointReader``: lazy, read-only, bounded access to the tensors of a checkpoint.

Sources: a ``.safetensors`` file; a directory holding ``model.safetensors.index.json``
(sharded) or ``*.safetensors`` files, and optionally ``config.json``; a mapping
``name -> torch.Tensor`` (a ``state_dict``, used as is).

A checkpoint directory is a unit: an index may only name regular files inside
the directory (no absolute paths, no ``..``, no symlinks leading out), every
shard it names must be there, and numbered shards (``*-00001-of-00003.safetensors``)
are never read without the index they belong to. Tensors read from files are
new memory this process owns (see :mod:`torch_bq.checkpoint.safetensors_file`).
"""

from __future__ import annotations

import difflib
import json
import os
import re
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Iterator, Mapping, Optional, Union

import torch

from .errors import CheckpointError, IncompleteCheckpointError, MissingTensorError, UnsafePathError
from .record import LayerRecord, decode_records
from .safetensors_file import SafetensorsFile, open_regular
from .stored import from_stored, has_unit_axis, natural_shape

__all__ = ["CheckpointReader", "open_checkpoint", "INDEX_NAME", "Source", "SHARD_PATTERN"]

INDEX_NAME = "model.safetensors.index.json"

#: the name of shard ``i`` of ``n`` as transformers and ``convert_checkpoint`` write it
SHARD_PATTERN = re.compile(r"^(?P<stem>.*)-(?P<i>\d{5})-of-(?P<n>\d{5})\.safetensors$")

#: JSON side files larger than this are refused (a config or index is kilobytes to a few megabytes)
MAX_JSON_BYTES = 256 << 20

Source = Union[str, os.PathLike, Mapping[str, torch.Tensor], "CheckpointReader"]


def read_json(path: Path, what: str):
    """Parse the regular file ``path`` as JSON (bounded size, never blocks), raising :class:`CheckpointError`."""
    fd = open_regular(path, what)
    try:
        size = os.fstat(fd).st_size
        if size > MAX_JSON_BYTES:
            raise CheckpointError(f"{path}: {size} bytes is too large for a {what}")
        with os.fdopen(fd, "rb", closefd=False) as f:
            raw = f.read()
    finally:
        os.close(fd)
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


class CheckpointReader:
    """Lazy, read-only access to the tensors of a checkpoint.

    Args:
        source: a ``.safetensors`` file, a directory (sharded index or ``*.safetensors``
            files, optional ``config.json``), or a mapping ``name -> Tensor``.

    :meth:`keys`, :meth:`shape`, :meth:`dtype` and :meth:`metadata` read headers only; shapes
    and tensors are natural (torch_bq's stored unit axis removed, see :mod:`.stored`);
    with a sharded index a shard's header is read the first time one of its
    tensors is asked about. Files stay open until :meth:`close` (or the end of a
    ``with`` block); tensors already read stay valid after it.

    Raises:
        CheckpointError: unreadable source; :class:`IncompleteCheckpointError` for an
        index naming absent shards or numbered shards without their index;
        :class:`UnsafePathError` for an index naming files outside the directory;
        :class:`NotARegularFileError` for FIFOs and other non-regular files.
    """

    def __init__(self, source: Union[str, os.PathLike, Mapping[str, torch.Tensor]]) -> None:
        self._files: dict[str, SafetensorsFile] = {}
        self._records: dict[str, dict[str, LayerRecord]] = {}  # file -> its decoded records
        self._config: Optional[dict] = None
        self._tensors: Optional[Mapping[str, torch.Tensor]] = None
        self._where: dict[str, str] = {}  # tensor name -> file
        self._alias: dict[str, str] = {}  # tied name -> the stored name it reads (save_quantized's ties)
        self._index: Optional[Path] = None
        self.root: Optional[Path] = None  # where config.json is looked for
        self.directory: Optional[Path] = None  # set when the source is a directory
        if isinstance(source, Mapping):
            for k, v in source.items():
                if not isinstance(k, str):
                    raise TypeError(f"source: expected str tensor names, got {type(k).__name__} {k!r}")
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
        elif path.exists():
            self.root = path.parent
            self._add_file(path)
        else:
            raise CheckpointError(f"source: {path} does not exist")

    # -- construction ------------------------------------------------------------

    def _index_directory(self, root: Path) -> None:
        index = root / INDEX_NAME
        if index.exists() or index.is_symlink():
            self._index = index
            weight_map, tied = self._read_index(index)
            shards = sorted(set(weight_map.values()))
            files = {name: self._confined(root, name, index) for name in shards}
            absent = [name for name, f in files.items() if not f.exists()]
            series: dict[tuple[str, int], set[int]] = {}
            for name in shards:
                m = SHARD_PATTERN.match(PurePosixPath(name).name)
                if m:
                    series.setdefault((m["stem"], int(m["n"])), set()).add(int(m["i"]))
            unnamed = [f"{stem}-{i:05d}-of-{n:05d}.safetensors" for (stem, n), seen in series.items()
                       for i in range(1, n + 1) if i not in seen]
            if absent or unnamed:
                raise IncompleteCheckpointError(
                    f"{index}: the checkpoint is incomplete: "
                    + (f"names shard(s) {absent[:5]} that are not in {root}" if absent else "")
                    + ("; " if absent and unnamed else "")
                    + (f"names no tensor in shard(s) {unnamed[:5]} of its own numbering" if unnamed else "")
                    + " (an interrupted write or copy?)"
                )
            # Shard headers are read when a tensor of that shard is first asked about,
            # so loading one layer of a 160-shard checkpoint opens only its shards.
            self._where = {tensor: str(files[file]) for tensor, file in weight_map.items()}
            for alias, kept in tied.items():
                self._where[alias], self._alias[alias] = self._where[kept], kept
            return
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"source: {root} holds neither {INDEX_NAME} nor any *.safetensors file")
        numbered = [f.name for f in files if SHARD_PATTERN.match(f.name)]
        if numbered:
            raise IncompleteCheckpointError(
                f"{root}: holds numbered shards {numbered[:3]}{'...' if len(numbered) > 3 else ''} but not the "
                f"{INDEX_NAME} they belong to; the checkpoint is incomplete (an interrupted write or copy?)"
            )
        for f in files:
            self._confined(root, f.name, root)
            self._add_file(f)

    def _read_index(self, index: Path) -> tuple[dict[str, str], dict[str, str]]:
        data = read_json(index, "safetensors index")
        if not isinstance(data, dict) or not isinstance(data.get("weight_map"), dict):
            got = type(data.get("weight_map")).__name__ if isinstance(data, dict) else type(data).__name__
            raise CheckpointError(f"{index}: not a safetensors index (expected a JSON object with a 'weight_map' object, got {got})")
        weight_map = data["weight_map"]
        for tensor, file in weight_map.items():
            if not isinstance(file, str) or not file:
                raise CheckpointError(
                    f"{index}: weight_map[{tensor!r}] must be a shard file name (a non-empty string), "
                    f"got {type(file).__name__} {file!r}"
                )
        # Tied tensors (lm_head = embed_tokens) are stored once; the index names the others.
        meta = data.get("metadata")
        tied = meta.get("torch_bq_tied", {}) if isinstance(meta, dict) else {}
        if not isinstance(tied, dict) or not all(
            isinstance(a, str) and isinstance(k, str) and k in weight_map and a not in weight_map
            for a, k in tied.items()
        ):
            raise CheckpointError(
                f"{index}: metadata.torch_bq_tied must map tied names absent from weight_map to stored ones, got {tied!r}"
            )
        return weight_map, tied

    @staticmethod
    def _confined(root: Path, name: str, where: Path) -> Path:
        """``root / name``, refusing names that leave ``root`` (absolute, ``..``, or through a symlink)."""
        if PurePosixPath(name).is_absolute() or PureWindowsPath(name).is_absolute() or PureWindowsPath(name).drive:
            raise UnsafePathError(f"{where}: names {name!r}, an absolute path; shards must be inside {root}")
        parts = re.split(r"[\\/]", name)
        if ".." in parts:
            raise UnsafePathError(f"{where}: names {name!r}, which climbs out with '..'; shards must be inside {root}")
        path = root / name
        real, real_root = os.path.realpath(path), os.path.realpath(root)
        if os.path.commonpath([real, real_root]) != real_root:
            raise UnsafePathError(
                f"{where}: {name!r} resolves to {real}, outside the checkpoint directory {real_root} (a symlink?)"
            )
        return path

    def _add_file(self, path: Path) -> None:
        f = self._file(path)
        for name in f.entries:
            if name in self._where:
                raise CheckpointError(f"{name!r} is in both {self._where[name]} and {path}")
            self._where[name] = str(path)

    def _file(self, path: Union[str, Path]) -> SafetensorsFile:
        key = str(path)
        if key not in self._files:
            self._files[key] = SafetensorsFile(key)
        return self._files[key]

    def _entry(self, name: str) -> tuple[SafetensorsFile, str]:
        """The parsed file holding ``name`` and the name stored there, reading its header on first use."""
        f = self._file(self._where[name])
        name = self._alias.get(name, name)
        if name not in f.entries:
            raise CheckpointError(f"{self._index}: maps {name!r} to {f.path.name!r}, but that shard does not hold it")
        return f, name

    # -- queries -----------------------------------------------------------------

    def keys(self) -> list[str]:
        """All tensor names stored, sorted (a tied name is readable but not listed: it is stored once)."""
        if self._tensors is not None:
            return sorted(self._tensors.keys())
        return sorted(k for k in self._where if k not in self._alias)

    def __contains__(self, name: object) -> bool:
        return name in (self._tensors if self._tensors is not None else self._where)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self._tensors) if self._tensors is not None else len(self._where) - len(self._alias)

    def file_of(self, name: str) -> Optional[str]:
        """The file holding ``name`` (``None`` for a mapping)."""
        self._require(name)
        return self._where.get(name)

    def files(self) -> list[str]:
        """The safetensors files behind this reader (empty for a mapping)."""
        return sorted(set(self._where.values()))

    def opened_files(self) -> list[str]:
        """The files whose headers have been read so far."""
        return sorted(self._files)

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of ``name`` in torch's terms (``float4_e2m1fn_x2`` counts byte pairs), read from the header.

        Natural: without the trailing unit axis torch_bq's layout stores element codes with
        (:mod:`torch_bq.checkpoint.stored`); :meth:`get` and slices return that shape too.
        """
        self._require(name)
        if self._tensors is not None:
            return tuple(self._tensors[name].shape)
        f, stored = self._entry(name)
        shape = f.torch_shape(stored)
        if self.unit_axis(name):
            shape = natural_shape(name, shape, str(f.path))
        return shape

    def unit_axis(self, name: str) -> bool:
        """Whether ``name`` is stored with torch_bq's trailing unit axis (its file's record says so)."""
        self._require(name)
        if self._tensors is not None:
            return False
        return has_unit_axis(self.records(name), self._entry(name)[1])

    def dtype(self, name: str) -> torch.dtype:
        """Torch dtype of ``name``, read from the header."""
        self._require(name)
        if self._tensors is not None:
            return self._tensors[name].dtype
        f, name = self._entry(name)
        return f.torch_dtype(name)

    def nbytes(self, name: str) -> int:
        """Size of ``name``'s data in bytes."""
        n = 1
        for d in self.shape(name):
            n *= d
        return n * self.dtype(name).itemsize

    def metadata(self, name: str) -> dict[str, str]:
        """The ``__metadata__`` of the file holding tensor ``name`` (``{}`` for a mapping)."""
        self._require(name)
        if self._tensors is not None:
            return {}
        return self._entry(name)[0].metadata

    def records(self, name: str) -> dict[str, "LayerRecord"]:
        """torch_bq's layer records in the file holding tensor ``name`` (decoded once per file; ``{}`` for a mapping)."""
        self._require(name)
        if self._tensors is not None:
            return {}
        f = self._entry(name)[0]
        key = str(f.path)
        if key not in self._records:
            self._records[key] = decode_records(f.metadata, key)
        return self._records[key]

    @property
    def config(self) -> dict:
        """``config.json`` next to the checkpoint, or ``{}``."""
        if self._config is None:
            self._config = self._side_json("config.json")
        return self._config

    def side_file(self, name: str) -> dict:
        """A JSON file next to the checkpoint (``hf_quant_config.json``...) or ``{}``; must be an object."""
        if name == "config.json":
            return self.config
        return self._side_json(name)

    def _side_json(self, name: str) -> dict:
        if self.root is None:
            return {}
        path = self.root / name
        if not (path.exists() or path.is_symlink()):
            return {}
        data = read_json(path, name)
        if not isinstance(data, dict):
            raise CheckpointError(f"{path}: expected a JSON object, got a {type(data).__name__}")
        return data

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
        """Read the whole tensor ``name`` (CPU, owned by the caller; a mapping's tensor as is)."""
        return self._read(name, None)

    def get_slice(self, name: str):
        """An indexable view of ``name`` that reads only what is indexed (``sl[i]``, ``sl[a:b]``, ``sl[i, a:b, c:d]``)."""
        self._require(name)
        if self._tensors is not None:
            return self._tensors[name]
        return _Slice(self, name)

    def get_index(self, name: str, index: int) -> torch.Tensor:
        """``name[index]`` along the first dim, reading only that part (one expert of a stack)."""
        n = self.shape(name)[0]
        if not -n <= index < n:
            raise CheckpointError(f"{name}: index {index} is out of range for its first dim of {n}")
        return self.get_slice(name)[index]

    def _read(self, name: str, index) -> torch.Tensor:
        self._require(name)
        if self._tensors is not None:
            t = self._tensors[name]
            return t if index is None else t[index]
        f, stored = self._entry(name)
        unit = self.unit_axis(name)
        if unit and isinstance(index, tuple) and len(index) > len(self.shape(name)):
            raise CheckpointError(f"{name}: cannot read {index!r} from {f.path}: {len(index)} indices for a "
                                  f"{len(self.shape(name))}-d tensor")
        try:
            t = f.read(stored, index)
        except IndexError as e:
            raise CheckpointError(f"{name}: cannot read {index!r} from {f.path}: {e}") from None
        return from_stored(name, t, str(f.path)) if unit else t

    def _require(self, name: str) -> None:
        if name not in self:
            near = self.closest(name)
            raise MissingTensorError(
                f"{name!r} is not in {self.description}" + (f"; closest names: {near}" if near else "")
            )

    # -- lifetime ----------------------------------------------------------------

    def close(self) -> None:
        """Release open files (tensors already read stay valid)."""
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointReader({self.description!r}, {len(self)} tensors)"


class _Slice:
    """``reader.get_slice(name)``: indexing reads only the selected bytes."""

    def __init__(self, reader: CheckpointReader, name: str) -> None:
        self._reader, self._name = reader, name

    @property
    def shape(self) -> tuple[int, ...]:
        return self._reader.shape(self._name)

    def __getitem__(self, index) -> torch.Tensor:
        return self._reader._read(self._name, index)


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
