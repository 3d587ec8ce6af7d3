"""The quantize stage's search: pre-processing (with the BERT fallback), per-node sensitivity,
mixed precision under the budget, the layer-by-layer view, and the checks that a result is
worth shipping."""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from schemas import Refused
from schemas.quantsearch import FileSize, LayerRow, SelectionRow, SensitivityRow
from schemas.tasks import TASKS
from stages._contract import StageContext
from stages.onnx.graph import all_tensors, node_scope
from stages.quant import accuracy as acc
from stages.quant import pertoken
from stages.quant.methods import Quantizer

if TYPE_CHECKING:
    from schemas.spec.quantization import AccuracyBudget, QuantizedBase

REMEDIES = (
    "Try quantization.per_channel: true (per-tensor scales can be far worse on encoders), "
    "method int8-static with calibration data, or relax quantization.budget; or raise "
    "quantization.max_size_ratio if a smaller gain is worth shipping"
)


def gains_nothing(
    q: QuantizedBase, excluded: list[str], ranked: list[SensitivityRow], ratio: float
) -> str:
    """Why a quantized model that passes its budget is still not worth shipping ("" if it is):
    mixed precision kept every quantizable node in float (FP32 in all but name), or the file
    is not smaller than quantization.max_size_ratio x FP32."""
    if ranked and len(excluded) >= len(ranked):
        return (
            f"mixed precision kept all {len(ranked)} quantizable node(s) in float to meet the "
            f"budget, so the model ships as FP32 in all but name ({ratio:.2f}x FP32)"
        )
    if ratio > q.max_size_ratio:
        return (
            f"the quantized file is {ratio:.2f}x the FP32 file, above "
            f"quantization.max_size_ratio {q.max_size_ratio:g}"
        )
    return ""


def brief(metrics: dict[str, float]) -> str:
    keys = ("top1_agreement", "greedy_agreement", "logit_cosine", "perplexity_increase")
    return ", ".join(f"{k} {metrics[k]:.4g}" for k in keys if k in metrics)


def preprocess(ctx: StageContext, model: Path) -> tuple[Path, str]:
    """onnxruntime's quantization pre-processing (symbolic shape inference, ONNX Runtime's
    basic graph optimization, ONNX shape inference), done the way `quant_pre_process` does
    it but without the weights in Python: the shape passes see the graph's `skeleton`
    (weights as byte ranges of the export file) and ONNX Runtime writes the optimized graph
    with its weights in one external file (`model.onnx.data`). `quant_pre_process` parses
    and copies the whole model several times: 4.4 GB peak on gpt2-small's 0.5 GB.

    Symbolic shape inference fails on BERT-family graphs ("unsupported broadcast between
    Min(512, sequence) sequence"); ONNX's own shape inference handles them, and the
    quantizers only need the shapes of the nodes they touch. So on that failure it runs
    again without it and says so (the second string; "" when not needed).
    """
    out = ctx.work / "_pre" / "model.onnx"
    first = ""
    for skip in (False, True):
        shutil.rmtree(out.parent, ignore_errors=True)
        out.parent.mkdir()
        scratch = ctx.work / "_pre_scratch"
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir()
        try:
            # anything the passes write or read by relative path stays in the scratch folder
            with contextlib.chdir(scratch):
                _preprocess(model.resolve(), scratch.resolve(), out.resolve(), skip)
        except Exception as exc:  # symbolic shape inference raises assorted types
            if skip:
                raise Refused(
                    f"quantization pre-processing failed with symbolic shape inference "
                    f"({first}) and without it ({' '.join(str(exc).split())[:200]})",
                    "the exported graph needs shapes ONNX or ONNX Runtime can infer",
                ) from None
            first = " ".join(str(exc).split())[:200]
            continue
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        if skip:
            return out, (
                f"symbolic shape inference failed ({first}); pre-processed with ONNX shape "
                "inference instead (skip_symbolic_shape)"
            )
        return out, ""
    raise AssertionError("unreachable")


PRE_DATA = "model.onnx.data"
SHAPED = "shipyard-shaped.onnx"  # the skeleton with its shapes, beside the export's files


