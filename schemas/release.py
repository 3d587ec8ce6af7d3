"""ReleaseSpec: one YAML file per model release, validated strictly."""

from __future__ import annotations

import posixpath
import re
from typing import Annotated, Literal

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from pydantic import AfterValidator, BaseModel, ByteSize, ConfigDict, Field, model_validator

SCHEMA_VERSION = 1
NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]*$"
# Semantic Versioning 2.0.0 (semver.org's regular expression): a version becomes a registry
# path. pydantic's (Rust) `$` matches only at the very end; Python code uses re.fullmatch.
SEMVER_PATTERN = (
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$"
)
SHA256_PATTERN = r"^[0-9a-f]{64}$"
Task = Literal["causal-lm", "text-embedding", "sequence-classification", "generic"]

# Dims every task needs; the KV-cache graph adds `past_sequence` (total = past + sequence).
TASK_DIMS: dict[str, tuple[str, ...]] = {
    "causal-lm": ("batch", "sequence", "past_sequence"),
    "text-embedding": ("batch", "sequence"),
    "sequence-classification": ("batch", "sequence"),
    "generic": (),
}


# Every string of a spec is capped (a megabyte of free text is a mistake or an attack);
# longer prose fields say so with their own max_length.
MAX_STR = 1024
MAX_PROSE = 8192
# PEP 508 distribution names.
PACKAGE_NAME = r"^([A-Za-z0-9]|[A-Za-z0-9][A-Za-z0-9._-]*[A-Za-z0-9])$"
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


def _repo_relative(value: str) -> str:
    """Syntactic half of the path rule (the loader resolves symlinks against the repo)."""
    if "\0" in value or "\\" in value:
        raise ValueError(f"{value[:80]!r}: NUL bytes and backslashes are not allowed in paths")
    if value.startswith(("/", "~")) or re.match(r"^[A-Za-z]:", value):
        raise ValueError(f"{value[:80]!r} is absolute; give a path relative to the repo root")
    normal = posixpath.normpath(value)
    if normal == "." or normal == ".." or normal.startswith("../"):
        raise ValueError(
            f"{value[:80]!r} {'is the repo root itself' if normal == '.' else 'leaves the repo'}; "
            "give a path inside the repository (e.g. models/<name>)"
        )
    return value


# A path in the repository: relative, and (checked by the loader) resolving inside it.
RepoPath = Annotated[
    str,
    Field(min_length=1, max_length=MAX_STR, json_schema_extra={"x-repo-path": True}),
    AfterValidator(_repo_relative),
]


def _specifier(value: str) -> str:
    try:
        SpecifierSet(value)
    except InvalidSpecifier:
        raise ValueError(
            f"{value[:80]!r} is not a PEP 440 version specifier; write e.g. `==2.13.0` or "
            "`>=3.11,<3.12`"
        ) from None
    if not value.strip():
        raise ValueError("an empty specifier pins nothing; write e.g. `==2.13.0`")
    return value


Specifier = Annotated[str, Field(max_length=256), AfterValidator(_specifier)]
PackageName = Annotated[str, Field(pattern=PACKAGE_NAME, max_length=128)]


def _inside_model_folder(value: str) -> str:
    _repo_relative(value)
    return value


CheckpointName = Annotated[str, Field(max_length=MAX_STR), AfterValidator(_inside_model_folder)]


def _semver(value: str) -> str:
    if not re.fullmatch(SEMVER_PATTERN, value):
        shown = value if len(value) <= 40 else value[:39] + "…"
        raise ValueError(
            f"{shown!r} is not a Semantic Versioning 2.0 version; write MAJOR.MINOR.PATCH, "
            "e.g. 1.0.0 or 1.1.0-rc.1 (it names the registry folder, so nothing else)"
        )
    return value


def _positive_bytes(value: ByteSize) -> ByteSize:
    if value <= 0:
        raise ValueError(f"must be more than 0 bytes (found {int(value)}); write e.g. `24GiB`")
    return value


PositiveBytes = Annotated[ByteSize, AfterValidator(_positive_bytes)]


class Strict(BaseModel):
    # .inf and .nan are valid YAML floats; no limit, tolerance or size of ours means either.
    model_config = ConfigDict(
        extra="forbid", frozen=True, str_max_length=MAX_STR, allow_inf_nan=False
    )


