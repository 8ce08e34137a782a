"""A NumPy stand-in for the parts of AWS NKI that torch_bq's kernels use.

Test-only. ``tests/neuron/conftest.py`` puts this package on ``sys.path`` as
``nki`` when the real Neuron SDK is absent. It follows the documented
semantics of ``nki.jit`` / ``nki.simulate`` / ``nki.language`` / ``nki.isa``
and enforces the documented limits (see ``_core`` and ``isa``); it cannot tell
whether the Neuron compiler accepts a kernel, how fast it runs, or how the
hardware rounds.

    result = nki.simulate(kernel)(x_np, w_np)       # one core (torch tensors work too)
    result = nki.simulate(kernel[2])(x_np, w_np)    # LNC=2: program_id(0) in {0, 1}
"""

from __future__ import annotations

import numpy as np

from . import _core, _subset, isa, language, rules  # noqa: F401
from ._core import NkiShimError, NkiTensor

__torch_bq_stand_in__ = True  # lets torch_bq's capability check refuse the stand-in

__all__ = ["jit", "simulate", "Kernel", "NkiShimError", "last_launch"]

last_launch: "_core.Launch | None" = None  # for tests: budgets seen by the latest launch


class Kernel:
    """What ``nki.jit`` returns: callable, and ``kernel[lnc]`` picks the LNC degree."""

    def __init__(self, fn, lnc: int = 1):
        self.fn = fn
        self.lnc = lnc
        self.__name__ = getattr(fn, "__name__", "kernel")
        self.__doc__ = getattr(fn, "__doc__", None)

    def __getitem__(self, lnc) -> "Kernel":
        if isinstance(lnc, tuple):
            if len(lnc) != 1:
                raise NkiShimError(f"{self.__name__}[{lnc}]: only a 1-D launch (the LNC degree) is modelled")
            lnc = lnc[0]
        if int(lnc) not in (1, 2):
            raise NkiShimError(f"{self.__name__}[{lnc}]: Trainium2 supports LNC 1 or 2")
        return Kernel(self.fn, int(lnc))

    def __call__(self, *args, **kwargs):
        if _core.Launch.current is not None:
            raise NkiShimError(f"{rules.tag('py-decorated-helper')} the @nki.jit kernel {self.__name__} is called "
                               "from inside a kernel; call a plain helper function instead")
        return simulate(self)(*args, **kwargs)


def jit(fn=None, **options):
    if fn is None:
        return lambda f: Kernel(f)
    return fn if isinstance(fn, Kernel) else Kernel(fn)


def _torch():
    try:
        import torch
    except ImportError:  # pragma: no cover
        return None
    return torch


def _to_numpy(value) -> np.ndarray:
    """NumPy arrays pass; torch tensors become NumPy with the same bytes (bf16 via ml_dtypes)."""
    torch = _torch()
    if torch is not None and isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(_core.bfloat16)
        return t.numpy()
    return np.ascontiguousarray(value)


def _to_torch(array: np.ndarray):
    torch = _torch()
    if array.dtype == _core.bfloat16:
        return torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(array.copy())


def simulate(kernel, check_outputs_written: bool = True):
    """Run ``kernel`` on NumPy arrays: every program of the launch in turn, then return its outputs.

    ``check_outputs_written=False`` (stand-in only) is for tracing output shapes on placeholder
    inputs (zeros), where a kernel with data-dependent control flow may legitimately write nothing.
    """
    kernel = jit(kernel)

    def run(*args, **kwargs):
        global last_launch
        # What the NKI compiler refuses, refused before anything runs (rules.py: py-*).
        _subset.check_signature(kernel.fn)
        _subset.check_function(kernel.fn, is_kernel=True)
        for name, value in (*enumerate(args), *kwargs.items()):
            if isinstance(value, list):
                raise NkiShimError(f"{rules.tag('py-list-arg')} {kernel.__name__}: argument {name} is a list; "
                                   "pass a tuple")
        torch = _torch()
        as_torch = torch is not None and any(isinstance(v, torch.Tensor) for v in (*args, *kwargs.values()))
        args = [_to_numpy(v) if torch is not None and isinstance(v, torch.Tensor) else v for v in args]
        kwargs = {k: _to_numpy(v) if torch is not None and isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        launch = _core.Launch(kernel.lnc, kernel.__name__)
        names = kernel.fn.__code__.co_varnames

        results = []
        # The inputs are HBM tensors both cores of an LNC=2 launch share: a kernel that writes into an
        # input (a scatter into the tensor it returns) writes one copy, as on the device.
        stored = [_core.wrap_input(_to_numpy(v), names[i] if i < len(names) else f"arg{i}")
                  if isinstance(v, np.ndarray) else None for i, v in enumerate(args)]
        stored_kw = {k: _core.wrap_input(_to_numpy(v), k) for k, v in kwargs.items() if isinstance(v, np.ndarray)}
        for pid in range(kernel.lnc):
            # Each core gets its own handles (views) over the same bytes.
            wrapped = [v if st is None else _core.NkiTensor(st.storage, st.arr) for v, st in zip(args, stored)]
            kw = {k: (_core.NkiTensor(stored_kw[k].storage, stored_kw[k].arr) if k in stored_kw else v)
                  for k, v in kwargs.items()}
            _core.Launch.current = _core._Program(launch, pid)
            try:
                results.append(kernel.fn(*wrapped, **kw))
            finally:
                _core.Launch.current = None
        last_launch = launch
        out = _outputs(results[0], check_outputs_written)
        if as_torch:  # like the real simulate: results come back in the callers' format
            out = type(out)(_to_torch(o) for o in out) if isinstance(out, (tuple, list)) else _to_torch(out)
        return out

    return run


def _outputs(result, check_written: bool = True):
    if isinstance(result, (tuple, list)):
        return type(result)(_outputs(r, check_written) for r in result)
    if not isinstance(result, NkiTensor):
        raise NkiShimError(f"kernel returned {type(result).__name__}, expected tensors allocated in shared_hbm")
    if result.buffer != _core.MemoryRegion.shared_hbm:
        raise NkiShimError(f"kernel output {_core.fmt_shape(result)} must be allocated in nl.shared_hbm")
    if check_written and not result._mask().all():
        missing = int((~result._mask().all(axis=-1)).sum())
        raise NkiShimError(f"kernel output {_core.fmt_shape(result)}: {missing} element(s) never written")
    return np.array(result.arr, copy=True)