def _preprocess(model: Path, scratch: Path, out: Path, skip_symbolic: bool) -> None:
    """The three passes of quant_pre_process on `model`, written to `out` + PRE_DATA."""
    import onnx
    import onnxruntime as ort
    from onnxruntime.quantization.quant_utils import add_pre_process_metadata

    from stages.onnx import stream

    skel = stream.skeleton(model)  # weights: byte ranges of the export's files
    files = stream.data_files(skel, model)
    # the export's files (linked or copied) in a folder of their own, beside the skeleton;
    # what ONNX Runtime writes goes to another, so it can never write through a link into
    # the export (whose data file may well be named model.onnx.data too)
    src, opt = scratch / "src", scratch / "opt"
    src.mkdir()
    opt.mkdir()
    for name in files:
        if Path(name).name != name or name in ("", ".", "..", SHAPED):
            raise ValueError(f"{model}: external data location {name!r} is not a file name")
        source, target = model.parent / name, src / name
        if skip_symbolic:  # ONNX Runtime and infer_shapes_path read it: a link will do
            with contextlib.suppress(OSError):
                os.link(source, target)
        if not target.exists():
            # symbolic shape inference reads some constants through onnx, which refuses
            # external data in a file with several hard links ("potential hardlink
            # attack"): a copy (on disk, not in memory)
            shutil.copyfile(source, target)
    if not skip_symbolic:
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

        with contextlib.chdir(src):  # onnx resolves the constants it reads from here
            skel = SymbolicShapeInference.infer_shapes(skel, 2**31 - 1, False, False, 0)
    shaped = src / SHAPED
    shaped.write_bytes(skel.SerializeToString())
    del skel
    optimized = opt / "optimized.onnx"
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.optimized_model_filepath = str(optimized)
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.add_session_config_entry(
        "session.optimized_model_external_initializers_file_name", PRE_DATA
    )
    options.add_session_config_entry(
        "session.optimized_model_external_initializers_min_size_in_bytes", "1024"
    )
    ort.InferenceSession(str(shaped), options, providers=["CPUExecutionProvider"])
    inferred = opt / "inferred.onnx"
    onnx.shape_inference.infer_shapes_path(str(optimized), str(inferred))
    result = onnx.load(str(inferred), load_external_data=False)
    for tensor in result.graph.initializer:  # ORT's external writer sets an empty doc_string
        if tensor.HasField("doc_string") and not tensor.doc_string:
            tensor.ClearField("doc_string")
    add_pre_process_metadata(result)
    onnx.save(result, str(out))
    if (opt / PRE_DATA).exists():  # absent when every weight is small enough to inline
        os.replace(opt / PRE_DATA, out.parent / PRE_DATA)


class Evaluator:
    """Compares a quantized variant with the FP32 graph on fixed samples; with `greedy`, also
    on text FP32 generated from them (greedy agreement, language models only).

    The FP32 outputs are kept on disk, one file a sample, and compared one sample at a time
    (acc.Agreement): a model's logits over its samples are vocabulary x tokens x samples
    floats (0.4 GB for GPT-2 on 32 samples of 64 tokens), which held in memory, and copied
    to float64 for the comparison, were most of the stage's peak."""

    def __init__(
        self, task: str, fp32: Path | Any, samples: list[dict[str, Any]], greedy: bool = False
    ) -> None:
        import tempfile

        self.task, self.samples = task, samples
        self._store = tempfile.TemporaryDirectory(prefix="shipyard-reference-")
        session: Any = session_for(fp32) if isinstance(fp32, Path) else fp32
        name = session.get_outputs()[0].name
        for i, feeds in enumerate(samples):
            out = session.run([name], feeds)[0]
            if not np.all(np.isfinite(out)):
                raise Refused(
                    f"the FP32 model's output on calibration sample {i + 1} is not finite "
                    "(NaN or inf): there is nothing to quantize against",
                    "fix the checkpoint (NaN weights?); evalcheck and parity should fail too",
                )
            np.save(self._reference(i), out)
        self.generated = (
            acc.greedy_continuations(session, samples)
            if greedy and TASKS[task].language_model
            else []
        )
        # the texts may run right-padded only where padding leaves a row its own (a
        # non-causal graph reaches quantize before kvcheck stops it)
        texts = [feeds for feeds, _ in self.generated]
        _, padded = acc.pass_groups(session, texts)
        self._inert = not padded or acc.padding_is_inert(session, texts)

    def _reference(self, i: int) -> Path:
        return Path(self._store.name) / f"{i}.npy"

    def __call__(
        self, model: Path | Any, greedy: bool = True, together: bool | None = None
    ) -> dict[str, float]:
        """The metrics of a variant: its file, or a session already open on it (creating a
        session is 0.4 s on a 24-layer model; a search measures one variant three ways);
        without `greedy`, no greedy agreement (a ranking that reads only the SNR).
        `together`: whether the variant's rows are independent (pertoken.rows_independent;
        read from its file when not given, else False), so that its greedy text runs in
        right-padded batches where FP32's padding is inert: the same count as one text a
        run."""
        session: Any = session_for(model) if isinstance(model, Path) else model
        name = session.get_outputs()[0].name
        agree = acc.Agreement(self.task)
        for i, feeds in enumerate(self.samples):
            agree.add(np.load(self._reference(i)), session.run([name], feeds)[0], feeds)
        out = agree.result()
        if self.generated and greedy:
            if together is None:  # read from its file only when its text is measured
                together = isinstance(model, Path) and pertoken.rows_independent(model)
            batched = together and self._inert
            agreement = acc.teacher_forced_together if batched else acc.greedy_agreement
            out["greedy_agreement"] = agreement(session, self.generated)
        return out


