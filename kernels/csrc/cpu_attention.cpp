// Paged attention kernels for CPUs: the KV-cache write and single-token (decode) attention.
//
// They read the paged cache in place (no gather into a contiguous copy) and do a whole batch in
// one call, which is what makes decode fast on a CPU: the torch path spends most of a decode
// layer on gathers and per-op overhead. Prefills have their own kernel
// (cpu_prefill_attention.cpp).
//
// Layouts: query/key/value [tokens, heads, head_dim] (head_dim contiguous); key_cache and
// value_cache [num_blocks, block_size, num_kv_heads, head_dim] (contiguous); block_tables
// [num_reqs, max_blocks] int32; seq_lens [num_reqs] int32; slot_mapping [tokens] int64.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "simd.h"

namespace {

using namespace compiled_llm_cpu;

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 3 && t.stride(2) == 1 && t.stride(1) == t.size(2), name,
              " must be [tokens, heads, head_dim] with contiguous heads");
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32");
}

void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                    at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  check_rows(key, "key");
  check_rows(value, "value");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  const int64_t tokens = slot_mapping.size(0);
  const int64_t row = key.size(1) * key.size(2);  // floats per token
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const float* k = key.data_ptr<float>();
  const float* v = value.data_ptr<float>();
  float* kc = key_cache.data_ptr<float>();
  float* vc = value_cache.data_ptr<float>();
  const int64_t ks = key.stride(0), vs = value.stride(0);
  for (int64_t t = 0; t < tokens; t++) {  // a few KB a token: one thread keeps up
    const int64_t slot = slots[t];
    if (slot < 0) continue;  // a padded token
    std::memcpy(kc + slot * row, k + t * ks, row * sizeof(float));
    std::memcpy(vc + slot * row, v + t * vs, row * sizeof(float));
  }
}