# ----------------------------------------------------------------------------- model
class HfModel(Strict):
    kind: Literal["hf"] = Field(description="A local Hugging Face folder.")
    path: RepoPath = Field(
        description="Folder with config.json and *.safetensors, relative to the repo root."
    )


class PythonModel(Strict):
    kind: Literal["python"] = Field(description="A model built by a Python factory.")
    entrypoint: str = Field(
        pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
        description="`module:factory`; the factory takes no arguments and returns an nn.Module.",
    )
    source: RepoPath = Field(
        description="File or folder holding the module, put on sys.path (a DVC dependency)."
    )
    weights: RepoPath | None = Field(
        default=None, description="Optional safetensors state dict loaded into the module."
    )


ModelSource = Annotated[HfModel | PythonModel, Field(discriminator="kind")]


# ----------------------------------------------------------------------------- pins
class PinsConfig(Strict):
    python: Specifier | None = Field(default=None, description="PEP 440 specifier for Python.")
    packages: dict[PackageName, Specifier] = Field(
        default_factory=dict,
        description="Package name -> PEP 440 specifier, e.g. `torch: ==2.13.0`.",
    )
    checkpoints: dict[CheckpointName, Annotated[str, Field(pattern=SHA256_PATTERN)]] = Field(
        default_factory=dict,
        description="Checkpoint file (relative to the model folder) -> expected sha256. "
        "When given, every weight file must be listed.",
    )
    require_clean_git: bool = Field(
        default=False, description="Fail when the code has uncommitted changes."
    )


# ----------------------------------------------------------------------------- export
class DimRange(Strict):
    min: int = Field(ge=0, description="Smallest size the deployed graph must accept.")
    opt: int = Field(ge=0, description="Typical size; the trace and TensorRT opt shape.")
    max: int = Field(ge=1, description="Largest size the deployed graph must accept.")

    @model_validator(mode="after")
    def _ordered(self) -> DimRange:
        """Rule: min <= opt <= max for every dim range."""
        if not self.min <= self.opt <= self.max:
            raise ValueError(
                f"need min <= opt <= max, found min={self.min}, opt={self.opt}, max={self.max}"
            )
        return self


class TensorSpec(Strict):
    name: str = Field(description="Graph input name.")
    dtype: Literal["float32", "float16", "int64", "int32", "bool"] = Field(
        default="float32", description="Element type."
    )
    shape: list[int | str] = Field(
        description="Sizes: an int is static, a string names a dim from `export.dims`."
    )
    low: float = Field(default=0, description="Smallest generated value (integer inputs).")
    high: float = Field(default=1, description="Upper bound (exclusive) of generated values.")


class OutputSpec(Strict):
    name: str = Field(description="Graph output name.")
    shape: list[int | str] | None = Field(
        default=None, description="Expected sizes (ints or dim names); checked at every probe."
    )


class ExportConfig(Strict):
    exporter: Literal["legacy", "dynamo"] = Field(
        default="legacy",
        description="`legacy` = TorchScript exporter (dynamo=False), `dynamo` = torch.export.",
    )
    opset: int = Field(default=18, ge=14, le=23, description="ONNX opset version.")
    dims: dict[str, DimRange] = Field(
        description="Named dynamic dims with min/opt/max, e.g. batch, sequence, past_sequence."
    )
    inputs: list[TensorSpec] | None = Field(
        default=None,
        description="Graph inputs. Required for `generic`; derived for transformer tasks.",
    )
    outputs: list[OutputSpec] | None = Field(
        default=None, description="Outputs (generic task); derived for transformer tasks."
    )
    external_data: Literal["auto", "always", "never"] = Field(
        default="auto", description="Weights in a side file: auto = when the model is over 2 GB."
    )
    odd_sizes: bool = Field(
        default=True, description="Also run the graph at odd in-between sizes to prove dynamism."
    )


# ----------------------------------------------------------------------------- parity
class Tolerance(Strict):
    atol: float = Field(default=1e-4, ge=0, description="Absolute tolerance.")
    rtol: float = Field(default=1e-3, ge=0, description="Relative tolerance (of the reference).")


