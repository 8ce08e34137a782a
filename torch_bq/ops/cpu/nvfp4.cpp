// Fast CPU kernel of torch_bq::nvfp4_linear (docs/contract.md §1 and §4; the
// format: torch_bq/formats/nvfp4.py and the NVFP4 descriptor).
//
// Compiled into the same per-ISA-level libraries as kernels.cpp (one more
// translation unit per level: torch_bq/ops/cpu/isa.py), registering into the
// same op namespace with TORCH_LIBRARY_FRAGMENT. kernels.cpp lends it its task
// pool and its prefill GEMM (shared.h); the decoder and the decode tiles are
// NVFP4's own.
//
// Layout and numerics
// -------------------
// A        fp32 [M, K] row-major: qdq_fp8(x) or bf16(x), prepared by torch_bq/ops/cpu/linear.py.
// weight   uint8 [N, ceil(K/2)]: e2m1, element 2j in the low nibble of byte j.
// scale    uint8 [N, ceil(K/16)]: the E4M3FN bytes of the 1x16 block scales.
// scale_2  fp32 scalar, the per-tensor scale.
// out      fp32 [M, N] = sum_k A[m, k] * W[n, k] (+ bias[n]), with
//          W[n, k] = fp32(fp32(e2m1 * e4m3) * scale_2) formed exactly as the
//          reference forms it: the first product is exact, the second is one
//          float32 rounding (to a subnormal, or to inf, wherever the reference's
//          does). Products and sums are fp32; only the summation order differs
//          from the reference (vector lanes, then the tail of a partial block).
//
// The decoder: one table per call, T[c][v] = fp32(fp32(e2m1[v] * e4m3[c]) *
// scale_2) for every scale byte c and nibble v (256 x 16 fp32, 16 KiB, one
// 64-byte row per byte). A weight element is then one lookup, T[scale][nibble],
// bit-identical to the reference's decode for every byte (NaN, negative and
// zero scales included; validation of those is the loader's job). So no
// element is ever rounded twice and there is nothing to guard: the fp8 / MXFP4
// kernels send subnormal-prone calls to fp32 because vdpbf16ps flushes
// subnormals, and an NVFP4 weight is in general not exact in bf16 at all
// (scale_2 is any float32), so these kernels never use bf16 dot products; the
// fp32 FMA keeps subnormal weights and products as IEEE arithmetic does.
//   AVX-512: a block's 16 nibbles index its table row with one vpermps; in the
//         M <= 3 tiles two blocks at a time, one vpermt2ps per 16 elements
//         against an activation whose 32-element pairs are permuted (even
//         elements, then odd) to match the nibble order (Block::decode_pair).
//   AVX2: the row's first 8 entries (nibbles 0-7) with two vpermps of 8; the
//         nibble's bit 3 flips the sign (T[c][v + 8] = -T[c][v] exactly:
//         rounding to nearest is symmetric, -0 and NaN included).
//   generic: scalar lookups.
//
// Decode (M <= decode_max_m): threads take 16-row tasks of W from a shared
// counter; the decoded weight never reaches memory:
//   for n-tile (NT rows): for m-tile (MT rows): for 16-block b:
//     for j < NT: w = T[scale[n + j, b]][nibbles of W[n + j, 16b:16b+16]]
//       for i < MT: acc[i][j] += A[m + i, 16b:16b+16] * w
//   then the partial last block, scalar. Tiles: NT = 4 x MT = M when M <= 3
//   (one A load serves four weight rows), else NT = 2 (AVX-512) or 1 x MT <= 8
//   / 4 rows (one decode serves several A rows). Each output element is summed
//   by one task in a fixed order: the result does not depend on the thread count.
//   The M <= 3 tiles also prefetch the weight rows two tiles ahead (short row
//   streams do not train the hardware prefetchers).
// Prefill (M > decode_max_m): kernels.cpp's prefill path (shared.h:
//   prefill_fp32) with fp32 rows decoded here through the same table.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "isa.h"
#include "shared.h"

#if defined(TORCH_BQ_AVX2)
#include <immintrin.h>
#endif

