"""NKI kernel for ``torch_bq::paged_window_attention``: split-K ("flash decoding") over the window.

Importing this module imports ``nki``; only the neuron registration and the tests do so.
Arguments arrive laid out by :func:`torch_bq.ops.nki.paged_launch.prepare_attention`; the kernel
is the NKI form of :func:`torch_bq.reference.flash_decoding.paged_window_attention_split`.
"""

from __future__ import annotations

import nki
import nki.isa as nisa
import nki.language as nl

PT = 128  # partitions; cache positions per gather; max query-tile rows and head_dim
CHUNK = 512  # cache positions per split: one 2 KiB fp32 PSUM bank of scores per query row
SUBS = CHUNK // PT  # 128-position gathers per split
MASKED = -3.0e38  # a masked score: finite, so exp(s - m) never meets -inf - -inf (NaN)


def _load_tile_fp32(src, rows, cols, name):
    """``[PT, cols]`` fp32 SBUF copy of an HBM view with ``rows x cols`` elements (exact widening)."""
    raw = nl.ndarray((PT, cols), dtype=src.dtype, buffer=nl.sbuf, name=name + "_raw")
    nisa.dma_copy(dst=raw[:rows], src=src)
    wide = nl.ndarray((PT, cols), dtype=nl.float32, buffer=nl.sbuf, name=name)
    nisa.tensor_copy(dst=wide[:rows], src=raw[:rows])
    return wide


def _transposed(src, rows, cols, name):
    """``[PT, PT]`` fp32 SBUF tile holding ``src[:rows, :cols].T`` (Tensor Engine transpose, bit-exact)."""
    t_ps = nl.ndarray((PT, PT), dtype=nl.float32, buffer=nl.psum, name=name + "_ps")
    nisa.nc_transpose(dst=t_ps[:cols, :rows], data=src[:rows, :cols])
    t_sb = nl.ndarray((PT, PT), dtype=nl.float32, buffer=nl.sbuf, name=name)
    nisa.tensor_copy(dst=t_sb[:cols, :rows], src=t_ps[:cols, :rows])
    return t_sb