// Decode attention for one request over KV heads [h0, h1): `group` query heads per KV head.
// The cache is walked block by block (each block's rows hold every KV head, contiguously), so
// memory is read sequentially once per phase. Scores take four positions at a time
// (independent accumulators, one batched reduction); values are summed per block into
// per-head accumulators.
template <int D>
void decode_request(const float* q_req, float* out_req, const float* kc, const float* vc, const int32_t* table,
                    int64_t len, int64_t h0, int64_t h1, int64_t group, int64_t block_size, int64_t block_stride,
                    int64_t token_stride, float scale, std::vector<float>& scores) {
  const int64_t rows = (h1 - h0) * group;  // query heads handled here
  scores.resize(static_cast<size_t>(rows * len));
  const int64_t num_blocks = (len + block_size - 1) / block_size;
  // Blocks sit anywhere in the pool and hardware prefetchers stop at page boundaries: fetch the
  // next block's rows (this request's heads only) while working on the current one.
  auto prefetch_block = [&](const float* cache, int64_t b) {
    if (b >= num_blocks) return;
    const char* base = reinterpret_cast<const char*>(cache + table[b] * block_stride + h0 * D);
    const int64_t bytes = (h1 - h0) * D * static_cast<int64_t>(sizeof(float));
    const int64_t n = std::min(block_size, len - b * block_size);
    for (int64_t i = 0; i < n; i++)
      for (int64_t off = 0; off < bytes; off += 64)
        __builtin_prefetch(base + i * token_stride * static_cast<int64_t>(sizeof(float)) + off);
  };
  prefetch_block(kc, 0);
  // Scores.
  for (int64_t b = 0; b < num_blocks; b++) {
    const float* kb = kc + table[b] * block_stride;
    const int64_t first = b * block_size, n = std::min(block_size, len - first);
    prefetch_block(kc, b + 1);
    for (int64_t h = h0; h < h1; h++) {
      for (int64_t g = 0; g < group; g++) {
        const int64_t row = (h - h0) * group + g;
        const float* q = q_req + (h * group + g) * D;
        float* s = scores.data() + row * len + first;
        int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
        __m256 qv[D / 8];
        for (int j = 0; j < D / 8; j++) qv[j] = _mm256_loadu_ps(q + 8 * j);
        for (; i + 4 <= n; i += 4) {
          const float* k0 = kb + i * token_stride + h * D;
          const float *k1 = k0 + token_stride, *k2 = k1 + token_stride, *k3 = k2 + token_stride;
          __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
          for (int j = 0; j < D / 8; j++) {
            a0 = _mm256_fmadd_ps(qv[j], _mm256_loadu_ps(k0 + 8 * j), a0);
            a1 = _mm256_fmadd_ps(qv[j], _mm256_loadu_ps(k1 + 8 * j), a1);
            a2 = _mm256_fmadd_ps(qv[j], _mm256_loadu_ps(k2 + 8 * j), a2);
            a3 = _mm256_fmadd_ps(qv[j], _mm256_loadu_ps(k3 + 8 * j), a3);
          }
          _mm_storeu_ps(s + i, _mm_mul_ps(hsum4(a0, a1, a2, a3), _mm_set1_ps(scale)));
        }
#endif
        for (; i < n; i++) s[i] = dot(q, kb + i * token_stride + h * D, D) * scale;
      }
    }
  }
  // Softmax per query head (normalised at the end).
  float denom[256];
  for (int64_t row = 0; row < rows; row++) {
    float* s = scores.data() + row * len;
    float row_max = -INFINITY;
    for (int64_t p = 0; p < len; p++) row_max = std::max(row_max, s[p]);
    for (int64_t p = 0; p < len; p++) s[p] -= row_max;
    exp_inplace(s, len);
    float sum = 0.f;
    for (int64_t p = 0; p < len; p++) sum += s[p];
    denom[row] = sum;
  }
  // Weighted values, accumulated into the output rows block by block.
  for (int64_t row = 0; row < rows; row++) std::fill(out_req + (h0 * group + row) * D, out_req + (h0 * group + row + 1) * D, 0.f);
  prefetch_block(vc, 0);
  for (int64_t b = 0; b < num_blocks; b++) {
    const float* vb = vc + table[b] * block_stride;
    const int64_t first = b * block_size, n = std::min(block_size, len - first);
    prefetch_block(vc, b + 1);
    for (int64_t h = h0; h < h1; h++) {
      for (int64_t g = 0; g < group; g++) {
        const int64_t row = (h - h0) * group + g;
        const float* w = scores.data() + row * len + first;
        float* out = out_req + (h * group + g) * D;
#if defined(__AVX2__) && defined(__FMA__)
        __m256 acc[D / 8];
        for (int j = 0; j < D / 8; j++) acc[j] = _mm256_loadu_ps(out + 8 * j);
        for (int64_t i = 0; i < n; i++) {
          const float* v = vb + i * token_stride + h * D;
          const __m256 wi = _mm256_set1_ps(w[i]);
          for (int j = 0; j < D / 8; j++) acc[j] = _mm256_fmadd_ps(wi, _mm256_loadu_ps(v + 8 * j), acc[j]);
        }
        for (int j = 0; j < D / 8; j++) _mm256_storeu_ps(out + 8 * j, acc[j]);
#else
        for (int64_t i = 0; i < n; i++) axpy(out, w[i], vb + i * token_stride + h * D, D);
#endif
      }
    }
  }
  for (int64_t row = 0; row < rows; row++) {
    float* out = out_req + (h0 * group + row) * D;
    const float inv = 1.f / denom[row];
    for (int64_t d = 0; d < D; d++) out[d] *= inv;
  }
}

// Any head_dim (the slow path): scalar-friendly loops.
void decode_one_any(const float* q_rows, float* out_rows, const float* kc, const float* vc, const int32_t* table,
                    int64_t len, int64_t group, int64_t head_dim, int64_t block_size, int64_t block_stride,
                    int64_t token_stride, float scale, std::vector<float>& scores) {
  scores.resize(static_cast<size_t>(len));
  for (int64_t g = 0; g < group; g++) {
    const float* q = q_rows + g * head_dim;
    float* out = out_rows + g * head_dim;
    float row_max = -INFINITY;
    for (int64_t p = 0; p < len; p++) {
      const float* k = kc + table[p / block_size] * block_stride + (p % block_size) * token_stride;
      scores[p] = dot(q, k, head_dim) * scale;
      row_max = std::max(row_max, scores[p]);
    }
    for (int64_t p = 0; p < len; p++) scores[p] -= row_max;
    exp_inplace(scores.data(), len);
    float denom = 0.f;
    std::fill(out, out + head_dim, 0.f);
    for (int64_t p = 0; p < len; p++) {
      denom += scores[p];
      axpy(out, scores[p], vc + table[p / block_size] * block_stride + (p % block_size) * token_stride, head_dim);
    }
    for (int64_t d = 0; d < head_dim; d++) out[d] /= denom;
  }
}

