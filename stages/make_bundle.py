"""bundle: model + manifest + reports + model card + serving configs, all hashed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from schemas import ReleaseSpec
from stages import write_manifest as wm
from stages._hashing import hash_shards
from stages._runtime import (
    StageContext,
    StageIO,
    StageResult,
    link_or_copy,
    read_report,
    write_json,
)

NAME = "bundle"
TEMPLATES = Path(__file__).parent / "templates"
RENDERED = {"MODEL_CARD.md": "MODEL_CARD.md.j2"}


def io(release: ReleaseSpec) -> StageIO:
    return StageIO(
        params=("version", "task", "bundle"),
        upstream=(*wm.CHECKED, "manifest"),
        code=(
            "stages/write_manifest.py",
            "stages/_hashing.py",
            "stages/render_serving.py",
            "stages/templates/MODEL_CARD.md.j2",
        ),
    )


def run(ctx: StageContext, release: Any) -> StageResult:
    manifest = wm.load_manifest(ctx.upstream("manifest") / "manifest.json")
    for name, source in wm.payload(ctx).items():
        link_or_copy(source, ctx.work / name)
    info = json.loads((ctx.work / "model/model_info.json").read_text())
    info["dtype"] = json.loads((ctx.work / "model/quant_info.json").read_text())["dtype"]
    values = read_report(ctx.upstream("serve")).details["serving"]
    loadtest = read_report(ctx.upstream("loadtest")).details
    rendered = render(ctx, release, info, values | {"loadtest": loadtest}, manifest)
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


def render(
    ctx: StageContext, release: Any, info: dict[str, Any], values: dict[str, Any], manifest: Any
) -> list[str]:
    from stages.render_serving import render as render_templates

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
    render_templates(ctx.work, RENDERED, context, trim=False)
    return list(RENDERED)
