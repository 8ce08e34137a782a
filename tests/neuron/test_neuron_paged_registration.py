"""A whole DrafterLayer and FP4/FP8Experts on the ``neuron`` device run NKI kernels only, eager and compiled.

Each case runs in a fresh interpreter on the NKI and TorchNeuron stand-ins (see
test_neuron_registration.py): the public ``torch_bq::`` ops dispatch to their ``neuron`` kernels,
which launch the NKI kernels through ``wrap_nki``; under ``torch.compile(backend="neuron",
fullgraph=True)`` the graph must hold ATen ops and NKI kernel calls only (the stand-in backend
refuses anything else). ``kernel_calls`` counts which kernels ran. Nothing here has run on Trainium
hardware or with the real TorchNeuron.
"""

from __future__ import annotations

import pytest

from test_neuron_registration import _on_stand_in

LAYER = """
import sys
sys.path.insert(0, "tests")
from test_drafter import make_drafter, make_step, clone_caches
layer = make_drafter().layers[0]
step = make_step()
cpu_caches = clone_caches(step.kv_caches)

def neuron_step():
    kc, vc = (to_neuron(t.clone()) for t in step.kv_caches[0])
    meta = [to_neuron(t) for t in (step.block_table, step.slots, step.seq_lens)]
    return (to_neuron(step.hidden), to_neuron(step.positions), kc, vc, *meta), (kc, vc)

with torch.no_grad():
    ref = layer(step.hidden, step.positions, *cpu_caches[0], step.block_table, step.slots, step.seq_lens)
    torch_neuronx.module_to_neuron(layer)
    args, caches = neuron_step()
    y = layer(*args)
    eager_calls = dict(kernel_calls)
    kernel_calls.clear()
    args_c, caches_c = neuron_step()
    yc = torch.compile(layer, backend="neuron", fullgraph=True)(*args_c)
gm = torch_neuronx.compiled_graphs[-1]
targets = sorted({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
same = lambda a, b: torch.equal(to_cpu(a).contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
print(json.dumps({
    "eager_calls": eager_calls, "compiled_calls": dict(kernel_calls),
    "graph_kernels": sorted(torch_neuronx.nki_kernel_nodes(gm)),
    "torch_bq_nodes": [t for t in targets if "torch_bq" in t],
    "eager_exact": same(y, ref), "compiled_exact": same(yc, ref),
    "caches_exact": all(same(c, r) for c, r in zip((*caches, *caches_c), (*cpu_caches[0], *cpu_caches[0]))),
    "written": not torch.equal(cpu_caches[0][0].float().nan_to_num(), step.kv_caches[0][0].float().nan_to_num()),
}))
"""


@pytest.mark.slow
def test_drafter_layer_runs_nki_kernels_only_eager_and_compiled():
    out = _on_stand_in(LAYER)
    expected = {"fp8_linear_kernel": 5, "paged_kv_write_kernel": 1, "paged_window_attention_kernel": 1}
    assert out["eager_calls"] == expected
    assert out["compiled_calls"] == expected
    assert out["graph_kernels"] == sorted(["fp8_linear_kernel"] * 5 + ["paged_kv_write_kernel",
                                                                     "paged_window_attention_kernel"])
    assert out["torch_bq_nodes"] == []
    # TINY's shapes sum in the reference's order: equal bit for bit here (not promised in general).
    assert out["eager_exact"] and out["compiled_exact"] and out["caches_exact"] and out["written"]


EXPERTS = """
from torch_bq.nn import FP4Experts, FP8Experts
res = {}
gen = torch.Generator().manual_seed(0)
E, H, I, T = 6, 64, 128, 20
gate_up, down = torch.randn(E, 2 * I, H, generator=gen) * 0.2, torch.randn(E, H, I, generator=gen) * 0.2
modules = {
    "fp4": FP4Experts.from_weights(gate_up, down, torch.randn(E, 2 * I, generator=gen),
                                   torch.randn(E, H, generator=gen), activation="gpt-oss"),
    "fp8": FP8Experts.from_weights(gate_up, down, activation="swiglu", block=(32, 32)),
}
ids = torch.randint(0, 2, (T, 2), generator=gen) * 3 + 1  # experts 0, 2, 3, 5 get no rows
weights = torch.rand(T, 2, generator=gen).softmax(-1)
hidden = torch.randn(T, H, generator=gen)
for name, m in modules.items():
    with torch.no_grad():
        ref = m(hidden, ids, weights)
        torch_neuronx.module_to_neuron(m)
        kernel_calls.clear()
        y = m(to_neuron(hidden), to_neuron(ids), to_neuron(weights))
        eager_calls = dict(kernel_calls)
        kernel_calls.clear()
        yc = torch.compile(m, backend="neuron", fullgraph=True)(to_neuron(hidden), to_neuron(ids), to_neuron(weights))
    gm = torch_neuronx.compiled_graphs[-1]
    targets = sorted({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
    res[name] = {
        "eager_calls": eager_calls, "compiled_calls": dict(kernel_calls),
        "graph_kernels": torch_neuronx.nki_kernel_nodes(gm), "torch_bq_nodes": [t for t in targets if "torch_bq" in t],
        "err": float((to_cpu(y).double() - ref.double()).abs().max()),
        "err_compiled": float((to_cpu(yc).double() - ref.double()).abs().max()),
        "scale": float(ref.abs().max()),
    }
print(json.dumps(res))
"""


@pytest.mark.slow
def test_experts_run_nki_kernels_only_eager_and_compiled():
    out = _on_stand_in(EXPERTS)
    for name in ("fp4", "fp8"):
        r = out[name]
        kernel = f"{name}_grouped_linear_kernel"
        assert r["eager_calls"] == {kernel: 2}, r  # gate_up and down, one launch each over all experts
        assert r["compiled_calls"] == {kernel: 2}, r
        assert r["graph_kernels"] == [kernel, kernel]
        assert r["torch_bq_nodes"] == []
        # fp32 outputs mixed in fp32: only the order of fp32 sums may differ from the CPU reference.
        assert r["err"] <= 1e-5 * r["scale"] and r["err_compiled"] <= 1e-5 * r["scale"], r


def test_compiled_attention_guards_a_request_that_sees_more_than_the_traced_span():
    """Traced, the span is window + rows - 1; a padded row far back needs more: a device assert, not a wrong answer."""
    out = _on_stand_in(
        """
        import sys
        sys.path.insert(0, "tests")
        from test_attention import build
        case = dict(num_requests=1, rows_per_request=2, hkv=1, hq=2, d=8, block_size=16, window=8, causal=False,
                    seq_lens=[900], positions=[899, 3], chunk_size=16, seed=0)
        q, _, _, kc, vc, table, positions, seq_lens = build(case)
        f = torch.compile(lambda *a: torch_bq.ops.paged_window_attention(*a, rows_per_request=2, window=8,
                                                                        validate=False),
                          backend="neuron", fullgraph=True)
        args = [to_neuron(t) for t in (q, kc, vc, table, positions, seq_lens)]
        eager = torch_bq.ops.paged_window_attention(*args, rows_per_request=2, window=8)  # eager reads the span
        try:
            f(*args)
            print(json.dumps({"error": None}))
        except RuntimeError as e:
            print(json.dumps({"error": str(e), "eager_device": eager.device.type}))
        """
    )
    assert out["error"] is not None and "sees more than 512 cache positions" in out["error"], out
    assert out["eager_device"] == "neuron"
