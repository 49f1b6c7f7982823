// Batched LoRA on CPUs, as Punica and S-LoRA apply it: every token of a flat batch picks its
// adapter by a slot index, and the low-rank update is two small products per token.
//
//   shrink:  t[i, :]  = x[i, :] . A[slot_i]^T                  A:  [L, S * R, K]
//   expand:  y[i, o] += scale[slot_i] * sum_r t[i, j*R + r] * Bt[slot_i, r, o]
//                                                               Bt: [L, R, N], o in slice j
//
// A fused layer (QKV, gate-up) stacks its S sub-projections: A's rows hold S blocks of R, and
// output column o reads the block of the slice it lies in, so one shrink and one expand serve
// every sub-projection. B is stored transposed (written so when an adapter is loaded into its
// slot): the expand is then FMAs along the outputs, never a length-R dot product per output.
//
// Tokens are grouped by slot in tiles of up to kTile, so a tile reads its adapter's A and B once
// for all its tokens (a batch of 32 over 8 adapters reads each adapter's matrices 1-2 times per
// layer, not 4). A token with slot -1 (the base model, a padded row) gets t = 0 and its y is not
// touched: the expand adds into the base layer's output in place (a functional expand copied every
// row of y, 2 ms a batch-32 step of the bundled model with no adapter in it). The stacks are
// preallocated at the largest rank, zero-padded, so an adapter's rank never changes a shape.
//
// Activations are float32; the stacks float32 or fp16 (converted in registers). At batch 32 with
// eight adapters a step reads every adapter's A and B once a layer (156 MB of float32 for eight
// rank-16 adapters on SmolLM2-135M), and that read, not the arithmetic, bounds the products.
// Other dtypes take the torch reference (kernels/lora.py).

#include <ATen/ATen.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "parallel.h"
#include "vec.h"
#include "widen.h"

