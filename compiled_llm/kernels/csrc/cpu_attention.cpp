// Paged attention kernels for CPUs: the KV-cache write and decode attention, of requests with
// one query token and of those with a few (a speculative verification, a tiny prefill chunk).
//
// They read the paged cache in place (no gather into a contiguous copy) and do a whole batch in
// one call, which is what makes decode fast on a CPU: the torch path spends most of a decode
// layer on gathers and per-op overhead. A request with a few query tokens reads each cached row
// once for all of them; the prefill kernel's tiles and online softmax took 1.6-1.8x as long for 5
// tokens over a 900-token context of SmolLM2. Longer prefills have their own kernel
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
#include <type_traits>
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
    TORCH_CHECK((slot + 1) * row <= key_cache.numel() && (slot + 1) * row <= value_cache.numel(), "slot ", slot,
                " is outside the KV cache");
    std::memcpy(kc + slot * row, k + t * ks, row * sizeof(float));
    std::memcpy(vc + slot * row, v + t * vs, row * sizeof(float));
  }
}

#if defined(__AVX512F__)
// With AVX-512 (head_dim a multiple of 16), decode_range computes a block's scores 16 positions
// at a time against its keys transposed in registers (kt[d]: dimension d of the 16 positions), so
// that each query row costs one FMA per dimension and no horizontal sums, and its weighted
// values 4 rows at a time, each value row loaded once for them: a verification's 5 query tokens
// (15 rows a KV head for SmolLM2) then cost little more than a decode's 1.
inline void transpose16x16(__m512 (&r)[16]) {
  __m512 t[16], u[16], v[16];
  for (int i = 0; i < 8; i++) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; i++) {
    u[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int i = 0; i < 2; i++)
    for (int k = 0; k < 4; k++) {
      v[8 * i + k] = _mm512_shuffle_f32x4(u[8 * i + k], u[8 * i + 4 + k], 0x88);
      v[8 * i + 4 + k] = _mm512_shuffle_f32x4(u[8 * i + k], u[8 * i + 4 + k], 0xDD);
    }
  for (int k = 0; k < 8; k++) {
    r[k] = _mm512_shuffle_f32x4(v[k], v[8 + k], 0x88);
    r[8 + k] = _mm512_shuffle_f32x4(v[k], v[8 + k], 0xDD);
  }
}

// kt[d][0..16) = key row i0 + p's dimension d (p < n; zero past n), for a tile of 16 positions.
template <int D>
inline void transpose_keys(const float* kb, int64_t token_stride, int64_t n, float (*kt)[16]) {
  for (int c = 0; c < D / 16; c++) {
    __m512 r[16];
    for (int p = 0; p < 16; p++) r[p] = p < n ? _mm512_loadu_ps(kb + p * token_stride + 16 * c) : _mm512_setzero_ps();
    transpose16x16(r);
    for (int d = 0; d < 16; d++) _mm512_store_ps(kt[16 * c + d], r[d]);
  }
}

// s[i][0..n) = scale * q[i] . key(p) for R query rows against a transposed tile. D / 16
// accumulators a row (dimension d in d % (D / 16)), summed pairwise: each chain is 16 products
// long, as each lane's is in the AVX2 kernel, and the same for every row whatever R is.
template <int D, int R>
inline void score_rows(const float* const* q, const float (*kt)[16], float scale, float* const* s, int64_t n) {
  constexpr int A = D / 16;
  __m512 a[R][A];
  for (int i = 0; i < R; i++)
    for (int u = 0; u < A; u++) a[i][u] = _mm512_setzero_ps();
  for (int d = 0; d < D; d += A)
    for (int u = 0; u < A; u++) {
      const __m512 k = _mm512_load_ps(kt[d + u]);
      for (int i = 0; i < R; i++) a[i][u] = _mm512_fmadd_ps(_mm512_set1_ps(q[i][d + u]), k, a[i][u]);
    }
  const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
  for (int i = 0; i < R; i++) {
    for (int width = A / 2; width > 0; width /= 2)
      for (int u = 0; u < width; u++) a[i][u] = _mm512_add_ps(a[i][u], a[i][u + width]);
    _mm512_mask_storeu_ps(s[i], mask, _mm512_mul_ps(a[i][0], _mm512_set1_ps(scale)));
  }
}

