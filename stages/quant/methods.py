"""One interface over onnxruntime.quantization's methods: quantize all but / only some nodes.

Sensitivity needs one variant per node with only that node quantized. Quantizing the whole
model per node costs ~10 s at 124M parameters (onnxruntime re-runs shape inference on the
full graph), so for the weight-carrying methods a variant is built by quantizing a one-node
model with the same onnxruntime call and splicing its nodes into the FP32 graph, whose
weights stay in one external-data file shared by every variant (~0.2 s a node).
"""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from typing import Any

import numpy as np

from schemas import StageError
from stages.onnx import shapes as sh

TWO_GB = 2 << 30
WEIGHTS = "weights.data"
SMOOTHED = "smoothed.data"


class Quantizer:
    """Writes quantized variants of one pre-processed FP32 model into `folder`."""

    def __init__(
        self, model: Path, cfg: Any, calibration: list[dict[str, np.ndarray]], folder: Path
    ) -> None:
        self.cfg, self.calibration, self.folder = cfg, calibration, folder
        self.counter = itertools.count()
        self.large = model.stat().st_size + _data_size(model) > TWO_GB
        folder.mkdir(parents=True, exist_ok=True)
        self.splice = cfg.method != "int8-static"
        # Gemm -> MatMul ourselves, keeping node names: onnxruntime's dynamic mode renames
        # Gemm nodes (`<name>_MatMul`), which would silently defeat nodes_to_exclude, and
        # MatMulNBits only takes MatMul.
        alpha = getattr(cfg, "smooth_alpha", None)  # SmoothQuant smooths MatMul inputs too
        convert = self.splice or alpha is not None
        self.model = _gemm_as_matmul(model, folder / "fp32.onnx") if convert else model
        self.smoothing: dict[str, Any] = {}
        if alpha is not None:  # SmoothQuant: same function in float, evened-out activations
            from stages.quant.smooth import smooth

            try:
                self.smoothing = smooth(
                    self.model, folder / "smoothed.onnx", calibration, alpha, SMOOTHED, cfg.op_types
                )
            except Exception as exc:  # an unforeseen graph: a clear failure, not a traceback
                raise StageError(
                    "quantize",
                    f"SmoothQuant could not rewrite the graph: {type(exc).__name__}: "
                    f"{' '.join(str(exc).split())[:300]}",
                    "quantize without smooth_alpha (or drop the int8-dynamic-smoothquant recipe)",
                ) from None
            self.model = folder / "smoothed.onnx"
        self._skeleton: Any = None

    def candidates(self) -> list[str]:
        """Nodes this method can quantize (weight-carrying ones unless static QDQ)."""
        graph = self.skeleton().graph
        weights = {t.name for t in graph.initializer}
        return [
            n.name
            for n in graph.node
            if n.op_type in self.cfg.op_types
            and (not self.splice or any(i in weights for i in n.input[1:2]))
        ]

    def skeleton(self) -> Any:
        import onnx

        if self._skeleton is None:
            self._skeleton = onnx.load(str(self.model), load_external_data=False)
        return self._skeleton

    def quantize(self, exclude: list[str] = (), only: list[str] | None = None) -> Path:  # type: ignore[assignment]
        """The whole model through onnxruntime, minus `exclude` (or just `only`)."""
        out = self._next()
        try:
            _METHODS[self.cfg.method](self, self.model, out, list(exclude), only, self.large)
        except Exception as exc:  # onnxruntime's quantizers raise bare asserts and ValueErrors
            raise StageError(
                "quantize",
                f"onnxruntime's {self.cfg.method} quantizer failed: "
                f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}",
                "check that the FP32 export is finite and runs (evalcheck, parity); try "
                "another method",
            ) from None
        return out

    def alone(self, node: str) -> Path:
        """A variant with only `node` quantized."""
        return self._spliced(node) if self.splice else self.quantize(only=[node])

    def _next(self) -> Path:
        return self.folder / f"q{next(self.counter)}.onnx"

    def _spliced(self, name: str) -> Path:
        import onnx

        skel = self.skeleton()
        index, node = next((i, n) for i, n in enumerate(skel.graph.node) if n.name == name)
        sub, qsub = self._next(), self._next()
        onnx.save(_one_node_model(skel, node, self.model.parent), sub)
        _METHODS[self.cfg.method](self, sub, qsub, [], None, False)
        quantized = onnx.load(str(qsub))
        variant = copy.deepcopy(skel)
        nodes = list(variant.graph.node)
        nodes[index : index + 1] = list(quantized.graph.node)
        del variant.graph.node[:]
        variant.graph.node.extend(nodes)
        used = {i for n in nodes for i in n.input}
        keep = [t for t in variant.graph.initializer if t.name in used]
        del variant.graph.initializer[:]
        variant.graph.initializer.extend(keep)
        names = {t.name for t in keep}
        variant.graph.initializer.extend(
            t for t in quantized.graph.initializer if t.name not in names
        )
        out = self._next()
        onnx.save(variant, str(out))  # its FP32 weights stay in the shared WEIGHTS file
        for f in (sub, qsub):
            f.unlink()
        return out


