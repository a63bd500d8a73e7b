// Vector math shared by the AVX-512 and AMX kernels. Include after <immintrin.h> inside a
// `#pragma GCC target` region that enables AVX-512F.
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
inline __m512 silu_mul512(__m512 g, __m512 u) {
  const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
  return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), u);
}

}  // namespace ostinato
