"""Fusion pass: the rotary embedding folded into the attention op that consumes it.

Before: `q, k = rotary_embedding(positions, q, k, cos_sin)` in the compiled piece (one or two
Inductor kernels a layer), then `attention(q, k, v, out, kv_cache, scale)` (on a GPU a KV-cache
write kernel and an attention kernel). After: `attention(q, k, v, out, kv_cache, scale, positions,
cos_sin)`, whose KV-cache write kernel rotates the queries and keys itself: one kernel fewer or
two a layer on a GPU, one op call fewer a layer on a CPU. The queries, keys and values reach the
op as the views of the fused QKV projection's output that the split made, read in place: the
QKV split costs no copy.

The pass runs on the traced graph before it is split around the attention ops, the one place
where the rotary (inside a piece) and its consumer (the splitting op) are in one graph.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from compiled_llm.compilation.partition import op_name

ROTARY_OP = "compiled_llm::rotary_embedding"
ATTENTION_OP = "compiled_llm::attention"
# Users of a rotated tensor that only read its shape and dtype: they may take the unrotated
# tensor instead (same shape and dtype).
_SHAPE_ONLY = {torch.empty_like, torch.Tensor.new_empty, "size", "new_empty"}


def _is_op(node: fx.Node, name: str) -> bool:
    return node.op == "call_function" and op_name(node.target) == name


def _rotary_output(node: object, index: int) -> fx.Node | None:
    """The rotary node if `node` is output `index` of one."""
    if (isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.getitem
            and node.args[1] == index and isinstance(node.args[0], fx.Node) and _is_op(node.args[0], ROTARY_OP)):
        return node.args[0]
    return None


def _shape_only(user: fx.Node) -> bool:
    target = user.target if user.op == "call_function" else user.target if user.op == "call_method" else None
    return target in _SHAPE_ONLY


class RotaryAttentionFusion:
    name = "rotary_attention"

    def __call__(self, graph: fx.Graph) -> int:
        fused = 0
        for attention in list(graph.nodes):
            if not _is_op(attention, ATTENTION_OP) or len(attention.args) != 6 or attention.kwargs:
                continue
            query, key = attention.args[0], attention.args[1]
            rotary = _rotary_output(query, 0)
            if rotary is None or _rotary_output(key, 1) is not rotary:
                continue
            if any(u is not attention and not _shape_only(u) for u in (*query.users, *key.users)):
                continue  # the rotated tensors are needed elsewhere: keep the rotary
            positions, raw_query, raw_key, cos_sin_cache = rotary.args
            for rotated, raw in ((query, raw_query), (key, raw_key)):
                for user in list(rotated.users):
                    if user is attention:
                        continue
                    user.replace_input_with(rotated, raw)
                    if user.target is torch.empty_like:  # the unrotated view is strided: ask for a dense buffer
                        user.kwargs = {**user.kwargs, "memory_format": torch.contiguous_format}
            attention.args = (raw_query, raw_key, *attention.args[2:], positions, cos_sin_cache)
            for node in (query, key):
                if not node.users:
                    graph.erase_node(node)
            if not rotary.users:
                graph.erase_node(rotary)
            fused += 1
        return fused
