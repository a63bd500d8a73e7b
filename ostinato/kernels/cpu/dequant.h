// GGUF blocks -> bf16 rows, as ggml's dequantize_row_* computes them in fp32, then rounded to
// nearest even: the weights of a quantized expert for the AMX tiles (kernels_amx.cpp).
//
// Why bf16 tiles for quantized experts: the row kernels (kernels_quant.cpp) decode each weight
// block once per kQTok routes and spend their time on integer dots and block scales, about
// 9 us of 14 workers per route of the 30B file at 256 tokens. An expert with many routes
// (prefill) costs them that per route; decoded once into bf16, its rows go through the tile
// unit for all its routes at once, so the decoding is paid once per expert.
//
// Plain loops, no intrinsics: kernels_amx.cpp includes this file under its AVX-512 target,
// where GCC vectorizes them, and bindings.cpp under none, for the tests against gguf's
// dequantize on any x86-64 host. The anonymous namespace keeps the two builds apart (internal
// linkage: no instance compiled for AVX-512 can be picked for a caller built without it).
#pragma once

#include <cstdint>
#include <cstring>

#include "experts.h"

// No fused multiply-adds: the AVX-512 build would fuse d * q - m into one rounding, and then
// differ from gguf's (and this file's portable build) in an odd bf16 value.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

namespace ostinato {
namespace {

inline float dq_half(const uint8_t* p) {  // IEEE binary16 -> fp32, exact (subnormals too)
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  float f;
  if (e == 0) {  // zero or subnormal: m * 2^-24
    f = float(m) * 0x1p-24f;
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u |= sign;
    std::memcpy(&f, &u, 4);
    return f;
  }
  const uint32_t u = sign | (e == 31 ? 0x7f800000u | (m << 13) : ((e + 112) << 23) | (m << 13));
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t dq_bf16(float f) {  // round to nearest even (no NaN can come out of a block)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// Q4_K / Q5_K: the 6-bit scale and min of 32-block j of a super-block (ggml's get_scale_min_k4).
inline void dq_scale_min(int j, const uint8_t* q, float& sc, float& m) {
  if (j < 4) {
    sc = float(q[j] & 63);
    m = float(q[j + 4] & 63);
  } else {
    sc = float((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    m = float((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

// One 256-value super-block of Q4_K (144 bytes: d, dmin, scales[12], qs[128]) or Q5_K
// (176 bytes: d, dmin, scales[12], qh[32], qs[128]).
template <bool kQ5>
inline void dq_k4(const uint8_t* b, uint16_t* y) {
  const float d = dq_half(b), dmin = dq_half(b + 2);
  const uint8_t* sc = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + (kQ5 ? 48 : 16);
  for (int g = 0; g < 4; ++g) {  // 64 values: low nibbles (block 2g), high nibbles (2g + 1)
    float s0, m0, s1, m1;
    dq_scale_min(2 * g, sc, s0, m0);
    dq_scale_min(2 * g + 1, sc, s1, m1);
    const float d0 = d * s0, d1 = d * s1, n0 = dmin * m0, n1 = dmin * m1;
    const uint8_t* q = qs + 32 * g;
    for (int l = 0; l < 32; ++l) {
      int lo = q[l] & 0xF, hi = q[l] >> 4;
      if constexpr (kQ5) {
        lo += ((qh[l] >> (2 * g)) & 1) << 4;
        hi += ((qh[l] >> (2 * g + 1)) & 1) << 4;
      }
      y[64 * g + l] = dq_bf16(d0 * float(lo) - n0);
      y[64 * g + 32 + l] = dq_bf16(d1 * float(hi) - n1);
    }
  }
}

// One super-block of Q6_K (210 bytes: ql[128], qh[64], scales[16] int8, d). Value l + 32k of a
// 128-value half (k < 4) takes nibble k / 2 of ql[l + 32 (k % 2)] and bits 2k, 2k + 1 of qh[l],
// minus 32, times d * scales[l / 16 + 2k]: loops of 16 values with one scale, which vectorize.
inline void dq_q6k(const uint8_t* b, uint16_t* y) {
  const float d = dq_half(b + 208);
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  for (int h = 0; h < 2; ++h) {
    const uint8_t* qh = b + 128 + 32 * h;
    for (int k = 0; k < 4; ++k) {
      const uint8_t* ql = b + 64 * h + 32 * (k % 2);
      const int nib = 4 * (k / 2);
      uint16_t* o = y + 128 * h + 32 * k;
      for (int part = 0; part < 2; ++part) {
        const float dk = d * float(sc[8 * h + part + 2 * k]);
        for (int l = 16 * part; l < 16 * part + 16; ++l) {
          const int q = (((ql[l] >> nib) & 0xF) | (((qh[l] >> (2 * k)) & 3) << 4)) - 32;
          o[l] = dq_bf16(dk * float(q));
        }
      }
    }
  }
}

// One 32-value block of Q8_0 (34 bytes: d, qs[32] int8).
inline void dq_q80(const uint8_t* b, uint16_t* y) {
  const float d = dq_half(b);
  const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
  for (int l = 0; l < 32; ++l) y[l] = dq_bf16(d * float(q[l]));
}

// One 32-value block of MXFP4 (17 bytes: an E8M0 exponent e, qs[16]): value i is
// e2m1(nibble) * 2^(e - 127); low nibbles are values 0-15, high nibbles 16-31. The table holds
// doubled e2m1 values, so the scale is 2^(e - 128) (ggml's GGML_E8M0_TO_FP32_HALF).
inline void dq_mxfp4(const uint8_t* b, uint16_t* y) {
  static constexpr int8_t kValues[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
  const uint32_t e = b[0];
  // 2^(e - 128) as fp32 bits: normal from e = 2; 2^-127 and 2^-128 (e = 1, 0) are subnormal
  const uint32_t bits = e >= 2 ? (e - 1) << 23 : 0x00200000u << e;
  float s;
  std::memcpy(&s, &bits, 4);
  const uint8_t* q = b + 1;
  for (int l = 0; l < 16; ++l) {
    y[l] = dq_bf16(s * float(kValues[q[l] & 0xF]));
    y[l + 16] = dq_bf16(s * float(kValues[q[l] >> 4]));
  }
}

// Row w (n values of format qt, n a multiple of its block values) -> y[n] bf16.
inline void dequant_row_bf16(QType qt, const uint8_t* w, int64_t n, uint16_t* y) {
  const int64_t k = qtype_block_values(qt), bb = qtype_block_bytes(qt);
  for (int64_t i = 0; i < n / k; ++i, w += bb, y += k) {
    switch (qt) {
      case QType::kQ4_K: dq_k4<false>(w, y); break;
      case QType::kQ5_K: dq_k4<true>(w, y); break;
      case QType::kQ6_K: dq_q6k(w, y); break;
      case QType::kQ8_0: dq_q80(w, y); break;
      case QType::kMXFP4: dq_mxfp4(w, y); break;
      default: return;
    }
  }
}

}  // namespace
}  // namespace ostinato

#pragma GCC pop_options
