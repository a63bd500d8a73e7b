// Quantized experts (Q4_K, Q6_K, MXFP4) on the AMX int8 tiles: the row kernels' integer dots, 16 weight
// rows by up to 16 routes at once.
//
// Why: the row kernels (kernels_quant.cpp) spend, per route and 32 weight values, a VPDPBUSD and
// three vector instructions to scale its int32 sums (convert, permute, FMA), so a prefill's cold
// experts run at some 50 G products a second per core, far below what the memory delivers. The
// tile unit computes a sub-block's sums for 16 rows and the routes of an expert in one TDPBSUD.
//
// What is computed: the same integers as the row kernels. The routes' activations are the A operand
// (a row per route: int8 quantized per 32 values exactly as the row kernels' records hold them,
// i8_pack in kernels.h, packed by whoever quantizes them); the weights are the B operand as u8 (Q4_K
// nibbles 0-15, Q6_K values 0-63 before their -32), 16 rows decoded block by block into the tile's
// 4-byte columns (a transpose of the rows' 4-byte groups, which hold 4 consecutive values in both
// formats). A tile op covers one scale's sub-block (Q4_K: 32 values, K = 32; Q6_K: 16, K = 16), so
// each int32 sum is one sub-block's, as in the row kernels; only the fp32 combination of the sums,
// sub-block by sub-block, runs in another order:
//   Q4_K  dot += ((d sc_j) C_j) dx_j - (dmin m_j) (dx_j sum_j)
//   Q6_K  dot += ((d sc_i) C_i) dx_c - (32 d sc_i) (dx_c sum_i)    (q - 32 as q, minus 32 times the sum)
// The sums' rows are routes, their lanes the 16 weight rows: scaling them costs four instructions a
// route and sub-block, and a tile op's rows are the routes (4, 8, 12 or 16), so both shrink with
// fewer routes. Which rows a task computes never changes a row's result: rows go in aligned groups of
// 16, and a route's result does not depend on the others in its group.
//
// Measured (results/2026-12-06-h100-s41/amx_int8_local/, scripts/bench_cpu_quant.py, one layer of the
// 30B shape's Q4_K/Q6_K experts, every route cold, on the 2-core development host, from 4 routes an
// expert): 0.92x the row kernels' time at 64 tokens (4 routes an expert), 0.70x at 128, 0.62x at 256,
// 0.55x at 512. The first design (the weights as A, one scaling chain per weight row) took 1.10x,
// 0.85x, 1.62x (an outlier; 0.89x from 8 routes) and 0.76x on the same host, and on the 16-core H100
// host (session 41's call 8) 0.69x at 256 tokens but 5.6x at 32. This design on the 16-core H100 host
// (results/2026-12-06-h100-s42/amx_int8_30b.txt, from 4 routes an expert): Q4_K/Q6_K 1.04x at 64
// tokens, 0.81x at 128, 0.65x at 256; Q4_K 0.84x, 0.61x, 0.52x (32 tokens not run). On by default from 4 routes
// (cpu_experts.py AMX_INT8_MIN_TOKENS; OSTINATO_AMX_INT8=0 turns it off).
//
// MXFP4 (session 48, for gpt-oss): the doubled e2m1 values + 12 (0-24, the row kernels' table) as the B
// operand, a tile op per 32-value block (K = 32), the block's 2^(e - 128) as Q4_K's d sc and 12 times it as
// its min (decode_mxfp4). One gpt-oss-120b layer on the 2-core development host, one worker
// (results/2026-12-07-h100-s48/amx_int8_mxfp4_local.txt): 1.4-1.5x the row kernels' time from 2 routes an
// expert, 1.0x from 4, 0.74x at 256 tokens and 0.55x at 512 from 8; hence from 8 by default
// (AMX_INT8_MIN_TOKENS_MXFP4).
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

