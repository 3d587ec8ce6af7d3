"""evaluate: task metrics of the shipped model vs the FP32 export, with thresholds.

The reference is the FP32 ONNX graph quantize judged its recipes against, the export that
parity and kvcheck proved equal to PyTorch (at every shape, and through its cache): one
accuracy contract with one reference. PyTorch was the reference before; its greedy decoding
for the contract, a module at a time with the checkpoint paged out after each (memory), was
30 of 49 s on a 30-layer decoder (issue 40: evaluate's goal is 3 FP32 passes)."""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from schemas import ReleaseSpec
from schemas.artifacts import Evaluation, ModelInfo
from schemas.contract import BUDGET_METRICS, budget_of
from schemas.details import EvaluateDetails, ThresholdResult
from schemas.tasks import METRIC_SOURCES, TASKS
from stages._contract import StageContext, StageIO, StageResult
from stages.onnx import fused, stream
from stages.onnx import kvcache as kv
from stages.onnx import model as m
from stages.onnx import shapes as sh
from stages.quant import accuracy as acc
from stages.quant import calibration as calib
from stages.quant.pertoken import rows_independent
from stages.quant.thresholds import check, has_change  # noqa: F401

if TYPE_CHECKING:
    from schemas.spec.evaluation import DecodeConfig
    from schemas.spec.quantization import AccuracyBudget

NAME = "evaluate"
Run = Callable[[dict[str, np.ndarray]], list[np.ndarray]]


def io(release: ReleaseSpec) -> StageIO:
    data = release.evaluation.dataset
    return StageIO(
        # quantization's method and budget: the accuracy contract (schemas/contract.py)
        params=(
            "model",
            "task",
            "export",
            "evaluation",
            "quantization.method",
            "quantization.budget",
        ),
        reads=(ModelInfo,),
        upstream=("export/model.onnx", "quantize/model.onnx"),
        data=(("dataset", data.path), ("dataset_tokenizer", data.tokenizer)),
    )


def run(ctx: StageContext, release: ReleaseSpec) -> StageResult:
    import onnxruntime as ort

    cfg, task = release.evaluation, release.task
    info = ctx.read(ModelInfo)
    lay = m.layout_from_info(info)
    limit = release.export.dims["sequence"].max if "sequence" in release.export.dims else None
    rows = calib.read_rows(
        ctx.root, cfg.dataset, lay, limit, info.arch.vocab, "evaluation.dataset"
    )[: cfg.dataset.samples]
    samples = [calib.to_feeds(task, lay, row) for row in rows]
    names = [t.name for t in lay.outputs]
    export = ctx.upstream("export") / "model.onnx"
    # the two sessions built at once: building one (loading, optimizing its graph) is one
    # thread's work, and onnxruntime lets go of the GIL (2.3 s -> 1.2 s on llama-30)
    with ThreadPoolExecutor(max_workers=1) as pool:
        shipped = pool.submit(
            ort.InferenceSession,
            str(ctx.upstream("quantize") / "model.onnx"),
            providers=["CPUExecutionProvider"],
        )
        with stream.external_view(export) as view:
            fp32 = ort.InferenceSession(str(view), providers=["CPUExecutionProvider"])
            independent = rows_independent(view)  # the view: the structure alone, read fast
        session = shipped.result()
    reference: Run = lambda feeds: fp32.run(names, feeds)  # noqa: E731
    candidate: Run = lambda feeds: session.run(names, feeds)  # noqa: E731
    shipped_path = ctx.upstream("quantize") / "model.onnx"
    apart = TASKS[task].kv_cache and rows_independent(shipped_path)
    # a fused graph's rows are right-padded (stages/onnx/fused.py): its passes run as
    # right-padded groups where its own padding leaves a row alone (checked: another
    # kernel than FP32's), and its prompts decode right-padded
    left = fused.padding_side(shipped_path) == "left"
    if apart and not left:
        apart = acc.padding_is_inert(session, samples)
    agree = acc.Agreement(task)  # a group of samples at a time: no dataset's logits kept
    groups, padded = acc.pass_groups(fp32, samples)
    inert = not padded or acc.padding_is_inert(fp32, samples)
    if not inert:  # padding moved a row: one sample a run, groups still in turn
        groups, padded = acc.pass_groups(fp32, samples, pad=False)
    with ctx.progress(f"{len(samples)} samples", len(samples)) as advance:
        for group in groups:
            for ref, got, feeds, i in compare(
                group, padded, samples, fp32, session, names[0], apart
            ):
                agree.add(ref, got, feeds, i)
            advance(len(group))
    compared = agree.result()
    metrics = task_metrics(task, compared)
    budget = budget_of(release.quantization, task)
    texts = budget.greedy_agreement_min is not None and TASKS[task].kv_cache
    generated, wanted = None, None
    if TASKS[task].kv_cache and samples and acc.cacheable(fp32, samples[0]) and independent:
        generated, wanted = reference_generations(reference, lay, samples, cfg.decode, texts)
    if TASKS[task].kv_cache:
        metrics |= decode_metrics(
            reference, candidate, lay, samples, cfg.decode, apart, wanted, right=not left
        )
    measured = contract_metrics(
        task, compared, budget, fp32, session, samples, apart and inert, generated
    )
    # Absolute bounds hold whatever the baseline; changes vs production are the gate's job.
    baselines = reference_values(metrics)
    results = [
        check(t, metrics, baselines[t.metric] if t.baseline == "reference" else None)
        for t in cfg.thresholds
        if t.threshold is not None or t.baseline == "reference"
    ]
    contract = contract_results(budget, measured)
    failed = [r.message for r in [*contract, *results] if not r.ok]
    metrics |= measured
    ctx.write(Evaluation(metrics=metrics))
    details = EvaluateDetails(
        metrics=metrics, contract=contract, thresholds=results, samples=len(samples)
    ).dump()
    summary = ", ".join(f"{k} {v:.4g}" for k, v in metrics.items())
    if failed:
        _keep_worst_samples(ctx.work / "failed_samples.jsonl", agree.per_sample)
        broken = sum(not r.ok for r in contract)
        return StageResult.failed(
            f"{len(failed)} threshold(s) broken"
            + (f" ({broken} of the accuracy contract, quantization.budget)" if broken else ""),
            failed,
            details=details,
            metrics=metrics,
        )
    return StageResult.passed(summary, details=details, metrics=metrics)


