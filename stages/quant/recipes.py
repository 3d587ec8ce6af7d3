"""`quantization.method: auto`: a recipe search instead of one method.

Recipes are tried in the spec's order (expected gain first: per-channel dynamic INT8,
per-tensor dynamic INT8, static QDQ INT8, weight-only block-wise INT4). Each is built on
the whole model and measured: the budget's metrics on the calibration probe and on the
held-out samples, the file size and the speed against FP32 (decode steps for a KV-cache
graph, forward passes otherwise; timed only for a recipe that could ship and for the one
that falls back), decided by interleaved timing with an interval or, where the interval
decides nothing, by a deterministic cost model (stages/quant/speed.py).
The first recipe that meets the budget *with a margin* on both sample sets, is small enough
and at least `min_speedup` x FP32's speed ships. When none does, the best fast-enough recipe
keeps whole classes of layers in float (every `mlp.c_proj`, every `down_proj`: where an
activation outlier lives, it lives in every layer), most damaging class first, ranked by
quantizing all but one class at a time: one variant per class, not per node, so the cost
does not grow with depth (a one-pass ranking by local SNR was tried and missed: on a
Llama with planted outliers it ranked the MLP classes worst, and keeping v_proj in float
is what met the budget). Every variant tried is a row of the report, with why it was or
was not chosen.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from schemas import StageError
from schemas.quantsearch import RecipeTrial, SpeedCheck
from stages.onnx.graph import node_scope
from stages.onnx.kvcache import PAST, PRESENT
from stages.quant import accuracy as acc
from stages.quant import pertoken
from stages.quant import speed as sp
from stages.quant.methods import Quantizer
from stages.quant.search import session_for

if TYPE_CHECKING:
    from schemas.spec.quantization import AccuracyBudget, AutoQuantization, Recipe
    from stages._contract import StageContext
    from stages.quant.calibration import Samples
    from stages.quant.methods import Method
    from stages.quant.search import Evaluator

# recipe -> (method, its settings)
RECIPES: dict[str, tuple[str, dict[str, Any]]] = {
    "int8-dynamic-per-channel": ("int8-dynamic", {"per_channel": True}),
    "int8-dynamic-smoothquant": ("int8-dynamic", {"per_channel": True, "smooth": True}),
    "int8-dynamic": ("int8-dynamic", {"per_channel": False}),
    "int8-static": ("int8-static", {}),
    "int8-weight-only": ("int8-weight-only", {"op_types": ["MatMul"]}),
    "int4-weight-only": ("int4-weight-only", {"op_types": ["MatMul"]}),
    # the decoder rebuilt by onnxruntime-genai's builder (stages/onnx/fused.py)
    "int4-weight-only-fused": ("int4-weight-only", {"op_types": ["MatMul"], "graph": "fused"}),
}
# recipe -> (the recipe it cannot beat on accuracy, why). When that one misses the budget's
# accuracy, this one is not built (its row says why)
DOMINATED_BY: dict[str, tuple[str, str]] = {
    # per-tensor weight scales: no row's step is finer than its own per-channel scale's,
    # and the activations are quantized alike (dynamic, per tensor)
    "int8-dynamic": ("int8-dynamic-per-channel", "is the same scheme on a coarser grid"),
    # the same blocks and scales' range on 16 levels instead of 256
    "int4-weight-only": ("int8-weight-only", "is the same scheme on a coarser grid"),
    # auto's static QDQ (minmax ranges, per-channel weights: `concrete`): the same weight
    # scales; an activation's step spans its range over every calibration sample, never
    # finer than the range of the one input a dynamic scale is computed from, and more is
    # quantized (activation x activation MatMuls). It may still be faster: it is built when
    # the dynamic one met the accuracy and was too slow
    "int8-static": (
        "int8-dynamic-per-channel",
        "has the same weight scales and activation steps no finer (one calibrated range "
        "for every input), and quantizes more",
    ),
}
IDEAL = {
    "top1_agreement_min": 1.0,
    "greedy_agreement_min": 1.0,
    "logit_cosine_min": 1.0,
}  # the best a metric can be


def concrete(q: AutoQuantization, recipe: str) -> Method:
    """The explicit method spec a recipe stands for, with auto's shared settings."""
    from schemas.spec.quantization import Int4WeightOnly, Int8Dynamic, Int8Static, Int8WeightOnly

    method, preset = RECIPES[recipe]
    settings = dict(preset)  # RECIPES stays as written
    base = q.model_dump(
        include={"calibration", "budget", "max_size_ratio", "max_float_nodes", "op_types"}
    )
    if method.endswith("weight-only"):
        settings = {**settings, "block_size": q.block_size}
    if settings.pop("smooth", False):
        settings = {**settings, "smooth_alpha": q.smooth_alpha}
    kinds: dict[str, type[Int8Dynamic | Int8Static | Int4WeightOnly | Int8WeightOnly]] = {
        "int8-dynamic": Int8Dynamic,
        "int8-static": Int8Static,
        "int4-weight-only": Int4WeightOnly,
        "int8-weight-only": Int8WeightOnly,
    }
    return kinds[method].model_validate({**base, "method": method, **settings})


