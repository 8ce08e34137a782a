"""Compatibility re-export: the bounded-memory NaN-code scan lives in :mod:`torch_bq.checkpoint.scan`."""

from ..checkpoint.scan import SCAN_CHUNK_BYTES, check_scale_range, scan_nan_codes

__all__ = ["SCAN_CHUNK_BYTES", "scan_nan_codes", "check_scale_range"]
