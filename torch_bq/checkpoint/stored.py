"""How torch_bq's own layout stores element codes: one trailing unit axis, so no other reader takes them for values.

Why: an fp8 linear's codes ``weight float8_e4m3fn [N, K]`` sit under the name of
the dense parameter they replace. A reader that does not know torch_bq
(transformers without ``import torch_bq.hf``: it only warns about the unknown
``quant_method``) would cast the codes to bf16 and run them as weights. The one
thing such a reader refuses is a shape it does not expect (transformers 5.23:
``RuntimeError: You set `ignore_mismatched_sizes` to `False`, thus raising an
error``, after a load report naming each ``MISMATCH``). So every element-code
tensor torch_bq writes in its own layout carries one more dim of size 1:

=====================================  =========================  ====================
tensor (in memory)                     stored as                  formats
=====================================  =========================  ====================
linear ``{p}.weight [N, K]``           ``[N, K, 1]``              fp8 (any block)
linear ``{p}.weight [N, ceil(K/2)]``   ``[N, ceil(K/2), 1]``      fp4 (MXFP4)
experts ``{p}.gate_up_proj [E, N, .]`` ``[E, N, ., 1]``           fp8, fp4
experts ``{p}.down_proj [E, N, .]``    ``[E, N, ., 1]``           fp8, fp4
=====================================  =========================  ====================

and the layer's record in that file's ``__metadata__["torch_bq"]`` (version 2)
lists those tensors under ``unit_axis``. Scales, biases and dense tensors keep
their shapes. NVFP4 keeps ModelOpt's layout, as ModelOpt writes it; the other
families' layouts (DeepSeek, gpt-oss, ModelOpt) are read as they are.

This module is the one place the axis is added (:func:`to_stored`, used by
``convert_checkpoint``, ``save_quantized`` and ``save_pretrained`` through
:mod:`torch_bq.hf`) and removed (:func:`natural_shape` / :func:`from_stored`,
used by :class:`~torch_bq.checkpoint.CheckpointReader` and by :mod:`torch_bq.hf`'s
load ops, which receive tensors from transformers as stored). In memory, modules
and their ``state_dict()`` keep their natural shapes. A tensor is read as
stored with the axis exactly when the record of its own file says so, and the
axis must then be there; files written before (record version 1) hold natural
shapes and read as before.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping

import torch

from .errors import CheckpointError
from .record import UNIT_AXIS_FORMATS, UNIT_AXIS_LEAVES, LayerRecord, encode_records

__all__ = ["to_stored", "natural_shape", "from_stored", "has_unit_axis"]

#: the dtypes element codes are stored in (fp8 e4m3; packed fp4 bytes)
_CODE_DTYPES = (torch.float8_e4m3fn, torch.uint8)


def to_stored(
    tensors: Mapping[str, torch.Tensor], records: Mapping[str, LayerRecord]
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors of one file as torch_bq's layout stores them, and the ``__metadata__`` recording them.

    Args:
        tensors: ``name -> tensor`` in natural shapes (a state dict, or one shard of one).
        records: ``layer prefix -> LayerRecord`` of the layers the file holds (records of
            layers whose tensors are elsewhere may be included; they are written as given).

    Returns:
        ``(stored, metadata)``: ``stored`` has the code tensor of every fp8/fp4 layer
        (``{p}.weight``; ``{p}.gate_up_proj`` / ``{p}.down_proj`` for experts) as a view
        with a trailing unit axis, every other tensor as given; ``metadata`` is
        ``{"torch_bq": ...}`` with each such layer's ``unit_axis``.

    Raises:
        ValueError: a recorded fp8/fp4 layer whose code tensor is not fp8/uint8 codes.
    """
    stored = dict(tensors)
    out: dict[str, LayerRecord] = {}
    for prefix, record in records.items():
        leaves: tuple[str, ...] = ()
        if record.format in UNIT_AXIS_FORMATS:
            leaves = tuple(leaf for leaf in UNIT_AXIS_LEAVES if f"{prefix}.{leaf}" in tensors)
            for leaf in leaves:
                name = f"{prefix}.{leaf}"
                t = tensors[name]
                if t.dtype not in _CODE_DTYPES:
                    raise ValueError(f"{name}: recorded as {record.format} but holds {t.dtype}, not element codes")
                stored[name] = t.unsqueeze(-1)
        out[prefix] = replace(record, unit_axis=leaves)
    return stored, encode_records(out)


def has_unit_axis(records: Mapping[str, LayerRecord], name: str) -> bool:
    """Whether ``name`` is stored with the unit axis, by the records of the file that holds it."""
    prefix, _, leaf = name.rpartition(".")
    record = records.get(prefix)
    return record is not None and leaf in record.unit_axis


def natural_shape(name: str, shape: tuple[int, ...], where: str) -> tuple[int, ...]:
    """``shape`` without the trailing unit axis its record says ``name`` was stored with (checked)."""
    if len(shape) < 2 or shape[-1] != 1:
        raise CheckpointError(
            f"{where}: {name!r} is recorded (__metadata__['torch_bq'] unit_axis) as stored with a trailing unit "
            f"axis, but its shape is {list(shape)}"
        )
    return tuple(shape[:-1])


def from_stored(name: str, t: torch.Tensor, where: str = "the checkpoint") -> torch.Tensor:
    """``t``, a tensor stored with the unit axis, in its natural shape (a view)."""
    natural_shape(name, tuple(t.shape), where)
    return t.squeeze(-1)
