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


# --------------------------------------------------------------------------- #
# hardware and ISA rules
# --------------------------------------------------------------------------- #


@nki.jit
def int32_times_scalar(x, factor=1.5):
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=factor)
    nisa.dma_copy(dst=out, src=t)
    return out


@nki.jit
def int32_plus_tile(x, y):
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    a = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
    b = nl.ndarray(y.shape, dtype=y.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=a, src=x)
    nisa.dma_copy(dst=b, src=y)
    nisa.tensor_tensor(dst=a, data1=a, data2=b, op=nl.add)
    nisa.dma_copy(dst=out, src=a)
    return out


def test_tensor_scalar_is_fp32_math_even_on_int32():
    x = np.array([[3, 16777217]], dtype=np.int32)
    # 3 x 1.5 = 4.5 in fp32, rounded to even (4) on the int32 write; 2**24 + 1 is not an fp32
    # (exact integer math would give 4 or 5, and 25165825 or 25165826).
    assert nki.simulate(int32_times_scalar)(x).tolist() == [[4, 25165824]]
    assert nki.simulate(int32_times_scalar)(x, 1.0).tolist() == [[3, 16777216]]
    # tensor_tensor on all-int32 tiles is GpSimd's exact integer math.
    y = np.array([[1, 1]], dtype=np.int32)
    assert nki.simulate(int32_plus_tile)(x, y).tolist() == [[4, 16777218]]


@nki.jit
def dma_cast(x):
    out = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.shared_hbm)
    t = nl.ndarray(x.shape, dtype=nl.bfloat16, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)  # fp32 -> bf16 by DMA
    nisa.tensor_copy(dst=t, src=t)
    return out


def test_dma_does_not_cast():
    with pytest.raises(nki.NkiShimError, match=r"^\[isa-dma-no-cast\] dma_copy"):
        nki.simulate(dma_cast)(X)


@nki.jit
def engine_access(x, start=0, rows=8):
    out = nl.ndarray((rows, 4), dtype=nl.float32, buffer=nl.shared_hbm)
    t = nl.ndarray((128, 4), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t[start:start + rows], src=x[0:rows])  # DMA may start anywhere
    u = nl.ndarray((128, 4), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=u[start:start + rows], src=t[start:start + rows])  # an engine may not
    nisa.dma_copy(dst=out, src=u[start:start + rows])
    return out


@pytest.mark.parametrize("start,rows,ok", [
    (8, 8, False),  # what the public reference kernel hit on hardware
    (0, 8, True), (32, 8, True), (96, 32, True), (40, 8, False),
    (64, 64, True), (32, 64, False), (0, 65, True), (64, 65 - 1, True), (1, 100, False),
])
def test_engine_access_start_partition(start, rows, ok):
    x = np.arange(128 * 4, dtype=np.float32).reshape(128, 4)
    if ok:
        assert np.array_equal(nki.simulate(engine_access)(x, start, rows), x[:rows])
    else:
        with pytest.raises(nki.NkiShimError, match=rf"^\[hw-start-partition\] tensor_copy: invalid access of "
                                                   rf"{rows} partitions starting at partition {start}"):
            nki.simulate(engine_access)(x, start, rows)


@nki.jit
def big_tile(x, kib=200):
    t = nl.ndarray((128, kib * 256), dtype=nl.float32, buffer=nl.sbuf, name="big")
    nisa.dma_copy(dst=t[:, 0:4], src=x[0:128])
    return _copy_through_sbuf(x)


@pytest.mark.parametrize("target,limit_kib", [("trn1", 192), ("gen2", 192), ("trn2", 224), ("", 224), ("trn3", 256)])
def test_sbuf_budget_is_per_target(monkeypatch, target, limit_kib):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", target)
    x = np.zeros((128, 4), np.float32)
    nki.simulate(big_tile)(x, limit_kib - 1)  # plus the 16 B helper tile: fits
    with pytest.raises(nki.NkiShimError, match=rf"^\[hw-sbuf\].*limit {limit_kib * 1024} B/partition"):
        nki.simulate(big_tile)(x, limit_kib)
    assert nl.tile_size.sbuf_fmax_bytes == limit_kib * 1024


@nki.jit
def many_copies(x, n=10):
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    for i in range(n):
        nisa.tensor_copy(dst=t, src=t)
    nisa.dma_copy(dst=out, src=t)
    return out


def test_instruction_budget(monkeypatch):
    monkeypatch.setitem(nki._core.instruction_budgets, "many_copies", 12)
    nki.simulate(many_copies)(X, 10)  # 1 + 10 + 1 instructions
    assert nki.last_launch.instructions == 12
    assert nki.last_launch.instructions_by_op == {"dma_copy": 2, "tensor_copy": 10}
    with pytest.raises(nki.NkiShimError, match=r"^\[isa-instruction-budget\] many_copies: program 0 issues more "
                                               r"than 12"):
        nki.simulate(many_copies)(X, 11)


@nki.jit
def bf16_round_trip(x):
    out = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.shared_hbm)
    t = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    b = nl.ndarray(x.shape, dtype=nl.bfloat16, buffer=nl.sbuf)
    nisa.tensor_copy(dst=b, src=t)
    nisa.tensor_copy(dst=t, src=b)
    nisa.dma_copy(dst=out, src=t)
    return out


def test_denormal_flush_mode(monkeypatch):
    x = np.array([[2.0**-130, -(2.0**-127), 2.0**-126, 1.0]], np.float32)
    assert nki.simulate(bf16_round_trip)(x).tolist() == x.tolist()  # default: denormals kept
    monkeypatch.setattr(nki._core, "FLUSH_DENORMALS", True)
    flushed = nki.simulate(bf16_round_trip)(x)
    assert flushed.tolist() == [[0.0, -0.0, 2.0**-126, 1.0]] and np.signbit(flushed[0, 1])
