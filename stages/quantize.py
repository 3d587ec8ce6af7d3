"""quantize: PTQ on real calibration data: one method with per-node sensitivity and mixed
precision, or (method auto) a recipe search (stages/quant/recipes.py)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from schemas import ReleaseSpec
from schemas.artifacts import CalibrationUsed, FloatNode, ModelInfo, QuantInfo
from schemas.contract import budget_of
from schemas.quantsearch import (
    CalibrationSummary,
    FusedDetails,
    LayerPlotRow,
    LayerRow,
    PerNodeDetails,
    RecipeSearchDetails,
    SensitivityRow,
)
from schemas.spec.quantization import AccuracyBudget, dtype_of
from schemas.tasks import TASKS
from stages._contract import Plot, StageContext, StageIO, StageResult, link_or_copy, write_json
from stages.onnx import model as m
from stages.quant import accuracy as acc
from stages.quant import calibration as calib
from stages.quant import recipes, search
from stages.quant.methods import Quantizer

if TYPE_CHECKING:
    from schemas.spec.quantization import AutoQuantization, Quantization

NAME = "quantize"
LAYER_PLOT = Plot(
    name="layer_snr",
    file="plots/layer_snr.json",
    x="layer",
    y="snr_db",
    title="Quantization error per layer (SNR, FP32 vs quantized; higher is better)",
    x_label="module, in execution order",
    y_label="SNR (dB)",
)


def io(release: ReleaseSpec) -> StageIO:
    q = release.quantization
    cal = getattr(q, "calibration", None)
    return StageIO(
        # auto times a decode step at the served batch; declared for every method, since
        # one dvc.yaml template serves every release (an auto release beside an explicit one)
        params=("task", "model", "export", "quantization", "bundle.serving.max_batch_size"),
        reads=(ModelInfo,),
        upstream=("export/model.onnx",),
        # `graph: fused` rebuilds the decoder from the checkpoint (declared for every
        # method: one dvc.yaml template; pin's lock.json, which hashes the model's files)
        reads_model=True,
        data=(
            ("calibration", cal.path if cal else None),
            ("tokenizer", cal.tokenizer if cal else None),
        ),
        plots=() if q.method == "none" else (LAYER_PLOT,),
    )


def run(ctx: StageContext, release: ReleaseSpec) -> StageResult:
    q, export = release.quantization, ctx.upstream("export")
    if q.method == "none":
        for f in export.glob("model.onnx*"):
            link_or_copy(f, ctx.work / f.name)
        ctx.write(_info(q, [], None))
        ctx.write(CalibrationUsed())
        return StageResult.passed("method none: the FP32 model ships unchanged")
    # the fused graph first, while the stage holds nothing else: its builder's child peaks
    # at 1.95x the checkpoint, and beside the samples and sessions held later the stage's
    # process tree reached 4.5x (llama-30)
    built = _prebuild(ctx, release, q)
    info = ctx.read(ModelInfo)
    lay = m.layout_from_info(info)
    samples = calib.load(
        ctx.root, q.calibration, release.task, lay, release.export.dims, info.arch.vocab
    )
    pre, fallback = search.preprocess(ctx, export / "model.onnx")
    if fallback:
        ctx.log(fallback)
    budget = budget_of(q, release.task)  # the accuracy contract evaluate applies too
    if q.method == "auto":
        return _auto(ctx, release, q, pre, fallback, samples, budget, export, built)
    if getattr(q, "graph", "traced") == "fused":
        return _fused(ctx, q, pre, fallback, samples, budget, export, built)
    quantizer = Quantizer(pre, q, samples.calibration, ctx.work / "_variants")
    probe = samples.calibration[: q.calibration.sensitivity_samples]
    greedy = budget.greedy_agreement_min is not None  # costs generation: only when asked
    evaluate = search.Evaluator(release.task, pre, probe, greedy)
    refine = max(2 * q.max_float_nodes, search.REFINE_MIN)
    ranked = search.sensitivity(ctx, quantizer, evaluate, refine)
    chosen, trace = search.mixed_precision(ctx, quantizer, evaluate, ranked, q, budget)
    held = search.Evaluator(release.task, pre, samples.holdout, greedy=True)(chosen.path)
    details = PerNodeDetails(
        calibration=_calibration(samples),
        sensitivity=ranked,
        selection=trace,
        holdout=held,
        float_nodes=chosen.excluded,
        layerwise=search.layerwise(pre, chosen.path, samples.holdout[0]),
        preprocess=fallback or "quant_pre_process with symbolic shape inference",
        budget=budget,
    )
    metrics = {f"holdout_{k}": v for k, v in held.items()}
    write_json(ctx.work / LAYER_PLOT.file, _layer_rows(details.layerwise or []))
    if not chosen.ok:
        return StageResult.failed(
            f"accuracy budget not met with the cap of {q.max_float_nodes} float node(s)",
            [
                f"best on calibration samples with {len(chosen.excluded)} node(s) in float: "
                f"{'; '.join(chosen.broken)}. Raise quantization.max_float_nodes, relax "
                "quantization.budget, or choose a gentler method"
            ],
            details=details.model_dump(),
            metrics=metrics,
        )
    broken = acc.violations(budget, held)
    if broken:
        return StageResult.failed(
            "held-out samples break the accuracy budget",
            [
                f"held-out: {'; '.join(broken)} (calibration samples passed; "
                "add calibration data that covers the held-out inputs)"
            ],
            details=details.model_dump(),
            metrics=metrics,
        )
    details.size = sizes = search.publish(ctx, chosen.path, export)
    gains = search.gains_nothing(q, chosen.excluded, ranked, sizes.ratio)
    if gains:
        return StageResult.failed(
            f"{q.method} gains nothing worth shipping: {gains}",
            [f"{gains}. {search.REMEDIES}"],
            details=details.model_dump(),
            metrics={**metrics, "size_ratio": sizes.ratio},
        )
    ctx.write(_info(q, chosen.excluded, ranked, budget))
    ctx.write(CalibrationUsed(path=samples.source, sha256=samples.sha256))
    shutil.rmtree(ctx.work / "_variants")
    shutil.rmtree(pre.parent)
    return StageResult.passed(
        f"{dtype_of(q.method)} ({q.method}), {len(chosen.excluded)} of {len(ranked)} node(s) "
        f"kept in float; held-out {search.brief(held)}; size {sizes.ratio:.2f}x FP32"
        + (" (pre-processed without symbolic shape inference)" if fallback else ""),
        details=details.model_dump(),
        metrics={**metrics, "size_ratio": sizes.ratio},
    )


def _fused(
    ctx: StageContext,
    q: Quantization,
    pre: Path,
    fallback: str,
    samples: calib.Samples,
    budget: AccuracyBudget,
    export: Path,
    built: Path | Exception | None,
) -> StageResult:
    """A weight-only method with `graph: fused`: the decoder rebuilt from the checkpoint by
    onnxruntime-genai's builder (stages/onnx/fused.py), every projection quantized, held to
    the budget against the FP32 export on the calibration probe and the held-out samples,
    as the traced graph is. Nothing can be kept in float: a budget it breaks is a failure
    that names `graph: traced`, whose search can."""
    from schemas.spec.quantization import WeightOnly
    from stages.onnx import fused

    assert isinstance(q, WeightOnly)  # the spec rules: graph fused is a weight-only field
    if not isinstance(built, Path):
        exc = built if isinstance(built, fused.FusedError) else fused.FusedError("not built", "")
        return StageResult.failed(
            "quantization.graph fused: the fused graph could not be built",
            [f"{exc.reason}: {exc.fix}"],
        )
    path, where = built, built.parent
    cal = q.calibration
    details = FusedDetails(
        calibration=_calibration(samples),
        budget=budget,
        preprocess=fallback or "quant_pre_process with symbolic shape inference",
        builder=fused.builder_of(path),
        kernels=fused.describe(path),
        probe={},
        holdout={},
    )
    greedy = budget.greedy_agreement_min is not None
    probe = samples.calibration[: cal.sensitivity_samples]
    details.probe = search.Evaluator("causal-lm", pre, probe, greedy)(path, greedy)
    broken = acc.violations(budget, details.probe)
    if not broken:
        details.holdout = search.Evaluator("causal-lm", pre, samples.holdout, greedy=True)(path)
        broken = [f"held-out: {b}" for b in acc.violations(budget, details.holdout)]
    metrics = {f"holdout_{k}": v for k, v in details.holdout.items()}
    if broken:
        return StageResult.failed(
            "the fused graph breaks the accuracy budget",
            [
                f"{'; '.join(broken)}: the fused graph quantizes every projection; use "
                "`graph: traced`, whose search keeps the most damaging layers in float, or "
                "an 8-bit method"
            ],
            details=details.model_dump(),
            metrics=metrics,
        )
    details.size = sizes = search.publish(ctx, path, export)
    shutil.rmtree(where)
    shutil.rmtree(pre.parent)
    write_json(ctx.work / LAYER_PLOT.file, [])  # no per-layer pairing: other nodes, other names
    ctx.write(_info(q, [], None, budget))
    ctx.write(CalibrationUsed(path=samples.source, sha256=samples.sha256))
    return StageResult.passed(
        f"{dtype_of(q.method)} ({q.method}), fused graph ({sum(details.kernels.values())} "
        f"kernels, {details.builder}); held-out {search.brief(details.holdout)}; size "
        f"{sizes.ratio:.2f}x FP32",
        details=details.model_dump(),
        metrics={**metrics, "size_ratio": sizes.ratio},
    )


FUSED_RECIPE = "int4-weight-only-fused"


def _prebuild(ctx: StageContext, release: ReleaseSpec, q: Quantization) -> Path | Exception | None:
    """The fused graph a release asks for (`graph: fused`, or the auto recipe), built into
    ctx.work/_fused; the FusedError when it cannot be; None when none is asked for."""
    from stages.onnx import fused

    if getattr(q, "graph", "traced") == "fused":
        cfg: Any = q
    elif q.method == "auto" and FUSED_RECIPE in q.recipes:
        cfg = recipes.concrete(q, FUSED_RECIPE)
    else:
        return None
    try:
        return _fused_builder(ctx, release)(cfg, ctx.work / "_fused")
    except fused.FusedError as exc:
        return exc


def _fused_builder(ctx: StageContext, release: ReleaseSpec) -> Callable[[Any, Path], Path]:
    """Builds a weight-only config's fused graph into a folder from the release's checkpoint
    (stages/onnx/fused.py; FusedError when it cannot: another family, another task)."""
    from schemas.spec.model import HfModel
    from stages.onnx import fused

    def build(cfg: Any, folder: Path) -> Path:
        if not TASKS[release.task].kv_cache or not isinstance(release.model, HfModel):
            raise fused.FusedError(
                f"a fused graph is a causal-lm decoder from a Hugging Face folder, not task "
                f"{release.task} ({release.model.kind})",
                "use `graph: traced`",
            )
        tokenizer = cfg.calibration.tokenizer
        return fused.build(
            ctx.root / release.model.path,
            folder,
            bits=4 if cfg.method == "int4-weight-only" else 8,
            block_size=cfg.block_size,
            symmetric=cfg.symmetric,
            accuracy_level=4 if cfg.compute == "int8" else 0,
            tokenizer=ctx.root / tokenizer if tokenizer else None,
            log=ctx.work / "fused_builder.log",
        )

    return build


def _prebuilt(built: Path | Exception | None) -> Path:
    """The search's fused recipe: the graph `_prebuild` left, or its FusedError again."""
    from stages.onnx import fused

    if isinstance(built, Path):
        return built
    raise built if isinstance(built, fused.FusedError) else fused.FusedError("not built", "")


