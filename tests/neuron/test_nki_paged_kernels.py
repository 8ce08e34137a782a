"""The KV-cache, attention and grouped (MoE) NKI kernels through ``nki.simulate`` against the references.

``paged_kv_write`` is compared bit for bit (it moves bytes). The attention kernel sums in another
order and uses the engine's ``exp``: it is held to twice the float32 error bound that
tests/test_attention.py derives for the op (each is within it of the exact result), plus half an
ulp of the output dtype. The grouped kernels are compared per expert within the bound of
``nki_testing.assert_linear_close`` (exact products, fp32 sums in another order, one rounding).
Nothing here has run on Trainium hardware.
"""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest
import torch

from nki_testing import activation, assert_linear_close, to_numpy, to_torch
from torch_bq import formats
from torch_bq.ops.nki import grouped_launch, launch as dense_launch, paged_launch
from torch_bq.reference import attention as ref_attention
from torch_bq.reference import grouped as ref_grouped
from torch_bq.reference import linear as ref_linear

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tests/: the attention test's helpers
from test_attention import build, error_bound  # noqa: E402

_HALF_ULP = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


@pytest.fixture(scope="module")
def paged(nki_backend):
    from types import SimpleNamespace

    from torch_bq.ops.nki import attention, grouped, kv_cache

    return SimpleNamespace(attention=attention, grouped=grouped, kv_cache=kv_cache)


def _grouped(kernel, launch, lnc=1, budget=dense_launch.INSTRUCTION_BUDGET):
    """The chain of launches the neuron op runs (grouped_launch.run_grouped), each through nki.simulate."""
    import nki

    target = kernel if lnc == 1 else kernel[lnc]

    def call(*args):
        out = nki.simulate(target)(*[to_numpy(a) if isinstance(a, torch.Tensor) else a for a in args])
        return to_torch(np.asarray(out))

    return grouped_launch.run_grouped(call, launch, budget)


def _simulate(kernel, launch, lnc=1):
    import nki

    target = kernel if lnc == 1 else kernel[lnc]
    out = nki.simulate(target)(*[to_numpy(t) for t in launch.tensors], **launch.options)
    return tuple(to_torch(np.asarray(o)) for o in out) if isinstance(out, tuple) else to_torch(np.asarray(out))


# --------------------------------------------------------------------------- #
# paged_kv_write: bit-exact
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("rows,lnc", [(5, 1), (200, 1), (7, 2)])
def test_kv_write_bit_exact(paged, dtype, rows, lnc):
    g = torch.Generator().manual_seed(rows)
    nb, bs, hkv, d = 60, 4, 2, 16
    k_cache = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
    k = torch.randn(rows, hkv, d, generator=g).to(dtype)
    v = torch.randn(rows, hkv, d, generator=g).to(dtype)
    slots = torch.randperm(nb * bs, generator=g)[:rows]
    slots[::3] = -1  # padded rows: not written
    launch = paged_launch.prepare_kv_write(k, v, k_cache, v_cache, slots)
    new_k, new_v = _simulate(paged.kv_cache.paged_kv_write_kernel, launch, lnc)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ref_attention.paged_kv_write(k, v, ref_k, ref_v, slots)
    assert torch.equal(new_k.view(k_cache.shape).view(torch.uint8), ref_k.view(torch.uint8))
    assert torch.equal(new_v.view(v_cache.shape).view(torch.uint8), ref_v.view(torch.uint8))
    assert not torch.equal(ref_k, k_cache)  # something was written


def test_kv_write_refuses_a_slot_outside_the_cache_instead_of_skipping_it():
    k_cache = torch.zeros(2, 4, 1, 8)
    k = torch.ones(2, 1, 8)
    with pytest.raises(ValueError, match="slot is >= the cache's 2 blocks x 4 = 8 slots"):
        paged_launch.prepare_kv_write(k, k, k_cache, k_cache.clone(), torch.tensor([3, 8]))


