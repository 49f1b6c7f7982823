// Linear layers over 8- and 4-bit weights on CPUs: y = x W^T + b with float32 activations, the
// weights de-quantized in registers inside the GEMM, never into a float32 copy.
//
// Why: a decode step streams every weight once, so its time is the weight bytes over the read
// bandwidth; 8-bit weights are about a quarter of float32's bytes, 4-bit about a sixth (with
// their scales). The formats GGUF files ship (Q8_0, Q4_0, Q4_1) and the weight-only int8 and int4
// of gpt-fast and torchao are one format here: per output feature n and group g of `group_size`
// consecutive inputs (the last one shorter where K is not a multiple: 576 = 4 x 128 + 64),
//     w[n, k] = scale[n, g] * q[n, k]  (+ min[n, g] for 4-bit),
// q int8 for 8-bit (symmetric), 0..15 for 4-bit (asymmetric: Q4_1's d q + m; Q4_0's (q - 8) d is
// d q + (-8 d), exact in float32).
//
// Scales and mins are fp16 or float32, as given: GGUF's d and m are fp16 in the file, and kept so a
// Q4_1 weight reads 0.625 bytes like llama.cpp's, not 0.75 with float32 ones (20% more bytes for
// a step bound by reading them; Q8_0 1.0625 not 1.125). Weights quantized at load from float ones
// keep float32 scales (quantized_reference.py says why). A packed weight does not record which:
// the two layouts' panel sizes never coincide for K > 0, so quantized_linear tells them apart by
// the packed tensor's width, and callers pass the same arguments for both.
//
// Layout: panels of NR output features as in the fp32 GEMM (cpu_gemm.cpp), a uint8 tensor
// [panels, panel bytes]. Inside a panel, one block per group: the NR scales, the NR mins (4-bit),
// then the group's q at each k for the NR features (NR bytes; 4-bit: NR / 2 bytes, byte i holding
// feature i in its low nibble and feature NR / 2 + i in its high one, so one zero-extension and a
// mask or a shift give both vectors). A pass reads each panel as one sequential stream. (Blocks
// are multiples of 64 bytes except 8-bit ones with fp16 scales in 16-wide panels: 32 + 16 G; the
// loads are unaligned ones anyway.)
//
// Two micro-kernels, both NR wide:
// - few rows (decode): per group, sum_k (s q_k + m) x_k = s * sum_k q_k x_k + m * sum_k x_k, so the
//   inner loop only converts q to float and multiplies it by x; each group ends with one FMA by
//   the scales and one by the mins times the row's sum of x over the group (summed once per call).
//   Its accumulators are twice the rows', which bounds it to a few rows.
// - many rows (prefill): each k's weights are de-quantized once (convert, one FMA with the
//   group's scales and mins held in registers) and used by every row of the block, as the fp32
//   micro-kernel uses its loaded weights: a few operations per weight vector, shared by up to 12
//   rows.
// A call with at most `few_rows` rows takes the first, and so does one of up to twice as many
// (in blocks; see quantized_gemm); any other the second.
// On AVX2, 4-bit weights in 16-wide panels take neither: they multiply activations quantized to
// int8 in integer lanes (q8_gemm below), at every row count; with AVX512-VNNI (and VBMI) so do
// 8- and 4-bit weights in 32-wide panels (vnni_gemm).

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <type_traits>
#include <vector>

#include "huge_pages.h"
#include "panel_gemm.h"
#include "parallel.h"
#include "vec.h"
#include "widen.h"

namespace {

using namespace compiled_llm_cpu;

constexpr int64_t kNativePanel = 2 * kNativeLanes;
// Packed bytes per work item. Smaller than the fp32 GEMM's 128 KB: a byte of 4-bit weights is four
// times the arithmetic of a byte of floats, and a decode projection must still split into enough
// items for every thread.
constexpr int64_t kItemBytes = 32 * 1024;

// Bytes of one group's block in a panel of NR features: the scales (and mins), `scale_size` bytes
// each, then the q values of its `length` inputs; and of a whole panel.
constexpr int64_t scale_bytes(int64_t NR, int64_t bits, int64_t scale_size) { return NR * scale_size * (bits == 4 ? 2 : 1); }
constexpr int64_t block_bytes(int64_t NR, int64_t bits, int64_t scale_size, int64_t length) {
  return scale_bytes(NR, bits, scale_size) + length * NR * bits / 8;
}
constexpr int64_t group_count(int64_t K, int64_t G) { return (K + G - 1) / G; }
constexpr int64_t panel_bytes(int64_t NR, int64_t bits, int64_t scale_size, int64_t K, int64_t G) {
  return group_count(K, G) * scale_bytes(NR, bits, scale_size) + K * NR * bits / 8;
}

// The NV weight vectors of one k, q converted to float (not yet scaled).
template <typename V, int NV, int Bits>
inline void load_q(const uint8_t* __restrict p, V (&w)[NV]) {
  constexpr int L = lanes<V>();
  if constexpr (Bits == 8) {
    for (int j = 0; j < NV; j++)
      w[j] = __builtin_convertvector(widen_s8<V>(reinterpret_cast<const int8_t*>(p) + j * L), V);
  } else {
    static_assert(NV % 2 == 0, "4-bit panels hold their vectors in pairs (low and high nibbles)");
    for (int j = 0; j < NV; j += 2) {
      const ints_of<V> both = widen_u8<V>(p + j / 2 * L);
      if constexpr (L == 16 && kNativeLanes == 16) {
        // A 16-float permute (vpermps) reads only the low 4 bits of each index: a lookup in the table
        // of 0..15 is the mask and the conversion in one instruction, on the port the FMAs use less.
        const V values = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
        w[j] = __builtin_shuffle(values, both);
        w[j + 1] = __builtin_shuffle(values, both >> 4);
      } else {
        w[j] = __builtin_convertvector(both & 15, V);
        w[j + 1] = __builtin_convertvector(both >> 4, V);
      }
    }
  }
}

// Few-row passes ask for the next groups' bytes at the start of each group (panel_gemm.h).
inline void prefetch_bytes(const uint8_t* p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i, 0, kPrefetchLocality);
}

