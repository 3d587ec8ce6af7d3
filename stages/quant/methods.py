"""One interface over onnxruntime.quantization's methods: quantize all but / only some nodes.

Every variant is spliced (dynamic INT8, MatMulNBits, static QDQ): each node is quantized
once, alone, in a one-node model by the same onnxruntime call, and a variant is the FP32
graph's skeleton with the chosen nodes' quantized pieces put in place.
The FP32 weights stay in one external-data file (WEIGHTS) that the skeleton points to, and
the variant is written one tensor at a time (stages/onnx/stream.py), so no step holds the
model: onnxruntime's quantize_dynamic parses, copies and re-serializes the whole model
(2.5 GB above the stage's baseline on gpt2-small's 0.5 GB), and re-runs shape inference on
the full graph for every variant (~7 s at 124M parameters). A variant's output is the same
as quantize_dynamic's on the whole model: each node's quantization depends only on its own
weight, and nodes that share an input share its one dynamic quantization, as there.
Static QDQ's ranges are calibrated first, on the skeleton (stages/quant/static.py), and
every piece is quantized from them; the variant computes what quantize_static's does, with
one difference: a tensor read by a quantized node and by one kept in float reaches the
float one unquantized (quantize_static feeds every reader the Q/DQ'd tensor, so a node
"kept in float" could still see INT8 input).
"""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from schemas import Refused, StageError
from stages.onnx import shapes as sh
from stages.onnx import stream
from stages.quant import pertoken, static

if TYPE_CHECKING:
    from schemas.spec.quantization import Int4WeightOnly, Int8Dynamic, Int8Static, Int8WeightOnly
    from stages.quant.smooth import Smoothing

    # an explicit method's spec: what a Quantizer builds (auto's recipes become one of these)
    Method = Int8Dynamic | Int8Static | Int4WeightOnly | Int8WeightOnly

TWO_GB = 2 << 30
WEIGHTS = "weights.data"
SMOOTHED = "smoothed.data"


