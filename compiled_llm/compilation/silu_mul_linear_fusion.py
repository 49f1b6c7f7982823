"""Fusion pass: SwiGLU's gate folded into the down projection on a CPU.

Before: `silu_and_mul(x)` (an Inductor kernel, a call from the piece's Python wrapper) feeding
`packed_linear(h, W, b, n)`. After: `silu_and_mul_packed_linear(x, W, b, n)`, one C++ op that
gates and multiplies: one call fewer a layer. It applies only where the model calls the C++
packed GEMM (float32 on a CPU); on a GPU the projection is cuBLAS's and the gate stays
Inductor's kernel.

With LoRA the gated product has a second reader, the down projection's adapter shrink: then the
fused op is `silu_and_mul_packed_linear_act`, which returns the product too, and the shrink reads
that.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from compiled_llm.compilation.partition import op_name

SILU_AND_MUL_OP = "compiled_llm::silu_and_mul"
PACKED_LINEAR_OP = "compiled_llm_cpu::packed_linear"
LORA_SHRINK_OP = "compiled_llm_cpu::lora_shrink"


class SiluMulLinearFusion:
    name = "silu_mul_linear"

    def __call__(self, graph: fx.Graph) -> int:
        fused = 0
        for linear in list(graph.nodes):
            if linear.op != "call_function" or op_name(linear.target) != PACKED_LINEAR_OP or linear.kwargs:
                continue
            gate = linear.args[0]
            if not (isinstance(gate, fx.Node) and gate.op == "call_function"
                    and op_name(gate.target) == SILU_AND_MUL_OP):
                continue
            shrinks = [u for u in gate.users if u is not linear]
            if not all(u.op == "call_function" and op_name(u.target) == LORA_SHRINK_OP and u.args[0] is gate
                       and gate not in u.args[1:] for u in shrinks):
                continue
            ops = torch.ops.compiled_llm_cpu
            with graph.inserting_before(linear):
                if not shrinks:
                    replacement = graph.call_function(ops.silu_and_mul_packed_linear.default,
                                                      (gate.args[0], *linear.args[1:]))
                    replacement.meta = dict(linear.meta)
                else:
                    both = graph.call_function(ops.silu_and_mul_packed_linear_act.default,
                                               (gate.args[0], *linear.args[1:]))
                    replacement = graph.call_function(operator.getitem, (both, 0))
                    act = graph.call_function(operator.getitem, (both, 1))
                    replacement.meta, act.meta = dict(linear.meta), dict(gate.meta)
                    for shrink in shrinks:
                        shrink.replace_input_with(gate, act)
            linear.replace_all_uses_with(replacement)
            graph.erase_node(linear)
            graph.erase_node(gate)
            fused += 1
        return fused
