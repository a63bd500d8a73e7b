// Quantized experts: row dot products that read GGUF blocks in place, with AVX512_VNNI.
//
// Why integer dots: one token per expert (decode) reads every weight once, so a kernel must
// turn bytes into products faster than memory delivers them. A Q4_K row kernel decoding
// blocks into bf16 for VDPBF16PS (32 products an instruction, exact for bf16 activations)
// measured about 15% slower than one with VPDPBUSD (64 u8 x s8 products an instruction into
// int32) on the 2-core Zen 4 host, in cache and from memory, and both were compute-bound
// there (in-cache rates near the host's per-core read bandwidth), so the activations are
// quantized instead: per 32
// values to int8 with an fp32 scale (quantize_activations, experts.h), once per token for x
// and once per route for h. The weights' integers then meet them exactly; the block scales
// (weight scale x activation scale) combine the int32 sums in fp32.
//
// Each format's kernel takes the 64 weight bytes of 128 (Q4_K, Q5_K, Q6_K, MXFP4) or 64
// (Q8_0) values to two u8 vectors, and its activation record (kernels.h) holds x in the
// matching arrangement, so that no shuffle of weights is needed:
//   Q4_K, Q5_K  low / high nibbles of a 64-byte qs chunk are sub-blocks (4c, 4c+2) /
//               (4c+1, 4c+3) of group c; x's 32-blocks are stored in the order 0 2 1 3 4 6 5 7.
//               Q5_K adds its fifth bit from qh. w = d*sc*q - dmin*m: the min term is
//               dmin*m_j * (sum of sub-block j of x), from aux.
//   Q6_K        ql's low nibbles are values 0-63 of a half, high nibbles 64-127, qh adds two
//               bits; x is natural. q - 32: the dots start at -32 * lane sums (corr).
//   Q8_0        two blocks a step; int8 weights + 128 are u8, dots start at -128 * lane sums.
//   MXFP4       four blocks a step; nibbles -> (doubled e2m1 value + 12) by VPSHUFB, dots start
//               at -12 * lane sums; block i's low nibbles meet x[0:16], high x[16:32], so x is
//               stored in 16-value halves: four first halves, then four second halves.
// Integer sums never overflow: a lane adds at most 8 products |u8 * s8| <= 255 * 127 to its
// start value.
//
// A kernel call takes kQRows rows for one activation (decode; independent chains, one
// horizontal sum for all) or fewer rows for up to kQTok activations (the routes of one
// expert), so the weight bytes are decoded once per kQTok routes. Software prefetch keeps
// the bytes ahead of the rows in flight (ColdArgs::prefetch_bytes), because the hardware prefetchers alone
// left the row kernels at a third of the read bandwidth on the Zen 4 host.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "kernels.h"

namespace ostinato {

QActLayout qact_layout(QType qt, int64_t n) {
  QActLayout l;
  l.n = n;
  const int64_t pad = round_up(n, 128);
  int64_t aux = 0;  // fp32 entries
  switch (qt) {
    case QType::kQ4_K:
    case QType::kQ5_K:
    case QType::kQ6_K: aux = n / 256 * 16; break;
    case QType::kQ8_0: aux = round_up(n / 32, 2) * 8; break;
    case QType::kMXFP4: aux = (n + 127) / 128 * 16; break;
    default: break;
  }
  l.aux_off = pad;
  l.corr_off = pad + round_up(aux * 4, 64);
  l.stride = l.corr_off + pad;
  return l;
}

int64_t qact_max_stride(int64_t n) {
  int64_t m = 0;
  for (int q = 1; q <= 5; ++q) m = std::max(m, qact_layout(QType(q), n).stride);
  return m;
}

}  // namespace ostinato

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c,bmi2")
// GCC 12's intrinsic headers build their "undefined" vectors (casts, extracts) as `v = v`,
// which -Wuninitialized reports once inlined into these kernels: a false positive.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"

#include "vecmath.h"

