"""One interface over onnxruntime.quantization's methods: quantize all but / only some nodes."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np

TWO_GB = 2 << 30


class Quantizer:
    """Writes quantized variants of one pre-processed FP32 model into `folder`."""

    def __init__(
        self, model: Path, cfg: Any, calibration: list[dict[str, np.ndarray]], folder: Path
    ) -> None:
        self.model, self.cfg, self.calibration, self.folder = model, cfg, calibration, folder
        self.counter = itertools.count()
        self.large = model.stat().st_size + _data_size(model) > TWO_GB
        folder.mkdir(parents=True, exist_ok=True)
        if cfg.method == "int4-weight-only":
            self.model = _gemm_as_matmul(model, folder / "matmul.onnx")

    def candidates(self) -> list[str]:
        """Nodes this method can quantize (weight-carrying ones unless static QDQ)."""
        import onnx

        graph = onnx.load(str(self.model), load_external_data=False).graph
        weights = {t.name for t in graph.initializer}
        static = self.cfg.method == "int8-static"
        return [
            n.name
            for n in graph.node
            if n.op_type in self.cfg.op_types
            and (static or any(i in weights for i in n.input[1:2]))
        ]

    def quantize(self, exclude: list[str] = (), only: list[str] | None = None) -> Path:  # type: ignore[assignment]
        out = self.folder / f"q{next(self.counter)}.onnx"
        {
            "int8-dynamic": self._dynamic,
            "int8-static": self._static,
            "int4-weight-only": self._int4,
        }[self.cfg.method](out, list(exclude), only)
        return out

    def _dynamic(self, out: Path, exclude: list[str], only: list[str] | None) -> None:
        from onnxruntime.quantization import QuantType, quantize_dynamic

        quantize_dynamic(
            self.model,
            out,
            op_types_to_quantize=self.cfg.op_types,
            per_channel=self.cfg.per_channel,
            weight_type=QuantType.QInt8,
            nodes_to_quantize=only,
            nodes_to_exclude=exclude,
            use_external_data_format=self.large,
        )

    def _static(self, out: Path, exclude: list[str], only: list[str] | None) -> None:
        from onnxruntime.quantization import (
            CalibrationMethod,
            QuantFormat,
            QuantType,
            quantize_static,
        )

        method = {
            "minmax": CalibrationMethod.MinMax,
            "entropy": CalibrationMethod.Entropy,
            "percentile": CalibrationMethod.Percentile,
        }[self.cfg.calibrate_method]
        # Ranges are calibrated once (on every candidate) and reused from the cache file.
        quantize_static(
            self.model,
            out,
            _Reader(self.calibration),
            quant_format=QuantFormat.QDQ,
            op_types_to_quantize=self.cfg.op_types,
            per_channel=self.cfg.per_channel,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            nodes_to_quantize=only,
            nodes_to_exclude=exclude,
            use_external_data_format=self.large,
            calibrate_method=method,
            calibration_cache_path=self.folder / "calibration-cache.json",
            extra_options={"CalibPercentile": self.cfg.percentile},
        )

    def _int4(self, out: Path, exclude: list[str], only: list[str] | None) -> None:
        import logging

        import onnx
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(
            logging.WARNING
        )

        quantizer = MatMulNBitsQuantizer(
            onnx.load(str(self.model)),
            block_size=self.cfg.block_size,
            is_symmetric=self.cfg.symmetric,
            nodes_to_exclude=exclude,
            nodes_to_include=only,
            op_types_to_quantize=("MatMul",),
        )
        quantizer.process()
        quantizer.model.save_model_to_file(str(out), use_external_data_format=self.large)


class _Reader:
    """onnxruntime's CalibrationDataReader protocol over real calibration samples."""

    def __init__(self, samples: list[dict[str, np.ndarray]]) -> None:
        self.samples = _packed(samples)
        self.it = iter(self.samples)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self.it, None)

    def rewind(self) -> None:
        self.it = iter(self.samples)


def _data_size(model: Path) -> int:
    return sum(p.stat().st_size for p in model.parent.glob(f"{model.name}.data"))


def _gemm_as_matmul(src: Path, dst: Path) -> Path:
    """Gemm(A, B, C) with constant B -> MatMul + Add, keeping the node name, so MatMulNBits
    (MatMul only) can take GPT-2's Conv1D projections, which export as Gemm."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(src))
    inits = {t.name: t for t in model.graph.initializer}
    nodes = []
    for node in model.graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        simple = (
            attrs.get("alpha", 1.0) == 1.0
            and attrs.get("beta", 1.0) == 1.0
            and not attrs.get("transA", 0)
        )
        if node.op_type != "Gemm" or not simple or node.input[1] not in inits:
            nodes.append(node)
            continue
        weight_name = node.input[1]
        if attrs.get("transB", 0):  # a new initializer: the old one may feed other nodes
            weight = numpy_helper.to_array(inits[weight_name]).T.copy()
            weight_name += "_transposed"
            model.graph.initializer.append(numpy_helper.from_array(weight, weight_name))
        product = node.output[0] + "_matmul"
        nodes.append(
            helper.make_node("MatMul", [node.input[0], weight_name], [product], name=node.name)
        )
        if len(node.input) > 2 and node.input[2]:
            nodes.append(
                helper.make_node(
                    "Add", [product, node.input[2]], node.output, name=node.name + "_bias"
                )
            )
        else:
            nodes[-1].output[0] = node.output[0]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    large = src.stat().st_size + _data_size(src) > TWO_GB
    onnx.save_model(model, str(dst), save_as_external_data=large, location=dst.name + ".data")
    return dst


def _packed(samples: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """Texts of different lengths, concatenated and cut into equal windows.

    onnxruntime's histogram calibrators (entropy, percentile) stack each tensor across
    samples, so every sample must have the same shape; packing keeps every real token.
    """
    shapes = {tuple(s["input_ids"].shape) for s in samples if "input_ids" in s}
    if len(shapes) <= 1:
        return samples
    tokens = np.concatenate([s["input_ids"][0] for s in samples])
    width = max(shape[1] for shape in shapes)
    windows = []
    for start in range(0, tokens.size - width + 1, width):
        ids = tokens[None, start : start + width]
        windows.append({**samples[0], "input_ids": ids, "attention_mask": np.ones_like(ids)})
    return windows