namespace {

using namespace compiled_llm_cpu;
using V = std::conditional_t<kNativeLanes == 16, v16, v8>;
constexpr int kLanes = lanes<V>();
constexpr int64_t kPrefetch = 256;  // elements ahead along a row of A or Bt (1 KB of float32)
constexpr int kTile = 4;  // tokens of one slot computed together (the switches below list 1..4)

// fn(item) for item in [0, items), in contiguous runs of at least kMinWork multiply-adds each (about
// 25 us): a pool wake-up or a worker descheduled mid-chunk on a shared machine costs more than
// smaller work (measured: 2 threads on a loaded 2-core machine ran batch-32 LoRA 3x slower than 1
// with 64k-FMA chunks), while at 1M a batch-32 step's products all ran on one thread: on a quiet
// 2-core machine 256k took eight adapters' cost at batch 32 from 30% to 13-24% (median 17%, 3 runs).
constexpr int64_t kMinWork = 1 << 18;

template <class F>
void for_items(int64_t items, int64_t work_per_item, const F& fn) {
  const int64_t max_chunks = std::max<int64_t>(1, 4 * at::get_num_threads());
  const int64_t chunks = std::clamp<int64_t>(items * work_per_item / kMinWork, 1, std::min(items, max_chunks));
  if (chunks == 1) {
    for (int64_t i = 0; i < items; i++) fn(i);
    return;
  }
  parallel_chunks(chunks, [&](int64_t c) {
    const int64_t begin = items * c / chunks, end = items * (c + 1) / chunks;
    for (int64_t i = begin; i < end; i++) fn(i);
  });
}

// One element of a float32 or fp16 stack, for the tails the vectors leave.
template <typename S>
inline float scalar_w(const S* p) {
  if constexpr (std::is_same_v<S, float>)
    return *p;
  else
    return c10::detail::fp16_ieee_to_fp32_value(*p);
}

// Up to kTile tokens with one slot (-1: tokens without an adapter): rows[0, count).
struct Tile {
  int64_t slot;
  int64_t rows[kTile];
  int count;
};

// The tokens grouped by slot (a counting sort: T and L are small), cut into tiles.
std::vector<Tile> tiles_by_slot(const int64_t* indices, int64_t T, int64_t L) {
  std::vector<int64_t> start(L + 2, 0), order(T);
  auto bucket = [&](int64_t i) { return indices[i] >= 0 && indices[i] < L ? indices[i] + 1 : 0; };
  for (int64_t i = 0; i < T; i++) start[bucket(i) + 1]++;
  for (int64_t b = 0; b <= L; b++) start[b + 1] += start[b];
  std::vector<int64_t> next(start.begin(), start.end() - 1);
  for (int64_t i = 0; i < T; i++) order[next[bucket(i)]++] = i;
  std::vector<Tile> tiles;
  tiles.reserve(T / kTile + L + 1);
  for (int64_t b = 0; b <= L; b++) {
    for (int64_t k = start[b]; k < start[b + 1]; k += kTile) {
      Tile tile{b - 1, {}, static_cast<int>(std::min<int64_t>(kTile, start[b + 1] - k))};
      std::copy(order.begin() + k, order.begin() + k + tile.count, tile.rows);
      tiles.push_back(tile);
    }
  }
  return tiles;
}

// t[g, r0 + n] = x_g . a_{r0 + n} for G tokens and NR rows of A: each vector of A is loaded once
// for all G tokens, each of x once for all NR rows (NR * G independent sums in registers).
template <int G, int NR, typename S>
void shrink_rows(const float* const* x, const S* a, int64_t r0, int64_t K, float* const* t) {
  const S* ar = a + r0 * K;
  V acc[NR][G] = {};
  int64_t k = 0;
  auto step = [&](int64_t k) {
    V av[NR];
    for (int n = 0; n < NR; n++) av[n] = load_widened<V>(ar + n * K + k);
    for (int g = 0; g < G; g++) {
      const V xv = load<V>(x[g] + k);
      for (int n = 0; n < NR; n++) acc[n][g] += av[n] * xv;
    }
  };
  constexpr int64_t kLine = 64 / sizeof(float);
  for (; k + kLine <= K; k += kLine) {
    for (int n = 0; n < NR; n++) __builtin_prefetch(ar + n * K + k + kPrefetch);  // runs on into the next rows
    for (int64_t v = 0; v < kLine; v += kLanes) step(k + v);
  }
  for (; k + kLanes <= K; k += kLanes) step(k);
  for (int n = 0; n < NR; n++) {
    for (int g = 0; g < G; g++) {
      float s = reduce_sum<V>(acc[n][g]);
      for (int64_t kk = k; kk < K; kk++) s += scalar_w(ar + n * K + kk) * x[g][kk];
      t[g][r0 + n] = s;
    }
  }
}

template <int G, typename S>
void shrink_tile(const float* const* x, const S* a, int64_t R, int64_t K, float* const* t) {
  constexpr int NR = G <= 2 ? 4 : 2;  // at least 4 independent sums to hide the FMA latency (batch 1)
  int64_t r = 0;
  for (; r + NR <= R; r += NR) shrink_rows<G, NR, S>(x, a, r, K, t);
  for (; r < R; r++) shrink_rows<G, 1, S>(x, a, r, K, t);
}

// y_g[o] += scale * sum_r t_g[r] * b[r, o] for o in [o0, o1), G tokens, W vectors at a time: each
// row of Bt is read once for all G tokens.
template <int G, int W, typename S>
int64_t expand_vectors(float* const* y, const float* const* t, const S* b, int64_t N, int64_t R, float scale,
                       int64_t o0, int64_t o1) {
  const V sv = splat<V>(scale);
  int64_t o = o0;
  for (; o + W * kLanes <= o1; o += W * kLanes) {
    V acc[G][W] = {};
    for (int64_t r = 0; r < R; r++) {
      // R rows are read side by side, N apart: too many streams for the hardware prefetcher when
      // 8 adapters' matrices come from memory (gate-up's expand, 30 layers: 6.0 -> 4.3 ms with it).
      for (int w = 0; w < W * kLanes; w += 64 / sizeof(float)) __builtin_prefetch(b + r * N + o + w + kPrefetch);
      V bv[W];
      for (int w = 0; w < W; w++) bv[w] = load_widened<V>(b + r * N + o + w * kLanes);
      for (int g = 0; g < G; g++) {
        const V tv = splat<V>(t[g][r]);
        for (int w = 0; w < W; w++) acc[g][w] += tv * bv[w];
      }
    }
    for (int g = 0; g < G; g++)
      for (int w = 0; w < W; w++) store<V>(y[g] + o + w * kLanes, load<V>(y[g] + o + w * kLanes) + sv * acc[g][w]);
  }
  return o;
}

template <int G, typename S>
void expand_tile(float* const* y, const float* const* t, const S* b, int64_t N, int64_t R, float scale, int64_t o0,
                 int64_t o1) {
  constexpr int W = G <= 2 ? 4 : 2;  // as above: G * W sums in registers
  int64_t o = expand_vectors<G, W, S>(y, t, b, N, R, scale, o0, o1);
  o = expand_vectors<G, 1, S>(y, t, b, N, R, scale, o, o1);
  for (; o < o1; o++) {
    for (int g = 0; g < G; g++) {
      float s = 0.f;
      for (int64_t r = 0; r < R; r++) s += t[g][r] * scalar_w(b + r * N + o);
      y[g][o] += scale * s;
    }
  }
}

void check(const at::Tensor& x, const at::Tensor& stack, const at::Tensor& indices, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, name, ": float32 activations only");
  TORCH_CHECK(stack.scalar_type() == at::kFloat || stack.scalar_type() == at::kHalf, name,
              ": the stack must be float32 or float16, got ", stack.scalar_type());
  TORCH_CHECK(stack.dim() == 3 && stack.is_contiguous(), name, ": the stack must be contiguous [L, rows, cols]");
  TORCH_CHECK(indices.scalar_type() == at::kLong && indices.dim() == 1 && indices.size(0) >= x.size(0), name,
              ": indices must be int64 with a slot for each of the ", x.size(0), " tokens");
}

