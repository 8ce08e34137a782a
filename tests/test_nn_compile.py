"""A small model of torch_bq modules under torch.compile(fullgraph=True, dynamic=True)."""

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounter

from torch_bq.nn import BF16Linear, FP4Linear, FP8Linear


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = FP8Linear.from_linear(nn.Linear(64, 96, bias=True))
        self.gate = FP8Linear.from_linear(nn.Linear(64, 96), block=(128, 128), scale_dtype=torch.float32)
        self.down = FP4Linear.from_linear(nn.Linear(96, 64, bias=False))
        self.head = BF16Linear.from_linear(nn.Linear(64, 10))

    def forward(self, x):
        h = torch.nn.functional.silu(self.gate(x)) * self.up(x)
        return self.head(x + self.down(h))


@pytest.mark.slow
@pytest.mark.parametrize("unbacked", [False, True], ids=["dynamic", "mark_unbacked"])
def test_compiled_model_matches_eager_without_recompiles(unbacked):
    # dynamic=True still specialises sizes 0 and 1 (a dynamo rule, not ours), so the
    # plain run covers M >= 2; marking the batch dim unbacked covers M = 0 and 1 too.
    torch._dynamo.reset()
    model = Block()
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    for batch in (3, 5, 17, 1, 0) if unbacked else (3, 5, 17, 2):
        x = torch.randn(batch, 64, dtype=torch.bfloat16)
        if unbacked:
            torch._dynamo.decorators.mark_unbacked(x, 0)
        # eager and compiled run the same ops on the same inputs: bit-identical
        assert torch.equal(compiled(x), model(x))
    # fullgraph=True raises on any graph break; one frame, compiled once across batch sizes
    assert counter.frame_count == 1
    assert counter.op_count > 0


@pytest.mark.slow
def test_inductor_compile_matches_eager_and_backward_traces():
    torch._dynamo.reset()
    model = Block()
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    for batch in (2, 7):
        x = torch.randn(batch, 3, 64, requires_grad=True)
        y = compiled(x)
        x_eager = x.detach().clone().requires_grad_()
        y_eager = model(x_eager)
        assert torch.equal(y, y_eager)
        g = torch.randn_like(y)
        y.backward(g)
        y_eager.backward(g)
        # the backward graph runs the same slabbed math; only fusion of the float32 adds may differ
        torch.testing.assert_close(x.grad, x_eager.grad, rtol=2**-20, atol=1e-6)
