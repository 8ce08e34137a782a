// CPU kernels of torch_bq::paged_window_attention and torch_bq::paged_kv_write
// (docs/contract.md §5 steps 4-5).
//
// Compiled into the same per-ISA-level libraries as kernels.cpp (one translation
// unit more per level; torch_bq/ops/cpu/isa.py has the levels and their flags),
// registering into the same op namespace with TORCH_LIBRARY_FRAGMENT.
//
// Attention is split-K ("flash decoding", torch_bq/reference/flash_decoding.py):
//
//   task (request r, KV head g, split s)        independent; handed out to threads
//     Q   = q rows of r x query heads of g        [T = rows * group, d] float32, t = row * group + head
//     K^T, V = keys [j0, j1) of the split          float32, read through the block table
//     S   = Q K^T * scale; rows masked to their visible keys
//     m_s = rowmax S, P = exp(S - m_s), l_s = rowsum P, o_s = P V      (unnormalised)
//   merge (r, g): M = max m_s, out = sum o_s e^(m_s - M) / sum l_s e^(m_s - M)
//
// A row that sees no key of a split has m_s = -inf, l_s = 0, o_s = 0 and adds
// nothing (no NaN). The two products are one register-blocked tile kernel
// (C = A B, A row-major, B row-major) written with GCC/Clang vector types, so
// the same source is 16-lane on AVX-512, 8-lane on AVX2 and 4-lane (SSE2) on
// the generic build; all buffers are zero-padded to whole tiles, so the tile
// kernel has no edge cases. Everything is float32; the caller rounds once to
// q's dtype.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "isa.h"

#if defined(TORCH_BQ_AVX512_BF16)
#include <immintrin.h>
#endif

namespace torch_bq_cpu_attention {
namespace {

#if defined(__AVX512F__)
#define TORCH_BQ_ATTN_LANES 16
constexpr int kTileRows = 8;  // 8 x 2 accumulators + 2 loads + 1 broadcast of 32 registers
#elif defined(__AVX2__)
#define TORCH_BQ_ATTN_LANES 8
constexpr int kTileRows = 6;  // 12 accumulators + 3 of 16 registers
#else
#define TORCH_BQ_ATTN_LANES 4
constexpr int kTileRows = 6;
#endif
constexpr int kLanes = TORCH_BQ_ATTN_LANES;
constexpr int kTileCols = 2 * kLanes;  // the widest tile; a one-vector tile takes the rest
typedef float vf __attribute__((vector_size(4 * TORCH_BQ_ATTN_LANES)));
typedef int32_t vi __attribute__((vector_size(4 * TORCH_BQ_ATTN_LANES)));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vf splat(float x) { return vf{} + x; }

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// C[kTileRows x NV lanes-vectors] = A[kTileRows x K] * B[K x NV vectors], with A's
// element (r, k) at A[r * a_row + k * a_k] (so A may be read transposed), B row-major.
template <int NV>
inline void tile(const float* A, int64_t a_row, int64_t a_k, const float* B, int64_t ldb, int64_t K, float* C,
                 int64_t ldc) {
  vf acc[kTileRows][NV];
#pragma GCC unroll 8
  for (int r = 0; r < kTileRows; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) acc[r][v] = vf{};
  for (int64_t k = 0; k < K; ++k) {
    vf b[NV];
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) b[v] = load(B + k * ldb + v * kLanes);
    const float* ak = A + k * a_k;
#pragma GCC unroll 8
    for (int r = 0; r < kTileRows; ++r) {
      const float a = ak[r * a_row];
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) acc[r][v] += a * b[v];
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < kTileRows; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) store(C + r * ldc + v * kLanes, acc[r][v]);
}

// C[rows x cols] = A[rows x K] B[K x cols] (A strided as in tile); rows a multiple of
// kTileRows, cols of kLanes (two-vector tiles, then a one-vector tile for the rest).
void matmul(const float* A, int64_t a_row, int64_t a_k, const float* B, int64_t ldb, int64_t K, float* C, int64_t ldc,
            int64_t rows, int64_t cols) {
  for (int64_t t = 0; t < rows; t += kTileRows) {
    int64_t c = 0;
    for (; c + kTileCols <= cols; c += kTileCols)
      tile<2>(A + t * a_row, a_row, a_k, B + c, ldb, K, C + t * ldc + c, ldc);
    if (c < cols) tile<1>(A + t * a_row, a_row, a_k, B + c, ldb, K, C + t * ldc + c, ldc);
  }
}

// e^x for x <= 0 (Cody-Waite reduction, Cephes' degree-6 polynomial: about 1 ulp).
// x < -87 (e^x below float32's normal range, -inf included) gives exactly 0.
inline vf exp_nonpositive(vf x) {
  const vf lowest = splat(-87.0f);
  const auto dead = x < lowest;
  x = dead ? lowest : x;
  const vf magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const vf n = (x * 1.44269504088896341f + magic) - magic;
  const vf r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  vf y = splat(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.0f;
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;  // 2^n, n in [-126, 0]
  vf pow2;
  std::memcpy(&pow2, &bits, sizeof pow2);
  const vf out = y * pow2;
  return dead ? vf{} : out;
}

// Runs task(i) for i in [0, count) on torch's intra-op threads, handed out from a
// shared counter (a thread scheduled late on a busy machine delays the call by
// one task, not by a fixed share). What a task computes does not depend on the thread.
template <class Task>
void run_tasks(int64_t count, const Task& task) {
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), count);
  if (workers <= 1) {
    for (int64_t i = 0; i < count; ++i) task(i);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1); i < count; i = next.fetch_add(1)) task(i);
  });
}

