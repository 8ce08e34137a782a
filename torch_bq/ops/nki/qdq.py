"""Activation quant-dequant (docs/contract.md §3) on SBUF tiles, and the standalone ``qdq_fp8_kernel``.

Importing this module imports ``nki``; only the neuron registration and the
tests do so.

The round trip of one ``[rows, 32 * nb]`` bf16 chunk, rows on partitions:

    a    = |x|                                         tensor_scalar(abs), exact in bf16
    amax = max over each 32-block of a                 tensor_reduce -> fp32 [rows, nb]
    t    = max(amax, 1e-4) * fp32(1 / peak)            tensor_scalar, fp32 math
    e    = biased exponent of t, +1 if t's mantissa != 0   bit ops on t.view(int32)
    s    = bits(e << 23)  = 2**ceil(log2 t)            exact, from the bits
    r    = bits((254 - e) << 23) = 1 / s               exact
    q    = fp8_e4m3(x * r)                             Trainium2 e4m3; |x * r| <= peak <= 240
    out  = bf16(q * s)

Every step is exact or rounds exactly where the reference rounds, so the result
equals :func:`torch_bq.formats.qdq_fp8` bit for bit. ``peak`` must be <= 240 (the
saturation point of Trainium2's e4m3); e4m3 and OCP e4m3fn agree on every
value up to 240, which is why 224 (the default) reproduces the OCP reference.
"""

from __future__ import annotations

import nki
import nki.isa as nisa
import nki.language as nl

QDQ_BLOCK = 32
PT = 128  # partitions per tile
CHUNK = 512  # K columns processed per round trip (16 blocks; 1 KiB bf16 per partition)
AMAX_FLOOR = 1e-4


def qdq_chunk(x_sb, rows, nb, peak):
    """Round-trip ``x_sb[:rows]`` (a ``[PT, nb, 32]`` bf16 SBUF tile) through fp8; return the bf16 tile.

    SBUF per partition: 5 tiles of ``nb * 32`` elements (bf16 x2, fp8, and two
    small ``[nb]`` int32/fp32 tiles), at most 3.2 KiB for ``nb = 16``.
    """
    x3 = x_sb[:rows]
    absx = nl.ndarray((PT, nb, QDQ_BLOCK), dtype=nl.bfloat16, buffer=nl.sbuf, name="qdq_abs")
    # The ALU's unary abs (exact), not the Scalar Engine's activation table, whose
    # functions are piecewise-polynomial approximations.
    nisa.tensor_scalar(dst=absx[:rows], data=x3, op0=nl.abs, operand0=None)

    t = nl.ndarray((PT, nb), dtype=nl.float32, buffer=nl.sbuf, name="qdq_t")
    nisa.tensor_reduce(dst=t[:rows], op=nl.maximum, data=absx[:rows], axis=2)
    # Multiply by the fp32 reciprocal, as the reference does: it decides the ceil at 2**j.
    nisa.tensor_scalar(dst=t[:rows], data=t[:rows], op0=nl.maximum, operand0=AMAX_FLOOR,
                       op1=nl.multiply, operand1=1.0 / peak)

    bits = t.view(nl.int32)
    expo = nl.ndarray((PT, nb), dtype=nl.int32, buffer=nl.sbuf, name="qdq_exp")
    nisa.tensor_scalar(dst=expo[:rows], data=bits[:rows], op0=nl.right_shift, operand0=23,
                       op1=nl.bitwise_and, operand1=0xFF)
    bump = nl.ndarray((PT, nb), dtype=nl.int32, buffer=nl.sbuf, name="qdq_bump")
    nisa.tensor_scalar(dst=bump[:rows], data=bits[:rows], op0=nl.bitwise_and, operand0=0x7FFFFF)
    # Mantissa fields are < 2**23, so the compare is exact even in fp32.
    nisa.tensor_scalar(dst=bump[:rows], data=bump[:rows], op0=nl.not_equal, operand0=0.0)
    nisa.tensor_tensor(dst=expo[:rows], data1=expo[:rows], data2=bump[:rows], op=nl.add)

    scale = nl.ndarray((PT, nb), dtype=nl.int32, buffer=nl.sbuf, name="qdq_scale")
    nisa.tensor_scalar(dst=scale[:rows], data=expo[:rows], op0=nl.left_shift, operand0=23)
    recip = nl.ndarray((PT, nb), dtype=nl.int32, buffer=nl.sbuf, name="qdq_recip")
    # 254 - e stays in 1..253 for any t a bf16 input can produce, so fp32 math is exact.
    nisa.tensor_scalar(dst=recip[:rows], data=expo[:rows], op0=nl.subtract, operand0=254.0, reverse0=True)
    nisa.tensor_scalar(dst=recip[:rows], data=recip[:rows], op0=nl.left_shift, operand0=23)

    q = nl.ndarray((PT, nb, QDQ_BLOCK), dtype=nl.float8_e4m3, buffer=nl.sbuf, name="qdq_q")
    nisa.tensor_tensor(dst=q[:rows], data1=x3, data2=_per_block(recip, rows, nb), op=nl.multiply)
    out = nl.ndarray((PT, nb, QDQ_BLOCK), dtype=nl.bfloat16, buffer=nl.sbuf, name="qdq_out")
    nisa.tensor_tensor(dst=out[:rows], data1=q[:rows], data2=_per_block(scale, rows, nb), op=nl.multiply)
    return out


