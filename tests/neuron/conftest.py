"""Pick the NKI the kernel tests run on: the real SDK's ``nki.simulate`` or the NumPy stand-in.

``--nki-backend`` (declared in tests/conftest.py):

* ``auto`` (default): the real ``nki`` if the Neuron SDK is importable, else the stand-in;
* ``shim``: the stand-in in ``tests/nki_shim`` (refused if the real SDK is installed,
  since the stand-in must never shadow it);
* ``simulate``: the real ``nki.simulate``; kernel tests skip when the SDK is absent.

The stand-in is put on ``sys.path`` only here, so tests outside ``tests/neuron`` never see it.
"""

from __future__ import annotations

import pathlib
import sys

import pytest

from torch_bq.ops import _backend

SHIM_DIR = pathlib.Path(__file__).resolve().parents[1] / "nki_shim"

_state = {"backend": None, "skip": None}


def _install_shim() -> None:
    if str(SHIM_DIR) not in sys.path:
        sys.path.insert(0, str(SHIM_DIR))
    # A placeholder ``nki`` imported earlier (PyPI's is empty) must not win.
    for name in [m for m in sys.modules if m == "nki" or m.startswith("nki.")]:
        del sys.modules[name]
    import nki

    if not getattr(nki, "__torch_bq_stand_in__", False):
        raise pytest.UsageError(f"expected the NKI stand-in from {SHIM_DIR}, imported {nki.__file__}")
    from torch_bq.ops.nki import launch as prep

    # Every kernel is held to torch_bq's instruction budget (one constant, in launch.py).
    nki._core.DEFAULT_INSTRUCTION_BUDGET = prep.INSTRUCTION_BUDGET


def pytest_configure(config):
    choice = config.getoption("--nki-backend", default="auto")
    real = _backend.nki_available()  # checked before the stand-in can be on the path
    if choice == "simulate" or (choice == "auto" and real):
        _state["backend"] = "simulate"
        if not real:
            _state["skip"] = "--nki-backend=simulate needs the AWS Neuron SDK (real `nki`), which is not importable"
    else:
        if real:
            raise pytest.UsageError("--nki-backend=shim: the real Neuron SDK is installed; the stand-in never shadows it")
        _state["backend"] = "shim"
        _install_shim()


@pytest.fixture(scope="session")
def nki_backend() -> str:
    """``"shim"`` or ``"simulate"``; skips the test when the chosen backend is unavailable."""
    if _state["skip"]:
        pytest.skip(_state["skip"])
    return _state["backend"]


@pytest.fixture(scope="session")
def shim_only(nki_backend):
    """For tests of the stand-in itself (its limits and bookkeeping)."""
    if nki_backend != "shim":
        pytest.skip("tests the NumPy stand-in, not the real SDK")
    import nki

    return nki


@pytest.fixture(scope="session")
def kernels(nki_backend):
    """The kernel modules, imported through whichever ``nki`` was chosen."""
    from types import SimpleNamespace

    from torch_bq.ops.nki import linear, qdq

    return SimpleNamespace(linear=linear, qdq=qdq)
