"""torch_bq: block-quantized (fp8 / fp4) linear layers as PyTorch custom ops.

See README.md and docs/ for the formats, ops and modules.
"""

__version__ = "0.1.0"

from . import formats, ops  # noqa: E402  (registers the torch_bq:: ops)

__all__ = ["formats", "ops", "__version__"]