// o[i] += sum over p < n of w[i][p] * value(p) for R rows, each value row loaded once for all.
template <int D, int R>
inline void weigh_rows(const float* vb, int64_t token_stride, int64_t n, const float* const* w, float* const* o) {
  __m512 acc[R][D / 16];
  for (int i = 0; i < R; i++)
    for (int c = 0; c < D / 16; c++) acc[i][c] = _mm512_loadu_ps(o[i] + 16 * c);
  for (int64_t p = 0; p < n; p++) {
    __m512 v[D / 16];
    for (int c = 0; c < D / 16; c++) v[c] = _mm512_loadu_ps(vb + p * token_stride + 16 * c);
    for (int i = 0; i < R; i++) {
      const __m512 wi = _mm512_set1_ps(w[i][p]);
      for (int c = 0; c < D / 16; c++) acc[i][c] = _mm512_fmadd_ps(wi, v[c], acc[i][c]);
    }
  }
  for (int i = 0; i < R; i++)
    for (int c = 0; c < D / 16; c++) _mm512_storeu_ps(o[i] + 16 * c, acc[i][c]);
}

// Rows per score_rows / weigh_rows call: their accumulators (D / 16 a row) fit the 32 registers.
template <int D>
constexpr int wide_rows() {
  return D <= 64 ? 4 : 2;
}
static_assert((64 / 16) * wide_rows<64>() <= 16 && (128 / 16) * wide_rows<128>() <= 16);

// f(std::integral_constant<int, rows>{}) for a run-time 1 <= rows <= R: the row count as a
// template argument of the micro-kernels.
template <int R, class F>
inline void with_rows(int rows, const F& f) {
  if constexpr (R > 1)
    if (rows < R) return with_rows<R - 1>(rows, f);
  f(std::integral_constant<int, R>{});
}
#endif

