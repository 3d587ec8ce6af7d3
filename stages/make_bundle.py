"""bundle: model + manifest + reports + model card + serving configs, all hashed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from schemas import ReleaseSpec, StageError
from stages import write_manifest as wm
from stages._hashing import hash_shards
from stages._runtime import StageContext, StageIO, StageResult, link_or_copy, write_json

NAME = "bundle"
TEMPLATES = Path(__file__).parent / "templates"
RENDERED = {
    "serving.yaml": "serving.yaml.j2",
    "ort_session.json": "ort_session.json.j2",
    "MODEL_CARD.md": "MODEL_CARD.md.j2",
}


def io(release: ReleaseSpec) -> StageIO:
    return StageIO(
        params=("version", "task", "bundle"),
        upstream=(*wm.CHECKED, "manifest"),
        code=("stages/write_manifest.py", "stages/_hashing.py", "stages/templates"),
    )


def run(ctx: StageContext, release: Any) -> StageResult:
    manifest = wm.load_manifest(ctx.upstream("manifest") / "manifest.json")
    for name, source in wm.payload(ctx).items():
        link_or_copy(source, ctx.work / name)
    info = json.loads((ctx.work / "model/model_info.json").read_text())
    info["dtype"] = json.loads((ctx.work / "model/quant_info.json").read_text())["dtype"]
    plan = json.loads((ctx.upstream("plan") / "plan.json").read_text())
    values = serving_values(release, info, plan)
    rendered = render(ctx, release, info, values, manifest)
    for name in rendered:
        _parse_back(ctx.work / name)
    extra = hash_shards(
        {n: ctx.work / n for n in rendered}, manifest.predicate.serialization.shard_size
    )
    digests = {r.name: r.digest for r in manifest.predicate.resources} | extra
    final = wm.build_manifest(
        manifest.subject[0].name,
        digests,
        {**manifest.predicate.shipyard, "serving": values},
        manifest.predicate.serialization.shard_size,
    )
    write_json(ctx.work / "manifest.json", final.model_dump(mode="json", by_alias=True))
    files = sum(1 for p in ctx.work.rglob("*") if p.is_file())
    return StageResult.passed(
        f"{files} files in build/{ctx.release}/bundle, manifest digest "
        f"{final.subject[0].digest['sha256'][:16]}",
        metrics={"files": files},
        details={"serving": values},
    )


def serving_values(release: Any, info: dict[str, Any], plan: dict[str, Any]) -> dict[str, Any]:
    """Serving keys from the spec, defaulted from the capacity plan and checked against it
    and against the export's ranges."""
    s, dims = release.bundle.serving, info["dims"]
    batch_max = dims.get("batch", {}).get("max", 1)
    context = s.max_context_length or plan["context"]
    fits = plan["max_batch_that_fits"] if context == plan["context"] else batch_max
    batch = s.max_batch_size or max(1, min(batch_max, plan["batch"], fits))
    _within("bundle.serving.max_batch_size", batch, batch_max, "export.dims.batch.max")
    _within(
        "bundle.serving.max_batch_size",
        batch,
        fits,
        f"the largest batch the capacity plan fits at {context} tokens",
    )
    if plan["context"]:
        _within(
            "bundle.serving.max_context_length",
            context,
            plan["context"],
            "the plan's context (capacity.max_context or the export's maximum)",
        )
    kv_bytes = plan["kv_bytes_per_sequence"] * context // max(plan["context"], 1) * batch
    kv_budget = kv_bytes if s.kv_cache_budget is None else s.kv_cache_budget
    _within(
        "bundle.serving.kv_cache_budget",
        kv_budget,
        plan["usable_bytes"] - plan["extreme"]["weights"] - plan["extreme"]["overhead"],
        "the device memory the plan leaves after weights and overhead",
    )
    causal = release.task == "causal-lm"
    return {
        "model_path": "model/model.onnx",
        "dtype": info["dtype"],
        "port": s.port,
        "max_batch_size": batch,
        "max_queue_depth": s.max_queue_depth,
        "max_context_length": context,
        "kv_cache_budget": kv_budget,
        "request_timeout_seconds": s.request_timeout_seconds,
        "streaming": causal if s.streaming is None else s.streaming,
    }


def _within(field: str, value: int, limit: int, source: str) -> None:
    if value > limit:
        raise StageError(
            NAME,
            f"{field} = {value} exceeds {source} = {limit}; the exported "
            "graph is not promised to run beyond it",
            f"lower {field} or raise {source} and re-export",
        )


def render(
    ctx: StageContext, release: Any, info: dict[str, Any], values: dict[str, Any], manifest: Any
) -> list[str]:
    from jinja2 import FileSystemLoader, StrictUndefined
    from jinja2.sandbox import SandboxedEnvironment

    env = SandboxedEnvironment(
        loader=FileSystemLoader(TEMPLATES),
        undefined=StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    context = {
        **values,
        "release": ctx.release,
        "version": release.version,
        "task": release.task,
        "ort": release.bundle.ort_session.model_dump(),
        "info": info,
        "card": release.bundle.model_card.model_dump(),
        "stages": manifest.predicate.shipyard["stages"],
        "digest": manifest.subject[0].digest["sha256"],
        "quant": manifest.predicate.shipyard["quantization"],
    }
    for out, template in RENDERED.items():
        (ctx.work / out).write_text(env.get_template(template).render(context), encoding="utf-8")
    return list(RENDERED)


def _parse_back(path: Path) -> None:
    """A rendered config must parse; a template bug fails here, not in production."""
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix == ".json":
            json.loads(text)
        elif path.suffix == ".yaml":
            yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise StageError(
            NAME,
            f"rendered {path.name} does not parse: {exc}",
            f"fix stages/templates/{RENDERED[path.name]}",
        ) from None
