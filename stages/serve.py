"""serve: serving configs rendered from templates, parsed back and checked against the plan.

Outputs, laid out as they sit in the bundle:
- `serving.yaml` and `ort_session.json`: the generic server config;
- `serving/triton/<release>/config.pbtxt`: a Triton model repository entry (onnxruntime
  backend; the bundle adds `1/model.onnx`), parsed back with Triton's own protobuf;
- for a generating task, `serving/triton/<release>-generate/`: a decoupled python-backend
  entry (`1/model.py` with `1/shipyard_engine/`) that generates with the same engine and
  reads the onnxruntime entry's model;
- `serving/mlserver/`: `settings.json` and `<release>/model-settings.json` plus the
  `shipyard_runtime.py` that serves the model (Open Inference Protocol, and the OpenAI API
  for generating and embedding tasks) and the generation engine it drives, `shipyard_engine/`;
  `shipyard_serve.py` starts it guarded (token, body cap, timeouts; front_door.py) with the
  limits of `shipyard_server.json`;
- `serving/text/`: the tokenizer files the runtime reads text with (when the model ships a
  `tokenizer.json`): `tokenizer_config.json` and `chat_template.jinja` where present.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from schemas import ReleaseSpec
from schemas.artifacts import (
    CapacityPlan,
    ModelInfo,
    QuantInfo,
)
from schemas.tasks import TASKS
from stages._contract import StageContext, StageIO, StageResult
from stages.serving import configs
from stages.serving.render import render

NAME = "serve"
RUNTIME = Path(__file__).parent / "serving" / "mlserver_runtime.py"  # ships as shipyard_runtime.py
FRONT_DOOR = Path(__file__).parent / "serving" / "front_door.py"  # ships as shipyard_serve.py
TRITON_MODEL = Path(__file__).parent / "serving" / "triton_model.py"  # ships as 1/model.py
ENGINE = Path(__file__).parent / "serving" / "engine"  # ships as shipyard_engine/
TEXT_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
TEXT_DIR = "serving/text"


def rendered(release: str, generating: bool = False) -> dict[str, str]:
    """Output path -> template."""
    out = {
        "serving.yaml": "serving.yaml.j2",
        "ort_session.json": "ort_session.json.j2",
        f"serving/triton/{release}/config.pbtxt": "triton_config.pbtxt.j2",
        "serving/mlserver/settings.json": "mlserver_settings.json.j2",
        f"serving/mlserver/{release}/model-settings.json": "model-settings.json.j2",
    }
    if generating:
        out[f"serving/triton/{generate_entry(release)}/config.pbtxt"] = (
            "triton_generate_config.pbtxt.j2"
        )
    return out


def generate_entry(release: str) -> str:
    """The Triton model that generates (python backend), beside the one-step onnxruntime one."""
    return f"{release}-generate"


def io(release: ReleaseSpec) -> StageIO:
    return StageIO(
        params=("version", "task", "model", "bundle.serving", "bundle.ort_session"),
        reads=(ModelInfo, QuantInfo, CapacityPlan),
        # the tokenizer files and generation config it ships come from the model's folder
        reads_model=True,
        # the templates it renders (named once, in rendered()) and the runtime it ships
        code=(
            *sorted({f"stages/templates/{t}" for t in rendered(release.name, True).values()}),
            "stages/serving/mlserver_runtime.py",
            "stages/serving/front_door.py",
            "stages/serving/triton_model.py",
            *sorted(f"stages/serving/engine/{p.name}" for p in ENGINE.glob("*.py")),
        ),
    )


def run(ctx: StageContext, release: ReleaseSpec) -> StageResult:
    info, plan = ctx.read(ModelInfo), ctx.read(CapacityPlan)
    values = configs.serving_values(release, info, plan, ctx.read(QuantInfo).dtype)
    ctx.write(values)
    text, generation = _text(ctx, release)
    settings = configs.runtime_settings(release, info, plan, values, text, generation)
    triton = configs.triton_values(info, values)
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
        # everything the shipped runtime reads, typed (stages/serving/engine/settings.py)
        "runtime": settings.model_dump(mode="json"),
        # the same, for the Triton generate entry: paths from its version folder
        "generate_name": generate_entry(ctx.release),
        "triton_runtime": settings.model_copy(
            update={
                "ort_session": "../../../../ort_session.json",
                "text": "../../../text" if text else None,
            }
        ).model_dump(mode="json"),
    }
    generating = settings.engine is not None
    files = render(ctx.work, rendered(ctx.release, generating), context)
    for path in files:
        configs.parse_back(path, info, values)
    mlserver = ctx.work / "serving" / "mlserver"
    shutil.copyfile(FRONT_DOOR, mlserver / "shipyard_serve.py")
    (mlserver / "shipyard_server.json").write_text(
        json.dumps(configs.front_door(values), indent=2) + "\n", encoding="utf-8"
    )
    entry = mlserver / ctx.release
    shutil.copyfile(RUNTIME, entry / "shipyard_runtime.py")
    (entry / "shipyard_engine").mkdir()
    for module in sorted(ENGINE.glob("*.py")):
        shutil.copyfile(module, entry / "shipyard_engine" / module.name)
    if generating:
        version = ctx.work / "serving" / "triton" / generate_entry(ctx.release) / "1"
        shutil.copytree(entry / "shipyard_engine", version / "shipyard_engine")
        shutil.copyfile(TRITON_MODEL, version / "model.py")
    return StageResult.passed(
        f"{len(files)} configs rendered and parsed back; max_batch_size "
        f"{values.max_batch_size}, context {values.max_context_length}",
        metrics={"max_batch_size": values.max_batch_size},
        details={
            "serving": values.model_dump(),
            "files": sorted(rendered(ctx.release, generating)),
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
    out = ctx.work / TEXT_DIR
    out.mkdir(parents=True)
    for name in TEXT_FILES:
        if (folder / name).is_file():
            shutil.copyfile(folder / name, out / name)
    # relative to serving/mlserver/<release>/model-settings.json
    return "../../text", generation if isinstance(generation, dict) else {}