class ParityConfig(Strict):
    shapes: list[dict[str, int]] | None = Field(
        default=None,
        description="Dim assignments to compare at; default: min, opt, max and an odd size.",
    )
    tolerance: Tolerance = Field(default_factory=Tolerance, description="Default tolerance.")
    outputs: dict[str, Tolerance] = Field(
        default_factory=dict,
        description="Per-output tolerance; keys are output names or globs like `present.*`.",
    )
    statistic: Literal["max", "mean", "quantile"] = Field(
        default="max",
        description="Statistic of the normalized error |a-b| / (atol + rtol*|b|) that must "
        "stay <= 1 (max = numpy.allclose).",
    )
    quantile: float = Field(default=0.99, gt=0, lt=1, description="Quantile for `quantile`.")
    layerwise: Literal["on-failure", "always", "never"] = Field(
        default="on-failure", description="When to compare layer by layer."
    )
    seed: int = Field(default=0, description="Seed for generated inputs.")


# ----------------------------------------------------------------------------- quantization
class CalibrationData(Strict):
    path: RepoPath = Field(
        description="JSONL of texts (with `tokenizer`) or NPZ of input tensors (first axis = "
        "sample), relative to the repo root. Never replaced by random data."
    )
    tokenizer: RepoPath | None = Field(
        default=None, description="Folder with tokenizer.json; required for JSONL."
    )
    text_field: str = Field(default="text", description="JSONL key holding the text.")
    samples: int = Field(default=128, ge=1, description="Samples used to calibrate.")
    holdout: int = Field(
        default=32, ge=1, description="Further samples, never calibrated on, for the final check."
    )
    sensitivity_samples: int = Field(
        default=16, ge=1, description="Calibration samples used to rank node sensitivity."
    )
    max_length: int | None = Field(
        default=None, ge=1, description="Longest sample in tokens; default export sequence max."
    )

    @model_validator(mode="after")
    def _enough(self) -> CalibrationData:
        """Rule: sensitivity_samples <= samples; a .jsonl calibration set needs `tokenizer`; the
        path ends in .jsonl or .npz."""
        if self.sensitivity_samples > self.samples:
            raise ValueError(
                f"sensitivity_samples ({self.sensitivity_samples}) cannot exceed samples "
                f"({self.samples}); they are drawn from the calibration samples"
            )
        if self.path.endswith(".jsonl") and not self.tokenizer:
            raise ValueError("a JSONL calibration set needs `tokenizer` (a tokenizer.json folder)")
        if not self.path.endswith((".jsonl", ".npz")):
            raise ValueError(f"path {self.path!r}: use a .jsonl (texts) or .npz (tensors) file")
        return self


class AccuracyBudget(Strict):
    """Quantized vs FP32 ONNX on the same inputs; every bound given must hold."""

    top1_agreement_min: float | None = Field(
        default=None, ge=0, le=1, description="Share of positions with the same argmax."
    )
    logit_cosine_min: float | None = Field(
        default=None, ge=-1, le=1, description="Mean cosine similarity of output vectors."
    )
    snr_db_min: float | None = Field(
        default=None, description="Signal-to-noise ratio of the outputs, in dB."
    )
    perplexity_increase_max: float | None = Field(
        default=None, ge=0, description="Relative perplexity increase (0.01 = +1 %); causal-lm."
    )

    @model_validator(mode="after")
    def _some(self) -> AccuracyBudget:
        """Rule: An accuracy budget gives at least one bound."""
        if all(v is None for v in self.model_dump().values()):
            raise ValueError("give at least one bound, e.g. `top1_agreement_min: 0.99`")
        return self


class QuantizedBase(Strict):
    calibration: CalibrationData = Field(description="Real input samples (never random).")
    budget: AccuracyBudget = Field(description="Accuracy the quantized model must keep.")
    max_float_nodes: int = Field(
        default=8, ge=0, description="Cap on nodes mixed precision may keep in float."
    )
    op_types: list[str] = Field(
        default_factory=lambda: ["MatMul", "Gemm"],
        description="Op types to quantize (MatMul/Gemm measured faster and closer on CPU).",
    )


class NoQuantization(Strict):
    method: Literal["none"] = Field(description="Ship the FP32 model.")


