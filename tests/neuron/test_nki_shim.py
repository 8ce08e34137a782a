"""The NumPy NKI stand-in rejects kernels that break documented limits, and models the semantics we rely on.

Each negative test is a small kernel that is wrong in exactly one way; the
stand-in must raise naming the instruction and the offending shape. These test
the stand-in itself, so they skip under ``--nki-backend=simulate``.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest


@pytest.fixture
def nk(shim_only):
    import nki
    import nki.isa as nisa
    import nki.language as nl

    return nki, nisa, nl


def _bf16(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(ml_dtypes.bfloat16)


def _matmul_kernel(nki, nisa, nl, m, n):
    rows = min(m, 128)  # dst rows; an over-wide stationary must be caught by nc_matmul itself

    def kernel(a_t, b):
        k = a_t.shape[0]
        out = nl.ndarray((rows, n), dtype=nl.float32, buffer=nl.shared_hbm)
        a_sb = nl.ndarray((k, m), dtype=nl.bfloat16, buffer=nl.sbuf)
        b_sb = nl.ndarray((k, n), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=a_sb, src=a_t)
        nisa.dma_copy(dst=b_sb, src=b)
        acc = nl.ndarray((rows, n), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=acc, stationary=a_sb, moving=b_sb, accumulate=False)
        res = nl.ndarray((rows, n), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=res, src=acc)
        nisa.dma_copy(dst=out, src=res)
        return out

    return nki.jit(kernel)


def test_matmul_within_limits_is_stationary_transpose_times_moving(nk):
    nki, nisa, nl = nk
    a_t, b = _bf16((128, 128)), _bf16((128, 512), 1)
    out = nki.simulate(_matmul_kernel(nki, nisa, nl, 128, 512))(a_t, b)
    expected = a_t.astype(np.float64).T @ b.astype(np.float64)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-4)


def test_rejects_over_wide_moving_tile(nk):
    nki, nisa, nl = nk
    # 513 fp32 columns do not fit one 2 KiB PSUM bank: the moving free dim is capped at 512.
    # (The PSUM tile itself is legal, it spans two banks.)
    with pytest.raises(nki.NkiShimError, match=r"nc_matmul: moving free dim 513 > 512.*\[128, 513\]"):
        nki.simulate(_matmul_kernel(nki, nisa, nl, 128, 513))(_bf16((128, 128)), _bf16((128, 513)))


def test_rejects_over_wide_stationary_tile(nk):
    nki, nisa, nl = nk
    # 129 stationary columns would be 129 output partitions; the PE array has 128 columns.
    with pytest.raises(nki.NkiShimError, match=r"nc_matmul: stationary free dim 129 > 128.*\[128, 129\]"):
        nki.simulate(_matmul_kernel(nki, nisa, nl, 129, 64))(_bf16((128, 129)), _bf16((128, 64)))


def test_rejects_partition_dim_over_128(nk):
    nki, nisa, nl = nk

    @nki.jit
    def kernel(x):
        t = nl.ndarray((129, 4), dtype=nl.float32, buffer=nl.sbuf, name="tall")
        return t

    with pytest.raises(nki.NkiShimError, match=r"partition dim 129 > 128.*tall\[129, 4\]"):
        nki.simulate(kernel)(np.zeros((1, 1), np.float32))


def test_rejects_dma_transpose_of_one_byte_dtype(nk):
    nki, nisa, nl = nk

    @nki.jit
    def kernel(w):
        out = nl.ndarray((64, 32), dtype=nl.uint8, buffer=nl.shared_hbm)
        t = nl.ndarray((64, 32), dtype=nl.uint8, buffer=nl.sbuf)
        nisa.dma_transpose(dst=t, src=w)
        nisa.dma_copy(dst=out, src=t)
        return out

    with pytest.raises(nki.NkiShimError, match=r"dma_transpose: only 2-byte dtypes.*\[32, 64\] uint8"):
        nki.simulate(kernel)(np.zeros((32, 64), np.uint8))


def test_dma_transpose_of_uint16_view_is_allowed(nk):
    nki, nisa, nl = nk

    @nki.jit
    def kernel(w):
        out = nl.ndarray((16, 128), dtype=nl.uint8, buffer=nl.shared_hbm)
        raw = nl.ndarray((64, 32), dtype=nl.uint8, buffer=nl.sbuf)
        nisa.dma_copy(dst=raw, src=w)
        t = nl.ndarray((16, 64), dtype=nl.uint16, buffer=nl.sbuf)
        nisa.dma_transpose(dst=t, src=raw.view(nl.uint16))  # byte pairs move together
        nisa.dma_copy(dst=out, src=t.view(nl.uint8))
        return out

    w = np.arange(64 * 32, dtype=np.uint16).astype(np.uint8).reshape(64, 32)
    out = nki.simulate(kernel)(w)
    expected = w.view(np.uint16).T.copy().view(np.uint8)
    assert np.array_equal(out, expected)


def test_rejects_reading_memory_nobody_wrote(nk):
    nki, nisa, nl = nk

    @nki.jit
    def kernel(x):
        out = nl.ndarray((8, 16), dtype=nl.float32, buffer=nl.shared_hbm)
        t = nl.ndarray((8, 16), dtype=nl.float32, buffer=nl.sbuf, name="fresh")
        nisa.dma_copy(dst=t[:, :8], src=x)  # half the tile
        nisa.dma_copy(dst=out, src=t)
        return out

    with pytest.raises(nki.NkiShimError, match=r"dma_copy: reads uninitialised memory of fresh\[8, 16\]"):
        nki.simulate(kernel)(np.ones((8, 8), np.float32))


def test_fresh_allocations_are_nan_filled(nk):
    nki, nisa, nl = nk
    # Observed from outside a kernel (a kernel cannot read unwritten memory: that raises).
    nki._core.Launch.current = nki._core._Program(nki._core.Launch(1), 0)
    try:
        t = nl.ndarray((4, 4), dtype=nl.bfloat16, buffer=nl.sbuf)
        assert np.isnan(np.array(t.arr, dtype=np.float32)).all()
    finally:
        nki._core.Launch.current = None


def test_rejects_accumulate_into_psum_no_matmul_initialised(nk):
    nki, nisa, nl = nk

    @nki.jit
    def kernel(a_t, b):
        out = nl.ndarray((16, 16), dtype=nl.float32, buffer=nl.shared_hbm)
        a_sb = nl.ndarray((32, 16), dtype=nl.bfloat16, buffer=nl.sbuf)
        b_sb = nl.ndarray((32, 16), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=a_sb, src=a_t)
        nisa.dma_copy(dst=b_sb, src=b)
        acc = nl.ndarray((16, 16), dtype=nl.float32, buffer=nl.psum)
        nisa.memset(dst=acc, value=0.0)  # initialised, but not by a matmul
        nisa.nc_matmul(dst=acc, stationary=a_sb, moving=b_sb, accumulate=True)
        return out

    with pytest.raises(nki.NkiShimError, match=r"nc_matmul: accumulate=True into PSUM no matmul initialised"):
        nki.simulate(kernel)(_bf16((32, 16)), _bf16((32, 16)))


def test_psum_accumulate_flag_sums_in_fp32(nk):
    nki, nisa, nl = nk

    @nki.jit
    def kernel(a_t, b):
        out = nl.ndarray((16, 8), dtype=nl.float32, buffer=nl.shared_hbm)
        acc = nl.ndarray((16, 8), dtype=nl.float32, buffer=nl.psum)
        for kb in range(3):
            a_sb = nl.ndarray((128, 16), dtype=nl.bfloat16, buffer=nl.sbuf)
            b_sb = nl.ndarray((128, 8), dtype=nl.bfloat16, buffer=nl.sbuf)
            nisa.dma_copy(dst=a_sb, src=a_t[kb * 128:(kb + 1) * 128, :])
            nisa.dma_copy(dst=b_sb, src=b[kb * 128:(kb + 1) * 128, :])
            nisa.nc_matmul(dst=acc, stationary=a_sb, moving=b_sb, accumulate=(kb > 0))
        res = nl.ndarray((16, 8), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=res, src=acc)
        nisa.dma_copy(dst=out, src=res)
        return out

    a_t, b = _bf16((384, 16)), _bf16((384, 8), 2)
    out = nki.simulate(kernel)(a_t, b)
    np.testing.assert_allclose(out, a_t.astype(np.float64).T @ b.astype(np.float64), rtol=1e-5, atol=1e-4)


def test_rejects_sbuf_over_budget_but_frees_rebound_tiles(nk):
    nki, nisa, nl = nk

    @nki.jit
    def looping(x):
        for _ in range(10):
            # 80 KiB a partition each. The previous tile is still live while the next is
            # allocated (as with double buffering), so the peak is two tiles, not ten.
            t = nl.ndarray((128, 20480), dtype=nl.float32, buffer=nl.sbuf)
        out = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=x)
        return out

    nki.simulate(looping)(np.zeros((1, 1), np.float32))
    assert nki.last_launch.sbuf_peak == 2 * 20480 * 4

    @nki.jit
    def hoarding(x):
        kept = []
        for i in range(3):
            kept.append(nl.ndarray((128, 20480), dtype=nl.float32, buffer=nl.sbuf, name="t" + str(i)))
        return kept

    with pytest.raises(nki.NkiShimError, match=r"SBUF budget exceeded allocating t2\[128, 20480\]"):
        nki.simulate(hoarding)(np.zeros((1, 1), np.float32))


def test_rejects_more_than_eight_psum_banks(nk):
    nki, nisa, nl = nk

    @nki.jit
    def kernel(x):
        accs = []
        for i in range(9):
            accs.append(nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum, name="acc" + str(i)))
        return accs

    with pytest.raises(nki.NkiShimError, match=r"PSUM exhausted allocating acc8\[128, 512\].*8 of 8"):
        nki.simulate(kernel)(np.zeros((1, 1), np.float32))


def test_rejects_bitwise_op_on_float_tile(nk):
    nki, nisa, nl = nk

    @nki.jit
    def kernel(x):
        t = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.sbuf, name="f")
        nisa.dma_copy(dst=t, src=x)
        nisa.tensor_scalar(dst=t, data=t, op0=nl.bitwise_and, operand0=0x7FFFFFFF)
        return t

    with pytest.raises(nki.NkiShimError, match=r"tensor_scalar: bitvec operator needs integer tiles.*f\[4, 8\] float32"):
        nki.simulate(kernel)(np.ones((4, 8), np.float32))


def test_view_reinterprets_bytes_and_bitwise_ops_work_on_integer_views(nk):
    nki, nisa, nl = nk

    @nki.jit
    def kernel(x):
        out = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.shared_hbm)
        t = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        assert t.view(nl.uint8).shape == (4, 32) and t.view(nl.bfloat16).shape == (4, 16)
        bits = t.view(nl.int32)
        nisa.tensor_scalar(dst=bits, data=bits, op0=nl.bitwise_and, operand0=0x7FFFFFFF)  # |x|
        nisa.dma_copy(dst=out, src=t)
        return out

    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    assert np.array_equal(nki.simulate(kernel)(x), np.abs(x))


def test_fp8_e4m3_saturates_at_240_and_e4m3fn_at_448(nk):
    nki, nisa, nl = nk

    def kernel_for(dtype):
        @nki.jit
        def kernel(x):
            out = nl.ndarray((1, 6), dtype=nl.float32, buffer=nl.shared_hbm)
            t = nl.ndarray((1, 6), dtype=nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=t, src=x)
            q = nl.ndarray((1, 6), dtype=dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=q, src=t)
            nisa.tensor_copy(dst=t, src=q)
            nisa.dma_copy(dst=out, src=t)
            return out

        return kernel

    x = np.array([[300.0, -1000.0, 239.0, 232.0, 224.0, 2.0**-9]], np.float32)
    e4m3 = nki.simulate(kernel_for(nl.float8_e4m3))(x)
    assert e4m3.tolist() == [[240.0, -240.0, 240.0, 224.0, 224.0, 2.0**-9]]  # 232 ties to even (224)
    e4m3fn = nki.simulate(kernel_for(nl.float8_e4m3fn))(x)
    assert e4m3fn.tolist() == [[288.0, -448.0, 240.0, 224.0, 224.0, 2.0**-9]]  # same mantissa grid below 256


def test_rejects_e4m3fn_in_trainium2_matmul(nk):
    nki, nisa, nl = nk

    @nki.jit
    def kernel(a):
        q = nl.ndarray((32, 16), dtype=nl.float8_e4m3fn, buffer=nl.sbuf)
        t = nl.ndarray((32, 16), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=a)
        nisa.tensor_copy(dst=q, src=t)
        acc = nl.ndarray((16, 16), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=acc, stationary=q, moving=q)
        return acc

    with pytest.raises(nki.NkiShimError, match=r"nc_matmul: dtype float8_e4m3fn is not a Trainium2 matmul input"):
        nki.simulate(kernel)(np.ones((32, 16), np.float32))


def test_arithmetic_is_fp32_with_one_cast_on_write(nk):
    nki, nisa, nl = nk

    @nki.jit
    def kernel(x):
        out = nl.ndarray((8, 64), dtype=nl.bfloat16, buffer=nl.shared_hbm)
        t = nl.ndarray((8, 64), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        r = nl.ndarray((8, 64), dtype=nl.bfloat16, buffer=nl.sbuf)
        # (x * 1/3) + 1 in fp32, rounded to bf16 once (not after each op)
        nisa.tensor_scalar(dst=r, data=t, op0=nl.multiply, operand0=1.0 / 3.0, op1=nl.add, operand1=1.0)
        nisa.dma_copy(dst=out, src=r)
        return out

    x = _bf16((8, 64), 5)
    out = nki.simulate(kernel)(x)
    once = (x.astype(np.float32) * np.float32(1.0 / 3.0) + np.float32(1.0)).astype(ml_dtypes.bfloat16)
    assert np.array_equal(out.view(np.uint16), once.view(np.uint16))


def test_rejects_dma_into_psum(nk):
    nki, nisa, nl = nk

    @nki.jit
    def kernel(x):
        acc = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.psum, name="acc")
        nisa.dma_copy(dst=acc, src=x)
        return acc

    with pytest.raises(nki.NkiShimError, match=r"dma_copy: DMA cannot access PSUM"):
        nki.simulate(kernel)(np.zeros((4, 4), np.float32))


def test_lnc2_runs_two_programs_sharing_the_output(nk):
    nki, nisa, nl = nk

    @nki.jit
    def kernel(x):
        pid = nl.program_id(0)
        out = nl.ndarray((2, 4), dtype=nl.float32, buffer=nl.shared_hbm)
        t = nl.ndarray((1, 4), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x[pid:pid + 1, :])
        nisa.dma_copy(dst=out[pid:pid + 1, :], src=t)  # each core writes its own row
        return out

    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    assert np.array_equal(nki.simulate(kernel[2])(x), x)  # both programs ran, with ids 0 and 1
    # On one core only row 0 is written: the stand-in refuses to return a partly written output.
    with pytest.raises(nki.NkiShimError, match=r"4 element\(s\) never written"):
        nki.simulate(kernel)(x)
    with pytest.raises(nki.NkiShimError, match=r"LNC 1 or 2"):
        kernel[4]
