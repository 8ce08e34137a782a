"""Gemma-style RMSNorm module (the ``1 + w`` form) used by the drafter."""

import torch

from ..reference.transformer import gemma_rms_norm

__all__ = ["GemmaRMSNorm"]


class GemmaRMSNorm(torch.nn.Module):
    """``bf16(x * rsqrt(mean(x^2) + eps) * (1 + weight))`` over the last dim, in float32.

    ``weight`` stores Gemma's ``w`` (initialised to zeros, i.e. a unit scale), so a
    checkpoint's ``*.weight`` loads as is.

    Args:
        dim: normalised size ``D``.
        eps: added to the mean square.
        device, dtype: of ``weight`` (bfloat16 by default, as checkpoints store it).

    Shapes: ``[..., D]`` any float dtype -> ``[..., D]`` bfloat16.
    """

    def __init__(self, dim: int, eps: float = 1e-6, *, device=None, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(dim, device=device, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemma_rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, gemma (1 + w)"
