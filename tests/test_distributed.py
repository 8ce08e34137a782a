"""torch_bq.distributed: shard construction (single process) and the collectives (gloo, 2 and 4 ranks).

The multi-process part spawns one gloo group per world size and runs every check of
tests/tp_checks.py inside it (one spawn is ~20 s of interpreter start-up on 2 cores,
so checks are not spawned one by one); each check is then reported as its own test.
"""

import json
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from hypothesis import given
from hypothesis import strategies as st

import tp_checks
from torch_bq import formats
from torch_bq.distributed import (
    column_parallel,
    column_shard,
    kv_head_range,
    row_shard,
    split_range,
    tensor_parallel,
)
from torch_bq.distributed.linear import block_amax, qdq_with_block_amax
from torch_bq.distributed.sharding import read_column_shard, read_row_shard
from torch_bq.nn import BF16Linear, CheckpointReader, DrafterConfig, DrafterLayer, FP4Linear, FP8Linear, detect_linear

# --------------------------------------------------------------------------- #
# ranges
# --------------------------------------------------------------------------- #


def test_split_range_is_balanced_and_covers():
    for size, world in ((96, 4), (70, 4), (5, 5), (7, 3)):
        ranges = [split_range(size, r, world) for r in range(world)]
        assert ranges[0][0] == 0 and ranges[-1][1] == size
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert max(b - a for a, b in ranges) - min(b - a for a, b in ranges) <= 1
    assert split_range(96, 1, 4) == (24, 48)


@pytest.mark.parametrize(
    "args,match",
    [((3, 0, 4), "cannot split 3 features over 4 ranks"), ((8, 4, 4), r"rank: expected an int in \[0, 4\)"),
     ((8, 0, 0), "world_size: expected a positive int")],
)
def test_split_range_errors(args, match):
    with pytest.raises(ValueError, match=match):
        split_range(*args)


# --------------------------------------------------------------------------- #
# shards decode to exactly the full weight's slice
# --------------------------------------------------------------------------- #


def _fp8(n, k, block, scale_dtype, seed=0):
    w = tp_checks.float_weight(n, k, seed)
    data, scale = formats.quantize_fp8(w, block, scale_dtype)
    if scale_dtype == torch.float32:
        scale = scale * (1 + torch.rand(scale.shape, generator=torch.Generator().manual_seed(seed)))
    return FP8Linear.from_quantized(data, scale, block=block)


def _fp4(n, k, seed=0):
    packed, scale = formats.quantize_fp4(tp_checks.float_weight(n, k, seed))
    return FP4Linear.from_quantized(packed, scale, in_features=k)


def _bytes(t):
    return t.contiguous().view(torch.uint8)


@given(
    n=st.integers(1, 150), k=st.integers(1, 80), world=st.integers(1, 6),
    block=st.sampled_from([(32, 32), (128, 128), (1, 32), (16, 8), (3, 5)]),
    f32=st.booleans(), data=st.data(),
)
def test_fp8_shards_decode_exactly(n, k, world, block, f32, data):
    layer = _fp8(n, k, block, torch.float32 if f32 else torch.float8_e8m0fnu)
    full = tp_checks.decoded(layer)
    if n >= world:
        rank = data.draw(st.integers(0, world - 1))
        n0, n1 = split_range(n, rank, world)
        shard = column_shard(layer, [(n0, n1)])
        assert shard.block[1] == block[1] and block[0] % shard.block[0] == 0
        assert torch.equal(tp_checks.decoded(shard), full[n0:n1])
        assert torch.equal(_bytes(shard.weight), _bytes(layer.weight[n0:n1]))
    if k >= world:
        rank = data.draw(st.integers(0, world - 1))
        k0, k1 = split_range(k, rank, world)
        part = row_shard(layer, k0, k1)
        assert part.lead == 0 and part.module.block[0] == block[0]
        assert torch.equal(tp_checks.decoded(part.module), full[:, k0:k1])


def test_fp8_non_aligned_shards_use_the_finest_exact_block():
    # N = 96 over 4 ranks: rows 0, 24, 48, 72 -> blocks of gcd(32, start) rows.
    layer = _fp8(96, 64, (32, 32), torch.float8_e8m0fnu)
    blocks = [column_shard(layer, [split_range(96, r, 4)]).block for r in range(4)]
    assert blocks == [(32, 32), (8, 32), (16, 32), (8, 32)]
    # Rank 1 holds rows 24..47: its first 8 rows use full block row 0's scales, the rest block row 1's.
    shard = column_shard(layer, [(24, 48)])
    codes = shard.weight_scale.view(torch.uint8)
    full = layer.weight_scale.view(torch.uint8)
    assert torch.equal(codes, torch.stack([full[0], full[1], full[1]]))
    # An odd start falls back to one scale row per weight row, still exact.
    odd = column_shard(layer, [(7, 40)])
    assert odd.block == (1, 32) and torch.equal(tp_checks.decoded(odd), tp_checks.decoded(layer)[7:40])


