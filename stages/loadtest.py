"""loadtest: the bundle's server under load: grid, concurrency ramp and knee, streaming
TTFT/ITL, soak, batching on vs off, SLO gates, plots.

The server is MLServer started from the serve stage's configs on 127.0.0.1 (or an external
V2 endpoint from `loadtest.target`). All traffic is bounded in count and time.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from schemas import ReleaseSpec
from schemas.artifacts import LoadTestSummary, ModelInfo
from schemas.loadresults import (
    Batching,
    Headline,
    LoadTestResults,
    Measured,
    Point,
    RampRow,
    Soak,
)
from schemas.report import Check
from stages._contract import Plot, StageContext, StageIO, StageResult, write_json
from stages.loadtesting import measure
from stages.loadtesting.load_phases import MB, spread
from stages.loadtesting.slo import check_slo

NAME = "loadtest"
RAMP_PLOT = Plot(
    name="latency_throughput",
    file="plots/latency_throughput.json",
    x="throughput_rps",
    y="p95_latency_ms",
    title="Latency vs throughput over the concurrency ramp",
    x_label="throughput (req/s)",
    y_label="p95 latency (ms)",
)
STREAM_PLOT = Plot(
    name="ttft",
    file="plots/streaming.json",
    x="concurrency",
    y="p95_ttft_ms",
    title="Streaming: time to first token vs concurrency",
    x_label="concurrency",
    y_label="p95 TTFT (ms)",
)


def io(release: ReleaseSpec) -> StageIO:
    return StageIO(
        params=("task", "loadtest", "capacity"),
        reads=(ModelInfo,),
        upstream=("quantize/model.onnx", "serve"),
        plots=(RAMP_PLOT, STREAM_PLOT) if measure.streams(release.task) else (RAMP_PLOT,),
    )


def run(ctx: StageContext, release: ReleaseSpec) -> StageResult:
    info = ctx.read(ModelInfo)
    cfg = release.loadtest
    model = cfg.target.model if cfg.target and cfg.target.model else ctx.release
    with tempfile.TemporaryDirectory(prefix="shipyard-serve-") as tmp:
        tree = Path(tmp)
        if cfg.target is None:
            from stages.loadtesting.server import assemble

            models = sorted(ctx.upstream("quantize").glob("model.onnx*"))
            assemble(tree, models, ctx.upstream("serve"))
        measured = measure.measure_all(ctx, release, info, model, tree)
    from stages.loadtesting.plots import plot_results

    plots = plot_results(measured, ctx.work)
    _plot_data(ctx.work, measured)
    slo = check_slo(cfg.slo, measured, release.capacity.device_memory)
    results = LoadTestResults(**dict(measured), slo=slo)
    write_json(ctx.work / "loadtest.json", results.model_dump(mode="json"))
    result, summary = verdict(results, plots)
    ctx.write(summary)
    return result


# The columns of the plot data: fields of Point (a test holds them so).
RAMP_COLUMNS = ("concurrency", "throughput_rps", "p95_latency_ms", "p50_latency_ms")
STREAM_COLUMNS = ("concurrency", "p95_ttft_ms", "p95_itl_ms", "throughput_rps")


def _plot_data(out: Path, results: Measured) -> None:
    """The curves as rows for `dvc plots` (declared in io().plots)."""
    write_json(out / RAMP_PLOT.file, _rows(results.ramp.points, RAMP_COLUMNS))
    if results.streaming:
        write_json(out / STREAM_PLOT.file, _rows(results.streaming.points, STREAM_COLUMNS))


def _rows(points: list[Point], columns: tuple[str, ...]) -> list[dict[str, Any]]:
    """The points' `columns`, None where not measured."""
    return [{c: getattr(p, c) for c in columns} for p in points]


def verdict(results: LoadTestResults, plots: list[str]) -> tuple[StageResult, LoadTestSummary]:
    ramp = results.ramp
    knee = ramp.knee_point
    summary = (
        f"knee at concurrency {ramp.knee}: {knee.throughput_rps:.1f} req/s, "
        f"p95 {_round(knee.p95_latency_ms, 1)} ms"
    )
    batching = results.batching if isinstance(results.batching, Batching) else None
    if batching and batching.ratio:
        summary += f"; batching on/off {batching.ratio:.2f}x"
    reasons = [f"SLO {r.slo}: {r.why}" for r in results.slo if not r.ok]
    soaked = results.soak if isinstance(results.soak, Soak) else None
    if soaked and soaked.growth_ok is False:
        reasons.append(
            f"soak: server RSS grew {soaked.growth_mb_per_min} MB/min, above "
            f"{soaked.growth_limit_mb_per_min} (leak?)"
        )
    for phase, points in (
        ("ramp", ramp.points),
        ("streaming", results.streaming.points if results.streaming else []),
        ("soak", [soaked.load] if soaked else []),
    ):
        failed = sum(p.errors for p in points)
        if failed:
            first = next((p.first_error for p in points if p.first_error), "")
            reasons.append(f"{failed} request(s) failed in the {phase}: {first}")
    head = _headline(results)
    rows = [RampRow(**p.model_dump(include=set(RampRow.model_fields))) for p in ramp.points]
    out = LoadTestSummary(summary=head, slo=results.slo, plots=plots, ramp=rows)
    checks = [Check(name=f"SLO {r.slo}", ok=r.ok, why=r.why) for r in out.slo]
    kw: dict[str, Any] = {"metrics": head.metrics(), "details": out.model_dump(), "checks": checks}
    if reasons:
        return StageResult.failed(summary, reasons, **kw), out
    return StageResult.passed(summary, **kw), out


def _headline(results: LoadTestResults) -> Headline:
    ramp = results.ramp
    knee = ramp.knee_point
    low, high = spread(knee.window_metrics.throughput_rps, knee.throughput_rps)
    head: dict[str, Any] = {
        "target": results.target,
        "knee_concurrency": ramp.knee,
        "knee_throughput_rps": _round(knee.throughput_rps),
        "knee_throughput_rps_low": _round(low),
        "knee_throughput_rps_high": _round(high),
        "knee_p95_latency_ms": _round(knee.p95_latency_ms),
        "knee_stable": knee.stable,
        "slo_judged_at_concurrency": ramp.judged_at,
    }
    stream = results.streaming.points if results.streaming else []
    if stream:  # the streaming point where the SLOs were judged, else the highest one
        at = next((p for p in stream if p.concurrency == ramp.judged_at), stream[-1])
        head.update(
            streaming_concurrency=at.concurrency,
            p95_ttft_ms=_round(at.p95_ttft_ms),
            p95_itl_ms=_round(at.p95_itl_ms),
            tokens_per_s=_round(at.tokens_per_s),
        )
        for name in ("p95_ttft_ms", "tokens_per_s"):  # what a rebuild may measure: the windows
            if getattr(at, name) is not None:
                low, high = spread(getattr(at.window_metrics, name), getattr(at, name))
                head[f"{name}_low"], head[f"{name}_high"] = _round(low), _round(high)
    if isinstance(results.batching, Batching) and results.batching.ratio:
        head["batching_ratio"] = round(results.batching.ratio, 3)
    if results.peak_rss_bytes:
        head["peak_rss_mb"] = round(results.peak_rss_bytes / MB, 1)
    return Headline(**head)


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)
