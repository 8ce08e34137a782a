"""Every rule the NKI stand-in enforces beyond plain semantics, with where it is documented. One place.

Each rule has an id; the stand-in's errors start with ``[id]`` so a failure names the rule.
Sources are files of the public ``aws-neuron/aws-neuron-sdk`` docs (NKI 0.6, Neuron SDK 2.32)
unless noted. Where the docs and another source disagree the stand-in takes the stricter reading
and says so here.

Python subset (checked on the source of every kernel and every helper it calls, by ``nki.jit``):
see :mod:`._subset`. Hardware / ISA rules: see :mod:`._core` and :mod:`.isa`.
"""

from __future__ import annotations

from typing import NamedTuple


class Rule(NamedTuple):
    what: str
    source: str


RULES = {
    # ---- the Python subset the NKI compiler accepts (specialization) ----------------------------
    "py-is": Rule(
        "no `is` / `is not` (compare with == / !=)",
        "nki/migration/index.rst, NKI 0.3.0 'Language restrictions': Replace is / is not with == / !=",
    ),
    "py-kwonly": Rule(
        "no keyword-only separator `*` (or *args / **kwargs) in a kernel signature",
        "nki/migration/index.rst, NKI 0.3.0 'Remove keyword-only argument separator (*)'",
    ),
    "py-list-arg": Rule(
        "no list as a kernel argument (pass a tuple)",
        "nki/migration/index.rst, NKI 0.3.0 'Replace list kernel arguments with tuples'",
    ),
    "py-comprehension": Rule(
        "no list / set / dict comprehensions or generator expressions, no lambda",
        "nki/get-started/nki-language-guide.rst ('NKI Values', 'Control Flow': the subset is if, for over "
        "ranges/lists/tuples, while, named functions); nki/guides/nki_simulator.rst 'NKI Meta-Programming "
        "Support': other Python runs in the simulator but fails to compile",
    ),
    "py-range-value": Rule(
        "range() / nl.*_range() only as the iterable of a for loop: never stored, passed or returned",
        "nki/get-started/nki-language-guide.rst: NKI values are None, bool, int32, fp32, string literals, "
        "tensors, tuples, lists, string-keyed dicts, NKIObject classes; a range is not one; loops iterate "
        "ranges, lists or tuples",
    ),
    "py-dict-key": Rule(
        "dictionary keys are string literals",
        "nki/get-started/nki-language-guide.rst 'Dictionaries with string-value keys'; "
        "nki/migration/index.rst 0.2.0 'Dictionaries support only string keys'",
    ),
    "py-global-state": Rule(
        "a kernel or helper reads only modules, functions and immutable constants (int, float, bool, str, "
        "None, tuples of them) from module scope: no module-level dict / list / set / object",
        "nki/get-started/nki-language-guide.rst 'Caching': kernels must be pure functions of their arguments; "
        "global variables and closures over mutable objects give stale compiled artifacts",
    ),
    "py-construct": Rule(
        "none of: try/except, with, yield, global/nonlocal, class or nested function definitions, async, "
        "set literals, f-strings, raise (use assert with a string literal)",
        "nki/get-started/nki-language-guide.rst lists the supported values (string *literals*), containers and "
        "control flow; these are outside that list (the simulator runs them, the compiler does not)",
    ),
    "py-decorated-helper": Rule(
        "helpers a kernel calls are plain functions: no decorators, no @nki.jit kernel called from a kernel",
        "nki/migration/index.rst 0.2.0 'Decorators on sub-kernels need to be removed'",
    ),
    # ---- hardware and ISA ---------------------------------------------------------------------
    "hw-start-partition": Rule(
        "an engine (compute) instruction's SBUF/PSUM access of n partitions starts at partition 0 if "
        "64 < n <= 128, at 0 or 64 if 32 < n <= 64, at 0/32/64/96 if n <= 32 (DMA is not restricted)",
        "nki/guides/architecture/trainium_inferentia2_arch.rst (start_partition rule); the public reference "
        "kernel hit 'Invalid access of 8 partitions starting at partition 8' on hardware",
    ),
    "hw-sbuf": Rule(
        "live SBUF per partition <= 192 KiB on Trn1 (NeuronCore-v2), 224 KiB on Trn2 (NeuronCore-v3); "
        "target chosen by NEURON_PLATFORM_TARGET_OVERRIDE (trn1/trn2), default trn2",
        "nki/guides/architecture/trainium_inferentia2_arch.rst (24 MiB, 192 KiB/partition); "
        "nki/guides/architecture/trainium2_arch.rst (28 MiB, 224 KiB/partition)",
    ),
    "hw-psum": Rule(
        "PSUM: 8 banks of 2 KiB per partition (16 KiB)",
        "nki/guides/architecture/trainium_inferentia2_arch.rst (2 MiB PSUM, 16 KiB per partition)",
    ),
    "isa-tensor-scalar-fp32": Rule(
        "tensor_scalar / scalar_tensor_tensor / activation arithmetic is fp32 math on any dtype (int32 3 x 1.5 "
        "= 4.5 before the cast on write); only tensor_tensor with all-int32/uint32 tiles is exact integer math",
        "nki/api/nki/isa: tensor_scalar ('casts data.dtype to float32 and performs the operators in float32 "
        "math'), tensor_tensor ('int32/uint32 ... GpSimd ... native integer arithmetic')",
    ),
    "isa-dma-no-cast": Rule(
        "dma_copy between different dtypes is refused",
        "STRICTER than the docs: nki/api/nki/isa dma_copy and nki/get-started/about/nki-dma-overview.rst say "
        "the DMA casts through fp32 (not for MX types); torch_bq's Trainium notes (issue 13) report that "
        "hardware DMA does not cast. Kernels that never rely on a DMA cast work under both readings",
    ),
    "isa-instruction-budget": Rule(
        "a launch issues at most the kernel's instruction budget of ISA calls per program (every loop is "
        "unrolled at specialization, so the count is the instruction stream's length)",
        "nki/get-started/nki-language-guide.rst 'Specialization': all for loops (except dynamic_range) are "
        "unrolled; the budget itself is torch_bq's (compile time and NEFF size), docs/nki.md",
    ),
    "hw-denormal-flush": Rule(
        "optional mode: engines flush fp32/bf16 denormal inputs and results to zero",
        "the docs say nothing about denormals on the engines; the mode shows what a flush would cost",
    ),
    "rt-register": Rule(
        "a VirtualRegister (and nl.dynamic_range's induction variable) has no compile-time value: no Python "
        "arithmetic, int(), indexing or if/while on it; it is a loop bound or an instruction operand",
        "nki/api/nki/isa VirtualRegister (note: under the tracer a register in Python control flow or int() / "
        "range() raises TypeError); nki/api/nki/language dynamic_range (bounds may be registers, step a "
        "compile-time int)",
    ),
    "isa-indirect-dma": Rule(
        "indirect DMA: .ap(vector_offset=idx) on an HBM tensor, idx an SBUF (P, 1) int32/uint32 tile, the "
        "pattern's partition entry [dim stride, P]; an index outside the indexed dim raises (oob_mode.error) "
        "or skips that partition (oob_mode.skip)",
        "nki/api/nki/isa dma_copy ('Indirect addressing (gather/scatter)', oob_mode); "
        "nki/api/nki/language NkiTensor.ap",
    ),
    "nki-version": Rule(
        "NkiTensor.broadcast needs NKI >= 0.5 (Neuron SDK 2.31); torch_bq's nki_available() checks the floor",
        "release-notes/components/nki.rst, NKI 0.5.0 'New NkiTensor view primitives ... broadcast'",
    ),
}


def tag(rule: str) -> str:
    """``[rule]`` prefix for an error message (``KeyError`` for an unknown rule, so ids stay in this table)."""
    RULES[rule]
    return f"[{rule}]"