// Four sums tiles (tmm0, 5, 6, 7: M routes x 16 rows of int32), so that four sub-blocks' tile ops run
// back to back while the vector unit scales the previous four; two A tiles (tmm1, 3: M routes x K
// int8) and two B tiles (tmm2, 4: K / 4 rows x 16 weight rows x 4 u8), used in turn. K = 32 (Q4_K)
// or 16 (Q6_K). A task configures them when a group of routes needs another M or K than the last,
// and releases them at its end.
class Tiles {
 public:
  void use(int M, int K) {
    if (M == M_ && K == K_) return;
    TileConfig c;
    for (int i : {0, 5, 6, 7}) {
      c.rows[i] = uint8_t(M);
      c.colsb[i] = 64;
    }
    for (int i : {1, 3}) {
      c.rows[i] = uint8_t(M);
      c.colsb[i] = uint16_t(K);
    }
    for (int i : {2, 4}) {
      c.rows[i] = uint8_t(K / 4);
      c.colsb[i] = 64;
    }
    _tile_loadconfig(&c);
    M_ = M;
    K_ = K;
  }
  ~Tiles() {
    if (M_ >= 0) _tile_release();
  }

 private:
  int M_ = -1, K_ = -1;
};

// One block of 16 weight rows, decoded: the B tile of each sub-block (K = 32: 8 sub-blocks of 8 x 64
// bytes; K = 16: 16 of 4 x 64; 4 KiB either way), the scales as vectors over the 16 rows (lane r =
// row r), and the four sums tiles read back.
struct Block16 {
  alignas(64) uint8_t B[4096];
  alignas(64) int32_t C[4][16][16];
  __m512 rs[16], ms[8];  // Q4_K: d sc_j and dmin m_j (j < 8); Q6_K: d sc_i (i < 16)
  __m512 rs32[16];       // Q6_K: 32 d sc_i
};

// The 16 x 16 transpose of 32-bit lanes: r[i] = row i -> r[e] = element e of every row.
inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + e], 128-bit lane L: rows 4i .. 4i+3 of element 4L + e
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int e = 0; e < 4; ++e) {
    const __m512i u0 = _mm512_shuffle_i32x4(r[e], r[4 + e], 0x88), u1 = _mm512_shuffle_i32x4(r[e], r[4 + e], 0xDD);
    const __m512i v0 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0x88), v1 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0xDD);
    t[e] = _mm512_shuffle_i32x4(u0, v0, 0x88);
    t[8 + e] = _mm512_shuffle_i32x4(u0, v0, 0xDD);
    t[4 + e] = _mm512_shuffle_i32x4(u1, v1, 0x88);
    t[12 + e] = _mm512_shuffle_i32x4(u1, v1, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// Dwords [o, o + 16) of each of 16 rows (rb bytes apart) -> T[e] = dword o + e of every row.
inline void columns(const uint8_t* w, int64_t rb, int64_t o, __m512i* T) {
  for (int r = 0; r < 16; ++r) T[r] = _mm512_loadu_si512(w + r * rb + 4 * o);
  transpose16(T);
}

// Lane r: r * rb, the byte offset of row r (the gathers' indices).
inline __m512i row_offsets(int64_t rb) {
  return _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                            _mm512_set1_epi32(int32_t(rb)));
}

inline __m512i bytes_of(__m512i v, int byte) {  // byte `byte` of each lane, as int32
  return _mm512_and_si512(_mm512_srli_epi32(v, 8 * byte), _mm512_set1_epi32(0xFF));
}

