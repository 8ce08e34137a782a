// Fast CPU kernels for torch_bq: block-scaled fp8 / MXFP4 linear and the fp8
// activation quant-dequant (docs/contract.md §3-4).
//
// Built once per instruction-set level (torch_bq/ops/cpu/isa.py: generic,
// avx2, avx512, avx512_bf16), each time from this file with that level's -m
// flags: at install time by setup.py, or at first use by
// torch_bq/ops/_backend.py when the installed libraries are missing. Which
// code a build contains follows from the compiler's own target macros
// (TORCH_BQ_AVX2 / TORCH_BQ_AVX512 / TORCH_BQ_AVX512_BF16 below), never from
// the build machine's CPU; _backend picks the library to load from the CPU it
// runs on. Each level registers its own internal op namespace
// `torch.ops.torch_bq_cpu_<level>.*`, so several can live in one process; the
// public `torch_bq::` ops call them from torch_bq/ops/cpu/linear.py: the
// one-call entry points fp8_linear_op / fp4_linear_op (section "public-op
// entry points": the op's own operands in, its result out), or, for calls
// those refuse, the kernels below on inputs linear.py prepared (A as fp32
// [M, K], weight bytes, scale codes).
//
// Layout and numerics
// -------------------
// A      fp32 [M, K] row-major: qdq_fp8(x) or bf16(x), already exact in fp32.
// weight fp8: uint8 [N, K] E4M3FN bytes; fp4: uint8 [N, ceil(K/2)], element 2j
//        in the low nibble of byte j.
// scale  [ceil(N/bn), ceil(K/bk)] uint8 e8m0 codes or fp32 multipliers
//        (fp4: bn = 1, bk = 32, codes only).
// out    fp32 [M, N] = sum_k A[m,k] * (w[n,k] * s[n/bn, k/bk]) (+ bias[n]).
//        Every weight element is formed as one fp32 product value * scale,
//        exactly as the reference does; products and sums are fp32; only the
//        summation order differs from the reference (8 lanes, then a tail).
//
// Decode (M <= decode_max_m): threads take 16-row tasks of W from a shared
//   counter and decode 16 weight elements at a time into registers inside
//   the dot product; the decoded weight never reaches memory:
//     for n-tile (NT rows): for m-tile (MT rows): for k-block b: s = scale[n/bn, b]
//       for 16-wide chunk: w = decode16(W[n, k:k+16]) * s; acc[m][n] += A[m, k:k+16] * w
//   Tiles: NT = 4 weight rows x MT = M activation rows when M <= 3 (decode-
//   bound: one A load serves four rows), else NT = 1 x MT <= 8 in row tiles
//   of near-equal height (FMA-bound: one decode serves up to eight rows).
//   MXFP4 on the AVX2 int path (below) instead: NT = 4 at M <= 2, from M = 3
//   NT = 1 x MT <= 4.
//   Single-row tiles with e8m0 scales factor the (power-of-two) scale out of
//   each block's partial sum, which is exact.
//   With 32-wide e8m0 blocks, tiles of every shape run the F16C-free
//   whole-block loops against a copy of A permuted to the order their
//   decoders produce (so no decoder interleaves): fp8_blocks32, one block
//   per iteration (scales up to 2**7; the rest of the row falls back to the
//   general loop at a larger one), and fp4_groups64, two blocks per
//   iteration. The general loop takes block remainders and other scales.
//   Each output element is produced by one task in a fixed order, so the
//   result does not depend on the thread count.
//   With AVX-512 BF16 (TORCH_BQ_AVX512_BF16), 32-wide e8m0 blocks take the
//   bf16 dot-product kernels instead: section "decode path, AVX-512 BF16".
// Prefill (M > decode_max_m): tasks of 96 (AVX512_BF16) or 64 rows of W
//   dequantize K chunks of their rows into an L2-resident panel and multiply
//   it with A in fp32 accumulators: torch_bq's vdpbf16ps tiles with AVX512_BF16,
//   oneDNN's fp32 brgemm microkernel otherwise, at::mm in the generic build
//   (section "prefill path"). Extra memory: per task the panel and an
//   [Nt, M] fp32 tile, per call a bf16 copy of A; independent of N*K.
//
// Vector decoding (AVX2 + F16C):
//   fp8: sign-extend byte to int16, shift left 7, keep sign and bits 7..13 ->
//        an fp16 whose value is e4m3(b) / 2**8 (E4M3 subnormals map to fp16
//        subnormals, which vcvtph2ps converts exactly). The 2**8 goes into the
//        block scale when that stays finite; blocks whose scale * 2**8
//        overflows take the scalar path.
//        Whole 32-wide e8m0 blocks use integer ops only: the magnitude bits
//        shifted 4 to the right within a 16-bit word, the sign kept in bit
//        15, are the bf16 encoding of e4m3(b) * 2**-120 (subnormals exact);
//        a bf16 word is an fp32 after one shift or mask; times the block
//        scale * 2**120 (Fp8Format::decode32_bf16). Needs MXCSR.DAZ clear
//        (checked per tile: torch.set_flush_denormal(True) sets it), else
//        the F16C decoder runs.
//   fp4: nibble -> high byte of the fp16 encoding of its e2m1 value via
//        vpshufb (the low byte is always 0), then vcvtph2ps (block
//        remainders only). Whole 64-groups avoid F16C (the M = 1 limit):
//        two vpshufb give both bytes of the bf16 encoding, and a bf16 word
//        is an fp32 after one shift or mask (Fp4Format::decode64_bf16).
//        At M <= 28 (kFp4IntMaxM, the avx2 decode limit) whole 64-groups
//        take exact int16 dot products instead: vpshufb gives W * 2 as int8,
//        vpmaddwd multiplies it with A * 2**t held as int16 per block
//        (fp4_groups64_int).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/EmptyTensor.h>
#include <ATen/native/CPUBlas.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <exception>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <unistd.h>

// The ISA level macros (TORCH_BQ_AVX2, TORCH_BQ_AVX512, TORCH_BQ_AVX512_BF16, TORCH_BQ_OPS):
// one header, shared with attention.cpp.
#include "isa.h"
// What this file lends nvfp4.cpp (the task pool, the prefill GEMM): end of file.
#include "shared.h"

#if defined(TORCH_BQ_AVX2)
#include <immintrin.h>
#endif

namespace torch_bq_cpu {
namespace {

#if defined(TORCH_BQ_AVX2)
// Software prefetch of the weight stream ahead of the decode tiles: into L2
// (T1), not L1. A T0 prefetch holds one of the L1's few miss buffers until its
// line arrives from memory, so at memory latency those capped the stream: on a
// Zen 4 (2 vCPUs, 1 thread, cold cache) a 4096 x 4096 fp8 weight streamed at
// about 11 GB/s of the core's 27 GB/s, and M = 1 took twice its warm-cache
// time. With T1 the same calls took 0.48-0.84x the time (fp8, five shapes;
// fp4 0.59-1.02x; AVX2 level fp8 0.60-0.79x; in-process A/B, 9 rounds): the
// L1 misses that remain hit L2 (docs/benchmarks.md, stop 24).
inline void prefetch_weights(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }
#endif

inline float f32_from_bits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

// p rounded up to the next 64-byte boundary (callers leave that much room).
template <class T>
inline T* cache_line_aligned(T* p) {
  return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63));
}

inline uint32_t bits_from_f32(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

// torch's float -> bfloat16 (round to nearest even; NaN -> 0x7FC0).
inline uint16_t bf16_rne(float f) {
  if (std::isnan(f)) return 0x7FC0;
  const uint32_t b = bits_from_f32(f);
  return static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

#if defined(TORCH_BQ_AVX512)
// bf16_rne on 16 lanes (vcvtneps2bf16 would flush subnormals, which torch keeps).
inline __m256i bf16_rne16(__m512 x) {
  const __m512i b = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}
#endif

// Exact decode tables (docs/contract.md §1).
struct Tables {
  float e8m0[256];
  float e4m3[256];
  float fp4[16];
  Tables() {
    const float nan = std::numeric_limits<float>::quiet_NaN();
    for (int c = 0; c < 256; ++c) {
      // Code 0 is 2**-127, an fp32 subnormal; codes 1..254 are normal floats.
      e8m0[c] = c == 255 ? nan : c == 0 ? f32_from_bits(0x00400000u) : f32_from_bits(uint32_t(c) << 23);
      const int e = (c >> 3) & 15, m = c & 7;
      float mag = e == 0 ? std::ldexp(float(m), -9) : std::ldexp(float(8 + m), e - 10);
      if ((c & 0x7F) == 0x7F) mag = nan;
      e4m3[c] = (c & 0x80) ? -mag : mag;
    }
    const float v[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    for (int i = 0; i < 8; ++i) {
      fp4[i] = v[i];
      fp4[i + 8] = -v[i];
    }
  }
};
const Tables kTables;

inline float scale_value(const uint8_t* s, int64_t i) { return kTables.e8m0[s[i]]; }
inline float scale_value(const float* s, int64_t i) { return s[i]; }

// --------------------------------------------------------------------------
// weight formats: scalar decode of element k, vector decode of 16 elements
// --------------------------------------------------------------------------

struct Fp8Format {
  // The vector decoder yields value / 2**8 (see the file comment).
  static constexpr float kVectorFactor = 256.0f;
  static int64_t row_bytes(int64_t k) { return k; }
  static float scalar(const uint8_t* row, int64_t k) { return kTables.e4m3[row[k]]; }
#if defined(TORCH_BQ_AVX2)
  static void decode16(const uint8_t* row, int64_t k, __m256& lo, __m256& hi) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k));
    __m256i h = _mm256_cvtepi8_epi16(b);
    h = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16(static_cast<short>(0xBF80)));
    lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
  }
  // 32 elements (one 32-wide block) without F16C, as value * 2**-120: an
  // E4M3 byte's magnitude bits shifted 4 to the right within a 16-bit word
  // (the high byte by an arithmetic shift that keeps its sign in bit 15, the
  // low byte moved up first) are the bf16 encoding of e4m3(b) * 2**-120
  // (both biases differ by 120; E4M3 subnormals become bf16 subnormals,
  // exact), and a bf16 word becomes an fp32 with one shift or mask. Integer
  // ops only, 9 per 32 elements; v[i] lane d holds element 4 d + i
  // (permute_activation_blocks32). One multiply by the block scale * 2**120
  // then forms the weight element e4m3(b) * s exactly, as the reference does.
  static void decode32_bf16(const uint8_t* p, __m256 (&v)[4]) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i keep = _mm256_set1_epi16(static_cast<short>(0x87F0));
    const __m256i high_words = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    const __m256i odd = _mm256_and_si256(_mm256_srai_epi16(b, 4), keep);
    const __m256i even = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(b, 8), 4), keep);
    v[0] = _mm256_castsi256_ps(_mm256_slli_epi32(even, 16));
    v[1] = _mm256_castsi256_ps(_mm256_slli_epi32(odd, 16));
    v[2] = _mm256_castsi256_ps(_mm256_and_si256(even, high_words));
    v[3] = _mm256_castsi256_ps(_mm256_and_si256(odd, high_words));
  }
#endif
};

struct Fp4Format {
  static constexpr float kVectorFactor = 1.0f;
  static int64_t row_bytes(int64_t k) { return (k + 1) / 2; }
  static float scalar(const uint8_t* row, int64_t k) {
    return kTables.fp4[(row[k >> 1] >> ((k & 1) * 4)) & 0x0F];
  }
#if defined(TORCH_BQ_AVX2)
  // k is even (chunks start at multiples of 16 within 32-wide blocks).
  static void decode16(const uint8_t* row, int64_t k, __m256& lo, __m256& hi) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + (k >> 1)));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i nib_lo = _mm_and_si128(b, mask);
    const __m128i nib_hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    const __m128i nib = _mm_unpacklo_epi8(nib_lo, nib_hi);  // element order
    // High byte of the fp16 encoding of each e2m1 value; the low byte is 0.
    const __m128i lut = _mm_setr_epi8(0x00, 0x38, 0x3C, 0x3E, 0x40, 0x42, 0x44, 0x46, char(0x80), char(0xB8),
                                      char(0xBC), char(0xBE), char(0xC0), char(0xC2), char(0xC4), char(0xC6));
    const __m128i hb = _mm_shuffle_epi8(lut, nib);
    const __m128i zero = _mm_setzero_si128();
    lo = _mm256_cvtph_ps(_mm_unpacklo_epi8(zero, hb));
    hi = _mm256_cvtph_ps(_mm_unpackhi_epi8(zero, hb));
  }
  // Two 32-element blocks (32 bytes, one per 128-bit lane) to 64 fp32 values
  // without F16C: two vpshufb lookups per nibble give the high and low byte
  // of the bf16 (= upper half of the fp32) encoding of each e2m1 value, one
  // byte unpack pairs them into bf16 words, and each word becomes an fp32
  // with one integer op (shift left 16 for even words, mask for odd ones).
  // 1 load + 3 + 4 + 4 + 8 vector ops per 64 elements, no conversions; the
  // values come out in a fixed order that the caller's activation is
  // permuted to (group64_element).
  static void decode64_bf16(const uint8_t* p, __m256 (&w)[8]) {
    // bytes 2 and 3 of the fp32 encoding of e2m1 codes 0..15 (sign in bit 3; -0 for code 8)
    const __m256i lb = _mm256_setr_epi8(0, 0, char(0x80), char(0xC0), 0, 0x40, char(0x80), char(0xC0), 0, 0,
                                        char(0x80), char(0xC0), 0, 0x40, char(0x80), char(0xC0), 0, 0, char(0x80),
                                        char(0xC0), 0, 0x40, char(0x80), char(0xC0), 0, 0, char(0x80), char(0xC0), 0,
                                        0x40, char(0x80), char(0xC0));
    const __m256i hb = _mm256_setr_epi8(0, 0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40, char(0x80), char(0xBF),
                                        char(0xBF), char(0xBF), char(0xC0), char(0xC0), char(0xC0), char(0xC0), 0,
                                        0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40, char(0x80), char(0xBF), char(0xBF),
                                        char(0xBF), char(0xC0), char(0xC0), char(0xC0), char(0xC0));
    const __m256i mask = _mm256_set1_epi8(0x0F);
    const __m256i high_words = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i lo = _mm256_and_si256(b, mask), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), mask);
    const __m256i lo_l = _mm256_shuffle_epi8(lb, lo), lo_h = _mm256_shuffle_epi8(hb, lo);
    const __m256i hi_l = _mm256_shuffle_epi8(lb, hi), hi_h = _mm256_shuffle_epi8(hb, hi);
    const __m256i words[4] = {_mm256_unpacklo_epi8(lo_l, lo_h), _mm256_unpackhi_epi8(lo_l, lo_h),
                              _mm256_unpacklo_epi8(hi_l, hi_h), _mm256_unpackhi_epi8(hi_l, hi_h)};
    for (int i = 0; i < 4; ++i) {
      w[2 * i] = _mm256_castsi256_ps(_mm256_slli_epi32(words[i], 16));
      w[2 * i + 1] = _mm256_castsi256_ps(_mm256_and_si256(words[i], high_words));
    }
  }
  // Which element of its block register w[i], lane l of decode64_bf16 holds
  // (lanes 0-3: the first block, 4-7: the second): words[i / 2] holds, per
  // 128-bit lane, the low (i < 4) or high nibbles of bytes 0-7 or 8-15 in
  // order; even words are w[2j], odd ones w[2j + 1].
  static constexpr int group64_element(int i, int l) {
    return (l / 4) * 32 + (i / 4) + 16 * ((i / 2) % 2) + 2 * (i % 2) + 4 * (l % 4);
  }
#endif
};

#if defined(TORCH_BQ_AVX2)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The block scale times the vector decoder's factor (2**8 for fp8), and
// whether the vector path may use it: false when the product would overflow
// although the decoded values do not (scale near 2**127); such blocks take
// the scalar path. e8m0 codes fold exactly: (c + 8) << 23 is 2**(c - 127 + 8),
// code 0 (2**-127) included.
template <class Fmt>
inline float folded_scale(const uint8_t* s, int64_t i, bool& ok) {
  const uint32_t code = s[i];
  if constexpr (Fmt::kVectorFactor == 1.0f) {
    return kTables.e8m0[code];  // NaN code 255 stays NaN, as in the reference
  } else {
    static_assert(Fmt::kVectorFactor == 256.0f, "fp8 decodes to value / 2**8");
    ok = ok && code <= 246;
    return f32_from_bits((code + 8) << 23);
  }
}

template <class Fmt>
inline float folded_scale(const float* s, int64_t i, bool& ok) {
  const float folded = s[i] * Fmt::kVectorFactor;
  ok = ok && (std::isfinite(folded) || !std::isfinite(s[i]));
  return folded;
}
#endif

#if defined(TORCH_BQ_AVX2)
// fp8 with 32-wide e8m0 blocks (32x32, 1x32), MT activation rows x NT
// weight rows, one whole block per iteration with the F16C-free decoder
// (Fp8Format::decode32_bf16) against the activation permuted to its order
// (permute_activation_blocks32): per 32 elements 9 integer ops and 4
// multiplies per weight row, then 4 multiply-adds and 2 adds per activation
// row. Covers blocks [0, K/32) and returns the first block it did not
// do: the partial last block, or a block whose scale * 2**120 would overflow
// (code > 134, i.e. a scale above 2**7), which the caller's general loop
// then takes over. Needs MXCSR.DAZ clear (the decoded subnormals are inputs).
template <int MT, int NT>
int64_t fp8_blocks32(const uint8_t* const* rows, const uint8_t* const* scale_rows, const float* const* a_perm,
                     int64_t K, __m256 (&acc)[MT][NT], const uint8_t* ahead) {
  __m256 acc_odd[NT];  // the second chain of each single-row output
  for (int j = 0; j < NT; ++j) acc_odd[j] = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b < K / 32; ++b) {
    uint32_t max_code = 0;
    for (int j = 0; j < NT; ++j) max_code = std::max<uint32_t>(max_code, scale_rows[j][b]);
    if (max_code > 134) break;
    for (int c = 0; c < (NT + 1) / 2; ++c)  // the next rows' share for this block (see dot_tile)
      prefetch_weights(ahead + (b * ((NT + 1) / 2) + c) * 64);
    for (int j = 0; j < NT; ++j) {
      // 2**(code - 127) * 2**120, exact for codes 0..134 (code 0 included).
      const __m256 s = _mm256_set1_ps(f32_from_bits((uint32_t(scale_rows[j][b]) + 120) << 23));
      __m256 v[4];
      Fp8Format::decode32_bf16(rows[j] + b * 32, v);
      for (int e = 0; e < 4; ++e) v[e] = _mm256_mul_ps(v[e], s);
      if constexpr (MT == 1) {  // two chains per output (eight at NT = 4), no adds
        const float* a = a_perm[0] + b * 32;
        acc[0][j] = _mm256_fmadd_ps(_mm256_loadu_ps(a), v[0], acc[0][j]);
        acc_odd[j] = _mm256_fmadd_ps(_mm256_loadu_ps(a + 8), v[1], acc_odd[j]);
        acc[0][j] = _mm256_fmadd_ps(_mm256_loadu_ps(a + 16), v[2], acc[0][j]);
        acc_odd[j] = _mm256_fmadd_ps(_mm256_loadu_ps(a + 24), v[3], acc_odd[j]);
        continue;
      }
      for (int i = 0; i < MT; ++i) {
        // The block's partial sum in two short chains of its own, then one
        // add into the accumulator (on the adder, not the FMA units): the
        // only loop-carried dependency is that add, whatever the tile height.
        const float* a = a_perm[i] + b * 32;
        __m256 p0 = _mm256_mul_ps(_mm256_loadu_ps(a), v[0]);
        __m256 p1 = _mm256_mul_ps(_mm256_loadu_ps(a + 8), v[1]);
        p0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + 16), v[2], p0);
        p1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + 24), v[3], p1);
        acc[i][j] = _mm256_add_ps(acc[i][j], _mm256_add_ps(p0, p1));
      }
    }
  }
  if constexpr (MT == 1)
    for (int j = 0; j < NT; ++j) acc[0][j] = _mm256_add_ps(acc[0][j], acc_odd[j]);
  return b;
}

// M = 1 with each block's scale factored out of its partial sum: per 32
// elements and weight row 2 multiplies and 4 multiply-adds instead of 4
// multiplies and 4 multiply-adds (the single row is decode-bound). The
// activation was multiplied by 2**a_exp when it was permuted
// (scale_for_factoring), so that every product of it and a decoded
// e4m3 * 2**-120 is a normal float, hence exact; each block's partial sum is
// then multiplied by 2**(code - 127 + 120 - a_exp), exact while that is a
// normal float (a stretch of blocks with a code outside that range, or code
// 255, ends the loop, and the caller's general loop takes over from there).
// Two chains per output, as in fp8_blocks32. Needs MXCSR.DAZ clear.
template <int NT>
int64_t fp8_blocks32_factored(const uint8_t* const* rows, const uint8_t* const* scale_rows, const float* a_perm,
                              int64_t K, __m256 (&acc)[1][NT], const uint8_t* ahead, int a_exp) {
  __m256 acc_odd[NT];
  for (int j = 0; j < NT; ++j) acc_odd[j] = _mm256_setzero_ps();
  // code + 120 - a_exp must be a normal exponent field, 1..254; 255 is the NaN code.
  const uint32_t lowest = a_exp > 119 ? uint32_t(a_exp - 119) : 0u;
  const uint32_t highest = std::min<uint32_t>(254, uint32_t(134 + a_exp));
  const uint32_t bias = uint32_t(120 - a_exp);  // modulo 2**32: code + bias is the field
  // The scales of a stretch of blocks are formed (and checked) before its
  // blocks are multiplied, in a loop the compiler vectorizes: per block and
  // row the multiply loop then only broadcasts one (scalar work per block was
  // about a third of the instructions).
  constexpr int64_t kStretch = 128;
  alignas(32) float scales[NT][kStretch];
  const int64_t blocks = K / 32;
  int64_t b0 = 0;
  for (; b0 < blocks; b0 += kStretch) {
    const int64_t n = std::min(kStretch, blocks - b0);
    uint32_t bad = 0;
    for (int j = 0; j < NT; ++j) {
      const uint8_t* codes = scale_rows[j] + b0;
      for (int64_t i = 0; i < n; ++i) {
        const uint32_t code = codes[i];
        bad |= uint32_t(code < lowest) | uint32_t(code > highest);
        scales[j][i] = f32_from_bits((code + bias) << 23);
      }
    }
    if (bad != 0) break;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t b = b0 + i;
      for (int c = 0; c < (NT + 1) / 2; ++c)  // the next rows' share for this block (see dot_tile)
        prefetch_weights(ahead + (b * ((NT + 1) / 2) + c) * 64);
      const float* a = a_perm + b * 32;
      for (int j = 0; j < NT; ++j) {
        const __m256 s = _mm256_broadcast_ss(&scales[j][i]);
        __m256 v[4];
        Fp8Format::decode32_bf16(rows[j] + b * 32, v);
        __m256 p0 = _mm256_mul_ps(_mm256_loadu_ps(a), v[0]);
        __m256 p1 = _mm256_mul_ps(_mm256_loadu_ps(a + 8), v[1]);
        p0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + 16), v[2], p0);
        p1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + 24), v[3], p1);
        acc[0][j] = _mm256_fmadd_ps(p0, s, acc[0][j]);
        acc_odd[j] = _mm256_fmadd_ps(p1, s, acc_odd[j]);
      }
    }
  }
  for (int j = 0; j < NT; ++j) acc[0][j] = _mm256_add_ps(acc[0][j], acc_odd[j]);
  return std::min(b0, blocks);  // a stretch with a code out of range: the caller's loop from there
}

// For fp8_blocks32_factored: multiplies a[0, n) (bf16-exact floats) by 2**e in
// place and returns e, the smallest e >= 0 that makes every nonzero |a| at
// least 2**3 (then its products with decoded weights, at least 2**-129, are
// normal); -1, a unchanged, where a holds a subnormal, an inf or NaN, values
// below 2**-124 (e would exceed 127), or magnitudes too far apart for one e to
// keep the largest finite.
int scale_for_factoring(float* a, int64_t n) {
  uint32_t lowest = 255, highest = 0;
  for (int64_t i = 0; i < n; ++i) {  // branch-free, so that it vectorizes; a zero's field is 0
    const uint32_t bits = bits_from_f32(a[i]) & 0x7FFFFFFFu;
    const uint32_t field = bits >> 23;
    lowest = std::min(lowest, bits != 0 ? field : 255u);
    highest = std::max(highest, field);
  }
  if (highest == 0 && lowest == 255) return 0;  // all zero
  if (lowest == 0 || highest == 255) return -1;
  const int e = std::max(0, 130 - int(lowest));
  if (e > 127 || int(highest) + e > 254) return -1;  // 2**e itself must be a float
  const float factor = f32_from_bits(uint32_t(127 + e) << 23);
  for (int64_t i = 0; i < n; ++i) a[i] *= factor;
  return e;
}

// The partial sum of one decoded 64-group (Fp4Format::decode64_bf16) against
// its activation in the same order, per lane (lanes 0-3: the first block,
// 4-7: the second); two chains: the FMA latency, not its throughput, would
// bound one.
inline __m256 group64_dot(const __m256 (&w)[8], const float* a) {
  __m256 p0 = _mm256_mul_ps(_mm256_loadu_ps(a), w[0]);
  __m256 p1 = _mm256_mul_ps(_mm256_loadu_ps(a + 8), w[1]);
  for (int e = 2; e < 8; e += 2) {
    p0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + 8 * e), w[e], p0);
    p1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + 8 * e + 8), w[e + 1], p1);
  }
  return _mm256_add_ps(p0, p1);
}

// The e8m0 scales of a 64-group's two blocks (codes s[0], s[1]) in group64_dot's lanes.
inline __m256 group64_scales(const uint8_t* s) {
  return _mm256_set_m128(_mm_set1_ps(kTables.e8m0[s[1]]), _mm_set1_ps(kTables.e8m0[s[0]]));
}

// MXFP4, MT activation rows x NT weight rows: two whole blocks (64
// elements) per iteration with the bf16-pattern decoder, against the
// activation permuted to its output order (permute_activation_groups64).
// Each weight group is decoded once for all MT rows; each block's e8m0 scale
// is factored out of its partial sum (exact for a power of two), both
// blocks' scales in one register (lanes 0-3 and 4-7): MT multiply-adds per
// group where scaling the decoded weights would take 8 multiplies. Covers blocks
// [0, 2 * (K / 64)); the caller's general loop takes the rest.
template <int MT, int NT>
int64_t fp4_groups64(const uint8_t* const* rows, const uint8_t* const* scale_rows, const float* const* a_perm,
                     int64_t K, __m256 (&acc)[MT][NT], const uint8_t* ahead) {
  const int64_t groups = K / 64;
  for (int64_t g = 0; g < groups; ++g) {
    for (int c = 0; c < (NT + 1) / 2; ++c)  // the next rows' share for this group (see dot_tile)
      prefetch_weights(ahead + (g * ((NT + 1) / 2) + c) * 64);
    for (int j = 0; j < NT; ++j) {
      __m256 w[8];
      Fp4Format::decode64_bf16(rows[j] + g * 32, w);
      const __m256 sv = group64_scales(scale_rows[j] + 2 * g);
      for (int i = 0; i < MT; ++i) acc[i][j] = _mm256_fmadd_ps(group64_dot(w, a_perm[i] + g * 64), sv, acc[i][j]);
    }
  }
  return 2 * groups;
}

// MXFP4 at M = 1 and 2 through exact int16 dot products (the avx2 and avx512
// levels; AVX-512 BF16 has its own kernels). A qdq'd activation block is
// e4m3 values times one power of two (docs/contract.md §3), so within a
// block A * 2**t is usually a vector of integers below 2**15 for one t; e2m1
// values times 2 are the integers 0, 1, 2, 3, 4, 6, 8, 12 with a sign. One
// vpshufb turns the nibbles into int8 W * 2, a 16-bit shift or mask puts
// each byte in the high byte of a word ((W * 2) << 8, sign kept), and
// vpmaddwd against the int16 A gives int32 sums of two products. Per
// 32-block a lane sums 8 products, each below 2**15 * 12 * 2**8: the sum is
// an exact integer, a multiple of 2**8 below 2**31, so it has at most 23
// significant bits and vcvtdq2ps converts it exactly. The block's value is
// that sum times 2**(code - 127 - 9 - t) (the 2**8 of the shift, the 2 of
// the table, the 2**t of A), exact while that factor is a normal float and
// the product stays finite (then every nonzero lane, at least 2**8, times
// it is normal too); one multiply-add per block adds it to the fp32
// accumulator. Each product is formed exactly and each block's partial sum
// is its exact value, so only the fp32 summation order differs from the
// reference (docs/contract.md §4).
// Per 64 elements and weight row at M = 1: 1 load, 3 nibble ops, 2 vpshufb,
// 4 shifts/masks, 4 vpmaddwd (A as memory operands), 3 adds, 1 conversion,
// 1 shuffle for the scale, 1 multiply-add and a quarter of the scale work
// (about 21 against about 31 on the float path, fp4_groups64). Measured on a
// Zen 5 at the avx2 level, cold weights, 1 thread: 0.69-0.75 of the float
// path's time at M = 1 (4096 x 4096: 479 against 655 us), 0.81-0.83 at
// M = 2. The time follows the instruction count (no single port limits it:
// with the vpmaddwd replaced by adds it ran as fast). From M = 3 the tiles
// are one weight row x at most 4 activation rows (kFp4IntTileRows): see
// the measurements after this function.
//
// Fp4IntActivation holds an A row prepared once per call (prepare_fp4_int): the
// int16 A in the order the decoder produces, per block -9 - t (the exponent
// bias of its scale), and the blocks whose A is not such an integer vector
// (exponents too far apart, subnormal, inf, NaN), which the float path
// multiplies (their int16 A is zero) in a correction pass over the few
// 64-groups that hold one. t = 14 - (the block's largest exponent): every
// block of a qdq'd activation whose nonzero values lie within 2**11 of its
// largest is an int block (e4m3 values carry 4 significant bits).
struct Fp4IntActivation {
  // [groups * 64]: register r of group g, 128-bit lane L, word p holds element
  // 64 g + 32 L + 4 p + {0, 2, 1, 3}[r] times 2**t of its block (zero for
  // the float blocks).
  std::vector<int16_t> a;
  // [chunks * 8], per chunk of 4 groups: the first blocks of its groups, then
  // their second blocks (the order fp4_groups64_int forms its scales in):
  // -9 - t; padding, float and all-zero blocks copy another block's value,
  // so that they never narrow the scale codes a row may have.
  std::vector<int32_t> bias;
  // The groups with a float block, ascending, each with the lanes of group64_dot that
  // hold its float blocks (lanes 0-3: the first block, 4-7: the second).
  struct Fix {
    int64_t g;
    __m256 lanes;
  };
  std::vector<Fix> fix;
  int64_t groups = 0;
  int64_t float_blocks = 0;
  // The scale codes a row may have for the int path: code + bias in 1..223
  // for every bias (the factor 2**(code + bias - 127) normal, and a lane sum
  // below 2**31 times it finite), code at most 252 (255 is NaN; 253 and 254
  // give weights the reference forms as inf).
  int lowest_code = 0, highest_code = 0;
};