namespace ostinato {
namespace {

constexpr int kQTok = 4;  // activations per row pass
constexpr int kQRows = 4;  // rows per kernel call for one activation (2 for two)
// Software prefetch keeps about ColdArgs::prefetch_bytes ahead of the rows being read per
// thread, split over the streams a task reads (gate/up: 2, down: 1). On the 2-core Zen 4 host
// 8 KiB (the default) was best both for one stream (the row kernels alone: 4 KiB 68-78% of the
// read probe, 8 KiB 91-106%, 16-32 KiB no better) and for two (4 KiB each beat 8 and 16 KiB
// each); scripts/bench_cpu_quant.py --prefetch-kib sweeps it on another host.

inline float half_to_f32(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// Prefetches len bytes from p into L2, in step with the reading of the current rows.
struct Prefetch {
  const char* p = nullptr;
  int64_t len = 0, off = 0;
  inline void upto(int64_t step, int64_t steps) {
    if (p == nullptr) return;
    for (const int64_t end = len * (step + 1) / steps; off < end; off += 64) _mm_prefetch(p + off, _MM_HINT_T1);
  }
};

// The prefetch window for rows [r, r + nr) of a region whose rows end at `end` (exclusive):
// the bytes `ahead` bytes ahead of them, clamped to the region.
inline Prefetch window(const uint8_t* row, int nr, int64_t rb, const uint8_t* end, int64_t ahead, bool on) {
  Prefetch pf;
  const uint8_t* lo = row + ahead;
  if (!on || lo >= end) return pf;
  pf.p = reinterpret_cast<const char*>(lo);
  pf.len = std::min<int64_t>(nr * rb, end - lo);
  return pf;
}

// The head of a task's region, the bytes that no window covers: prefetched at the task's
// start, so that its first rows do not wait on memory line by line.
inline void prefetch_head(const uint8_t* row, const uint8_t* end, int64_t ahead, bool on) {
  if (!on) return;
  const uint8_t* stop = std::min(row + ahead, end);
  for (const uint8_t* c = row; c < stop; c += 64) _mm_prefetch(reinterpret_cast<const char*>(c), _MM_HINT_T0);
}

// 16 int32 lanes: lanes 4i..4i+3 hold a, b, c, d for i = 0..3 (permutation constants).
inline __m512i lanes(int a, int b, int c, int d) {
  return _mm512_setr_epi32(a, a, a, a, b, b, b, b, c, c, c, c, d, d, d, d);
}

// A format's row kernel is a sequence of steps (a block, or a group of small blocks); step s
// of a row adds that row's partial dot products with NT activations into two accumulators.

// ---- Q4_K and Q5_K: steps of one 256-value block -------------------------------------

// [d * sc_j for j < 8, dmin * m_j for j < 8] of a Q4_K / Q5_K block (its first 16 bytes).
inline __m512 k4_scales(const uint8_t* blk) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk));
  // s[k] = h[4 + k]. sc0-3 = s0-3 & 63; sc4-7 = (s8-11 & 15) | (s0-3 >> 6) << 4;
  // m0-3 = s4-7 & 63; m4-7 = (s8-11 >> 4) | (s4-7 >> 6) << 4.
  const __m128i A = _mm_shuffle_epi8(h, _mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15));
  const __m128i B = _mm_shuffle_epi8(h, _mm_setr_epi8(-1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1, 8, 9, 10, 11));
  const __m128i m1 = _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0);
  const __m128i m2 = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15);
  const __m128i m3 = _mm_setr_epi8(0, 0, 0, 0, 48, 48, 48, 48, 0, 0, 0, 0, 48, 48, 48, 48);
  const __m128i sm = _mm_or_si128(_mm_or_si128(_mm_and_si128(A, m1), _mm_and_si128(_mm_srli_epi16(A, 4), m2)),
                                  _mm_and_si128(_mm_srli_epi16(B, 2), m3));
  const __m256i dd = _mm256_permutexvar_epi16(_mm256_setr_epi16(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                              _mm256_castsi128_si256(h));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sm)), _mm512_cvtph_ps(dd));
}

template <bool Q5>
struct K4 {
  static constexpr int64_t kBytes = Q5 ? 176 : 144;
  static int64_t steps(int64_t n) { return n / 256; }