class Quantizer:
    """Writes quantized variants of one pre-processed FP32 model into `folder`."""

    def __init__(
        self, model: Path, cfg: Method, calibration: list[dict[str, np.ndarray]], folder: Path
    ) -> None:
        self.cfg, self.calibration, self.folder = cfg, calibration, folder
        self.counter = itertools.count()
        self.large = model.stat().st_size + _data_size(model) > TWO_GB
        folder.mkdir(parents=True, exist_ok=True)
        self.static = cfg.method == "int8-static"
        # Gemm -> MatMul ourselves, keeping node names: onnxruntime's dynamic mode renames
        # Gemm nodes (`<name>_MatMul`), which would silently defeat nodes_to_exclude,
        # MatMulNBits only takes MatMul, and a spliced piece is a MatMul's.
        alpha = getattr(cfg, "smooth_alpha", None)  # SmoothQuant smooths MatMul inputs too
        self.model = _gemm_as_matmul(model, folder / "fp32.onnx")
        self.smoothing: Smoothing | None = None  # what SmoothQuant did, when it ran
        if alpha is not None:  # SmoothQuant: same function in float, evened-out activations
            from stages.quant.smooth import smooth

            try:
                self.smoothing = smooth(
                    self.model, folder / "smoothed.onnx", calibration, alpha, SMOOTHED, cfg.op_types
                )
            except Exception as exc:  # an unforeseen graph: a clear failure, not a traceback
                raise Refused(
                    f"SmoothQuant could not rewrite the graph: {type(exc).__name__}: "
                    f"{' '.join(str(exc).split())[:300]}",
                    "quantize without smooth_alpha (or drop the int8-dynamic-smoothquant recipe)",
                ) from None
            self.model = folder / "smoothed.onnx"
        self._skeleton: Any = None
        self._by_name: Any = None
        self._node_map: dict[str, Any] | None = None
        self._group_of: dict[str, list[str]] | None = None
        self._pieces: dict[str, Path] = {}  # node -> its one-node quantized model, on disk

    def candidates(self) -> list[str]:
        """Nodes this method can quantize (weight-carrying ones unless static QDQ, which
        also quantizes a product of two activations: attention's Q K^T)."""
        from stages.onnx.invariant import SUMS

        graph = self.skeleton().graph
        weights = {t.name for t in graph.initializer}
        return [
            n.name
            for n in graph.node
            if n.op_type in self.cfg.op_types
            and (self.static or any(i in weights for i in n.input[1:2]))
            # a softmax's sum of exponentials (stages/onnx/invariant.py): quantized, small
            # terms would round to 0 in the sum and not in the numerator
            and not n.name.endswith(SUMS)
        ]

    def skeleton(self) -> Any:
        import onnx

        if self._skeleton is None:
            self._skeleton = onnx.load(str(self.model), load_external_data=False)
        return self._skeleton

    def quantize(
        self,
        exclude: list[str] = (),  # type: ignore[assignment]
        only: list[str] | None = None,
        shared: bool = False,
    ) -> Path:
        """The whole model minus `exclude` (or just `only`) quantized; with `shared`, a
        probe that reads its float weights from the FP32 file (when spliced)."""
        if self.splices:
            chosen = set(exclude)
            names = [n for n in (only or self.candidates()) if n not in chosen]
            return self._spliced(names, shared)
        out = self._next()
        try:
            _METHODS[self.cfg.method](self, self.model, out, list(exclude), only, self.large)
        except Exception as exc:  # onnxruntime's quantizers raise bare asserts and ValueErrors
            raise _failed(self.cfg.method, exc) from None
        return out

    def alone(self, node: str) -> Path:
        """A variant with only `node` quantized."""
        return self._spliced([node], shared=True) if self.splices else self.quantize(only=[node])

    @property
    def splices(self) -> bool:
        """Whether variants are spliced from per-node pieces (every op type quantized is a
        MatMul by now); other op types go through onnxruntime on the whole model."""
        return set(self.cfg.op_types) <= SPLICED

    def _next(self) -> Path:
        return self.folder / f"q{next(self.counter)}.onnx"

    def _piece(self, name: str, node: Any) -> Any:
        """`node` quantized by onnxruntime apart from the graph (its nodes and initializers),
        once: with the other nodes of its group (`_groups`), in one model of disconnected
        nodes, and cut out of the result."""
        import onnx

        if name not in self._pieces:
            if self.static and not (self.folder / static.CACHE).is_file():
                cfg = cast("Int8Static", self.cfg)  # self.static: cfg.method is int8-static
                static.calibrate(
                    self.model,
                    static.tensors(self.skeleton(), self.candidates()),
                    _packed(self.calibration),
                    cfg.calibrate_method,
                    cfg.percentile,
                    self.folder / static.CACHE,
                )
            group = self._groups().get(name, [name])
            by_name = self._nodes()
            sub, qsub = self._next(), self._next()
            onnx.save(
                _group_model(
                    self._index(), [by_name.get(n, node) for n in group], self.model.parent
                ),
                sub,
            )
            try:
                _METHODS[self.cfg.method](self, sub, qsub, [], None, False)
                quantized = onnx.load(str(qsub))
            except Exception as exc:
                raise _failed(self.cfg.method, exc) from None
            finally:
                sub.unlink()
                qsub.unlink(missing_ok=True)
            for member in group:
                out = self._next()
                onnx.save(_cut(quantized, by_name.get(member, node).output[0]), out)
                self._pieces[member] = out
        return onnx.load(str(self._pieces[name]))

    def _groups(self) -> dict[str, list[str]]:
        """Candidates quantized together, in graph order: up to GROUP_BYTES of weights, and
        never a node reading another member's output (each member is cut from the result
        as if alone). onnxruntime's per-model work (parse, shape inference, save) was most
        of a piece's cost on a small model: 724 one-node models for a 24-layer search."""
        if self._group_of is None:
            _, _, weights = self._index()
            by_name = self._nodes()
            groups: list[list[str]] = [[]]
            produced: set[str] = set()
            size = 0
            for name in self.candidates():
                node = by_name[name]
                nbytes = sum(stream.nbytes(weights[i]) for i in set(node.input) if i in weights)
                if groups[-1] and (
                    size + nbytes > GROUP_BYTES or any(i in produced for i in node.input)
                ):
                    groups.append([])
                    produced, size = set(), 0
                groups[-1].append(name)
                produced.update(node.output)
                size += nbytes
            self._group_of = {n: g for g in groups for n in g}
        return self._group_of

    def _nodes(self) -> dict[str, Any]:
        """The skeleton's nodes by name, built once."""
        if self._node_map is None:
            self._node_map = {n.name: n for n in self.skeleton().graph.node}
        return self._node_map

    def _index(self) -> tuple[Any, dict[str, Any], dict[str, Any]]:
        """The skeleton with its value infos and initializers by name, built once (per
        piece, on a 24-layer model, rebuilding them was a fifth of the piece's cost)."""
        if self._by_name is None:
            g = self.skeleton().graph
            infos = {v.name: v for v in (*g.value_info, *g.input, *g.output)}
            self._by_name = (self.skeleton(), infos, {t.name: t for t in g.initializer})
        return cast(tuple[Any, dict[str, Any], dict[str, Any]], self._by_name)

    def _spliced(self, names: list[str], shared: bool = False) -> Path:
        """The skeleton with the named nodes replaced by their quantized pieces. A piece node
        that computes what an earlier piece already does (the dynamic quantization of an
        input shared by several MatMuls: same input, same op, same outputs) is dropped.

        Written self-contained (a variant that may ship, or be sized), or with `shared` (a
        sensitivity probe: one node quantized) pointing at the FP32 weights file."""
        import onnx

        skel = self.skeleton()
        chosen = set(names)
        nodes: list[Any] = []
        produced: set[str] = set()
        named = {n.name for n in skel.graph.node if n.name not in chosen}
        inits: dict[str, Any] = {}
        for node in skel.graph.node:
            if node.name not in chosen:
                nodes.append(node)
                continue
            piece = self._piece(node.name, node)
            for q in piece.graph.node:
                if q.output and all(o in produced for o in q.output):
                    continue  # the shared input's quantization, already in the graph
                produced.update(q.output)
                if q.name in named:  # static QDQ: a quantized output read by another
                    q.name = f"{q.name}_{len(nodes)}"  # piece's input: both name a DQ
                named.add(q.name)
                nodes.append(q)
            for t in piece.graph.initializer:
                inits.setdefault(t.name, t)
        variant = _shell(skel)
        variant.graph.node.extend(nodes)
        used = {i for n in nodes for i in n.input}
        variant.graph.initializer.extend(t for t in skel.graph.initializer if t.name in used)
        names_kept = {t.name for t in variant.graph.initializer}
        variant.graph.initializer.extend(t for n, t in inits.items() if n not in names_kept)
        out = self._next()
        if shared:
            onnx.save(variant, str(out))  # its FP32 weights stay in the shared file
            return out
        external = (
            {t.name for t in variant.graph.initializer if stream.nbytes(t) > 1024}
            if self.large
            else set()
        )
        stream.save(variant, self.model.parent, out, external, out.name + ".data")
        return out


