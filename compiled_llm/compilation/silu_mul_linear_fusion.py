"""Fusion pass: SwiGLU's gate folded into the down projection on a CPU.

Before: `silu_and_mul(x)` (an Inductor kernel, a call from the piece's Python wrapper) feeding
`packed_linear(h, W, b, n)`. After: `silu_and_mul_packed_linear(x, W, b, n)`, one C++ op that
gates and multiplies: one call fewer a layer. It applies only where the model calls the C++
packed GEMM (float32 on a CPU); on a GPU the projection is cuBLAS's and the gate stays
Inductor's kernel.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from compiled_llm.compilation.partition import op_name

SILU_AND_MUL_OP = "compiled_llm::silu_and_mul"
PACKED_LINEAR_OP = "compiled_llm_cpu::packed_linear"


class SiluMulLinearFusion:
    name = "silu_mul_linear"

    def __call__(self, graph: fx.Graph) -> int:
        fused = 0
        for linear in list(graph.nodes):
            if linear.op != "call_function" or op_name(linear.target) != PACKED_LINEAR_OP or linear.kwargs:
                continue
            gate = linear.args[0]
            if not (isinstance(gate, fx.Node) and gate.op == "call_function"
                    and op_name(gate.target) == SILU_AND_MUL_OP and len(gate.users) == 1):
                continue
            with graph.inserting_before(linear):
                replacement = graph.call_function(
                    torch.ops.compiled_llm_cpu.silu_and_mul_packed_linear.default, (gate.args[0], *linear.args[1:])
                )
            replacement.meta = dict(linear.meta)
            linear.replace_all_uses_with(replacement)
            graph.erase_node(linear)
            graph.erase_node(gate)
            fused += 1
        return fused
