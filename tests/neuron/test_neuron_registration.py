"""The public ``torch_bq::`` ops on the ``neuron`` device, eager and under ``torch.compile``.

Each case runs in a fresh interpreter with the NKI stand-in as ``nki`` and the TorchNeuron
stand-in (``tests/nki_shim/neuronx/torch_neuronx``) as ``torch_neuronx``: it renames PrivateUse1
to ``neuron``, provides ``nki_op`` / ``wrap_nki`` with TorchNeuron's contract (the op body is also
its fake kernel), neuron tensors, and a ``"neuron"`` compile backend that refuses any graph node
other than ATen ops and NKI kernel calls. ``neuron_available()`` refuses both stand-ins, so the
cases force the registration (``_backend.neuron_available = lambda: True``). Nothing here has run
on Trainium hardware or with the real TorchNeuron.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SHIM_DIR = ROOT / "tests" / "nki_shim"
NEURONX_DIR = SHIM_DIR / "neuronx"

BOOT = """
import json, warnings
import torch
import torch_bq
import torch_neuronx
from torch_bq import formats
from torch_bq.ops import _backend
from torch_bq.ops.nki import register
from torch_bq.reference import linear as ref
from torch_neuronx import kernel_calls, to_cpu, to_neuron
import nki
from torch_bq.ops.nki import launch as prep


def set_budget(n):  # torch_bq's instruction budget, which the stand-in then enforces on every launch
    prep.INSTRUCTION_BUDGET = nki._core.DEFAULT_INSTRUCTION_BUDGET = n


set_budget(prep.INSTRUCTION_BUDGET)
_backend.neuron_available = lambda: True
assert register.register_neuron_kernels()
g = torch.Generator().manual_seed(0)

def bits(t):
    return to_cpu(t).contiguous().view(torch.uint8)
