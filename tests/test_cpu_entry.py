"""The one-call CPU entry points (kernels.cpp ``fp8_linear_op`` / ``fp4_linear_op``) and the eager direct path.

The entry points do in one C++ call what torch_bq/ops/cpu/linear.py's staged path
does in several (bf16(x), qdq, the kernel, bias, the output rounding), so at every
ISA level their result must be the staged path's bit for bit (the staged path is
what the twin tests of test_cpu_kernels.py hold to the contract). They refuse
(return None) what they do not take, and the public op and the modules call them
without the torch_bq:: dispatcher only where nothing could tell the difference.
"""

import shutil
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torch_bq import formats, nn as bqnn, ops, reference
from torch_bq.ops import _backend
from torch_bq.ops.cpu import linear as fast

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="needs the compiled kernels")

LEVELS = _backend.supported_cpu_isas()


def kernels_at(level):
    kernels = _backend.cpu_kernels(level)
    if kernels is None:
        pytest.fail(f"the {level} CPU kernels did not build or load")
    return kernels


def staged_fp8(kernels, x, weight, scale, bias, block, act_quant, peak, out_dtype, decode_max_m):
    """The general path of torch_bq/ops/cpu/linear.py, step by step."""
    x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
    a = kernels.qdq_fp8(x2, peak, True) if act_quant else x2.to(torch.float32)
    codes = scale if scale.dtype == torch.float32 else formats.as_e8m0_codes(scale)
    b = None if bias is None else bias.to(torch.float32).contiguous()
    y = kernels.fp8_linear(a, formats.as_fp8_bytes(weight).contiguous(), codes.contiguous(), b, *block,
                           decode_max_m, fast.PANEL_BYTES)
    return y.to(out_dtype).reshape(*x.shape[:-1], weight.shape[0])


def staged_fp4(kernels, x, weight, scale, bias, act_quant, peak, out_dtype, decode_max_m):
    x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
    a = kernels.qdq_fp8(x2, peak, True) if act_quant else x2.to(torch.float32)
    b = None if bias is None else bias.to(torch.float32).contiguous()
    y = kernels.fp4_linear(a, formats.as_fp4_bytes(weight).contiguous(), formats.as_e8m0_codes(scale).contiguous(),
                           b, decode_max_m, fast.PANEL_BYTES)
    return y.to(out_dtype).reshape(*x.shape[:-1], weight.shape[0])