// Fills p for one activation row a[0, K) (exact bf16 values in fp32); false
// when no block can take the int path (then p is unused).
inline bool prepare_fp4_int(const float* a, int64_t K, Fp4IntActivation& p) {
  const int64_t groups = K / 64, blocks = 2 * groups, chunks = (groups + 3) / 4;
  if (groups == 0) return false;
  std::vector<int> t(blocks);
  std::vector<uint8_t> kind(blocks);  // 0: all zero, 1: int, 2: float
  alignas(32) float scaled[32];
  int bias_min = 1 << 20, bias_max = -(1 << 20);
  for (int64_t b = 0; b < blocks; ++b) {
    const float* x = a + 32 * b;
    uint32_t top = 0;  // the largest magnitude's bits (loops without branches: the compiler vectorizes them)
    for (int i = 0; i < 32; ++i) top = std::max(top, bits_from_f32(x[i]) & 0x7FFFFFFFu);
    kind[b] = 2;
    if (top == 0) {
      kind[b] = 0;
      continue;
    }
    const int emax = int(top >> 23) - 127;  // 128: inf or NaN
    // t = 14 - emax makes the largest |a| * 2**t at least 2**14, below 2**15;
    // 2**t must be a normal float (blocks below 2**-113 stay float).
    if (emax > 127 || emax < -113) continue;
    t[b] = 14 - emax;
    const float factor = f32_from_bits(uint32_t(127 + t[b]) << 23);
    uint32_t fraction = 0;  // nonzero when some a * 2**t is not an integer (subnormals never are)
    for (int i = 0; i < 32; ++i) {
      scaled[i] = x[i] * factor;  // exact: a power of two, the result normal or 0
      fraction |= uint32_t(scaled[i] != float(int32_t(scaled[i])));
    }
    if (fraction != 0) continue;
    kind[b] = 1;
    bias_min = std::min(bias_min, -9 - t[b]);
    bias_max = std::max(bias_max, -9 - t[b]);
  }
  if (bias_min > bias_max) return false;  // no int block
  p.lowest_code = std::max(0, 1 - bias_min);
  p.highest_code = std::min(252, 223 - bias_max);
  if (p.lowest_code > p.highest_code) return false;
  const int neutral = bias_min;
  p.groups = groups;
  p.a.assign(groups * 64, 0);
  p.bias.assign(chunks * 8, neutral);
  p.fix.clear();
  p.float_blocks = 0;
  static constexpr int kRegisterOffset[4] = {0, 2, 1, 3};
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t g = b / 2, lane = b % 2;
    if (kind[b] == 2) ++p.float_blocks;
    if (kind[b] != 1) continue;
    p.bias[(g / 4) * 8 + lane * 4 + g % 4] = -9 - t[b];
    const float factor = f32_from_bits(uint32_t(127 + t[b]) << 23);
    for (int r = 0; r < 4; ++r)
      for (int q = 0; q < 8; ++q)
        p.a[g * 64 + r * 16 + lane * 8 + q] =
            static_cast<int16_t>(a[64 * g + 32 * lane + 4 * q + kRegisterOffset[r]] * factor);
  }
  for (int64_t g = groups; g < chunks * 4; ++g)  // the partial chunk's padding: as its first block (and code)
    p.bias[(g / 4) * 8 + (g % 4)] = p.bias[(g / 4) * 8 + 4 + (g % 4)] = p.bias[(g / 4) * 8];
  for (int64_t g = 0; g < groups; ++g) {
    const bool first = kind[2 * g] == 2, second = kind[2 * g + 1] == 2;
    if (first || second)
      p.fix.push_back({g, _mm256_castsi256_ps(_mm256_set_m128i(_mm_set1_epi32(second ? -1 : 0),
                                                                _mm_set1_epi32(first ? -1 : 0)))});
  }
  return true;
}

// The scale vector of group GI of a chunk (lanes 0-3: its first block, 4-7:
// its second) from the chunk's 8 scale fields in Fp4IntActivation::bias order.
template <int GI>
inline __m256 fp4_int_scale(__m256i fields_shifted) {
  return _mm256_castsi256_ps(_mm256_shuffle_epi32(fields_shifted, GI * 0x55));
}

// One 64-group of NT weight rows x MT activation rows (the step of
// fp4_groups64_int); GI: its place in the chunk. Each weight row is decoded
// once for all MT rows.
template <int GI, int MT, int NT>
inline void fp4_int_group(const uint8_t* const* rows, const int16_t* const* a, int64_t g,
                          const __m256i (&sc)[MT][NT], __m256 (&acc)[MT][NT], const uint8_t* ahead) {
  // W * 2 as int8 for e2m1 codes 0..15 (code 8 is -0)
  const __m256i lut = _mm256_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12, 0, 1, 2, 3, 4, 6, 8,
                                       12, 0, -1, -2, -3, -4, -6, -8, -12);
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const __m256i high = _mm256_set1_epi16(static_cast<short>(0xFF00));
  for (int c = 0; c < (NT + 1) / 2; ++c)  // the next rows' share for this group (see dot_tile)
    prefetch_weights(ahead + (g * ((NT + 1) / 2) + c) * 64);
  for (int j = 0; j < NT; ++j) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[j] + g * 32));
    const __m256i wl = _mm256_shuffle_epi8(lut, _mm256_and_si256(b, mask));
    const __m256i wh = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(b, 4), mask));
    const __m256i u[4] = {_mm256_slli_epi16(wl, 8), _mm256_and_si256(wl, high), _mm256_slli_epi16(wh, 8),
                          _mm256_and_si256(wh, high)};
    for (int i = 0; i < MT; ++i) {
      const __m256i* av = reinterpret_cast<const __m256i*>(a[i] + g * 64);
      const __m256i s0 = _mm256_add_epi32(_mm256_madd_epi16(u[0], _mm256_loadu_si256(av)),
                                          _mm256_madd_epi16(u[1], _mm256_loadu_si256(av + 1)));
      const __m256i s1 = _mm256_add_epi32(_mm256_madd_epi16(u[2], _mm256_loadu_si256(av + 2)),
                                          _mm256_madd_epi16(u[3], _mm256_loadu_si256(av + 3)));
      acc[i][j] =
          _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1)), fp4_int_scale<GI>(sc[i][j]), acc[i][j]);
    }
  }
}

// MT activation rows (act[0, MT)) x NT weight rows: the int path over groups
// [0, K / 64), then the float path over each row's fix list (against a_perm,
// the activation as fp4_groups64 reads it; the int blocks' lanes get a zero
// scale: their int16 A already counted them). False (acc
// untouched) when a weight row has a scale code outside some activation
// row's [lowest_code, highest_code] among those blocks: the caller's float
// path takes such tiles.
template <int MT, int NT>
bool fp4_groups64_int(const uint8_t* const* rows, const uint8_t* const* scale_rows, const Fp4IntActivation* act,
                      const float* const* a_perm, __m256 (&acc)[MT][NT], const uint8_t* ahead) {
  const int64_t groups = act[0].groups;
  const int16_t* a[MT];
  for (int i = 0; i < MT; ++i) a[i] = act[i].a.data();
  const __m128i order = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  // The range check, once per row before its blocks are multiplied (in the
  // loop it cost about 4% of the time): every code within [lowest, highest].
  const int64_t blocks = 2 * groups;
  {
    __m128i lo = _mm_set1_epi8(char(255)), hi = _mm_setzero_si128();
    for (int j = 0; j < NT; ++j) {
      const uint8_t* codes = scale_rows[j];
      if (blocks >= 16) {  // 16 codes at a time, the last 16 overlapping
        for (int64_t b = 0;; b += 16) {
          const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + std::min(b, blocks - 16)));
          lo = _mm_min_epu8(lo, v);
          hi = _mm_max_epu8(hi, v);
          if (b + 16 >= blocks) break;
        }
      } else {
        for (int64_t b = 0; b < blocks; ++b) {
          lo = _mm_min_epu8(lo, _mm_set1_epi8(char(codes[b])));
          hi = _mm_max_epu8(hi, _mm_set1_epi8(char(codes[b])));
        }
      }
    }
    // every byte of lo at least each lowest_code, of hi at most each highest_code
    __m128i fits = _mm_set1_epi8(-1);
    for (int i = 0; i < MT; ++i) {
      const __m128i below = _mm_cmpeq_epi8(_mm_max_epu8(lo, _mm_set1_epi8(char(act[i].lowest_code))), lo);
      const __m128i above = _mm_cmpeq_epi8(_mm_min_epu8(hi, _mm_set1_epi8(char(act[i].highest_code))), hi);
      fits = _mm_and_si128(fits, _mm_and_si128(below, above));
    }
    if (_mm_movemask_epi8(fits) != 0xFFFF) return false;
  }
  for (int64_t c = 0; c * 4 < groups; ++c) {
    const int64_t g0 = 4 * c;
    const bool whole = g0 + 4 <= groups;
    __m256i sc[MT][NT];
    for (int j = 0; j < NT; ++j) {
      __m128i codes;
      if (whole) {
        codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(scale_rows[j] + 8 * c));
      } else {  // the last, partial chunk: padded with its first code (and bias)
        alignas(8) uint8_t tmp[8];
        const int64_t valid = 2 * (groups - g0);
        for (int i = 0; i < 8; ++i) tmp[i] = scale_rows[j][8 * c + (i < valid ? i : 0)];
        codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(tmp));
      }
      const __m256i code32 = _mm256_cvtepu8_epi32(_mm_shuffle_epi8(codes, order));
      for (int i = 0; i < MT; ++i) {
        const __m256i bias = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(act[i].bias.data() + 8 * c));
        sc[i][j] = _mm256_slli_epi32(_mm256_add_epi32(code32, bias), 23);
      }
    }
    if (whole) {
      fp4_int_group<0, MT, NT>(rows, a, g0, sc, acc, ahead);
      fp4_int_group<1, MT, NT>(rows, a, g0 + 1, sc, acc, ahead);
      fp4_int_group<2, MT, NT>(rows, a, g0 + 2, sc, acc, ahead);
      fp4_int_group<3, MT, NT>(rows, a, g0 + 3, sc, acc, ahead);
    } else {
      fp4_int_group<0, MT, NT>(rows, a, g0, sc, acc, ahead);
      if (g0 + 1 < groups) fp4_int_group<1, MT, NT>(rows, a, g0 + 1, sc, acc, ahead);
      if (g0 + 2 < groups) fp4_int_group<2, MT, NT>(rows, a, g0 + 2, sc, acc, ahead);
    }
  }
  for (int i = 0; i < MT; ++i) {
    for (const Fp4IntActivation::Fix& f : act[i].fix) {
      for (int j = 0; j < NT; ++j) {
        __m256 w[8];
        Fp4Format::decode64_bf16(rows[j] + f.g * 32, w);
        const __m256 sv = _mm256_and_ps(group64_scales(scale_rows[j] + 2 * f.g), f.lanes);
        acc[i][j] = _mm256_fmadd_ps(group64_dot(w, a_perm[i] + f.g * 64), sv, acc[i][j]);
      }
    }
  }
  return true;
}

// Tile shapes of the int path (kFp4IntMaxM, kFp4IntWideMaxM, kFp4IntTileRows).
// Per activation row it costs 4 vpmaddwd, 3 adds, a conversion, a shuffle and
// a multiply-add against the float path's 8 multiplies / multiply-adds, an
// add and a multiply-add: it gains on the decode (about 10 instructions per
// 64-group and weight row against about 20), which a tile shares among its
// rows. Measured on a Zen 5 (avx2 level, cold weights, 1 thread, 4096 x 4096,
// 2880 x 2880, 14336 x 4096 or 4096 x 14336), time over the float path's:
// * four-row tiles (NT = 4): 0.69-0.73 at M = 1, 0.81-0.83 at M = 2, 1.02-1.08
//   at M = 3 (its 3 x 4 accumulators and scales no longer fit 16 registers);
// * single-row tiles from M = 3 (NT = 1), at most 4 rows (kFp4IntTileRows):
//   0.75-0.90 at M = 3-16 on five shapes (0.65 at 4096 x 14336 M = 16, a
//   step of the float path there); at most 8 rows: 0.02-0.09 slower at M = 6-16
//   (GCC keeps the 8 scale vectors in registers and spills the
//   accumulators); the scales kept in memory (an asm memory clobber, vpshufd
//   reads them) to free registers for tall tiles: no better; two weight rows
//   x 3 rows at M = 3: slower than one (0.81-0.88 against 0.74-0.81);
// * the weight row's int16 words decoded once into a thread-local buffer for
//   all of its row tiles (from M = 5): 1.13-1.38x the time of decoding them
//   in each tile at M = 5, the same at M = 12-16 (4 stores and 4 extra loads
//   per group against the decode's 10 instructions; 28 KiB per row at
//   K = 14336). Not kept.

// Decode-path counts of the int path above since load: [MXFP4 calls that
// took it, their float blocks (multiplied by the correction pass), tiles that
// fell back to fp4_groups64 for a scale code, tiles that ran it]; tests read
// them through the fp4_int_counts op.
std::atomic<int64_t> fp4_int_calls[4];

// Subnormal inputs read as zero (torch.set_flush_denormal(True) sets this).
inline bool denormals_are_zero() { return (_mm_getcsr() & 0x0040) != 0; }
#endif

struct Fp4IntActivation;  // one row's int16 activation for the AVX2 MXFP4 path (M <= kFp4IntMaxM)

// The AVX2 MXFP4 int path's reach (fp4_groups64_int): calls of up to
// kFp4IntMaxM rows (the avx2 decode limit, DECODE_MAX_M in linear.py); four
// weight rows x 1-2 activation rows at M <= kFp4IntWideMaxM, from M = 3 one
// weight row x near-equal row tiles of at most kFp4IntTileRows rows.
constexpr int kFp4IntMaxM = 28;
constexpr int kFp4IntWideMaxM = 2;
constexpr int kFp4IntTileRows = 4;

struct WeightView {
  const uint8_t* data;  // [N, row_bytes(K)]
  int64_t row_stride;
  const void* scale;    // [ceil(N/bn), ceil(K/bk)]
  int64_t scale_stride;
  int64_t bn, bk, K;
};

// --------------------------------------------------------------------------
// decode path: out[m0:m0+MT, n0:n0+NT] for one tile
// --------------------------------------------------------------------------

// Elements [k0, k1) of block b: the vector pass covers [k0, vector_end) in
// 16-wide chunks; the scalar pass covers the rest (all of it when the
// block's folded scale would overflow). Returns 1 when the tile ran the AVX2
// MXFP4 int path (fp4_groups64_int), else 0.
// Never inlined: GCC inlined the 4- and 5-row single-weight-row tiles into
// decode_rows and the 5-row one ran 1.2x slower per row than 4 or 6 rows
// (avx2 level, fp8, kernel calls interleaved, 21 rounds, Zen 4: 4096 x 4096 M = 5
// 810-818 us per row inlined, 672-677 not; M = 4 697-703, M = 6 664-671
// either way; fp4 and fp8 at M = 1-3, 6-16 within 3%).
template <class Fmt, class S, int MT, int NT>
__attribute__((noinline)) int dot_tile(const WeightView& w, const float* A, const float* a_split, int64_t a_stride,
                                       int a_exp, const Fp4IntActivation* fp4_int, int64_t m0, int64_t n0,
                                       float* out, int64_t N) {
  const int64_t K = w.K;
  const uint8_t* rows[NT];
  const S* srows[NT];
  for (int j = 0; j < NT; ++j) {
    rows[j] = w.data + (n0 + j) * w.row_stride;
    srows[j] = static_cast<const S*>(w.scale) + ((n0 + j) / w.bn) * w.scale_stride;
  }
  const float* arows[MT];
  for (int i = 0; i < MT; ++i) arows[i] = A + (m0 + i) * K;
  const int64_t nblocks = (K + w.bk - 1) / w.bk;

  float total[MT][NT];
  int ran_int = 0;
  bool vector_skipped_a_block = false;
  // Single-row tiles are decode-bound: factor power-of-two (e8m0) scales out
  // of the block's dot product. Float32 scales are multiplied into each
  // element, exactly as the reference forms the weight.
  constexpr bool kFactorScale = MT == 1 && std::is_same_v<S, uint8_t>;
#if defined(TORCH_BQ_AVX2)
  {
    // acc_odd: a second chain per output for the multi-row loop below (a
    // 4 x 1 tile has only four, and the FMA latency bounds them).
    __m256 acc[MT][NT], acc_odd[MT][NT];
    for (int i = 0; i < MT; ++i)
      for (int j = 0; j < NT; ++j) acc[i][j] = acc_odd[i][j] = _mm256_setzero_ps();
    int64_t b = 0;
    // The weight streams from memory in NT short rows, too short for the
    // hardware prefetchers to ramp up, so the single-row loops also prefetch
    // NT rows two tiles ahead (contiguous with these; one tile ahead measured
    // 10-25% slower at M = 1 on a Zen 5).
    const uint8_t* ahead = w.data + (n0 + 2 * NT) * w.row_stride;
    if constexpr (std::is_same_v<S, uint8_t>) {
      if (a_split != nullptr) {  // the F16C-free whole-block loops, against the permuted A
        const float* a_perm[MT];
        for (int i = 0; i < MT; ++i) a_perm[i] = a_split + (m0 + i) * a_stride;
        if constexpr (std::is_same_v<Fmt, Fp4Format>) {
          bool done = false;
          if constexpr ((NT == 4 && MT <= kFp4IntWideMaxM) || (NT == 1 && MT <= kFp4IntTileRows)) {
            if (fp4_int != nullptr) {
              done = fp4_groups64_int<MT, NT>(rows, srows, fp4_int + m0, a_perm, acc, ahead);
              if (!done) fp4_int_calls[2].fetch_add(1, std::memory_order_relaxed);  // a scale code out of its range
              ran_int = done;
            }
          }
          b = done ? 2 * (K / 64) : fp4_groups64<MT, NT>(rows, srows, a_perm, K, acc, ahead);
        }
        if constexpr (std::is_same_v<Fmt, Fp8Format>) {
          if (!denormals_are_zero()) {  // this thread's MXCSR (a worker's may differ from the caller's)
            if constexpr (MT == 1) {
              b = a_exp >= 0 ? fp8_blocks32_factored<NT>(rows, srows, a_perm[0], K, acc, ahead, a_exp)
                             : fp8_blocks32<MT, NT>(rows, srows, a_perm, K, acc, ahead);
            } else {
              b = fp8_blocks32<MT, NT>(rows, srows, a_perm, K, acc, ahead);
            }
          }
        }
      }
    }
    for (; b < nblocks; ++b) {
      const int64_t k0 = b * w.bk, k1 = std::min(K, k0 + w.bk);
      const int64_t vector_end = k0 + (k1 - k0) / 16 * 16;
      if (vector_end == k0) continue;
      bool ok = true;
      __m256 sv[NT];
      for (int j = 0; j < NT; ++j) sv[j] = _mm256_set1_ps(folded_scale<Fmt>(srows[j], b, ok));
      if (!ok) {
        vector_skipped_a_block = true;
        continue;
      }
      if constexpr (kFactorScale) {
        // sum_k a * (w * s) == s * sum_k a * w exactly for a power-of-two s:
        // one multiply per block instead of one per element.
        __m256 block_acc[NT];
        for (int j = 0; j < NT; ++j) block_acc[j] = _mm256_setzero_ps();
        for (int64_t k = k0; k < vector_end; k += 16) {
          const __m256 a0 = _mm256_loadu_ps(arows[0] + k), a1 = _mm256_loadu_ps(arows[0] + k + 8);
          for (int j = 0; j < NT; ++j) {
            __m256 w0, w1;
            Fmt::decode16(rows[j], k, w0, w1);
            block_acc[j] = _mm256_fmadd_ps(a0, w0, block_acc[j]);
            block_acc[j] = _mm256_fmadd_ps(a1, w1, block_acc[j]);
          }
        }
        for (int j = 0; j < NT; ++j) acc[0][j] = _mm256_fmadd_ps(block_acc[j], sv[j], acc[0][j]);
      } else {
        for (int64_t k = k0; k < vector_end; k += 16) {
          for (int j = 0; j < NT; ++j) {
            __m256 w0, w1;
            Fmt::decode16(rows[j], k, w0, w1);
            w0 = _mm256_mul_ps(w0, sv[j]);
            w1 = _mm256_mul_ps(w1, sv[j]);
            for (int i = 0; i < MT; ++i) {
              acc[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(arows[i] + k), w0, acc[i][j]);
              acc_odd[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(arows[i] + k + 8), w1, acc_odd[i][j]);
            }
          }
        }
      }
    }
    for (int i = 0; i < MT; ++i)
      for (int j = 0; j < NT; ++j) total[i][j] = hsum(_mm256_add_ps(acc[i][j], acc_odd[i][j]));
  }
  const bool vector_pass = true;
#else
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) total[i][j] = 0.0f;
  const bool vector_pass = false;
#endif
  // Scalar pass. With 16 | bk and no skipped block, only the last block can
  // have a remainder, so the other blocks are not revisited.
  const int64_t first = (vector_pass && w.bk % 16 == 0 && !vector_skipped_a_block) ? nblocks - 1 : 0;
  for (int64_t b = std::max<int64_t>(first, 0); b < nblocks; ++b) {
    const int64_t k0 = b * w.bk, k1 = std::min(K, k0 + w.bk);
    float s[NT];
    bool ok = true;
    for (int j = 0; j < NT; ++j) {
      s[j] = scale_value(srows[j], b);
#if defined(TORCH_BQ_AVX2)
      folded_scale<Fmt>(srows[j], b, ok);
#endif
    }
    const int64_t start = (vector_pass && ok) ? k0 + (k1 - k0) / 16 * 16 : k0;
    for (int64_t k = start; k < k1; ++k) {
      for (int j = 0; j < NT; ++j) {
        const float wv = Fmt::scalar(rows[j], k) * s[j];
        for (int i = 0; i < MT; ++i) total[i][j] = std::fma(arows[i][k], wv, total[i][j]);
      }
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) out[(m0 + i) * N + n0 + j] = total[i][j];
  return ran_int;
}

// The tallest tile over two fp8 weight rows (e8m0 scales, fp8_blocks32). One
// weight row per tile (up to 8 rows of A) read all of A once per weight row,
// from L2 at these sizes; two per tile read it once per pair. avx2 level, kernel
// calls interleaved (15-21 rounds, Zen 4), time per row over one weight row per
// tile, 5 rows at most: M = 4 0.80-0.81, 5 0.78-0.80, 6 0.91-0.92, 8 0.84-0.86,
// 10 0.77-0.78, 16 0.85; the step from 3 rows (four weight rows per tile) to 4
// went from 1.17-1.20x to 0.95-0.97x, but the tile count stepped at 5 -> 6 and
// 10 -> 11 (1.11-1.15x and 1.09-1.15x in `--cliffs`: each tile decodes its two
// weight rows again). 5 rows are what the 16 registers hold (10 accumulators, the
// decoded block, two partial sums); from 6 they no longer fit and GCC keeps
// some accumulators on the stack, which still costs less than decoding both
// weight rows again for another tile: with 8, M = 6 took 0.76-0.83x and M = 11
// 0.79-0.90x the time per row of tiles of at most 5.
constexpr int kPairTileMaxMT = 8;

// All M rows of A against W[n:n+NT, :] in row tiles of near-equal height,
// at most max_mt (NT = 1: 8, or kFp4IntTileRows on the AVX2 MXFP4 int path;
// NT = 2: kPairTileMaxMT; NT = 4: 3, at M <= 3): every tile decodes the weight
// rows once more, so M = 8 q + r costs q + 1 decodes, never q + 2 or 3 (a
// tile of 1 or 2 rows after the 8s and 4s was the M = 5 and M = 9 steps).
// Returns how many of its tiles ran the int path.
template <class Fmt, class S, int NT>
int rows_tile(const WeightView& w, const float* A, const float* a_split, int64_t a_stride, int a_exp,
              const Fp4IntActivation* fp4_int, int64_t M, int64_t n, float* out, int64_t N, int max_mt) {
  const int64_t tiles = (M + max_mt - 1) / max_mt;
  int64_t m0 = 0;
  int ran_int = 0;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t mt = (M - m0) / (tiles - t);
    switch (mt) {
#define TORCH_BQ_ROWS(R)                                       \
  case R:                                                      \
    if constexpr (R <= (NT == 4 ? 3 : NT == 2 ? kPairTileMaxMT : 8)) { \
      ran_int += dot_tile<Fmt, S, R, NT>(w, A, a_split, a_stride, a_exp, fp4_int, m0, n, out, N); \
    }                                                          \
    break;
      TORCH_BQ_ROWS(1) TORCH_BQ_ROWS(2) TORCH_BQ_ROWS(3) TORCH_BQ_ROWS(4)
      TORCH_BQ_ROWS(5) TORCH_BQ_ROWS(6) TORCH_BQ_ROWS(7) TORCH_BQ_ROWS(8)
#undef TORCH_BQ_ROWS
      default: break;
    }
    m0 += mt;
  }
  return ran_int;
}

template <class Fmt, class S>
void decode_rows(const WeightView& w, const float* A, const float* a_split, int64_t a_stride, int a_exp,
                 const Fp4IntActivation* fp4_int, int64_t M, int64_t n_begin, int64_t n_end, float* out, int64_t N) {
  int64_t n = n_begin;
  // The AVX2 MXFP4 int path (fp4_int set): four-row tiles at M <= 2 only,
  // single-row tiles of at most kFp4IntTileRows rows from M = 3.
  const bool int_path = fp4_int != nullptr;
  int64_t int_tiles = 0;
  if (M <= (int_path ? kFp4IntWideMaxM : 3)) {  // decode-bound: share each A load across four weight rows
    for (; n + 4 <= n_end; n += 4)
      int_tiles += rows_tile<Fmt, S, 4>(w, A, a_split, a_stride, a_exp, fp4_int, M, n, out, N, 3);
  }
  // fp8 with e8m0 scales from 4 rows (fp8_blocks32): two weight rows per tile, so each A
  // load serves both (see kPairTileMaxMT).
  if constexpr (std::is_same_v<Fmt, Fp8Format> && std::is_same_v<S, uint8_t>) {
    if (a_split != nullptr && M >= 4)
      for (; n + 2 <= n_end; n += 2)
        rows_tile<Fmt, S, 2>(w, A, a_split, a_stride, a_exp, fp4_int, M, n, out, N, kPairTileMaxMT);
  }
  const int max_mt = int_path ? kFp4IntTileRows : 8;
  for (; n < n_end; ++n)
    int_tiles += rows_tile<Fmt, S, 1>(w, A, a_split, a_stride, a_exp, fp4_int, M, n, out, N, max_mt);
#if defined(TORCH_BQ_AVX2)
  if (int_tiles != 0) fp4_int_calls[3].fetch_add(int_tiles, std::memory_order_relaxed);  // once per task
#endif
}

#if defined(TORCH_BQ_AVX2)
// A copy of A [M, K] for the AVX2 whole-block loops, in their element order:
// rows `stride` floats apart, the first on a cache line. The stride is a
// multiple of 16 floats (no 32-byte load straddles two lines) and not of 1024
// (4 KiB): with K = 4096 or 14336, rows exactly K apart put every row's
// current lines into the same L1 sets, and from 6 rows a tile evicted its own
// activation (per-row time up 1.3-1.45x from M = 5 to 6 at the avx2 level, and
// it varied with where malloc put the copy).
struct PermutedActivation {
  std::vector<float> buf;
  float* data = nullptr;
  int64_t stride = 0;
  void allocate(int64_t M, int64_t K) {
    stride = (K + 15) / 16 * 16;
    if (stride % 1024 == 0) stride += 16;
    buf.resize(M * stride + 16);
    data = cache_line_aligned(buf.data());
  }
};

// A [M, K] with every full 64-element group reordered as fp4_groups64
// reads it (Fp4Format::group64_element); the rest of each row as it is.
void permute_activation_groups64(const float* A, int64_t M, int64_t K, PermutedActivation& perm) {
  perm.allocate(M, K);
  for (int64_t m = 0; m < M; ++m) {
    float* row = perm.data + m * perm.stride;
    std::memcpy(row, A + m * K, K * sizeof(float));
    for (int64_t k0 = 0; k0 + 64 <= K; k0 += 64)
      for (int i = 0; i < 8; ++i)
        for (int l = 0; l < 8; ++l) row[k0 + 8 * i + l] = A[m * K + k0 + Fp4Format::group64_element(i, l)];
  }
}

// A [M, K] with every full 32-block reordered as fp8_blocks32 reads it
// (element 4 d + i at 8 i + d); the rest of each row as it is.
void permute_activation_blocks32(const float* A, int64_t M, int64_t K, PermutedActivation& perm) {
  perm.allocate(M, K);
  for (int64_t m = 0; m < M; ++m) {
    float* row = perm.data + m * perm.stride;
    std::memcpy(row, A + m * K, K * sizeof(float));
    for (int64_t k0 = 0; k0 + 32 <= K; k0 += 32)
      for (int i = 0; i < 4; ++i)
        for (int d = 0; d < 8; ++d) row[k0 + 8 * i + d] = A[m * K + k0 + 4 * d + i];
  }
}
#endif

// Runs task(i) for i in [0, count) on torch_bq's own worker threads (as many
// as torch.get_num_threads(), the caller included). Tasks are handed out
// from a shared counter, and the call ends when every task is done, without
// waiting for the workers that never got to one: on a machine whose cores
// are busy with other processes, a worker the OS schedules late delays the
// call by at most the task it is on, never by a share of the work or by a
// barrier. Idle workers sleep on a condition variable (no spinning that
// would take the core from the threads doing work). Which thread runs a task
// never changes what the task computes. Nested or concurrent calls run their
// tasks on the calling thread alone.
class TaskPool {
 public:
  using Body = void (*)(const void* task, int64_t i);

