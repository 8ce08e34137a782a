"""Exact software decode of fp8 / fp4 weight bytes into bf16 SBUF tiles (NKI).

Weights arrive as raw ``uint8`` and never pass through Trainium2's fp8 type
(which saturates at 240 and would clip OCP e4m3fn values up to 448). Each
helper decodes one N-major tile: ``rows`` weight rows on partitions, ``kc``
consecutive K columns on the free axis, and returns a ``[PT, kc]`` bf16 tile.

**e4m3 -> bf16** (NKI_NOTES): ``h = b * 256`` puts the byte in the high half of
a uint16 lane; ``((h & 0x7F00) >> 4) | (h & 0x8000)`` read as bf16 is
``e4m3(b) * 2**-120`` for normal *and* subnormal codes (subnormals land on bf16
denormals, so the engine must not flush them). The e8m0 code ``c`` becomes the
bf16 factor ``2**(c - 7)`` with bits ``(c + 120) << 7``; the product is exactly
``e4m3(b) * 2**(c - 127)``. Exact for every code ``3 <= c <= 134`` (scales
``2**-124 .. 2**7``): above 134 the factor leaves bf16's exponent range, below 3
the smallest e4m3 subnormals fall under bf16's smallest denormal ``2**-133``.

**e2m1 -> bf16**: nibble ``v`` times ``0x1040`` masked with ``0x81C0`` puts the
sign in bit 15, the exponent in bits 7-8 and the mantissa in bit 6: as bf16 that
is ``e2m1(v) * 2**-126``. The ``2**126`` is split so every factor stays in bf16
range: the weight side gets ``2**(c - 1 - FP4_POST_EXP)`` (bits
``(c + 126 - FP4_POST_EXP) << 7``) and the GEMM multiplies its fp32 PSUM result
by ``2**FP4_POST_EXP`` once. With ``FP4_POST_EXP = 32`` every code
``27 <= c <= 160`` decodes exactly (scales ``2**-100 .. 2**33``): the tile holds
multiples of ``2**(c - 160)``, which bf16 carries down to ``2**-133``.
"""

from __future__ import annotations

import nki.isa as nisa
import nki.language as nl

PT = 128
BLOCK = 32  # both formats scale 32 consecutive K elements with one e8m0 code
FP8_FACTOR_BIAS = 120  # e8m0 code + 120 = bf16 exponent field of 2**(c - 7)
FP4_POST_EXP = 32  # fp4 tiles carry 2**-32; the GEMM applies 2**32 to PSUM
FP4_FACTOR_BIAS = 126 - FP4_POST_EXP  # e8m0 code + 94 = bf16 exponent field of 2**(c - 33)
FP4_MAGIC = 0x1040
FP4_MASK = 0x81C0


def _scaled(bits16, factor16, rows, nb, name, block=BLOCK):
    """``bf16(bits) * bf16(factor)`` per ``block`` columns; both exact bf16, so is the product."""
    out = nl.ndarray((PT, nb, block), dtype=nl.bfloat16, buffer=nl.sbuf, name=name)
    values = bits16.view(nl.bfloat16)[:rows].reshape((rows, nb, block))
    factor = factor16.view(nl.bfloat16)[:rows].reshape((rows, nb, 1)).broadcast(2, block)
    nisa.tensor_tensor(dst=out[:rows], data1=values, data2=factor, op=nl.multiply)
    return out.reshape((PT, nb * block))