def same_bits(a, b):
    """Bit for bit, except that NaN only has to be NaN (torch's own bf16 rounding gives 0xFFFF or
    0x7FC0 depending on its vector path; the contract asks for NaN, not a payload)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    nan = torch.isnan(a)
    assert torch.equal(nan, torch.isnan(b))
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    assert torch.equal(a[~nan].contiguous().view(view), b[~nan].contiguous().view(view))


# (x shape, x dtype, transposed x, act_quant, peak, out dtype, bias dtype, decode_max_m)
CASES = [
    ((1, 96), torch.bfloat16, False, True, 224.0, torch.bfloat16, None, 64),
    ((1, 96), torch.float32, False, False, 224.0, torch.float32, torch.float32, 64),
    ((2, 3, 96), torch.float16, False, True, 448.0, torch.float16, torch.bfloat16, 64),
    ((5, 96), torch.bfloat16, True, True, 224.0, torch.bfloat16, torch.float32, 64),  # strided x
    ((7, 96), torch.float32, False, True, 4.0, torch.bfloat16, torch.float16, 0),  # prefill path
    ((0, 96), torch.bfloat16, False, True, 224.0, torch.bfloat16, torch.float32, 64),  # M = 0
]


def make_x(shape, dtype, transposed):
    torch.manual_seed(1)
    if transposed:
        return (torch.randn(shape[::-1]) * 3).to(dtype).t()
    x = (torch.randn(shape) * 3).to(dtype)
    if x.numel():
        x.view(-1)[::7] = 0.0  # zero blocks and zeros within blocks
        x.view(-1)[3] = 1e-30  # bf16 subnormal range: qdq floors the block scale
    return x


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("fp8_case", [((32, 32), torch.float8_e8m0fnu), ((1, 32), torch.uint8),
                                      ((128, 128), torch.float32)], ids=str)
def test_fp8_entry_is_the_staged_path_bit_for_bit(level, case, fp8_case):
    shape, dtype, transposed, act_quant, peak, out_dtype, bias_dtype, decode_max_m = case
    block, scale_dtype = fp8_case
    kernels = kernels_at(level)
    torch.manual_seed(0)
    weight, scale = formats.quantize_fp8(torch.randn(70, 96), block=block, scale_dtype=scale_dtype)
    bias = None if bias_dtype is None else torch.randn(70).to(bias_dtype)
    x = make_x(shape, dtype, transposed)
    y = kernels.fp8_linear_op(x, weight, scale, bias, list(block), act_quant, peak, out_dtype, decode_max_m,
                              fast.PANEL_BYTES)
    assert y is not None
    same_bits(y, staged_fp8(kernels, x, weight, scale, bias, block, act_quant, peak, out_dtype, decode_max_m))


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("k", [96, 95])  # odd K: a padding nibble
def test_fp4_entry_is_the_staged_path_bit_for_bit(level, case, k):
    shape, dtype, transposed, act_quant, peak, out_dtype, bias_dtype, decode_max_m = case
    shape = (*shape[:-1], k)
    kernels = kernels_at(level)
    torch.manual_seed(0)
    weight, scale = formats.quantize_fp4(torch.randn(70, k))
    bias = None if bias_dtype is None else torch.randn(70).to(bias_dtype)
    x = make_x(shape, dtype, transposed)
    y = kernels.fp4_linear_op(x, weight, scale, bias, act_quant, peak, out_dtype, decode_max_m, fast.PANEL_BYTES)
    assert y is not None
    same_bits(y, staged_fp4(kernels, x, weight, scale, bias, act_quant, peak, out_dtype, decode_max_m))


def staged_dense(kernels, x, weight, bias, out_dtype):
    a = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).to(torch.float32).contiguous()
    b = None if bias is None else bias.to(torch.float32).contiguous()
    y = kernels.dense_linear(a, weight.contiguous(), b, fast.PANEL_BYTES)
    return y.to(out_dtype).reshape(*x.shape[:-1], weight.shape[0])


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_dense_entry_is_the_staged_path_bit_for_bit(level, case, weight_dtype):
    """bf16_linear / fp32w_linear's one-call entry (dense_linear_op; act_quant and the decode
    boundary do not apply) against the staged dense_linear call, for every x layout, out dtype
    and bias dtype of CASES; then refusals."""
    shape, dtype, transposed, _, _, out_dtype, bias_dtype, _ = case
    kernels = kernels_at(level)
    torch.manual_seed(0)
    weight = torch.randn(70, 96).to(weight_dtype)
    bias = None if bias_dtype is None else torch.randn(70).to(bias_dtype)
    x = make_x(shape, dtype, transposed)
    y = kernels.dense_linear_op(x, weight, bias, out_dtype, fast.PANEL_BYTES)
    assert y is not None
    same_bits(y, staged_dense(kernels, x, weight, bias, out_dtype))
    refused = {
        "float64 x": kernels.dense_linear_op(x.double(), weight, bias, out_dtype, 0),
        "wrong K": kernels.dense_linear_op(torch.randn(2, 95), weight, bias, out_dtype, 0),
        "fp16 weight": kernels.dense_linear_op(x, weight.half(), bias, out_dtype, 0),
        "strided weight": kernels.dense_linear_op(x, weight.t().contiguous().t(), bias, out_dtype, 0),
        "bias shape": kernels.dense_linear_op(x, weight, torch.zeros(3), out_dtype, 0),
        "x requires grad": kernels.dense_linear_op(x.float().requires_grad_(), weight, bias, out_dtype, 0),
    }
    assert all(r is None for r in refused.values()), [name for name, r in refused.items() if r is not None]


@pytest.mark.parametrize("decode_max_m", [64, 0])  # 0: the prefill tasks round into the output themselves
def test_bf16_output_rounding_matches_torch_on_special_values(decode_max_m):
    # The entry rounds fp32 -> bf16 itself: nearest even at every tie, subnormals, inf, NaN.
    kernels = _backend.cpu_kernels()
    weight = torch.ones(1, 32, dtype=torch.float8_e4m3fn)
    values = [1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2.0**-130, 3 * 2.0**-134, 1e38 * 3, float("inf"),
              float("-inf"), float("nan"), 0.0, -0.0, 65504.0, 1.00390625 * 2**100]
    # One weight row of ones with an exact power-of-two scale: y = sum(x) = x[0] when x[1:] = 0.
    for v in values:
        x = torch.zeros(1, 32)
        x[0, 0] = v
        scale = torch.ones(1, 1)
        y = kernels.fp8_linear_op(x, weight, scale, None, [1, 32], False, 224.0, torch.float32, decode_max_m,
                                  fast.PANEL_BYTES)
        y16 = kernels.fp8_linear_op(x, weight, scale, None, [1, 32], False, 224.0, torch.bfloat16, decode_max_m,
                                    fast.PANEL_BYTES)
        same_bits(y16, y.to(torch.bfloat16))
    # fp32 outputs (from fp32 bias) that sit exactly on bf16 ties, many lanes at once (the vector path).
    bias = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, 2.0**-130, float("nan"), -(1 + 2**-8), 3e38, 1e-45, 5.0] * 3)
    w = torch.zeros(24, 32, dtype=torch.float8_e4m3fn)
    y = kernels.fp8_linear_op(torch.zeros(1, 32), w, torch.ones(24, 1), bias, [1, 32], False, 224.0,
                              torch.bfloat16, decode_max_m, fast.PANEL_BYTES)
    same_bits(y, (torch.zeros(1, 24) + bias).to(torch.bfloat16))
    codes = torch.full((24, 1), 127, dtype=torch.uint8)  # e8m0 scales: the bf16 tiles where the CPU has them
    y = kernels.fp8_linear_op(torch.zeros(3, 32), w, codes, bias, [1, 32], False, 224.0, torch.bfloat16,
                              decode_max_m, fast.PANEL_BYTES)
    same_bits(y, (torch.zeros(3, 24) + bias).to(torch.bfloat16))
    y = kernels.fp8_linear_op(torch.zeros(3, 32), w, codes, bias, [1, 32], False, 224.0, torch.float16,
                              decode_max_m, fast.PANEL_BYTES)
    same_bits(y, (torch.zeros(3, 24) + bias).to(torch.float16))


class Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_entry_refuses_what_it_does_not_take():
    kernels = _backend.cpu_kernels()
    torch.manual_seed(0)
    weight, scale = formats.quantize_fp8(torch.randn(64, 64))
    x = torch.randn(2, 64)

    def call(x=x, weight=weight, scale=scale, bias=None, block=(32, 32)):
        return kernels.fp8_linear_op(x, weight, scale, bias, list(block), True, 224.0, torch.bfloat16, 16,
                                     fast.PANEL_BYTES)

    assert call() is not None
    refused = {
        "float64 x": call(x=x.double()),
        "int x": call(x=x.to(torch.int32)),
        "wrong K": call(x=torch.randn(2, 65)),
        "0-d x": call(x=torch.tensor(1.0)),
        "meta weight": call(weight=weight.to("meta")),
        "meta x": call(x=x.to("meta")),
        "strided weight": call(weight=weight.t().contiguous().t()),
        "scale shape": call(scale=scale[:1]),
        "scale dtype": call(scale=scale.view(torch.uint8).to(torch.int32)),
        "block 0": call(block=(0, 32)),
        "block mismatch": call(block=(16, 32)),
        "bias shape": call(bias=torch.zeros(3)),
        "int bias": call(bias=torch.zeros(64, dtype=torch.int32)),
        "K = 0": call(x=torch.randn(2, 0), weight=weight[:, :0], scale=scale[:, :0]),
        "x requires grad": call(x=x.clone().requires_grad_()),
    }
    assert all(y is None for y in refused.values()), [name for name, y in refused.items() if y is not None]
    with torch.no_grad():  # nothing for autograd to record: taken
        assert call(x=x.clone().requires_grad_()) is not None
    recorder = Recorder()
    with recorder:
        assert call() is None  # a dispatch mode must see the torch_bq:: op instead
    p, s4 = formats.quantize_fp4(torch.randn(64, 64))
    assert kernels.fp4_linear_op(x.double(), p, s4, None, True, 224.0, torch.bfloat16, 16, 0) is None
    assert kernels.fp4_linear_op(torch.randn(2, 62), p, s4, None, True, 224.0, torch.bfloat16, 16, 0) is None


def dispatched(fn):
    """Names of the ops the profiler saw while ``fn()`` ran (it records dispatcher calls, not modes)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {event.name for event in prof.events()}


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_eager_calls_skip_the_dispatcher_only_where_nothing_can_tell(fmt):
    torch.manual_seed(0)
    w = torch.randn(48, 64)
    if fmt == "fp8":
        weight, scale = formats.quantize_fp8(w)
        module = bqnn.FP8Linear.from_quantized(weight, scale)

        def op(x):
            return ops.fp8_linear(x, weight, scale)

        def ref(x):
            return reference.fp8_linear(x, weight, scale, None, [32, 32], True, 224.0, torch.bfloat16)
    else:
        weight, scale = formats.quantize_fp4(w)
        module = bqnn.FP4Linear.from_quantized(weight, scale)

        def op(x):
            return ops.fp4_linear(x, weight, scale)

        def ref(x):
            return reference.fp4_linear(x, weight, scale, None, True, 224.0, torch.bfloat16)

    x = torch.randn(1, 64, dtype=torch.bfloat16)
    entry, public = f"{fmt}_linear_op", f"torch_bq::{fmt}_linear"
    for fn in (lambda: op(x), lambda: module(x)):
        names = dispatched(fn)
        assert public not in names and any(n.endswith(entry) for n in names), names
        with ops.fast_kernels_disabled("cpu"):  # set_kernel_enabled: the reference body, through the op
            names = dispatched(fn)
            assert public in names and not any(n.endswith(entry) for n in names), names
            assert torch.equal(fn(), ref(x))
    recorder = Recorder()
    with recorder:
        op(x), module(x)
    assert recorder.ops.count(getattr(torch.ops.torch_bq, f"{fmt}_linear").default) == 2
    # Autograd needs the op: a grad-requiring input goes through it, and gets its gradient.
    xg = x.float().requires_grad_()
    names = dispatched(lambda: module(xg).sum().backward())
    assert public in names
    assert xg.grad is not None and xg.grad.abs().sum() > 0