class Int8Dynamic(QuantizedBase):
    method: Literal["int8-dynamic"] = Field(description="Weights INT8, activations at run time.")
    per_channel: bool = Field(default=False, description="Per-output-channel weight scales.")


class Int8Static(QuantizedBase):
    method: Literal["int8-static"] = Field(description="QDQ with calibrated activation ranges.")
    per_channel: bool = Field(default=True, description="Per-output-channel weight scales.")
    calibrate_method: Literal["minmax", "entropy", "percentile"] = Field(
        default="minmax", description="How activation ranges are chosen."
    )
    percentile: float = Field(
        default=99.999, gt=90, le=100, description="Percentile for `percentile` calibration."
    )


class Int4WeightOnly(QuantizedBase):
    method: Literal["int4-weight-only"] = Field(description="Block-wise 4-bit MatMul weights.")
    block_size: int = Field(default=32, ge=16, description="Weights per scale (power of 2).")
    symmetric: bool = Field(default=True, description="Symmetric (no zero point) blocks.")
    op_types: list[str] = Field(
        default_factory=lambda: ["MatMul"], description="Only MatMul (MatMulNBits)."
    )

    @model_validator(mode="after")
    def _power_of_two(self) -> Int4WeightOnly:
        """Rule: int4 block_size is a power of 2."""
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size {self.block_size} must be a power of 2 (16, 32, 64…)")
        return self


Quantization = Annotated[
    NoQuantization | Int8Dynamic | Int8Static | Int4WeightOnly, Field(discriminator="method")
]


# ----------------------------------------------------------------------------- evaluation
# Metrics the evaluate stage computes, per task; thresholds may only name these.
TASK_METRICS: dict[str, tuple[str, ...]] = {
    "causal-lm": (
        "perplexity",
        "perplexity_reference",
        "top1_agreement",
        "greedy_exact_match",
        "greedy_token_match",
    ),
    "text-embedding": ("cosine_to_reference",),
    "sequence-classification": ("agreement",),
    "generic": ("cosine_to_reference", "snr_db"),
}


class EvalData(Strict):
    path: RepoPath = Field(
        description="JSONL of texts (or NPZ of inputs), relative to the repo root."
    )
    tokenizer: RepoPath | None = Field(
        default=None, description="Folder with tokenizer.json (JSONL)."
    )
    text_field: str = Field(default="text", description="JSONL key holding the text.")
    samples: int = Field(default=64, ge=1, description="Samples to evaluate.")


class DecodeConfig(Strict):
    prompts: int = Field(default=8, ge=1, description="Prompts to decode greedily (causal-lm).")
    prompt_tokens: int = Field(default=8, ge=1, description="Tokens of each prompt fed first.")
    tokens: int = Field(default=16, ge=1, description="Tokens generated per prompt.")


class MetricThreshold(Strict):
    """MLflow MetricThreshold semantics, with a named baseline."""

    metric: str = Field(description="Metric name (see TASK_METRICS for the task).")
    threshold: float | None = Field(
        default=None, description="Absolute bound: >= when higher is better, else <=."
    )
    min_absolute_change: float | None = Field(
        default=None,
        description="Candidate must beat the baseline by this much (negative = allowed loss).",
    )
    min_relative_change: float | None = Field(
        default=None, description="Same, as a fraction of the baseline (0.01 = 1 %)."
    )
    greater_is_better: bool = Field(description="Direction of the metric.")
    baseline: Literal["reference", "production"] = Field(
        default="production",
        description="What the change is measured against: the PyTorch FP32 reference on the "
        "same inputs, or the release in the registry's production channel.",
    )

    @model_validator(mode="after")
    def _something(self) -> MetricThreshold:
        """Rule: A threshold gives threshold, min_absolute_change or min_relative_change."""
        if (self.threshold, self.min_absolute_change, self.min_relative_change) == (None,) * 3:
            raise ValueError("give threshold, min_absolute_change or min_relative_change")
        return self


class EvaluationConfig(Strict):
    dataset: EvalData = Field(description="The evaluation set (never the calibration set).")
    decode: DecodeConfig = Field(default_factory=DecodeConfig, description="Greedy decoding.")
    thresholds: list[MetricThreshold] = Field(
        default_factory=list, description="Gates on the metrics; all must hold."
    )


# ----------------------------------------------------------------------------- capacity
KV_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "int8": 1}


