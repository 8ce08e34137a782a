"""NKI kernels for ``torch_bq::fp8_grouped_linear`` / ``fp4_grouped_linear``: many experts per launch.

Importing this module imports ``nki``; only the neuron registration and the tests do so.
Arguments arrive laid out by :mod:`torch_bq.ops.nki.grouped_launch`. Each expert's rows get
exactly the dense kernels' math (docs/contract.md §4): the same activation round trip
(:func:`.qdq.qdq_chunk`), the same exact weight decode (:mod:`.decode`), fp32 PSUM sums and
one rounding, so a grouped result differs from the reference only by fp32 summation order.

Routing is data: the kernel reads each expert's row range from ``bounds`` at run time and
runs a dynamic loop (``nl.dynamic_range`` over a register) over that expert's 128-row tiles,
so an expert with no rows runs no iteration and its weight is never read or decoded. Rows
are gathered and the results scattered with indirect DMA (one row index per partition);
rows of a tile past the expert's end carry the out-of-bounds index ``T`` and are skipped.
The output ``y`` is an argument the kernel writes into and returns, so that the experts and
columns of a layer too large for one launch's instruction budget are a chain of launches
(:func:`torch_bq.ops.nki.grouped_launch.run_grouped`); small layers are one launch.
"""

from __future__ import annotations

import nki
import nki.isa as nisa
import nki.language as nl

from .decode import decode_fp4_tile, decode_fp8_tile
from .qdq import QDQ_BLOCK, qdq_chunk

PT = 128  # partitions: rows per tile, K tile
N_TILE = 512  # fp32 columns in one PSUM bank
K_CHUNK = 512  # weight columns decoded (and activation columns round-tripped) per step


def _cdiv(a, b):
    return (a + b - 1) // b


