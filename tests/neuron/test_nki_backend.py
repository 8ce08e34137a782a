"""The Neuron capability check and the ``neuron`` registration.

Each case runs in a fresh interpreter (``-W error``) so that what torch_bq
imports, registers or warns at import time is observed from scratch.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[2]
SHIM_DIR = ROOT / "tests" / "nki_shim"


def _python(code: str, *paths, env_extra=None) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "NEURON_LOGICAL_NC_CONFIG")}
    env["PYTHONPATH"] = os.pathsep.join([*(str(p) for p in paths), str(ROOT)])
    env.update(env_extra or {})
    proc = subprocess.run(
        [sys.executable, "-W", "error", "-c", textwrap.dedent(code)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "", proc.stderr  # not even a warning
    return proc.stdout.strip()


def _package(root: pathlib.Path, name: str, body: str = "") -> None:
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text(textwrap.dedent(body))


def test_import_without_neuron_sdk_imports_nothing_and_registers_nothing():
    out = _python(
        """
        import sys, torch_bq
        from torch_bq.ops import _backend
        from torch_bq.ops.nki import register
        print(_backend.neuron_available(), register.registered,
              [m for m in sys.modules if m.split('.')[0] in ('nki', 'torch_neuronx')])
        """
    )
    assert out == "False False []"


def test_pypi_placeholders_are_not_the_sdk(tmp_path):
    # PyPI's nki / torch-neuronx are empty; a broken one may raise or warn on import.
    _package(tmp_path, "nki")
    _package(tmp_path, "torch_neuronx", "import warnings\nwarnings.warn('placeholder package')\n")
    out = _python(
        """
        import torch_bq
        from torch_bq.ops import _backend
        from torch_bq.ops.nki import register
        print(_backend.nki_available(), _backend.neuron_available(), register.registered)
        """,
        tmp_path,
    )
    assert out == "False False False"


def test_placeholder_that_raises_on_import_is_not_available(tmp_path):
    _package(tmp_path, "nki", "raise ImportError('this is a placeholder')\n")
    _package(tmp_path, "torch_neuronx")
    out = _python("import torch_bq\nfrom torch_bq.ops import _backend\nprint(_backend.neuron_available())", tmp_path)
    assert out == "False"


def test_the_stand_in_is_never_taken_for_the_sdk(tmp_path):
    _package(tmp_path, "torch_neuronx", "def nki_op(name, mutates_args):\n    raise AssertionError('called')\n")
    out = _python(
        "import torch_bq\nfrom torch_bq.ops import _backend\nprint(_backend.nki_available(), _backend.neuron_available())",
        SHIM_DIR, tmp_path,
    )
    assert out == "False False"


def test_lnc_follows_the_runtime_setting(monkeypatch):
    from torch_bq.ops import _backend

    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    assert _backend.neuron_lnc() == 2  # Trainium2's runtime default
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    assert _backend.neuron_lnc() == 1
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    assert _backend.neuron_lnc() == 2


def test_registration_glue_with_a_fake_torch_neuronx(tmp_path):
    """Drive register_neuron_kernels() end to end with stand-ins for the SDK pieces.

    ``torch_neuronx.nki_op`` is faked with ``torch.library.custom_op`` and the
    stand-in plays ``nki``; the ``neuron`` device is PrivateUse1 renamed. This
    checks the wiring (op names, argument order, options), not the SDK.
    """
    _package(
        tmp_path,
        "torch_neuronx",
        """
        import torch
        def nki_op(name, mutates_args):
            return lambda fn: torch.library.custom_op(name, mutates_args=())(fn)
        """,
    )
    out = _python(
        """
        import torch
        torch.utils.rename_privateuse1_backend("neuron")
        import torch_bq
        from torch_bq import formats
        from torch_bq.ops import _backend
        from torch_bq.ops.nki import launch as prep, register
        from torch_bq.reference import linear as ref
        _backend.neuron_available = lambda: True
        assert register.register_neuron_kernels()
        for op in ("fp8_linear", "fp4_linear", "bf16_linear", "fp32w_linear", "qdq_fp8"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(f"torch_bq::{op}", "PrivateUse1"), op
        torch.manual_seed(0)
        x, w, b = torch.randn(5, 64), torch.randn(40, 64) * 0.1, torch.randn(40)
        data, scale = formats.quantize_fp8(w)
        launch = prep.prepare_fp8_linear(x, data, scale, b, (32, 32), True, 224.0, torch.bfloat16)
        y = torch.ops.torch_bq_nki.fp8_linear(*launch.tensors, *launch.options.values())
        r = ref.fp8_linear(x, data, scale, b, (32, 32), True, 224.0, torch.bfloat16)
        print(y.dtype, tuple(y.shape), bool(((y.float() - r.float()).abs() <= 2**-6 * (1 + r.float().abs())).all()))
        q = torch.ops.torch_bq_nki.qdq_fp8(*prep.prepare_qdq_fp8(x, 224.0).tensors, 224.0)
        print(torch.equal(q.view(torch.int16), formats.qdq_fp8(x).view(torch.int16)))
        """,
        SHIM_DIR, tmp_path, env_extra={"NEURON_LOGICAL_NC_CONFIG": "2"},
    )
    assert out.splitlines() == ["torch.bfloat16 (5, 40) True", "True"]