// Rows per micro-kernel call, as many as the registers hold (32 zmm with AVX-512, 16 ymm with
// AVX2). Many rows: MR x NV accumulators, NV weights, NV scales, NV mins, one broadcast. Few rows:
// twice the accumulators (the group's and the total), NV weights, one broadcast.
template <typename V>
constexpr int many_rows() {
  return lanes<V>() == 16 && kNativePanel == 32 ? 12 : 4;
}
template <typename V>
constexpr int few_rows() {
  return lanes<V>() == 16 && kNativePanel == 32 ? 6 : 3;
}

// y[0:MR, 0:cols] = x[0:MR, :] . dequant(panel) + bias, group by group through sums of q x.
// `xsum` holds each row's sums of x per group (row stride `groups`).
template <typename V, int NV, int MR, int Bits, typename S>
void few_rows_kernel(const float* __restrict x, int64_t xs, const float* __restrict xsum, const uint8_t* __restrict panel,
                     int64_t K, int64_t G, float* __restrict y, int64_t ys, int64_t cols,
                     const float* __restrict bias) {
  constexpr int L = lanes<V>();
  constexpr int NR = NV * L;
  constexpr int64_t step = NR * Bits / 8;  // q bytes per k
  // Few rows are bound by memory and the conversions; KU interleaved streams of k with their own
  // accumulators keep the FMA latency chains from bounding them.
  constexpr int KU = MR <= 2 ? 2 : 1;
  const int64_t block = block_bytes(NR, Bits, sizeof(S), G), groups = group_count(K, G);
  V total[MR][NV];
  for (int m = 0; m < MR; m++)
    for (int j = 0; j < NV; j++) total[m][j] = V{};
  for (int64_t g = 0; g < groups; g++) {
    const uint8_t* blk = panel + g * block;
    prefetch_bytes(blk + kPrefetchBytes, block);
    const uint8_t* q = blk + scale_bytes(NR, Bits, sizeof(S));
    const float* xg = x + g * G;
    const int64_t length = std::min(G, K - g * G);
    V acc[KU][MR][NV];
    for (int u = 0; u < KU; u++)
      for (int m = 0; m < MR; m++)
        for (int j = 0; j < NV; j++) acc[u][m][j] = V{};
    for (int64_t k = 0; k < length; k += KU) {  // a multiple of 32
#pragma GCC unroll 2
      for (int u = 0; u < KU; u++) {
        V w[NV];
        load_q<V, NV, Bits>(q + (k + u) * step, w);
#pragma GCC unroll 8
        for (int m = 0; m < MR; m++) {
          const V a = splat<V>(xg[m * xs + k + u]);
#pragma GCC unroll 4
          for (int j = 0; j < NV; j++) acc[u][m][j] += a * w[j];
        }
      }
    }
    const S* scale = reinterpret_cast<const S*>(blk);
    for (int j = 0; j < NV; j++) {
      const V s = load_widened<V>(scale + j * L);
      for (int m = 0; m < MR; m++) {
        V sum = acc[0][m][j];
        for (int u = 1; u < KU; u++) sum += acc[u][m][j];
        total[m][j] += s * sum;
      }
    }
    if constexpr (Bits == 4) {
      const S* mins = scale + NR;
      for (int j = 0; j < NV; j++) {
        const V mn = load_widened<V>(mins + j * L);
        for (int m = 0; m < MR; m++) total[m][j] += mn * splat<V>(xsum[m * groups + g]);
      }
    }
  }
  store_tile<V, NV, MR>(total, y, ys, cols, bias);
}

// y[0:MR, 0:cols] = x[0:MR, :] . dequant(panel) + bias, each k's weights de-quantized once for
// all MR rows.
template <typename V, int NV, int MR, int Bits, typename S>
void many_rows_kernel(const float* __restrict x, int64_t xs, const uint8_t* __restrict panel, int64_t K, int64_t G,
                      float* __restrict y, int64_t ys, int64_t cols, const float* __restrict bias) {
  constexpr int L = lanes<V>();
  constexpr int NR = NV * L;
  constexpr int64_t step = NR * Bits / 8;
  const int64_t block = block_bytes(NR, Bits, sizeof(S), G), groups = group_count(K, G);
  V acc[MR][NV];
  for (int m = 0; m < MR; m++)
    for (int j = 0; j < NV; j++) acc[m][j] = V{};
  for (int64_t g = 0; g < groups; g++) {
    const uint8_t* blk = panel + g * block;
    prefetch_bytes(blk + kPrefetchBytes, block);
    const S* scale = reinterpret_cast<const S*>(blk);
    const uint8_t* q = blk + scale_bytes(NR, Bits, sizeof(S));
    const float* xg = x + g * G;
    const int64_t length = std::min(G, K - g * G);
    V s[NV], mn[NV];
    for (int j = 0; j < NV; j++) {
      s[j] = load_widened<V>(scale + j * L);
      mn[j] = Bits == 4 ? load_widened<V>(scale + NR + j * L) : V{};
    }
    for (int64_t k = 0; k < length; k++) {
      V w[NV];
      load_q<V, NV, Bits>(q + k * step, w);
      for (int j = 0; j < NV; j++) w[j] = Bits == 4 ? w[j] * s[j] + mn[j] : w[j] * s[j];
#pragma GCC unroll 16
      for (int m = 0; m < MR; m++) {
        const V a = splat<V>(xg[m * xs + k]);
#pragma GCC unroll 4
        for (int j = 0; j < NV; j++) acc[m][j] += a * w[j];
      }
    }
  }
  store_tile<V, NV, MR>(acc, y, ys, cols, bias);
}

