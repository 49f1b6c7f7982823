// Linear layers over 16-bit weights (fp16 or bf16) on CPUs: y = x W^T + b with float32
// activations, each weight converted to float32 in registers.
//
// Why: 16-bit storage halves the bytes a decode step streams, on any CPU. bf16 is the top half of
// a float32: a zero-extension and a 16-bit shift, which GCC's vector types express. fp16 takes the
// conversion instruction (vcvtph2ps: F16C on AVX2 machines, AVX-512F's 16-wide form), with a
// portable fallback in vector types elsewhere. Activations and arithmetic stay float32, so a CPU
// without native bf16 (AVX512_BF16, AMX) still reads half the bytes, and every CPU computes with
// exactly the weights as stored.
//
// Layout and micro-kernel are the fp32 GEMM's (cpu_gemm.cpp): panels [ceil(N / NR), K, NR] in the
// weight's own dtype, the last panel zero-padded; an MR x NR block of y in registers; NR weights
// converted once per k and used by every row of the block.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>

#include "huge_pages.h"
#include "panel_gemm.h"
#include "parallel.h"
#include "vec.h"
#include "widen.h"

namespace {

using namespace compiled_llm_cpu;

constexpr int64_t kNativePanel = 2 * kNativeLanes;
// Packed bytes per work item: the fp32 GEMM's item in weights (128 KB of floats).
constexpr int64_t kItemBytes = 64 * 1024;

// y[0:MR, 0:cols] = x[0:MR, :] . panel + bias, for one panel (NV vectors of output features).
// Small row counts split k into KU interleaved streams with their own accumulators, so the FMA
// latency chains do not bound a memory-bound pass.
template <typename V, int NV, int MR, class Format>
void half_kernel(const float* __restrict x, int64_t xs, const uint16_t* __restrict panel, int64_t K,
                 float* __restrict y, int64_t ys, int64_t cols, const float* __restrict bias) {
  constexpr int L = lanes<V>();
  constexpr int NR = NV * L;
  constexpr int KU = MR <= 2 ? 2 : 1;
  V acc[KU][MR][NV];
  for (int u = 0; u < KU; u++)
    for (int m = 0; m < MR; m++)
      for (int j = 0; j < NV; j++) acc[u][m][j] = V{};
  int64_t k = 0;
  for (; k + KU <= K; k += KU) {
#pragma GCC unroll 2
    for (int u = 0; u < KU; u++) {
      const uint16_t* w = panel + (k + u) * NR;
      __builtin_prefetch(w + kPrefetchBytes / sizeof(uint16_t), 0, kPrefetchLocality);
      V wv[NV];
#pragma GCC unroll 4
      for (int j = 0; j < NV; j++) wv[j] = Format::template load<V>(w + j * L);
#pragma GCC unroll 16
      for (int m = 0; m < MR; m++) {
        const V a = splat<V>(x[m * xs + k + u]);
#pragma GCC unroll 4
        for (int j = 0; j < NV; j++) acc[u][m][j] += a * wv[j];
      }
    }
  }
  for (; k < K; k++) {  // K odd with KU = 2
    const uint16_t* w = panel + k * NR;
    for (int m = 0; m < MR; m++) {
      const V a = splat<V>(x[m * xs + k]);
      for (int j = 0; j < NV; j++) acc[0][m][j] += a * Format::template load<V>(w + j * L);
    }
  }
  for (int u = 1; u < KU; u++)
    for (int m = 0; m < MR; m++)
      for (int j = 0; j < NV; j++) acc[0][m][j] += acc[u][m][j];
  store_tile<V, NV, MR>(acc[0], y, ys, cols, bias);
}

// Rows per micro-kernel call, as the fp32 GEMM: 12 x 32 floats in 32 zmm registers, 6 x 16 in 16 ymm.
template <typename V>
constexpr int max_rows() {
  return lanes<V>() == 16 && kNativePanel == 32 ? 12 : 6;
}

template <typename V, int NV, class Format>
void rows_block(int rows, const float* x, int64_t xs, const uint16_t* panel, int64_t K, float* y, int64_t ys,
                int64_t cols, const float* bias) {
  switch (rows) {
#define CASE(R) \
  case R:       \
    if constexpr (R <= max_rows<V>()) return half_kernel<V, NV, R, Format>(x, xs, panel, K, y, ys, cols, bias);
    CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) CASE(9) CASE(10) CASE(11) CASE(12)
#undef CASE
  }
}

