"""Drop-in modules on block-quantized weights."""

from .experts import FP4Experts, FP8Experts

__all__ = ["FP4Experts", "FP8Experts"]
