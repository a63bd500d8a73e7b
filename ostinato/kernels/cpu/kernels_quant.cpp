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
// A kernel call takes kQRows rows for one activation (decode; independent chains, scale bytes
// decoded together, one horizontal sum for all) or fewer rows for up to kQTok activations (the
// routes of one expert), so the weight bytes are decoded once per kQTok routes. A task walks
// its rows as kQRows ascending streams (Streams below) for the hardware prefetcher, and keeps
// each stream's next bytes in flight by software prefetch (prefetch_rows below).
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
constexpr int kQRows = int(kQRowsUnit);  // rows per kernel call for one activation (2 for two)

inline float half_to_f32(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// The rows [r0, r0 + n) of a task as nr interleaved streams of consecutive rows (the first
// n % nr streams one row longer): kernel call i reads row i of each stream.
//
// Why streams: a call reads its rows block by block side by side, and rows that are neighbours
// in memory make one 4 KiB page see addresses that jump back and forth, so the hardware's
// stream prefetcher (one forward stream per page) never locks on. Rows from nr distant parts
// of the range make nr ascending streams, which it follows. Software prefetch into L2 of every
// line in row order could not make up for it: on the 2-core Xeon host, one core from DRAM,
// gate/up read 11.7 GB/s with it in row order, 13.7 with streams and no prefetch instructions,
// 11.9 with both, against a 15.5 GB/s read probe. (The prefetch below follows the streams.)
struct Streams {
  Streams(int64_t r0, int64_t n, int nr) : r0(r0), len(n / nr), extra(n % nr), nr(nr) {}
  int64_t calls() const { return len + (extra > 0); }
  int64_t start(int k) const { return r0 + k * len + std::min<int64_t>(k, extra); }
  // The rows of call i, in stream order; returns how many (nr, or fewer in the last call).
  int rows(int64_t i, int64_t* out) const {
    int c = 0;
    for (int k = 0; k < nr; ++k)
      if (i < len + (k < extra)) out[c++] = start(k) + i;
    return c;
  }
  int64_t r0, len, extra;  // first row, rows of a stream, streams one row longer
  int nr;
};

// Software prefetch (ColdArgs::prefetch; `ahead` = ColdArgs::prefetch_bytes), of two kinds.
//
// Lines, for memory-level parallelism: each step of a kernel call first prefetches, for each of
// its rows, the lines that the same step reads `ahead` bytes further on (prefetch_rows, called by
// dot_rows); past a row's end these are the next rows of its stream, which the task's next calls
// read. Why: a step's weight loads are followed by a dozen or more dependent vector instructions
// per 64 bytes (decoding, dots, scales); while those wait for a line from memory they fill the
// out-of-order scheduler, and the loads of the next steps wait to be issued, so a core keeps few
// lines in flight, where the read probe's plain sum (one add per 64 bytes) keeps all of its fill
// buffers busy. A prefetch has nothing waiting on it: issued `ahead` bytes early in every
// stream, the lines keep coming while the arithmetic waits. (Without them, on the 16-core Xeon
// host, the kernels' share of the read probe was the same at any worker count: a limit of each
// core, not of the memory.) Into L1: Intel's prefetch instructions all hold a fill buffer until
// the line arrives, so L1 costs no more parallelism than L2 and saves the loads the trip to L2.
//
// Pages, for the hardware prefetcher: it follows an ascending stream within a 4 KiB page, but
// must see two accesses in a page before it fetches ahead there. So a stream's first two lines
// are touched at a task's start, and, at each call whose row's bytes `ahead` further on reach
// into the next page, that page's first two lines: a call earlier than the line prefetches get
// there (measured on the 2-core Xeon host, one core from DRAM, 96-row gate/up and 256-row down
// tasks, before the line prefetches: 92% of the read probe without the page hints, 99% with them
// 1 KiB ahead, 94% 4 KiB ahead, and no gain from one line instead of two; with the line
// prefetches and no page hints, layers in L3 were read slower).
inline void touch2(const uint8_t* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1);
  _mm_prefetch(reinterpret_cast<const char*>(p) + 64, _MM_HINT_T1);
}

inline void next_page_hint(const uint8_t* row, int64_t rb, int64_t ahead) {
  const uintptr_t lo = reinterpret_cast<uintptr_t>(row) + uintptr_t(ahead);
  const uintptr_t page = (lo + 4095) & ~uintptr_t(4095);
  if (page < lo + uintptr_t(rb)) touch2(reinterpret_cast<const uint8_t*>(page));
}

// The bytes [off, off + len) of each of NR rows (len > 0) into L1, a line at a time. Successive
// calls over successive ranges cover every line: no two prefetches lie more than 64 bytes apart.
template <int NR>
inline void prefetch_rows(const uint8_t* const* w, int64_t off, int64_t len) {
  for (int r = 0; r < NR; ++r)
    for (int64_t o = 0; o < len; o += 64) _mm_prefetch(reinterpret_cast<const char*>(w[r] + off + o), _MM_HINT_T0);
}

// 16 int32 lanes: lanes 4i..4i+3 hold a, b, c, d for i = 0..3 (permutation constants).
inline __m512i lanes(int a, int b, int c, int d) {
  return _mm512_setr_epi32(a, a, a, a, b, b, b, b, c, c, c, c, d, d, d, d);
}

