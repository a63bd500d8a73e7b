// Vector math shared by the AVX-512 and AMX kernels. Include after <immintrin.h> and experts.h
// inside a `#pragma GCC target` region that enables AVX-512F.
#pragma once

namespace ostinato {

// exp(x), 16 lanes: x = n ln2 + r with |r| <= ln2/2 (Cody-Waite, two-part ln2), e^r by a
// degree-7 Taylor polynomial (truncation < 0.05 ulp), times 2^n by VSCALEFPS. About 1 ulp;
// overflow gives +inf, underflow 0, NaN stays NaN (min/max keep the NaN operand).
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-100.0f), _mm512_min_ps(_mm512_set1_ps(100.0f), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// silu(g) * u = g / (1 + e^-g) * u, 16 lanes (e^-g -> inf gives -0 for very negative g).
// 16 bf16 values (bit patterns) -> fp32, exactly.
inline __m512 bf16x16_to_f32(__m256i v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// Round fp32 to the nearest bf16 (ties to even), kept as fp32; AVX-512F only, so the plain
// AVX-512 path may use it too (equals _mm512_cvtneps_pbh for every non-NaN input).
inline __m512 round_bf16_512(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i biased = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_castsi512_ps(_mm512_and_si512(biased, _mm512_set1_epi32(int(0xFFFF0000u))));
}

inline __m512 silu_mul512(__m512 g, __m512 u) {
  const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
  return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), u);
}

// The call's activation of 16 lanes (experts.h Act). The clamps keep a NaN operand (MINPS and
// MAXPS return their second operand when one is NaN), as torch's clamp does.
inline __m512 act512(__m512 g, __m512 u, const ColdArgs& a) {
  if (a.act == Act::kSilu) return silu_mul512(g, u);
  const __m512 lim = _mm512_set1_ps(a.act_limit), one = _mm512_set1_ps(1.0f);
  g = _mm512_min_ps(lim, g);
  u = _mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), lim), _mm512_min_ps(lim, u));
  const __m512 e = exp512(_mm512_mul_ps(_mm512_set1_ps(-a.act_alpha), g));
  return _mm512_mul_ps(_mm512_add_ps(u, one), _mm512_div_ps(g, _mm512_add_ps(one, e)));
}

}  // namespace ostinato