def decode_fp8_tile(weight, scale, row0, rows, c0, kc, block_rows=BLOCK, block_cols=BLOCK):
    """bf16 ``W[row0:row0+rows, c0:c0+kc]`` from e4m3 bytes and ``block_rows x block_cols`` e8m0 codes.

    ``weight``: ``[N, K]`` uint8 (HBM); ``scale``: ``[ceil(N/bn), K/bk]`` uint8 (HBM).
    ``row0`` a multiple of 128 and ``rows <= 128``; ``block_rows`` divides 128 or is a
    multiple of it (1 = MXFP8, 32, 128, ...); ``block_cols`` and ``c0`` divide into
    ``kc``/``c0`` (32 .. 512). SBUF per partition: ``kc`` x (1 + 2 + 2 + 2 + 2) B +
    scales, 4.6 KiB for ``kc = 512``.
    """
    nb = kc // block_cols
    raw = nl.ndarray((PT, kc), dtype=nl.uint8, buffer=nl.sbuf, name="w8_raw")
    nisa.dma_copy(dst=raw[:rows], src=weight[row0:row0 + rows, c0:c0 + kc])
    high = nl.ndarray((PT, kc), dtype=nl.uint16, buffer=nl.sbuf, name="w8_high")
    # b * 256 < 2**16 is exact through the engine's fp32 math.
    nisa.tensor_scalar(dst=high[:rows], data=raw[:rows], op0=nl.multiply, operand0=256.0)
    bits = nl.ndarray((PT, kc), dtype=nl.uint16, buffer=nl.sbuf, name="w8_bits")
    nisa.tensor_scalar(dst=bits[:rows], data=high[:rows], op0=nl.bitwise_and, operand0=0x7F00,
                       op1=nl.right_shift, operand1=4)
    sign = nl.ndarray((PT, kc), dtype=nl.uint16, buffer=nl.sbuf, name="w8_sign")
    nisa.tensor_scalar(dst=sign[:rows], data=high[:rows], op0=nl.bitwise_and, operand0=0x8000)
    nisa.tensor_tensor(dst=bits[:rows], data1=bits[:rows], data2=sign[:rows], op=nl.bitwise_or)

    codes = nl.ndarray((PT, nb), dtype=nl.uint8, buffer=nl.sbuf, name="w8_codes")
    cb0 = c0 // block_cols
    if block_rows == 1:
        nisa.dma_copy(dst=codes[:rows], src=scale[row0:row0 + rows, cb0:cb0 + nb])
    else:
        # Partition p holds weight row row0 + p, whose scale row is (row0 + p) // bn:
        # replicate each scale row over its partitions straight from HBM.
        group = min(block_rows, PT)
        for g in range((rows + group - 1) // group):
            grows = min(group, rows - g * group)
            srow = (row0 + g * group) // block_rows
            nisa.dma_copy(dst=codes[g * group:g * group + grows],
                          src=scale[srow:srow + 1, cb0:cb0 + nb].broadcast(0, grows))
    factor = nl.ndarray((PT, nb), dtype=nl.uint16, buffer=nl.sbuf, name="w8_factor")
    # (c + 120) * 128 <= 32512 for c <= 134: exact, and the bf16 bits of 2**(c - 7).
    nisa.tensor_scalar(dst=factor[:rows], data=codes[:rows], op0=nl.add, operand0=float(FP8_FACTOR_BIAS),
                       op1=nl.multiply, operand1=128.0)
    return _scaled(bits, factor, rows, nb, "w8_bf16", block_cols)


def decode_fp4_tile(weight, scale, row0, rows, c0, kc):
    """bf16 ``W[row0:row0+rows, c0:c0+kc] * 2**-FP4_POST_EXP`` from packed e2m1 and 1x32 e8m0 codes.

    ``weight``: ``[N, K/2]`` uint8 (low nibble = even element); ``scale``: ``[N, K/32]``
    uint8; ``c0`` and ``kc`` multiples of 64. SBUF per partition for ``kc = 512``:
    256 B raw + 512 B + 1 KiB uint16 + 1 KiB bf16 + scales, 2.8 KiB.
    """
    nb = kc // BLOCK
    half = kc // 2
    raw = nl.ndarray((PT, half), dtype=nl.uint8, buffer=nl.sbuf, name="w4_raw")
    nisa.dma_copy(dst=raw[:rows], src=weight[row0:row0 + rows, c0 // 2:c0 // 2 + half])
    wide = nl.ndarray((PT, half), dtype=nl.uint16, buffer=nl.sbuf, name="w4_wide")
    nisa.tensor_copy(dst=wide[:rows], src=raw[:rows])  # u8 -> u16 through fp32: exact
    nib = nl.ndarray((PT, half, 2), dtype=nl.uint16, buffer=nl.sbuf, name="w4_nib")
    nisa.tensor_scalar(dst=nib[:rows, :, 0], data=wide[:rows], op0=nl.bitwise_and, operand0=0x0F)
    nisa.tensor_scalar(dst=nib[:rows, :, 1], data=wide[:rows], op0=nl.right_shift, operand0=4)
    bits = nib.reshape((PT, kc))
    # v * 0x1040 <= 62400 is exact in fp32; then keep sign, exponent and mantissa bits.
    nisa.tensor_scalar(dst=bits[:rows], data=bits[:rows], op0=nl.multiply, operand0=float(FP4_MAGIC))
    nisa.tensor_scalar(dst=bits[:rows], data=bits[:rows], op0=nl.bitwise_and, operand0=FP4_MASK)

    codes = nl.ndarray((PT, nb), dtype=nl.uint8, buffer=nl.sbuf, name="w4_codes")
    nisa.dma_copy(dst=codes[:rows], src=scale[row0:row0 + rows, c0 // BLOCK:c0 // BLOCK + nb])
    factor = nl.ndarray((PT, nb), dtype=nl.uint16, buffer=nl.sbuf, name="w4_factor")
    nisa.tensor_scalar(dst=factor[:rows], data=codes[:rows], op0=nl.add, operand0=float(FP4_FACTOR_BIAS),
                       op1=nl.multiply, operand1=128.0)
    return _scaled(bits, factor, rows, nb, "w4_bf16")


def load_dense_tile(weight, row0, rows, c0, kc):
    """bf16 ``W[row0:row0+rows, c0:c0+kc]`` from an fp32 weight (RNE narrowing in the engine)."""
    wide = nl.ndarray((PT, kc), dtype=nl.float32, buffer=nl.sbuf, name="w32_raw")
    nisa.dma_copy(dst=wide[:rows], src=weight[row0:row0 + rows, c0:c0 + kc])
    narrow = nl.ndarray((PT, kc), dtype=nl.bfloat16, buffer=nl.sbuf, name="w32_bf16")
    nisa.tensor_copy(dst=narrow[:rows], src=wide[:rows])
    return narrow