def _per_block(bits, rows, nb):
    """fp32 bit patterns ``[PT, nb]`` as a ``[rows, nb, 32]`` view repeating each value over its block."""
    return bits.view(nl.float32)[:rows].reshape((rows, nb, 1)).broadcast(2, QDQ_BLOCK)


@nki.jit
def qdq_fp8_kernel(x, peak=224.0):
    """Activation round trip of docs/contract.md §3: ``[M, K]`` bf16 -> ``[M, K]`` bf16, ``K % 32 == 0``.

    Tiling: 128 rows x 512 columns per step (partial last tiles are sliced, never padded
    into the output). Under LNC=2 the two cores take alternate row tiles.

    SBUF budget per partition (one step, bf16 unless noted):

        x chunk              512 x 2 B   1.0 KiB
        |x|, out             2 x 1.0     2.0 KiB
        q (fp8 e4m3)         512 x 1 B   0.5 KiB
        t/exp/bump/s/r       5 x 16 x 4  0.3 KiB
        total                            ~3.8 KiB  (PSUM: none)

    Pseudocode::

        for m0 in rows (this core's share), step 128:
            for c0 in 0..K step 512:
                x_sb  <- dma x[m0:m0+128, c0:c0+512]
                out   <- qdq_chunk(x_sb)
                dma out -> y[m0:m0+128, c0:c0+512]
    """
    m, k = x.shape
    y = nl.ndarray((m, k), dtype=nl.bfloat16, buffer=nl.shared_hbm, name="qdq_y")
    pid = nl.program_id(0)
    nprog = nl.num_programs(0)
    for mi in range(pid, (m + PT - 1) // PT, nprog):
        m0 = mi * PT
        rows = min(PT, m - m0)
        for c0 in range(0, k, CHUNK):
            kc = min(CHUNK, k - c0)
            nb = kc // QDQ_BLOCK
            x_sb = nl.ndarray((PT, nb, QDQ_BLOCK), dtype=nl.bfloat16, buffer=nl.sbuf, name="qdq_x")
            nisa.dma_copy(dst=x_sb[:rows], src=x[m0:m0 + rows, c0:c0 + kc])
            out = qdq_chunk(x_sb, rows, nb, peak)
            nisa.dma_copy(dst=y[m0:m0 + rows, c0:c0 + kc], src=out[:rows])
    return y
