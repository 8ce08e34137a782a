"""A stand-in for TorchNeuron's ``torch_neuronx``: the ``neuron`` device, ``nki_op``, ``wrap_nki`` and the
``"neuron"`` ``torch.compile`` backend, as far as torch_bq's registration relies on them. Test-only.

It follows the contract TorchNeuron documents and implements (read from its public source,
``torch_neuronx/nki_hop.py``, its tests ``tests/nki/test_nki_op.py`` / ``test_nki_v2.py``, and
``frameworks/torch/pytorch-native-overview.rst`` of the Neuron SDK docs):

* ``nki_op(name, mutates_args=...)`` turns a typed Python function into a ``torch.library`` custom
  op whose body is that function, **registers the same function as its fake (meta) kernel**, and
  registers a ``FunctionalTensorMode`` rule that runs the function under the mode, so that
  ``torch.compile`` traces *through* the op into what the body calls. The body must therefore be
  traceable with fake tensors: no reads of tensor data, no host syncs.
* Inside the body the kernel is called as ``wrap_nki(kernel)(...)`` or ``wrap_nki(kernel)[grid](...)``
  (``grid`` a sequence, e.g. ``(2,)`` for LNC=2); that call is what appears in a compiled graph. Here
  it is one custom op, ``torch_neuronx_stand_in::nki_kernel`` (TorchNeuron uses a higher-order op,
  ``nki_kernel_wrapper``); its fake kernel traces the NKI kernel for its output shapes and dtypes, as
  TorchNeuron's does with ``dump_config`` on meta tensors.
* The ``neuron`` device is ``PrivateUse1`` renamed. This stand-in has no device memory, so a
  ``neuron`` tensor is :class:`NeuronTensor`, a wrapper over a CPU tensor: ops with a ``neuron`` kernel
  (``torch.library.register_kernel(..., "neuron")``) dispatch to it, ATen ops run on the wrapped data.
* The ``"neuron"`` compile backend lowers a graph only if every call in it is an ATen/prims op or an
  NKI kernel call: an opaque custom op (such as ``torch_bq::fp8_linear`` with a Python ``neuron``
  kernel) is refused with :class:`NeuronLoweringError`, the failure the real backend would hit.

What it cannot show: that the Neuron compiler accepts the kernels, that TorchNeuron's backend
lowers the graphs it accepts, or anything about performance.
"""

from __future__ import annotations

import collections
import operator
import types
from typing import List, Optional

import torch
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
from torch.utils._pytree import tree_map

__torch_bq_stand_in__ = True  # torch_bq's capability check refuses this module

__all__ = ["nki_op", "wrap_nki", "NeuronTensor", "to_neuron", "to_cpu", "kernel_calls", "compiled_graphs",
           "NeuronLoweringError"]

DEVICE = "neuron"

# --------------------------------------------------------------------------- #
# the device
# --------------------------------------------------------------------------- #

if torch._C._get_privateuse1_backend_name() != DEVICE:
    torch.utils.rename_privateuse1_backend(DEVICE)
    torch.utils.generate_methods_for_privateuse1_backend()
    _module = types.ModuleType("torch_neuronx_stand_in_device")
    _module.is_available = lambda: False  # no streams or events to model
    _module.device_count = lambda: 1
    _module.current_device = lambda: 0
    _module._is_in_bad_fork = lambda: False
    torch._register_device_module(DEVICE, _module)
    # A device guard and hooks, so that C++ paths that guard the device (indexing, item()) accept it;
    # torch's own helpers for a Python-only PrivateUse1 backend (experimental).
    from torch.utils.backend_registration import _DummyDeviceGuard, _DummyPrivateUse1Hook

    torch._C._acc.register_python_privateuseone_hook(_DummyPrivateUse1Hook())
    torch._C._acc.register_python_privateuseone_device_guard(_DummyDeviceGuard())


def _to_cpu_device(value):
    if isinstance(value, torch.device) and value.type == DEVICE:
        return torch.device("cpu")
    if isinstance(value, str) and value.split(":")[0] == DEVICE:
        return "cpu"
    return value


