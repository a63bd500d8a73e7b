// AMX path: experts with many routes (prefill) as bf16 tile GEMMs, fp32 accumulation.
//
// Weights are the A operand, read straight from the checkpoint layout (16 rows x 32 bf16
// per tile, row stride = the matrix row), so they are never repacked; each weight tile is
// loaded once per 32 tokens. Activations are the B operand, packed once per call into
// VNNI tiles ([16 pairs of k][16 tokens][2]), token blocks padded with zeros.
//
// Precision: x is bf16 (as the model's activations are). The intermediate h is computed in
// fp32 and rounded once to bf16 before the down projection, as every expert kernel of the
// project does with bf16 weights (and the reference model). Products are exact; sums are
// fp32 in tile order.
// (VCVTNEPS2BF16 rounds to nearest even and flushes denormals, as the tile unit does.)
//
// Weight rows are separate 4 KiB pages for the hardware prefetcher, so the first pass
// over a tile row block prefetches its lines kPrefetchSteps K steps ahead.
//
// Quantized experts (Plan::quant, ColdArgs::amx_quant_min_tokens): a task first decodes its
// rows (32 of gate and of up, or 16 of the down projection) into a bf16 scratch of its thread
// (dequant.h), which then serves every token block from cache; the rest is the bf16 path. Their
// h is bf16 here, where the row kernels quantize it per 32 values: both round what the
// dequantize-then-bf16 reference computes. A gate/up task completes one 32-chunk of h and says
// so (Plan::chunks_left), since the merged phase starts a slot's down tasks on that count.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>

#include "kernels.h"

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")

#include "dequant.h"
#include "vecmath.h"

namespace ostinato {
namespace {

constexpr int64_t kTile = 512;  // uint16 elements in one 1 KiB tile

// Every tile is 16 rows x 64 bytes; tmm0-3 accumulators, tmm4-7 operands.
class TileScope {
 public:
  TileScope() {
    TileConfig cfg;
    for (int i = 0; i < 8; ++i) {
      cfg.colsb[i] = 64;
      cfg.rows[i] = 16;
    }
    _tile_loadconfig(&cfg);
  }
  ~TileScope() { _tile_release(); }
};

constexpr int64_t kPrefetchSteps = 8;  // weight lines fetched this many K steps ahead

// 16 rows of a weight tile, the 64-byte line of K step kb: ask for it ahead of the load.
template <_mm_hint kHint = _MM_HINT_T0>
inline void prefetch_tile_rows(const uint16_t* rows, int64_t stride, int64_t kb) {
  for (int i = 0; i < 16; ++i)
    _mm_prefetch(reinterpret_cast<const char*>(rows + i * stride + kb * 32), kHint);
}

// Two rows (f even, f + 1) x 16 tokens of bf16 values -> one VNNI tile row of pairs.
inline __m512i pair_rows(__m256i even, __m256i odd) {
  return _mm512_or_si512(_mm512_cvtepu16_epi32(even), _mm512_slli_epi32(_mm512_cvtepu16_epi32(odd), 16));
}

inline int32_t num_blocks(const Plan& p, int32_t s) { return (p.start[s + 1] - p.start[s] + 15) / 16; }

// Q4_K and Q5_K by table (most of a Q4_K_M file's expert weights): a 32-block has one scale and
// one min, so its 16 (Q5_K: 32) possible values d * sc * q - dmin * m are computed once, rounded
// as dq_bf16 rounds, and its 32 values looked up by their nibbles with one VPERMW. Products and
// differences are separate roundings, as in dequant.h (no fused multiply-add), so the two agree
// bit for bit (tests/test_cpu_quant.py: test_dequant_rows_bf16_is_gguf_rounded, both builds).
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

inline __m512i round_bf16_words(__m512 v) {  // 16 lanes: bf16 bits in the low half of each
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
}

// Words q -> bf16(d * q - m) for q < 16 (kTwo: q < 32).
template <bool kTwo>
inline __m512i value_table(float d, float m) {
  const __m512 q = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 dv = _mm512_set1_ps(d), mv = _mm512_set1_ps(m);
  const __m256i lo = _mm512_cvtepi32_epi16(round_bf16_words(_mm512_sub_ps(_mm512_mul_ps(dv, q), mv)));
  if constexpr (!kTwo) return _mm512_castsi256_si512(lo);
  const __m512 q16 = _mm512_add_ps(q, _mm512_set1_ps(16.0f));
  const __m256i hi = _mm512_cvtepi32_epi16(round_bf16_words(_mm512_sub_ps(_mm512_mul_ps(dv, q16), mv)));
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

template <bool kQ5>
void k4_row_table(const uint8_t* w, int64_t n, uint16_t* y) {
  const int64_t bb = kQ5 ? 176 : 144;
  const __m256i nib = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
  for (int64_t i = 0; i < n / 256; ++i, w += bb, y += 256) {
    const float d = dq_half(w), dmin = dq_half(w + 2);
    const uint8_t* sc = w + 4;
    const uint8_t* qs = w + (kQ5 ? 48 : 16);
    const __m256i qh = kQ5 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16)) : _mm256_setzero_si256();
    for (int g = 0; g < 4; ++g) {
      float s0, m0, s1, m1;
      dq_scale_min(2 * g, sc, s0, m0);
      dq_scale_min(2 * g + 1, sc, s1, m1);
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * g));
      __m256i lo = _mm256_and_si256(q, nib), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), nib);
      if constexpr (kQ5) {  // the fifth bits: bit 2g of qh[l] for the low nibbles, 2g + 1 for the high
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * g), one), 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * g + 1), one), 4));
      }
      const __m512i t0 = value_table<kQ5>(d * s0, dmin * m0), t1 = value_table<kQ5>(d * s1, dmin * m1);
      _mm512_storeu_si512(y + 64 * g, _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(lo), t0));
      _mm512_storeu_si512(y + 64 * g + 32, _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(hi), t1));
    }
  }
}