def session_for(path: Path) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3  # unused-initializer notices from quantized graphs
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


REFINE_MIN = 16  # nodes measured alone at least (all of them in a model this small)


def sensitivity(
    ctx: StageContext, quantizer: Quantizer, evaluate: Evaluator, refine: int = REFINE_MIN
) -> list[SensitivityRow]:
    """Candidates ranked by the damage they do, most damaging (lowest SNR) first.

    Up to `refine` nodes, each is quantized alone and evaluated end to end. Beyond that, one
    instrumented pass of the fully quantized model ranks every node by its *local* error (its
    quantized output against its FP32 weight applied to the same quantized-model input, so
    upstream error does not count against it; `local_snr`), and only the `refine` worst are measured
    alone: the cost stops growing with depth. Rows say which way they were measured."""
    scopes = {n.name: node_scope(n) for n in quantizer.skeleton().graph.node}
    nodes = quantizer.candidates()
    if not nodes:
        raise Refused(
            f"no node of types {quantizer.cfg.op_types} to quantize",
            "check quantization.op_types against the exported graph",
        )
    local: dict[str, float] = {}
    if len(nodes) > refine:
        full = quantizer.quantize()
        local = local_snr(quantizer, full, nodes, evaluate.samples[0])
        _remove(full)
        ctx.log(f"one pass ranked {len(nodes)} nodes by local SNR; refining the {refine} worst")
    chosen = sorted(nodes, key=lambda n: local[n])[:refine] if local else nodes
    rows: list[tuple[float, SensitivityRow]] = []
    with ctx.progress(f"sensitivity of {len(chosen)} nodes", len(chosen)) as advance:
        for node in chosen:
            path = quantizer.alone(node)
            metrics = evaluate(path)
            row = SensitivityRow.model_validate(
                {
                    "node": node,
                    "module": scopes.get(node, ""),
                    "measured": "alone",
                    **metrics,
                    "local_snr_db": local.get(node),
                }
            )
            rows.append((acc.score(metrics), row))
            _remove(path)
            advance()
    rest = [
        SensitivityRow(node=n, module=scopes.get(n, ""), measured="one pass", local_snr_db=local[n])
        for n in sorted(set(nodes) - set(chosen), key=lambda n: local[n])
    ]
    return [row for _, row in sorted(rows, key=lambda scored: scored[0])] + rest


def local_snr(
    quantizer: Quantizer, quantized: Path, nodes: list[str], feeds: dict[str, Any]
) -> dict[str, float]:
    """Each node's own quantization error in one run of the quantized model: the mean
    per-channel SNR of its output against x @ W_fp32, x being the input it saw there (one
    SNR over the tensor let outlier channels hide the crushed ones: an up_proj with
    outlier rows ranked 22 dB locally and did the most damage end to end)."""
    from stages.onnx import stream
    from stages.onnx.graph import marked_runs

    graph = quantizer.skeleton().graph
    by_name = {n.name: n for n in graph.node}
    weights = {t.name: t for t in graph.initializer}
    # a static-QDQ candidate may multiply two activations (attention's Q K^T): both marked
    names = list(
        dict.fromkeys(
            t
            for n in nodes
            for t in (*by_name[n].input[:3], by_name[n].output[0])
            if t and t not in weights
        )
    )
    values = next(marked_runs(quantized, names, [feeds]))

    def value(t: str) -> np.ndarray:
        return stream.array(weights[t], quantizer.model.parent) if t in weights else values[t]

    out = {}
    for name in nodes:
        node = by_name[name]
        reference = _product(node, value)
        out[name] = acc.mean_channel_snr_db(reference, values[node.output[0]])
    return out