class NeuronTensor(torch.Tensor):
    """A ``neuron`` tensor of the stand-in: a CPU tensor whose device reads ``neuron:0``."""

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        if isinstance(data, NeuronTensor):
            data = data.cpu_data
        out = torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), storage_offset=data.storage_offset(), dtype=data.dtype,
            device=torch.device(DEVICE, 0), requires_grad=data.requires_grad,
        )
        out.cpu_data = data
        return out

    # A traceable wrapper subclass, so torch.compile sees neuron-device inputs.
    def __tensor_flatten__(self):
        return ["cpu_data"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return NeuronTensor(inner["cpu_data"])

    def __repr__(self):
        return f"NeuronTensor({self.cpu_data!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.name()
        # Over fake data (torch.compile tracing) an op runs its fake kernel, as on a real device.
        tracing = any(isinstance(_unwrap(t), (torch._subclasses.FakeTensor, FunctionalTensor))
                      for t in torch.utils._pytree.tree_leaves((args, kwargs)))
        if not tracing and func.namespace not in ("aten", "prims") and torch._C._dispatch_has_kernel_for_dispatch_key(
            name, "PrivateUse1"
        ):
            # An op with a neuron kernel (or a composite body) runs it, with neuron tensors.
            return func.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse1), *args, **kwargs)
        to_host = _copies_to_host(func, args, kwargs)
        args = tree_map(_to_cpu_device, tree_map(_unwrap, args))
        kwargs = tree_map(_to_cpu_device, tree_map(_unwrap, kwargs))
        out = func(*args, **kwargs)
        if to_host:
            return out
        return tree_map(lambda t: NeuronTensor(t) if isinstance(t, torch.Tensor) else t, out)


def _copies_to_host(func, args, kwargs) -> bool:
    """``func`` copies a neuron tensor to the CPU (aten.to.device takes the device positionally)."""
    if func not in (torch.ops.aten._to_copy.default, torch.ops.aten.to.device):
        return False
    target = kwargs.get("device", args[1] if func is torch.ops.aten.to.device and len(args) > 1 else None)
    return target is not None and torch.device(target).type == "cpu"


def _unwrap(t):
    if isinstance(t, NeuronTensor):
        return t.cpu_data
    if isinstance(t, (torch._subclasses.FakeTensor, FunctionalTensor)) and t.device.type == DEVICE:
        # A factory traced with device="neuron" (e.g. torch.arange(..., device=x.device)) is a plain fake
        # tensor on the neuron device, not a NeuronTensor: meet the wrapped data on the stand-in's host.
        return t.to("cpu")
    return t


def _factory_fallback(op, *args, **kwargs):
    """Ops that reach the PrivateUse1 key without a neuron tensor argument (factories such as
    ``torch.empty(..., device="neuron")``): run on CPU, return neuron tensors."""
    to_host = _copies_to_host(op, args, kwargs)  # reached inside a neuron kernel (Python key excluded)
    args = tree_map(_to_cpu_device, tree_map(_unwrap, args))
    kwargs = tree_map(_to_cpu_device, tree_map(_unwrap, kwargs))
    out = op(*args, **kwargs)
    return out if to_host else tree_map(lambda t: NeuronTensor(t) if isinstance(t, torch.Tensor) else t, out)


_fallback_lib = torch.library.Library("_", "IMPL")
_fallback_lib.fallback(_factory_fallback, "PrivateUse1")