struct CacheView {
  int64_t num_blocks, block_size, hkv, d;
  int64_t s0, s1, s2, s3;  // element strides of [block, offset, head, dim]
};

CacheView view_of(const at::Tensor& cache) {
  return {cache.size(0), cache.size(1), cache.size(2), cache.size(3),
          cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3)};
}

// One split of one (request, KV head): its keys [j0, j1) and where its partials go.
struct Split {
  int64_t request, head, j0, j1, slot;
};

template <class Elem>
void attention_impl(const float* q, const Elem* kc, const Elem* vc, const CacheView& cv, const CacheView& vcv,
                    const int32_t* table,
                    int64_t max_blocks, const int64_t* positions, const int32_t* seq_lens, int64_t requests,
                    int64_t rpr, int64_t hq, int64_t window, bool causal, float scale, int64_t chunk, float* out) {
  const int64_t d = cv.d, hkv = cv.hkv, group = hq / hkv, bs = cv.block_size;
  // T query rows per (request, KV head): Tq padded for the score tiles' columns, Tr for
  // the output tiles' rows; Dp: head_dim padded for the output tiles' columns.
  const int64_t T = rpr * group, Tq = round_up(T, kLanes), Tr = round_up(T, kTileRows);
  const int64_t Dp = round_up(d, kLanes), Cr = round_up(chunk, kTileRows);

  // Each request's keys [lo, hi): lo from its lowest row position, hi = seq_len.
  std::vector<Split> splits;
  std::vector<int64_t> first_split(requests * hkv + 1, 0);
  for (int64_t r = 0; r < requests; ++r) {
    int64_t lowest = std::numeric_limits<int64_t>::max();
    for (int64_t i = 0; i < rpr; ++i) lowest = std::min(lowest, positions[r * rpr + i]);
    const int64_t lo = std::max<int64_t>(0, lowest - window + 1), hi = seq_lens[r];
    // Every block the request reads must exist (validate=False skips the Python check).
    if (hi > lo) {
      TORCH_CHECK_INDEX((hi - 1) / bs < max_blocks, "paged_window_attention: request ", r, " reads logical block ",
                        (hi - 1) / bs, " of a block_table with ", max_blocks, " columns");
      for (int64_t b = lo / bs; b <= (hi - 1) / bs; ++b) {
        const int64_t phys = table[r * max_blocks + b];
        TORCH_CHECK_INDEX(0 <= phys && phys < cv.num_blocks, "paged_window_attention: request ", r,
                          ", logical block ", b, " maps to physical block ", phys, ", outside the cache's [0, ",
                          cv.num_blocks, ")");
      }
    }
    for (int64_t g = 0; g < hkv; ++g) {
      first_split[r * hkv + g] = static_cast<int64_t>(splits.size());
      for (int64_t j0 = lo; j0 < hi; j0 += chunk)
        splits.push_back({r, g, j0, std::min(hi, j0 + chunk), static_cast<int64_t>(splits.size())});
    }
  }
  first_split[requests * hkv] = static_cast<int64_t>(splits.size());

  // Transposed query tiles Q^T [requests, hkv, d, Tq], zero-padded.
  std::vector<float> qt(requests * hkv * d * Tq, 0.0f);
  for (int64_t r = 0; r < requests; ++r)
    for (int64_t i = 0; i < rpr; ++i)
      for (int64_t h = 0; h < hq; ++h) {
        const int64_t g = h / group, t = i * group + h % group;
        const float* src = q + ((r * rpr + i) * hq + h) * d;
        float* dst = &qt[(r * hkv + g) * d * Tq + t];
        for (int64_t e = 0; e < d; ++e) dst[e * Tq] = src[e];
      }

  // The splits' partials. Every split writes all of its rows, so the buffers need no
  // initialisation; they are kept per calling thread (no page faults on every call).
  const int64_t nsplits = static_cast<int64_t>(splits.size());
  // (The tasks run on other threads: they must use these pointers, not the thread_local names.)
  thread_local std::vector<float> part_o_buf, part_m_buf, part_l_buf;
  part_o_buf.resize(std::max<size_t>(part_o_buf.size(), nsplits * Tr * Dp));
  part_m_buf.resize(std::max<size_t>(part_m_buf.size(), nsplits * Tq));
  part_l_buf.resize(std::max<size_t>(part_l_buf.size(), nsplits * Tq));
  float* const part_o = part_o_buf.data();
  float* const part_m = part_m_buf.data();
  float* const part_l = part_l_buf.data();

  run_tasks(nsplits, [&](int64_t index) {
    const Split& sp = splits[index];
    const int64_t r = sp.request, g = sp.head, n = sp.j1 - sp.j0, rows = round_up(n, kTileRows);
    // K [rows, d], V [rows, Dp] in float32 (padding zero) and the scores S^T [rows, Tq].
    thread_local std::vector<float> kf, vv, st;
    thread_local std::vector<int32_t> vis_lo, vis_hi;
    kf.resize(Cr * d);
    vv.resize(Cr * Dp);
    st.resize(Cr * Tq);
    vis_lo.resize(Tq);
    vis_hi.resize(Tq);
    for (int64_t jj = 0; jj < n; ++jj) {
      const int64_t j = sp.j0 + jj;
      const int64_t phys = table[r * max_blocks + j / bs];
      const Elem* kp = kc + phys * cv.s0 + (j % bs) * cv.s1 + g * cv.s2;
      const Elem* vp = vc + phys * vcv.s0 + (j % bs) * vcv.s1 + g * vcv.s2;
      float* krow = kf.data() + jj * d;
      float* vrow = vv.data() + jj * Dp;
      if (cv.s3 == 1 && vcv.s3 == 1) {
        for (int64_t e = 0; e < d; ++e) krow[e] = static_cast<float>(kp[e]);
        for (int64_t e = 0; e < d; ++e) vrow[e] = static_cast<float>(vp[e]);
      } else {
        for (int64_t e = 0; e < d; ++e) krow[e] = static_cast<float>(kp[e * cv.s3]);
        for (int64_t e = 0; e < d; ++e) vrow[e] = static_cast<float>(vp[e * vcv.s3]);
      }
      std::fill(vrow + d, vrow + Dp, 0.0f);
    }
    std::fill(kf.begin() + n * d, kf.begin() + rows * d, 0.0f);
    std::fill(vv.begin() + n * Dp, vv.begin() + rows * Dp, 0.0f);

    matmul(kf.data(), d, 1, qt.data() + (r * hkv + g) * d * Tq, Tq, d, st.data(), Tq, rows, Tq);

    // Each query row's visible keys in split coordinates, [vis_lo, vis_hi) (empty for padding).
    for (int64_t t = 0; t < Tq; ++t) {
      int64_t a = 0, b = 0;
      if (t < T) {
        const int64_t p = positions[r * rpr + t / group];
        a = std::max<int64_t>(std::max<int64_t>(0, p - window + 1) - sp.j0, 0);
        b = std::min<int64_t>((causal ? std::min(sp.j1, p + 1) : sp.j1) - sp.j0, n);
      }
      vis_lo[t] = static_cast<int32_t>(a);
      vis_hi[t] = static_cast<int32_t>(std::max(a, b));
    }
    // Softmax down the columns of S^T: scale and mask, column max, exp, column sum.
    const float neg_inf = -std::numeric_limits<float>::infinity();
    float* m_out = part_m + sp.slot * Tq;
    float* l_out = part_l + sp.slot * Tq;
    std::fill(m_out, m_out + Tq, neg_inf);
    std::fill(l_out, l_out + Tq, 0.0f);
    for (int64_t c = 0; c < rows; ++c) {
      float* row = st.data() + c * Tq;
      const vi cc = vi{} + static_cast<int32_t>(c);
      for (int64_t t = 0; t < Tq; t += kLanes) {
        vi lo_v, hi_v;
        std::memcpy(&lo_v, vis_lo.data() + t, sizeof lo_v);
        std::memcpy(&hi_v, vis_hi.data() + t, sizeof hi_v);
        const auto visible = (cc >= lo_v) & (cc < hi_v);
        const vf x = visible ? load(row + t) * scale : splat(neg_inf);
        store(row + t, x);
        const vf m = load(m_out + t);
        store(m_out + t, x > m ? x : m);
      }
    }
    // A column that saw nothing keeps m = -inf; exponentiate it against 0 (exp(-inf) = 0).
    thread_local std::vector<float> shift;
    shift.resize(Tq);
    for (int64_t t = 0; t < Tq; ++t) shift[t] = std::isfinite(m_out[t]) ? m_out[t] : 0.0f;
    for (int64_t c = 0; c < rows; ++c) {
      float* row = st.data() + c * Tq;
      for (int64_t t = 0; t < Tq; t += kLanes) {
        const vf pexp = exp_nonpositive(load(row + t) - load(shift.data() + t));
        store(row + t, pexp);
        store(l_out + t, load(l_out + t) + pexp);
      }
    }
    // O = P V with P read transposed from S^T.
    matmul(st.data(), 1, Tq, vv.data(), Dp, rows, part_o + sp.slot * Tr * Dp, Dp, Tr, Dp);
  });

  // Merge each (request, KV head)'s splits into out [R, hq, d].
  run_tasks(requests * hkv, [&](int64_t rg) {
    const int64_t r = rg / hkv, g = rg % hkv, s0 = first_split[rg], s1 = first_split[rg + 1];
    std::vector<float> acc(d);
    for (int64_t t = 0; t < T; ++t) {
      float big_m = -std::numeric_limits<float>::infinity();
      for (int64_t sidx = s0; sidx < s1; ++sidx) big_m = std::max(big_m, part_m[sidx * Tq + t]);
      if (!std::isfinite(big_m)) big_m = 0.0f;  // no split saw a key: every weight below is 0
      float big_l = 0.0f;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t sidx = s0; sidx < s1; ++sidx) {
        const float w = std::exp(part_m[sidx * Tq + t] - big_m);  // exactly 0 for m = -inf
        if (w == 0.0f) continue;
        big_l += part_l[sidx * Tq + t] * w;
        const float* o = part_o + (sidx * Tr + t) * Dp;
        for (int64_t e = 0; e < d; ++e) acc[e] += o[e] * w;
      }
      const int64_t i = t / group, h = g * group + t % group;
      float* dst = out + ((r * rpr + i) * hq + h) * d;
      for (int64_t e = 0; e < d; ++e) dst[e] = big_l > 0.0f ? acc[e] / big_l : 0.0f;
    }
  });
}

