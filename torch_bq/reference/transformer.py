"""The elementwise pieces of the drafter layer (docs/contract.md §5): Gemma RMSNorm, partial NeoX
RoPE and the clamped SwiGLU, as plain torch functions.

Each computes in float32 and rounds once to bfloat16 at the end, which is where
the layer keeps its activations.
"""

import torch

__all__ = ["gemma_rms_norm", "rope_cos_sin", "apply_rope", "clamped_swiglu"]


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma RMSNorm over the last dim: ``bf16(x * rsqrt(mean(x^2) + eps) * (1 + w))`` in float32.

    Args:
        x: ``[..., D]`` any float dtype.
        weight: ``[D]``, the stored ``w`` of the ``1 + w`` form (zeros = identity scale).
        eps: added to the mean square.

    Returns:
        ``[..., D]`` bfloat16.
    """
    x32 = x.to(torch.float32)
    inv_rms = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (x32 * inv_rms * (1.0 + weight.to(torch.float32))).to(torch.bfloat16)


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary angles for NeoX-style RoPE: ``cos``/``sin`` of ``p * theta**(-2i / rotary_dim)``.

    Computed in float32 the way Hugging Face transformers does (inverse frequencies from
    an integer ``arange``, angle as a float32 product), so the drafter sees the same
    rotations its checkpoint was trained with.

    Args:
        positions: int64 ``[R]``.
        rotary_dim: even number of rotated dims.
        theta: RoPE base.

    Returns:
        ``(cos, sin)``, float32 ``[R, rotary_dim // 2]``.
    """
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=positions.device).to(torch.float32)
    inv_freq = 1.0 / (theta ** (exponents / rotary_dim))
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``rotary_dim = 2 * cos.shape[-1]`` dims of each head (NeoX halves).

    For ``i < r/2``: ``o[i] = x[i] c_i - x[i + r/2] s_i``, ``o[i + r/2] = x[i + r/2] c_i + x[i] s_i``;
    dims past ``rotary_dim`` pass through unchanged.

    Args:
        x: ``[R, heads, head_dim]`` any float dtype.
        cos, sin: float32 ``[R, rotary_dim // 2]`` from :func:`rope_cos_sin`.

    Returns:
        ``[R, heads, head_dim]`` bfloat16.
    """
    half = cos.shape[-1]
    x32 = x.to(torch.float32)
    lo, hi, rest = x32[..., :half], x32[..., half : 2 * half], x32[..., 2 * half :]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((lo * c - hi * s, hi * c + lo * s, rest), dim=-1).to(torch.bfloat16)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """``bf16(g * sigmoid(alpha * g) * (u + 1))`` with ``g = min(gate, limit)``, ``u = clamp(up, -limit, limit)``.

    The gpt-oss style gated activation of docs/contract.md §5 step 7 (alpha 1.702, limit 7),
    computed in float32.

    Args:
        gate, up: ``[..., I]`` any float dtype.

    Returns:
        ``[..., I]`` bfloat16.
    """
    g = gate.to(torch.float32).clamp(max=limit)
    u = up.to(torch.float32).clamp(-limit, limit)
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return (g * torch.sigmoid(alpha * g) * (u + 1.0)).to(torch.bfloat16)
    # The same float32 operations in the same order, in place on the fresh g and u:
    # each [rows, I] float32 temporary above glibc's mmap threshold is a fresh mapping
    # whose pages fault in on first touch, which costs more than the arithmetic
    # (docs/benchmarks.md, "All branches merged, on a quiet machine (stop 18 ...)").
    s = torch.sigmoid_(alpha * g)
    return g.mul_(s).mul_(u.add_(1.0)).to(torch.bfloat16)