class CapacityConfig(Strict):
    """The device the release must fit, for the plan stage's memory budget."""

    device_memory: PositiveBytes = Field(
        description="Memory of one device, e.g. `24GiB` or `80GB`."
    )
    headroom: float = Field(
        default=0.85, gt=0, le=1, description="Fraction of device memory the plan may use."
    )
    max_context: int | None = Field(
        default=None, ge=1, description="Tokens per sequence; default the export's maximum."
    )
    max_batch: int | None = Field(
        default=None, ge=1, description="Sequences at once; default export.dims.batch.max."
    )
    kv_dtype: Literal["float32", "float16", "bfloat16", "fp8", "int8"] = Field(
        default="float32", description="Element type of the KV cache."
    )
    runtime_overhead: ByteSize = Field(
        default=ByteSize(256 << 20), description="Runtime, allocator and workspace reserve."
    )


# ----------------------------------------------------------------------------- bundle
class ServingConfig(Strict):
    port: int = Field(
        default=8000,
        ge=1,
        le=65535 - max(DERIVED_PORTS.values()),
        description="HTTP port; MLServer's gRPC and metrics ports are port+1 and port+2.",
    )
    max_batch_size: int | None = Field(
        default=None, ge=1, description="Default: the export's batch max; may not exceed it."
    )
    max_queue_depth: int = Field(default=64, ge=1, description="Requests queued before 503.")
    max_context_length: int | None = Field(
        default=None, ge=1, description="Default: the export's largest total sequence."
    )
    kv_cache_budget: int | None = Field(
        default=None, ge=0, description="Bytes for KV cache; default: computed for the extreme."
    )
    request_timeout_seconds: float = Field(default=30.0, gt=0, description="Per-request timeout.")
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


# ----------------------------------------------------------------------------- engine
class EngineProfile(Strict):
    name: str = Field(pattern=r"^[a-z0-9_-]+$", description="e.g. prefill or decode.")
    dims: dict[str, DimRange] = Field(
        default_factory=dict,
        description="min/opt/max per named dim; a dim left out takes the export's range.",
    )


class CudaGraphs(Strict):
    enabled: bool = Field(default=True, description="Capture and replay each decode step.")
    batch_sizes: list[Annotated[int, Field(ge=1)]] = Field(
        default_factory=lambda: [1], description="Batch sizes to capture; inside a profile."
    )


class EngineConfig(Strict):
    """A TensorRT engine built from the (quantized) ONNX; strongly typed, so INT8 comes from
    the graph's Q/DQ nodes, never from builder flags or a calibrator."""

    backend: Literal["tensorrt", "none"] = Field(
        default="tensorrt", description="`none` builds no engine (the stage is skipped)."
    )
    required: bool = Field(
        default=False, description="Fail, rather than skip, where TensorRT or a GPU is missing."
    )
    profiles: list[EngineProfile] = Field(
        default_factory=lambda: [EngineProfile(name="default")],
        min_length=1,
        description="Optimization profiles; one spanning the export's ranges by default.",
    )
    workspace: PositiveBytes = Field(default=ByteSize(4 << 30), description="Workspace pool limit.")
    optimization_level: int = Field(default=3, ge=0, le=5, description="Builder level 0-5.")
    timing_cache: RepoPath | None = Field(
        default=None, description="Timing-cache file reused across builds (repo-relative)."
    )
    hardware_compatibility: Literal["none", "ampere_plus", "same_compute_capability"] = Field(
        default="none", description="TensorRT HardwareCompatibilityLevel."
    )
    version_compatible: bool = Field(default=False, description="BuilderFlag.VERSION_COMPATIBLE.")
    cuda_graphs: CudaGraphs = Field(default_factory=CudaGraphs, description="CUDA Graphs.")
    parity: Tolerance | None = Field(
        default=None, description="TensorRT vs ONNX Runtime tolerance; default parity.tolerance."
    )


# ----------------------------------------------------------------------------- loadtest
class LoadTarget(Strict):
    url: str = Field(
        pattern=r"^https?://[^/\s]+$",
        description="Base URL of an Open Inference Protocol (KServe V2) server, no path.",
    )
    model: str | None = Field(default=None, description="Model name there; default the release.")