def _auto(
    ctx: StageContext,
    release: ReleaseSpec,
    q: AutoQuantization,
    pre: Path,
    fallback: str,
    samples: calib.Samples,
    budget: AccuracyBudget,
    export: Path,
    built: Path | Exception | None = None,
) -> StageResult:
    """method auto: the recipe search (stages/quant/recipes.py); its table is the report.
    `built`: the fused recipe's graph, built first (`_prebuild`), or why it could not be."""
    probe = samples.calibration[: q.calibration.sensitivity_samples]
    fp32 = search.session_for(pre)  # one session: references and decode feeds
    searcher = recipes.Search(
        ctx,
        pre,
        q,
        samples,
        budget,
        search.Evaluator(release.task, fp32, probe, greedy=True),
        search.Evaluator(release.task, fp32, samples.holdout, greedy=True),
        sum(f.stat().st_size for f in export.glob("model.onnx*")),
        _served_rows(release),
        fp32,
        lambda cfg, folder: _prebuilt(built),
    )
    del fp32  # not held while variants are built and measured (peak memory)
    outcome = searcher.run()
    details = RecipeSearchDetails(
        calibration=_calibration(samples),
        recipes=outcome.table,
        fp32=outcome.fp32,
        budget=budget,
        budget_with_margin=recipes.tightened(budget, q.margin),
        preprocess=fallback or "quant_pre_process with symbolic shape inference",
    )
    if (not outcome.ok or outcome.path is None) and q.fallback == "fp32":
        return _fp32_fallback(ctx, q, pre, export, outcome, details, samples)
    if not outcome.ok or outcome.path is None:
        return StageResult.failed(
            recipes.no_recipe_headline(outcome.table),
            [
                f"{'; '.join(outcome.broken)}. Relax quantization.budget or "
                "quantization.margin, lower quantization.min_speedup (0: ship INT8 even when "
                "slower), add recipes, or add calibration data that covers the held-out "
                "inputs; method none ships FP32"
            ],
            details=details.model_dump(),
        )
    # a fused graph's nodes are not the export's: no layer pairs them (an empty plot)
    fused = recipes.RECIPES[outcome.recipe][1].get("graph") == "fused"
    details.layerwise = [] if fused else search.layerwise(pre, outcome.path, samples.holdout[0])
    write_json(ctx.work / LAYER_PLOT.file, _layer_rows(details.layerwise))
    details.size = sizes = search.publish(ctx, outcome.path, export)
    metrics = {f"holdout_{k}": v for k, v in outcome.holdout.items()}
    metrics["size_ratio"] = sizes.ratio
    if sizes.ratio > q.max_size_ratio:  # measured in the search; checked on what ships
        return StageResult.failed(
            f"recipe {outcome.recipe} gains nothing worth shipping",
            [
                f"the quantized file is {sizes.ratio:.2f}x the FP32 file, above "
                f"quantization.max_size_ratio {q.max_size_ratio:g}. {search.REMEDIES}"
            ],
            details=details.model_dump(),
            metrics=metrics,
        )
    why = ", ".join(outcome.float_classes)
    ctx.write(
        QuantInfo(
            method=outcome.method,
            dtype=dtype_of(outcome.method),
            float_nodes=[
                FloatNode(node=n, why=f"its layer class ({why}) kept in float by the recipe search")
                for n in outcome.excluded
            ],
            recipes=[r.shipped() for r in outcome.table],
            budget=budget.model_dump(exclude_none=True),
            margin=q.margin,
        )
    )
    ctx.write(CalibrationUsed(path=samples.source, sha256=samples.sha256))
    shutil.rmtree(ctx.work / "_variants", ignore_errors=True)
    shutil.rmtree(ctx.work / "_fused", ignore_errors=True)
    shutil.rmtree(pre.parent)
    chosen = next(r for r in outcome.table if r.chosen)
    details.chosen = outcome.recipe
    return StageResult.passed(
        f"recipe {outcome.recipe} ({dtype_of(outcome.method)})"
        + (f" with {why} in float" if why else "")
        + f"; held-out {search.brief(outcome.holdout)}; size {sizes.ratio:.2f}x FP32, "
        f"{chosen.speedup:.2f}x FP32 speed ("
        + ", ".join(f"{k} {v:.2f}x" for k, v in chosen.speedups.items())
        + ")",
        details=details.model_dump(),
        metrics=metrics,
    )