// One block of `rows` rows (at most many_rows) against one panel, by the kernel the call's row
// count picks (`few`: every call's rows fit few_rows).
template <typename V, int NV, int Bits, typename S>
void rows_block(bool few, int rows, const float* x, int64_t xs, const float* xsum, const uint8_t* panel, int64_t K,
                int64_t G, float* y, int64_t ys, int64_t cols, const float* bias) {
  if (few) {
    switch (rows) {
#define CASE(R) \
  case R:       \
    if constexpr (R <= few_rows<V>()) return few_rows_kernel<V, NV, R, Bits, S>(x, xs, xsum, panel, K, G, y, ys, cols, bias);
      CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6)
#undef CASE
    }
    return;
  }
  switch (rows) {
#define CASE(R) \
  case R:       \
    if constexpr (R <= many_rows<V>()) return many_rows_kernel<V, NV, R, Bits, S>(x, xs, panel, K, G, y, ys, cols, bias);
    CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) CASE(9) CASE(10) CASE(11) CASE(12)
#undef CASE
  }
}

// Each row's sums of x over each group: xsum[m * groups + g].
template <typename V>
std::vector<float> group_sums(const float* x, int64_t xs, int64_t M, int64_t K, int64_t G) {
  constexpr int L = lanes<V>();
  const int64_t groups = group_count(K, G);
  std::vector<float> sums(M * groups);
  for (int64_t m = 0; m < M; m++)
    for (int64_t g = 0; g < groups; g++) {
      const float* p = x + m * xs + g * G;
      const int64_t length = std::min(G, K - g * G);  // a multiple of 32
      V acc = V{};
      for (int64_t k = 0; k < length; k += L) acc += load<V>(p + k);
      sums[m * groups + g] = reduce_sum(acc);
    }
  return sums;
}

#if defined(__AVX2__)
constexpr int64_t kQ8Block = 32;

// One block of 32 inputs quantized to int8, as both int8-activation paths (and
// quantized_reference.int8_activations) do it: d = max |x| / 127, q = round(x * (127 / max |x|)).
// Returns d; `qsum` gets the sum of q.
inline float quantize_block(const float* __restrict p, int8_t* __restrict q, int* qsum) {
  float amax = 0.f;
  for (int64_t i = 0; i < kQ8Block; i++) amax = std::max(amax, std::fabs(p[i]));
  const float d = amax / 127.f, inverse = amax > 0.f ? 127.f / amax : 0.f;
  int sum = 0;
  for (int64_t i = 0; i < kQ8Block; i++) {
    q[i] = static_cast<int8_t>(std::nearbyint(p[i] * inverse));
    sum += q[i];
  }
  *qsum = sum;
  return d;
}

// 4-bit weights in 16-wide panels times activations quantized to int8, on AVX2: llama.cpp's way
// (its Q4 x Q8 dot products). Each row of x is cut into blocks of 32 inputs, each block scaled to
// int8 by its largest magnitude (d = max |x| / 127, q = round(x / d)); then a weight's 4-bit q and
// the row's 8-bit q multiply in 16-bit integer lanes (vpmaddubsw: 16 products a lane pair, summed
// in pairs), exact, and only each block's sum is converted to float and scaled by d. Per 64
// weights of a panel that is four operations to unpack the nibbles, shared by every row, and three
// per row (multiply-add, add, and an eighth of the block's conversion); the float kernels above
// spend ten per 64 weights on conversions and eight FMAs per row. So a verification of 5 rows
// costs little more than a decode of 1, and a prefill less than the float kernel's.
// The mins' term takes the sum of the quantized x too (llama.cpp's Q8_1 carries it), so that y is
// exactly W x' for the quantized x': then its error is W (x' - x), where with the float sum of x
// it would be (s q) (x' - x), whose all-positive s q (Q4_1's q is 0..15, its min about -8 s) make
// the rounding errors add up (perplexity of the bundled Q4_1 model +1.0% against +0.3%). Every row's
// result depends only on that row (the integer sums are exact and the float steps come in one
// order), never on how many rows the call has: a request's logits are the same whether verified
// with drafts or decoded alone, which greedy speculation's exactness leans on.
constexpr int kQ8Rows = 4;  // rows per micro-kernel call: 2 accumulators a row, 16 ymm registers

// x's rows quantized, as the micro-kernel reads them: for each 4 inputs k..k+3, one vector whose
// low 128-bit lane holds the bytes (q[k], q[k+1]) eight times and whose high lane (q[k+2], q[k+3])
// (the pairs vpmaddubsw multiplies with a panel's two k in each lane); and each block's scale.
struct Q8Rows {
  std::unique_ptr<__m256i[]> pairs;  // [M][K / 4], every entry written (no zeroing pass first)
  std::vector<float> scale;    // [M][K / 32]
  std::vector<float> sum;      // [M][weight groups]: the sum of d q over the group's inputs
};

Q8Rows quantize_rows(const float* x, int64_t xs, int64_t M, int64_t K, int64_t G) {
  const int64_t chunks = K / 4, blocks = K / kQ8Block, groups = group_count(K, G);
  Q8Rows r{std::unique_ptr<__m256i[]>(new __m256i[M * chunks]), std::vector<float>(M * blocks),
           std::vector<float>(M * groups, 0.f)};
  auto row = [&](int64_t m) {
    for (int64_t b = 0; b < blocks; b++) {
      int8_t q[kQ8Block];
      int qsum;
      const float d = quantize_block(x + m * xs + b * kQ8Block, q, &qsum);
      r.scale[m * blocks + b] = d;
      r.sum[m * groups + b * kQ8Block / G] += d * static_cast<float>(qsum);
      for (int64_t c = 0; c < kQ8Block / 4; c++) {
        const uint8_t* u = reinterpret_cast<const uint8_t*>(q) + 4 * c;
        const short low = static_cast<short>(u[0] | u[1] << 8), high = static_cast<short>(u[2] | u[3] << 8);
        r.pairs[m * chunks + b * (kQ8Block / 4) + c] = _mm256_setr_m128i(_mm_set1_epi16(low), _mm_set1_epi16(high));
      }
    }
  };
  if (M * K < (1 << 16)) {  // a decode's few rows: not worth waking the pool
    for (int64_t m = 0; m < M; m++) row(m);
  } else {
    parallel_chunks(M, row);
  }
  return r;
}