def test_kv_write_float64_cache_falls_back():
    launch = paged_launch.prepare_kv_write(torch.ones(1, 1, 8, dtype=torch.float64),
                                           torch.ones(1, 1, 8, dtype=torch.float64),
                                           torch.zeros(2, 4, 1, 8, dtype=torch.float64),
                                           torch.zeros(2, 4, 1, 8, dtype=torch.float64), torch.tensor([0]))
    assert launch.kernel is None and "float64" in launch.fallback


# --------------------------------------------------------------------------- #
# paged_window_attention: derived tolerance
# --------------------------------------------------------------------------- #


def _case(**kw):
    case = dict(num_requests=2, rows_per_request=3, hkv=2, hq=6, d=8, block_size=4, window=9, causal=False,
                seq_lens=[20, 11], positions=[17, 18, 19, 8, 9, 10], chunk_size=4, seed=1)
    case.update(kw)
    return case


ATTENTION_CASES = {
    "two-requests": _case(),
    "causal": _case(causal=True),
    "window-beyond-sequence": _case(window=40),
    "mqa-block1": _case(hkv=1, hq=4, block_size=1, positions=[17, 18, 19, 8, 9, 10], window=5),
    # 1100 positions: three 512-position splits; the padded row (position 30) sees far back, the
    # last rows see only the last split, so their first splits are empty (m = -3e38, l = 0).
    "three-splits-with-empty-splits": _case(num_requests=1, seq_lens=[1100], positions=[1098, 1099, 30],
                                            window=60, block_size=16, d=16),
    "causal-three-splits": _case(num_requests=1, seq_lens=[1100], positions=[1098, 1099, 30], window=600,
                                 block_size=16, causal=True),
    "full-tile-112-rows-d128": _case(num_requests=1, rows_per_request=7, hkv=2, hq=32, d=128, seq_lens=[40],
                                     positions=list(range(33, 40)), window=16, block_size=8),
}


def _attention(paged, case, dtype=torch.float32, lnc=1):
    q, keys, values, k_cache, v_cache, table, positions, seq_lens = build(case, dtype)
    rpr, window, causal = case["rows_per_request"], case["window"], case["causal"]
    scale = case["d"] ** -0.5
    launch = paged_launch.prepare_attention(q, k_cache, v_cache, table, positions, seq_lens, rpr, window, causal,
                                            scale)
    out = _simulate(paged.attention.paged_window_attention_kernel, launch, lnc)
    ref = ref_attention.paged_window_attention(q, k_cache, v_cache, table, positions, seq_lens,
                                               rows_per_request=rpr, window=window, causal=causal, scale=scale)
    bound = 2 * error_bound(q, keys, values, positions, seq_lens, rpr, window, scale)
    return out, ref, bound


@pytest.mark.parametrize("name", list(ATTENTION_CASES))
def test_attention_matches_reference(paged, name):
    out, ref, bound = _attention(paged, ATTENTION_CASES[name])
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert torch.isfinite(out).all()
    err = (out.double() - ref.double()).abs().max().item()
    assert err <= bound, (err, bound)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_attention_half_precision_caches_within_one_rounding(paged, dtype):
    out, ref, bound = _attention(paged, ATTENTION_CASES["three-splits-with-empty-splits"], dtype)
    err = (out.double() - ref.double()).abs()
    assert bool((err <= 2 * bound + 2 * _HALF_ULP[dtype] * ref.double().abs()).all()), err.max()


def test_attention_two_cores_take_alternate_requests(paged):
    out, ref, bound = _attention(paged, _case(num_requests=3, seq_lens=[20, 11, 9],
                                              positions=[17, 18, 19, 8, 9, 10, 6, 7, 8]), lnc=2)
    assert (out.double() - ref.double()).abs().max().item() <= bound


