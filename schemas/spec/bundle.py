"""`bundle`: what ships: serving settings, the ONNX Runtime session, the model card."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from schemas.spec.base import MAX_PROSE, Strict

# Execution providers onnxruntime knows (any build); a typo here would only fail at serving.
ORT_PROVIDERS = (
    "CPUExecutionProvider",
    "CUDAExecutionProvider",
    "TensorrtExecutionProvider",
    "NvTensorRTRTXExecutionProvider",
    "ROCMExecutionProvider",
    "MIGraphXExecutionProvider",
    "OpenVINOExecutionProvider",
    "DnnlExecutionProvider",
    "DmlExecutionProvider",
    "CoreMLExecutionProvider",
    "QNNExecutionProvider",
    "SNPEExecutionProvider",
    "NnapiExecutionProvider",
    "XnnpackExecutionProvider",
    "ACLExecutionProvider",
    "ArmNNExecutionProvider",
    "CANNExecutionProvider",
    "VitisAIExecutionProvider",
    "WebGpuExecutionProvider",
    "JsExecutionProvider",
    "AzureExecutionProvider",
    "RknpuExecutionProvider",
    "TvmExecutionProvider",
)


# The MLServer config derives its gRPC and metrics ports from `port` (+1, +2).
DERIVED_PORTS = {"grpc": 1, "metrics": 2}


def batch_limits(
    served: int | None, preferred: list[int], export_max: int | None, engine: bool = False
) -> tuple[str, str]:
    """Rule: the served max batch <= export.dims.batch.max; each preferred batch size <= the
    served max. One rule for the spec (`served`: bundle.serving.max_batch_size, None when
    unset) and the serve stage (`served`: what it chose from the plan); `export_max` None:
    the export declares no batch axis (the graph runs one row). `engine`: the generation
    engine serves the graph, whose rows are independent (kvcheck holds each row of a padded
    batch to its own pass) and whose batch axis is dynamic: its rows are sized from the KV
    budget by the plan, not capped by the export's probe batch. Returns (problem, fix), or
    ("", "") when the limits hold."""
    limit = 1 if export_max is None else export_max
    if engine and export_max is not None:
        limit = served or limit
    if served is not None and served > limit:
        if export_max is None:
            return (
                f"bundle.serving.max_batch_size: {served} exceeds 1: the export declares no "
                "batch axis, so the server runs one row at a time",
                "drop max_batch_size or export a `batch` dim",
            )
        return (
            f"bundle.serving.max_batch_size: {served} exceeds export.dims.batch.max ({limit}); "
            "the exported graph is not promised to run beyond it",
            "lower max_batch_size or raise the export's batch max",
        )
    served = limit if served is None else served
    for size in preferred:
        if size > served:
            return (
                f"bundle.serving.preferred_batch_sizes: {size} is beyond the served "
                f"max_batch_size {served}",
                f"list sizes up to {served} only, or raise max_batch_size",
            )
    return "", ""


class ServingConfig(Strict):
    port: int = Field(
        default=8000,
        ge=1,
        le=65535 - max(DERIVED_PORTS.values()),
        description="HTTP port; MLServer's gRPC and metrics ports are port+1 and port+2.",
    )
    max_batch_size: int | None = Field(
        default=None,
        ge=1,
        description="Default: the capacity plan's (a generation engine's rows, sized from its "
        "KV budget), else the export's batch max, which a one-pass model may not exceed.",
    )
    max_queue_depth: int = Field(default=64, ge=1, description="Requests queued before 503.")
    max_context_length: int | None = Field(
        default=None, ge=1, description="Default: the export's largest total sequence."
    )
    kv_cache_budget: int | None = Field(
        default=None,
        ge=0,
        description="Bytes of KV cache the engine may hold (padded rows x longest); default: "
        "the plan's budget, what the device leaves after weights, overhead and activations.",
    )
    request_timeout_seconds: float = Field(default=30.0, gt=0, description="Per-request timeout.")
    max_request_bytes: int = Field(
        default=4 * 1024 * 1024,
        ge=1024,
        le=1024**3,
        description="Largest request body (REST) or message (gRPC); larger ones get 413 "
        "before they are parsed.",
    )
    read_timeout_seconds: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        description="A request's headers and body must arrive within this (slow-drip "
        "connections are closed; a slow body gets 408).",
    )
    idle_timeout_seconds: float = Field(
        default=5.0, gt=0, le=3600, description="An idle kept-alive connection closes after this."
    )
    max_connections: int = Field(
        default=512,
        ge=1,
        le=65535,
        description="Open connections and requests on each port (REST, gRPC, metrics); beyond: "
        "503 or closed.",
    )
    metrics_auth: bool = Field(
        default=True,
        description="/metrics needs the API token; false: a scraper on loopback needs none (a "
        "client from elsewhere still does).",
    )
    streaming: bool | None = Field(default=None, description="Default: true for causal-lm.")
    dynamic_batching: bool = Field(
        default=True, description="Server-side batching of concurrent requests (Triton, MLServer)."
    )
    max_queue_delay_microseconds: int = Field(
        default=2000, ge=0, description="How long a request may wait for a batch to fill."
    )
    preferred_batch_sizes: list[Annotated[int, Field(ge=1)]] | None = Field(
        default=None, description="Triton dynamic_batching.preferred_batch_size; each <= max."
    )
    instance_count: int = Field(default=1, ge=1, description="Model instances (Triton).")
    instance_kind: Literal["KIND_CPU", "KIND_GPU", "KIND_AUTO"] = Field(
        default="KIND_CPU", description="Triton instance_group kind."
    )
    warmup: bool = Field(default=True, description="Triton model_warmup with a max-shape request.")
    scheduling: Literal["continuous", "request"] = Field(
        default="continuous",
        description="causal-lm: batch decode steps (requests join and leave between steps), "
        "or request-level (a batch runs to its end before the next is admitted).",
    )
    prefix_caching: bool = Field(
        default=True,
        description="causal-lm: reuse the KV cache of a shared prompt prefix, within the "
        "KV budget, least recently used evicted first.",
    )
    max_wait_ms: float = Field(
        default=1000.0,
        ge=0,
        description="causal-lm: how long a waiting request that does not fit may be overtaken "
        "by later ones that do (ageing).",
    )


class OrtSessionConfig(Strict):
    graph_optimization_level: Literal["disable", "basic", "extended", "all"] = Field(
        default="all", description="onnxruntime GraphOptimizationLevel."
    )
    intra_op_num_threads: int = Field(default=0, ge=0, description="0 = onnxruntime default.")
    inter_op_num_threads: int = Field(default=0, ge=0, description="0 = onnxruntime default.")
    execution_mode: Literal["sequential", "parallel"] = Field(
        default="sequential", description="onnxruntime ExecutionMode."
    )
    providers: list[Literal[ORT_PROVIDERS]] = Field(  # type: ignore[valid-type]
        default_factory=lambda: ["CPUExecutionProvider"],
        min_length=1,
        description="Execution providers, in order of preference (onnxruntime names).",
    )

    @model_validator(mode="after")
    def _unique(self) -> OrtSessionConfig:
        """Rule: ONNX Runtime providers are listed once each."""
        if len(set(self.providers)) != len(self.providers):
            raise ValueError(f"providers lists one twice ({self.providers}); keep one of each")
        return self


class ModelCard(Strict):
    description: str = Field(default="", max_length=MAX_PROSE, description="What the model does.")
    license: str = Field(
        default="unspecified", max_length=128, description="License of the weights (SPDX id)."
    )
    intended_use: str = Field(
        default="", max_length=MAX_PROSE, description="Who should use it for what."
    )
    limitations: str = Field(default="", max_length=MAX_PROSE, description="Known limitations.")


class BundleConfig(Strict):
    serving: ServingConfig = Field(default_factory=ServingConfig, description="Server config.")
    ort_session: OrtSessionConfig = Field(
        default_factory=OrtSessionConfig, description="onnxruntime SessionOptions."
    )
    model_card: ModelCard = Field(default_factory=ModelCard, description="Model card text.")