// The 8 int32 sums of a vector of 16-bit lanes' two halves: feature i's (k, k+1) and (k+2, k+3) terms.
inline v8 lane_sums(__m256i a) {
  const __m256i sum = _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(a)),
                                       _mm256_cvtepi16_epi32(_mm256_extracti128_si256(a, 1)));
  return (v8)_mm256_cvtepi32_ps(sum);
}

// y[0:MR, 0:cols] = x[0:MR, :] . dequant(panel) + bias for a 16-wide 4-bit panel, x given as Q8Rows
// (`pairs` and `scale` at this block's first row; row strides `chunks` and `blocks`).
template <int MR, typename S>
void q8_rows_kernel(const __m256i* __restrict pairs, int64_t chunks, const float* __restrict xscale, int64_t blocks,
                    const float* __restrict xsum, const uint8_t* __restrict panel, int64_t K, int64_t G,
                    float* __restrict y, int64_t ys, int64_t cols, const float* __restrict bias) {
  constexpr int NR = 16;
  const int64_t block = block_bytes(NR, 4, sizeof(S), G), groups = group_count(K, G);
  const __m256i interleave = _mm256_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15,
                                              0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
  const __m256i nibble = _mm256_set1_epi8(15);
  // The float sums live in memory, touched once per 32 inputs: the 16 registers hold the integer
  // accumulators, the two constants and the weights.
  alignas(32) float total[MR][NR] = {};
  alignas(32) float sums[MR][NR];
  for (int64_t g = 0; g < groups; g++) {
    const uint8_t* blk = panel + g * block;
    prefetch_bytes(blk + kPrefetchBytes, block);
    const uint8_t* q = blk + scale_bytes(NR, 4, sizeof(S));
    const int64_t length = std::min(G, K - g * G);  // a multiple of 32
    for (int m = 0; m < MR; m++)
      for (int j = 0; j < 2; j++) store<v8>(sums[m] + 8 * j, v8{});
    for (int64_t sub = 0; sub < length; sub += kQ8Block) {
      // 8 steps of 4 inputs: each 16-bit lane sums at most 8 x 2 products of 15 x 127 (30480 < 2^15).
      __m256i low[MR], high[MR];
      for (int m = 0; m < MR; m++) low[m] = high[m] = _mm256_setzero_si256();
      const __m256i* xp = pairs + (g * G + sub) / 4;
      const uint8_t* qs = q + sub * NR / 2;
#pragma GCC unroll 1
      for (int c = 0; c < kQ8Block / 4; c++) {
        // 4 k's of 8 bytes (feature i in the low nibble of byte i, feature 8 + i in its high one),
        // regrouped per 128-bit lane as each feature's two k side by side.
        const __m256i both =
            _mm256_shuffle_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 4 * c * NR / 2)), interleave);
        const __m256i w0 = _mm256_and_si256(both, nibble), w1 = _mm256_and_si256(_mm256_srli_epi16(both, 4), nibble);
#pragma GCC unroll 4
        for (int m = 0; m < MR; m++) {
          const __m256i a = _mm256_load_si256(xp + m * chunks + c);
          low[m] = _mm256_add_epi16(low[m], _mm256_maddubs_epi16(w0, a));
          high[m] = _mm256_add_epi16(high[m], _mm256_maddubs_epi16(w1, a));
        }
      }
      const int64_t b = (g * G + sub) / kQ8Block;
      for (int m = 0; m < MR; m++) {
        const v8 d = splat<v8>(xscale[m * blocks + b]);
        store<v8>(sums[m], load<v8>(sums[m]) + lane_sums(low[m]) * d);
        store<v8>(sums[m] + 8, load<v8>(sums[m] + 8) + lane_sums(high[m]) * d);
      }
    }
    const S* scale = reinterpret_cast<const S*>(blk);
    for (int j = 0; j < 2; j++) {
      const v8 s = load_widened<v8>(scale + j * 8), mn = load_widened<v8>(scale + NR + j * 8);
      for (int m = 0; m < MR; m++) {
        v8 t = load<v8>(total[m] + 8 * j);
        t += s * load<v8>(sums[m] + 8 * j);
        t += mn * splat<v8>(xsum[m * groups + g]);
        store<v8>(total[m] + 8 * j, t);
      }
    }
  }
  v8 out[MR][2];
  for (int m = 0; m < MR; m++)
    for (int j = 0; j < 2; j++) out[m][j] = load<v8>(total[m] + 8 * j);
  store_tile<v8, 2, MR>(out, y, ys, cols, bias);
}

