"""Exact software decode of fp8 / fp4 weight bytes into bf16 SBUF tiles (NKI).

Weights arrive as raw ``uint8`` and never pass through Trainium2's fp8 type (which
saturates at 240 and would clip OCP e4m3fn values up to 448). Each helper decodes one
N-major tile: ``rows`` weight rows on partitions, ``kc`` consecutive K columns on the free
axis, and returns a ``[PT, kc]`` bf16 tile holding the weight ``W`` itself, exactly.

The decode is arithmetic on the element's fields, in int32 and fp32 lanes, so that no
intermediate is a denormal (the docs say nothing about whether the engines keep them):

* **e4m3** byte ``b``: ``e = (b >> 3) & 15``, ``m = b & 7``; the magnitude is
  ``(m + 8 [e != 0]) * 2**(max(e, 1) - 10)`` (normal and subnormal codes alike), the power
  of two built as fp32 bits ``(max(e, 1) + 117) << 23`` (exponent fields 118..132, normal);
  the sign bit ``(b & 0x80) << 24`` is OR-ed into the fp32 result.
* **e2m1** nibble ``v`` (low nibble of byte ``j`` is element ``2j``): ``e = (v >> 1) & 3``,
  ``m = v & 1``; magnitude ``(m + 2 [e != 0]) * 2**(max(e, 1) - 2)``, the power of two as
  fp32 bits ``(max(e, 1) + 125) << 23``; sign ``(v & 8) << 28``.
* **e8m0** code ``c`` is the fp32 ``2**(c - 127)`` with bits ``c << 23`` (normal for
  ``1 <= c <= 254``); ``W = magnitude * 2**(c - 127)`` in fp32 math, one cast to bf16.

Every step is exact (integers below 2**24, products of powers of two and at most 4-bit
significands), so the bf16 ``W`` equals the reference wherever bf16 holds it: fp8 codes
``3 <= c <= 246`` (``448 * 2**119`` is bf16's top binade; below 3 the smallest subnormal
weights fall under bf16's ``2**-133``), fp4 codes ``1 <= c <= 252``. A weight is a bf16
*denormal* only when ``|W| < 2**-126``: never for fp8 codes >= 10 or fp4 codes >= 2, so
only such tiny scales would change if the engines flushed denormals (tests/neuron show
exactly which).
"""

from __future__ import annotations

import nki.isa as nisa
import nki.language as nl

PT = 128
BLOCK = 32  # fp4 (and MXFP8) scale 32 consecutive K elements with one e8m0 code
FP8_POW2_BIAS = 117  # fp32 exponent field of 2**(max(e, 1) - 10) is max(e, 1) + 117
FP4_POW2_BIAS = 125  # ... of 2**(max(e, 1) - 2) is max(e, 1) + 125


