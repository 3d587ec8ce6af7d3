"""The ONNX Runtime session every front end opens, with the bundle's `ort_session.json`.

`SHIPYARD_DEVICE=cuda` (the launcher's `--device cuda`) runs it on ONNX Runtime's CUDA
execution provider, CPU for the nodes CUDA lacks; refused, never a silent CPU session, when
this onnxruntime has no CUDA provider (the `gpu` extra's onnxruntime-gpu has it) or it
fails to start (no driver, no device).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import onnxruntime as ort

LEVELS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


def session_from(model_path: Path, config: dict[str, Any]) -> ort.InferenceSession:
    """An ORT session with the bundle's `ort_session.json` options."""
    options = ort.SessionOptions()
    opts = config.get("session_options", {})
    options.graph_optimization_level = LEVELS[opts.get("graph_optimization_level", "all")]
    options.intra_op_num_threads = opts.get("intra_op_num_threads", 0)
    options.inter_op_num_threads = opts.get("inter_op_num_threads", 0)
    if opts.get("execution_mode") == "parallel":
        options.execution_mode = ort.ExecutionMode.ORT_PARALLEL
    providers = config.get("providers", ["CPUExecutionProvider"])
    device = os.environ.get(DEVICE_ENV, "cpu")
    if device == "cuda":
        problem = cuda_missing()
        if problem:
            raise RuntimeError(problem)
        providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    elif device != "cpu":
        raise RuntimeError(f"{DEVICE_ENV}={device!r}: cpu or cuda")
    session = ort.InferenceSession(str(model_path), options, providers=providers)
    if device == "cuda" and session.get_providers()[0] != "CUDAExecutionProvider":
        raise RuntimeError(
            "ONNX Runtime's CUDA execution provider did not start (it fell back to "
            f"{session.get_providers()[0]}): check the NVIDIA driver and CUDA 12 libraries"
        )
    return session


DEVICE_ENV = "SHIPYARD_DEVICE"


def cuda_missing() -> str | None:
    """Why this onnxruntime cannot run on CUDA, or None."""
    if "CUDAExecutionProvider" in ort.get_available_providers():
        return None
    return (
        f"this onnxruntime ({ort.__version__}, providers {ort.get_available_providers()}) has "
        "no CUDA execution provider: install the gpu extra's onnxruntime-gpu in its place "
        "(bash scripts/gpu_check.sh does), or serve with --device cpu"
    )