  template <int NT>
  static inline void step(const uint8_t* w, int64_t b, const QActView* a, __m512* acc0, __m512* acc1) {
    const __m512i m4 = _mm512_set1_epi8(0x0f), m10 = _mm512_set1_epi8(0x10);
    // Sub-blocks of the dot lanes: group c, low nibbles (4c, 4c+2), high (4c+1, 4c+3).
    const __m512i iA[2] = {lanes(0, 0, 2, 2), lanes(4, 4, 6, 6)}, iB[2] = {lanes(1, 1, 3, 3), lanes(5, 5, 7, 7)};
    const uint8_t* blk = w + b * kBytes;
    const __m512 S = k4_scales(blk);
    __m512 St[NT];
    for (int t = 0; t < NT; ++t) {  // x [dx_j | sum_j]: this block's scales, and its mins (upper half)
      St[t] = _mm512_mul_ps(S, _mm512_loadu_ps(a[t].aux + b * 16));
      acc1[t] = _mm512_mask_sub_ps(acc1[t], 0xff00, acc1[t], St[t]);
    }
    const uint8_t* qs = blk + (Q5 ? 48 : 16);
    __m512i qh = _mm512_setzero_si512();
    if (Q5) qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16)));
    for (int c = 0; c < 2; ++c) {
      const __m512i q = _mm512_loadu_si512(qs + 64 * c);
      __m512i lo = _mm512_and_si512(q, m4), hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
      if (Q5) {  // qh bit j of byte l is bit 4 of value l of sub-block j: shift it to bit 4 per
                 // 16-bit word (bytes 0-31 | 32-63: sub-blocks 4c | 4c+2, then 4c+1 | 4c+3)
        const __mmask32 up = 0xffff0000u;
        const auto cnt = [up](int x, int y) { return _mm512_mask_blend_epi16(up, _mm512_set1_epi16(x), _mm512_set1_epi16(y)); };
        const __m512i bl = c == 0 ? _mm512_sllv_epi16(qh, cnt(4, 2)) : _mm512_srlv_epi16(qh, cnt(0, 2));
        const __m512i bh = c == 0 ? _mm512_sllv_epi16(qh, cnt(3, 1)) : _mm512_srlv_epi16(qh, cnt(1, 3));
        lo = _mm512_ternarylogic_epi32(lo, bl, m10, 0xF8);  // lo | (bl & 0x10)
        hi = _mm512_ternarylogic_epi32(hi, bh, m10, 0xF8);
      }
      for (int t = 0; t < NT; ++t) {
        const int8_t* x = a[t].q + b * 256 + 128 * c;
        const __m512i dA = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(x));
        const __m512i dB = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi, _mm512_loadu_si512(x + 64));
        acc0[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dA), _mm512_permutexvar_ps(iA[c], St[t]), acc0[t]);
        acc1[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dB), _mm512_permutexvar_ps(iB[c], St[t]), acc1[t]);
      }
    }
  }
};

// ---- Q6_K: steps of one 256-value block ----------------------------------------------

struct Q6K {
  static constexpr int64_t kBytes = 210;
  static int64_t steps(int64_t n) { return n / 256; }

  template <int NT>
  static inline void step(const uint8_t* w, int64_t b, const QActView* a, __m512* acc0, __m512* acc1) {
    const __m512i m4 = _mm512_set1_epi8(0x0f), m30 = _mm512_set1_epi8(0x30);
    const __mmask32 up = 0xffff0000u;
    // qh bits to bits 4-5 (per 16-bit word, bytes 0-31 | 32-63): low nibbles take bits 0-1 |
    // 2-3, high nibbles bits 4-5 | 6-7.
    const __m512i shl = _mm512_mask_blend_epi16(up, _mm512_set1_epi16(4), _mm512_set1_epi16(2));
    const __m512i shr = _mm512_mask_blend_epi16(up, _mm512_set1_epi16(0), _mm512_set1_epi16(2));
    // Sub-blocks of 16 of the dot lanes, half h: low 8h + m/4, high 8h + 4 + m/4.
    const __m512i iA[2] = {lanes(0, 1, 2, 3), lanes(8, 9, 10, 11)}, iB[2] = {lanes(4, 5, 6, 7), lanes(12, 13, 14, 15)};
    const uint8_t* blk = w + b * kBytes;
    const __m512 S = _mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)))),
        _mm512_set1_ps(half_to_f32(blk + 208)));
    __m512 St[NT];
    for (int t = 0; t < NT; ++t) St[t] = _mm512_mul_ps(S, _mm512_loadu_ps(a[t].aux + b * 16));
    for (int h = 0; h < 2; ++h) {
      const __m512i ql = _mm512_loadu_si512(blk + 64 * h);
      const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h)));
      const __m512i lo = _mm512_ternarylogic_epi32(ql, m4, _mm512_and_si512(_mm512_sllv_epi16(qh, shl), m30), 0xEA);
      const __m512i hi = _mm512_ternarylogic_epi32(_mm512_srli_epi16(ql, 4), m4,
                                                   _mm512_and_si512(_mm512_srlv_epi16(qh, shr), m30), 0xEA);
      for (int t = 0; t < NT; ++t) {
        const int64_t v = b * 256 + 128 * h;
        const int8_t* x = a[t].q + v;
        const int32_t* corr = a[t].corr + v / 4;
        const __m512i dA = _mm512_dpbusd_epi32(_mm512_loadu_si512(corr), lo, _mm512_loadu_si512(x));
        const __m512i dB = _mm512_dpbusd_epi32(_mm512_loadu_si512(corr + 16), hi, _mm512_loadu_si512(x + 64));
        acc0[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dA), _mm512_permutexvar_ps(iA[h], St[t]), acc0[t]);
        acc1[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dB), _mm512_permutexvar_ps(iB[h], St[t]), acc1[t]);
      }
    }
  }
};

