// Quantized experts on the AMX int8 tiles: the row kernels' integer dots, 16 rows x 16 routes at once.
//
// Why: the row kernels (kernels_quant.cpp) spend, per route and 32 weight values, a VPDPBUSD and
// three vector instructions to scale its int32 sums (convert, permute, FMA), so a prefill's cold
// experts run at some 50 G products a second per core, far below what the memory delivers. The
// tile unit computes a sub-block's sums for 16 rows and 16 routes in one TDPBUSD; the scaling
// then costs four instructions per row and sub-block, shared by the 16 routes.
//
// What is computed: the same integers as the row kernels. Weights are the A operand as u8 (Q4_K
// nibbles 0-15, Q6_K values 0-63 before their -32), decoded block by block for 16 rows into a
// scratch of this thread; activations are the B operand, int8 quantized per 32 values exactly
// as the row kernels' records hold them (i8_pack, kernels.h), packed by whoever quantizes them.
// A tile op covers one scale's sub-block (Q4_K: 32 values, K = 32; Q6_K: 16, K = 16), so each
// int32 sum is one sub-block's, as in the row kernels; only the fp32 combination of the sums,
// sub-block by sub-block and row by row, runs in another order:
//   Q4_K  dot += (d sc_j) (dx_j C_j) - (dmin m_j) (dx_j sum_j)
//   Q6_K  dot += (d sc_i) (dx_c C_i - 32 dx_c sum_i)      (q - 32 as q, minus 32 times the sum)
// Which rows a task computes never changes a row's result: rows go in aligned groups of 16.
//
// Measured (results/2026-12-06-h100-s41/, scripts/bench_cpu_quant.py, one layer of the 30B shape,
// Q4_K/Q6_K, every route cold, 15 workers of the 16-core H100 host): with every expert of at least 8
// routes on the tiles, 14.9 -> 10.1 ms at 256 tokens (16 routes an expert), 29.0 -> 16.6 at 512, 8.6
// -> 7.5 at 128; at 32 tokens with the 19 experts of 4 routes or more on the tiles, 3.1 -> 17.5 ms,
// not explained. A tile op's cost does not shrink with fewer routes (the scaling is per row and
// sub-block), so the tiles pay from some 8 routes an expert; they stay off by default
// (cpu_experts.py AMX_INT8_MIN_TOKENS) until the engine's replays say where.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>

#include "kernels.h"

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")

namespace ostinato {
namespace {

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Four sums tiles (tmm0, 5, 6, 7: 16 rows x 16 routes of int32), so that four sub-blocks' tile ops
// run back to back while the vector unit scales the previous four (a TDPBUSD, its TILESTORED and the
// loads that read the sums back form a chain); two A tiles (tmm1, 3: 16 rows
// x K u8) and two B tiles (tmm2, 4: K / 4 rows x 64 bytes), used in turn. K = 32 (Q4_K) or 16 (Q6_K).
// Configured once a task (a task is one projection, one format).
class Tiles {
 public:
  explicit Tiles(int K) {
    TileConfig c;
    for (int i : {0, 5, 6, 7}) {
      c.rows[i] = 16;
      c.colsb[i] = 64;
    }
    for (int i : {1, 3}) {
      c.rows[i] = 16;
      c.colsb[i] = uint16_t(K);
    }
    for (int i : {2, 4}) {
      c.rows[i] = uint8_t(K / 4);
      c.colsb[i] = 64;
    }
    _tile_loadconfig(&c);
  }
  ~Tiles() { _tile_release(); }
};

// 16 rows' block b decoded: values as u8, scales (V), and the four sums tiles read back.
struct Block16 {
  alignas(64) uint8_t A[16][256];
  alignas(64) int32_t C[4][16][16];
  alignas(64) float V[16][16];  // row r: Q4_K d sc_j (j < 8) then dmin m_j; Q6_K d sc_i (i < 16)
};

inline __m256i load256(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
// Rows r and r + 1's 32 bytes at offset o of their blocks, as one vector.
inline __m512i load2(const uint8_t* w, int64_t rb, int64_t o) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(load256(w + o)), load256(w + rb + o), 1);
}
// Rows r and r + 1 of A, 32 values each at column o (the scratch rows are 256 bytes: two stores).
inline void store2(uint8_t* a, int64_t o, __m512i v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(a + o), _mm512_castsi512_si256(v));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(a + 256 + o), _mm512_extracti64x4_epi64(v, 1));
}

void decode_q4k(const uint8_t* w, int64_t rb, int64_t b, Block16& k) {
  q4k_scales16(w, rb, b, k.V[0]);
  const __m512i nib = _mm512_set1_epi8(0x0F);
  for (int r = 0; r < 16; r += 2) {
    const uint8_t* blk = w + r * rb + b * 144;
    for (int g = 0; g < 4; ++g) {  // 32 bytes: sub-block 2g in the low nibbles, 2g + 1 in the high
      const __m512i q = load2(blk, rb, 16 + 32 * g);
      store2(k.A[r], 64 * g, _mm512_and_si512(q, nib));
      store2(k.A[r], 64 * g + 32, _mm512_and_si512(_mm512_srli_epi16(q, 4), nib));
    }
  }
}