namespace torch_bq_cpu_nvfp4 {
namespace {

constexpr int64_t kBlock = 16;  // elements per block scale (the NVFP4 descriptor's 1x16)
constexpr int64_t kBlockBytes = kBlock / 2;

// T[c * 16 + v], see the file comment. Rows are 64-byte aligned (one vector load).
struct alignas(64) ValueTable {
  float v[256 * 16];
  explicit ValueTable(float scale_2) {
    const float* e4m3 = torch_bq_cpu_shared::e4m3_values();
    const float* e2m1 = torch_bq_cpu_shared::e2m1_values();
    for (int c = 0; c < 256; ++c)
      for (int n = 0; n < 16; ++n) {
        const float block = e2m1[n] * e4m3[c];  // exact: 2 x 4 significant bits
        v[c * 16 + n] = block * scale_2;        // the one rounding, as the reference does it
      }
  }
};

struct Weight {
  const float* table;     // ValueTable::v
  const uint8_t* data;    // [N, row_bytes]
  const uint8_t* scale;   // [N, nblocks]
  int64_t row_bytes, nblocks, K;
  float element(int64_t n, int64_t k) const {
    const uint8_t byte = data[n * row_bytes + (k >> 1)];
    return table[scale[n * nblocks + k / kBlock] * 16 + ((byte >> ((k & 1) * 4)) & 0x0F)];
  }
};

// --------------------------------------------------------------------------
// one 16-element block: decode, multiply-add, reduce (per ISA)
// --------------------------------------------------------------------------

#if defined(TORCH_BQ_AVX512)
struct Block {
  static constexpr const char* kIsa = "avx512";
  static constexpr int kMaxMT = 8, kWideNT = 2;  // NT x MT = 16 of 32 registers
  using W = __m512;
  using Acc = __m512;
  static Acc zero() { return _mm512_setzero_ps(); }
  // vpermps reads index bits 0-3 only, so the byte's other nibble may stay in bits 4-7.
  static W decode(const float* table, const uint8_t* bytes, uint8_t code) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes));
    const __m128i nibbles = _mm_unpacklo_epi8(b, _mm_srli_epi16(b, 4));  // element order
    return _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(nibbles), _mm512_load_ps(table + code * 16));
  }
  // Two blocks (16 bytes) in split order, for an activation permuted to match
  // (split_pairs): `even` holds the low nibbles (lanes 0-7: elements 0, 2, .., 14
  // of block 0; lanes 8-15: of block 1), `odd` the high ones. One vpermt2ps per
  // 16 elements looks both blocks' rows up (index bit 4: the second block).
  static constexpr bool kPairs = true;
  static void decode_pair(const float* table, const uint8_t* bytes, const uint8_t* codes, W& even, W& odd) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
    const __m512i second = _mm512_maskz_set1_epi32(0xFF00, 16);
    // (b & 15) | second
    const __m512i index_even = _mm512_ternarylogic_epi32(b, _mm512_set1_epi32(0x0F), second, 0xEA);
    const __m512i index_odd = _mm512_or_si512(_mm512_srli_epi32(b, 4), second);
    const __m512 t0 = _mm512_load_ps(table + codes[0] * 16), t1 = _mm512_load_ps(table + codes[1] * 16);
    even = _mm512_permutex2var_ps(t0, index_even, t1);
    odd = _mm512_permutex2var_ps(t0, index_odd, t1);
  }
  static void fma(const float* a, const W& w, Acc& acc) { acc = _mm512_fmadd_ps(_mm512_loadu_ps(a), w, acc); }
  static void store(float* dst, const W& w) { _mm512_storeu_ps(dst, w); }
  static Acc add(const Acc& x, const Acc& y) { return _mm512_add_ps(x, y); }
  static float sum(const Acc& acc) { return _mm512_reduce_add_ps(acc); }
  static void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
};
#elif defined(TORCH_BQ_AVX2)
struct Block {
  static constexpr const char* kIsa = "avx2";
  static constexpr int kMaxMT = 4, kWideNT = 1;  // 2 x MT accumulators of 16 registers
  static constexpr bool kPairs = false;
  struct W {
    __m256 lo, hi;
  };
  using Acc = W;
  static Acc zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static __m256 lookup(__m256 row, __m256i index) {
    // vpermps reads index bits 0-2; bit 3 (the nibble's sign) moved to bit 31 flips the sign.
    const __m256i sign_bit = _mm256_set1_epi32(static_cast<int>(0x80000000u));
    const __m256i sign = _mm256_and_si256(_mm256_slli_epi32(index, 28), sign_bit);
    return _mm256_xor_ps(_mm256_permutevar8x32_ps(row, index), _mm256_castsi256_ps(sign));
  }
  static W decode(const float* table, const uint8_t* bytes, uint8_t code) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes));
    const __m128i nibbles = _mm_unpacklo_epi8(b, _mm_srli_epi16(b, 4));  // element order, bits 4-7 ignored
    const __m256 row = _mm256_load_ps(table + code * 16);
    return {lookup(row, _mm256_cvtepu8_epi32(nibbles)), lookup(row, _mm256_cvtepu8_epi32(_mm_srli_si128(nibbles, 8)))};
  }
  static void fma(const float* a, const W& w, Acc& acc) {
    acc.lo = _mm256_fmadd_ps(_mm256_loadu_ps(a), w.lo, acc.lo);
    acc.hi = _mm256_fmadd_ps(_mm256_loadu_ps(a + 8), w.hi, acc.hi);
  }
  static void store(float* dst, const W& w) {
    _mm256_storeu_ps(dst, w.lo);
    _mm256_storeu_ps(dst + 8, w.hi);
  }
  static float sum(const Acc& acc) {
    const __m256 v = _mm256_add_ps(acc.lo, acc.hi);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
};
#else
struct Block {
  static constexpr const char* kIsa = "generic";
  static constexpr int kMaxMT = 4, kWideNT = 1;
  static constexpr bool kPairs = false;
  struct W {
    float v[kBlock];
  };
  using Acc = W;
  static Acc zero() { return Acc{}; }
  static W decode(const float* table, const uint8_t* bytes, uint8_t code) {
    W w;
    const float* row = table + code * 16;
    for (int i = 0; i < kBlockBytes; ++i) {
      w.v[2 * i] = row[bytes[i] & 0x0F];
      w.v[2 * i + 1] = row[bytes[i] >> 4];
    }
    return w;
  }
  // Without FMA hardware a product is rounded before the add: still one of the
  // K + 1 roundings per term the contract allows.
  static void fma(const float* a, const W& w, Acc& acc) {
    for (int i = 0; i < kBlock; ++i) acc.v[i] += a[i] * w.v[i];
  }
  static void store(float* dst, const W& w) { std::copy(w.v, w.v + kBlock, dst); }
  static float sum(const Acc& acc) {
    float s = 0.0f;
    for (int i = 0; i < kBlock; ++i) s += acc.v[i];
    return s;
  }
};
#endif