def test_the_direct_path_follows_the_isa_cap():
    torch.manual_seed(0)
    weight, scale = formats.quantize_fp8(torch.randn(48, 64))
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    for level in LEVELS:
        previous = _backend.set_cpu_isa_cap(level)
        try:
            names = dispatched(lambda: ops.fp8_linear(x, weight, scale))
        finally:
            _backend.set_cpu_isa_cap(previous)
        assert f"torch_bq_cpu_{level}::fp8_linear_op" in names, names


def test_traces_and_transforms_see_the_torch_bq_op():
    # Each of these records or transforms ops from above the dispatcher: a direct call would put
    # an ISA-specific kernel op (or nothing) where torch_bq::fp8_linear belongs.
    from torch.fx.experimental.proxy_tensor import make_fx

    torch.manual_seed(0)
    weight, scale = formats.quantize_fp8(torch.randn(48, 64))
    module = bqnn.FP8Linear.from_quantized(weight, scale)
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    expected = module(x)
    graph = make_fx(module)(x).graph
    assert torch.ops.torch_bq.fp8_linear.default in [node.target for node in graph.nodes]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # TorchScript's deprecation notice
        traced = torch.jit.trace(module, x, check_trace=False)
    assert "torch_bq::fp8_linear" in [node.kind() for node in traced.graph.nodes()]
    assert torch.equal(traced(x), expected)
    for transformed, arg in ((torch.func.vmap(module), x[None]), (torch.func.functionalize(module), x)):
        names = dispatched(lambda: transformed(arg))
        assert "torch_bq::fp8_linear" in names, names
    with torch.device("cpu"):  # a TorchFunctionMode
        assert "torch_bq::fp8_linear" in dispatched(lambda: module(x))
    # torch.export: strict (dynamo traces the module; the wrappers ask is_dynamo_compiling) and
    # non-strict (the Python runs on fake tensors under a mode, which the direct call declines).
    for strict in (True, False):
        exported = torch.export.export(module, (x,), strict=strict)
        targets = [node.target for node in exported.graph.nodes]
        assert torch.ops.torch_bq.fp8_linear.default in targets, (strict, targets)
        assert torch.equal(exported.module()(x), expected)


