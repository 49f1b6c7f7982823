"""The compiler's fusion passes: what they rewrite, what they leave alone, that they key the
compile cache, and that a fused model computes what the unfused one does (on the CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

import compiled_llm.models.layers.activation  # noqa: F401  (defines compiled_llm::silu_and_mul)
import compiled_llm.models.layers.attention  # noqa: F401  (defines compiled_llm::attention)
import compiled_llm.models.layers.rotary  # noqa: F401  (defines compiled_llm::rotary_embedding)
from compiled_llm import LLM, SamplingParams
from compiled_llm.compilation.cache_key import compute_factors
from compiled_llm.compilation.config import CompilationConfig
from compiled_llm.compilation.partition import op_name
from compiled_llm.compilation.pass_manager import DEFAULT_PASSES, PassManager
from compiled_llm.compilation.rotary_attention_fusion import RotaryAttentionFusion
from compiled_llm.compilation.silu_mul_linear_fusion import SiluMulLinearFusion
from compiled_llm.compilation.traced_graph import SavedGraphModule
from compiled_llm.engine.arg_utils import EngineArgs
from compiled_llm.kernels.cpu_extension import cpu_kernels_available
from tests.models.test_hf_parity import PROMPTS
from tests.oracle import check_close, ours_greedy


class AttentionBlock(torch.nn.Module):
    """The model's QKV split, rotary and attention call, as Dynamo records them."""

    def __init__(self, keep_rotated_query: bool = False) -> None:
        super().__init__()
        self.keep_rotated_query = keep_rotated_query
        self.register_buffer("cos_sin_cache", torch.zeros(64, 8))
        self.register_buffer("kv_cache", torch.zeros(2, 4, 16, 1, 8))

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor):
        q, k, v = qkv.split([16, 8, 8], dim=-1)
        q, k, v = q.view(-1, 2, 8), k.view(-1, 1, 8), v.view(-1, 1, 8)
        q, k = torch.ops.compiled_llm.rotary_embedding(positions, q, k, self.cos_sin_cache)
        output = torch.empty_like(q)
        torch.ops.compiled_llm.attention(q, k, v, output, self.kv_cache, 0.5)
        return (output, q) if self.keep_rotated_query else output


def ops_in(gm: fx.GraphModule) -> list[str]:
    return [op_name(n.target) for n in gm.graph.nodes if n.op == "call_function" and op_name(n.target)]


def test_rotary_and_qkv_split_fold_into_attention():
    gm = fx.symbolic_trace(AttentionBlock())
    assert RotaryAttentionFusion()(gm.graph) == 1
    gm.graph.lint()
    assert "compiled_llm::rotary_embedding" not in ops_in(gm)
    (attention,) = [n for n in gm.graph.nodes if op_name(n.target) == "compiled_llm::attention"]
    assert attention.target is torch.ops.compiled_llm.attention.qkv
    qkv, output, kv_cache, scale, num_kv_heads, positions, cos_sin = attention.args
    assert qkv.target == "qkv" and (scale, num_kv_heads) == (0.5, 1)  # the projection's output, whole
    assert [positions.target, cos_sin.target, kv_cache.target] == ["positions", "cos_sin_cache", "kv_cache"]
    assert output.target is torch.empty_like and output.kwargs["memory_format"] is torch.contiguous_format
    # What is left of the split feeds only the output buffer's shape: no view of qkv reaches the op.
    (split,) = [n for n in gm.graph.nodes if n.target == "split"]
    assert len(split.users) == 1


class UnevenSplitBlock(AttentionBlock):
    """Queries, keys and values that are not one split of one tensor: the rotary still folds in."""

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor):
        q, k = qkv[:, :16].reshape(-1, 2, 8), qkv[:, 16:24].reshape(-1, 1, 8)
        v = qkv[:, 24:].reshape(-1, 1, 8) * 2
        q, k = torch.ops.compiled_llm.rotary_embedding(positions, q, k, self.cos_sin_cache)
        output = torch.empty_like(q)
        torch.ops.compiled_llm.attention(q, k, v, output, self.kv_cache, 0.5)
        return output


