"""The ONNX Runtime session every front end opens, with the bundle's `ort_session.json`."""

from __future__ import annotations

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
    return ort.InferenceSession(str(model_path), options, providers=providers)
