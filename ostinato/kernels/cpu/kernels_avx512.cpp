// Vector path: row-wise dot products with AVX-512 (+ AVX512_BF16), for experts with few
// routes (decode) or CPUs without AMX.
//
// Each microkernel computes an 8-row x NT-activation block of dot products: every weight
// vector loaded from memory meets all NT activations (weights are read once per call;
// activations stay in L1). Lanes are summed by _mm512_reduce_add_ps at the end: a fixed
// order, so results never depend on threads. Rows past the block end are clamped to the
// last valid row (computed again and dropped) so only the full 8-row kernel exists.
//
// Memory: a weight row is 4 KiB at D = 2048, and hardware prefetchers stop at page ends,
// so while one 8-row group is computed the kernel prefetches the next group (or the next
// expert's rows) into L2, one line per row per step; the stream never waits on a cold page.
//
// Compiled for AVX-512 through a target pragma, not -march, so that the library loads on
// any x86-64; experts.cpp only calls in here after checking cpuid.
#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "kernels.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,bmi2")

#include "vecmath.h"

namespace ostinato {
namespace {

constexpr int kRows = 8;

inline __mmask32 tail_mask32(int64_t n) { return _bzhi_u32(0xffffffffu, uint32_t(n)); }
inline __mmask16 tail_mask16(int64_t n) { return __mmask16(_bzhi_u32(0xffffu, uint32_t(n))); }

template <class W>
inline void prefetch_rows(const W* const* pf, int64_t k) {
  for (int i = 0; i < kRows; ++i) _mm_prefetch(reinterpret_cast<const char*>(pf[i] + k), _MM_HINT_T1);
}

// bf16 weights . bf16 activations, both natural layout: VDPBF16PS on 32 elements a step.
template <int NT, bool PF>
inline void dots(const uint16_t* const* w, const uint16_t* const* a, const uint16_t* const* pf,
                 int64_t K, float (*out)[NT]) {
  __m512 acc[kRows][NT];
#pragma GCC unroll 16
  for (int i = 0; i < kRows; ++i)
    for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    if (PF) prefetch_rows(pf, k);
    __m512i av[NT];
    for (int j = 0; j < NT; ++j) av[j] = _mm512_loadu_si512(a[j] + k);
#pragma GCC unroll 8
    for (int i = 0; i < kRows; ++i) {
      __m512i wv = _mm512_loadu_si512(w[i] + k);
      for (int j = 0; j < NT; ++j)
        acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)wv, (__m512bh)av[j]);
    }
  }
  if (k < K) {
    if (PF) prefetch_rows(pf, k);
    __mmask32 m = tail_mask32(K - k);
    __m512i av[NT];
    for (int j = 0; j < NT; ++j) av[j] = _mm512_maskz_loadu_epi16(m, a[j] + k);
    for (int i = 0; i < kRows; ++i) {
      __m512i wv = _mm512_maskz_loadu_epi16(m, w[i] + k);
      for (int j = 0; j < NT; ++j)
        acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)wv, (__m512bh)av[j]);
    }
  }
  for (int i = 0; i < kRows; ++i)
    for (int j = 0; j < NT; ++j) out[i][j] = _mm512_reduce_add_ps(acc[i][j]);
}