inline __m128i load128(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline __m256i load256(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// The 128-bit lane R of v (R a compile-time constant, as VEXTRACTI32X4 needs).
template <int R>
inline __m128i lane128(__m512i v) {
  if constexpr (R == 0) return _mm512_castsi512_si128(v);
  else return _mm512_extracti32x4_epi32(v, R);
}

// NR 16-byte pieces, piece r from p[r], in the 128-bit lanes 0..NR-1 (NR <= 4).
template <int NR>
inline __m512i gather128(const uint8_t* const* p) {
  __m512i v = _mm512_castsi128_si512(load128(p[0]));
  if constexpr (NR > 1) v = _mm512_inserti32x4(v, load128(p[1]), 1);
  if constexpr (NR > 2) v = _mm512_inserti32x4(v, load128(p[2]), 2);
  if constexpr (NR > 3) v = _mm512_inserti32x4(v, load128(p[3]), 3);
  return v;
}

// A format's row kernel is a sequence of steps (a block, or a group of small blocks: kStepBytes
// of a row); step s adds the partial dot products of NR rows with NT activations into two
// accumulators per (row, activation), acc0 and acc1; a row's dot is the sum of the lanes of
// acc0 + kAcc1Scale * acc1. The rows of one step share what they can: activation loads, and
// for Q4_K / Q5_K the decoding of their scale bytes (one 512-bit pass for four rows).
//
// Why the steps look as they do: with 512-bit instructions in flight, vector work issues on two
// ports (on the Xeon host VPDPBUSD, VCVTDQ2PS, FMA and logic run two a cycle, VPERMPS, VPSHUFB
// and VPMOVZX one), and in cache these kernels keep both busy, so a step's vector instruction
// count per weight byte sets their speed, and the lower it is the more of a core's time is
// left over for memory to deliver the next rows.

// ---- Q4_K and Q5_K: steps of one 256-value block -------------------------------------

// V[r] = [d * sc_j for j < 8, dmin * m_j for j < 8] of the block at blk[r] (its first 16 bytes),
// for NR rows at once: the 6-bit unpacking runs once on the four headers in one register.
template <int NR>
inline void k4_scales(const uint8_t* const* blk, __m512* V) {
  const __m512i h = gather128<NR>(blk);
  // s[k] = h[4 + k]. sc0-3 = s0-3 & 63; sc4-7 = (s8-11 & 15) | (s0-3 >> 6) << 4;
  // m0-3 = s4-7 & 63; m4-7 = (s8-11 >> 4) | (s4-7 >> 6) << 4.
  const __m512i A = _mm512_shuffle_epi8(
      h, _mm512_broadcast_i32x4(_mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15)));
  const __m512i B = _mm512_shuffle_epi8(
      h, _mm512_broadcast_i32x4(_mm_setr_epi8(-1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1, 8, 9, 10, 11)));
  const __m512i m1 = _mm512_broadcast_i32x4(_mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0));
  const __m512i m2 = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15));
  const __m512i m3 = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 0, 0, 0, 48, 48, 48, 48, 0, 0, 0, 0, 48, 48, 48, 48));
  __m512i sm = _mm512_ternarylogic_epi32(_mm512_and_si512(A, m1), _mm512_srli_epi16(A, 4), m2, 0xF8);  // a | (b & c)
  sm = _mm512_ternarylogic_epi32(sm, _mm512_srli_epi16(B, 2), m3, 0xF8);
  // (d, dmin) of the rows: words 0 and 1 of each lane -> fp32 [d0 dmin0 d1 dmin1 ...]
  const __m512i pick = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 25,
                                        24, 17, 16, 9, 8, 1, 0);
  const __m512 dd = _mm512_castps256_ps512(_mm256_cvtph_ps(_mm512_castsi512_si128(_mm512_permutexvar_epi16(pick, h))));
  const auto row = [&](auto r) {
    constexpr int R = decltype(r)::value;
    const __m512 d = _mm512_permutexvar_ps(_mm512_setr_epi32(2 * R, 2 * R, 2 * R, 2 * R, 2 * R, 2 * R, 2 * R, 2 * R,
                                                             2 * R + 1, 2 * R + 1, 2 * R + 1, 2 * R + 1, 2 * R + 1,
                                                             2 * R + 1, 2 * R + 1, 2 * R + 1), dd);
    V[R] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lane128<R>(sm))), d);
  };
  row(std::integral_constant<int, 0>{});
  if constexpr (NR > 1) row(std::integral_constant<int, 1>{});
  if constexpr (NR > 2) row(std::integral_constant<int, 2>{});
  if constexpr (NR > 3) row(std::integral_constant<int, 3>{});
}

template <bool Q5>
struct K4 {
  static constexpr int64_t kBytes = Q5 ? 176 : 144;
  static constexpr int64_t kStepBytes = kBytes;
  // Q4_K's high nibbles enter the dots as 16 * q, masked in place instead of shifted down (one
  // instruction fewer per 64 bytes): acc1 then holds 16 times its terms (the mins too), and a
  // row scales it back once. Powers of two scale every rounding alike, so the bits are those
  // of the unscaled sums.
  static constexpr float kAcc1Scale = Q5 ? 1.0f : 1.0f / 16;
  static int64_t steps(int64_t n) { return n / 256; }