def test_rotary_folds_into_the_plain_attention_call_without_a_qkv_split():
    gm = fx.symbolic_trace(UnevenSplitBlock())
    assert RotaryAttentionFusion()(gm.graph) == 1
    (attention,) = [n for n in gm.graph.nodes if op_name(n.target) == "compiled_llm::attention"]
    assert len(attention.args) == 8 and attention.args[0].target == "reshape"
    assert [a.target for a in attention.args[6:]] == ["positions", "cos_sin_cache"]


def test_rotary_stays_where_the_rotated_query_is_needed_elsewhere():
    gm = fx.symbolic_trace(AttentionBlock(keep_rotated_query=True))
    before = str(gm.graph)
    assert RotaryAttentionFusion()(gm.graph) == 0
    assert str(gm.graph) == before


@pytest.mark.skipif(not cpu_kernels_available(), reason="the C++ CPU kernels could not be built")
def test_silu_mul_folds_only_into_a_packed_projection_it_alone_feeds():
    class MLPs(torch.nn.Module):
        def forward(self, x, packed, weight):
            packed_out = torch.ops.compiled_llm_cpu.packed_linear(torch.ops.compiled_llm.silu_and_mul(x), packed,
                                                                  None, 4)
            dense_out = F.linear(torch.ops.compiled_llm.silu_and_mul(x), weight)  # not the packed GEMM
            shared = torch.ops.compiled_llm.silu_and_mul(x)  # also returned: must stay
            return packed_out, dense_out, torch.ops.compiled_llm_cpu.packed_linear(shared, packed, None, 4), shared

    gm = fx.symbolic_trace(MLPs())
    assert SiluMulLinearFusion()(gm.graph) == 1
    gm.recompile()
    assert ops_in(gm).count("compiled_llm_cpu::silu_and_mul_packed_linear") == 1
    assert ops_in(gm).count("compiled_llm::silu_and_mul") == 2
    x, w = torch.randn(3, 10), torch.randn(4, 5)
    packed = torch.ops.compiled_llm_cpu.pack_linear_weight(w, 0)
    fused, dense, unfused, shared = gm(x, packed, w)
    torch.testing.assert_close(fused, unfused)
    torch.testing.assert_close(dense, F.linear(shared, w))


def test_silu_mul_folds_into_a_packed_projection_whose_lora_shrink_reads_the_product():
    """With LoRA the down projection's adapter shrink reads the gated product too: the fused op then
    returns it, and the shrink reads that; any other reader keeps the gate unfused."""
    ops = torch.ops.compiled_llm_cpu

    class LoRAMLP(torch.nn.Module):
        def forward(self, x, packed, a, idx):
            h = torch.ops.compiled_llm.silu_and_mul(x)
            return ops.packed_linear(h, packed, None, 4), ops.lora_shrink(h, a, idx)

    class OtherReader(torch.nn.Module):
        def forward(self, x, packed, a, idx):
            h = torch.ops.compiled_llm.silu_and_mul(x)
            return ops.packed_linear(h, packed, None, 4), ops.lora_shrink(h, a, idx), h.sum()

    x, w = torch.randn(3, 10), torch.randn(4, 5)
    a, idx = torch.randn(2, 6, 5), torch.tensor([1, -1, 0])
    packed = ops.pack_linear_weight(w, 0)
    gm = fx.symbolic_trace(LoRAMLP())
    assert SiluMulLinearFusion()(gm.graph) == 1
    gm.recompile()
    assert ops_in(gm).count("compiled_llm_cpu::silu_and_mul_packed_linear_act") == 1
    assert "compiled_llm::silu_and_mul" not in ops_in(gm)
    y, t = gm(x, packed, a, idx)
    y_ref, t_ref = LoRAMLP()(x, packed, a, idx)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(t, t_ref)
    other = fx.symbolic_trace(OtherReader())
    assert SiluMulLinearFusion()(other.graph) == 0