#pragma GCC pop_options

// n quantized rows of rb bytes from `rows`, each of k values of format qt -> out[n, k] bf16.
void decode_rows(QType qt, const uint8_t* rows, int64_t rb, int64_t n, int64_t k, uint16_t* out) {
  for (int64_t i = 0; i < n; ++i) {
    if (qt == QType::kQ4_K)
      k4_row_table<false>(rows + i * rb, k, out + i * k);
    else if (qt == QType::kQ5_K)
      k4_row_table<true>(rows + i * rb, k, out + i * k);
    else
      dequant_row_bf16(qt, rows + i * rb, k, out + i * k);
  }
}

// This thread's scratch of at least n values (decoded rows, reused task after task). Plain
// malloc, no std::vector: a template instantiated in this file is compiled for AVX-512, and the
// linker may hand its copy to callers in files built for any x86-64 CPU.
struct Scratch {
  uint16_t* p = nullptr;
  int64_t cap = 0;
  ~Scratch() { std::free(p); }
};

uint16_t* scratch(int64_t n) {
  thread_local Scratch s;
  if (s.cap < n) {
    std::free(s.p);
    s.p = static_cast<uint16_t*>(std::malloc(size_t(n) * sizeof(uint16_t)));
    s.cap = s.p ? n : 0;
    if (s.p == nullptr) throw std::bad_alloc();
  }
  return s.p;
}

}  // namespace

void amx_pack_x(const Plan& p, int32_t s, int64_t b) {
  const ColdArgs& a = p.a;
  const int64_t KB = a.D / 32;
  uint32_t* dst = reinterpret_cast<uint32_t*>(p.xpack + p.xpack_off[s] + b * KB * kTile);
  // Pair kk of a token's 32-element K step goes to tile row kk, column n: a 16-way scatter.
  const __m512i rows = _mm512_mullo_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(16));
  for (int n = 0; n < 16; ++n) {
    const int64_t q = p.start[s] + b * 16 + n;
    const uint16_t* src = nullptr;
    if (q < p.start[s + 1]) src = static_cast<const uint16_t*>(a.x) + p.route_token(q) * a.x_stride;
    for (int64_t kb = 0; kb < KB; ++kb) {
      const __m512i v = src ? _mm512_loadu_si512(src + kb * 32) : _mm512_setzero_si512();
      _mm512_i32scatter_epi32(dst + kb * (kTile / 2) + n, rows, v, 4);
    }
  }
}