SPLICED = {"MatMul", "Gemm"}  # Gemm is a MatMul by now (_gemm_as_matmul)
GROUP_BYTES = 16 << 20  # weights quantized in one onnxruntime call (a few of gpt2's)


def _failed(method: str, exc: Exception) -> StageError:
    return Refused(
        f"onnxruntime's {method} quantizer failed: "
        f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}",
        "check that the FP32 export is finite and runs (evalcheck, parity); try another method",
    )


def _shell(model: Any) -> Any:
    """A copy of `model` without its nodes and initializers (the rest is small)."""
    import onnx

    shell = onnx.ModelProto()
    shell.CopyFrom(model)  # weightless skeleton: a small copy
    del shell.graph.node[:]
    del shell.graph.initializer[:]
    return shell


def _dynamic(
    q: Quantizer, src: Path, out: Path, exclude: list[str], only: list[str] | None, large: bool
) -> None:
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from stages.quant.perchannel import vectorized

    cfg = cast("Int8Dynamic", q.cfg)  # _METHODS: only its methods come here
    with vectorized():  # onnxruntime's result, without its per-channel loop in Python
        quantize_dynamic(
            src,
            out,
            op_types_to_quantize=cfg.op_types,
            per_channel=cfg.per_channel,
            weight_type=QuantType.QInt8,
            nodes_to_quantize=only,
            nodes_to_exclude=exclude,
            use_external_data_format=large,
        )
    # one activation scale per token, not per call: rows and positions stay independent
    model = onnx.load(str(out), load_external_data=False)
    if pertoken.rewrite(model):
        onnx.save(model, str(out))