@given(n=st.integers(2, 200), bn=st.sampled_from([1, 4, 32, 128]), cuts=st.lists(st.integers(0, 199), min_size=2,
       max_size=6), f32=st.booleans())
def test_any_multi_range_fp8_column_shard_decodes_exactly(n, bn, cuts, f32):
    layer = _fp8(n, 40, (bn, 32), torch.float32 if f32 else torch.float8_e8m0fnu)
    points = sorted({c % (n + 1) for c in cuts})
    ranges = [(a, b) for a, b in zip(points[::2], points[1::2]) if a < b]
    if not ranges:
        return
    shard = column_shard(layer, ranges)
    full = tp_checks.decoded(layer)
    assert torch.equal(tp_checks.decoded(shard), torch.cat([full[a:b] for a, b in ranges]))


def test_multi_range_column_shard_is_the_concatenation():
    layer = _fp8(160, 64, (32, 32), torch.float8_e8m0fnu)
    ranges = [(0, 32), (64, 96), (128, 160)]  # q | k | v of one rank in a fused qkv
    shard = column_shard(layer, ranges)
    assert shard.block == (32, 32)
    full = tp_checks.decoded(layer)
    assert torch.equal(tp_checks.decoded(shard), torch.cat([full[a:b] for a, b in ranges]))
    shard = column_shard(layer, [(8, 24), (100, 104)])  # gcd(32, 8, 16, 100) = 4
    assert shard.block == (4, 32)
    assert torch.equal(tp_checks.decoded(shard), torch.cat([full[8:24], full[100:104]]))


@given(n=st.integers(1, 40), k=st.integers(2, 140), world=st.integers(1, 6), data=st.data())
def test_fp4_shards_decode_exactly(n, k, world, data):
    layer = _fp4(n, k)
    full = tp_checks.decoded(layer)
    if k >= world:
        rank = data.draw(st.integers(0, world - 1))
        k0, k1 = split_range(k, rank, world)
        part = row_shard(layer, k0, k1)
        assert part.lead == k0 % 32
        got = tp_checks.decoded(part.module)
        assert torch.equal(got[:, part.lead:], full[:, k0:k1])
        assert torch.equal(got[:, :part.lead], torch.zeros(n, part.lead))  # the previous rank's columns
    if n >= world:
        rank = data.draw(st.integers(0, world - 1))
        n0, n1 = split_range(n, rank, world)
        assert torch.equal(tp_checks.decoded(column_shard(layer, [(n0, n1)])), full[n0:n1])


def test_fp4_row_shard_zeroes_the_neighbours_nibbles():
    layer = _fp4(4, 75)
    part = row_shard(layer, 37, 56)  # starts at an odd column inside group 1, ends at an even one
    data = part.module.weight
    assert part.lead == 5 and part.module.in_features == 56 - 32
    assert torch.equal(data[:, :2], torch.zeros(4, 2, dtype=torch.uint8))  # columns 32..35
    assert torch.equal(data[:, 2] & 0x0F, torch.zeros(4, dtype=torch.uint8))  # column 36's low nibble
    assert torch.equal(data[:, 2] >> 4, layer.weight[:, 18] >> 4)  # column 37 kept


def test_dense_shards_are_slices():
    layer = BF16Linear.from_quantized(torch.randn(10, 12).to(torch.bfloat16), torch.randn(10))
    assert torch.equal(column_shard(layer, [(3, 7)]).weight, layer.weight[3:7])
    part = row_shard(layer, 5, 12)
    assert torch.equal(part.module.weight, layer.weight[:, 5:]) and part.module.bias is None
    assert torch.equal(part.bias, layer.bias)


def test_shards_do_not_keep_the_full_weight_alive():
    layer = _fp8(96, 64, (32, 32), torch.float8_e8m0fnu)
    layer.bias = torch.randn(96)
    shard, part = column_shard(layer, [(24, 48)]), row_shard(layer, 24, 48)
    for t in (shard.weight, shard.weight_scale, shard.bias, part.module.weight, part.module.weight_scale, part.bias):
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()


