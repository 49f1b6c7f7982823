// Linear layers on CPUs with weights packed once at load: y = x W^T + b, float32.
//
// Why: a decode step streams every weight once, and `F.linear` (MKL's sgemv/sgemm on an
// unpacked [N, K] weight) reaches about half the machine's read bandwidth at 1-16 rows; a
// prefill is compute-bound, and MKL repacks the weight on every call. Packed here, a weight is
// read as one sequential stream per thread, and every row of x is computed from it while the
// weight panel is in L1/L2: decode costs the weight bytes once, whatever the batch, and prefill
// runs register-blocked FMAs without a repack.
//
// Layout: W [N, K] becomes panels [ceil(N / NR), K, NR] (NR output features, K-major inside a
// panel; the last panel zero-padded). NR is two native vectors: 16 floats with AVX2, 32 with
// AVX-512. The micro-kernel keeps an MR x NR block of y in registers and, for each k, loads NR
// weights once and broadcasts one x value per row. The code is written with GCC vector types,
// so the same source compiles to AVX2, AVX-512 or any other ISA: both panel widths are built on
// every machine (on AVX2 the 32-wide one runs as pairs of 256-bit ops), which lets the tests
// check the AVX-512 layout's logic on an AVX2 machine too. The packed width is chosen at build
// time from the compiler's target (-march=native: the CPU's own flags).

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>

#include "huge_pages.h"
#include "parallel.h"
#include "vec.h"

namespace {

using namespace compiled_llm_cpu;

constexpr int64_t kNativePanel = 2 * kNativeLanes;
// Decode passes (few rows) are bound by reading the weights: each k step asks for the weight line
// this far ahead, so that the loads in flight keep the memory bus busy across the 4 KB page
// boundaries where the hardware prefetcher starts over. 4 KB measured best on a Zen 3
// (`benchmarks/cpu_linear.py --rows 1`: 23.0 -> 21.0 ms a pass of SmolLM2's linears, prefetchnta
// against none; 1 KB and 8-16 KB were no better than none).
// The hint is prefetcht1 (locality 2), as the quantized and 16-bit GEMMs' (panel_gemm.h): on an
// AVX-512 Xeon VM (2 cores, load 5-9 from others), medians of 31 passes of SmolLM2's linears with
// the hints interleaved, 1 row: nta 143 ms, t1 82, t0 82, t2 80, none 87; 4 rows: nta 231, t1 98,
// t0 108, t2 98, none 124 (8 rows, which then took no prefetch, 137-140 for all: the control). nta
// there is 1.7-2.4x slower than any other choice; t1 was not measured on the Zen 3.
// Every row count prefetches (it was 4 rows at most): on the same VM, same method, 21 passes,
// 8 rows 144 -> 129 ms, 16 181 -> 163, 32 251 -> 226, 128 694 -> 646. Distance 2 KB measured as
// 4 KB there (1 row 79 against 81 ms), 8 KB worse (87).
constexpr int64_t kPrefetchBytes = 4096;
constexpr int kPrefetchLocality = 2;  // __builtin_prefetch's: 2 is prefetcht1, 0 prefetchnta

// y[0:MR, 0:cols] = x[0:MR, :] . panel + bias, for one panel (NV vectors of output features).
// Small row counts split k into KU interleaved streams with their own accumulators, so the FMA
// latency chains do not bound a memory-bound pass.
template <typename V, int NV, int MR>
inline void micro_kernel(const float* __restrict x, int64_t xs, const float* __restrict panel, int64_t K,
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
      const float* w = panel + (k + u) * NR;
      __builtin_prefetch(w + kPrefetchBytes / sizeof(float), 0, kPrefetchLocality);
      V wv[NV];
#pragma GCC unroll 4
      for (int j = 0; j < NV; j++) wv[j] = load<V>(w + j * L);
#pragma GCC unroll 16
      for (int m = 0; m < MR; m++) {
        const V a = splat<V>(x[m * xs + k + u]);
#pragma GCC unroll 4
        for (int j = 0; j < NV; j++) acc[u][m][j] += a * wv[j];
      }
    }
  }
  for (; k < K; k++) {  // K odd with KU = 2
    const float* w = panel + k * NR;
    for (int m = 0; m < MR; m++) {
      const V a = splat<V>(x[m * xs + k]);
      for (int j = 0; j < NV; j++) acc[0][m][j] += a * load<V>(w + j * L);
    }
  }
  for (int u = 1; u < KU; u++)
    for (int m = 0; m < MR; m++)
      for (int j = 0; j < NV; j++) acc[0][m][j] += acc[u][m][j];
  if (cols == NR) {
    for (int m = 0; m < MR; m++)
      for (int j = 0; j < NV; j++) {
        V v = acc[0][m][j];
        if (bias) v += load<V>(bias + j * L);
        store<V>(y + m * ys + j * L, v);
      }
  } else {  // the last, partial panel
    for (int m = 0; m < MR; m++) {
      float row[NR];
      for (int j = 0; j < NV; j++) store<V>(row + j * L, acc[0][m][j]);
      for (int64_t c = 0; c < cols; c++) y[m * ys + c] = row[c] + (bias ? bias[c] : 0.f);
    }
  }
}

