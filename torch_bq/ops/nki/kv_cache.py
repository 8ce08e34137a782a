"""NKI kernel for ``torch_bq::paged_kv_write`` (docs/contract.md §5 step 4): a row scatter into the caches.

Importing this module imports ``nki``; only the neuron registration and the tests do so.
Arguments arrive laid out by :func:`torch_bq.ops.nki.paged_launch.prepare_kv_write`.
"""

from __future__ import annotations

import nki
import nki.isa as nisa
import nki.language as nl

PT = 128  # partitions: rows scattered per DMA


@nki.jit
def paged_kv_write_kernel(k, v, k_cache, v_cache, slots):
    """Write row ``i`` of ``k``/``v`` to row ``slots[i]`` of the flattened caches; return the caches.

    Args (HBM): ``k``, ``v`` ``[R, F]`` of the caches' dtype (``F = num_kv_heads * head_dim``);
    ``k_cache``, ``v_cache`` ``[S, F]`` (``S = num_blocks * block_size``, one row per slot);
    ``slots`` ``[R, 1]`` int32, ``S`` for a row not to write (the launch maps negative slots
    there). Returns ``(k_cache, v_cache)`` with the rows written.

    Tiling: 128 rows per step. Each step loads the slots onto partitions (one index per
    partition), loads the 128 key rows and scatters them with one indirect DMA
    (``vector_offset`` = the slots, ``oob_mode.skip``: slot ``S`` is out of bounds, so
    nothing is written for it); the same for the values. No compute engine is used and
    the DMAs do not cast (the tiles have the caches' dtype).

    SBUF per partition: 4 B (slot) + ``F`` x itemsize (one row tile at a time; 1 KiB for
    the full-size bf16 drafter, F = 4 x 128). PSUM: none.
    Instructions: ``5 x ceil(R / 128)`` DMAs (5 for the drafter's R <= 128).
    Under LNC=2 both cores write every row (identical bytes to identical slots); the
    kernel is a handful of DMAs, not worth splitting.
    """
    rows_total, f = k.shape
    for r0 in range(0, rows_total, PT):
        rows = min(PT, rows_total - r0)
        idx = nl.ndarray((PT, 1), dtype=nl.int32, buffer=nl.sbuf, name="kvw_slots")
        nisa.dma_copy(dst=idx[:rows], src=slots[r0:r0 + rows])
        for src, cache in ((k, k_cache), (v, v_cache)):
            tile = nl.ndarray((PT, f), dtype=cache.dtype, buffer=nl.sbuf, name="kvw_rows")
            nisa.dma_copy(dst=tile[:rows], src=src[r0:r0 + rows])
            nisa.dma_copy(dst=cache.ap(pattern=[[f, rows], [1, f]], vector_offset=idx[:rows], indirect_dim=0),
                          src=tile[:rows], oob_mode=nisa.oob_mode.skip)
    return k_cache, v_cache