def test_meta_modules_shard_to_meta():
    layer = FP8Linear(64, 96, bias=True, device="meta")
    shard = column_shard(layer, [(24, 48)])
    assert shard.weight.is_meta and shard.block == (8, 32) and shard.weight_scale.shape == (3, 2)
    part = row_shard(FP4Linear(75, 8, device="meta"), 37, 56)
    assert part.module.weight.is_meta and part.lead == 5


def test_unsupported_inputs_are_refused():
    with pytest.raises(TypeError, match="expected an FP8Linear, FP4Linear, NVFP4Linear or BF16Linear, got Linear"):
        column_shard(torch.nn.Linear(4, 4), [(0, 2)])
    with pytest.raises(ValueError, match=r"rows: range \[3, 3\) is empty"):
        column_shard(_fp8(8, 8, (1, 32), torch.float8_e8m0fnu), [(3, 3)])
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        column_parallel(_fp8(8, 8, (1, 32), torch.float8_e8m0fnu))
    with pytest.raises(TypeError, match="expected a DrafterLayer or a Drafter"):
        tensor_parallel(torch.nn.Linear(4, 4))


@pytest.mark.parametrize(
    "hq,hkv,world,expected",
    [(8, 4, 4, [(0, 1), (1, 2), (2, 3), (3, 4)]), (8, 4, 2, [(0, 2), (2, 4)]),
     (8, 2, 4, [(0, 1), (0, 1), (1, 2), (1, 2)]), (8, 1, 4, [(0, 1)] * 4)],
)
def test_kv_heads_split_or_replicate(hq, hkv, world, expected):
    config = DrafterConfig(num_attention_heads=hq, num_key_value_heads=hkv)
    assert [kv_head_range(config, r, world) for r in range(world)] == expected


@pytest.mark.parametrize(
    "hq,hkv,world,match",
    [(8, 4, 3, "num_attention_heads = 8 is not a multiple of the world size 3"),
     (12, 6, 4, "num_key_value_heads = 6 is not a multiple of the world size 4"),
     (12, 3, 4, "num_key_value_heads = 3 < world size 4, and 4 is not a multiple of 3")],
)
def test_kv_head_splits_that_cannot_work_are_refused(hq, hkv, world, match):
    with pytest.raises(ValueError, match=match):
        kv_head_range(DrafterConfig(num_attention_heads=hq, num_key_value_heads=hkv), 0, world)


@given(k=st.integers(1, 200), world=st.integers(1, 7), rows=st.integers(0, 4), seed=st.integers(0, 2**16),
       peak=st.sampled_from([224.0, 448.0]))