// Rows per micro-kernel call: as many as the registers hold (MR x NV accumulators, NV weight
// vectors and one broadcast): 6 x 16 floats in 16 ymm registers, 12 x 32 in 32 zmm registers.
template <typename V>
constexpr int max_rows() {
  return lanes<V>() == 16 && kNativePanel == 32 ? 12 : 6;
}

template <typename V, int NV>
void rows_block(int rows, const float* x, int64_t xs, const float* panel, int64_t K, float* y, int64_t ys,
                int64_t cols, const float* bias) {
  switch (rows) {
#define CASE(R) \
  case R:       \
    return micro_kernel<V, NV, R>(x, xs, panel, K, y, ys, cols, bias);
    CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6)
#undef CASE
  }
  if constexpr (max_rows<V>() > 6) {
    switch (rows) {
#define CASE(R) \
  case R:       \
    return micro_kernel<V, NV, R>(x, xs, panel, K, y, ys, cols, bias);
      CASE(7) CASE(8) CASE(9) CASE(10) CASE(11) CASE(12)
#undef CASE
    }
  }
}

// Rows of x kept hot in L2 while panels stream past them (prefill); a decode batch is one chunk,
// so each weight panel is read from memory exactly once per call.
constexpr int64_t kChunkBytes = 192 * 1024;
// Weight bytes per work item: big enough to amortise claiming it, small enough to balance.
constexpr int64_t kItemBytes = 128 * 1024;

template <typename V, int NV>
void packed_gemm(const float* x, int64_t xs, int64_t M, const float* packed, int64_t K, int64_t N,
                 const float* bias, float* y) {
  constexpr int64_t NR = NV * lanes<V>();
  constexpr int MR = max_rows<V>();
  const int64_t panels = (N + NR - 1) / NR;
  const int64_t chunk = std::max<int64_t>(MR, kChunkBytes / (K * static_cast<int64_t>(sizeof(float))) / MR * MR);
  const int64_t row_chunks = (M + chunk - 1) / chunk;
  const int64_t group = std::max<int64_t>(1, kItemBytes / (K * NR * static_cast<int64_t>(sizeof(float))));
  const int64_t groups = (panels + group - 1) / group;
  // Items: (chunk of rows, group of panels), rows outermost: a thread's consecutive items share
  // its rows of x in L2, and its panels come in memory order.
  parallel_chunks(row_chunks * groups, [&](int64_t item) {
    const int64_t m0 = item / groups * chunk, m1 = std::min(M, m0 + chunk);
    const int64_t p0 = item % groups * group, p1 = std::min(panels, p0 + group);
    for (int64_t p = p0; p < p1; p++) {
      const float* panel = packed + p * K * NR;
      const int64_t n0 = p * NR, cols = std::min(NR, N - n0);
      const float* b = bias ? bias + n0 : nullptr;
      for (int64_t m = m0; m < m1; m += MR) {
        const int rows = static_cast<int>(std::min<int64_t>(MR, m1 - m));
        rows_block<V, NV>(rows, x + m * xs, xs, panel, K, y + m * N + n0, N, cols, b);
      }
    }
  });
}