// ---- Q8_0: steps of two 32-value blocks -----------------------------------------------

struct Q80 {
  static constexpr int64_t kBytes = 34;
  static int64_t steps(int64_t n) { return (n / 32 + 1) / 2; }

  template <int NT>
  static inline void step(const uint8_t* w, int64_t s, const QActView* a, __m512* acc0, __m512*) {
    const int64_t j = 2 * s;
    const uint8_t* p = w + j * kBytes;
    const __m256i qa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2));
    const __m256i qb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + kBytes + 2));
    // int8 weights + 128 as u8 (the dot starts at -128 * lane sums)
    const __m512i u = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(qa), qb, 1),
                                       _mm512_set1_epi8(int8_t(0x80)));
    const __m512 sd = _mm512_insertf32x8(_mm512_set1_ps(half_to_f32(p)), _mm256_set1_ps(half_to_f32(p + kBytes)), 1);
    for (int t = 0; t < NT; ++t) {
      const __m512i d = _mm512_dpbusd_epi32(_mm512_loadu_si512(a[t].corr + 8 * j), u, _mm512_loadu_si512(a[t].q + 32 * j));
      acc0[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(sd, _mm512_loadu_ps(a[t].aux + 8 * j)), acc0[t]);
    }
  }

  // The last step of a row of an odd number of blocks: its second block absent (q = 0 - 128
  // against x = 0 sums to zero, and its scale is 0); never reads past the row.
  template <int NT>
  static inline void last_odd(const uint8_t* w, int64_t s, const QActView* a, __m512* acc0) {
    const int64_t j = 2 * s;
    const uint8_t* p = w + j * kBytes;
    const __m256i qa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2));
    const __m512i u = _mm512_xor_si512(_mm512_castsi256_si512(qa), _mm512_set1_epi8(int8_t(0x80)));
    const __m512 sd = _mm512_maskz_mov_ps(0x00ff, _mm512_set1_ps(half_to_f32(p)));
    for (int t = 0; t < NT; ++t) {
      const __m512i d = _mm512_dpbusd_epi32(_mm512_loadu_si512(a[t].corr + 8 * j), u, _mm512_loadu_si512(a[t].q + 32 * j));
      acc0[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(sd, _mm512_loadu_ps(a[t].aux + 8 * j)), acc0[t]);
    }
  }
};

// ---- MXFP4: steps of four 32-value blocks ---------------------------------------------

// E8M0 exponent e -> 2^(e - 128), the scale of the doubled e2m1 values (ggml's
// ggml_e8m0_to_fp32_half, denormal for e < 2).
struct E8M0Half {
  float v[256];
  E8M0Half() {
    for (uint32_t e = 0; e < 256; ++e) {
      const uint32_t bits = e < 2 ? 0x00200000u << e : (e - 1) << 23;
      std::memcpy(&v[e], &bits, 4);
    }
  }
};
const E8M0Half kE8M0Half;

struct MXFP4 {
  static constexpr int64_t kBytes = 17;
  static int64_t steps(int64_t n) { return (n / 32 + 3) / 4; }

  template <int NT>
  static inline void dots(__m512i qs, __m128 s4, int64_t g, const QActView* a, __m512* acc0) {
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    // Doubled e2m1 values + 12, by nibble: 0 1 2 3 4 6 8 12, then their negatives.
    const __m512i tbl = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
    const __m512i lo = _mm512_shuffle_epi8(tbl, _mm512_and_si512(qs, m4));
    const __m512i hi = _mm512_shuffle_epi8(tbl, _mm512_and_si512(_mm512_srli_epi16(qs, 4), m4));
    const __m512 sv = _mm512_permutexvar_ps(lanes(0, 1, 2, 3), _mm512_castps128_ps512(s4));
    for (int t = 0; t < NT; ++t) {
      const int8_t* x = a[t].q + 128 * g;
      __m512i d = _mm512_dpbusd_epi32(_mm512_loadu_si512(a[t].corr + 16 * g), lo, _mm512_loadu_si512(x));
      d = _mm512_dpbusd_epi32(d, hi, _mm512_loadu_si512(x + 64));
      acc0[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(sv, _mm512_loadu_ps(a[t].aux + 16 * g)), acc0[t]);
    }
  }

