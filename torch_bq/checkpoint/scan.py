"""Bounded-memory NaN-code scans for loaders and ``from_*`` constructors (docs/contract.md §1).

:func:`torch_bq.formats.find_nan_codes` builds two byte-sized temporaries the
size of the tensor it scans; for a 16384 x 16384 weight that is twice the
weight again. Loaders promise to stay within ~1.5x of the quantized bytes, so
they scan in row chunks and only re-run the full check (for its exact message
and absolute index) once a chunk is known to be bad.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import formats

__all__ = ["SCAN_CHUNK_BYTES", "scan_nan_codes", "check_scale_range"]

#: bytes of weight scanned at a time (each chunk costs about twice this in temporaries)
SCAN_CHUNK_BYTES = 4 << 20


def scan_nan_codes(
    data: Optional[torch.Tensor],
    scale: Optional[torch.Tensor],
    *,
    name: str = "weight",
    fmt: str = "fp8",
    in_features: Optional[int] = None,
) -> None:
    """Raise ``ValueError`` naming the tensor and first bad index if ``data``/``scale`` hold NaN codes.

    Same checks and messages as :func:`torch_bq.formats.find_nan_codes`
    (e8m0 code 255, fp8 bytes 0x7F/0xFF, a non-zero fp4 padding nibble for odd
    ``in_features``), with at most ``SCAN_CHUNK_BYTES`` of temporaries while the
    tensor is clean.
    """
    if scale is not None:
        formats.find_nan_codes(None, scale, name=name, fmt=fmt)
        check_scale_range(scale, name=f"{name}_scale", fmt=fmt)
    if data is None:
        return
    if data.dim() == 0 or data.shape[0] == 0:
        return
    row_bytes = max(1, data[0].numel() * data.element_size())
    rows = max(1, SCAN_CHUNK_BYTES // row_bytes)
    for r0 in range(0, data.shape[0], rows):
        r1 = min(data.shape[0], r0 + rows)
        try:
            formats.find_nan_codes(data[r0:r1], None, name=name, fmt=fmt, in_features=in_features)
        except ValueError:
            # Earlier rows are clean, so the full check's first bad index is in this chunk.
            formats.find_nan_codes(data[:r1], None, name=name, fmt=fmt, in_features=in_features)
            raise


#: the largest data magnitude each format's float32 scales multiply (e4m3 448, e2m1 6)
_DATA_MAX = {"fp8": formats.FP8_MAX, "fp4": 6.0}


def check_scale_range(scale: torch.Tensor, *, name: str = "weight_scale", fmt: str = "fp8",
                      limit: Optional[float] = None) -> None:
    """Raise ``ValueError`` if a float32 multiplier would overflow float32 on the largest data code.

    A float32 scale of 3e38 is finite and positive, but 448 x 3e38 is inf: the
    decoded weight would hold inf where the checkpoint promised a number.
    (e8m0 codes cannot overflow this way: 448 x 2^127 < float32's max.)
    """
    if scale.dtype != torch.float32 or scale.numel() == 0:
        return
    if limit is None:
        limit = torch.finfo(torch.float32).max / _DATA_MAX.get(fmt, formats.FP8_MAX)
    bad = scale > limit
    if bool(bad.any()):
        index = [int(i) for i in bad.nonzero()[0]]
        raise ValueError(
            f"{name}: found scale {scale[tuple(index)].item():g} at index {index}, above {limit:g} "
            f"(the largest {fmt} code times it overflows float32); the tensor is corrupt"
        )
