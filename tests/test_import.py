"""``import torch_bq`` alone gives the subpackages the README uses; ``distributed`` loads lazily."""

import subprocess
import sys

_CHECK = """
import sys
import torch_bq
assert "torch_bq.nn" in sys.modules, "import torch_bq did not import torch_bq.nn"
assert "torch_bq.distributed" not in sys.modules, "torch_bq.distributed was imported eagerly"
layer = torch_bq.nn.FP8Linear.from_linear(__import__("torch").nn.Linear(64, 32))
assert "distributed" in dir(torch_bq)
assert torch_bq.distributed.column_parallel is sys.modules["torch_bq.distributed"].column_parallel
try:
    torch_bq.no_such_thing
except AttributeError as e:
    assert "no_such_thing" in str(e)
else:
    raise AssertionError("torch_bq.no_such_thing did not raise AttributeError")
"""


def test_import_torch_bq_makes_nn_available_and_distributed_lazy():
    # A fresh interpreter: this test session has imported everything already.
    result = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
