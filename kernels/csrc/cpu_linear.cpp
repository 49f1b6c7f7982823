// Linear layers for decode-sized batches on CPUs.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#include "simd.h"

namespace {

using namespace compiled_llm_cpu;

// y = x W^T + b for a few rows of x (decode batches): each weight row is streamed from memory
// once and reused from L1 for every row of x, so the cost is the weight bytes, not M times them
// (MKL's sgemm costs about twice as much at M = 4..12 as at M = 1 on these CPUs).
constexpr int64_t kSmallMin = 3, kSmallMax = 16;  // measured: MKL wins at 1-2 rows and above 16

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  const bool small = x.dim() == 2 && x.size(0) >= kSmallMin && x.size(0) <= kSmallMax && x.scalar_type() == at::kFloat &&
                     weight.scalar_type() == at::kFloat && weight.is_contiguous() && x.stride(1) == 1 &&
                     x.size(1) % 8 == 0 && (!bias.has_value() || bias->is_contiguous());
#if !(defined(__AVX2__) && defined(__FMA__))
  return at::linear(x, weight, bias);
#endif
  if (!small) return at::linear(x, weight, bias);
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t xs = x.stride(0);
#if defined(__AVX2__) && defined(__FMA__)
  // Work: blocks of 4 output rows; enough blocks per task to amortise the task.
  const int64_t blocks = N / 4;
  at::parallel_for(0, blocks, std::max<int64_t>(1, 8192 / K), [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; nb++) {
      const float* w0 = w + nb * 4 * K;
      const float *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
      for (int64_t m = 0; m < M; m += 2) {
        const bool two = m + 1 < M;
        const float* x0 = xp + m * xs;
        const float* x1 = two ? x0 + xs : x0;
        __m256 a00 = _mm256_setzero_ps(), a01 = _mm256_setzero_ps(), a02 = _mm256_setzero_ps(), a03 = _mm256_setzero_ps();
        __m256 a10 = _mm256_setzero_ps(), a11 = _mm256_setzero_ps(), a12 = _mm256_setzero_ps(), a13 = _mm256_setzero_ps();
        for (int64_t k = 0; k < K; k += 8) {
          const __m256 v0 = _mm256_loadu_ps(w0 + k), v1 = _mm256_loadu_ps(w1 + k), v2 = _mm256_loadu_ps(w2 + k),
                       v3 = _mm256_loadu_ps(w3 + k);
          const __m256 xa = _mm256_loadu_ps(x0 + k), xb = _mm256_loadu_ps(x1 + k);
          a00 = _mm256_fmadd_ps(xa, v0, a00);
          a01 = _mm256_fmadd_ps(xa, v1, a01);
          a02 = _mm256_fmadd_ps(xa, v2, a02);
          a03 = _mm256_fmadd_ps(xa, v3, a03);
          a10 = _mm256_fmadd_ps(xb, v0, a10);
          a11 = _mm256_fmadd_ps(xb, v1, a11);
          a12 = _mm256_fmadd_ps(xb, v2, a12);
          a13 = _mm256_fmadd_ps(xb, v3, a13);
        }
        __m128 r0 = hsum4(a00, a01, a02, a03);
        if (b) r0 = _mm_add_ps(r0, _mm_loadu_ps(b + nb * 4));
        _mm_storeu_ps(yp + m * N + nb * 4, r0);
        if (two) {
          __m128 r1 = hsum4(a10, a11, a12, a13);
          if (b) r1 = _mm_add_ps(r1, _mm_loadu_ps(b + nb * 4));
          _mm_storeu_ps(yp + (m + 1) * N + nb * 4, r1);
        }
      }
    }
  });
  for (int64_t n = blocks * 4; n < N; n++)  // the last N % 4 rows
    for (int64_t m = 0; m < M; m++) yp[m * N + n] = dot(xp + m * xs, w + n * K, K) + (b ? b[n] : 0.f);
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(compiled_llm_cpu, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(compiled_llm_cpu, CPU, m) {
  m.impl("linear", linear);
}