def test_odd_argument_types_get_the_ops_own_errors():
    # The direct path passes only exact types on: anything else reaches the op's schema, whose
    # error names the public op, not an internal entry point.
    torch.manual_seed(0)
    weight, scale = formats.quantize_fp8(torch.randn(32, 32))
    x = torch.randn(1, 32)
    for kwargs in ({"out_dtype": "bfloat16"}, {"act_quant": "yes"}):
        with pytest.raises((TypeError, RuntimeError)) as direct:
            ops.fp8_linear(x, weight, scale, **kwargs)
        with ops.fast_kernels_disabled("cpu"), pytest.raises(type(direct.value)) as through_op:
            ops.fp8_linear(x, weight, scale, **kwargs)
        assert "fp8_linear_op" not in str(direct.value)
        assert str(direct.value) == str(through_op.value)


def python_headers() -> bool:
    import sysconfig

    include = sysconfig.get_path("include", scheme="posix_prefix")
    return include is not None and (Path(include) / "Python.h").exists()


@pytest.mark.skipif(not python_headers(), reason="the libraries are Python modules only when built with Python.h")
def test_each_level_calls_its_entry_points_through_its_python_module():
    # The entry points as the kernel library's Python module holds them (no torch.ops): the
    # same C++ functions of the same level, the same bits, the same refusals; the direct
    # ones also refuse while anything above the dispatcher watches.
    from torch.fx.experimental.proxy_tensor import make_fx

    torch.manual_seed(0)
    w = torch.randn(40, 96)
    w8, s8 = formats.quantize_fp8(w)
    w4, s4 = formats.quantize_fp4(w)
    x = torch.randn(1, 96, dtype=torch.bfloat16)
    seen = set()
    for level in LEVELS:
        kernels = kernels_at(level)
        module = _backend.entry_module(kernels)
        assert module is not None and module.isa == level
        fp8_op, fp4_op = fast.entry_ops(kernels)
        assert (fp8_op, fp4_op) == (module.fp8_linear_op, module.fp4_linear_op)
        assert fast.entry_ops(kernels) == (fp8_op, fp4_op)  # kept, not looked up again
        seen.add(module)
        m8 = fast.decode_max_m(kernels, "fp8", 96)
        m4 = fast.decode_max_m(kernels, "fp4", 96)
        args8 = (x, w8, s8, None, [32, 32], True, 224.0, torch.bfloat16, m8, fast.PANEL_BYTES)
        args4 = (x, w4, s4, None, True, 224.0, torch.bfloat16, m4, fast.PANEL_BYTES)
        expected8, expected4 = kernels.fp8_linear_op(*args8), kernels.fp4_linear_op(*args4)
        a = kernels.qdq_fp8(x, 224.0, True)  # and the staged kernels the benchmarks time
        staged8 = (a, formats.as_fp8_bytes(w8), formats.as_e8m0_codes(s8), None, 32, 32, m8, fast.PANEL_BYTES)
        staged4 = (a, formats.as_fp4_bytes(w4), formats.as_e8m0_codes(s4), None, m4, fast.PANEL_BYTES)
        same_bits(module.fp8_linear(*staged8), kernels.fp8_linear(*staged8))
        same_bits(module.fp4_linear(*staged4), kernels.fp4_linear(*staged4))
        for fn8, fn4 in ((fp8_op, fp4_op), (module.fp8_linear_direct, module.fp4_linear_direct)):
            same_bits(fn8(*args8), expected8)
            same_bits(fn4(*args4), expected4)
            assert fn8(x.double(), *args8[1:]) is None and fn4(x.double(), *args4[1:]) is None
            with Recorder():
                assert fn8(*args8) is None and fn4(*args4) is None
        direct8, direct4 = module.fp8_linear_direct, module.fp4_linear_direct
        with torch.device("cpu"):  # a TorchFunctionMode
            assert direct8(*args8) is None and direct4(*args4) is None
            assert fp8_op(*args8) is not None  # the ops' own functions do not look
        refused = []
        torch.func.vmap(lambda xs: refused.append(direct8(xs, *args8[1:])) or xs)(x[None])
        torch.func.functionalize(lambda xs: refused.append(direct4(xs, *args4[1:])) or xs)(x)
        make_fx(lambda xs: refused.append(direct8(xs.clone(), *args8[1:])) or xs, tracing_mode="real")(x)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TorchScript's deprecation notice, the tracer's warnings
            torch.jit.trace(lambda xs: refused.append(direct8(xs, *args8[1:])) or xs + 1, x, check_trace=False)
        assert refused == [None] * 4, refused
        assert direct8(*args8) is not None  # and taken again once they are off
    assert len(seen) == len(LEVELS)