// Block b of 16 Q4_K rows: sub-block 2g's values are the low nibbles of qs dwords 8g .. 8g+7, 2g+1's
// the high ones; scales and mins as ggml's get_scale_min_k4, in the row kernels' arithmetic.
void decode_q4k(const uint8_t* w, int64_t rb, int64_t b, Block16& k) {
  const uint8_t* blk = w + b * 144;
  const __m512i rows = row_offsets(rb);
  const __m512i h = _mm512_i32gather_epi32(rows, blk, 1);  // d | dmin << 16
  const __m512i s0 = _mm512_i32gather_epi32(rows, blk + 4, 1), s1 = _mm512_i32gather_epi32(rows, blk + 8, 1),
                s2 = _mm512_i32gather_epi32(rows, blk + 12, 1);
  const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(h));
  const __m512 dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(h, 16)));
  const __m512i m63 = _mm512_set1_epi32(63), m15 = _mm512_set1_epi32(15);
  for (int j = 0; j < 8; ++j) {
    __m512i sc, m;
    if (j < 4) {
      sc = _mm512_and_si512(bytes_of(s0, j), m63);
      m = _mm512_and_si512(bytes_of(s1, j), m63);
    } else {
      sc = _mm512_or_si512(_mm512_and_si512(bytes_of(s2, j - 4), m15),
                           _mm512_slli_epi32(_mm512_srli_epi32(bytes_of(s0, j - 4), 6), 4));
      m = _mm512_or_si512(_mm512_srli_epi32(bytes_of(s2, j - 4), 4),
                          _mm512_slli_epi32(_mm512_srli_epi32(bytes_of(s1, j - 4), 6), 4));
    }
    k.rs[j] = _mm512_mul_ps(_mm512_cvtepi32_ps(sc), d);
    k.ms[j] = _mm512_mul_ps(_mm512_cvtepi32_ps(m), dmin);
  }
  const __m512i nib = _mm512_set1_epi8(0x0F);
  __m512i T[16];
  for (int half = 0; half < 2; ++half) {  // qs dwords 16 half .. 16 half + 15: groups g = 2 half, 2 half + 1
    columns(blk + 16, rb, 16 * half, T);
    for (int gg = 0; gg < 2; ++gg) {
      const int g = 2 * half + gg;
      uint8_t* lo = k.B + (2 * g) * 512;
      uint8_t* hi = k.B + (2 * g + 1) * 512;
      for (int r = 0; r < 8; ++r) {
        const __m512i q = T[8 * gg + r];
        _mm512_store_si512(lo + 64 * r, _mm512_and_si512(q, nib));
        _mm512_store_si512(hi + 64 * r, _mm512_and_si512(_mm512_srli_epi32(q, 4), nib));
      }
    }
  }
}

// Block b of 16 Q6_K rows. Value l + 32k of a 128-value half h (k < 4) takes nibble k / 2 of
// ql[64h + l + 32 (k % 2)] and bits 2k, 2k+1 of qh[32h + l]: sub-block i = 8h + s (16 values, l from
// 16 (s % 2), k = s / 2) has B rows kk < 4 from ql dword 16h + 8 (k % 2) + 4 (s % 2) + kk and qh
// dword 8h + 4 (s % 2) + kk.
void decode_q6k(const uint8_t* w, int64_t rb, int64_t b, Block16& k) {
  const uint8_t* blk = w + b * 210;
  const __m512i rows = row_offsets(rb);
  // d: bytes 208-209, read as the high half of the dword at 206 (never past the row)
  const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_i32gather_epi32(rows, blk + 206, 1), 16)));
  for (int q = 0; q < 4; ++q) {
    const __m512i s = _mm512_i32gather_epi32(rows, blk + 192 + 4 * q, 1);
    for (int e = 0; e < 4; ++e) {  // int8 scale 4q + e: byte e, sign-extended
      const __m512i sc = _mm512_srai_epi32(_mm512_slli_epi32(s, 24 - 8 * e), 24);
      k.rs[4 * q + e] = _mm512_mul_ps(_mm512_cvtepi32_ps(sc), d);
      k.rs32[4 * q + e] = _mm512_mul_ps(k.rs[4 * q + e], _mm512_set1_ps(32.0f));
    }
  }
  const __m512i nib = _mm512_set1_epi8(0x0F), m03 = _mm512_set1_epi8(0x03);
  __m512i L[32], H[16];
  columns(blk, rb, 0, L);
  columns(blk, rb, 16, L + 16);
  columns(blk + 128, rb, 0, H);
  for (int i = 0; i < 16; ++i) {
    const int h = i / 8, s = i % 8, kq = s / 2;
    uint8_t* dst = k.B + i * 256;
    for (int kk = 0; kk < 4; ++kk) {
      const __m512i ql = L[16 * h + 8 * (kq % 2) + 4 * (s % 2) + kk];
      const __m512i qh = H[8 * h + 4 * (s % 2) + kk];
      const __m512i lo = kq < 2 ? _mm512_and_si512(ql, nib) : _mm512_and_si512(_mm512_srli_epi32(ql, 4), nib);
      const __m512i up = _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(qh, 2 * kq), m03), 4);
      _mm512_store_si512(dst + 64 * kk, _mm512_or_si512(lo, up));
    }
  }
}

