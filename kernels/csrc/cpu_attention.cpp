// Paged attention kernels for CPUs: the KV-cache write and single-token (decode) attention.
//
// They read the paged cache in place (no gather into a contiguous copy) and do a whole batch in
// one call, which is what makes decode fast on a CPU: the torch path spends most of a decode
// layer on gathers and per-op overhead. Prefills keep using the torch path (SDPA), which is
// compute-bound and already efficient.
//
// Layouts: query/key/value [tokens, heads, head_dim] (head_dim contiguous); key_cache and
// value_cache [num_blocks, block_size, num_kv_heads, head_dim] (contiguous); block_tables
// [num_reqs, max_blocks] int32; seq_lens [num_reqs] int32; slot_mapping [tokens] int64.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

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

// exp(x) for x <= 0 (softmax arguments), in place over n floats: a degree-6 polynomial on the
// fraction after splitting off the power of two; relative error ~1e-7.
inline void exp_inplace(float* x, int64_t n) {
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 log2e = _mm256_set1_ps(1.44269504088896341f), ln2 = _mm256_set1_ps(0.693147180559945309f);
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 c1 = _mm256_set1_ps(1.0f), c2 = _mm256_set1_ps(0.5f), c3 = _mm256_set1_ps(1.66666666e-1f),
               c4 = _mm256_set1_ps(4.16666666e-2f), c5 = _mm256_set1_ps(8.33333333e-3f), c6 = _mm256_set1_ps(1.38888889e-3f);
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_max_ps(_mm256_loadu_ps(x + i), lo);
    __m256 k = _mm256_round_ps(_mm256_mul_ps(v, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(k, ln2, v);  // v - k ln2, |r| <= ln2 / 2
    __m256 p = _mm256_fmadd_ps(c6, r, c5);
    p = _mm256_fmadd_ps(p, r, c4);
    p = _mm256_fmadd_ps(p, r, c3);
    p = _mm256_fmadd_ps(p, r, c2);
    p = _mm256_fmadd_ps(p, r, c1);
    p = _mm256_fmadd_ps(p, r, c1);
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    _mm256_storeu_ps(x + i, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
  }
#endif
  for (; i < n; i++) x[i] = std::exp(x[i]);
}

inline void axpy(float* y, float alpha, const float* x, int64_t n) {
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 a = _mm256_set1_ps(alpha);
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(a, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
  for (; i < n; i++) y[i] += alpha * x[i];
}

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
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; t++) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;  // a padded token
      std::memcpy(kc + slot * row, k + t * ks, row * sizeof(float));
      std::memcpy(vc + slot * row, v + t * vs, row * sizeof(float));
    }
  });
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
  TORCH_CHECK(group <= 64, "at most 64 query heads per KV head");

  // Small batches run on the calling thread: waking the pool costs more than the work.
  int64_t total_positions = 0;
  for (int64_t r = 0; r < num_reqs; r++) total_positions += std::max<int32_t>(lens[r], 0);
  const int64_t work_items = num_reqs * num_kv_heads;
  const int64_t cost_per_item = std::max<int64_t>(1, total_positions * group * head_dim / std::max<int64_t>(num_reqs, 1));
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 17) / cost_per_item);

  at::parallel_for(0, work_items, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    float row_max[64], denom[64];
    for (int64_t work = begin; work < end; work++) {
      const int64_t r = work / num_kv_heads, h = work % num_kv_heads;
      const int64_t len = lens[r];
      float* out_rows = o + r * os + h * group * head_dim;
      std::fill(out_rows, out_rows + group * head_dim, 0.f);
      if (len <= 0) continue;  // a padded request
      const float* q_rows = q + r * qs + h * group * head_dim;
      scores.resize(static_cast<size_t>(group * len));
      std::fill(row_max, row_max + group, -INFINITY);
      for (int64_t pos = 0; pos < len; pos++) {
        const int64_t block = tables[r * ts + pos / block_size];
        const float* k = kc + block * block_stride + (pos % block_size) * token_stride + h * head_dim;
        for (int64_t g = 0; g < group; g++) {
          const float s = dot(q_rows + g * head_dim, k, head_dim) * fscale;
          scores[g * len + pos] = s;
          row_max[g] = std::max(row_max[g], s);
        }
      }
      std::fill(denom, denom + group, 0.f);
      for (int64_t g = 0; g < group; g++) {
        float* s = scores.data() + g * len;
        for (int64_t pos = 0; pos < len; pos++) s[pos] -= row_max[g];
        exp_inplace(s, len);
        for (int64_t pos = 0; pos < len; pos++) denom[g] += s[pos];
      }
      for (int64_t pos = 0; pos < len; pos++) {
        const int64_t block = tables[r * ts + pos / block_size];
        const float* v = vc + block * block_stride + (pos % block_size) * token_stride + h * head_dim;
        for (int64_t g = 0; g < group; g++) axpy(out_rows + g * head_dim, scores[g * len + pos], v, head_dim);
      }
      for (int64_t g = 0; g < group; g++) {
        const float inv = 1.f / denom[g];
        for (int64_t d = 0; d < head_dim; d++) out_rows[g * head_dim + d] *= inv;
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