// bf16 weights widened exactly to fp32 . fp32 activations in split layout (kernels.h).
template <int NT, bool PF>
inline void dots(const uint16_t* const* w, const float* const* a, const uint16_t* const* pf,
                 int64_t K, float (*out)[NT]) {
  const __m512i hi_mask = _mm512_set1_epi32(int(0xffff0000u));
  __m512 acc[kRows][NT];
#pragma GCC unroll 16
  for (int i = 0; i < kRows; ++i)
    for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    if (PF) prefetch_rows(pf, k);
    __m512 ae[NT], ao[NT];
    for (int j = 0; j < NT; ++j) {
      ae[j] = _mm512_loadu_ps(a[j] + k);
      ao[j] = _mm512_loadu_ps(a[j] + k + 16);
    }
    // Past the row end the weights read as zero; the activations are zero-padded.
    __mmask32 m = K - k >= 32 ? __mmask32(0xffffffffu) : tail_mask32(K - k);
#pragma GCC unroll 8
    for (int i = 0; i < kRows; ++i) {
      __m512i wv = _mm512_maskz_loadu_epi16(m, w[i] + k);
      __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(wv, 16));
      __m512 wo = _mm512_castsi512_ps(_mm512_and_si512(wv, hi_mask));
      for (int j = 0; j < NT; ++j) {
        acc[i][j] = _mm512_fmadd_ps(we, ae[j], acc[i][j]);
        acc[i][j] = _mm512_fmadd_ps(wo, ao[j], acc[i][j]);
      }
    }
  }
  for (int i = 0; i < kRows; ++i)
    for (int j = 0; j < NT; ++j) out[i][j] = _mm512_reduce_add_ps(acc[i][j]);
}

// fp32 weights . fp32 activations, natural layout.
template <int NT, bool PF>
inline void dots(const float* const* w, const float* const* a, const float* const* pf, int64_t K,
                 float (*out)[NT]) {
  __m512 acc[kRows][NT];
#pragma GCC unroll 16
  for (int i = 0; i < kRows; ++i)
    for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    if (PF) prefetch_rows(pf, k);
    __mmask16 m = K - k >= 16 ? __mmask16(0xffff) : tail_mask16(K - k);
    __m512 av[NT];
    for (int j = 0; j < NT; ++j) av[j] = _mm512_maskz_loadu_ps(m, a[j] + k);
#pragma GCC unroll 8
    for (int i = 0; i < kRows; ++i) {
      __m512 wv = _mm512_maskz_loadu_ps(m, w[i] + k);
      for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_fmadd_ps(wv, av[j], acc[i][j]);
    }
  }
  for (int i = 0; i < kRows; ++i)
    for (int j = 0; j < NT; ++j) out[i][j] = _mm512_reduce_add_ps(acc[i][j]);
}

// One or two activations; prefetches pf (the rows computed next) when given.
template <class W, class A>
inline void dots_n(const W* const* w, const A* const* a, int nt, const W* const* pf, int64_t K,
                   float (*out)[2]) {
  if (nt == 2) {
    if (pf)
      dots<2, true>(w, a, pf, K, out);
    else
      dots<2, false>(w, a, pf, K, out);
    return;
  }
  float o[kRows][1];
  if (pf)
    dots<1, true>(w, a, pf, K, o);
  else
    dots<1, false>(w, a, pf, K, o);
  for (int i = 0; i < kRows; ++i) out[i][0] = o[i][0];
}

// h[f0, f0 + 32) = act(g, u) for one route (silu(g) * u unless the call says otherwise),
// where h holds g and u the up values (biases added); the chunk is 32 positions in either
// layout (split only permutes inside a chunk). Positions of f >= F become 0: the down kernels
// read whole chunks. With bf16 weights h is rounded to bf16 (nearest even), as the GPU kernels
// and the reference model round it before the down projection, so the two branches of a layer
// compute the same function.
inline void act_chunk(const ColdArgs& a, float* h, const float* u, int64_t f0, int64_t F, bool split,
                      bool round_bf16) {
  __mmask16 valid[2] = {0, 0};
  for (int pos = 0; pos < 32; ++pos) {
    int64_t f = f0 + (split ? (pos < 16 ? 2 * pos : 2 * (pos - 16) + 1) : pos);
    if (f < F) valid[pos / 16] |= __mmask16(1u << (pos % 16));
  }
  for (int half = 0; half < 2; ++half) {
    const __mmask16 m = valid[half];
    const __m512 g = _mm512_maskz_loadu_ps(m, h + f0 + 16 * half);
    const __m512 uv = _mm512_maskz_loadu_ps(m, u + f0 + 16 * half);
    __m512 hv = act512(g, uv, a);
    if (round_bf16) hv = round_bf16_512(hv);
    _mm512_storeu_ps(h + f0 + 16 * half, _mm512_maskz_mov_ps(m, hv));
  }
}

