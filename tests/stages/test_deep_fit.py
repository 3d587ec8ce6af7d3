"""The test models' fit (tests/fixtures/outliers.py: train) on a deep Llama: a zero embedding
row (the pad token's, which transformers zeroes) sends every gradient to NaN once the model
is deep enough, whatever the learning rate; without it the fit runs. benchmarks/bench_memory
.bench_model fits the 30-layer benchmark model with pad_token_id=None for this reason."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.fixtures import outliers

DEEP = {  # the smallest that overflows here: 24 layers of 64 do not, of 128 do
    "num_hidden_layers": 24,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "hidden_size": 128,
    "intermediate_size": 384,
}
TOKENIZER = Path(__file__).resolve().parents[2] / "models" / "tiny-gpt2" / "tokenizer.json"


def _texts() -> list[str]:
    lines = (TOKENIZER.parents[2] / "data" / "calibration" / "docstrings.jsonl").read_text()
    return [json.loads(line)["text"] for line in lines.splitlines()[240:]]


def _model(pad: int | None) -> Any:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**outliers.LLAMA, **DEEP, "pad_token_id": pad})
    return transformers.LlamaForCausalLM(config)


def _gradient_norm(model: Any, first: int) -> float:
    """One backward pass of a fit's window that starts with token `first` (how the 30-layer
    fit met it at its fifth step: a window cut just before a pad-token id)."""
    import torch
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(TOKENIZER)).encode(_texts()[0]).ids[:15]
    x = torch.tensor([[first, *ids]])
    model.train()
    model(input_ids=x, labels=x).loss.backward()
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))


def test_a_zero_embedding_row_sends_a_deep_fit_to_nan() -> None:
    import math

    assert math.isnan(_gradient_norm(_model(pad=2), first=2))
    assert math.isfinite(_gradient_norm(_model(pad=2), first=3))  # that row alone does it
    assert math.isfinite(_gradient_norm(_model(pad=None), first=2))


def test_without_it_the_same_fit_runs_and_learns() -> None:
    model = _model(pad=None)
    loss = outliers.train(model, _texts(), TOKENIZER, steps=12, seed=0)
    assert loss < 6.0  # from ln(512) = 6.24 at the start