class LoadGrid(Strict):
    batch_sizes: list[Annotated[int, Field(ge=1)]] = Field(
        default_factory=lambda: [1, 4, 8, 16, 32],
        min_length=1,
        description="Batch sizes; values beyond export.dims.batch.max are trimmed to it.",
    )
    input_lengths: list[Annotated[int, Field(ge=1)]] = Field(
        default_factory=lambda: [128, 512, 1024, 2048],
        min_length=1,
        description="Input lengths; values beyond export.dims.sequence.max are trimmed to it.",
    )
    requests: int = Field(default=8, ge=1, le=10_000, description="Requests per grid point.")


class LoadRamp(Strict):
    max_concurrency: int = Field(default=32, ge=1, le=4096, description="Cap of the ramp.")
    window_seconds: float = Field(default=2.0, gt=0, description="One measurement window.")
    max_windows: int = Field(
        default=10, ge=3, le=100, description="Windows per point before it is inconclusive."
    )
    stability: float = Field(
        default=0.10, gt=0, lt=1, description="Last 3 windows must agree within this fraction."
    )
    knee_gain: float = Field(
        default=0.05, ge=0, description="A step gaining less throughput than this is flat."
    )
    knee_patience: int = Field(default=4, ge=1, description="Flat steps before the ramp stops.")
    input_length: int = Field(default=32, ge=1, description="Input tokens (or rows) per request.")
    output_tokens: int = Field(
        default=16, ge=1, description="causal-lm: tokens generated per request (streamed)."
    )


class LoadSoak(Strict):
    seconds: float = Field(default=10.0, ge=0, description="Soak length; 0 skips the soak.")
    concurrency: int | None = Field(default=None, ge=1, description="Default: the knee.")
    max_growth_mb_per_min: float = Field(
        default=50.0, gt=0, description="Steady RSS growth of the server above this fails."
    )


class LoadSlo(Strict):
    """Service-level objectives; each unset one is not checked. Latencies at the knee."""

    p95_latency_ms: float | None = Field(default=None, gt=0, description="End-to-end p95.")
    p95_ttft_ms: float | None = Field(default=None, gt=0, description="causal-lm: first token.")
    p95_itl_ms: float | None = Field(
        default=None, gt=0, description="causal-lm: p95 inter-token (per-token) latency."
    )
    min_throughput_rps: float | None = Field(default=None, gt=0, description="Requests/s.")
    min_tokens_per_s: float | None = Field(default=None, gt=0, description="Output tokens/s.")
    max_memory_fraction: float | None = Field(
        default=None, gt=0, le=1, description="Server peak RSS / capacity.device_memory."
    )


class LoadTestConfig(Strict):
    target: LoadTarget | None = Field(
        default=None, description="An external V2 endpoint instead of the bundle's own server."
    )
    grid: LoadGrid = Field(default_factory=LoadGrid, description="Batch x input-length grid.")
    ramp: LoadRamp = Field(default_factory=LoadRamp, description="Closed-loop concurrency ramp.")
    soak: LoadSoak = Field(default_factory=LoadSoak, description="Memory-growth soak.")
    slo: LoadSlo = Field(default_factory=LoadSlo, description="Gates on the measured numbers.")
    batching_comparison: bool = Field(
        default=True, description="Measure dynamic batching on vs off at the knee."
    )
    startup_seconds: float = Field(default=120.0, gt=0, description="Server start timeout.")
    request_timeout_seconds: float = Field(
        default=60.0, gt=0, description="One request's timeout; a timeout counts as an error."
    )