def test_passes_are_configured_checked_and_part_of_the_cache_key(tiny_llama):
    assert EngineArgs(compile_passes=None).create_engine_config().compilation_config.passes == list(DEFAULT_PASSES)
    parser = EngineArgs.add_cli_args(__import__("argparse").ArgumentParser())
    assert parser.parse_args(["--compile-passes", "none"]).compile_passes == []
    assert parser.parse_args(["--compile-passes", "silu_mul_linear"]).compile_passes == ["silu_mul_linear"]
    with pytest.raises(ValueError, match=r"unknown compiler pass.*known: \['rotary_attention'"):
        CompilationConfig.resolve("cpu", 4, 64, passes=["rotary"])
    configs = [EngineArgs(tiny_llama, compile_passes=p).create_engine_config()
               for p in (None, [], ["rotary_attention"])]
    keys = set()
    for config in configs:
        factors = compute_factors(
            hf_config=config.model_config.hf_config, dtype=torch.float32, device=torch.device("cpu"),
            compilation_config=config.compilation_config, max_num_batched_tokens=64, source_files=[],
        )
        keys.add(repr(factors["passes"]))
    assert len(keys) == 3
    assert PassManager([]).uuid() != PassManager(["rotary_attention"]).uuid()


def fused_attention_calls(llm: LLM, qkv_only: bool = False) -> int:
    """Attention calls that rotate their own inputs (the qkv overload also splits them), in the
    split graph's eager pieces."""
    split = llm.llm_engine.engine_core.executor.driver.compiled_forward.backend.split
    graphs = [m.graph for m in split.modules() if isinstance(m, (fx.GraphModule, SavedGraphModule))]
    return sum(1 for g in graphs for n in g.nodes if op_name(n.target) == "compiled_llm::attention"
               and (n.target is torch.ops.compiled_llm.attention.qkv or (len(n.args) == 8 and not qkv_only)))


@pytest.mark.parametrize("arch", ["qwen3", "llama-biased"])
def test_fused_and_unfused_tiny_models_agree(tiny_model_factory, tmp_path, arch):
    """Qwen3 normalises queries and keys before the rotary; the biased Llama adds biases around
    both folded sites: the fused model must compute what the unfused one does."""
    path = tiny_model_factory(arch)
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=3, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (1, 5, 23)]
    results = []
    for passes in (None, []):
        llm = LLM(path, optimization_level=1, compile_cache=str(tmp_path), max_model_len=256, compile_passes=passes,
                  kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=64, max_num_seqs=8)
        assert fused_attention_calls(llm) == (2 if passes is None else 0)  # both layers, or none
        results.append(llm.generate(prompts, params, use_tqdm=False))
        del llm
    fused, unfused = results
    for a, b in zip(fused, unfused):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for lp_a, lp_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for token, logprob in lp_a.items():
                assert abs(logprob.logprob - lp_b[token].logprob) < 1e-4


def test_fused_real_model_matches_unfused(real_model_path, warm_compile_cache, tmp_path):
    """SmolLM2 with every pass (the default, warm from precompile) against no pass at all."""
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=5, ignore_eos=True)
    fused = LLM(real_model_path, optimization_level=1, require_cache_hit=True, max_model_len=1024,
                kv_cache_memory_bytes=128 << 20)
    assert fused_attention_calls(fused, qkv_only=True) == 30  # every layer: split and rotary folded in
    ours = fused.generate(PROMPTS, params, use_tqdm=False)
    del fused
    unfused = LLM(real_model_path, optimization_level=1, compile_cache=str(tmp_path), compile_passes=[],
                  max_model_len=1024, kv_cache_memory_bytes=128 << 20)
    assert fused_attention_calls(unfused) == 0
    reference = unfused.generate(PROMPTS, params, use_tqdm=False)
    assert check_close(ours_greedy(ours), ours_greedy(reference), "fused", "unfused") == len(PROMPTS)
