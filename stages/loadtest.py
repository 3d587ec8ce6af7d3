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
from schemas.report import Check
from stages._contract import Plot, StageContext, StageIO, StageResult, write_json
from stages.loadtesting import measure
from stages.loadtesting.load_phases import MB
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
            from stages.serving.server import assemble

            models = sorted(ctx.upstream("quantize").glob("model.onnx*"))
            assemble(tree, models, ctx.upstream("serve"))
        results = measure.measure_all(ctx, release, info, model, tree)
    from stages.loadtesting.plots import plot_results

    plots = plot_results(results, ctx.work)
    _plot_data(ctx.work, results)
    slo = check_slo(cfg.slo, results, release.capacity.device_memory)
    results["slo"] = slo
    write_json(ctx.work / "loadtest.json", results)
    result, summary = verdict(results, slo, plots)
    ctx.write(summary)
    return result


def _plot_data(out: Path, results: dict[str, Any]) -> None:
    """The curves as rows for `dvc plots` (declared in io().plots)."""
    ramp = ("concurrency", "throughput_rps", "p95_latency_ms", "p50_latency_ms")
    write_json(out / RAMP_PLOT.file, _rows(results["ramp"]["points"], ramp))
    if "streaming" in results:
        stream = ("concurrency", "p95_ttft_ms", "p95_itl_ms", "throughput_rps")
        write_json(out / STREAM_PLOT.file, _rows(results["streaming"]["points"], stream))


def _rows(points: list[dict[str, Any]], keys: tuple[str, ...]) -> list[dict[str, Any]]:
    return [{k: p.get(k) for k in keys} for p in points]


def verdict(
    results: dict[str, Any], slo: list[dict[str, Any]], plots: list[str]
) -> tuple[StageResult, LoadTestSummary]:
    knee = results["ramp"]["knee_point"]
    summary = (
        f"knee at concurrency {results['ramp']['knee']}: {knee['throughput_rps']:.1f} req/s, "
        f"p95 {_round(knee['p95_latency_ms'], 1)} ms"
    )
    b = results["batching"]
    if b.get("ratio"):
        summary += f"; batching on/off {b['ratio']:.2f}x"
    reasons = [f"SLO {r['slo']}: {r['why']}" for r in slo if not r["ok"]]
    soak_result = results["soak"]
    if soak_result.get("growth_ok") is False:
        reasons.append(
            f"soak: server RSS grew {soak_result['growth_mb_per_min']} MB/min, above "
            f"{soak_result['growth_limit_mb_per_min']} (leak?)"
        )
    errors = sum(p["errors"] for p in results["ramp"]["points"])
    if errors:
        reasons.append(f"{errors} request(s) failed in the ramp: {_first_error(results)}")
    for phase, points in (
        ("streaming", results.get("streaming", {}).get("points", [])),
        ("soak", [soak_result["load"]] if "load" in soak_result else []),
    ):
        failed = sum(p["errors"] for p in points)
        if failed:
            first = next((p["first_error"] for p in points if "first_error" in p), "")
            reasons.append(f"{failed} request(s) failed in the {phase}: {first}")
    keys = ("concurrency", "throughput_rps", "p95_latency_ms", "stable", "window_throughput")
    points = _rows(results["ramp"]["points"], keys)
    head = _headline(results)
    out = LoadTestSummary.model_validate(
        {"summary": head, "slo": slo, "plots": plots, "ramp": points}
    )
    details = out.model_dump()
    metrics = {k: v for k, v in head.items() if isinstance(v, int | float)}
    checks = [Check(name=f"SLO {r.slo}", ok=r.ok, why=r.why) for r in out.slo]
    kw: dict[str, Any] = {"metrics": metrics, "details": details, "checks": checks}
    if reasons:
        return StageResult.failed(summary, reasons, **kw), out
    return StageResult.passed(summary, **kw), out


def _first_error(results: dict[str, Any]) -> str:
    return next((p["first_error"] for p in results["ramp"]["points"] if "first_error" in p), "")


def _headline(results: dict[str, Any]) -> dict[str, Any]:
    knee = results["ramp"]["knee_point"]
    judged = results["ramp"].get("judged_at")
    head = {
        "target": results["target"],
        "knee_concurrency": results["ramp"]["knee"],
        "knee_throughput_rps": _round(knee["throughput_rps"]),
        "knee_p95_latency_ms": _round(knee["p95_latency_ms"]),
        "knee_stable": knee["stable"],
        "slo_judged_at_concurrency": judged,
    }
    stream = results.get("streaming", {}).get("points", [])
    if stream:  # the streaming point where the SLOs were judged, else the highest one
        at = next((p for p in stream if p["concurrency"] == judged), stream[-1])
        head.update(
            streaming_concurrency=at["concurrency"],
            p95_ttft_ms=_round(at.get("p95_ttft_ms")),
            p95_itl_ms=_round(at.get("p95_itl_ms")),
            tokens_per_s=_round(at["tokens_per_s"]),
        )
    if results["batching"].get("ratio"):
        head["batching_ratio"] = round(results["batching"]["ratio"], 3)
    if results.get("peak_rss_bytes"):
        head["peak_rss_mb"] = round(results["peak_rss_bytes"] / MB, 1)
    return head


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)
