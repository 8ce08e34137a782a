"""The drafter's elementwise pieces (docs/contract.md §5 steps 1, 3, 7) against values worked out by hand.

The layer tests go through these with activations that never reach the SwiGLU
clamps (|gate|, |up| stay well below 7), so the clamps and the RoPE pass-through
are pinned down here.
"""

import math

import torch

from torch_bq.reference.transformer import apply_rope, clamped_swiglu, gemma_rms_norm, rope_cos_sin


def bf16(values):
    return torch.tensor(values, dtype=torch.float64).to(torch.bfloat16)


def test_clamped_swiglu_clamps_gate_above_only_and_up_both_ways():
    gate = torch.tensor([10.0, -10.0, 2.0, 2.0, 7.0])
    up = torch.tensor([0.0, 0.0, 10.0, -10.0, -3.0])

    def expected(g, u):
        return g / (1 + math.exp(-1.702 * g)) * (u + 1)

    # g = min(gate, 7): 10 -> 7, -10 stays -10; u = clamp(up, -7, 7): 10 -> 7, -10 -> -7.
    want = bf16([expected(7, 0), expected(-10, 0), expected(2, 7), expected(2, -7), expected(7, -3)])
    got = clamped_swiglu(gate, up, 1.702, 7.0)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (got, want)


def test_clamped_swiglu_in_place_path_equals_the_autograd_path_and_leaves_inputs_alone():
    # Without autograd the function works in place on its own float32 copies; with it,
    # out of place. Both must give the same bits, NaN/inf/saturated entries included,
    # and a float32 input (which .to(float32) does not copy) must not be written to.
    gen = torch.Generator().manual_seed(3)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 7.0, -200.0, 0.0, -0.0, 1e-40])
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        gate = torch.cat([specials, 30 * torch.randn(1000, generator=gen)]).to(dtype)
        up = torch.cat([specials.flip(0), 10 * torch.randn(1000, generator=gen)]).to(dtype)
        gate_before, up_before = gate.clone(), up.clone()
        fast = clamped_swiglu(gate, up, 1.702, 7.0)
        assert torch.equal(gate.view(torch.uint8), gate_before.view(torch.uint8))
        assert torch.equal(up.view(torch.uint8), up_before.view(torch.uint8))
        with torch.enable_grad():
            slow = clamped_swiglu(gate.float().requires_grad_(), up.float(), 1.702, 7.0)
        assert slow.requires_grad
        assert torch.equal(fast.view(torch.int16), slow.detach().view(torch.int16)), dtype


def test_gemma_rms_norm_uses_one_plus_w_and_eps():
    x = torch.tensor([[3.0, 4.0], [0.0, 0.0]])
    w = torch.tensor([0.0, 1.0], dtype=torch.bfloat16)
    eps = 0.5
    inv_rms = 1 / math.sqrt((9 + 16) / 2 + eps)
    want = bf16([[3 * inv_rms * 1, 4 * inv_rms * 2], [0.0, 0.0]])
    got = gemma_rms_norm(x, w, eps)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (got, want)


def test_rope_rotates_neox_halves_and_passes_the_rest_through():
    # head_dim 6, rotary_dim 4: pairs (0, 2) and (1, 3) rotate, dims 4 and 5 pass through.
    theta = 100.0
    positions = torch.tensor([0, 3])
    cos, sin = rope_cos_sin(positions, 4, theta)
    angles = [[p * theta ** (-2 * i / 4) for i in range(2)] for p in (0, 3)]
    torch.testing.assert_close(cos, torch.tensor(angles).cos(), rtol=2**-22, atol=2**-22)
    torch.testing.assert_close(sin, torch.tensor(angles).sin(), rtol=2**-22, atol=2**-22)

    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).expand(2, 1, 6)
    got = apply_rope(x, cos, sin)
    want = []
    for (a0, a1) in angles:
        c0, s0, c1, s1 = math.cos(a0), math.sin(a0), math.cos(a1), math.sin(a1)
        want.append([1 * c0 - 3 * s0, 2 * c1 - 4 * s1, 3 * c0 + 1 * s0, 4 * c1 + 2 * s1, 5.0, 6.0])
    want = bf16(want)[:, None, :]
    assert got.dtype == torch.bfloat16
    # Position 0 is the identity; position 3 within one bf16 rounding of the float64 rotation.
    assert torch.equal(got[0], bf16([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]]))
    torch.testing.assert_close(got.double(), want.double(), rtol=2**-8, atol=0)
    assert torch.equal(got[..., 4:], x[..., 4:].to(torch.bfloat16))