def tightened(budget: AccuracyBudget, margin: float) -> AccuracyBudget:
    """The budget with a margin: a min bound moves `margin` of the way to its ideal (1 for
    agreement and cosine; SNR by margin x its own size), a max bound shrinks by `margin`."""
    changes: dict[str, float] = {}
    for name, (_, kind) in acc.BOUNDS.items():
        bound = getattr(budget, name)
        if bound is None:
            continue
        if kind == "max":
            changes[name] = bound * (1 - margin)
        elif name in IDEAL:
            changes[name] = bound + margin * (IDEAL[name] - bound)
        else:
            changes[name] = bound + margin * abs(bound)
    return budget.model_copy(update=changes)


def decode_feeds(session: Any, sample: dict[str, np.ndarray], rows: int) -> dict[str, Any] | None:
    """One decode step of `rows` sequences after the sample's prompt (its own KV cache from
    the FP32 graph's session, repeated): what a served causal LM spends its time on. None
    for a graph without a KV cache."""
    names = [i.name for i in session.get_inputs()]
    pasts = [n for n in names if n.startswith(PAST)]
    if not pasts or "input_ids" not in sample:
        return None
    presents = [n.replace(PAST, PRESENT) for n in pasts]
    cache = session.run(presents, sample)
    length = int(cache[0].shape[2])
    feeds: dict[str, Any] = {
        "input_ids": np.repeat(sample["input_ids"][:1, -1:], rows, 0),
        "attention_mask": np.ones((rows, length + 1), np.int64),
    }
    if "position_ids" in names:
        feeds["position_ids"] = np.full((rows, 1), length, np.int64)
    for name, array in zip(pasts, cache, strict=True):
        feeds[name] = np.repeat(array[:1], rows, 0)
    return feeds


def class_of(node: Any) -> str:
    """A node's layer class: its module path with the layer index wildcarded."""
    scope = node_scope(node) or node.name
    return re.sub(r"(^|[./_])\d+(?=[./_]|$)", r"\1*", scope)


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.parent.glob(path.name + "*"))


@dataclass
class Outcome:
    """The variant the search ships (or the best it found), and every row it measured."""

    path: Path | None = None
    method: str = ""
    recipe: str = ""
    excluded: list[str] = field(default_factory=list)
    float_classes: list[str] = field(default_factory=list)
    ok: bool = False
    broken: list[str] = field(default_factory=list)
    holdout: dict[str, float] = field(default_factory=dict)
    table: list[RecipeTrial] = field(default_factory=list)
    fp32: dict[str, int | float] = field(default_factory=dict)


