"""serve: serving configs rendered from templates, parsed back and checked against the plan.

Outputs, laid out as they sit in the bundle:
- `serving.yaml` and `ort_session.json`: the generic server config;
- `serving/triton/<release>/config.pbtxt`: a Triton model repository entry (onnxruntime
  backend; the bundle adds `1/model.onnx`), parsed back with Triton's own protobuf;
- `serving/mlserver/`: `settings.json` and `<release>/model-settings.json` plus the
  `shipyard_runtime.py` that serves the model over the Open Inference Protocol.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from schemas import ReleaseSpec
from schemas.artifacts import (
    CapacityPlan,
    ModelInfo,
    QuantInfo,
)
from schemas.tasks import TASKS
from stages._runtime import StageContext, StageIO, StageResult
from stages.serving import configs
from stages.serving.render import render

NAME = "serve"
RUNTIME = Path(__file__).parent / "serving" / "mlserver_runtime.py"  # ships as shipyard_runtime.py


def rendered(release: str) -> dict[str, str]:
    """Output path -> template."""
    return {
        "serving.yaml": "serving.yaml.j2",
        "ort_session.json": "ort_session.json.j2",
        f"serving/triton/{release}/config.pbtxt": "triton_config.pbtxt.j2",
        "serving/mlserver/settings.json": "mlserver_settings.json.j2",
        f"serving/mlserver/{release}/model-settings.json": "model-settings.json.j2",
    }


def io(release: ReleaseSpec) -> StageIO:
    return StageIO(
        params=("version", "task", "bundle.serving", "bundle.ort_session"),
        reads=(ModelInfo, QuantInfo, CapacityPlan),
        # the templates it renders (named once, in rendered()) and the runtime it ships
        code=(
            *sorted({f"stages/templates/{t}" for t in rendered(release.name).values()}),
            "stages/serving/mlserver_runtime.py",
        ),
    )


def run(ctx: StageContext, release: ReleaseSpec) -> StageResult:
    info, plan = ctx.read(ModelInfo), ctx.read(CapacityPlan)
    values = configs.serving_values(release, info, plan, ctx.read(QuantInfo).dtype)
    ctx.write(values)
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
        "labels": info.labels or [],
        # [low, high) per integer input: the runtime refuses other values with 400 (an id
        # past its embedding table is an ONNX Runtime error, a 500, otherwise)
        "input_bounds": {
            t.name: [int(t.low), int(t.high)]
            for t in info.inputs
            if t.low is not None and t.high is not None
        },
        "max_prompt_tokens": info.dims["sequence"].max if "sequence" in info.dims else 0,
        "max_past_tokens": info.dims["past_sequence"].max if "past_sequence" in info.dims else 0,
    }
    files = render(ctx.work, rendered(ctx.release), context)
    for path in files:
        configs.parse_back(path, info, values)
    runtime = ctx.work / "serving" / "mlserver" / ctx.release / "shipyard_runtime.py"
    shutil.copyfile(RUNTIME, runtime)
    return StageResult.passed(
        f"{len(files)} configs rendered and parsed back; max_batch_size "
        f"{values.max_batch_size}, context {values.max_context_length}",
        metrics={"max_batch_size": values.max_batch_size},
        details={"serving": values.model_dump(), "files": sorted(rendered(ctx.release))},
    )
