"""The one comparator: PyTorch vs ONNX Runtime (parity), TensorRT vs ONNX Runtime (engine
parity) and CUDA-graph replay vs plain execution all judge outputs here.

Per element, the normalized error is |a-b| / (atol + rtol*|ref|); a tensor passes when the
spec's statistic of it (max = numpy.allclose, mean, or a quantile) is <= 1. A NaN or inf
where the reference has a number, a shape mismatch and a missing output all fail.
"""

from __future__ import annotations

import fnmatch
from typing import Any

import numpy as np


def tolerance(cfg: Any, output: str) -> Any:
    """The per-output tolerance whose key (name or glob) matches, else the default."""
    return next(
        (tol for pattern, tol in cfg.outputs.items() if fnmatch.fnmatchcase(output, pattern)),
        cfg.tolerance,
    )


def compare(ref: np.ndarray, out: np.ndarray, tol: Any, cfg: Any) -> dict[str, Any]:
    """Normalized error |a-b| / (atol + rtol*|ref|), reduced by the spec's statistic."""
    ref, out = np.asarray(ref), np.asarray(out)
    if ref.shape != out.shape:
        return {
            "ok": False,
            "error": float("inf"),
            "max_abs": float("inf"),
            "note": f"shape {list(out.shape)} != reference {list(ref.shape)}",
        }
    if ref.size == 0:
        return {"ok": True, "error": 0.0, "max_abs": 0.0}
    diff = np.abs(ref.astype(np.float64) - out.astype(np.float64))
    with np.errstate(divide="ignore", invalid="ignore"):  # zero tolerance: exact or infinite
        norm = np.where(diff == 0, 0.0, diff / (tol.atol + tol.rtol * np.abs(ref)))
    stat: Any = {"max": np.max, "mean": np.mean}.get(cfg.statistic)
    error = float(stat(norm)) if stat else float(np.quantile(norm, cfg.quantile))
    error = error if np.isfinite(error) else float("inf")  # NaN anywhere fails
    max_abs = float(np.max(diff)) if np.isfinite(diff).all() else float("inf")
    return {"ok": error <= 1.0, "error": error, "max_abs": max_abs}


def compare_outputs(
    want: dict[str, Any], have: dict[str, Any], cfg: Any, default: Any = None
) -> list[dict[str, Any]]:
    """One row per reference output, in its order; `default` replaces cfg.tolerance for
    outputs no per-output key matches (e.g. engine.parity)."""
    rows = []
    for name, ref in want.items():
        if name not in have:
            rows.append(
                {
                    "output": name,
                    "ok": False,
                    "error": float("inf"),
                    "max_abs": float("inf"),
                    "note": "missing from the outputs",
                }
            )
            continue
        tol = tolerance(cfg, name)
        if default is not None and tol is cfg.tolerance:
            tol = default
        rows.append({"output": name, **compare(np.asarray(ref), np.asarray(have[name]), tol, cfg)})
    return rows