def _split_partials(q_t, k_cache, v_cache, key_rows, key_pos, bounds, r, h, c0, t_rows, d, scale,
                    m_all, l_all, o_all, c):
    """Split ``c`` (cache positions ``c0 .. c0 + 511`` of request ``r``'s span) for KV head ``h``.

    Writes ``m_all[:, c]`` (row max of the masked scores), ``l_all[:, c]`` (sum of
    ``exp(s - m)`` over visible keys) and ``o_all[:, :, c]`` (unnormalised ``P @ V``).
    """
    f = k_cache.shape[1]
    k_t = nl.ndarray((PT, CHUNK), dtype=nl.float32, buffer=nl.sbuf, name="att_kT")
    v_all = nl.ndarray((PT, SUBS, PT), dtype=nl.float32, buffer=nl.sbuf, name="att_v")
    for b in range(SUBS):
        p0 = c0 + b * PT
        idx = nl.ndarray((PT, 1), dtype=nl.int32, buffer=nl.sbuf, name="att_rows")
        nisa.dma_copy(dst=idx, src=key_rows[r:r + 1, p0:p0 + PT])
        for which in range(2):
            cache = k_cache
            if which == 1:
                cache = v_cache
            raw = nl.ndarray((PT, d), dtype=cache.dtype, buffer=nl.sbuf, name="att_gather")
            # Positions past the request's end carry the out-of-bounds row S: skipped, left 0.
            nisa.memset(dst=raw, value=0.0)
            nisa.dma_copy(dst=raw, src=cache.ap(pattern=[[f, PT], [1, d]], offset=h * d, vector_offset=idx,
                                                indirect_dim=0), oob_mode=nisa.oob_mode.skip)
            if which == 0:
                wide = nl.ndarray((PT, d), dtype=nl.float32, buffer=nl.sbuf, name="att_k32")
                nisa.tensor_copy(dst=wide, src=raw)
                k_blk = _transposed(wide, PT, d, "att_kTb")
                nisa.tensor_copy(dst=k_t[:d, b * PT:(b + 1) * PT], src=k_blk[:d, :PT])
            else:
                nisa.tensor_copy(dst=v_all[:, b, :d], src=raw)

    # Visibility of key j to tile row t: lo_t <= j < hi_t (window, sequence end, causality).
    jpos = nl.ndarray((PT, CHUNK), dtype=nl.float32, buffer=nl.sbuf, name="att_jpos")
    nisa.dma_copy(dst=jpos[:t_rows], src=key_pos[r:r + 1, c0:c0 + CHUNK].broadcast(0, t_rows))
    vis = nl.ndarray((PT, CHUNK), dtype=nl.float32, buffer=nl.sbuf, name="att_vis")
    nisa.tensor_scalar(dst=vis[:t_rows], data=jpos[:t_rows], op0=nl.greater_equal, operand0=bounds[:t_rows, 0:1])
    below = nl.ndarray((PT, CHUNK), dtype=nl.float32, buffer=nl.sbuf, name="att_below")
    nisa.tensor_scalar(dst=below[:t_rows], data=jpos[:t_rows], op0=nl.less, operand0=bounds[:t_rows, 1:2])
    nisa.tensor_tensor(dst=vis[:t_rows], data1=vis[:t_rows], data2=below[:t_rows], op=nl.multiply)
    # (vis - 1) * 3e38: 0 where visible, -3e38 where not (exact: vis is 0 or 1).
    nisa.tensor_scalar(dst=below[:t_rows], data=vis[:t_rows], op0=nl.subtract, operand0=1.0,
                       op1=nl.multiply, operand1=-MASKED)

    s_ps = nl.ndarray((PT, CHUNK), dtype=nl.float32, buffer=nl.psum, name="att_s")
    nisa.nc_matmul(dst=s_ps[:t_rows, :], stationary=q_t[:d, :t_rows], moving=k_t[:d, :])
    s_sb = nl.ndarray((PT, CHUNK), dtype=nl.float32, buffer=nl.sbuf, name="att_s_sb")
    nisa.scalar_tensor_tensor(dst=s_sb[:t_rows], data=s_ps[:t_rows, :], op0=nl.multiply, operand0=scale,
                              op1=nl.add, operand1=below[:t_rows])
    nisa.tensor_reduce(dst=m_all[:t_rows, c:c + 1], op=nl.maximum, data=s_sb[:t_rows], axis=1)
    neg_m = nl.ndarray((PT, 1), dtype=nl.float32, buffer=nl.sbuf, name="att_negm")
    nisa.tensor_scalar(dst=neg_m[:t_rows], data=m_all[:t_rows, c:c + 1], op0=nl.multiply, operand0=-1.0)
    p_sb = nl.ndarray((PT, CHUNK), dtype=nl.float32, buffer=nl.sbuf, name="att_p")
    nisa.activation(dst=p_sb[:t_rows], op=nl.exp, data=s_sb[:t_rows], bias=neg_m[:t_rows], scale=1.0)
    # Masked keys weigh exactly 0 (also in a split nothing is visible in: l = 0, o = 0).
    nisa.tensor_tensor(dst=p_sb[:t_rows], data1=p_sb[:t_rows], data2=vis[:t_rows], op=nl.multiply)
    nisa.tensor_reduce(dst=l_all[:t_rows, c:c + 1], op=nl.add, data=p_sb[:t_rows], axis=1)

    o_ps = nl.ndarray((PT, PT), dtype=nl.float32, buffer=nl.psum, name="att_o")
    for b in range(SUBS):
        p_t = _transposed(p_sb[:, b * PT:(b + 1) * PT], t_rows, PT, "att_pT")
        nisa.nc_matmul(dst=o_ps[:t_rows, :d], stationary=p_t[:PT, :t_rows], moving=v_all[:, b, :d],
                       accumulate=(b > 0))
    nisa.tensor_copy(dst=o_all[:t_rows, :, c], src=o_ps[:t_rows, :d])


