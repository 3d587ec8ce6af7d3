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
    shipped_path = ctx.upstream("quantize") / "model.onnx"
    kv_task = TASKS[task].kv_cache
    apart = kv_task and rows_independent(shipped_path)
    # a fused graph's rows are right-padded (stages/onnx/fused.py): its passes run as
    # right-padded groups where its own padding leaves a row alone (checked: another
    # kernel than FP32's), and its prompts decode right-padded
    left = fused.padding_side(shipped_path) == "left"
    with ThreadPoolExecutor(max_workers=1) as pool, stream.external_view(export) as view:
        # building the FP32 session is one core's work (1.2-2.4 s on llama-30; onnxruntime
        # lets go of the GIL): the shipped graph's session and its padding check run on
        # the other core meanwhile, neither reading FP32
        building = pool.submit(reference_session, view)
        session = ort.InferenceSession(str(shipped_path), providers=["CPUExecutionProvider"])
        candidate: Run = lambda feeds: session.run(names, feeds)  # noqa: E731
        if apart and not left:
            apart = acc.padding_is_inert(session, samples)
        independent = rows_independent(view)  # the view: the structure alone, read fast
        fp32 = building.result()
    # the shipped decode after the build: its steps' two threads beside the build's one
    # slowed the build more than they saved (llama-30, 14 interleaved runs: -0.3 to -0.6 s)
    haves = (
        shipped_decode(candidate, lay, samples, cfg.decode, apart, not left) if kv_task else None
    )
    reference: Run = lambda feeds: fp32.run(names, feeds)  # noqa: E731
    agree = acc.Agreement(task)  # a group of samples at a time: no dataset's logits kept
    groups, padded = acc.pass_groups(fp32, samples)
    inert = not padded or acc.padding_is_inert(fp32, samples)
    if not inert:  # padding moved a row: one sample a run, groups still in turn
        groups, padded = acc.pass_groups(fp32, samples, pad=False)
    budget = budget_of(release.quantization, task)
    texts = budget.greedy_agreement_min is not None and kv_task
    decodes = kv_task and bool(samples) and acc.cacheable(fp32, samples[0]) and independent
    # FP32's cache of the prompts it decodes, kept from its pass (their prefill is free)
    kept = decodes and Prefixes.fits(lay)
    prefixes = Prefixes(lay, prompt_rows(samples, cfg.decode, texts)) if kept else None
    # the shipped graph's cache of the contract's prompts, for its teacher forcing through
    # that cache: where its rows are independent and its own cache can be fed back
    shipped = None
    if texts and prefixes is not None and apart and inert and acc.cacheable(session, samples[0]):
        shipped = Prefixes(lay, prefixes.rows[: min(acc.GREEDY_PROMPTS, len(samples))])
    with ctx.progress(f"{len(samples)} samples", len(samples)) as advance:
        for group in groups:
            agree.add_many(
                compare(group, padded, samples, fp32, session, names[0], apart, prefixes, shipped)
            )
            advance(len(group))
    compared = agree.result()
    metrics = task_metrics(task, compared)
    generated, wanted = None, None
    if decodes:
        generated, wanted = reference_generations(
            reference, lay, samples, cfg.decode, texts, prefixes
        )
    if haves is not None:
        metrics |= decode_metrics(reference, lay, samples, cfg.decode, haves, wanted)
    cached = None
    if shipped is not None and generated is not None:
        held = shipped
        cached = lambda texts: forced_through_cache(candidate, lay, held, texts)  # noqa: E731
    measured = contract_metrics(
        task, compared, budget, fp32, session, samples, apart and inert, generated, cached
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
    prefixes: Prefixes | None = None,
    shipped: Prefixes | None = None,
) -> list[Pair]:
    """One group of samples (acc.pass_groups) through FP32, its outputs kept, then through
    the shipped graph: each sample's (reference, shipped, feeds, place in the dataset) for
    acc.Agreement.add. A `padded` group runs as one right-padded batch through FP32, and
    through the shipped graph too when its rows are independent (`batched`); else one
    sample a run (a per-call INT8 scale spans every row: a row would depend on its
    batch-mates). `prefixes`: FP32's cache of the prompts it will decode, kept from this
    run for each sample of the group that starts one; `shipped`: the shipped graph's of the
    prompts it is teacher-forced after (forced_through_cache)."""
    refs = _run_keeping(fp32, name, samples, group, padded, prefixes)
    gots = _run_keeping(session, name, samples, group, padded and batched, shipped)
    return [(ref, got, samples[i], i) for ref, got, i in zip(refs, gots, group, strict=True)]