void amx_gate_up(const Plan& p, int32_t s, int64_t f0) {
  const ColdArgs& a = p.a;
  const int64_t D = a.D, F = a.F, KB = D / 32, KBF = F / 32;
  // rows f0 .. f0 + 31 of gate (g) and of up (u), D apart
  const uint16_t *g, *u;
  if (p.quant) {
    const uint8_t* q13 = static_cast<const uint8_t*>(a.w13) + int64_t(p.exp_id[s]) * 2 * F * p.rb13;
    uint16_t* buf = scratch(64 * D);
    decode_rows(a.qt13, q13 + f0 * p.rb13, p.rb13, 32, D, buf);
    decode_rows(a.qt13, q13 + (F + f0) * p.rb13, p.rb13, 32, D, buf + 32 * D);
    g = buf;
    u = buf + 32 * D;
  } else {
    const uint16_t* w13 = static_cast<const uint16_t*>(a.w13) + int64_t(p.exp_id[s]) * 2 * F * D;
    g = w13 + f0 * D;
    u = w13 + (F + f0) * D;
  }
  const bool prefetch = a.prefetch && !p.quant;  // decoded rows are in cache already
  const uint16_t* xp = p.xpack + p.xpack_off[s];
  const int32_t nb = num_blocks(p, s);
  const float* bg = a.b13 ? a.b13 + int64_t(p.exp_id[s]) * 2 * F : nullptr;  // gate biases, then up
  alignas(64) float c[4][256];
  TileScope tiles;
  for (int32_t b = 0; b < nb; b += 2) {
    const bool two = b + 1 < nb;
    const uint16_t* xb0 = xp + int64_t(b) * KB * kTile;
    const uint16_t* xb1 = xb0 + KB * kTile;
    for (int half = 0; half < 2; ++half) {
      const int64_t r0 = f0 + 16 * half;
      const uint16_t* ag = g + 16 * half * D;
      const uint16_t* au = u + 16 * half * D;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t kb = 0; kb < KB; ++kb) {
        if (prefetch && b == 0) {  // later token blocks find the rows in cache
          if (kb + kPrefetchSteps < KB) {
            prefetch_tile_rows(ag, D, kb + kPrefetchSteps);
            prefetch_tile_rows(au, D, kb + kPrefetchSteps);
          }
          if (half == 0) {  // the next 16 rows, into L2, so that their first steps hit
            prefetch_tile_rows<_MM_HINT_T1>(ag + 16 * D, D, kb);
            prefetch_tile_rows<_MM_HINT_T1>(au + 16 * D, D, kb);
          }
        }
        _tile_loadd(4, ag + kb * 32, D * 2);
        _tile_loadd(5, au + kb * 32, D * 2);
        _tile_loadd(6, xb0 + kb * kTile, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 5, 6);
        if (two) {
          _tile_loadd(7, xb1 + kb * kTile, 64);
          _tile_dpbf16ps(2, 4, 7);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, c[0], 64);
      _tile_stored(1, c[1], 64);
      _tile_stored(2, c[2], 64);
      _tile_stored(3, c[3], 64);
      for (int bb = 0; bb < (two ? 2 : 1); ++bb) {
        const int64_t off = p.hpack_off[s] + (int64_t(b + bb) * KBF + f0 / 32) * kTile;
        const float* cg = c[2 * bb];
        const float* cu = c[2 * bb + 1];
        for (int i = 0; i < 16; i += 2) {  // rows r0 + i (even f) and r0 + i + 1
          __m256i hi[2];
          for (int j = 0; j < 2; ++j) {
            // a tile row is one f for 16 tokens: its biases broadcast along the row
            __m512 g = _mm512_loadu_ps(cg + (i + j) * 16), u = _mm512_loadu_ps(cu + (i + j) * 16);
            if (bg) {
              g = _mm512_add_ps(g, _mm512_set1_ps(bg[r0 + i + j]));
              u = _mm512_add_ps(u, _mm512_set1_ps(bg[F + r0 + i + j]));
            }
            // AMX runs on bf16 weights only: h rounds to bf16 (nearest even), as in the vector path
            hi[j] = (__m256i)_mm512_cvtneps_pbh(act512(g, u, a));
          }
          const int64_t kk = ((r0 + i) % 32) / 2;
          _mm512_storeu_si512(p.hhi + off + kk * 32, pair_rows(hi[0], hi[1]));
        }
      }
    }
  }
  if (p.quant) __atomic_sub_fetch(&p.chunks_left[s], 1, __ATOMIC_RELEASE);  // chunk f0 / 32 of h is whole
}

