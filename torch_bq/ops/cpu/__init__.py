"""Fast CPU kernels for the ``torch_bq::`` ops (C++ in ``kernels.cpp``, ``nvfp4.cpp`` and ``attention.cpp``, built on
first use).

Importing this package registers them as the ops' ``cpu`` kernels; the
reference stays each op's default body and runs whenever the kernels cannot
be built (see :mod:`torch_bq.ops._backend`).
"""

from .attention import paged_kv_write, paged_window_attention
from .linear import bf16_linear, fp4_linear, fp8_linear, fp32w_linear, nvfp4_linear, qdq_fp8

__all__ = [
    "fp8_linear", "fp4_linear", "nvfp4_linear", "bf16_linear", "fp32w_linear", "qdq_fp8",
    "paged_kv_write", "paged_window_attention",
]