at::Tensor pack_linear_weight(const at::Tensor& weight, int64_t panel) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "weight must be a 2-D float32 tensor");
  if (panel <= 0) panel = kNativePanel;
  TORCH_CHECK(panel == 16 || panel == 32, "panel width must be 16 or 32, got ", panel);
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t panels = (N + panel - 1) / panel;
  auto padded = at::zeros({panels * panel, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  // [panels, NR, K] -> [panels, K, NR]
  at::Tensor packed = huge_page_empty({panels, K, panel}, weight.options());
  packed.copy_(padded.view({panels, panel, K}).transpose(1, 2));
  return packed;
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         int64_t out_features) {
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == at::kFloat,
              "packed weight must come from pack_linear_weight");
  const int64_t NR = packed.size(2), K = packed.size(1), N = out_features;
  TORCH_CHECK(N > 0 && N <= packed.size(0) * NR && N > (packed.size(0) - 1) * NR,
              "out_features ", N, " does not match the packed weight's ", packed.size(0), " panels of ", NR);
  TORCH_CHECK(x.size(-1) == K, "x has ", x.size(-1), " features, the weight ", K);
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be float32");
  if (bias.has_value())
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == at::kFloat,
                "bias must be a contiguous float32 [out_features]");
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  at::Tensor x2 = x.reshape({-1, K});
  if (x2.stride(1) != 1) x2 = x2.contiguous();
  const int64_t M = x2.size(0);
  auto y = at::empty({M, N}, x.options());
  if (M > 0) {
    const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
    const float* xp = x2.data_ptr<float>();
    if (NR == 16)
      packed_gemm<v8, 2>(xp, x2.stride(0), M, packed.data_ptr<float>(), K, N, b, y.data_ptr<float>());
    else
      packed_gemm<v16, 2>(xp, x2.stride(0), M, packed.data_ptr<float>(), K, N, b, y.data_ptr<float>());
  }
  return y.view(sizes);
}

// SwiGLU's gate folded into the down projection: silu(x[:, :I]) * x[:, I:] is computed here
// (vectorised, exp from vec.h) and fed to the GEMM in the same call, so a layer's MLP is two
// calls instead of three. silu(g) = g * sigmoid(g), with sigmoid from e = exp(-|g|) (never
// overflows): 1 / (1 + e) for g >= 0, e / (1 + e) below.
template <typename V>
void silu_and_mul_rows(const float* x, int64_t x_stride, int64_t M, int64_t I, float* out) {
  constexpr int L = lanes<V>();
  const V one = splat<V>(1.f), zero = splat<V>(0.f);
  for (int64_t m = 0; m < M; m++) {
    const float* gate = x + m * x_stride;
    const float* up = gate + I;
    float* o = out + m * I;
    int64_t i = 0;
    for (; i + L <= I; i += L) {
      const V g = load<V>(gate + i);
      const V e = exp_nonpositive<V>(g < zero ? g : -g);
      const V sigmoid = (g < zero ? e : one) / (one + e);
      store<V>(o + i, g * sigmoid * load<V>(up + i));
    }
    for (; i < I; i++) o[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
  }
}

// (y, act): the product of the gate and up halves as well, for a LoRA adapter's shrink on the down
// projection, which reads the projection's input.
std::tuple<at::Tensor, at::Tensor> silu_and_mul_packed_linear_act(const at::Tensor& x, const at::Tensor& packed,
                                                                  const c10::optional<at::Tensor>& bias,
                                                                  int64_t out_features) {
  const int64_t I = x.size(-1) / 2;
  TORCH_CHECK(x.size(-1) == 2 * I, "x must hold gate and up halves, got ", x.size(-1), " features");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be float32");
  at::Tensor x2 = x.reshape({-1, 2 * I});
  if (x2.stride(1) != 1) x2 = x2.contiguous();
  auto sizes = x.sizes().vec();
  sizes.back() = I;
  at::Tensor act = at::empty({x2.size(0), I}, x.options());
  using V = std::conditional_t<kNativeLanes == 16, v16, v8>;
  silu_and_mul_rows<V>(x2.data_ptr<float>(), x2.stride(0), x2.size(0), I, act.data_ptr<float>());
  at::Tensor act_view = act.view(sizes);
  return {packed_linear(act_view, packed, bias, out_features), act_view};
}

at::Tensor silu_and_mul_packed_linear(const at::Tensor& x, const at::Tensor& packed,
                                      const c10::optional<at::Tensor>& bias, int64_t out_features) {
  return std::get<0>(silu_and_mul_packed_linear_act(x, packed, bias, out_features));
}

int64_t native_panel_width() { return kNativePanel; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(compiled_llm_cpu, m) {
  m.def("pack_linear_weight(Tensor weight, int panel=0) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  m.def("silu_and_mul_packed_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  m.def("silu_and_mul_packed_linear_act(Tensor x, Tensor packed, Tensor? bias, int out_features) -> (Tensor, Tensor)");
  m.def("native_panel_width() -> int");
}

TORCH_LIBRARY_IMPL(compiled_llm_cpu, CPU, m) {
  m.impl("pack_linear_weight", pack_linear_weight);
  m.impl("packed_linear", packed_linear);
  m.impl("silu_and_mul_packed_linear", silu_and_mul_packed_linear);
  m.impl("silu_and_mul_packed_linear_act", silu_and_mul_packed_linear_act);
}

TORCH_LIBRARY_IMPL(compiled_llm_cpu, CompositeExplicitAutograd, m) {
  m.impl("native_panel_width", native_panel_width);
}