  template <int NR, int NT>
  static inline void step(const uint8_t* const* w, int64_t b, const QActView* a, __m512 (&acc0)[NR][NT],
                          __m512 (&acc1)[NR][NT]) {
    const __m512i m4 = _mm512_set1_epi8(0x0f), m10 = _mm512_set1_epi8(0x10);
    // Sub-blocks of the dot lanes: group c, low nibbles (4c, 4c+2), high (4c+1, 4c+3).
    const __m512i iA[2] = {lanes(0, 0, 2, 2), lanes(4, 4, 6, 6)}, iB[2] = {lanes(1, 1, 3, 3), lanes(5, 5, 7, 7)};
    const uint8_t* blk[NR];
    for (int r = 0; r < NR; ++r) blk[r] = w[r] + b * kBytes;
    __m512 V[NR];
    k4_scales<NR>(blk, V);
    __m512 St[NR][NT];
    for (int t = 0; t < NT; ++t) {  // x [dx_j | sum_j]: this block's scales, and its mins (upper half)
      const __m512 xs = _mm512_loadu_ps(a[t].aux + b * 16);
      for (int r = 0; r < NR; ++r) {
        St[r][t] = _mm512_mul_ps(V[r], xs);
        acc1[r][t] = _mm512_mask3_fnmadd_ps(St[r][t], _mm512_set1_ps(1.0f / kAcc1Scale), acc1[r][t], 0xff00);
      }
    }
    for (int c = 0; c < 2; ++c) {
      for (int r = 0; r < NR; ++r) {  // (the compiler loads each x once for all rows)
        const uint8_t* qs = blk[r] + (Q5 ? 48 : 16);
        const __m512i q = _mm512_loadu_si512(qs + 64 * c);
        __m512i lo = _mm512_and_si512(q, m4), hi;
        if constexpr (Q5) {  // qh bit j of byte l is bit 4 of value l of sub-block j: shift it to bit 4
                             // per 16-bit word (bytes 0-31 | 32-63: sub-blocks 4c | 4c+2, then 4c+1 | 4c+3)
          const __m512i qh = _mm512_broadcast_i64x4(load256(blk[r] + 16));
          const __mmask32 up = 0xffff0000u;
          const auto cnt = [up](int x, int y) {
            return _mm512_mask_blend_epi16(up, _mm512_set1_epi16(x), _mm512_set1_epi16(y));
          };
          const __m512i bl = c == 0 ? _mm512_sllv_epi16(qh, cnt(4, 2)) : _mm512_srlv_epi16(qh, cnt(0, 2));
          const __m512i bh = c == 0 ? _mm512_sllv_epi16(qh, cnt(3, 1)) : _mm512_srlv_epi16(qh, cnt(1, 3));
          hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
          lo = _mm512_ternarylogic_epi32(lo, bl, m10, 0xF8);  // lo | (bl & 0x10)
          hi = _mm512_ternarylogic_epi32(hi, bh, m10, 0xF8);
        } else {
          hi = _mm512_andnot_si512(m4, q);  // 16 * high nibble
        }
        for (int t = 0; t < NT; ++t) {
          const int8_t* x = a[t].q + b * 256 + 128 * c;
          const __m512i dA = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(x));
          const __m512i dB = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi, _mm512_loadu_si512(x + 64));
          acc0[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dA), _mm512_permutexvar_ps(iA[c], St[r][t]), acc0[r][t]);
          acc1[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dB), _mm512_permutexvar_ps(iB[c], St[r][t]), acc1[r][t]);
        }
      }
    }
  }
};


// ---- Q6_K: steps of one 256-value block ----------------------------------------------

struct Q6K {
  static constexpr int64_t kBytes = 210;
  static constexpr int64_t kStepBytes = kBytes;
  static constexpr float kAcc1Scale = 1.0f;
  static int64_t steps(int64_t n) { return n / 256; }