// --------------------------------------------------------------------------
// decode path: out[m0:m0+MT, n0:n0+NT] for one tile
// --------------------------------------------------------------------------

// A [M, K] with every full 32-element pair of blocks reordered as decode_pair
// reads it: elements 0, 2, .., 30 of the pair, then 1, 3, .., 31 (the rest as is).
std::vector<float> split_pairs(const float* A, int64_t M, int64_t K) {
  std::vector<float> split(A, A + M * K);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k0 = 0; k0 + 2 * kBlock <= K; k0 += 2 * kBlock)
      for (int i = 0; i < kBlock; ++i) {
        split[m * K + k0 + i] = A[m * K + k0 + 2 * i];
        split[m * K + k0 + kBlock + i] = A[m * K + k0 + 2 * i + 1];
      }
  return split;
}

// A: split_pairs(A) where kPairs (its partial last pair, read here in element order, is as is).
// The pair decoder runs in the decode-bound tiles only (NT = 4, M <= 3; measured faster there,
// slower than one block at a time when several A rows share each decode).
template <int NT>
constexpr bool kPairs = Block::kPairs && NT == 4;

template <int MT, int NT>
void tile(const Weight& w, const float* A, int64_t m0, int64_t n0, float* out, int64_t N) {
  const int64_t K = w.K, full = K / kBlock;
  const uint8_t* rows[NT];
  const uint8_t* srows[NT];
  for (int j = 0; j < NT; ++j) {
    rows[j] = w.data + (n0 + j) * w.row_bytes;
    srows[j] = w.scale + (n0 + j) * w.nblocks;
  }
  const float* arows[MT];
  for (int i = 0; i < MT; ++i) arows[i] = A + (m0 + i) * K;
  typename Block::Acc acc[MT][NT];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) acc[i][j] = Block::zero();
  int64_t b = 0;