  static TaskPool& instance() {
    // A forked child has none of the parent's workers (and perhaps a mutex a
    // worker held): it gets a pool of its own; the old one is left alone.
    static std::atomic<TaskPool*> pool{nullptr};
    static std::atomic<pid_t> owner{0};
    TaskPool* p = pool.load();
    if (p == nullptr || owner.load() != getpid()) {
      static std::mutex create;
      std::lock_guard<std::mutex> lock(create);
      p = pool.load();
      if (p == nullptr || owner.load() != getpid()) {
        p = new TaskPool();  // lives for the process: workers may still be parked on it at exit
        pool.store(p);
        owner.store(getpid());
      }
    }
    return *p;
  }

  void run(int64_t count, int64_t workers, Body body, const void* task) {
    if (workers <= 1 || in_task() || busy_.exchange(true)) {
      Scope scope;
      for (int64_t i = 0; i < count; ++i) body(task, i);
      return;
    }
    Job job{body, task, count};
    {
      std::lock_guard<std::mutex> lock(mutex_);
      grow(workers - 1);
      job.seats = workers - 1;
      job_ = &job;
      ++generation_;
    }
    wake_.notify_all();
    work(job);
    {
      std::unique_lock<std::mutex> lock(mutex_);
      job_ = nullptr;  // late workers find nothing to join
      done_.wait(lock, [&] { return job.active == 0; });
    }
    busy_.store(false);
    if (job.error) std::rethrow_exception(job.error);
  }

 private:
  struct Job {
    Body body;
    const void* task;
    int64_t count;
    std::atomic<int64_t> next{0};
    int seats = 0;   // workers that may still join (guarded by mutex_)
    int active = 0;  // workers inside work() (guarded by mutex_)
    std::exception_ptr error;  // the first task exception (guarded by mutex_)
  };

  struct Scope {  // marks the thread as running tasks, so nested calls run inline
    Scope() { in_task() = true; }
    ~Scope() { in_task() = false; }
  };
  static bool& in_task() {
    static thread_local bool inside = false;
    return inside;
  }

  void work(Job& job) {
    Scope scope;
    try {
      for (int64_t i = job.next.fetch_add(1); i < job.count; i = job.next.fetch_add(1)) job.body(job.task, i);
    } catch (...) {
      job.next.store(job.count);  // the others stop taking tasks
      std::lock_guard<std::mutex> lock(mutex_);
      if (!job.error) job.error = std::current_exception();
    }
  }

  void grow(int64_t helpers) {  // under mutex_
    while (static_cast<int64_t>(threads_.size()) < helpers) {
      threads_.emplace_back([this] { serve(); });
      threads_.back().detach();
    }
  }

  void serve() {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      wake_.wait(lock, [&] { return generation_ != seen; });
      seen = generation_;
      Job* job = job_;
      if (job == nullptr || job->seats == 0) continue;
      --job->seats;
      ++job->active;
      lock.unlock();
      work(*job);
      lock.lock();
      if (--job->active == 0) done_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> threads_;
  Job* job_ = nullptr;
  uint64_t generation_ = 0;
  std::atomic<bool> busy_{false};
};

template <class Task>
void run_tasks(int64_t count, const Task& task) {
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), count);
  TaskPool::instance().run(count, workers, [](const void* t, int64_t i) { (*static_cast<const Task*>(t))(i); },
                           &task);
}

// Decode-path calls of the AVX-512 BF16 kernels since load: [per-lane-scale
// tiles only, folded tiles] (tests read them through the decode_counts op to
// see which tiles a row count took; zero in builds without those kernels).
std::atomic<int64_t> dot_decode_calls[2];
// Weight rows the AVX-512 BF16 per-lane-scale tiles ran against the prescaled A
// (dotbf16::prescale_activation): the decode_prescaled_rows op, for tests.
std::atomic<int64_t> prescaled_rows{0};

#if defined(TORCH_BQ_AVX512_BF16)  // vdpbf16ps, vpermi2b, AVX-512 BW
#define TORCH_BQ_DOT_BF16 1
// --------------------------------------------------------------------------
// decode path, AVX-512 BF16: weights decoded to bf16 and vdpbf16ps
// --------------------------------------------------------------------------
//
// For 32-wide e8m0 blocks (fp8 bk = 32, MXFP4). Every decoded weight and
// every A value is exact in bf16 (docs/contract.md §1), so a bf16 x bf16 product is
// exact in fp32; vdpbf16ps adds two such products into an fp32 lane, which
// is fp32 accumulation in another order. The block scale (a power of two)
// is applied to each block's fp32 partial sum, exactly as the scalar path
// factors it out.
//
// vdpbf16ps reads subnormal inputs as zero and flushes subnormal results
// (it ignores MXCSR). The decoded weights are normal or zero (fp8: e4m3 is
// at least 2**-9; fp4: at least 0.5), so only A matters: every product is a
// multiple of 2**(e_a - 7 - 9) (fp8) or 2**(e_a - 7 - 1) (fp4), where e_a is
// the smallest exponent of a nonzero A value, and so is every partial sum;
// when that quantum is at least 2**-126 nothing is ever subnormal and the
// instruction is exact IEEE arithmetic. A call whose A has a smaller
// exponent (or values that are not bf16) takes the fp32 path instead.
//
// Layout: K in groups of D::kGroupElems elements (64 = two 32-blocks; 128 =
// four for Fp4Span). A group of a weight row decodes to D::kRegs registers of
// 32 bf16 words in an order that is cheapest to produce (D::element says which
// element each word holds); A is copied once per call into bf16 [M, Kp] (Kp =
// K rounded up to the group, zero padded) with every group in that same
// order. In every order fp32 lane l of the dot product holds block
// l / (16 / blocks per group) of the group, so one register of 16 lane scales
// serves it.
//   for n-tile (NT rows): for m-tile (MT rows): for 16-block span:
//     s16 = e8m0 scales of the span (per row)
//     for group g: w[] = decode(W[n, g]); for m: t = sum over r of dot(w[r], A[r])
//                  acc[m][n] += t * s16[lanes of g]
// Tiles: below Fold<D>::kMinRows rows (7 for both formats; fp8 whose scale rows
// serve 16 weight rows: prescale_max_rows(K) + 1, with A prescaled), NT = 4 weight rows x
// MT = 1-5 rows (6 with A prescaled and M = 6; fp4: Fp4Span for 1 and 2 rows, Fp4Dot from 3)
// with the per-lane scales above (taller M: several row tiles over the same 4
// weight rows, the later ones reading them from L1); from there the folded
// K-block tiles (section "From Fold<D>::kMinRows rows" below), for every e8m0
// block height.
// Tiles prefetch the weight rows ahead (and their scales): short row streams
// do not train the hardware prefetchers.
namespace dotbf16 {

constexpr int64_t kGroup = 64;

// fp8: 64 bytes -> two 128-entry byte lookups (high and low byte of the bf16
// encoding of each e4m3 magnitude, subnormals included), the sign ORed into
// the high byte, then an in-lane byte interleave: word q of the first
// register is element 16 * (q / 8) + q % 8, of the second 8 more.
struct Fp8Dot {
  static constexpr int kMinExponentA = -126 + 7 + 9;
  static constexpr int64_t kGroupElems = 64;
  static constexpr int kRegs = 2;
  static constexpr int64_t kGroupBytes = 64;
  static int64_t element(int64_t word) {
    const int64_t half = word / 32, q = word % 32;
    return 16 * (q / 8) + 8 * half + q % 8;
  }
  __m512i hi0, hi1, lo0, lo1;
  Fp8Dot() {
    alignas(64) uint8_t hi[128], lo[128];
    for (int c = 0; c < 128; ++c) {
      const uint32_t b = bits_from_f32(kTables.e4m3[c]);  // exact in bf16: the low 16 bits are 0
      hi[c] = static_cast<uint8_t>(b >> 24);
      lo[c] = static_cast<uint8_t>(b >> 16);
    }
    hi0 = _mm512_load_si512(hi);
    hi1 = _mm512_load_si512(hi + 64);
    lo0 = _mm512_load_si512(lo);
    lo1 = _mm512_load_si512(lo + 64);
  }
  void decode(const uint8_t* row, int64_t g, __m512i (&w)[kRegs]) const {
    // One load of the 64 bytes, held in a register: left to itself, GCC loads
    // them again for each of the two lookups and the sign (three loads of the
    // same line per group and weight row). In the 4-row tile, next to its
    // eight A loads, that cost 10-20% of the time (kernel calls, cold cache,
    // 1 thread, Zen 5); with one load M = 4 as one tile costs no more per row
    // than M = 3.
    __m512i b = _mm512_loadu_si512(row + g * 64);
    asm("" : "+v"(b));
    bytes(b, w[0], w[1]);
  }
  void decode_masked(const uint8_t* row, int64_t g, __mmask64 valid, __m512i (&w)[kRegs]) const {
    bytes(_mm512_maskz_loadu_epi8(valid, row + g * 64), w[0], w[1]);
  }
  void bytes(__m512i b, __m512i& w0, __m512i& w1) const {
    __m512i hi = _mm512_permutex2var_epi8(hi0, b, hi1);  // index bits 0-6: the magnitude
    const __m512i lo = _mm512_permutex2var_epi8(lo0, b, lo1);
    hi = _mm512_ternarylogic_epi32(hi, b, _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);  // hi | (b & 0x80)
    w0 = _mm512_unpacklo_epi8(lo, hi);
    w1 = _mm512_unpackhi_epi8(lo, hi);
  }
  static __mmask64 valid_bytes(int64_t row_bytes, int64_t g) {
    const int64_t left = row_bytes - g * 64;
    return left >= 64 ? ~__mmask64(0) : (__mmask64(1) << left) - 1;
  }
};

// MXFP4 for the folded tiles: 32 bytes zero-extended to words; a 16-bit lookup
// of the low nibble (index bits 0-4, so the table is the 16 e2m1 values twice)
// gives the even elements, of the word shifted right by 4 the odd ones: word q
// of the first register is element 2q, of the second 2q + 1.
struct Fp4Dot {
  static constexpr int kMinExponentA = -126 + 7 + 1;
  static constexpr int64_t kGroupElems = 64;
  static constexpr int kRegs = 2;
  static constexpr int64_t kGroupBytes = 32;
  static int64_t element(int64_t word) { return word < 32 ? 2 * word : 2 * (word - 32) + 1; }
  __m512i lut;
  Fp4Dot() {
    alignas(64) uint16_t t[32];
    for (int i = 0; i < 32; ++i) t[i] = static_cast<uint16_t>(bits_from_f32(kTables.fp4[i % 16]) >> 16);
    lut = _mm512_load_si512(t);
  }
  void decode(const uint8_t* row, int64_t g, __m512i (&w)[kRegs]) const {
    bytes(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + g * 32)), w[0], w[1]);
  }
  void decode_masked(const uint8_t* row, int64_t g, __mmask32 valid, __m512i (&w)[kRegs]) const {
    bytes(_mm256_maskz_loadu_epi8(valid, row + g * 32), w[0], w[1]);
  }
  void bytes(__m256i raw, __m512i& w0, __m512i& w1) const {
    const __m512i b = _mm512_cvtepu8_epi16(raw);
    w0 = _mm512_permutexvar_epi16(b, lut);
    w1 = _mm512_permutexvar_epi16(_mm512_srli_epi16(b, 4), lut);
  }
  static __mmask32 valid_bytes(int64_t row_bytes, int64_t g) {
    const int64_t left = row_bytes - g * 32;
    return left >= 32 ? ~__mmask32(0) : (__mmask32(1) << left) - 1;
  }
};

// MXFP4 for the per-lane tiles of 1 and 2 rows: 64 bytes (128 elements) read as
// 32 words, no widening; the lookup of each word's bits 4r .. 4r + 4 (Fp4Dot's
// table: bit 4 does not matter) gives register r, so word q of register r is
// element 4q + r, and lanes 4b .. 4b + 3 of a dot product hold block b. Per 64
// elements that is 2 lookups, 1.5 shifts and half a scale multiply and
// permute, against Fp4Dot's widening, 2 lookups, 1 shift and a whole one. At
// M = 1 and 2 the decode is the cost even with the weight in memory (4096 x
// 4096, M = 1: 245-272 us per call from L3, 279-307 us from memory). These
// spans took 0.83-0.99x of Fp4Dot's time at M = 1 and 0.82-0.98x at M = 2 on
// four of the five benchmark shapes, and 1.02-1.07x / 0.94-0.98x on 4096 x
// 14336 (kernel calls interleaved in one process, cold cache, 11-21 rounds,
// four runs, 1 thread, Zen 5). From 3 rows they were no faster (0.95-1.09x):
// the multiply, not the decode, is the cost there.
// Fp4Dot stays for those and for the folded tiles, whose scratch and scale fold
// work in 64s.
struct Fp4Span {
  static constexpr int kMinExponentA = Fp4Dot::kMinExponentA;
  static constexpr int64_t kGroupElems = 128;
  static constexpr int kRegs = 4;
  static constexpr int64_t kGroupBytes = 64;
  static int64_t element(int64_t word) { return 4 * (word % 32) + word / 32; }
  __m512i lut = Fp4Dot().lut;
  void decode(const uint8_t* row, int64_t g, __m512i (&w)[kRegs]) const {
    words(_mm512_loadu_si512(row + g * 64), w);
  }
  void decode_masked(const uint8_t* row, int64_t g, __mmask64 valid, __m512i (&w)[kRegs]) const {
    words(_mm512_maskz_loadu_epi8(valid, row + g * 64), w);
  }
  void words(__m512i raw, __m512i (&w)[kRegs]) const {
    w[0] = _mm512_permutexvar_epi16(raw, lut);
    w[1] = _mm512_permutexvar_epi16(_mm512_srli_epi16(raw, 4), lut);
    w[2] = _mm512_permutexvar_epi16(_mm512_srli_epi16(raw, 8), lut);
    w[3] = _mm512_permutexvar_epi16(_mm512_srli_epi16(raw, 12), lut);
  }
  static __mmask64 valid_bytes(int64_t row_bytes, int64_t g) { return Fp8Dot::valid_bytes(row_bytes, g); }
};

template <class Fmt>
struct DotFor;
template <>
struct DotFor<Fp8Format> {
  using type = Fp8Dot;
};
template <>
struct DotFor<Fp4Format> {
  using type = Fp4Dot;
};

// The e8m0 values of up to 16 consecutive block codes (masked-off ones read
// as code 0): exact, 2**-127 (an fp32 subnormal) and NaN included.
inline __m512 e8m0x16(const uint8_t* codes, __mmask16 valid) {
  const __m512i c = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(valid, codes));
  __m512i bits = _mm512_slli_epi32(c, 23);
  bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(c, _mm512_setzero_si512()), _mm512_set1_epi32(0x00400000));
  bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(c, _mm512_set1_epi32(255)), _mm512_set1_epi32(0x7FC00000));
  return _mm512_castsi512_ps(bits);
}

// A [M, K] fp32 -> bf16 [M, Kp] in the decoder's word order, zero padded.
// Returns the smallest exponent field of a nonzero A value (255 when A is all
// zero), or -1 when a value is not exactly bf16 (then A cannot take this path);
// the largest field goes to *max_field_out (0 when A is all zero).
template <class D>
int prepare_activation(const float* A, int64_t M, int64_t K, int64_t kp, int64_t stride, uint16_t* dst,
                       int* max_field_out) {
  // The words of a group in natural order are D::kRegs registers, pairs of them
  // 64 words; output register r takes each word from one pair (a two-register
  // word permute of it), the pair picked per word by `upper` (128-word groups).
  constexpr int64_t kWords = D::kGroupElems;
  constexpr int kRegs = D::kRegs;
  alignas(64) uint16_t order[kWords];
  for (int64_t j = 0; j < kWords; ++j) order[j] = static_cast<uint16_t>(D::element(j) % 64);
  __m512i idx[kRegs];
  __mmask32 upper[kRegs];
  for (int r = 0; r < kRegs; ++r) {
    idx[r] = _mm512_load_si512(order + 32 * r);
    upper[r] = 0;
    for (int q = 0; q < 32; ++q)
      if (D::element(32 * r + q) >= 64) upper[r] |= __mmask32(1) << q;
  }
  __m512i min_field = _mm512_set1_epi32(255), max_field = _mm512_setzero_si512(), low_bits = _mm512_setzero_si512();
  const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF), low = _mm512_set1_epi32(0xFFFF);
  for (int64_t m = 0; m < M; ++m) {
    const float* a = A + m * K;
    uint16_t* d = dst + m * stride;
    for (int64_t k0 = 0; k0 < kp; k0 += kWords) {
      __m256i words[2 * kRegs];
      for (int q = 0; q < 2 * kRegs; ++q) {
        const int64_t left = K - (k0 + 16 * q);
        const __mmask16 valid = left >= 16 ? __mmask16(0xFFFF) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
        const __m512i bits = _mm512_castps_si512(_mm512_maskz_loadu_ps(valid, a + k0 + 16 * q));
        low_bits = _mm512_ternarylogic_epi32(low_bits, bits, low, 0xF8);  // low_bits | (bits & low)
        const __m512i mag = _mm512_and_si512(bits, magnitude);
        const __m512i field = _mm512_srli_epi32(mag, 23);
        min_field = _mm512_mask_min_epu32(min_field, _mm512_test_epi32_mask(mag, mag), min_field, field);
        max_field = _mm512_max_epu32(max_field, field);
        words[q] = _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16));
      }
      __m512i n[kRegs];
      for (int r = 0; r < kRegs; ++r) n[r] = _mm512_inserti64x4(_mm512_castsi256_si512(words[2 * r]), words[2 * r + 1], 1);
      for (int r = 0; r < kRegs; ++r) {
        __m512i out = _mm512_permutex2var_epi16(n[0], idx[r], n[1]);
        if constexpr (kRegs == 4)
          out = _mm512_mask_blend_epi16(upper[r], out, _mm512_permutex2var_epi16(n[2], idx[r], n[3]));
        _mm512_storeu_si512(d + k0 + 32 * r, out);
      }
    }
  }
  if (max_field_out != nullptr) *max_field_out = static_cast<int>(_mm512_reduce_max_epu32(max_field));
  if (_mm512_test_epi32_mask(low_bits, low_bits) != 0) return -1;
  return static_cast<int>(_mm512_reduce_min_epu32(min_field));
}

struct Problem {
  const WeightView* w;
  const uint16_t* a;  // bf16 [M, kp] in the decoder's order, rows a_stride words apart
  int a_min_field;    // smallest exponent field of a nonzero A value (255: none)
  int a_max_field;    // largest (0: none)
  int64_t kp, a_stride, ngroups, nblocks, row_bytes;  // ngroups: of the decoder's kGroupElems
  float* out;         // [M, N]
  int64_t N;
};

// With A prescaled (no scale registers), 6 x 4 accumulators, the byte tables and the
// decoded pair fit, and M = 6 runs as one tile instead of two of 3 rows, which decode
// the weight twice: the step from 5 to 6 rows went from 1.18-1.20x the time per row
// on three of four shapes to 1.03-1.07x (kernel calls, cold, 21 rounds, Zen 4; in
// the VM's slow stretches the two ran about even; see tile() for its A prefetch).
// At M = 6 only: per row the 6-row tile is slower than those of 4 and 5 rows (M = 12
// as 6 + 6 took 1.08-1.20x the time of 4 + 4 + 4), and from 7 rows up those take no
// more tiles (M = 7-10) or one more over a weight in L1.
constexpr int kPrescaledMaxMT = 6;

// How far ahead (in groups) the tiles of 5 and more rows prefetch A.
constexpr int64_t kAheadGroupsA = 4;

// out[m0:m0+MT, n0:n0+NT]
// kPre: A already carries the block scales (prescale_activation), so the tile
// accumulates plain dot products: no scale permute or multiply-add per group.
template <class D, int MT, int NT, bool kPre = false>
void tile(const D& dec, const Problem& p, int64_t m0, int64_t n0) {
  const WeightView& w = *p.w;
  const uint8_t* rows[NT];
  const uint8_t* srows[NT];
  for (int j = 0; j < NT; ++j) {
    rows[j] = w.data + (n0 + j) * w.row_stride;
    srows[j] = static_cast<const uint8_t*>(w.scale) + ((n0 + j) / w.bn) * w.scale_stride;
  }
  const uint16_t* arows[MT];
  for (int i = 0; i < MT; ++i) arows[i] = p.a + (m0 + i) * p.a_stride;
  __m512 acc[MT][NT];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_setzero_ps();
  // Lane l of a group's dot product holds its block l / (16 / kBlocks); the 16
  // scales loaded at a time serve 16 / kBlocks groups.
  constexpr int kBlocks = static_cast<int>(D::kGroupElems / 32), kSpan = 16 / kBlocks;
  alignas(64) int32_t first[16];
  for (int l = 0; l < 16; ++l) first[l] = l / kSpan;
  const __m512i lanes0 = _mm512_load_si512(first);
  const int64_t full = p.row_bytes / D::kGroupBytes;  // groups without a partial load
  // The weight streams from memory in NT short row streams, too short for the
  // hardware prefetchers to ramp up; so each group also prefetches its share
  // of NT rows two tiles ahead (contiguous with these; one tile ahead measured
  // 10-25% slower at M = 1 on a Zen 5).
  const uint8_t* ahead = w.data + (n0 + 2 * NT) * w.row_stride;
  constexpr int64_t kAheadLines = NT * D::kGroupBytes / 64;
  for (int j = 0; j < NT; ++j) {  // and the next rows' scales, a few short rows of their own
    const int64_t n = std::min(n0 + NT + j, p.N - 1);
    const uint8_t* s = static_cast<const uint8_t*>(w.scale) + (n / w.bn) * w.scale_stride;
    for (int64_t c = 0; c < p.nblocks; c += 64) _mm_prefetch(reinterpret_cast<const char*>(s + c), _MM_HINT_T0);
  }
  auto group = [&](int64_t g, const __m512 (&s16)[NT], __m512i lanes, auto masked) {
    for (int64_t c = 0; c < kAheadLines; ++c)
      prefetch_weights(ahead + (g * kAheadLines + c) * 64);
    // From 5 A rows, their lines too (kAheadGroupsA groups ahead): with the NT
    // weight rows that makes 9 or more streams, more than the hardware
    // prefetchers follow, and where A does not fit in L1 (K = 4096 and up) each
    // A load then waited on L2. Without this the fp8 5-row tile took 1.2-1.7x
    // the time of two tiles of 2 and 3 rows; with it 0.90-0.91x. Not the
    // prescaled 6-row tile: with these 12 prefetches per group it took 1.05-1.09x
    // the time it takes without them (kernel calls, weights in L3, Zen 4).
    if constexpr (MT >= 5 && !(kPre && NT == 4 && MT == kPrescaledMaxMT)) {
      for (int i = 0; i < MT; ++i)
        for (int r = 0; r < D::kRegs; ++r)
          _mm_prefetch(reinterpret_cast<const char*>(arows[i] + (g + kAheadGroupsA) * D::kGroupElems + 32 * r),
                       _MM_HINT_T0);
    }
    for (int j = 0; j < NT; ++j) {
      __m512i wv[D::kRegs];
      if constexpr (decltype(masked)::value)
        dec.decode_masked(rows[j], g, D::valid_bytes(p.row_bytes, g), wv);
      else
        dec.decode(rows[j], g, wv);
      if constexpr (kPre) {
        for (int i = 0; i < MT; ++i)
          for (int r = 0; r < D::kRegs; ++r)
            acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)wv[r],
                                         (__m512bh)_mm512_loadu_si512(arows[i] + g * D::kGroupElems + 32 * r));
        continue;
      }
      const __m512 s = _mm512_permutexvar_ps(lanes, s16[j]);
      for (int i = 0; i < MT; ++i) {
        const uint16_t* a = arows[i] + g * D::kGroupElems;
        __m512 t = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)wv[0], (__m512bh)_mm512_loadu_si512(a));
        for (int r = 1; r < D::kRegs; ++r)
          t = _mm512_dpbf16_ps(t, (__m512bh)wv[r], (__m512bh)_mm512_loadu_si512(a + 32 * r));
        acc[i][j] = _mm512_fmadd_ps(t, s, acc[i][j]);
      }
    }
  };
  if constexpr (kPre) {
    // One loop over all groups: in the span loop below GCC kept the accumulators on the
    // stack between spans (a load and a store of each per 8 groups); without it, M = 4-9
    // ran 0.80-0.97x the time (kernel calls, cold, Zen 4).
    const __m512 none[NT] = {};
    int64_t g = 0;
    for (; g < std::min(p.ngroups, full); ++g) group(g, none, lanes0, std::false_type{});
    for (; g < p.ngroups; ++g) group(g, none, lanes0, std::true_type{});
  } else
  for (int64_t g0 = 0; g0 < p.ngroups; g0 += kSpan) {
    // Scales of blocks kBlocks g0 .. kBlocks g0 + 15 (the kSpan groups from g0).
    const int64_t left = p.nblocks - kBlocks * g0;
    const __mmask16 svalid = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    __m512 s16[NT];
    for (int j = 0; j < NT; ++j) s16[j] = e8m0x16(srows[j] + kBlocks * g0, svalid);
    const int64_t g1 = std::min(p.ngroups, g0 + kSpan);
    __m512i lanes = lanes0;
    int64_t g = g0;
    for (; g < std::min(g1, full); ++g) {
      group(g, s16, lanes, std::false_type{});
      lanes = _mm512_add_epi32(lanes, _mm512_set1_epi32(kBlocks));
    }
    for (; g < g1; ++g) {
      group(g, s16, lanes, std::true_type{});
      lanes = _mm512_add_epi32(lanes, _mm512_set1_epi32(kBlocks));
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) p.out[(m0 + i) * p.N + n0 + j] = _mm512_reduce_add_ps(acc[i][j]);
}

// The tallest per-lane-scale tile over 4 weight rows, by decoder. Fp4Dot: 5 x 4
// accumulators, 4 scale registers, the decoded pair and the lane permute fit
// the 32 zmm (M = 5 in one tile took 0.87-0.94x the time of two tiles of 3 and
// 2 rows, which decode the weight twice; 1 thread, Zen 5). Fp4Span: 2 (linear()
// gives it only M = 1 and 2; see there). fp8: 5 (5 x 4 accumulators, the byte
// tables and the decoded pair; the scales are memory operands). With the
// weight bytes loaded once per group (Fp8Dot::decode), M = 4 as one 4-row tile
// took 0.75-0.87x the time of 2 + 2 and about the same time per row as M = 3;
// without that, 2 + 2 (the second tile reading the 4 weight rows from L1)
// had been as fast or faster. M = 5 as one tile took 0.86-0.95x the time of
// 2 + 3 once the tile prefetched its A rows (see tile(); without that it was
// 1.2-1.7x) and about M = 4's time per row (kernel calls interleaved in one
// process, cold cache, 11 rounds, five shapes, Zen 5, 2026-12-02; section
// "The fp8 M = 4 -> 5 step: A's streams (stop 22 ...)" of docs/benchmarks.md).
template <class D>
constexpr int kDirectMaxMT = std::is_same_v<D, Fp4Span> ? 2 : 5;

template <class D, int NT, bool kPre = false>
void rows_tile(const D& dec, const Problem& p, int64_t M, int64_t n0) {
  // Row tiles of near-equal height <= 8 for NT = 1, 2; <= kDirectMaxMT<D> for NT = 4,
  // except one tile where A is prescaled and M = kPrescaledMaxMT.
  constexpr int kMaxMT = NT != 4 ? 8 : kPre ? kPrescaledMaxMT : kDirectMaxMT<D>;
  const int64_t height = kPre && M == kPrescaledMaxMT ? M : NT != 4 ? 8 : kDirectMaxMT<D>;
  const int64_t tiles = (M + height - 1) / height;
  int64_t m0 = 0;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t mt = (M - m0) / (tiles - t);
    switch (mt) {
#define TORCH_BQ_TILE(R)                                                                 \
  case R:                                                                                \
    if constexpr (R <= kMaxMT) {                                                         \
      tile<D, R, NT, kPre>(dec, p, m0, n0);                                                    \
    }                                                                                    \
    break;
      TORCH_BQ_TILE(1) TORCH_BQ_TILE(2) TORCH_BQ_TILE(3) TORCH_BQ_TILE(4)
      TORCH_BQ_TILE(5) TORCH_BQ_TILE(6) TORCH_BQ_TILE(7) TORCH_BQ_TILE(8)
#undef TORCH_BQ_TILE
      default: break;
    }
    m0 += mt;
  }
}

// --------------------------------------------------------------------------
// From Fold<D>::kMinRows rows: the weight decoded once per K-block, used by every row
// --------------------------------------------------------------------------
//
// A task's weight rows go in groups of kFoldRows (two 4-row register tiles).
// For each K-block of kFoldGroups groups (512 elements), the group's rows are
// decoded once, with their e8m0 block scales folded into the bf16 words (an
// exponent add on every nonzero word, exact while the result is a normal bf16),
// into an L1 scratch (8 KiB); then every row tile of A runs over that scratch:
//   for row group (8 weight rows):
//     for K-block kb: scratch[8][512] = decode(W[rows, kb]) * scale
//       for m-tile (MT = 3..5 rows, near-equal heights): for 4-row half h:
//         acc[m-tile][h] (+)= A[m-tile, kb] . scratch[h]      (vdpbf16ps)
//     out[m, n0:n0+8] = lane sums of acc[m][0:8]              (one 8-wide store)
// So every M from there up reads and decodes the weight once; a remainder row
// costs a shorter row tile, never a second pass over the weight (the tiles
// this replaced ran 4 rows per weight pass: M = 5 cost 1.2-1.7x per row what
// M = 4 did). Register tile: MT x 4 accumulators + 8 weight registers + 2 A
// registers <= 30 of the 32 zmm (MT <= 2 would keep two accumulators per
// pair, so that each has one dependent vdpbf16ps per group). An m-tile's
// accumulators go to memory between K-blocks (one load and one store per 16
// vdpbf16ps); its A rows (MT x 1 KiB) serve both halves from L1. A's rows are
// padded to a stride that is not a multiple of 4 KiB: otherwise all rows of a
// K-block fall into the same L1 sets (32 rows, 12 ways). 1 thread, Zen 5:
// 0.80-0.89x of the vdpbf16ps peak in the tile loop alone (L1 data, MT = 3-5).
//
// Below that the per-lane-scale tiles above run (NT = 4 weight rows x MT <=
// kDirectMaxMT<D> rows in registers; taller M as several tiles over the same 4
// weight rows, the later ones reading them from L1): there the decode, not the
// multiply, is the cost, and the scratch round trip (decode, scale, store,
// reload) costs more than decoding the 4 rows again.
//
// The weight rows of the next row group (and their scale rows) are prefetched
// while this one is decoded: the row streams are short (K bytes each), too
// short for the hardware prefetchers to ramp up on their own.
//
// Folding is exact when every scaled word is a normal, finite bf16 and every
// product a multiple of 2**-126 (so vdpbf16ps, which flushes subnormals, never
// meets one): the smallest nonzero weight (fp8 2**-9, fp4 2**-1) times
// 2**(c - 127) is normal for c >= kMinCode, the largest (448, 6) finite for
// c <= kMaxCode, and an A value (a multiple of 2**(e_a - 7)) times a multiple
// of the smallest weight quantum needs c >= kQuantumCode - e_a. The codes are
// checked per K-block as they are loaded; a row group that meets one out of
// range runs the per-lane-scale tiles instead (nothing of it is written
// before its last K-block). fp8 bytes 0x7F / 0xFF are not weights
// (docs/contract.md §1: loaders refuse them; the ops do not scan values).
constexpr int64_t kFoldRows = 8;
constexpr int64_t kFoldGroups = 8;
constexpr int kFoldMaxMT = 5;
// folded_rows lays its accumulator buffer out with two slots per (row, weight
// row) when M <= 2 and one otherwise, while folded_tile<MT> keeps two for
// MT <= 2: the two agree only if no row tile of M >= 3 rows is shorter than 3.
// With near-equal heights of at most kFoldMaxMT, the shortest tile of M > kFoldMaxMT
// rows, floor(M / ceil(M / kFoldMaxMT)), is at least (kFoldMaxMT + 1) / 2 rounded
// down, so 3 or more from kFoldMaxMT = 5 on (at 4, M = 5 would split 2 + 3 and read
// the wrong slots).
static_assert(kFoldMaxMT >= 5, "a folded row tile of 2 rows at M >= 3 would misread the accumulator slots");

