"""Fusion pass: the rotary embedding folded into the attention op that consumes it.

Before: `q, k = rotary_embedding(positions, q, k, cos_sin)` in the compiled piece (one or two
Inductor kernels a layer), then `attention(q, k, v, out, kv_cache, scale)` (on a GPU a KV-cache
write kernel and an attention kernel). After: `attention(q, k, v, out, kv_cache, scale, positions,
cos_sin)`, whose KV-cache write kernel rotates the queries and keys itself: one kernel fewer or
two a layer on a GPU, one op call fewer a layer on a CPU.

The QKV split is folded in too: where the unrotated queries, keys and values are the three views
of one split of the fused QKV projection's output (as the models make them), the op's `qkv`
overload takes that output whole, `attention.qkv(qkv, out, kv_cache, scale, num_kv_heads,
positions, cos_sin)`, and makes the views itself. The compiled piece then returns one fresh
buffer instead of three views of it (regenerating an aliased output costs about 7 us a call).

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
_SHAPE_ONLY = {torch.empty_like, "size", "new_empty"}


def _is_op(node: fx.Node, name: str) -> bool:
    return node.op == "call_function" and op_name(node.target) == name


def _rotary_output(node: object, index: int) -> fx.Node | None:
    """The rotary node if `node` is output `index` of one."""
    if (isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.getitem
            and node.args[1] == index and isinstance(node.args[0], fx.Node) and _is_op(node.args[0], ROTARY_OP)):
        return node.args[0]
    return None


def _split_view(node: object) -> tuple[fx.Node, int, tuple] | None:
    """(split node, output index, view shape) if `node` is `view(split(x, sizes, dim=-1)[i], *shape)`."""
    if not (isinstance(node, fx.Node) and node.op == "call_method" and node.target == "view"):
        return None
    item = node.args[0]
    if not (isinstance(item, fx.Node) and item.op == "call_function" and item.target is operator.getitem):
        return None
    split = item.args[0]
    if not (isinstance(split, fx.Node) and split.op == "call_method" and split.target == "split"):
        return None
    dim = split.kwargs.get("dim", split.args[2] if len(split.args) > 2 else 0)
    return (split, item.args[1], tuple(node.args[1:])) if dim == -1 and len(split.args) >= 2 else None


def _qkv_source(query: object, key: object, value: object) -> tuple[fx.Node, int] | None:
    """(the fused QKV output, num_kv_heads) if the three are `view(-1, heads, head_dim)` of outputs
    0, 1 and 2 of one split of it into exactly [H D, Hkv D, Hkv D] along the last dim."""
    found = [_split_view(x) for x in (query, key, value)]
    views = [v for v in found if v is not None]
    if len(views) != 3 or len({split for split, _, _ in views}) != 1 or [i for _, i, _ in views] != [0, 1, 2]:
        return None
    split, shapes = views[0][0], [shape for _, _, shape in views]
    if any(len(shape) != 3 or shape[0] != -1 or not all(isinstance(n, int) for n in shape) for shape in shapes):
        return None
    (_, heads, dim), (_, kv_heads, k_dim), (_, v_heads, v_dim) = shapes
    sizes = split.args[1]
    if (v_heads, k_dim, v_dim) != (kv_heads, dim, dim) or not isinstance(sizes, (list, tuple)) \
            or list(sizes) != [heads * dim, kv_heads * dim, kv_heads * dim]:
        return None
    return split.args[0], kv_heads


def _shape_only(user: fx.Node) -> bool:
    return user.op in ("call_function", "call_method") and user.target in _SHAPE_ONLY


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
            value, output, kv_cache, scale = attention.args[2:]
            qkv = _qkv_source(raw_query, raw_key, value)
            if qkv is None:
                attention.args = (raw_query, raw_key, value, output, kv_cache, scale, positions, cos_sin_cache)
            else:
                with graph.inserting_before(attention):
                    fused_call = graph.call_function(
                        torch.ops.compiled_llm.attention.qkv,
                        (qkv[0], output, kv_cache, scale, qkv[1], positions, cos_sin_cache),
                    )
                fused_call.meta = dict(attention.meta)
                graph.erase_node(attention)
            _erase_unused([query, key, rotary, raw_query, raw_key, value], graph)
            fused += 1
        return fused


def _erase_unused(nodes: list[fx.Node], graph: fx.Graph) -> None:
    """Erase nodes left without users, and then their inputs that are left without users and are
    views or getitems (the split's), so that no dead view stays an output of a compiled piece."""
    pending = list(nodes)
    while pending:
        node = pending.pop(0)
        if getattr(node, "_erased", False) or node.users or node.op in ("placeholder", "output"):
            continue
        removable = node.op == "call_method" and node.target in ("view", "split") or node.target is operator.getitem \
            or _is_op(node, ROTARY_OP)
        if not removable:
            continue
        inputs = list(node.all_input_nodes)
        graph.erase_node(node)
        pending.extend(inputs)
