// One layer's attention for a whole step in one call: the rotary embedding of the new queries and
// keys (when the compiler's fusion pass moved it here), the KV-cache write, decode attention for
// the requests with at most kMaxDecodeQuery query tokens (wherever they are in the batch),
// prefill attention for the rest, and zeros for padded rows.
//
// Why one op: from Python the same work was a write, a decode call and a prefill call, each
// with its tensor slicing and checks, about 70 us a layer; at batch 1 that was 2 ms of a 30 ms
// decode step of SmolLM2 (30 layers), more than the attention itself. In the common case
// (float32, the layouts the model makes) it works on raw pointers: no tensor op and no
// dispatcher call but the prefill kernel's (each of those costs 0.5-1 us, and a batch-1 decode
// layer's attention is only a few us of arithmetic). Anything else takes the tensor path below,
// which raises the errors.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

namespace compiled_llm_cpu {
// As defined in cpu_attention.cpp: query rows [row, row + q_len), block table row `req`.
struct DecodeRequest {
  int64_t req, row, q_len, seq_len;
};
// Decode attention on raw pointers (cpu_attention.cpp); the caller has checked the layouts.
void decode_attention(float* out, int64_t out_stride, const float* query, int64_t query_stride,
                      const float* key_cache, const float* value_cache, const int32_t* block_tables,
                      int64_t table_stride, const DecodeRequest* reqs, int64_t num_reqs, int64_t num_heads,
                      int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale);
}  // namespace compiled_llm_cpu

namespace {

// Requests with up to this many query tokens (a verification of a few drafts, a tiny prefill
// chunk) take the decode kernel, which reads each cached row once for all of them; the prefill
// kernel's tiles and online softmax pay off only for longer queries.
constexpr int64_t kMaxDecodeQuery = 16;

// NeoX rotary embedding of one head's row, in float32 as kernels/rotary.py does:
// halves (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin); `cos` is followed by `sin`.
inline void rotate_row(const float* x, const float* cos, int64_t half, float* o) {
  const float* sin = cos + half;
  const float* x2 = x + half;
  for (int64_t i = 0; i < half; i++) {
    o[i] = x[i] * cos[i] - x2[i] * sin[i];
    o[half + i] = x2[i] * cos[i] + x[i] * sin[i];
  }
}

// The rotary embedding of `x` [T, heads, D] (rows may be strided) into a new contiguous tensor.
at::Tensor rotate_neox(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos_sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.scalar_type() == at::kFloat,
              "rotary input must be float32 [tokens, heads, head_dim] with unit stride in head_dim");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  TORCH_CHECK(D % 2 == 0 && cos_sin.dim() == 2 && cos_sin.size(1) == D && cos_sin.is_contiguous() &&
                  cos_sin.scalar_type() == at::kFloat,
              "cos_sin_cache must be a contiguous float32 [max_position, head_dim]");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) >= T && positions.scalar_type() == at::kLong,
              "positions must be int64 [tokens]");
  at::Tensor out = at::empty({T, H, D}, x.options());
  const float* src = x.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* table = cos_sin.data_ptr<float>();
  const int64_t max_position = cos_sin.size(0), st = x.stride(0), sh = x.stride(1);
  for (int64_t t = 0; t < T; t++) {
    TORCH_CHECK(0 <= pos[t] && pos[t] < max_position, "position ", pos[t], " is outside the rotary table");
    for (int64_t h = 0; h < H; h++) rotate_row(src + t * st + h * sh, table + pos[t] * D, half, dst + (t * H + h) * D);
  }
  return out;
}

// A [tokens, heads, head_dim] operand as a pointer and strides (head_dim has unit stride).
struct Rows {
  const float* data;
  int64_t token_stride, head_stride;
};