// (code - 127) << 7 for 16 e8m0 codes as bf16 words: the exponent add of each block's scale.
inline __m512i block_exponents(__m128i codes) {
  const __m256i c = _mm256_cvtepu8_epi16(codes);
  return _mm512_castsi256_si512(_mm256_slli_epi16(_mm256_sub_epi16(c, _mm256_set1_epi16(127)), 7));
}

// The exponent add of group gg of a K-block on each bf16 word: words 0-15 get
// block 2 gg's, words 16-31 block 2 gg + 1's. `ev` holds (code - 127) << 7
// for the K-block's 16 blocks.
inline __m512i group_exponents(__m512i ev, int64_t gg) {
  const __m512i pick = _mm512_add_epi16(_mm512_mask_set1_epi16(_mm512_setzero_si512(), 0xFFFF0000u, 1),
                                        _mm512_set1_epi16(static_cast<short>(2 * gg)));
  return _mm512_permutexvar_epi16(pick, ev);
}

template <class D>
struct Fold;

template <>
struct Fold<Fp8Dot> {
  static constexpr int kMinCode = 10, kMaxCode = 246, kQuantumCode = 17;
  // Where the folded tiles overtake the per-lane ones (kernel calls, 5 shapes,
  // 1 thread, Zen 5, folded / per-lane time): M = 6 0.99-1.32 (median 1.06),
  // M = 7 0.93-1.02 (0.94), M = 8 0.87-0.99.
  static constexpr int64_t kMinRows = 7;
  template <bool kMasked>
  static void decode(const Fp8Dot& dec, const uint8_t* bytes, __mmask64 valid, __m512i e, uint16_t* dst) {
    const __m512i raw = kMasked ? _mm512_maskz_loadu_epi8(valid, bytes) : _mm512_loadu_si512(bytes);
    __m512i w0, w1;
    dec.bytes(raw, w0, w1);
    const __m512i magnitude = _mm512_set1_epi16(0x7FFF);  // +-0 keep their bits
    _mm512_store_si512(dst, _mm512_mask_add_epi16(w0, _mm512_test_epi16_mask(w0, magnitude), w0, e));
    _mm512_store_si512(dst + 32, _mm512_mask_add_epi16(w1, _mm512_test_epi16_mask(w1, magnitude), w1, e));
  }
};

template <>
struct Fold<Fp4Dot> {
  static constexpr int kMinCode = 2, kMaxCode = 252, kQuantumCode = 9;
  // As for fp8: M = 5 1.02-1.22 (median 1.10; the cliff when folding started
  // there), M = 6 0.99-1.13 (1.02), M = 7 0.88-1.05 (0.97), M = 8 0.86-1.09.
  static constexpr int64_t kMinRows = 7;
  // dec.lut holds the 16 e2m1 values twice: entries 0-15 get the first
  // block's exponent, 16-31 the second's (on the nonzero entries: 0 and 8 are
  // +-0); index bit 4 picks the block.
  template <bool kMasked>
  static void decode(const Fp4Dot& dec, const uint8_t* bytes, __mmask32 valid, __m512i e, uint16_t* dst) {
    const __m512i table = _mm512_mask_add_epi16(dec.lut, 0xFEFEFEFEu, dec.lut, e);
    const __m256i raw = kMasked ? _mm256_maskz_loadu_epi8(valid, bytes) : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
    const __m512i b = _mm512_cvtepu8_epi16(raw);
    const __m512i second = _mm512_maskz_set1_epi16(0xFFFF0000u, 0x10);
    const __m512i nibble = _mm512_set1_epi16(0x0F);
    _mm512_store_si512(dst, _mm512_permutexvar_epi16(_mm512_ternarylogic_epi32(b, nibble, second, 0xEA), table));
    _mm512_store_si512(dst + 32, _mm512_permutexvar_epi16(_mm512_ternarylogic_epi32(_mm512_srli_epi16(b, 4), nibble, second, 0xEA), table));
  }
};

// The smallest code the folded path takes for this A (e_a = a_min_field - 127;
// a_min_field 255: A is zero, kMinCode will do); above Fold<D>::kMaxCode: none.
template <class D>
int lowest_fold_code(const Problem& p) {
  return std::max(Fold<D>::kMinCode, p.a_min_field == 255 ? 0 : Fold<D>::kQuantumCode - (p.a_min_field - 127));
}

// Groups [g0, g0 + groups) of one weight row, scales folded, to dst (group gg
// at dst + gg * 64); false when a code rules the folded path out.
// Blocks past the row's end read code 0; their words are zero and stay so.
template <class D>
inline bool fold_block(const D& dec, const Problem& p, const uint8_t* row, const uint8_t* srow, int64_t g0,
                       int64_t groups, int lowest, uint16_t* dst) {
  const int64_t b0 = 2 * g0, left = p.nblocks - b0;
  const __mmask16 cvalid = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
  const __m128i c8 = _mm_maskz_loadu_epi8(cvalid, srow + b0);
  if ((_mm_mask_cmplt_epu8_mask(cvalid, c8, _mm_set1_epi8(static_cast<char>(lowest))) |
       _mm_mask_cmpgt_epu8_mask(cvalid, c8, _mm_set1_epi8(static_cast<char>(Fold<D>::kMaxCode)))) != 0)
    return false;
  const __m512i ev = block_exponents(c8);
  const uint8_t* bytes = row + g0 * D::kGroupBytes;
  if (groups == kFoldGroups && (g0 + kFoldGroups) * D::kGroupBytes <= p.row_bytes) {
#pragma GCC unroll 8
    for (int64_t gg = 0; gg < kFoldGroups; ++gg)
      Fold<D>::template decode<false>(dec, bytes + gg * D::kGroupBytes, 0, group_exponents(ev, gg), dst + gg * kGroup);
  } else {
    for (int64_t gg = 0; gg < groups; ++gg)
      Fold<D>::template decode<true>(dec, bytes + gg * D::kGroupBytes, D::valid_bytes(p.row_bytes, g0 + gg),
                                     group_exponents(ev, gg), dst + gg * kGroup);
  }
  return true;
}

// acc[MT rows][4 weight rows][kAcc] (+)= A[MT rows, groups] . w (row j's group gg at w + (j * kFoldGroups + gg) * 64).
template <int MT>
__attribute__((always_inline)) inline void folded_tile(const uint16_t* w, int64_t groups, const uint16_t* a, int64_t stride, float* acc, bool first) {
  constexpr int kAcc = MT <= 2 ? 2 : 1;
  __m512 r[MT][4][kAcc];
  if (first) {
    for (int i = 0; i < MT; ++i)
      for (int j = 0; j < 4; ++j)
        for (int h = 0; h < kAcc; ++h) r[i][j][h] = _mm512_setzero_ps();
  } else {
    for (int i = 0; i < MT; ++i)
      for (int j = 0; j < 4; ++j)
        for (int h = 0; h < kAcc; ++h) r[i][j][h] = _mm512_loadu_ps(acc + ((i * 4 + j) * kAcc + h) * 16);
  }
  for (int64_t gg = 0; gg < groups; ++gg) {
    __m512bh w0[4], w1[4];
    for (int j = 0; j < 4; ++j) {
      w0[j] = (__m512bh)_mm512_load_si512(w + (j * kFoldGroups + gg) * kGroup);
      w1[j] = (__m512bh)_mm512_load_si512(w + (j * kFoldGroups + gg) * kGroup + 32);
      // Held in registers: left to itself, GCC re-loads them for every row at MT = 3 (30 loads per 24 vdpbf16ps).
      asm("" : "+v"(w0[j]), "+v"(w1[j]));
    }
    for (int i = 0; i < MT; ++i) {
      const __m512bh a0 = (__m512bh)_mm512_loadu_si512(a + i * stride + gg * kGroup);
      const __m512bh a1 = (__m512bh)_mm512_loadu_si512(a + i * stride + gg * kGroup + 32);
      for (int j = 0; j < 4; ++j) {
        if constexpr (kAcc == 2) {
          r[i][j][0] = _mm512_dpbf16_ps(r[i][j][0], w0[j], a0);
          r[i][j][1] = _mm512_dpbf16_ps(r[i][j][1], w1[j], a1);
        } else {
          r[i][j][0] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(r[i][j][0], w0[j], a0), w1[j], a1);
        }
      }
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < 4; ++j)
      for (int h = 0; h < kAcc; ++h) _mm512_storeu_ps(acc + ((i * 4 + j) * kAcc + h) * 16, r[i][j][h]);
}

struct FoldBuffers {
  std::vector<float> acc;  // [kFoldRows / 4][M][4][slots][16 lanes]
  alignas(64) uint16_t scratch[kFoldRows * kFoldGroups * kGroup];
};

// Weight rows [n0, n0 + rows) (rows <= kFoldRows; missing rows decode as zero
// and are not written) for all M rows. False (nothing written) when a row's
// codes rule the folded path out.
template <class D>
bool folded_rows(const D& dec, const Problem& p, int64_t M, int64_t n0, int64_t rows, FoldBuffers& buf) {
  const WeightView& w = *p.w;
  const uint8_t* wrows[kFoldRows];
  const uint8_t* srows[kFoldRows];
  for (int64_t j = 0; j < rows; ++j) {
    wrows[j] = w.data + (n0 + j) * w.row_stride;
    srows[j] = static_cast<const uint8_t*>(w.scale) + ((n0 + j) / w.bn) * w.scale_stride;
  }
  const int lowest = lowest_fold_code<D>(p);
  if (lowest > Fold<D>::kMaxCode) return false;
  const int64_t slots = M <= 2 ? 2 : 1;  // the accumulators per (row, weight row) of folded_tile<MT>
  const int64_t tiles = (M + kFoldMaxMT - 1) / kFoldMaxMT;
  buf.acc.resize(M * kFoldRows * slots * 16);
  if (rows < kFoldRows) std::memset(buf.scratch, 0, sizeof(buf.scratch));
  // The next row group's rows, at the same offsets as the decode, so the
  // prefetches keep pace with it.
  const bool ahead = n0 + 2 * kFoldRows <= p.N;
  for (int64_t g0 = 0; g0 < p.ngroups; g0 += kFoldGroups) {
    const int64_t groups = std::min(kFoldGroups, p.ngroups - g0);
    for (int64_t j = 0; j < rows; ++j) {
      if (ahead) {
        for (int64_t c = 0; c < groups * D::kGroupBytes; c += 64)
          prefetch_weights(wrows[j] + kFoldRows * w.row_stride + g0 * D::kGroupBytes + c);
        if (g0 % (4 * kFoldGroups) == 0)  // and its scales, 64 codes a line
          _mm_prefetch(reinterpret_cast<const char*>(static_cast<const uint8_t*>(w.scale) +
                                                     ((n0 + kFoldRows + j) / w.bn) * w.scale_stride + 2 * g0),
                       _MM_HINT_T0);
      }
      if (!fold_block(dec, p, wrows[j], srows[j], g0, groups, lowest, buf.scratch + j * kFoldGroups * kGroup))
        return false;  // only buf.acc has been written
    }
    // m-tiles outside the two 4-row halves: a tile's A rows serve both halves from L1.
    int64_t m0 = 0;
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t mt = (M - m0) / (tiles - t);
      const uint16_t* a = p.a + m0 * p.a_stride + g0 * kGroup;
      for (int64_t h = 0; h < kFoldRows / 4 && 4 * h < rows; ++h) {
        const uint16_t* wh = buf.scratch + h * 4 * kFoldGroups * kGroup;
        float* acc = buf.acc.data() + (h * M + m0) * 4 * slots * 16;
        switch (mt) {
          case 1: folded_tile<1>(wh, groups, a, p.a_stride, acc, g0 == 0); break;
          case 2: folded_tile<2>(wh, groups, a, p.a_stride, acc, g0 == 0); break;
          case 3: folded_tile<3>(wh, groups, a, p.a_stride, acc, g0 == 0); break;
          case 4: folded_tile<4>(wh, groups, a, p.a_stride, acc, g0 == 0); break;
          default: folded_tile<5>(wh, groups, a, p.a_stride, acc, g0 == 0); break;
        }
      }
      m0 += mt;
    }
  }
  // out[m, n0:n0+8] = lane sums of the 8 accumulators of row m: halves of
  // each, then a transposing horizontal-add tree, one store per row.
  const __mmask8 store = static_cast<__mmask8>((1u << rows) - 1);
  for (int64_t m = 0; m < M; ++m) {
    __m256 v[kFoldRows];
    for (int64_t j = 0; j < kFoldRows; ++j) {
      const float* r = buf.acc.data() + (((j / 4) * M + m) * 4 + j % 4) * slots * 16;
      __m512 x = _mm512_loadu_ps(r);
      if (slots == 2) x = _mm512_add_ps(x, _mm512_loadu_ps(r + 16));
      v[j] = _mm256_add_ps(_mm512_castps512_ps256(x), _mm512_extractf32x8_ps(x, 1));
    }
    const __m256 q0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 q1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(q0, q1, 0x20), _mm256_permute2f128_ps(q0, q1, 0x31));
    _mm256_mask_storeu_ps(p.out + m * p.N + n0, store, sums);
  }
  return true;
}

// --------------------------------------------------------------------------
// fp8 with scale rows shared by 16 weight rows (32x32 blocks): the scales on A
// --------------------------------------------------------------------------
//
// Where the weight rows of a task share one row of e8m0 codes (w.bn a multiple
// of 16; a task is then one scale row's w.bn rows, up to 128), A times those
// scales, block by block, serves them all: an exponent add on each nonzero
// bf16 word of A, once per task, instead of a scale
// permute and a multiply-add per group, weight row and row of A in the
// tiles. W * (A * s) has the same exact products as the reference's
// (W * A) * s, so only the fp32 summation order differs. Exact while every
// scaled word is a normal bf16 and every product a multiple of 2**-126 (A's
// smallest exponent plus the smallest code's, at least Fp8Dot::kMinExponentA
// (as for A itself on this path), and the largest below the top of the range
// by enough that no sum of K products can overflow where the reference's
// would not); a code 255 (NaN) or one out of that range sends the task's
// rows to the per-lane scales instead.
// From 2 rows of A only: at M = 1 the tiles ran 0.72x the time with the
// weight in L3 (4096 x 4096, kernel calls) but 1.04-1.14x with it in memory
// (cold, 1 thread, Zen 4: the faster loop streamed the weight less well;
// prefetching 3 or 4 tiles ahead or into L1 did not help), while M = 2-6 ran
// 0.82-0.99x cold (4096 x 4096, 2880 x 2880, 4096 x 14336).
constexpr int64_t kPrescaleMinRows = 2;
// Up to 24 rows (up to five tiles over the same 4 weight rows), 16 where K is
// longer than kPrescaleLongK: there the folded tiles become as fast per row or
// faster. The prescaled tiles' time per row stays flat in M; the folded ones' falls,
// and where it meets theirs moved with what ran between the calls (kernel calls,
// cold, 15-21 rounds, Zen 4). Alone, the folded tiles took 0.97-1.12x the prescaled
// time per row at M = 16-18 and 0.92-1.04x at 24 (4096 x 4096, 2880 x 2880,
// 5760 x 2880, 14336 x 4096, 4096 x 14336); with a bf16 F.linear over a 32 MiB
// weight between the calls (as in the ggml side by side) 1.05-1.14x at 17 and
// 0.85-1.05x at 24-25, and at K = 14336 (4096 x 14336) 0.92-1.05x at 17 and
// 0.88-0.94x at 24 (three runs). With the switch at 17 for every K the side by side
// saw steps of 1.11-1.24x per row at 16 -> 17 on four shapes; with it at 11 (stop
// 26), 10 -> 11 was one of 1.11-1.17x (31 rounds). 8192 lies between the K
// measured (4096 and 14336).
constexpr int64_t kPrescaleMaxRows = 24;
constexpr int64_t kPrescaleMaxRowsLongK = 16;
constexpr int64_t kPrescaleLongK = 8192;
inline int64_t prescale_max_rows(int64_t K) { return K > kPrescaleLongK ? kPrescaleMaxRowsLongK : kPrescaleMaxRows; }

// A [M, kp] in Fp8Dot's order times the codes of one scale row, to dst (the
// same layout and stride); false, nothing written, where the codes rule it out.
inline bool prescale_activation(const Problem& p, int64_t M, const uint8_t* codes, uint16_t* dst) {
  int cmin = 255, cmax = 0;
  for (int64_t b = 0; b < p.nblocks; ++b) {
    cmin = std::min<int>(cmin, codes[b]);
    cmax = std::max<int>(cmax, codes[b]);
  }
  // Exponent fields of the scaled words; a sum of K products below 448 * 2**(e + 1) each
  // stays below 2**(e + 10 + bit width of K).
  const int lowest = p.a_min_field + cmin - 127, highest = p.a_max_field + cmax - 127;
  const int sum_bits = 10 + 64 - __builtin_clzll(static_cast<uint64_t>(p.kp));
  if (cmax == 255 || lowest - 127 < Fp8Dot::kMinExponentA || highest + sum_bits > 254) return false;
  const __m512i magnitude = _mm512_set1_epi16(0x7FFF);  // +-0 keep their bits
  for (int64_t g0 = 0; g0 < p.ngroups; g0 += 8) {  // 16 blocks of codes at a time
    const int64_t b0 = 2 * g0, left = p.nblocks - b0;
    const __mmask16 valid = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    const __m512i ev = block_exponents(_mm_maskz_loadu_epi8(valid, codes + b0));
    for (int64_t g = g0; g < std::min(p.ngroups, g0 + 8); ++g) {
      const __m512i e = group_exponents(ev, g - g0);
      for (int64_t m = 0; m < M; ++m)
        for (int r = 0; r < Fp8Dot::kRegs; ++r) {
          const int64_t at = m * p.a_stride + g * 64 + 32 * r;
          const __m512i x = _mm512_load_si512(p.a + at);
          _mm512_store_si512(dst + at, _mm512_mask_add_epi16(x, _mm512_test_epi16_mask(x, magnitude), x, e));
        }
    }
  }
  return true;
}

// `words` bf16 words for A's rows, from a cache line on: `kept` (per thread, kept
// between calls) up to kKeptWords (256 KiB), so that a small call pays no heap
// allocation and zero fill of its own; `own` (per call) above that.
constexpr int64_t kKeptWords = int64_t(1) << 17;
inline uint16_t* a_rows_buffer(std::vector<uint16_t>& kept, std::vector<uint16_t>& own, int64_t words) {
  std::vector<uint16_t>& buffer = words <= kKeptWords ? kept : own;
  if (static_cast<int64_t>(buffer.size()) < words) buffer.resize(words);
  return cache_line_aligned(buffer.data());
}

// The decode-path call with decoder D (A in its order); false (nothing written)
// when A cannot take it.
template <class Fmt, class D>
bool decode_with(const WeightView& w, const float* A, int64_t M, int64_t N, float* out) {
  const int64_t kp = (w.K + D::kGroupElems - 1) / D::kGroupElems * D::kGroupElems;
  // Rows one cache line longer than kp: with a row length that is a multiple
  // of 4 KiB, the rows of a K-block would all fall into the same L1 sets.
  // The buffer starts on a cache line, so no 64-byte load of A straddles two.
  const int64_t a_stride = kp + 32;
  // Nothing reads the rows' padding (or the words before `a`).
  const int64_t words = M * a_stride + 32;
  thread_local std::vector<uint16_t> kept;
  std::vector<uint16_t> own;
  uint16_t* a = a_rows_buffer(kept, own, words);
  int a_max_field = 0;
  const int a_min_field = prepare_activation<D>(A, M, w.K, kp, a_stride, a, &a_max_field);
  if (a_min_field < 0 || (a_min_field != 255 && a_min_field - 127 < D::kMinExponentA)) return false;
  static const D dec;
  const Problem p{&w, a, a_min_field, a_max_field, kp, a_stride, kp / D::kGroupElems, (w.K + 31) / 32,
                  Fmt::row_bytes(w.K), out, N};
  constexpr int64_t kRowsPerTask = 16;  // a multiple of every NT and of kFoldRows
  constexpr bool kFp8 = std::is_same_v<D, Fp8Dot>;
  // Scales on A where a task's weight rows share a scale row (see prescale_activation).
  const bool prescale = kFp8 && w.bn % kRowsPerTask == 0 && a_min_field != 255 && M >= kPrescaleMinRows;
  if constexpr (std::is_same_v<D, typename DotFor<Fmt>::type>) {
    if (M >= (prescale ? prescale_max_rows(w.K) + 1 : Fold<D>::kMinRows)) {
      dot_decode_calls[1].fetch_add(1, std::memory_order_relaxed);
      run_tasks((N + kRowsPerTask - 1) / kRowsPerTask, [&](int64_t t) {
        thread_local FoldBuffers buf;
        const int64_t n_end = std::min(N, (t + 1) * kRowsPerTask);
        for (int64_t n = t * kRowsPerTask; n < n_end; n += kFoldRows) {
          const int64_t rows = std::min(kFoldRows, n_end - n);
          if (!folded_rows(dec, p, M, n, rows, buf))  // scales or bytes out of the folded range
            for (int64_t r = n; r < n + rows; ++r) rows_tile<D, 1>(dec, p, M, r);
        }
      });
      return true;
    }
  }
  dot_decode_calls[0].fetch_add(1, std::memory_order_relaxed);
  // Prescaling, a task is the weight rows of one scale row (up to 128; more would
  // leave too few tasks for the threads), so that A is scaled once per scale row.
  const int64_t task_rows = prescale && w.bn <= 128 ? w.bn : kRowsPerTask;
  run_tasks((N + task_rows - 1) / task_rows, [&](int64_t t) {
    const int64_t n_end = std::min(N, (t + 1) * task_rows);
    int64_t n = t * task_rows;
    if constexpr (kFp8) {
      if (prescale) {
        thread_local std::vector<uint16_t> kept_scaled;
        std::vector<uint16_t> own_scaled;
        uint16_t* scaled_a = a_rows_buffer(kept_scaled, own_scaled, words);
        Problem scaled = p;
        scaled.a = scaled_a;
        const uint8_t* codes = static_cast<const uint8_t*>(w.scale) + (n / w.bn) * w.scale_stride;
        if (prescale_activation(p, M, codes, scaled_a)) {
          prescaled_rows.fetch_add(n_end - n, std::memory_order_relaxed);
          for (; n + 4 <= n_end; n += 4) rows_tile<D, 4, true>(dec, scaled, M, n);
          for (; n < n_end; ++n) rows_tile<D, 1, true>(dec, scaled, M, n);
          return;
        }
      }
    }
    for (; n + 4 <= n_end; n += 4) rows_tile<D, 4>(dec, p, M, n);
    for (; n < n_end; ++n) rows_tile<D, 1>(dec, p, M, n);
  });
  return true;
}

// The whole decode-path call; false (nothing written) when A cannot take it.
// MXFP4 with M = 1 or 2 takes Fp4Span's 128-element spans.
template <class Fmt>
bool linear(const WeightView& w, const float* A, int64_t M, int64_t N, float* out) {
  if constexpr (std::is_same_v<Fmt, Fp4Format>) {
    if (M <= kDirectMaxMT<Fp4Span>) return decode_with<Fmt, Fp4Span>(w, A, M, N, out);
  }
  return decode_with<Fmt, typename DotFor<Fmt>::type>(w, A, M, N, out);
}

}  // namespace dotbf16
#endif  // AVX-512 BF16 + VBMI

template <class Fmt, class S>
void decode_linear(const WeightView& w, const float* A, int64_t M, int64_t N, float* out) {
#if defined(TORCH_BQ_DOT_BF16)
  if constexpr (std::is_same_v<S, uint8_t>) {
    if (w.bk == 32 && dotbf16::linear<Fmt>(w, A, M, N, out)) return;
  }
#endif
  constexpr int64_t kRowsPerTask = 16;  // multiple of the tile height NT
  const float* a_split = nullptr;  // the permuted copy of A, rows a_stride apart (AVX2 builds)
  int64_t a_stride = 0;
  int a_exp = -1;  // >= 0: the copy was multiplied by 2**a_exp for fp8_blocks32_factored (M = 1)
  const Fp4IntActivation* fp4_int = nullptr;  // the int path's A (AVX2 builds, MXFP4 at M <= kFp4IntMaxM)
#if defined(TORCH_BQ_AVX2)
  PermutedActivation split;
  if constexpr (std::is_same_v<S, uint8_t>) {
    if constexpr (std::is_same_v<Fmt, Fp4Format>) permute_activation_groups64(A, M, w.K, split);
    // The fp8 decoder's subnormals are inputs of its multiplies: with DAZ set it cannot run.
    if constexpr (std::is_same_v<Fmt, Fp8Format>) {
      if (w.bk == 32 && !denormals_are_zero()) {
        permute_activation_blocks32(A, M, w.K, split);
        if (M == 1) a_exp = scale_for_factoring(split.data, w.K / 32 * 32);  // the permuted blocks only
      }
    }
  }
  a_split = split.data;
  a_stride = split.stride;
  std::vector<Fp4IntActivation> int_a;
  if constexpr (std::is_same_v<Fmt, Fp4Format> && std::is_same_v<S, uint8_t>) {
    if (M <= kFp4IntMaxM) {  // every row must have an int block, else the float path for all
      int_a.resize(M);
      bool all = true;
      for (int64_t m = 0; m < M && all; ++m) all = prepare_fp4_int(A + m * w.K, w.K, int_a[m]);
      if (all) {
        fp4_int = int_a.data();
        fp4_int_calls[0].fetch_add(1, std::memory_order_relaxed);
        for (const Fp4IntActivation& r : int_a) fp4_int_calls[1].fetch_add(r.float_blocks, std::memory_order_relaxed);
      }
    }
  }
#endif
  run_tasks((N + kRowsPerTask - 1) / kRowsPerTask, [&](int64_t t) {
    decode_rows<Fmt, S>(w, A, a_split, a_stride, a_exp, fp4_int, M, t * kRowsPerTask,
                        std::min(N, (t + 1) * kRowsPerTask), out, N);
  });
}

// --------------------------------------------------------------------------
// prefill path: dequantize tiles of W, then a GEMM microkernel per tile
// --------------------------------------------------------------------------
//
// Every task owns up to 4 consecutive row groups of Nt rows of W (output
// columns n0 .. n0 + Nt; Nt = kDotTaskRows with AVX512_BF16, else kTileRows)
// and computes each for all M rows of A, K chunk by K chunk:
//   for each group, for k-chunk (kc elements, whole scale blocks; kc does not depend on K):
//     bf16 tiles:  panel[Nt, kc] = dequantize(W[n0:n0+Nt, k-chunk])   (L2-resident; bf16 W
//                                                                      with K even: W itself)
//                  C^T[Nt, M] (+)= panel x A^T[k-chunk, :]             (fp32 accumulators)
//     fp32 brgemm: panel^T[kc, Nt] = dequantize(W[n0:n0+Nt, k-chunk])^T
//                  C[M, Nt] (+)= A[:, k-chunk] x panel^T               (fp32 accumulators)
//   out[:, n0:n0+Nt] = C, or (C^T)^T where every chunk of the group ran the bf16 tiles
//   (or the same rounded with the bias into the op's output)
// With AVX512_BF16 the next panel of the task (next chunk, or the next group's
// first) is decoded during the current chunk's multiply (PanelJob, dot_tile);
// for bf16 weights read in place the job only scans it for the subnormal bound.
// The GEMM of a chunk is single-threaded inside each task: the tasks are the
// only parallelism, so no GEMM-internal barrier waits for a descheduled
// thread. Accumulation is fp32 over the whole of K (C or C^T is fp32 and
// accumulates across chunks), so there is one final rounding only, in the
// caller. Extra memory per thread: two bf16 panels (AVX512_BF16), one fp32
// panel and its rows' strip, and an Nt x M fp32 tile, independent of N and of
// K; per call, the packed bf16 copy of A.
//
// Element types of the microkernel:
// * bf16 x bf16 -> fp32 (builds with AVX512_BF16): torch_bq's own vdpbf16ps
//   register tiles (dot_chunk below; oneDNN's brgemm with the panel as its
//   row operand reached only about 0.8x of oneDNN's own matmul). The
//   decoded weights and A are exact in bf16 (docs/contract.md §1, §3), so
//   every product is the fp32 product the reference forms, and each
//   vdpbf16ps adds two of them into an fp32 lane: fp32 accumulation in
//   another order, inside the contract's bound (each term passes through at
//   most K + 1 fp32 roundings). vdpbf16ps treats subnormal inputs and
//   results as zero, so a chunk takes this path only if nothing subnormal can
//   occur: A and the chunk's weights hold no subnormal and the product of
//   their lowest set bits is at least 2**-126 (every product, and every fp32
//   partial sum of them, is then a multiple of that quantum: zero or
//   normal). Other chunks run the fp32 microkernel, and so do the later
//   chunks of their row group (its partial sums may now be subnormal, and
//   vdpbf16ps would read its accumulators as zero); a group that ran bf16
//   chunks first has its C^T transposed into C once, where it switches.
// * fp32 x fp32 -> fp32: oneDNN's brgemm microkernel
//   (at::native::cpublas::brgemm) as C[M, Nt] (+)= A x panel^T (AVX2 /
//   AVX-512 builds, fp32 scales, and the chunks above): the panel is written
//   transposed (rows decoded kStripRows at a time, then moved by register
//   transposes), so that the microkernel's vector dimension is the group's
//   weight rows (64: whole vectors) and A's rows are its broadcast side,
//   read in place from fp32 A (rows K apart) in kTileCols-row calls. With A
//   rows as the vector dimension (C^T = panel x A^T, before 2026-12-02),
//   every 8 or 16 A rows past a multiple of 16 paid for a whole vector block:
//   the time per row stepped up 1.1-1.4x at M = 17, 33, 49, 65.
// * The generic build (CPUs without AVX2) keeps at::mm on fp32 panels.
//
// A weight format plugs in as a "Rows" type (QuantizedRows<Fmt, S>,
// DenseRows<T>) with: chunk_align() (K chunks hold whole multiples of it),
// fp32(n, k0, k1, dst) (dequantized row n, elements [k0, k1)), bf16(n, k0,
// k1, dst16, scratch) -> LowBits (the same as bf16 bits, exact whenever the
// returned bound says normal); optionally PanelJob /
// panel_job (the bf16 panel decode cut into steps), and in_place(n, k0) with
// scan(n, k0, k1) (bf16 weights the tiles read where they lie, and their bound).