// The sums of N sub-blocks (N <= 4) into k.C[0 .. N - 1]: sub-block u's A at a + u kK (the group's routes, rows
// K bytes apart), its B at b + u bstride (the decoded block). Two A / B pairs (tmm1-2, tmm3-4) in turn, so that
// two tile ops run back to back; Q4_K and Q6_K take four sub-blocks of a 256-value block, MXFP4 up to four
// 32-value blocks (a row's last step may hold fewer).
template <int N>
inline void tile_ops(Block16& k, const uint8_t* a, int64_t K, int kK, const uint8_t* b, int bstride) {
  _tile_zero(0);
  if constexpr (N > 1) _tile_zero(5);
  if constexpr (N > 2) _tile_zero(6);
  if constexpr (N > 3) _tile_zero(7);
  _tile_loadd(1, a, K);
  _tile_loadd(2, b, 64);
  if constexpr (N > 1) {
    _tile_loadd(3, a + kK, K);
    _tile_loadd(4, b + bstride, 64);
  }
  _tile_dpbsud(0, 1, 2);
  if constexpr (N > 1) _tile_dpbsud(5, 3, 4);
  if constexpr (N > 2) {
    _tile_loadd(1, a + 2 * kK, K);
    _tile_loadd(2, b + 2 * bstride, 64);
  }
  if constexpr (N > 3) {
    _tile_loadd(3, a + 3 * kK, K);
    _tile_loadd(4, b + 3 * bstride, 64);
  }
  if constexpr (N > 2) _tile_dpbsud(6, 1, 2);
  if constexpr (N > 3) _tile_dpbsud(7, 3, 4);
  _tile_stored(0, k.C[0][0], 64);
  if constexpr (N > 1) _tile_stored(5, k.C[1][0], 64);
  if constexpr (N > 2) _tile_stored(6, k.C[2][0], 64);
  if constexpr (N > 3) _tile_stored(7, k.C[3][0], 64);
}

// The bytes [o, o + len) of 16 rows (rb apart) on their way into L1: the weights stream from memory
// once per 16 rows, and a block's decoding waits on every line it has not asked for ahead.
inline void prefetch16(const uint8_t* w, int64_t rb, int64_t o, int64_t len) {
  for (int r = 0; r < 16; ++r) {
    const char* p = reinterpret_cast<const char*>(w + r * rb + o);
    for (int64_t x = 0; x < len; x += 64) _mm_prefetch(p + x, _MM_HINT_T0);
    _mm_prefetch(p + len - 1, _MM_HINT_T0);
  }
}