Pair = tuple[np.ndarray, np.ndarray, dict[str, np.ndarray], int]


def compare(
    group: list[int],
    padded: bool,
    samples: list[dict[str, np.ndarray]],
    fp32: Any,
    session: Any,
    name: str,
    batched: bool,
) -> list[Pair]:
    """One group of samples (acc.pass_groups) through FP32, its outputs kept, then through
    the shipped graph: each sample's (reference, shipped, feeds, place in the dataset) for
    acc.Agreement.add. A `padded` group runs as one right-padded batch through FP32, and
    through the shipped graph too when its rows are independent (`batched`); else one
    sample a run (a per-call INT8 scale spans every row: a row would depend on its
    batch-mates)."""
    refs = acc.run_group(fp32, name, samples, group, padded)
    gots = acc.run_group(session, name, samples, group, padded and batched)
    return [(ref, got, samples[i], i) for ref, got, i in zip(refs, gots, group, strict=True)]


def contract_metrics(
    task: str,
    compared: dict[str, float],
    budget: AccuracyBudget,
    fp32: Any,
    session: Any,
    samples: list[dict[str, np.ndarray]],
    batched: bool = False,
    generated: list[tuple[dict[str, np.ndarray], int]] | None = None,
) -> dict[str, float]:
    """The metric of every bound the contract gives, measured as quantize measures it: the
    comparison's (top-1, cosine, SNR, perplexity increase) and, for a language model, the
    greedy agreement on text the FP32 session `fp32` generates (acc.GREEDY_* prompts and
    tokens), the shipped `session` fed it in batches when its rows are independent
    (`batched`), else one text a run."""
    out = {}
    for field, (metric, _) in BUDGET_METRICS.items():
        if getattr(budget, field) is not None and metric in compared:
            out[metric] = compared[metric]
    if budget.greedy_agreement_min is not None and TASKS[task].kv_cache:
        # FP32's own greedy text, generated as quantize generates it (the prompts batched
        # through the cache), then the shipped graph teacher-forced on it
        if generated is None:
            generated = acc.greedy_continuations(fp32, samples)
        if batched:
            out["greedy_agreement"] = acc.teacher_forced_together(session, generated)
        else:
            out["greedy_agreement"] = acc.greedy_agreement(session, generated)
    return out


def contract_results(budget: AccuracyBudget, measured: dict[str, float]) -> list[ThresholdResult]:
    """Each contract bound on the evaluation set, without quantize's margin, in the shape of
    a threshold's result (baseline: the reference)."""
    out = []
    for field, (metric, kind) in BUDGET_METRICS.items():
        bound = getattr(budget, field)
        if bound is None or metric not in measured:
            continue
        value = measured[metric]
        ok = value >= bound if kind == "min" else value <= bound
        sign = (">=" if ok else "<") if kind == "min" else ("<=" if ok else ">")
        out.append(
            ThresholdResult(
                metric=metric,
                baseline="reference",
                value=value,
                baseline_value=None,
                ok=ok,
                message=f"{metric} {value:.4g} {sign} quantization.budget.{field} {bound:g}"
                + ("" if ok else " on the evaluation set (the accuracy contract)"),
            )
        )
    return out


def _keep_worst_samples(path: Path, per_sample: list[dict[str, float]]) -> None:
    """Evidence for a broken threshold: every sample's own agreement, worst first; `sample`
    counts the samples evaluated in evaluation.dataset's order (kept in failed/evaluate/)."""
    rows = [{"sample": i, **s} for i, s in enumerate(per_sample)]
    rows.sort(key=lambda r: (r["top1_agreement"], r["logit_cosine"]))
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def task_metrics(task: str, agree: dict[str, float]) -> dict[str, float]:
    """The task's metrics (TASKS) from the comparison with the reference (acc.Agreement's
    result); the decode metrics of a KV-cache task come from generation (decode_metrics)."""
    return {m: agree[METRIC_SOURCES[m]] for m in TASKS[task].metrics if m in METRIC_SOURCES}


