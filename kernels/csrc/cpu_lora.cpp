// Batched LoRA on CPUs, as Punica and S-LoRA apply it: every token of a flat batch picks its
// adapter by a slot index, and the low-rank update is two small products per token.
//
//   shrink:  t[i, :]  = x[i, :] . A[slot_i]^T                   A: [L, S * R, K]
//   expand:  out[i, o] = y[i, o] + scale[slot_i] * t[i, j*R : (j+1)*R] . B[slot_i, o, :]
//                                                                B: [L, N, R], o in slice j
//
// A fused layer (QKV, gate-up) stacks its S sub-projections: A's rows hold S blocks of R, and
// output column o reads the block of the slice it lies in, so one shrink and one expand serve
// every sub-projection. A token with slot -1 (the base model, a padded row) gets t = 0 and
// out = y. The stacks are preallocated at the largest rank, zero-padded, so an adapter's rank
// never changes a shape. float32 only: other dtypes take the torch reference (kernels/lora.py).

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>

#include "parallel.h"
#include "vec.h"

namespace {

using namespace compiled_llm_cpu;
using V = std::conditional_t<kNativeLanes == 16, v16, v8>;

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  constexpr int L = lanes<V>();
  V acc0{}, acc1{};
  int64_t k = 0;
  for (; k + 2 * L <= n; k += 2 * L) {
    acc0 += load<V>(a + k) * load<V>(b + k);
    acc1 += load<V>(a + k + L) * load<V>(b + k + L);
  }
  for (; k + L <= n; k += L) acc0 += load<V>(a + k) * load<V>(b + k);
  float s = reduce_sum<V>(acc0 + acc1);
  for (; k < n; k++) s += a[k] * b[k];
  return s;
}

// fn(item) for item in [0, items), in contiguous runs of at least kMinWork multiply-adds each (about
// 100 us): the products are small (a batch-32 decode step's are serial), and a pool wake-up or a
// worker descheduled mid-chunk on a shared machine costs more than the work (measured: 2 threads
// on a loaded 2-core machine ran batch-32 LoRA 3x slower than 1 with 64k-FMA chunks).
constexpr int64_t kMinWork = 1 << 20;

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

void check(const at::Tensor& x, const at::Tensor& stack, const at::Tensor& indices, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && stack.scalar_type() == at::kFloat, name, ": float32 only");
  TORCH_CHECK(stack.dim() == 3 && stack.is_contiguous(), name, ": the stack must be contiguous [L, rows, cols]");
  TORCH_CHECK(indices.scalar_type() == at::kLong && indices.dim() == 1 && indices.size(0) >= x.size(0), name,
              ": indices must be int64 with a slot for each of the ", x.size(0), " tokens");
}

at::Tensor lora_shrink(const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& indices) {
  check(x, lora_a, indices, "lora_shrink");
  const int64_t T = x.size(0), K = x.size(1), R = lora_a.size(1), L = lora_a.size(0);
  TORCH_CHECK(lora_a.size(2) == K, "lora_shrink: A has ", lora_a.size(2), " input features, x ", K);
  at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  at::Tensor out = at::empty({T, R}, x.options());
  const float* xp = xc.data_ptr<float>();
  const float* ap = lora_a.data_ptr<float>();
  const int64_t* ip = indices.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t xs = xc.stride(0);
  for_items(T, R * K, [&](int64_t i) {
    const int64_t slot = ip[i];
    float* o = op + i * R;
    if (slot < 0 || slot >= L) {
      std::fill(o, o + R, 0.f);
      return;
    }
    const float* a = ap + slot * R * K;
    for (int64_t r = 0; r < R; r++) o[r] = dot(xp + i * xs, a + r * K, K);
  });
  return out;
}

at::Tensor lora_expand(const at::Tensor& y, const at::Tensor& t, const at::Tensor& lora_b, const at::Tensor& scalings,
                       const at::Tensor& indices, at::IntArrayRef slices) {
  check(y, lora_b, indices, "lora_expand");
  const int64_t T = y.size(0), N = y.size(1), R = lora_b.size(2), L = lora_b.size(0);
  const int64_t S = static_cast<int64_t>(slices.size());
  int64_t total = 0;
  for (int64_t s : slices) total += s;
  TORCH_CHECK(total == N && lora_b.size(1) == N, "lora_expand: slices sum to ", total, ", y has ", N,
              " features, B ", lora_b.size(1));
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.size(0) == T && t.size(1) == S * R, "lora_expand: t must be [", T,
              ", ", S * R, "] float32");
  TORCH_CHECK(scalings.scalar_type() == at::kFloat && scalings.numel() == L, "lora_expand: one scaling per slot");
  at::Tensor tc = t.contiguous();
  at::Tensor yc = y.stride(1) == 1 ? y : y.contiguous();
  // Written row block by row block below, not cloned: ATen's copy opens an OpenMP region, which on
  // a loaded machine waits for descheduled threads (the reason for csrc/parallel.h).
  at::Tensor out = at::empty({T, N}, y.options());
  const float* yp = yc.data_ptr<float>();
  const int64_t ys = yc.stride(0);
  const float* tp = tc.data_ptr<float>();
  const float* bp = lora_b.data_ptr<float>();
  const float* sp = scalings.data_ptr<float>();
  const int64_t* ip = indices.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  // Work items: (token, block of outputs), so a single decode token still spreads over threads.
  constexpr int64_t kBlock = 256;
  const int64_t blocks = (N + kBlock - 1) / kBlock;
  for_items(T * blocks, kBlock * R, [&](int64_t item) {
    const int64_t i = item / blocks, o0 = (item % blocks) * kBlock, o1 = std::min(N, o0 + kBlock);
    std::copy(yp + i * ys + o0, yp + i * ys + o1, op + i * N + o0);
    const int64_t slot = ip[i];
    if (slot < 0 || slot >= L) return;
    const float scale = sp[slot];
    const float* b = bp + slot * N * R;
    int64_t start = 0;
    for (int64_t j = 0; j < S; j++) {
      const int64_t stop = start + slices[j];
      const float* tv = tp + i * S * R + j * R;
      for (int64_t o = std::max(o0, start); o < std::min(o1, stop); o++) op[i * N + o] += scale * dot(tv, b + o * R, R);
      start = stop;
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(compiled_llm_cpu, m) {
  m.def("lora_shrink(Tensor x, Tensor lora_a, Tensor indices) -> Tensor");
  m.def("lora_expand(Tensor y, Tensor t, Tensor lora_b, Tensor scalings, Tensor indices, int[] slices) -> Tensor");
}

TORCH_LIBRARY_IMPL(compiled_llm_cpu, CPU, m) {
  m.impl("lora_shrink", lora_shrink);
  m.impl("lora_expand", lora_expand);
}