// The step on raw pointers, for the layouts the model makes; false (having changed nothing) for
// anything else, which the tensor path then handles or rejects. `query` is used only for a
// long prefill without rotary (the prefill kernel is still called as an op: that path is not hot).
bool step_on_pointers(Rows q, Rows k, Rows v, int64_t T, int64_t H, const at::Tensor& query, at::Tensor& output,
                      at::Tensor& kv_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                      const at::Tensor& seq_lens, const at::Tensor& query_start_loc, int64_t num_reqs,
                      int64_t num_decodes, int64_t num_actual_tokens, double scale, const at::Tensor* positions,
                      const at::Tensor* cos_sin) {
  const int64_t block_size = kv_cache.size(2), Hkv = kv_cache.size(3), D = kv_cache.size(4);
  const bool rotary = positions != nullptr;
  // Unrotated operands go to the kernels as they are: their heads must be contiguous.
  if (!kv_cache.is_contiguous() || Hkv <= 0 || H % Hkv != 0 || H > 256 || (block_size & (block_size - 1)) != 0 ||
      v.head_stride != D || (!rotary && (q.head_stride != D || k.head_stride != D)))
    return false;
  if (output.dim() != 3 || output.scalar_type() != at::kFloat || output.size(0) != T || output.size(1) != H ||
      output.size(2) != D || output.stride(2) != 1 || output.stride(1) != D)
    return false;
  if (slot_mapping.scalar_type() != at::kLong || slot_mapping.dim() != 1 || slot_mapping.stride(0) != 1 ||
      block_tables.scalar_type() != at::kInt || block_tables.dim() != 2 || block_tables.stride(1) != 1 ||
      block_tables.size(0) < num_reqs || seq_lens.scalar_type() != at::kInt || seq_lens.dim() != 1 ||
      seq_lens.stride(0) != 1 || num_decodes > T)
    return false;
  if (num_reqs > num_decodes &&
      (query_start_loc.scalar_type() != at::kInt || query_start_loc.dim() != 1 || query_start_loc.stride(0) != 1 ||
       query_start_loc.size(0) < num_reqs + 1))
    return false;
  if (rotary && (D % 2 != 0 || cos_sin->dim() != 2 || cos_sin->size(1) != D || !cos_sin->is_contiguous() ||
                 cos_sin->scalar_type() != at::kFloat || positions->dim() != 1 || positions->size(0) < T ||
                 positions->stride(0) != 1 || positions->scalar_type() != at::kLong))
    return false;

  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t max_context = block_tables.size(1) * block_size;
  for (int64_t r = 0; r < num_reqs; r++)
    TORCH_CHECK(lens[r] <= max_context, "a request's context is longer than its block table");
  // The decode kernel's requests: the decodes (query token r), then the short queries after them.
  const int32_t* starts = num_reqs > num_decodes ? query_start_loc.data_ptr<int32_t>() : nullptr;
  auto query_len = [&](int64_t r) { return static_cast<int64_t>(starts[r + 1]) - starts[r]; };
  thread_local std::vector<compiled_llm_cpu::DecodeRequest> short_reqs;
  short_reqs.clear();
  for (int64_t r = 0; r < num_decodes; r++) short_reqs.push_back({r, r, 1, lens[r]});
  bool any_long = false;
  for (int64_t r = num_decodes; r < num_reqs; r++) {
    TORCH_CHECK(0 <= starts[r] && starts[r] <= starts[r + 1] && starts[r + 1] <= T,
                "query_start_loc must be non-decreasing within the step's tokens");
    const int64_t q_len = query_len(r);
    if (q_len > kMaxDecodeQuery) {
      any_long = true;
    } else if (q_len > 0) {  // none: a padded request
      TORCH_CHECK(q_len <= lens[r], "a request has more query tokens than its seq_len");
      short_reqs.push_back({r, starts[r], q_len, lens[r]});
    }
  }
  const int64_t* pos = nullptr;
  const float* table = nullptr;
  if (rotary) {
    pos = positions->data_ptr<int64_t>();
    table = cos_sin->data_ptr<float>();
    const int64_t max_position = cos_sin->size(0);
    for (int64_t t = 0; t < T; t++)
      TORCH_CHECK(0 <= pos[t] && pos[t] < max_position, "position ", pos[t], " is outside the rotary table");
  }

  // Rotated queries go to a per-thread buffer; rotated keys straight into their cache slots.
  thread_local std::vector<float> rotated;
  const float* q_rows = q.data;
  int64_t q_stride = q.token_stride;
  const int64_t half = D / 2;
  if (rotary) {
    rotated.resize(static_cast<size_t>(T * H * D));
    for (int64_t t = 0; t < T; t++)
      for (int64_t h = 0; h < H; h++)
        rotate_row(q.data + t * q.token_stride + h * q.head_stride, table + pos[t] * D, half,
                   rotated.data() + (t * H + h) * D);
    q_rows = rotated.data();
    q_stride = H * D;
  }
  float* kc = kv_cache.data_ptr<float>();
  float* vc = kc + kv_cache.stride(0);
  const int64_t row = Hkv * D, num_slots = kv_cache.size(1) * block_size;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; t++) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;  // a padded token
    TORCH_CHECK(slot < num_slots, "slot ", slot, " is outside the KV cache");
    const float* k_t = k.data + t * k.token_stride;
    if (rotary) {
      for (int64_t h = 0; h < Hkv; h++) rotate_row(k_t + h * k.head_stride, table + pos[t] * D, half, kc + slot * row + h * D);
    } else {
      std::memcpy(kc + slot * row, k_t, row * sizeof(float));
    }
    std::memcpy(vc + slot * row, v.data + t * v.token_stride, row * sizeof(float));
  }

  float* out = output.data_ptr<float>();
  if (!short_reqs.empty())
    compiled_llm_cpu::decode_attention(out, output.stride(0), q_rows, q_stride, kc, vc, block_tables.data_ptr<int32_t>(),
                                       block_tables.stride(0), short_reqs.data(),
                                       static_cast<int64_t>(short_reqs.size()), H, Hkv, D, block_size,
                                       static_cast<float>(scale));
  if (any_long) {
    static auto prefill = c10::Dispatcher::singleton()
                              .findSchemaOrThrow("compiled_llm_cpu::paged_prefill_attention", "")
                              .typed<void(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                          const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, double,
                                          int64_t)>();
    const at::Tensor q_tensor = rotary ? at::from_blob(rotated.data(), {T, H, D}, output.options()) : query;
    // One call per run of consecutive long queries (the op does requests [first, end)).
    for (int64_t r = num_decodes; r < num_reqs;) {
      if (query_len(r) <= kMaxDecodeQuery) {
        r++;
        continue;
      }
      int64_t end = r + 1;
      while (end < num_reqs && query_len(end) > kMaxDecodeQuery) end++;
      prefill.call(output, q_tensor, kv_cache.select(0, 0), kv_cache.select(0, 1), block_tables.narrow(0, 0, end),
                   seq_lens.narrow(0, 0, end), query_start_loc, r, scale, 0);
      r = end;
    }
  }
  for (int64_t t = num_actual_tokens; t < T; t++) std::memset(out + t * output.stride(0), 0, H * D * sizeof(float));
  return true;
}

