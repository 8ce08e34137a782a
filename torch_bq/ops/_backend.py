"""Capability checks: the one place torch_bq looks at its environment.

Nothing else in the package sniffs for SDKs, compilers or devices; backend
modules ask here and register their kernels only when the answer is yes.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import warnings

__all__ = ["nki_available", "neuron_available", "neuron_lnc"]


# --------------------------------------------------------------------------- #
# Neuron (Trainium2): the real NKI and torch_neuronx
# --------------------------------------------------------------------------- #


def _spec_exists(name: str) -> bool:
    """A regular module or package ``name`` is on the path (a bare directory of that name is not)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    return spec is not None and spec.origin is not None


def _import_quietly(name: str):
    """Import ``name`` or return ``None``; never raises, never lets a warning out."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return importlib.import_module(name)
    except Exception:  # a broken or placeholder install is "not available", whatever it raises
        return None


@functools.lru_cache(maxsize=None)
def nki_available() -> bool:
    """True when the real ``nki`` package (AWS Neuron SDK) is importable.

    PyPI's ``nki`` is an empty placeholder and torch_bq's own test stand-in
    (``tests/nki_shim``) marks itself; neither counts. When no ``nki`` is on the
    path this costs one ``find_spec`` and imports nothing.
    """
    if not _spec_exists("nki"):
        return False
    nki = _import_quietly("nki")
    if nki is None or getattr(nki, "__torch_bq_stand_in__", False):
        return False
    isa = _import_quietly("nki.isa")
    language = _import_quietly("nki.language")
    return (
        callable(getattr(nki, "jit", None))
        and callable(getattr(isa, "nc_matmul", None))
        and callable(getattr(isa, "dma_transpose", None))
        and callable(getattr(language, "ndarray", None))
    )


@functools.lru_cache(maxsize=None)
def neuron_available() -> bool:
    """True when torch_bq can register NKI kernels for the ``neuron`` device.

    Needs the real ``nki`` and ``torch_neuronx`` with its ``nki_op`` custom-op
    wrapper. On a machine without them (``find_spec`` finds neither) nothing is
    imported; an empty placeholder package is imported, found wanting, and ignored.
    """
    if not (_spec_exists("torch_neuronx") and _spec_exists("nki")):
        return False
    if not nki_available():
        return False
    torch_neuronx = _import_quietly("torch_neuronx")
    return torch_neuronx is not None and callable(getattr(torch_neuronx, "nki_op", None))


def neuron_lnc() -> int:
    """The Logical NeuronCore degree the Neuron runtime was started with (1 or 2).

    A kernel must be launched with the LNC the runtime uses
    (``NEURON_LOGICAL_NC_CONFIG``); this reads it rather than choosing one.
    Unset means the Trainium2 runtime default, LNC=2.
    """
    value = os.environ.get("NEURON_LOGICAL_NC_CONFIG", "2").strip()
    return 1 if value == "1" else 2