// Decode attention of one request's query tokens (q_len of them, q_stride floats apart) for KV
// heads [h0, h1) over context positions [p0, p1) (p0 a multiple of block_size). Query token j
// sees positions below seq_len - q_len + j + 1 (causal). `out` holds, for each token
// (out_stride apart), the rows of those query heads, D floats apart. The cache is walked block
// by block (each block's rows hold every KV head, contiguously), each block used for every query
// row it serves while it is in L1, so memory is read sequentially once per phase. Scores take
// four positions at a time (independent accumulators, one batched reduction); values are summed
// per block into per-row accumulators. Rows are ordered (token, head, head in the group).
template <int D>
void decode_range(const float* q_req, int64_t q_stride, float* out, int64_t out_stride, const float* kc,
                  const float* vc, const int32_t* table, int64_t p0, int64_t p1, int64_t h0, int64_t h1, int64_t group,
                  int64_t q_len, int64_t seq_len, int64_t block_size, int64_t block_stride, int64_t token_stride,
                  float scale, float* stat, std::vector<float>& scores) {
  const int64_t heads = (h1 - h0) * group;  // query heads handled here
  const int64_t rows = heads * q_len;
  const int64_t len = p1 - p0;
  scores.resize(static_cast<size_t>(rows * (len + 2)));
  float* row_max = scores.data() + rows * len;
  float* denom = row_max + rows;
  // Positions token j sees (past p0): the causal limit, clipped to this range.
  auto visible = [&](int64_t j) { return std::clamp<int64_t>(seq_len - q_len + j + 1 - p0, 0, len); };
  const int64_t b0 = p0 / block_size, b1 = (p1 + block_size - 1) / block_size;
  // Blocks sit anywhere in the pool and hardware prefetchers stop at page boundaries: fetch the
  // next block's rows (this item's heads only) while working on the current one.
  auto prefetch_block = [&](const float* cache, int64_t b) {
    if (b >= b1) return;
    const char* base = reinterpret_cast<const char*>(cache + table[b] * block_stride + h0 * D);
    const int64_t bytes = (h1 - h0) * D * static_cast<int64_t>(sizeof(float));
    const int64_t n = std::min(block_size, p1 - b * block_size);
    for (int64_t i = 0; i < n; i++)
      for (int64_t off = 0; off < bytes; off += 64)
        __builtin_prefetch(base + i * token_stride * static_cast<int64_t>(sizeof(float)) + off);
  };
  prefetch_block(kc, b0);
#if defined(__AVX512F__)
  constexpr bool wide = D % 16 == 0;
#else
  constexpr bool wide = false;
#endif
#if defined(__AVX512F__)
  const int64_t head_rows = q_len * group;  // a KV head's query rows: (token, head in the group)
  // Row i of KV head h: its row in `scores` and its query.
  auto row_of = [&](int64_t h, int64_t i) { return i / group * heads + (h - h0) * group + i % group; };
  auto query_of = [&](int64_t h, int64_t i) { return q_req + i / group * q_stride + (h * group + i % group) * D; };
#endif
  // Scores.
#if defined(__AVX512F__)
  if constexpr (wide) {
    constexpr int R = wide_rows<D>();
    for (int64_t b = b0; b < b1; b++) {
      const float* kb = kc + table[b] * block_stride;
      const int64_t first = b * block_size - p0, block_n = std::min(block_size, p1 - b * block_size);
      prefetch_block(kc, b + 1);
      for (int64_t h = h0; h < h1; h++) {
        for (int64_t i0 = 0; i0 < block_n; i0 += 16) {
          const int64_t n = std::min<int64_t>(16, block_n - i0);
          alignas(64) float kt[D][16];
          transpose_keys<D>(kb + i0 * token_stride + h * D, token_stride, n, kt);
          // Every row of the head, those past their causal limit too (their softmax reads only
          // the positions they see; the rest is zeroed before the values are weighed).
          for (int64_t i = 0; i < head_rows; i += R) {
            const float* q[R];
            float* out_rows[R];
            const int rows_here = static_cast<int>(std::min<int64_t>(R, head_rows - i));
            for (int r = 0; r < rows_here; r++) {
              q[r] = query_of(h, i + r);
              out_rows[r] = scores.data() + row_of(h, i + r) * len + first + i0;
            }
            with_rows<R>(rows_here, [&](auto rows) { score_rows<D, rows()>(q, kt, scale, out_rows, n); });
          }
        }
      }
    }
  }
#endif
  for (int64_t b = wide ? b1 : b0; b < b1; b++) {
    const float* kb = kc + table[b] * block_stride;
    const int64_t first = b * block_size - p0, block_n = std::min(block_size, p1 - b * block_size);
    prefetch_block(kc, b + 1);
    for (int64_t h = h0; h < h1; h++) {
      for (int64_t j = 0; j < q_len; j++) {
        const int64_t n = std::min(block_n, visible(j) - first);
        if (n <= 0) continue;
        for (int64_t g = 0; g < group; g++) {
          const int64_t row = j * heads + (h - h0) * group + g;
          const float* q = q_req + j * q_stride + (h * group + g) * D;
          float* s = scores.data() + row * len + first;
          int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
          __m256 qv[D / 8];
          for (int k = 0; k < D / 8; k++) qv[k] = _mm256_loadu_ps(q + 8 * k);
          for (; i + 4 <= n; i += 4) {
            const float* k0 = kb + i * token_stride + h * D;
            const float *k1 = k0 + token_stride, *k2 = k1 + token_stride, *k3 = k2 + token_stride;
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
            for (int k = 0; k < D / 8; k++) {
              a0 = _mm256_fmadd_ps(qv[k], _mm256_loadu_ps(k0 + 8 * k), a0);
              a1 = _mm256_fmadd_ps(qv[k], _mm256_loadu_ps(k1 + 8 * k), a1);
              a2 = _mm256_fmadd_ps(qv[k], _mm256_loadu_ps(k2 + 8 * k), a2);
              a3 = _mm256_fmadd_ps(qv[k], _mm256_loadu_ps(k3 + 8 * k), a3);
            }
            _mm_storeu_ps(s + i, _mm_mul_ps(hsum4(a0, a1, a2, a3), _mm_set1_ps(scale)));
          }
#endif
          for (; i < n; i++) s[i] = dot(q, kb + i * token_stride + h * D, D) * scale;
        }
      }
    }
  }
  // Softmax numerators per row (normalised at the end, or by the merge); a row that sees none of
  // the range (a split context's last part) gets max -inf and sum 0, which the merge weighs 0.
  for (int64_t row = 0; row < rows; row++) {
    float* s = scores.data() + row * len;
    const int64_t n = visible(row / heads);
    row_max[row] = max_of(s, n);
    denom[row] = n > 0 ? exp_sum_inplace(s, n, row_max[row]) : 0.f;
    if (wide) std::fill(s + n, s + len, 0.f);  // weighed with the rows that see further: adds zeros
  }
  // Weighted values, accumulated into the output rows block by block.
  for (int64_t j = 0; j < q_len; j++) std::fill(out + j * out_stride, out + j * out_stride + heads * D, 0.f);
  prefetch_block(vc, b0);
#if defined(__AVX512F__)
  if constexpr (wide) {
    constexpr int R = wide_rows<D>();
    for (int64_t b = b0; b < b1; b++) {
      const float* vb = vc + table[b] * block_stride;
      const int64_t first = b * block_size - p0, block_n = std::min(block_size, p1 - b * block_size);
      prefetch_block(vc, b + 1);
      for (int64_t h = h0; h < h1; h++) {
        for (int64_t i = 0; i < head_rows; i += R) {
          const int rows_here = static_cast<int>(std::min<int64_t>(R, head_rows - i));
          // The positions the furthest-seeing of these rows sees in this block.
          const int64_t n = std::min(block_n, visible((i + rows_here - 1) / group) - first);
          if (n <= 0) continue;
          const float* w[R];
          float* o[R];
          for (int r = 0; r < rows_here; r++) {
            w[r] = scores.data() + row_of(h, i + r) * len + first;
            o[r] = out + (i + r) / group * out_stride + ((h - h0) * group + (i + r) % group) * D;
          }
          with_rows<R>(rows_here, [&](auto rows) { weigh_rows<D, rows()>(vb + h * D, token_stride, n, w, o); });
        }
      }
    }
  }
#endif
  for (int64_t b = wide ? b1 : b0; b < b1; b++) {
    const float* vb = vc + table[b] * block_stride;
    const int64_t first = b * block_size - p0, block_n = std::min(block_size, p1 - b * block_size);
    prefetch_block(vc, b + 1);
    for (int64_t h = h0; h < h1; h++) {
      for (int64_t j = 0; j < q_len; j++) {
        const int64_t n = std::min(block_n, visible(j) - first);
        if (n <= 0) continue;
        for (int64_t g = 0; g < group; g++) {
          const int64_t row = j * heads + (h - h0) * group + g;
          const float* w = scores.data() + row * len + first;
          float* o = out + j * out_stride + ((h - h0) * group + g) * D;
#if defined(__AVX2__) && defined(__FMA__)
          __m256 acc[D / 8];
          for (int k = 0; k < D / 8; k++) acc[k] = _mm256_loadu_ps(o + 8 * k);
          for (int64_t i = 0; i < n; i++) {
            const float* v = vb + i * token_stride + h * D;
            const __m256 wi = _mm256_set1_ps(w[i]);
            for (int k = 0; k < D / 8; k++) acc[k] = _mm256_fmadd_ps(wi, _mm256_loadu_ps(v + 8 * k), acc[k]);
          }
          for (int k = 0; k < D / 8; k++) _mm256_storeu_ps(o + 8 * k, acc[k]);
#else
          for (int64_t i = 0; i < n; i++) axpy(o, w[i], vb + i * token_stride + h * D, D);
#endif
        }
      }
    }
  }
  if (stat != nullptr) {  // a part of a split context: the merge normalises
    for (int64_t row = 0; row < rows; row++) {
      stat[2 * row] = row_max[row];
      stat[2 * row + 1] = denom[row];
    }
    return;
  }
  for (int64_t row = 0; row < rows; row++) {
    const float inv = 1.f / denom[row];
    float* o = out + (row / heads) * out_stride + (row % heads) * D;
    for (int64_t d = 0; d < D; d++) o[d] *= inv;
  }
}