// The compute roof the benchmarks compare with (benchmarks/drafter_cpu.py): runs
// `iters` rounds of independent register-only multiply-adds and returns the
// floating-point operations done (2 per multiply-add), 0 when this build lacks the
// instruction. kind "fp32_fma": the vector FMA (multiply, add on the generic build)
// of the tile kernel above; "bf16_dot": vdpbf16ps (2 bf16 products + add per lane).
double peak_probe(const std::string& kind, int64_t iters) {
  constexpr int kChains = 12;  // independent accumulators: more than latency x issue width
  volatile float sink = 0.0f;
  if (kind == "fp32_fma") {
    vf acc[kChains];
    for (int c = 0; c < kChains; ++c) acc[c] = splat(1.0f + c);
    const vf mul = splat(0.999999f), add = splat(1e-7f);
    for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 12
      for (int c = 0; c < kChains; ++c) acc[c] = acc[c] * mul + add;
    }
    vf total = vf{};
    for (int c = 0; c < kChains; ++c) total += acc[c];
    sink = total[0];
    return 2.0 * kChains * kLanes * static_cast<double>(iters);
  }
  if (kind == "bf16_dot") {
#if defined(TORCH_BQ_AVX512_BF16)
    __m512 acc[kChains];
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_ps(1.0f + c);
    const __m512bh x = (__m512bh)_mm512_set1_epi16(0x3F80), y = (__m512bh)_mm512_set1_epi16(0x3380);
    for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 12
      for (int c = 0; c < kChains; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], x, y);
    }
    __m512 total = _mm512_setzero_ps();
    for (int c = 0; c < kChains; ++c) total = _mm512_add_ps(total, acc[c]);
    sink = _mm512_reduce_add_ps(total);
    return 4.0 * kChains * 16 * static_cast<double>(iters);