def test_attention_a_wrong_mask_fails_the_bound(paged):
    """The bound can fail: attending one position further back than the window is far outside it."""
    case = ATTENTION_CASES["two-requests"]
    q, keys, values, k_cache, v_cache, table, positions, seq_lens = build(case)
    scale = case["d"] ** -0.5
    launch = paged_launch.prepare_attention(q, k_cache, v_cache, table, positions, seq_lens, 3, 9, False, scale)
    bounds = launch.tensors[5].clone()
    bounds[:, 0] -= 1  # one more key per row
    launch.tensors = (*launch.tensors[:5], bounds)
    out = _simulate(paged.attention.paged_window_attention_kernel, launch)
    ref = ref_attention.paged_window_attention(q, k_cache, v_cache, table, positions, seq_lens,
                                               rows_per_request=3, window=9, causal=False, scale=scale)
    bound = 2 * error_bound(q, keys, values, positions, seq_lens, 3, 9, scale)
    assert (out.double() - ref.double()).abs().max().item() > 100 * bound


def test_attention_over_the_budget_runs_in_request_groups_each_within_it(paged, monkeypatch):
    import nki

    case = _case(num_requests=3, seq_lens=[20, 11, 9], positions=[17, 18, 19, 8, 9, 10, 6, 7, 8])
    q, keys, values, k_cache, v_cache, table, positions, seq_lens = build(case)
    scale = case["d"] ** -0.5
    launch = paged_launch.prepare_attention(q, k_cache, v_cache, table, positions, seq_lens, 3, 9, False, scale)
    budget = 2 * paged_launch.attention_instructions(2, 512) + 8  # two requests per core and launch
    monkeypatch.setattr(nki._core, "DEFAULT_INSTRUCTION_BUDGET", budget)
    calls = []

    def call(*args):
        calls.append(args[3].shape[0])
        out = nki.simulate(paged.attention.paged_window_attention_kernel)(
            *[to_numpy(a) if isinstance(a, torch.Tensor) else a for a in args])
        return to_torch(np.asarray(out))

    out = paged_launch.run_attention(call, launch, lnc=1, budget=budget)
    assert calls == [2, 1]
    ref = ref_attention.paged_window_attention(q, k_cache, v_cache, table, positions, seq_lens,
                                               rows_per_request=3, window=9, causal=False, scale=scale)
    assert (out.double() - ref.double()).abs().max().item() <= 2 * error_bound(q, keys, values, positions,
                                                                                seq_lens, 3, 9, scale)


def test_attention_span_rounds_up_to_splits_and_bounds_traced_calls():
    assert paged_launch.attention_span(1, 4096, 7, 10**6, tracing=False) == 512
    assert paged_launch.attention_span(4102, 4096, 7, 10**6, tracing=False) == 4608
    assert paged_launch.attention_span(0, 4096, 7, 10**6, tracing=True) == 4608  # W + rows - 1 = 4102
    assert paged_launch.attention_span(0, 4096, 7, 1000, tracing=True) == 1024  # capped by the table


def test_attention_metadata_the_reference_refuses_raises():
    case = ATTENTION_CASES["two-requests"]
    q, _, _, k_cache, v_cache, table, positions, seq_lens = build(case)
    table = table.clone()
    table[1, 1] = k_cache.shape[0] + 5  # a visible position of request 1 maps outside the cache
    with pytest.raises(ValueError, match="maps to a block outside the cache"):
        paged_launch.prepare_attention(q, k_cache, v_cache, table, positions, seq_lens, 3, 9, False, 0.3)


def test_attention_shapes_it_cannot_tile_fall_back():
    q = torch.zeros(1, 1, 256)
    cache = torch.zeros(2, 4, 1, 256)
    launch = paged_launch.prepare_attention(q, cache, cache.clone(), torch.zeros(1, 2, dtype=torch.int32),
                                            torch.tensor([0]), torch.tensor([1], dtype=torch.int32), 1, 4, False,
                                            0.1)
    assert launch.kernel is None and "head_dim 256" in launch.fallback