// out[m * ldo + r] = row r (of 16 from w, K values of format Q4_K or Q6_K) . route m of the group of
// M routes at group (the slot's packed activations; M = 4, 8, 12 or 16, routes past the slot's
// count computed on stale bytes and not stored: m < n).
// next: the 16 rows computed after these (null: none), whose first block is fetched during the last.
template <bool kQ6, int M>
void rows16(Tiles& tiles, const uint8_t* w, int64_t rb, int64_t K, const uint8_t* group, int n, float* out,
            int64_t ldo, const uint8_t* next) {
  constexpr int64_t kBlock = kQ6 ? 210 : 144;
  const float* scales = reinterpret_cast<const float*>(group + kI8Routes * K);
  tiles.use(M, kQ6 ? 16 : 32);
  Block16 k;
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  const int64_t blocks = K / 256;
  for (int64_t b = 0; b < blocks; ++b) {
    if (b + 1 < blocks) prefetch16(w, rb, (b + 1) * kBlock, kBlock);
    else if (next) prefetch16(next, rb, 0, kBlock);
    if constexpr (kQ6) decode_q6k(w, rb, b, k);
    else decode_q4k(w, rb, b, k);
    for (int j0 = 0; j0 < (kQ6 ? 16 : 8); j0 += 4) {
      constexpr int kK = kQ6 ? 16 : 32, kBytes = kQ6 ? 256 : 512;  // a sub-block's values, its B tile's bytes
      tile_ops<4>(k, group + b * 256 + kK * j0, K, kK, k.B + kBytes * j0, kBytes);
      for (int u = 0; u < 4; ++u) {
        const int j = j0 + u;
        const float* f = scales + (8 * b + (kQ6 ? j / 2 : j)) * 64;  // d, d sum, d sum of 16 first, last
        for (int m = 0; m < M; ++m) {
          const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(k.C[u][m])), k.rs[j]);
          acc[m] = _mm512_fmadd_ps(t, _mm512_set1_ps(f[m]), acc[m]);
          if constexpr (kQ6) acc[m] = _mm512_fnmadd_ps(k.rs32[j], _mm512_set1_ps(f[32 + 16 * (j % 2) + m]), acc[m]);
          else acc[m] = _mm512_fnmadd_ps(k.ms[j], _mm512_set1_ps(f[16 + m]), acc[m]);
        }
      }
    }
  }
  for (int m = 0; m < M && m < n; ++m) _mm512_storeu_ps(out + m * ldo, acc[m]);
}

// Blocks c .. c + n - 1 (n <= 4) of 16 MXFP4 rows (17 bytes a 32-value block: the E8M0 exponent e,
// then qs, whose low nibbles are values 0-15 and high nibbles 16-31): sub-block u's B tile holds the
// doubled e2m1 values + 12 (0-24, the row kernels' table and integers), its scale 2^(e - 128) (the
// row kernels' VSCALEFPS, subnormal for e < 2 too) and 12 times it, the +12's share (as Q4_K's mins):
//   MXFP4  dot += (2^(e-128) C_u) dx_u - (12 2^(e-128)) (dx_u sum_u)
// The step's 17 n bytes of each row are read once (masked: nothing past them) and transposed as Q4_K's
// are, so that raw[q] holds dword q of every row; any 4 bytes of a row are then two shifts of its lane
// away, 17-byte blocks or not.
void decode_mxfp4(const uint8_t* w, int64_t rb, int64_t c, int n, Block16& k) {
  const uint8_t* blk = w + c * 17;
  const int len = 17 * n;  // <= 68: dwords 0-15 by the transpose, 16 (bytes 64-67) by a gather
  __m512i raw[17];
  const __mmask64 first = len >= 64 ? ~__mmask64(0) : (__mmask64(1) << len) - 1;
  for (int r = 0; r < 16; ++r) raw[r] = _mm512_maskz_loadu_epi8(first, blk + r * rb);
  transpose16(raw);
  raw[16] = len > 64 ? _mm512_i32gather_epi32(row_offsets(rb), blk + 64, 1) : _mm512_setzero_si512();
  const auto at = [&](int b) {  // bytes b .. b + 3 of every row, byte b lowest
    const int q = b / 4, t = 8 * (b % 4);
    if (t == 0) return raw[q];
    return _mm512_or_si512(_mm512_srlv_epi32(raw[q], _mm512_set1_epi32(t)),
                           _mm512_sllv_epi32(raw[q + 1], _mm512_set1_epi32(32 - t)));
  };
  const __m512i tbl = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  for (int u = 0; u < n; ++u) {
    const __m512i e = bytes_of(at(17 * u), 0);
    k.rs[u] = _mm512_scalef_ps(_mm512_set1_ps(1.0f), _mm512_cvtepi32_ps(_mm512_sub_epi32(e, _mm512_set1_epi32(128))));
    k.ms[u] = _mm512_mul_ps(k.rs[u], _mm512_set1_ps(12.0f));
    uint8_t* B = k.B + u * 512;
    for (int kr = 0; kr < 4; ++kr) {  // qs bytes 4 kr .. 4 kr + 3: values 4 kr .. (low nibbles), 16 + 4 kr .. (high)
      const __m512i q = at(17 * u + 1 + 4 * kr);
      _mm512_store_si512(B + 64 * kr, _mm512_shuffle_epi8(tbl, _mm512_and_si512(q, m4)));
      _mm512_store_si512(B + 64 * (4 + kr), _mm512_shuffle_epi8(tbl, _mm512_and_si512(_mm512_srli_epi32(q, 4), m4)));
    }
  }
}