def _magnitude_times_sign(fields, rows, kc, name, exp_shift, exp_mask, mant_mask, lead, pow2_bias, sign_mask,
                          sign_shift):
    """fp32 bits ``[PT, kc]`` (int32) of the element whose integer code is ``fields`` (int32)."""
    f = fields[:rows]
    expo = nl.ndarray((PT, kc), dtype=nl.int32, buffer=nl.sbuf, name=name + "_exp")
    nisa.tensor_scalar(dst=expo[:rows], data=f, op0=nl.right_shift, operand0=exp_shift,
                       op1=nl.bitwise_and, operand1=exp_mask)
    mant = nl.ndarray((PT, kc), dtype=nl.int32, buffer=nl.sbuf, name=name + "_mant")
    nisa.tensor_scalar(dst=mant[:rows], data=f, op0=nl.bitwise_and, operand0=mant_mask)
    normal = nl.ndarray((PT, kc), dtype=nl.float32, buffer=nl.sbuf, name=name + "_normal")
    nisa.tensor_scalar(dst=normal[:rows], data=expo[:rows], op0=nl.not_equal, operand0=0.0)
    # significand = mant + lead * [e != 0]: small integers, exact in fp32.
    sig = nl.ndarray((PT, kc), dtype=nl.float32, buffer=nl.sbuf, name=name + "_sig")
    nisa.scalar_tensor_tensor(dst=sig[:rows], data=normal[:rows], op0=nl.multiply, operand0=lead,
                              op1=nl.add, operand1=mant[:rows])
    pow2 = nl.ndarray((PT, kc), dtype=nl.int32, buffer=nl.sbuf, name=name + "_pow2")
    nisa.tensor_scalar(dst=pow2[:rows], data=expo[:rows], op0=nl.maximum, operand0=1.0,
                       op1=nl.add, operand1=float(pow2_bias))
    nisa.tensor_scalar(dst=pow2[:rows], data=pow2[:rows], op0=nl.left_shift, operand0=23)
    mag = nl.ndarray((PT, kc), dtype=nl.float32, buffer=nl.sbuf, name=name + "_mag")
    nisa.tensor_tensor(dst=mag[:rows], data1=sig[:rows], data2=pow2.view(nl.float32)[:rows], op=nl.multiply)
    sign = nl.ndarray((PT, kc), dtype=nl.int32, buffer=nl.sbuf, name=name + "_sign")
    nisa.tensor_scalar(dst=sign[:rows], data=f, op0=nl.bitwise_and, operand0=sign_mask,
                       op1=nl.left_shift, operand1=sign_shift)
    bits = mag.view(nl.int32)
    nisa.tensor_tensor(dst=bits[:rows], data1=bits[:rows], data2=sign[:rows], op=nl.bitwise_or)
    return bits


def _scaled(bits32, codes, rows, nb, block, name):
    """bf16 ``[PT, nb * block]``: the fp32 elements ``bits32`` times ``2**(c - 127)`` per ``block`` columns."""
    factor = nl.ndarray((PT, nb), dtype=nl.int32, buffer=nl.sbuf, name=name + "_factor")
    nisa.tensor_copy(dst=factor[:rows], src=codes[:rows])  # u8 -> i32, exact
    nisa.tensor_scalar(dst=factor[:rows], data=factor[:rows], op0=nl.left_shift, operand0=23)
    out = nl.ndarray((PT, nb, block), dtype=nl.bfloat16, buffer=nl.sbuf, name=name + "_bf16")
    values = bits32.view(nl.float32)[:rows].reshape((rows, nb, block))
    per_block = factor.view(nl.float32)[:rows].reshape((rows, nb, 1)).broadcast(2, block)
    nisa.tensor_tensor(dst=out[:rows], data1=values, data2=per_block, op=nl.multiply)  # one rounding: exact
    return out.reshape((PT, nb * block))