template <typename S>
void shrink_tiles(const std::vector<Tile>& tiles, const float* xp, int64_t xs, const S* ap, int64_t R, int64_t K,
                  float* op) {
  for_items(static_cast<int64_t>(tiles.size()), kTile * R * K, [&](int64_t item) {
    const Tile& tile = tiles[item];
    const float* xr[kTile];
    float* tr[kTile];
    for (int g = 0; g < tile.count; g++) {
      xr[g] = xp + tile.rows[g] * xs;
      tr[g] = op + tile.rows[g] * R;
      if (tile.slot < 0) std::fill(tr[g], tr[g] + R, 0.f);
    }
    if (tile.slot < 0) return;
    const S* a = ap + tile.slot * R * K;
    switch (tile.count) {  // the tile's size as a compile-time constant
      case 1: shrink_tile<1, S>(xr, a, R, K, tr); break;
      case 2: shrink_tile<2, S>(xr, a, R, K, tr); break;
      case 3: shrink_tile<3, S>(xr, a, R, K, tr); break;
      default: shrink_tile<kTile, S>(xr, a, R, K, tr); break;
    }
  });
}

at::Tensor lora_shrink(const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& indices) {
  check(x, lora_a, indices, "lora_shrink");
  const int64_t T = x.size(0), K = x.size(1), R = lora_a.size(1), L = lora_a.size(0);
  TORCH_CHECK(lora_a.size(2) == K, "lora_shrink: A has ", lora_a.size(2), " input features, x ", K);
  at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  at::Tensor out = at::empty({T, R}, x.options());
  const std::vector<Tile> tiles = tiles_by_slot(indices.data_ptr<int64_t>(), T, L);
  if (lora_a.scalar_type() == at::kFloat)
    shrink_tiles<float>(tiles, xc.data_ptr<float>(), xc.stride(0), lora_a.data_ptr<float>(), R, K, out.data_ptr<float>());
  else
    shrink_tiles<Fp16Bits>(tiles, xc.data_ptr<float>(), xc.stride(0),
                           reinterpret_cast<const Fp16Bits*>(lora_a.data_ptr()), R, K, out.data_ptr<float>());
  return out;
}

