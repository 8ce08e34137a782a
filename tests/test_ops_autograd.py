"""The input-gradient ops behind the linear ops' backward: opcheck and exact cases."""

import pytest
import torch

from torch_bq import formats


def _fp8(n, k, block=(32, 32), scale_dtype=torch.uint8):
    # uint8 bytes: opcheck's schema test does arithmetic on inputs that float8 dtypes lack on CPU
    data, scale = formats.quantize_fp8(torch.randn(n, k), block, scale_dtype)
    return data.view(torch.uint8), scale


def _fp4(n, k):
    packed, scale = formats.quantize_fp4(torch.randn(n, k))
    return packed, scale.view(torch.uint8)


SAMPLES = [
    ("fp8_linear_grad_input", lambda: (torch.randn(3, 40), *_fp8(40, 70), [32, 32], torch.float32)),
    ("fp8_linear_grad_input", lambda: (torch.randn(2, 0, 40), *_fp8(40, 70), [32, 32], torch.bfloat16)),
    ("fp8_linear_grad_input",
     lambda: (torch.randn(2, 2, 130), *_fp8(130, 33, (128, 128), torch.float32), [128, 128], torch.float64)),
    ("fp4_linear_grad_input", lambda: (torch.randn(3, 24), *_fp4(24, 33), 33,
                                       torch.float32)),
    ("dense_linear_grad_input", lambda: (torch.randn(4, 16), torch.randn(16, 31).bfloat16(), torch.float16)),
    ("dense_linear_grad_input", lambda: (torch.randn(4, 16), torch.randn(16, 31), torch.float32)),
]


@pytest.mark.parametrize("name, make", SAMPLES)
def test_opcheck(name, make):
    torch.library.opcheck(getattr(torch.ops.torch_bq, name).default, make())


def test_grad_input_matches_fp64_matmul():
    torch.manual_seed(0)
    data, scale = _fp8(40, 70)
    g = torch.randn(5, 40, dtype=torch.float64)
    out = torch.ops.torch_bq.fp8_linear_grad_input(g, data, scale, [32, 32], torch.float64)
    w = formats.dequantize_fp8(data, scale, (32, 32), torch.float64)
    # float64 accumulation when the gradient is float64: only fp64 rounding of 40 terms
    torch.testing.assert_close(out, g @ w, rtol=1e-13, atol=1e-13)