def _run_keeping(
    session: Any,
    name: str,
    samples: list[dict[str, np.ndarray]],
    group: list[int],
    padded: bool,
    prefixes: Prefixes | None,
) -> list[np.ndarray]:
    """acc.run_group, the cache of each prompt `prefixes` wants kept from the same run."""
    if prefixes is None or not prefixes.wants(group):
        return acc.run_group(session, name, samples, group, padded)
    outs = acc.run_group_outputs(session, {name: 1, **prefixes.axes}, samples, group, padded)
    for out, i in zip(outs, group, strict=True):
        prefixes.keep(i, out, name)
    return [out[name] for out in outs]


def contract_metrics(
    task: str,
    compared: dict[str, float],
    budget: AccuracyBudget,
    fp32: Any,
    session: Any,
    samples: list[dict[str, np.ndarray]],
    batched: bool = False,
    generated: list[tuple[dict[str, np.ndarray], int]] | None = None,
    cached: Callable[[list[tuple[dict[str, np.ndarray], int]]], float] | None = None,
) -> dict[str, float]:
    """The metric of every bound the contract gives, measured as quantize measures it: the
    comparison's (top-1, cosine, SNR, perplexity increase) and, for a language model, the
    greedy agreement on text the FP32 session `fp32` generates (acc.GREEDY_* prompts and
    tokens), the shipped `session` fed it through its cache when `cached` is given
    (forced_through_cache), else in batches when its rows are independent (`batched`),
    else one text a run."""
    out = {}
    for field, (metric, _) in BUDGET_METRICS.items():
        if getattr(budget, field) is not None and metric in compared:
            out[metric] = compared[metric]
    if budget.greedy_agreement_min is not None and TASKS[task].kv_cache:
        # FP32's own greedy text, generated as quantize generates it (the prompts batched
        # through the cache), then the shipped graph teacher-forced on it
        if generated is None:
            generated = acc.greedy_continuations(fp32, samples)
        if cached is not None:  # through the shipped graph's cache (forced_through_cache)
            out["greedy_agreement"] = cached(generated)
        elif batched:
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
    first: dict[str, np.ndarray] | None = None,
) -> list[list[int]]:
    """Greedy decoding with the KV-cache graph (kvcache.greedy): the prompts together, for
    a graph whose rows do not depend on each other (FP32, per-token INT8), or one alone;
    the prefill in runs of `prefill_rows` rows when given; `right`: a graph whose rows are
    right-padded (a fused graph); `first`: the prefill's outputs, already computed
    (kv.greedy)."""
    feeds = calib.to_feeds("causal-lm", lay, {"input_ids": prompts[0][None, :]})  # KV tasks
    empty = {t.name: feeds[t.name] for t in lay.inputs if t.name.startswith(kv.PAST)}
    names = [t.name for t in lay.outputs]
    positions = any(t.name == sh.POSITIONS for t in lay.inputs)

    def by_name(f: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(names, run(f), strict=True))

    made = kv.greedy(by_name, empty, positions, prompts, tokens, prefill_rows, right, first)
    return [[int(i) for i in row] for row in made]