// Tiles run per microkernel since load: bf16, fp32, at::mm panels (tests read
// them through the prefill_counts op to see which path a call took).
std::atomic<int64_t> prefill_tiles[3];

constexpr int64_t kTileRows = 64;   // W rows per task (the fp32 microkernel's N: its vector dimension)
constexpr int64_t kTileCols = 64;   // A rows per fp32 microkernel call (its M)
constexpr int64_t kChunkElems = 1024;  // target K chunk

// Lowest possible set bit (as an exponent) of any nonzero element, and
// whether an element is subnormal. kNoSubnormalBits: every value is zero or has
// its lowest bit at or above 2**low_bit.
struct LowBits {
  int low_bit;       // a bound: every nonzero |v| is a multiple of 2**low_bit
  bool subnormal;    // some nonzero element is an fp32/bf16 subnormal
};

#if defined(TORCH_BQ_AVX512)
// The bound of fp32 values that are bf16-exact, 16 at a time (the activation's, taken while
// pack_activation converts it): the smallest exponent field among nonzero elements, and
// whether one of them is subnormal (exponent field 0).
struct ActivationScan {
  __m512i low = _mm512_set1_epi32(255);
  __mmask16 tiny = 0;
  void add(__m512 x) {
    const __m512i mag = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7FFFFFFF));
    const __mmask16 nonzero = _mm512_test_epi32_mask(mag, mag);
    const __m512i e = _mm512_srli_epi32(mag, 23);
    tiny |= _mm512_mask_testn_epi32_mask(nonzero, e, e);
    low = _mm512_mask_min_epu32(low, nonzero, low, e);
  }
  // A bf16-exact value with biased exponent e has its lowest bit >= 2**(e - 127 - 7).
  LowBits bits() const { return {static_cast<int>(_mm512_reduce_min_epu32(low)) - 134, tiny != 0}; }
};
#endif

#if defined(TORCH_BQ_AVX512)
// The bound of bf16 values, 32 at a time: the smallest exponent field among nonzero elements
// (per lane) and whether a nonzero one was subnormal. A's, taken while pack_activation packs
// it from bf16 (as ActivationScan on the same values widened to fp32: bf16 keeps fp32's
// exponent field), and bf16 weights' (DenseRows). No constant operands: inside the register
// tiles (DenseRows' ScanJob) every spare register is taken by accumulators, and one more
// would make GCC spill them around each step.
struct Bf16Scan {
  __m512i low = _mm512_set1_epi16(255);
  __mmask32 tiny = 0;
  void add(__m512i v) {
    const __m512i mag = _mm512_slli_epi16(v, 1);  // the sign shifted out
    const __mmask32 nonzero = _mm512_test_epi16_mask(mag, mag);
    const __m512i e = _mm512_srli_epi16(mag, 8);
    tiny |= _mm512_mask_testn_epi16_mask(nonzero, e, e);
    low = _mm512_mask_min_epu16(low, nonzero, low, e);
  }
  uint32_t min_exp() const {
    const __m512i lo = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(low));
    const __m512i hi = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(low, 1));
    return _mm512_reduce_min_epu32(_mm512_min_epu32(lo, hi));
  }
  LowBits bits() const { return {static_cast<int>(min_exp()) - 134, tiny != 0}; }
};
#endif

// The activation qdq (section "activation qdq" below).
template <bool kF32Out>
void qdq_block_scalar(const uint16_t* x, int64_t len, float recip_peak, void* out, int64_t offset);
#if defined(TORCH_BQ_AVX2)
template <bool kF32Out>
void qdq_block32(const uint16_t* x, float recip_peak, void* out, int64_t offset);
#endif
#if defined(TORCH_BQ_AVX512)
inline bool qdq_bf16x32(const uint16_t* x, float recip_peak, __m512i& y);
#endif
template <bool kF32Out>
void qdq_row(const uint16_t* x, int64_t r, int64_t K, float recip_peak, void* out);
template <bool kF32Out>
void qdq_rows(const uint16_t* x, int64_t M, int64_t K, float recip_peak, void* out);

// A of docs/contract.md §4 as the one-call entry points hold it: bf16 x [M, K] (contiguous)
// and whether A = qdq_fp8(x) (1 x 32 blocks along each row) or bf16(x) itself. The bf16
// tiles pack A straight from it (pack_activation), the qdq done 32 elements at a time on
// the way: before, the entry wrote A as fp32 (4 bytes per element, 29 MB at 512 x 14336)
// and the pack read it back. fp32 A is staged only for the paths that read it.
struct ActivationSource {
  const uint16_t* x = nullptr;
  int64_t M = 0, K = 0;
  bool qdq = false;
  float recip_peak = 1.0f;  // fp32(1 / peak), as qdq_fp8

  // fp32 A [M, K] into a, on the pool's threads (never from inside a task).
  void fp32(float* a) const {
    if (qdq) {
      qdq_rows<true>(x, M, K, recip_peak, a);
    } else {
      widen(a);
    }
  }
  // The same on the calling thread alone (from inside a task: run_tasks does not nest).
  void fp32_here(float* a) const {
    if (!qdq) return widen(a);
    for (int64_t m = 0; m < M; ++m) qdq_row<true>(x, m, K, recip_peak, a);
  }
  void widen(float* a) const {  // bf16(x) as fp32
    for (int64_t i = 0; i < M * K; ++i) a[i] = f32_from_bits(uint32_t(x[i]) << 16);
  }
#if defined(TORCH_BQ_AVX512_BF16)
  // Elements [k, k + 32) of A's row m as bf16 bits, those past K zero (k a multiple of 32:
  // a qdq block); scratch holds 32 uint16_t. The qdq's bf16 output is the same bits as the
  // top half of its fp32 output (both round the same value to bf16 once).
  __m512i bf16x32(int64_t m, int64_t k, uint16_t* scratch) const {
    const int64_t left = K - k;
    const __mmask32 valid = left >= 32 ? ~__mmask32(0) : (__mmask32(1) << left) - 1;
    const uint16_t* row = x + m * K + k;
    // The pack reads 16 rows a cache line at a time each, more streams than the hardware
    // prefetchers follow: the row's line 5 ahead (in-process A/B: 0.1-1.2% faster at M = 128-512).
    if (left > 160) _mm_prefetch(reinterpret_cast<const char*>(row + 160), _MM_HINT_T0);
    if (!qdq) return _mm512_maskz_loadu_epi16(valid, row);
    __m512i y;
    if (left >= 32 && qdq_bf16x32(row, recip_peak, y)) return y;
    qdq_block_scalar<false>(row, std::min<int64_t>(left, 32), recip_peak, scratch, 0);
    return _mm512_maskz_loadu_epi16(valid, scratch);
  }
#endif
};

// The A operands a call's microkernels read, built once per call.
struct GemmOperands {
  int64_t M = 0, K = 0, Kp = 0;  // Kp: K rounded up to even (bf16 pairs)
  at::Tensor a32;                // fp32 [M, K], contiguous (written by stage_a32 first where that is set)
  at::Tensor apack;              // bf16 A^T in pairs, blocked for the dot microkernel (pack_activation), or undefined
  std::vector<uint32_t> arows;   // the row-dot tiles' A rows (rowdot_activation), where apack is defined
  LowBits a_bits{0, false};
  const ActivationSource* stage_a32 = nullptr;  // A packed from here, a32 not written yet
  std::once_flag a32_once;
  // fp32 A for the fp32 microkernel, staged from stage_a32 on first use.
  const float* fp32_a() {
    std::call_once(a32_once, [&] {
      if (stage_a32 != nullptr) stage_a32->fp32_here(a32.data_ptr<float>());
    });
    return a32.data_ptr<float>();
  }
};

inline bool brgemm_enabled() {
  // oneDNN's microkernel is part of MKLDNN; torch.backends.mkldnn.enabled = False switches it off.
  return at::globalContext().userEnabledMkldnn();
}

#if defined(TORCH_BQ_AVX512_BF16)
// Whether oneDNN's bf16 microkernel runs here (it may be capped by ONEDNN_MAX_CPU_ISA).
bool bf16_brgemm_works() {
  static const bool works = [] {
    try {
      std::vector<at::BFloat16> a(2 * 2, at::BFloat16(1.0f)), b(2 * 16, at::BFloat16(1.0f));
      std::vector<float> c(2 * 16, 0.0f);
      at::native::cpublas::brgemm(2, 16, 2, 2, 16, 16, false, a.data(), b.data(), c.data(), true);
      at::native::cpublas::brgemm_release(true);
      return c[0] == 2.0f;
    } catch (const std::exception&) {
      return false;
    }
  }();
  return works;
}
#endif

#if defined(TORCH_BQ_AVX512)
// r[i][j] <- r[j][i] for a 16 x 16 matrix of 32-bit elements, one row per register.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
  }
}
#endif

#if defined(TORCH_BQ_AVX512_BF16)
// The bf16 microkernel (vdpbf16ps). A register tile holds C^T[r0 : r0 + NR,
// m0 : m0 + 16 MV] as NR x MV vectors of 16 A rows: per pair of K elements it
// loads MV vectors of A pairs and broadcasts one (w[n, 2p], w[n, 2p + 1]) pair
// per weight row, so each vdpbf16ps adds the two products of one pair into 16
// output lanes. 6 x 4 = 24 accumulators: enough independent chains to keep
// two vdpbf16ps per cycle in flight (latency x throughput is about 12 on
// Zen 4/5 and Sapphire Rapids) with 8 registers left for operands; 10 loads
// per 24 instructions stay under the load ports' rate.
//
// A is packed once per call (pack_activation) in blocks of kDotBlock rows:
// block b holds rows [kDotBlock b, + width) as [Kp/2][width] uint32 bf16 pairs
// (width = kDotBlock, the last block's rows rounded up to 16 with zero rows),
// starting at element kDotBlock * b * Kp/2, so a register tile reads one
// contiguous stream (up to 12 rows past the last whole 16-row vector are
// multiplied by the row-dot tiles instead, from a row-major copy: rowdot_rows).
// Per task (kDotTaskRows weight rows) and K chunk
// (kDotChunk elements): the bf16 panel (96 x 1024 x 2 = 192 KiB) and one
// block's chunk of A (512 pairs x 64 rows x 4 = 128 KiB) sit in L2 together
// with the fp32 C^T tile; the panel is decoded once and read by every A
// block, each A block by the 16 register tiles of the task. On the Zen 5
// benchmark machine the tile runs at 510-530 GFLOP/s per core from L2
// (vdpbf16ps peak about 2 x 64 flops per cycle), i.e. K does not shrink
// anything: the chunk is a fixed width and the tile covers the task's rows.
constexpr int64_t kDotRows = 6;     // weight rows per register tile
constexpr int64_t kDotBlock = 64;   // A rows per packed block: 4 vectors of 16
constexpr int64_t kDotChunk = 1024;  // K elements per panel chunk on this path
constexpr int64_t kDotTaskRows = 96;  // W rows per task on this path: 16 register tiles

inline int64_t packed_block_width(int64_t M, int64_t m0) {
  return std::min(kDotBlock, (M - m0 + 15) / 16 * 16);
}

// Memory for a packed A of `count` int32 pairs, 64-byte aligned: kept per calling thread up
// to kKeptPackBytes (the largest so far; one buffer for every pack_pairs instance), not
// allocated per call: the allocator gave some sizes back to the OS on free, and each call
// faulted the pages in again (4096 x 14336, M = 512: about 3000 page faults per call,
// 14.7 MB). Aligned as at::empty's memory is: the register tiles load A in whole 64-byte
// vectors, and from a std::vector's 16-byte-aligned data every one of them spans two cache
// lines (4096 x 4096, M = 89-128: 1-7% slower than with the aligned buffer).
inline at::Tensor packed_a_buffer(int64_t count) {
  constexpr int64_t kKeptPackBytes = int64_t(64) << 20;
  if (count * 4 > kKeptPackBytes) return at::empty({count}, at::TensorOptions().dtype(at::kInt));
  thread_local std::vector<int32_t> kept;
  if (static_cast<int64_t>(kept.size()) < count + 16) kept.resize(count + 16);
  return at::from_blob(cache_line_aligned(kept.data()), {count},
                       at::TensorOptions().dtype(at::kInt));
}

// bf16 pairs of A^T, 16 rows x 32 elements at a time (load(m, k, scan, scratch): row m's
// elements [k, k + 32) as 16 pairs, scanned into `scan`), transposed to 16 x 16 pairs. Rows
// past M and elements past K are zero. `bits` gets A's bound, taken from the same loads.
template <class Scan, class Load>
at::Tensor pack_pairs(int64_t M, int64_t kp2, LowBits& bits, const Load& load) {
  const int64_t blocks = (M + kDotBlock - 1) / kDotBlock;
  const int64_t total = (blocks - 1) * kDotBlock + packed_block_width(M, (blocks - 1) * kDotBlock);
  at::Tensor packed = packed_a_buffer(total * kp2);
  int32_t* dst = packed.data_ptr<int32_t>();
  constexpr int64_t kPairsPerTask = 512;  // a multiple of 16
  const int64_t spans = (kp2 + kPairsPerTask - 1) / kPairsPerTask;
  std::vector<LowBits> task_bits(blocks * spans);
  run_tasks(blocks * spans, [&](int64_t t) {
    Scan scan;
    alignas(64) uint16_t scratch[32];
    const int64_t m0 = t / spans * kDotBlock, width = packed_block_width(M, m0);
    const int64_t p0 = t % spans * kPairsPerTask, p1 = std::min(kp2, p0 + kPairsPerTask);
    int32_t* block = dst + m0 * kp2;
    for (int64_t g = 0; g < width; g += 16) {
      for (int64_t p = p0; p < p1; p += 16) {
        __m512i r[16];
        for (int i = 0; i < 16; ++i) {
          const int64_t m = m0 + g + i;
          r[i] = m < M ? load(m, 2 * p, scan, scratch) : _mm512_setzero_si512();
        }
        transpose16(r);
        const int64_t n = std::min<int64_t>(16, p1 - p);
        for (int64_t j = 0; j < n; ++j) _mm512_storeu_si512(block + (p + j) * width + g, r[j]);
      }
    }
    task_bits[t] = scan.bits();
  });
  bits = {std::numeric_limits<int>::max(), false};
  for (const LowBits& b : task_bits) bits = {std::min(bits.low_bit, b.low_bit), bits.subnormal || b.subnormal};
  return packed;
}

// From fp32 A [M, K] of bf16-exact values (so the conversion is exact; vcvtne2ps2bf16
// flushes subnormals: the packed copy is exact only where bits.subnormal is false).
at::Tensor pack_activation(const at::Tensor& A, int64_t kp2, LowBits& bits) {
  const int64_t K = A.size(1);
  const float* a = A.data_ptr<float>();
  return pack_pairs<ActivationScan>(A.size(0), kp2, bits, [&](int64_t m, int64_t k, ActivationScan& scan, uint16_t*) {
    const int64_t left = K - k;
    const __mmask16 lo = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << std::max<int64_t>(left, 0)) - 1);
    const __mmask16 hi = left >= 32 ? __mmask16(0xFFFF) : left <= 16 ? __mmask16(0) : __mmask16((1u << (left - 16)) - 1);
    const float* row = a + m * K + k;
    const __m512 x0 = _mm512_maskz_loadu_ps(lo, row), x1 = _mm512_maskz_loadu_ps(hi, row + 16);
    scan.add(x0);
    scan.add(x1);
    return (__m512i)_mm512_cvtne2ps_pbh(x1, x0);
  });
}

// From the entry points' bf16 x, qdq'd on the way where A is qdq(x): bf16 pairs are A's
// bits as they are, so the pack is the transpose alone.
at::Tensor pack_activation(const ActivationSource& src, int64_t kp2, LowBits& bits) {
  return pack_pairs<Bf16Scan>(src.M, kp2, bits, [&](int64_t m, int64_t k, Bf16Scan& scan, uint16_t* scratch) {
    const __m512i v = src.bf16x32(m, k, scratch);
    scan.add(v);
    return v;
  });
}

// The decode of the next K chunk's panel, cut into steps of 32 elements that
// the register tiles of the current chunk interleave with their vdpbf16ps
// (see PanelJob below). NoJob: nothing to interleave. A job's kPrefetchesA says
// whether its steps also carry dot_chunk's prefetch of A (PrefetchingJob).
struct NoJob {
  static constexpr bool kPrefetchesA = false;
  void step() {}
};

// C^T[NR rows (stride ldc), 16 MV columns] (+)= w[NR, 2 kp] x a^T: w bf16 rows of
// 2 ws elements, a the packed pairs of one block (row stride as). The last
// vector's columns beyond `tail` are neither read nor written. Meanwhile
// `steps` steps of `job` run, one every kp / steps pairs: the decode's loads
// and integer work use ports the vdpbf16ps chains leave idle, and its memory
// latency hides behind them (done as a separate pass, the decode took about a
// fifth of the multiply's time at M = 128, half of it waiting on memory).
// Never inlined: inlined into its caller (where it has a single one), the tile's
// registers were allocated in the caller's context, and bf16_linear's tiles ran
// about a tenth slower at M = 128.
template <int NR, int MV, class Job>
__attribute__((noinline)) void dot_tile(const uint16_t* w, int64_t ws, const uint32_t* a, int64_t as, int64_t kp,
                                        float* c, int64_t ldc, bool accumulate, __mmask16 tail, Job* job,
                                        int64_t steps) {
  // The chains start from zero and C^T is added once at the end: loaded first, from L2 (the
  // task's C^T is 96 x M floats), its loads held up every chain at each of the 16 tiles x
  // blocks calls per chunk (M = 128-512: the calls 0.4-2.7% faster this way).
  __m512 acc[NR][MV];
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < MV; ++v) acc[r][v] = _mm512_setzero_ps();
  // Runs of `interval` pairs without a branch, a job step after each (a step
  // inside the pair loop made GCC store every accumulator on each pair).
  const int64_t interval = steps > 0 ? std::max<int64_t>(1, kp / steps) : kp;
  int64_t left = steps;
  for (int64_t p = 0; p < kp;) {
    const int64_t end = left > 0 ? std::min(kp, p + interval) : kp;
    for (; p < end; ++p) {
      __m512bh av[MV];
      for (int v = 0; v < MV; ++v) av[v] = (__m512bh)_mm512_loadu_si512(a + p * as + 16 * v);
      for (int r = 0; r < NR; ++r) {
        uint32_t pair;
        std::memcpy(&pair, w + 2 * (r * ws + p), sizeof pair);
        const __m512bh wb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
        for (int v = 0; v < MV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], av[v], wb);
      }
    }
    if constexpr (!std::is_same_v<Job, NoJob>) {
      if (left > 0) {
        job->step();
        --left;
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < MV; ++v) {
      const __mmask16 lanes = v == MV - 1 ? tail : __mmask16(0xFFFF);
      float* ct = c + r * ldc + 16 * v;
      _mm512_mask_storeu_ps(ct, lanes, accumulate ? _mm512_add_ps(acc[r][v], _mm512_maskz_loadu_ps(lanes, ct)) : acc[r][v]);
    }
  if constexpr (!std::is_same_v<Job, NoJob>) {
    for (; left > 0; --left) job->step();
  }
}

template <class Job>
using DotTile = void (*)(const uint16_t*, int64_t, const uint32_t*, int64_t, int64_t, float*, int64_t, bool, __mmask16,
                         Job*, int64_t);

template <int NR, class Job>
constexpr DotTile<Job> dot_tile_for(int mv) {
  return mv == 1   ? &dot_tile<NR, 1, Job>
         : mv == 2 ? &dot_tile<NR, 2, Job>
         : mv == 3 ? &dot_tile<NR, 3, Job>
                   : &dot_tile<NR, 4, Job>;
}

// Partial register tiles (the last rows of the last row group) never carry job steps.
inline DotTile<NoJob> partial_dot_tile(int nr, int mv) {
  switch (nr) {
    case 1: return dot_tile_for<1, NoJob>(mv);
    case 2: return dot_tile_for<2, NoJob>(mv);
    case 3: return dot_tile_for<3, NoJob>(mv);
    case 4: return dot_tile_for<4, NoJob>(mv);
    default: return dot_tile_for<5, NoJob>(mv);
  }
}

// The A rows past the last whole 16-row vector, where there are few of them:
// in a broadcast tile they would fill one vector of 16 lanes, and that vector
// costs as much as 16 rows (M = 65: the 6 x 4 tiles of the first 64 rows plus
// 6 x 1 tiles whose 16 lanes hold one row, 1.17-1.39x the time per row of
// M = 64 on a Zen 4). rowdot_tile takes them instead: per weight row and A
// row a dot product along K, 32 products per vdpbf16ps whatever the count.
// Up to kRowDotMaxRows of them: M = 65-80 then cost 1.01-1.05x the time per
// row of M = 64 (4096 x 4096 and 2880 x 2880 fp8, 1 thread, Zen 4; with 8,
// M = 73 still rose 1.08x over 72). From about 13 rows a vector is the
// cheaper: hot, on a 768 x 1024 fp8 weight, M = 1-8 as row-dot rows took
// 89-150 us (8.7 us per row; the row-dot tiles read the panel from L2 once
// per 3 rows), M = 16 as one vector 203 us.
constexpr int64_t kRowDotMaxRows = 12;
// A rows per row-dot register tile: 6 x 3 accumulators. 6 x 4 (and 8 x 3, 12 x 2) spill
// accumulators to the stack: 0.37 vdpbf16ps per cycle from an L2-resident panel against
// 0.92 for 6 x 3 (Zen 4; one A row, 0.47: there the panel's L2 reads are the limit).
constexpr int64_t kRowDotMT = 3;

// A rows of an M-row call that the row-dot tiles take: the last M % 16, or none.
inline int64_t rowdot_rows(int64_t M) {
  const int64_t rest = M % 16;
  return rest <= kRowDotMaxRows ? rest : 0;
}

// Chunks that ran row-dot tiles since load (tests read them through the rowdot_chunks op).
std::atomic<int64_t> rowdot_chunks_run{0};

// C^T[NR rows (stride ldc), MR columns] (+)= w[NR, 2 kp] . a[MR, 2 kp]: w the panel's
// bf16 rows (ws pairs apart), a the row-dot rows' bf16 pairs (as pairs apart). Lane l
// of each accumulator sums pairs 16 j + l; its 16 lanes are added once at the end.
template <int NR, int MR>
__attribute__((noinline)) void rowdot_tile(const uint16_t* w, int64_t ws, const uint32_t* a, int64_t as, int64_t kp,
                                           float* c, int64_t ldc, bool accumulate) {
  __m512 acc[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MR; ++i) acc[r][i] = _mm512_setzero_ps();
  // One loop, masked loads throughout (the mask is all ones but in the last step).
  for (int64_t p = 0; p < kp; p += 16) {
    const __mmask16 valid = kp - p >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (kp - p)) - 1);
    __m512bh av[MR];
    for (int i = 0; i < MR; ++i) av[i] = (__m512bh)_mm512_maskz_loadu_epi32(valid, a + i * as + p);
    for (int r = 0; r < NR; ++r) {
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi32(valid, w + 2 * (r * ws + p));
      for (int i = 0; i < MR; ++i) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], wv, av[i]);
    }
  }
  // Unrolled: left as a loop, it indexes acc at run time, and GCC then kept every accumulator
  // in memory as well (a store after each vdpbf16ps of the loop above).
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      const float sum = _mm512_reduce_add_ps(acc[r][i]);
      c[r * ldc + i] = accumulate ? c[r * ldc + i] + sum : sum;
    }
}

using RowDotTile = void (*)(const uint16_t*, int64_t, const uint32_t*, int64_t, int64_t, float*, int64_t, bool);

template <int NR>
constexpr RowDotTile rowdot_tile_for(int mr) {
  static_assert(kRowDotMT == 3, "one instance per tile height");
  return mr == 1 ? &rowdot_tile<NR, 1> : mr == 2 ? &rowdot_tile<NR, 2> : &rowdot_tile<NR, 3>;
}

inline RowDotTile rowdot_tile_of(int nr, int mr) {
  switch (nr) {
    case 1: return rowdot_tile_for<1>(mr);
    case 2: return rowdot_tile_for<2>(mr);
    case 3: return rowdot_tile_for<3>(mr);
    case 4: return rowdot_tile_for<4>(mr);
    case 5: return rowdot_tile_for<5>(mr);
    default: return rowdot_tile_for<kDotRows>(mr);
  }
}

// C^T[rows, M] columns [M - count, M) (+)= panel[rows, 2 kp] . the row-dot rows' pairs
// [p0, p0 + kp) (arows: count rows of kp2 pairs).
inline void rowdot_chunk(const uint16_t* panel, int64_t ws, int64_t rows, const uint32_t* arows, int64_t count,
                         int64_t kp2, int64_t p0, int64_t kp, int64_t M, float* c, bool accumulate) {
  const int64_t tiles = (count + kRowDotMT - 1) / kRowDotMT;
  for (int64_t r0 = 0; r0 < rows; r0 += kDotRows) {
    const int nr = static_cast<int>(std::min(kDotRows, rows - r0));
    int64_t i0 = 0;
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t mr = (count - i0) / (tiles - t);  // near-equal heights
      rowdot_tile_of(nr, static_cast<int>(mr))(panel + 2 * r0 * ws, ws, arows + i0 * kp2 + p0, kp2, kp,
                                               c + r0 * M + (M - count) + i0, M, accumulate);
      i0 += mr;
    }
  }
  rowdot_chunks_run.fetch_add(1, std::memory_order_relaxed);
}

// The row-dot rows' bf16 pairs, row-major [count][kp2], gathered from the packed A (its
// last block's columns past the whole vectors).
inline std::vector<uint32_t> rowdot_activation(const uint32_t* apack, int64_t M, int64_t kp2) {
  const int64_t count = rowdot_rows(M);
  std::vector<uint32_t> rows(count * kp2);
  if (count == 0) return rows;
  const int64_t m0 = (M - 1) / kDotBlock * kDotBlock, width = packed_block_width(M, m0);
  const int64_t first = M - count - m0;  // column of the first row-dot row in its block
  const uint32_t* block = apack + m0 * kp2;
  for (int64_t p = 0; p < kp2; ++p)
    for (int64_t i = 0; i < count; ++i) rows[i * kp2 + p] = block[p * width + first + i];
  return rows;
}

// A job whose steps also bring A's next pairs into L2 (dot_chunk): after each
// step of the job, the lines of [ahead, edge += per_step).
template <class Job>
struct PrefetchingJob {
  Job* job;
  const char* ahead = nullptr;
  const char* edge = nullptr;
  int64_t per_step = 0;
  void step() {
    job->step();
    for (edge += per_step; ahead < edge; ahead += 64) _mm_prefetch(ahead, _MM_HINT_T1);
  }
};

// C^T[rows, M] (+)= panel[rows, 2 kp] x A^T[pairs p0 .. p0 + kp) with the packed A; panel
// rows are ws pairs apart (kp for a decoded panel, K / 2 for bf16 weights read in place).
// Meanwhile `job` (null: none) decodes the next panel, its steps shared out
// over the full register tiles (any left run at the end), and where the job
// says so the same steps prefetch the pairs the tiles read next into L2, an
// equal share per tile: a block's 16 tiles read its pairs of the chunk (128 KiB)
// from L2, but its first tile would otherwise wait for them on L3 or memory (at
// M = 512, K = 14336 the packed A is 14.7 MB, read again by every row group; in a
// microbenchmark of the tiles alone the prefetch took them from about 90% to 96%
// of their rate with A held in L2). (A software prefetch of the panel after next
// into L2, a share of its lines issued before each register tile, cost 1-5% at
// every shape measured once the steps prefetch the next row themselves: removed.)
template <class Job>
void dot_chunk(const uint16_t* panel, int64_t ws, int64_t rows, const uint32_t* apack, const uint32_t* arows,
               int64_t kp2, int64_t p0, int64_t kp, int64_t M, float* c, bool accumulate, Job* job, int64_t steps) {
  // The broadcast tiles take A rows [0, Mv), the row-dot tiles the rest (arows, rowdot_rows).
  const int64_t rest = rowdot_rows(M), Mv = M - rest;
  const int64_t blocks = (Mv + kDotBlock - 1) / kDotBlock, tiles = rows / kDotRows;
  int64_t job_calls = job == nullptr ? 0 : blocks * tiles;
  PrefetchingJob<Job> prefetching{job};
  for (int64_t m0 = 0; m0 < Mv; m0 += kDotBlock) {
    const int64_t width = packed_block_width(M, m0), cols = std::min(kDotBlock, Mv - m0);
    const int mv = static_cast<int>((cols + 15) / 16);
    const __mmask16 tail = cols % 16 == 0 ? __mmask16(0xFFFF) : __mmask16((1u << (cols % 16)) - 1);
    const uint32_t* a = apack + m0 * kp2 + p0 * width;
    // What the tiles read next: this chunk's pairs of the next block, else the first
    // block's next chunk (or its first chunk, where the next row group starts).
    const int64_t next_m0 = m0 + kDotBlock < Mv ? m0 + kDotBlock : 0;
    const int64_t next_p0 = next_m0 > 0 ? p0 : p0 + kp < kp2 ? p0 + kp : 0;
    const int64_t next_width = packed_block_width(M, next_m0);
    const char* next = reinterpret_cast<const char*>(apack + next_m0 * kp2 + next_p0 * next_width);
    const int64_t span = tiles > 0 ? std::min(kp, kp2 - next_p0) * next_width * 4 / tiles : 0;  // bytes per tile
    for (int64_t r0 = 0; r0 < rows; r0 += kDotRows) {
      const uint16_t* w = panel + 2 * r0 * ws;
      float* ct = c + r0 * M + m0;
      if (rows - r0 < kDotRows) {
        partial_dot_tile(static_cast<int>(rows - r0), mv)(w, ws, a, width, kp, ct, M, accumulate, tail, nullptr, 0);
      } else if (job_calls > 0) {
        const int64_t share = (steps + job_calls - 1) / job_calls;
        if constexpr (Job::kPrefetchesA) {
          prefetching.ahead = prefetching.edge = next + r0 / kDotRows * span;
          prefetching.per_step = share > 0 ? span / share : 0;
          dot_tile_for<kDotRows, PrefetchingJob<Job>>(mv)(w, ws, a, width, kp, ct, M, accumulate, tail, &prefetching,
                                                          share);
        } else {
          dot_tile_for<kDotRows, Job>(mv)(w, ws, a, width, kp, ct, M, accumulate, tail, job, share);
        }
        steps -= share;
        --job_calls;
      } else {
        dot_tile_for<kDotRows, NoJob>(mv)(w, ws, a, width, kp, ct, M, accumulate, tail, nullptr, 0);
      }
    }
  }
  if (rest > 0) rowdot_chunk(panel, ws, rows, arows, rest, kp2, p0, kp, M, c, accumulate);
  for (; job != nullptr && steps > 0; --steps) job->step();
}
#endif