def test_modules_find_their_tensors_wherever_they_are_registered():
    # The modules read weight, scale and bias from _buffers (cheaper than Module.__getattr__);
    # a bias moved to the parameters must still be added, not dropped.
    torch.manual_seed(0)
    w = torch.randn(48, 64)
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    bias = torch.randn(48, dtype=torch.bfloat16)
    w8, s8 = formats.quantize_fp8(w)
    w4, s4 = formats.quantize_fp4(w)
    for module, op in ((bqnn.FP8Linear.from_quantized(w8, s8, bias), lambda b: ops.fp8_linear(x, w8, s8, b)),
                       (bqnn.FP4Linear.from_quantized(w4, s4, bias), lambda b: ops.fp4_linear(x, w4, s4, b))):
        expected = op(bias)
        assert not torch.equal(expected, op(None))
        assert torch.equal(module(x), expected)
        module.bias = torch.nn.Parameter(bias.clone(), requires_grad=False)
        assert "bias" not in module._buffers
        assert torch.equal(module(x), expected)


def profiled(fn):
    """``fn()``'s Python frames (code objects) and the builtins it called, in order (``sys.setprofile``)."""
    events = []

    def record(frame, event, arg):
        if event == "call":
            events.append(frame.f_code)
        elif event == "c_call":
            events.append(arg)

    sys.setprofile(record)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return events