def _fp32_fallback(
    ctx: StageContext,
    q: AutoQuantization,
    pre: Path,
    export: Path,
    outcome: recipes.Outcome,
    details: RecipeSearchDetails,
    samples: calib.Samples,
) -> StageResult:
    """quantization.fallback fp32: no recipe is accurate, fast and small enough, so the FP32
    export ships unchanged (it meets every accuracy bound), and the report, QuantInfo and
    the model card say why, recipe by recipe."""
    why = recipes.no_recipe_headline(outcome.table)
    for f in export.glob("model.onnx*"):
        link_or_copy(f, ctx.work / f.name)
    write_json(ctx.work / LAYER_PLOT.file, [])  # nothing quantized: no layer lost anything
    ctx.write(
        QuantInfo(
            method="none",
            dtype=dtype_of("none"),
            float_nodes=[],
            recipes=[r.shipped() for r in outcome.table],
            budget=details.budget.model_dump(exclude_none=True),
            margin=q.margin,
        )
    )
    ctx.write(CalibrationUsed(path=samples.source, sha256=samples.sha256))
    shutil.rmtree(ctx.work / "_variants", ignore_errors=True)
    shutil.rmtree(ctx.work / "_fused", ignore_errors=True)
    shutil.rmtree(pre.parent, ignore_errors=True)
    details.fallback = why
    ctx.log(f"{why}: the FP32 model ships (quantization.fallback fp32)")
    return StageResult.passed(
        f"FP32 ships: {why} (quantization.fallback fp32; `fail` fails the stage instead)",
        details=details.model_dump(),
        metrics={"size_ratio": 1.0},
    )


