"""The task registry: one object per task, looked up in one place (Optimum-style).

A task decides the graph's inputs and outputs, the dims the spec must declare, the
transformers class that loads the checkpoint, the metrics evaluation computes, a default
accuracy budget, and what the serving runtime does with the outputs. Stages, the spec's
validators and the runtime read these fields; none of them branches on a task name.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

Task = Literal[
    "causal-lm",
    "text-embedding",
    "sequence-classification",
    "token-classification",
    "generic",
]


class TaskOutput(BaseModel):
    """One graph output: its name, the model-output attribute it comes from, and its axes
    (dims of the spec, or `vocab` / `labels` / `hidden`, sizes read from the config)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    attribute: str
    axes: tuple[str, ...]


class TaskDef(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    dims: tuple[str, ...]  # dims the spec's export.dims must declare
    auto_class: str  # the transformers Auto* class that loads an HF folder
    outputs: tuple[TaskOutput, ...]  # empty: the spec's export.outputs
    kv_cache: bool = False  # graph takes past_key_values.* and returns present.*
    language_model: bool = False  # next-token logits: perplexity is defined
    labels: bool = False  # outputs score config.id2label; the bundle ships the labels
    pooled: bool = False  # sentence embedding pooled (and normalized) inside the graph
    metrics: tuple[str, ...]  # what evaluation computes (thresholds may name these)
    default_budget: dict[str, float]  # quantization.budget when the spec gives none
    serving: Literal["generate", "labels", "tensors"]  # what the runtime returns


TASKS: dict[str, TaskDef] = {
    t.name: t
    for t in (
        TaskDef(
            name="causal-lm",
            dims=("batch", "sequence", "past_sequence"),
            auto_class="AutoModelForCausalLM",
            outputs=(
                TaskOutput(name="logits", attribute="logits", axes=("batch", "sequence", "vocab")),
            ),
            kv_cache=True,
            language_model=True,
            metrics=(
                "perplexity",
                "perplexity_reference",
                "top1_agreement",
                "greedy_exact_match",
                "greedy_token_match",
            ),
            default_budget={"top1_agreement_min": 0.98},
            serving="generate",
        ),
        TaskDef(
            name="text-embedding",
            dims=("batch", "sequence"),
            auto_class="AutoModel",
            outputs=(
                TaskOutput(
                    name="sentence_embedding",
                    attribute="sentence_embedding",
                    axes=("batch", "hidden"),
                ),
                TaskOutput(
                    name="token_embeddings",
                    attribute="token_embeddings",
                    axes=("batch", "sequence", "hidden"),
                ),
            ),
            pooled=True,
            metrics=("cosine_to_reference",),
            default_budget={"logit_cosine_min": 0.99},
            serving="tensors",
        ),
        TaskDef(
            name="sequence-classification",
            dims=("batch", "sequence"),
            auto_class="AutoModelForSequenceClassification",
            outputs=(TaskOutput(name="logits", attribute="logits", axes=("batch", "labels")),),
            labels=True,
            metrics=("agreement",),
            default_budget={"top1_agreement_min": 0.98},
            serving="labels",
        ),
        TaskDef(
            name="token-classification",
            dims=("batch", "sequence"),
            auto_class="AutoModelForTokenClassification",
            outputs=(
                TaskOutput(name="logits", attribute="logits", axes=("batch", "sequence", "labels")),
            ),
            labels=True,
            metrics=("agreement",),
            default_budget={"top1_agreement_min": 0.98},
            serving="labels",
        ),
        TaskDef(
            name="generic",
            dims=(),
            auto_class="AutoModel",  # an HF folder; python models build themselves
            outputs=(),
            metrics=("cosine_to_reference", "snr_db"),
            default_budget={"snr_db_min": 20.0},
            serving="tensors",
        ),
    )
}

# Where each evaluation metric comes from in the comparison of the shipped model with the
# reference (stages/quant/accuracy.py `agreement`); decode metrics come from generation.
METRIC_SOURCES = {
    "perplexity": "perplexity",
    "perplexity_reference": "perplexity_fp32",
    "top1_agreement": "top1_agreement",
    "agreement": "top1_agreement",
    "cosine_to_reference": "logit_cosine",
    "snr_db": "snr_db",
}
