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