  template <int NR, int NT>
  static inline void step(const uint8_t* const* w, int64_t b, const QActView* a, __m512 (&acc0)[NR][NT],
                          __m512 (&acc1)[NR][NT]) {
    const __m512i m4 = _mm512_set1_epi8(0x0f), m30 = _mm512_set1_epi8(0x30);
    const __mmask32 up = 0xffff0000u;
    // qh bits to bits 4-5 (per 16-bit word, bytes 0-31 | 32-63): low nibbles take bits 0-1 |
    // 2-3, high nibbles bits 4-5 | 6-7.
    const __m512i shl = _mm512_mask_blend_epi16(up, _mm512_set1_epi16(4), _mm512_set1_epi16(2));
    const __m512i shr = _mm512_mask_blend_epi16(up, _mm512_set1_epi16(0), _mm512_set1_epi16(2));
    // Sub-blocks of 16 of the dot lanes, half h: low 8h + m/4, high 8h + 4 + m/4.
    const __m512i iA[2] = {lanes(0, 1, 2, 3), lanes(8, 9, 10, 11)}, iB[2] = {lanes(4, 5, 6, 7), lanes(12, 13, 14, 15)};
    const uint8_t* blk[NR];
    __m512 St[NR][NT];
    for (int r = 0; r < NR; ++r) {
      blk[r] = w[r] + b * kBytes;
      const __m512 S = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load128(blk[r] + 192))),
                                     _mm512_set1_ps(half_to_f32(blk[r] + 208)));
      for (int t = 0; t < NT; ++t) St[r][t] = _mm512_mul_ps(S, _mm512_loadu_ps(a[t].aux + b * 16));
    }
    for (int h = 0; h < 2; ++h) {
      const int64_t v = b * 256 + 128 * h;
      for (int r = 0; r < NR; ++r) {  // (the compiler loads each x once for all rows)
        const __m512i ql = _mm512_loadu_si512(blk[r] + 64 * h);
        const __m512i qh = _mm512_broadcast_i64x4(load256(blk[r] + 128 + 32 * h));
        const __m512i lo = _mm512_ternarylogic_epi32(ql, m4, _mm512_and_si512(_mm512_sllv_epi16(qh, shl), m30), 0xEA);
        const __m512i hi = _mm512_ternarylogic_epi32(_mm512_srli_epi16(ql, 4), m4,
                                                     _mm512_and_si512(_mm512_srlv_epi16(qh, shr), m30), 0xEA);
        for (int t = 0; t < NT; ++t) {
          const int8_t* x = a[t].q + v;
          const int32_t* corr = a[t].corr + v / 4;
          const __m512i dA = _mm512_dpbusd_epi32(_mm512_loadu_si512(corr), lo, _mm512_loadu_si512(x));
          const __m512i dB = _mm512_dpbusd_epi32(_mm512_loadu_si512(corr + 16), hi, _mm512_loadu_si512(x + 64));
          acc0[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dA), _mm512_permutexvar_ps(iA[h], St[r][t]), acc0[r][t]);
          acc1[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dB), _mm512_permutexvar_ps(iB[h], St[r][t]), acc1[r][t]);
        }
      }
    }
  }
};

// ---- Q8_0: steps of two 32-value blocks -----------------------------------------------

struct Q80 {
  static constexpr int64_t kBytes = 34;
  static constexpr float kAcc1Scale = 1.0f;
  static constexpr int64_t kStepBlocks = 2;
  static constexpr int64_t kStepBytes = kStepBlocks * kBytes;
  static int64_t steps(int64_t n) { return (n / 32 + 1) / 2; }

  // int8 weights + 128 as u8 (the dot starts at -128 * lane sums), and [d0 x8 | d1 x8]: the
  // two scales from one 64-byte load (words 0 and 17) and one conversion.
  template <int NT>
  static inline void dots(__m512i u, __m512 sd, int64_t j, const QActView* a, __m512 (&acc0)[NT]) {
    for (int t = 0; t < NT; ++t) {
      const __m512i d = _mm512_dpbusd_epi32(_mm512_loadu_si512(a[t].corr + 8 * j), u, _mm512_loadu_si512(a[t].q + 32 * j));
      acc0[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(sd, _mm512_loadu_ps(a[t].aux + 8 * j)), acc0[t]);
    }
  }

  template <int NR, int NT>
  static inline void step(const uint8_t* const* w, int64_t s, const QActView* a, __m512 (&acc0)[NR][NT],
                          __m512 (&acc1)[NR][NT]) {
    const int64_t j = 2 * s;
    const __m512i pick = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 17, 17, 17, 17, 17, 17, 17,
                                          17, 0, 0, 0, 0, 0, 0, 0, 0);
    for (int r = 0; r < NR; ++r) {
      const uint8_t* p = w[r] + j * kBytes;
      const __m512i head = _mm512_loadu_si512(p);  // d0, qs0, d1 (+ part of qs1)
      const __m512 sd = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi16(pick, head)));
      const __m512i qs = _mm512_inserti64x4(_mm512_castsi256_si512(load256(p + 2)), load256(p + kBytes + 2), 1);
      const __m512i u = _mm512_xor_si512(qs, _mm512_set1_epi8(int8_t(0x80)));
      dots<NT>(u, sd, j, a, acc0[r]);
    }
  }

  // The last step of a row of an odd number of blocks (k = 1): its second block absent (q =
  // 0 - 128 against x = 0 sums to zero, and its scale is 0); never reads past the row.
  template <int NT>
  static inline void last(const uint8_t* w, int64_t s, int64_t, const QActView* a, __m512 (&acc0)[NT]) {
    const int64_t j = 2 * s;
    const uint8_t* p = w + j * kBytes;
    const __m512i u = _mm512_xor_si512(_mm512_castsi256_si512(load256(p + 2)), _mm512_set1_epi8(int8_t(0x80)));
    dots<NT>(u, _mm512_maskz_mov_ps(0x00ff, _mm512_set1_ps(half_to_f32(p))), j, a, acc0);
  }
};

// ---- MXFP4: steps of four 32-value blocks ---------------------------------------------

struct MXFP4 {
  static constexpr int64_t kBytes = 17;
  static constexpr float kAcc1Scale = 1.0f;
  static constexpr int64_t kStepBlocks = 4;
  static constexpr int64_t kStepBytes = kStepBlocks * kBytes;
  static int64_t steps(int64_t n) { return (n / 32 + 3) / 4; }