# ----------------------------------------------------------------------------- release
class ReleaseSpec(Strict):
    """One model release: what to build, how to check it, and what to ship.

    Every section is required, even when its defaults suffice (`parity: {}`): each is a DVC
    param of some stage, and DVC refuses a params key that is absent from the file.
    """

    schema_version: Literal[1] = Field(description="Spec format version; currently 1.")
    name: str = Field(pattern=NAME_PATTERN, description="Release name; equals the file stem.")
    version: Annotated[str, AfterValidator(_semver)] = Field(
        max_length=128,
        json_schema_extra={"pattern": SEMVER_PATTERN},
        description="Model version, Semantic Versioning 2.0 (e.g. 1.0.0 or 1.1.0-rc.1).",
    )
    task: Task = Field(description="What the model does; decides inputs, outputs and metrics.")
    model: ModelSource = Field(description="Where the model comes from (discriminated on kind).")
    pins: PinsConfig = Field(description="Versions and digests (`pins: {}` for none).")
    export: ExportConfig = Field(description="ONNX export settings and dynamic dims.")
    parity: ParityConfig = Field(description="PyTorch vs ONNX (`parity: {}` for defaults).")
    quantization: Quantization = Field(
        description="Post-training quantization (`quantization: {method: none}` for FP32)."
    )
    evaluation: EvaluationConfig = Field(description="Task metrics and regression thresholds.")
    capacity: CapacityConfig = Field(description="The device the release must fit.")
    bundle: BundleConfig = Field(description="What ships (`bundle: {}` for defaults).")
    engine: EngineConfig = Field(description="TensorRT engine (`engine: {}` for defaults).")
    loadtest: LoadTestConfig = Field(description="Load test (`loadtest: {}` for defaults).")

    @model_validator(mode="after")
    def _task_needs(self) -> ReleaseSpec:
        """Rule: The task's dims are in export.dims (causal-lm: batch, sequence, past_sequence);
        generic and python models declare export.inputs; every shape names declared dims;
        parity.shapes lie inside export.dims."""
        missing = [d for d in TASK_DIMS[self.task] if d not in self.export.dims]
        if missing:
            raise ValueError(
                f"task {self.task!r} needs export.dims {', '.join(missing)}; add e.g. "
                f"`{missing[0]}: {{min: 1, opt: 8, max: 64}}` under export.dims"
            )
        if self.task == "generic" and not self.export.inputs:
            raise ValueError("task 'generic' needs export.inputs (name, dtype, shape per input)")
        if self.task != "generic" and self.model.kind == "python" and not self.export.inputs:
            raise ValueError(
                f"model.kind 'python' with task {self.task!r} needs export.inputs; "
                "only Hugging Face models have derived inputs"
            )
        tensors: list[TensorSpec | OutputSpec] = [
            *(self.export.inputs or []),
            *(self.export.outputs or []),
        ]
        for spec in tensors:
            sizes = spec.shape or []
            unknown = [d for d in sizes if isinstance(d, str) and d not in self.export.dims]
            if unknown:
                raise ValueError(
                    f"export {spec.name!r} uses dims {unknown} that export.dims "
                    f"does not declare (declared: {sorted(self.export.dims)})"
                )
        self._check_quantization()
        self._check_evaluation()
        self._check_loadtest()
        self._check_engine()
        self._check_serving()
        for i, shape in enumerate(self.parity.shapes or []):
            bad = {k: v for k, v in shape.items() if k not in self.export.dims}
            if bad:
                raise ValueError(f"parity.shapes[{i}] names undeclared dims {sorted(bad)}")
            out = {
                k: v
                for k, v in shape.items()
                if not self.export.dims[k].min <= v <= self.export.dims[k].max
            }
            if out:
                raise ValueError(
                    f"parity.shapes[{i}] {out} lies outside the export.dims ranges; "
                    "the graph is only promised to run inside them"
                )
        return self

    def _check_quantization(self) -> None:
        """Rule: perplexity_increase_max only for causal-lm; calibration.max_length <=
        export.dims.sequence.max."""
        q = self.quantization
        if q.method == "none":
            return
        if q.budget.perplexity_increase_max is not None and self.task != "causal-lm":
            raise ValueError(
                "quantization.budget.perplexity_increase_max only applies to task causal-lm; "
                "use snr_db_min or logit_cosine_min"
            )
        seq = self.export.dims.get("sequence")
        if seq and q.calibration.max_length and q.calibration.max_length > seq.max:
            raise ValueError(
                f"quantization.calibration.max_length {q.calibration.max_length} exceeds "
                f"export.dims.sequence.max {seq.max}; the graph is not promised to run there"
            )

    def _check_evaluation(self) -> None:
        """Rule: Thresholds name metrics the task computes; causal-lm decode prompt_tokens + tokens
        - 1 <= past_sequence.max."""
        known = TASK_METRICS[self.task]
        for i, t in enumerate(self.evaluation.thresholds):
            if t.metric not in known:
                raise ValueError(
                    f"evaluation.thresholds[{i}] names unknown metric {t.metric!r} for task "
                    f"{self.task!r}; known: {', '.join(known)}"
                )
        d, dims = self.evaluation.decode, self.export.dims
        if self.task == "causal-lm" and d.prompt_tokens + d.tokens - 1 > dims["past_sequence"].max:
            raise ValueError(
                f"evaluation.decode prompt_tokens + tokens - 1 = {d.prompt_tokens + d.tokens - 1}"
                f" exceeds export.dims.past_sequence.max {dims['past_sequence'].max}"
            )

    def _check_loadtest(self) -> None:
        """Rule: causal-lm ramp input_length + output_tokens - 1 <= min(sequence.max,
        past_sequence.max)."""
        r, dims = self.loadtest.ramp, self.export.dims
        if self.task == "causal-lm" and r.input_length + r.output_tokens - 1 > min(
            dims["sequence"].max, dims["past_sequence"].max
        ):
            raise ValueError(
                f"loadtest.ramp input_length + output_tokens - 1 = "
                f"{r.input_length + r.output_tokens - 1} exceeds the export's sequence or "
                "past_sequence max; lower them or widen export.dims"
            )
        s = self.bundle.serving
        if s.preferred_batch_sizes and s.max_batch_size:
            over = [b for b in s.preferred_batch_sizes if b > s.max_batch_size]
            if over:
                raise ValueError(
                    f"bundle.serving.preferred_batch_sizes {over} exceed max_batch_size "
                    f"{s.max_batch_size}"
                )

    def _check_serving(self) -> None:
        """Rule: bundle.serving.max_batch_size <= export.dims.batch.max; each preferred batch size
        <= the served max."""
        s, dims = self.bundle.serving, self.export.dims
        batch_max = dims["batch"].max if "batch" in dims else None
        if s.max_batch_size is not None and batch_max is not None and s.max_batch_size > batch_max:
            raise ValueError(
                f"bundle.serving.max_batch_size: {s.max_batch_size} exceeds "
                f"export.dims.batch.max ({batch_max}); the exported graph is not promised to "
                "run beyond it: lower max_batch_size or raise the export's batch max"
            )
        served = s.max_batch_size or batch_max
        for size in s.preferred_batch_sizes or []:
            if served is not None and size > served:
                raise ValueError(
                    f"bundle.serving.preferred_batch_sizes: {size} is beyond the served "
                    f"max_batch_size {served}; each preferred size must be <= it"
                )

    def _check_engine(self) -> None:
        """Rule: Engine profile names are unique; profile dims are declared and inside the export's
        ranges; CUDA-graph batch sizes fall inside some profile's batch range and within the
        served max_batch_size."""
        dims = self.export.dims
        names = [p.name for p in self.engine.profiles]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(
                f"engine.profiles names {repeated} more than once; profile names must be "
                "unique (Triton and the engine report refer to profiles by name)"
            )
        for i, p in enumerate(self.engine.profiles):
            for name, r in p.dims.items():
                where = f"engine.profiles[{i}] ({p.name}) dim {name!r}"
                if name not in dims:
                    raise ValueError(f"{where} is not in export.dims ({sorted(dims)})")
                if r.min < dims[name].min or r.max > dims[name].max:
                    raise ValueError(
                        f"{where} [{r.min}, {r.max}] lies outside the export's "
                        f"[{dims[name].min}, {dims[name].max}]"
                    )
        g = self.engine.cuda_graphs
        served = self.bundle.serving.max_batch_size
        if g.enabled and served is not None:
            beyond = [b for b in g.batch_sizes if b > served]
            if beyond:
                raise ValueError(
                    f"engine.cuda_graphs.batch_sizes {beyond} exceed bundle.serving."
                    f"max_batch_size {served}; a graph for a batch never served is wasted "
                    "memory: drop them or raise max_batch_size"
                )
        if g.enabled and "batch" in dims:
            for b in g.batch_sizes:
                ranges = [p.dims.get("batch", dims["batch"]) for p in self.engine.profiles]
                if not any(r.min <= b <= r.max for r in ranges):
                    raise ValueError(
                        f"engine.cuda_graphs.batch_sizes has {b}, outside every profile's "
                        "batch range"
                    )