void attention_step(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, at::Tensor& output,
                    at::Tensor& kv_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                    const at::Tensor& seq_lens, const at::Tensor& query_start_loc, int64_t num_reqs,
                    int64_t num_decodes, int64_t num_actual_tokens, double scale,
                    const c10::optional<at::Tensor>& positions, const c10::optional<at::Tensor>& cos_sin_cache) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.scalar_type() == at::kFloat,
              "kv_cache must be float32 [2, blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(0 <= num_decodes && num_decodes <= num_reqs && num_reqs <= seq_lens.size(0),
              "num_decodes <= num_reqs <= len(seq_lens) must hold");
  const int64_t num_tokens = query.size(0);
  TORCH_CHECK(0 <= num_actual_tokens && num_actual_tokens <= num_tokens && slot_mapping.size(0) >= num_tokens,
              "num_actual_tokens and slot_mapping must cover the step's tokens");
  TORCH_CHECK(positions.has_value() == cos_sin_cache.has_value(), "positions and cos_sin_cache go together");
  const int64_t Hkv = kv_cache.size(3), D = kv_cache.size(4);
  auto rows_fit = [&](const at::Tensor& t, int64_t heads) {
    return t.dim() == 3 && t.scalar_type() == at::kFloat && t.size(0) == num_tokens && t.size(1) == heads &&
           t.size(2) == D && t.stride(2) == 1;
  };
  if (rows_fit(query, query.size(1)) && rows_fit(key, Hkv) && rows_fit(value, Hkv) &&
      step_on_pointers({query.data_ptr<float>(), query.stride(0), query.stride(1)},
                       {key.data_ptr<float>(), key.stride(0), key.stride(1)},
                       {value.data_ptr<float>(), value.stride(0), value.stride(1)}, num_tokens, query.size(1), query,
                       output, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, num_reqs, num_decodes,
                       num_actual_tokens, scale, positions.has_value() ? &*positions : nullptr,
                       cos_sin_cache.has_value() ? &*cos_sin_cache : nullptr))
    return;

  // The tensor path: the kernels as ops, which check (and reject) what the pointer path does not take.
  static auto write = c10::Dispatcher::singleton()
                          .findSchemaOrThrow("compiled_llm_cpu::write_kv_cache", "")
                          .typed<void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&,
                                      const at::Tensor&)>();
  static auto decode = c10::Dispatcher::singleton()
                           .findSchemaOrThrow("compiled_llm_cpu::paged_decode_attention", "")
                           .typed<void(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                       const at::Tensor&, const at::Tensor&, double)>();
  static auto prefill = c10::Dispatcher::singleton()
                            .findSchemaOrThrow("compiled_llm_cpu::paged_prefill_attention", "")
                            .typed<void(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                        const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, double,
                                        int64_t)>();
  at::Tensor q = query, k = key;
  if (positions.has_value()) {
    q = rotate_neox(query, *positions, *cos_sin_cache);
    k = rotate_neox(key, *positions, *cos_sin_cache);
  }
  at::Tensor key_cache = kv_cache.select(0, 0), value_cache = kv_cache.select(0, 1);
  write.call(k, value, key_cache, value_cache, slot_mapping.narrow(0, 0, num_tokens));
  if (num_decodes > 0) {
    at::Tensor out = output.narrow(0, 0, num_decodes);
    decode.call(out, q.narrow(0, 0, num_decodes), key_cache, value_cache, block_tables.narrow(0, 0, num_decodes),
                seq_lens.narrow(0, 0, num_decodes), scale);
  }
  if (num_reqs > num_decodes) {
    prefill.call(output, q, key_cache, value_cache, block_tables.narrow(0, 0, num_reqs),
                 seq_lens.narrow(0, 0, num_reqs), query_start_loc, num_decodes, scale, 0);
  }
  if (num_actual_tokens < num_tokens) output.narrow(0, num_actual_tokens, num_tokens - num_actual_tokens).zero_();
}

