// The instruction-set level a CPU kernel source is compiled for, from the
// compiler's own target macros (the flags of each level: torch_bq/ops/cpu/isa.py),
// and the op namespace torch_bq_cpu_<level> its library registers. Included by
// every kernel source of the per-level libraries (kernels.cpp, attention.cpp).
#pragma once

// Instruction-set level of this build, from the compiler's target macros
// (cumulative: each level has everything of the one below).
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TORCH_BQ_AVX2 1
#endif
#if defined(TORCH_BQ_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__)
#define TORCH_BQ_AVX512 1
#endif
#if defined(TORCH_BQ_AVX512) && defined(__AVX512BF16__) && defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define TORCH_BQ_AVX512_BF16 1
#endif

#if defined(TORCH_BQ_AVX512_BF16)
#define TORCH_BQ_ISA avx512_bf16
#elif defined(TORCH_BQ_AVX512)
#define TORCH_BQ_ISA avx512
#elif defined(TORCH_BQ_AVX2)
#define TORCH_BQ_ISA avx2
#else
#define TORCH_BQ_ISA generic
#endif
#define TORCH_BQ_STR2(x) #x
#define TORCH_BQ_STR(x) TORCH_BQ_STR2(x)
#define TORCH_BQ_CAT2(a, b) a##b
#define TORCH_BQ_CAT(a, b) TORCH_BQ_CAT2(a, b)
// The op namespace torch_bq_cpu_<level> (torch_bq/ops/cpu/isa.py: op_namespace).
#define TORCH_BQ_OPS TORCH_BQ_CAT(torch_bq_cpu_, TORCH_BQ_ISA)

// TORCH_LIBRARY pastes its argument, so the namespace macro is expanded first.
// kernels.cpp defines the library; other sources of the same library add fragments.
#define TORCH_BQ_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define TORCH_BQ_LIBRARY_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