@pytest.mark.skipif(not python_headers(), reason="the libraries are Python modules only when built with Python.h")
def test_eager_calls_reach_the_kernel_through_the_c_route():
    # The point of the C route is to skip Python: after the first call, the public ops and the
    # modules must call the selected library's route and nothing of the Python direct path or
    # torch.ops (the profiler cannot tell: every path records the entry op's name).
    torch.manual_seed(0)
    w = torch.randn(48, 64)
    w8, s8 = formats.quantize_fp8(w)
    w4, s4 = formats.quantize_fp4(w)
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    l8, l4 = bqnn.FP8Linear.from_quantized(w8, s8), bqnn.FP4Linear.from_quantized(w4, s4)
    module = _backend.cpu_selection().entry_module
    assert module is not None
    first8, first4 = ops.fp8_linear(x, w8, s8), ops.fp4_linear(x, w4, s4)  # configures the routes
    out = []
    events = profiled(lambda: out.extend((ops.fp8_linear(x, w8, s8), l8(x), ops.fp4_linear(x, w4, s4), l4(x))))
    routes = {module.fp8_linear_route: "fp8", module.fp4_linear_route: "fp4"}
    assert [routes[e] for e in events if e in routes] == ["fp8", "fp8", "fp4", "fp4"]
    python = {e.co_name for e in events if isinstance(e, types.CodeType)}
    assert not python & {"direct_fp8_linear", "direct_fp4_linear", "_direct_route", "_configure_c_route"}, python
    assert not any(isinstance(e, types.CodeType) and e.co_filename.endswith("_ops.py") for e in events)
    expected8 = module.fp8_linear_direct(x, w8, s8, None, [32, 32], True, 224.0, torch.bfloat16,
                                         fast.decode_max_m(_backend.cpu_kernels(), "fp8", 64), fast.PANEL_BYTES)
    for y, expected in zip(out, (expected8, expected8, first4, first4)):
        same_bits(y, expected)
    same_bits(first8, expected8)