  template <int NT>
  static inline void step(const uint8_t* w, int64_t g, const QActView* a, __m512* acc0, __m512*) {
    const uint8_t* p = w + g * 4 * kBytes;
    __m512i qs = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 1)));
    qs = _mm512_inserti32x4(qs, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kBytes + 1)), 1);
    qs = _mm512_inserti32x4(qs, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * kBytes + 1)), 2);
    qs = _mm512_inserti32x4(qs, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 3 * kBytes + 1)), 3);
    const __m128 s4 = _mm_setr_ps(kE8M0Half.v[p[0]], kE8M0Half.v[p[kBytes]], kE8M0Half.v[p[2 * kBytes]],
                                  kE8M0Half.v[p[3 * kBytes]]);
    dots<NT>(qs, s4, g, a, acc0);
  }

  // The row's last k < 4 blocks; the missing ones are zero and meet zero x.
  template <int NT>
  static inline void last_partial(const uint8_t* w, int64_t g, int64_t k, const QActView* a, __m512* acc0) {
    const uint8_t* p = w + g * 4 * kBytes;
    alignas(64) uint8_t buf[64] = {};
    alignas(16) float s[4] = {0, 0, 0, 0};
    for (int64_t i = 0; i < k; ++i) {
      std::memcpy(buf + 16 * i, p + i * kBytes + 1, 16);
      s[i] = kE8M0Half.v[p[i * kBytes]];
    }
    dots<NT>(_mm512_load_si512(buf), _mm_load_ps(s), g, a, acc0);
  }
};

// ---- the row driver -------------------------------------------------------------------

// The sum of a vector's lanes, in a fixed order.
inline float hsum(__m512 v) {
  const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));
}

// Sums of 4 vectors, one per lane of the result, in a fixed order.
inline __m128 reduce4(__m512 v0, __m512 v1, __m512 v2, __m512 v3) {
  const __m512 a = _mm512_add_ps(_mm512_unpacklo_ps(v0, v1), _mm512_unpackhi_ps(v0, v1));  // v0 v1 v0 v1
  const __m512 b = _mm512_add_ps(_mm512_unpacklo_ps(v2, v3), _mm512_unpackhi_ps(v2, v3));
  const __m512 c = _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xee));  // v0 v1 v2 v3
  const __m256 d = _mm256_add_ps(_mm512_castps512_ps256(c), _mm512_extractf32x8_ps(c, 1));
  return _mm_add_ps(_mm256_castps256_ps128(d), _mm256_extractf128_ps(d, 1));
}

// out[r * NT + t] = row w[r] (n values) . activation a[t], for NR rows and NT activations.
template <class Fmt, int NR, int NT>
void dot_rows(const uint8_t* const* w, int64_t n, const QActView* a, Prefetch pf, float* out) {
  __m512 acc0[NR][NT], acc1[NR][NT];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) acc0[r][t] = acc1[r][t] = _mm512_setzero_ps();
  const int64_t steps = Fmt::steps(n);
  int64_t full = steps;
  if constexpr (std::is_same_v<Fmt, Q80>) full = n / 64;
  if constexpr (std::is_same_v<Fmt, MXFP4>) full = n / 128;
  for (int64_t s = 0; s < full; ++s) {
    pf.upto(s, steps);
    for (int r = 0; r < NR; ++r) Fmt::template step<NT>(w[r], s, a, acc0[r], acc1[r]);
  }
  if (full < steps) {
    pf.upto(full, steps);
    for (int r = 0; r < NR; ++r) {
      if constexpr (std::is_same_v<Fmt, Q80>) Fmt::template last_odd<NT>(w[r], full, a, acc0[r]);
      if constexpr (std::is_same_v<Fmt, MXFP4>) Fmt::template last_partial<NT>(w[r], full, n / 32 - 4 * full, a, acc0[r]);
    }
  }
  if constexpr (NR == 4 && NT == 1) {
    _mm_storeu_ps(out, reduce4(_mm512_add_ps(acc0[0][0], acc1[0][0]), _mm512_add_ps(acc0[1][0], acc1[1][0]),
                               _mm512_add_ps(acc0[2][0], acc1[2][0]), _mm512_add_ps(acc0[3][0], acc1[3][0])));
  } else {
    for (int r = 0; r < NR; ++r)
      for (int t = 0; t < NT; ++t) out[r * NT + t] = hsum(_mm512_add_ps(acc0[r][t], acc1[r][t]));
  }
}

