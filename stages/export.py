"""export: torch.onnx.export with the spec's dynamic dims, then prove the dims are dynamic."""

from __future__ import annotations

import shutil
from typing import Any

from schemas import ReleaseSpec, StageError
from schemas.artifacts import Arch, DimSizes, ModelInfo, TensorInfo, VersionLock
from schemas.details import ExportDetails
from schemas.tasks import TASKS
from stages._contract import StageContext, StageIO, StageResult, in_child
from stages.onnx import exporter, grouped, stream
from stages.onnx import model as m
from stages.onnx import shapes as sh

NAME = "export"
TWO_GB = 2 << 30


def io(release: ReleaseSpec) -> StageIO:
    return StageIO(
        params=("model", "task", "export"),
        reads=(VersionLock,),  # not read: the environment it runs in; a change reruns it
        reads_model=True,
    )


def run(ctx: StageContext, release: ReleaseSpec) -> StageResult:
    config = m.model_config(release.model, ctx.root)
    _check_context(release, config)
    trace = sh.trace_sizes(release.export.dims)
    ctx.log(f"exporting with the {release.export.exporter} exporter at {trace}")
    # PyTorch in a child process: this one never imports torch, so the ONNX steps below
    # run without it and without what the tracer leaves behind (issue 14: peak memory)
    traced = in_child(_trace, ctx, release, trace)
    if traced["grouped"]:
        ctx.log(
            "grouped-query attention traced with each group's query heads as rows of one "
            "product: no copy of the keys and values per query head (stages/onnx/grouped.py)"
        )
    lay, weight_bytes, pooled = traced["layout"], traced["weight_bytes"], traced["pooling"]
    external = release.export.external_data == "always" or (
        release.export.external_data == "auto" and weight_bytes > TWO_GB
    )
    path, tied = exporter.finish(ctx, traced["raw"], lay, external)
    problems = exporter.static_axes(path, lay)
    arch = m.arch_of(config, lay)
    with stream.external_view(path) as view:  # ONNX Runtime reads the weights from the file
        probes = exporter.probe(
            ctx,
            view,
            lay,
            release.export.dims,
            trace,
            release.export.odd_sizes,
            lambda s: sh.run_bytes(lay, s, arch["hidden"], arch["heads"]),
            sh.probe_budget(weight_bytes),
        )
    problems += probes.problems
    ctx.write(
        ModelInfo(
            task=release.task,
            arch=Arch(**arch),
            parameters=traced["parameters"],
            weight_bytes=weight_bytes,
            dtype="float32",
            exporter=release.export.exporter,
            opset=release.export.opset,
            external_data=external,
            dims={k: DimSizes(**v.model_dump()) for k, v in release.export.dims.items()},
            inputs=[_tensor(t) for t in lay.inputs],
            outputs=[_tensor(t) for t in lay.outputs],
            labels=m.label_names(config) if TASKS[release.task].labels else None,
            pooling=pooled["pooling"] if pooled else None,
            normalize=pooled["normalize"] if pooled else None,
        )
    )
    shipped = _model_files(ctx, release)
    found: dict[str, Any] = {"trace_sizes": trace, "probed": probes.runs, "model_files": shipped}
    if tied:
        found["tied_weights"] = tied
    if pooled:
        found["embedding"] = pooled
    details = ExportDetails.model_validate(found).dump()
    if problems:
        return StageResult.failed(
            f"{len(problems)} dynamic-axis problem(s)", problems, details=details
        )
    size = sum(f.stat().st_size for f in ctx.work.glob("model.onnx*"))
    return StageResult.passed(
        f"{len(lay.inputs)} inputs, {len(release.export.dims)} dims symbolic, ran at "
        f"{len(probes.runs)} shapes in ONNX Runtime ({size / 1e6:.1f} MB)",
        details=details,
        metrics={"onnx_bytes": size, "shapes_run": len(probes.runs)},
    )


def _trace(ctx: StageContext, release: ReleaseSpec, trace: dict[str, int]) -> dict[str, Any]:
    """The PyTorch step, run in a child process: load the model, export it with its weights
    in a raw external data file, and say what the parent needs about the model."""
    net, lay = m.load_with_layout(ctx.root, release)
    pooled = getattr(net, "pooling", None)  # set by the embedding wrapper only
    # a grouped-query Llama-style model: its keys and values are not repeated per query
    # head in the graph (the PyTorch references elsewhere keep the model's own attention)
    switched = grouped.use(net)
    flat = m.adapter(release.task, net, lay)
    raw = exporter.trace_graph(ctx, flat, lay, release.export, trace)
    return {
        "raw": raw,
        "grouped": switched,
        "layout": lay,
        "parameters": _count(net),
        "weight_bytes": sum(p.numel() * p.element_size() for p in net.parameters()),
        "pooling": (
            {"pooling": pooled.mode, "normalize": pooled.normalize, "from": pooled.source}
            if pooled
            else None
        ),
    }


def _check_context(release: ReleaseSpec, config: dict[str, Any]) -> None:
    dims, positions = release.export.dims, m.arch(config)["positions"]
    if not positions or "sequence" not in dims:
        return
    if TASKS[release.task].kv_cache and "past_sequence" in dims:
        longest = dims["past_sequence"].max + dims["sequence"].max
        if longest > positions:
            raise StageError(
                NAME,
                f"export.dims: past_sequence.max + sequence.max = {longest} "
                f"exceeds the model's {positions} positions",
                "lower export.dims.past_sequence.max or sequence.max",
            )
    elif dims["sequence"].max > positions:
        raise StageError(
            NAME,
            f"export.dims: sequence.max = {dims['sequence'].max} exceeds the model's "
            f"{positions} positions",
            "lower export.dims.sequence.max",
        )


# What a client needs besides the graph: the model's config and its tokenizer, so that the
# bundle is self-contained (a client tokenizes with exactly what the model was built with).
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",  # transformers 5 keeps the chat template in a file of its own
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "sentencepiece.bpe.model",
    "spiece.model",
    "modules.json",
    "sentence_bert_config.json",
    "config_sentence_transformers.json",
)


def _model_files(ctx: StageContext, release: ReleaseSpec) -> list[str]:
    """Copy the config and tokenizer files of an HF folder into `model_files/`."""
    if release.model.kind != "hf":
        return []
    folder, out = ctx.root / release.model.path, ctx.work / "model_files"
    found = [name for name in MODEL_FILES if (folder / name).is_file()]
    for name in found:
        out.mkdir(exist_ok=True)
        shutil.copyfile(folder / name, out / name)
    return found


def _count(net: Any) -> int:
    return sum(p.numel() for p in net.parameters())


def _tensor(t: sh.Tensor) -> TensorInfo:
    """Every integer input keeps the values it accepts (token ids below the vocabulary,
    segment ids below type_vocab_size, masks 0/1, a declared export.inputs range): the
    server refuses a value outside with 400, the load test and the engine's inputs draw
    from it. Without it a BERT's token_type_ids were drawn from the whole vocabulary."""
    low, high = sh.accepted_range(t) if t.dtype.startswith("int") else (None, None)
    return TensorInfo(name=t.name, dtype=t.dtype, axes=list(t.axes), low=low, high=high)