// Any head_dim (the slow path), one KV head: scalar-friendly loops over its group's query rows
// for each of the q_len tokens (q_stride and out_stride floats apart), unnormalised into `out`
// with each row's max and sum in `stat` (row j * group + g) when that is given.
void decode_range_any(const float* q_head, int64_t q_stride, float* out_head, int64_t out_stride, const float* kc,
                      const float* vc, const int32_t* table, int64_t p0, int64_t p1, int64_t group, int64_t q_len,
                      int64_t seq_len, int64_t head_dim, int64_t block_size, int64_t block_stride,
                      int64_t token_stride, float scale, float* stat, std::vector<float>& scores) {
  const int64_t len = p1 - p0;
  scores.resize(static_cast<size_t>(len));
  for (int64_t j = 0; j < q_len; j++) {
    const int64_t end = p0 + std::clamp<int64_t>(seq_len - q_len + j + 1 - p0, 0, len);  // causal limit
    for (int64_t g = 0; g < group; g++) {
      const float* q = q_head + j * q_stride + g * head_dim;
      float* out = out_head + j * out_stride + g * head_dim;
      for (int64_t p = p0; p < end; p++) {
        const float* k = kc + table[p / block_size] * block_stride + (p % block_size) * token_stride;
        scores[p - p0] = dot(q, k, head_dim) * scale;
      }
      const float row_max = max_of(scores.data(), end - p0);
      const float denom = end > p0 ? exp_sum_inplace(scores.data(), end - p0, row_max) : 0.f;
      std::fill(out, out + head_dim, 0.f);
      for (int64_t p = p0; p < end; p++)
        axpy(out, scores[p - p0], vc + table[p / block_size] * block_stride + (p % block_size) * token_stride,
             head_dim);
      if (stat != nullptr) {
        stat[2 * (j * group + g)] = row_max;
        stat[2 * (j * group + g) + 1] = denom;
      } else {
        for (int64_t d = 0; d < head_dim; d++) out[d] /= denom;
      }
    }
  }
}