def test_cut_qdq_blocks_quantize_like_the_full_row(k, world, rows, seed, peak):
    # Emulates the exchange of RowParallelLinear: each rank's block maxima, maximized over
    # the ranks (the all-reduce), then each rank quantizes its columns alone.
    world = min(world, k)
    x = tp_checks.make_input(k, lead=(rows,), seed=seed)
    x[..., 5::32] *= 1e-3  # some values deep in a block's subnormal range
    ranges = [split_range(k, r, world) for r in range(world)]
    nb = -(-k // 32)
    amax = torch.zeros(rows, nb)
    for k0, k1 in ranges:
        part = block_amax(x[:, k0:k1], k0)
        amax[:, k0 // 32:k0 // 32 + part.shape[1]] = torch.maximum(amax[:, k0 // 32:k0 // 32 + part.shape[1]], part)
    full = formats.qdq_fp8(x, peak)
    for k0, k1 in ranges:
        got = qdq_with_block_amax(x[:, k0:k1], k0, amax[:, k0 // 32:-(-k1 // 32)], peak)
        assert torch.equal(got.view(torch.int16), full[:, k0:k1].view(torch.int16))


# --------------------------------------------------------------------------- #
# checkpoints: each rank reads only its slices
# --------------------------------------------------------------------------- #


class RecordingReader(CheckpointReader):
    """A reader that records every whole-tensor read and every slice index (and its bytes)."""

    def __init__(self, source):
        super().__init__(source)
        self.whole, self.slices = [], []

    def get(self, name):
        self.whole.append(name)
        return super().get(name)

    def get_slice(self, name):
        inner = super().get_slice(name)
        reader = self

        class Recorded:
            def __getitem__(self, index):
                out = inner[index]
                reader.slices.append((name, index, out.numel() * out.element_size()))
                return out

        return Recorded()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_ckpt")
    tp_checks.write_checkpoints(root)
    return root


@pytest.mark.parametrize("index", range(5))
@pytest.mark.parametrize("world", [2, 4])
def test_checkpoint_reads_only_the_ranks_slices(checkpoints, index, world):
    fmt, n, k, path, prefix, opts = tp_checks.checkpoint_layers(checkpoints)[index]
    full = tp_checks.make_layer(fmt, n, k, seed=n + k + 1)
    find = {key: v for key, v in opts.items()}
    for rank in range(world):
        n0, n1 = split_range(n, rank, world)
        k0, k1 = split_range(k, rank, world)
        with RecordingReader(path) as reader:
            layout = detect_linear(reader, prefix, **find)
            names = (layout.weight_name, layout.scale_name)
            sizes = {name: reader.nbytes(name) for name in names if name}
            col = read_column_shard(reader, layout, [(n0, n1)])
            assert not reader.whole, reader.whole  # nothing read whole, not even the bias
            col_bytes = _read_bytes(reader, names)
            reader.slices.clear()
            row = read_row_shard(reader, layout, k0, k1)
            assert set(reader.whole) <= {layout.bias_name}, reader.whole  # only the bias (added after the sum)
            row_bytes = _read_bytes(reader, names)
        expected_col = column_shard(full, [(n0, n1)])
        expected_row = row_shard(full, k0, k1)
        assert tp_checks._same_state(col, expected_col)
        assert tp_checks._same_state(row.module, expected_row.module) and row.lead == expected_row.lead
        # Bytes read, counted independently of the sharding code: the rank's rows / columns of
        # the weight (fp4: the bytes holding its columns; gpt-oss: the 16-byte groups holding
        # them) and the scale rows / columns covering them, shared blocks included.
        itemsize = {name: reader.dtype(name).itemsize for name in sizes}
        grid = reader.shape(layout.scale_name)[-2:] if layout.scale_name else None
        weight, scale = layout.weight_name, layout.scale_name
        if fmt == "fp4":
            groups = -(-k1 // 32) - k0 // 32
            row_weight = n * 16 * groups if layout.layout == "gpt-oss" else n * (-(-k1 // 2) - k0 // 2)
            assert col_bytes[weight] == (n1 - n0) * -(-k // 2)
            assert row_weight == row_bytes[weight]
            assert col_bytes[scale] == (n1 - n0) * grid[1] and row_bytes[scale] == n * groups
        else:
            assert col_bytes[weight] == (n1 - n0) * k * itemsize[weight]
            assert row_bytes[weight] == n * (k1 - k0) * itemsize[weight]
        if fmt.startswith("fp8"):
            bn, bk = layout.block
            assert col_bytes[scale] == (-(-n1 // bn) - n0 // bn) * grid[1] * itemsize[scale]
            assert row_bytes[scale] == grid[0] * (-(-k1 // bk) - k0 // bk) * itemsize[scale]
        assert col_bytes[weight] < sizes[weight] and row_bytes[weight] < sizes[weight]


def _read_bytes(reader, names):
    out = {}
    for name, _, nbytes in reader.slices:
        out[name] = out.get(name, 0) + nbytes
    return out


# --------------------------------------------------------------------------- #
# multi-process: gloo groups of 2 and 4 ranks
# --------------------------------------------------------------------------- #

WORLD_SIZES = (2, 4)
SPAWN_TIMEOUT_S = 400


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory, checkpoints):
    """``{world_size: [per-rank {check: "ok" | traceback}]}``, one gloo group per world size."""
    out = {}
    for world in WORLD_SIZES:
        work = tmp_path_factory.mktemp(f"gloo{world}")
        ctx = mp.start_processes(
            tp_checks.worker, args=(world, str(work / "init"), str(checkpoints), str(work)),
            nprocs=world, join=False, start_method="spawn",
        )
        deadline = time.monotonic() + SPAWN_TIMEOUT_S
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                pytest.fail(f"the {world}-rank gloo group did not finish in {SPAWN_TIMEOUT_S} s")
        out[world] = [json.loads((work / f"rank{r}.json").read_text()) for r in range(world)]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("check", list(tp_checks.CHECKS))
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_gloo(rank_results, world, check):
    outcomes = [res[check] for res in rank_results[world]]
    if all(o.startswith("skip: ") for o in outcomes):
        pytest.skip(outcomes[0][len("skip: "):])
    failures = [f"rank {r}:\n{o}" for r, o in enumerate(outcomes) if o != "ok"]
    assert not failures, "\n".join(failures)