def _served_rows(release: ReleaseSpec) -> int:
    """The batch the bundle serves: bundle.serving.max_batch_size, else the export's max."""
    batch = release.export.dims.get("batch")
    return release.bundle.serving.max_batch_size or (batch.max if batch else 1)


def _calibration(samples: calib.Samples) -> CalibrationSummary:
    return CalibrationSummary(
        path=samples.source,
        sha256=samples.sha256,
        samples=len(samples.calibration),
        holdout=len(samples.holdout),
    )


def _layer_rows(layers: list[LayerRow]) -> list[dict[str, Any]]:
    """The per-layer SNR as DVC plot rows (x: position in execution order)."""
    return [
        LayerPlotRow(
            layer=i,
            module=row.module,
            snr_db=row.snr_db,
            worst_channel_snr_db=row.worst_channel_snr_db,
        ).model_dump()
        for i, row in enumerate(layers)
    ]


def _info(
    q: Quantization,
    float_nodes: list[str],
    ranked: list[SensitivityRow] | None,
    budget: AccuracyBudget | None = None,
) -> QuantInfo:
    why = {
        r.node: f"rank {i + 1} of {len(ranked or [])} by sensitivity, SNR {r.snr_db:.1f} dB "
        "when quantized alone"
        for i, r in enumerate(ranked or [])
        if r.snr_db is not None  # only nodes measured alone can be kept in float
    }
    return QuantInfo(
        method=q.method,
        dtype=dtype_of(q.method),
        float_nodes=[FloatNode(node=n, why=why[n]) for n in float_nodes],
        # an explicit method keeps nodes in float until the bounds themselves hold: no margin
        budget=budget.model_dump(exclude_none=True) if budget else None,
        margin=0.0 if budget else None,
    )
