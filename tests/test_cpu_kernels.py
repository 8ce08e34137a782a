"""The fast CPU kernels (torch_bq/ops/cpu) against the contract, next to the reference.

Every math test body runs over the reference and each ISA level of the
compiled kernels this CPU has (``generic``, ``avx2``, ``avx512``,
``avx512_bf16``: one library per level, all loaded into this process), which
share one positional signature. A level that does not load fails its tests
(or skips them where no C++ compiler exists), never runs the reference in its
place. Linear results are checked against float64 with the bound of
:func:`torch_bq.testing.assert_linear_close` (fp32 accumulation of K + 1 terms
in any order plus one output rounding); qdq is bit-exact.
"""

import math
import os
import shutil
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from torch_bq import formats, ops, reference
from torch_bq.ops import _backend
from torch_bq.ops.cpu import linear as fast
from torch_bq.testing import activations, assert_linear_close, fp4_weights, fp8_weights

HAS_COMPILER = shutil.which("c++") is not None
LEVELS = _backend.supported_cpu_isas()
IMPLS = ["reference", *LEVELS]


def at_level(level, kernel):
    """``kernel`` (a fast wrapper of torch_bq.ops.cpu.linear) run with the ``level`` kernels selected."""

    def run(*args):
        if _backend.cpu_kernels(level) is None:
            if HAS_COMPILER or os.environ.get(_backend.REQUIRE_ENV):
                pytest.fail(f"the {level} CPU kernels did not build or load")
            pytest.skip(f"no C++ compiler and no installed {level} library")
        previous = _backend.set_cpu_isa_cap(level)
        try:
            assert _backend.cpu_selection().isa == level
            return kernel(*args)
        finally:
            _backend.set_cpu_isa_cap(previous)

    return run


FP8 = {"reference": reference.fp8_linear, **{level: at_level(level, fast.fp8_linear) for level in LEVELS}}
FP4 = {"reference": reference.fp4_linear, **{level: at_level(level, fast.fp4_linear) for level in LEVELS}}
QDQ = {"reference": formats.qdq_fp8, **{level: at_level(level, fast.qdq_fp8) for level in LEVELS}}
BF16 = {"reference": reference.bf16_linear, **{level: at_level(level, fast.bf16_linear) for level in LEVELS}}
FP32W = {"reference": reference.fp32w_linear, **{level: at_level(level, fast.fp32w_linear) for level in LEVELS}}
impls = pytest.mark.parametrize("impl", IMPLS)


def other_than(impl):
    """The twin a qdq result is compared with bit for bit: the reference, or the best level for the reference."""
    return "reference" if impl != "reference" else LEVELS[-1]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def operand(x, act_quant, peak=224.0):
    return formats.qdq_fp8(x, peak) if act_quant else x.to(torch.bfloat16)


@pytest.fixture
def threads():
    """Set torch's thread count inside a test; restored afterwards."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.fixture
def small_panels(monkeypatch):
    """Prefill panels of 8 rows, so small weights cross several panels and a partial last one."""
    monkeypatch.setattr(fast, "PANEL_BYTES", 1)


# --------------------------------------------------------------------------- #
# the kernels are there, one library per level, and are what the ops run
# --------------------------------------------------------------------------- #


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler: the reference fallback is tested below")
def test_every_level_the_cpu_has_loads_and_the_best_one_runs():
    info = ops.backend_info()["cpu"]
    assert info["supported"] == list(LEVELS)
    assert info["kernels"] == "fast" and info["isa"] == _backend.cpu_isa()
    for level in LEVELS:
        kernels = _backend.cpu_kernels(level)
        assert kernels is not None, f"{level} did not load"
        assert kernels.isa() == level
        assert kernels.vectorized() == (level != "generic")


def test_levels_follow_the_cpu_features(monkeypatch):
    """The level comes from the CPU's own flags: AVX2 needs FMA and F16C too, AVX-512 needs F/BW/VL/DQ."""
    AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq")
    LEVELS_ALL = ("generic", "avx2", "avx512", "avx512_bf16")
    cases = [
        ({"sse2"}, ("generic",)),
        ({"avx2", "fma"}, ("generic",)),
        ({"avx2", "fma", "f16c", "avx512f"}, ("generic", "avx2")),
        ({"avx2", "fma", "f16c", *AVX512}, ("generic", "avx2", "avx512")),
        ({"avx2", "fma", "f16c", *AVX512, "avx512_bf16", "avx512_vnni"}, ("generic", "avx2", "avx512")),  # Cooper Lake
        ({"avx2", "fma", "f16c", *AVX512, "avx512_bf16", "avx512_vnni", "avx512vbmi"}, LEVELS_ALL),
    ]
    monkeypatch.setattr(_backend.platform, "machine", lambda: "x86_64")
    for features, levels in cases:
        monkeypatch.setattr(_backend, "cpu_features", lambda features=features: frozenset(features))
        assert _backend.supported_cpu_isas() == levels, features
    monkeypatch.setattr(_backend.platform, "machine", lambda: "aarch64")
    assert _backend.supported_cpu_isas() == ("generic",)


def test_isa_cap_by_function_and_environment(monkeypatch):
    best = LEVELS[-1]
    monkeypatch.delenv(_backend.ISA_ENV, raising=False)
    assert _backend.cpu_isa() == best
    previous = _backend.set_cpu_isa_cap("generic")
    try:
        assert _backend.cpu_isa() == "generic"
        monkeypatch.setenv(_backend.ISA_ENV, best)
        assert _backend.cpu_isa() == "generic"  # the function's cap wins over the environment's
    finally:
        _backend.set_cpu_isa_cap(previous)
    assert _backend.cpu_isa() == best
    monkeypatch.setenv(_backend.ISA_ENV, "generic")
    assert _backend.cpu_isa() == "generic"
    monkeypatch.setenv(_backend.ISA_ENV, "avx3")
    with pytest.raises(ValueError, match=r"TORCH_BQ_CPU_ISA: expected one of generic, avx2"):
        _backend.cpu_isa()
    with pytest.raises(ValueError, match="CPU ISA level: expected one of"):
        _backend.set_cpu_isa_cap("sse4")


def kernel_calls(fn):
    """``fn()`` and the names of the selected kernel library's ops it ran (profiler events)."""
    ns = _backend._isa_table().op_namespace(_backend.cpu_selection().isa) + "::"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn()
    return out, sorted(e.name[len(ns):] for e in prof.events() if e.name.startswith(ns))


@pytest.mark.skipif(not HAS_COMPILER, reason="needs the compiled kernels")
def test_ops_dispatch_to_the_fast_kernels_and_set_kernel_enabled_switches_them_off():
    # Every route to a kernel (the eager direct path's C route included) must obey
    # set_kernel_enabled: switched off, the ops run their reference bodies.
    torch.manual_seed(0)
    d, s = formats.quantize_fp8(torch.randn(40, 64))
    p, s4 = formats.quantize_fp4(torch.randn(40, 64))
    x = torch.randn(3, 64)

    def run():
        return ops.fp8_linear(x, d, s), ops.fp4_linear(x, p, s4), ops.qdq_fp8(x)

    run()  # configures the direct path's C route
    assert kernel_calls(run)[1] == ["fp4_linear_op", "fp8_linear_op", "qdq_fp8"]
    with ops.fast_kernels_disabled("cpu"):
        (y8, y4, q), names = kernel_calls(run)
    assert names == []  # dispatch went to the reference bodies
    assert torch.equal(y8, reference.fp8_linear(x, d, s, None, [32, 32], True, 224.0, torch.bfloat16))
    assert torch.equal(y4, reference.fp4_linear(x, p, s4, None, True, 224.0, torch.bfloat16))
    assert torch.equal(bits(q), bits(formats.qdq_fp8(x)))
    assert kernel_calls(run)[1] == ["fp4_linear_op", "fp8_linear_op", "qdq_fp8"]  # and back on after the block


# --------------------------------------------------------------------------- #
# linear: hand-written shapes, every block shape and scale dtype
# --------------------------------------------------------------------------- #

FP8_CASES = [
    # (N, K, block, scale dtype)
    (64, 64, (32, 32), torch.float8_e8m0fnu),
    (130, 300, (128, 128), torch.float32),  # N, K not block multiples; DeepSeek scales
    (37, 97, (1, 32), torch.uint8),  # MXFP8
    (50, 70, (7, 13), torch.float8_e8m0fnu),  # a block that is no multiple of the 16-wide vector
    (33, 100, (16, 48), torch.float32),
    (5, 1, (32, 32), torch.uint8),  # K = 1
]


@impls
@pytest.mark.parametrize("n, k, block, scale_dtype", FP8_CASES)
@pytest.mark.parametrize("rows", [(0,), (1,), (3,), (16,), (17,), (2, 9, 3)], ids=str)
def test_fp8_linear_shapes(impl, n, k, block, scale_dtype, rows, small_panels):
    torch.manual_seed(n * k + len(rows))
    d, s = formats.quantize_fp8(torch.randn(n, k), block, scale_dtype)
    x = torch.randn(*rows, k)
    bias = torch.randn(n, dtype=torch.float16)
    for act_quant, b, out_dtype in ((True, None, torch.bfloat16), (False, bias, torch.float32), (True, bias, torch.float16)):
        y = FP8[impl](x, d, s, b, list(block), act_quant, 224.0, out_dtype)
        assert y.dtype == out_dtype and y.shape == (*rows, n)
        w = formats.dequantize_fp8(d, s, block, torch.float32)
        assert_linear_close(y, operand(x, act_quant), w, b, msg=f"{block} act_quant={act_quant}")


@impls
@pytest.mark.parametrize("n, k", [(64, 64), (37, 97), (20, 33), (9, 1), (3, 31), (40, 130)])
@pytest.mark.parametrize("rows", [(0,), (1,), (2,), (17,), (4, 5)], ids=str)
def test_fp4_linear_shapes(impl, n, k, rows, small_panels):
    torch.manual_seed(n + k)
    p, s = formats.quantize_fp4(torch.randn(n, k))
    x = torch.randn(*rows, k, dtype=torch.bfloat16)
    bias = torch.randn(n)
    for act_quant, b, out_dtype in ((True, None, torch.bfloat16), (False, bias, torch.float32)):
        y = FP4[impl](x, p, s, b, act_quant, 448.0, out_dtype)
        assert y.dtype == out_dtype and y.shape == (*rows, n)
        assert_linear_close(y, operand(x, act_quant, 448.0), formats.dequantize_fp4(p, s, k, torch.float32), b)