def _dynamic(
    q: Quantizer, src: Path, out: Path, exclude: list[str], only: list[str] | None, large: bool
) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(
        src,
        out,
        op_types_to_quantize=q.cfg.op_types,
        per_channel=q.cfg.per_channel,
        weight_type=QuantType.QInt8,
        nodes_to_quantize=only,
        nodes_to_exclude=exclude,
        use_external_data_format=large,
    )


def _static(
    q: Quantizer, src: Path, out: Path, exclude: list[str], only: list[str] | None, large: bool
) -> None:
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    method = {
        "minmax": CalibrationMethod.MinMax,
        "entropy": CalibrationMethod.Entropy,
        "percentile": CalibrationMethod.Percentile,
    }[q.cfg.calibrate_method]
    # Ranges are calibrated once (on every candidate) and reused from the cache file.
    quantize_static(
        src,
        out,
        _Reader(q.calibration),
        quant_format=QuantFormat.QDQ,
        op_types_to_quantize=q.cfg.op_types,
        per_channel=q.cfg.per_channel,
        # Signed INT8 with zero points fixed at 0 for activations and weights: TensorRT builds
        # INT8 from these Q/DQ nodes and refuses any other zero point ("TensorRT only supports
        # symmetric quantization"); asymmetric QUInt8 activations gave zero points like 202.
        activation_type=QuantType.QInt8,
        weight_type=QuantType.QInt8,
        nodes_to_quantize=only,
        nodes_to_exclude=exclude,
        use_external_data_format=large,
        calibrate_method=method,
        calibration_cache_path=q.folder / "calibration-cache.json",
        extra_options={
            "CalibPercentile": q.cfg.percentile,
            "ActivationSymmetric": True,
            "WeightSymmetric": True,
        },
    )


def _int4(
    q: Quantizer, src: Path, out: Path, exclude: list[str], only: list[str] | None, large: bool
) -> None:
    import logging

    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    quantizer = MatMulNBitsQuantizer(
        onnx.load(str(src)),
        bits=8 if q.cfg.method == "int8-weight-only" else 4,
        block_size=q.cfg.block_size,
        is_symmetric=q.cfg.symmetric,
        nodes_to_exclude=exclude,
        nodes_to_include=only,
        op_types_to_quantize=("MatMul",),
    )
    quantizer.process()
    quantizer.model.save_model_to_file(str(out), use_external_data_format=large)


_METHODS = {
    "int8-dynamic": _dynamic,
    "int8-static": _static,
    "int4-weight-only": _int4,
    "int8-weight-only": _int4,  # the same MatMulNBits quantizer at 8 bits
}


def _one_node_model(skel: Any, node: Any, base: Path) -> Any:
    """A model holding one weight-carrying node, its activation input and its weight."""
    from onnx import TensorProto, external_data_helper, helper

    infos = {v.name: v for v in (*skel.graph.value_info, *skel.graph.input, *skel.graph.output)}
    weights = {t.name: t for t in skel.graph.initializer}
    inits = []
    for name in node.input[1:]:
        if name in weights:
            tensor = copy.deepcopy(weights[name])
            if external_data_helper.uses_external_data(tensor):
                external_data_helper.load_external_data_for_tensor(tensor, str(base))
                tensor.data_location = TensorProto.DEFAULT
                del tensor.external_data[:]
            inits.append(tensor)
    x = infos.get(node.input[0]) or helper.make_tensor_value_info(
        node.input[0], TensorProto.FLOAT, None
    )
    y = infos.get(node.output[0]) or helper.make_tensor_value_info(
        node.output[0], TensorProto.FLOAT, None
    )
    graph = helper.make_graph([node], "one_node", [x], [y], inits)
    return helper.make_model(graph, opset_imports=skel.opset_import, ir_version=skel.ir_version)


class _Reader:
    """onnxruntime's CalibrationDataReader protocol over real calibration samples."""

    def __init__(self, samples: list[dict[str, np.ndarray]]) -> None:
        self.samples = _packed(samples)
        self.it = iter(self.samples)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self.it, None)

    def rewind(self) -> None:
        self.it = iter(self.samples)


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
        window = {**samples[0], "input_ids": ids, "attention_mask": np.ones_like(ids)}
        if sh.POSITIONS in window:
            window[sh.POSITIONS] = sh.positions_from_mask(window["attention_mask"], width)
        windows.append(window)
    return windows


def _data_size(model: Path) -> int:
    return sum(p.stat().st_size for p in model.parent.glob(f"{model.name}.data"))


def _gemm_as_matmul(src: Path, dst: Path) -> Path:
    """Gemm(A, B, C) with constant B -> MatMul + Add, keeping the node name; saved with every
    weight in one external file (WEIGHTS) that spliced variants share."""
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
    onnx.save_model(
        model,
        str(dst),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=WEIGHTS,
        size_threshold=1024,
    )
    return dst