// The same for the rotary fusion pass's `attention.qkv` call: `qkv` is the fused projection's
// output [T, (H + 2 Hkv) D], split here into the queries, keys and values the model's split
// would make: as pointers, or (the tensor path) as views.
void attention_step_qkv(const at::Tensor& qkv, at::Tensor& output, at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                        int64_t num_reqs, int64_t num_decodes, int64_t num_actual_tokens, double scale,
                        int64_t num_kv_heads, const at::Tensor& positions, const at::Tensor& cos_sin_cache) {
  TORCH_CHECK(output.dim() == 3, "output must be [tokens, heads, head_dim]");
  const int64_t T = qkv.size(0), H = output.size(1), D = output.size(2);
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (H + 2 * num_kv_heads) * D && qkv.stride(1) == 1,
              "qkv must be [tokens, (heads + 2 kv_heads) * head_dim] with unit stride, got ", qkv.sizes());
  if (qkv.scalar_type() == at::kFloat && kv_cache.dim() == 5 && kv_cache.size(0) == 2 &&
      kv_cache.scalar_type() == at::kFloat && kv_cache.size(3) == num_kv_heads && kv_cache.size(4) == D &&
      0 <= num_decodes && num_decodes <= num_reqs && num_reqs <= seq_lens.size(0) && 0 <= num_actual_tokens &&
      num_actual_tokens <= T && slot_mapping.size(0) >= T) {
    const float* base = qkv.data_ptr<float>();
    const int64_t ts = qkv.stride(0);
    if (step_on_pointers({base, ts, D}, {base + H * D, ts, D}, {base + (H + num_kv_heads) * D, ts, D}, T, H,
                         at::Tensor(), output, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc,
                         num_reqs, num_decodes, num_actual_tokens, scale, &positions, &cos_sin_cache))
      return;
  }
  at::Tensor heads = qkv.as_strided({T, H + 2 * num_kv_heads, D}, {qkv.stride(0), D, 1});
  attention_step(heads.narrow(1, 0, H), heads.narrow(1, H, num_kv_heads), heads.narrow(1, H + num_kv_heads, num_kv_heads),
                 output, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, num_reqs, num_decodes,
                 num_actual_tokens, scale, positions, cos_sin_cache);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(compiled_llm_cpu, m) {
  m.def(
      "attention_step(Tensor query, Tensor key, Tensor value, Tensor(a!) output, Tensor(b!) kv_cache, "
      "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, int num_reqs, "
      "int num_decodes, int num_actual_tokens, float scale, Tensor? positions=None, Tensor? cos_sin_cache=None) -> ()");
  m.def(
      "attention_step_qkv(Tensor qkv, Tensor(a!) output, Tensor(b!) kv_cache, Tensor slot_mapping, "
      "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, int num_reqs, int num_decodes, "
      "int num_actual_tokens, float scale, int num_kv_heads, Tensor positions, Tensor cos_sin_cache) -> ()");
}

TORCH_LIBRARY_IMPL(compiled_llm_cpu, CPU, m) {
  m.impl("attention_step", attention_step);
  m.impl("attention_step_qkv", attention_step_qkv);
}
