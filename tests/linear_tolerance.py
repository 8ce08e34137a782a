"""The GEMM tolerance our module and loader tests use (fp64 reference, bound derived from K).

The ops form every product of two bf16-exact values exactly in float32 and add
K of them (plus the bias) in float32, then round once to ``out_dtype``. With
``u32 = 2**-24`` and ``mag = |A| @ |W|.T + |bias|``, the float32 sum of K + 1
terms is off by at most ``(K + 1) * u32 * mag`` (the gamma_n bound, n*u << 1),
and the final rounding adds ``u_out * (|ref| + that)`` (``u_out`` = 2**-8 for
bf16, 2**-11 for fp16, 2**-24 for fp32). A tiny absolute term covers results
that round into the subnormal range.
"""

import torch

_UNIT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24, torch.float64: 2.0**-24}


def assert_linear_close(y, a, w, bias=None):
    """Assert ``y`` equals ``a @ w.T + bias`` (computed in float64) within the derived bound.

    Args:
        y: ``[..., N]`` the result under test (its dtype picks ``u_out``; float64
            outputs were computed in float32 and widened).
        a: ``[..., K]`` the activation the op multiplies (already qdq'd / rounded).
        w: ``[N, K]`` the decoded weight.
        bias: ``[N]`` or ``None``.
    """
    a64, w64 = a.double(), w.double()
    ref = a64 @ w64.T
    mag = a64.abs() @ w64.abs().T
    if bias is not None:
        ref = ref + bias.double()
        mag = mag + bias.double().abs()
    k = a.shape[-1]
    acc = (k + 1) * 2.0**-24 * mag
    bound = acc + _UNIT[y.dtype] * (ref.abs() + acc) + 2.0**-126
    err = (y.double() - ref).abs()
    excess = err - bound
    if bool((excess > 0).any()):
        i = int(excess.flatten().argmax())
        raise AssertionError(
            f"linear result off by {err.flatten()[i].item():.3e} at flat index {i} "
            f"(bound {bound.flatten()[i].item():.3e}, value {y.double().flatten()[i].item():.6e}, "
            f"reference {ref.flatten()[i].item():.6e})"
        )