# --------------------------------------------------------------------------- #
# grouped linears: derived tolerance, empty experts skipped
# --------------------------------------------------------------------------- #


def _grouped_inputs(counts, n, k, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    e = len(counts)
    x = torch.randn(sum(counts), k, generator=g) * 2.0
    w = torch.randn(e, n, k, generator=g) * 0.05
    b = torch.randn(e, n, generator=g) if bias else None
    offsets = torch.tensor(np.cumsum(counts), dtype=torch.int32)
    return x, w, b, offsets


def _assert_grouped_close(y, ref, x, w_decoded, b, offsets, act_quant, out_dtype):
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            a = activation(x[start:end], act_quant)
            bias = None if b is None else b[e].float()
            assert_linear_close(y[start:end], ref[start:end], a, w_decoded[e], bias, out_dtype)
        start = end


GROUPED_CASES = [
    # counts per expert, N, K, out dtype, act_quant, bias, lnc
    ([3, 0, 130, 2], 160, 128, torch.bfloat16, True, True, 1),  # an empty expert, one crossing two row tiles
    ([0, 0, 5, 0], 600, 640, torch.float32, False, False, 1),  # a partial N tile and K chunk
    ([1, 1, 1], 320, 64, torch.float16, True, True, 2),  # LNC=2 splits N
    ([7], 64, 2048, torch.bfloat16, True, False, 1),
]


@pytest.mark.parametrize("counts,n,k,out_dtype,act_quant,bias,lnc", GROUPED_CASES)
def test_fp8_grouped_matches_reference(paged, counts, n, k, out_dtype, act_quant, bias, lnc):
    x, w, b, offsets = _grouped_inputs(counts, n, k, seed=n + k, bias=bias)
    data, scale = map(torch.stack, zip(*[formats.quantize_fp8(w[e]) for e in range(len(counts))]))
    launch = grouped_launch.prepare_fp8_grouped(x, data, scale, offsets, b, (32, 32), act_quant, 224.0, out_dtype)
    y = _grouped(paged.grouped.fp8_grouped_linear_kernel, launch, lnc)
    ref = ref_grouped.fp8_grouped_linear(x, data, scale, offsets, b, (32, 32), act_quant, 224.0, out_dtype)
    decoded = torch.stack([ref_linear.decode_fp8_rows(data[e], scale[e], (32, 32), 0, n) for e in range(len(counts))])
    _assert_grouped_close(y, ref, x, decoded.float(), b, offsets, act_quant, out_dtype)


@pytest.mark.parametrize("block", [(1, 32), (128, 128)])
def test_fp8_grouped_other_blocks(paged, block):
    x, w, b, offsets = _grouped_inputs([4, 0, 9], 256, 256, seed=3)
    data, scale = map(torch.stack, zip(*[formats.quantize_fp8(w[e], block=block) for e in range(3)]))
    launch = grouped_launch.prepare_fp8_grouped(x, data, scale, offsets, b, block, True, 224.0, torch.bfloat16)
    y = _grouped(paged.grouped.fp8_grouped_linear_kernel, launch)
    ref = ref_grouped.fp8_grouped_linear(x, data, scale, offsets, b, block, True, 224.0, torch.bfloat16)
    decoded = torch.stack([ref_linear.decode_fp8_rows(data[e], scale[e], block, 0, 256) for e in range(3)])
    _assert_grouped_close(y, ref, x, decoded.float(), b, offsets, True, torch.bfloat16)


@pytest.mark.parametrize("counts,n,k,out_dtype,act_quant,bias,lnc", GROUPED_CASES)
def test_fp4_grouped_matches_reference(paged, counts, n, k, out_dtype, act_quant, bias, lnc):
    x, w, b, offsets = _grouped_inputs(counts, n, k, seed=n * k, bias=bias)
    data, scale = map(torch.stack, zip(*[formats.quantize_fp4(w[e]) for e in range(len(counts))]))
    launch = grouped_launch.prepare_fp4_grouped(x, data, scale, offsets, b, act_quant, 224.0, out_dtype)
    y = _grouped(paged.grouped.fp4_grouped_linear_kernel, launch, lnc)
    ref = ref_grouped.fp4_grouped_linear(x, data, scale, offsets, b, act_quant, 224.0, out_dtype)
    decoded = torch.stack([ref_linear.decode_fp4_rows(data[e], scale[e], k, 0, n) for e in range(len(counts))])
    _assert_grouped_close(y, ref, x, decoded.float(), b, offsets, act_quant, out_dtype)


def test_grouped_empty_experts_decode_nothing(paged):
    """An expert without rows runs no iteration: the work done is proportional to the experts with rows."""
    import nki

    def transposes(counts):
        x, w, b, offsets = _grouped_inputs(counts, 128, 256, seed=1)
        data, scale = map(torch.stack, zip(*[formats.quantize_fp4(w[e]) for e in range(len(counts))]))
        launch = grouped_launch.prepare_fp4_grouped(x, data, scale, offsets, b, True, 224.0, torch.bfloat16)
        _grouped(paged.grouped.fp4_grouped_linear_kernel, launch)
        return nki.last_launch.instructions_by_op["dma_transpose"]

    one = transposes([5, 0, 0, 0])
    assert transposes([5, 0, 0, 3]) == 2 * one
    assert transposes([1, 1, 1, 1]) == 4 * one
    assert transposes([0, 0, 0, 130]) == 2 * one  # 130 rows: two row tiles of one expert


def test_grouped_plan_covers_every_expert_and_column_once_within_the_budget():
    for experts, n, k, budget in ((8, 512, 512, 20_000), (256, 2048, 7168, 20_000), (4, 18432, 7168, 20_000),
                                  (3, 1000, 640, 700)):
        plan = grouped_launch.plan_launches(experts, n, k, budget)
        cover = torch.zeros(experts, n, dtype=torch.int64)
        for e0, e1, n0, n1 in plan:
            cover[e0:e1, n0:n1] += 1
            assert grouped_launch.estimated_instructions(e1 - e0, n1 - n0, k) <= budget, (e0, e1, n0, n1)
        assert bool((cover == 1).all()), (experts, n, k)
    assert len(grouped_launch.plan_launches(8, 512, 512, 20_000)) == 1  # the test shapes: one launch


def test_grouped_over_the_budget_runs_as_a_chain_of_launches_each_within_it(paged, monkeypatch):
    """A small budget forces several launches (expert groups, then N ranges); the stand-in enforces it."""
    import nki

    counts, n, k = [3, 0, 2, 5], 1000, 640
    x, w, b, offsets = _grouped_inputs(counts, n, k, seed=7)
    data, scale = map(torch.stack, zip(*[formats.quantize_fp4(w[e]) for e in range(4)]))
    ref = ref_grouped.fp4_grouped_linear(x, data, scale, offsets, b, True, 224.0, torch.float32)
    decoded = torch.stack([ref_linear.decode_fp4_rows(data[e], scale[e], k, 0, n) for e in range(4)])
    for budget in (1_500, 700):  # two experts per launch; then one expert and 512 columns per launch
        monkeypatch.setattr(nki._core, "DEFAULT_INSTRUCTION_BUDGET", budget)
        assert len(grouped_launch.plan_launches(4, n, k, budget)) > 1
        launch = grouped_launch.prepare_fp4_grouped(x, data, scale, offsets, b, True, 224.0, torch.float32)
        y = _grouped(paged.grouped.fp4_grouped_linear_kernel, launch, budget=budget)
        _assert_grouped_close(y, ref, x, decoded.float(), b, offsets, True, torch.float32)


def test_grouped_offsets_the_reference_refuses_raise():
    x, w, b, offsets = _grouped_inputs([2, 2], 64, 64)
    data, scale = map(torch.stack, zip(*[formats.quantize_fp4(w[e]) for e in range(2)]))
    with pytest.raises(ValueError, match="offsets"):
        grouped_launch.prepare_fp4_grouped(x, data, scale, torch.tensor([3, 2], dtype=torch.int32), b, True, 224.0,
                                           torch.bfloat16)


def test_grouped_scale_codes_outside_the_exact_range_fall_back():
    x, w, b, offsets = _grouped_inputs([2, 2], 64, 64)
    data, scale = map(torch.stack, zip(*[formats.quantize_fp8(w[e]) for e in range(2)]))
    codes = scale.view(torch.uint8).clone()
    codes[1, 0, 0] = dense_launch.FP8_EXACT_CODES[1] + 1
    launch = grouped_launch.prepare_fp8_grouped(x, data, codes.view(scale.dtype), offsets, b, (32, 32), True, 224.0,
                                                torch.bfloat16)
    assert launch.kernel is None and "outside" in launch.fallback


# --------------------------------------------------------------------------- #
# instruction counts of the shapes docs/nki.md lists (within the stand-in's budget)
# --------------------------------------------------------------------------- #


@pytest.mark.slow
def test_full_size_drafter_attention_instruction_count(paged):
    import nki

    case = _case(num_requests=1, rows_per_request=7, hkv=4, hq=64, d=128, block_size=16, window=4096,
                 seq_lens=[4200], positions=list(range(4193, 4200)))
    out, ref, bound = _attention(paged, case, torch.bfloat16)
    assert nki.last_launch.instructions <= dense_launch.INSTRUCTION_BUDGET
    assert nki.last_launch.instructions == 2393  # the count docs/nki.md gives (span 4608, 4 KV heads)
    err = (out.double() - ref.double()).abs()
    assert bool((err <= 2 * bound + 2 * _HALF_ULP[torch.bfloat16] * ref.double().abs()).all())


# --------------------------------------------------------------------------- #
# the stand-in's run-time addressing and control (tests/nki_shim/nki/_dynamic.py)
# --------------------------------------------------------------------------- #


def test_stand_in_indirect_gather_raises_or_skips_out_of_bounds_rows(shim_only):
    nki = shim_only
    import nki.isa as nisa
    import nki.language as nl

    @nki.jit
    def gather(data, idx, skip=False):
        out = nl.ndarray((4, 8), dtype=data.dtype, buffer=nl.shared_hbm)
        ix = nl.ndarray((4, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=ix, src=idx)
        rows = nl.ndarray((4, 8), dtype=data.dtype, buffer=nl.sbuf)
        nisa.memset(dst=rows, value=-1.0)
        mode = nisa.oob_mode.error
        if skip:
            mode = nisa.oob_mode.skip
        nisa.dma_copy(dst=rows, src=data.ap(pattern=[[8, 4], [1, 8]], vector_offset=ix, indirect_dim=0),
                      oob_mode=mode)
        nisa.dma_copy(dst=out, src=rows)
        return out

    data = np.arange(48, dtype=np.float32).reshape(6, 8)
    got = nki.simulate(gather)(data, np.array([[5], [0], [6], [2]], dtype=np.int32), True)
    assert np.array_equal(got[[0, 1, 3]], data[[5, 0, 2]]) and (got[2] == -1).all()
    with pytest.raises(nki.NkiShimError, match="index 6 at partition 2 is outside"):
        nki.simulate(gather)(data, np.array([[5], [0], [6], [2]], dtype=np.int32))


def test_stand_in_dynamic_loop_index_is_a_register(shim_only):
    nki = shim_only
    import nki.isa as nisa
    import nki.language as nl

    @nki.jit
    def loop(x):
        out = nl.ndarray((1, 4), dtype=nl.float32, buffer=nl.shared_hbm)
        t = nl.ndarray((1, 4), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        n = nisa.register_alloc(3)
        for i in nl.dynamic_range(n):
            nisa.tensor_scalar(dst=t, data=t, op0=nl.add, operand0=float(i * 1))
        nisa.dma_copy(dst=out, src=t)
        return out

    with pytest.raises(nki.NkiShimError, match="induction variable of nl.dynamic_range is a register"):
        nki.simulate(loop)(np.zeros((1, 4), dtype=np.float32))


def test_stand_in_dynamic_loop_runs_its_trip_count_and_counts_its_body_once(shim_only):
    nki = shim_only
    import nki.isa as nisa
    import nki.language as nl

    @nki.jit
    def loop(x, count):
        out = nl.ndarray((1, 4), dtype=nl.float32, buffer=nl.shared_hbm)
        t = nl.ndarray((1, 4), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        c = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=c, src=count)
        n = nisa.register_alloc()
        nisa.register_load(n, c)
        for _ in nl.dynamic_range(n):
            nisa.tensor_scalar(dst=t, data=t, op0=nl.add, operand0=1.0)
        nisa.dma_copy(dst=out, src=t)
        return out

    got = nki.simulate(loop)(np.zeros((1, 4), dtype=np.float32), np.array([[5]], dtype=np.int32))
    assert (got == 5).all()
    assert nki.last_launch.instructions == 5  # 2 loads, register_load, one body copy, the store


def test_stand_in_nc_transpose_limits(shim_only):
    nki = shim_only
    import nki.isa as nisa
    import nki.language as nl

    @nki.jit
    def transpose(x, rows=128, vector=False):
        out = nl.ndarray((x.shape[1], rows), dtype=nl.float32, buffer=nl.shared_hbm)
        t = nl.ndarray((128, x.shape[1]), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t[:rows], src=x[:rows])
        ps = nl.ndarray((x.shape[1], 128), dtype=nl.float32, buffer=nl.psum)
        engine = nisa.engine.tensor
        if vector:
            engine = nisa.engine.vector  # the Vector Engine transposes at most 32 x 32
        nisa.nc_transpose(dst=ps[:, :rows], data=t[:rows], engine=engine)
        sb = nl.ndarray((x.shape[1], 128), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=sb[:, :rows], src=ps[:, :rows])
        nisa.dma_copy(dst=out, src=sb[:, :rows])
        return out

    x = np.random.default_rng(0).standard_normal((128, 96)).astype(np.float32)
    assert np.array_equal(nki.simulate(transpose)(x), x.T)
    assert np.array_equal(nki.simulate(transpose)(x[:32, :32], 32, True), x[:32, :32].T)
    with pytest.raises(nki.NkiShimError, match="exceeds \\[32, 32\\]"):
        nki.simulate(transpose)(x, 128, True)


@pytest.mark.parametrize("fmt,e,n,k,expected", [
    ("fp8", 8, 512, 512, 957), ("fp4", 8, 512, 512, 925),
    pytest.param("fp8", 8, 1024, 2048, 6557, marks=pytest.mark.slow),
    pytest.param("fp4", 8, 1024, 2048, 6301, marks=pytest.mark.slow),
])
def test_grouped_instruction_counts_docs_list(paged, fmt, e, n, k, expected):
    import nki

    x, w, _, offsets = _grouped_inputs([1] * e, n, k, bias=False)
    if fmt == "fp8":
        data, scale = map(torch.stack, zip(*[formats.quantize_fp8(w[i]) for i in range(e)]))
        launch = grouped_launch.prepare_fp8_grouped(x, data, scale, offsets, None, (32, 32), True, 224.0,
                                                    torch.bfloat16)
        _grouped(paged.grouped.fp8_grouped_linear_kernel, launch)
    else:
        data, scale = map(torch.stack, zip(*[formats.quantize_fp4(w[i]) for i in range(e)]))
        launch = grouped_launch.prepare_fp4_grouped(x, data, scale, offsets, None, True, 224.0, torch.bfloat16)
        _grouped(paged.grouped.fp4_grouped_linear_kernel, launch)
    assert nki.last_launch.instructions == expected <= dense_launch.INSTRUCTION_BUDGET