#if defined(TORCH_BQ_AVX512_BF16)
// 32 fp8 elements as bf16 bits for an e8m0 code up to 134, without DAZ: each
// byte sign-extended, shifted left 20 and masked to its sign and bits 20..26
// is an fp32 equal to e4m3(b) * 2**-120 (subnormal for the smallest codes),
// times sv = 2**(code - 127 + 120) exactly; vcvtne2ps2bf16 is exact on
// bf16-exact values (it flushes subnormal ones, but a panel that could hold
// any is never multiplied in bf16: low_bits).
inline __m512i fp8_bf16x32(const uint8_t* src, __m512 sv) {
  const __m512i keep = _mm512_set1_epi32(static_cast<int>(0x87F00000u));
  __m512 v[2];
  for (int h = 0; h < 2; ++h) {
    const __m512i d = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16 * h)));
    v[h] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(d, 20), keep)), sv);
  }
  return (__m512i)_mm512_cvtne2ps_pbh(v[1], v[0]);
}

inline __m512 fp8_lean_scale(uint8_t code) {
  return _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>((uint32_t(code) + 120) << 23)));
}

// One 32-element MXFP4 block (16 bytes) as bf16 bits: the 16 e2m1 values times
// the scale (fp32 products, as the reference forms them; exact in bf16
// wherever the result is used), then one word lookup per element: nibble
// pairs of byte j are words 2j (low nibble) and 2j + 1 (high nibble).
inline __m512i fp4_bf16x32(const uint8_t* src, float scale) {
  const __m512 values = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f, -1.5f,
                                       -2.0f, -3.0f, -4.0f, -6.0f);
  const __m512i nibble = _mm512_set1_epi32(0x0F);
  const __m512 scaled = _mm512_mul_ps(values, _mm512_set1_ps(scale));
  const __m512i table = _mm512_castsi256_si512(_mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(scaled), 16)));
  const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  const __m512i idx = _mm512_or_si512(_mm512_and_si512(x, nibble),
                                      _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(x, 4), nibble), 16));
  return _mm512_permutexvar_epi16(idx, table);
}

// The bf16 panel of QuantizedRows<Fmt, uint8_t>::bf16 for rows [n0, n0 + rows),
// elements [k0, k1), as steps of 32 elements (row by row), for a chunk the
// lean decoders above cover whole: 32-aligned blocks and chunk, e8m0 codes
// up to 134 and no DAZ for fp8. The same values as bf16(), and the same bound.
template <class Fmt>
struct QuantPanelJob {
  const uint8_t* row = nullptr;     // the current row's bytes at element k0
  const uint8_t* scales = nullptr;  // e8m0 codes [ceil(N / bn), scale_stride]
  const uint8_t* srow = nullptr;    // the current row's codes from block k0 / bk
  uint16_t* out = nullptr;          // the current row's panel row
  int64_t row_stride = 0, scale_stride = 0, bn = 1, kb0 = 0, per_block = 1, padded = 0;
  int64_t n = 0, n_end = 0, units = 0, total = 0, j = 0, jb = 0, b = 0;
  LowBits low{0, true};
  static constexpr bool kPrefetchesA = true;  // see dot_chunk

  bool init(const WeightView& w, int64_t n0, int64_t rows, int64_t k0, int64_t k1, uint16_t* dst, int64_t padded_) {
    constexpr bool fp8 = std::is_same_v<Fmt, Fp8Format>;
    if (w.bk % 32 != 0 || (k1 - k0) % 32 != 0 || (fp8 && denormals_are_zero())) return false;
    scales = static_cast<const uint8_t*>(w.scale);
    scale_stride = w.scale_stride;
    bn = w.bn;
    kb0 = k0 / w.bk;
    const int64_t kb1 = (k1 + w.bk - 1) / w.bk;
    uint32_t min_code = 255, max_code = 0;
    for (int64_t g = n0 / bn; g <= (n0 + rows - 1) / bn; ++g) {
      for (int64_t bb = kb0; bb < kb1; ++bb) {
        const uint32_t code = scales[g * scale_stride + bb];
        min_code = std::min(min_code, code);
        max_code = std::max(max_code, code);
      }
    }
    if (fp8 && max_code > 134) return false;
    // As QuantizedRows::low_bits: e4m3 values are multiples of 2**-9, e2m1 values of 0.5.
    const int low_bit = static_cast<int>(min_code) - 127 + (fp8 ? -9 : -1);
    low = {low_bit, low_bit < -126};
    row_stride = w.row_stride;
    row = w.data + n0 * row_stride + Fmt::row_bytes(k0);
    n = n0;
    n_end = n0 + rows;
    out = dst;
    padded = padded_;
    per_block = w.bk / 32;
    units = (k1 - k0) / 32;
    total = rows * units;
    return true;
  }
  int64_t steps() const { return total; }
  LowBits bits() const { return low; }
  void step() {
    if (j == 0) srow = scales + (n / bn) * scale_stride + kb0;
    // The next row's bytes at this position, a row of steps ahead (the only
    // software prefetch of the weights left).
    if (n + 1 < n_end) _mm_prefetch(reinterpret_cast<const char*>(row + row_stride + Fmt::row_bytes(32 * j)), _MM_HINT_T0);
    __m512i v;
    if constexpr (std::is_same_v<Fmt, Fp8Format>) {
      v = fp8_bf16x32(row + 32 * j, fp8_lean_scale(srow[b]));
    } else {
      v = fp4_bf16x32(row + 16 * j, kTables.e8m0[srow[b]]);
    }
    _mm512_storeu_si512(reinterpret_cast<void*>(out + 32 * j), v);
    if (++jb == per_block) {
      jb = 0;
      ++b;
    }
    if (++j == units) {
      j = jb = b = 0;
      ++n;
      row += row_stride;
      out += padded;
    }
  }
};
#endif

// The weight side of one task: fills panels with rows [n0, n0 + rows) of W,
// elements [k0, k1) of each, as fp32 or as bf16 bits, and says the lowest-bit
// bound of a tile's (decoded) elements.
template <class Fmt, class S>
struct QuantizedRows {
  const WeightView& w;
  int64_t chunk_align() const { return w.bk; }  // chunks hold whole scale blocks
  // Dequantize elements [k0, k1) (k0 a block start) of row n into dst[0, k1 - k0).
  void fp32(int64_t n, int64_t k0, int64_t k1, float* dst) const {
    const uint8_t* row = w.data + n * w.row_stride;
    const S* srow = static_cast<const S*>(w.scale) + (n / w.bn) * w.scale_stride;
    for (int64_t b = k0 / w.bk; b * w.bk < k1; ++b) {
      const int64_t b0 = b * w.bk, b1 = std::min(k1, b0 + w.bk);
      const float s = scale_value(srow, b);
      int64_t k = b0;
#if defined(TORCH_BQ_AVX2)
      bool ok = true;
      const float folded = folded_scale<Fmt>(srow, b, ok);
      if (ok) {
        const __m256 sv = _mm256_set1_ps(folded);
        for (; k + 16 <= b1; k += 16) {
          __m256 w0, w1;
          Fmt::decode16(row, k, w0, w1);
          _mm256_storeu_ps(dst + k - k0, _mm256_mul_ps(w0, sv));
          _mm256_storeu_ps(dst + k - k0 + 8, _mm256_mul_ps(w1, sv));
        }
      }
#endif
      for (; k < b1; ++k) dst[k - k0] = Fmt::scalar(row, k) * s;
    }
  }
  // Lowest-bit bound of the decoded elements [k0, k1) of row n, from the smallest scale code.
  LowBits low_bits(int64_t n, int64_t k0, int64_t k1) const {
    if constexpr (!std::is_same_v<S, uint8_t>) {
      return {0, true};  // fp32 multipliers: w * s is not exact in bf16
    } else {
      const uint8_t* srow = static_cast<const uint8_t*>(w.scale) + (n / w.bn) * w.scale_stride;
      uint32_t min_code = 255;
      for (int64_t b = k0 / w.bk; b * w.bk < k1; ++b) min_code = std::min<uint32_t>(min_code, srow[b]);
      // e4m3 values are multiples of 2**-9 (the smallest nonzero one), e2m1 values of 0.5.
      const int lowest = std::is_same_v<Fmt, Fp4Format> ? -1 : -9;
      const int low_bit = static_cast<int>(min_code) - 127 + lowest;
      return {low_bit, low_bit < -126};
    }
  }
  // bf16 bits of the same elements: the top half of each fp32 value, exact
  // whenever low_bits says the elements are normal (the only case the bf16
  // microkernel runs). Returns low_bits of the elements.
  LowBits bf16(int64_t n, int64_t k0, int64_t k1, uint16_t* dst, float* scratch) const {
#if defined(TORCH_BQ_AVX512)
    const uint8_t* row = w.data + n * w.row_stride;
    const S* srow = static_cast<const S*>(w.scale) + (n / w.bn) * w.scale_stride;
    const bool daz = denormals_are_zero();
    int64_t b = k0 / w.bk;
    if constexpr (std::is_same_v<S, uint8_t>) {
      // Whole blocks in the lean loops below while they apply; the general loop does the rest.
      if constexpr (std::is_same_v<Fmt, Fp8Format>) {
#if defined(TORCH_BQ_AVX512_BF16)
        if (!daz && w.bk % 32 == 0) {
          for (; (b + 1) * w.bk <= k1 && srow[b] <= 134; ++b) {
            const __m512 sv = fp8_lean_scale(srow[b]);
            const uint8_t* src = row + b * w.bk;
            uint16_t* out = dst + (b * w.bk - k0);
            for (int64_t j = 0; j < w.bk; j += 32)
              _mm512_storeu_si512(reinterpret_cast<void*>(out + j), fp8_bf16x32(src + j, sv));
          }
        }
#endif
      } else if constexpr (std::is_same_v<Fmt, Fp4Format>) {
#if defined(TORCH_BQ_AVX512_BF16)
        if (w.bk == 32) {
          for (; (b + 1) * 32 <= k1; ++b)
            _mm512_storeu_si512(reinterpret_cast<void*>(dst + (b * 32 - k0)), fp4_bf16x32(row + b * 16, kTables.e8m0[srow[b]]));
        }
#endif
      }
    }
    for (; b * w.bk < k1; ++b) {
      const int64_t b0 = b * w.bk, b1 = std::min(k1, b0 + w.bk);
      const float s = scale_value(srow, b);
      bool ok = true;
      const float folded = folded_scale<Fmt>(srow, b, ok);
      int64_t k = b0;
      if constexpr (std::is_same_v<Fmt, Fp8Format> && std::is_same_v<S, uint8_t>) {
        // Fewer instructions for fp8: sign-extend each byte to 32 bits, shift
        // left 20, keep the sign and bits 20..26: an fp32 equal to
        // e4m3(b) * 2**-120 (subnormal for the smallest codes, hence the DAZ
        // check), times 2**(code - 127 + 120); exact for codes up to 134.
        if (srow[b] <= 134 && !daz) {
          const __m512 sv = _mm512_set1_ps(f32_from_bits((uint32_t(srow[b]) + 120) << 23));
          const __m512i keep = _mm512_set1_epi32(static_cast<int>(0x87F00000u));
          for (; k + 16 <= b1; k += 16) {
            const __m512i d = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k)));
            const __m512 v = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(d, 20), keep)), sv);
            const __m256i top = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (k - k0)), top);
          }
        }
      }
      if (ok) {
        const __m512 sv = _mm512_set1_ps(folded);
        for (; k + 16 <= b1; k += 16) {
          __m256 w0, w1;
          Fmt::decode16(row, k, w0, w1);
          const __m512 v = _mm512_mul_ps(_mm512_insertf32x8(_mm512_castps256_ps512(w0), w1, 1), sv);
          const __m256i top = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (k - k0)), top);
        }
      }
      for (; k < b1; ++k) dst[k - k0] = static_cast<uint16_t>(bits_from_f32(Fmt::scalar(row, k) * s) >> 16);
    }
#else
    fp32(n, k0, k1, scratch);
    for (int64_t k = 0; k < k1 - k0; ++k) dst[k] = static_cast<uint16_t>(bits_from_f32(scratch[k]) >> 16);
#endif
    return low_bits(n, k0, k1);
  }
#if defined(TORCH_BQ_AVX512_BF16)
  using PanelJob = QuantPanelJob<Fmt>;
  // bf16()'s panel of rows [n0, n0 + rows) as a job of steps, where the lean decoders cover the chunk.
  bool panel_job(int64_t n0, int64_t rows, int64_t k0, int64_t k1, uint16_t* dst, int64_t padded,
                 PanelJob& job) const {
    if constexpr (std::is_same_v<S, uint8_t>) {
      return job.init(w, n0, rows, k0, k1, dst, padded);
    } else {
      return false;  // fp32 multipliers: never a bf16 panel
    }
  }
#endif
};

// bf16 or fp32 weights [N, K] (bf16_linear, fp32w_linear: both use bf16(W)).
template <class T>
struct DenseRows {
  const T* data;
  int64_t K;
  int64_t chunk_align() const { return 1; }
  static uint16_t bf16_of(T v) {
    if constexpr (std::is_same_v<T, float>) {
      return bf16_rne(v);
    } else {
      return v.x;
    }
  }
  void fp32(int64_t n, int64_t k0, int64_t k1, float* dst) const {
    const T* row = data + n * K;
    for (int64_t k = k0; k < k1; ++k) dst[k - k0] = f32_from_bits(uint32_t(bf16_of(row[k])) << 16);
  }
#if defined(TORCH_BQ_AVX512)
  // 32 elements of src as bf16 bits (fp32: rounded as torch rounds, nearest even on the bits, NaN -> 0x7FC0).
  static __m512i bf16x32(const T* src) {
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      return _mm512_loadu_si512(reinterpret_cast<const void*>(src));
    } else {
      return _mm512_inserti64x4(_mm512_castsi256_si512(bf16_rne16(_mm512_loadu_ps(src))),
                                bf16_rne16(_mm512_loadu_ps(src + 16)), 1);
    }
  }
  using Scan = Bf16Scan;
#endif
  // Copies and scans in one pass (bf16 weights carry no shared scale to read the bound from).
  LowBits bf16(int64_t n, int64_t k0, int64_t k1, uint16_t* dst, float*) const { return convert<true>(n, k0, k1, dst); }
  // The bound of bf16(n, k0, k1) without the copy (for weights read in place).
  LowBits scan(int64_t n, int64_t k0, int64_t k1) const { return convert<false>(n, k0, k1, nullptr); }
  // Row n's bf16 weights from element k0 where the register tiles can read them in place
  // (bf16 weights and K even: every row holds whole pairs), else null (a panel is copied).
  // No copy, so no panel to write and keep in L2; the bound comes from scan() or ScanJob.
  const uint16_t* in_place(int64_t n, int64_t k0) const {
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      if (K % 2 == 0) return reinterpret_cast<const uint16_t*>(data + n * K + k0);
    }
    return nullptr;
  }
#if defined(TORCH_BQ_AVX512_BF16)
  // The bound of the next chunk of in-place weights (whole 32-element units), as steps of
  // 32 elements (row by row) inside the current chunk's register tiles: one load, one
  // prefetch and a few integer operations each, which also bring the rows into L1 before
  // they are multiplied.
  // The same bound as scan(). Kept this small: the tiles leave it five vector registers.
  struct ScanJob {
    const uint16_t* row = nullptr;  // the current row at the chunk's first element
    const uint16_t* last = nullptr;  // the last row's
    int64_t stride = 0, units = 0, total = 0, j = 0;
    Scan scan;
    // No prefetch of A with these steps (dot_chunk): with it, bf16_linear was slower in 18 of
    // 20 cells (five shapes, M = 128 and 512, two alternating runs; by up to 6%) and faster in
    // 2 (by 3-4%); cause not found (perhaps the prefetched A pushing out of L2 the weight rows
    // the scan brought in, which a decoded panel does not need).
    static constexpr bool kPrefetchesA = false;
    int64_t steps() const { return total; }
    LowBits bits() const { return {static_cast<int>(scan.min_exp()) - 134, scan.tiny != 0}; }
    void step() {
      // The next row's elements at this position, a row of steps ahead, as QuantPanelJob's
      // steps do (rows are K elements apart, each in other pages, where the hardware's stream
      // prefetch starts over: without this, bf16_linear at M = 128 was 2-6% slower at four
      // shapes, in-process A/B).
      if (row != last) _mm_prefetch(reinterpret_cast<const char*>(row + stride + 32 * j), _MM_HINT_T0);
      scan.add(_mm512_loadu_si512(reinterpret_cast<const void*>(row + 32 * j)));
      if (++j == units) {
        j = 0;
        row += stride;
      }
    }
  };
  using PanelJob = ScanJob;
  bool panel_job(int64_t n0, int64_t rows, int64_t k0, int64_t k1, uint16_t*, int64_t, PanelJob& job) const {
    const uint16_t* first = in_place(n0, k0);
    if (first == nullptr || (k1 - k0) % 32 != 0) return false;  // scanned (or copied) on its own
    job.row = first;
    job.last = first + (rows - 1) * K;
    job.stride = K;
    job.units = (k1 - k0) / 32;
    job.total = rows * job.units;
    return true;
  }
#endif

 private:
  template <bool kStore>
  LowBits convert(int64_t n, int64_t k0, int64_t k1, uint16_t* dst) const {
    const T* row = data + n * K;
    uint32_t min_exp = 255;
    bool subnormal = false;
    int64_t k = k0;
#if defined(TORCH_BQ_AVX512)
    {
      Scan scan;
      for (; k + 32 <= k1; k += 32) {
        const __m512i v = bf16x32(row + k);
        if constexpr (kStore) _mm512_storeu_si512(reinterpret_cast<void*>(dst + (k - k0)), v);
        scan.add(v);
      }
      min_exp = scan.min_exp();
      subnormal = scan.tiny != 0;
    }
#endif
    for (; k < k1; ++k) {
      const uint16_t v = bf16_of(row[k]);
      if constexpr (kStore) dst[k - k0] = v;
      const uint32_t b = v & 0x7FFFu, e = b >> 7;
      subnormal |= (e == 0) & (b != 0);
      min_exp = std::min(min_exp, b == 0 ? 255u : e);
    }
    return {static_cast<int>(min_exp) - 134, subnormal};
  }
};

struct TileBuffers {
  std::vector<float> c;         // Nt x M fp32 accumulators: C [M, Nt] (fp32 microkernel), C^T [Nt, M] (bf16 tiles)
  std::vector<float> panel32;   // [kc, Nt]: the fp32 panel, transposed
  std::vector<float> strip;     // [kStripRows, kc]: rows decoded for panel32's transposes
  std::vector<float> ct;        // C^T set aside while a group moves from the bf16 tiles to the fp32 microkernel
  std::vector<uint16_t> panel16;  // two bf16 panels [Nt, kc]: the one multiplied, the one being decoded
  std::vector<float> scratch;   // one row chunk
};

inline TileBuffers& tile_buffers() {
  static thread_local TileBuffers buffers;  // reused: large blocks would be mmap'd and faulted in per call
  return buffers;
}

inline int64_t chunk_elems(int64_t align) {
  // Whole scale blocks, even (bf16 pairs), near kChunkElems.
  int64_t step = align % 2 == 0 ? align : 2 * align;
#if defined(TORCH_BQ_AVX512_BF16)
  constexpr int64_t target = kDotChunk;
#else
  constexpr int64_t target = kChunkElems;
#endif
  return std::max<int64_t>(step, target / step * step);
}

// Whether a Rows type can have its bf16 weights multiplied where they lie (in_place; optional).
template <class R, class = void>
struct has_in_place : std::false_type {};
template <class R>
struct has_in_place<R, std::void_t<decltype(std::declval<const R&>().in_place(0, 0))>> : std::true_type {};

// Whether a Rows type can cut its bf16 panel decode into steps (PanelJob, panel_job; optional).
template <class R, class = void>
struct has_panel_job : std::false_type {};
template <class R>
struct has_panel_job<R, std::void_t<typename R::PanelJob>> : std::true_type {};

// The op's own output [M, N] (out_dtype), for kernels that write it directly: the
// fp32 result plus the fp32 bias, rounded once (as store_output below).
struct FinalOutput {
  void* data = nullptr;
  at::ScalarType dtype = at::kFloat;
  const float* bias = nullptr;  // [N] or null
  int64_t N = 0;

  void put(int64_t m, int64_t n, float v) const {
    if (bias != nullptr) v += bias[n];
    if (dtype == at::kBFloat16)
      static_cast<uint16_t*>(data)[m * N + n] = bf16_rne(v);
    else if (dtype == at::kHalf)
      static_cast<at::Half*>(data)[m * N + n] = at::Half(v);
    else
      static_cast<float*>(data)[m * N + n] = v;
  }
#if defined(TORCH_BQ_AVX512)
  // Columns [n, n + 16) of row m.
  void put16(int64_t m, int64_t n, __m512 v) const {
    if (bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n));
    if (dtype == at::kBFloat16) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(data) + m * N + n), bf16_rne16(v));
    } else if (dtype == at::kFloat) {
      _mm512_storeu_ps(static_cast<float*>(data) + m * N + n, v);
    } else {
      alignas(64) float lanes[16];
      _mm512_store_ps(lanes, v);
      for (int i = 0; i < 16; ++i) static_cast<at::Half*>(data)[m * N + n + i] = at::Half(lanes[i]);
    }
  }
#endif
};

#if defined(TORCH_BQ_AVX512)
// dst[0, n) = src[0, n), 64 bytes at a time (a row segment of the output: no libc call per row).
inline void copy_bytes(void* dst, const void* src, int64_t n) {
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) _mm512_storeu_si512(d + i, _mm512_loadu_si512(s + i));
  if (i < n) {
    const __mmask64 m = (uint64_t(1) << (n - i)) - 1;
    _mm512_mask_storeu_epi8(d + i, m, _mm512_maskz_loadu_epi8(m, s + i));
  }
}
#endif

// out[m, n0 + r] = c[r, m] for r < rows, m < M (out fp32, rows ldo apart), or into
// `final` (not null) with its bias and rounding.
inline void store_transposed(const float* c, int64_t rows, int64_t M, float* out, int64_t ldo, int64_t n0,
                             const FinalOutput* final) {
  int64_t r0 = 0;
#if defined(TORCH_BQ_AVX512)
  // 16 output rows at a time: the 16 x 16 transposes of up to kSlab columns go to a
  // row-major buffer in L1, then each row's segment is copied whole. Written straight
  // from the transposes, each cache line of a row would be filled by two 32-byte stores
  // far apart in time, with the rows N elements apart (the same L1 set for N = 4096) in
  // between, and fetched again for the second.
  constexpr int64_t kSlab = 128;
  alignas(64) float buffer[16 * kSlab];
  const int64_t full = rows / 16 * 16;
  const int64_t esize = final != nullptr ? static_cast<int64_t>(c10::elementSize(final->dtype)) : 4;
  for (int64_t s0 = 0; s0 < full; s0 += kSlab) {
    const int64_t width = std::min(kSlab, full - s0);
    FinalOutput staged;  // put16 into the buffer: rows `width` elements apart
    if (final != nullptr)
      staged = {buffer, final->dtype, final->bias != nullptr ? final->bias + n0 + s0 : nullptr, width};
    for (int64_t m0 = 0; m0 < M; m0 += 16) {
      const int64_t cols = std::min<int64_t>(16, M - m0);
      const __mmask16 valid = cols == 16 ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1);
      for (int64_t q = 0; q < width; q += 16) {
        __m512i v[16];
        for (int i = 0; i < 16; ++i) v[i] = _mm512_maskz_loadu_epi32(valid, c + (s0 + q + i) * M + m0);
        transpose16(v);
        if (final != nullptr) {
          for (int64_t j = 0; j < cols; ++j) staged.put16(j, q, _mm512_castsi512_ps(v[j]));
        } else {
          for (int64_t j = 0; j < cols; ++j) _mm512_store_si512(buffer + j * width + q, v[j]);
        }
      }
      for (int64_t j = 0; j < cols; ++j) {
        const char* src = reinterpret_cast<const char*>(buffer) + j * width * esize;
        if (final != nullptr)
          copy_bytes(static_cast<char*>(final->data) + ((m0 + j) * final->N + n0 + s0) * esize, src, width * esize);
        else
          copy_bytes(out + (m0 + j) * ldo + n0 + s0, src, width * 4);
      }
    }
  }
  r0 = full;
#endif
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t r = r0; r < rows; ++r) {
      if (final != nullptr)
        final->put(m, n0 + r, c[r * M + m]);
      else
        out[m * ldo + n0 + r] = c[r * M + m];
    }
  }
}

// out[m, n0 + r] = c[m * rows + r] for r < rows, m < M (out fp32, rows ldo apart), or into
// `final` (not null) with its bias and rounding: C as the fp32 microkernel leaves it.
inline void store_rows(const float* c, int64_t rows, int64_t M, float* out, int64_t ldo, int64_t n0,
                       const FinalOutput* final) {
  for (int64_t m = 0; m < M; ++m) {
    const float* src = c + m * rows;
    if (final == nullptr) {
#if defined(TORCH_BQ_AVX512)
      copy_bytes(out + m * ldo + n0, src, rows * 4);
#else
      std::memcpy(out + m * ldo + n0, src, rows * 4);
#endif
      continue;
    }
    int64_t r = 0;
#if defined(TORCH_BQ_AVX512)
    for (; r + 16 <= rows; r += 16) final->put16(m, n0 + r, _mm512_loadu_ps(src + r));
#endif
    for (; r < rows; ++r) final->put(m, n0 + r, src[r]);
  }
}

#if defined(TORCH_BQ_AVX2)
// r[i][j] <- r[j][i] for an 8 x 8 matrix of floats, one row per register.
inline void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);      // r0[0] r1[0] r0[1] r1[1] | same from [4]
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);  // [2], [3] | [6], [7]
  }
  for (int h = 0; h < 2; ++h) {  // rows 0-3, then 4-7
    u[4 * h + 0] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0x44);      // column 0 | 4 of four rows
    u[4 * h + 1] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0xEE);      // 1 | 5
    u[4 * h + 2] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0x44);  // 2 | 6
    u[4 * h + 3] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0xEE);  // 3 | 7
  }
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm256_permute2f128_ps(u[j], u[j + 4], 0x20);
    r[j + 4] = _mm256_permute2f128_ps(u[j], u[j + 4], 0x31);
  }
}
#endif

// Rows decoded at a time for the transposed fp32 panel: one block of transposes.
#if defined(TORCH_BQ_AVX512)
constexpr int64_t kStripRows = 16;
#else
constexpr int64_t kStripRows = 8;
#endif

// The fp32 microkernel's panel: pt[k - k0, r] = W[n0 + r, k] (dequantized) for r < rows,
// k0 <= k < k1, rows `rows` elements apart (the weight rows are the microkernel's vector
// dimension). kStripRows rows are decoded at a time into `strip` (row-major: 32 KiB with
// AVX2, 64 KiB with AVX-512 at kc = 1024), then moved in kStripRows x kStripRows register
// transposes; leftover rows and elements one by one. The transposes are this layout's
// price: about 0.6-1.4 ms of a 4096 x 4096 call at AVX2 (docs/benchmarks.md, "AVX2 prefill
// vectorized over weight rows"), which is what keeps M = 32-128 at 1.0-1.2x the old
// layout's time where its A-row vectors were full.
template <class Rows>
void transposed_panel(const Rows& wr, int64_t n0, int64_t rows, int64_t k0, int64_t k1, float* pt,
                      std::vector<float>& strip) {
  const int64_t width = k1 - k0;
  strip.resize(kStripRows * width);
  float* s = strip.data();
  for (int64_t r0 = 0; r0 < rows; r0 += kStripRows) {
    const int64_t here = std::min(kStripRows, rows - r0);
    for (int64_t i = 0; i < here; ++i) wr.fp32(n0 + r0 + i, k0, k1, s + i * width);
    int64_t k = 0;
    if (here == kStripRows) {
#if defined(TORCH_BQ_AVX512)
      for (; k + 16 <= width; k += 16) {
        __m512i v[16];
        for (int i = 0; i < 16; ++i) v[i] = _mm512_castps_si512(_mm512_loadu_ps(s + i * width + k));
        transpose16(v);
        for (int j = 0; j < 16; ++j) _mm512_storeu_ps(pt + (k + j) * rows + r0, _mm512_castsi512_ps(v[j]));
      }
#elif defined(TORCH_BQ_AVX2)
      for (; k + 8 <= width; k += 8) {
        __m256 v[8];
        for (int i = 0; i < 8; ++i) v[i] = _mm256_loadu_ps(s + i * width + k);
        transpose8(v);
        for (int j = 0; j < 8; ++j) _mm256_storeu_ps(pt + (k + j) * rows + r0, v[j]);
      }
#endif
    }
    for (; k < width; ++k)
      for (int64_t i = 0; i < here; ++i) pt[k * rows + r0 + i] = s[i * width + k];
  }
}