template <typename V, int NV, class Format>
void half_gemm(const float* x, int64_t xs, int64_t M, const uint16_t* packed, int64_t K, int64_t N, const float* bias,
               float* y) {
  constexpr int64_t NR = NV * lanes<V>();
  constexpr int R = max_rows<V>();
  const int64_t panels = (N + NR - 1) / NR;
  const int64_t panel_bytes = K * NR * static_cast<int64_t>(sizeof(uint16_t));
  parallel_panels(M, K, panels, panel_bytes, kItemBytes, R, [&](int64_t m0, int64_t m1, int64_t p) {
    const uint16_t* panel = packed + p * K * NR;
    const int64_t n0 = p * NR, cols = std::min(NR, N - n0);
    const float* b = bias ? bias + n0 : nullptr;
    for (int64_t m = m0; m < m1; m += R) {
      const int rows = static_cast<int>(std::min<int64_t>(R, m1 - m));
      rows_block<V, NV, Format>(rows, x + m * xs, xs, panel, K, y + m * N + n0, N, cols, b);
    }
  });
}

bool is_half(const at::Tensor& t) { return t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16; }

at::Tensor pack_half_weight(const at::Tensor& weight, int64_t panel) {
  TORCH_CHECK(weight.dim() == 2 && is_half(weight), "weight must be a 2-D float16 or bfloat16 tensor, got ",
              weight.scalar_type(), " ", weight.sizes());
  if (panel <= 0) panel = kNativePanel;
  TORCH_CHECK(panel == 16 || panel == 32, "panel width must be 16 or 32, got ", panel);
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t panels = (N + panel - 1) / panel;
  auto padded = at::zeros({panels * panel, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  // [panels, NR, K] -> [panels, K, NR]
  at::Tensor packed = packed_weight_empty({panels, K, panel}, weight.options());
  packed.copy_(padded.view({panels, panel, K}).transpose(1, 2));
  return packed;
}

at::Tensor half_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                       int64_t out_features) {
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && is_half(packed) && (packed.size(2) == 16 || packed.size(2) == 32),
              "packed weight must come from pack_half_weight");
  const int64_t NR = packed.size(2), K = packed.size(1), N = out_features;
  TORCH_CHECK(N > 0 && N <= packed.size(0) * NR && N > (packed.size(0) - 1) * NR, "out_features ", N,
              " does not match the packed weight's ", packed.size(0), " panels of ", NR);
  const at::Tensor x2 = rows_of(x, K);
  const float* b = bias_data(bias, N);
  const int64_t M = x2.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M > 0) {
    const float* xp = x2.data_ptr<float>();
    const uint16_t* w = reinterpret_cast<const uint16_t*>(packed.data_ptr());
    float* yp = y.data_ptr<float>();
    const int64_t xs = x2.stride(0);
    const bool bf16 = packed.scalar_type() == at::kBFloat16;
    if (NR == 16)
      bf16 ? half_gemm<v8, 2, Bf16>(xp, xs, M, w, K, N, b, yp) : half_gemm<v8, 2, Fp16>(xp, xs, M, w, K, N, b, yp);
    else
      bf16 ? half_gemm<v16, 2, Bf16>(xp, xs, M, w, K, N, b, yp) : half_gemm<v16, 2, Fp16>(xp, xs, M, w, K, N, b, yp);
  }
  return y.view(output_sizes(x, N));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(compiled_llm_cpu, m) {
  m.def("pack_half_weight(Tensor weight, int panel=0) -> Tensor");
  m.def("half_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(compiled_llm_cpu, CPU, m) {
  m.impl("pack_half_weight", pack_half_weight);
  m.impl("half_linear", half_linear);
}
