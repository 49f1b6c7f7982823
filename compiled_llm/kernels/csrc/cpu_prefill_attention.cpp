// Prefill attention on CPUs: every request with more than one query token (a prompt, a chunk of
// one, or a prompt after a prefix-cache hit), causal, over its paged KV cache, in one call.
//
// Why: the torch path runs a scaled_dot_product_attention per request from Python (and gathers
// the cached context into a contiguous copy when there is one); on a CPU it reaches about a third
// of the FMA rate, and at a few hundred tokens a prompt's attention is a tenth to a fifth of its
// prefill. Here it is flash-attention style: for each (request, KV head, tile of query tokens) the
// keys are read tile by tile from the cache in place, scores go through an online softmax, and the
// weighted values accumulate in a small L1-resident block. The query heads that share a KV head
// (GQA) are done together, so each key and value tile is read once for all of them.
//
// The new tokens' keys and values must already be in the cache (write_kv_cache runs first), so
// a request with cached context is the same case as one without. Written with GCC vector types:
// 8 or 16 floats a vector, picked at build time from the target (AVX2 or AVX-512) or forced by the
// op's `vector_width` (the tests run both on any CPU).

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>


#include "parallel.h"
#include "vec.h"

namespace {

using namespace compiled_llm_cpu;

constexpr int kKeys = 16;       // keys per tile
constexpr int kQueryTokens = 16;  // query tokens per work item
constexpr int kRows = 6;        // query vectors per score micro-kernel call

struct Problem {
  const float* query;
  float* out;
  const float* key_cache;
  const float* value_cache;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const int32_t* query_start;
  int64_t qs, os, table_stride;
  int64_t block_size, block_stride, token_stride;
  int64_t group, head_dim;
  float scale;
};

// S[r][0:16] = scale * q_r . K^T for up to kRows query vectors, K transposed as kt[d][16].
template <typename V, int R>
inline void scores(const float* const* q, const float* kt, int64_t D, float scale, float* s) {
  constexpr int L = lanes<V>(), NV = kKeys / L;
  V acc[R][NV];
  for (int r = 0; r < R; r++)
    for (int j = 0; j < NV; j++) acc[r][j] = V{};
  for (int64_t d = 0; d < D; d++) {
    V k[NV];
    for (int j = 0; j < NV; j++) k[j] = load<V>(kt + d * kKeys + j * L);
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
      const V a = splat<V>(q[r][d]);
      for (int j = 0; j < NV; j++) acc[r][j] += a * k[j];
    }
  }
  const V sv = splat<V>(scale);
  for (int r = 0; r < R; r++)
    for (int j = 0; j < NV; j++) store<V>(s + r * kKeys + j * L, acc[r][j] * sv);
}

template <typename V>
void scores_rows(int rows, const float* const* q, const float* kt, int64_t D, float scale, float* s) {
  switch (rows) {
    case 1: return scores<V, 1>(q, kt, D, scale, s);
    case 2: return scores<V, 2>(q, kt, D, scale, s);
    case 3: return scores<V, 3>(q, kt, D, scale, s);
    case 4: return scores<V, 4>(q, kt, D, scale, s);
    case 5: return scores<V, 5>(q, kt, D, scale, s);
    default: return scores<V, 6>(q, kt, D, scale, s);
  }
}

// o = o * alpha + sum_t p[t] v_t over `n` value rows, W vectors of o at a time (all in registers).
template <typename V, int W>
inline void accumulate_block(float* o, V alpha, const float* p, const float* const* v, int n, int64_t d) {
  constexpr int L = lanes<V>();
  V acc[W];
  for (int j = 0; j < W; j++) acc[j] = load<V>(o + d + j * L) * alpha;
  for (int t = 0; t < n; t++) {
    const V w = splat<V>(p[t]);
    const float* row = v[t] + d;
    for (int j = 0; j < W; j++) acc[j] += w * load<V>(row + j * L);
  }
  for (int j = 0; j < W; j++) store<V>(o + d + j * L, acc[j]);
}

template <typename V>
inline void accumulate_values(float* o, float alpha, const float* p, const float* const* v, int n, int64_t D) {
  constexpr int L = lanes<V>();
  const V a = splat<V>(alpha);
  int64_t d = 0;
  for (; d + 8 * L <= D; d += 8 * L) accumulate_block<V, 8>(o, a, p, v, n, d);
  for (; d + 2 * L <= D; d += 2 * L) accumulate_block<V, 2>(o, a, p, v, n, d);
  for (; d + L <= D; d += L) accumulate_block<V, 1>(o, a, p, v, n, d);
  for (; d < D; d++) {
    float acc = o[d] * alpha;
    for (int t = 0; t < n; t++) acc += p[t] * v[t][d];
    o[d] = acc;
  }
}

