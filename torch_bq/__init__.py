"""torch_bq: block-quantized (fp8 / fp4) linear layers as PyTorch custom ops.

See README.md and docs/ for the formats, ops and modules.

``import torch_bq`` makes ``torch_bq.formats``, ``torch_bq.ops`` (which registers the
``torch_bq::`` ops) and ``torch_bq.nn`` available. ``torch_bq.distributed`` is imported
on first attribute access, so a program that does not use it does not pay for it.
``torch_bq.testing`` needs hypothesis (a test dependency) and is imported explicitly.
"""

import importlib

__version__ = "0.1.0"

from . import formats, ops  # noqa: E402  (registers the torch_bq:: ops)
from . import nn  # noqa: E402  (after ops: the modules call them)

_LAZY_SUBMODULES = ("distributed",)

__all__ = ["formats", "ops", "nn", "distributed", "__version__"]


def __getattr__(name: str):
    # PEP 562: import the subpackage when it is first named.
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY_SUBMODULES))
