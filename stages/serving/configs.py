"""The serve stage's values and checks: serving settings from the spec and the capacity plan,
the Triton tensor entries, and parsing every rendered config back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from schemas import Refused
from schemas.artifacts import (
    CapacityPlan,
    ModelInfo,
    ServingValues,
    TensorInfo,
)
from schemas.spec.bundle import batch_limits
from schemas.tasks import TASKS
from shipyard_runtime.dtypes import TRITON_OF_NUMPY
from shipyard_runtime.front_door import Limits
from shipyard_runtime.generation.scheduler import EngineSettings
from shipyard_runtime.generation.text import eos_ids, sampling_defaults
from shipyard_runtime.settings import BatchingSettings, RuntimeSettings
from stages.bundling import layout
from stages.onnx import shapes as sh
from stages.rendering.render import parse_triton

if TYPE_CHECKING:
    from schemas import ReleaseSpec


def serving_values(
    release: ReleaseSpec, info: ModelInfo, plan: CapacityPlan, dtype: str
) -> ServingValues:
    """Serving keys from the spec, defaulted from the capacity plan and checked against it
    and against the export's ranges; `dtype` is the served model's (the quantize stage's)."""
    s, dims = release.bundle.serving, info.dims
    export_max = dims["batch"].max if "batch" in dims else None
    batch_max = export_max or 1
    context = s.max_context_length or plan.context
    # the generation engine: rows sized with its KV budget by the plan (stages/plan.py
    # _engine_rows), not capped by the export's probe batch; a one-pass model: what fits
    engine = TASKS[release.task].serving == "generate" and bool(plan.kv_budget_tokens)
    if engine:
        fits = plan.max_batch_that_fits
        batch = s.max_batch_size or plan.batch
    else:
        fits = plan.max_batch_that_fits if context == plan.context else batch_max
        batch = s.max_batch_size or max(1, min(batch_max, plan.batch, fits))
    # the spec's rule (checked at validate) on the batch chosen here from the plan
    problem, fix = batch_limits(batch, s.preferred_batch_sizes or [], export_max, engine)
    if problem:
        raise Refused(problem, fix)
    _within(
        "bundle.serving.max_batch_size",
        batch,
        fits,
        f"the largest batch the capacity plan fits at {context} tokens",
    )
    if plan.context:
        _within(
            "bundle.serving.max_context_length",
            context,
            plan.context,
            "the plan's context (capacity.max_context or the export's maximum)",
        )
    # every row's cache at the served context (never more than the plan's cached tokens)
    tokens = min(context, plan.cached_tokens) if plan.cached_tokens else context
    if engine:  # the plan's budget, no more than every row at the served context
        kv_bytes = plan.kv_bytes_per_token * min(plan.kv_budget_tokens, tokens * batch)
        # what the device leaves for the cache (held as many times as the plan's engine
        # holds it) beside these rows
        room = (
            plan.usable_bytes
            - plan.extreme.weights
            - plan.extreme.overhead
            - plan.extreme.activations
            - plan.kv_prefill_bytes
            - plan.activation_bytes_per_sequence * (batch - plan.batch)
        ) // plan.kv_copies
        source = (
            f"the device memory the plan leaves the cache (held {plan.kv_copies}x) after "
            "weights, overhead and activations"
        )
    else:
        kv_bytes = (
            plan.kv_bytes_per_token * tokens * batch
            if plan.kv_bytes_per_token
            else plan.kv_bytes_per_sequence * context // max(plan.context, 1) * batch
        )
        room = plan.usable_bytes - plan.extreme.weights - plan.extreme.overhead
        source = "the device memory the plan leaves after weights and overhead"
    kv_budget = kv_bytes if s.kv_cache_budget is None else s.kv_cache_budget
    _within("bundle.serving.kv_cache_budget", kv_budget, room, source)
    generates = TASKS[release.task].serving == "generate"
    return ServingValues(
        model_path=layout.at(layout.MODEL_FILE, release.name),
        dtype=dtype,
        port=s.port,
        max_batch_size=batch,
        max_queue_depth=s.max_queue_depth,
        max_context_length=context,
        kv_cache_budget=kv_budget,
        request_timeout_seconds=s.request_timeout_seconds,
        max_request_bytes=s.max_request_bytes,
        read_timeout_seconds=s.read_timeout_seconds,
        idle_timeout_seconds=s.idle_timeout_seconds,
        max_connections=s.max_connections,
        metrics_auth=s.metrics_auth,
        streaming=generates if s.streaming is None else s.streaming,
        dynamic_batching=s.dynamic_batching,
        max_queue_delay_microseconds=s.max_queue_delay_microseconds,
        preferred_batch_sizes=s.preferred_batch_sizes or [],
        instance_count=s.instance_count,
        instance_kind=s.instance_kind,
        warmup=s.warmup,
        scheduling=s.scheduling,
        prefix_caching=s.prefix_caching,
        max_wait_ms=s.max_wait_ms,
    )


def runtime_settings(
    release: ReleaseSpec,
    info: ModelInfo,
    plan: CapacityPlan,
    values: ServingValues,
    text: str | None,
    generation: dict[str, Any],
) -> RuntimeSettings:
    """What the shipped runtime reads (parameters.extra of model-settings.json), typed."""
    task = TASKS[release.task]
    batch_rows = values.max_batch_size if "batch" in info.dims else 1
    batching = BatchingSettings(
        max_rows=batch_rows,
        enabled=values.dynamic_batching and batch_rows > 1,
        delay_s=values.max_queue_delay_microseconds / 1e6,
        instances=values.instance_count,
        max_queue=values.max_queue_depth,
        timeout_s=values.request_timeout_seconds,
    )
    engine = None
    if task.serving == "generate":
        per_token = plan.kv_bytes_per_token or max(
            1, plan.kv_bytes_per_sequence // max(plan.context, 1)
        )
        engine = EngineSettings(
            # dynamic batching off: one sequence decodes at a time
            max_rows=values.max_batch_size if values.dynamic_batching else 1,
            max_context=values.max_context_length,
            chunk=info.dims["sequence"].max,
            max_past=info.dims["past_sequence"].max,
            kv_budget_tokens=max(1, values.kv_cache_budget // per_token),
            max_queue=values.max_queue_depth,
            timeout_s=values.request_timeout_seconds,
            max_wait_s=values.max_wait_ms / 1000,
            policy=values.scheduling,  # type: ignore[arg-type]
            prefix_cache_tokens=max(1, values.kv_cache_budget // per_token)
            if values.prefix_caching
            else 0,
            eos_token_ids=eos_ids(generation),
        )
    return RuntimeSettings(
        task=release.task,
        serving=task.serving,
        labels=info.labels or [],
        input_bounds={
            t.name: (int(t.low), int(t.high))
            for t in info.inputs
            if t.low is not None and t.high is not None
        },
        max_sequence=info.dims["sequence"].max if "sequence" in info.dims else None,
        embedding_output="sentence_embedding" if task.pooled else None,
        ort_session=layout.relative(layout.MLSERVER_ENTRY, layout.ORT_SESSION, release.name),
        text=text,
        sampling_defaults=sampling_defaults(generation),
        batching=batching,
        engine=engine,
    )


def _within(field: str, value: int, limit: int, source: str) -> None:
    if value > limit:
        raise Refused(
            f"{field} = {value} exceeds {source} = {limit}; the exported "
            "graph is not promised to run beyond it",
            f"lower {field} or raise {source} and re-export",
        )


def triton_values(info: ModelInfo, values: ServingValues) -> dict[str, Any]:
    """Inputs/outputs with -1 for dynamic axes; the batch axis is implicit when batching."""
    tensors = [*info.inputs, *info.outputs]
    batched = "batch" in info.dims and all(t.axes[:1] == ["batch"] for t in tensors)
    opt = sh.corners(info.dims, ("opt",))["opt"]

    def entry(t: TensorInfo, warm: bool = False) -> dict[str, Any]:
        axes = t.axes[1:] if batched else t.axes
        dims = [sh.axis_size(a, opt) if warm else a for a in axes]
        return {
            "name": t.name,
            "data_type": TRITON_OF_NUMPY[t.dtype],
            "dims": [d if isinstance(d, int) else -1 for d in dims],
        }

    return {
        # the raw graph's entry: at most the export's batch (the generation engine's rows
        # may be more: they are sized from its KV budget)
        "max_batch_size": (limit := min(values.max_batch_size, info.dims["batch"].max))
        if batched
        else 0,
        "preferred_batch_sizes": [b for b in values.preferred_batch_sizes if b <= limit]
        if batched
        else [],
        "inputs": [entry(t) for t in info.inputs],
        "outputs": [entry(t) for t in info.outputs],
        "warmup": [entry(t, warm=True) for t in info.inputs],
    }


def parse_back(path: Path, info: ModelInfo, values: ServingValues) -> None:
    """A rendered config must parse (and, for Triton, agree with the export and the plan)."""
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix == ".json":
            json.loads(text)
        elif path.suffix == ".yaml":
            data = yaml.safe_load(text)
            known = values.model_dump()
            wrong = {k: v for k, v in data.items() if k in known and known[k] != v}
            extra = set(data) - set(known) - {"ort_session_config"}
            if wrong or extra:
                raise ValueError(f"values do not read back as rendered: {wrong or extra}")
        elif path.suffix == ".pbtxt":
            config = parse_triton(text)
            if config.backend == "python":
                check_generate(config)
            else:
                check_triton(config, info, values)
    except (ValueError, yaml.YAMLError) as exc:
        raise Refused(
            f"rendered {path.name} is not valid: {exc}",
            "fix the template in stages/templates/ that produced it",
        ) from None


def check_generate(config: Any) -> None:
    """The generate entry is decoupled and its parameters read back as the engine's."""
    if not config.model_transaction_policy.decoupled:
        raise ValueError("the generate entry must be decoupled (one response per token)")
    parameters = {k: v.string_value for k, v in config.parameters.items()}
    if not parameters.get("model", "").endswith("/1/model.onnx"):
        raise ValueError(f"parameters.model {parameters.get('model')!r} names no model.onnx")
    settings = RuntimeSettings.model_validate_json(parameters.get("runtime", ""))
    if settings.engine is None:
        raise ValueError("parameters.runtime has no engine settings")


def check_triton(config: Any, info: ModelInfo, values: ServingValues) -> None:
    """The parsed config's batch and tensors match the export and the plan."""
    batch_max = info.dims["batch"].max if "batch" in info.dims else 0
    if config.max_batch_size > min(values.max_batch_size, batch_max or config.max_batch_size):
        raise ValueError(
            f"max_batch_size {config.max_batch_size} exceeds the plan/export limit "
            f"{values.max_batch_size}"
        )
    expected = triton_values(info, values)
    for kind, tensors in (("input", config.input), ("output", config.output)):
        want = {t["name"]: t["dims"] for t in expected[f"{kind}s"]}
        have = {t.name: list(t.dims) for t in tensors}
        if want != have:
            raise ValueError(f"{kind}s {have} differ from the export's {want} (-1 = dynamic)")
    for b in config.dynamic_batching.preferred_batch_size:
        if b > config.max_batch_size:
            raise ValueError(f"preferred_batch_size {b} > max_batch_size")


def front_door(values: ServingValues) -> Limits:
    """`serving/mlserver/shipyard_server.json`: the limits the shipped launcher enforces,
    as its own model (shipyard_runtime/front_door.py) reads them back."""
    return Limits(
        max_request_bytes=values.max_request_bytes,
        read_timeout_s=values.read_timeout_seconds,
        idle_timeout_s=values.idle_timeout_seconds,
        max_connections=values.max_connections,
        metrics_auth=values.metrics_auth,
    )