def reference_session(path: Path) -> Any:
    """The FP32 reference's session. Graph optimization stops at the extended level: the
    layout level (NCHWc, for convolutions) took 0.7 of 2.2 s to build llama-30's FP32 export
    and changed none of its outputs' bits (measured on the evaluation set and its decode)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def prompt_rows(
    samples: list[dict[str, np.ndarray]], cfg: DecodeConfig, texts: bool
) -> list[tuple[int, int]]:
    """(sample, prompt tokens) of each prompt reference_generations decodes, in its rows'
    order: the contract's (acc.GREEDY_* prompts and tokens; only when `texts`), then the
    evaluation.decode prompts. Every prompt is the start of an evaluation sample."""
    lengths = [int(s["input_ids"].shape[1]) for s in samples]
    chosen = range(min(acc.GREEDY_PROMPTS, len(samples))) if texts else range(0)
    decoded = range(min(cfg.prompts, len(samples)))
    return [(i, min(acc.GREEDY_PROMPT_TOKENS, lengths[i])) for i in chosen] + [
        (i, min(cfg.prompt_tokens, lengths[i])) for i in decoded
    ]


class Prefixes:
    """FP32's prefill of the prompts reference_generations decodes, kept from its pass over
    the evaluation set instead of computed again: every prompt is the start of a sample,
    and in a causal graph a prefix's cache and last logits are the same in the longer run
    (right padding after a row included: evaluate holds FP32's padding inert first, else
    runs one sample a run). Only each prompt's last logits and cache are kept (llama-30:
    46 KB a token), never a sample's logits. On llama-30 the prefill was 1.0 s of 14."""

    def __init__(self, lay: sh.Layout, rows: list[tuple[int, int]]) -> None:
        self.rows = rows
        self._longest: dict[int, int] = {}
        for i, n in rows:
            self._longest[i] = max(n, self._longest.get(i, 0))
        # each present's sequence axis (past and new tokens: shapes.TOTAL)
        self.axes = {
            t.name: t.axes.index(sh.TOTAL) for t in lay.outputs if t.name.startswith(kv.PRESENT)
        }
        self._caches: dict[int, dict[str, np.ndarray]] = {}
        self._last: dict[tuple[int, int], np.ndarray] = {}

    @staticmethod
    def fits(lay: sh.Layout) -> bool:
        """Whether every present names its sequence axis (an export's always does): else
        FP32 decodes with its own prefill, as before."""
        presents = [t for t in lay.outputs if t.name.startswith(kv.PRESENT)]
        return bool(presents) and all(sh.TOTAL in t.axes for t in presents)

    def wants(self, group: list[int]) -> bool:
        return any(i in self._longest for i in group)

    def keep(self, i: int, out: dict[str, np.ndarray], name: str = "logits") -> None:
        """Sample `i`'s run (its logits, output `name`, and presents, sliced to its own
        length)."""
        if i not in self._longest:
            return
        longest = self._longest[i]
        self._caches[i] = {
            present: np.take(out[present], np.arange(longest), axis=axis).copy()
            for present, axis in self.axes.items()
        }
        for j, n in self.rows:
            if j == i:
                self._last[(i, n)] = out[name][:, n - 1 : n].copy()

    def _complete(self) -> None:
        missing = sorted({i for i, _ in self.rows} - set(self._caches))
        if missing:
            raise RuntimeError(f"samples {missing} ran without their prompts' cache kept")

    def prompt(self, i: int, n: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Sample `i`'s prompt of `n` tokens: its last logits [1, 1, vocab] and its cache
        as the graph's past inputs (one row, `n` tokens)."""
        self._complete()
        past = {
            name.replace(kv.PRESENT, kv.PAST): np.take(cache, np.arange(n), axis=self.axes[name])
            for name, cache in self._caches[i].items()
        }
        return self._last[(i, n)], past

    def first(self) -> dict[str, np.ndarray]:
        """The prefill's outputs for kv.greedy's `first`: each row's last logits, and its
        cache at the right of the widest prompt, zeros on its left (left-padded rows)."""
        self._complete()
        width = max(n for _, n in self.rows)
        out = {"logits": np.concatenate([self._last[row] for row in self.rows])}
        for name, axis in self.axes.items():
            cache = self._caches[self.rows[0][0]][name]
            shape = list(cache.shape)
            shape[0], shape[axis] = len(self.rows), width
            block = np.zeros(shape, cache.dtype)
            for r, (i, n) in enumerate(self.rows):
                at: list[Any] = [slice(r, r + 1)] + [slice(None)] * (cache.ndim - 1)
                at[axis] = slice(width - n, width)
                block[tuple(at)] = np.take(self._caches[i][name], np.arange(n), axis=axis)
            out[name] = block
        return out


def reference_generations(
    reference: Run,
    lay: sh.Layout,
    samples: list[dict[str, np.ndarray]],
    cfg: DecodeConfig,
    texts: bool,
    prefixes: Prefixes | None = None,
) -> tuple[list[tuple[dict[str, np.ndarray], int]] | None, list[list[int]]]:
    """FP32's greedy text for both of evaluate's uses, decoded as one batch: the contract's
    (acc.GREEDY_* prompts and tokens: what acc.greedy_continuations returns, the text the
    shipped graph is teacher-forced on; only when `texts`) and the decode metrics' (the
    evaluation.decode prompts' continuations). For an FP32 graph whose rows cannot move
    each other (`rows_independent`): a row's tokens are the same in any batch, and a step
    over every row reads the weights once instead of once a batch (a 30-layer FP32 decode
    step is the weights' bytes moved, ~55 ms here). The prefill is `prefixes`' (kept from
    the pass over the evaluation set) when given, else run here in rows whose logits fit
    acc.LOGITS_BYTES."""
    rows = prompt_rows(samples, cfg, texts) if prefixes is None else prefixes.rows
    prompts = [samples[i]["input_ids"][0, :n] for i, n in rows]
    chosen = [(samples[i], p) for (i, _), p in zip(rows, prompts, strict=True)]
    chosen = chosen[: min(acc.GREEDY_PROMPTS, len(samples)) if texts else 0]
    tokens = max(cfg.tokens, acc.GREEDY_TOKENS if texts else 0)
    width = max(p.size for p in prompts)
    vocab = lay.outputs[0].axes[-1] if lay.outputs and lay.outputs[0].axes else None
    fit = acc.LOGITS_BYTES // (width * vocab * 4) if isinstance(vocab, int) else 1
    first = None if prefixes is None else prefixes.first()
    made = greedy(reference, lay, prompts, tokens, max(1, fit), first=first)
    generated = [
        (
            acc.with_ids(sample, np.concatenate([prompt, made[r][: acc.GREEDY_TOKENS]])[None, :]),
            prompt.size,
        )
        for r, (sample, prompt) in enumerate(chosen)
    ]
    wanted = [row[: cfg.tokens] for row in made[len(chosen) :]]
    return (generated if texts else None), wanted


def forced_through_cache(
    candidate: Run,
    lay: sh.Layout,
    prefixes: Prefixes,
    generated: list[tuple[dict[str, np.ndarray], int]],
) -> float:
    """The contract's greedy agreement (acc.teacher_forced: the share of FP32's greedy
    tokens the shipped graph picks, fed FP32's text) through the shipped graph's own
    cache: each text's prompt cache and last logits kept from its pass over the
    evaluation set (`prefixes`, one row a text), then the text's FP32 tokens fed as one
    chunk with that past, as the engine prefills a prompt in chunks. For a graph whose
    rows cannot move each other (a cached run is then the full pass's to float rounding:
    kvcheck holds it there), never a per-call INT8 scale's (its scale moves with the
    call's shape). llama-30: 1.1 s of full passes -> 0.5 s."""
    names = [t.name for t in lay.outputs]
    positions = any(t.name == sh.POSITIONS for t in lay.inputs)
    same = total = 0
    for (feeds, prompt), (i, n) in zip(generated, prefixes.rows, strict=True):
        if n != prompt:
            raise ValueError(f"sample {i}: a prompt of {prompt} tokens, {n} kept")
        ids = feeds["input_ids"][0]
        last, past = prefixes.prompt(i, n)
        picks = [int(last[0, -1].argmax())]
        if ids.size - prompt > 1:  # the text's tokens but its last, after the prompt
            mask = np.ones((1, ids.size - 1), np.int64)
            chunk = {"input_ids": ids[None, prompt:-1], "attention_mask": mask, **past}
            if positions:
                chunk[sh.POSITIONS] = sh.positions_from_mask(mask, ids.size - 1 - prompt)
            logits = dict(zip(names, candidate(chunk), strict=True))["logits"]
            picks += [int(t) for t in logits[0].argmax(-1)]
        same += sum(a == b for a, b in zip(picks, ids[prompt:].tolist(), strict=True))
        total += ids.size - prompt
    return same / max(total, 1)


def decode_prompts(samples: list[dict[str, np.ndarray]], cfg: DecodeConfig) -> list[np.ndarray]:
    """The evaluation.decode prompts: the first prompt_tokens of the first `prompts` samples."""
    return [s["input_ids"][0, : cfg.prompt_tokens] for s in samples[: cfg.prompts]]


def shipped_decode(
    candidate: Run,
    lay: sh.Layout,
    samples: list[dict[str, np.ndarray]],
    cfg: DecodeConfig,
    batched: bool = False,
    right: bool = False,
) -> list[list[int]]:
    """The shipped graph's greedy tokens for the evaluation.decode prompts: together when
    its rows are independent (`batched`; right-padded for a fused graph, `right`), else one
    prompt a call (a per-call INT8 scale spans every row: a row would depend on its
    batch-mates)."""
    prompts = decode_prompts(samples, cfg)
    if batched:
        return greedy(candidate, lay, prompts, cfg.tokens, right=right)
    return [greedy(candidate, lay, [prompt], cfg.tokens)[0] for prompt in prompts]


def decode_metrics(
    reference: Run,
    lay: sh.Layout,
    samples: list[dict[str, np.ndarray]],
    cfg: DecodeConfig,
    haves: list[list[int]],
    wanted: list[list[int]] | None = None,
) -> dict[str, float]:
    """Exact-match rate of whole continuations, and of tokens, of the shipped graph's
    (`haves`, shipped_decode) vs the reference's (decoded here, the prompts as one batch,
    unless given: `wanted`, reference_generations)."""
    prompts = decode_prompts(samples, cfg)
    if wanted is None:
        wanted = greedy(reference, lay, prompts, cfg.tokens)
    exact, same = 0, 0
    for want, have in zip(wanted, haves, strict=True):
        exact += want == have
        same += sum(a == b for a, b in zip(want, have, strict=True))
    return {
        "greedy_exact_match": exact / len(prompts),
        "greedy_token_match": same / (len(prompts) * cfg.tokens),
    }
