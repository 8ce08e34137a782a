"""Checks run inside every rank of a gloo process group (see test_distributed.py).

Each check builds the same full layers on every rank from fixed seeds, shards them,
runs them, and compares with the single-rank math. A check raises ``AssertionError``
on failure; the worker records the traceback per check and the test reports it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from torch_bq.testing import assert_linear_close
from torch_bq import formats, ops
from torch_bq.distributed import (
    REDUCTIONS,
    column_parallel,
    column_parallel_from_checkpoint,
    row_parallel,
    row_parallel_from_checkpoint,
    split_range,
    tensor_parallel,
)
from torch_bq.nn import BF16Linear, Drafter, DrafterConfig, FP4Linear, FP8Linear

# --------------------------------------------------------------------------- #
# layers and inputs, the same on every rank (fixed seeds)
# --------------------------------------------------------------------------- #

# name -> (module class, from_linear options, post-processing)
FORMATS = ("fp8", "fp8_128_f32", "mxfp8", "fp4", "bf16", "fp32w")


def float_weight(n: int, k: int, seed: int) -> torch.Tensor:
    """Random ``[n, k]`` weight whose 8x8 tiles differ in magnitude by up to 2**6.

    Different scales in neighbouring blocks make a shard that picks the wrong scale
    row or column visibly wrong.
    """
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) / math.sqrt(k)
    tiles = torch.randint(-3, 4, (-(-n // 8), -(-k // 8)), generator=gen).to(torch.float32).exp2()
    return w * tiles.repeat_interleave(8, 0)[:n].repeat_interleave(8, 1)[:, :k]


def make_layer(fmt: str, n: int, k: int, *, bias: bool = True, seed: int = 0):
    """A full torch_bq layer of format ``fmt`` (see :data:`FORMATS`)."""
    lin = torch.nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(float_weight(n, k, seed))
        if bias:
            lin.bias.copy_(torch.randn(n, generator=torch.Generator().manual_seed(seed + 1)))
    if fmt == "fp8":
        return FP8Linear.from_linear(lin, block=(32, 32))
    if fmt == "fp8_128_f32":
        m = FP8Linear.from_linear(lin, block=(128, 128), scale_dtype=torch.float32)
        # DeepSeek's float32 multipliers are not powers of two; make these not either.
        m.weight_scale = m.weight_scale * (1 + torch.rand(m.weight_scale.shape, generator=torch.Generator().manual_seed(seed)))
        return m
    if fmt == "mxfp8":
        return FP8Linear.from_linear(lin, block=(1, 32))
    if fmt == "fp4":
        return FP4Linear.from_linear(lin)
    if fmt == "bf16":
        return BF16Linear.from_linear(lin)
    if fmt == "fp32w":
        return BF16Linear.from_linear(lin, keep_fp32=True)
    raise ValueError(fmt)


def make_input(k: int, lead=(5,), seed: int = 7) -> torch.Tensor:
    """``[*lead, k]`` with a spike in the first (even rows) or last (odd rows) column of
    every 32-wide block.

    The spike sets each qdq block's scale to 2**6 (amax 2**13 / peak 224 -> 2**6), which
    puts the block's ordinary values (|x| ~ 1 < 2**-6 * 2**6) into e4m3's subnormal range.
    A rank holding only the part of a cut block without the spike that quantized it on its
    own would pick a scale near 2**-6, keep 3 mantissa bits there, and differ. The spike
    sits at either end so that both the rank after a cut (which lacks the block's start)
    and the rank before it (which lacks its end) depend on the exchanged maxima.
    """
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, k, generator=gen)
    rows = x.view(-1, k)
    rows[0::2, ::32] = 2.0**13 * torch.sign(rows[0::2, ::32] + 0.5)
    rows[1::2, 31::32] = 2.0**13 * torch.sign(rows[1::2, 31::32] + 0.5)
    return x


def decoded(layer) -> torch.Tensor:
    if isinstance(layer, FP8Linear):
        return formats.dequantize_fp8(layer.weight, layer.weight_scale, layer.block, torch.float32)
    if isinstance(layer, FP4Linear):
        return formats.dequantize_fp4(layer.weight, layer.weight_scale, layer.in_features, torch.float32)
    return layer.weight.to(torch.bfloat16).to(torch.float32)


def activation(layer, x: torch.Tensor) -> torch.Tensor:
    """``A`` of docs/contract.md §4 for ``layer``."""
    if getattr(layer, "act_quant", False):
        return formats.qdq_fp8(x, layer.act_peak).to(torch.float32)
    return x.to(torch.bfloat16).to(torch.float32)


def expect(ok: bool, detail=None) -> None:
    """Assert ``ok`` on every rank at once.

    A check that failed on one rank only would leave the others waiting in the next
    collective (and gloo aborts on a mismatched one), so every rank learns whether any
    rank failed and all raise together.
    """
    failed = torch.tensor([0.0 if ok else 1.0])
    dist.all_reduce(failed)
    if failed.item():
        mine = "failed here" if not ok else "passed here, failed elsewhere"
        raise AssertionError(f"{detail!r}: {int(failed.item())} rank(s) failed; {mine}")


def expect_linear_close(y, a, w, bias=None) -> None:
    """:func:`assert_linear_close` on every rank at once (see :func:`expect`)."""
    try:
        assert_linear_close(y, a, w, bias)
        ok, detail = True, None
    except AssertionError as e:
        ok, detail = False, str(e)
    expect(ok, detail)


def all_equal_across_ranks(t: torch.Tensor, group=None) -> bool:
    """Every rank holds bitwise the same ``t``."""
    size = dist.get_world_size(group)
    raw = t.contiguous().view(torch.uint8).reshape(-1) if t.numel() else torch.zeros(0, dtype=torch.uint8)
    got = [torch.empty_like(raw) for _ in range(size)]
    dist.all_gather(got, raw, group=group)
    return all(torch.equal(got[0], g) for g in got)


# --------------------------------------------------------------------------- #
# checks
# --------------------------------------------------------------------------- #

CHECKS = {}


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


# N = 96 over 4 ranks gives 24 rows a rank: shards start at rows 24, 48, 72, inside
# 32-row blocks (and inside the single 128-row block). N = 70 splits unevenly.
COLUMN_SHAPES = ((96, 64), (70, 48))


@check
def column_parallel_matches_one_rank(ctx):
    rank, size = ctx["rank"], ctx["world_size"]
    for fmt in FORMATS:
        for n, k in COLUMN_SHAPES:
            full = make_layer(fmt, n, k, seed=n + k)
            x = make_input(k, lead=(2, 3))
            a, w = activation(full, x), decoded(full)
            y = column_parallel(full, gather_output=True)(x)
            expect(y.shape == (2, 3, n) and y.dtype == x.dtype, (fmt, y.shape))
            expect_linear_close(y, a, w, full.bias)
            expect(all_equal_across_ranks(y), fmt)
            n0, n1 = split_range(n, rank, size)
            mine = column_parallel(full, gather_output=False)(x)
            expect(mine.shape == (2, 3, n1 - n0), (fmt, mine.shape))
            expect_linear_close(mine, a, w[n0:n1], full.bias[n0:n1])


@check
def column_parallel_bf16_input_and_empty_batch(ctx):
    full = make_layer("fp8", 96, 64, seed=3)
    cp = column_parallel(full)
    x = make_input(64).to(torch.bfloat16)
    y = cp(x)
    expect(y.dtype == torch.bfloat16)
    expect_linear_close(y, activation(full, x), decoded(full), full.bias)
    empty = cp(torch.zeros(0, 64))
    expect(empty.shape == (0, 96))


@check
def compiled_fullgraph_matches_eager(ctx):
    # aot_eager: dynamo must trace the collectives into one graph (fullgraph) and
    # AOTAutograd must functionalize them. Inductor gave bitwise the same results when run
    # by hand but costs ~30 s a module on 2 cores, so the suite stops at aot_eager.
    if ctx["world_size"] != 2:
        return "run on 2 ranks only (compiling is slow)"
    full = make_layer("fp8", 96, 96, seed=4)
    x = make_input(96, lead=(3,))
    for module in (column_parallel(full), row_parallel(full), row_parallel(full, reduce="scatter_gather")):
        compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
        expect(torch.equal(compiled(x), module(x)), repr(module))


ROW_SHAPES = ((96, 96), (40, 70))  # K = 96 over 4: 24 columns a rank, boundaries inside qdq blocks


@check
def row_parallel_matches_one_rank(ctx):
    rank, size = ctx["rank"], ctx["world_size"]
    for fmt in FORMATS:
        shapes = ROW_SHAPES + (((48, 75),) if fmt == "fp4" else ())  # odd K: packed byte shared by two ranks
        for n, k in shapes:
            full = make_layer(fmt, n, k, seed=n + 2 * k)
            x = make_input(k, lead=(2, 3))
            a, w = activation(full, x), decoded(full)
            k0, k1 = split_range(k, rank, size)
            for reduce in REDUCTIONS:
                for parallel_input in (False, True):
                    rp = row_parallel(full, input_is_parallel=parallel_input, reduce=reduce)
                    y = rp(x[..., k0:k1] if parallel_input else x)
                    expect(y.shape == (2, 3, n) and y.dtype == x.dtype, (fmt, y.shape))
                    # assert_linear_close's gamma(K + 1) * sum|products| covers any order of the float32
                    # sum: here each rank sums k1 - k0 products and the P partials are added in
                    # P - 1 more steps, depth (K/P + P) <= K + 1 for these shapes.
                    expect_linear_close(y, a, w, full.bias)
                    expect(all_equal_across_ranks(y), (fmt, reduce))


@check
def row_parallel_quantizes_cut_blocks_exactly(ctx):
    rank, size = ctx["rank"], ctx["world_size"]
    cut_somewhere = torch.zeros(1)
    for fmt, k in (("fp8", 96), ("fp4", 75), ("fp8", 70)):
        full = make_layer(fmt, 32, k, seed=5)
        rp = row_parallel(full)
        k0, k1 = split_range(k, rank, size)
        x = make_input(k, lead=(6,))
        expected = formats.qdq_fp8(x, full.act_peak)[:, k0:k1]
        got = rp._quantize(x[:, k0:k1])
        expect(torch.equal(got.view(torch.int16), expected.view(torch.int16)), (fmt, rank))
        expect(rp.exchange_amax == any(split_range(k, r, size)[0] % 32 for r in range(1, size)))
        # The control: quantizing the slice alone gives other numbers wherever a block is cut.
        if not torch.equal(ops.qdq_fp8(x[:, k0:k1], full.act_peak).view(torch.int16), expected.view(torch.int16)):
            cut_somewhere += 1
    dist.all_reduce(cut_somewhere)
    expect(cut_somewhere.item() > 0, "the inputs never exercise a cut qdq block")


@check
def checkpoint_shards_equal_module_shards(ctx):
    rank, size, root = ctx["rank"], ctx["world_size"], Path(ctx["ckpt"])
    for fmt, n, k, path, prefix, opts in checkpoint_layers(root):
        full = make_layer(fmt, n, k, seed=n + k + 1)
        x = make_input(k, lead=(4,))
        from_ckpt = column_parallel_from_checkpoint(path, prefix, **opts)
        from_module = column_parallel(full)
        expect(_same_state(from_ckpt.local, from_module.local), (fmt, prefix, "column"))
        expect(torch.equal(from_ckpt(x), from_module(x)), (fmt, prefix))
        from_ckpt = row_parallel_from_checkpoint(path, prefix, **opts)
        from_module = row_parallel(full)
        expect(_same_state(from_ckpt.local, from_module.local), (fmt, prefix, "row"))
        expect(from_ckpt.lead == from_module.lead)
        expect(torch.equal(from_ckpt(x), from_module(x)), (fmt, prefix))


def _same_state(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    if sa.keys() != sb.keys() or getattr(a, "block", None) != getattr(b, "block", None):
        return False
    return all(sa[key].dtype == sb[key].dtype and torch.equal(sa[key].view(torch.uint8), sb[key].view(torch.uint8))
               for key in sa)


@check
def subgroups_shard_independently(ctx):
    rank, size = ctx["rank"], ctx["world_size"]
    if size != 4:
        return "needs 4 ranks"
    # new_group must be called by every rank for every group, in the same order.
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[rank // 2]
    full = make_layer("fp8", 96, 96, seed=11 + rank // 2)  # each pair shards its own layer
    x = make_input(96, lead=(3,), seed=rank // 2)
    y = column_parallel(full, group=group)(x)
    expect_linear_close(y, activation(full, x), decoded(full), full.bias)
    z = row_parallel(full, group=group)(x)
    expect(row_parallel(full, group=group).world_size == 2)
    expect_linear_close(z, activation(full, x), decoded(full), full.bias)
    for g in groups:
        dist.destroy_process_group(g)


# --------------------------------------------------------------------------- #
# checkpoints written once by the parent process
# --------------------------------------------------------------------------- #


def checkpoint_layers(root: Path):
    """``(fmt, N, K, path, prefix, options)`` of the layers :func:`write_checkpoints` stores."""
    return [
        ("fp8", 96, 96, root / "fp8.safetensors", "layer", {}),
        ("fp8_128_f32", 96, 70, root / "deepseek.safetensors", "model.proj", {}),
        ("fp4", 96, 75, root / "fp4.safetensors", "fp4", {"in_features": 75}),
        ("fp4", 64, 96, root / "gptoss.safetensors", "experts.down_proj", {"expert": 1}),
        ("bf16", 70, 96, root / "dense.safetensors", "dense", {}),
    ]


def write_checkpoints(root: Path) -> None:
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    for fmt, n, k, path, prefix, opts in checkpoint_layers(root):
        m = make_layer(fmt, n, k, seed=n + k + 1)
        if prefix == "experts.down_proj":  # gpt-oss: [E, N, K/32, 16] blocks, [E, N, K/32] scales, expert 1
            other = make_layer(fmt, n, k, seed=99)
            blocks = torch.stack([other.weight, m.weight]).reshape(2, n, k // 32, 16)
            scales = torch.stack([other.weight_scale, m.weight_scale]).view(torch.uint8)
            save_file({f"{prefix}_blocks": blocks.contiguous(), f"{prefix}_scales": scales.contiguous(),
                       f"{prefix}_bias": torch.stack([other.bias, m.bias]).contiguous()}, str(path))
            continue
        tensors = {f"{prefix}.weight": m.weight, f"{prefix}.bias": m.bias}
        if fmt == "fp8_128_f32":
            tensors[f"{prefix}.weight_scale_inv"] = m.weight_scale
        elif fmt != "bf16":
            tensors[f"{prefix}.weight_scale"] = m.weight_scale
        save_file({key: v.contiguous() for key, v in tensors.items()}, str(path))
    write_drafter_checkpoints(root)


def write_drafter_checkpoints(root: Path) -> None:
    """``drafter_fused.safetensors`` (qkv_proj) and ``drafter_split.safetensors`` (q/k/v_proj) of TINY24."""
    from safetensors.torch import save_file

    c = TINY24
    state = {k: v.contiguous() for k, v in make_drafter(c).state_dict().items()}
    save_file(state, str(root / "drafter_fused.safetensors"))
    split = {}
    q, kv, bn = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.fp8_block[0]
    for key, value in state.items():
        if ".qkv_proj." not in key:
            split[key] = value
            continue
        per_row = 1 if key.endswith(".weight") else bn  # scale rows cover bn weight rows
        for name, a, b in (("q_proj", 0, q), ("k_proj", q, q + kv), ("v_proj", q + kv, q + 2 * kv)):
            if key.endswith("._extra_state"):  # the recorded block [bn, bk]: the same for each part
                split[key.replace("qkv_proj", name)] = value.clone()
                continue
            split[key.replace("qkv_proj", name)] = value[a // per_row:b // per_row].contiguous()
    save_file(split, str(root / "drafter_split.safetensors"))


# --------------------------------------------------------------------------- #
# the drafter
# --------------------------------------------------------------------------- #

TINY = DrafterConfig(
    hidden_size=64, num_attention_heads=8, num_key_value_heads=4, head_dim=32, rotary_dim=16,
    rope_theta=1e4, sliding_window=11, intermediate_size=96, rows_per_request=3, num_layers=2,
)
# head_dim 24: a rank's q/k/v rows and o_proj columns start inside 32-wide blocks
# (k rows at 24, 48, 72 on 4 ranks), and I = 96 over 4 ranks cuts the down_proj qdq blocks.
TINY24 = dataclasses.replace(TINY, head_dim=24, rotary_dim=8)


def make_drafter(config: DrafterConfig, seed: int = 0) -> Drafter:
    gen = torch.Generator().manual_seed(seed)
    c = config
    drafter = Drafter(c, device="meta")
    state = {}
    shapes = dict(qkv_proj=(c.qkv_size, c.hidden_size), o_proj=(c.hidden_size, c.num_attention_heads * c.head_dim),
                  gate_proj=(c.intermediate_size, c.hidden_size), up_proj=(c.intermediate_size, c.hidden_size),
                  down_proj=(c.hidden_size, c.intermediate_size))
    norms = dict(input_layernorm=c.hidden_size, q_norm=c.head_dim, k_norm=c.head_dim,
                 post_attention_layernorm=c.hidden_size)
    for i in range(c.num_layers):
        for name, (n, k) in shapes.items():
            w = torch.randn(n, k, generator=gen) / math.sqrt(k)
            if c.weight_format == "bf16":
                state[f"layers.{i}.{name}.weight"] = w.to(torch.bfloat16)
            else:
                data, scale = formats.quantize_fp8(w, c.fp8_block)
                state[f"layers.{i}.{name}.weight"], state[f"layers.{i}.{name}.weight_scale"] = data, scale
        for name, dim in norms.items():
            state[f"layers.{i}.{name}.weight"] = (0.2 * torch.randn(dim, generator=gen)).to(torch.bfloat16)
    state["norm.weight"] = (0.2 * torch.randn(c.hidden_size, generator=gen)).to(torch.bfloat16)
    drafter.load_state_dict(state, assign=True)
    return drafter


def make_step(config: DrafterConfig, seed: int = 1, seq_lens=(5, 17, 9), block_size: int = 4):
    """Requests whose context is already in shuffled paged caches, plus this step's rows (one padded)."""
    gen = torch.Generator().manual_seed(seed)
    rpr, c = config.rows_per_request, config
    counts = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(counts) + 2
    physical = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.full((len(seq_lens), max(counts)), 0, dtype=torch.int32)
    for r, nb in enumerate(counts):
        for b in range(nb):
            table[r, b] = physical.pop()
    positions, slots = [], []
    for r, s in enumerate(seq_lens):
        real = rpr - 1 if r == 0 else rpr  # request 0's last row is padding
        for i in range(rpr):
            p = s - real + i if i < real else s - 1
            positions.append(p)
            slots.append(int(table[r, p // block_size]) * block_size + p % block_size if i < real else -1)
    shape = (num_blocks, block_size, c.num_key_value_heads, c.head_dim)
    caches = []
    for _ in range(c.num_layers):
        k_cache = torch.randn(shape, generator=gen).to(torch.bfloat16)
        v_cache = torch.randn(shape, generator=gen).to(torch.bfloat16)
        caches.append((k_cache, v_cache))
    hidden = torch.randn(len(seq_lens) * rpr, c.hidden_size, generator=gen).to(torch.bfloat16)
    return dict(hidden=hidden, positions=torch.tensor(positions), block_table=table,
                slots=torch.tensor(slots), seq_lens=torch.tensor(seq_lens, dtype=torch.int32), caches=caches)


def sqnr_db(actual, expected) -> float:
    noise = (actual.double() - expected.double()).pow(2).sum()
    return float(10 * torch.log10(expected.double().pow(2).sum() / noise)) if noise > 0 else math.inf


def _drafter_case(config: DrafterConfig, ctx, layer_only: bool, reduce: str = "all_reduce") -> None:
    from torch_bq.distributed import kv_head_range

    rank, size = ctx["rank"], ctx["world_size"]
    full = make_drafter(config)
    step = make_step(config)
    h0, h1 = kv_head_range(config, rank, size)
    local_caches = [(k[:, :, h0:h1].clone(), v[:, :, h0:h1].clone()) for k, v in step["caches"]]
    full_caches = [(k.clone(), v.clone()) for k, v in step["caches"]]
    args = (step["positions"],)
    meta = (step["block_table"], step["slots"], step["seq_lens"])
    if layer_only:
        tp = tensor_parallel(full.layers[0], reduce=reduce)
        out = tp(step["hidden"], *args, *local_caches[0], *meta)
        ref = full.layers[0](step["hidden"], *args, *full_caches[0], *meta)
        used = 1
    else:
        tp = tensor_parallel(full, reduce=reduce)
        out = tp(step["hidden"], *args, local_caches, *meta)
        ref = full(step["hidden"], *args, full_caches, *meta)
        used = config.num_layers
    expect(out.shape == ref.shape and out.dtype == torch.bfloat16)
    expect(all_equal_across_ranks(out), "ranks disagree on the residual stream")
    # Tolerance. TP changes only the float32 order of the o_proj/down sums (P partials) and,
    # possibly, of the gemms' blocking; those differ from one rank by <= (K + P) 2**-24 of the
    # sum of |products|, ~1e-5 relative, far below a bf16 ulp (2**-8). What does show is an
    # intermediate landing on the other side of a bf16 rounding (one ulp), and behind a qdq an
    # e4m3 code flipping (one step, <= 2**-3 of that element's block scale). Each such flip
    # reaches the output through a ~1/sqrt(K) linear and a residual add, moving an output
    # element by a fraction of its scale: we allow 2 bf16 ulps of the largest output
    # (2**-7 * max|ref|) per element and ask for > 40 dB overall; a wrong head, KV head,
    # FFN slice or missing reduction gives < 10 dB.
    err = (out.double() - ref.double()).abs().max().item()
    expect(err <= 2.0**-7 * ref.double().abs().max().item(), (err, ref.abs().max().item()))
    expect(sqnr_db(out, ref) > 40, sqnr_db(out, ref))
    # Each rank's caches now hold its KV heads of what the full layer wrote (same tolerance story:
    # k and v come out of a column shard of qkv_proj, computed exactly as the full one).
    for (k_loc, v_loc), (k_full, v_full) in zip(local_caches[:used], full_caches[:used]):
        for got, want in ((k_loc, k_full[:, :, h0:h1]), (v_loc, v_full[:, :, h0:h1])):
            diff = (got.double() - want.double()).abs()
            expect(diff.max().item() <= 2.0**-7 * want.double().abs().max().item())
            expect((diff > 0).float().mean().item() < 0.05)


@check
def tp_drafter_layer_fp8(ctx):
    _drafter_case(TINY, ctx, layer_only=True)


@check
def tp_drafter_stack_fp8(ctx):
    _drafter_case(TINY24, ctx, layer_only=False)


@check
def tp_drafter_from_checkpoint_equals_sharded_module(ctx):
    from torch_bq.distributed import kv_head_range, tensor_parallel_from_checkpoint

    expected = tensor_parallel(make_drafter(TINY24))
    step = make_step(TINY24)
    for name in ("drafter_fused", "drafter_split"):
        loaded = tensor_parallel_from_checkpoint(Path(ctx["ckpt"]) / f"{name}.safetensors", config=TINY24)
        same = all(_same_state(a, b) for a, b in zip(loaded.modules(), expected.modules())
                   if isinstance(a, (FP8Linear, BF16Linear)))
        expect(same and loaded.state_dict().keys() == expected.state_dict().keys(), name)
        expect(loaded.config == expected.config and loaded.full_config == TINY24, name)
        outs = []
        for module in (loaded, expected):
            h0, h1 = kv_head_range(TINY24, ctx["rank"], ctx["world_size"])
            caches = [(k[:, :, h0:h1].clone(), v[:, :, h0:h1].clone()) for k, v in step["caches"]]
            outs.append(module(step["hidden"], step["positions"], caches, step["block_table"], step["slots"],
                               step["seq_lens"]))
        expect(torch.equal(outs[0], outs[1]), name)


@check
def tp_drafter_refuses_full_caches(ctx):
    tp = tensor_parallel(make_drafter(TINY))
    step = make_step(TINY)
    try:
        tp(step["hidden"], step["positions"], step["caches"], step["block_table"], step["slots"], step["seq_lens"])
        message = ""
    except ValueError as e:
        message = str(e)
    local = 4 // ctx["world_size"]
    expect(f"expected shape [num_blocks, block_size, {local}, 32]" in message, message)


@check
def tp_drafter_mxfp8_causal_scatter_gather(ctx):
    config = dataclasses.replace(TINY, weight_format="mxfp8", causal=True)
    _drafter_case(config, ctx, layer_only=False, reduce="scatter_gather")


@check
def tp_drafter_bf16(ctx):
    _drafter_case(dataclasses.replace(TINY, weight_format="bf16"), ctx, layer_only=True)


@check
def tp_drafter_replicated_kv_heads(ctx):
    # Hkv = 2 < P = 4: each KV head lives on two ranks; Hkv = 1 on two ranks likewise.
    hkv = 2 if ctx["world_size"] == 4 else 1
    _drafter_case(dataclasses.replace(TINY, num_key_value_heads=hkv), ctx, layer_only=True)


@check
def docs_example_runs(ctx):
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "tp_fp8_example", Path(__file__).resolve().parents[1] / "examples" / "tp_fp8_linear.py"
    )
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    path = Path(ctx["ckpt"]) / "example.safetensors"
    if ctx["rank"] == 0:
        example.write_checkpoint(str(path))
    dist.barrier()
    err = example.run(str(path), verbose=False)
    expect(err <= 2.0**-7, err)


# --------------------------------------------------------------------------- #
# the worker
# --------------------------------------------------------------------------- #


def worker(rank: int, world_size: int, init_file: str, ckpt: str, out_dir: str, only=None) -> None:
    """Join the gloo group, run every check (or those named in ``only``), write
    ``{check: "ok" | "skip: why" | traceback}`` to ``out_dir/rank{rank}.json``.

    A check returns ``None`` when it ran, or a reason string when it does not apply.
    """
    torch.set_num_threads(1)  # 2-4 ranks share 2 cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=120))
    ctx = dict(rank=rank, world_size=world_size, ckpt=ckpt)
    results = {}
    for name, fn in CHECKS.items():
        if only and name not in only:
            continue
        try:
            skipped = fn(ctx)
            results[name] = "ok" if skipped is None else f"skip: {skipped}"
        except Exception:
            results[name] = traceback.format_exc()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()
    os._exit(0)  # skip interpreter teardown of the gloo threads