def _static(
    q: Quantizer, src: Path, out: Path, exclude: list[str], only: list[str] | None, large: bool
) -> None:
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    cfg = cast("Int8Static", q.cfg)  # _METHODS: only its methods come here
    method = {
        "minmax": CalibrationMethod.MinMax,
        "entropy": CalibrationMethod.Entropy,
        "percentile": CalibrationMethod.Percentile,
    }[cfg.calibrate_method]
    # Ranges are calibrated once (on every candidate) and reused from the cache file.
    quantize_static(
        src,
        out,
        _Reader(q.calibration),
        quant_format=QuantFormat.QDQ,
        op_types_to_quantize=cfg.op_types,
        per_channel=cfg.per_channel,
        # Signed INT8 with zero points fixed at 0 for activations and weights: TensorRT builds
        # INT8 from these Q/DQ nodes and refuses any other zero point ("TensorRT only supports
        # symmetric quantization"); asymmetric QUInt8 activations gave zero points like 202.
        activation_type=QuantType.QInt8,
        weight_type=QuantType.QInt8,
        nodes_to_quantize=only,
        nodes_to_exclude=exclude,
        use_external_data_format=large,
        calibrate_method=method,
        calibration_cache_path=q.folder / static.CACHE,
        extra_options={
            "CalibPercentile": cfg.percentile,
            "ActivationSymmetric": True,
            "WeightSymmetric": True,
        },
    )


# MatMulNBits' accuracy_level by WeightOnly.compute: 4 runs onnxruntime's int8 kernels (each
# row's activations quantized alone, in blocks along K); 0 the float path (the weights
# dequantized, fp32 products; its 8-bit kernel is ~50x slower than 4 at one row here)
ACCURACY_LEVEL = {"int8": pertoken.INT8_PATH, "float": 0}


def _int4(
    q: Quantizer, src: Path, out: Path, exclude: list[str], only: list[str] | None, large: bool
) -> None:
    import logging

    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    cfg = cast("Int4WeightOnly | Int8WeightOnly", q.cfg)  # _METHODS: only its methods come here
    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    quantizer = MatMulNBitsQuantizer(
        onnx.load(str(src)),
        bits=8 if cfg.method == "int8-weight-only" else 4,
        block_size=cfg.block_size,
        is_symmetric=cfg.symmetric,
        accuracy_level=ACCURACY_LEVEL[cfg.compute],
        nodes_to_exclude=exclude,
        nodes_to_include=only,
        op_types_to_quantize=("MatMul",),
    )
    quantizer.process()
    quantizer.model.save_model_to_file(str(out), use_external_data_format=large)


# Each function is called only for its own methods, so it reads q.cfg as that method's spec
# (the casts at their tops).
_METHODS = {
    "int8-dynamic": _dynamic,
    "int8-static": _static,
    "int4-weight-only": _int4,
    "int8-weight-only": _int4,  # the same MatMulNBits quantizer at 8 bits
}


