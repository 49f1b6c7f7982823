// One layer's attention for a whole step in one call: the KV-cache write, decode attention for
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

void attention_step(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, at::Tensor& output,
                    at::Tensor& kv_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                    const at::Tensor& seq_lens, const at::Tensor& query_start_loc, int64_t num_reqs,
                    int64_t num_decodes, int64_t num_actual_tokens, double scale) {
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
  at::Tensor key_cache = kv_cache.select(0, 0), value_cache = kv_cache.select(0, 1);
  write.call(key, value, key_cache, value_cache, slot_mapping.narrow(0, 0, num_tokens));
  if (num_decodes > 0) {
    at::Tensor out = output.narrow(0, 0, num_decodes);
    decode.call(out, query.narrow(0, 0, num_decodes), key_cache, value_cache, block_tables.narrow(0, 0, num_decodes),
                seq_lens.narrow(0, 0, num_decodes), scale);
  }
  if (num_reqs > num_decodes) {
    prefill.call(output, query, key_cache, value_cache, block_tables.narrow(0, 0, num_reqs),
                 seq_lens.narrow(0, 0, num_reqs), query_start_loc, num_decodes, scale, 0);
  }
  if (num_actual_tokens < num_tokens) output.narrow(0, num_actual_tokens, num_tokens - num_actual_tokens).zero_();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(compiled_llm_cpu, m) {
  m.def(
      "attention_step(Tensor query, Tensor key, Tensor value, Tensor(a!) output, Tensor(b!) kv_cache, "
      "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, int num_reqs, "
      "int num_decodes, int num_actual_tokens, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(compiled_llm_cpu, CPU, m) { m.impl("attention_step", attention_step); }