// rows16 for MXFP4 rows: K values in 32-value blocks, four at a time (K need not be a multiple of 128:
// gpt-oss's 2880 ends with two).
template <int M>
void rows16_mx(Tiles& tiles, const uint8_t* w, int64_t rb, int64_t K, const uint8_t* group, int n, float* out,
               int64_t ldo, const uint8_t* next) {
  const float* scales = reinterpret_cast<const float*>(group + kI8Routes * K);
  tiles.use(M, 32);
  Block16 k;
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  const int64_t chunks = K / 32;
  for (int64_t c = 0; c < chunks; c += 4) {
    const int cnt = int(std::min<int64_t>(4, chunks - c));
    if (c + 4 < chunks) prefetch16(w, rb, (c + 4) * 17, std::min<int64_t>(4, chunks - c - 4) * 17);
    else if (next) prefetch16(next, rb, 0, std::min<int64_t>(4, chunks) * 17);
    decode_mxfp4(w, rb, c, cnt, k);
    const uint8_t* a = group + 32 * c;
    switch (cnt) {
      case 4: tile_ops<4>(k, a, K, 32, k.B, 512); break;
      case 3: tile_ops<3>(k, a, K, 32, k.B, 512); break;
      case 2: tile_ops<2>(k, a, K, 32, k.B, 512); break;
      default: tile_ops<1>(k, a, K, 32, k.B, 512); break;
    }
    for (int u = 0; u < cnt; ++u) {
      const float* f = scales + (c + u) * 64;  // d, d sum (kernels.h i8_pack)
      for (int m = 0; m < M; ++m) {
        const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(k.C[u][m])), k.rs[u]);
        acc[m] = _mm512_fmadd_ps(t, _mm512_set1_ps(f[m]), acc[m]);
        acc[m] = _mm512_fnmadd_ps(k.ms[u], _mm512_set1_ps(f[16 + m]), acc[m]);
      }
    }
  }
  for (int m = 0; m < M && m < n; ++m) _mm512_storeu_ps(out + m * ldo, acc[m]);
}

// Q: 0 Q4_K, 1 Q6_K, 2 MXFP4; a group of n routes as M = 4, 8, 12 or 16 tile rows.
template <int Q, int M>
void rows16_q(Tiles& tiles, const uint8_t* w, int64_t rb, int64_t K, const uint8_t* group, int n, float* out,
              int64_t ldo, const uint8_t* next) {
  if constexpr (Q == 2) rows16_mx<M>(tiles, w, rb, K, group, n, out, ldo, next);
  else rows16<Q == 1, M>(tiles, w, rb, K, group, n, out, ldo, next);
}