void decode_q6k(const uint8_t* w, int64_t rb, int64_t b, Block16& k) {
  const __m512i nib = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
  for (int r = 0; r < 16; ++r) {
    const uint8_t* blk = w + r * rb + b * 210;
    uint16_t h;
    std::memcpy(&h, blk + 208, 2);
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192));
    _mm512_store_ps(k.V[r], _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)), _mm512_set1_ps(_cvtsh_ss(h))));
  }
  for (int r = 0; r < 16; r += 2) {
    const uint8_t* blk = w + r * rb + b * 210;
    for (int h = 0; h < 2; ++h) {  // value l + 32k of a half: nibble k / 2 of ql[l + 32 (k % 2)], bits 2k, 2k+1 of qh[l]
      const __m512i ql0 = load2(blk, rb, 64 * h), ql1 = load2(blk, rb, 64 * h + 32), qh = load2(blk, rb, 128 + 32 * h);
      const int64_t o = 128 * h;
      store2(k.A[r], o, _mm512_or_si512(_mm512_and_si512(ql0, nib), _mm512_and_si512(_mm512_slli_epi16(qh, 4), m30)));
      store2(k.A[r], o + 32, _mm512_or_si512(_mm512_and_si512(ql1, nib), _mm512_and_si512(_mm512_slli_epi16(qh, 2), m30)));
      store2(k.A[r], o + 64,
             _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql0, 4), nib), _mm512_and_si512(qh, m30)));
      store2(k.A[r], o + 96, _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql1, 4), nib),
                                             _mm512_and_si512(_mm512_srli_epi16(qh, 2), m30)));
    }
  }
}

// The sums of sub-blocks j0 .. j0 + 3 of the block whose first 32-chunk is c0, into k.C.
template <bool kQ6>
inline void tile_ops(Block16& k, const uint8_t* tiles, int64_t c0, int j0) {
  constexpr int kK = kQ6 ? 16 : 32;
  const auto b_tile = [&](int j) { return tiles + (c0 + (kQ6 ? j / 2 : j)) * 512 + (kQ6 ? (j % 2) * 256 : 0); };
  _tile_zero(0);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  _tile_loadd(1, k.A[0] + kK * j0, 256);
  _tile_loadd(2, b_tile(j0), 64);
  _tile_loadd(3, k.A[0] + kK * (j0 + 1), 256);
  _tile_loadd(4, b_tile(j0 + 1), 64);
  _tile_dpbusd(0, 1, 2);
  _tile_dpbusd(5, 3, 4);
  _tile_loadd(1, k.A[0] + kK * (j0 + 2), 256);
  _tile_loadd(2, b_tile(j0 + 2), 64);
  _tile_loadd(3, k.A[0] + kK * (j0 + 3), 256);
  _tile_loadd(4, b_tile(j0 + 3), 64);
  _tile_dpbusd(6, 1, 2);
  _tile_dpbusd(7, 3, 4);
  _tile_stored(0, k.C[0][0], 64);
  _tile_stored(5, k.C[1][0], 64);
  _tile_stored(6, k.C[2][0], 64);
  _tile_stored(7, k.C[3][0], 64);
}

// res[r * ld + i] = row r (of 16 from w, K values of format Q4_K or Q6_K) . route i (i < n) of the
// slot's packed activations pk.
template <bool kQ6>
void rows16(const uint8_t* w, int64_t rb, int64_t K, const uint8_t* pk, int32_t n, float* res, int64_t ld) {
  const int64_t nc = K / 32, gb = i8_group_bytes(K), blocks = K / 256, bb = kQ6 ? 210 : 144;
  Block16 k;
  for (int32_t g = 0; g * kI8Routes < n; ++g) {
    const uint8_t* tiles = pk + g * gb;
    const float* scales = reinterpret_cast<const float*>(tiles + nc * 512);
    __m512 acc[16];
    for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      if (b + 1 < blocks)  // the next block of each row, while this one computes
        for (int r = 0; r < 16; ++r)
          for (int64_t o = 0; o < bb; o += 64)
            _mm_prefetch(reinterpret_cast<const char*>(w + r * rb + (b + 1) * bb + o), _MM_HINT_T0);
      if constexpr (kQ6) decode_q6k(w, rb, b, k);
      else decode_q4k(w, rb, b, k);
      for (int j0 = 0; j0 < (kQ6 ? 16 : 8); j0 += 4) {
        tile_ops<kQ6>(k, tiles, 8 * b, j0);
        for (int u = 0; u < 4; ++u) {
          const int j = j0 + u;
          const int64_t c = 8 * b + (kQ6 ? j / 2 : j);
          const float* f = scales + c * 64;  // d, d * sum, d * sum of the first 16, of the last 16
          const __m512 dx = _mm512_loadu_ps(f);
          if constexpr (kQ6) {
            const __m512 s32 = _mm512_mul_ps(_mm512_loadu_ps(f + 32 + 16 * (j % 2)), _mm512_set1_ps(32.0f));
            for (int r = 0; r < 16; ++r) {
              const __m512 t = _mm512_fmsub_ps(_mm512_cvtepi32_ps(_mm512_load_si512(k.C[u][r])), dx, s32);
              acc[r] = _mm512_fmadd_ps(t, _mm512_set1_ps(k.V[r][j]), acc[r]);
            }
          } else {
            const __m512 sm = _mm512_loadu_ps(f + 16);
            for (int r = 0; r < 16; ++r) {
              const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(k.C[u][r])), dx);
              acc[r] = _mm512_fmadd_ps(t, _mm512_set1_ps(k.V[r][j]), acc[r]);
              acc[r] = _mm512_fnmadd_ps(sm, _mm512_set1_ps(k.V[r][8 + j]), acc[r]);
            }
          }
        }
      }
    }
    const int32_t m = std::min<int32_t>(kI8Routes, n - g * kI8Routes);
    const __mmask16 valid = __mmask16((1u << m) - 1);
    for (int r = 0; r < 16; ++r) _mm512_mask_storeu_ps(res + r * ld + g * kI8Routes, valid, acc[r]);
  }
}