template <class W, class A>
void gate_up(const Plan& p, int32_t s, int64_t f0, int64_t f1, bool split_h) {
  const ColdArgs& a = p.a;
  const W* w13 = static_cast<const W*>(a.w13) + int64_t(p.exp_id[s]) * 2 * a.F * a.D;
  const int32_t q0 = p.start[s], q1 = p.start[s + 1];
  const float* bg = a.b13 ? a.b13 + int64_t(p.exp_id[s]) * 2 * a.F : nullptr;  // gate biases, then up
  for (int64_t f = f0; f < f1; f += 4) {
    const int nr = int(std::min<int64_t>(4, f1 - f));
    const W* rows[kRows];
    const W* next[kRows];
    for (int i = 0; i < 4; ++i) {
      const int64_t ff = f + std::min(i, nr - 1), fn = std::min(f + 4 + i, f1 - 1);
      rows[i] = w13 + ff * a.D;  // gate
      rows[4 + i] = w13 + (a.F + ff) * a.D;  // up
      next[i] = w13 + fn * a.D;
      next[4 + i] = w13 + (a.F + fn) * a.D;
    }
    for (int32_t q = q0; q < q1; q += 2) {
      const int nt = std::min(2, q1 - q);
      const A* acts[2];
      for (int j = 0; j < nt; ++j) {
        int64_t t = p.route_token(q + j);
        if (p.kind == VecKind::kDpBf16 || (p.kind == VecKind::kF32 && a.x_dtype == DType::kFloat32))
          acts[j] = static_cast<const A*>(a.x) + t * a.x_stride;
        else
          acts[j] = reinterpret_cast<const A*>(p.xconv + t * p.D32);
      }
      float r[kRows][2];
      dots_n<W, A>(rows, acts, nt, a.prefetch && q == q0 && f + 4 < f1 ? next : nullptr, a.D, r);
      for (int j = 0; j < nt; ++j) {
        float* h = p.h + int64_t(q + j) * p.F32;
        float* u = p.u + int64_t(q + j) * p.F32;
        for (int i = 0; i < nr; ++i) {
          const int64_t idx = split_h ? split_index(f + i) : f + i;
          h[idx] = bg ? r[i][j] + bg[f + i] : r[i][j];
          u[idx] = bg ? r[4 + i][j] + bg[a.F + f + i] : r[4 + i][j];
        }
      }
    }
  }
  for (int32_t q = q0; q < q1; ++q)
    act_chunk(a, p.h + int64_t(q) * p.F32, p.u + int64_t(q) * p.F32, f0, a.F, split_h,
              a.w_dtype == DType::kBFloat16);
}

