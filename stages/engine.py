"""engine: a TensorRT engine from the quantized ONNX, with parity and CUDA-graph checks.

Where TensorRT or a CUDA device is missing the stage is `skipped` with that reason (still
writing the profile table it would have built), unless `engine.required`, when it fails.
A GPU is detected by asking the driver (NVML, then the CUDA driver API), never from ONNX
Runtime's provider list. Engines are not byte-reproducible: the report records TensorRT
version, GPU, compute capability and parity, and nothing gates on engine bytes.
"""

from __future__ import annotations

import ctypes
import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Any

from schemas import ReleaseSpec, StageError
from schemas.artifacts import CapacityPlan, EngineProfiles, ModelInfo, QuantInfo
from stages._contract import StageContext, StageIO, StageResult
from stages.onnx import shapes as sh
from stages.tensorrt.triton import (  # noqa: F401 (re-exported)
    TRT_TEMPLATE,
    check_trt_layout,
    plan_name,
    render_serving_parse,
    render_trt_triton,
    triton_trt_values,
    trt_model_dir,
)

if TYPE_CHECKING:
    from schemas.spec.engine import EngineConfig

NAME = "engine"


def io(release: ReleaseSpec) -> StageIO:
    return StageIO(
        params=("task", "export", "parity", "quantization.method", "engine", "bundle.serving"),
        reads=(ModelInfo, CapacityPlan, QuantInfo),
        upstream=("export/model.onnx", "quantize/model.onnx"),
        code=(f"stages/templates/{TRT_TEMPLATE}",),  # the only template it renders
    )


def run(ctx: StageContext, release: ReleaseSpec) -> StageResult:
    cfg = release.engine
    info = ctx.read(ModelInfo)
    profiles = derive_profiles(cfg, info)
    source, why = engine_source(ctx.read(QuantInfo).method)  # auto: the recipe it chose
    details: dict[str, Any] = {
        "profiles": profiles,
        "source": {"stage": source, "why": why},
    }
    ctx.write(EngineProfiles.model_validate({"profiles": profiles}))
    if cfg.backend == "none":
        return StageResult.skipped(
            "engine.backend is none", details=details, optional=not cfg.required
        )
    missing = why_unavailable()
    if missing:
        if cfg.required:
            raise StageError(
                NAME,
                f"engine.required is true but {missing}",
                "run on a machine with an NVIDIA GPU and TensorRT, or set engine.required: false",
            )
        return StageResult.skipped(missing, details=details, optional=not cfg.required)
    from stages.tensorrt import build as trt_build

    model = ctx.upstream(source) / "model.onnx"
    asymmetric = asymmetric_qdq(model)
    if asymmetric:
        raise StageError(
            NAME,
            f"{len(asymmetric)} Q/DQ node(s) have non-zero zero points, which TensorRT refuses: "
            f"{', '.join(asymmetric[:3])}",
            "rebuild the quantize stage (int8-static now writes symmetric INT8)",
        )
    return trt_build.build_and_check(ctx, release, info, profiles, model, details)


def engine_source(method: str) -> tuple[str, str]:
    """Which ONNX the engine is built from, and why. TensorRT takes INT8 from explicit
    Q/DQ nodes; ONNX Runtime's dynamic INT8 (MatMulInteger, DynamicQuantizeLinear) and
    weight-only INT4 (MatMulNBits) are ORT-only ops it cannot parse."""
    if method == "int8-static":
        return "quantize", "Q/DQ graph: TensorRT builds INT8 from its Q/DQ nodes"
    if method == "none":
        return "quantize", "no quantization: the exported graph"
    return "export", (
        f"quantization.method {method} writes ONNX Runtime-only ops TensorRT cannot parse; "
        "the engine is built from the FP32 export (use int8-static for an INT8 engine)"
    )


def why_unavailable() -> str:
    """'' when TensorRT imports and the driver reports a CUDA device, else the reason."""
    missing = []
    if not module_present("tensorrt"):
        missing.append("TensorRT is not installed (no `tensorrt` Python package)")
    elif not module_present("cuda.bindings"):
        # `cuda` alone can be a bare namespace package; the code imports cuda.bindings
        missing.append(
            "cuda-python is not installed (no `cuda.bindings`, needed for CUDA-graph capture)"
        )
    count, how = cuda_devices()
    if count == 0:
        missing.append(f"no CUDA device ({how})")
    return "; ".join(missing)


def asymmetric_qdq(model: Path) -> list[str]:
    """Q/DQ nodes whose zero point is not 0: TensorRT refuses them (symmetric INT8 only)."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    graph = onnx.load(str(model), load_external_data=False).graph
    constants = {t.name: t for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute:
            constants[node.output[0]] = node.attribute[0].t
    bad = []
    for node in graph.node:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear") and len(node.input) > 2:
            zero = constants.get(node.input[2])
            if zero is None:
                bad.append(f"{node.name or node.output[0]} (zero point is computed)")
            elif np.any(numpy_helper.to_array(zero) != 0):
                values = numpy_helper.to_array(zero).ravel()[:3].tolist()
                bad.append(f"{node.name or node.output[0]} (zero point {values})")
    return bad


def module_present(name: str) -> bool:
    """find_spec that answers False (not ModuleNotFoundError) when a parent is missing."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def cuda_devices() -> tuple[int, str]:
    """Device count from NVML, else from the CUDA driver; 0 with the reason when neither."""
    for lib, init, count_fn in (
        ("libnvidia-ml.so.1", "nvmlInit_v2", "nvmlDeviceGetCount_v2"),
        ("libcuda.so.1", "cuInit", "cuDeviceGetCount"),
    ):
        try:
            handle = ctypes.CDLL(lib)
        except OSError:
            continue
        args = (0,) if lib.startswith("libcuda") else ()
        if getattr(handle, init)(*args) != 0:
            return 0, f"{lib}: {init} failed (driver loaded but no usable device)"
        n = ctypes.c_uint() if lib.startswith("libnvidia") else ctypes.c_int()
        if getattr(handle, count_fn)(ctypes.byref(n)) != 0:
            return 0, f"{lib}: {count_fn} failed"
        return int(n.value), f"{lib} reports {n.value}"
    return 0, "neither libnvidia-ml.so.1 nor libcuda.so.1 loads: no NVIDIA driver"


def derive_profiles(cfg: EngineConfig, info: ModelInfo) -> list[dict[str, Any]]:
    """Per profile, per graph input: min/opt/max shapes from the named axes.

    A dim a profile does not set takes the export's range; `total_sequence` (the attention
    mask of a KV-cache graph) is past + sequence at each of min, opt and max.
    """
    out = []
    for p in cfg.profiles:
        ranges = {k: v.model_dump() for k, v in info.dims.items()}
        ranges.update({k: v.model_dump() for k, v in p.dims.items()})
        at = sh.corners(ranges)
        shapes = {
            t.name: {k: [sh.axis_size(a, at[k]) for a in t.axes] for k in sh.BOUNDS}
            for t in info.inputs
        }
        out.append({"name": p.name, "dims": ranges, "shapes": shapes})
    return out