#if defined(TORCH_BQ_AVX512)  // (Block's pair members exist only there)
  if constexpr (kPairs<NT>) {
    // Few accumulators: a second set (the odd halves) halves the FMA dependency chains.
    constexpr bool kTwo = MT * NT <= 8;
    typename Block::Acc odd_acc[MT][NT];
    for (int i = 0; i < MT; ++i)
      for (int j = 0; j < NT; ++j) odd_acc[i][j] = Block::zero();
    // The weight streams in NT short rows, too short for the hardware prefetchers
    // to ramp up: prefetch the rows two tiles ahead (contiguous with these) at the
    // rate these are read, as kernels.cpp's decode tiles do.
    const uint8_t* ahead = w.data + std::min(n0 + 2 * NT, N - 1) * w.row_bytes;
    for (int64_t pair = 0; pair < K / (2 * kBlock); ++pair) {
      if (((pair * NT * kBlock) & 63) < NT * kBlock) Block::prefetch(ahead + pair * NT * kBlock);
      for (int j = 0; j < NT; ++j) {
        typename Block::W even, odd;
        Block::decode_pair(w.table, rows[j] + pair * kBlock, srows[j] + 2 * pair, even, odd);
        for (int i = 0; i < MT; ++i) {
          Block::fma(arows[i] + pair * 2 * kBlock, even, acc[i][j]);
          Block::fma(arows[i] + pair * 2 * kBlock + kBlock, odd, kTwo ? odd_acc[i][j] : acc[i][j]);
        }
      }
    }
    if constexpr (kTwo)
      for (int i = 0; i < MT; ++i)
        for (int j = 0; j < NT; ++j) acc[i][j] = Block::add(acc[i][j], odd_acc[i][j]);
    b = K / (2 * kBlock) * 2;
  }
#endif
  for (; b < full; ++b) {
    for (int j = 0; j < NT; ++j) {
      const typename Block::W wv = Block::decode(w.table, rows[j] + b * kBlockBytes, srows[j][b]);
      for (int i = 0; i < MT; ++i) Block::fma(arows[i] + b * kBlock, wv, acc[i][j]);
    }
  }
  float total[MT][NT];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) total[i][j] = Block::sum(acc[i][j]);
  for (int64_t k = full * kBlock; k < K; ++k) {  // the partial last block (its bytes may end the tensor)
    for (int j = 0; j < NT; ++j) {
      const float wv = w.element(n0 + j, k);
      for (int i = 0; i < MT; ++i) total[i][j] += arows[i][k] * wv;
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) out[(m0 + i) * N + n0 + j] = total[i][j];
}

// All M rows against weight rows [n0, n0 + NT): row tiles of near-equal height <= kMaxMT.
template <int NT>
void rows_tile(const Weight& w, const float* A, int64_t M, int64_t n0, float* out, int64_t N) {
  constexpr int kMaxMT = NT == 4 ? 3 : Block::kMaxMT;
  const int64_t tiles = (M + kMaxMT - 1) / kMaxMT;
  int64_t m0 = 0;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t mt = (M - m0) / (tiles - t);
    switch (mt) {
#define TORCH_BQ_NVFP4_TILE(R)            \
  case R:                                 \
    if constexpr (R <= kMaxMT) {          \
      tile<R, NT>(w, A, m0, n0, out, N);  \
    }                                     \
    break;
      TORCH_BQ_NVFP4_TILE(1) TORCH_BQ_NVFP4_TILE(2) TORCH_BQ_NVFP4_TILE(3) TORCH_BQ_NVFP4_TILE(4)
      TORCH_BQ_NVFP4_TILE(5) TORCH_BQ_NVFP4_TILE(6) TORCH_BQ_NVFP4_TILE(7) TORCH_BQ_NVFP4_TILE(8)
#undef TORCH_BQ_NVFP4_TILE
      default: break;
    }
    m0 += mt;
  }
}

void decode_linear(const Weight& w, const float* A, int64_t M, int64_t N, float* out) {
  constexpr int64_t kRowsPerTask = 16;  // a multiple of every NT
  std::vector<float> split;
  if (kPairs<4> && M <= 3) split = split_pairs(A, M, w.K);  // the rows the NT = 4 tiles read
  const float* a = split.empty() ? A : split.data();
  torch_bq_cpu_shared::run_tasks((N + kRowsPerTask - 1) / kRowsPerTask, [&](int64_t t) {
    const int64_t n_end = std::min(N, (t + 1) * kRowsPerTask);
    int64_t n = t * kRowsPerTask;
    if (M <= 3) {
      for (; n + 4 <= n_end; n += 4) rows_tile<4>(w, a, M, n, out, N);
      for (; n < n_end; ++n) rows_tile<1>(w, A, M, n, out, N);
      return;
    }
    if constexpr (Block::kWideNT == 2)
      for (; n + 2 <= n_end; n += 2) rows_tile<2>(w, A, M, n, out, N);
    for (; n < n_end; ++n) rows_tile<1>(w, A, M, n, out, N);
  });
}

