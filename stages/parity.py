"""parity: PyTorch vs ONNX Runtime at every spec shape; layer by layer to find divergence."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from schemas import ReleaseSpec
from stages._runtime import StageContext, StageIO, StageResult
from stages.onnx import model as m
from stages.onnx import shapes as sh
from stages.onnx.compare import compare, tolerance
from stages.onnx.graph import all_tensors, scoped_outputs

NAME = "parity"


def io(release: ReleaseSpec) -> StageIO:
    return StageIO(
        params=("model", "task", "export", "parity"),
        upstream=("export/model.onnx",),
        reads_model=True,
    )


def run(ctx: StageContext, release: ReleaseSpec) -> StageResult:
    import onnxruntime as ort

    cfg = release.parity
    net, lay = m.load_with_layout(NAME, ctx.root, release)
    flat = m.adapter(release.task, net, lay)
    path = ctx.upstream("export") / "model.onnx"
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rows, failures = [], []
    shapes = _shapes(release)
    with ctx.progress("comparing outputs", len(shapes)) as advance:
        for label, sizes in shapes:
            feeds = sh.make_inputs(lay, sizes, seed=cfg.seed)
            expected = m.torch_outputs(flat, lay, feeds)
            got = session.run([t.name for t in lay.outputs], feeds)
            for t, ref, out in zip(lay.outputs, expected, got, strict=True):
                row = {
                    "shape": label,
                    "sizes": sizes,
                    "output": t.name,
                    **compare(ref, out, tolerance(cfg, t.name), cfg),
                }
                rows.append(row)
                if not row["ok"]:
                    failures.append((row, feeds))
            advance()
    details: dict[str, Any] = {"comparisons": rows}
    if failures or cfg.layerwise == "always":
        feeds = failures[0][1] if failures else sh.make_inputs(lay, shapes[0][1], cfg.seed)
        details["layerwise"] = layerwise(flat, lay, path, feeds, cfg)
    worst = max(r["error"] for r in rows)
    metrics = {"worst_normalized_error": worst, "max_abs_diff": max(r["max_abs"] for r in rows)}
    if failures:
        return StageResult.failed(
            f"{len(failures)} output(s) out of tolerance",
            _reasons(failures, details),
            details=details,
            metrics=metrics,
        )
    return StageResult.passed(
        f"{len(rows)} comparisons at {len(shapes)} shapes within tolerance "
        f"({cfg.statistic} normalized error {worst:.3g} <= 1)",
        details=details,
        metrics=metrics,
    )


def _shapes(release: Any) -> list[tuple[str, dict[str, int]]]:
    dims = release.export.dims
    if release.parity.shapes:
        return [
            (f"shape[{i}]", {**sh.trace_sizes(dims), **s})
            for i, s in enumerate(release.parity.shapes)
        ]
    shapes = sh.corners(dims, odd_avoid={n: d.opt for n, d in dims.items()})
    return list({str(s): (k, s) for k, s in shapes.items()}.values())


def layerwise(
    flat: Any, lay: sh.Layout, path: Path, feeds: dict[str, np.ndarray], cfg: Any
) -> dict[str, Any]:
    """Compare each PyTorch module's output with the last ONNX tensor of the same scope."""
    _, modules = m.traced_run(flat, lay, feeds)
    tensors = all_tensors(path, feeds)
    scoped = scoped_outputs(path)
    layers, first = [], None
    for module, _, ref in modules:
        # A module's output is the last tensor computed inside it or its children
        # (GPT-2's attention ends in c_proj; eval-mode dropout after it exports to nothing).
        match = next(
            (
                t
                for scope, t in reversed(scoped)
                if (scope == module or scope.startswith(module + "."))
                and t in tensors
                and tensors[t].shape == ref.shape
            ),
            None,
        )
        if match is None:
            continue
        row = {
            "module": module,
            "tensor": match,
            **compare(ref, tensors[match], cfg.tolerance, cfg),
        }
        layers.append(row)
        if first is None and not row["ok"]:
            first = row
    return {"compared": len(layers), "first_divergent": first, "layers": layers}


def _reasons(failures: list[tuple[dict, Any]], details: dict[str, Any]) -> list[str]:
    reasons = [f"{r['output']} at {r['shape']} {r['sizes']}: {cfg_stat(r)}" for r, _ in failures]
    first = details["layerwise"]["first_divergent"]
    if first:
        reasons.append(
            f"first diverging layer: {first['module']} (ONNX tensor {first['tensor']},"
            f" normalized error {first['error']:.3g}, max |diff| {first['max_abs']:.3g})"
        )
    else:
        reasons.append(
            "layer-by-layer comparison found no diverging module output; the "
            "difference enters outside module boundaries"
        )
    return reasons


def cfg_stat(row: dict[str, Any]) -> str:
    return row.get("note") or (
        f"normalized error {row['error']:.3g} > 1 (max |diff| {row['max_abs']:.3g})"
    )