template <class Fmt>
void dot_rows_n(const uint8_t* const* w, int nr, int64_t n, const QActView* a, int nt, Prefetch pf, float* out) {
  if (nt == 1 && nr == 4) return dot_rows<Fmt, 4, 1>(w, n, a, pf, out);
  if (nt == 2 && nr == 2) return dot_rows<Fmt, 2, 2>(w, n, a, pf, out);
  for (int r = 0; r < nr; ++r, pf = Prefetch{}) {  // one row at a time (prefetch on the first)
    float* o = out + r * nt;
    switch (nt) {
      case 1: dot_rows<Fmt, 1, 1>(w + r, n, a, pf, o); break;
      case 2: dot_rows<Fmt, 1, 2>(w + r, n, a, pf, o); break;
      case 3: dot_rows<Fmt, 1, 3>(w + r, n, a, pf, o); break;
      default: dot_rows<Fmt, 1, 4>(w + r, n, a, pf, o); break;
    }
  }
}

// out[r * nt + t] = row w[r] (n values of format qt) . activation a[t]; nr <= kQRows,
// nt <= kQTok, and nr * nt <= kQRows.
void qdot(QType qt, const uint8_t* const* w, int nr, int64_t n, const QActView* a, int nt, Prefetch pf, float* out) {
  switch (qt) {
    case QType::kQ4_K: dot_rows_n<K4<false>>(w, nr, n, a, nt, pf, out); break;
    case QType::kQ5_K: dot_rows_n<K4<true>>(w, nr, n, a, nt, pf, out); break;
    case QType::kQ6_K: dot_rows_n<Q6K>(w, nr, n, a, nt, pf, out); break;
    case QType::kQ8_0: dot_rows_n<Q80>(w, nr, n, a, nt, pf, out); break;
    case QType::kMXFP4: dot_rows_n<MXFP4>(w, nr, n, a, nt, pf, out); break;
    default: break;
  }
}

// Rows per call for nt activations (kQRows in all).
inline int rows_for(int nt) { return nt == 1 ? kQRows : nt == 2 ? kQRows / 2 : 1; }

// ---- activations --------------------------------------------------------------------

// Blocks with a smaller amax count as zeros (127 / amax must not overflow).
constexpr float kMinAmax = 0x1p-96f;

// 32 fp32 values -> q[32] (natural order), the sum of q; returns the scale d.
inline float quantize32(const float* v, int8_t* q, int32_t* qsum) {
  const __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const __m512 id = _mm512_set1_ps(amax >= kMinAmax ? 127.0f / amax : 0.0f);
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512i lim = _mm512_set1_epi32(127), nlim = _mm512_set1_epi32(-127);
  const __m512i qa = _mm512_max_epi32(nlim, _mm512_min_epi32(lim, _mm512_cvt_roundps_epi32(_mm512_mul_ps(a, id), kRound)));
  const __m512i qb = _mm512_max_epi32(nlim, _mm512_min_epi32(lim, _mm512_cvt_roundps_epi32(_mm512_mul_ps(b, id), kRound)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qb));
  *qsum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
  return amax >= kMinAmax ? amax / 127.0f : 0.0f;
}

// Writes 32-block j of a vector (q natural, scale d, sum of q) into its record for qt.
void put_block(QType qt, const int8_t* q, float d, int32_t qsum, int64_t j, const QActView& v) {
  int32_t lane[8];  // sums of q[4i .. 4i+3]
  for (int i = 0; i < 8; ++i) lane[i] = q[4 * i] + q[4 * i + 1] + q[4 * i + 2] + q[4 * i + 3];
  switch (qt) {
    case QType::kQ4_K:
    case QType::kQ5_K: {
      const int64_t b = j / 8, jj = j % 8;
      static constexpr int kSlot[4] = {0, 2, 1, 3};
      std::memcpy(v.q + b * 256 + (jj / 4) * 128 + kSlot[jj % 4] * 32, q, 32);
      v.aux[b * 16 + jj] = d;
      v.aux[b * 16 + 8 + jj] = d * float(qsum);
      break;
    }
    case QType::kQ6_K:
      std::memcpy(v.q + 32 * j, q, 32);
      v.aux[(j / 8) * 16 + 2 * (j % 8)] = v.aux[(j / 8) * 16 + 2 * (j % 8) + 1] = d;
      for (int i = 0; i < 8; ++i) v.corr[8 * j + i] = -32 * lane[i];
      break;
    case QType::kQ8_0:
      std::memcpy(v.q + 32 * j, q, 32);
      for (int i = 0; i < 8; ++i) {
        v.aux[8 * j + i] = d;
        v.corr[8 * j + i] = -128 * lane[i];
      }
      break;
    case QType::kMXFP4: {
      const int64_t g = j / 4, k = j % 4;
      std::memcpy(v.q + 128 * g + 16 * k, q, 16);
      std::memcpy(v.q + 128 * g + 64 + 16 * k, q + 16, 16);
      for (int i = 0; i < 4; ++i) {
        v.aux[16 * g + 4 * k + i] = d;
        v.corr[16 * g + 4 * k + i] = -12 * (lane[i] + lane[4 + i]);
      }
      break;
    }
    default: break;
  }
}