// out[:, n_begin:n_end] for one task: groups of `group` weight rows one after
// the other, each over all of K. With bf16_ok (A allows it), each K chunk of a
// group whose weights allow it too runs the bf16 microkernel, the others (and
// every chunk after one of those in the group) the fp32 one; both accumulate
// into the group's fp32 C^T. On the bf16 path the panel that comes next (the
// group's next chunk, or the next group's first) is decoded while this one is
// multiplied (a PanelJob's steps inside the register tiles, where the Rows type
// has one for that chunk), into the other of two panel buffers (or, for weights
// read in place, only scanned for its bound); the task's first panel, and
// panels whose job does not apply, are decoded (or scanned) on their own.
template <class Rows>
void gemm_task(const Rows& wr, GemmOperands& ops, int64_t n_begin, int64_t n_end, int64_t group, bool bf16_ok,
               float* out, int64_t N, const FinalOutput* final) {
  const int64_t M = ops.M, K = ops.K;
  const int64_t kc = chunk_elems(wr.chunk_align());
  TileBuffers& buf = tile_buffers();
  buf.c.resize(std::min(group, n_end - n_begin) * M);
  float* c = buf.c.data();
#if defined(TORCH_BQ_AVX512_BF16)
  bool decoded = false;  // this panel was decoded by the previous panel's job
  LowBits decoded_bits{0, true};
  int64_t panels = 0;
  if (bf16_ok) {
    buf.panel16.resize(2 * std::min(group, n_end - n_begin) * kc);  // kc is even: padded widths <= kc
    buf.scratch.resize(kc);
  }
#endif
  for (int64_t n0 = n_begin; n0 < n_end; n0 += group) {
    const int64_t rows = std::min(group, n_end - n0);
    bool all_bf16 = bf16_ok;
    for (int64_t k0 = 0; k0 < K; k0 += kc) {
      const int64_t k1 = std::min(K, k0 + kc), width = k1 - k0;
      bool chunk_bf16 = false;
#if defined(TORCH_BQ_AVX512_BF16)
      if (bf16_ok) {
        const int64_t padded = width + (width & 1);  // pairs with A^T's zero row
        const int64_t half = std::min(group, n_end - n_begin) * kc;
        uint16_t* p = buf.panel16.data() + (panels & 1) * half;
        // The multiplied panel: p, rows padded / 2 pairs apart, or the weights themselves.
        const uint16_t* panel = p;
        int64_t ws = padded / 2;
        if constexpr (has_in_place<Rows>::value) {
          if (const uint16_t* w = wr.in_place(n0, k0)) {
            panel = w;
            ws = K / 2;
          }
        }
        LowBits bits{std::numeric_limits<int>::max(), false};
        auto merge = [&](const LowBits& b) {
          bits = {std::min(bits.low_bit, b.low_bit), bits.subnormal || b.subnormal};
        };
        if (decoded) {
          bits = decoded_bits;
        } else if (!all_bf16) {
          // the group is on the fp32 microkernel for the rest of K (below): no bf16 panel
        } else if (panel != p) {
          if constexpr (has_in_place<Rows>::value)
            for (int64_t r = 0; r < rows; ++r) merge(wr.scan(n0 + r, k0, k1));
        } else {
          for (int64_t r = 0; r < rows; ++r) merge(wr.bf16(n0 + r, k0, k1, p + r * padded, buf.scratch.data()));
        }
        if (panel == p && padded != width)
          for (int64_t r = 0; r < rows; ++r) p[r * padded + width] = 0;
        decoded = false;
        // all_bf16: after an fp32 chunk the group's C may hold subnormal partial sums, which vdpbf16ps
        // would read as zero, so the group's later chunks take the fp32 microkernel too.
        chunk_bf16 = all_bf16 && !bits.subnormal && ops.a_bits.low_bit + bits.low_bit >= -126;
        if (chunk_bf16) {
          // The panel after this one: the next chunk of these rows, else the next rows' first
          // (none past the task).
          struct Panel {
            int64_t n0, rows, k0, k1;
          };
          const Panel next = k1 < K ? Panel{n0, rows, k1, std::min(K, k1 + kc)}
                                    : Panel{n0 + rows, std::min(group, n_end - n0 - rows), 0, std::min(K, kc)};
          const uint32_t* apack = reinterpret_cast<const uint32_t*>(ops.apack.data_ptr<int32_t>());
          bool fused = false;
          if constexpr (has_panel_job<Rows>::value) {
            typename Rows::PanelJob job;
            const int64_t npadded = (next.k1 - next.k0) + ((next.k1 - next.k0) & 1);
            uint16_t* np = buf.panel16.data() + ((panels + 1) & 1) * half;
            if (next.n0 < n_end && wr.panel_job(next.n0, next.rows, next.k0, next.k1, np, npadded, job)) {
              dot_chunk(panel, ws, rows, apack, ops.arows.data(), ops.Kp / 2, k0 / 2, padded / 2, M, c, k0 > 0, &job,
                        job.steps());
              decoded_bits = job.bits();
              fused = decoded = true;
            }
          }
          if (!fused)
            dot_chunk<NoJob>(panel, ws, rows, apack, ops.arows.data(), ops.Kp / 2, k0 / 2, padded / 2, M, c, k0 > 0,
                             nullptr, 0);
        }
        ++panels;
      }
#endif
      if (!chunk_bf16) {
#if defined(TORCH_BQ_AVX512_BF16)
        if (k0 > 0 && all_bf16) {
          // The group's earlier chunks ran the bf16 tiles into C^T: from here on, C (rare).
          buf.ct.assign(c, c + rows * M);
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t m = 0; m < M; ++m) c[m * rows + r] = buf.ct[r * M + m];
        }
#endif
        const float* a = ops.fp32_a();
        buf.panel32.resize(width * rows);
        float* p = buf.panel32.data();
        transposed_panel(wr, n0, rows, k0, k1, p, buf.strip);
        // C [M, rows] (+)= A[:, k0:k1] x panel^T: the weight rows are the vector dimension,
        // A's rows the broadcast one (a remainder of A rows only shortens a register block).
        for (int64_t m0 = 0; m0 < M; m0 += kTileCols) {
          const int64_t cols = std::min(kTileCols, M - m0);
          at::native::cpublas::brgemm(cols, rows, width, K, rows, rows, k0 > 0, a + m0 * K + k0, p, c + m0 * rows,
                                      false);
        }
        all_bf16 = false;
      }
    }
    if (all_bf16)
      store_transposed(c, rows, M, out, N, n0, final);  // every chunk on the bf16 tiles: C^T
    else
      store_rows(c, rows, M, out, N, n0, final);
    prefill_tiles[all_bf16 ? 0 : 1].fetch_add(1, std::memory_order_relaxed);
  }
}

// at::mm on fp32 panels: CPUs without AVX2 (generic build) or with MKLDNN switched off.
// Panels of at least kTileRows rows whatever K is (a large K must not shrink them to a few rows).
template <class Rows>
void panel_mm(const Rows& wr, const at::Tensor& A, int64_t N, int64_t panel_bytes, at::Tensor& out) {
  const int64_t K = A.size(1);
  const int64_t by_bytes = panel_bytes / (4 * std::max<int64_t>(K, 1)) / 8 * 8;
  const int64_t panel_rows = std::min(N, std::max<int64_t>(panel_bytes <= 1 ? 8 : kTileRows, by_bytes));
  at::Tensor panel = at::empty({panel_rows, K}, A.options());
  float* p = panel.data_ptr<float>();
  for (int64_t n0 = 0; n0 < N; n0 += panel_rows) {
    const int64_t rows_here = std::min(panel_rows, N - n0);
    run_tasks(rows_here, [&](int64_t r) { wr.fp32(n0 + r, 0, K, p + r * K); });
    out.narrow(1, n0, rows_here).copy_(at::mm(A, panel.narrow(0, 0, rows_here).t()));
    prefill_tiles[2].fetch_add(1, std::memory_order_relaxed);
  }
}

// out [M, N] fp32 = A [M, K] (fp32, bf16-exact values) x W^T; or, where `final` is given
// and the microkernel tasks run, final = round(A x W^T + bias) directly (then `out` is
// not written). Returns whether `final` was written. With `src`, A's values are not in A
// yet: they come from src (packed straight from it for the bf16 tiles), and A is written
// only where a path reads fp32 A (the fp32 microkernel's chunks, at::mm panels).
template <class Rows>
bool prefill_linear(const Rows& wr, const at::Tensor& A, int64_t N, int64_t panel_bytes, at::Tensor& out,
                    const FinalOutput* final = nullptr, const ActivationSource* src = nullptr) {
#if !defined(TORCH_BQ_AVX512)
  final = nullptr;  // the transposing store is scalar here: fp32 out, then store_output's vector rounding
#endif
  auto stage = [&] {
    if (src != nullptr) src->fp32(A.data_ptr<float>());
    src = nullptr;
  };
#if defined(TORCH_BQ_AVX2)
  if (brgemm_enabled()) {
    GemmOperands ops;
    ops.M = A.size(0);
    ops.K = A.size(1);
    ops.a32 = A;
    bool bf16 = false;
#if defined(TORCH_BQ_AVX512_BF16)
    if (bf16_brgemm_works()) {
      ops.Kp = ops.K + (ops.K & 1);
      ops.apack = src != nullptr ? pack_activation(*src, ops.Kp / 2, ops.a_bits) : pack_activation(A, ops.Kp / 2, ops.a_bits);
      ops.arows = rowdot_activation(reinterpret_cast<const uint32_t*>(ops.apack.data_ptr<int32_t>()), ops.M, ops.Kp / 2);
      bf16 = !ops.a_bits.subnormal;
    }
#endif
    if (bf16)
      ops.stage_a32 = src;  // fp32 A only if some chunk takes the fp32 microkernel (GemmOperands::at32)
    else
      stage();  // every chunk on the fp32 microkernel
#if defined(TORCH_BQ_AVX512_BF16)
    constexpr int64_t task_rows = kDotTaskRows;
#else
    constexpr int64_t task_rows = kTileRows;
#endif
    // Consecutive groups of task_rows per task, so that a group's first panel is decoded
    // during the previous group's last chunk; at least 8 tasks per thread (a late thread
    // costs one task), at most 4 groups each. On one thread there is no late thread to
    // wait for, so a single task takes every group: only the call's first panel is decoded
    // on its own, and only its last chunk runs without a job (no decode overlap, no A
    // prefetch). With 4 groups per task, 2880 x 2880 (30 groups, 10 tasks) decoded a ninth
    // of its panels on their own; one task was about 5% faster there (in-process A/B).
    const int64_t groups = (N + task_rows - 1) / task_rows;
    const int threads = std::max(1, at::get_num_threads());
    const int64_t per_task =
        threads == 1 ? std::max<int64_t>(groups, 1) : std::clamp<int64_t>(groups / (8 * threads), 1, 4);
    const int64_t tasks = (groups + per_task - 1) / per_task;
    float* o = final != nullptr ? nullptr : out.data_ptr<float>();
    run_tasks(tasks, [&](int64_t t) {
      const int64_t n0 = t * per_task * task_rows, n1 = std::min(N, n0 + per_task * task_rows);
      gemm_task(wr, ops, n0, n1, task_rows, bf16, o, N, final);
    });
    return final != nullptr;
  }
#endif
  stage();
  panel_mm(wr, A, N, panel_bytes, out);
  return false;
}

// --------------------------------------------------------------------------
// op bodies
// --------------------------------------------------------------------------

void check(bool ok, const char* what) { TORCH_CHECK(ok, "torch_bq_cpu: ", what); }

template <class Fmt>
at::Tensor linear(const at::Tensor& a, const at::Tensor& weight, const at::Tensor& scale,
                  const std::optional<at::Tensor>& bias, int64_t bn, int64_t bk, int64_t decode_max_m,
                  int64_t panel_bytes) {
  check(a.dim() == 2 && a.scalar_type() == at::kFloat && a.is_contiguous(), "a must be contiguous fp32 [M, K]");
  check(weight.dim() == 2 && weight.scalar_type() == at::kByte && weight.is_contiguous(),
        "weight must be contiguous uint8 [N, row_bytes]");
  check(scale.dim() == 2 && scale.is_contiguous() &&
            (scale.scalar_type() == at::kByte || scale.scalar_type() == at::kFloat),
        "scale must be contiguous uint8 or fp32 [N/bn, K/bk]");
  check(bn >= 1 && bk >= 1, "block must be positive");
  const int64_t M = a.size(0), K = a.size(1), N = weight.size(0);
  check(weight.size(1) == Fmt::row_bytes(K), "weight row length does not match K");
  check(scale.size(0) == (N + bn - 1) / bn && scale.size(1) == (K + bk - 1) / bk, "scale shape does not match the block");

  at::Tensor out = at::empty({M, N}, a.options());
  if (M > 0 && N > 0) {
    const WeightView w{weight.data_ptr<uint8_t>(), weight.size(1), scale.data_ptr(), scale.size(1), bn, bk, K};
    const bool codes = scale.scalar_type() == at::kByte;
    if (M <= decode_max_m) {
      if (codes)
        decode_linear<Fmt, uint8_t>(w, a.data_ptr<float>(), M, N, out.data_ptr<float>());
      else
        decode_linear<Fmt, float>(w, a.data_ptr<float>(), M, N, out.data_ptr<float>());
    } else {
      if (codes)
        prefill_linear(QuantizedRows<Fmt, uint8_t>{w}, a, N, panel_bytes, out);
      else
        prefill_linear(QuantizedRows<Fmt, float>{w}, a, N, panel_bytes, out);
    }
  }
  if (bias.has_value()) {
    check(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == N, "bias must be fp32 [N]");
    out.add_(*bias);  // one fp32 add before the single final rounding
  }
  return out;
}

at::Tensor fp8_linear(const at::Tensor& a, const at::Tensor& weight, const at::Tensor& scale,
                      const std::optional<at::Tensor>& bias, int64_t bn, int64_t bk, int64_t decode_max_m,
                      int64_t panel_bytes) {
  return linear<Fp8Format>(a, weight, scale, bias, bn, bk, decode_max_m, panel_bytes);
}

// bf16_linear / fp32w_linear: a fp32 [M, K] (bf16-exact), weight bf16 or fp32 [N, K]
// (fp32 weights are narrowed to bf16 element by element, as the reference does).
at::Tensor dense_linear(const at::Tensor& a, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                        int64_t panel_bytes) {
  check(a.dim() == 2 && a.scalar_type() == at::kFloat && a.is_contiguous(), "a must be contiguous fp32 [M, K]");
  check(weight.dim() == 2 && weight.is_contiguous() &&
            (weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kFloat),
        "weight must be contiguous bf16 or fp32 [N, K]");
  const int64_t M = a.size(0), K = a.size(1), N = weight.size(0);
  check(weight.size(1) == K, "weight row length does not match K");
  at::Tensor out = at::empty({M, N}, a.options());
  if (M > 0 && N > 0) {
    if (weight.scalar_type() == at::kBFloat16)
      prefill_linear(DenseRows<at::BFloat16>{weight.data_ptr<at::BFloat16>(), K}, a, N, panel_bytes, out);
    else
      prefill_linear(DenseRows<float>{weight.data_ptr<float>(), K}, a, N, panel_bytes, out);
  }
  if (bias.has_value()) {
    check(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == N, "bias must be fp32 [N]");
    out.add_(*bias);
  }
  return out;
}

at::Tensor fp4_linear(const at::Tensor& a, const at::Tensor& weight, const at::Tensor& scale,
                      const std::optional<at::Tensor>& bias, int64_t decode_max_m, int64_t panel_bytes) {
  check(scale.scalar_type() == at::kByte, "fp4 scale must be uint8 e8m0 codes");
  return linear<Fp4Format>(a, weight, scale, bias, 1, 32, decode_max_m, panel_bytes);
}

// --------------------------------------------------------------------------
// activation qdq (docs/contract.md §3), bit-exact with torch_bq.formats.qdq_fp8
// --------------------------------------------------------------------------

constexpr int64_t kQdqBlock = 32;
const uint32_t kAmaxFloorBits = bits_from_f32(1e-4f);


// Round a magnitude below 480 to E4M3FN, nearest even: subnormals (quantum
// 2**-9) via the fp32 add of 2**14, normals by rounding the mantissa to 3 bits.
inline float e4m3_round_magnitude(float m) {
  if (m < 0.015625f) return (m + 16384.0f) - 16384.0f;
  uint32_t b = bits_from_f32(m);
  b = (b + 0x7FFFFu + ((b >> 20) & 1u)) & 0xFFF00000u;
  return f32_from_bits(b);
}

// torch's float -> float8_e4m3fn -> float: RNE, saturating at +-448 (what
// torch 2.13's conversion does for out-of-range values and inf), NaN stays NaN.
inline float e4m3_round(float v) {
  const float m = std::fabs(v);
  const float r = std::isnan(m) ? m : m >= 448.0f ? 448.0f : e4m3_round_magnitude(m);
  return std::signbit(v) ? -r : r;
}

struct BlockScale {
  float scale, recip;
  bool finite;  // scale is a finite power of two: the block cannot produce NaN or overflow
};

// s = 2**ceil(log2(amax * fp32(1/peak))) from the bits, and its reciprocal,
// with the same int32 arithmetic as the reference (including its wrap-around
// for non-finite t, so NaN/inf blocks come out the same).
inline BlockScale block_scale(uint32_t amax_abs_bits, float recip_peak) {
  const uint32_t amax_bits = std::max(amax_abs_bits, kAmaxFloorBits);  // NaN bits stay NaN
  const float t = f32_from_bits(amax_bits) * recip_peak;
  const int32_t bits = static_cast<int32_t>(bits_from_f32(t));
  const int32_t biased = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0);
  return {f32_from_bits(static_cast<uint32_t>(biased) << 23), f32_from_bits(static_cast<uint32_t>(254 - biased) << 23),
          biased <= 254};
}

template <bool kF32Out>
inline void store(void* out, int64_t i, float v) {
  if constexpr (kF32Out) {
    static_cast<float*>(out)[i] = f32_from_bits(uint32_t(bf16_rne(v)) << 16);
  } else {
    static_cast<uint16_t*>(out)[i] = bf16_rne(v);
  }
}

template <bool kF32Out>
void qdq_block_scalar(const uint16_t* x, int64_t len, float recip_peak, void* out, int64_t offset) {
  uint32_t amax = 0;
  for (int64_t i = 0; i < len; ++i) amax = std::max<uint32_t>(amax, (uint32_t(x[i]) << 16) & 0x7FFFFFFFu);
  const BlockScale bs = block_scale(amax, recip_peak);
  for (int64_t i = 0; i < len; ++i) {
    const float v = f32_from_bits(uint32_t(x[i]) << 16);
    store<kF32Out>(out, offset + i, e4m3_round(v * bs.recip) * bs.scale);
  }
}

#if defined(TORCH_BQ_AVX2)
// One full 32-wide block whose scale is finite: every |x / s| <= peak (<= 448),
// so e4m3 rounding never reaches the saturation, and q * s has at most 4 significant bits,
// so the bf16 result is exact (a truncation of the fp32 bits).
template <bool kF32Out>
void qdq_block32(const uint16_t* x, float recip_peak, void* out, int64_t offset) {
  __m256i xi[4];
  __m256i amax_v = _mm256_setzero_si256();
  const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF);
  for (int q = 0; q < 4; ++q) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 8 * q));
    xi[q] = _mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16);
    // Non-negative float bits order like the floats; NaN sorts above inf.
    amax_v = _mm256_max_epu32(amax_v, _mm256_and_si256(xi[q], abs_mask));
  }
  __m128i m4 = _mm_max_epu32(_mm256_castsi256_si128(amax_v), _mm256_extracti128_si256(amax_v, 1));
  m4 = _mm_max_epu32(m4, _mm_shuffle_epi32(m4, _MM_SHUFFLE(1, 0, 3, 2)));
  m4 = _mm_max_epu32(m4, _mm_shuffle_epi32(m4, _MM_SHUFFLE(2, 3, 0, 1)));
  const BlockScale bs = block_scale(static_cast<uint32_t>(_mm_cvtsi128_si32(m4)), recip_peak);
  if (!bs.finite) {
    qdq_block_scalar<kF32Out>(x, kQdqBlock, recip_peak, out, offset);
    return;
  }
  const __m256 recip = _mm256_set1_ps(bs.recip), scale = _mm256_set1_ps(bs.scale);
  const __m256i sign_mask = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  const __m256 magic = _mm256_set1_ps(16384.0f), min_normal = _mm256_set1_ps(0.015625f);
  for (int q = 0; q < 4; ++q) {
    const __m256i sign = _mm256_and_si256(xi[q], sign_mask);
    const __m256 m = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_and_si256(xi[q], abs_mask)), recip);
    const __m256 sub = _mm256_sub_ps(_mm256_add_ps(m, magic), magic);
    const __m256i mb = _mm256_castps_si256(m);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(mb, 20), _mm256_set1_epi32(1));
    const __m256i nb = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(mb, _mm256_set1_epi32(0x7FFFF)), lsb),
                                        _mm256_set1_epi32(static_cast<int>(0xFFF00000u)));
    const __m256 r = _mm256_blendv_ps(_mm256_castsi256_ps(nb), sub, _mm256_cmp_ps(m, min_normal, _CMP_LT_OQ));
    const __m256i y = _mm256_or_si256(_mm256_castps_si256(_mm256_mul_ps(r, scale)), sign);
    if constexpr (kF32Out) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<float*>(out) + offset + 8 * q), y);
    } else {
      const __m256i hi = _mm256_srli_epi32(y, 16);
      const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + offset + 8 * q), packed);
    }
  }
}
#endif

#if defined(TORCH_BQ_AVX512)
// 16 bf16 (or fp32 high-half) words as the fp32 values they encode.
inline __m512i bf16_widened(__m256i words) { return _mm512_slli_epi32(_mm512_cvtepu16_epi32(words), 16); }

// One full 32-wide block as 32 bf16 lanes of one vector: the same bits as qdq_block32, in
// about a third of its time. Where |x| >= s * 2**-6 (x / s an e4m3 normal), dividing by the
// power of two s and multiplying back are exponent shifts that cancel, so the qdq is the
// round-to-nearest-even of bf16(x)'s 7-bit mantissa to e4m3's 3 bits, done on the bf16 bits
// themselves (a carry runs into the exponent, as rounding up to the next binade does). Lanes
// below that bound (e4m3 subnormals: multiples of s * 2**-9, zero excepted) take
// qdq_block32's fp32 arithmetic, on the blocks that have any. False where the block's scale
// is not finite (a NaN or inf in it): the caller takes qdq_block_scalar.
inline bool qdq_bf16x32(const uint16_t* x, float recip_peak, __m512i& y) {
  const __m512i v = _mm512_loadu_si512(x);
  const __m512i mag = _mm512_and_si512(v, _mm512_set1_epi16(0x7FFF));
  // amax: bf16 magnitudes order like their bits (NaN above inf), 32 -> 8 lanes, then
  // phminposuw on the complement for the largest of 8.
  const __m256i m16 = _mm256_max_epu16(_mm512_castsi512_si256(mag), _mm512_extracti64x4_epi64(mag, 1));
  const __m128i m8 = _mm_max_epu16(_mm256_castsi256_si128(m16), _mm256_extracti128_si256(m16, 1));
  const uint32_t amax = 0xFFFFu - (_mm_cvtsi128_si32(_mm_minpos_epu16(_mm_xor_si128(m8, _mm_set1_epi32(-1)))) & 0xFFFFu);
  const BlockScale bs = block_scale(amax << 16, recip_peak);
  if (!bs.finite) return false;
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi16(mag, 4), _mm512_set1_epi16(1));
  __m512i r = _mm512_and_si512(_mm512_add_epi16(_mm512_add_epi16(mag, _mm512_set1_epi16(7)), lsb),
                               _mm512_set1_epi16(static_cast<short>(0xFFF0)));
  // s * 2**-6 as bf16 bits: s's exponent field less 6 (s >= 2**-22: no underflow).
  const int bound = static_cast<int>(bits_from_f32(bs.scale) >> 16) - (6 << 7);
  const __mmask32 tiny = _mm512_mask_cmplt_epu16_mask(_mm512_test_epi16_mask(mag, mag), mag, _mm512_set1_epi16(static_cast<short>(bound)));
  if (tiny != 0) {
    // (m + 2**14) - 2**14 rounds m = |x| / s to a multiple of 2**-9, as e4m3_round_magnitude.
    const __m512 recip = _mm512_set1_ps(bs.recip), scale = _mm512_set1_ps(bs.scale), magic = _mm512_set1_ps(16384.0f);
    __m512i half[2];
    for (int h = 0; h < 2; ++h) {
      const __m512i bits = bf16_widened(h == 0 ? _mm512_castsi512_si256(mag) : _mm512_extracti64x4_epi64(mag, 1));
      const __m512 m = _mm512_mul_ps(_mm512_castsi512_ps(bits), recip);
      half[h] = _mm512_srli_epi32(_mm512_castps_si512(_mm512_mul_ps(_mm512_sub_ps(_mm512_add_ps(m, magic), magic), scale)), 16);
    }
    // the high halves (exact: at most 4 significant bits) of the two 16-lane halves, in order
    const __m512i words = _mm512_permutex2var_epi16(half[0], _mm512_set_epi16(62, 60, 58, 56, 54, 52, 50, 48, 46, 44, 42, 40, 38, 36, 34, 32, 30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0), half[1]);
    r = _mm512_mask_mov_epi16(r, tiny, words);
  }
  y = _mm512_or_si512(r, _mm512_and_si512(v, _mm512_set1_epi16(static_cast<short>(0x8000))));
  return true;
}
#endif

template <bool kF32Out>
void qdq_row(const uint16_t* x, int64_t r, int64_t K, float recip_peak, void* out) {
  for (int64_t k0 = 0; k0 < K; k0 += kQdqBlock) {
    const int64_t len = std::min(kQdqBlock, K - k0);
#if defined(TORCH_BQ_AVX512)
    __m512i y;
    if (len == kQdqBlock && qdq_bf16x32(x + r * K + k0, recip_peak, y)) {
      if constexpr (kF32Out) {
        float* o = static_cast<float*>(out) + r * K + k0;
        _mm512_storeu_si512(o, bf16_widened(_mm512_castsi512_si256(y)));
        _mm512_storeu_si512(o + 16, bf16_widened(_mm512_extracti64x4_epi64(y, 1)));
      } else {
        _mm512_storeu_si512(static_cast<uint16_t*>(out) + r * K + k0, y);
      }
      continue;
    }
#elif defined(TORCH_BQ_AVX2)
    if (len == kQdqBlock) {
      qdq_block32<kF32Out>(x + r * K + k0, recip_peak, out, r * K + k0);
      continue;
    }
#endif
    qdq_block_scalar<kF32Out>(x + r * K + k0, len, recip_peak, out, r * K + k0);
  }
}

template <bool kF32Out>
void qdq_rows(const uint16_t* x, int64_t M, int64_t K, float recip_peak, void* out) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1));
  run_tasks((M + grain - 1) / grain, [&](int64_t t) {
    for (int64_t r = t * grain; r < std::min(M, (t + 1) * grain); ++r) qdq_row<kF32Out>(x, r, K, recip_peak, out);
  });
}

at::Tensor qdq_fp8(const at::Tensor& x, double peak, bool fp32_out) {
  check(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "x must be contiguous bf16 [M, K]");
  const float recip_peak = static_cast<float>(1.0 / peak);  // fp32(1/peak), rounded once
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor out = at::empty({M, K}, x.options().dtype(fp32_out ? at::kFloat : at::kBFloat16));
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  if (fp32_out)
    qdq_rows<true>(xp, M, K, recip_peak, out.data_ptr());
  else
    qdq_rows<false>(xp, M, K, recip_peak, out.data_ptr());
  return out;
}

// --------------------------------------------------------------------------
// public-op entry points: the whole CPU body of torch_bq::fp8_linear / fp4_linear
// --------------------------------------------------------------------------
//
// One call from Python per linear (torch_bq/ops/cpu/linear.py): the operands as
// the public op takes them (x any of bf16/fp16/fp32 [..., K], any strides;
// weight and scale in their checkpoint dtypes, reinterpreted as bytes, never
// copied when contiguous; bias any float [N] or None), then bf16(x), the
// activation qdq (or the bf16 value as fp32), the kernel above, the bias in
// fp32 and the one rounding to out_dtype, returning [..., N].
//
// They take only calls they can run as they are: plain dense CPU tensors
// (no Python subclass or mode, no functorch wrapper, no conj/neg bit, no meta),
// no autograd to record (grad mode off or nothing requiring grad), the
// shapes and dtypes the checks of torch_bq/reference/linear.py accept,
// contiguous weight and scale and K > 0. Anything else, invalid arguments
// included, returns an undefined tensor (None in Python) and the Python side
// runs the named-error checks and its general path: the checks and their
// messages stay in one place. act_peak and the block's upper bound are
// checked there too (module arguments are checked once, at construction).

// The ops are CompositeImplicitAutograd (m.def with a function), so a TorchDispatchMode
// (fake tensors, make_fx, FlopCounter) never sees them, only what they call: they refuse
// while one is active, and the mode sees the torch_bq:: op instead.
bool plain_cpu(const at::Tensor& t) {
  return t.defined() && t.device().is_cpu() && t.layout() == at::kStrided && !t.is_conj() && !t.is_neg() &&
         !t._is_zerotensor() && !t.unsafeGetTensorImpl()->is_python_dispatch() &&
         !t.key_set().has_any(c10::DispatchKeySet({c10::DispatchKey::FuncTorchBatched,
                                                   c10::DispatchKey::FuncTorchGradWrapper})) &&
         !(t.requires_grad() && at::GradMode::is_enabled());
}

bool no_mode() { return c10::impl::TorchDispatchModeTLS::stack_len() == 0; }

bool plain_bias(const std::optional<at::Tensor>& bias, int64_t N) {
  return !bias.has_value() || (plain_cpu(*bias) && bias->dim() == 1 && bias->size(0) == N &&
                               at::isFloatingType(bias->scalar_type()));
}

bool act_dtype(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf || t == at::kFloat; }

bool e8m0_codes(at::ScalarType t) { return t == at::kByte || t == at::kFloat8_e8m0fnu; }

// Scratch for the entry points' fp32 A and result: kept per calling thread (no allocation
// per call) up to kScratchFloats, allocated per call above it.
constexpr int64_t kScratchFloats = int64_t(1) << 20;

float* scratch(int64_t count, int slot, at::Tensor& holder) {
  if (count > kScratchFloats) {
    holder = at::empty({count}, at::TensorOptions().dtype(at::kFloat));
    return holder.data_ptr<float>();
  }
  thread_local std::vector<float> buffers[2];
  if (static_cast<int64_t>(buffers[slot].size()) < count) buffers[slot].resize(count);
  return buffers[slot].data();
}

