"""Grouped-query attention traced without repeating the keys and values (issue 41: what a
decode step copies).

transformers' eager attention for a grouped-query model (Llama's `eager_attention_forward`,
which Mistral, Qwen2/3, Phi-3, SmolLM3, ... carry as copies) repeats each key/value head for
every query head of its group (`repeat_kv`: expand, then reshape). Traced into ONNX, that is
an Expand per layer that writes the whole cache `group` times over in every step, and the
invariant attention's key padding (stages/onnx/invariant.py) then copies the repeated keys
and values once more. On a 30-layer 9/3-head decoder, a decode step of 16 rows on a
128-token past spent 7.0 of its 118 ms of kernel time in those Expands
(benchmarks/bench_decode_ops.py).

`attention` folds a group's query heads into the query rows instead: Q as
[batch, kv_heads, group x queries, head_dim] against K [batch, kv_heads, keys, head_dim],
the mask's rows repeated once per group member. Each score is the same dot product of the
same numbers over head_dim, and each output the same probabilities times the same values;
only the GEMMs' shapes change (the last bit of a sum can move with them, within parity's
tolerance). Export traces with it where the model's own eager attention is Llama's
(`generic`); any other model (softcapping, sinks, no grouping) keeps its own. PyTorch
references (evalcheck, parity, kvcheck) keep the model's own attention, so parity compares
the graph against the model's code, not against this function.
"""

from __future__ import annotations

import sys
from typing import Any

NAME = "shipyard_grouped"


def generic(module: Any) -> bool:
    """Whether `module` (an attention layer) computes attention with transformers' Llama
    eager function: the same bytecode, constants and names (its copies in other families
    are "Copied from" it)."""
    import importlib

    own = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if own is None:
        return False
    base = importlib.import_module("transformers.models.llama.modeling_llama")
    a, b = own.__code__, base.eager_attention_forward.__code__
    return bool(a.co_code == b.co_code and a.co_consts == b.co_consts and a.co_names == b.co_names)


def attention(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Any, Any]:
    """Llama's eager attention with a group's query heads as rows of one product (see the
    top); the model's own eager attention where that would not be the same computation."""
    import torch

    own = sys.modules[type(module).__module__].eager_attention_forward
    batch, heads, queries, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[-2]
    # the mask's heads (1: broadcast) and rows (one per query), as eager masks are
    mask_heads, mask_rows = (1, queries) if attention_mask is None else attention_mask.shape[1:3]
    if (
        kv_heads == heads
        or heads % kv_heads
        or mask_heads != 1
        or mask_rows != queries
        or (dropout and module.training)
        or not generic(module)
    ):
        out, weights = own(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
        return out, weights
    group = heads // kv_heads
    # heads are kv_head x group + member (repeat_kv's order): rows member x queries + q
    q = query.reshape(batch, kv_heads, group * queries, dim)
    scores = torch.matmul(q, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        # the mask's rows once per member: expand and reshape, not repeat (a Tile whose
        # repeats are computed has no rank for ONNX shape inference, and the invariant
        # rewrite needs the probabilities' rank to sum their product with V in blocks)
        m = attention_mask
        rows = m[:, :, None].expand(m.shape[0], m.shape[1], group, m.shape[2], m.shape[3])
        scores = scores + rows.reshape(m.shape[0], m.shape[1], group * m.shape[2], m.shape[3])
    probs = torch.nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(probs, value)  # [batch, kv_heads, group x queries, dim]
    out = out.reshape(batch, heads, queries, dim).transpose(1, 2).contiguous()
    return out, probs.reshape(batch, heads, queries, keys)


def use(net: Any) -> bool:
    """Trace `net` with `attention` (registered under NAME, with eager's mask) when one of
    its attention layers is a grouped-query Llama-style one; whether it was switched."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    config = getattr(net, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "eager":
        return False
    layers = [m for m in net.modules() if hasattr(m, "num_key_value_groups")]
    if not any(m.num_key_value_groups > 1 and generic(m) for m in layers):
        return False
    AttentionInterface.register(NAME, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, eager_mask)
    for sub in {id(c): c for c in _configs(config)}.values():
        sub._attn_implementation = NAME
    return True


def _configs(config: Any) -> list[Any]:
    """The config and its sub-configs (a multimodal model's text config reads its own)."""
    out = [config]
    for name in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "_attn_implementation"):
            out.append(sub)
    return out
