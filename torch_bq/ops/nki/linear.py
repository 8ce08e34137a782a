"""NKI GEMM kernels for the ``torch_bq::`` linear ops on Trainium2 (docs/contract.md §4).

Importing this module imports ``nki``; only the neuron registration and the
tests do so. Arguments arrive laid out by :mod:`torch_bq.ops.nki.launch`.

All four kernels share one tiling (:func:`_linear`) and differ in how a weight
tile becomes bf16 (:mod:`torch_bq.ops.nki.decode`):

* ``fp8_linear_kernel``  e4m3 bytes x e8m0 block codes (32x32, 1x32, 128x128, ...), optional qdq
* ``fp4_linear_kernel``  packed e2m1 x 1x32 e8m0 codes, activation qdq (W4A8)
* ``bf16_linear_kernel`` bf16 weight, DMA-transposed straight from HBM
* ``fp32w_linear_kernel`` fp32 weight narrowed to bf16 in SBUF

Launched as ``kernel(...)`` they run on one core; as ``kernel[2](...)`` (LNC=2)
each core takes a contiguous span of whole 128-column groups of N.

Tiling (``nc_matmul(dst, stationary, moving)`` computes ``stationary.T @ moving``,
contraction on partitions, so both operands are staged K-major)::

    M tile   128 rows  (stationary free dim <= 128; a partial last tile is sliced)
    N tile   512 cols  (moving free dim <= 512 = one 2 KiB fp32 PSUM bank)
    K tile   128       (partition dim); weights decoded 512 columns at a time
    M group  up to 4 M tiles staged K-major at once (<= 64 KiB), one PSUM bank each

    for each group of M tiles:
        aT[g] <- bf16(x) or qdq(x), transposed to [K, 128] tiles (dma_transpose, bf16)
        for each N tile of this core's span:
            acc[g] <- PSUM [128, 512] fp32 per M tile of the group
            for each 512-column K chunk:
                for each 128-row block of the N tile:
                    w <- decode(weight rows, chunk) as bf16 [128, 512]   (N-major)
                    wT[:, j, block] <- dma_transpose(w[:, j*128:(j+1)*128])
                for each K tile j of the chunk, each M tile g:
                    nc_matmul(acc[g], aT[g][:, kb, :], wT[:, j, :], accumulate=(kb > 0))
            y[g] <- acc[g] * post_scale (+ bias), one rounding to out_dtype

SBUF budget per partition (live at once, worst case):

    staged activations  min(4, 64 KiB // 2K) M tiles x 2K B   <= 64.0 KiB
    qdq of one chunk    (qdq.qdq_chunk, while staging)          ~3.8 KiB
    weight decode       (decode.decode_*_tile)                  ~4.6 KiB
    wT                  4 x 512 x 2 B                            4.0 KiB
    bias, output tile   512 x 4 B + 512 x <= 4 B                 4.0 KiB
    total                                                      <= ~80 KiB of 192 KiB

The stand-in measures 63.5 KiB for M=512, K=6144, N=600 (fp8, a full group of
4 staged tiles) and 76.5 KiB for M=130, K=32768 (``MAX_K``, one staged tile).
PSUM: one 2 KiB bank per M tile of the group, at most 4 of the 8 banks.
"""

from __future__ import annotations

import nki
import nki.isa as nisa
import nki.language as nl

from .decode import FP4_POST_EXP, decode_fp4_tile, decode_fp8_tile, load_dense_tile
from .qdq import QDQ_BLOCK, qdq_chunk

PT = 128  # partitions; also the M and K tile
N_TILE = 512  # fp32 columns in one PSUM bank
K_CHUNK = 512  # weight columns decoded per step
STAGE_BYTES = 64 * 1024  # staged K-major activations per partition
MAX_GROUP = 4  # PSUM banks for the accumulators of one M group (of 8)
# Kernel arguments stay plain strings; NKI dictionaries take string keys.
_OUT_DTYPES = {"bfloat16": nl.bfloat16, "float16": nl.float16, "float32": nl.float32}


def _cdiv(a, b):
    return (a + b - 1) // b