@pytest.mark.skipif(not python_headers(), reason="the libraries are Python modules only when built with Python.h")
@pytest.mark.parametrize("level", LEVELS)
def test_the_c_route_refuses_what_the_python_route_refuses(level, monkeypatch):
    # At every level: the route a cap change leads to (the old route's guard no longer holds, so
    # its Python fallback configures the new level's), refusing (None) every call the Python
    # direct path would send to the op, and following a replaced decode_max_m.
    from torch.fx.experimental.proxy_tensor import make_fx

    torch.manual_seed(0)
    w = torch.randn(40, 96)
    w8, s8 = formats.quantize_fp8(w)
    w4, s4 = formats.quantize_fp4(w)
    x = torch.randn(2, 96, dtype=torch.bfloat16)
    previous = _backend.set_cpu_isa_cap(level)
    try:
        kernels = _backend.cpu_kernels()
        module = _backend.entry_module(kernels)
        assert module is not None and module.isa == level
        ops.fp8_linear(x, w8, s8), ops.fp4_linear(x, w4, s4)
        route8, route4 = ops.linear._direct["fp8_linear"], ops.linear._direct["fp4_linear"]
        assert (route8, route4) == (module.fp8_linear_route, module.fp4_linear_route)
        m8, m4 = fast.decode_max_m(kernels, "fp8", 96), fast.decode_max_m(kernels, "fp4", 96)
        args8 = (x, w8, s8, None, (32, 32), True, 224.0, torch.bfloat16)
        args4 = (x, w4, s4, None, True, 224.0, torch.bfloat16)
        same_bits(route8(*args8), module.fp8_linear_direct(*args8, m8, fast.PANEL_BYTES))
        same_bits(route4(*args4), module.fp4_linear_direct(*args4, m4, fast.PANEL_BYTES))

        class Sub(torch.Tensor):
            pass

        refused = [
            route8(x.double(), *args8[1:]),  # the entry point's own refusal
            route8(x.as_subclass(Sub), *args8[1:]),
            route8(x[0, 0], *args8[1:]),  # 0-d
            route8(*args8[:4], [32, 32.0], *args8[5:]),
            route8(*args8[:4], (32,), *args8[5:]),
            route8(*args8[:4], (32, 1 << 70), *args8[5:]),
            route8(*args8[:5], 1, *args8[6:]),  # act_quant not a bool
            route8(*args8[:6], 224, *args8[7:]),  # peak not a float
            route8(*args8[:6], 449.0, *args8[7:]),  # out of the peak's range
            route8(*args8[:7], "bfloat16"),
            route4(*args4[:3], torch.zeros(40).as_subclass(Sub), *args4[4:]),
            route4(*args4[:5], float("nan"), *args4[6:]),
        ]
        with ops.fast_kernels_disabled("cpu"):
            refused += [route8(*args8), route4(*args4)]
        with Recorder():
            refused += [route8(*args8), route4(*args4)]
        with torch.device("cpu"):  # a TorchFunctionMode
            refused += [route8(*args8), route4(*args4)]
        torch.func.vmap(lambda xs: refused.append(route8(xs, *args8[1:])) or xs)(x[None])
        make_fx(lambda xs: refused.append(route4(xs.clone(), *args4[1:])) or xs, tracing_mode="real")(x)
        assert refused == [None] * len(refused), refused
        assert route8(*args8) is not None and route4(*args4) is not None  # and taken again

        # decode_max_m replaced: the route's guard fails, its Python fallback routes the call
        # with the new rule (here: every M on the prefill path) and leaves the route unconfigured.
        before = torch.tensor(kernels.prefill_counts())
        monkeypatch.setattr(fast, "decode_max_m", lambda kernels, fmt, k: 0)
        events = profiled(lambda: route8(*args8))
        assert any(isinstance(e, types.CodeType) and e.co_name == "direct_fp8_linear" for e in events)
        assert int((torch.tensor(kernels.prefill_counts()) - before).sum()) > 0
        assert ops.linear._direct["fp8_linear"] is route8
    finally:
        _backend.set_cpu_isa_cap(previous)