#else
    return 0.0;
#endif
  }
  TORCH_CHECK(false, "peak_probe: kind must be \"fp32_fma\" or \"bf16_dot\", got \"", kind, "\"");
}

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, ": expected a CPU tensor, got one on ", t.device());
}

// q: float32 [R, hq, d] (the caller converts and rounds the result to q's dtype);
// the metadata's dtypes and shapes are checked by the caller (reference checks).
at::Tensor paged_window_attention(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_table_in, const at::Tensor& positions_in,
                                  const at::Tensor& seq_lens_in, int64_t rows_per_request, int64_t window, bool causal,
                                  double scale, int64_t chunk) {
  for (auto* t : {&q_in, &k_cache, &v_cache, &block_table_in, &positions_in, &seq_lens_in}) check_cpu(*t, "tensor");
  TORCH_CHECK(q_in.scalar_type() == at::kFloat && q_in.dim() == 3, "q: expected float32 [R, num_heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "k_cache, v_cache: expected two [num_blocks, block_size, num_kv_heads, head_dim] tensors of one dtype");
  TORCH_CHECK(block_table_in.scalar_type() == at::kInt && positions_in.scalar_type() == at::kLong &&
                  seq_lens_in.scalar_type() == at::kInt,
              "block_table, positions, seq_lens: expected int32, int64, int32");
  TORCH_CHECK(chunk >= 1 && rows_per_request >= 1 && window >= 1, "chunk, rows_per_request, window: expected >= 1");
  const at::Tensor q = q_in.contiguous(), table = block_table_in.contiguous();
  const at::Tensor positions = positions_in.contiguous(), seq_lens = seq_lens_in.contiguous();
  const int64_t rows = q.size(0), hq = q.size(1);
  TORCH_CHECK(rows % rows_per_request == 0 && q.size(2) == k_cache.size(3) && hq % k_cache.size(2) == 0,
              "q: shape does not match the cache and rows_per_request");
  const int64_t requests = rows / rows_per_request;
  TORCH_CHECK(table.dim() == 2 && table.size(0) == requests && positions.numel() == rows &&
                  seq_lens.numel() == requests,
              "block_table, positions, seq_lens: shapes do not match q");
  at::Tensor out = at::empty({rows, hq, q.size(2)}, q.options());
  if (rows == 0) return out;
  const CacheView cv = view_of(k_cache), vcv = view_of(v_cache);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "paged_window_attention", [&] {
    attention_impl<scalar_t>(q.data_ptr<float>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(), cv, vcv,
                             table.data_ptr<int32_t>(), table.size(1), positions.data_ptr<int64_t>(),
                             seq_lens.data_ptr<int32_t>(), requests, rows_per_request, hq, window, causal,
                             static_cast<float>(scale), chunk, out.data_ptr<float>());
  });
  return out;
}