void paged_decode_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double scale) {
  check_rows(query, "query");
  check_rows(out, "out");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt, "int32 tables");
  const int64_t num_reqs = seq_lens.size(0);
  const int64_t num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  TORCH_CHECK(group * num_kv_heads == num_heads, "num_heads must be a multiple of num_kv_heads");
  const float* q = query.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const float* kc = key_cache.data_ptr<float>();
  const float* vc = value_cache.data_ptr<float>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t qs = query.stride(0), os = out.stride(0), ts = block_tables.stride(0);
  const int64_t block_stride = block_size * num_kv_heads * head_dim, token_stride = num_kv_heads * head_dim;
  const float fscale = static_cast<float>(scale);
  TORCH_CHECK((block_size & (block_size - 1)) == 0, "block_size must be a power of two");

  TORCH_CHECK(num_heads <= 256, "at most 256 query heads");

  // Work items: whole requests when there are enough of them to keep the threads busy (each
  // request's cache blocks are then read once, sequentially); otherwise (request, KV head).
  const bool split_heads = num_reqs < 2 * at::get_num_threads();
  const int64_t per_req = split_heads ? num_kv_heads : 1;
  const int64_t work_items = num_reqs * per_req;
  int64_t total_positions = 0;
  for (int64_t r = 0; r < num_reqs; r++) total_positions += std::max<int32_t>(lens[r], 0);
  // Chunks of work items of about 2^16 multiply-adds: a batch-1 decode over a short context is
  // one chunk (on the calling thread), a long one is split over the threads.
  const int64_t cost_per_item = std::max<int64_t>(1, total_positions * num_heads * head_dim / std::max<int64_t>(work_items, 1));
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / cost_per_item);

  const int64_t chunks = (work_items + grain - 1) / grain;
  parallel_chunks(chunks, [&](int64_t chunk) {
    thread_local std::vector<float> scores;
    const int64_t begin = chunk * grain, end = std::min(work_items, begin + grain);
    for (int64_t work = begin; work < end; work++) {
      const int64_t r = work / per_req;
      const int64_t h0 = split_heads ? work % per_req : 0, h1 = split_heads ? h0 + 1 : num_kv_heads;
      const int64_t len = lens[r];
      const float* q_req = q + r * qs;
      float* out_req = o + r * os;
      if (len <= 0) {  // a padded request
        std::fill(out_req + h0 * group * head_dim, out_req + h1 * group * head_dim, 0.f);
        continue;
      }
      const int32_t* table = tables + r * ts;
      switch (head_dim) {
        case 64:
          decode_request<64>(q_req, out_req, kc, vc, table, len, h0, h1, group, block_size, block_stride, token_stride, fscale, scores);
          break;
        case 128:
          decode_request<128>(q_req, out_req, kc, vc, table, len, h0, h1, group, block_size, block_stride, token_stride, fscale, scores);
          break;
        case 32:
          decode_request<32>(q_req, out_req, kc, vc, table, len, h0, h1, group, block_size, block_stride, token_stride, fscale, scores);
          break;
        default:
          for (int64_t h = h0; h < h1; h++) {
            decode_one_any(q_req + h * group * head_dim, out_req + h * group * head_dim, kc + h * head_dim, vc + h * head_dim,
                           table, len, group, head_dim, block_size, block_stride, token_stride, fscale, scores);
          }
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY(compiled_llm_cpu, m) {
  m.def("write_kv_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slot_mapping) -> ()");
  m.def("paged_decode_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, Tensor seq_lens, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(compiled_llm_cpu, CPU, m) {
  m.impl("write_kv_cache", write_kv_cache);
  m.impl("paged_decode_attention", paged_decode_attention);
}