def _stage_rows(x, rows_idx, k, act_quant, act_peak):
    """``[PT, KT, PT]`` bf16: ``A`` of the tile's rows (gathered by ``rows_idx``), transposed K-major."""
    a_t = nl.ndarray((PT, _cdiv(k, PT), PT), dtype=nl.bfloat16, buffer=nl.sbuf, name="grp_act_T")
    for c0 in range(0, k, K_CHUNK):
        kc = min(K_CHUNK, k - c0)
        nb = kc // QDQ_BLOCK
        x_sb = nl.ndarray((PT, nb, QDQ_BLOCK), dtype=nl.bfloat16, buffer=nl.sbuf, name="grp_x")
        nisa.memset(dst=x_sb, value=0.0)  # skipped rows (past the expert) stay 0: finite through qdq
        nisa.dma_copy(dst=x_sb, src=x.ap(pattern=[[k, PT], [1, kc]], offset=c0, vector_offset=rows_idx,
                                         indirect_dim=0), oob_mode=nisa.oob_mode.skip)
        src = x_sb.reshape((PT, kc))
        if act_quant:
            src = qdq_chunk(x_sb, PT, nb, act_peak).reshape((PT, kc))
        for k0 in range(c0, c0 + kc, PT):
            kt = min(PT, k - k0)
            nisa.dma_transpose(dst=a_t[:kt, k0 // PT, :], src=src[:, k0 - c0:k0 - c0 + kt])
    return a_t


def _expert_tile(x, weight, scale, bias, y, e, rows_idx, fmt, act_quant, act_peak, block, n_lo, n_hi):
    """``y[rows_idx, n_lo:n_hi] = round(A @ W_e.T + bias_e)`` for one 128-row tile of expert ``e``."""
    k = x.shape[1]
    w_e = weight[e]
    s_e = scale[e]
    a_t = _stage_rows(x, rows_idx, k, act_quant, act_peak)
    for n0 in range(n_lo, n_hi, N_TILE):
        nt = min(N_TILE, n_hi - n0)
        acc = nl.ndarray((PT, N_TILE), dtype=nl.float32, buffer=nl.psum, name="grp_acc")
        for c0 in range(0, k, K_CHUNK):
            kc = min(K_CHUNK, k - c0)
            w_t = nl.ndarray((PT, K_CHUNK // PT, N_TILE), dtype=nl.bfloat16, buffer=nl.sbuf, name="grp_w_T")
            for r0 in range(0, nt, PT):
                rows = min(PT, nt - r0)
                if fmt == "fp8":
                    w = decode_fp8_tile(w_e, s_e, n0 + r0, rows, c0, kc, block[0], block[1])[:rows]
                else:
                    w = decode_fp4_tile(w_e, s_e, n0 + r0, rows, c0, kc)[:rows]
                for j in range(_cdiv(kc, PT)):
                    kt = min(PT, kc - j * PT)
                    nisa.dma_transpose(dst=w_t[:kt, j, r0:r0 + rows], src=w[:, j * PT:j * PT + kt])
            for j in range(_cdiv(kc, PT)):
                kb = c0 // PT + j
                kt = min(PT, k - kb * PT)
                nisa.nc_matmul(dst=acc[:, :nt], stationary=a_t[:kt, kb, :], moving=w_t[:kt, j, :nt],
                               accumulate=(kb > 0))
        out_sb = nl.ndarray((PT, N_TILE), dtype=y.dtype, buffer=nl.sbuf, name="grp_y")
        if bias != None:  # noqa: E711  (NKI has no `is`)
            bias_sb = nl.ndarray((PT, N_TILE), dtype=nl.float32, buffer=nl.sbuf, name="grp_bias")
            nisa.dma_copy(dst=bias_sb[:, :nt], src=bias[e:e + 1, n0:n0 + nt].broadcast(0, PT))
            nisa.tensor_tensor(dst=out_sb[:, :nt], data1=acc[:, :nt], data2=bias_sb[:, :nt], op=nl.add)
        else:
            nisa.tensor_copy(dst=out_sb[:, :nt], src=acc[:, :nt])
        n = y.shape[1]
        nisa.dma_copy(dst=y.ap(pattern=[[n, PT], [1, nt]], offset=n0, vector_offset=rows_idx, indirect_dim=0),
                      src=out_sb[:, :nt], oob_mode=nisa.oob_mode.skip)


def _grouped(x, weight, scale, bounds, y, bias, fmt, act_quant, act_peak, block, n_begin, n_end):
    """The shared body: one static loop over experts, a dynamic loop over each expert's row tiles."""
    t, k = x.shape
    n_experts = weight.shape[0]
    # This core's columns of [n_begin, n_end): whole 128-column groups (as the dense kernels split).
    span = _cdiv(_cdiv(n_end - n_begin, PT), nl.num_programs(0)) * PT
    n_lo = min(n_end, n_begin + nl.program_id(0) * span)
    n_hi = min(n_end, n_lo + span)

    # bounds[0, e] / bounds[1, e]: first row and end of expert e, on every partition.
    se = nl.ndarray((PT, 2, n_experts), dtype=nl.int32, buffer=nl.sbuf, name="grp_bounds")
    nisa.dma_copy(dst=se, src=bounds.reshape((1, 2, n_experts)).broadcast(0, PT))
    tiles = nl.ndarray((1, n_experts), dtype=nl.int32, buffer=nl.sbuf, name="grp_tiles")
    # ceil((end - start) / 128): int32 subtraction on GpSimd, + 127 in fp32 (exact below 2**24), >> 7.
    nisa.tensor_tensor(dst=tiles, data1=se[0:1, 1, :], data2=se[0:1, 0, :], op=nl.subtract)
    nisa.tensor_scalar(dst=tiles, data=tiles, op0=nl.add, operand0=float(PT - 1))
    nisa.tensor_scalar(dst=tiles, data=tiles, op0=nl.right_shift, operand0=7)
    lane = nl.ndarray((PT, 1), dtype=nl.int32, buffer=nl.sbuf, name="grp_lane")
    nisa.iota(dst=lane, pattern=[[0, 1]], offset=0, channel_multiplier=1)

    for e in range(n_experts):
        idx = nl.ndarray((PT, 1), dtype=nl.int32, buffer=nl.sbuf, name="grp_idx")
        nisa.tensor_tensor(dst=idx, data1=lane, data2=se[:, 0, e:e + 1], op=nl.add)
        count = nisa.register_alloc()
        nisa.register_load(count, tiles[0:1, e:e + 1])
        for _ in nl.dynamic_range(count):  # 0 iterations for an expert without rows
            # Rows past the expert's end -> index T (out of bounds): not gathered, not written.
            inside = nl.ndarray((PT, 1), dtype=nl.int32, buffer=nl.sbuf, name="grp_inside")
            nisa.tensor_tensor(dst=inside, data1=idx, data2=se[:, 1, e:e + 1], op=nl.less)
            rows_idx = nl.ndarray((PT, 1), dtype=nl.int32, buffer=nl.sbuf, name="grp_rows")
            nisa.tensor_scalar(dst=rows_idx, data=idx, op0=nl.subtract, operand0=float(t))
            nisa.tensor_tensor(dst=rows_idx, data1=rows_idx, data2=inside, op=nl.multiply)
            nisa.tensor_scalar(dst=rows_idx, data=rows_idx, op0=nl.add, operand0=float(t))
            _expert_tile(x, weight, scale, bias, y, e, rows_idx, fmt, act_quant, act_peak, block, n_lo, n_hi)
            nisa.tensor_scalar(dst=idx, data=idx, op0=nl.add, operand0=float(PT))
    return y


@nki.jit
def fp8_grouped_linear_kernel(x, weight, scale, bounds, y, bias=None, act_quant=True, act_peak=224.0,
                              block_rows=32, block_cols=32, n_begin=0, n_end=1):
    """Rows ``bounds[0, e]:bounds[1, e]`` of ``x`` through expert ``e``'s fp8 linear, all experts given, one launch.

    Args (HBM): ``x`` ``[T, K]`` bf16 (rows sorted by expert); ``weight`` ``[E, N, K]`` uint8
    (e4m3fn bytes); ``scale`` ``[E, ceil(N/bn), K/bk]`` uint8 e8m0 codes (exact for codes in
    ``FP8_EXACT_CODES`` of :mod:`.launch`); ``bounds`` ``[2, E]`` int32 (first row, end row of each expert: every row of
    ``x`` in at most one range); ``y`` ``[T, N]`` (bf16/fp16/fp32), the output, written in place and
    returned: columns ``n_begin:n_end`` of the rows of these experts (``N`` here is ``y``'s; the
    weight holds only those experts, so a layer with more experts than fit the instruction budget
    is several launches, each writing its experts' rows, see :mod:`.grouped_launch`); ``bias``
    ``[E, N]`` fp32 or ``None``. ``K % 32 == 0``, ``T < 2**24``; blocks as the dense fp8 kernel.

    Tiling: for each expert (static loop), for each of its 128-row tiles (dynamic loop,
    trip count ``ceil(rows_e / 128)`` loaded into a register)::

        idx  <- row indices of the tile (T past the expert's end)
        aT   <- transpose(qdq(gather(x, idx)))   per 512-column chunk, K-major [128, K/128, 128]
        for each N tile (512) of this core's span:
            for each K chunk: wT <- transpose(decode_fp8(W_e rows, chunk)); nc_matmul(acc, aT, wT)
            scatter(y, idx) <- round(acc + bias_e)

    SBUF per partition: staged A ``2 K`` B (<= 64 KiB at K = 32768; 14 KiB at K = 7168), qdq
    3.8 KiB, decode 4.6 KiB, wT 4 KiB, bias + output 4 KiB, bounds ``8 E`` B: <= ~82 KiB.
    PSUM: one 2 KiB bank (one row tile at a time).

    Instructions: the loop body is emitted once per expert (dynamic loops are not unrolled),
    about ``E x ceil(N/512) x ceil(K/512) x 50`` (weight decode and transposes dominate); measured
    on the stand-in: 957 for E = 8, N = K = 512 and 6,557 for E = 8, N = 1024, K = 2048 (fp4: 925
    and 6,301). A model-size expert set exceeds the 20,000 budget (docs/nki.md). Under LNC=2 each
    core takes half of N.
    """
    assert (not act_quant) or act_peak <= 240.0, "act_peak > 240: Trainium2's fp8 e4m3 saturates at 240"
    return _grouped(x, weight, scale, bounds, y, bias, "fp8", act_quant, act_peak, (block_rows, block_cols), n_begin,
                    n_end)


@nki.jit
def fp4_grouped_linear_kernel(x, weight, scale, bounds, y, bias=None, act_quant=True, act_peak=224.0, n_begin=0,
                              n_end=1):
    """Rows ``bounds[0, e]:bounds[1, e]`` of ``x`` through expert ``e``'s MXFP4 linear (W4A8 by default).

    Args (HBM): ``x`` ``[T, K]`` bf16; ``weight`` ``[E, N, K/2]`` uint8 (element ``2j`` in the low
    nibble of byte ``j``); ``scale`` ``[E, N, K/32]`` uint8 e8m0 codes (exact for ``FP4_EXACT_CODES``);
    ``bounds``, ``y``, ``bias``, ``n_begin``, ``n_end`` as :func:`fp8_grouped_linear_kernel`. ``K % 64 == 0``.

    Tiling, SBUF/PSUM and instruction counts as :func:`fp8_grouped_linear_kernel`, with the
    fp4 decode (:func:`.decode.decode_fp4_tile`).
    """
    assert (not act_quant) or act_peak <= 240.0, "act_peak > 240: Trainium2's fp8 e4m3 saturates at 240"
    return _grouped(x, weight, scale, bounds, y, bias, "fp4", act_quant, act_peak, (32, 32), n_begin, n_end)