class Search:
    def __init__(
        self,
        ctx: StageContext,
        pre: Path,
        q: AutoQuantization,
        samples: Samples,
        budget: AccuracyBudget,
        calibration: Evaluator,
        holdout: Evaluator,
        fp32_bytes: int,
        served_rows: int = 1,
        fp32_session: Any = None,
        fused: Callable[[Method, Path], Path] | None = None,
    ) -> None:
        """`fused(cfg, folder)`: builds a `graph: fused` recipe's graph in `folder` from the
        checkpoint (fused.FusedError when it cannot); None: such a recipe is not built."""
        self.ctx, self.pre, self.q, self.samples = ctx, pre, q, samples
        self.fused = fused
        self.budget, self.tight = budget, tightened(budget, q.margin)
        self.calibration, self.holdout = calibration, holdout
        self.feeds = samples.calibration[: min(4, len(samples.calibration))]
        self.fp32_bytes = fp32_bytes  # the export's files, as the published ratio counts them
        # what is timed: for a KV-cache graph, one decode step at batch 1 and at the served
        # batch (what a served causal LM spends its time on, and what decides); otherwise
        # forward passes over calibration samples
        fp32 = fp32_session or session_for(pre)
        # pass -> (its feeds, the rows the cost model prices: sequences decoded, or tokens)
        self.timed: dict[str, tuple[list[dict[str, Any]], int]] = {}
        for rows in sorted({1, served_rows}):
            step = decode_feeds(fp32, self.feeds[0], rows)
            if step is not None:
                self.timed[f"decode_batch_{rows}"] = ([step] * 8, rows)
        tokens = max((int(f["input_ids"].size) for f in self.feeds if "input_ids" in f), default=1)
        self.timed = self.timed or {"forward": (self.feeds, tokens)}
        # no FP32 session is held while variants are built and measured: one is opened for
        # each timing (one or two a search) and closed after it (issue 26: peak memory)
        self.fp32_s: dict[str, float] = {}

    def run(self) -> Outcome:
        out = Outcome(fp32={"bytes": self.fp32_bytes})
        self._search(out)
        out.fp32 |= {f"{k}_ms": round(v * 1000, 3) for k, v in self.fp32_s.items()}
        return out

    def _search(self, out: Outcome) -> Outcome:
        # a recipe that misses the budget may still become the fallback that keeps layer
        # classes in float: the best-scoring one that is fast and small enough. Speed is a
        # third of a recipe's cost and matters only for the one that falls back, so the
        # best-scoring recipe so far keeps its files untimed, and the others are dropped
        # (rebuilt only if every better one turns out too slow)
        best: tuple[tuple[bool, float, int, Recipe], Quantizer, Path] | None = None
        rest: list[tuple[bool, float, int, Recipe]] = []
        rows: dict[str, RecipeTrial] = {}
        inaccurate: set[str] = set()
        for order, recipe in enumerate(self.q.recipes):
            cfg = concrete(self.q, recipe)
            by, reason = DOMINATED_BY.get(recipe, ("", ""))
            if by in inaccurate and _dominates(cfg):
                out.table.append(_dominated(recipe, cfg.method, by, reason))
                self.ctx.log(f"recipe {recipe}: {out.table[-1].why}")
                inaccurate.add(recipe)  # what it dominates in turn is not built either
                continue
            folder = self.ctx.work / "_variants" / recipe
            if getattr(cfg, "graph", "traced") == "fused":
                done = self._fused(out, recipe, cfg, folder)
                if done is not None:
                    return done
                continue
            try:
                quantizer = Quantizer(self.pre, cfg, self.samples.calibration, folder)
                path = quantizer.quantize()
            except StageError as exc:  # one recipe onnxruntime cannot build: the next may
                shutil.rmtree(folder, ignore_errors=True)
                out.table.append(_unbuilt(recipe, cfg.method, exc.message))
                self.ctx.log(f"recipe {recipe}: {exc.message}")
                continue
            row, why, cal = self._measure(recipe, cfg.method, path, [])
            out.table.append(row)
            rows[recipe] = row
            if not why:
                return self._chosen(out, row, path, cfg.method, recipe, [], [])
            if any(w.startswith(("calibration", "held-out")) for w in why):
                inaccurate.add(recipe)
            if any(w.startswith(("speed", "size")) for w in why):  # accurate: timed; or big
                _discard(quantizer, path)
                continue
            # ranked first by whether the cost model expects it fast enough (a guess that
            # orders the candidates; the timing still decides the one that falls back),
            # then by score, ties to the earlier recipe. On a 30-layer decoder the best
            # scorer was 8-bit weight-only, predicted 0.09x and timed 0.14x: timing it and
            # then rebuilding the next candidate took 50 s of a 165 s search
            entry = (self._predicted_fast(path), acc.score(cal), -order, recipe)
            if best is None or entry > best[0]:
                if best is not None:
                    rest.append(best[0])
                    _discard(best[1], best[2])
                best = (entry, quantizer, path)
            else:
                rest.append(entry)
                _discard(quantizer, path)
        rest.sort(reverse=True)
        while best is not None:
            (expected, *_, recipe), quantizer, path = best
            if expected:
                # the cost model expects it fast enough: not timed here, since the variant
                # that ships from it is timed anyway (on the 30-layer decoder this timing
                # was 7 s of a 124 s search). Timed only when that variant turns out too
                # slow: then, as when the cost model expects it slow, it falls back only if
                # the timing says it is fast enough, else the next candidate is tried
                _remove(path)
                done = self._by_class(out, recipe, quantizer)
                if done.ok or not any(w.startswith("speed") for w in done.broken):
                    return done
                path = quantizer.quantize()
                if self._time(rows[recipe], path):
                    _remove(path)
                    return done  # fast itself, too slow with its classes in float: as before
                fast = False
            else:
                fast = self._time(rows[recipe], path)
            _remove(path)
            if fast:
                return self._by_class(out, recipe, quantizer)
            shutil.rmtree(quantizer.folder, ignore_errors=True)
            best = None
            if rest:  # rebuilt: the next best was dropped to save its copy of the weights
                entry = rest.pop(0)
                folder = self.ctx.work / "_variants" / entry[-1]
                quantizer = Quantizer(
                    self.pre, concrete(self.q, entry[-1]), self.samples.calibration, folder
                )
                best = (entry, quantizer, quantizer.quantize())
        out.broken = [
            "no recipe is fast and small enough to fall back on: "
            + "; ".join(f"{r.recipe}: {r.why}" for r in out.table)
        ]
        return out

    def _fused(self, out: Outcome, recipe: str, cfg: Method, folder: Path) -> Outcome | None:
        """A fused recipe: built from the checkpoint, measured as any variant, shipped when
        it meets everything; else its row says why and the search goes on (nothing of it
        can be kept in float, so it never falls back on layer classes)."""
        from stages.onnx.fused import FusedError

        try:
            if self.fused is None:
                raise FusedError("no checkpoint to rebuild the decoder from", "")
            path = self.fused(cfg, folder)
        except FusedError as exc:
            shutil.rmtree(folder, ignore_errors=True)
            out.table.append(_unbuilt(recipe, cfg.method, exc.reason))
            self.ctx.log(f"recipe {recipe}: {out.table[-1].why}")
            return None
        row, why, _ = self._measure(recipe, cfg.method, path, [])
        out.table.append(row)
        if not why:
            return self._chosen(out, row, path, cfg.method, recipe, [], [])
        shutil.rmtree(folder, ignore_errors=True)
        return None

    def _measure(
        self, recipe: str, method: str, path: Path, float_classes: list[str]
    ) -> tuple[RecipeTrial, list[str], dict[str, float]]:
        """Accuracy and size, then speed when the variant meets the budget (it could ship);
        an untimed row has speedup None (`_time` may time it later)."""
        session = session_for(path)  # one for every measurement of this variant
        apart = pertoken.rows_independent(path)  # its greedy text in batches
        cal = self.calibration(session, together=apart)
        why = [f"calibration (with margin): {b}" for b in acc.violations(self.tight, cal)]
        # held-out confirms a variant that could ship; one the probe already rules out is
        # ranked by its calibration metrics alone (held-out is most of a measurement's cost)
        held = {} if why else self.holdout(session, together=apart)
        if held:
            why += [f"held-out (with margin): {b}" for b in acc.violations(self.tight, held)]
        checks: dict[str, SpeedCheck] = {}
        speedup: float | None = None
        if not why:
            # timed on a fresh session: this one's arena grew over every sample measured, and
            # FP32's opens beside it (on a 30-layer decoder the two peaked at 4x the model)
            del session
            checks, speedup, slow = self._speed(session_for(path), path)
            why += [slow] if slow else []
        ratio = _size(path) / self.fp32_bytes
        if ratio > self.q.max_size_ratio:
            why.append(f"size {ratio:.2f}x FP32, above max_size_ratio {self.q.max_size_ratio:g}")
        row = RecipeTrial(
            recipe=recipe,
            method=method,
            float_classes=float_classes,
            size_ratio=round(ratio, 4),
            speedup=None,
            calibration=cal,
            holdout=held,
            chosen=False,
            why="; ".join(why) or "meets the budget with its margin, fast and small enough",
        )
        if speedup is not None:
            self._record(row, checks, speedup)
        label = recipe + (f" + float {', '.join(float_classes)}" if float_classes else "")
        self.ctx.log(f"recipe {label}: {row.why}")
        return row, why, cal

    def _speed(self, session: Any, path: Path) -> tuple[dict[str, SpeedCheck], float, str | None]:
        """Every pass timed against FP32 (stages/quant/speed.py: interleaved rounds, an
        interval, the cost model where the interval decides nothing), the decisive
        (slowest) figure, and why it is too slow (None: fast enough)."""
        checks: dict[str, SpeedCheck] = {}
        fp32 = session_for(self.pre)
        for k, (feeds, rows) in self.timed.items():
            timing = sp.paired(
                _passes(fp32, feeds), _passes(session, feeds), bar=self.q.min_speedup
            )
            self.fp32_s[k] = timing.fp32_s
            verdict = sp.decide(
                timing, sp.predicted_speedup(self.pre, path, rows), self.q.min_speedup
            )
            checks[k] = SpeedCheck(
                ratio=round(timing.ratio, 3),
                interval=verdict.interval,
                predicted=verdict.predicted,
                decided_by=verdict.decided_by,
                fast=verdict.fast,
                rounds=timing.rounds,
            )
        del fp32
        # a causal LM is served by decode steps: those decide; otherwise the forward pass
        decisive = [k for k in checks if k.startswith("decode")] or ["forward"]
        figure = {k: self._figure(checks[k]) for k in decisive}
        slowest = min(decisive, key=lambda k: (checks[k].fast, figure[k]))
        speedup = figure[slowest]
        slow = None
        if not all(checks[k].fast for k in decisive):
            c = checks[slowest]
            slow = (
                f"speed {speedup:.2f}x FP32 ({slowest}, decided by the {c.decided_by}: timed "
                f"{c.ratio:.2f}x, 95 % interval {c.interval[0]:.2f}-{c.interval[1]:.2f}, "
                f"predicted {c.predicted:.2f}x), below quantization.min_speedup "
                f"{self.q.min_speedup:g}"
            )
        return checks, speedup, slow

    def _predicted_fast(self, path: Path) -> bool:
        """The cost model expects every decisive pass at min_speedup or better."""
        decisive = [r for k, (_, r) in self.timed.items() if k != "forward"] or [
            r for _, r in self.timed.values()
        ]
        return all(
            sp.predicted_speedup(self.pre, path, rows) >= self.q.min_speedup for rows in decisive
        )

    @staticmethod
    def _figure(check: SpeedCheck) -> float:
        """The speed-up a verdict rests on: the timed median, or the prediction."""
        return check.ratio if check.decided_by == "timing" else check.predicted

    def _record(self, row: RecipeTrial, checks: dict[str, SpeedCheck], speedup: float) -> None:
        row.speedup, row.speed = speedup, checks
        row.speedups = {k: c.ratio for k, c in checks.items()}
        decisive = [c for k, c in checks.items() if k.startswith("decode")] or list(checks.values())
        slowest = min(decisive, key=lambda c: (c.fast, self._figure(c)))
        row.speed_decided_by = slowest.decided_by

    def _time(self, row: RecipeTrial, path: Path) -> bool:
        """Time a variant measured untimed (the fallback candidate) into its row; whether
        it is fast enough to fall back on."""
        checks, speedup, slow = self._speed(session_for(path), path)
        self._record(row, checks, speedup)
        if slow:
            row.why += f"; {slow}"
        self.ctx.log(f"recipe {row.recipe}: timed as the fallback: {speedup:.2f}x FP32")
        return slow is None

    def _chosen(
        self,
        out: Outcome,
        row: RecipeTrial,
        path: Path,
        method: str,
        recipe: str,
        excluded: list[str],
        classes: list[str],
    ) -> Outcome:
        row.chosen = True
        out.path, out.method, out.recipe, out.ok = path, method, recipe, True
        out.excluded, out.float_classes, out.holdout = excluded, classes, row.holdout
        return out

    def _by_class(self, out: Outcome, recipe: str, quantizer: Quantizer) -> Outcome:
        """Keep whole layer classes in float, most damaging first, until the budget holds."""
        graph = quantizer.skeleton().graph
        candidates = set(quantizer.candidates())
        classes: dict[str, list[str]] = {}
        for node in graph.node:
            if node.name in candidates:
                classes.setdefault(class_of(node), []).append(node.name)
        damage = []
        for name, nodes in classes.items():  # all but this class quantized
            path = quantizer.quantize(exclude=nodes, shared=True)  # a probe: never ships
            damage.append((acc.score(self.calibration(path, greedy=False)), name))
            _remove(path)
        order = [name for _, name in sorted(damage, reverse=True)]
        excluded: list[str] = []
        for i, name in enumerate(order[:-1]):  # at least one class stays quantized
            excluded += classes[name]
            path = quantizer.quantize(exclude=excluded)
            row, why, _ = self._measure(recipe, quantizer.cfg.method, path, order[: i + 1])
            out.table.append(row)
            if not why:
                return self._chosen(
                    out, row, path, quantizer.cfg.method, recipe, list(excluded), order[: i + 1]
                )
            out.broken = why
            _remove(path)
        out.broken = out.broken or ["one class of layers only: nothing to keep in float"]
        return out


