"""What one stage hands another: typed, validated, written and read only through the stage
context (`ctx.write(obj)`, `ctx.read(ModelInfo)`).

Each artifact names the stage that writes it and its file, so a path is spelled once: a
stage lists the artifacts it reads in `io().reads`, the compiler turns them into DVC deps,
and `ctx.read` refuses an artifact the stage did not declare. `StageReport.details` is for
humans; nothing downstream reads it.

Artifacts marked `SHIPS = False` stay in the build folder: they feed the manifest's facts
(`shipyard.json`), which is what ships.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from schemas.loadresults import Headline, RampRow, SloVerdict
from schemas.quantsearch import RecipeRow


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


_DECLARED: list[type[Artifact]] = []  # every artifact class below, in definition order


class Artifact(_Model):
    STAGE: ClassVar[str]
    FILE: ClassVar[str]
    SHIPS: ClassVar[bool] = True
    OPTIONAL: ClassVar[bool] = False  # written only sometimes: read with optional=True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _DECLARED.append(cls)

    @classmethod
    def location(cls) -> str:
        """`stage/file` inside a release's build folder."""
        return f"{cls.STAGE}/{cls.FILE}"


# pin ---------------------------------------------------------------------------------------
class VersionLock(Artifact):
    """The environment and checkpoint a release is built from; deterministic (no commit,
    no time), so the stages after it rerun only when these change."""

    STAGE: ClassVar[str] = "pin"
    FILE: ClassVar[str] = "lock.json"
    python: str
    packages: dict[str, str | None] = Field(description="Installed version; null = absent.")
    checkpoints: dict[str, str] = Field(description="Checkpoint file -> sha256.")
    files: dict[str, str] = Field(
        default_factory=dict,
        description="Every file under the model's paths (repo-relative) -> sha256. The "
        "stages that load the model depend on this file instead of the model folders.",
    )


class GitState(_Model):
    commit: str
    dirty: bool


class Provenance(Artifact):
    """Which code built the release; read only by the manifest (it changes every commit)."""

    STAGE: ClassVar[str] = "pin"
    FILE: ClassVar[str] = "provenance.json"
    SHIPS: ClassVar[bool] = False
    git: GitState


# export ------------------------------------------------------------------------------------
class Arch(_Model):
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    positions: int
    labels: int


class DimSizes(_Model):
    min: int
    opt: int
    max: int


class TensorInfo(_Model):
    name: str
    dtype: str
    axes: list[int | str] = Field(description="Named dims of the spec, or fixed sizes.")
    low: float | None = Field(
        default=None,
        description="Smallest value an integer input accepts (token ids 0, masks 0, or "
        "export.inputs' low); null for floats.",
    )
    high: float | None = Field(
        default=None,
        description="Exclusive upper bound of an integer input's values (the vocabulary, "
        "type_vocab_size, 2 for a mask, or export.inputs' high); the server refuses values "
        "outside [low, high) with 400.",
    )


class ModelInfo(Artifact):
    """The exported graph: task, architecture, dims and the input/output layout."""

    STAGE: ClassVar[str] = "export"
    FILE: ClassVar[str] = "model_info.json"
    task: str
    arch: Arch
    parameters: int
    weight_bytes: int
    dtype: str = Field(description="The export's dtype; the served one is QuantInfo.dtype.")
    exporter: str
    opset: int
    external_data: bool
    dims: dict[str, DimSizes]
    inputs: list[TensorInfo]
    outputs: list[TensorInfo]
    labels: list[str] | None = Field(
        default=None, description="What each score means (config.id2label), for label tasks."
    )
    pooling: str | None = Field(default=None, description="text-embedding: the pooling mode.")
    normalize: bool | None = Field(default=None, description="text-embedding: L2-normalized.")


# quantize ----------------------------------------------------------------------------------
class FloatNode(_Model):
    node: str
    why: str


class QuantInfo(Artifact):
    """What the quantize stage shipped: method, served dtype, nodes kept in float, and (method
    auto) every recipe the search measured."""

    STAGE: ClassVar[str] = "quantize"
    FILE: ClassVar[str] = "quant_info.json"
    method: str
    dtype: str
    float_nodes: list[FloatNode]
    recipes: list[RecipeRow] | None = None
    budget: dict[str, float] | None = Field(
        default=None,
        description="The accuracy contract's bounds (quantization.budget or the task's "
        "default; schemas/contract.py); None when nothing was quantized.",
    )
    margin: float | None = Field(
        default=None, description="Share of each bound's room quantize kept in reserve."
    )


class CalibrationUsed(Artifact):
    """The data the weights were fitted to (null when the method needs none)."""

    STAGE: ClassVar[str] = "quantize"
    FILE: ClassVar[str] = "calibration.json"
    SHIPS: ClassVar[bool] = False
    path: str | None = None
    sha256: str | None = None


# evaluate ----------------------------------------------------------------------------------
class Evaluation(Artifact):
    """Task metrics of the quantized model on the evaluation set (the gate's baseline)."""

    STAGE: ClassVar[str] = "evaluate"
    FILE: ClassVar[str] = "evaluation.json"
    SHIPS: ClassVar[bool] = False
    metrics: dict[str, float]


# plan --------------------------------------------------------------------------------------
class MemoryParts(_Model):
    weights: int
    kv_cache: int
    activations: int
    overhead: int
    total: int


# the traced graph's engine (kv.Batch): the cache fed to a decode step, the presents ONNX
# Runtime builds from it (in its arena), and their copy into the arrays the engine keeps:
# three copies for the length of a step (measured: tests/stages/test_plan_models_the_engine.py,
# 3.04 copies at batch 8 x 898)
KV_COPIES = 3
# a fused graph's engine (kv.Slots) writes its cache in place: one copy, two while its
# buffers are remade (a join, a growth or a compaction copies the rows kept into fresh
# buffers), and a prompt's chunk beside them (CapacityPlan.kv_prefill_bytes) (measured: the
# same test's fused variant)
KV_COPIES_IN_PLACE = 2


