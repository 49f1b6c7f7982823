// One layer's attention for a whole step in one call: the rotary embedding of the new queries and
// keys (when the compiler's fusion pass moved it here), the KV-cache write, decode attention for
// the single-token requests, prefill attention for the rest, and zeros for padded rows.
//
// Why one op: from Python the same work was a write, a decode call and a prefill call, each
// with its tensor slicing and checks, about 70 us a layer; at batch 1 that was 2 ms of a 30 ms
// decode step of SmolLM2 (30 layers), more than the attention itself. The kernels stay in
// their own files; this calls them through the dispatcher (a fraction of a microsecond each).

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace {

// NeoX rotary embedding of `x` [T, heads, D] (rows may be strided) into a new contiguous tensor,
// in float32 as kernels/rotary.py does: halves (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).
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
    const float* cos = table + pos[t] * D;
    const float* sin = cos + half;
    for (int64_t h = 0; h < H; h++) {
      const float* x1 = src + t * st + h * sh;
      const float* x2 = x1 + half;
      float* o = dst + (t * H + h) * D;
      for (int64_t i = 0; i < half; i++) {
        o[i] = x1[i] * cos[i] - x2[i] * sin[i];
        o[half + i] = x2[i] * cos[i] + x1[i] * sin[i];
      }
    }
  }
  return out;
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
  TORCH_CHECK(positions.has_value() == cos_sin_cache.has_value(), "positions and cos_sin_cache go together");
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
// output [T, (H + 2 Hkv) D], split here into the views the model's split would make (in C++:
// the same three views from Python cost about 8 us a layer).
void attention_step_qkv(const at::Tensor& qkv, at::Tensor& output, at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                        int64_t num_reqs, int64_t num_decodes, int64_t num_actual_tokens, double scale,
                        int64_t num_kv_heads, const at::Tensor& positions, const at::Tensor& cos_sin_cache) {
  TORCH_CHECK(output.dim() == 3, "output must be [tokens, heads, head_dim]");
  const int64_t T = qkv.size(0), H = output.size(1), D = output.size(2);
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (H + 2 * num_kv_heads) * D && qkv.stride(1) == 1,
              "qkv must be [tokens, (heads + 2 kv_heads) * head_dim] with unit stride, got ", qkv.sizes());
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