// --------------------------------------------------------------------------
// prefill path: fp32 rows for kernels.cpp's GEMM
// --------------------------------------------------------------------------

class Rows final : public torch_bq_cpu_shared::RowDecoder {
 public:
  explicit Rows(const Weight& w) : w_(w) {}
  int64_t chunk_align() const override { return kBlock; }
  void fp32(int64_t n, int64_t k0, int64_t k1, float* dst) const override {
    const uint8_t* row = w_.data + n * w_.row_bytes;
    const uint8_t* srow = w_.scale + n * w_.nblocks;
    int64_t k = k0;  // a block start (chunk_align)
    for (; k + kBlock <= std::min(k1, w_.K / kBlock * kBlock); k += kBlock)
      Block::store(dst + (k - k0), Block::decode(w_.table, row + k / 2, srow[k / kBlock]));
    for (; k < k1; ++k) dst[k - k0] = w_.element(n, k);
  }

 private:
  const Weight& w_;
};

// --------------------------------------------------------------------------
// op body
// --------------------------------------------------------------------------

void check(bool ok, const char* what) { TORCH_CHECK(ok, "torch_bq_cpu: nvfp4_linear: ", what); }

at::Tensor nvfp4_linear(const at::Tensor& a, const at::Tensor& weight, const at::Tensor& weight_scale,
                        const at::Tensor& weight_scale_2, const std::optional<at::Tensor>& bias, int64_t decode_max_m,
                        int64_t panel_bytes) {
  check(a.dim() == 2 && a.scalar_type() == at::kFloat && a.is_contiguous(), "a must be contiguous fp32 [M, K]");
  check(weight.dim() == 2 && weight.scalar_type() == at::kByte && weight.is_contiguous(),
        "weight must be contiguous uint8 [N, ceil(K/2)]");
  check(weight_scale.dim() == 2 && weight_scale.scalar_type() == at::kByte && weight_scale.is_contiguous(),
        "weight_scale must be contiguous uint8 (E4M3FN bytes) [N, ceil(K/16)]");
  check(weight_scale_2.scalar_type() == at::kFloat && weight_scale_2.numel() == 1, "weight_scale_2 must be one fp32");
  const int64_t M = a.size(0), K = a.size(1), N = weight.size(0);
  check(weight.size(1) == (K + 1) / 2, "weight row length does not match K");
  check(weight_scale.size(0) == N && weight_scale.size(1) == (K + kBlock - 1) / kBlock,
        "weight_scale shape does not match [N, ceil(K/16)]");
  if (bias.has_value())
    check(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == N, "bias must be fp32 [N]");

  at::Tensor out = at::empty({M, N}, a.options());
  if (M > 0 && N > 0) {
    const ValueTable table(weight_scale_2.contiguous().data_ptr<float>()[0]);
    const Weight w{table.v, weight.data_ptr<uint8_t>(), weight_scale.data_ptr<uint8_t>(), weight.size(1),
                   weight_scale.size(1), K};
    if (M <= decode_max_m)
      decode_linear(w, a.data_ptr<float>(), M, N, out.data_ptr<float>());
    else
      torch_bq_cpu_shared::prefill_fp32(Rows(w), a, N, panel_bytes, out);
  }
  if (bias.has_value()) out.add_(*bias);  // one fp32 add before the single final rounding
  return out;
}

// The decode kernels this build runs for NVFP4 (torch_bq/ops/cpu/linear.py: DECODE_MAX_M["nvfp4"]).
std::string nvfp4_decode_isa() { return Block::kIsa; }

}  // namespace
}  // namespace torch_bq_cpu_nvfp4

TORCH_BQ_LIBRARY_FRAGMENT(TORCH_BQ_OPS, m) {
  m.def(
      "nvfp4_linear(Tensor a, Tensor weight, Tensor weight_scale, Tensor weight_scale_2, Tensor? bias, "
      "int decode_max_m, int panel_bytes) -> Tensor",
      &torch_bq_cpu_nvfp4::nvfp4_linear);
  m.def("nvfp4_decode_isa() -> str", &torch_bq_cpu_nvfp4::nvfp4_decode_isa);
}