def _passes(session: Any, feeds: list[dict[str, Any]]) -> Callable[[], None]:
    """One timed pass: every feed run once through the session."""

    def run() -> None:
        for sample in feeds:
            session.run(None, sample)

    return run


def no_recipe_headline(table: list[RecipeTrial]) -> str:
    """Why no recipe shipped, by the real reason of each: accuracy, speed, size or build."""
    reasons: dict[str, list[str]] = {}
    for row in table:
        label = row.recipe + (" + float classes" if row.float_classes else "")
        kinds = [
            kind
            for kind, marks in (
                ("accuracy", ("(with margin)", "missed the accuracy")),
                ("speed", ("speed ",)),
                ("size", ("size ",)),
                ("build", ("could not be built",)),
            )
            if any(m in row.why for m in marks)
        ]
        for kind in kinds or ["other"]:
            reasons.setdefault(kind, []).append(label)
    parts = [
        f"{kind}: {', '.join(dict.fromkeys(labels))}" for kind, labels in sorted(reasons.items())
    ]
    return "no recipe ships; refused for " + "; ".join(parts)


def _dominates(cfg: Method) -> bool:
    """Whether DOMINATED_BY's reasoning holds for this recipe's settings: a calibrated
    static range that clips (entropy, percentile) is not a coarser grid, a different one."""
    return getattr(cfg, "calibrate_method", "minmax") == "minmax"


def _unbuilt(recipe: str, method: str, why: str) -> RecipeTrial:
    """The table row of a recipe that could not be built."""
    return _not_built(recipe, method, f"could not be built: {why}")


def _dominated(recipe: str, method: str, by: str, reason: str) -> RecipeTrial:
    """The table row of a recipe not built: one it cannot beat missed the accuracy."""
    return _not_built(
        recipe, method, f"not tried: {by} missed the accuracy budget, and {recipe} {reason}"
    )


def _not_built(recipe: str, method: str, why: str) -> RecipeTrial:
    """A row with nothing measured: no size, not timed, no metrics."""
    return RecipeTrial(
        recipe=recipe,
        method=method,
        float_classes=[],
        size_ratio=0.0,
        speedup=None,
        calibration={},
        holdout={},
        chosen=False,
        why=why,
    )


def _discard(quantizer: Quantizer, path: Path) -> None:
    """A recipe's variant and its folder (each holds a copy of the weights)."""
    _remove(path)
    shutil.rmtree(quantizer.folder, ignore_errors=True)


def _remove(path: Path) -> None:
    for f in path.parent.glob(path.name + "*"):
        f.unlink()