// Zero blocks after the last one up to the end of the kernels' last step (Q8_0: pairs,
// MXFP4: fours), so that a partial step adds nothing.
void put_padding(QType qt, int64_t n, const QActView& v) {
  const int64_t step = qt == QType::kQ8_0 ? 2 : qt == QType::kMXFP4 ? 4 : 1;
  const int8_t zeros[32] = {};
  for (int64_t j = n / 32; j % step; ++j) put_block(qt, zeros, 0.0f, 0, j, v);
}

// Quantizes 32-chunk j of h for route position q (fp32 h, already rounded to bf16).
void put_h_chunk(const Plan& p, int64_t q, int64_t j, const float* h32) {
  int8_t qv[32];
  int32_t qsum;
  const float d = quantize32(h32, qv, &qsum);
  const QActView v = qact_view(p.hact, p.hl, q);
  put_block(p.a.qt2, qv, d, qsum, j, v);
  if ((j + 1) * 32 == p.a.F) put_padding(p.a.qt2, p.a.F, v);
}

}  // namespace

void quantize_activations(const float* v, int64_t n, int8_t* q, float* d) {
  for (int64_t j = 0; j < n / 32; ++j) {
    int32_t qsum;
    d[j] = quantize32(v + 32 * j, q + 32 * j, &qsum);
  }
}

void quant_prepare_x(const Plan& p, int64_t t) {
  const ColdArgs& a = p.a;
  const QActView v = qact_view(p.xact, p.xl, t);
  alignas(64) float buf[32];
  int8_t qv[32];
  for (int64_t j = 0; j < a.D / 32; ++j) {
    if (a.x_dtype == DType::kBFloat16) {
      const uint16_t* x = static_cast<const uint16_t*>(a.x) + t * a.x_stride + 32 * j;
      for (int h = 0; h < 2; ++h)
        _mm512_store_ps(buf + 16 * h, bf16x16_to_f32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16 * h))));
    } else {
      std::memcpy(buf, static_cast<const float*>(a.x) + t * a.x_stride + 32 * j, sizeof(buf));
    }
    int32_t qsum;
    const float d = quantize32(buf, qv, &qsum);
    put_block(a.qt13, qv, d, qsum, j, v);
  }
  put_padding(a.qt13, a.D, v);
}

