"""serve: serving configs rendered from templates, parsed back and checked against the plan.

Outputs, laid out as they sit in the bundle:
- `serving.yaml` and `ort_session.json`: the generic server config;
- `serving/triton/<release>/config.pbtxt`: a Triton model repository entry (onnxruntime
  backend; the bundle adds `1/model.onnx`), parsed back with Triton's own protobuf;
- for a generating task, `serving/triton/<release>-generate/`: a decoupled python-backend
  entry (`1/model.py`, the runtime's Triton adapter, with `1/shipyard_runtime/`) that
  generates with the same engine and reads the onnxruntime entry's model;
- `serving/mlserver/`: `settings.json` and `<release>/model-settings.json` plus the
  runtime package `<release>/shipyard_runtime/` that serves the model (its `mlserver.py`:
  Open Inference Protocol, and the OpenAI API for generating and embedding tasks) with the
  generation engine it drives; `shipyard_serve.py` (the runtime's front door) starts it
  guarded (token, body cap, timeouts) with the limits of `shipyard_server.json`;

Every path here is a row of the bundle's layout table, stages/bundling/layout.py.
- `serving/text/`: the tokenizer files the runtime reads text with (when the model ships a
  `tokenizer.json`): `tokenizer_config.json` and `chat_template.jinja` where present.
"""

from __future__ import annotations

import json
import shutil
from typing import Any

from schemas import ReleaseSpec
from schemas.artifacts import (
    CapacityPlan,
    ModelInfo,
    QuantInfo,
)
from schemas.tasks import TASKS
from stages._contract import StageContext, StageIO, StageResult
from stages.bundling import layout
from stages.rendering.render import render
from stages.serving import configs

NAME = "serve"
TEXT_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def generate_entry(release: str) -> str:
    """The Triton model that generates (python backend), beside the one-step onnxruntime one."""
    return layout.at(layout.GENERATE_ENTRY, release).rsplit("/", 1)[1]


def io(release: ReleaseSpec) -> StageIO:
    return StageIO(
        params=("version", "task", "model", "bundle.serving", "bundle.ort_session"),
        reads=(ModelInfo, QuantInfo, CapacityPlan),
        # the tokenizer files and generation config it ships come from the model's folder
        reads_model=True,
        # the templates it renders and the runtime it ships (stages/bundling/layout.py)
        code=tuple(layout.shipped_sources()),
    )


def run(ctx: StageContext, release: ReleaseSpec) -> StageResult:
    info, plan = ctx.read(ModelInfo), ctx.read(CapacityPlan)
    values = configs.serving_values(release, info, plan, ctx.read(QuantInfo).dtype)
    ctx.write(values)
    text, generation = _text(ctx, release)
    settings = configs.runtime_settings(release, info, plan, values, text, generation)
    triton = configs.triton_values(info, values)
    gen = layout.GENERATE_VERSION
    context = {
        **values.model_dump(),
        "release": ctx.release,
        "model_name": ctx.release,
        "version": release.version,
        "task": release.task,
        "ort": release.bundle.ort_session.model_dump(),
        "triton": triton,
        # what the KV-cache graph accepts: a prompt of at most sequence.max tokens, then a
        # past of at most past_sequence.max (0 = no such dim: the runtime does not check)
        # what the runtime returns (TASKS): generated ids, labels and scores, or the tensors
        "serving_kind": TASKS[release.task].serving,
        # everything the shipped runtime reads, typed (shipyard_runtime/settings.py)
        "runtime": settings.model_dump(mode="json"),
        "implementation": layout.MLSERVER_IMPLEMENTATION,
        "model_uri": layout.relative(layout.MLSERVER_ENTRY, layout.MODEL_FILE, ctx.release),
        # the same, for the Triton generate entry: paths from its version folder
        "generate_name": generate_entry(ctx.release),
        "generate_model": layout.relative(gen, layout.MODEL_FILE, ctx.release),
        "triton_runtime": settings.model_copy(
            update={
                "ort_session": layout.relative(gen, layout.ORT_SESSION, ctx.release),
                "text": layout.relative(gen, layout.TEXT_DIR, ctx.release) if text else None,
            }
        ).model_dump(mode="json"),
    }
    generating = settings.engine is not None
    files = layout.shipped(ctx.release, generating)
    templates = layout.templates(ctx.release, generating)
    for path in render(ctx.work, templates, context):
        configs.parse_back(path, info, values)
    for f in files:
        if not f.rendered:
            (ctx.work / f.path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f.file, ctx.work / f.path)
    (ctx.work / layout.LAUNCHER_LIMITS).write_text(
        configs.front_door(values).dump(), encoding="utf-8"
    )
    return StageResult.passed(
        f"{len(templates)} configs rendered and parsed back; max_batch_size "
        f"{values.max_batch_size}, context {values.max_context_length}",
        metrics={"max_batch_size": values.max_batch_size},
        details={
            "serving": values.model_dump(),
            "files": sorted(templates),
        },
    )


def _text(ctx: StageContext, release: ReleaseSpec) -> tuple[str | None, dict[str, Any]]:
    """Copy the tokenizer files into serving/text/ (text in and out of the server) and read
    the generation config (EOS ids, sampling defaults). A model without a tokenizer.json is
    served with token ids only."""
    folder = ctx.root / release.model.path if release.model.kind == "hf" else None
    if folder is None:
        return None, {}
    gen_file = folder / "generation_config.json"
    generation = json.loads(gen_file.read_text(encoding="utf-8")) if gen_file.is_file() else {}
    if not (folder / "tokenizer.json").is_file():
        return None, generation if isinstance(generation, dict) else {}
    out = ctx.work / layout.TEXT_DIR
    out.mkdir(parents=True)
    for name in TEXT_FILES:
        if (folder / name).is_file():
            shutil.copyfile(folder / name, out / name)
    text = layout.relative(layout.MLSERVER_ENTRY, layout.TEXT_DIR, ctx.release)
    return text, generation if isinstance(generation, dict) else {}