void write_rows(const at::Tensor& src_in, const at::Tensor& cache, const int64_t* slots, int64_t rows) {
  const at::Tensor src = src_in.contiguous();
  const CacheView cv = view_of(cache);
  const int64_t item = cache.element_size(), row_elems = cv.hkv * cv.d;
  const char* s = static_cast<const char*>(src.data_ptr());
  char* dst = static_cast<char*>(cache.data_ptr());
  const bool dense_row = cv.s3 == 1 && (cv.hkv == 1 || cv.s2 == cv.d);
  for (int64_t i = 0; i < rows; ++i) {
    if (slots[i] < 0) continue;
    const int64_t b = slots[i] / cv.block_size, off = slots[i] % cv.block_size;
    char* base = dst + (b * cv.s0 + off * cv.s1) * item;
    const char* from = s + i * row_elems * item;
    if (dense_row) {
      std::memcpy(base, from, row_elems * item);
      continue;
    }
    for (int64_t h = 0; h < cv.hkv; ++h)
      for (int64_t e = 0; e < cv.d; ++e)
        std::memcpy(base + (h * cv.s2 + e * cv.s3) * item, from + (h * cv.d + e) * item, item);
  }
}

// Copies the rows of k, v with slot >= 0 into the caches (bytes: bit-exact). Every
// slot is checked against the cache before anything is written.
void paged_kv_write(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& slots_in) {
  for (auto* t : {&k, &v, &k_cache, &v_cache, &slots_in}) check_cpu(*t, "tensor");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "k_cache, v_cache: expected one 4-D shape");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k_cache.scalar_type() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "k, v, k_cache, v_cache: expected one dtype");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.size(1) == k_cache.size(2) && k.size(2) == k_cache.size(3),
              "k, v: expected [R, num_kv_heads, head_dim] of the cache");
  TORCH_CHECK(slots_in.scalar_type() == at::kLong && slots_in.numel() == k.size(0), "slots: expected int64 [R]");
  const at::Tensor slots = slots_in.contiguous();
  const int64_t rows = k.size(0), capacity = k_cache.size(0) * k_cache.size(1);
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows; ++i)
    TORCH_CHECK_INDEX(sl[i] < capacity, "paged_kv_write: row ", i, " writes slot ", sl[i], ", outside the cache's ",
                      capacity, " slots");
  write_rows(k, k_cache, sl, rows);
  write_rows(v, v_cache, sl, rows);
}

}  // namespace
}  // namespace torch_bq_cpu_attention

TORCH_BQ_LIBRARY_FRAGMENT(TORCH_BQ_OPS, m) {
  m.def(
      "paged_window_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor positions, "
      "Tensor seq_lens, int rows_per_request, int window, bool causal, float scale, int chunk) -> Tensor",
      &torch_bq_cpu_attention::paged_window_attention);
  m.def("peak_probe(str kind, int iters) -> float", &torch_bq_cpu_attention::peak_probe);
  m.def("paged_kv_write(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> ()",
        &torch_bq_cpu_attention::paged_kv_write);
}