def _product(node: Any, value: Any) -> np.ndarray:
    """What the FP32 node computes from its inputs' values (MatMul, or Gemm with its
    transposes, alpha, beta and bias: static QDQ keeps Gemm as it is)."""
    from onnx import helper

    a, b = value(node.input[0]), value(node.input[1])
    if node.op_type != "Gemm":
        return cast(np.ndarray, a @ b)
    attrs = {x.name: helper.get_attribute_value(x) for x in node.attribute}
    a = a.T if attrs.get("transA", 0) else a
    b = b.T if attrs.get("transB", 0) else b
    out = attrs.get("alpha", 1.0) * (a @ b)
    if len(node.input) > 2 and node.input[2]:
        out = out + attrs.get("beta", 1.0) * value(node.input[2])
    return cast(np.ndarray, out)


@dataclass(frozen=True)
class Choice:
    """A mixed-precision variant: its file, the nodes it keeps in float, and whether it meets
    the budget on the calibration probe (else the bounds it breaks)."""

    path: Path
    excluded: list[str]
    ok: bool
    broken: list[str]
    score: float


def mixed_precision(
    ctx: StageContext,
    quantizer: Quantizer,
    evaluate: Evaluator,
    ranked: list[SensitivityRow],
    q: QuantizedBase,
    budget: AccuracyBudget,
) -> tuple[Choice, list[SelectionRow]]:
    """Keep the k most sensitive nodes in float, k = 0, 1, ... until the budget holds."""
    trace: list[SelectionRow] = []
    best: Choice | None = None
    for k in range(min(q.max_float_nodes, len(ranked)) + 1):
        excluded = [r.node for r in ranked[:k]]
        path = quantizer.quantize(exclude=excluded)
        metrics = evaluate(path)
        broken = acc.violations(budget, metrics)
        trace.append(
            SelectionRow.model_validate({"float_nodes": k, **metrics, "meets_budget": not broken})
        )
        ctx.log(f"{k} node(s) in float: {brief(metrics)}{' (meets budget)' if not broken else ''}")
        current = Choice(path, excluded, not broken, broken, acc.score(metrics))
        if best is None or not broken or current.score > best.score:
            best = current
        if not broken:
            break
    assert best is not None
    return best, trace


def layerwise(fp32: Path, quant: Path, feeds: dict[str, Any]) -> list[LayerRow]:
    """Where error enters: SNR of each module's last tensor, FP32 vs quantized, in order.

    The worst channel's SNR finds an outlier-dominated layer whose overall SNR looks fine
    (one huge channel carries the energy while the scale crushes the others).
    """
    import onnx

    ref, got = all_tensors(fp32, feeds), all_tensors(quant, feeds)
    last: dict[str, str] = {}
    for node in onnx.load(str(fp32), load_external_data=False).graph.node:
        scope = node_scope(node)
        for out in node.output:
            if (
                scope
                and out in ref
                and out in got
                and ref[out].shape == got[out].shape
                and ref[out].dtype.kind == "f"
                and ref[out].ndim >= 1
                # attention's scores padded with -inf (stages/onnx/invariant.py): no SNR
                and bool(np.isfinite(ref[out]).all())
            ):
                last[scope] = out
    return [
        LayerRow(
            module=scope,
            tensor=t,
            snr_db=acc.snr_db(ref[t], got[t]),
            worst_channel_snr_db=acc.worst_channel_snr_db(ref[t], got[t]),
        )
        for scope, t in last.items()
    ]


def publish(ctx: StageContext, path: Path, export: Path) -> FileSize:
    data = path.with_name(path.name + ".data")
    os.replace(path, ctx.work / "model.onnx")
    if data.exists():
        os.replace(data, ctx.work / "model.onnx.data")
        _relocate(ctx.work / "model.onnx", data.name)
    size = sum(f.stat().st_size for f in ctx.work.glob("model.onnx*"))
    fp32 = sum(f.stat().st_size for f in export.glob("model.onnx*"))
    return FileSize(bytes=size, fp32_bytes=fp32, ratio=size / fp32)


def _relocate(model: Path, old: str) -> None:
    """Point external-data references at the renamed side file."""
    import onnx

    proto = onnx.load(str(model), load_external_data=False)
    for tensor in proto.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location" and entry.value == old:
                entry.value = "model.onnx.data"
    onnx.save_model(proto, str(model))


def _remove(path: Path) -> None:
    for f in path.parent.glob(path.name + "*"):
        f.unlink()
