// SIMD helpers shared by the CPU kernels (AVX2 + FMA where the compiler targets it, scalar
// loops otherwise).
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace compiled_llm_cpu {


inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float sum = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  __m256 acc = _mm256_add_ps(acc0, acc1);
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  lo = _mm_hadd_ps(lo, lo);
  lo = _mm_hadd_ps(lo, lo);
  sum = _mm_cvtss_f32(lo);
#endif
  for (; i < n; i++) sum += a[i] * b[i];
  return sum;
}

#if defined(__AVX2__) && defined(__FMA__)
// exp(v) for v <= 0 (softmax arguments): a degree-6 polynomial on the fraction after splitting off
// the power of two; relative error ~1e-7.
inline __m256 exp256(__m256 v) {
  const __m256 log2e = _mm256_set1_ps(1.44269504088896341f), ln2 = _mm256_set1_ps(0.693147180559945309f);
  const __m256 c1 = _mm256_set1_ps(1.0f), c2 = _mm256_set1_ps(0.5f), c3 = _mm256_set1_ps(1.66666666e-1f),
               c4 = _mm256_set1_ps(4.16666666e-2f), c5 = _mm256_set1_ps(8.33333333e-3f), c6 = _mm256_set1_ps(1.38888889e-3f);
  v = _mm256_max_ps(v, _mm256_set1_ps(-87.0f));
  __m256 k = _mm256_round_ps(_mm256_mul_ps(v, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, ln2, v);  // v - k ln2, |r| <= ln2 / 2
  __m256 p = _mm256_fmadd_ps(c6, r, c5);
  p = _mm256_fmadd_ps(p, r, c4);
  p = _mm256_fmadd_ps(p, r, c3);
  p = _mm256_fmadd_ps(p, r, c2);
  p = _mm256_fmadd_ps(p, r, c1);
  p = _mm256_fmadd_ps(p, r, c1);
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// Horizontal max and sum of the 8 lanes.
inline float hmax256(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

// The largest of n floats (-inf for none): a softmax's max without a serial dependency chain.
inline float max_of(const float* x, int64_t n) {
  int64_t i = 0;
  float m = -INFINITY;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0;
  for (; i + 16 <= n; i += 16) {
    m0 = _mm256_max_ps(m0, _mm256_loadu_ps(x + i));
    m1 = _mm256_max_ps(m1, _mm256_loadu_ps(x + i + 8));
  }
  m = hmax256(_mm256_max_ps(m0, m1));
#endif
  for (; i < n; i++) m = x[i] > m ? x[i] : m;
  return m;
}

// x = exp(x - shift) in place (x <= shift), returning the sum: a softmax's numerators and
// denominator in one pass.
inline float exp_sum_inplace(float* x, int64_t n, float shift) {
  int64_t i = 0;
  float sum = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 s = _mm256_set1_ps(shift);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), s));
    _mm256_storeu_ps(x + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = hsum256(acc);
#endif
  for (; i < n; i++) {
    x[i] = std::exp(x[i] - shift);
    sum += x[i];
  }
  return sum;
}

inline void axpy(float* y, float alpha, const float* x, int64_t n) {
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 a = _mm256_set1_ps(alpha);
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(a, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
  for (; i < n; i++) y[i] += alpha * x[i];
}

#if defined(__AVX2__) && defined(__FMA__)
// Sums of four vectors, as one 4-float vector: {sum(a), sum(b), sum(c), sum(d)}.
inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
  __m256 abcd = _mm256_hadd_ps(ab, cd);
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}
#endif

}  // namespace compiled_llm_cpu
