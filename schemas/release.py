"""ReleaseSpec: one YAML file per model release, validated strictly.

Each section lives in its own module under schemas/spec/ (so a stage depends only on the
sections it reads); this module assembles them and holds the rules that span sections.
Every name is re-exported here for `from schemas.release import ...`."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Field, model_validator

from schemas.contract import disagreements
from schemas.spec.base import (
    MAX_PROSE,
    MAX_STR,
    NAME_PATTERN,
    PACKAGE_NAME,
    SCHEMA_VERSION,
    SEMVER_PATTERN,
    SHA256_PATTERN,
    CheckpointName,
    PackageName,
    PositiveBytes,
    RepoPath,
    Specifier,
    Strict,
    _semver,
)
from schemas.spec.bundle import (
    DERIVED_PORTS,
    ORT_PROVIDERS,
    BundleConfig,
    ModelCard,
    OrtSessionConfig,
    ServingConfig,
    batch_limits,
)
from schemas.spec.capacity import KV_BYTES, CapacityConfig
from schemas.spec.engine import CudaGraphs, EngineConfig, EngineProfile
from schemas.spec.evaluation import (
    DecodeConfig,
    EvalData,
    EvaluationConfig,
    MetricThreshold,
)
from schemas.spec.export import DERIVED_DIM, DimRange, ExportConfig, OutputSpec, TensorSpec
from schemas.spec.loadtest import LoadGrid, LoadRamp, LoadSlo, LoadSoak, LoadTarget, LoadTestConfig
from schemas.spec.model import HfModel, ModelSource, PythonModel
from schemas.spec.parity import ParityConfig, Tolerance
from schemas.spec.pins import PinsConfig
from schemas.spec.quantization import (
    AccuracyBudget,
    AutoQuantization,
    CalibrationData,
    Int4WeightOnly,
    Int8Dynamic,
    Int8Static,
    Int8WeightOnly,
    NoQuantization,
    Quantization,
    QuantizedBase,
    WeightOnly,
)
from schemas.tasks import TASKS, Task

__all__ = [
    "SCHEMA_VERSION",
    "NAME_PATTERN",
    "SEMVER_PATTERN",
    "SHA256_PATTERN",
    "Task",
    "MAX_STR",
    "MAX_PROSE",
    "PACKAGE_NAME",
    "RepoPath",
    "Specifier",
    "PackageName",
    "CheckpointName",
    "PositiveBytes",
    "Strict",
    "HfModel",
    "PythonModel",
    "ModelSource",
    "PinsConfig",
    "DimRange",
    "TensorSpec",
    "OutputSpec",
    "ExportConfig",
    "Tolerance",
    "ParityConfig",
    "CalibrationData",
    "AccuracyBudget",
    "QuantizedBase",
    "NoQuantization",
    "Int8Dynamic",
    "Int8Static",
    "WeightOnly",
    "Int4WeightOnly",
    "Int8WeightOnly",
    "AutoQuantization",
    "Quantization",
    "EvalData",
    "DecodeConfig",
    "MetricThreshold",
    "EvaluationConfig",
    "KV_BYTES",
    "CapacityConfig",
    "ORT_PROVIDERS",
    "DERIVED_PORTS",
    "ServingConfig",
    "OrtSessionConfig",
    "ModelCard",
    "BundleConfig",
    "EngineProfile",
    "CudaGraphs",
    "EngineConfig",
    "LoadTarget",
    "LoadGrid",
    "LoadRamp",
    "LoadSoak",
    "LoadSlo",
    "LoadTestConfig",
    "ReleaseSpec",
]


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
        generic and python models declare export.inputs; every shape names declared dims
        (or total_sequence, derived as past_sequence + sequence and never declared);
        parity.shapes lie inside export.dims."""
        if not TASKS[self.task].pooled and (
            self.export.pooling is not None or self.export.normalize is not None
        ):
            raise ValueError(
                f"export.pooling: pooling and export.normalize apply to task text-embedding "
                f"only, not {self.task!r}; remove them"
            )
        missing = [d for d in TASKS[self.task].dims if d not in self.export.dims]
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
        if DERIVED_DIM in self.export.dims:
            raise ValueError(
                f"export.dims.{DERIVED_DIM} is derived (past_sequence + sequence), never "
                "declared; remove it from export.dims and name it in shapes as it is"
            )
        derived = {DERIVED_DIM} if {"past_sequence", "sequence"} <= set(self.export.dims) else set()
        for spec in tensors:
            sizes = spec.shape or []
            unknown = [
                d
                for d in sizes
                if isinstance(d, str) and d not in self.export.dims and d not in derived
            ]
            if unknown:
                raise ValueError(
                    f"export {spec.name!r} uses dims {unknown} that export.dims "
                    f"does not declare (declared: {sorted(self.export.dims)})"
                )
        self._check_quantization()
        self._check_evaluation()
        self._check_kv()
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
        export.dims.sequence.max; a fused graph (`graph: fused`) only for causal-lm from a
        Hugging Face checkpoint."""
        q = self.quantization
        if q.method == "none":
            return
        fused = getattr(q, "graph", "traced") == "fused" or "int4-weight-only-fused" in getattr(
            q, "recipes", []
        )
        if fused and (not TASKS[self.task].kv_cache or self.model.kind != "hf"):
            raise ValueError(
                f"quantization.graph fused (and recipe int4-weight-only-fused) rebuilds a "
                f"causal-lm decoder from a Hugging Face checkpoint; this release is task "
                f"{self.task!r}, model.kind {self.model.kind!r}: use `graph: traced` (drop "
                "the recipe)"
            )
        lm = TASKS[self.task].language_model
        if q.budget and q.budget.perplexity_increase_max is not None and not lm:
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
        """Rule: Thresholds name metrics the task computes; a threshold evaluate judges (an
        absolute bound, or a change against the reference) is no stricter than
        quantization.budget and judges only damage the budget bounds (one accuracy contract:
        schemas/contract.py); causal-lm decode prompt_tokens + tokens - 2 <= past_sequence.max
        (the past its last step reads: schemas.tasks decode_past)."""
        known = TASKS[self.task].metrics
        for i, t in enumerate(self.evaluation.thresholds):
            if t.metric not in known:
                raise ValueError(
                    f"evaluation.thresholds[{i}] names unknown metric {t.metric!r} for task "
                    f"{self.task!r}; known: {', '.join(known)}"
                )
        problems = disagreements(self.quantization, self.task, self.evaluation.thresholds)
        if problems:
            raise ValueError(problems[0])
        d, dims, task = self.evaluation.decode, self.export.dims, TASKS[self.task]
        past = task.decode_past(d.prompt_tokens, d.tokens)
        if task.kv_cache and past > dims["past_sequence"].max:
            raise ValueError(
                f"evaluation.decode prompt_tokens + tokens - 2 = {past} (the past its last "
                f"step reads) exceeds export.dims.past_sequence.max "
                f"{dims['past_sequence'].max}; lower them or widen it"
            )

    def _check_kv(self) -> None:
        """Rule: causal-lm parity.kv.past_lengths lie in [0, export.dims.past_sequence.max]; the
        KV check prefills an empty past and decodes one token a step (past_sequence.min 0,
        sequence.min 1)."""
        if not TASKS[self.task].kv_cache:
            return
        kv, dims = self.parity.kv, self.export.dims
        top = dims["past_sequence"].max
        wrong = [p for p in kv.past_lengths or [] if not 0 <= p <= top]
        if wrong:
            raise ValueError(
                f"parity.kv.past_lengths {wrong} lie outside [0, {top}] "
                "(export.dims.past_sequence); the graph is not promised to run there"
            )
        if dims["past_sequence"].min != 0 or dims["sequence"].min != 1:
            raise ValueError(
                f"export.dims: a KV-cache graph is prefilled with an empty past and decodes one "
                f"token a step: past_sequence.min must be 0 (is {dims['past_sequence'].min}) "
                f"and sequence.min 1 (is {dims['sequence'].min})"
            )

    def _check_loadtest(self) -> None:
        """Rule: causal-lm loadtest.ramp input_length + output_tokens - 2 <= past_sequence.max,
        and so for each loadtest.ramp.mix entry (the past a request's last decode step reads:
        schemas.tasks decode_past; a long prompt is prefilled in chunks)."""
        r, dims, task = self.loadtest.ramp, self.export.dims, TASKS[self.task]
        if not task.kv_cache:
            return
        top = dims["past_sequence"].max
        shapes = [("loadtest.ramp", r.input_length, r.output_tokens)] + [
            (f"loadtest.ramp.mix[{i}]", m.input_length, m.output_tokens)
            for i, m in enumerate(r.mix or [])
        ]
        for where, prompt, new in shapes:
            past = task.decode_past(prompt, new)
            if past > top:
                raise ValueError(
                    f"{where}: input_length + output_tokens - 2 = {past} (the past a request's "
                    f"last decode step reads) exceeds export.dims.past_sequence.max = {top}; "
                    "lower them or widen it"
                )

    def _check_serving(self) -> None:
        """Rule: bundle.serving.max_batch_size <= export.dims.batch.max (1 without a batch axis;
        the generation engine's rows are not capped by it);
        each preferred batch size <= the served max (schemas.spec.bundle.batch_limits, which
        the serve stage applies to the batch it chose)."""
        s, dims = self.bundle.serving, self.export.dims
        export_max = dims["batch"].max if "batch" in dims else None
        engine = TASKS[self.task].serving == "generate"
        problem, fix = batch_limits(
            s.max_batch_size, s.preferred_batch_sizes or [], export_max, engine
        )
        if problem:
            raise ValueError(f"{problem}; {fix}")

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