def _group_model(
    index: tuple[Any, dict[str, Any], dict[str, Any]], nodes: list[Any], base: Path
) -> Any:
    """A model holding the nodes, their activation inputs and their weights, apart (no
    node reads another's output); `index` is the skeleton, its value infos and its
    initializers by name."""
    from onnx import TensorProto, external_data_helper, helper

    skel, infos, weights = index

    def info(name: str) -> Any:
        return infos.get(name) or helper.make_tensor_value_info(name, TensorProto.FLOAT, None)

    names = list(dict.fromkeys(i for n in nodes for i in n.input if i))
    inits = []
    for name in names:
        if name in weights:
            tensor = copy.deepcopy(weights[name])
            if external_data_helper.uses_external_data(tensor):
                external_data_helper.load_external_data_for_tensor(tensor, str(base))
                tensor.data_location = TensorProto.DEFAULT
                del tensor.external_data[:]
            inits.append(tensor)
    # every input that is not a weight is fed: the activation, and for static QDQ's
    # activation x activation MatMul (Q K^T) the second one too
    xs = [info(i) for i in names if i not in weights]
    ys = [info(n.output[0]) for n in nodes]
    graph = helper.make_graph(list(nodes), "pieces", xs, ys, inits)
    model = helper.make_model(graph, opset_imports=skel.opset_import, ir_version=skel.ir_version)
    # cut from the pre-processed graph: say so, or onnxruntime warns once per node
    helper.set_model_props(model, {p.key: p.value for p in skel.metadata_props})
    return model


def _cut(quantized: Any, output: str) -> Any:
    """The nodes (in order) and initializers of a quantized group model that compute
    `output`: one member's piece, with the quantization of an input it shares."""
    from onnx import helper

    producer = {o: i for i, n in enumerate(quantized.graph.node) for o in n.output}
    keep: set[int] = set()
    todo = [output]
    while todo:
        i = producer.get(todo.pop())
        if i is not None and i not in keep:
            keep.add(i)
            todo.extend(quantized.graph.node[i].input)
    nodes = [quantized.graph.node[i] for i in sorted(keep)]
    used = {t for n in nodes for t in n.input}
    inits = [t for t in quantized.graph.initializer if t.name in used]
    return helper.make_model(helper.make_graph(nodes, "piece", [], [], inits))


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
    # every input with a token axis ([1, tokens], like input_ids: token_type_ids too) is
    # packed the same way, so a window's inputs stay one text's tokens and agree in shape;
    # the rest (an empty KV cache) is the first sample's
    per_token = [
        k
        for k in samples[0]
        if all(
            k in s and s[k].ndim >= 2 and s[k].shape[:2] == s["input_ids"].shape[:2]
            for s in samples
        )
    ]
    packed = {k: np.concatenate([s[k][0] for s in samples]) for k in per_token}
    width = max(shape[1] for shape in shapes)
    windows = []
    for start in range(0, packed["input_ids"].shape[0] - width + 1, width):
        window = {**samples[0], **{k: v[None, start : start + width] for k, v in packed.items()}}
        if "attention_mask" in window:
            window["attention_mask"] = np.ones_like(window["input_ids"])
        if sh.POSITIONS in window:
            window[sh.POSITIONS] = sh.positions_from_mask(np.ones_like(window["input_ids"]), width)
        windows.append(window)
    return windows


def _data_size(model: Path) -> int:
    return sum(p.stat().st_size for p in model.parent.glob(f"{model.name}.data"))


def _gemm_as_matmul(src: Path, dst: Path) -> Path:
    """Gemm(A, B, C) with constant B -> MatMul + Add, keeping the node name; saved with every
    weight in one external file (WEIGHTS) that spliced variants share. The graph is read as
    a skeleton and the weights copied file to file (only a transposed B is loaded)."""
    from onnx import helper, numpy_helper

    model = stream.skeleton(src)
    base = src.parent
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
            weight = np.ascontiguousarray(stream.array(inits[weight_name], base).T)
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
    big = {t.name for t in model.graph.initializer if stream.nbytes(t) > 1024}
    stream.save(model, base, dst, big, WEIGHTS)
    return dst
