"""The numerical contract (docs/contract.md) as plain torch code: slow, obvious, exact.

These are the default bodies of the ``torch_bq::`` ops; every faster kernel is
tested against them.
"""

from .grouped import fp4_grouped_linear, fp8_grouped_linear
from .linear import bf16_linear, fp4_linear, fp8_linear, fp32w_linear, nvfp4_linear

__all__ = ["fp8_linear", "fp4_linear", "nvfp4_linear", "bf16_linear", "fp32w_linear", "fp8_grouped_linear", "fp4_grouped_linear"]
