"""Grouped-query attention traced without repeating keys and values (stages/onnx/grouped.py):
the same logits as the model's own eager attention, through a cache and with left padding;
used only where the model's own attention is Llama's; and the exported graph of a
grouped-query decoder has no per-layer Expand of the cache, while a GPT-2 graph is traced
as before."""

from __future__ import annotations

from typing import Any

import pytest

from stages.onnx import grouped
from tests.fixtures.outliers import LLAMA


def _model(cls: str = "LlamaConfig", **settings: Any) -> Any:
    import torch
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, cls)(**{**LLAMA, **settings})
    config._attn_implementation = "eager"
    model_cls = {
        "LlamaConfig": transformers.LlamaForCausalLM,
        "Qwen3Config": transformers.Qwen3ForCausalLM,
        "Gemma2Config": transformers.Gemma2ForCausalLM,
    }[cls]
    return model_cls(config).eval()


def _run(model: Any) -> list[Any]:
    """Logits of a left-padded prefill, then of a cached decode step."""
    import torch

    ids = torch.randint(3, 500, (3, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding
    mask[2, :1] = 0
    with torch.no_grad():
        first = model(input_ids=ids, attention_mask=mask, use_cache=True)
        step = torch.randint(3, 500, (3, 1), generator=torch.Generator().manual_seed(2))
        mask2 = torch.cat([mask, torch.ones_like(step)], dim=1)
        second = model(input_ids=step, attention_mask=mask2, past_key_values=first.past_key_values)
    return [first.logits, second.logits]


@pytest.mark.parametrize("cls", ["LlamaConfig", "Qwen3Config"])
def test_grouped_attention_gives_the_models_logits(cls: str) -> None:
    import torch

    model = _model(cls, head_dim=32)
    want = _run(model)
    assert grouped.use(model)
    calls = []
    own = grouped.attention

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return own(*args, **kwargs)

    from transformers import AttentionInterface

    AttentionInterface.register(grouped.NAME, counted)
    try:
        have = _run(model)
    finally:
        AttentionInterface.register(grouped.NAME, own)
    assert calls  # really the grouped function, not the eager one
    for w, h in zip(want, have, strict=True):
        torch.testing.assert_close(h, w, rtol=1e-5, atol=1e-5)


def test_only_grouped_llama_style_attention_is_switched() -> None:
    import transformers

    # every head its own keys: nothing to repeat, the eager graph stays as it was
    assert not grouped.use(_model(num_key_value_heads=LLAMA["num_attention_heads"]))
    # Gemma 2's eager attention soft-caps its scores: not Llama's computation
    assert not grouped.use(_model("Gemma2Config", head_dim=32))
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64)
    )
    gpt2.config._attn_implementation = "eager"
    assert not grouped.use(gpt2)
    # an attention the model does not run eagerly (sdpa, flash) is left alone
    sdpa = _model()
    sdpa.config._attn_implementation = "sdpa"
    assert not grouped.use(sdpa)


def test_a_grouped_decoder_exports_without_repeating_its_cache(tmp_path: Any) -> None:
    import onnx

    ws = llama_workspace(tmp_path)
    spec = llama_spec()
    for stage in ("pin", "export", "parity"):
        report = ws.run(stage, spec)
        assert report.status.value == "passed", (stage, report.reasons)
    graph = onnx.load(ws.out("tiny-llama", "export") / "model.onnx", load_external_data=False)
    assert repeated_caches(graph.graph) == []
    # the row-independent attention rewrote every layer's probabilities x V product too
    # (it needs their rank: a mask repeated by a computed Tile lost it, and the products
    # were left to sum their keys in an order padding can change)
    products = [n for n in graph.graph.node if n.name.endswith("/row_invariant/probs/split")]
    assert len(products) == LLAMA["num_hidden_layers"]
    # the same model traced with its own attention repeats every cache (the check can fail)
    ws.run("pin", spec)
    eager = _without_grouping(ws, spec)
    assert len(repeated_caches(eager)) == 2 * LLAMA["num_hidden_layers"]


def repeated_caches(graph: Any) -> list[str]:
    """The presents (a layer's whole keys or values) that reach an Expand (repeat_kv's),
    directly or through an Unsqueeze."""
    consumers: dict[str, list[Any]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    out = []
    for present in (o.name for o in graph.output if o.name.startswith("present.")):
        near = consumers.get(present, [])
        unsqueezed = [n.output[0] for n in near if n.op_type == "Unsqueeze"]
        near += [c for name in unsqueezed for c in consumers.get(name, [])]
        if any(n.op_type == "Expand" for n in near):
            out.append(present)
    return out


def _without_grouping(ws: Any, spec: dict[str, Any]) -> Any:
    """The export's graph with grouped.use switched off (traced in this process)."""
    import os
    from unittest import mock

    import onnx

    with (
        mock.patch.dict(os.environ, {"SHIPYARD_STAGE_CHILD": "0"}),
        mock.patch.object(grouped, "use", lambda net: False),
    ):
        report = ws.run("export", spec)
    assert report.status.value == "passed", report.reasons
    path = ws.out("tiny-llama", "export") / "model.onnx"
    return onnx.load(path, load_external_data=False).graph


def llama_workspace(root: Any) -> Any:
    """A test workspace with a tiny grouped-query Llama (random weights, 8/2 heads) beside
    the tiny GPT-2, under models/tiny-llama (its tokenizer: tiny-gpt2's)."""
    import shutil

    from tests.conftest import Workspace

    ws = Workspace(root)
    folder = root / "models" / "tiny-llama"
    _model().save_pretrained(folder, safe_serialization=True)
    shutil.copy(root / "models" / "tiny-gpt2" / "tokenizer.json", folder / "tokenizer.json")
    return ws


def llama_spec() -> dict[str, Any]:
    """gpt2_spec's release for models/tiny-llama."""
    from tests.conftest import gpt2_spec

    spec = gpt2_spec()
    spec["name"] = "tiny-llama"
    spec["model"] = {"kind": "hf", "path": "models/tiny-llama"}
    spec["pins"].pop("checkpoints", None)
    return spec