struct Scratch {
  std::vector<float> kt, s, o, m, l, alpha;
  std::vector<int> visible;
  std::vector<const float*> q, v;
};

// One work item: request `r`, KV head `h`, query tokens [j0, j1) of the request.
template <typename V>
void tile(const Problem& P, int64_t r, int64_t h, int64_t j0, int64_t j1, Scratch& w) {
  const int64_t D = P.head_dim, group = P.group;
  const int64_t q_begin = P.query_start[r], q_len = P.query_start[r + 1] - q_begin;
  const int64_t seq_len = P.seq_lens[r], context = seq_len - q_len;
  const int64_t rows = (j1 - j0) * group;  // query vectors: (token, head in the group)
  const int32_t* table = P.block_tables + r * P.table_stride;
  w.kt.resize(D * kKeys);
  w.s.resize(rows * kKeys);
  w.o.assign(rows * D, 0.f);
  w.m.assign(rows, -INFINITY);
  w.l.assign(rows, 0.f);
  w.alpha.resize(rows);
  w.visible.resize(rows);
  w.q.resize(rows);
  w.v.resize(kKeys);
  for (int64_t j = j0; j < j1; j++)
    for (int64_t g = 0; g < group; g++)
      w.q[(j - j0) * group + g] = P.query + (q_begin + j) * P.qs + (h * group + g) * D;
  const int64_t kv_len = context + j1;  // keys the last token of the tile sees
  const int64_t first_masked = context + j0 + 1;  // keys at and past this one are hidden from some rows
  for (int64_t k0 = 0; k0 < kv_len; k0 += kKeys) {
    const int n = static_cast<int>(std::min<int64_t>(kKeys, kv_len - k0));
    // Keys of the tile, transposed to [D][16] (zeros past n), and the value rows' addresses.
    for (int t = 0; t < kKeys; t++) {
      if (t < n) {
        const int64_t pos = k0 + t;
        const int64_t offset = table[pos / P.block_size] * P.block_stride + (pos % P.block_size) * P.token_stride +
                               h * D;
        const float* k = P.key_cache + offset;
        for (int64_t d = 0; d < D; d++) w.kt[d * kKeys + t] = k[d];
        w.v[t] = P.value_cache + offset;
      } else {
        for (int64_t d = 0; d < D; d++) w.kt[d * kKeys + t] = 0.f;
      }
    }
    for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
      const int count = static_cast<int>(std::min<int64_t>(kRows, rows - r0));
      scores_rows<V>(count, w.q.data() + r0, w.kt.data(), D, P.scale, w.s.data() + r0 * kKeys);
    }
    // Online softmax: the new running maxima, the factors that rescale what was summed so far
    // (vectorised over rows), then each row's weights and weighted values.
    constexpr int NV = kKeys / lanes<V>();
    for (int64_t row = 0; row < rows; row++) {
      // Keys this row sees in the tile: its token's position and those before it.
      const int64_t position = context + j0 + row / group;
      const int visible = k0 + n <= first_masked ? n : static_cast<int>(std::clamp<int64_t>(position + 1 - k0, 0, n));
      w.visible[row] = visible;
      float* s = w.s.data() + row * kKeys;
      for (int t = visible; t < kKeys; t++) s[t] = -INFINITY;
      V mx = load<V>(s);
      for (int j = 1; j < NV; j++) {
        const V x = load<V>(s + j * lanes<V>());
        mx = x > mx ? x : mx;
      }
      const float m_old = w.m[row];
      const float m_new = visible ? std::max(m_old, reduce_max(mx)) : m_old;
      w.alpha[row] = m_old - m_new;  // exponentiated below
      w.m[row] = m_new;
    }
    {
      int64_t row = 0;
      for (; row + lanes<V>() <= rows; row += lanes<V>())
        store<V>(w.alpha.data() + row, exp_nonpositive(load<V>(w.alpha.data() + row)));
      for (; row < rows; row++) w.alpha[row] = std::exp(std::max(w.alpha[row], -87.f));
    }
    for (int64_t row = 0; row < rows; row++) {
      const int visible = w.visible[row];
      if (visible == 0) continue;
      float* s = w.s.data() + row * kKeys;
      const V m = splat<V>(w.m[row]);
      V sum = V{};
      for (int j = 0; j < NV; j++) {
        const V p = exp_nonpositive(load<V>(s + j * lanes<V>()) - m);
        store<V>(s + j * lanes<V>(), p);
      }
      for (int t = visible; t < kKeys; t++) s[t] = 0.f;
      for (int j = 0; j < NV; j++) sum += load<V>(s + j * lanes<V>());
      w.l[row] = w.l[row] * w.alpha[row] + reduce_sum(sum);
      accumulate_values<V>(w.o.data() + row * D, w.alpha[row], s, w.v.data(), visible, D);
    }
  }
  for (int64_t j = j0; j < j1; j++)
    for (int64_t g = 0; g < group; g++) {
      const int64_t row = (j - j0) * group + g;
      float* out = P.out + (q_begin + j) * P.os + (h * group + g) * D;
      const float inv = 1.f / w.l[row];
      const float* o = w.o.data() + row * D;
      for (int64_t d = 0; d < D; d++) out[d] = o[d] * inv;
    }
}