template <typename S>
void expand_tiles(const std::vector<Tile>& tiles, float* yp, int64_t ys, const float* tp, const S* bp, const float* sp,
                  int64_t N, int64_t R, at::IntArrayRef slices) {
  const int64_t S_ = static_cast<int64_t>(slices.size());
  for_items(static_cast<int64_t>(tiles.size()), kTile * R * N, [&](int64_t item) {
    const Tile& tile = tiles[item];
    if (tile.slot < 0) return;  // the base model: y as the base layer wrote it
    float* yr[kTile];
    for (int g = 0; g < tile.count; g++) yr[g] = yp + tile.rows[g] * ys;
    const S* b = bp + tile.slot * R * N;
    const float scale = sp[tile.slot];
    int64_t start = 0;
    for (int64_t j = 0; j < S_; j++) {
      const float* tr[kTile];
      for (int g = 0; g < tile.count; g++) tr[g] = tp + tile.rows[g] * S_ * R + j * R;
      const int64_t stop = start + slices[j];
      switch (tile.count) {
        case 1: expand_tile<1, S>(yr, tr, b, N, R, scale, start, stop); break;
        case 2: expand_tile<2, S>(yr, tr, b, N, R, scale, start, stop); break;
        case 3: expand_tile<3, S>(yr, tr, b, N, R, scale, start, stop); break;
        default: expand_tile<kTile, S>(yr, tr, b, N, R, scale, start, stop); break;
      }
      start = stop;
    }
  });
}

void lora_expand_(at::Tensor& y, const at::Tensor& t, const at::Tensor& lora_b, const at::Tensor& scalings,
                  const at::Tensor& indices, at::IntArrayRef slices) {
  check(y, lora_b, indices, "lora_expand_");
  const int64_t T = y.size(0), N = y.size(1), R = lora_b.size(1), L = lora_b.size(0);
  const int64_t S = static_cast<int64_t>(slices.size());
  int64_t total = 0;
  for (int64_t s : slices) total += s;
  TORCH_CHECK(y.dim() == 2 && y.stride(1) == 1, "lora_expand_: y must be [tokens, features] with unit feature stride");
  TORCH_CHECK(total == N && lora_b.size(2) == N, "lora_expand_: slices sum to ", total, ", y has ", N,
              " features, B^T ", lora_b.size(2));
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.size(0) == T && t.size(1) == S * R, "lora_expand_: t must be [", T,
              ", ", S * R, "] float32");
  TORCH_CHECK(scalings.scalar_type() == at::kFloat && scalings.numel() == L, "lora_expand_: one scaling per slot");
  at::Tensor tc = t.contiguous();
  const std::vector<Tile> tiles = tiles_by_slot(indices.data_ptr<int64_t>(), T, L);
  float* yp = y.data_ptr<float>();
  if (lora_b.scalar_type() == at::kFloat)
    expand_tiles<float>(tiles, yp, y.stride(0), tc.data_ptr<float>(), lora_b.data_ptr<float>(),
                        scalings.data_ptr<float>(), N, R, slices);
  else
    expand_tiles<Fp16Bits>(tiles, yp, y.stride(0), tc.data_ptr<float>(),
                           reinterpret_cast<const Fp16Bits*>(lora_b.data_ptr()), scalings.data_ptr<float>(), N, R,
                           slices);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(compiled_llm_cpu, m) {
  m.def("lora_shrink(Tensor x, Tensor lora_a, Tensor indices) -> Tensor");
  m.def("lora_expand_(Tensor(a!) y, Tensor t, Tensor lora_b, Tensor scalings, Tensor indices, int[] slices) -> ()");
}

TORCH_LIBRARY_IMPL(compiled_llm_cpu, CPU, m) {
  m.impl("lora_shrink", lora_shrink);
  m.impl("lora_expand_", lora_expand_);
}
