"""Activation ranges for static QDQ, calibrated without holding the model.

onnxruntime's calibrators load the whole model with its weights, save an augmented copy,
open a session on it and (entropy, percentile) keep every calibrated tensor of every
sample in memory before building histograms: with quantize_static's own whole-model pass
that was 8.4x gpt2-small's checkpoint. Here the ranges come from one run per sample of the
weightless skeleton (its weights stay in their file, `marked_runs`), each sample folded
into running minima and maxima, or into onnxruntime's own HistogramCollector, and are
written as onnxruntime's calibration cache. quantize_static then reads the cache instead
of calibrating, so each node is quantized alone, in a one-node model, and spliced.

The same statistics as onnxruntime's calibrators with quantize_static's defaults: minmax
is the min and max over every calibration window (identical); entropy and percentile
histograms are collected one window at a time and merged, as onnxruntime's calibrator does
across calls, instead of from every window at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

CACHE = "calibration-cache.json"
# quantize_static's defaults for each method (onnxruntime.quantization.calibrate):
# bins, quantized bins, symmetric range
HISTOGRAM = {"entropy": (128, 128, False), "percentile": (2048, 128, True)}


def tensors(skel: Any, nodes: list[str]) -> list[str]:
    """The tensors quantize_static needs a range for: every input and output of the nodes
    it quantizes that is a float activation (not a weight, not an integer)."""
    from onnx import TensorProto

    g = skel.graph
    weights = {t.name for t in g.initializer}
    kinds = {v.name: v.type.tensor_type.elem_type for v in (*g.value_info, *g.input, *g.output)}
    floats = {TensorProto.FLOAT, TensorProto.FLOAT16}
    chosen = set(nodes)
    names = (
        t
        for n in g.node
        if n.name in chosen
        for t in (*n.input, *n.output)
        if t and t not in weights
    )
    return list(dict.fromkeys(t for t in names if kinds.get(t, TensorProto.FLOAT) in floats))


def calibrate(
    model: Path,
    names: list[str],
    windows: list[dict[str, np.ndarray]],
    method: str,
    percentile: float,
    cache: Path,
) -> None:
    """Write onnxruntime's calibration cache for `names` over the calibration windows."""
    from onnxruntime.quantization.calibrate import (
        CalibrationMethod,
        HistogramCollector,
        TensorsData,
        save_tensors_data,
    )

    from stages.onnx.graph import marked_runs

    runs = marked_runs(model, names, windows)
    if method == "minmax":
        low: dict[str, np.float32] = {}
        high: dict[str, np.float32] = {}
        for values in runs:
            for name, value in values.items():
                lo, hi = np.min(value), np.max(value)
                low[name] = min(low.get(name, lo), lo)
                high[name] = max(high.get(name, hi), hi)
        data: dict[str, Any] = {
            n: (np.array([low[n]], np.float32), np.array([high[n]], np.float32)) for n in low
        }
        save_tensors_data(TensorsData(CalibrationMethod.MinMax, data), cache)
        return
    bins, quantized, symmetric = HISTOGRAM[method]
    collector = HistogramCollector(
        method=method,
        symmetric=symmetric,
        num_bins=bins,
        num_quantized_bins=quantized,
        percentile=percentile,
        scenario="same",
    )
    for values in runs:
        collector.collect({n: [v] for n, v in values.items()})
    kind = {"entropy": CalibrationMethod.Entropy, "percentile": CalibrationMethod.Percentile}
    save_tensors_data(TensorsData(kind[method], collector.compute_collection_result()), cache)
