"""Paged KV write and paged sliding-window attention (docs/contract.md §5 steps 4-5).

The ground truth is a dense computation written here: each request's keys and
values live in plain ``[seq_len, Hkv, d]`` arrays, the visible ones are picked
by position, and a float64 softmax runs over them. The ops only ever see those
arrays scattered into a paged cache through a random block table.
"""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import torch_bq
from torch_bq.reference.attention import check_paged_metadata
from torch_bq.reference.attention import paged_window_attention as reference_attention
from torch_bq.reference.flash_decoding import merge_partials, paged_window_attention_split

U32 = 2.0**-24  # float32 unit roundoff
NAN = float("nan")


def dense_attention(q, keys, values, positions, seq_lens, rows_per_request, window, causal, scale):
    """float64 ``[R, Hq, d]``; ``keys[r]``/``values[r]`` are request r's ``[seq_len, Hkv, d]`` arrays."""
    rows, hq, d = q.shape
    out = torch.zeros(rows, hq, d, dtype=torch.float64)
    for i in range(rows):
        r = i // rows_per_request
        p = int(positions[i])
        hi = min(int(seq_lens[r]), p + 1) if causal else int(seq_lens[r])
        lo = max(0, p - window + 1)
        k = keys[r][lo:hi].double()  # [n, Hkv, d]
        v = values[r][lo:hi].double()
        group = hq // k.shape[1]
        for h in range(hq):
            s = (k[:, h // group] @ q[i, h].double()) * scale
            w = torch.softmax(s, dim=0)
            out[i, h] = w @ v[:, h // group]
    return out


def error_bound(q, keys, values, positions, seq_lens, rows_per_request, window, scale):
    """Float32 error of the op against the exact result, per call (a scalar).

    With ``u = 2**-24``: a score is a length-``d`` dot product times ``scale``, so its
    absolute error is ``delta <= (d + 2) u scale max sum|q||k|``. Shifting by the max
    and ``exp`` add a relative error ``(|s - m| + 2) u`` to each probability, with
    ``|s - m| <= 2 max|s|``; normalising and the ``n``-term weighted sum of ``v`` add
    ``(n + 2) u`` relatively. A score error ``delta`` moves each probability by at most
    a factor ``e^(2 delta)``. So ``|out - exact| <= max|v| (4 delta + (2 max|s| + n + 6) u)``,
    doubled here for the second-order terms.
    """
    d = q.shape[-1]
    qa = q.double().abs()
    worst_dot, worst_score, worst_n = 0.0, 0.0, 0
    for r, k in enumerate(keys):
        ka = k.double().abs()  # [L, Hkv, d]
        mine = qa[r * rows_per_request : (r + 1) * rows_per_request]  # [rows, Hq, d]
        group = mine.shape[1] // ka.shape[1]
        dots = torch.einsum("rhd,lhd->rhl", mine, ka.repeat_interleave(group, dim=1))
        worst_dot = max(worst_dot, float(dots.max()) if dots.numel() else 0.0)
        worst_score = max(worst_score, scale * worst_dot)
        worst_n = max(worst_n, min(window, int(seq_lens[r])))
    vmax = max((float(v.abs().max()) for v in values), default=0.0)
    delta = (d + 2) * U32 * scale * worst_dot
    return 2 * vmax * (4 * delta + (2 * worst_score + worst_n + 6) * U32)


def page(keys, values, lo, block_size, hkv, d, dtype, gen, spare_blocks=2):
    """Scatter per-request ``[seq_len, Hkv, d]`` keys and values into paged caches.

    Physical blocks are a random permutation (non-contiguous); blocks wholly before a
    request's visible start ``lo[r]`` are left unmapped (-1) and every cache entry not
    written is NaN, so reading anything outside the visible range poisons the result.

    Returns ``(k_cache, v_cache, block_table)``.
    """
    counts = [-(-k.shape[0] // block_size) for k in keys]
    num_blocks = sum(counts) + spare_blocks
    physical = torch.randperm(num_blocks, generator=gen).tolist()
    k_cache = torch.full((num_blocks, block_size, hkv, d), NAN, dtype=dtype)
    v_cache = k_cache.clone()
    table = torch.full((len(keys), max(counts, default=0) + 1), -1, dtype=torch.int32)
    for r, (k, v) in enumerate(zip(keys, values)):
        for b in range(counts[r]):
            block = physical.pop()
            if (b + 1) * block_size <= lo[r]:
                continue  # slid out of every window: freed
            table[r, b] = block
            for j in range(max(b * block_size, lo[r]), min((b + 1) * block_size, k.shape[0])):
                k_cache[block, j - b * block_size] = k[j]
                v_cache[block, j - b * block_size] = v[j]
    return k_cache, v_cache, table


@st.composite
def attention_cases(draw):
    num_requests = draw(st.integers(0, 3))
    rows_per_request = draw(st.integers(1, 4))
    hkv = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 3]))
    d = draw(st.sampled_from([4, 8]))
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    window = draw(st.integers(1, 40))
    causal = draw(st.booleans())
    seq_lens, positions = [], []
    for _ in range(num_requests):
        seq_len = draw(st.integers(rows_per_request, 70))  # shorter and longer than the window
        seq_lens.append(seq_len)
        # This step's rows end the sequence; padded rows repeat any earlier position.
        real = draw(st.integers(1, rows_per_request))
        for i in range(rows_per_request):
            if i < real:
                positions.append(seq_len - real + i)
            else:
                positions.append(draw(st.integers(0, seq_len - 1)))
    chunk_size = draw(st.sampled_from([1, 3, block_size, 2 * block_size, 32]))
    seed = draw(st.integers(0, 2**16))
    return dict(
        num_requests=num_requests,
        rows_per_request=rows_per_request,
        hkv=hkv,
        hq=hkv * group,
        d=d,
        block_size=block_size,
        window=window,
        causal=causal,
        seq_lens=seq_lens,
        positions=positions,
        chunk_size=chunk_size,
        seed=seed,
    )


def build(case, dtype=torch.float32):
    gen = torch.Generator().manual_seed(case["seed"])
    hkv, d, rpr = case["hkv"], case["d"], case["rows_per_request"]
    seq_lens = torch.tensor(case["seq_lens"], dtype=torch.int32)
    positions = torch.tensor(case["positions"], dtype=torch.int64)
    keys = [torch.randn(s, hkv, d, generator=gen).to(dtype) for s in case["seq_lens"]]
    values = [torch.randn(s, hkv, d, generator=gen).to(dtype) for s in case["seq_lens"]]
    # Scaled-up queries make the softmax peaky, so a wrong mask shows.
    q = (3 * torch.randn(len(case["positions"]), case["hq"], d, generator=gen)).to(dtype)
    lo = [max(0, min(case["positions"][r * rpr : (r + 1) * rpr]) - case["window"] + 1) for r in range(len(keys))]
    k_cache, v_cache, table = page(keys, values, lo, case["block_size"], hkv, d, dtype, gen)
    return q, keys, values, k_cache, v_cache, table, positions, seq_lens


@pytest.mark.parametrize("impl", ["op", "reference", "split"])
@given(case=attention_cases())
def test_attention_matches_dense(impl, case):
    q, keys, values, k_cache, v_cache, table, positions, seq_lens = build(case)
    rpr, window, causal = case["rows_per_request"], case["window"], case["causal"]
    scale = case["d"] ** -0.5
    args = (q, k_cache, v_cache, table, positions, seq_lens)
    if impl == "op":
        out = torch_bq.ops.paged_window_attention(*args, rows_per_request=rpr, window=window, causal=causal)
    elif impl == "reference":
        out = reference_attention(*args, rows_per_request=rpr, window=window, causal=causal, scale=scale)
    else:
        out = paged_window_attention_split(
            *args, rows_per_request=rpr, window=window, causal=causal, scale=scale, chunk_size=case["chunk_size"]
        )
    expected = dense_attention(q, keys, values, positions, seq_lens, rpr, window, causal, scale)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert not out.isnan().any()
    bound = error_bound(q, keys, values, positions, seq_lens, rpr, window, scale)
    err = (out.double() - expected).abs().max().item() if out.numel() else 0.0
    assert err <= bound, (err, bound)


@given(case=attention_cases())
def test_split_matches_reference(case):
    q, keys, values, k_cache, v_cache, table, positions, seq_lens = build(case)
    args = (q, k_cache, v_cache, table, positions, seq_lens)
    scale = case["d"] ** -0.5
    kw = dict(rows_per_request=case["rows_per_request"], window=case["window"], causal=case["causal"], scale=scale)
    ref = reference_attention(*args, **kw)
    split = paged_window_attention_split(*args, **kw, chunk_size=case["chunk_size"])
    # Each is within error_bound of the exact result, so of each other within twice that.
    bound = 2 * error_bound(q, keys, values, positions, seq_lens, case["rows_per_request"], case["window"], scale)
    assert (ref - split).abs().max().item() <= bound if ref.numel() else True


def test_bf16_cache_within_one_rounding():
    # bf16 q and caches: the op computes in float32 and rounds once, so it is within the
    # float32 bound plus half a bf16 ulp (2**-8 relative: 8 significant bits) of the result.
    case = dict(
        num_requests=2, rows_per_request=3, hkv=2, hq=4, d=8, block_size=4, window=9, causal=False,
        seq_lens=[13, 30], positions=[10, 11, 12, 27, 28, 29], chunk_size=8, seed=3,
    )
    q, keys, values, k_cache, v_cache, table, positions, seq_lens = build(case, torch.bfloat16)
    out = torch_bq.ops.paged_window_attention(q, k_cache, v_cache, table, positions, seq_lens, rows_per_request=3, window=9)
    expected = dense_attention(q, keys, values, positions, seq_lens, 3, 9, False, 8**-0.5)
    f32_bound = error_bound(q, keys, values, positions, seq_lens, 3, 9, 8**-0.5)
    bound = f32_bound + 2.0**-8 * (expected.abs() + f32_bound)
    assert out.dtype == torch.bfloat16
    assert ((out.double() - expected).abs() <= bound).all()


def test_window_edges_by_hand():
    # One KV head, d = 1, keys all 1 (every score equal), values = position: each row's
    # output is the mean of the positions it sees, so the visible set is read off exactly.
    block_size, window = 4, 3
    seq_len = 10
    values = torch.arange(seq_len, dtype=torch.float32).view(seq_len, 1, 1)
    keys = torch.ones(seq_len, 1, 1)
    positions = torch.tensor([7, 8, 9], dtype=torch.int64)
    lo = [5]
    k_cache, v_cache, table = page([keys], [values], lo, block_size, 1, 1, torch.float32, torch.Generator().manual_seed(0))
    q = torch.ones(3, 1, 1)
    seq_lens = torch.tensor([seq_len], dtype=torch.int32)
    both_ways = torch_bq.ops.paged_window_attention(q, k_cache, v_cache, table, positions, seq_lens, rows_per_request=3, window=window)
    causal = torch_bq.ops.paged_window_attention(
        q, k_cache, v_cache, table, positions, seq_lens, rows_per_request=3, window=window, causal=True
    )
    # Row at p sees [p - 2, 10) both ways and [p - 2, p] causally; row 9 sees [7, 10) either way.
    assert both_ways.flatten().tolist() == pytest.approx([7.0, 7.5, 8.0])
    assert causal.flatten().tolist() == pytest.approx([6.0, 7.0, 8.0])


def test_merge_partials_empty_splits():
    # Split 1 is empty for every row (m = -inf, l = 0, o = 0); row 1 sees nothing at all.
    m = torch.tensor([[0.5, float("-inf")], [float("-inf"), float("-inf")], [2.0, float("-inf")]])
    l = torch.tensor([[2.0, 0.0], [0.0, 0.0], [1.0, 0.0]])
    o = torch.tensor([[[4.0], [0.0]], [[0.0], [0.0]], [[3.0], [0.0]]])
    out = merge_partials(m, l, o)
    w0 = math.exp(0.5 - 2.0)
    assert out[0, 0].item() == pytest.approx((4.0 * w0 + 3.0) / (2.0 * w0 + 1.0), rel=1e-6)
    assert out[1, 0].item() == 0.0


# --------------------------------------------------------------------------- #
# KV write
# --------------------------------------------------------------------------- #


@given(
    num_blocks=st.integers(1, 6),
    block_size=st.sampled_from([1, 3, 8]),
    rows=st.integers(0, 10),
    seed=st.integers(0, 2**16),
)
def test_kv_write_exact(num_blocks, block_size, rows, seed):
    gen = torch.Generator().manual_seed(seed)
    hkv, d = 2, 5
    capacity = num_blocks * block_size
    rows = min(rows, capacity)
    slots = torch.randperm(capacity, generator=gen)[:rows]
    slots[torch.rand(rows, generator=gen) < 0.3] = -1  # padded rows
    k = torch.randn(rows, hkv, d, generator=gen).to(torch.bfloat16)
    v = torch.randn(rows, hkv, d, generator=gen).to(torch.bfloat16)
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(torch.bfloat16)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            k_expected[slot // block_size, slot % block_size] = k[i]
            v_expected[slot // block_size, slot % block_size] = v[i]
    torch_bq.ops.paged_kv_write(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(torch.int16), k_expected.view(torch.int16))
    assert torch.equal(v_cache.view(torch.int16), v_expected.view(torch.int16))


def test_kv_write_non_contiguous_cache():
    # A cache that is a strided view of a bigger buffer is still written in place.
    buf = torch.zeros(3, 4, 2, 2, 2)
    k_cache, v_cache = buf[..., 0], buf[..., 1]
    k = torch.ones(2, 2, 2)
    torch_bq.ops.paged_kv_write(k, 2 * k, k_cache, v_cache, torch.tensor([5, -1]))
    assert buf[1, 1, :, :, 0].eq(1).all() and buf[1, 1, :, :, 1].eq(2).all()
    assert buf.sum().item() == 4 + 8


def test_write_then_attend_under_compile():
    case = dict(
        num_requests=2, rows_per_request=3, hkv=2, hq=6, d=8, block_size=4, window=6, causal=False,
        seq_lens=[9, 14], positions=[6, 7, 8, 11, 12, 13], chunk_size=4, seed=11,
    )
    q, keys, values, k_cache, v_cache, table, positions, seq_lens = build(case)
    # This step's rows are not yet in the cache: blank them, then write them back.
    step_k = torch.stack([keys[i // 3][p] for i, p in enumerate(case["positions"])])
    step_v = torch.stack([values[i // 3][p] for i, p in enumerate(case["positions"])])
    slots = torch.stack(
        [table[i // 3, p // 4].long() * 4 + p % 4 for i, p in enumerate(case["positions"])]
    )
    k_cache.view(-1, 2, 8)[slots] = NAN
    v_cache.view(-1, 2, 8)[slots] = NAN

    def step(q, k, v, k_cache, v_cache, slots):
        torch_bq.ops.paged_kv_write(k, v, k_cache, v_cache, slots)
        return torch_bq.ops.paged_window_attention(
            q, k_cache, v_cache, table, positions, seq_lens, rows_per_request=3, window=6
        )

    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    eager = step(q, step_k, step_v, *caches[0], slots)
    compiled = torch.compile(step, fullgraph=True)(q, step_k, step_v, *caches[1], slots)
    expected = dense_attention(q, keys, values, positions, seq_lens, 3, 6, False, 8**-0.5)
    assert torch.equal(eager, compiled)
    for eager_cache, compiled_cache in zip(caches[0], caches[1]):  # bits, so NaN == NaN
        assert torch.equal(eager_cache.view(torch.int32), compiled_cache.view(torch.int32))
    assert (eager.double() - expected).abs().max().item() <= error_bound(
        q, keys, values, positions, seq_lens, 3, 6, 8**-0.5
    )


# --------------------------------------------------------------------------- #
# opcheck
# --------------------------------------------------------------------------- #


def _attention_sample(num_requests, causal, dtype=torch.float32):
    case = dict(
        num_requests=num_requests, rows_per_request=2, hkv=2, hq=4, d=8, block_size=4, window=5, causal=causal,
        seq_lens=[7, 12, 3][:num_requests], positions=[5, 6, 10, 11, 1, 2][: 2 * num_requests],
        chunk_size=4, seed=1,
    )
    q, keys, values, k_cache, v_cache, table, positions, seq_lens = build(case, dtype)
    # opcheck compares outputs, and NaN never equals NaN: zero the unread entries.
    return (
        (q, k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0), table, positions, seq_lens),
        dict(rows_per_request=2, window=5, causal=causal, scale=8**-0.5),
    )


@pytest.mark.parametrize(
    "num_requests,causal,dtype",
    [(3, False, torch.float32), (3, True, torch.float32), (2, False, torch.bfloat16), (0, False, torch.float32)],
)
def test_opcheck_paged_window_attention(num_requests, causal, dtype):
    args, kwargs = _attention_sample(num_requests, causal, dtype)
    torch.library.opcheck(torch.ops.torch_bq.paged_window_attention.default, args, kwargs)


@pytest.mark.parametrize("rows", [0, 3])
def test_opcheck_paged_kv_write(rows):
    gen = torch.Generator().manual_seed(rows)
    k_cache = torch.randn(4, 4, 2, 8, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(4, 4, 2, 8, generator=gen).to(torch.bfloat16)
    k = torch.randn(rows, 2, 8, generator=gen).to(torch.bfloat16)
    v = torch.randn(rows, 2, 8, generator=gen).to(torch.bfloat16)
    slots = torch.tensor([9, -1, 2][:rows], dtype=torch.int64)
    torch.library.opcheck(torch.ops.torch_bq.paged_kv_write.default, (k, v, k_cache, v_cache, slots))


# --------------------------------------------------------------------------- #
# errors
# --------------------------------------------------------------------------- #


def _valid():
    args, kwargs = _attention_sample(3, False)
    q, k_cache, v_cache, table, positions, seq_lens = args
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, block_table=table, positions=positions, seq_lens=seq_lens)


def _attend(a, **kw):
    kw = {"rows_per_request": 2, "window": 5, **kw}
    return torch_bq.ops.paged_window_attention(
        a["q"], a["k_cache"], a["v_cache"], a["block_table"], a["positions"], a["seq_lens"], **kw
    )


def test_valid_sample_passes():
    _attend(_valid())


@pytest.mark.parametrize(
    "change,kw,error,match",
    [
        (lambda a: a.update(positions=a["positions"][:5]), {}, ValueError, r"positions: expected shape \[6\]"),
        (lambda a: None, {"rows_per_request": 4}, ValueError, "not a multiple of rows_per_request"),
        (
            lambda a: a["positions"].__setitem__(1, 7), {}, ValueError,
            r"row 1 \(request 0\) has position 7, outside \[0, seq_len = 7\)",
        ),
        (lambda a: a["positions"].__setitem__(0, -1), {}, ValueError, "row 0 .* position -1"),
        (lambda a: a["seq_lens"].__setitem__(1, 0), {}, ValueError, "request 1 has seq_len 0"),
        (
            lambda a: a["seq_lens"].__setitem__(1, 40), {}, ValueError,
            "block_table: request 1 has seq_len 40, which needs 10 blocks of 4, but the table has only 4 columns",
        ),
        (
            lambda a: a["block_table"].__setitem__((1, 2), 99), {}, ValueError,
            r"request 1, logical block 2 maps to physical block 99, outside the cache's \[0, ",
        ),
        (lambda a: a["block_table"].__setitem__((1, 2), -1), {}, ValueError, "logical block 2 maps to physical block -1"),
        (lambda a: a.update(block_table=a["block_table"].long()), {}, TypeError, "block_table: expected dtype torch.int32"),
        (lambda a: a.update(positions=a["positions"].int()), {}, TypeError, "positions: expected dtype torch.int64"),
        (lambda a: a.update(seq_lens=a["seq_lens"].long()), {}, TypeError, "seq_lens: expected dtype torch.int32"),
        (lambda a: a.update(v_cache=a["v_cache"].bfloat16()), {}, TypeError, "v_cache: expected dtype torch.float32"),
        (lambda a: a.update(q=a["q"][..., :4]), {}, ValueError, r"q: expected a 3-D \[R, num_heads, 8\]"),
        (lambda a: a.update(q=a["q"][:, :3]), {}, ValueError, "num_heads \\(3\\) must be a multiple"),
        (lambda a: None, {"window": 0}, ValueError, "window: expected >= 1"),
    ],
)
def test_attention_errors(change, kw, error, match):
    a = _valid()
    change(a)
    with pytest.raises(error, match=match):
        _attend(a, **kw)


@pytest.mark.parametrize("entry", [99, 8, -1])
def test_block_table_entries_checked_even_without_validate(entry):
    # validate=False skips the metadata checks, but the op still refuses a table entry
    # outside the cache (-1 used to read the last block silently, 99 an IndexError).
    a = _valid()
    a["block_table"][1, 2] = entry
    with pytest.raises(ValueError, match=rf"request 1, logical block 2 maps to physical block {entry}, outside"):
        _attend(a, validate=False)


def _write_args(slots=(0, 1), k_shape=(2, 2, 8), k_dtype=torch.float32, cache_shape=(3, 4, 2, 8),
                v_cache_shape=None, slot_dtype=torch.int64):
    k = torch.zeros(k_shape, dtype=k_dtype)
    v = torch.zeros(k_shape)
    k_cache = torch.zeros(cache_shape)
    v_cache = torch.zeros(v_cache_shape or cache_shape)
    return k, v, k_cache, v_cache, torch.tensor(slots, dtype=slot_dtype)


@pytest.mark.parametrize(
    "args,error,match",
    [
        (_write_args([0, 12]), ValueError, r"slots: row 1 writes slot 12, outside the cache's 3 blocks x 4 = 12 slots"),
        (_write_args([5, -1, 5], k_shape=(3, 2, 8)), ValueError, "slot 5 is written by more than one row"),
        (_write_args(slot_dtype=torch.int32), TypeError, "slots: expected dtype torch.int64"),
        (_write_args(k_dtype=torch.bfloat16), TypeError, "k: expected dtype torch.float32"),
        (_write_args(k_shape=(2, 1, 8)), ValueError, r"k: expected shape \[2, 2, 8\]"),
        (_write_args(v_cache_shape=(3, 4, 2, 4)), ValueError, "v_cache: expected shape"),
        (_write_args(cache_shape=(3, 4, 16)), ValueError, "k_cache: expected a 4-D"),
    ],
)
def test_kv_write_errors(args, error, match):
    with pytest.raises(error, match=match):
        torch_bq.ops.paged_kv_write(*args)


def test_metadata_slot_must_match_table():
    a = _valid()
    slots = torch.tensor([-1, -1, -1, -1, -1, -1], dtype=torch.int64)
    common = dict(rows_per_request=2, window=5, num_blocks=a["k_cache"].shape[0], block_size=4)
    check_paged_metadata(a["positions"], a["seq_lens"], a["block_table"], slots=slots, **common)
    # Row 3 is request 1 at position 11: logical block 2, offset 3.
    home = int(a["block_table"][1, 2]) * 4 + 3
    slots[3] = home
    check_paged_metadata(a["positions"], a["seq_lens"], a["block_table"], slots=slots, **common)
    slots[3] = home - 1
    message = f"row 3 \\(request 1, position 11\\) writes slot {home - 1}, but the block table places that position at slot {home}"
    with pytest.raises(ValueError, match=message):
        check_paged_metadata(a["positions"], a["seq_lens"], a["block_table"], slots=slots, **common)
