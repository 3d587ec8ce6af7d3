"""Layer by layer: each PyTorch module's outputs against the ONNX tensors of its scope, to
name where a parity failure enters (Polygraphy's layerwise comparison, on module scopes)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from schemas.details import LayerComparison, Layerwise
from stages.onnx import model as m
from stages.onnx import shapes as sh
from stages.onnx.compare import compare, placed
from stages.onnx.graph import all_tensors, boundary_outputs, scoped_outputs

if TYPE_CHECKING:
    from schemas.spec.parity import ParityConfig


def layerwise(
    flat: Any, lay: sh.Layout, path: Path, feeds: dict[str, np.ndarray], cfg: ParityConfig
) -> Layerwise:
    """Compare each PyTorch module's output with the ONNX tensor of the same scope: for a
    module with one output, the last tensor computed inside it or its children (GPT-2's
    attention ends in c_proj; eval-mode dropout after it exports to nothing); for a module
    returning several tensors, each output with the one of the tensors leaving the scope it
    matches (a rotary embedding's cos is not compared with its sin)."""
    _, modules = m.traced_run(flat, lay, feeds)
    tensors = all_tensors(path, feeds)
    scoped = scoped_outputs(path)
    layers: list[LayerComparison] = []
    first: LayerComparison | None = None
    for module, _, ref, outs in modules:
        if len(outs) > 1:
            rows = _several(module, outs, boundary_outputs(path, module), tensors, cfg)
        else:
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
            rows = [] if match is None else [_row(module, match, ref, tensors[match], cfg)]
        for row in rows:
            layers.append(row)
            if first is None and not row.ok:
                first = row
    return Layerwise(compared=len(layers), first_divergent=first, layers=layers)


def _row(
    module: str, tensor: str, ref: np.ndarray, got: np.ndarray, cfg: ParityConfig
) -> LayerComparison:
    compared = compare(ref, got, cfg.tolerance, cfg)
    return placed(LayerComparison, compared, module=module, tensor=tensor)


def _several(
    module: str,
    outs: list[np.ndarray],
    leaving: list[str],
    tensors: dict[str, np.ndarray],
    cfg: ParityConfig,
) -> list[LayerComparison]:
    """Output k of a multi-output module against the leaving tensor of its shape that it is
    closest to, each tensor used once: the graph does not keep the module's return order,
    and of two same-shaped outputs only the right pairing matches."""
    rows, used = [], set()
    for k, ref in enumerate(outs):
        candidates = [
            t for t in leaving if t in tensors and t not in used and tensors[t].shape == ref.shape
        ]
        if not candidates:
            continue
        scored = [_row(f"{module}[{k}]", t, ref, tensors[t], cfg) for t in candidates]
        best = min(scored, key=lambda r: r.error)
        used.add(best.tensor)
        rows.append(best)
    return rows