class CapacityPlan(Artifact):
    """Memory for the extreme case vs the usable device memory."""

    STAGE: ClassVar[str] = "plan"
    FILE: ClassVar[str] = "plan.json"
    batch: int
    context: int
    device_bytes: int
    usable_bytes: int
    kv_dtype: str
    kv_copies: int = Field(
        default=KV_COPIES,
        description="Copies of its KV budget the serving engine holds at its peak: 3 for the "
        "traced graph (the past fed to a step, ONNX Runtime's presents, their copy), 2 for a "
        "fused graph whose cache is written in place (its buffers remade as rows join or "
        "grow; a prompt beside them: kv_prefill_bytes).",
    )
    kv_prefill_bytes: int = Field(
        default=0,
        description="Held beside the budget by an engine that writes its cache in place (a "
        "fused graph's): one sequence at cached_tokens, a prompt's chunk (the past fed and "
        "the presents grown from it); 0 for the traced graph's, whose three copies cover it.",
    )
    kv_bytes_per_sequence: int = Field(
        description="One sequence's cache at the extreme: kv_bytes_per_token x cached_tokens."
    )
    kv_bytes_per_token: int = Field(
        default=0, description="K and V of every layer for one token (0: no KV cache)."
    )
    cached_tokens: int = Field(
        default=0,
        description="Tokens the engine counts for one sequence at most (prompt + max_tokens): "
        "the context, or past_sequence.max + 2 when that is less (the engine refuses a request "
        "whose last step would read a longer past).",
    )
    extreme: MemoryParts
    max_batch_that_fits: int = Field(
        description="A KV-cache model: the most engine rows whose decode activations fit while "
        "the KV budget still holds one sequence at the full context and 256 tokens a row; a "
        "one-pass model: the most rows at the full sequence."
    )
    kv_budget_tokens: int = Field(
        default=0,
        description="Padded cache tokens (rows x the longest sequence) the engine may hold: "
        "what the device leaves after weights, overhead and activations, at most every row at "
        "cached_tokens; the serve stage's default KV budget (0: no KV cache).",
    )
    activation_bytes_per_sequence: int = Field(
        default=0, description="Activations one more row adds (its decode step, or its pass)."
    )


# engine ------------------------------------------------------------------------------------
class EngineProfileInfo(_Model):
    name: str
    dims: dict[str, DimSizes]
    shapes: dict[str, dict[str, list[int]]] = Field(description="input -> min/opt/max shape")


class EngineProfiles(Artifact):
    """TensorRT optimization profiles derived from the spec and the export (always written,
    also when no engine can be built here)."""

    STAGE: ClassVar[str] = "engine"
    FILE: ClassVar[str] = "profiles.json"
    profiles: list[EngineProfileInfo]


class EngineParityRow(BaseModel):
    """TensorRT against ONNX Runtime at one shape of one optimization profile."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    profile: str
    shape: str = Field(description="min, opt, max or odd")
    ok: bool
    why: str


class CudaGraphRow(BaseModel):
    """A CUDA-graph replay against plain execution at one batch size."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    batch: int
    ok: bool
    plain_ms: float
    graph_ms: float
    speedup: float
    why: str


class EngineBuild(Artifact):
    """Where and with what an engine was built; absent when none was."""

    STAGE: ClassVar[str] = "engine"
    FILE: ClassVar[str] = "engine.json"
    OPTIONAL: ClassVar[bool] = True
    tensorrt: str
    gpu: str
    compute_capability: str
    plan: str = Field(description="The plan's path inside the bundle.")
    parity: list[EngineParityRow] = Field(description="TensorRT vs ONNX Runtime rows.")
    cuda_graphs: list[CudaGraphRow] = Field(description="CUDA-graph replay rows.")


# serve -------------------------------------------------------------------------------------
class ServingValues(Artifact):
    """The resolved serving settings every config was rendered from."""

    STAGE: ClassVar[str] = "serve"
    FILE: ClassVar[str] = "serving_values.json"
    SHIPS: ClassVar[bool] = False
    model_path: str
    dtype: str
    port: int
    max_batch_size: int
    max_queue_depth: int
    max_context_length: int
    kv_cache_budget: int
    request_timeout_seconds: float
    max_request_bytes: int
    read_timeout_seconds: float
    idle_timeout_seconds: float
    max_connections: int
    metrics_auth: bool = True
    streaming: bool
    dynamic_batching: bool
    max_queue_delay_microseconds: int
    preferred_batch_sizes: list[int]
    instance_count: int
    instance_kind: str
    warmup: bool
    scheduling: str
    prefix_caching: bool
    max_wait_ms: float


# loadtest ----------------------------------------------------------------------------------
class LoadTestSummary(Artifact):
    """The headline numbers, SLO verdicts, plots and ramp the model card and facts show."""

    STAGE: ClassVar[str] = "loadtest"
    FILE: ClassVar[str] = "summary.json"
    SHIPS: ClassVar[bool] = False
    summary: Headline
    slo: list[SloVerdict]
    plots: list[str]
    ramp: list[RampRow]


# every artifact class of this module, as declared (no hand-kept list to forget one in)
ARTIFACTS: tuple[type[Artifact], ...] = tuple(_DECLARED)
# Files that stay in the build folder when a stage's outputs ship.
NOT_SHIPPED: frozenset[str] = frozenset(a.location() for a in ARTIFACTS if not a.SHIPS)