  // The four blocks at p (68 bytes): qs of block i in 128-bit lane i, and, per lane, the
  // exponent of its block minus 128 as fp32 (the block scale is 2^(e - 128), ggml's
  // ggml_e8m0_to_fp32_half; VSCALEFPS applies it exactly, denormal for e < 2 too). The
  // exponents sit at bytes 0, 17, 34, 51 = byte i of lane i of the first 64 bytes.
  static inline void load(const uint8_t* p, __m512i* qs, __m512* e) {
    const __m512i head = _mm512_loadu_si512(p);
    const __m512i ei = _mm512_shuffle_epi8(head, _mm512_setr_epi32(-256, -256, -256, -256, -255, -255, -255, -255, -254,
                                                                    -254, -254, -254, -253, -253, -253, -253));
    *e = _mm512_cvtepi32_ps(_mm512_sub_epi32(ei, _mm512_set1_epi32(128)));
    const uint8_t* const q[4] = {p + 1, p + kBytes + 1, p + 2 * kBytes + 1, p + 3 * kBytes + 1};
    *qs = gather128<4>(q);
  }

  template <int NT>
  static inline void dots(__m512i qs, __m512 e, int64_t g, const QActView* a, __m512 (&acc0)[NT]) {
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    // Doubled e2m1 values + 12, by nibble: 0 1 2 3 4 6 8 12, then their negatives.
    const __m512i tbl = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
    const __m512i lo = _mm512_shuffle_epi8(tbl, _mm512_and_si512(qs, m4));
    const __m512i hi = _mm512_shuffle_epi8(tbl, _mm512_and_si512(_mm512_srli_epi16(qs, 4), m4));
    for (int t = 0; t < NT; ++t) {
      const int8_t* x = a[t].q + 128 * g;
      __m512i d = _mm512_dpbusd_epi32(_mm512_loadu_si512(a[t].corr + 16 * g), lo, _mm512_loadu_si512(x));
      d = _mm512_dpbusd_epi32(d, hi, _mm512_loadu_si512(x + 64));
      acc0[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_scalef_ps(_mm512_loadu_ps(a[t].aux + 16 * g), e), acc0[t]);
    }
  }

  template <int NR, int NT>
  static inline void step(const uint8_t* const* w, int64_t g, const QActView* a, __m512 (&acc0)[NR][NT],
                          __m512 (&acc1)[NR][NT]) {
    for (int r = 0; r < NR; ++r) {
      __m512i qs;
      __m512 e;
      load(w[r] + g * 4 * kBytes, &qs, &e);
      dots<NT>(qs, e, g, a, acc0[r]);
    }
  }

  // The row's last k < 4 blocks, copied after zeros: the missing ones are zero (scale 2^-128)
  // and meet zero x.
  template <int NT>
  static inline void last(const uint8_t* w, int64_t g, int64_t k, const QActView* a, __m512 (&acc0)[NT]) {
    alignas(64) uint8_t buf[4 * kBytes] = {};
    std::memcpy(buf, w + g * 4 * kBytes, size_t(k * kBytes));
    __m512i qs;
    __m512 e;
    load(buf, &qs, &e);
    dots<NT>(qs, e, g, a, acc0);
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

// out[r * NT + t] = row w[r] (n values) . activation a[t], for NR rows and NT activations;
// ahead > 0: each step first prefetches the rows' bytes `ahead` further on (see touch2).
template <class Fmt, int NR, int NT>
void dot_rows(const uint8_t* const* w, int64_t n, const QActView* a, int64_t ahead, float* out) {
  __m512 acc0[NR][NT], acc1[NR][NT];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) acc0[r][t] = acc1[r][t] = _mm512_setzero_ps();
  const int64_t steps = Fmt::steps(n);
  constexpr bool kTail = std::is_same_v<Fmt, Q80> || std::is_same_v<Fmt, MXFP4>;  // steps of several blocks
  int64_t full = steps;
  if constexpr (kTail) full = n / 32 / Fmt::kStepBlocks;
  for (int64_t s = 0; s < full; ++s) {
    if (ahead > 0) prefetch_rows<NR>(w, s * Fmt::kStepBytes + ahead, Fmt::kStepBytes);
    Fmt::template step<NR, NT>(w, s, a, acc0, acc1);
  }
  if constexpr (kTail) {
    if (full < steps) {
      for (int r = 0; r < NR; ++r) Fmt::template last<NT>(w[r], full, n / 32 - Fmt::kStepBlocks * full, a, acc0[r]);
    }
  }
  const __m512 k1 = _mm512_set1_ps(Fmt::kAcc1Scale);  // a power of two: one rounding, as an add's
  const auto sum = [&](int r, int t) { return _mm512_fmadd_ps(acc1[r][t], k1, acc0[r][t]); };
  if constexpr (NR == 4 && NT == 1) {
    _mm_storeu_ps(out, reduce4(sum(0, 0), sum(1, 0), sum(2, 0), sum(3, 0)));
  } else {
    for (int r = 0; r < NR; ++r)
      for (int t = 0; t < NT; ++t) out[r * NT + t] = hsum(sum(r, t));
  }
}

template <class Fmt>
void dot_rows_n(const uint8_t* const* w, int nr, int64_t n, const QActView* a, int nt, int64_t ahead, float* out) {
  if (nt == 1 && nr == 4) return dot_rows<Fmt, 4, 1>(w, n, a, ahead, out);
  if (nt == 2 && nr == 2) return dot_rows<Fmt, 2, 2>(w, n, a, ahead, out);
  for (int r = 0; r < nr; ++r) {  // one row at a time
    float* o = out + r * nt;
    switch (nt) {
      case 1: dot_rows<Fmt, 1, 1>(w + r, n, a, ahead, o); break;
      case 2: dot_rows<Fmt, 1, 2>(w + r, n, a, ahead, o); break;
      case 3: dot_rows<Fmt, 1, 3>(w + r, n, a, ahead, o); break;
      default: dot_rows<Fmt, 1, 4>(w + r, n, a, ahead, o); break;
    }
  }
}

// out[r * nt + t] = row w[r] (n values of format qt) . activation a[t]; nr <= kQRows,
// nt <= kQTok, and nr * nt <= kQRows; ahead: the software prefetch distance (0: none).
void qdot(QType qt, const uint8_t* const* w, int nr, int64_t n, const QActView* a, int nt, int64_t ahead,
          float* out) {
  switch (qt) {
    case QType::kQ4_K: dot_rows_n<K4<false>>(w, nr, n, a, nt, ahead, out); break;
    case QType::kQ5_K: dot_rows_n<K4<true>>(w, nr, n, a, nt, ahead, out); break;
    case QType::kQ6_K: dot_rows_n<Q6K>(w, nr, n, a, nt, ahead, out); break;
    case QType::kQ8_0: dot_rows_n<Q80>(w, nr, n, a, nt, ahead, out); break;
    case QType::kMXFP4: dot_rows_n<MXFP4>(w, nr, n, a, nt, ahead, out); break;
    default: break;
  }
}

// Rows per call for nt activations (kQRows in all).
inline int rows_for(int nt) { return nt == 1 ? kQRows : nt == 2 ? kQRows / 2 : 1; }

// ---- activations --------------------------------------------------------------------

// Blocks with a smaller amax count as zeros (127 / amax must not overflow).
constexpr float kMinAmax = 0x1p-96f;

// A quantized block of 32 values: q (natural order), scale d, and the sums of q[4i .. 4i+3]
// (the dot lanes' sums, from which the records' offset corrections follow).
struct Q32 {
  __m256i q;  // 32 int8
  __m256i lane4;  // 8 int32
  float d;
};

// 32 fp32 values -> their Q32.
inline Q32 quantize32(const float* v) {
  const __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const __m512 id = _mm512_set1_ps(amax >= kMinAmax ? 127.0f / amax : 0.0f);
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512i lim = _mm512_set1_epi32(127), nlim = _mm512_set1_epi32(-127);
  const __m512i qa = _mm512_max_epi32(nlim, _mm512_min_epi32(lim, _mm512_cvt_roundps_epi32(_mm512_mul_ps(a, id), kRound)));
  const __m512i qb = _mm512_max_epi32(nlim, _mm512_min_epi32(lim, _mm512_cvt_roundps_epi32(_mm512_mul_ps(b, id), kRound)));
  Q32 r;
  r.q = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm512_cvtepi32_epi8(qa)), _mm512_cvtepi32_epi8(qb), 1);
  r.lane4 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(1), r.q);
  r.d = amax >= kMinAmax ? amax / 127.0f : 0.0f;
  return r;
}