template <typename S>
void q8_gemm(const float* x, int64_t xs, int64_t M, const uint8_t* packed, int64_t K, int64_t N, int64_t G,
             const float* bias, float* y) {
  constexpr int64_t NR = 16;
  const int64_t groups = group_count(K, G), panels = (N + NR - 1) / NR, chunks = K / 4, blocks = K / kQ8Block;
  const int64_t stride = panel_bytes(NR, 4, sizeof(S), K, G);
  const Q8Rows rows_q8 = quantize_rows(x, xs, M, K, G);
  parallel_panels(M, K, panels, stride, kItemBytes, kQ8Rows, [&](int64_t m0, int64_t m1, int64_t p) {
    const uint8_t* panel = packed + p * stride;
    const int64_t n0 = p * NR, cols = std::min(NR, N - n0);
    const float* b = bias ? bias + n0 : nullptr;
    for (int64_t m = m0; m < m1; m += kQ8Rows) {
      const __m256i* xp = rows_q8.pairs.get() + m * chunks;
      const float* xd = rows_q8.scale.data() + m * blocks;
      const float* xg = rows_q8.sum.data() + m * groups;
      float* yp = y + m * N + n0;
      switch (std::min<int64_t>(kQ8Rows, m1 - m)) {
        case 1: q8_rows_kernel<1, S>(xp, chunks, xd, blocks, xg, panel, K, G, yp, N, cols, b); break;
        case 2: q8_rows_kernel<2, S>(xp, chunks, xd, blocks, xg, panel, K, G, yp, N, cols, b); break;
        case 3: q8_rows_kernel<3, S>(xp, chunks, xd, blocks, xg, panel, K, G, yp, N, cols, b); break;
        default: q8_rows_kernel<4, S>(xp, chunks, xd, blocks, xg, panel, K, G, yp, N, cols, b); break;
      }
    }
  });
}
#endif

#if defined(__AVX2__) && defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
#define COMPILED_LLM_VNNI 1
// 8- and 4-bit weights in 32-wide panels (AVX-512's layout) times activations quantized to int8 as
// above, with AVX512-VNNI's vpdpbusd: one instruction multiplies 64 unsigned bytes by 64 signed
// ones and adds each 4 products into an int32 lane. A lane must hold 4 consecutive k of one
// feature, so each 4 k of a panel are regrouped with one byte permute (AVX512-VBMI) per 16
// features: 4-bit weights (0..15, unsigned) are split into nibbles first and multiply the signed
// activations; 8-bit weights (signed) take the activations offset by 128 as the unsigned side,
// and each block's sum of 128 w, counted once per panel for all rows, is taken off again. About 5
// operations per 128 weights shared by every row, and 2 per row (AVX2's path spends 4 and 3 per
// 64), so a verification of 5 rows costs little more than a decode of 1, and a batch of 32 far
// less than the float kernels.
// As on AVX2, each row's result depends only on that row (exact integer sums, float steps in one
// fixed order), so a request's logits do not depend on the batch it is computed in.

// Rows per micro-kernel call: 2 int32 accumulators a row in registers (the float totals, touched
// once per 32 k, in memory), so that a verification's 1 + k rows unpack each panel once.
constexpr int kVnniRows = 8;

// x's rows quantized: q [M][K] int8 (offset by 128 into uint8 for 8-bit weights), scale
// [M][K / 32], and (4-bit) each weight group's sum of d q, for the mins.
struct Int8Rows {
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<float> sum;
};

Int8Rows quantize_rows_int8(const float* x, int64_t xs, int64_t M, int64_t K, int64_t G, bool offset) {
  const int64_t blocks = K / kQ8Block, groups = group_count(K, G);
  Int8Rows r{std::vector<int8_t>(M * K), std::vector<float>(M * blocks), std::vector<float>(M * groups, 0.f)};
  auto row = [&](int64_t m) {
    for (int64_t b = 0; b < blocks; b++) {
      int8_t* q = r.q.data() + m * K + b * kQ8Block;
      int qsum;
      const float d = quantize_block(x + m * xs + b * kQ8Block, q, &qsum);
      r.scale[m * blocks + b] = d;
      r.sum[m * groups + b * kQ8Block / G] += d * static_cast<float>(qsum);
      if (offset)  // q + 128 as an unsigned byte is q with its top bit flipped
        for (int64_t i = 0; i < kQ8Block; i++) q[i] = static_cast<int8_t>(static_cast<uint8_t>(q[i]) ^ 0x80);
    }
  };
  if (M * K < (1 << 16)) {  // a decode's few rows: not worth waking the pool
    for (int64_t m = 0; m < M; m++) row(m);
  } else {
    parallel_chunks(M, row);
  }
  return r;
}

// The byte permutes that regroup 4 k of a panel into 16 lanes of 4 k each (byte 4 i + k of the
// result): for 4-bit weights, from one 64-byte vector of nibbles (byte 16 k + i: feature i, or
// feature 16 + i in the high nibbles); for 8-bit, from two (k, k + 1 and k + 2, k + 3; byte 32 k +
// i: feature i), `half` 0 for features 0..15 and 1 for 16..31.
inline __m512i vnni_order(int bits, int half) {
  alignas(64) uint8_t index[64];
  for (int i = 0; i < 16; i++)
    for (int k = 0; k < 4; k++) index[4 * i + k] = static_cast<uint8_t>(bits == 4 ? 16 * k + i : 32 * k + 16 * half + i);
  return _mm512_load_si512(index);
}

inline __m512i broadcast_4_bytes(const int8_t* p) {
  int32_t v;
  __builtin_memcpy(&v, p, sizeof(v));
  return _mm512_set1_epi32(v);
}