def to_neuron(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A CPU tensor (or ``None``) as a stand-in ``neuron`` tensor."""
    return None if t is None else NeuronTensor(t.detach())


def to_cpu(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else (t.cpu_data if isinstance(t, NeuronTensor) else t)


def module_to_neuron(module: torch.nn.Module) -> torch.nn.Module:
    """Move a module's parameters and buffers to the stand-in device (what ``.to("neuron")`` does on TorchNeuron)."""
    for sub in module.modules():
        for key, p in list(sub._parameters.items()):
            if p is not None:
                sub._parameters[key] = torch.nn.Parameter(NeuronTensor(p.detach()), requires_grad=False)
        for key, b in list(sub._buffers.items()):
            if b is not None:
                sub._buffers[key] = NeuronTensor(b)
    return module


# --------------------------------------------------------------------------- #
# wrap_nki: the traceable kernel call
# --------------------------------------------------------------------------- #

kernel_calls: collections.Counter = collections.Counter()  # kernel name -> executions (not traces)
_kernels: list = []  # kernel index -> (kernel, argument names, defaults)
_kernel_index: dict = {}
_constants: dict = {}  # constants key -> (names of the tensor arguments, {name: constant value})
_shape_cache: dict = {}


class _Caller:
    """``wrap_nki(kernel)`` (and ``[grid]`` of it): merges arguments with the kernel's signature and calls the op."""

    def __init__(self, index: int, grid: tuple):
        self.index = index
        self.grid = grid

    def __getitem__(self, grid) -> "_Caller":
        # As TorchNeuron: the grid is a sequence of ints (``(2,)``), not a bare int.
        return _Caller(self.index, tuple(int(g) for g in grid))

    def __call__(self, *args, **kwargs):
        kernel, names, defaults = _kernels[self.index]
        if len(args) > len(names):
            raise TypeError(f"{kernel.__name__}: {len(args)} positional arguments for {len(names)} parameters")
        merged = dict(zip(names, args))
        for k, v in kwargs.items():
            if k not in names:
                raise TypeError(f"{kernel.__name__}: unexpected argument {k!r}")
            if k in merged:
                raise TypeError(f"{kernel.__name__}: argument {k!r} given twice")
            merged[k] = v
        for n in names:
            if n not in merged:
                if n not in defaults:
                    raise TypeError(f"{kernel.__name__}: missing argument {n!r}")
                merged[n] = defaults[n]
        tensor_names = tuple(n for n in names if isinstance(merged[n], torch.Tensor))
        constants = tuple((n, merged[n]) for n in names if n not in tensor_names)
        key = hash((self.index, tensor_names, repr(constants)))
        _constants[key] = (tensor_names, dict(constants))
        outs = torch.ops.torch_neuronx_stand_in.nki_kernel(
            self.index, list(self.grid), [merged[n] for n in tensor_names], key
        )
        return outs[0] if len(outs) == 1 else tuple(outs)


def wrap_nki(kernel, **kwargs) -> _Caller:
    """The traceable form of an ``@nki.jit`` kernel, for use inside an :func:`nki_op` body."""
    import inspect

    if kwargs:
        raise NotImplementedError("the stand-in's wrap_nki takes no options")
    fn = getattr(kernel, "fn", None)
    if fn is None or not callable(kernel):
        raise TypeError(f"wrap_nki expects an @nki.jit kernel, got {kernel!r}")
    ident = id(fn)
    if ident not in _kernel_index:
        sig = inspect.signature(fn)
        defaults = {n: p.default for n, p in sig.parameters.items() if p.default is not inspect.Parameter.empty}
        _kernel_index[ident] = len(_kernels)
        _kernels.append((kernel, list(sig.parameters), defaults))
    return _Caller(_kernel_index[ident], ())


def _launch(index: int, grid: List[int], tensors, key: int, shapes_only: bool = False):
    import nki

    kernel, _, _ = _kernels[index]
    tensor_names, constants = _constants[key]
    target = kernel[tuple(grid)] if grid else kernel
    # On placeholder zeros a data-dependent kernel may write nothing (e.g. every expert empty).
    out = nki.simulate(target, check_outputs_written=not shapes_only)(**dict(zip(tensor_names, tensors)), **constants)
    return list(out) if isinstance(out, (tuple, list)) else [out]


@torch.library.custom_op("torch_neuronx_stand_in::nki_kernel", mutates_args=())
def _nki_kernel(index: int, grid: List[int], tensors: List[Optional[torch.Tensor]], key: int) -> List[torch.Tensor]:
    on_device = any(isinstance(t, NeuronTensor) for t in tensors)
    outs = _launch(index, grid, [to_cpu(t) for t in tensors], key)
    kernel_calls[_kernels[index][0].__name__] += 1
    return [NeuronTensor(o) if on_device else o for o in outs]


@_nki_kernel.register_fake
def _(index, grid, tensors, key):
    # Trace the kernel for its outputs' shapes and dtypes (TorchNeuron: dump_config on meta tensors).
    # The stand-in traces by running it on zeros of the inputs' shapes and dtypes, once per signature.
    sig = (index, tuple(grid), key, tuple(None if t is None else (tuple(t.shape), t.dtype) for t in tensors))
    if sig not in _shape_cache:
        with torch.utils._python_dispatch._disable_current_modes():  # real tensors, outside fake/functional modes
            zeros = [None if t is None else torch.zeros(t.shape, dtype=t.dtype) for t in tensors]
            _shape_cache[sig] = [(tuple(o.shape), o.dtype) for o in _launch(index, grid, zeros, key, shapes_only=True)]
    device = next((t.device for t in tensors if t is not None), torch.device("cpu"))
    return [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in _shape_cache[sig]]


# --------------------------------------------------------------------------- #
# nki_op
# --------------------------------------------------------------------------- #


def nki_op(name: str, fn=None, mutates_args=()):
    """A custom op backed by NKI kernels; ``fn`` is both its body and its fake kernel (TorchNeuron's contract)."""

    def decorate(body):
        op = torch.library.custom_op(name, body, mutates_args=mutates_args,
                                     schema=torch.library.infer_schema(body, mutates_args=mutates_args))
        op.register_fake(body)

        def trace_through(mode, func, types, args, kwargs):
            # Under torch.compile's functionalization, record what the body calls instead of the op.
            known = (torch.Tensor, FunctionalTensor, torch._subclasses.FakeTensor, NeuronTensor)
            if any(not issubclass(t, known) for t in types):
                return NotImplemented
            with mode:
                return body(*args, **kwargs)

        op.register_torch_dispatch(FunctionalTensorMode, trace_through)
        return op

    return decorate if fn is None else decorate(fn)


# --------------------------------------------------------------------------- #
# the "neuron" torch.compile backend
# --------------------------------------------------------------------------- #


class NeuronLoweringError(RuntimeError):
    """A compiled graph holds a call the Neuron backend cannot lower (an opaque Python custom op)."""


compiled_graphs: list = []  # every forward graph the backend accepted, for tests to inspect


def _lowerable(target) -> bool:
    if target is operator.getitem:
        return True
    if isinstance(target, torch._ops.OpOverload):
        return target.namespace in ("aten", "prims") or target is torch.ops.torch_neuronx_stand_in.nki_kernel.default
    return False


def _lower(gm: torch.fx.GraphModule, example_inputs):
    for node in gm.graph.nodes:
        if node.op == "call_function" and not _lowerable(node.target):
            raise NeuronLoweringError(
                f"the Neuron backend cannot lower {node.target} (node {node.name}): only ATen ops and NKI kernel "
                "calls (wrap_nki inside an nki_op) become Neuron IR; a custom op with a Python neuron kernel does not"
            )
        if node.op not in ("placeholder", "output", "call_function", "get_attr"):
            raise NeuronLoweringError(f"the Neuron backend cannot lower a {node.op} node ({node.name})")
    compiled_graphs.append(gm)
    return gm


def _register_backend():
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    if DEVICE not in _COMPILER_FNS:
        register_backend(aot_autograd(fw_compiler=_lower, bw_compiler=_lower), name=DEVICE)


_register_backend()


def nki_kernel_nodes(gm: torch.fx.GraphModule) -> list:
    """Names of the NKI kernels a compiled graph calls, in order."""
    names = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.torch_neuronx_stand_in.nki_kernel.default:
            names.append(_kernels[node.args[0]][0].__name__)
    return names

