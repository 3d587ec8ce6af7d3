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
    budget_why: str  # why that default (docs/spec-rules.md prints it)
    serving: Literal["generate", "labels", "tensors"]  # what the runtime returns

    def decode_tokens(self, prompt: int, new_tokens: int) -> int:
        """Tokens the graph reads over a decode of `new_tokens` after `prompt`: the prompt and
        every generated token but the last (no step reads it back)."""
        return prompt + new_tokens - 1

    def decode_past(self, prompt: int, new_tokens: int) -> int:
        """The longest past a cached decode feeds the graph: its last step reads every token
        before its own, prompt + new_tokens - 2 (a prompt prefilled in chunks, down to one
        token, reads up to prompt - 1 too). The one KV-length rule: spec validation
        (evaluation.decode, loadtest.ramp) and the shipped engine's request check apply it
        (the engine, shipped without schemas, keeps a copy a test holds to this one)."""
        return self.decode_tokens(prompt, new_tokens) - 1


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
            default_budget={"greedy_agreement_min": 0.9, "perplexity_increase_max": 0.02},
            budget_why="A user meets a decoder through the text it generates. Top-1 agreement "
            "on calibration text mostly counts positions where the model itself is unsure "
            "(near-ties that any noise flips), so it refuses recipes whose generations do not "
            "change. Greedy agreement is measured on FP32's own generations, where the model is "
            "confident: 0.9 refuses a recipe that changes more than one token in ten of what "
            "the model would write. Perplexity +2 % bounds the change of the whole "
            "distribution: INT8 recipes that handle outliers (LLM.int8(), SmoothQuant W8A8) "
            "stay within ~1 % on 7B models and small models lose somewhat more, while INT8 "
            "broken by activation outliers costs tens of percent or more.",
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
            budget_why="Retrieval compares embeddings by cosine: at 0.99 to the FP32 vector "
            "a document's similarity to a query moves by at most ~0.14 of their angle's room, "
            "so only near-tied neighbours swap ranks. Per-tensor INT8 of BERT-family encoders "
            "(per-channel outliers) lands well below; per-channel or smoothed INT8 near 0.99, "
            "which is why auto needs its margin and a held-out confirmation here.",
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
            budget_why="The label is what a classifier's user sees: 0.98 allows at most 2 "
            "changed decisions in 100 inputs, most of them inputs FP32 itself scores near the "
            "decision boundary.",
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
            budget_why="The label is what a classifier's user sees: 0.98 allows at most 2 "
            "changed decisions in 100 inputs, most of them inputs FP32 itself scores near the "
            "decision boundary.",
            serving="labels",
        ),
        TaskDef(
            name="generic",
            dims=(),
            auto_class="AutoModel",  # an HF folder; python models build themselves
            outputs=(),
            metrics=("cosine_to_reference", "snr_db"),
            default_budget={"snr_db_min": 20.0},
            budget_why="A generic graph's outputs have no known meaning: 20 dB keeps the "
            "error's energy at 1 % of the output's, where INT8 of well-scaled layers lands.",
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