void rows16_of(QType qt, const uint8_t* w, int64_t rb, int64_t K, const uint8_t* pk, int32_t n, float* res,
               int64_t ld) {
  if (qt == QType::kQ6_K) rows16<true>(w, rb, K, pk, n, res, ld);
  else rows16<false>(w, rb, K, pk, n, res, ld);
}

// This thread's results of 16 rows for n routes (plain malloc: see kernels_amx.cpp's Scratch).
float* results(int64_t n) {
  struct Buf {
    float* p = nullptr;
    int64_t cap = 0;
    ~Buf() { std::free(p); }
  };
  thread_local Buf s;
  if (s.cap < n) {
    std::free(s.p);
    s.p = static_cast<float*>(std::aligned_alloc(64, size_t(round_up(n, 16)) * sizeof(float)));
    s.cap = s.p ? n : 0;
    if (s.p == nullptr) throw std::bad_alloc();
  }
  return s.p;
}

}  // namespace

void amx8_gate_up(const Plan& p, int32_t s, int64_t f0, int64_t f1) {
  const ColdArgs& a = p.a;
  const int64_t rb = p.rb13;
  const uint8_t* w13 = static_cast<const uint8_t*>(a.w13) + int64_t(p.exp_id[s]) * 2 * a.F * rb;
  const int32_t q0 = p.start[s], n = p.start[s + 1] - q0;
  const int64_t ld = round_up(n, kI8Routes);
  float* res = results(16 * ld);
  Tiles config(a.qt13 == QType::kQ6_K ? 16 : 32);
  for (int64_t f = f0; f < f1; f += 16) {
    for (int half = 0; half < 2; ++half) {  // gate rows f.., then up rows F + f..
      rows16_of(a.qt13, w13 + (half * a.F + f) * rb, rb, a.D, p.xpk + p.xpk_off[s], n, res, ld);
      float* dst = half ? p.u : p.h;
      for (int32_t i = 0; i < n; ++i)
        for (int r = 0; r < 16; ++r) dst[int64_t(q0 + i) * p.F32 + f + r] = res[r * ld + i];
    }
  }
}

void amx8_down(const Plan& p, int32_t s, int64_t d0, int64_t d1) {
  const ColdArgs& a = p.a;
  const int64_t rb = p.rb2;
  const uint8_t* w2 = static_cast<const uint8_t*>(a.w2) + int64_t(p.exp_id[s]) * a.D * rb;
  const float* b2 = a.b2 ? a.b2 + int64_t(p.exp_id[s]) * a.D : nullptr;  // y = w2 . h + b2
  const int32_t q0 = p.start[s], n = p.start[s + 1] - q0;
  const int64_t ld = round_up(n, kI8Routes);
  float* res = results(16 * ld);
  Tiles config(a.qt2 == QType::kQ6_K ? 16 : 32);
  for (int64_t d = d0; d < d1; d += 16) {
    rows16_of(a.qt2, w2 + d * rb, rb, a.F, p.hpk + p.hpk_off[s], n, res, ld);
    for (int32_t i = 0; i < n; ++i)
      for (int r = 0; r < 16; ++r) {
        const float v = b2 ? res[r * ld + i] + b2[d + r] : res[r * ld + i];
        if (p.scatter) {
          p.y[int64_t(q0 + i) * a.D + d + r] = v;
        } else {
          float* o = a.out + int64_t(p.route_token(q0 + i)) * a.out_stride + d + r;
          *o = std::fma(p.route_weight(q0 + i), v, *o);
        }
      }
  }
}

}  // namespace ostinato

#pragma GCC pop_options