def _stage_activation(x, m0, rows, k, act_quant, act_peak):
    """``[PT, KT, PT]`` bf16 tile: ``aT[:, kb, :rows]`` is ``A[m0:m0+rows, kb*128:...].T``."""
    kt_count = _cdiv(k, PT)
    a_t = nl.ndarray((PT, kt_count, PT), dtype=nl.bfloat16, buffer=nl.sbuf, name="act_T")
    for c0 in range(0, k, K_CHUNK):
        kc = min(K_CHUNK, k - c0)
        if act_quant:
            nb = kc // QDQ_BLOCK
            x_sb = nl.ndarray((PT, nb, QDQ_BLOCK), dtype=nl.bfloat16, buffer=nl.sbuf, name="act_x")
            nisa.dma_copy(dst=x_sb[:rows], src=x[m0:m0 + rows, c0:c0 + kc])
            src = qdq_chunk(x_sb, rows, nb, act_peak).reshape((PT, kc))
        for k0 in range(c0, c0 + kc, PT):
            kt = min(PT, k - k0)
            if act_quant:
                nisa.dma_transpose(dst=a_t[:kt, k0 // PT, :rows], src=src[:rows, k0 - c0:k0 - c0 + kt])
            else:
                nisa.dma_transpose(dst=a_t[:kt, k0 // PT, :rows], src=x[m0:m0 + rows, k0:k0 + kt])
    return a_t


def _weight_chunk(fmt, weight, scale, n0, nt, c0, kc, block):
    """``[PT, K_CHUNK // PT, N_TILE]`` bf16: ``wT[:, j, :nt]`` is ``W[n0:n0+nt, c0+j*128:...].T``."""
    w_t = nl.ndarray((PT, K_CHUNK // PT, N_TILE), dtype=nl.bfloat16, buffer=nl.sbuf, name="w_T")
    for r0 in range(0, nt, PT):
        rows = min(PT, nt - r0)
        row0 = n0 + r0
        if fmt == "bf16":
            w = None  # already bf16 in HBM: transpose straight from there
        elif fmt == "fp8":
            w = decode_fp8_tile(weight, scale, row0, rows, c0, kc, block[0], block[1])
        elif fmt == "fp4":
            w = decode_fp4_tile(weight, scale, row0, rows, c0, kc)
        else:
            w = load_dense_tile(weight, row0, rows, c0, kc)
        for j in range(_cdiv(kc, PT)):
            kt = min(PT, kc - j * PT)
            if w is None:
                src = weight[row0:row0 + rows, c0 + j * PT:c0 + j * PT + kt]
            else:
                src = w[:rows, j * PT:j * PT + kt]
            nisa.dma_transpose(dst=w_t[:kt, j, r0:r0 + rows], src=src)
    return w_t


def _core_span(n):
    """This core's columns of N: whole 128-column groups, contiguous, split as evenly as possible."""
    nprog = nl.num_programs(0)
    pid = nl.program_id(0)
    span = _cdiv(_cdiv(n, PT), nprog) * PT
    lo = min(n, pid * span)
    return lo, min(n, lo + span)


def _linear(x, weight, scale, bias, fmt, act_quant, act_peak, out_dtype, block=(32, 32)):
    """The shared GEMM; see the module docstring for tiling and budgets."""
    m, k = x.shape
    n = weight.shape[0]
    y = nl.ndarray((m, n), dtype=_OUT_DTYPES[out_dtype], buffer=nl.shared_hbm, name="y")
    n_lo, n_hi = _core_span(n)
    m_tiles = _cdiv(m, PT)
    group = max(1, min(MAX_GROUP, STAGE_BYTES // (2 * PT * _cdiv(k, PT))))
    for g0 in range(0, m_tiles, group):
        # One call per group, so a group's staged tiles are dead before the next is staged.
        _linear_group(x, weight, scale, bias, y, fmt, act_quant, act_peak, block,
                      range(g0, min(m_tiles, g0 + group)), n_lo, n_hi)
    return y


def _linear_group(x, weight, scale, bias, y, fmt, act_quant, act_peak, block, m_tile_ids, n_lo, n_hi):
    """``y[rows of the group, n_lo:n_hi]`` for a group of M tiles staged together."""
    m, k = x.shape
    post_scale = float(2 ** FP4_POST_EXP) if fmt == "fp4" else 1.0
    tiles = []
    for mi in m_tile_ids:
        rows = min(PT, m - mi * PT)
        tiles.append((mi * PT, rows, _stage_activation(x, mi * PT, rows, k, act_quant, act_peak)))

    for n0 in range(n_lo, n_hi, N_TILE):
        nt = min(N_TILE, n_hi - n0)
        accs = [nl.ndarray((PT, N_TILE), dtype=nl.float32, buffer=nl.psum, name="acc") for _ in tiles]
        for c0 in range(0, k, K_CHUNK):
            kc = min(K_CHUNK, k - c0)
            w_t = _weight_chunk(fmt, weight, scale, n0, nt, c0, kc, block)
            for j in range(_cdiv(kc, PT)):
                kb = c0 // PT + j
                kt = min(PT, k - kb * PT)
                for g in range(len(tiles)):
                    m0, rows, a_t = tiles[g]
                    nisa.nc_matmul(dst=accs[g][:rows, :nt], stationary=a_t[:kt, kb, :rows],
                                   moving=w_t[:kt, j, :nt], accumulate=(kb > 0))

        if bias is not None:
            bias_sb = nl.ndarray((PT, N_TILE), dtype=nl.float32, buffer=nl.sbuf, name="bias")
            nisa.dma_copy(dst=bias_sb[:, :nt], src=bias[0:1, n0:n0 + nt].broadcast(0, PT))
        for g in range(len(tiles)):
            m0, rows, _ = tiles[g]
            acc = accs[g]
            out_sb = nl.ndarray((PT, N_TILE), dtype=y.dtype, buffer=nl.sbuf, name="y_sb")
            # One rounding: (acc * post_scale + bias) in fp32, cast once on write.
            if bias is not None:
                nisa.scalar_tensor_tensor(dst=out_sb[:rows, :nt], data=acc[:rows, :nt], op0=nl.multiply,
                                          operand0=post_scale, op1=nl.add, operand1=bias_sb[:rows, :nt])
            else:
                nisa.tensor_scalar(dst=out_sb[:rows, :nt], data=acc[:rows, :nt], op0=nl.multiply,
                                   operand0=post_scale)
            nisa.dma_copy(dst=y[m0:m0 + rows, n0:n0 + nt], src=out_sb[:rows, :nt])


@nki.jit
def fp8_linear_kernel(x, weight, scale, bias=None, act_quant=True, act_peak=224.0, out_dtype="bfloat16",
                      block_rows=32, block_cols=32):
    """``y = round(A @ W.T + bias)`` with an fp8 weight and e8m0 block scales (32x32 by default).

    Args (HBM): ``x`` ``[M, K]`` bf16; ``weight`` ``[N, K]`` uint8 (e4m3fn bytes);
    ``scale`` ``[ceil(N/bn), K/bk]`` uint8 e8m0 codes (exact for codes in ``[3, 134]``,
    scales ``2**-124 .. 2**7``); ``bias`` ``[1, N]`` fp32 or ``None``. ``K % 32 == 0``,
    ``act_peak <= 240``. ``A = qdq(x, act_peak)`` if ``act_quant`` else ``x``.
    ``(bn, bk) = (block_rows, block_cols)``: ``bn`` divides 128 or is a multiple of it
    (1 = MXFP8), ``bk`` divides 512 and ``K``; :mod:`.launch` checks.
    Returns ``[M, N]`` of ``out_dtype`` in shared HBM.

    Tiling: M 128 x N 512 (one PSUM bank) x K 128; weight decoded 128 rows x 512
    K columns at a time (:func:`decode.decode_fp8_tile`); up to 4 M tiles staged
    K-major. ``kernel[2]``: core ``p`` takes N columns ``[p*span, (p+1)*span)``.

    SBUF per partition: staged A <= 64 KiB, qdq 3.8 KiB, decode 4.6 KiB, wT 4 KiB,
    bias + output 4 KiB: <= ~80 KiB of 192. PSUM: <= 4 of 8 banks.

        for each group of <= 4 M tiles:  aT <- transpose(qdq(x rows))
            for each N tile of this core:
                for each K chunk:  wT <- transpose(decode_fp8(W rows, chunk))
                    for each K tile, M tile:  nc_matmul(acc, aT, wT, accumulate=(kb > 0))
                y <- round(acc + bias)
    """
    if act_quant and act_peak > 240.0:
        raise ValueError(f"act_peak={act_peak}: Trainium2's fp8 e4m3 saturates at 240")
    return _linear(x, weight, scale, bias, "fp8", act_quant, act_peak, out_dtype, (block_rows, block_cols))


@nki.jit
def fp4_linear_kernel(x, weight, scale, bias=None, act_quant=True, act_peak=224.0, out_dtype="bfloat16"):
    """``y = round(A @ W.T + bias)`` with an OCP MXFP4 weight (W4A8 by default).

    Args (HBM): ``x`` ``[M, K]`` bf16; ``weight`` ``[N, K/2]`` uint8, element ``2j`` in
    the low nibble of byte ``j``; ``scale`` ``[N, K/32]`` uint8 e8m0 codes (exact for codes
    in ``[27, 160]``); ``bias`` ``[1, N]`` fp32 or ``None``. ``K % 64 == 0``.

    Tiling as :func:`fp8_linear_kernel`; the decode (:func:`decode.decode_fp4_tile`)
    leaves ``2**-32`` in each weight tile and the PSUM result is multiplied by
    ``2**32`` (exact) together with the bias add.

    SBUF per partition: staged A <= 64 KiB, qdq 3.8 KiB, decode 2.8 KiB, wT 4 KiB,
    bias + output 4 KiB: <= ~79 KiB of 192. PSUM: <= 4 of 8 banks.

        for each group of <= 4 M tiles:  aT <- transpose(qdq(x rows))
            for each N tile of this core:
                for each K chunk:  wT <- transpose(decode_fp4(W rows, chunk))   # x 2**-32
                    for each K tile, M tile:  nc_matmul(acc, aT, wT, accumulate=(kb > 0))
                y <- round(acc * 2**32 + bias)
    """
    if act_quant and act_peak > 240.0:
        raise ValueError(f"act_peak={act_peak}: Trainium2's fp8 e4m3 saturates at 240")
    return _linear(x, weight, scale, bias, "fp4", act_quant, act_peak, out_dtype)


@nki.jit
def bf16_linear_kernel(x, weight, bias=None, out_dtype="bfloat16"):
    """``y = round(x @ W.T + bias)``: ``x`` ``[M, K]`` bf16, ``weight`` ``[N, K]`` bf16, ``K % 32 == 0``.

    Tiling as :func:`fp8_linear_kernel`, without qdq or decode: x and W tiles
    (128 x 128) are DMA-transposed from HBM straight into the K-major tiles.

    SBUF per partition: staged x <= 64 KiB, wT 4 KiB, bias + output 4 KiB:
    <= ~72 KiB of 192. PSUM: <= 4 of 8 banks.

        for each group of <= 4 M tiles:  aT <- dma_transpose(x rows)
            for each N tile of this core:
                for each K chunk:  wT <- dma_transpose(W rows, chunk)
                    for each K tile, M tile:  nc_matmul(acc, aT, wT, accumulate=(kb > 0))
                y <- round(acc + bias)
    """
    return _linear(x, weight, None, bias, "bf16", False, 224.0, out_dtype)


@nki.jit
def fp32w_linear_kernel(x, weight, bias=None, out_dtype="bfloat16"):
    """``y = round(x @ bf16(W).T + bias)``: ``weight`` ``[N, K]`` fp32, narrowed to bf16 in SBUF.

    Tiling as :func:`bf16_linear_kernel`; each 128 x 512 fp32 weight tile is
    copied to bf16 by the engine (round to nearest even) before its transposes.

    SBUF per partition: staged x <= 64 KiB, fp32 + bf16 weight tile 3 KiB, wT 4 KiB,
    bias + output 4 KiB: <= ~75 KiB of 192. PSUM: <= 4 of 8 banks.

        for each group of <= 4 M tiles:  aT <- dma_transpose(x rows)
            for each N tile of this core:
                for each K chunk:  wT <- transpose(bf16(W rows, chunk))
                    for each K tile, M tile:  nc_matmul(acc, aT, wT, accumulate=(kb > 0))
                y <- round(acc + bias)
    """
    return _linear(x, weight, None, bias, "fp32w", False, 224.0, out_dtype)