"""


def _run(code: str, *paths, env_extra=None, boot=True) -> dict:
    """Run ``code`` (after BOOT) in a fresh interpreter; it prints one JSON line, returned as a dict."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "NEURON_LOGICAL_NC_CONFIG")}
    env["PYTHONPATH"] = os.pathsep.join([*(str(p) for p in paths), str(ROOT)])
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(env_extra or {})
    src = (textwrap.dedent(BOOT) if boot else "") + textwrap.dedent(code)
    proc = subprocess.run([sys.executable, "-c", src], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _on_stand_in(code: str, env_extra=None) -> dict:
    return _run(code, SHIM_DIR, NEURONX_DIR, env_extra=env_extra)


# --------------------------------------------------------------------------- #
# eager: the public op on neuron tensors
# --------------------------------------------------------------------------- #


def test_fp4_and_fp8_scale_codes_outside_the_exact_range_run_the_reference_through_the_public_op():
    """Legal weights the kernels cannot decode exactly (codes 253 for fp4, 250 for fp8) get the reference.

    Before the fix, fp4 passed ``reference=None`` here and raised ``TypeError: 'NoneType' object is not
    callable``; the glue test called the internal ops and never reached this path.
    """
    out = _on_stand_in(
        """
        x, w = torch.randn(3, 64, generator=g), torch.randn(40, 64, generator=g) * 0.1
        res = {}
        d4, s4 = formats.quantize_fp4(w)
        codes = s4.view(torch.uint8).clone()
        codes[3, 1] = 253  # scale 2**126: legal e8m0, outside 1..252
        s4o = codes.view(s4.dtype)
        y = torch_bq.ops.fp4_linear(to_neuron(x), to_neuron(d4), to_neuron(s4o))
        r = ref.fp4_linear(x, d4, s4o, None, True, 224.0, torch.bfloat16)
        res["fp4_fallback_exact"] = torch.equal(bits(y), r.contiguous().view(torch.uint8))
        res["fp4_fallback_device"] = y.device.type
        res["calls_after_fallbacks"] = dict(kernel_calls)
        d8, s8 = formats.quantize_fp8(w)
        c8 = s8.view(torch.uint8).clone()
        c8[0, 0] = 250  # outside 3..246
        s8o = c8.view(s8.dtype)
        y8 = torch_bq.ops.fp8_linear(to_neuron(x), to_neuron(d8), to_neuron(s8o))
        r8 = ref.fp8_linear(x, d8, s8o, None, (32, 32), True, 224.0, torch.bfloat16)
        res["fp8_fallback_exact"] = torch.equal(bits(y8), r8.contiguous().view(torch.uint8))
        res["calls_after_fallbacks"] = dict(kernel_calls)
        torch_bq.ops.fp4_linear(to_neuron(x), to_neuron(d4), to_neuron(s4))  # in range: the kernel
        res["calls_in_range"] = dict(kernel_calls)
        print(json.dumps(res))
        """
    )
    assert out["fp4_fallback_exact"] and out["fp8_fallback_exact"]
    assert out["fp4_fallback_device"] == "neuron"
    assert out["calls_after_fallbacks"] == {}
    assert out["calls_in_range"] == {"fp4_linear_kernel": 1}


def test_every_public_op_on_neuron_calls_its_kernel_and_matches_the_reference():
    out = _on_stand_in(
        """
        from torch_bq.testing import assert_linear_close
        x = torch.randn(2, 3, 64, generator=g)
        w, b = torch.randn(40, 64, generator=g) * 0.1, torch.randn(40, generator=g)
        n = lambda *ts: [to_neuron(t) for t in ts]
        d8, s8 = formats.quantize_fp8(w)
        d4, s4 = formats.quantize_fp4(w)
        qx = formats.qdq_fp8(x)
        res = {}
        cases = {  # output, activation operand, decoded weight (the bound of torch_bq.testing)
            "fp8": (torch_bq.ops.fp8_linear(*n(x, d8, s8, b)), qx,
                    formats.dequantize_fp8(d8, s8, (32, 32), torch.float32)),
            "fp4": (torch_bq.ops.fp4_linear(*n(x, d4, s4, b)), qx, formats.dequantize_fp4(d4, s4, 64, torch.float32)),
            "bf16": (torch_bq.ops.bf16_linear(*n(x, w.bfloat16(), b)), x.bfloat16(), w.bfloat16().float()),
            "fp32w": (torch_bq.ops.fp32w_linear(*n(x, w, b)), x.bfloat16(), w.bfloat16().float()),
        }
        for name, (y, a, wd) in cases.items():
            assert_linear_close(to_cpu(y), a.float(), wd, b, msg=name)
            res[name] = [y.device.type, list(y.shape), True]
        q = torch_bq.ops.qdq_fp8(to_neuron(x))
        res["qdq_exact"] = torch.equal(bits(q), formats.qdq_fp8(x).contiguous().view(torch.uint8))
        res["calls"] = dict(kernel_calls)
        print(json.dumps(res))
        """
    )
    for name in ("fp8", "fp4", "bf16", "fp32w"):
        assert out[name] == ["neuron", [2, 3, 40], True], name
    assert out["qdq_exact"]
    assert out["calls"] == {"fp8_linear_kernel": 1, "fp4_linear_kernel": 1, "bf16_linear_kernel": 1,
                            "fp32w_linear_kernel": 1, "qdq_fp8_kernel": 1}


def test_the_nki_op_body_is_its_fake_kernel_and_runs_no_kernel_when_faked():
    """TorchNeuron's nki_op registers the body as the fake kernel: it must trace with fake tensors."""
    out = _on_stand_in(
        """
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch_bq.ops.nki import launch as prep
        x, w = torch.randn(5, 64, generator=g), torch.randn(40, 64, generator=g) * 0.1
        d8, s8 = formats.quantize_fp8(w)
        launch = prep.prepare_fp8_linear(x, d8, s8, None, (32, 32), True, 224.0, torch.bfloat16)
        with FakeTensorMode() as mode:
            fake = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in launch.tensors]
            y = torch.ops.torch_bq_nki.fp8_linear(*fake, *launch.options.values(), 2)
        print(json.dumps({"shape": list(y.shape), "dtype": str(y.dtype), "fake": type(y).__name__,
                          "calls": dict(kernel_calls)}))
        """
    )
    assert out == {"shape": [5, 40], "dtype": "torch.bfloat16", "fake": "FakeTensor", "calls": {}}


# --------------------------------------------------------------------------- #
# torch.compile(backend="neuron", fullgraph=True)
# --------------------------------------------------------------------------- #


def test_compile_traces_the_public_ops_into_nki_kernel_calls():
    out = _on_stand_in(
        """
        from torch import nn
        from torch_bq.nn import BF16Linear, FP4Linear, FP8Linear
        torch.manual_seed(0)

        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.up = FP8Linear.from_linear(nn.Linear(128, 128, bias=True))
                self.gate = FP8Linear.from_linear(nn.Linear(128, 128), block=(128, 128))
                self.down = FP4Linear.from_linear(nn.Linear(128, 128, bias=False))
                self.skip = BF16Linear.from_linear(nn.Linear(128, 128))

            def forward(self, x):
                return self.down(self.up(x) * torch.sigmoid(self.gate(x))) + self.skip(x)

        model = Block().eval()
        x = torch.randn(2, 5, 128)
        with torch.no_grad():
            eager_cpu = model(x)
            torch_neuronx.module_to_neuron(model)
            eager = model(to_neuron(x))
            eager_calls = dict(kernel_calls)
            kernel_calls.clear()
            compiled = torch.compile(model, backend="neuron", fullgraph=True)
            y = compiled(to_neuron(x))
        gm = torch_neuronx.compiled_graphs[-1]
        targets = sorted({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        print(json.dumps({
            "eager_calls": eager_calls,
            "compiled_calls": dict(kernel_calls),
            "graph_kernels": torch_neuronx.nki_kernel_nodes(gm),
            "torch_bq_nodes": [t for t in targets if "torch_bq" in t],
            "same_as_eager": torch.equal(bits(y), bits(eager)),
            "close_to_cpu": bool(torch.allclose(to_cpu(y).float(), eager_cpu.float(), rtol=2**-6, atol=2e-2)),
            "device": y.device.type,
        }))
        """
    )
    assert out["eager_calls"] == {"fp8_linear_kernel": 2, "fp4_linear_kernel": 1, "bf16_linear_kernel": 1}
    assert sorted(out["graph_kernels"]) == ["bf16_linear_kernel", "fp4_linear_kernel", "fp8_linear_kernel",
                                            "fp8_linear_kernel"]
    assert out["compiled_calls"] == out["eager_calls"]
    assert out["torch_bq_nodes"] == []
    assert out["same_as_eager"] and out["close_to_cpu"] and out["device"] == "neuron"


def test_the_neuron_backend_refuses_an_opaque_custom_op():
    """The stand-in backend must be able to fail: a custom op with a Python neuron kernel is not lowered."""
    out = _on_stand_in(
        """
        @torch.library.custom_op("nki_test::opaque", mutates_args=())
        def opaque(x: torch.Tensor) -> torch.Tensor:
            return x * 2

        opaque.register_fake(lambda x: torch.empty_like(x))
        opaque.register_kernel("neuron")(lambda x: x * 2)
        try:
            torch.compile(lambda x: opaque(x) + 1, backend="neuron", fullgraph=True)(to_neuron(torch.ones(4)))
            print(json.dumps({"error": None}))
        except Exception as e:
            print(json.dumps({"error": type(e).__name__, "message": str(e)}))
        """
    )
    assert out["error"] == "BackendCompilerFailed"
    assert "cannot lower nki_test.opaque" in out["message"]


def test_compile_guards_scale_codes_the_kernel_cannot_decode_on_the_device():
    out = _on_stand_in(
        """
        x, w = torch.randn(3, 64, generator=g), torch.randn(40, 64, generator=g) * 0.1
        d4, s4 = formats.quantize_fp4(w)
        codes = s4.view(torch.uint8).clone()
        codes[0, 0] = 253
        f = torch.compile(lambda x, d, s: torch_bq.ops.fp4_linear(x, d, s), backend="neuron", fullgraph=True)
        ok = f(to_neuron(x), to_neuron(d4), to_neuron(s4))
        try:
            f(to_neuron(x), to_neuron(d4), to_neuron(codes.view(s4.dtype)))
            print(json.dumps({"error": None}))
        except RuntimeError as e:
            print(json.dumps({"error": str(e), "ok_device": ok.device.type}))
        """
    )
    assert out["error"] is not None and "outside 1..252" in out["error"], out
    assert out["ok_device"] == "neuron"


# --------------------------------------------------------------------------- #
# capability: warn once when a device is present but nothing can register
# --------------------------------------------------------------------------- #


def _package(root: pathlib.Path, name: str, body: str = "") -> None:
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text(textwrap.dedent(body))


_LOOKS_REAL_NKI = """
__version__ = "{version}"
def jit(fn=None, **kw):
    return fn
"""


def _looks_real_nki(root: pathlib.Path, version: str, broadcast: bool = True) -> None:
    _package(root, "nki", _LOOKS_REAL_NKI.format(version=version))
    (root / "nki" / "isa.py").write_text("def nc_matmul(*a): pass\ndef dma_transpose(*a): pass\n")
    method = "    def broadcast(self, dim, size): pass\n" if broadcast else "    pass\n"
    (root / "nki" / "language.py").write_text(f"def ndarray(*a): pass\nclass NkiTensor:\n{method}")


WARN_PROBE = """
import json, warnings
import torch
torch.utils.rename_privateuse1_backend("neuron")  # what TorchNeuron's autoload does
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import torch_bq
    from torch_bq.ops.nki import register
    again = register.register_neuron_kernels()
msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning) and "torch_bq" in str(w.message)]
print(json.dumps({"warnings": msgs, "registered": again}))
"""


def test_torch_xla_flavour_without_nki_op_warns_once(tmp_path):
    _looks_real_nki(tmp_path, "0.6.0")
    _package(tmp_path, "torch_neuronx", "def trace(*a, **k):\n    pass\n")  # torch-xla flavour: no nki_op
    out = _run(WARN_PROBE, tmp_path, boot=False)
    assert out["registered"] is False
    assert len(out["warnings"]) == 1, out
    assert "no nki_op / wrap_nki" in out["warnings"][0] and "torch-xla" in out["warnings"][0]


def test_no_warning_without_a_neuron_device(tmp_path):
    code = WARN_PROBE.replace('torch.utils.rename_privateuse1_backend("neuron")', "")
    out = _run(code, tmp_path, boot=False)
    assert out == {"warnings": [], "registered": False}


@pytest.mark.parametrize("version,broadcast,available", [
    ("0.4.0", True, False),  # below the floor even though the method exists
    ("0.5.0", True, True),
    ("0.6.1", True, True),
    ("", False, False),  # no readable version and no NkiTensor.broadcast
    ("", True, True),  # no readable version, but the feature is there
])
def test_nki_available_checks_the_version_floor(tmp_path, version, broadcast, available):
    _looks_real_nki(tmp_path, version, broadcast)
    out = _run(
        """
        import json
        from torch_bq.ops import _backend
        print(json.dumps({"available": _backend.nki_available(), "reason": _backend.nki_unavailable_reason()}))
        """,
        tmp_path, boot=False,
    )
    assert out["available"] is available, out
    if not available:
        assert "0.5" in out["reason"]


def test_large_m_decodes_the_weight_once_then_runs_bf16_gemm_chunks():
    """Above DECODE_M_MAX rows: one dequant launch, one qdq, then ceil(M / GEMM_M_CHUNK) GEMM launches,
    bit-identical to the fused kernel; and the same kernel calls under torch.compile."""
    out = _on_stand_in(
        """
        from torch_bq.ops.nki import launch as prep
        x, w = torch.randn(300, 256, generator=g), torch.randn(96, 256, generator=g) * 0.1
        b = torch.randn(96, generator=g)
        res = {}
        for fmt in ("fp8", "fp4"):
            d, s = formats.quantize_fp8(w) if fmt == "fp8" else formats.quantize_fp4(w)
            op = torch_bq.ops.fp8_linear if fmt == "fp8" else torch_bq.ops.fp4_linear
            args = [to_neuron(t) for t in (x, d, s, b)]
            fused = op(*args)  # M = 300 <= DECODE_M_MAX: the fused kernel
            prep.DECODE_M_MAX, prep.GEMM_M_CHUNK = 64, 128
            kernel_calls.clear()
            split = op(*args)
            res[fmt + "_calls"] = dict(kernel_calls)
            res[fmt + "_equal"] = torch.equal(bits(split), bits(fused))
            kernel_calls.clear()
            compiled = torch.compile(lambda *a: op(*a), backend="neuron", fullgraph=True)(*args)
            res[fmt + "_compiled_calls"] = dict(kernel_calls)
            res[fmt + "_compiled_equal"] = torch.equal(bits(compiled), bits(fused))
            prep.DECODE_M_MAX, prep.GEMM_M_CHUNK = 512, 1024
            torch._dynamo.reset()
        print(json.dumps(res))
        """
    )
    for fmt in ("fp8", "fp4"):
        calls = {f"{fmt}_dequant_kernel": 1, "qdq_fp8_kernel": 1, "bf16_linear_kernel": 3}
        assert out[fmt + "_calls"] == calls and out[fmt + "_compiled_calls"] == calls, out
        assert out[fmt + "_equal"] and out[fmt + "_compiled_equal"], out


@pytest.mark.parametrize("block", [(32, 32), (256, 128), (1, 32)])
def test_large_m_dequant_is_split_into_launches_within_the_budget(block):
    out = _on_stand_in(
        f"""
        from torch_bq.ops.nki import launch as prep
        prep.DECODE_M_MAX = 8
        set_budget(800)
        prep.DEQUANT_TILE_INSTRUCTIONS = 300  # -> dequant_rows(512) = 2 blocks (256 rows) per launch
        x, w = torch.randn(20, 512, generator=g), torch.randn(700, 512, generator=g) * 0.1
        d, s = formats.quantize_fp8(w, block={block})
        y = torch_bq.ops.fp8_linear(to_neuron(x), to_neuron(d), to_neuron(s), block={block})
        r = ref.fp8_linear(x, d, s, None, {block}, True, 224.0, torch.bfloat16)
        print(json.dumps({{"rows": prep.dequant_rows(512), "calls": dict(kernel_calls),
                          "close": bool(torch.allclose(to_cpu(y).float(), r.float(), rtol=2**-7, atol=1e-3))}}))
        """
    )
    assert out["rows"] == 256
    assert out["calls"]["fp8_dequant_kernel"] == 3 and out["close"], out  # 700 rows in 256-row launches


def test_large_m_gemm_is_split_over_rows_and_columns_within_the_budget():
    out = _on_stand_in(
        """
        from torch_bq.ops.nki import launch as prep
        prep.DECODE_M_MAX = 8
        set_budget(300)  # per N tile 16 + 4 * 4 + 8 = 40: 6 tiles (3072 columns), 1 group (512 rows)
        x, w = torch.randn(600, 512, generator=g), torch.randn(3200, 512, generator=g) * 0.1
        b = torch.randn(3200, generator=g)
        d, s = formats.quantize_fp4(w)
        y = torch_bq.ops.fp4_linear(to_neuron(x), to_neuron(d), to_neuron(s), to_neuron(b))
        chunks = list(prep.gemm_chunks(3200, 512))
        prep.DECODE_M_MAX = 10**6
        set_budget(20_000)
        fused = torch_bq.ops.fp4_linear(to_neuron(x), to_neuron(d), to_neuron(s), to_neuron(b))
        print(json.dumps({"chunks": chunks, "calls": dict(kernel_calls),
                          "equal": torch.equal(bits(y), bits(fused))}))
        """
    )
    assert out["chunks"] == [512, 3072]
    # 600 rows in 2 row chunks x 3200 columns in 2 column chunks = 4 GEMM launches, bit-identical to fused.
    assert out["calls"]["bf16_linear_kernel"] == 4 and out["equal"], out


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_fused_kernel_is_split_over_columns_within_the_budget(fmt):
    """Decode-sized M with a wide N: fused launches over column chunks, bit-identical to one launch."""
    out = _on_stand_in(
        f"""
        from torch_bq.ops.nki import launch as prep
        x, w = torch.randn(5, 512, generator=g), torch.randn(1300, 512, generator=g) * 0.1
        b = torch.randn(1300, generator=g)
        d, s = formats.quantize_{fmt}(w)
        op = torch_bq.ops.{fmt}_linear
        whole = op(to_neuron(x), to_neuron(d), to_neuron(s), to_neuron(b))
        set_budget(250)  # fused_cols(5, 512) -> 512 columns per launch
        cols = prep.fused_cols(5, 512)
        kernel_calls.clear()
        split = op(to_neuron(x), to_neuron(d), to_neuron(s), to_neuron(b))
        print(json.dumps({{"cols": cols, "calls": dict(kernel_calls), "equal": torch.equal(bits(split), bits(whole))}}))
        """
    )
    assert out["cols"] == 512
    assert out["calls"] == {f"{fmt}_linear_kernel": 3} and out["equal"], out  # 1300 columns in 3 launches