template <typename V>
void run(const Problem& P, int64_t first_req, int64_t num_reqs, int64_t num_kv_heads) {
  // Work items: (request, KV head, tile of query tokens), heaviest (last) tiles first.
  struct Item {
    int64_t r, h, j0, j1;
  };
  std::vector<Item> items;
  for (int64_t r = first_req; r < num_reqs; r++) {
    const int64_t q_len = P.query_start[r + 1] - P.query_start[r];
    if (q_len <= 0) continue;
    for (int64_t j0 = (q_len - 1) / kQueryTokens * kQueryTokens; j0 >= 0; j0 -= kQueryTokens)
      for (int64_t h = 0; h < num_kv_heads; h++) items.push_back({r, h, j0, std::min(q_len, j0 + kQueryTokens)});
  }
  parallel_chunks(static_cast<int64_t>(items.size()), [&](int64_t i) {
    thread_local Scratch scratch;
    const Item& it = items[i];
    tile<V>(P, it.r, it.h, it.j0, it.j1, scratch);
  });
}

void paged_prefill_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                             const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                             const at::Tensor& query_start_loc, int64_t first_req, double scale, int64_t vector_width) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2) &&
                  query.scalar_type() == at::kFloat,
              "query must be float32 [tokens, heads, head_dim] with contiguous heads");
  TORCH_CHECK(out.sizes() == query.sizes() && out.stride(2) == 1 && out.stride(1) == out.size(2) &&
                  out.scalar_type() == at::kFloat,
              "out must be like query");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() && key_cache.scalar_type() == at::kFloat &&
                  value_cache.scalar_type() == at::kFloat && key_cache.dim() == 4,
              "caches must be contiguous float32 [blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt && block_tables.stride(1) == 1,
              "block_tables, seq_lens and query_start_loc must be int32");
  const int64_t num_reqs = seq_lens.size(0);
  TORCH_CHECK(query_start_loc.size(0) >= num_reqs + 1, "query_start_loc needs num_reqs + 1 entries");
  TORCH_CHECK(0 <= first_req && first_req <= num_reqs, "first_req out of range");
  const int64_t num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_dim, "the caches' head_dim differs from the query's");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  if (vector_width == 0) vector_width = kNativeLanes;
  TORCH_CHECK(vector_width == 8 || vector_width == 16, "vector_width must be 0, 8 or 16");
  Problem P{query.data_ptr<float>(),
            out.data_ptr<float>(),
            key_cache.data_ptr<float>(),
            value_cache.data_ptr<float>(),
            block_tables.data_ptr<int32_t>(),
            seq_lens.data_ptr<int32_t>(),
            query_start_loc.data_ptr<int32_t>(),
            query.stride(0),
            out.stride(0),
            block_tables.stride(0),
            block_size,
            block_size * num_kv_heads * head_dim,
            num_kv_heads * head_dim,
            num_heads / num_kv_heads,
            head_dim,
            static_cast<float>(scale)};
  if (vector_width == 16)
    run<v16>(P, first_req, num_reqs, num_kv_heads);
  else
    run<v8>(P, first_req, num_reqs, num_kv_heads);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(compiled_llm_cpu, m) {
  m.def(
      "paged_prefill_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, int first_req, float scale, "
      "int vector_width=0) -> ()");
}

TORCH_LIBRARY_IMPL(compiled_llm_cpu, CPU, m) {
  m.impl("paged_prefill_attention", paged_prefill_attention);
}