// y[0:MR, 0:cols] = x[0:MR, :] . dequant(panel) + bias for a 32-wide panel, x given as Int8Rows at
// this block's first row (`xq` row stride K, `xscale` blocks, `xsum` groups).
template <int MR, int Bits, typename S>
void vnni_rows_kernel(const int8_t* __restrict xq, const float* __restrict xscale, int64_t blocks,
                      const float* __restrict xsum, const uint8_t* __restrict panel, int64_t K, int64_t G,
                      const __m512i (&order)[2], float* __restrict y, int64_t ys, int64_t cols,
                      const float* __restrict bias) {
  constexpr int NR = 32;
  constexpr int64_t step = 4 * NR * Bits / 8;  // bytes of 4 k
  const int64_t block = block_bytes(NR, Bits, sizeof(S), G), groups = group_count(K, G);
  const __m512i nibble = _mm512_set1_epi8(15), ones = _mm512_set1_epi8(1);
  alignas(64) float total[MR][NR] = {};
  for (int64_t g = 0; g < groups; g++) {
    const uint8_t* blk = panel + g * block;
    prefetch_bytes(blk + kPrefetchBytes, block);
    const S* scale = reinterpret_cast<const S*>(blk);
    const __m512 s[2] = {(__m512)load_widened<v16>(scale), (__m512)load_widened<v16>(scale + 16)};
    const uint8_t* q = blk + scale_bytes(NR, Bits, sizeof(S));
    const int64_t length = std::min(G, K - g * G);  // a multiple of 32
    for (int64_t sub = 0; sub < length; sub += kQ8Block) {
      // 32 k: each int32 lane sums at most 32 products of 15 x 128 or 255 x 128, far from overflowing.
      __m512i acc[MR][2], wsum[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
      for (int m = 0; m < MR; m++) acc[m][0] = acc[m][1] = _mm512_setzero_si512();
      const uint8_t* qs = q + sub / 4 * step;
      const int8_t* xk = xq + g * G + sub;
#pragma GCC unroll 8
      for (int c = 0; c < kQ8Block / 4; c++) {
        __m512i w[2];
        if constexpr (Bits == 4) {
          const __m512i raw = _mm512_loadu_si512(qs + c * step);
          w[0] = _mm512_permutexvar_epi8(order[0], _mm512_and_si512(raw, nibble));
          w[1] = _mm512_permutexvar_epi8(order[0], _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble));
        } else {
          const __m512i k01 = _mm512_loadu_si512(qs + c * step), k23 = _mm512_loadu_si512(qs + c * step + 64);
          w[0] = _mm512_permutex2var_epi8(k01, order[0], k23);
          w[1] = _mm512_permutex2var_epi8(k01, order[1], k23);
          wsum[0] = _mm512_dpbusd_epi32(wsum[0], ones, w[0]);
          wsum[1] = _mm512_dpbusd_epi32(wsum[1], ones, w[1]);
        }
        for (int m = 0; m < MR; m++) {
          const __m512i a = broadcast_4_bytes(xk + m * K + 4 * c);
          if constexpr (Bits == 4) {  // weights unsigned, activations signed
            acc[m][0] = _mm512_dpbusd_epi32(acc[m][0], w[0], a);
            acc[m][1] = _mm512_dpbusd_epi32(acc[m][1], w[1], a);
          } else {  // activations + 128 unsigned, weights signed
            acc[m][0] = _mm512_dpbusd_epi32(acc[m][0], a, w[0]);
            acc[m][1] = _mm512_dpbusd_epi32(acc[m][1], a, w[1]);
          }
        }
      }
      if constexpr (Bits == 8)
        for (int j = 0; j < 2; j++) {
          const __m512i offset = _mm512_slli_epi32(wsum[j], 7);
          for (int m = 0; m < MR; m++) acc[m][j] = _mm512_sub_epi32(acc[m][j], offset);
        }
      const int64_t b = (g * G + sub) / kQ8Block;
      for (int m = 0; m < MR; m++) {
        const __m512 d = _mm512_set1_ps(xscale[m * blocks + b]);
        for (int j = 0; j < 2; j++) {
          float* t = total[m] + 16 * j;
          _mm512_store_ps(t, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m][j]), _mm512_mul_ps(s[j], d), _mm512_load_ps(t)));
        }
      }
    }
    if constexpr (Bits == 4) {
      const __m512 mn[2] = {(__m512)load_widened<v16>(scale + NR), (__m512)load_widened<v16>(scale + NR + 16)};
      for (int m = 0; m < MR; m++) {
        const __m512 xg = _mm512_set1_ps(xsum[m * groups + g]);
        for (int j = 0; j < 2; j++) {
          float* t = total[m] + 16 * j;
          _mm512_store_ps(t, _mm512_fmadd_ps(mn[j], xg, _mm512_load_ps(t)));
        }
      }
    }
  }
  v16 out[MR][2];
  for (int m = 0; m < MR; m++)
    for (int j = 0; j < 2; j++) out[m][j] = load<v16>(total[m] + 16 * j);
  store_tile<v16, 2, MR>(out, y, ys, cols, bias);
}

template <int Bits, typename S>
void vnni_gemm(const float* x, int64_t xs, int64_t M, const uint8_t* packed, int64_t K, int64_t N, int64_t G,
               const float* bias, float* y) {
  constexpr int64_t NR = 32;
  const int64_t groups = group_count(K, G), panels = (N + NR - 1) / NR, blocks = K / kQ8Block;
  const int64_t stride = panel_bytes(NR, Bits, sizeof(S), K, G);
  const Int8Rows rows_q8 = quantize_rows_int8(x, xs, M, K, G, Bits == 8);
  const __m512i order[2] = {vnni_order(Bits, 0), vnni_order(Bits, 1)};
  parallel_panels(M, K, panels, stride, kItemBytes, kVnniRows, [&](int64_t m0, int64_t m1, int64_t p) {
    const uint8_t* panel = packed + p * stride;
    const int64_t n0 = p * NR, cols = std::min(NR, N - n0);
    const float* b = bias ? bias + n0 : nullptr;
    for (int64_t m = m0; m < m1; m += kVnniRows) {
      const int8_t* xq = rows_q8.q.data() + m * K;
      const float* xd = rows_q8.scale.data() + m * blocks;
      const float* xg = rows_q8.sum.data() + m * groups;
      float* yp = y + m * N + n0;
      switch (std::min<int64_t>(kVnniRows, m1 - m)) {
#define CASE(R)                                                                           \
  case R:                                                                                 \
    vnni_rows_kernel<R, Bits, S>(xq, xd, blocks, xg, panel, K, G, order, yp, N, cols, b); \
    break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7)
#undef CASE
        default: vnni_rows_kernel<8, Bits, S>(xq, xd, blocks, xg, panel, K, G, order, yp, N, cols, b);
      }
    }
  });
}
#endif

