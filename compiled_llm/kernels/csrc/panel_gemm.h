// What the GEMMs over packed panels of compressed weights share (cpu_half_gemm.cpp,
// cpu_quant_gemm.cpp): the split of y = x W^T over the thread pool, the store of a tile of y, and
// the checks of x and the bias. The panel layout is the fp32 GEMM's (cpu_gemm.cpp): NR output
// features per panel, K-major inside it, the last panel zero-padded.

#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>

#include "parallel.h"
#include "vec.h"

namespace compiled_llm_cpu {

// Few-row passes (decode) are bound by reading the weights: they ask for the weight bytes this far
// ahead, so that the loads in flight keep the memory bus busy across the 4 KB page boundaries where
// the hardware prefetcher starts over (the fp32 GEMM's distance, measured on a Zen 3). The hint is
// prefetcht1, as the fp32 GEMM's now is: on an AVX-512 Xeon VM (2 cores) a batch-1 pass over
// a 56 MB fp16 weight read 5.3 GB/s with nta, 13.3 with no prefetch, 15.9 with t1 (t0 and t2
// within noise of t1); Q8_0 6.4 -> 12.5 GB/s, Q4_1 5.7 -> 11.4.
constexpr int64_t kPrefetchBytes = 4096;
constexpr int kPrefetchLocality = 2;  // __builtin_prefetch's: 2 is prefetcht1

// Rows of x kept hot in L2 while panels stream past them (prefill); a decode batch is one chunk,
// so each panel is read from memory exactly once per call.
constexpr int64_t kRowChunkBytes = 192 * 1024;

// tile(m0, m1, p) computes rows [m0, m1) of y against panel p; this runs it for every panel and
// chunk of rows, on the pool. Items are (a chunk of rows, a run of panels of about `item_bytes`),
// rows outermost: a thread's consecutive items share their rows of x in L2, and its panels come
// in memory order. `rows_step` (the micro-kernel's rows) divides every chunk but the last.
template <class F>
inline void parallel_panels(int64_t M, int64_t K, int64_t panels, int64_t panel_bytes, int64_t item_bytes,
                            int64_t rows_step, const F& tile) {
  const int64_t chunk =
      std::max<int64_t>(rows_step, kRowChunkBytes / (K * static_cast<int64_t>(sizeof(float))) / rows_step * rows_step);
  const int64_t row_chunks = (M + chunk - 1) / chunk;
  const int64_t run = std::max<int64_t>(1, item_bytes / panel_bytes);
  const int64_t runs = (panels + run - 1) / run;
  parallel_chunks(row_chunks * runs, [&](int64_t item) {
    const int64_t m0 = item / runs * chunk, m1 = std::min(M, m0 + chunk);
    const int64_t p0 = item % runs * run, p1 = std::min(panels, p0 + run);
    for (int64_t p = p0; p < p1; p++) tile(m0, m1, p);
  });
}

// y[0:MR, 0:cols] = acc + bias: a full panel straight from the registers, the last, partial one
// through a buffer.
template <typename V, int NV, int MR>
inline void store_tile(V (&acc)[MR][NV], float* __restrict y, int64_t ys, int64_t cols,
                       const float* __restrict bias) {
  constexpr int L = lanes<V>();
  constexpr int NR = NV * L;
  if (cols == NR) {
    for (int m = 0; m < MR; m++)
      for (int j = 0; j < NV; j++) {
        V v = acc[m][j];
        if (bias) v += load<V>(bias + j * L);
        store<V>(y + m * ys + j * L, v);
      }
  } else {
    for (int m = 0; m < MR; m++) {
      float row[NR];
      for (int j = 0; j < NV; j++) store<V>(row + j * L, acc[m][j]);
      for (int64_t c = 0; c < cols; c++) y[m * ys + c] = row[c] + (bias ? bias[c] : 0.f);
    }
  }
}

// x [..., K] as float32 rows [M, K] with unit stride along K (a view where it can be).
inline at::Tensor rows_of(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, "x has ", x.dim() ? x.size(-1) : 0, " features, the weight ", K);
  at::Tensor x2 = x.reshape({-1, K});
  return x2.stride(1) == 1 ? x2 : x2.contiguous();
}

inline const float* bias_data(const c10::optional<at::Tensor>& bias, int64_t N) {
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == at::kFloat,
              "bias must be a contiguous float32 [out_features] (", N, "), got ", bias->scalar_type(), " ",
              bias->sizes());
  return bias->data_ptr<float>();
}

// y [..., N] for x [..., K].
inline std::vector<int64_t> output_sizes(const at::Tensor& x, int64_t N) {
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return sizes;
}

}  // namespace compiled_llm_cpu
