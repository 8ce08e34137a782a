"""``torch_bq::`` custom ops. Importing this module registers them.

Each op's default body is the reference of :mod:`torch_bq.reference`; faster
kernels are registered per device by the backend modules.
"""

from .linear import bf16_linear, fp4_linear, fp8_linear, fp32w_linear, qdq_fp8

from . import cpu  # noqa: E402,F401  (registers the fast CPU kernels)

__all__ = ["fp8_linear", "fp4_linear", "bf16_linear", "fp32w_linear", "qdq_fp8"]
