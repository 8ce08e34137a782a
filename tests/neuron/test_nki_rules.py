"""Each rule of ``tests/nki_shim/nki/rules.py``: a kernel that breaks it, and the stand-in refusing it.

These test the stand-in itself (they skip under ``--nki-backend=simulate``). Kernels are at module
level so that their helpers and module-scope names are resolved as for the project's kernels.
"""

from __future__ import annotations

import numpy as np
import pytest

try:  # the stand-in is importable once tests/neuron/conftest.py put it on the path
    import nki
    import nki.isa as nisa
    import nki.language as nl
except ImportError:  # pragma: no cover
    nki = None

pytestmark = pytest.mark.usefixtures("shim_only")

DTYPES = {"bf16": "bfloat16"}  # a module-level dict: kernels must not read it
TILE = 4  # a module-level int: fine


def _copy_through_sbuf(x):
    """A legal helper: allocate, DMA in, DMA out."""
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    nisa.dma_copy(dst=out, src=t)
    return out


def _helper_with_comprehension(x):
    sizes = [d for d in x.shape]
    return _copy_through_sbuf(x) if sizes else None


def _helper_taking_a_range(x, rows):
    for r in rows:
        pass
    return _copy_through_sbuf(x)


@nki.jit
def legal_kernel(x, flag=True):
    out = None
    if flag == True:  # noqa: E712  (what the migration guide prescribes instead of `is True`)
        out = _copy_through_sbuf(x)
    for i in range(TILE):
        pass
    d = {"a": 1}
    assert d["a"] == 1, "string-keyed dict"
    return out


@nki.jit
def uses_is(x, bias=None):
    if bias is None:
        return _copy_through_sbuf(x)
    return _copy_through_sbuf(x)


@nki.jit
def kw_only(x, *, flag=True):
    return _copy_through_sbuf(x)


@nki.jit
def list_comprehension(x):
    shapes = [s for s in x.shape]
    return _copy_through_sbuf(x) if shapes else None


@nki.jit
def lambda_kernel(x):
    f = lambda t: t  # noqa: E731
    return _copy_through_sbuf(f(x))


@nki.jit
def range_as_argument(x):
    return _helper_taking_a_range(x, range(2))


@nki.jit
def non_string_key(x):
    d = {1: "one"}
    return _copy_through_sbuf(x) if d else None


@nki.jit
def module_level_dict(x):
    name = DTYPES["bf16"]
    return _copy_through_sbuf(x) if name else None


@nki.jit
def uses_try(x):
    try:
        return _copy_through_sbuf(x)
    except ValueError:
        return None


@nki.jit
def uses_raise(x):
    if x.shape[0] > 128:
        raise ValueError("too tall")
    return _copy_through_sbuf(x)


@nki.jit
def uses_fstring(x):
    assert x.shape[0] <= 128, f"{x.shape[0]} rows"
    return _copy_through_sbuf(x)


@nki.jit
def calls_a_bad_helper(x):
    return _helper_with_comprehension(x)


@nki.jit
def calls_a_kernel(x):
    return legal_kernel(x)


X = np.arange(8, dtype=np.float32).reshape(2, 4)


def test_a_legal_kernel_passes():
    assert np.array_equal(nki.simulate(legal_kernel)(X), X)


@pytest.mark.parametrize("kernel,rule", [
    (uses_is, "py-is"),
    (kw_only, "py-kwonly"),
    (list_comprehension, "py-comprehension"),
    (lambda_kernel, "py-comprehension"),
    (range_as_argument, "py-range-value"),
    (non_string_key, "py-dict-key"),
    (module_level_dict, "py-global-state"),
    (uses_try, "py-construct"),
    (uses_raise, "py-construct"),
    (uses_fstring, "py-construct"),
    (calls_a_bad_helper, "py-comprehension"),  # found in the helper, not the kernel
    (calls_a_kernel, "py-decorated-helper"),
])
def test_the_compiler_subset_is_enforced(kernel, rule):
    with pytest.raises(nki.NkiShimError, match=rf"^\[{rule}\]"):
        nki.simulate(kernel)(X)


def test_a_helper_violation_names_the_helper():
    with pytest.raises(nki.NkiShimError, match=r"_helper_with_comprehension"):
        nki.simulate(calls_a_bad_helper)(X)


def test_list_argument_refused_tuple_accepted():
    with pytest.raises(nki.NkiShimError, match=r"^\[py-list-arg\]"):
        nki.simulate(legal_kernel)(X, [True])
    assert np.array_equal(nki.simulate(legal_kernel)(X, True), X)


def test_every_rule_has_a_source():
    from nki.rules import RULES

    assert RULES and all(rule.what and rule.source for rule in RULES.values())
    with pytest.raises(KeyError):
        nki.rules.tag("no-such-rule")
