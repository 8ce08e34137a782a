"""DrafterConfig, DrafterLayer and Drafter (docs/contract.md §5) on tiny configs.

The layer is checked against a dense float64 implementation of docs/contract.md §5 written
here (its own norm, RoPE, attention over plain per-request arrays and SwiGLU,
sharing only the linear ops and the qdq rule, which have their own tests).
"""

import dataclasses
import math
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
import torch._inductor.config as inductor_config
from safetensors.torch import save_file

from torch_bq import formats
from torch_bq.nn import BF16Linear, CheckpointError, Drafter, DrafterConfig, DrafterLayer, FP8Linear, MissingTensorError

LINEARS = ("qkv_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NORMS = ("input_layernorm", "q_norm", "k_norm", "post_attention_layernorm")

TINY = DrafterConfig(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    rotary_dim=16,
    rope_theta=1e4,
    sliding_window=11,
    intermediate_size=96,
    rows_per_request=3,
    num_layers=2,
)


# --------------------------------------------------------------------------- #
# config
# --------------------------------------------------------------------------- #


def test_config_defaults_are_the_full_size_drafter():
    c = DrafterConfig()
    assert dataclasses.asdict(c) == dict(
        hidden_size=6144, num_attention_heads=64, num_key_value_heads=4, head_dim=128, rotary_dim=64,
        rope_theta=5e6, sliding_window=4096, intermediate_size=12288, rms_norm_eps=1e-6, rows_per_request=7,
        num_layers=5, swiglu_alpha=1.702, swiglu_limit=7.0, causal=False, weight_format="fp8", act_quant=True,
        act_peak=224.0,
    )
    assert c.qkv_size == (64 + 8) * 128 and c.num_groups == 16 and c.fp8_block == (32, 32)
    assert DrafterConfig(weight_format="mxfp8").fp8_block == (1, 32)
    assert DrafterConfig(weight_format="bf16").fp8_block is None


@pytest.mark.parametrize(
    "change,error,match",
    [
        (dict(num_key_value_heads=3), ValueError, r"num_attention_heads \(64\) must be a multiple of num_key_value_heads \(3\)"),
        (dict(rotary_dim=63), ValueError, "rotary_dim: expected an even int in \\[0, head_dim = 128\\]"),
        (dict(rotary_dim=130), ValueError, "rotary_dim"),
        (dict(hidden_size=0), ValueError, "hidden_size: expected a positive int, got 0"),
        (dict(sliding_window=2.5), ValueError, "sliding_window: expected a positive int"),
        (dict(rows_per_request=True), ValueError, "rows_per_request"),
        (dict(rms_norm_eps=0.0), ValueError, "rms_norm_eps: expected a positive number"),
        (dict(weight_format="fp4"), ValueError, r"weight_format: expected one of \['bf16', 'fp8', 'mxfp8'\], got 'fp4'"),
        (dict(act_peak=500.0), ValueError, "act_peak: expected 4 <= act_peak <= 448"),
        (dict(causal=1), TypeError, "causal: expected a bool"),
    ],
)
def test_config_errors(change, error, match):
    with pytest.raises(error, match=match):
        DrafterConfig(**change)


# --------------------------------------------------------------------------- #
# building a drafter and a step
# --------------------------------------------------------------------------- #


def float_weights(config, seed=0):
    """Random float32 weights by state-dict name, the "trained model" both formats quantize."""
    gen = torch.Generator().manual_seed(seed)
    c = config
    shapes = dict(
        qkv_proj=(c.qkv_size, c.hidden_size),
        o_proj=(c.hidden_size, c.num_attention_heads * c.head_dim),
        gate_proj=(c.intermediate_size, c.hidden_size),
        up_proj=(c.intermediate_size, c.hidden_size),
        down_proj=(c.hidden_size, c.intermediate_size),
    )
    norm_dims = dict(
        input_layernorm=c.hidden_size, q_norm=c.head_dim, k_norm=c.head_dim, post_attention_layernorm=c.hidden_size
    )
    out = {}
    for i in range(c.num_layers):
        for name, (n, k) in shapes.items():
            out[f"layers.{i}.{name}.weight"] = torch.randn(n, k, generator=gen) / math.sqrt(k)
        for name, dim in norm_dims.items():
            out[f"layers.{i}.{name}.weight"] = (0.2 * torch.randn(dim, generator=gen)).to(torch.bfloat16)
    out["norm.weight"] = (0.2 * torch.randn(c.hidden_size, generator=gen)).to(torch.bfloat16)
    return out


def quantized_state(config, weights):
    """The state dict of a drafter of ``config.weight_format`` holding ``weights``."""
    state = {}
    for name, w in weights.items():
        if w.dim() == 1:
            state[name] = w
        elif config.weight_format == "bf16":
            state[name] = w.to(torch.bfloat16)
        else:
            data, scale = formats.quantize_fp8(w, config.fp8_block)
            state[name] = data
            state[name + "_scale"] = scale
    return state


def make_drafter(config=TINY, seed=0, **kw):
    drafter = Drafter(config, device="meta", **kw)
    drafter.load_state_dict(quantized_state(config, float_weights(config, seed)), assign=True)
    return drafter


@dataclasses.dataclass
class Step:
    hidden: torch.Tensor
    positions: torch.Tensor
    block_table: torch.Tensor
    slots: torch.Tensor
    seq_lens: torch.Tensor
    kv_caches: list
    context: list  # per layer, per request: (k, v) float32 [seq_len, Hkv, d], NaN at this step's rows


def make_step(config=TINY, seed=1, seq_lens=(5, 30, 12), real_rows=(3, 2, 3), block_size=4, cache_dtype=torch.bfloat16):
    """Requests whose context is already in paged caches, plus this step's rows.

    Request ``r`` ends at ``seq_lens[r]``; its last ``real_rows[r]`` positions are this
    step's real rows (written by the layer), the rest of its ``rows_per_request`` rows
    are padding (slot -1, position repeated). Physical blocks are shuffled.
    """
    gen = torch.Generator().manual_seed(seed)
    c = config
    rpr = c.rows_per_request
    counts = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(counts) + 3
    physical = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.full((len(seq_lens), max(counts) + 1), -1, dtype=torch.int32)
    for r, n in enumerate(counts):
        for b in range(n):
            table[r, b] = physical.pop()
    positions, slots = [], []
    for r, (s, real) in enumerate(zip(seq_lens, real_rows)):
        for i in range(rpr):
            p = s - real + i if i < real else s - 1
            positions.append(p)
            slots.append(int(table[r, p // block_size]) * block_size + p % block_size if i < real else -1)
    positions = torch.tensor(positions, dtype=torch.int64)
    slots = torch.tensor(slots, dtype=torch.int64)
    shape = (num_blocks, block_size, c.num_key_value_heads, c.head_dim)
    kv_caches, context = [], []
    for _ in range(c.num_layers):
        k_cache = torch.zeros(shape, dtype=cache_dtype)
        v_cache = torch.zeros(shape, dtype=cache_dtype)
        per_request = []
        for r, (s, real) in enumerate(zip(seq_lens, real_rows)):
            k = torch.randn(s, c.num_key_value_heads, c.head_dim, generator=gen).to(cache_dtype).float()
            v = torch.randn(s, c.num_key_value_heads, c.head_dim, generator=gen).to(cache_dtype).float()
            k[s - real :] = float("nan")  # written by this step, not context
            v[s - real :] = float("nan")
            for j in range(s - real):
                b = int(table[r, j // block_size])
                k_cache[b, j % block_size] = k[j]
                v_cache[b, j % block_size] = v[j]
            per_request.append((k, v))
        kv_caches.append((k_cache, v_cache))
        context.append(per_request)
    hidden = torch.randn(len(seq_lens) * rpr, c.hidden_size, generator=gen).to(torch.bfloat16)
    return Step(hidden, positions, table, slots, torch.tensor(seq_lens, dtype=torch.int32), kv_caches, context)


def clone_caches(caches):
    return [(k.clone(), v.clone()) for k, v in caches]


# --------------------------------------------------------------------------- #
# dense implementation of docs/contract.md §5
# --------------------------------------------------------------------------- #


def bf16(x):
    return x.to(torch.bfloat16).to(torch.float64)


def dense_norm(x, w, eps):
    return bf16(x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * (1 + w.double()))


def dense_rope(x, positions, rotary_dim, theta):
    half = rotary_dim // 2
    i = torch.arange(half, dtype=torch.float64)
    angle = positions.double()[:, None, None] * theta ** (-2 * i / rotary_dim)
    c, s = angle.cos(), angle.sin()
    out = x.clone()
    out[..., :half] = x[..., :half] * c - x[..., half:rotary_dim] * s
    out[..., half:rotary_dim] = x[..., half:rotary_dim] * c + x[..., :half] * s
    return bf16(out)


def dense_linear(module, x):
    if isinstance(module, FP8Linear):
        a = formats.qdq_fp8(x, module.act_peak).double() if module.act_quant else bf16(x)
        w = formats.dequantize_fp8(module.weight, module.weight_scale, module.block, torch.float64)
    else:
        a, w = bf16(x), module.weight.double()
    return bf16(a @ w.T)


def dense_layer(layer, hidden, positions, seq_lens, context):
    """float64 docs/contract.md §5 with the contract's bf16 rounding points; returns (h, k, v) of this step."""
    c = layer.config
    rows, hq, hkv, d = hidden.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim
    eps = c.rms_norm_eps
    h = hidden.double()
    x = dense_norm(h, layer.input_layernorm.weight, eps)
    qkv = dense_linear(layer.qkv_proj, x)
    q = qkv[:, : hq * d].reshape(rows, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].reshape(rows, hkv, d)
    v = qkv[:, (hq + hkv) * d :].reshape(rows, hkv, d)
    q = dense_rope(dense_norm(q, layer.q_norm.weight, eps), positions, c.rotary_dim, c.rope_theta)
    k = dense_rope(dense_norm(k, layer.k_norm.weight, eps), positions, c.rotary_dim, c.rope_theta)
    # The request's full sequence: context plus this step's rows at their positions.
    keys = [kv[0].double().clone() for kv in context]
    values = [kv[1].double().clone() for kv in context]
    rpr = c.rows_per_request
    for i in range(rows):
        r, p = i // rpr, int(positions[i])
        if torch.isnan(keys[r][p]).any():  # padded rows repeat a real row's position
            keys[r][p], values[r][p] = k[i], v[i]
    attn = torch.zeros(rows, hq, d, dtype=torch.float64)
    for i in range(rows):
        r, p = i // rpr, int(positions[i])
        hi = min(int(seq_lens[r]), p + 1) if c.causal else int(seq_lens[r])
        lo = max(0, p - c.sliding_window + 1)
        for head in range(hq):
            g = head // (hq // hkv)
            s = keys[r][lo:hi, g] @ q[i, head] * d**-0.5
            attn[i, head] = torch.softmax(s, 0) @ values[r][lo:hi, g]
    h = bf16(h + dense_linear(layer.o_proj, bf16(attn).reshape(rows, hq * d)))
    y = dense_norm(h, layer.post_attention_layernorm.weight, eps)
    g = dense_linear(layer.gate_proj, y).clamp(max=c.swiglu_limit)
    u = dense_linear(layer.up_proj, y).clamp(-c.swiglu_limit, c.swiglu_limit)
    a = bf16(g * torch.sigmoid(c.swiglu_alpha * g) * (u + 1))
    return bf16(h + dense_linear(layer.down_proj, a)), k, v


def sqnr_db(actual, expected):
    noise = (actual.double() - expected.double()).pow(2).sum()
    return float(10 * torch.log10(expected.double().pow(2).sum() / noise)) if noise > 0 else math.inf


@pytest.mark.parametrize("weight_format,causal", [("fp8", False), ("mxfp8", True), ("bf16", False)])
def test_layer_matches_dense(weight_format, causal):
    config = dataclasses.replace(TINY, weight_format=weight_format, causal=causal, num_layers=1)
    layer = make_drafter(config).layers[0]
    layer.validate = True
    step = make_step(config)
    k_cache, v_cache = step.kv_caches[0]
    out = layer(step.hidden, step.positions, k_cache, v_cache, step.block_table, step.slots, step.seq_lens)
    expected, k, v = dense_layer(layer, step.hidden, step.positions, step.seq_lens, step.context[0])
    assert out.dtype == torch.bfloat16 and out.shape == step.hidden.shape
    # Same rounding points, float32 instead of float64 sums: an intermediate now and then
    # lands on the other side of a bf16 rounding (one ulp, 2**-8 relative), and through a
    # qdq an e4m3 code flips (one step, <= 2**-3 of that element's block scale). Each flip
    # reaches the output through a linear whose weights are ~1/sqrt(K), so an output
    # element moves by a small fraction of its scale; we bound it by 2 bf16 ulps of the
    # largest output (2**-7 * max|h|) and ask for > 40 dB overall, which a wrong rotation,
    # mask, head mapping or split order misses by far (they give < 10 dB).
    err = (out.double() - expected).abs().max().item()
    assert err <= 2.0**-7 * expected.abs().max().item(), err
    assert sqnr_db(out, expected) > 40
    # The cache now holds this step's K and V at the real rows' slots; padded rows wrote nothing.
    written = step.slots >= 0
    block_size = k_cache.shape[1]
    at = (step.slots[written] // block_size, step.slots[written] % block_size)
    assert torch.allclose(k_cache[at].double(), k[written], rtol=2.0**-7, atol=0)
    assert torch.equal(v_cache[at].double(), v[written])


@settings(max_examples=12)
@given(
    weight_format=st.sampled_from(["fp8", "bf16"]),
    causal=st.booleans(),
    block_size=st.sampled_from([1, 4, 16]),
    requests=st.lists(st.tuples(st.integers(3, 40), st.integers(1, 3)), min_size=1, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_layer_matches_dense_property(weight_format, causal, block_size, requests, seed):
    # Random request mixes: seq_lens below and above the window (11), 1-3 real rows per
    # request (the rest padding), several block sizes, shuffled blocks. Bound as above.
    config = dataclasses.replace(TINY, weight_format=weight_format, causal=causal, num_layers=1)
    layer = make_drafter(config, seed=seed).layers[0]
    seq_lens, real_rows = zip(*requests)
    step = make_step(config, seed=seed, seq_lens=seq_lens, real_rows=real_rows, block_size=block_size)
    k_cache, v_cache = step.kv_caches[0]
    out = layer(step.hidden, step.positions, k_cache, v_cache, step.block_table, step.slots, step.seq_lens)
    expected, _, _ = dense_layer(layer, step.hidden, step.positions, step.seq_lens, step.context[0])
    assert (out.double() - expected).abs().max().item() <= 2.0**-7 * expected.abs().max().item()


def test_drafter_stacks_layers_and_final_norm():
    drafter = make_drafter()
    step = make_step()
    caches = clone_caches(step.kv_caches)
    out = drafter(step.hidden, step.positions, caches, step.block_table, step.slots, step.seq_lens)
    h = step.hidden
    for layer, (k_cache, v_cache) in zip(drafter.layers, clone_caches(step.kv_caches)):
        h = layer(h, step.positions, k_cache, v_cache, step.block_table, step.slots, step.seq_lens)
    assert torch.equal(out, drafter.norm(h))
    assert not torch.equal(out, drafter.norm(step.hidden))


@pytest.mark.slow
def test_compiled_drafter_equals_eager():
    drafter = make_drafter()
    step = make_step()
    eager_caches, compiled_caches = clone_caches(step.kv_caches), clone_caches(step.kv_caches)
    args = (step.positions,)
    eager = drafter(step.hidden, *args, eager_caches, step.block_table, step.slots, step.seq_lens)
    # validate is on: fullgraph=True also proves the eager-only checks stay out of the graph.
    # Inductor otherwise keeps fused bf16 intermediates in float32 (skipping the
    # roundings docs/contract.md §5 prescribes); with the casts emulated it matches eager bit for bit.
    with inductor_config.patch(emulate_precision_casts=True):
        compiled_fn = torch.compile(drafter, fullgraph=True)
        compiled = compiled_fn(step.hidden, *args, compiled_caches, step.block_table, step.slots, step.seq_lens)
    assert torch.equal(eager.view(torch.int16), compiled.view(torch.int16))
    for (ek, ev), (ck, cv) in zip(eager_caches, compiled_caches):
        assert torch.equal(ek.view(torch.int16), ck.view(torch.int16))
        assert torch.equal(ev.view(torch.int16), cv.view(torch.int16))


def test_fp8_weights_close_to_bf16_weights():
    # Same float weights, quantized to fp8 (32x32 blocks, fp8 activations) or rounded to
    # bf16. docs/contract.md §2-3: e4m3 keeps 3 mantissa bits under a power-of-two block scale, a
    # relative rounding error <= 2**-4 and ~2**-4/sqrt(3) RMS (~28 dB) for each of weight
    # and activation, so ~25 dB for one linear. The layer's output is h + o_proj(.) +
    # down(.); its residual updates (out - hidden) pass through up to three quantized
    # linears in series (qkv -> o_proj, gate/up -> down), whose noise powers add:
    # 25 - 10 log10(3) ~ 20 dB is the floor we require.
    weights = float_weights(TINY, seed=5)
    results = {}
    for fmt in ("fp8", "bf16"):
        config = dataclasses.replace(TINY, weight_format=fmt)
        drafter = Drafter(config, device="meta")
        drafter.load_state_dict(quantized_state(config, weights), assign=True)
        step = make_step(config, seed=6)
        layer = drafter.layers[0]
        k_cache, v_cache = step.kv_caches[0]
        out = layer(step.hidden, step.positions, k_cache, v_cache, step.block_table, step.slots, step.seq_lens)
        results[fmt] = out.double() - step.hidden.double()
    sqnr = sqnr_db(results["fp8"], results["bf16"])
    print(f"fp8 vs bf16 weights, layer residual update SQNR = {sqnr:.1f} dB")
    assert sqnr >= 20.0


# --------------------------------------------------------------------------- #
# checkpoints
# --------------------------------------------------------------------------- #


def run(drafter, step):
    caches = clone_caches(step.kv_caches)
    return drafter(step.hidden, step.positions, caches, step.block_table, step.slots, step.seq_lens)


@pytest.mark.parametrize("weight_format", ["fp8", "bf16"])
def test_from_checkpoint_file_round_trip(tmp_path, weight_format):
    config = dataclasses.replace(TINY, weight_format=weight_format)
    drafter = make_drafter(config)
    path = tmp_path / "drafter.safetensors"
    save_file({"model.mtp." + k: v.contiguous() for k, v in drafter.state_dict().items()}, str(path))
    loaded = Drafter.from_checkpoint(path, "model.mtp.", config=config)
    for key, value in drafter.state_dict().items():
        got = loaded.state_dict()[key]
        assert got.dtype == value.dtype and torch.equal(got.view(torch.uint8), value.view(torch.uint8)), key
    step = make_step(config)
    assert torch.equal(run(loaded, step), run(drafter, step))


@pytest.mark.parametrize("weight_format", ["fp8", "mxfp8", "bf16"])
def test_from_checkpoint_fuses_separate_qkv(weight_format):
    config = dataclasses.replace(TINY, weight_format=weight_format)
    drafter = make_drafter(config)
    state = dict(drafter.state_dict())
    hq_d = config.num_attention_heads * config.head_dim
    kv_d = config.num_key_value_heads * config.head_dim
    bn = 1 if config.fp8_block is None else config.fp8_block[0]
    for i in range(config.num_layers):
        base = f"layers.{i}."
        w = state.pop(base + "qkv_proj.weight")
        s = state.pop(base + "qkv_proj.weight_scale", None)
        for name, lo, hi in (("q", 0, hq_d), ("k", hq_d, hq_d + kv_d), ("v", hq_d + kv_d, hq_d + 2 * kv_d)):
            state[f"{base}{name}_proj.weight"] = w[lo:hi]
            if s is not None:
                # DeepSeek-V3.1-style name for the e8m0 scales: the loader's aliases apply.
                state[f"{base}{name}_proj.scale"] = s[lo // bn : hi // bn]
    loaded = Drafter.from_checkpoint(state, config=config)
    for key, value in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[key].view(torch.uint8), value.view(torch.uint8)), key


def test_from_checkpoint_errors():
    config = TINY
    state = dict(make_drafter(config).state_dict())
    # the checkpoint's own record (FP8Linear's _extra_state) contradicts the config
    message = r"qkv_proj.weight_scale: block=\[1, 32\] was passed but .*records block \[32, 32\] \(config.weight_format='mxfp8'\)"
    with pytest.raises(CheckpointError, match=message):
        Drafter.from_checkpoint(state, config=dataclasses.replace(config, weight_format="mxfp8"))
    with pytest.raises(CheckpointError, match="holds fp8 block .* weights, but config.weight_format='bf16'"):
        Drafter.from_checkpoint(state, config=dataclasses.replace(config, weight_format="bf16"))
    missing = {k: v for k, v in state.items() if k != "layers.1.k_norm.weight"}
    with pytest.raises(MissingTensorError, match="layers.1.k_norm.weight"):
        Drafter.from_checkpoint(missing, config=config)
    wrong = dict(state, **{"norm.weight": torch.zeros(3)})
    with pytest.raises(CheckpointError, match=r"norm.weight: expected shape \[64\], got \[3\]"):
        Drafter.from_checkpoint(wrong, config=config)
    message = r"layers.0.qkv_proj.weight: expected a \[128, 64\] layer for this config, got \[256, 64\]"
    with pytest.raises(CheckpointError, match=message):
        Drafter.from_checkpoint(state, config=dataclasses.replace(config, num_attention_heads=2, num_key_value_heads=1))


def test_from_checkpoint_fuses_straddling_qkv_blocks_exactly():
    # KV heads of 16 rows each under 32-row scale blocks: the fused weight uses 16-row blocks,
    # on which every scale is a copy of its part's (this was refused before). v's scales are
    # float32 (DeepSeek style) next to e8m0 ones: the fused scales are float32, also exactly.
    config = dataclasses.replace(TINY, head_dim=16, rotary_dim=8, num_attention_heads=4, num_key_value_heads=1)
    weights = float_weights(config)
    state = {k: v for k, v in quantized_state(config, weights).items() if "qkv" not in k}
    parts = {}
    for i in range(config.num_layers):
        w = weights[f"layers.{i}.qkv_proj.weight"]
        for name, rows in (("q", slice(0, 64)), ("k", slice(64, 80)), ("v", slice(80, 96))):
            data, scale = formats.quantize_fp8(w[rows], scale_dtype=torch.float32 if name == "v" else torch.float8_e8m0fnu)
            state[f"layers.{i}.{name}_proj.weight"] = data
            state[f"layers.{i}.{name}_proj.weight_scale"] = scale
            parts[i, name] = formats.dequantize_fp8(data, scale, (32, 32), torch.float32)
    drafter = Drafter.from_checkpoint(state, config=config)
    for i, layer in enumerate(drafter.layers):
        qkv = layer.qkv_proj
        assert qkv.block == (16, 32) and qkv.weight_scale.dtype == torch.float32
        fused = formats.dequantize_fp8(qkv.weight, qkv.weight_scale, qkv.block, torch.float32)
        expected = torch.cat([parts[i, n] for n in "qkv"])
        assert torch.equal(fused.view(torch.int32), expected.view(torch.int32))


def test_state_dict_names():
    layer = DrafterLayer(TINY, device="meta")
    keys = set(layer.state_dict())
    expected = {f"{n}.weight" for n in (*LINEARS, *NORMS)} | {f"{n}.{t}" for n in LINEARS for t in ("weight_scale", "_extra_state")}
    assert keys == expected
    assert set(DrafterLayer(dataclasses.replace(TINY, weight_format="bf16"), device="meta").state_dict()) == {
        f"{n}.weight" for n in (*LINEARS, *NORMS)
    }
    assert layer.qkv_proj.weight.shape == (TINY.qkv_size, TINY.hidden_size)
    assert layer.qkv_proj.block == (32, 32)
    assert DrafterLayer(dataclasses.replace(TINY, weight_format="mxfp8"), device="meta").up_proj.block == (1, 32)
    assert isinstance(DrafterLayer(dataclasses.replace(TINY, weight_format="bf16"), device="meta").down_proj, BF16Linear)


# --------------------------------------------------------------------------- #
# validation
# --------------------------------------------------------------------------- #


def _call(drafter, step, **changes):
    args = dict(
        hidden=step.hidden, positions=step.positions, kv_caches=step.kv_caches, block_table=step.block_table,
        slots=step.slots, seq_lens=step.seq_lens,
    )
    args.update(changes)
    return drafter(**args)


def spare_slot(step):
    """A slot inside the cache in a block no request maps (same offset as row 0's)."""
    num_blocks, block_size = step.kv_caches[0][0].shape[:2]
    spare = sorted(set(range(num_blocks)) - set(step.block_table.flatten().tolist()))[0]
    return spare * block_size + int(step.slots[0]) % block_size


def _set(t, index, value):
    t = t.clone()
    t[index] = value
    return t


@pytest.mark.parametrize(
    "changes,error,match",
    [
        (
            lambda s: dict(hidden=s.hidden[:8]),
            ValueError,
            "hidden: R = 8 rows is not a multiple of rows_per_request = 3",
        ),
        (lambda s: dict(hidden=s.hidden[:, :32]), ValueError, r"hidden: expected shape \[R, 64\]"),
        (
            lambda s: dict(positions=_set(s.positions, 3, 30)),
            ValueError,
            r"positions: row 3 \(request 1\) has position 30, outside \[0, seq_len = 30\)",
        ),
        (
            lambda s: dict(positions=s.positions.int()),
            TypeError,
            "positions: expected dtype torch.int64, got torch.int32",
        ),
        (
            lambda s: dict(block_table=s.block_table[:, :3]),
            ValueError,
            "block_table: request 1 has seq_len 30, which needs 8 blocks of 4, but the table has only 3 columns",
        ),
        (
            lambda s: dict(slots=_set(s.slots, 0, 10_000)),
            ValueError,
            "slots: row 0 writes slot 10000, outside the cache",
        ),
        (
            lambda s: dict(slots=_set(s.slots, 0, s.slots[1])),
            ValueError,
            r"slots: slot \d+ is written by more than one row",
        ),
        (
            lambda s: dict(slots=_set(s.slots, 0, spare_slot(s))),
            ValueError,
            r"slots: row 0 \(request 0, position 2\) writes slot \d+, but the block table places that position at slot",
        ),
        (lambda s: dict(seq_lens=s.seq_lens[:2]), ValueError, r"seq_lens: expected shape \[3\]"),
        (
            lambda s: dict(kv_caches=s.kv_caches[:1]),
            ValueError,
            r"kv_caches: expected one \(k_cache, v_cache\) pair per layer \(2\), got 1",
        ),
        (
            lambda s: dict(kv_caches=[s.kv_caches[0], (s.kv_caches[1][0], s.kv_caches[1][1].float())]),
            ValueError,
            r"kv_caches\[1\].v_cache: expected the shape and dtype of k_cache",
        ),
        (
            lambda s: dict(kv_caches=[(k[..., :16], v[..., :16]) for k, v in s.kv_caches]),
            ValueError,
            r"kv_caches\[0\].k_cache: expected shape \[num_blocks, block_size, 2, 32\]",
        ),
        (
            lambda s: dict(kv_caches=[(k[:5], v[:5]) for k, v in s.kv_caches]),
            ValueError,
            r"block_table: request .* maps to physical block .* outside the cache's \[0, 5\)",
        ),
    ],
)
def test_step_validation_errors(changes, error, match):
    drafter = make_drafter()
    step = make_step()
    with pytest.raises(error, match=match):
        _call(drafter, step, **changes(step))


def test_layer_validation_and_switch_off():
    drafter = make_drafter()
    step = make_step()
    layer = drafter.layers[0]
    k_cache, v_cache = step.kv_caches[0]
    bad_slots = _set(step.slots, 0, spare_slot(step))  # inside the cache but not where position 2 lives
    layer.validate = True
    with pytest.raises(ValueError, match="row 0 .* writes slot"):
        layer(step.hidden, step.positions, k_cache, v_cache, step.block_table, bad_slots, step.seq_lens)
    layer.validate = False
    layer(step.hidden, step.positions, k_cache, v_cache, step.block_table, bad_slots, step.seq_lens)
    drafter.validate = False
    _call(drafter, step, slots=bad_slots)


@pytest.mark.slow
def test_docs_example_runs(capsys):
    text = (Path(__file__).parent.parent / "docs" / "drafter.md").read_text()
    code = re.findall(r"```python\n(.*?)```", text, re.S)[0]
    exec(compile(code, "docs/drafter.md", "exec"), {"__name__": "docs_example"})
    assert "torch.Size([14, 256]) torch.bfloat16" in capsys.readouterr().out