inline int32_t hsum8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
}

// -k * lanes (exact: |lanes| <= 4 * 127).
inline __m256i times_neg(__m256i lanes, int32_t k) { return _mm256_mullo_epi32(lanes, _mm256_set1_epi32(-k)); }

// Writes 32-block j of a vector into its record for qt.
void put_block(QType qt, const Q32& x, int64_t j, const QActView& v) {
  switch (qt) {
    case QType::kQ4_K:
    case QType::kQ5_K: {
      const int64_t b = j / 8, jj = j % 8;
      static constexpr int kSlot[4] = {0, 2, 1, 3};
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(v.q + b * 256 + (jj / 4) * 128 + kSlot[jj % 4] * 32), x.q);
      v.aux[b * 16 + jj] = x.d;
      v.aux[b * 16 + 8 + jj] = x.d * float(hsum8(x.lane4));
      break;
    }
    case QType::kQ6_K:
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(v.q + 32 * j), x.q);
      v.aux[(j / 8) * 16 + 2 * (j % 8)] = v.aux[(j / 8) * 16 + 2 * (j % 8) + 1] = x.d;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(v.corr + 8 * j), times_neg(x.lane4, 32));
      break;
    case QType::kQ8_0:
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(v.q + 32 * j), x.q);
      _mm256_storeu_ps(v.aux + 8 * j, _mm256_set1_ps(x.d));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(v.corr + 8 * j), times_neg(x.lane4, 128));
      break;
    case QType::kMXFP4: {  // first halves with first halves: lane i of the record is lanes i and 4 + i
      const int64_t g = j / 4, k = j % 4;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(v.q + 128 * g + 16 * k), _mm256_castsi256_si128(x.q));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(v.q + 128 * g + 64 + 16 * k), _mm256_extracti128_si256(x.q, 1));
      _mm_storeu_ps(v.aux + 16 * g + 4 * k, _mm_set1_ps(x.d));
      const __m128i halves = _mm_add_epi32(_mm256_castsi256_si128(x.lane4), _mm256_extracti128_si256(x.lane4, 1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(v.corr + 16 * g + 4 * k), _mm_mullo_epi32(halves, _mm_set1_epi32(-12)));
      break;
    }
    default: break;
  }
}