void amx_down(const Plan& p, int32_t s, int64_t d0, const uint16_t* next_rows) {
  const ColdArgs& a = p.a;
  const int64_t D = a.D, F = a.F, KBF = F / 32;
  const uint16_t* w2;  // rows d0 .. d0 + 15, F apart
  if (p.quant) {
    uint16_t* buf = scratch(16 * F);
    decode_rows(a.qt2, static_cast<const uint8_t*>(a.w2) + (int64_t(p.exp_id[s]) * D + d0) * p.rb2, p.rb2, 16, F,
                buf);
    w2 = buf;
    next_rows = nullptr;
  } else {
    w2 = static_cast<const uint16_t*>(a.w2) + (int64_t(p.exp_id[s]) * D + d0) * F;
  }
  const bool prefetch = a.prefetch && !p.quant;
  const uint16_t* hhi = p.hhi + p.hpack_off[s];
  const int32_t nb = num_blocks(p, s);
  const float* b2 = a.b2 ? a.b2 + int64_t(p.exp_id[s]) * D + d0 : nullptr;  // y = w2 . h + b2
  alignas(64) float c[2][256];
  TileScope tiles;
  for (int32_t b = 0; b < nb; b += 2) {
    const bool two = b + 1 < nb;
    const int64_t o0 = int64_t(b) * KBF * kTile, o1 = o0 + KBF * kTile;
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t kb = 0; kb < KBF; ++kb) {
      if (prefetch && b == 0) {
        if (kb + kPrefetchSteps < KBF) prefetch_tile_rows(w2, F, kb + kPrefetchSteps);
        if (next_rows) prefetch_tile_rows<_MM_HINT_T1>(next_rows, F, kb);
      }
      _tile_loadd(4, w2 + kb * 32, F * 2);
      _tile_loadd(5, hhi + o0 + kb * kTile, 64);
      _tile_dpbf16ps(0, 4, 5);
      if (two) {
        _tile_loadd(7, hhi + o1 + kb * kTile, 64);
        _tile_dpbf16ps(1, 4, 7);
      }
    }
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    if (b2)
      for (int bb = 0; bb < (two ? 2 : 1); ++bb)
        for (int i = 0; i < 16; ++i) _mm512_storeu_ps(c[bb] + i * 16, _mm512_add_ps(_mm512_loadu_ps(c[bb] + i * 16),
                                                                                    _mm512_set1_ps(b2[i])));
    for (int bb = 0; bb < (two ? 2 : 1); ++bb) {
      const int32_t q0 = p.start[s] + (b + bb) * 16;
      const int32_t nq = std::min(16, p.start[s + 1] - q0);
      for (int n = 0; n < nq; ++n) {
        if (p.scatter) {
          float* y = p.y + int64_t(q0 + n) * D + d0;
          for (int i = 0; i < 16; ++i) y[i] = c[bb][i * 16 + n];
        } else {
          float* o = a.out + int64_t(p.route_token(q0 + n)) * a.out_stride + d0;
          const float wt = p.route_weight(q0 + n);
          for (int i = 0; i < 16; ++i) o[i] = std::fma(wt, c[bb][i * 16 + n], o[i]);
        }
      }
    }
  }
}

void dequant_rows_bf16_avx512(QType qt, const uint8_t* w, int64_t rows, int64_t n, uint16_t* out) {
  decode_rows(qt, w, qtype_row_bytes(qt, n), rows, n, out);
}

void amx_down_rows(const Plan& p, int32_t s, int64_t d0, int64_t d1) {
  const ColdArgs& a = p.a;
  const uint16_t* w2 = p.quant ? nullptr : static_cast<const uint16_t*>(a.w2) + int64_t(p.exp_id[s]) * a.D * a.F;
  for (int64_t d = d0; d < d1; d += kDownRows)
    amx_down(p, s, d, w2 && d + kDownRows < d1 ? w2 + (d + kDownRows) * a.F : nullptr);
}

}  // namespace ostinato

#pragma GCC pop_options