template <typename V, int NV, int Bits, typename S>
void quantized_gemm(const float* x, int64_t xs, int64_t M, const uint8_t* packed, int64_t K, int64_t N, int64_t G,
                    const float* bias, float* y) {
  constexpr int64_t NR = NV * lanes<V>();
#if defined(__AVX2__)
  if constexpr (Bits == 4 && NR == 16) return q8_gemm<S>(x, xs, M, packed, K, N, G, bias, y);
#endif
#if defined(COMPILED_LLM_VNNI)
  if constexpr (NR == 32) return vnni_gemm<Bits, S>(x, xs, M, packed, K, N, G, bias, y);
#endif
  const int64_t groups = group_count(K, G), panels = (N + NR - 1) / NR;
  const int64_t stride = panel_bytes(NR, Bits, sizeof(S), K, G);
  // Up to twice few_rows rows (a speculative verification's 1 + k) still take the few-row kernel,
  // in blocks over a panel that stays in L1: per weight one conversion per block and one FMA per
  // row, where the many-row kernel adds a de-quantizing FMA per block (5 rows of the bundled
  // model's 4-bit linears on AVX2, before q8_gemm took them: 3 + 2 few rows ran 13.5 ms a pass,
  // 4 + 1 many rows 17.2). Exactly many_rows rows are one many-row block.
  const bool few = M <= few_rows<V>() || (M != many_rows<V>() && M <= 2 * few_rows<V>());
  std::vector<float> xsum;
  if (few && Bits == 4) xsum = group_sums<V>(x, xs, M, K, G);
  const int R = few ? few_rows<V>() : many_rows<V>();
  parallel_panels(M, K, panels, stride, kItemBytes, R, [&](int64_t m0, int64_t m1, int64_t p) {
    const uint8_t* panel = packed + p * stride;
    const int64_t n0 = p * NR, cols = std::min(NR, N - n0);
    const float* b = bias ? bias + n0 : nullptr;
    for (int64_t m = m0; m < m1; m += R) {
      const int rows = static_cast<int>(std::min<int64_t>(R, m1 - m));
      const float* sums = xsum.empty() ? nullptr : xsum.data() + m * groups;
      rows_block<V, NV, Bits, S>(few, rows, x + m * xs, xs, sums, panel, K, G, y + m * N + n0, N, cols, b);
    }
  });
}

// The format's rules, checked alike when packing and when computing.
void check_format(int64_t bits, int64_t group_size, int64_t K) {
  TORCH_CHECK(bits == 8 || bits == 4, "bits must be 8 or 4, got ", bits);
  TORCH_CHECK(K > 0 && K % 32 == 0, "in_features must be a multiple of 32 for quantized weights, got ", K);
  TORCH_CHECK(group_size == 32 || group_size == 64 || group_size == 128 || group_size == K,
              "group_size must be 32, 64, 128 or in_features (", K, "), got ", group_size);
}

// Repacks q [N, K] (int8 for 8-bit; uint8 holding 0..15 for 4-bit), scales [N, groups] and (4-bit)
// mins [N, groups] (groups = ceil(K / group_size)), both float32 or both float16 (kept so in the
// layout), into [panels, panel bytes] uint8.
at::Tensor pack_quantized_weight(const at::Tensor& q, const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                                 int64_t bits, int64_t group_size, int64_t panel) {
  TORCH_CHECK(q.dim() == 2, "q must be 2-D [out_features, in_features], got ", q.sizes());
  const int64_t N = q.size(0), K = q.size(1);
  check_format(bits, group_size, K);
  if (panel <= 0) panel = kNativePanel;
  TORCH_CHECK(panel == 16 || panel == 32, "panel width must be 16 or 32, got ", panel);
  const int64_t G = group_size, groups = group_count(K, G);
  if (bits == 8) {
    TORCH_CHECK(q.scalar_type() == at::kChar, "8-bit q must be int8, got ", q.scalar_type());
    TORCH_CHECK(!mins.has_value(), "8-bit weights are symmetric: mins must be None");
  } else {
    TORCH_CHECK(q.scalar_type() == at::kByte, "4-bit q must be uint8 holding 0..15, got ", q.scalar_type());
    TORCH_CHECK(mins.has_value(), "4-bit weights need mins (w = scale * q + min; Q4_0's min is -8 * scale)");
    const int largest = N == 0 ? 0 : q.max().item<uint8_t>();
    TORCH_CHECK(largest <= 15, "4-bit q must hold values 0..15, found ", largest);
  }
  TORCH_CHECK(scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf,
              "scales must be float32 or float16, got ", scales.scalar_type());
  const bool half_scales = scales.scalar_type() == at::kHalf;
  auto check_params = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.scalar_type() == scales.scalar_type(), name, " must have the scales' dtype (",
                scales.scalar_type(), "), got ", t.scalar_type());
    TORCH_CHECK(t.dim() == 2 && t.size(0) == N && t.size(1) == groups, name, " must be [out_features, ceil(in_features / group_size)] = [",
                N, ", ", groups, "], got ", t.sizes());
  };
  check_params(scales, "scales");
  if (mins.has_value()) check_params(*mins, "mins");
  const at::Tensor qc = q.contiguous(), sc = scales.contiguous();
  const at::Tensor mc = mins.has_value() ? mins->contiguous() : at::Tensor();
  const int64_t scale_size = half_scales ? 2 : 4;
  const int64_t NR = panel, panels = (N + NR - 1) / NR, block = block_bytes(NR, bits, scale_size, G);
  const int64_t stride = panel_bytes(NR, bits, scale_size, K, G);
  at::Tensor packed = packed_weight_empty({panels, stride}, q.options().dtype(at::kByte));
  const uint8_t* qp = reinterpret_cast<const uint8_t*>(qc.data_ptr());
  // Scales and mins are copied as bytes, `scale_size` each (fp16 zero is all zero bits too).
  const uint8_t* sp = reinterpret_cast<const uint8_t*>(sc.data_ptr());
  const uint8_t* mp = mins.has_value() ? reinterpret_cast<const uint8_t*>(mc.data_ptr()) : nullptr;
  uint8_t* out = packed.data_ptr<uint8_t>();
  parallel_chunks(panels * groups, [&](int64_t item) {
    const int64_t p = item / groups, g = item % groups;
    uint8_t* blk = out + p * stride + g * block;
    uint8_t* mn = blk + NR * scale_size;
    uint8_t* qo = blk + scale_bytes(NR, bits, scale_size);
    for (int64_t i = 0; i < NR; i++) {  // features past N: zero scale, min and q
      const int64_t n = p * NR + i, at = (n * groups + g) * scale_size;
      for (int64_t b = 0; b < scale_size; b++) {
        blk[i * scale_size + b] = n < N ? sp[at + b] : 0;
        if (bits == 4) mn[i * scale_size + b] = n < N ? mp[at + b] : 0;
      }
    }
    for (int64_t k = 0; k < std::min(G, K - g * G); k++) {
      const int64_t kk = g * G + k;
      auto value = [&](int64_t i) -> uint8_t {
        const int64_t n = p * NR + i;
        return n < N ? qp[n * K + kk] : 0;
      };
      if (bits == 8) {
        for (int64_t i = 0; i < NR; i++) qo[k * NR + i] = value(i);
      } else {
        for (int64_t i = 0; i < NR / 2; i++) qo[k * NR / 2 + i] = value(i) | value(NR / 2 + i) << 4;
      }
    }
  });
  return packed;
}