// One work item: request reqs[r]'s KV heads [h0, h1) over positions [p0, p1); `part` >= 0 is the
// first of its rows (token, head in the group) in the partial buffers (a split context), -1
// writes the output directly.
struct Item {
  int64_t r, h0, h1, p0, p1, part;
};

constexpr int64_t kMaxSplits = 16;  // position ranges of one context at most

}  // namespace

namespace compiled_llm_cpu {

// A request for decode_attention: its query tokens are rows [row, row + q_len) of the query and
// the output, its block table is row `req` of the tables. (Declared alike in
// cpu_attention_step.cpp.)
struct DecodeRequest {
  int64_t req, row, q_len, seq_len;
};

void decode_attention(float* out, int64_t out_stride, const float* query, int64_t query_stride,
                      const float* key_cache, const float* value_cache, const int32_t* block_tables,
                      int64_t table_stride, const DecodeRequest* reqs, int64_t num_reqs, int64_t num_heads,
                      int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale) {
  if (num_reqs <= 0) return;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t block_stride = block_size * num_kv_heads * head_dim, token_stride = num_kv_heads * head_dim;
  const int threads = at::get_num_threads();
  // Cost of a request: its positions times its query tokens (each position is used once a row).
  auto cost_of = [&](int64_t r, int64_t positions) { return std::max<int64_t>(positions, 0) * reqs[r].q_len; };
  int64_t total_cost = 0;
  for (int64_t r = 0; r < num_reqs; r++) total_cost += cost_of(r, reqs[r].seq_len);
  const int64_t total_work = total_cost * num_heads * head_dim;  // multiply-adds per phase

  // Work items: whole requests when there are enough of them to keep the threads busy (each
  // request's cache blocks are then read once, sequentially); otherwise (request, KV head), and
  // when even those are fewer than two per thread, each context cut into block-aligned position
  // ranges (flash-decoding), so that one request's 3 KV heads spread evenly over 2 threads. Work
  // under about 2^17 multiply-adds (a batch-1 context of ~200 for SmolLM2) stays on the calling
  // thread, whole: there a pool hand-off and the merge cost about what a second thread saves.
  constexpr int64_t kChunkWork = int64_t{1} << 16, kParallelWork = int64_t{1} << 17;
  thread_local std::vector<Item> items;
  items.clear();
  int64_t part_rows = 0;
  const bool parallel = threads > 1 && total_work >= kParallelWork;
  const bool per_head = parallel && num_reqs < 2 * threads;
  const bool split = per_head && num_reqs * num_kv_heads < 2 * threads;
  if (!per_head) {
    for (int64_t r = 0; r < num_reqs; r++) items.push_back({r, 0, num_kv_heads, 0, reqs[r].seq_len, -1});
  } else {
    // Ranges of about an even share of two items a thread, at most kMaxSplits a context.
    constexpr int64_t kMinRange = 32;
    const int64_t range = std::max<int64_t>(kMinRange, total_cost * num_kv_heads / (2 * threads));
    for (int64_t r = 0; r < num_reqs; r++) {
      const int64_t len = reqs[r].seq_len, cost = cost_of(r, len);
      const int64_t splits = split && len > 0 ? std::min(kMaxSplits, (cost + range - 1) / range) : 1;
      // Equal, block-aligned ranges.
      const int64_t step = ((len + splits - 1) / splits + block_size - 1) / block_size * block_size;
      for (int64_t h = 0; h < num_kv_heads; h++) {
        if (splits == 1 || step >= len) {
          items.push_back({r, h, h + 1, 0, len, -1});
          continue;
        }
        for (int64_t p = 0; p < len; p += step) {
          items.push_back({r, h, h + 1, p, std::min(len, p + step), part_rows});
          part_rows += reqs[r].q_len * group;
        }
      }
    }
  }
  // Partial results of split contexts: [part_rows, D] accumulators, [part_rows, 2] stats.
  thread_local std::vector<float> partial;
  partial.resize(static_cast<size_t>(part_rows * (head_dim + 2)));
  float* part_acc = partial.data();
  float* part_stat = part_acc + part_rows * head_dim;

  const int64_t num_items = static_cast<int64_t>(items.size());
  // Chunks of items of about kChunkWork multiply-adds; where contexts were split, one chunk a
  // thread of about equal work: the pool hands chunks out in order, so each thread mostly gets
  // the same positions every step and finds them in its own cache when they fit there.
  thread_local std::vector<int64_t> bounds;
  bounds.assign(1, 0);
  if (split) {
    int64_t cost = 0, split_cost = 0;
    for (const Item& it : items) split_cost += cost_of(it.r, it.p1 - it.p0);
    for (int64_t i = 0; i + 1 < num_items; i++) {
      cost += cost_of(items[i].r, items[i].p1 - items[i].p0);
      if (cost * threads >= split_cost * static_cast<int64_t>(bounds.size())) bounds.push_back(i + 1);
    }
  } else if (parallel) {
    const int64_t grain = std::max<int64_t>(1, kChunkWork * num_items / std::max<int64_t>(total_work, 1));
    for (int64_t b = grain; b < num_items; b += grain) bounds.push_back(b);
  }
  bounds.push_back(num_items);
  const int64_t chunks = static_cast<int64_t>(bounds.size()) - 1;
  const Item* item_list = items.data();
  const int64_t* chunk_bounds = bounds.data();
  parallel_chunks(chunks, [&](int64_t chunk) {
    thread_local std::vector<float> scores;
    const int64_t begin = chunk_bounds[chunk], end = chunk_bounds[chunk + 1];
    for (int64_t i = begin; i < end; i++) {
      const Item& it = item_list[i];
      const DecodeRequest& rq = reqs[it.r];
      const float* q_req = query + rq.row * query_stride;
      // Split parts write [q_len, group, D] blocks of the partial buffers.
      float* dst = it.part >= 0 ? part_acc + it.part * head_dim : out + rq.row * out_stride + it.h0 * group * head_dim;
      const int64_t dst_stride = it.part >= 0 ? group * head_dim : out_stride;
      float* stat = it.part >= 0 ? part_stat + it.part * 2 : nullptr;
      if (it.p1 <= 0) {  // a padded request
        for (int64_t j = 0; j < rq.q_len; j++)
          std::fill(dst + j * dst_stride, dst + j * dst_stride + (it.h1 - it.h0) * group * head_dim, 0.f);
        continue;
      }
      const int32_t* table = block_tables + rq.req * table_stride;
      switch (head_dim) {
        case 64:
          decode_range<64>(q_req, query_stride, dst, dst_stride, key_cache, value_cache, table, it.p0, it.p1, it.h0,
                           it.h1, group, rq.q_len, rq.seq_len, block_size, block_stride, token_stride, scale, stat,
                           scores);
          break;
        case 128:
          decode_range<128>(q_req, query_stride, dst, dst_stride, key_cache, value_cache, table, it.p0, it.p1, it.h0,
                            it.h1, group, rq.q_len, rq.seq_len, block_size, block_stride, token_stride, scale, stat,
                            scores);
          break;
        case 32:
          decode_range<32>(q_req, query_stride, dst, dst_stride, key_cache, value_cache, table, it.p0, it.p1, it.h0,
                           it.h1, group, rq.q_len, rq.seq_len, block_size, block_stride, token_stride, scale, stat,
                           scores);
          break;
        default:
          for (int64_t h = it.h0; h < it.h1; h++) {
            decode_range_any(q_req + h * group * head_dim, query_stride, dst + (h - it.h0) * group * head_dim,
                             dst_stride, key_cache + h * head_dim, value_cache + h * head_dim, table, it.p0, it.p1,
                             group, rq.q_len, rq.seq_len, head_dim, block_size, block_stride, token_stride, scale,
                             stat, scores);
          }
      }
    }
  });
  if (part_rows == 0) return;
  // Merge the parts of each split (request, KV head): consecutive items of it.
  for (int64_t i = 0; i < num_items;) {
    if (item_list[i].part < 0) {
      i++;
      continue;
    }
    int64_t j = i;
    while (j < num_items && item_list[j].part >= 0 && item_list[j].r == item_list[i].r &&
           item_list[j].h0 == item_list[i].h0)
      j++;
    const int64_t n = j - i;
    const DecodeRequest& rq = reqs[item_list[i].r];
    for (int64_t row = 0; row < rq.q_len * group; row++) {
      float m = -INFINITY;
      for (int64_t k = 0; k < n; k++) m = std::max(m, part_stat[(item_list[i + k].part + row) * 2]);
      float denom = 0.f, weight[kMaxSplits];
      for (int64_t k = 0; k < n; k++) {
        const float* st = part_stat + (item_list[i + k].part + row) * 2;
        weight[k] = std::exp(st[0] - m);  // 0 for a part the row sees none of (max -inf)
        denom += weight[k] * st[1];
      }
      const float inv = 1.f / denom;
      float* dst = out + (rq.row + row / group) * out_stride + (item_list[i].h0 * group + row % group) * head_dim;
      for (int64_t d = 0; d < head_dim; d++) {
        float sum = 0.f;
        for (int64_t k = 0; k < n; k++) sum += weight[k] * part_acc[(item_list[i + k].part + row) * head_dim + d];
        dst[d] = sum * inv;
      }
    }
    i = j;
  }
}

}  // namespace compiled_llm_cpu