void quant_gate_up(const Plan& p, int32_t s, int64_t f0, int64_t f1) {
  const ColdArgs& a = p.a;
  const int64_t rb = p.rb13;
  const uint8_t* w13 = static_cast<const uint8_t*>(a.w13) + int64_t(p.exp_id[s]) * 2 * a.F * rb;
  const int32_t q0 = p.start[s], q1 = p.start[s + 1];
  for (int32_t q = q0; q < q1; q += kQTok) {
    const int nt = std::min(kQTok, q1 - q);
    QActView acts[kQTok];
    for (int j = 0; j < nt; ++j) acts[j] = qact_view(p.xact, p.xl, p.route_token(q + j));
    const bool pf = a.prefetch && q == q0;  // later passes find the rows in L2
    const int64_t ahead = a.prefetch_bytes / 2;  // two streams: gate and up rows
    prefetch_head(w13 + f0 * rb, w13 + f1 * rb, ahead, pf);
    prefetch_head(w13 + (a.F + f0) * rb, w13 + (a.F + f1) * rb, ahead, pf);
    for (int64_t f = f0; f < f1;) {
      const int nr = int(std::min<int64_t>(rows_for(nt), f1 - f));
      const uint8_t* gate[kQRows];
      const uint8_t* up[kQRows];
      for (int r = 0; r < nr; ++r) {
        gate[r] = w13 + (f + r) * rb;
        up[r] = w13 + (a.F + f + r) * rb;
      }
      float rg[kQRows * kQTok], ru[kQRows * kQTok];
      qdot(a.qt13, gate, nr, a.D, acts, nt, window(gate[0], nr, rb, w13 + f1 * rb, ahead, pf), rg);
      qdot(a.qt13, up, nr, a.D, acts, nt, window(up[0], nr, rb, w13 + (a.F + f1) * rb, ahead, pf), ru);
      for (int r = 0; r < nr; ++r)
        for (int j = 0; j < nt; ++j) {
          p.h[int64_t(q + j) * p.F32 + f + r] = rg[r * nt + j];
          p.u[int64_t(q + j) * p.F32 + f + r] = ru[r * nt + j];
        }
      f += nr;
    }
  }
  // h = bf16(act(gate + bg, up + bu)), as the bf16 kernels round it, then quantized for w2.
  const float* bg = a.b13 ? a.b13 + int64_t(p.exp_id[s]) * 2 * a.F : nullptr;
  alignas(64) float h32[32];
  for (int32_t q = q0; q < q1; ++q)
    for (int64_t c = f0; c < f1; c += 32) {
      const float* g = p.h + int64_t(q) * p.F32 + c;
      const float* u = p.u + int64_t(q) * p.F32 + c;
      for (int i = 0; i < 2; ++i) {
        __m512 gv = _mm512_loadu_ps(g + 16 * i), uv = _mm512_loadu_ps(u + 16 * i);
        if (bg) {
          gv = _mm512_add_ps(gv, _mm512_loadu_ps(bg + c + 16 * i));
          uv = _mm512_add_ps(uv, _mm512_loadu_ps(bg + a.F + c + 16 * i));
        }
        _mm512_store_ps(h32 + 16 * i, round_bf16_512(act512(gv, uv, a)));
      }
      put_h_chunk(p, q, c / 32, h32);
    }
}

void quant_down(const Plan& p, int32_t s, int64_t d0, int64_t d1) {
  const ColdArgs& a = p.a;
  const int64_t rb = p.rb2;
  const uint8_t* w2 = static_cast<const uint8_t*>(a.w2) + int64_t(p.exp_id[s]) * a.D * rb;
  const int32_t q0 = p.start[s], q1 = p.start[s + 1];
  const float* b2 = a.b2 ? a.b2 + int64_t(p.exp_id[s]) * a.D : nullptr;  // y = w2 . h + b2
  for (int32_t q = q0; q < q1; q += kQTok) {
    const int nt = std::min(kQTok, q1 - q);
    QActView acts[kQTok];
    for (int j = 0; j < nt; ++j) acts[j] = qact_view(p.hact, p.hl, q + j);
    prefetch_head(w2 + d0 * rb, w2 + d1 * rb, a.prefetch_bytes, a.prefetch && q == q0);
    for (int64_t d = d0; d < d1;) {
      const int nr = int(std::min<int64_t>(rows_for(nt), d1 - d));
      const uint8_t* rows[kQRows];
      for (int r = 0; r < nr; ++r) rows[r] = w2 + (d + r) * rb;
      float res[kQRows * kQTok];
      qdot(a.qt2, rows, nr, a.F, acts, nt, window(rows[0], nr, rb, w2 + d1 * rb, a.prefetch_bytes, a.prefetch && q == q0), res);
      for (int r = 0; r < nr; ++r)
        for (int j = 0; j < nt; ++j) {
          const float v = b2 ? res[r * nt + j] + b2[d + r] : res[r * nt + j];
          if (p.scatter) {
            p.y[int64_t(q + j) * a.D + d + r] = v;
          } else {
            float* o = a.out + int64_t(p.route_token(q + j)) * a.out_stride + d + r;
            *o = std::fma(p.route_weight(q + j), v, *o);
          }
        }
      d += nr;
    }
  }
}

double read_sum(const void* data, int64_t bytes) {
  const char* c = static_cast<const char*>(data);
  __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  int64_t i = 0;
  for (; i + 256 <= bytes; i += 256) {
    s0 = _mm512_add_ps(s0, _mm512_loadu_ps(c + i));
    s1 = _mm512_add_ps(s1, _mm512_loadu_ps(c + i + 64));
    s2 = _mm512_add_ps(s2, _mm512_loadu_ps(c + i + 128));
    s3 = _mm512_add_ps(s3, _mm512_loadu_ps(c + i + 192));
  }
  double r = hsum(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
  for (; i < bytes; ++i) r += c[i];
  return r;
}

}  // namespace ostinato

#pragma GCC diagnostic pop
#pragma GCC pop_options
