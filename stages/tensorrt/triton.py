"""The TensorRT Triton entry: its values, its rendered config and its file layout (the plan
inside the version folder). Used by the engine stage and the TensorRT build."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from schemas import Refused
from stages.bundling import layout
from stages.rendering.render import parse_triton, render

if TYPE_CHECKING:
    from schemas.spec.bundle import ServingConfig
    from schemas.spec.engine import CudaGraphs

TRT_TEMPLATE = "triton_trt_config.pbtxt.j2"


def triton_trt_values(
    profiles: list[dict[str, Any]],
    serving: ServingConfig,
    plan_batch: int,
    graphs: CudaGraphs,
    capability: str,
    portable: bool = False,
) -> dict[str, Any]:
    """Values for the tensorrt-backend Triton config; max_batch_size within every profile."""
    served = serving.max_batch_size or plan_batch
    batch_max = min(p["dims"].get("batch", {"max": 0})["max"] for p in profiles)
    if served > batch_max:
        raise Refused(
            f"bundle.serving.max_batch_size = {served} exceeds the engine profiles' "
            f"batch max = {batch_max}",
            "lower bundle.serving.max_batch_size or widen engine.profiles[*].dims.batch",
        )
    specs = []
    for b in graphs.batch_sizes if graphs.enabled else []:
        profile = next(
            p for p in profiles if p["dims"]["batch"]["min"] <= b <= p["dims"]["batch"]["max"]
        )
        specs.append(
            {"batch": b, "inputs": {n: s["opt"][1:] for n, s in profile["shapes"].items()}}
        )
    plan = plan_name(capability)
    return {
        "max_batch_size": served,
        "max_queue_delay_microseconds": serving.max_queue_delay_microseconds,
        "graphs": graphs.enabled,
        "graph_specs": specs,
        "cc_model_filenames": {capability: plan},
        # A hardware-compatible engine runs on other GPUs too: they fall back to it.
        "default_model_filename": plan if portable else "",
        # Every optimization profile is available to the instances (Triton picks by shape);
        # without this only profile 0 is used and the decode profile never serves.
        "profiles": [str(i) for i in range(len(profiles))],
    }


def plan_name(capability: str) -> str:
    return f"model_sm{capability.replace('.', '')}.plan"


def trt_model_dir(release: str) -> str:
    """The Triton model folder of the TensorRT entry; its plan lives in version 1."""
    return layout.at(layout.TRT_ENTRY, release)


def check_trt_layout(folder: Path) -> list[str]:
    """Every file the TensorRT Triton config names must exist in its version folder."""
    config = render_serving_parse(folder / "config.pbtxt")
    names = [*config.cc_model_filenames.values()]
    if config.default_model_filename:
        names.append(config.default_model_filename)
    problems = []
    for name in names:
        path = (folder / "1" / name).resolve()
        if folder.resolve() not in path.parents:
            problems.append(f"{name}: resolves outside the model folder")
        elif not path.is_file():
            problems.append(f"{name}: not in {folder.name}/1/ (Triton could not load it)")
    return problems


def render_serving_parse(path: Path) -> Any:
    return parse_triton(path.read_text())


def render_trt_triton(work: Path, release: str, values: dict[str, Any]) -> Path:
    """`serving/triton/<release>-trt/config.pbtxt`, parsed back with Triton's protobuf."""
    context = {"model_name": f"{release}-trt", "release": release, "trt": values}
    out = f"{trt_model_dir(release)}/config.pbtxt"
    [path] = render(work, {out: TRT_TEMPLATE}, context)
    try:
        config = parse_triton(path.read_text())
    except ValueError as exc:
        raise Refused(f"rendered {out} is not valid: {exc}", "fix the template") from None
    if config.max_batch_size != values["max_batch_size"]:
        raise Refused(f"{out}: max_batch_size did not survive the render", "fix it")
    return path