def _merge(m_all, l_all, o_all, t_rows, d, n_splits, out_dtype):
    """docs/contract.md §5: ``M = max m_c``, ``L = sum l_c e^(m_c - M)``, ``out = sum o_c e^(m_c - M) / L``."""
    neg_big_m = nl.ndarray((PT, 1), dtype=nl.float32, buffer=nl.sbuf, name="att_negM")
    nisa.tensor_reduce(dst=neg_big_m[:t_rows], op=nl.maximum, data=m_all[:t_rows], axis=1, negate=True)
    w = nl.ndarray((PT, n_splits), dtype=nl.float32, buffer=nl.sbuf, name="att_w")
    nisa.activation(dst=w[:t_rows], op=nl.exp, data=m_all[:t_rows], bias=neg_big_m[:t_rows], scale=1.0)
    lw = nl.ndarray((PT, n_splits), dtype=nl.float32, buffer=nl.sbuf, name="att_lw")
    nisa.tensor_tensor(dst=lw[:t_rows], data1=l_all[:t_rows], data2=w[:t_rows], op=nl.multiply)
    big_l = nl.ndarray((PT, 1), dtype=nl.float32, buffer=nl.sbuf, name="att_L")
    nisa.tensor_reduce(dst=big_l[:t_rows], op=nl.add, data=lw[:t_rows], axis=1)
    # L >= 1 when any key is visible (the split holding the max has w = 1 and l >= e^0);
    # L = 0 only if none is, and then o = 0: dividing by max(L, 1e-30) gives 0, never NaN.
    nisa.tensor_scalar(dst=big_l[:t_rows], data=big_l[:t_rows], op0=nl.maximum, operand0=1e-30)
    w_b = w[:t_rows].reshape((t_rows, 1, n_splits)).broadcast(1, d)
    nisa.tensor_tensor(dst=o_all[:t_rows], data1=o_all[:t_rows], data2=w_b, op=nl.multiply)
    acc = nl.ndarray((PT, d), dtype=nl.float32, buffer=nl.sbuf, name="att_acc")
    nisa.tensor_reduce(dst=acc[:t_rows], op=nl.add, data=o_all[:t_rows], axis=2)
    out_sb = nl.ndarray((PT, d), dtype=out_dtype, buffer=nl.sbuf, name="att_out")
    nisa.tensor_scalar(dst=out_sb[:t_rows], data=acc[:t_rows], op0=nl.divide, operand0=big_l[:t_rows])
    return out_sb