template <class W>
void down(const Plan& p, int32_t s, int64_t d0, int64_t d1) {
  const ColdArgs& a = p.a;
  const W* w2 = static_cast<const W*>(a.w2) + int64_t(p.exp_id[s]) * a.D * a.F;
  // Direct mode visits every slot for the same rows: prefetch the next vector slot's rows.
  const W* w2_next = nullptr;
  if (!p.scatter && s + 1 < int32_t(p.exp_id.size()) && !p.amx[s + 1])
    w2_next = static_cast<const W*>(a.w2) + int64_t(p.exp_id[s + 1]) * a.D * a.F;
  const int32_t q0 = p.start[s], q1 = p.start[s + 1];
  const float* b2 = a.b2 ? a.b2 + int64_t(p.exp_id[s]) * a.D : nullptr;  // y = w2 . h + b2
  for (int64_t d = d0; d < d1; d += kRows) {
    const int nr = int(std::min<int64_t>(kRows, d1 - d));
    const W* rows[kRows];
    const W* next[kRows];
    const bool more = d + kRows < d1;
    for (int i = 0; i < kRows; ++i) {
      rows[i] = w2 + (d + std::min(i, nr - 1)) * a.F;
      next[i] = more ? w2 + std::min(d + kRows + i, d1 - 1) * a.F
                     : (w2_next ? w2_next + std::min(d0 + i, d1 - 1) * a.F : nullptr);
    }
    const bool pf = more || w2_next;
    for (int32_t q = q0; q < q1; q += 2) {
      const int nt = std::min(2, q1 - q);
      const float* acts[2];
      for (int j = 0; j < nt; ++j) acts[j] = p.h + int64_t(q + j) * p.F32;
      float r[kRows][2];
      dots_n<W, float>(rows, acts, nt, a.prefetch && q == q0 && pf ? next : nullptr, a.F, r);
      for (int j = 0; j < nt; ++j) {
        if (b2)
          for (int i = 0; i < nr; ++i) r[i][j] += b2[d + i];
        if (p.scatter) {
          float* y = p.y + int64_t(q + j) * a.D + d;
          for (int i = 0; i < nr; ++i) y[i] = r[i][j];
        } else {
          float* o = a.out + int64_t(p.route_token(q + j)) * a.out_stride + d;
          const float wt = p.route_weight(q + j);
          for (int i = 0; i < nr; ++i) o[i] = std::fma(wt, r[i][j], o[i]);
        }
      }
    }
  }
}

}  // namespace

void vec_convert_x(const Plan& p, int64_t t) {
  const ColdArgs& a = p.a;
  float* dst = p.xconv + t * p.D32;
  const bool split = p.kind == VecKind::kSplit;
  for (int64_t k = 0; k < p.D32; ++k) {
    float v = 0.0f;
    if (k < a.D) {
      v = a.x_dtype == DType::kBFloat16
              ? bf16_to_f32(static_cast<const uint16_t*>(a.x)[t * a.x_stride + k])
              : static_cast<const float*>(a.x)[t * a.x_stride + k];
    }
    dst[split ? split_index(k) : k] = v;
  }
}

void reduce_token(const Plan& p, int64_t t) {
  const ColdArgs& a = p.a;
  float* o = a.out + t * a.out_stride;
  const int32_t k0 = p.tok_start[t], k1 = p.tok_start[t + 1];
  for (int64_t d = 0; d < a.D; d += 16) {
    const __mmask16 m = a.D - d >= 16 ? __mmask16(0xffff) : tail_mask16(a.D - d);
    __m512 acc = _mm512_setzero_ps();
    for (int32_t k = k0; k < k1; ++k) {
      const int32_t q = p.tok_pos[k];
      const __m512 yv = _mm512_maskz_loadu_ps(m, p.y + int64_t(q) * a.D + d);
      acc = _mm512_fmadd_ps(_mm512_set1_ps(p.route_weight(q)), yv, acc);
    }
    _mm512_mask_storeu_ps(o + d, m, acc);
  }
}

void vec_gate_up(const Plan& p, int32_t s, int64_t f0, int64_t f1) {
  switch (p.kind) {
    case VecKind::kDpBf16: gate_up<uint16_t, uint16_t>(p, s, f0, f1, true); break;
    case VecKind::kSplit: gate_up<uint16_t, float>(p, s, f0, f1, true); break;
    case VecKind::kF32: gate_up<float, float>(p, s, f0, f1, false); break;
  }
}

void vec_down(const Plan& p, int32_t s, int64_t d0, int64_t d1) {
  if (p.a.w_dtype == DType::kBFloat16)
    down<uint16_t>(p, s, d0, d1);
  else
    down<float>(p, s, d0, d1);
}

}  // namespace ostinato

#pragma GCC pop_options