// A of docs/contract.md §4 as fp32 [M, K] into scratch slot 0: qdq_fp8(bf16(x)) or bf16(x).
float* staged_a(const ActivationSource& src, at::Tensor& holder) {
  float* a = scratch(src.M * src.K, 0, holder);
  src.fp32(a);
  return a;
}

// out [M, N] of its dtype = round(y + bias): the op's one final rounding. bf16 as torch
// rounds (nearest even, NaN -> 0x7FC0), float16 through c10::Half, float32 as it is.
void store_output(const float* y, const float* bias, int64_t M, int64_t N, at::Tensor& out) {
  const at::ScalarType t = out.scalar_type();
  for (int64_t m = 0; m < M; ++m) {
    const float* yr = y + m * N;
    int64_t n = 0;
    if (t == at::kBFloat16) {
      uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr()) + m * N;
#if defined(TORCH_BQ_AVX2)
      const __m256i one = _mm256_set1_epi32(1), round = _mm256_set1_epi32(0x7FFF);
      const __m256i nan = _mm256_set1_epi32(0x7FC0);
      for (; n + 8 <= N; n += 8) {
        __m256 v = _mm256_loadu_ps(yr + n);
        if (bias != nullptr) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + n));
        const __m256i b = _mm256_castps_si256(v);
        const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), one);
        __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b, round), lsb), 16);
        r = _mm256_blendv_epi8(r, nan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o + n),
                         _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
      }
#endif
      for (; n < N; ++n) o[n] = bf16_rne(bias != nullptr ? yr[n] + bias[n] : yr[n]);
    } else if (t == at::kHalf) {
      at::Half* o = out.data_ptr<at::Half>() + m * N;
      for (; n < N; ++n) o[n] = at::Half(bias != nullptr ? yr[n] + bias[n] : yr[n]);
    } else {
      float* o = out.data_ptr<float>() + m * N;
      for (; n < N; ++n) o[n] = bias != nullptr ? yr[n] + bias[n] : yr[n];
    }
  }
}

// The shared body: bf16(x), kernel(src, y, final) (A's source; y fp32 [M, N]: the kernel
// stages fp32 A with staged_a where it needs it), bias and rounding into the final [..., N]
// tensor. The decode path touches no ATen op (each costs microseconds from a cold cache): the
// weight and scale bytes are read through their pointers, whatever their dtype names.
template <class Kernel>
at::Tensor staged_entry(const at::Tensor& x, int64_t N, const std::optional<at::Tensor>& bias, bool act_quant,
                        double act_peak, at::ScalarType out_dtype, const Kernel& kernel) {
  const int64_t K = x.size(-1), M = x.numel() / K;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor out = at::detail::empty_cpu(shape, out_dtype, false, std::nullopt);
  if (M == 0 || N == 0) return out;
  at::Tensor xb = x, y_holder, b_holder;
  if (!(x.scalar_type() == at::kBFloat16 && x.is_contiguous())) xb = x.reshape({M, K}).to(at::kBFloat16).contiguous();
  // fp32(1/peak), as qdq_fp8
  const ActivationSource src{reinterpret_cast<const uint16_t*>(xb.data_ptr()), M, K, act_quant,
                             static_cast<float>(1.0 / act_peak)};
  float* y = scratch(M * N, 1, y_holder);
  const float* b = nullptr;
  if (bias.has_value()) {
    b_holder = bias->scalar_type() == at::kFloat && bias->is_contiguous() ? *bias : bias->to(at::kFloat).contiguous();
    b = b_holder.const_data_ptr<float>();
  }
  const FinalOutput final{out.data_ptr(), out_dtype, b, N};
  if (!kernel(src, y, final)) store_output(y, b, M, N, out);  // the kernel wrote y, not out
  return out;
}

template <class Fmt>
at::Tensor run_entry(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                     const std::optional<at::Tensor>& bias, int64_t bn, int64_t bk, bool act_quant,
                     double act_peak, at::ScalarType out_dtype, int64_t decode_max_m, int64_t panel_bytes) {
  const int64_t K = x.size(-1), N = weight.size(0);
  return staged_entry(x, N, bias, act_quant, act_peak, out_dtype,
                      [&](const ActivationSource& src, float* y, const FinalOutput& final) {
    const int64_t M = src.M;
    const WeightView w{static_cast<const uint8_t*>(weight.const_data_ptr()), weight.size(1), scale.const_data_ptr(),
                       scale.size(1), bn, bk, K};
    const bool codes = scale.scalar_type() != at::kFloat;
    at::Tensor a_holder;
    if (M <= decode_max_m) {
      const float* a = staged_a(src, a_holder);
      if (codes)
        decode_linear<Fmt, uint8_t>(w, a, M, N, y);
      else
        decode_linear<Fmt, float>(w, a, M, N, y);
      return false;
    }
    const auto f32 = at::TensorOptions().dtype(at::kFloat);
    at::Tensor y_t = at::from_blob(y, {M, N}, f32);
    if (codes) {  // A packed from x where the bf16 tiles run
      at::Tensor a_t = at::from_blob(scratch(M * K, 0, a_holder), {M, K}, f32);
      return prefill_linear(QuantizedRows<Fmt, uint8_t>{w}, a_t, N, panel_bytes, y_t, &final, &src);
    }
    // fp32 multipliers: the fp32 microkernel throughout, on fp32 A
    at::Tensor a_t = at::from_blob(staged_a(src, a_holder), {M, K}, f32);
    return prefill_linear(QuantizedRows<Fmt, float>{w}, a_t, N, panel_bytes, y_t, &final);
  });
}

at::Tensor fp8_linear_op(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                         const std::optional<at::Tensor>& bias, at::IntArrayRef block, bool act_quant,
                         double act_peak, at::ScalarType out_dtype, int64_t decode_max_m, int64_t panel_bytes) {
  if (!(no_mode() && plain_cpu(x) && plain_cpu(weight) && plain_cpu(scale) && act_dtype(x.scalar_type()) &&
        act_dtype(out_dtype) && x.dim() >= 1 && block.size() == 2))
    return {};
  const int64_t bn = block[0], bk = block[1], limit = std::numeric_limits<int32_t>::max();
  if (!(bn >= 1 && bk >= 1 && bn <= limit && bk <= limit)) return {};
  if (!(weight.dim() == 2 && weight.is_contiguous() &&
        (weight.scalar_type() == at::kByte || weight.scalar_type() == at::kFloat8_e4m3fn)))
    return {};
  const int64_t N = weight.size(0), K = weight.size(1);
  if (!(K > 0 && x.size(-1) == K && plain_bias(bias, N) && scale.dim() == 2 && scale.is_contiguous() &&
        (e8m0_codes(scale.scalar_type()) || scale.scalar_type() == at::kFloat) &&
        scale.size(0) == (N + bn - 1) / bn && scale.size(1) == (K + bk - 1) / bk))
    return {};
  return run_entry<Fp8Format>(x, weight, scale, bias, bn, bk, act_quant, act_peak, out_dtype, decode_max_m,
                              panel_bytes);
}

at::Tensor fp4_linear_op(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                         const std::optional<at::Tensor>& bias, bool act_quant, double act_peak,
                         at::ScalarType out_dtype, int64_t decode_max_m, int64_t panel_bytes) {
  if (!(no_mode() && plain_cpu(x) && plain_cpu(weight) && plain_cpu(scale) && act_dtype(x.scalar_type()) &&
        act_dtype(out_dtype) && x.dim() >= 1))
    return {};
  const at::ScalarType wt = weight.scalar_type();
  if (!(weight.dim() == 2 && weight.is_contiguous() &&
        (wt == at::kByte || wt == at::kChar || wt == at::kFloat4_e2m1fn_x2)))
    return {};
  const int64_t N = weight.size(0), K = x.size(-1);
  if (!(K > 0 && weight.size(1) == (K + 1) / 2 && plain_bias(bias, N) && scale.dim() == 2 &&
        scale.is_contiguous() && e8m0_codes(scale.scalar_type()) && scale.size(0) == N &&
        scale.size(1) == (K + 31) / 32))
    return {};
  return run_entry<Fp4Format>(x, weight, scale, bias, 1, 32, act_quant, act_peak, out_dtype, decode_max_m,
                              panel_bytes);
}

// bf16_linear / fp32w_linear in one call: bf16(x), the prefill kernel on the dense weight
// (fp32 weights narrowed to bf16 element by element), the bias in fp32 and the one rounding
// to out_dtype. The caller has checked the arguments (which weight dtype the op takes is its
// to say); anything unusual still returns an undefined tensor.
at::Tensor dense_linear_op(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                           at::ScalarType out_dtype, int64_t panel_bytes) {
  if (!(no_mode() && plain_cpu(x) && plain_cpu(weight) && act_dtype(x.scalar_type()) && act_dtype(out_dtype) &&
        x.dim() >= 1 && weight.dim() == 2 && weight.is_contiguous() &&
        (weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kFloat)))
    return {};
  const int64_t N = weight.size(0), K = weight.size(1);
  if (!(K > 0 && x.size(-1) == K && plain_bias(bias, N))) return {};
  return staged_entry(x, N, bias, false, 1.0, out_dtype, [&](const ActivationSource& src, float* y,
                                                            const FinalOutput& final) {
    const int64_t M = src.M;
    const auto f32 = at::TensorOptions().dtype(at::kFloat);
    at::Tensor a_holder;
    // A packed from bf16(x) where the bf16 tiles run, fp32 A written only where a path reads it
    at::Tensor a_t = at::from_blob(scratch(M * K, 0, a_holder), {M, K}, f32), y_t = at::from_blob(y, {M, N}, f32);
    if (weight.scalar_type() == at::kBFloat16)
      return prefill_linear(DenseRows<at::BFloat16>{weight.const_data_ptr<at::BFloat16>(), K}, a_t, N, panel_bytes,
                            y_t, &final, &src);
    return prefill_linear(DenseRows<float>{weight.const_data_ptr<float>(), K}, a_t, N, panel_bytes, y_t, &final, &src);
  });
}

// The decode kernels this build runs for 32-wide e8m0 blocks: "avx512_bf16"
// (vdpbf16ps, AVX-512 BW + VBMI), "avx2" (fp32 FMA) or "generic" (scalar).
std::string decode_isa() {
#if defined(TORCH_BQ_DOT_BF16)
  return "avx512_bf16";
#elif defined(TORCH_BQ_AVX2)
  return "avx2";
#else
  return "generic";
#endif
}

bool vectorized() {
#if defined(TORCH_BQ_AVX2)
  return true;
#else
  return false;
#endif
}

std::vector<int64_t> prefill_counts() {
  return {prefill_tiles[0].load(), prefill_tiles[1].load(), prefill_tiles[2].load()};
}

int64_t rowdot_chunks() {
#if defined(TORCH_BQ_AVX512_BF16)
  return rowdot_chunks_run.load();
#else
  return 0;  // the row-dot tiles are part of the bf16 microkernel
#endif
}

std::vector<int64_t> fp4_int_counts() {
#if defined(TORCH_BQ_AVX2)
  return {fp4_int_calls[0].load(), fp4_int_calls[1].load(), fp4_int_calls[2].load(), fp4_int_calls[3].load()};
#else
  return {};
#endif
}

// The most rows the AVX2 MXFP4 int path takes (kFp4IntMaxM; tests compare the avx2 decode limit with it).
int64_t fp4_int_max_m() { return kFp4IntMaxM; }

std::vector<int64_t> decode_counts() { return {dot_decode_calls[0].load(), dot_decode_calls[1].load()}; }

int64_t decode_prescaled_rows() { return prescaled_rows.load(); }

// The fewest rows the AVX-512 BF16 decode runs on its folded tiles at this K, [fp8,
// fp4, fp8 whose scale rows serve 16 weight rows (A prescaled below that)] (empty in
// builds without those kernels): the one place tests read them from.
std::vector<int64_t> decode_fold_rows(int64_t K) {
#if defined(TORCH_BQ_DOT_BF16)
  return {dotbf16::Fold<dotbf16::Fp8Dot>::kMinRows, dotbf16::Fold<dotbf16::Fp4Dot>::kMinRows,
          dotbf16::prescale_max_rows(K) + 1};
#else
  return {};
#endif
}

// W rows per prefill task (the generic build: the fewest rows of an at::mm panel).
int64_t prefill_task_rows() {
#if defined(TORCH_BQ_AVX512_BF16)
  return kDotTaskRows;
#else
  return kTileRows;
#endif
}

// The level this library was compiled for (torch_bq/ops/cpu/isa.py: LEVELS).
std::string isa() { return TORCH_BQ_STR(TORCH_BQ_ISA); }

}  // namespace
}  // namespace torch_bq_cpu

// --------------------------------------------------------------------------
// lent to the other sources of this library (shared.h: nvfp4.cpp)
// --------------------------------------------------------------------------

namespace torch_bq_cpu {
namespace {
// A RowDecoder as prefill_linear's Rows: fp32 panels only. Its bf16 answer
// (nothing written, "subnormal") keeps every tile on the fp32 microkernel.
struct DecoderRows {
  const torch_bq_cpu_shared::RowDecoder& rows;
  int64_t chunk_align() const { return rows.chunk_align(); }
  void fp32(int64_t n, int64_t k0, int64_t k1, float* dst) const { rows.fp32(n, k0, k1, dst); }
  LowBits bf16(int64_t, int64_t, int64_t, uint16_t*, float*) const { return {0, true}; }
};
}  // namespace
}  // namespace torch_bq_cpu

namespace torch_bq_cpu_shared {

const float* e4m3_values() { return torch_bq_cpu::kTables.e4m3; }
const float* e2m1_values() { return torch_bq_cpu::kTables.fp4; }

void run_tasks(int64_t count, void (*body)(const void* ctx, int64_t i), const void* ctx) {
  torch_bq_cpu::run_tasks(count, [&](int64_t i) { body(ctx, i); });
}

void prefill_fp32(const RowDecoder& rows, const at::Tensor& A, int64_t N, int64_t panel_bytes, at::Tensor& out) {
  torch_bq_cpu::prefill_linear(torch_bq_cpu::DecoderRows{rows}, A, N, panel_bytes, out);
}

}  // namespace torch_bq_cpu_shared


TORCH_BQ_LIBRARY(TORCH_BQ_OPS, m) {
  m.def("isa() -> str", &torch_bq_cpu::isa);
  m.def("qdq_fp8(Tensor x, float peak, bool fp32_out) -> Tensor", &torch_bq_cpu::qdq_fp8);
  m.def(
      "fp8_linear(Tensor a, Tensor weight, Tensor scale, Tensor? bias, int bn, int bk, int decode_max_m, "
      "int panel_bytes) -> Tensor",
      &torch_bq_cpu::fp8_linear);
  m.def("fp4_linear(Tensor a, Tensor weight, Tensor scale, Tensor? bias, int decode_max_m, int panel_bytes) -> Tensor",
        &torch_bq_cpu::fp4_linear);
  m.def("dense_linear(Tensor a, Tensor weight, Tensor? bias, int panel_bytes) -> Tensor", &torch_bq_cpu::dense_linear);
  // The public ops' entry points (see "public-op entry points"): None for calls they do not take.
  m.def(
      "fp8_linear_op(Tensor x, Tensor weight, Tensor scale, Tensor? bias, int[] block, bool act_quant, "
      "float act_peak, ScalarType out_dtype, int decode_max_m, int panel_bytes) -> Tensor",
      &torch_bq_cpu::fp8_linear_op);
  m.def(
      "fp4_linear_op(Tensor x, Tensor weight, Tensor scale, Tensor? bias, bool act_quant, float act_peak, "
      "ScalarType out_dtype, int decode_max_m, int panel_bytes) -> Tensor",
      &torch_bq_cpu::fp4_linear_op);
  m.def("dense_linear_op(Tensor x, Tensor weight, Tensor? bias, ScalarType out_dtype, int panel_bytes) -> Tensor",
        &torch_bq_cpu::dense_linear_op);
  m.def("vectorized() -> bool", &torch_bq_cpu::vectorized);
  m.def("prefill_counts() -> int[]", &torch_bq_cpu::prefill_counts);
  m.def("rowdot_chunks() -> int", &torch_bq_cpu::rowdot_chunks);
  m.def("decode_counts() -> int[]", &torch_bq_cpu::decode_counts);
  m.def("decode_prescaled_rows() -> int", &torch_bq_cpu::decode_prescaled_rows);
  m.def("fp4_int_counts() -> int[]", &torch_bq_cpu::fp4_int_counts);
  m.def("decode_fold_rows(int K) -> int[]", &torch_bq_cpu::decode_fold_rows);
  m.def("fp4_int_max_m() -> int", &torch_bq_cpu::fp4_int_max_m);
  m.def("prefill_task_rows() -> int", &torch_bq_cpu::prefill_task_rows);
  m.def("decode_isa() -> str", &torch_bq_cpu::decode_isa);
}

// --------------------------------------------------------------------------
// the entry points as a Python extension module
// --------------------------------------------------------------------------
//
// From a cold cache a torch.ops call spends 80-100 us before the first line of the
// function it reaches (argument parsing against the schema, the dispatcher) and
// 15-25 us coming back: as much as the whole decode of a 2880 x 2880 MXFP4 weight.
// This module holds the same two entry points (and the staged kernels), callable from
// Python directly:
//
// * fp8_linear_op / fp4_linear_op: the ops' functions as they are, for the CPU
//   kernels of torch_bq::fp8_linear / fp4_linear (torch_bq/ops/cpu/linear.py),
//   which run under the dispatcher already;
// * fp8_linear_direct / fp4_linear_direct: the eager direct path, which skips
//   torch_bq::'s dispatcher. They also refuse (None) while anything that records
//   or transforms ops above the dispatcher is on: a TorchFunctionMode, a TorchScript
//   trace, a functorch transform (vmap, grad, functionalize): each of them must see
//   the public op. (torch.compile never gets here: the caller asks
//   torch.compiler.is_dynamo_compiling() first; other tracing passes fake or
//   functional tensors under a mode, which these refuse.)
//
// Both record themselves for the profiler under the ops' names. Built only when
// Python's headers are there (a torch extension build passes their directory):
// without them the library has the ops alone and the public ops go through the
// dispatcher.
#if defined(TORCH_EXTENSION_NAME) && defined(__has_include)
#if __has_include(<Python.h>)
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/TracerMode.h>
#include <ATen/record_function.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <array>

namespace torch_bq_cpu {

const char* const kFp8EntryName = TORCH_BQ_STR(TORCH_BQ_OPS) "::fp8_linear_op";
const char* const kFp4EntryName = TORCH_BQ_STR(TORCH_BQ_OPS) "::fp4_linear_op";

// What torch._C._is_torch_function_mode_enabled(), _get_tracing_state() and
// _are_functorch_transforms_active() report, in one call.
bool watched() {
  const c10::DispatchKeySet included = c10::impl::tls_local_dispatch_key_set().included_;
  return at::impl::torch_function_mode_enabled() || at::tracer::impl::is_dispatch_enabled() ||
         included.has(c10::DispatchKey::FuncTorchDynamicLayerFrontMode) ||
         included.has(c10::DispatchKey::FuncTorchDynamicLayerBackMode);
}

at::Tensor fp8_linear_entry(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                            const std::optional<at::Tensor>& bias, std::vector<int64_t> block, bool act_quant,
                            double act_peak, at::ScalarType out_dtype, int64_t decode_max_m, int64_t panel_bytes) {
  RECORD_FUNCTION(kFp8EntryName, std::vector<c10::IValue>());
  return fp8_linear_op(x, weight, scale, bias, block, act_quant, act_peak, out_dtype, decode_max_m, panel_bytes);
}

at::Tensor fp4_linear_entry(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                            const std::optional<at::Tensor>& bias, bool act_quant, double act_peak,
                            at::ScalarType out_dtype, int64_t decode_max_m, int64_t panel_bytes) {
  RECORD_FUNCTION(kFp4EntryName, std::vector<c10::IValue>());
  return fp4_linear_op(x, weight, scale, bias, act_quant, act_peak, out_dtype, decode_max_m, panel_bytes);
}

// `entry` as the eager direct path calls it: None (without calling it) while watched(),
// else its result with the GIL released while it runs (the watch is read before, with
// the GIL held: the torch function mode state is the calling thread's).
template <class... Args>
auto unless_watched(at::Tensor (*entry)(Args...)) {
  return [entry](Args... args) -> pybind11::object {
    if (watched()) return pybind11::none();
    at::Tensor y;
    {
      pybind11::gil_scoped_release no_gil;
      y = entry(std::forward<Args>(args)...);
    }
    return pybind11::cast(std::move(y));
  };
}

// ---- the eager direct path as one C call ----
//
// What the public ops and modules ask of an eager CPU call before it may skip the op
// (torch_bq/ops/cpu/linear.py, _direct_route: exact tensor types, a bool act_quant, a
// dtype, a peak in range, the kernel not switched off, the decode limit for K), done
// here from values that file configures, so that the call reaches the kernel through
// one Python frame (the public op's) instead of nine: from a cold cache each Python
// call and attribute lookup costs microseconds. The Python side stays the source of
// every rule: configure_direct() receives the plain tensor types, the peak's bounds,
// the op's record of switched-off device types, the decode limits and the panel size,
// and a list of guards, (namespace dict, key, value) triples the configuration was
// derived from (the kernel selection, decode_max_m, PANEL_BYTES): while any of them
// no longer holds (a cap change, a test's monkeypatch), the route calls the Python
// fallback instead, which routes the call the long way and configures the route again.
struct DirectRoute {
  pybind11::object tensor_type, parameter_type;  // the exact types taken as they are
  pybind11::object disabled, device;             // the op's set of switched-off device types; "cpu"
  double min_peak = 0, max_peak = 0;
  int64_t limit = 0, long_k = -1, long_k_limit = 0, panel_bytes = 0;  // decode_max_m's rule
  std::vector<std::array<pybind11::object, 3>> guards;
  pybind11::object fallback;  // the Python direct path: same arguments, Tensor or None
};

// [fp8, fp4]; replaced whole by configure_direct (with the GIL held) and never freed:
// the interpreter may be gone when static destructors run.
DirectRoute* direct_routes[2] = {nullptr, nullptr};

void configure_direct(const std::string& fmt, pybind11::object tensor_type, pybind11::object parameter_type,
                      pybind11::object disabled, double min_peak, double max_peak, int64_t limit, int64_t long_k,
                      int64_t long_k_limit, int64_t panel_bytes, std::vector<std::array<pybind11::object, 3>> guards,
                      pybind11::object fallback) {
  TORCH_CHECK(fmt == "fp8" || fmt == "fp4", "configure_direct: fmt must be 'fp8' or 'fp4', got ", fmt);
  TORCH_CHECK(PyAnySet_Check(disabled.ptr()), "configure_direct: disabled must be a set");
  for (const auto& g : guards) TORCH_CHECK(PyDict_Check(g[0].ptr()), "configure_direct: a guard's namespace must be a dict");
  auto* r = new DirectRoute{std::move(tensor_type), std::move(parameter_type), std::move(disabled),
                            pybind11::str("cpu"), min_peak, max_peak, limit, long_k, long_k_limit, panel_bytes,
                            std::move(guards), std::move(fallback)};
  DirectRoute*& slot = direct_routes[fmt == "fp8" ? 0 : 1];
  delete slot;
  slot = r;
}

bool guards_hold(const DirectRoute& r) {
  for (const auto& g : r.guards)
    if (PyDict_GetItemWithError(g[0].ptr(), g[1].ptr()) != g[2].ptr()) {  // borrowed; identity
      PyErr_Clear();
      return false;
    }
  return true;
}

bool plain_tensor(const DirectRoute& r, PyObject* o) {
  return Py_TYPE(o) == reinterpret_cast<PyTypeObject*>(r.tensor_type.ptr()) ||
         Py_TYPE(o) == reinterpret_cast<PyTypeObject*>(r.parameter_type.ptr());
}

// The common part of the two routes: the arguments they share, checked and unpacked, or
// false (the op must be called). x, weight, scale, bias, act_quant, act_peak, out_dtype.
struct RouteArgs {
  at::Tensor x, weight, scale;
  std::optional<at::Tensor> bias;
  bool act_quant;
  double act_peak;
  at::ScalarType out_dtype;
  int64_t limit;
};

bool route_args(const DirectRoute& r, PyObject* x, PyObject* weight, PyObject* scale, PyObject* bias,
                PyObject* act_quant, PyObject* act_peak, PyObject* out_dtype, RouteArgs& out) {
  if (!(plain_tensor(r, x) && plain_tensor(r, weight) && plain_tensor(r, scale) &&
        (bias == Py_None || plain_tensor(r, bias)) && PyBool_Check(act_quant) && PyFloat_CheckExact(act_peak) &&
        THPDtype_Check(out_dtype)))
    return false;
  out.act_peak = PyFloat_AS_DOUBLE(act_peak);
  if (!(r.min_peak <= out.act_peak && out.act_peak <= r.max_peak)) return false;
  const int in = PySet_Contains(r.disabled.ptr(), r.device.ptr());
  if (in != 0) {  // switched off (1) or the lookup failed (-1): the op decides
    if (in < 0) PyErr_Clear();
    return false;
  }
  out.x = THPVariable_Unpack(x);
  if (out.x.dim() == 0) return false;  // the op's checks name it
  out.weight = THPVariable_Unpack(weight);
  out.scale = THPVariable_Unpack(scale);
  if (bias != Py_None) out.bias = THPVariable_Unpack(bias);
  out.act_quant = act_quant == Py_True;
  out.out_dtype = reinterpret_cast<THPDtype*>(out_dtype)->scalar_type;
  out.limit = r.long_k >= 0 && out.x.size(-1) > r.long_k ? r.long_k_limit : r.limit;
  return true;
}

pybind11::object route_result(at::Tensor y) {
  if (!y.defined()) return pybind11::none();
  return pybind11::reinterpret_steal<pybind11::object>(THPVariable_Wrap(std::move(y)));
}

pybind11::object fp8_linear_route(pybind11::handle x, pybind11::handle weight, pybind11::handle scale,
                                  pybind11::handle bias, pybind11::handle block, pybind11::handle act_quant,
                                  pybind11::handle act_peak, pybind11::handle out_dtype) {
  const DirectRoute* r = direct_routes[0];
  if (r == nullptr) return pybind11::none();
  if (!guards_hold(*r)) {
    const pybind11::object fallback = r->fallback;  // the call may configure the route again (delete r)
    return fallback(x, weight, scale, bias, block, act_quant, act_peak, out_dtype);
  }
  RouteArgs a;
  if (!route_args(*r, x.ptr(), weight.ptr(), scale.ptr(), bias.ptr(), act_quant.ptr(), act_peak.ptr(),
                  out_dtype.ptr(), a))
    return pybind11::none();
  PyObject* b = block.ptr();  // (bn, bk) of exact ints, as formats.check_block gives it
  if (!((PyTuple_CheckExact(b) && PyTuple_GET_SIZE(b) == 2) || (PyList_CheckExact(b) && PyList_GET_SIZE(b) == 2)))
    return pybind11::none();
  PyObject* b0 = PySequence_Fast_GET_ITEM(b, 0);
  PyObject* b1 = PySequence_Fast_GET_ITEM(b, 1);
  if (!(PyLong_CheckExact(b0) && PyLong_CheckExact(b1))) return pybind11::none();
  const std::vector<int64_t> bv{PyLong_AsLongLong(b0), PyLong_AsLongLong(b1)};
  if (PyErr_Occurred()) {  // out of int64's range: the op's checks name it
    PyErr_Clear();
    return pybind11::none();
  }
  if (watched()) return pybind11::none();
  const int64_t panel_bytes = r->panel_bytes;  // r may be replaced while the GIL is released
  at::Tensor y;
  {
    pybind11::gil_scoped_release no_gil;
    y = fp8_linear_entry(a.x, a.weight, a.scale, a.bias, bv, a.act_quant, a.act_peak, a.out_dtype, a.limit,
                         panel_bytes);
  }
  return route_result(std::move(y));
}

pybind11::object fp4_linear_route(pybind11::handle x, pybind11::handle weight, pybind11::handle scale,
                                  pybind11::handle bias, pybind11::handle act_quant, pybind11::handle act_peak,
                                  pybind11::handle out_dtype) {
  const DirectRoute* r = direct_routes[1];
  if (r == nullptr) return pybind11::none();
  if (!guards_hold(*r)) {
    const pybind11::object fallback = r->fallback;
    return fallback(x, weight, scale, bias, act_quant, act_peak, out_dtype);
  }
  RouteArgs a;
  if (!route_args(*r, x.ptr(), weight.ptr(), scale.ptr(), bias.ptr(), act_quant.ptr(), act_peak.ptr(),
                  out_dtype.ptr(), a) ||
      watched())
    return pybind11::none();
  const int64_t panel_bytes = r->panel_bytes;
  at::Tensor y;
  {
    pybind11::gil_scoped_release no_gil;
    y = fp4_linear_entry(a.x, a.weight, a.scale, a.bias, a.act_quant, a.act_peak, a.out_dtype, a.limit,
                         panel_bytes);
  }
  return route_result(std::move(y));
}

}  // namespace torch_bq_cpu

// The module is named as the build names the library (TORCH_EXTENSION_NAME); the loader
// (torch_bq/ops/_backend.py) imports it from the file it loaded. Same arguments as the ops;
// an undefined result (a refused call) arrives as None. The GIL is released while the
// kernels run, as torch.ops releases it.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.attr("isa") = TORCH_BQ_STR(TORCH_BQ_ISA);
  m.def("fp8_linear_op", &torch_bq_cpu::fp8_linear_entry, release());
  m.def("fp4_linear_op", &torch_bq_cpu::fp4_linear_entry, release());
  // The staged kernels (qdq'd fp32 A in, fp32 out), for timing a kernel call without torch.ops
  // (benchmarks/ggml_side_by_side.py); torch_bq itself calls them through the ops.
  m.def("fp8_linear", &torch_bq_cpu::fp8_linear, release());
  m.def("fp4_linear", &torch_bq_cpu::fp4_linear, release());
  m.def("fp8_linear_direct", torch_bq_cpu::unless_watched(&torch_bq_cpu::fp8_linear_entry));
  m.def("fp4_linear_direct", torch_bq_cpu::unless_watched(&torch_bq_cpu::fp4_linear_entry));
  m.def("configure_direct", &torch_bq_cpu::configure_direct);
  m.def("fp8_linear_route", &torch_bq_cpu::fp8_linear_route);
  m.def("fp4_linear_route", &torch_bq_cpu::fp4_linear_route);
}
#endif
#endif