// Chunk c of route i of a slot's activations packed for the AMX int8 tiles (kernels.h i8_pack),
// from its quantized block: its 32 q in the route's row, and the scales and sums (d * sum as
// put_block computes it for Q4_K's mins).
void i8_pack(uint8_t* pk, int64_t K, int32_t i, int64_t c, const Q32& x) {
  uint8_t* group = pk + (i / kI8Routes) * i8_group_bytes(K);
  const int n = i % kI8Routes;
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(group + n * K + 32 * c), x.q);
  const __m128i s4 = _mm256_castsi256_si128(x.lane4), s8 = _mm256_extracti128_si256(x.lane4, 1);
  const int32_t lo = _mm_extract_epi32(s4, 0) + _mm_extract_epi32(s4, 1) + _mm_extract_epi32(s4, 2) +
                     _mm_extract_epi32(s4, 3);
  const int32_t hi = _mm_extract_epi32(s8, 0) + _mm_extract_epi32(s8, 1) + _mm_extract_epi32(s8, 2) +
                     _mm_extract_epi32(s8, 3);
  float* f = reinterpret_cast<float*>(group + kI8Routes * K) + c * 64;
  f[n] = x.d;
  f[16 + n] = x.d * float(lo + hi);  // = hsum8(x.lane4), as put_block's
  f[32 + n] = x.d * float(lo);
  f[48 + n] = x.d * float(hi);
}

// Zero blocks after the last one up to the end of the kernels' last step (Q8_0: pairs,
// MXFP4: fours), so that a partial step adds nothing.
void put_padding(QType qt, int64_t n, const QActView& v) {
  const int64_t step = qt == QType::kQ8_0 ? 2 : qt == QType::kMXFP4 ? 4 : 1;
  const Q32 zero{_mm256_setzero_si256(), _mm256_setzero_si256(), 0.0f};
  for (int64_t j = n / 32; j % step; ++j) put_block(qt, zero, j, v);
}

// Quantizes 32-chunk j of h for route position q of slot s (fp32 h, already rounded to bf16): into
// its record for the row kernels, or packed for the tiles where they compute the slot's down.
void put_h_chunk(const Plan& p, int32_t s, int64_t q, int64_t j, const float* h32) {
  const Q32 x = quantize32(h32);
  if (p.i8_2[s]) return i8_pack(p.hpk + p.hpk_off[s], p.a.F, int32_t(q - p.start[s]), j, x);
  const QActView v = qact_view(p.hact, p.hl, q);
  put_block(p.a.qt2, x, j, v);
  if ((j + 1) * 32 == p.a.F) put_padding(p.a.qt2, p.a.F, v);
}

// h = bf16(act(gate + bg, up + bu)) of 32-chunk c of slot s, for each of its routes, as the
// bf16 kernels round it, then quantized for w2.
void quantize_h_chunk(const Plan& p, int32_t s, int64_t c) {
  const ColdArgs& a = p.a;
  const float* bg = a.b13 ? a.b13 + int64_t(p.exp_id[s]) * 2 * a.F : nullptr;
  alignas(64) float h32[32];
  for (int32_t q = p.start[s]; q < p.start[s + 1]; ++q) {
    const float* g = p.h + int64_t(q) * p.F32 + 32 * c;
    const float* u = p.u + int64_t(q) * p.F32 + 32 * c;
    for (int i = 0; i < 2; ++i) {
      __m512 gv = _mm512_loadu_ps(g + 16 * i), uv = _mm512_loadu_ps(u + 16 * i);
      if (bg) {
        gv = _mm512_add_ps(gv, _mm512_loadu_ps(bg + 32 * c + 16 * i));
        uv = _mm512_add_ps(uv, _mm512_loadu_ps(bg + a.F + 32 * c + 16 * i));
      }
      _mm512_store_ps(h32 + 16 * i, round_bf16_512(act512(gv, uv, a)));
    }
    put_h_chunk(p, s, q, c, h32);
  }
}

}  // namespace

void quantize_activations(const float* v, int64_t n, int8_t* q, float* d) {
  for (int64_t j = 0; j < n / 32; ++j) {
    const Q32 x = quantize32(v + 32 * j);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 32 * j), x.q);
    d[j] = x.d;
  }
}

void quant_prepare_x(const Plan& p, int64_t t) {
  const ColdArgs& a = p.a;
  const QActView v = qact_view(p.xact, p.xl, t);
  alignas(64) float buf[32];
  for (int64_t j = 0; j < a.D / 32; ++j) {
    if (a.x_dtype == DType::kBFloat16) {
      const uint16_t* x = static_cast<const uint16_t*>(a.x) + t * a.x_stride + 32 * j;
      for (int h = 0; h < 2; ++h)
        _mm512_store_ps(buf + 16 * h, bf16x16_to_f32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16 * h))));
    } else {
      std::memcpy(buf, static_cast<const float*>(a.x) + t * a.x_stride + 32 * j, sizeof(buf));
    }
    const Q32 x = quantize32(buf);
    put_block(a.qt13, x, j, v);
    if (!p.xtok_start.empty())  // and for this token's routes in slots on the int8 tiles
      for (int32_t k = p.xtok_start[t]; k < p.xtok_start[t + 1]; ++k)
        i8_pack(p.xpk + p.xpk_off[p.xtok_slot[k]], a.D, p.xtok_idx[k], j, x);
  }
  put_padding(a.qt13, a.D, v);
}