// The GEMM for the panel width and bits, with scales of type S.
template <typename S>
void dispatch(int64_t NR, int64_t bits, const float* x, int64_t xs, int64_t M, const uint8_t* w, int64_t K, int64_t N,
              int64_t G, const float* b, float* y) {
  if (NR == 16)
    bits == 8 ? quantized_gemm<v8, 2, 8, S>(x, xs, M, w, K, N, G, b, y) : quantized_gemm<v8, 2, 4, S>(x, xs, M, w, K, N, G, b, y);
  else
    bits == 8 ? quantized_gemm<v16, 2, 8, S>(x, xs, M, w, K, N, G, b, y)
              : quantized_gemm<v16, 2, 4, S>(x, xs, M, w, K, N, G, b, y);
}

at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                            int64_t out_features, int64_t in_features, int64_t bits, int64_t group_size) {
  const int64_t N = out_features, K = in_features, G = group_size;
  check_format(bits, G, K);
  TORCH_CHECK(packed.dim() == 2 && packed.is_contiguous() && packed.scalar_type() == at::kByte,
              "packed weight must come from pack_quantized_weight");
  // The panel width and the scales' size, from the packed width (see the top of the file).
  int64_t NR = 0, scale_size = 0;
  for (const int64_t size : {4, 2})
    for (const int64_t width : {16, 32})
      if (packed.size(1) == panel_bytes(width, bits, size, K, G)) NR = width, scale_size = size;
  TORCH_CHECK(NR != 0, "packed weight was not packed with in_features ", K, ", bits ", bits, " and group_size ", G);
  TORCH_CHECK(N > 0 && N <= packed.size(0) * NR && N > (packed.size(0) - 1) * NR, "out_features ", N,
              " does not match the packed weight's ", packed.size(0), " panels of ", NR);
  const at::Tensor x2 = rows_of(x, K);
  const float* b = bias_data(bias, N);
  const int64_t M = x2.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M > 0) {
    const float* xp = x2.data_ptr<float>();
    const uint8_t* w = packed.data_ptr<uint8_t>();
    float* yp = y.data_ptr<float>();
    const int64_t xs = x2.stride(0);
    if (scale_size == 4)
      dispatch<float>(NR, bits, xp, xs, M, w, K, N, G, b, yp);
    else
      dispatch<Fp16Bits>(NR, bits, xp, xs, M, w, K, N, G, b, yp);
  }
  return y.view(output_sizes(x, N));
}

}  // namespace

// Whether weights of `bits` in panels `panel` wide compute with int8 activations in this build:
// 4-bit ones in 16-wide panels wherever there is AVX2 (q8_gemm), 8- and 4-bit ones in 32-wide
// panels where there is AVX512-VNNI too (vnni_gemm).
bool quantized_linear_int8_activations(int64_t bits, int64_t panel) {
#if defined(COMPILED_LLM_VNNI)
  if (panel == 32) return bits == 8 || bits == 4;
#endif
#if defined(__AVX2__)
  return bits == 4 && panel == 16;
#else
  return false;
#endif
}

TORCH_LIBRARY_FRAGMENT(compiled_llm_cpu, m) {
  m.def("quantized_linear_int8_activations(int bits, int panel) -> bool", quantized_linear_int8_activations);
  m.def("pack_quantized_weight(Tensor q, Tensor scales, Tensor? mins, int bits, int group_size, int panel=0) -> Tensor");
  m.def(
      "quantized_linear(Tensor x, Tensor packed, Tensor? bias, int out_features, int in_features, int bits, "
      "int group_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(compiled_llm_cpu, CPU, m) {
  m.impl("pack_quantized_weight", pack_quantized_weight);
  m.impl("quantized_linear", quantized_linear);
}