template <int Q>
void rows16_m(Tiles& tiles, const uint8_t* w, int64_t rb, int64_t K, const uint8_t* group, int n, float* out,
              int64_t ldo, const uint8_t* next) {
  if (n <= 4) rows16_q<Q, 4>(tiles, w, rb, K, group, n, out, ldo, next);
  else if (n <= 8) rows16_q<Q, 8>(tiles, w, rb, K, group, n, out, ldo, next);
  else if (n <= 12) rows16_q<Q, 12>(tiles, w, rb, K, group, n, out, ldo, next);
  else rows16_q<Q, 16>(tiles, w, rb, K, group, n, out, ldo, next);
}

// The 16 rows at w (of format qt) for every route of the slot (n, packed at pk): out[i * ldo + r] for
// route i; next: the rows computed after them (null: none).
void rows16_all(Tiles& tiles, QType qt, const uint8_t* w, int64_t rb, int64_t K, const uint8_t* pk, int32_t n,
                float* out, int64_t ldo, const uint8_t* next) {
  for (int32_t g = 0; g * kI8Routes < n; ++g) {
    const int m = int(std::min<int64_t>(kI8Routes, n - g * kI8Routes));
    const uint8_t* group = pk + g * i8_group_bytes(K);
    float* o = out + g * kI8Routes * ldo;
    const uint8_t* after = (g + 1) * kI8Routes < n ? w : next;  // the next group of routes reads w again
    if (qt == QType::kQ6_K) rows16_m<1>(tiles, w, rb, K, group, m, o, ldo, after);
    else if (qt == QType::kMXFP4) rows16_m<2>(tiles, w, rb, K, group, m, o, ldo, after);
    else rows16_m<0>(tiles, w, rb, K, group, m, o, ldo, after);
  }
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
  Tiles tiles;
  for (int64_t f = f0; f < f1; f += 16) {  // gate rows f.. into h, up rows F + f.. into u, at route q0 + i
    const uint8_t *gate = w13 + f * rb, *up = w13 + (a.F + f) * rb;
    rows16_all(tiles, a.qt13, gate, rb, a.D, p.xpk + p.xpk_off[s], n, p.h + int64_t(q0) * p.F32 + f, p.F32, up);
    rows16_all(tiles, a.qt13, up, rb, a.D, p.xpk + p.xpk_off[s], n, p.u + int64_t(q0) * p.F32 + f, p.F32,
               f + 16 < f1 ? gate + 16 * rb : nullptr);
  }
}

void amx8_down(const Plan& p, int32_t s, int64_t d0, int64_t d1) {
  const ColdArgs& a = p.a;
  const int64_t rb = p.rb2;
  const uint8_t* w2 = static_cast<const uint8_t*>(a.w2) + int64_t(p.exp_id[s]) * a.D * rb;
  const float* b2 = a.b2 ? a.b2 + int64_t(p.exp_id[s]) * a.D : nullptr;  // y = w2 . h + b2
  const int32_t q0 = p.start[s], n = p.start[s + 1] - q0;
  float* res = results(int64_t(n) * 16);
  Tiles tiles;
  for (int64_t d = d0; d < d1; d += 16) {
    rows16_all(tiles, a.qt2, w2 + d * rb, rb, a.F, p.hpk + p.hpk_off[s], n, res, 16, d + 16 < d1 ? w2 + (d + 16) * rb : nullptr);
    for (int32_t i = 0; i < n; ++i) {
      __m512 v = _mm512_load_ps(res + 16 * i);
      if (b2) v = _mm512_add_ps(v, _mm512_loadu_ps(b2 + d));
      if (p.scatter) {
        _mm512_storeu_ps(p.y + int64_t(q0 + i) * a.D + d, v);
      } else {  // fma(weight, v, out) element by element, as the row kernels' direct mode
        float* o = a.out + int64_t(p.route_token(q0 + i)) * a.out_stride + d;
        _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_set1_ps(p.route_weight(q0 + i)), v, _mm512_loadu_ps(o)));
      }
    }
  }
}

}  // namespace ostinato

#pragma GCC pop_options
