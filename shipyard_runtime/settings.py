"""The served model's settings, one typed object: the serve stage builds and validates it,
renders it into model-settings.json (`parameters.extra`), and every front end reads it back
through the same model, so a key is spelled in one place and a wrong one fails at load."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from shipyard_runtime.generation.scheduler import EngineSettings


class BatchingSettings(BaseModel):
    """Whole-request batching for the one-pass tasks (embeddings, labels, tensors)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_rows: int = Field(ge=1, description="Rows a merged batch may hold (max_batch_size).")
    enabled: bool = Field(description="Merge concurrent compatible requests.")
    delay_s: float = Field(ge=0, description="How long a request may wait for a batch.")
    instances: int = Field(ge=1, description="Batches run at once.")
    max_queue: int = Field(ge=0, description="Requests waiting before 503; 0: unbounded.")
    timeout_s: float = Field(ge=0, description="A request unanswered this long gets 504.")


class RuntimeSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    task: str = Field(description="The release's task.")
    serving: Literal["generate", "labels", "tensors"] = Field(description="What is returned.")
    labels: list[str] = Field(default_factory=list, description="Class names (labels tasks).")
    input_bounds: dict[str, tuple[int, int]] = Field(
        default_factory=dict, description="[low, high) of each integer input."
    )
    max_sequence: int | None = Field(
        default=None, description="Tokens one pass takes (export sequence.max); null: any."
    )
    embedding_output: str | None = Field(
        default=None, description="text-embedding: the output /v1/embeddings returns."
    )
    ort_session: str = Field(description="ort_session.json, relative to model-settings.json.")
    text: str | None = Field(
        default=None, description="Folder of the tokenizer files, relative; none shipped: null."
    )
    sampling_defaults: dict[str, float | int] = Field(
        default_factory=dict, description="The model's generation_config sampling values."
    )
    batching: BatchingSettings
    engine: EngineSettings | None = Field(default=None, description="Generating tasks only.")