def decode_fp8_tile(weight, scale, row0, rows, c0, kc, block_rows=BLOCK, block_cols=BLOCK):
    """bf16 ``W[row0:row0+rows, c0:c0+kc]`` from e4m3 bytes and ``block_rows x block_cols`` e8m0 codes.

    ``weight``: ``[N, K]`` uint8 (HBM); ``scale``: ``[ceil(N/bn), K/bk]`` uint8 (HBM).
    ``row0`` a multiple of 128 and ``rows <= 128``; ``block_rows`` divides 128 or is a
    multiple of it (1 = MXFP8, 32, 128, ...); ``block_cols`` divides ``kc`` and ``c0``
    (32 .. 512). 14 instructions plus one scale DMA per ``block_rows`` rows. SBUF per
    partition for ``kc = 512``: 0.5 KiB raw + 7 x 2 KiB int32/fp32 lanes + 1 KiB bf16 +
    scales, ~15.6 KiB (dead when the helper returns).
    """
    nb = kc // block_cols
    raw = nl.ndarray((PT, kc), dtype=nl.uint8, buffer=nl.sbuf, name="w8_raw")
    nisa.dma_copy(dst=raw[:rows], src=weight[row0:row0 + rows, c0:c0 + kc])
    fields = nl.ndarray((PT, kc), dtype=nl.int32, buffer=nl.sbuf, name="w8_i32")
    nisa.tensor_copy(dst=fields[:rows], src=raw[:rows])  # u8 -> i32 through fp32: exact
    bits = _magnitude_times_sign(fields, rows, kc, "w8", 3, 0xF, 0x7, 8.0, FP8_POW2_BIAS, 0x80, 24)

    codes = nl.ndarray((PT, nb), dtype=nl.uint8, buffer=nl.sbuf, name="w8_codes")
    cb0 = c0 // block_cols
    if block_rows == 1:
        nisa.dma_copy(dst=codes[:rows], src=scale[row0:row0 + rows, cb0:cb0 + nb])
    else:
        # Partition p holds weight row row0 + p, whose scale row is (row0 + p) // bn:
        # replicate each scale row over its partitions straight from HBM (a DMA may
        # start at any partition; engine instructions below all start at 0).
        group = min(block_rows, PT)
        for g in range((rows + group - 1) // group):
            grows = min(group, rows - g * group)
            srow = (row0 + g * group) // block_rows
            nisa.dma_copy(dst=codes[g * group:g * group + grows],
                          src=scale[srow:srow + 1, cb0:cb0 + nb].broadcast(0, grows))
    return _scaled(bits, codes, rows, nb, block_cols, "w8")


def decode_fp4_tile(weight, scale, row0, rows, c0, kc):
    """bf16 ``W[row0:row0+rows, c0:c0+kc]`` from packed e2m1 and 1x32 e8m0 codes.

    ``weight``: ``[N, K/2]`` uint8 (low nibble = even element); ``scale``: ``[N, K/32]``
    uint8; ``c0`` and ``kc`` multiples of 64. 16 instructions. SBUF per partition for
    ``kc = 512``: 256 B raw + 1 KiB int32 bytes + 7 x 2 KiB lanes + 1 KiB bf16 + scales, ~16.3 KiB.
    """
    nb = kc // BLOCK
    half = kc // 2
    raw = nl.ndarray((PT, half), dtype=nl.uint8, buffer=nl.sbuf, name="w4_raw")
    nisa.dma_copy(dst=raw[:rows], src=weight[row0:row0 + rows, c0 // 2:c0 // 2 + half])
    wide = nl.ndarray((PT, half), dtype=nl.int32, buffer=nl.sbuf, name="w4_i32")
    nisa.tensor_copy(dst=wide[:rows], src=raw[:rows])  # u8 -> i32 through fp32: exact
    nib = nl.ndarray((PT, half, 2), dtype=nl.int32, buffer=nl.sbuf, name="w4_nib")
    nisa.tensor_scalar(dst=nib[:rows, :, 0], data=wide[:rows], op0=nl.bitwise_and, operand0=0x0F)
    nisa.tensor_scalar(dst=nib[:rows, :, 1], data=wide[:rows], op0=nl.right_shift, operand0=4)
    bits = _magnitude_times_sign(nib.reshape((PT, kc)), rows, kc, "w4", 1, 0x3, 0x1, 2.0, FP4_POW2_BIAS, 0x8, 28)
    codes = nl.ndarray((PT, nb), dtype=nl.uint8, buffer=nl.sbuf, name="w4_codes")
    nisa.dma_copy(dst=codes[:rows], src=scale[row0:row0 + rows, c0 // BLOCK:c0 // BLOCK + nb])
    return _scaled(bits, codes, rows, nb, BLOCK, "w4")


def load_dense_tile(weight, row0, rows, c0, kc):
    """bf16 ``W[row0:row0+rows, c0:c0+kc]`` from an fp32 weight (RNE narrowing in the engine)."""
    wide = nl.ndarray((PT, kc), dtype=nl.float32, buffer=nl.sbuf, name="w32_raw")
    nisa.dma_copy(dst=wide[:rows], src=weight[row0:row0 + rows, c0:c0 + kc])
    narrow = nl.ndarray((PT, kc), dtype=nl.bfloat16, buffer=nl.sbuf, name="w32_bf16")
    nisa.tensor_copy(dst=narrow[:rows], src=wide[:rows])
    return narrow