@nki.jit
def paged_window_attention_kernel(q, k_cache, v_cache, key_rows, key_pos, row_bounds, scale=1.0,
                                  rows_per_request=1):
    """Sliding-window GQA attention over a paged cache, split-K over each request's span.

    Args (HBM): ``q`` ``[R, Hq, d]`` (bf16/fp16/fp32; the output has its dtype);
    ``k_cache``, ``v_cache`` ``[S, Hkv * d]`` (one row per slot, bf16/fp16/fp32);
    ``key_rows`` ``[num_requests, span]`` int32: the cache row of span position ``t`` of
    request ``r`` (position ``lo_r + t``), ``S`` past the request's end; ``key_pos``
    ``[num_requests, span]`` fp32: those positions ``lo_r + t``; ``row_bounds`` ``[R, 2]``
    fp32: query row ``i`` sees positions ``row_bounds[i, 0] <= j < row_bounds[i, 1]``.
    ``span`` a multiple of 512, ``d <= 128``, ``rows_per_request * Hq / Hkv <= 128``.

    Returns ``[R, Hq, d]`` of ``q.dtype``: per row, ``softmax(scale q.k)`` over its visible
    keys applied to the values, in fp32, rounded once.

    Tiling, per request ``r`` and KV head ``h`` (the query tile: the request's rows x the
    ``G = Hq / Hkv`` heads of ``h``, ``T = rows x G`` rows on partitions, 112 at full size)::

        qT  <- transpose(fp32(q tile))                                [d, T]
        for each split c of 512 span positions:                       # independent splits
            for each 128 positions: K, V rows <- indirect DMA gather (oob rows skipped)
                                    KT[:, 128 block] <- transpose(fp32(K))
            S = qT.T @ KT (one PSUM bank)                             [T, 512] fp32
            s = scale S + (vis - 1) 3e38                              # masked -> -3e38
            m_c = rowmax(s);  P = exp(s - m_c) * vis;  l_c = rowsum(P)
            o_c = sum over 128 blocks of transpose(P).T @ V           [T, d] fp32
        M = max m_c;  w_c = exp(m_c - M);  out = sum w_c o_c / max(sum w_c l_c, 1e-30)

    A split no key of a row is visible in has ``l = 0, o = 0`` (its ``m`` is about
    -3e38 rather than -inf, so no ``-inf - -inf``) and weighs nothing; the merge is
    docs/contract.md §5's. All matmuls take fp32 operands (the caches are widened
    exactly), so scores and sums are fp32 as in the reference; only the order of the
    fp32 sums and the engine's ``exp`` differ.

    SBUF per partition (one request and head live): K^T 2 KiB, V 2 KiB, scores / P /
    masks / positions 5 x 2 KiB, transposes 2 x 0.5 KiB, gathers <= 1 KiB, partials
    ``(d + 2) x 4 x n_splits`` B (4.6 KiB for span 4608): about 20 KiB. PSUM: scores
    1 bank, output 1, transposes 1-2: <= 4 of 8 banks.

    Instructions (unrolled): per (request, KV head) about ``10 + 65 x n_splits`` plus the merge
    (~12); measured on the stand-in: 313 per request for a 300-position sequence (1 split, 4 KV
    heads) and 2,393 for the full-size drafter (span 4608 = 9 splits, 4 KV heads, d = 128), so
    about 8 full-window requests per core fit the 20,000 budget. Under LNC=2 the two cores take
    alternate requests.
    """
    rows_total, hq, d = q.shape
    n_requests, span = key_rows.shape
    hkv = k_cache.shape[1] // d
    group = hq // hkv
    t_rows = rows_per_request * group
    n_splits = span // CHUNK
    out = nl.ndarray((rows_total, hq, d), dtype=q.dtype, buffer=nl.shared_hbm, name="att_y")
    for r in range(nl.program_id(0), n_requests, nl.num_programs(0)):
        i0 = r * rows_per_request
        # Tile row t = (request row t // G, head t % G): each row's bounds repeated over its G heads.
        bounds = nl.ndarray((PT, 2), dtype=nl.float32, buffer=nl.sbuf, name="att_bounds")
        nisa.dma_copy(dst=bounds[:t_rows], src=row_bounds[i0:i0 + rows_per_request].reshape(
            (rows_per_request, 1, 2)).broadcast(1, group))
        for h in range(hkv):
            q32 = _load_tile_fp32(q[i0:i0 + rows_per_request, h * group:(h + 1) * group, :], t_rows, d, "att_q")
            q_t = _transposed(q32, t_rows, d, "att_qT")
            m_all = nl.ndarray((PT, n_splits), dtype=nl.float32, buffer=nl.sbuf, name="att_m")
            l_all = nl.ndarray((PT, n_splits), dtype=nl.float32, buffer=nl.sbuf, name="att_l")
            o_all = nl.ndarray((PT, d, n_splits), dtype=nl.float32, buffer=nl.sbuf, name="att_o_all")
            for c in range(n_splits):
                _split_partials(q_t, k_cache, v_cache, key_rows, key_pos, bounds, r, h, c * CHUNK, t_rows, d,
                                scale, m_all, l_all, o_all, c)
            out_sb = _merge(m_all, l_all, o_all, t_rows, d, n_splits, q.dtype)
            nisa.dma_copy(dst=out[i0:i0 + rows_per_request, h * group:(h + 1) * group, :], src=out_sb[:t_rows])
    return out