namespace {

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
  TORCH_CHECK((block_size & (block_size - 1)) == 0, "block_size must be a power of two");
  TORCH_CHECK(num_heads <= 256, "at most 256 query heads");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.size(3) == head_dim && value_cache.sizes() == key_cache.sizes(),
              "the caches must be [blocks, block_size, kv_heads, head_dim] with the query's head_dim");
  TORCH_CHECK(out.size(1) == num_heads && out.size(2) == head_dim && out.size(0) >= num_reqs &&
                  query.size(0) >= num_reqs && block_tables.dim() == 2 && block_tables.size(0) >= num_reqs &&
                  block_tables.stride(1) == 1 && seq_lens.dim() == 1 && seq_lens.stride(0) == 1,
              "out, query, block_tables and seq_lens must cover the requests");
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  std::vector<compiled_llm_cpu::DecodeRequest> reqs(static_cast<size_t>(num_reqs));
  for (int64_t r = 0; r < num_reqs; r++) {
    TORCH_CHECK(lens[r] <= block_tables.size(1) * block_size, "a request's context is longer than its block table");
    reqs[r] = {r, r, 1, lens[r]};
  }
  compiled_llm_cpu::decode_attention(out.data_ptr<float>(), out.stride(0), query.data_ptr<float>(), query.stride(0),
                                     key_cache.data_ptr<float>(), value_cache.data_ptr<float>(),
                                     block_tables.data_ptr<int32_t>(), block_tables.stride(0), reqs.data(), num_reqs,
                                     num_heads, num_kv_heads, head_dim, block_size, static_cast<float>(scale));
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
