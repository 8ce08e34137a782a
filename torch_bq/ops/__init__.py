"""``torch_bq::`` custom ops. Importing this module registers them.

Each op's default body is the reference of :mod:`torch_bq.reference`; faster
kernels are registered per device by the backend modules.
"""

from .attention import paged_kv_write, paged_window_attention
from .grouped import fp4_grouped_linear, fp8_grouped_linear
from .linear import (
    bf16_linear,
    fp4_linear,
    fp4_linear_direct,
    fp8_linear,
    fp8_linear_direct,
    fp32w_linear,
    nvfp4_linear,
    qdq_fp8,
)
from . import autograd as _autograd  # noqa: F401,E402  (registers the input-gradient backwards)
from .nki import register as _nki_register  # noqa: F401  (neuron kernels, only where the Neuron SDK is)
from . import cpu  # noqa: F401,E402  (fast CPU kernels, loaded on first use)
from ._backend import backend_info, fast_kernels_disabled, set_cpu_isa_cap  # noqa: E402

__all__ = [
    "fp8_linear",
    "fp4_linear",
    "fp8_linear_direct",
    "fp4_linear_direct",
    "nvfp4_linear",
    "bf16_linear",
    "fp32w_linear",
    "qdq_fp8",
    "fp8_grouped_linear",
    "fp4_grouped_linear",
    "paged_kv_write",
    "paged_window_attention",
    "backend_info",
    "set_cpu_isa_cap",
    "fast_kernels_disabled",
]