@impls
def test_fp8_float8_storage_and_int8_fp4_storage(impl):
    torch.manual_seed(5)
    w = torch.randn(48, 80)
    d, s = formats.quantize_fp8(w)  # float8_e4m3fn data, float8_e8m0fnu scale
    x = torch.randn(2, 80)
    as_bytes = FP8[impl](x, d.view(torch.uint8), s.view(torch.uint8), None, [32, 32], True, 224.0, torch.float32)
    assert torch.equal(FP8[impl](x, d, s, None, [32, 32], True, 224.0, torch.float32), as_bytes)
    p, s4 = formats.quantize_fp4(w)
    y = FP4[impl](x, p.view(torch.float4_e2m1fn_x2), s4, None, True, 224.0, torch.float32)
    assert torch.equal(y, FP4[impl](x, p.view(torch.int8), s4.view(torch.uint8), None, True, 224.0, torch.float32))


@impls
@pytest.mark.parametrize("m", [2, 6])  # 6: the AVX2 tiles over two weight rows leave their block loop too
def test_fp8_huge_scales_take_the_exact_path(impl, m):
    """Scales near 2**127: the vector decoder's folded scale would overflow, the value does not."""
    n, k = 8, 64
    data = torch.full((n, k), 0x01, dtype=torch.uint8)  # e4m3 subnormal 2**-9
    data[:, ::3] = 0x8A  # -2**-6 * 1.25
    codes = torch.tensor([[254, 120]] * (n // 8), dtype=torch.uint8)  # 2**127 and 2**-7
    x = torch.randn(m, k) * 2.0**-100
    y = FP8[impl](x, data, codes, None, [8, 32], False, 224.0, torch.float32)
    w = formats.dequantize_fp8(data, codes, (8, 32), torch.float32)
    assert torch.isfinite(w).all() and torch.isfinite(y).all()
    assert_linear_close(y, operand(x, False), w)
    scale32 = torch.tensor([[3.0e38, 1.5]], dtype=torch.float32)
    y = FP8[impl](x, data, scale32, None, [8, 32], False, 224.0, torch.float32)
    assert_linear_close(y, operand(x, False), formats.dequantize_fp8(data, scale32, (8, 32), torch.float32))


@impls
@pytest.mark.parametrize("block", [(1, 32), (32, 32)])
@pytest.mark.parametrize("flush_denormal", [False, True])
def test_fp8_single_row_scale_range_and_subnormals(impl, block, flush_denormal, threads):
    """M = 1 with 32-wide e8m0 blocks (the kernel's whole-block path, which
    decodes E4M3 subnormals through fp32 subnormals and needs scale * 2**120
    finite): codes up to 134 take that path, a larger code hands the rest of
    the row to the general loop, and with denormals-are-zero set (torch's
    flush_denormal) the path is not used. Every weight element is subnormal
    or small, so a decoder that dropped subnormals would return about zero."""
    threads(1)  # flush_denormal applies to the calling thread only
    n, k = 8, 32 * 6 + 7  # two 4-row tiles; a partial last block
    data = torch.full((n, k), 0x01, dtype=torch.uint8)  # e4m3 subnormal 2**-9
    data[:, 1::3] = 0x86  # -2**-9 * 6
    data[:, 2::5] = 0x0B  # 2**-6 * 1.375
    codes = torch.tensor([130, 134, 0, 135, 100, 127, 125], dtype=torch.uint8).repeat(-(-n // block[0]), 1)
    codes[-1, 3] = 134  # with (1, 32): the last tile leaves the fast path one block later
    x = torch.randn(1, k)
    w = formats.dequantize_fp8(data, codes, block, torch.float32)
    torch.set_flush_denormal(flush_denormal)
    try:
        y = FP8[impl](x, data, codes, None, list(block), False, 224.0, torch.float32)
    finally:
        torch.set_flush_denormal(False)
    assert_linear_close(y, operand(x, False), w)


@impls
@given(weight=fp8_weights(max_n=70, max_k=200), act_quant=st.booleans(), data=st.data())
def test_fp8_linear_property_decode_and_prefill(impl, weight, act_quant, data):
    """Row counts on both sides of DECODE_MAX_M."""
    n, k = weight.data.shape
    x = data.draw(activations(k, max_rows=24, max_exponent=6))
    y = FP8[impl](x, weight.data, weight.scale, None, list(weight.block), act_quant, 224.0, torch.float32)
    assert_linear_close(y, operand(x, act_quant), weight.dequantize())


@impls
@given(weight=fp4_weights(max_n=70, max_k=200), data=st.data())
def test_fp4_linear_property_decode_and_prefill(impl, weight, data):
    x = data.draw(activations(weight.in_features, max_rows=24, max_exponent=6))
    y = FP4[impl](x, weight.packed, weight.scale, None, True, 224.0, torch.float32)
    assert_linear_close(y, operand(x, True), weight.dequantize())


@impls
@pytest.mark.parametrize("n, k", [(64, 64), (130, 300), (37, 97), (5, 1)])
@pytest.mark.parametrize("rows", [(0,), (1,), (3,), (17,), (2, 70)], ids=str)
def test_dense_linear_shapes(impl, n, k, rows):
    """bf16_linear and fp32w_linear (its weight narrowed to bf16 element by element)."""
    torch.manual_seed(n + k + len(rows))
    w = torch.randn(n, k) * torch.logspace(-3, 3, k)
    x = torch.randn(*rows, k)
    bias = torch.randn(n, dtype=torch.float16)
    for b, out_dtype in ((None, torch.bfloat16), (bias, torch.float32), (bias, torch.float16)):
        y = BF16[impl](x, w.to(torch.bfloat16), b, out_dtype)
        assert y.dtype == out_dtype and y.shape == (*rows, n)
        assert_linear_close(y, x.to(torch.bfloat16), w.to(torch.bfloat16), b)
        y = FP32W[impl](x, w, b, out_dtype)
        assert_linear_close(y, x.to(torch.bfloat16), w.to(torch.bfloat16), b)


@impls
def test_fp32w_narrows_weights_to_bf16_as_torch_does(impl):
    """Ties to even, values just above a tie or rounding up to the next binade, fp32 subnormals, NaN:
    the kernels' fp32 -> bf16 rounding of the weight must be torch's."""
    torch.manual_seed(4)
    n, k = 70, 96
    w = torch.randn(n, k)
    w[0, :32] = 1.0 + 2.0**-8  # a tie: rounds to even (1.0)
    w[1, :32] = 1.0 + 3 * 2.0**-8  # a tie: rounds up
    w[2, :32] = 2.0**100 * (1 + 2.0**-8 + 2.0**-20)  # just above a tie: rounds up
    w[3, :32] = -(1.0 - 2.0**-10)  # rounds up to -1.0 (next binade)
    w[4, :32] = 1e-40  # fp32 subnormal: a bf16 subnormal (or zero)
    w[5, 40] = float("nan")
    x = torch.randn(20, k)
    got = FP32W[impl](x, w, None, torch.float32)
    exact_w = w.to(torch.bfloat16)
    assert torch.equal(got.isnan(), reference.fp32w_linear(x, w, None, torch.float32).isnan())
    finite = torch.isfinite(exact_w).all(dim=1)
    assert_linear_close(got[:, finite], x.to(torch.bfloat16), exact_w[finite])


def prefill_counts(level):
    """Tiles run so far by the bf16 microkernel, the fp32 microkernel and at::mm panels, at ``level``."""
    return torch.tensor(_backend.cpu_kernels(level).prefill_counts())


PREFILL_PATH = {"generic": 2, "avx2": 1, "avx512": 1, "avx512_bf16": 0}


@pytest.mark.parametrize("level", LEVELS)
def test_prefill_runs_the_gemm_of_its_level(level):
    """bf16 microkernel with AVX512_BF16, fp32 microkernel with AVX2 / AVX-512, at::mm panels without."""
    torch.manual_seed(1)
    d, s = formats.quantize_fp8(torch.randn(130, 96))
    x = torch.randn(max(limits["fp8"] for limits in fast.DECODE_MAX_M.values()) + 1, 96)  # the prefill path
    before = prefill_counts(level)
    y = FP8[level](x, d, s, None, [32, 32], True, 224.0, torch.float32)
    grown = prefill_counts(level) - before
    assert grown[PREFILL_PATH[level]] > 0 and grown.sum() == grown[PREFILL_PATH[level]], grown
    assert_linear_close(y, operand(x, True), formats.dequantize_fp8(d, s, (32, 32), torch.float32))


@pytest.mark.skipif("avx512_bf16" not in LEVELS, reason="needs a CPU with AVX512_BF16")
def test_bf16_prefill_leaves_tiles_that_could_meet_a_subnormal_to_fp32():
    """vdpbf16ps reads and writes subnormals as zero. A tile goes to the bf16 microkernel only
    when no input is subnormal and the product of the lowest set bits of A and its weights is
    at least 2**-126 (then every product and partial sum is zero or normal); the others
    (and fp32 scales, whose weights are not exact in bf16) take the fp32 microkernel. Each case
    has enough weight in the subnormal range to fail the bound if it were flushed."""
    level = "avx512_bf16"
    torch.manual_seed(2)
    rows = _backend.cpu_kernels(level).prefill_task_rows()  # three tasks: rows, rows and 2 weight rows
    assert rows % 32 == 0
    n, k = 2 * rows + 2, 96
    m = fast.DECODE_MAX_M[level]["fp8"] + 4  # past the decode path: the prefill tiles are what is tested
    data = formats.quantize_fp8(torch.randn(n, k))[0].view(torch.uint8).clone()
    data[rows : rows + 32] = 0x08 | (data[rows : rows + 32] & 0x80)  # e4m3 2**-6, signs kept
    x = torch.randn(m, k)

    def run(codes, x, act_quant=False, scale=None):
        before = prefill_counts(level)
        y = FP8[level](x, data, codes if scale is None else scale, None, [32, 32], act_quant, 224.0, torch.float32)
        w = formats.dequantize_fp8(data, codes if scale is None else scale, (32, 32), torch.float32)
        assert_linear_close(y, operand(x, act_quant), w)
        return (prefill_counts(level) - before)[:2].tolist()  # [bf16 tiles, fp32 tiles]

    normal = torch.full(((n + 31) // 32, 3), 127, dtype=torch.uint8)
    assert run(normal, x, act_quant=True) == [3, 0]
    small = normal.clone()
    small[rows // 32, :] = 5  # the 32 rows set above (e4m3 2**-6 each): weights 2**-128, fp32 subnormals
    assert run(small, x) == [2, 1]
    tiny_x = x.clone()
    tiny_x[3, :] = 1e-39 * x[3].sign()  # a row of bf16 subnormals in A: every tile
    assert run(normal, tiny_x) == [0, 3]
    # Normal A with lowest bit 2**-107 (values 2**-100 * 1..7): products with weights
    # whose lowest bit is 2**-36 (code 100) fall below 2**-126, with 2**-9 (code 127) they do not.
    low_x = torch.randint(1, 8, (m, k)) * torch.randn(m, k).sign() * 2.0**-100
    quiet = normal.clone()
    quiet[-1, :] = 100  # the last two rows: the third task
    assert run(quiet, low_x) == [2, 1]
    assert run(None, x, scale=torch.rand(normal.shape) + 0.5) == [0, 3]
    # bf16 weights: scanned while copied; the second task's rows subnormal (2**-130 and below)
    w = torch.randn(n, k)
    w[rows : 2 * rows] *= 2.0**-130
    before = prefill_counts(level)
    y = BF16[level](x, w.to(torch.bfloat16), None, torch.float32)
    assert (prefill_counts(level) - before)[:2].tolist() == [2, 1]
    assert_linear_close(y, x.to(torch.bfloat16), w.to(torch.bfloat16))


@pytest.mark.skipif("avx512_bf16" not in LEVELS, reason="the CPU has no AVX-512 BF16")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("block", [(1, 32), (32, 32), (128, 128)])
@pytest.mark.parametrize("groups", [3, 33])  # 33: tasks of 2 row groups (2 threads) or one task (1 thread)
def test_bf16_prefill_decodes_the_next_panel_inside_the_multiply(block, threads, groups):
    """On the bf16 tiles the panel of K chunk i + 1 is decoded by steps inside chunk i's register
    tiles where the lean decoders cover it (whole 32-element units, e8m0 codes, fp8 codes up to 134
    and no DAZ); other chunks are decoded on their own, and a chunk whose bound says subnormal takes
    the fp32 microkernel after its job decoded it; a task of several row groups decodes each
    group's first panel during the previous group's last chunk. K = 4 chunks + 64 (a partial
    128-block in the last); per row group, the codes choose the route of each chunk. A panel step that wrote the wrong
    rows, elements or scale, or a chunk that skipped its decode, fails the derived bound (rows
    8..15 hold only e4m3 subnormals in chunk 1)."""
    level = "avx512_bf16"
    rows = _backend.cpu_kernels(level).prefill_task_rows()
    n, k = (groups - 1) * rows + 5, 4 * 1024 + 64
    bn, bk = block
    torch.manual_seed(bn + bk + threads)
    data, codes = formats.quantize_fp8(torch.randn(n, k), block, torch.uint8)
    data = data.view(torch.uint8).clone()
    # Rows 8..15 of chunk 1: e4m3 subnormals only (1..7 * 2**-9, signs kept), a quarter of their terms.
    data[8:16, 1024:2048] = torch.randint(1, 8, (8, 1024), dtype=torch.uint8) | (data[8:16, 1024:2048] & 0x80)
    codes = codes.clone()
    chunk = lambda i: slice(i * 1024 // bk, (i + 1) * 1024 // bk)  # noqa: E731
    big, small = (rows + 4) // bn, (2 * rows + 1) // bn  # scale rows in the second and third task
    codes[big, chunk(2)] = 140  # fp8: above the lean decoders' codes, decoded on its own
    codes[small, chunk(1)] = 5  # weights of 2**-131 and below: the fp32 microkernel
    codes[-1, chunk(0)] = 140  # the last group's first panel (decoded by a job when it is not a task's first)
    row_small = torch.zeros(n, dtype=torch.bool)
    row_small[small * bn : (small + 1) * bn] = True
    fp32_groups = sum(bool(row_small[g * rows : (g + 1) * rows].any()) for g in range(groups))
    x = torch.randn(2 * 64 + 3, k)  # past every DECODE_MAX_M; a 3-row last A block
    w = formats.dequantize_fp8(data, codes, block, torch.float32)
    bias = torch.randn(n)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        before = prefill_counts(level)
        y = FP8[level](x, data, codes, bias, list(block), True, 224.0, torch.float32)
        counts = (prefill_counts(level) - before)[:2].tolist()
    finally:
        torch.set_num_threads(previous_threads)
    assert_linear_close(y, operand(x, True), w, bias)
    assert counts == [groups - fp32_groups, fp32_groups]
    if block == (1, 32):  # MXFP4 through the same steps; codes of 5 stay normal there (e2m1 lowest bit 2**-1)
        p, s4 = formats.quantize_fp4(torch.randn(n, k))
        s4 = s4.view(torch.uint8).clone()
        s4[rows + 4, chunk(2)] = 140
        torch.set_num_threads(threads)
        try:
            y4 = FP4[level](x, p, s4, None, False, 224.0, torch.float32)
        finally:
            torch.set_num_threads(previous_threads)
        assert_linear_close(y4, x.to(torch.bfloat16), formats.dequantize_fp4(p, s4, k, torch.float32))


@pytest.mark.skipif("avx512_bf16" not in LEVELS, reason="needs a CPU with AVX512_BF16")
def test_bf16_chunks_after_an_fp32_chunk_keep_its_subnormal_partial_sums():
    """A chunk that takes the fp32 microkernel can leave subnormal partial sums in C^T, which a
    later bf16 chunk's vdpbf16ps would read as zero: once a row group has run an fp32 chunk, its
    later chunks run fp32 too. Rows whose only nonzero weights are in chunk 0 and tiny (products
    below 2**-126), two chunks: flushed, their outputs would be 0 against exact values of 1e-39."""
    level = "avx512_bf16"
    rows = _backend.cpu_kernels(level).prefill_task_rows()
    torch.manual_seed(5)
    k = 2048
    x = torch.randn(fast.DECODE_MAX_M[level]["fp8"] + 4, k)
    data, codes = formats.quantize_fp8(torch.randn(rows, k), (32, 32), torch.uint8)
    data = data.view(torch.uint8).clone()
    data[:32] = 0
    data[:32, :1024] = torch.randint(1, 8, (32, 1024), dtype=torch.uint8)  # e4m3 subnormals 1..7 * 2**-9
    codes = codes.clone()
    codes[0, :32] = 1  # times 2**-126
    before = prefill_counts(level)
    y = FP8[level](x, data, codes, None, [32, 32], False, 224.0, torch.float32)
    assert (prefill_counts(level) - before)[:2].tolist() == [0, 1]
    assert_linear_close(y, x.to(torch.bfloat16), formats.dequantize_fp8(data, codes, (32, 32), torch.float32))
    w = torch.randn(rows, k)
    w[8:16] = 0
    w[8:16, :1024] = torch.randn(8, 1024) * 2.0**-130  # bf16 subnormals
    y = BF16[level](x, w.to(torch.bfloat16), None, torch.float32)
    assert_linear_close(y, x.to(torch.bfloat16), w.to(torch.bfloat16))


@pytest.mark.skipif("avx512_bf16" not in LEVELS, reason="the CPU has no AVX-512 BF16")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("k", [4 * 1024 + 64, 4 * 1024 + 66, 4 * 1024 + 65])
def test_bf16_weights_multiplied_in_place_are_scanned_a_chunk_ahead(k, threads):
    """bf16 weights with an even K are read by the register tiles where they lie (no panel copy);
    each chunk's subnormal bound comes from a scan: by steps inside the previous chunk's tiles (the
    next chunk of the group, or the next group's first) where the chunk holds whole 32-element
    units, on its own otherwise (a task's first panel, a last chunk of 66). Odd K copies panels.
    Three row groups hold weights that are zero except for bf16 subnormals in one chunk each (the
    task's first group in chunk 1, a later group in its first chunk, another in the last, partial,
    chunk): flushed to zero by vdpbf16ps they would miss the derived bound, so each group must take
    the fp32 microkernel, and only those three."""
    level = "avx512_bf16"
    rows = _backend.cpu_kernels(level).prefill_task_rows()
    groups = 33  # one task (1 thread) or tasks of 2 row groups (2 threads)
    n = (groups - 1) * rows + 5
    torch.manual_seed(k + threads)
    w = torch.randn(n, k)
    last = 4 * 1024
    for group, (k0, k1) in ((0, (1024, 2048)), (5, (0, 1024)), (9, (last, k))):
        tiny = w[group * rows + 8 : group * rows + 16]
        tiny.zero_()
        tiny[:, k0:k1] = torch.randn(8, k1 - k0) * 2.0**-130  # bf16 subnormals
    w = w.to(torch.bfloat16)
    assert (w[8:16, 1024:2048] != 0).any() and (w[8:16, 1024:2048].abs() < 2.0**-126).all()
    x = torch.randn(2 * 64 + 3, k)  # past DECODE_MAX_M; a 3-row last A block
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        before = prefill_counts(level)
        y = BF16[level](x, w, None, torch.float32)
        counts = (prefill_counts(level) - before)[:2].tolist()
    finally:
        torch.set_num_threads(previous_threads)
    assert_linear_close(y, x.to(torch.bfloat16), w)
    assert counts == [groups - 3, 3]


@pytest.mark.parametrize("level", LEVELS)
def test_prefill_panels_do_not_shrink_with_large_k(level):
    """K = 33024: a 4 MiB fp32 budget would give 31-row panels; they stay at 64 rows (at::mm path)
    and the microkernel tasks are 64 (96 with AVX512_BF16) rows whatever K is."""
    torch.manual_seed(3)
    task_rows = _backend.cpu_kernels(level).prefill_task_rows()
    n, k = 2 * task_rows + 2, 33024
    d, s = formats.quantize_fp8(torch.randn(n, k), (1, 32))
    rows = max(limits["fp8"] for limits in fast.DECODE_MAX_M.values()) + 1  # on the prefill path at every level
    x = torch.randn(rows, k)
    before = prefill_counts(level)
    y = FP8[level](x, d, s, None, [1, 32], True, 224.0, torch.float32)
    assert int((prefill_counts(level) - before).sum()) == 3  # ceil(n / task_rows)
    assert_linear_close(y, operand(x, True), formats.dequantize_fp8(d, s, (1, 32), torch.float32))


PREFILL_EDGES = [
    # (M, N offset from 2 tasks, K, block, scale dtype): M, N and K off every tile and chunk size
    # (16-row A vectors, 64-row A blocks, 6-row register tiles, tasks, 1024-wide K chunks, bf16 pairs)
    (97, 13, 1031, (1, 32), torch.uint8),  # last A block 33 rows (3 vectors, one lane), odd K past a chunk
    (130, 7, 2050, (32, 32), torch.float8_e8m0fnu),  # last A block 2 rows; K = two chunks and 2
    (71, 1, 200, (128, 128), torch.float32),  # DeepSeek scales: the fp32 microkernel at every level
    (65, 5, 33, (1, 32), torch.uint8),  # K not a multiple of 32: a partial last block
    # four A blocks, the last 15 rows (the tiles of the third prefetch it from a 16-row block); K three
    # chunks and 64 (the last chunk's tiles prefetch a short chunk's worth from the first block's start)
    (207, 11, 3136, (1, 32), torch.uint8),
]


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("m, extra, k, block, scale_dtype", PREFILL_EDGES)
def test_prefill_tile_edges(level, m, extra, k, block, scale_dtype, monkeypatch):
    """Prefill at shapes that leave a remainder in every tile dimension; dropping any tile edge
    (the last rows of a task or register tile, the last A rows of a block, the last K pair or
    chunk) leaves outputs without their terms, which the derived bound catches."""
    monkeypatch.setattr(fast, "decode_max_m", lambda kernels, fmt, k: 0)  # these M may sit below DECODE_MAX_M
    torch.manual_seed(m + k)
    n = 2 * _backend.cpu_kernels(level).prefill_task_rows() + extra
    before = prefill_counts(level)
    d, s = formats.quantize_fp8(torch.randn(n, k), block, scale_dtype)
    x = torch.randn(m, k)
    bias = torch.randn(n)
    y = FP8[level](x, d, s, bias, list(block), True, 224.0, torch.float32)
    assert_linear_close(y, operand(x, True), formats.dequantize_fp8(d, s, block, torch.float32), bias)
    p, s4 = formats.quantize_fp4(torch.randn(n, k))
    y4 = FP4[level](x, p, s4, None, True, 224.0, torch.float32)
    assert_linear_close(y4, operand(x, True), formats.dequantize_fp4(p, s4, k, torch.float32))
    w = torch.randn(n, k)
    y16 = BF16[level](x, w.to(torch.bfloat16), None, torch.float32)
    assert_linear_close(y16, x.to(torch.bfloat16), w.to(torch.bfloat16))
    y32 = FP32W[level](x, w, None, torch.bfloat16)
    assert_linear_close(y32, x.to(torch.bfloat16), w.to(torch.bfloat16))
    grown = prefill_counts(level) - before
    if level != "generic":  # (at::mm panels there: as many rows as 4 MiB of fp32 holds)
        assert int(grown.sum()) == 4 * 3, grown  # the four ops ran three prefill tasks each
    if level == "avx512_bf16" and scale_dtype != torch.float32:
        assert int(grown[1]) == 0, grown  # e8m0 weights and normal A: all on the bf16 tiles


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("m", [16, 17, 63, 64, 65])
def test_prefill_rows_around_vector_multiples(level, m, monkeypatch):
    """The fp32 microkernel keeps C [M, Nt] (weight rows as its vector dimension, A rows as its
    broadcast side) and the bf16 tiles C^T [Nt, M]; a row group whose later chunks leave the bf16
    tiles (a weight row group 1 whose chunk 1 is tiny: products below 2**-126) moves its C^T
    into C once. M around 16 and 64 (whole vectors and a remainder), N = two groups and 13 rows
    (a partial group, not whole transposes), K = two chunks and 36 (a partial transposed block);
    fp32 and bf16 outputs with a bias (the store that rounds into the op's output). A store or
    transpose that used the wrong layout or stride misplaces terms, which the bound catches."""
    monkeypatch.setattr(fast, "decode_max_m", lambda kernels, fmt, k: 0)  # every M on the prefill path
    rows = _backend.cpu_kernels(level).prefill_task_rows()
    n, k = 2 * rows + 13, 2 * 1024 + 36
    torch.manual_seed(m)
    data, codes = formats.quantize_fp8(torch.randn(n, k), (1, 32), torch.uint8)
    codes = codes.clone()
    codes[rows + 3, 1024 // 32 : 2048 // 32] = 5  # row group 1, chunk 1: weights 2**-122 and below
    w = formats.dequantize_fp8(data, codes, (1, 32), torch.float32)
    x = torch.randn(m, k)
    bias = torch.randn(n)
    for out_dtype in (torch.float32, torch.bfloat16):
        before = prefill_counts(level)
        y = FP8[level](x, data, codes, bias, [1, 32], True, 224.0, out_dtype)
        counts = (prefill_counts(level) - before).tolist()
        assert_linear_close(y, operand(x, True), w, bias, msg=f"{level} M={m} {out_dtype}")
        if level == "avx512_bf16":
            assert counts[:2] == [2, 1], counts  # group 1 left the bf16 tiles after chunk 0
        elif level != "generic":
            assert counts[:2] == [0, 3], counts
    y16 = BF16[level](x, w.to(torch.bfloat16), None, torch.bfloat16)
    assert_linear_close(y16, x.to(torch.bfloat16), w.to(torch.bfloat16), msg=f"{level} M={m} bf16 weights")


@pytest.mark.skipif("avx512_bf16" not in LEVELS, reason="needs a CPU with AVX512_BF16")
@pytest.mark.parametrize("m, rowdot", [(64, False), (65, True), (76, True), (77, False), (12, True), (13, False)])
def test_bf16_prefill_last_rows_take_the_row_dot_tiles(m, rowdot, monkeypatch):
    """On the bf16 tiles, up to 12 A rows past the last whole vector of 16 go through the
    row-dot tiles (a dot product per weight row and A row) instead of a vector whose lanes
    they would fill only in part; 13 or more, and whole vectors, do not. N = two groups and 13
    rows (partial register tiles), K = two chunks and 36 (a partial step at the end of a
    chunk), a bias: a row-dot output in the wrong column, or missing a step, breaks the bound."""
    level = "avx512_bf16"
    kernels = _backend.cpu_kernels(level)
    monkeypatch.setattr(fast, "decode_max_m", lambda kernels, fmt, k: 0)  # every M on the prefill path
    n, k = 2 * kernels.prefill_task_rows() + 13, 2 * 1024 + 36
    torch.manual_seed(m)
    d, s = formats.quantize_fp8(torch.randn(n, k))
    x = torch.randn(m, k)
    bias = torch.randn(n)
    before = kernels.rowdot_chunks()
    y = FP8[level](x, d, s, bias, [32, 32], True, 224.0, torch.float32)
    assert (kernels.rowdot_chunks() > before) == rowdot
    assert_linear_close(y, operand(x, True), formats.dequantize_fp8(d, s, (32, 32), torch.float32), bias)
    w = torch.randn(n, k).to(torch.bfloat16)
    before = kernels.rowdot_chunks()
    y16 = BF16[level](x, w, None, torch.bfloat16)  # read in place (no panel copy), rounded on the way out
    assert (kernels.rowdot_chunks() > before) == rowdot
    assert_linear_close(y16, x.to(torch.bfloat16), w)


# --------------------------------------------------------------------------- #
# every row count to 64 on each path, and the decode / panel boundary
# --------------------------------------------------------------------------- #

# The AVX2 / AVX-512 single-row fp8 loop multiplies A by 2**e (the smallest e that keeps
# every product with a decoded weight normal) and factors each block's scale out of its sum,
# falling back to the per-element loop where no e fits A or a stretch of blocks holds a code
# the factored scale cannot represent. Exponent ranges of x, and scale codes, per case.
FACTORED_CASES = {
    "wide A, every code fits": ((-100, 20), (100, 141), {}),
    "tiny A, codes too small late in the row": ((-118, -110), (100, 141), {(1, 150): 0, (6, 190): 1}),
    "NaN code late in the row": ((-10, 10), (110, 141), {(2, 150): 255}),
    "large code late in the row": ((0, 10), (110, 130), {(5, 170): 160}),
    "A too wide for one factor": ((-120, 10), (100, 141), {}),
    "A too small for a float factor": ((-126, -124), (150, 170), {}),
}


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("case", list(FACTORED_CASES))
def test_fp8_single_row_scale_factoring_edges(level, case):
    exponents, codes, special = FACTORED_CASES[case]
    n, k = 8, 32 * 200  # 200 blocks: more than one stretch of the factored loop (128 blocks)
    g = torch.Generator().manual_seed(len(case))
    mantissa = torch.rand(1, k, generator=g) + 1
    sign = torch.randint(0, 2, (1, k), generator=g) * 2 - 1
    e = torch.randint(exponents[0], exponents[1] + 1, (1, k), generator=g)
    x = (sign * mantissa * torch.exp2(e.float())).to(torch.bfloat16)
    weight = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
    weight[(weight & 0x7F) == 0x7F] = 0x3C  # no NaN weights: the NaN here comes from the scale
    scale = torch.randint(codes[0], codes[1], (n, k // 32), generator=g, dtype=torch.uint8)
    for (row, block), code in special.items():
        scale[row, block] = code
    y = FP8[level](x, weight, scale, None, [1, 32], False, 224.0, torch.float32)
    w = formats.dequantize_fp8(weight, scale, (1, 32), torch.float32)
    finite = torch.isfinite(w).all(dim=1)
    assert torch.isnan(y[0, ~finite]).all()
    assert_linear_close(y[:, finite], x, w[finite], msg=case)


@pytest.mark.parametrize("level", [level for level in LEVELS if level in ("avx2", "avx512")])
def test_fp8_pair_tiles_under_flush_denormal(level):
    """With MXCSR's DAZ set (torch.set_flush_denormal; each thread checks its own) the AVX2 fp8
    tiles over two weight rows skip their whole-block loop (it decodes subnormal weights as
    inputs) and run the per-block one for every block: M = 4-28, one to four tiles of up to 8
    rows, 37 weight rows (a single row left over), K not a multiple of 32."""
    torch.manual_seed(5)
    d, s = formats.quantize_fp8(torch.randn(37, 200))
    w = formats.dequantize_fp8(d, s, (32, 32), torch.float32)
    x = torch.randn(28, 200)
    torch.set_flush_denormal(True)
    try:
        for m in (4, 6, 8, 13, 28):
            y = FP8[level](x[:m], d, s, None, [32, 32], True, 224.0, torch.float32)
            assert_linear_close(y, operand(x[:m], True), w, msg=f"M={m}")
    finally:
        torch.set_flush_denormal(False)


ROW_COUNTS = list(range(1, 34)) + [40, 47, 48, 63, 64]


@pytest.fixture(params=["decode", "panel", "auto"])
def path(request, monkeypatch):
    """Force every M onto the decode path, onto the panel path, or leave the boundary to decode_max_m."""
    if request.node.callspec.params.get("impl") == "reference" and request.param != "auto":
        pytest.skip("the reference has no decode / panel paths")
    if request.param == "decode":
        monkeypatch.setattr(fast, "decode_max_m", lambda kernels, fmt, k: 1 << 30)
    elif request.param == "panel":
        monkeypatch.setattr(fast, "decode_max_m", lambda kernels, fmt, k: 0)
    return request.param


# K: whole 64-groups, a trailing half group (one 32-block), partial blocks, odd K (fp4 padding nibble).
@impls
@pytest.mark.parametrize("k", [128, 96, 97, 130])
def test_fp8_every_row_count(impl, path, k):
    torch.manual_seed(k)
    n = 21  # not a multiple of the 4-row tiles or the 16-row tasks
    for block, scale_dtype in (((32, 32), torch.float8_e8m0fnu), ((1, 32), torch.uint8), ((128, 128), torch.float32)):
        d, s = formats.quantize_fp8(torch.randn(n, k), block, scale_dtype)
        w = formats.dequantize_fp8(d, s, block, torch.float32)
        x = torch.randn(max(ROW_COUNTS), k) * 4.0
        for m in ROW_COUNTS:
            for act_quant in (True, False):
                y = FP8[impl](x[:m], d, s, None, list(block), act_quant, 224.0, torch.float32)
                assert_linear_close(y, operand(x[:m], act_quant), w, msg=f"{path} {block} M={m} act_quant={act_quant}")


@impls
@pytest.mark.parametrize("k", [128, 96, 97, 130])
def test_fp4_every_row_count(impl, path, k):
    torch.manual_seed(k + 1)
    n = 21
    p, s = formats.quantize_fp4(torch.randn(n, k))
    w = formats.dequantize_fp4(p, s, k, torch.float32)
    x = torch.randn(max(ROW_COUNTS), k) * 4.0
    for m in ROW_COUNTS:
        for act_quant in (True, False):
            y = FP4[impl](x[:m], p, s, None, act_quant, 448.0, torch.float32)
            assert_linear_close(y, operand(x[:m], act_quant, 448.0), w, msg=f"{path} M={m} act_quant={act_quant}")


@pytest.mark.skipif(not HAS_COMPILER, reason="needs the compiled kernels")
@pytest.mark.parametrize("level", LEVELS)
def test_decode_kernels_and_boundary_per_level(level):
    """The avx512_bf16 library runs the bf16 dot-product decode kernels, avx2 and avx512 the fp32
    AVX2 ones, generic the scalar ones; the decode/panel boundary follows them."""
    kernels = _backend.cpu_kernels(level)
    assert kernels is not None, f"{level} did not load"
    isa = kernels.decode_isa()
    assert isa == {"generic": "generic", "avx2": "avx2", "avx512": "avx2", "avx512_bf16": "avx512_bf16"}[level]
    for fmt in ("fp8", "fp4"):
        assert fast.decode_max_m(kernels, fmt, 4096) == fast.DECODE_MAX_M[isa][fmt]
        assert 1 <= fast.decode_max_m(kernels, fmt, 1 << 20) <= fast.DECODE_MAX_M[isa][fmt]


@pytest.mark.skipif(not HAS_COMPILER, reason="needs the compiled kernels")
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_the_ops_switch_to_prefill_just_above_decode_max_m(level, fmt):
    """At M = decode_max_m the op runs the decode path (on AVX-512 BF16: the folded tiles), at
    M + 1 the prefill tiles, and both give the linear within its bound."""
    kernels = _backend.cpu_kernels(level)
    assert kernels is not None, f"{level} did not load"
    n, k = 21, 96
    limit = fast.decode_max_m(kernels, fmt, k)
    torch.manual_seed(limit)
    if fmt == "fp8":
        d, s = formats.quantize_fp8(torch.randn(n, k))
        w = formats.dequantize_fp8(d, s, (32, 32), torch.float32)
        linear = lambda x: FP8[level](x, d, s, None, [32, 32], True, 224.0, torch.float32)  # noqa: E731
    else:
        p, s = formats.quantize_fp4(torch.randn(n, k))
        w = formats.dequantize_fp4(p, s, k, torch.float32)
        linear = lambda x: FP4[level](x, p, s, None, True, 224.0, torch.float32)  # noqa: E731
    for m, on_decode in ((limit, True), (limit + 1, False)):
        x = torch.randn(m, k)
        prefill_before, decode_before = prefill_counts(level), torch.tensor(kernels.decode_counts())
        y = linear(x)
        prefill_grown = int((prefill_counts(level) - prefill_before).sum())
        decode_grown = (torch.tensor(kernels.decode_counts()) - decode_before).tolist()
        assert (prefill_grown == 0) == on_decode, f"M={m} (limit {limit}): {prefill_grown} prefill tasks"
        if kernels.decode_isa() == "avx512_bf16":
            assert decode_grown == ([0, 1] if on_decode else [0, 0]), f"M={m} (limit {limit}): {decode_grown}"
        assert_linear_close(y, operand(x, True), w, msg=f"{level} {fmt} M={m}")


# Row counts that give each tile shape of the decode kernels (the AVX2 ones: NT = 4 x MT = 1-3
# up to M = 3, then NT = 1 x MT = 4-8 in near-equal row tiles; the AVX-512 BF16 ones: NT = 4 x
# MT = 1-5, two such tiles at M = 6, the folded tiles from M = 7) and a few splits into several tiles.
ONE_HOT_ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16]


def one_hot_products(linear, k, dtype=torch.float32):
    """``linear(x)`` for x = the rows of the K x K identity, M rows per call for each M of
    ONE_HOT_ROWS: row m of x selects weight column m alone, so out[m, n] = 1 * w[n, m]
    exactly (one product; every other product is a zero) whatever the summation order.
    Yields (M, out [K, N]) with the calls' rows stacked."""
    eye = torch.eye(k, dtype=dtype)
    for m in ONE_HOT_ROWS:
        yield m, torch.cat([linear(eye[k0 : k0 + m]) for k0 in range(0, k, m)])


@pytest.mark.skipif("avx512_bf16" not in LEVELS, reason="this CPU has no AVX-512 BF16")
@pytest.mark.parametrize("fmt", ["fp8 32x32", "fp8 1x32", "fp4"])
def test_bf16_decode_tiles_around_the_fold_switch(fmt):
    """The AVX-512 BF16 decode runs its per-lane-scale tiles (up to 5 rows in one tile over 4
    weight rows, 6 as two tiles of 3, or as one with A prescaled)
    below ``decode_fold_rows(K)`` rows and its folded K-block tiles
    from there. At each row count around those switches the call takes the tiles it should
    (``decode_counts``) and, with one-hot activations, gives every weight element exactly:
    a row tile that read or wrote the wrong row of A or of the output, or a remainder row it
    lost, fails here. N = 21: a partial 8-row group and a 4-row tile plus single rows; K = 600:
    a partial last K-block and a partial last 32-block."""
    kernels = _backend.cpu_kernels("avx512_bf16")
    assert kernels is not None, "the avx512_bf16 CPU kernels did not build or load"
    fold8, fold4, fold8_shared = kernels.decode_fold_rows(600)
    fold = {"fp4": fold4, "fp8 1x32": fold8, "fp8 32x32": fold8_shared}[fmt]
    n, k = 21, 600
    torch.manual_seed(len(fmt))
    codes = torch.randint(120, 135, (n, -(-k // 32)), dtype=torch.uint8)  # the folded range for A = 1
    if fmt == "fp4":
        packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
        w = formats.dequantize_fp4(packed, codes, k, torch.float32)

        def linear(x):
            return FP4["avx512_bf16"](x, packed, codes, None, False, 448.0, torch.float32)
    else:
        block = (32, 32) if fmt == "fp8 32x32" else (1, 32)
        data = torch.randint(0, 256, (n, k), dtype=torch.uint8)
        data[(data & 0x7F) == 0x7F] = 0x3E  # no NaN bytes
        scale = codes[:: block[0]].contiguous()
        w = formats.dequantize_fp8(data, scale, block, torch.float32)

        def linear(x):
            return FP8["avx512_bf16"](x, data, scale, None, list(block), False, 224.0, torch.float32)

    eye = torch.eye(k)
    for m in sorted({1, 2, 3, 4, 5, 6, fold - 1, fold, fold + 1, 2 * fold, 2 * fold + 1}):
        before = torch.tensor(kernels.decode_counts())
        y = torch.cat([linear(eye[k0 : k0 + m]) for k0 in range(0, k - m + 1, m)])
        calls = k // m
        grown = (torch.tensor(kernels.decode_counts()) - before).tolist()
        assert grown == ([calls, 0] if m < fold else [0, calls]), f"M={m}: {grown} (fold from {fold})"
        torch.testing.assert_close(y, w.t()[: calls * m], rtol=0, atol=0, msg=lambda e: f"{fmt} M={m}: {e}")


@pytest.mark.skipif("avx512_bf16" not in LEVELS, reason="this CPU has no AVX-512 BF16")
def test_bf16_decode_scales_on_the_activation():
    """fp8 with 32x32 blocks, from 2 rows of A: the weight rows of each scale row multiply A by
    it once and run plain dot products (``decode_prescaled_rows`` counts those weight rows;
    up to ``decode_fold_rows(K)[2] - 1`` rows, the folded tiles from there),
    where the codes keep every scaled A word normal and every product at least 2**-126;
    elsewhere it keeps the per-lane scales. One-hot rows of A = 2**-100 make each output one
    product, compared exactly: rows 0-31 have code 100 (A * s = 2**-127 is not a normal bf16;
    scaled anyway, the exponent add would wrap and vdpbf16ps would flush), rows 32-63 code
    117 (A * s = 2**-110, the lowest the rule takes), rows 64-79 code 116 (one below); each
    weight row holds every finite e4m3 byte, subnormals included. M = 1 never prescales, nor
    do 1x32 blocks (scale rows per weight row)."""
    kernels = _backend.cpu_kernels("avx512_bf16")
    assert kernels is not None, "the avx512_bf16 CPU kernels did not build or load"
    finite = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    n, k = 80, 600  # three scale rows: 32 weight rows at code 100, 32 at 117, 16 at 116; a partial last block
    nn_, kk = torch.meshgrid(torch.arange(n), torch.arange(k), indexing="ij")
    data = finite[(nn_ + 7 * kk) % len(finite)]
    row_codes = torch.tensor([100, 117, 116], dtype=torch.uint8)
    scale = row_codes[:, None].expand(3, -(-k // 32)).contiguous()
    a_value = 2.0**-100
    w = formats.dequantize_fp8(data, scale, (32, 32), torch.float32)
    eye = torch.eye(k) * a_value

    def linear(x, data=data, scale=scale, block=(32, 32)):
        return FP8["avx512_bf16"](x, data, scale, None, list(block), False, 224.0, torch.float32)

    fold = kernels.decode_fold_rows(k)[2]
    for m in range(1, fold + 1):
        before = kernels.decode_prescaled_rows()
        y = torch.cat([linear(eye[k0 : k0 + m]) for k0 in range(0, k - m + 1, m)])
        calls = k // m
        grown = kernels.decode_prescaled_rows() - before
        assert grown == (0 if m in (1, fold) else 32 * calls), f"M={m}: {grown} prescaled rows in {calls} calls"
        torch.testing.assert_close(y, (w * a_value).t()[: calls * m], rtol=0, atol=0, msg=lambda e: f"M={m}: {e}")

    # The top of the range: A * s at field 254 - (10 + bit width of K rounded up to 64) is the
    # highest the rule takes (K = 600 -> 640, 10 bits: 234); one more goes back to the per-lane scales.
    for code, taken in ((234 - 130 + 127, True), (235 - 130 + 127, False)):
        top = torch.full((1, -(-k // 32)), code, dtype=torch.uint8)
        wt = formats.dequantize_fp8(data[:16], top, (32, 32), torch.float32)
        before = kernels.decode_prescaled_rows()
        y = linear(eye[:4] / a_value * 2.0**3, data[:16], top)
        assert (kernels.decode_prescaled_rows() - before == 16) == taken, f"code {code}"
        torch.testing.assert_close(y, (wt * 2.0**3).t()[:4], rtol=0, atol=0)

    # A NaN code (255) in a block: its rows are NaN, as the reference's, the others exact.
    nan_scale = scale.clone()
    nan_scale[1, 3] = 255
    y = linear(eye[:3], data, nan_scale)
    ref = formats.dequantize_fp8(data, nan_scale, (32, 32), torch.float32)
    assert torch.isnan(y[:, 32:64]).all()
    torch.testing.assert_close(y[:, :32], (w * a_value).t()[:3, :32], rtol=0, atol=0)
    torch.testing.assert_close(y[:, 64:], (w * a_value).t()[:3, 64:], rtol=0, atol=0)
    assert torch.isnan(ref[32:64]).any()

    before = kernels.decode_prescaled_rows()
    row_scale = scale.repeat_interleave(32, dim=0)[:n].contiguous()
    y = linear(eye[:4], data, row_scale, (1, 32))
    assert kernels.decode_prescaled_rows() == before, "1x32 blocks prescaled"
    torch.testing.assert_close(y, (w * a_value).t()[:4], rtol=0, atol=0)

    # The switch to the folded tiles depends on K: fewer rows past kPrescaleLongK (8192).
    k_long = 8256
    fold_long = kernels.decode_fold_rows(k_long)[2]
    assert fold_long < kernels.decode_fold_rows(8192)[2]
    long_data = finite[torch.randint(0, len(finite), (32, k_long), generator=torch.Generator().manual_seed(0))]
    long_scale = torch.full((1, k_long // 32), 127, dtype=torch.uint8)
    w_long = formats.dequantize_fp8(long_data, long_scale, (32, 32), torch.float32)
    for m in (fold_long - 1, fold_long):
        x = torch.randn(m, k_long, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16).float()
        before = kernels.decode_prescaled_rows()
        y = linear(x, long_data, long_scale)
        grown = kernels.decode_prescaled_rows() - before
        assert grown == (32 if m < fold_long else 0), f"K = {k_long}, M = {m}: {grown} prescaled rows"
        # fp32 sums of exact products in some order: within K * 2**-24 * sum |products|.
        bound = k_long * 2.0**-24 * (x.abs().double() @ w_long.abs().double().t())
        assert ((y.double() - x.double() @ w_long.double().t()).abs() <= bound).all(), f"K = {k_long}, M = {m}"


@impls
@pytest.mark.parametrize("block", [(1, 32), (32, 32)])
def test_fp8_every_byte_at_every_block_position(impl, block, path):
    """Every finite E4M3 byte at each of the 32 positions of a block (the AVX2 decoder permutes
    the elements of a block; fp8_blocks32 / the F16C loop decode them), under scale codes the
    whole-block path takes (0, 1, 120, 127, 134) and ones it must leave to the general loop
    (135, 200, 246), isolated by one-hot activations: each output is one weight element,
    compared exactly with the dequantized weight (K = 288: nine blocks, no remainder)."""
    finite = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    n, k = len(finite), 288
    nn_, kk = torch.meshgrid(torch.arange(n), torch.arange(k), indexing="ij")
    data = finite[(nn_ + 7 * kk) % n]  # column k holds every byte once, at a different row
    codes = torch.tensor([0, 1, 120, 127, 134, 135, 200, 246, 127], dtype=torch.uint8)
    scale = codes.repeat(-(-n // block[0]), 1)
    if block == (32, 32):
        scale = scale.view(torch.float8_e8m0fnu)
    w = formats.dequantize_fp8(data, scale, block, torch.float32)
    assert torch.isfinite(w).all()

    def linear(x):
        return FP8[impl](x, data, scale, None, list(block), False, 224.0, torch.float32)

    for m, y in one_hot_products(linear, k):
        torch.testing.assert_close(y, w.t(), rtol=0, atol=0, msg=lambda e: f"M={m} {block} {path}: {e}")


@impls
@pytest.mark.parametrize("k", [288, 97])
def test_fp4_every_nibble_at_every_group_position(impl, k, path):
    """Every e2m1 nibble (low and high) at each of the 64 positions of a two-block group and the
    128 of a four-block span (the AVX2 and AVX-512 BF16 decoders' output orders are permutations
    of these) and in the F16C remainder (a trailing single block at K = 288, a partial span;
    a partial block and the odd padding nibble at K = 97),
    under scale codes 0, 1, 2, 127, 130, 250, 252 (6 * 2**125 is still finite), isolated by
    one-hot activations and compared exactly with the dequantized weight."""
    n = 16
    nn_, kk = torch.meshgrid(torch.arange(n), torch.arange(k), indexing="ij")
    nibbles = ((nn_ + kk) % 16).to(torch.uint8)  # column k holds every nibble once
    padded = torch.nn.functional.pad(nibbles, (0, k % 2))
    packed = (padded[:, 0::2] | (padded[:, 1::2] << 4)).contiguous()
    codes = torch.tensor([0, 1, 2, 127, 130, 250, 252, 127, 1, 0], dtype=torch.uint8)[: -(-k // 32)]
    scale = codes.repeat(n, 1)
    w = formats.dequantize_fp4(packed, scale, k, torch.float32)
    assert torch.isfinite(w).all()

    def linear(x):
        return FP4[impl](x, packed, scale, None, False, 224.0, torch.float32)

    for m, y in one_hot_products(linear, k):
        torch.testing.assert_close(y, w.t(), rtol=0, atol=0, msg=lambda e: f"M={m} K={k} {path}: {e}")


@impls
@pytest.mark.parametrize("m", [1, 3, 4, 8, 33])
@pytest.mark.parametrize("exponent", [-100, -109, -111, -117, -119, -125, -127, -131])
def test_tiny_activations(impl, m, exponent, path):
    """bf16 activations near and below the normal range (act_quant off) against large weights,
    so every product and sum is a normal fp32 number and the exact result is in reach. The bf16
    dot-product kernels read subnormal inputs as zero and flush subnormal results, so they must
    hand such calls to the fp32 kernels."""
    torch.manual_seed(-exponent)
    k = 96
    x = (torch.randn(m, k) * 2.0**exponent).to(torch.bfloat16)
    d, s = formats.quantize_fp8(torch.randn(20, k) * 2.0**40, (1, 32))
    p, s4 = formats.quantize_fp4(torch.randn(20, k) * 2.0**40)
    y8 = FP8[impl](x, d, s, None, [1, 32], False, 224.0, torch.float32)
    assert_linear_close(y8, x, formats.dequantize_fp8(d, s, (1, 32), torch.float32))
    y4 = FP4[impl](x, p, s4, None, False, 224.0, torch.float32)
    assert_linear_close(y4, x, formats.dequantize_fp4(p, s4, k, torch.float32))


@impls
@pytest.mark.parametrize("m", [1, 2, 4, 5, 6, 7, 8, 16])
@pytest.mark.parametrize("low", [True, False], ids=["codes 0-3", "codes 250-253"])
def test_fp4_extreme_scale_codes(impl, m, low, path):
    """e8m0 codes at both ends: below 2 a scale folded into bf16 weights is no longer a normal
    bf16 (the bf16 kernels read it as zero), near 253 large values overflow. Each row mixes
    them with an ordinary code, so a tile holds blocks the folded path may take and blocks it
    must refuse; the activation is sized so the extreme blocks carry the result."""
    k, n = 32 * 8, 12
    row = [0, 1, 2, 3, 127, 2, 1, 0] if low else [253, 252, 251, 127, 250, 253, 252, 251]
    codes = torch.tensor(row, dtype=torch.uint8).repeat(n, 1)
    codes[::2] = codes[::2].flip(1)
    torch.manual_seed(m)
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8) & 0x55  # values 0, 0.5, 2, 3: finite at 253
    w = formats.dequantize_fp4(packed, codes, k, torch.float32)
    assert torch.isfinite(w).all()
    x = torch.randn(m, k) * (2.0**100 if low else 2.0**-100)
    y = FP4[impl](x, packed, codes, None, False, 224.0, torch.float32)
    assert_linear_close(y, x.to(torch.bfloat16), w)


# The levels whose MXFP4 decode at M = 1-28 runs the exact int16 dot products (kernels.cpp,
# fp4_groups64_int): AVX2 without AVX-512 BF16 (that level has its own bf16 kernels).
INT_LEVELS = [level for level in LEVELS if level in ("avx2", "avx512")]
# Row counts for the int path's tiles: NT = 4 weight rows x MT = 1, 2 at M <= 2 (and NT = 1
# for the rows left over); from M = 3 NT = 1 x MT = 2-4 in near-equal row tiles (5: 3 + 2,
# 6: 3 + 3, 7: 4 + 3, 9: 3 + 3 + 3, 13: 4 + 3 + 3 + 3, 16: 4 x 4, 21: 4 + 4 + 4 + 3 + 3 + 3, 24: 6 x 4, 32: 8 x 4).
INT_ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16, 21, 28]


def int_tiles_per_row(m):
    """How many tiles the AVX2 int path runs per weight row (tile) for an M-row call."""
    return 1 if m <= 2 else -(-m // 4)


def int_tiles(m, n):
    """How many tiles an M-row call on n weight rows runs (fp4_int_counts()[3] when all take the
    int path): four-row tiles and single rows at M <= 2 (16-row tasks hold whole four-row tiles)."""
    return n // 4 + n % 4 if m <= 2 else n * int_tiles_per_row(m)


def fp4_int_counts(level):
    """[MXFP4 calls that took the int path, their float blocks, tiles that fell back for a scale code,
    tiles that ran the int path]."""
    return torch.tensor(_backend.cpu_kernels(level).fp4_int_counts())


def every_nibble(n, k):
    """Packed MXFP4 bytes [n, ceil(k / 2)] whose column k holds every nibble once over 16 rows."""
    nn_, kk = torch.meshgrid(torch.arange(n), torch.arange(k), indexing="ij")
    nibbles = ((nn_ + kk) % 16).to(torch.uint8)
    padded = torch.nn.functional.pad(nibbles, (0, k % 2))
    return (padded[:, 0::2] | (padded[:, 1::2] << 4)).contiguous()


@pytest.mark.parametrize("level", INT_LEVELS)
@pytest.mark.parametrize("k", [512, 416, 480, 97 + 256])
@pytest.mark.parametrize("value", [1.0, -1.5 * 2.0**-20, 1.75 * 2.0**40, 2.0**-113])
def test_fp4_int_path_one_hot_is_exact(level, k, value):
    """M = 1-28 (INT_ROWS) through the int path: a one-hot activation row (a single nonzero: t = 14 - its
    exponent) picks one weight column (row r of a call: column m + 37 r), every nibble at every position of the 64-groups (two 4-group
    scale chunks; partial chunks of 2, 3 and 1 groups at K = 416, 480 (and a trailing block)
    and 353 (and a partial block and the padding nibble)) under scale codes that keep the int
    path's factor 2**(code - 136 - t) normal; compared exactly with value * the dequantized
    weight. Calls whose nonzero lies past the last whole group have no int block and must not
    take the path (at M = 2: when either row has none); no tile may fall back. (Fails when the decoder's table, its element order,
    the scale's exponent bias, t's bound or the handling of a partial chunk is off: tried.)"""
    n = 21  # five 4-row tiles and a single-row tile
    packed = every_nibble(n, k)
    g = torch.Generator().manual_seed(k)
    t = 14 - math.frexp(abs(value))[1] + 1  # the int path's shift: the value times 2**t in [2**14, 2**15)
    low, high = 10 + t, 220 + t  # field = code - 9 - t in 1..211 (2**-113: t = 127, the largest)
    scale = torch.randint(max(low, 0), min(high, 253), (n, -(-k // 32)), generator=g, dtype=torch.uint8)
    w = formats.dequantize_fp4(packed, scale, k, torch.float32)
    expected = (w * value).t()
    assert torch.isfinite(expected).all() and (expected.abs().max() < 2.0**127)
    whole = k // 64 * 64  # the columns of whole 64-groups
    for rows in INT_ROWS:
        before = fp4_int_counts(level)
        starts = range(k) if rows <= 2 else range(rows % 5, k, 5)  # every column, or every fifth from M = 3
        for m in starts:
            columns = [(m + 37 * r) % k for r in range(rows)]
            x = torch.zeros(rows, k)
            x[torch.arange(rows), columns] = value
            y = FP4[level](x, packed, scale, None, False, 224.0, torch.float32)
            torch.testing.assert_close(y, expected[columns], rtol=0, atol=0, msg=lambda e: f"columns {columns}: {e}")
        grown = fp4_int_counts(level) - before
        calls = sum(all((m + 37 * r) % k < whole for r in range(rows)) for m in starts)
        assert grown.tolist() == [calls, 0, 0, calls * int_tiles(rows, n)], rows


@pytest.mark.parametrize("level", INT_LEVELS)
@pytest.mark.parametrize("k", [64 * 9, 64 * 9 + 32, 64 * 11 + 37])
@pytest.mark.parametrize("codes", ["ordinary", "tiny", "huge", "nan"])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 9, 16])
def test_fp4_int_path_falls_back_per_block_and_per_tile(level, k, codes, m):
    """M = 1 with activation blocks the int path cannot take (exponents 2**22 or 2**23 apart: no
    int16 holds both; a bf16 subnormal) next to an all-zero block, blocks at the edge of the int16
    range and at a negative t, and ordinary ones. Each float block is counted and multiplied by
    the correction pass. Rows whose scale codes put the int path's factor out of range (codes
    3 with t = 6: below the normal range; 248 with t = 6: past 2**96; code 255: NaN) fall
    back to the float path as whole tiles. Compared with the exact result within the fp32 bound.
    (Fails without the correction pass, the row range check or the integrality check: tried.)"""
    n = 13
    g = torch.Generator().manual_seed(k + len(codes))
    packed = torch.randint(0, 256, (n, (k + 1) // 2), generator=g, dtype=torch.uint8)
    scale = torch.randint(118, 136, (n, -(-k // 32)), generator=g, dtype=torch.uint8)
    special = {"ordinary": None, "tiny": 3, "huge": 248, "nan": 255}[codes]
    if special is not None:
        scale[5, 4] = special  # the second 4-row tile
        scale[12, 7] = special  # the single-row tile
    # e4m3-like values 2**-3 .. 15 * 2**0 (every block an int block: lowest bits 2**-6, top 2**3) ...
    mantissa = torch.randint(8, 16, (1, k), generator=g) * (torch.randint(0, 2, (1, k), generator=g) * 2 - 1)
    x = mantissa * torch.exp2(torch.randint(-6, 0, (1, k), generator=g).float())
    x[0, 0:32] = 0.0  # block 0: all zero, an int block of nothing
    x[0, 40] = 2.0**11  # block 1: 2**11 and 2**-11 in one block: float
    x[0, 41] = -(2.0**-11)
    x[0, 70] = 2.0**-130  # block 2: a bf16 subnormal: float
    x[0, 96:128] = 0.0  # block 3: (1 + 2**-7) * 2**8 (lowest bit 2**1) and (1 + 2**-7) * 2**15
    x[0, 100] = 2.0**8 + 2.0  # (top 2**15): t = -1, the largest int 2**14 + 2**7, just fits
    x[0, 101] = -(2.0**15 + 2.0**8)
    x[0, 160:192] = 0.0  # block 5: a lone (1 + 2**-7) * 2**16: t = -9, int 2**7 + 1
    x[0, 170] = 2.0**16 + 2.0**9
    x[0, 200] = 2.0**-20  # block 6: ordinary values next to 2**-20: float
    assert torch.equal(x, x.to(torch.bfloat16).float()) and x[0, 70] != 0
    # row 2: the same blocks one group on (float blocks 3, 4, 8); rows 3 and 4 two and three groups
    # on; then the same four negated, then those eight halved (every block keeps its kind; no
    # larger values: the "huge" rows' float path overflows fp32 near 2**128)
    x = torch.cat([x.roll(64 * (i % 4), 1) * (-1.0) ** (i // 4) * 0.5 ** ((i // 8) % 2) for i in range(m)])
    a = x.to(torch.bfloat16)
    w = formats.dequantize_fp4(packed, scale, k, torch.float32)
    before = fp4_int_counts(level)
    y = FP4[level](x, packed, scale, None, False, 224.0, torch.float32)
    grown = fp4_int_counts(level) - before
    finite = torch.isfinite(w).all(dim=1)
    assert torch.isnan(y[:, ~finite]).all()
    assert_linear_close(y[:, finite], a, w[finite], msg=f"{codes} K={k}")
    # float blocks: 1, 2 and 6 per row (block 5 and 3 fit); tiles that fell back: rows 4-7 and
    # row 12 (M <= 2), rows 5 and 12 from M = 3 (each in int_tiles_per_row(m) tiles)
    fallback = 0 if special is None else 2 * int_tiles_per_row(m)
    assert grown.tolist() == [1, 3 * m, fallback, int_tiles(m, n) - fallback], grown


@pytest.mark.parametrize("level", INT_LEVELS)
def test_fp4_int_path_runs_for_qdq_activations(level, monkeypatch):
    """The int path serves qdq'd activations (the decode case it is for) and ordinary weights with
    no fallback at M = 1-28, at the K of the benchmarks' layers; M = 29 (on the decode path here)
    takes the float path."""
    monkeypatch.setattr(fast, "decode_max_m", lambda kernels, fmt, k: 1 << 30)
    torch.manual_seed(3)
    int_max_m = _backend.cpu_kernels(level).fp4_int_max_m()  # the int path's reach (kFp4IntMaxM)
    assert fast.DECODE_MAX_M["avx2"]["fp4"] <= int_max_m  # every fp4 decode call at these levels can take it
    for n, k in ((64, 2880), (36, 4096)):
        p, s = formats.quantize_fp4(torch.randn(n, k))
        for m in (1, 2, 3, 4, 8, 16, 21, int_max_m, int_max_m + 1):
            x = torch.randn(m, k)
            before = fp4_int_counts(level)
            y = FP4[level](x, p, s, None, True, 224.0, torch.float32)
            grown = fp4_int_counts(level) - before
            if m <= int_max_m:
                assert grown[0] == 1 and grown[1] <= m * k // 32 // 8 and grown[2] == 0, grown
                assert grown[3] == int_tiles(m, n), grown
            else:
                assert grown.tolist() == [0, 0, 0, 0]
            assert_linear_close(y, formats.qdq_fp8(x, 224.0), formats.dequantize_fp4(p, s, k, torch.float32))


@impls
@pytest.mark.parametrize("m", [4, 6, 7, 8, 9, 16, 28, 33])
@pytest.mark.parametrize("block", [(1, 32), (32, 32)])
def test_fp8_small_scales_the_folded_tiles_must_refuse(impl, m, block, path):
    """From 7 rows (``decode_fold_rows(K)``) the bf16 kernels fold each 32-block's scale into the
    decoded bf16 weights (an exponent add), a K-block of 8 weight rows at a time. That is exact only while w * s is a normal
    bf16: codes below 10 would wrap the exponent into a huge or negative value. Blocks with such
    codes sit among ordinary ones, in the first and the last K-block and in a partial row group
    (N = 21), so a kernel that folded them anyway, or that lost a row group it handed to the
    general tiles, fails here."""
    torch.manual_seed(m)
    n, k = 21, 32 * 33 + 5  # three K-blocks of 8 groups, the last one partial; 2 row groups + 5 rows
    data = torch.randint(0, 0x7F, (n, k), dtype=torch.uint8) | (torch.randint(0, 2, (n, k), dtype=torch.uint8) << 7)
    data[(data & 0x7F) == 0x7F] = 0x3E  # no NaN bytes: not weights (docs/contract.md §1)
    codes = torch.randint(120, 135, (-(-n // block[0]), -(-k // 32)), dtype=torch.uint8)
    codes[-1, 0] = 5  # w * s down to 2**-131: an fp32 subnormal, exact; a bf16 exponent add would wrap
    codes[0, -1] = 9
    w = formats.dequantize_fp8(data, codes, block, torch.float32)
    x = torch.randn(m, k) * 2.0**60  # products of the tiny scaled weights stay normal
    y = FP8[impl](x, data, codes, None, list(block), False, 224.0, torch.float32)
    assert_linear_close(y, x.to(torch.bfloat16), w)


# --------------------------------------------------------------------------- #
# threads and determinism
# --------------------------------------------------------------------------- #


@impls
@pytest.mark.parametrize("m", [1, 5, 16, 40])
def test_threads_and_determinism(impl, m, threads):
    """The same inputs give the same bits on every call for a fixed thread count, and
    the right answer at 1 and 2 threads. Decode rows (M <= decode_max_m) are each summed by one
    thread in a fixed order, so there the bits do not depend on the thread count either."""
    torch.manual_seed(m)
    n, k = 300, 520
    d, s = formats.quantize_fp8(torch.randn(n, k), (1, 32))
    p, s4 = formats.quantize_fp4(torch.randn(n, k))
    x = torch.randn(m, k)
    results = {}
    for count in (1, 2):
        threads(count)
        y8 = FP8[impl](x, d, s, None, [1, 32], True, 224.0, torch.float32)
        y4 = FP4[impl](x, p, s4, None, True, 224.0, torch.float32)
        assert torch.equal(bits(y8), bits(FP8[impl](x, d, s, None, [1, 32], True, 224.0, torch.float32)))
        assert torch.equal(bits(y4), bits(FP4[impl](x, p, s4, None, True, 224.0, torch.float32)))
        assert_linear_close(y8, operand(x, True), formats.dequantize_fp8(d, s, (1, 32), torch.float32))
        assert_linear_close(y4, operand(x, True), formats.dequantize_fp4(p, s4, k, torch.float32))
        results[count] = (y8, y4)
    if impl != "reference" and m <= min(fast.decode_max_m(_backend.cpu_kernels(impl), f, k) for f in ("fp8", "fp4")):
        for one, two in zip(results[1], results[2]):
            assert torch.equal(bits(one), bits(two))


# --------------------------------------------------------------------------- #
# activation qdq: bit-exact twins
# --------------------------------------------------------------------------- #


@impls
@pytest.mark.parametrize("peak", [224.0, 448.0, 4.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_qdq_hand_cases(impl, peak, dtype):
    torch.manual_seed(7)
    x = (torch.randn(6, 100) * torch.logspace(-8, 8, 100)).clamp(-6e4, 6e4)
    x[0, :32] = 0.0  # zero block: the 1e-4 floor
    x[1, 32:64] = 2.0**-130  # below every e4m3 code at the floor scale
    x[2, :33] = torch.tensor(peak) * 2.0**3  # power-of-two boundary in a full block
    x[2, 40] = -(2.0**-6)  # boundary between e4m3 subnormals and normals
    x[3, :] = torch.arange(100) * 0.015625 / 8  # every e4m3 subnormal step, ties included
    got = QDQ[impl](x.to(dtype), peak)
    other = QDQ[other_than(impl)](x.to(dtype), peak)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    assert torch.equal(bits(got), bits(other))


@impls
def test_qdq_non_finite_blocks(impl):
    """NaN and inf poison their own 32-block the same way in both twins, and only that block."""
    x = torch.randn(2, 96)
    x[0, 5] = float("nan")
    x[1, 40] = float("inf")
    x[1, 70] = -1e38
    got = QDQ[impl](x, 224.0)
    other = QDQ[other_than(impl)](x, 224.0)
    assert torch.equal(got.isnan(), other.isnan())
    finite = ~got.isnan()
    assert torch.equal(bits(got[finite]), bits(other[finite]))
    assert torch.isfinite(got[0, 32:]).all() and torch.isfinite(got[1, :32]).all()


@impls
@given(x_data=st.data(), k=st.integers(1, 200), peak=st.sampled_from([224.0, 448.0, 5.5]))
def test_qdq_property_bit_exact(impl, x_data, k, peak):
    x = x_data.draw(activations(k, max_rows=5, max_exponent=30, dtypes=(torch.float32, torch.bfloat16)))
    got = QDQ[impl](x, peak)
    other = QDQ[other_than(impl)](x, peak)
    assert torch.equal(bits(got), bits(other))


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("peak", [224.0, 448.0, 4.0])
def test_prefill_applies_the_qdq_bit_exactly(level, peak):
    """The prefill path qdq's A as it packs it (at the AVX-512 levels 32 bf16 lanes at a time,
    with the e4m3-subnormal lanes taken apart). With W the identity (exact in fp8) each output
    is one product, 1 * A[m, k], so the output is qdq_fp8(x) bit for bit: a lane the pack
    rounded differently, a block it scaled differently, or a tail it lost fails here (up to the
    sign of zero)."""
    k = 170  # five full 32-blocks and a partial one
    m = max(limits["fp8"] for limits in fast.DECODE_MAX_M.values()) + 3  # the prefill path
    torch.manual_seed(int(peak))
    x = (torch.randn(m, k) * torch.logspace(-8, 8, k)).clamp(-6e4, 6e4)
    x[0, :32] = 0.0  # the amax floor
    x[1, :] = torch.arange(k) * 0.015625 / 8 * (1 + torch.arange(k) % 3)  # e4m3 subnormal steps and ties
    x[2, :64] = 2.0 ** -6 * (1 - 2 * (torch.arange(64) % 2))  # at the subnormal / normal bound
    x[3, :] = peak * (1 + torch.arange(k) / 64)  # rounding up into the next binade
    x[4:, :32] *= torch.logspace(-6, 0, 32)  # one large lane, many small ones: mixed blocks
    d, s = formats.quantize_fp8(torch.eye(k))
    assert torch.equal(formats.dequantize_fp8(d, s, (32, 32), torch.float32), torch.eye(k))
    before = prefill_counts(level)
    y = FP8[level](x, d, s, None, [32, 32], True, peak, torch.bfloat16)
    assert (prefill_counts(level) - before).sum() > 0
    # + 0.0: the sum of a product -0 and the zero products is +0
    assert torch.equal(bits(y), bits(formats.qdq_fp8(x, peak) + 0.0))


def test_qdq_leading_dims_and_errors():
    x = torch.randn(2, 3, 70)
    assert torch.equal(bits(fast.qdq_fp8(x, 224.0)), bits(formats.qdq_fp8(x.reshape(6, 70), 224.0)).reshape(2, 3, 70))
    assert fast.qdq_fp8(torch.zeros(0, 70), 224.0).shape == (0, 70)
    with pytest.raises(ValueError, match="peak"):
        fast.qdq_fp8(x, 500.0)
    with pytest.raises(TypeError, match="x: expected a floating-point dtype"):
        fast.qdq_fp8(x.to(torch.int32), 224.0)


def test_fast_linear_raises_the_reference_errors():
    d, s = formats.quantize_fp8(torch.randn(40, 70))
    with pytest.raises(ValueError, match=r"weight_scale: expected shape \[1, 1\]"):
        fast.fp8_linear(torch.randn(3, 70), d, s, None, [128, 128], True, 224.0, torch.bfloat16)
    p, s4 = formats.quantize_fp4(torch.randn(40, 70))
    with pytest.raises(ValueError, match=r"weight: expected shape \[N, 36\]"):
        fast.fp4_linear(torch.randn(3, 71), p, s4, None, True, 224.0, torch.bfloat16)


# --------------------------------------------------------------------------- #
# fallback when the kernels cannot be built
# --------------------------------------------------------------------------- #


@pytest.fixture
def failed_build(monkeypatch):
    """Every level fails to load, as without a compiler; the selection is made afresh."""

    def no_compiler(level):
        raise RuntimeError("no C++ compiler ('c++' is not on PATH)\nsecond line never shown")

    monkeypatch.delenv(_backend.REQUIRE_ENV, raising=False)
    monkeypatch.setattr(_backend, "_load_level", no_compiler)
    monkeypatch.setattr(_backend, "_selection", None)
    yield
    _backend.set_cpu_isa_cap(None)  # select again, with the real loader, at the next call


def test_fallback_runs_the_reference_and_warns_once_in_one_line(failed_build):
    torch.manual_seed(8)
    d, s = formats.quantize_fp8(torch.randn(40, 70), (128, 128), torch.float32)
    p, s4 = formats.quantize_fp4(torch.randn(40, 70))
    x = torch.randn(2, 3, 70)
    with pytest.warns(RuntimeWarning) as record:
        y8 = ops.fp8_linear(x, d, s, block=(128, 128))
    assert len(record) == 1
    message = str(record[0].message)
    assert "\n" not in message and "reference" in message and "not on PATH" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # later calls stay quiet
        y4, q = ops.fp4_linear(x, p, s4), ops.qdq_fp8(x)
    assert torch.equal(y8, reference.fp8_linear(x, d, s, None, [128, 128], True, 224.0, torch.bfloat16))
    assert torch.equal(y4, reference.fp4_linear(x, p, s4, None, True, 224.0, torch.bfloat16))
    assert torch.equal(bits(q), bits(formats.qdq_fp8(x)))
    assert ops.backend_info()["cpu"]["kernels"] == "reference"


def test_require_fast_kernels_turns_the_fallback_into_an_error(failed_build, monkeypatch):
    monkeypatch.setenv(_backend.REQUIRE_ENV, "1")
    with pytest.raises(RuntimeError, match="TORCH_BQ_REQUIRE_FAST_KERNELS is set but the .* CPU kernels are unavailable"):
        ops.fp4_linear(torch.randn(2, 64), *formats.quantize_fp4(torch.randn(8, 64)))


def test_require_fast_kernels_refuses_a_lower_level(monkeypatch):
    """With the best level broken the selector would fall back to the next one; CI must hear of it."""
    if len(LEVELS) < 2:
        pytest.skip("this CPU has only the generic level")
    real = _backend._load_level

    def best_broken(level):
        if level == LEVELS[-1]:
            raise RuntimeError("compiler rejects the flags")
        return real(level)

    monkeypatch.setattr(_backend, "_load_level", best_broken)
    monkeypatch.setattr(_backend, "_selection", None)
    try:
        monkeypatch.delenv(_backend.REQUIRE_ENV, raising=False)
        selection = _backend.cpu_selection()
        assert selection.isa == LEVELS[-2] and "compiler rejects the flags" in selection.reason
        monkeypatch.setattr(_backend, "_selection", None)
        monkeypatch.setenv(_backend.REQUIRE_ENV, "1")
        with pytest.raises(RuntimeError, match=f"the {LEVELS[-1]} CPU kernels are unavailable"):
            _backend.cpu_selection()
    finally:
        monkeypatch.setattr(_backend, "_load_level", real)
        _backend.set_cpu_isa_cap(None)


def test_installed_libraries_are_found_by_level_and_torch_release(tmp_path, monkeypatch):
    """setup.py names each library after its level and the torch it was built against;
    one built against another torch release is never loaded (it would not link)."""
    from torch_bq.ops.cpu import isa

    monkeypatch.setattr(_backend, "INSTALLED_DIR", tmp_path)
    other = isa.module_name("avx2", "2.7.1")
    (tmp_path / f"{other}.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    assert _backend._installed_library("avx2") is None
    mine = tmp_path / f"{isa.module_name('avx2', torch.__version__)}.cpython-311-x86_64-linux-gnu.so"
    mine.write_bytes(b"")
    assert _backend._installed_library("avx2") == mine
    assert _backend._installed_library("generic") is None
