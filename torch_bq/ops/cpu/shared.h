// What kernels.cpp lends the other kernel sources of the same per-level library
// (nvfp4.cpp): its task pool and its prefill GEMM, so a format with a decoder of
// its own does not need a copy of either.
//
// Everything here has hidden visibility: it links between the translation units
// of one library and is never exported, so the per-level libraries loaded into
// one process (torch_bq/ops/cpu/isa.py) never bind to each other's copies.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#pragma GCC visibility push(hidden)
namespace torch_bq_cpu_shared {

// The exact decode tables of docs/contract.md §1: every E4M3FN byte (NaN for
// 0x7F / 0xFF) and every e2m1 nibble (element 2j of a byte is its low nibble).
const float* e4m3_values();  // [256]
const float* e2m1_values();  // [16]

// Rows of a quantized weight [N, K] as the prefill GEMM asks for them, decoded to fp32.
class RowDecoder {
 public:
  virtual ~RowDecoder() = default;
  // Every K chunk the GEMM asks for starts at a multiple of this (a scale block).
  virtual int64_t chunk_align() const = 0;
  // dst[0, k1 - k0) = W[n, k0:k1], exactly as the reference decodes it.
  virtual void fp32(int64_t n, int64_t k0, int64_t k1, float* dst) const = 0;
};

// Runs body(ctx, i) for i in [0, count) on torch_bq's own worker threads
// (kernels.cpp: TaskPool; which thread runs a task never changes its result).
void run_tasks(int64_t count, void (*body)(const void* ctx, int64_t i), const void* ctx);

template <class Task>
inline void run_tasks(int64_t count, const Task& task) {
  run_tasks(count, [](const void* t, int64_t i) { (*static_cast<const Task*>(t))(i); }, &task);
}

// out [M, N] fp32 = A [M, K] (fp32) x W^T with the prefill path of kernels.cpp:
// fp32 panels of W from `rows`, fed to the fp32 brgemm microkernel (at::mm on the
// generic build or with MKLDNN off). The bf16 microkernel is never used: the
// decoded rows need not be exact in bf16.
void prefill_fp32(const RowDecoder& rows, const at::Tensor& A, int64_t N, int64_t panel_bytes, at::Tensor& out);

}  // namespace torch_bq_cpu_shared
#pragma GCC visibility pop