def reference_values(metrics: dict[str, float]) -> dict[str, float]:
    """What each metric would be for the PyTorch FP32 reference itself."""
    perfect = {k: 1.0 for k in metrics}  # agreement and match rates, cosine
    perfect["perplexity"] = perfect["perplexity_reference"] = metrics.get("perplexity_reference", 1)
    if "snr_db" in metrics:
        perfect["snr_db"] = 200.0
    return perfect


def greedy(
    run: Run,
    lay: sh.Layout,
    prompts: list[np.ndarray],
    tokens: int,
    prefill_rows: int | None = None,
    right: bool = False,
) -> list[list[int]]:
    """Greedy decoding with the KV-cache graph (kvcache.greedy): the prompts together, for
    a graph whose rows do not depend on each other (FP32, per-token INT8), or one alone;
    the prefill in runs of `prefill_rows` rows when given; `right`: a graph whose rows are
    right-padded (a fused graph)."""
    feeds = calib.to_feeds("causal-lm", lay, {"input_ids": prompts[0][None, :]})  # KV tasks
    empty = {t.name: feeds[t.name] for t in lay.inputs if t.name.startswith(kv.PAST)}
    names = [t.name for t in lay.outputs]
    positions = any(t.name == sh.POSITIONS for t in lay.inputs)

    def by_name(f: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(names, run(f), strict=True))

    made = kv.greedy(by_name, empty, positions, prompts, tokens, prefill_rows, right)
    return [[int(i) for i in row] for row in made]


def reference_generations(
    reference: Run,
    lay: sh.Layout,
    samples: list[dict[str, np.ndarray]],
    cfg: DecodeConfig,
    texts: bool,
) -> tuple[list[tuple[dict[str, np.ndarray], int]] | None, list[list[int]]]:
    """FP32's greedy text for both of evaluate's uses, decoded as one batch: the contract's
    (acc.GREEDY_* prompts and tokens: what acc.greedy_continuations returns, the text the
    shipped graph is teacher-forced on; only when `texts`) and the decode metrics' (the
    evaluation.decode prompts' continuations). For an FP32 graph whose rows cannot move
    each other (`rows_independent`): a row's tokens are the same in any batch, and a step
    over every row reads the weights once instead of once a batch (a 30-layer FP32 decode
    step is the weights' bytes moved, ~55 ms here). The prefill runs in rows whose logits
    fit acc.LOGITS_BYTES."""
    chosen = samples[: acc.GREEDY_PROMPTS] if texts else []
    text_prompts = [s["input_ids"][0, : acc.GREEDY_PROMPT_TOKENS] for s in chosen]
    decode_prompts = [s["input_ids"][0, : cfg.prompt_tokens] for s in samples][: cfg.prompts]
    prompts = text_prompts + decode_prompts
    tokens = max(cfg.tokens, acc.GREEDY_TOKENS if texts else 0)
    width = max(p.size for p in prompts)
    vocab = lay.outputs[0].axes[-1] if lay.outputs and lay.outputs[0].axes else None
    rows = acc.LOGITS_BYTES // (width * vocab * 4) if isinstance(vocab, int) else 1
    made = greedy(reference, lay, prompts, tokens, max(1, rows))
    generated = [
        (
            acc.with_ids(sample, np.concatenate([prompt, made[i][: acc.GREEDY_TOKENS]])[None, :]),
            prompt.size,
        )
        for i, (sample, prompt) in enumerate(zip(chosen, text_prompts, strict=True))
    ]
    wanted = [row[: cfg.tokens] for row in made[len(text_prompts) :]]
    return (generated if texts else None), wanted


def decode_metrics(
    reference: Run,
    candidate: Run,
    lay: sh.Layout,
    samples: list[dict[str, np.ndarray]],
    cfg: DecodeConfig,
    batched: bool = False,
    wanted: list[list[int]] | None = None,
    right: bool = False,
) -> dict[str, float]:
    """Exact-match rate of whole continuations, and of tokens, vs the reference's (decoded
    here unless given: `wanted`, reference_generations)."""
    prompts = [s["input_ids"][0, : cfg.prompt_tokens] for s in samples][: cfg.prompts]
    exact, same = 0, 0
    # the FP32 reference decodes the prompts as one batch; the shipped graph too when its
    # rows are independent (`batched`), else one prompt a call (a per-call INT8 scale
    # spans every row: a row would depend on its batch-mates)
    if wanted is None:
        wanted = greedy(reference, lay, prompts, cfg.tokens)
    if batched:
        haves = greedy(candidate, lay, prompts, cfg.tokens, right=right)
    else:
        haves = [greedy(candidate, lay, [prompt], cfg.tokens)[0] for prompt in prompts]
    for want, have in zip(wanted, haves, strict=True):
        exact += want == have
        same += sum(a == b for a, b in zip(want, have, strict=True))
    return {
        "greedy_exact_match": exact / len(prompts),
        "greedy_token_match": same / (len(prompts) * cfg.tokens),
    }