namespace {

// Rows [f0, f1) of slot s's gate and up on the row kernels, into h and u.
void row_gate_up(const Plan& p, int32_t s, int64_t f0, int64_t f1) {
  const ColdArgs& a = p.a;
  const int64_t rb = p.rb13;
  const uint8_t* w13 = static_cast<const uint8_t*>(a.w13) + int64_t(p.exp_id[s]) * 2 * a.F * rb;
  const int32_t q0 = p.start[s], q1 = p.start[s + 1];
  for (int32_t q = q0; q < q1; q += kQTok) {
    const int nt = std::min(kQTok, q1 - q);
    QActView acts[kQTok];
    for (int j = 0; j < nt; ++j) acts[j] = qact_view(p.xact, p.xl, p.route_token(q + j));
    const Streams st(f0, f1 - f0, rows_for(nt));
    const bool pf = a.prefetch && q == q0;  // later passes find the rows in L2
    const int64_t ahead = pf ? a.prefetch_bytes : 0;
    for (int64_t i = 0; i < st.calls(); ++i) {
      int64_t f[kQRows];
      const int nr = st.rows(i, f);
      const uint8_t* gate[kQRows];
      const uint8_t* up[kQRows];
      for (int r = 0; r < nr; ++r) {
        gate[r] = w13 + f[r] * rb;
        up[r] = w13 + (a.F + f[r]) * rb;
        if (pf) {  // start the hardware prefetcher: the streams' heads, then their next pages
          if (i == 0) {
            touch2(gate[r]);
            touch2(up[r]);
          }
          next_page_hint(gate[r], rb, a.prefetch_bytes);
          next_page_hint(up[r], rb, a.prefetch_bytes);
        }
      }
      float rg[kQRows * kQTok], ru[kQRows * kQTok];
      qdot(a.qt13, gate, nr, a.D, acts, nt, ahead, rg);
      qdot(a.qt13, up, nr, a.D, acts, nt, ahead, ru);
      for (int r = 0; r < nr; ++r)
        for (int j = 0; j < nt; ++j) {
          p.h[int64_t(q + j) * p.F32 + f[r]] = rg[r * nt + j];
          p.u[int64_t(q + j) * p.F32 + f[r]] = ru[r * nt + j];
        }
    }
  }
}

}  // namespace

void quant_gate_up(const Plan& p, int32_t s, int64_t f0, int64_t f1) {
  if (p.i8_13[s]) amx8_gate_up(p, s, f0, f1);
  else row_gate_up(p, s, f0, f1);
  // The chunks of h this task completes (the last of the tasks sharing a chunk): their epilogue.
  for (int64_t c = f0 / 32; c * 32 < f1; ++c) {
    const int32_t rows = int32_t(std::min(f1, 32 * c + 32) - std::max(f0, 32 * c));
    // acquire: the other tasks' rows (GCC's atomic builtins: std::atomic_ref is C++20, torch builds C++17)
    if (__atomic_add_fetch(&p.chunk_rows[s * p.chunks + c], rows, __ATOMIC_ACQ_REL) < 32) continue;
    quantize_h_chunk(p, s, c);
    __atomic_sub_fetch(&p.chunks_left[s], 1, __ATOMIC_RELEASE);
  }
}

void quant_down(const Plan& p, int32_t s, int64_t d0, int64_t d1) {
  if (p.i8_2[s]) return amx8_down(p, s, d0, d1);
  const ColdArgs& a = p.a;
  const int64_t rb = p.rb2;
  const uint8_t* w2 = static_cast<const uint8_t*>(a.w2) + int64_t(p.exp_id[s]) * a.D * rb;
  const int32_t q0 = p.start[s], q1 = p.start[s + 1];
  const float* b2 = a.b2 ? a.b2 + int64_t(p.exp_id[s]) * a.D : nullptr;  // y = w2 . h + b2
  for (int32_t q = q0; q < q1; q += kQTok) {
    const int nt = std::min(kQTok, q1 - q);
    QActView acts[kQTok];
    for (int j = 0; j < nt; ++j) acts[j] = qact_view(p.hact, p.hl, q + j);
    const Streams st(d0, d1 - d0, rows_for(nt));
    const bool pf = a.prefetch && q == q0;
    const int64_t ahead = pf ? a.prefetch_bytes : 0;
    for (int64_t i = 0; i < st.calls(); ++i) {
      int64_t d[kQRows];
      const int nr = st.rows(i, d);
      const uint8_t* rows[kQRows];
      for (int r = 0; r < nr; ++r) {
        rows[r] = w2 + d[r] * rb;
        if (pf) {
          if (i == 0) touch2(rows[r]);
          next_page_hint(rows[r], rb, a.prefetch_bytes);
        }
      }
      float res[kQRows * kQTok];
      qdot(a.qt2, rows, nr, a.F, acts, nt, ahead, res);
      for (int r = 0; r < nr; ++r)
        for (int j = 0; j < nt; ++j) {
          const float v = b2 ? res[r * nt + j] + b2[d[r]] : res[r * nt + j];
          if (p.scatter) {
            p.y[int64_t(q + j) * a.D + d[r]] = v;
          } else {
            float* o = a.out + int64_t(p.route_token(q + j)) * a.out_stride + d[r];
            *o = std::fma(p.route_weight(q + j), v, *o);
          }
        }
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
