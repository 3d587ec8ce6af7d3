"""loadtest: the bundle's server under load: grid, concurrency ramp and knee, streaming
TTFT/ITL, soak, batching on vs off, SLO gates, plots.

The server is MLServer started from the serve stage's configs on 127.0.0.1 (or an external
V2 endpoint from `loadtest.target`). All traffic is bounded in count and time.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np

from schemas import ReleaseSpec
from stages import _loadgen as lg
from stages._runtime import StageContext, StageIO, StageResult, write_json

NAME = "loadtest"
MB = 1 << 20


def io(release: ReleaseSpec) -> StageIO:
    return StageIO(
        params=("task", "loadtest", "capacity"),
        upstream=("export/model_info.json", "quantize/model.onnx", "serve"),
        code=("stages/_loadgen.py", "stages/_server.py", "stages/_plots.py"),
    )


def run(ctx: StageContext, release: Any) -> StageResult:
    info = json.loads((ctx.upstream("export") / "model_info.json").read_text())
    cfg = release.loadtest
    model = cfg.target.model if cfg.target and cfg.target.model else ctx.release
    with tempfile.TemporaryDirectory(prefix="shipyard-serve-") as tmp:
        tree = Path(tmp)
        if cfg.target is None:
            from stages._server import assemble

            models = sorted(ctx.upstream("quantize").glob("model.onnx*"))
            assemble(tree, models, ctx.upstream("serve"))
        results = measure_all(ctx, release, info, model, tree)
    from stages._plots import plot_results

    plots = plot_results(results, ctx.work)
    slo = check_slo(cfg.slo, results, release.capacity.device_memory)
    results["slo"] = slo
    write_json(ctx.work / "loadtest.json", results)
    return verdict(results, slo, plots)


def measure_all(
    ctx: StageContext, release: Any, info: dict[str, Any], model: str, tree: Path
) -> dict[str, Any]:
    """Everything measured against one server (plus one without batching)."""
    from stages._server import LocalServer

    cfg = release.loadtest
    local = cfg.target is None
    log = ctx.work / "server.log"
    server = LocalServer(tree, model, log, cfg.startup_seconds) if local else nullcontext()
    results: dict[str, Any] = {"target": "local MLServer" if local else cfg.target.url}
    with server as srv:
        url = srv.url if local else cfg.target.url
        base = f"{url}/v2/models/{model}"
        results["grid"] = grid(base, release, info)
        results["ramp"] = ramp(base, release, info, stream=False)
        knee = results["ramp"]["knee"]
        if release.task == "causal-lm":
            results["streaming"] = ramp(base, release, info, stream=True, upto=knee)
        results["soak"] = soak(base, release, info, srv if local else None, knee)
        seen = srv.rss() if local else 0
        results["peak_rss_bytes"] = max(results["soak"].get("peak_rss_bytes", 0), seen)
    results["batching"] = batching(ctx, release, info, model, tree, knee, results["ramp"])
    return results


def _inputs(info: dict[str, Any], batch: int, length: int, seed: int = 0) -> dict[str, Any]:
    """Real-looking inputs for the exported graph: token ids, masks of ones, floats."""
    rng = np.random.default_rng(seed)
    sizes = {"batch": batch, "sequence": length}
    feeds = {}
    for t in info["inputs"]:
        if (
            t["name"].startswith("past_key_values.")
            or t["name"] == "attention_mask"
            and (info["task"] == "causal-lm")
        ):
            continue
        shape = [
            a if isinstance(a, int) else sizes.get(a, info["dims"][a]["opt"]) for a in t["axes"]
        ]
        if "mask" in t["name"]:
            feeds[t["name"]] = np.ones(shape, dtype=t["dtype"])
        elif t["dtype"].startswith("int"):
            vocab = info.get("arch", {}).get("vocab", 2)
            feeds[t["name"]] = rng.integers(0, vocab, shape).astype(t["dtype"])
        else:
            feeds[t["name"]] = rng.standard_normal(shape).astype(t["dtype"])
    return feeds


def request(
    base: str, info: dict[str, Any], batch: int, length: int, tokens: int, stream: bool
) -> lg.Request:
    causal = info["task"] == "causal-lm"
    params = {"max_new_tokens": tokens} if causal else None
    return lg.Request(
        url=f"{base}/{'infer_stream' if stream else 'infer'}",
        body=lg.v2_body(_inputs(info, batch, length), params),
        stream=stream,
        rows=batch,
        tokens=tokens if causal else 0,
    )


def trimmed(values: list[int], limit: int) -> list[int]:
    """The spec's values, those beyond the export's range replaced by its max."""
    return sorted({min(v, limit) for v in values})


def grid(base: str, release: Any, info: dict[str, Any]) -> list[dict[str, Any]]:
    """Latency per batch x input length at concurrency 1 (prefill only for causal-lm)."""
    g, dims = release.loadtest.grid, info["dims"]
    batches = trimmed(g.batch_sizes, dims.get("batch", {}).get("max", 1))
    has_seq = "sequence" in dims
    lengths = trimmed(g.input_lengths, dims["sequence"]["max"]) if has_seq else [0]
    timeout = release.loadtest.startup_seconds
    points = []
    for b in batches:
        for n in lengths:
            req = request(base, info, b, n, 1, stream=False)
            point = lg.run(lg.fixed_count(req, g.requests, timeout))
            points.append({"batch": b, "input_length": n or None, **point})
    return points


def ramp(
    base: str, release: Any, info: dict[str, Any], stream: bool, upto: int | None = None
) -> dict[str, Any]:
    """Concurrency 1, 2, 4, ... until the knee (Model Analyzer's rule) or the SLO breaks."""
    r, slo = release.loadtest.ramp, release.loadtest.slo
    req = request(base, info, 1, r.input_length, r.output_tokens, stream)
    points: list[dict[str, Any]] = []
    best, flat, knee = 0.0, 0, 1
    c = 1
    while c <= min(r.max_concurrency, upto or r.max_concurrency):
        p = lg.run(lg.measure(req, c, r.window_seconds, r.max_windows, r.stability, timeout=60.0))
        points.append(p)
        if slo.p95_latency_ms and (p["p95_latency_ms"] or 0) > slo.p95_latency_ms and c > 1:
            p["breaks_slo"] = True
            break
        if p["throughput_rps"] >= best * (1 + r.knee_gain):
            best, flat, knee = p["throughput_rps"], 0, c
        else:
            flat += 1
            if flat >= r.knee_patience:
                break
        c *= 2
    return {"points": points, "knee": knee, "knee_point": _at(points, knee)}


def _at(points: list[dict[str, Any]], concurrency: int) -> dict[str, Any]:
    return next(p for p in points if p["concurrency"] == concurrency)


def soak(base: str, release: Any, info: dict[str, Any], server: Any, knee: int) -> dict[str, Any]:
    """Load at the knee for `soak.seconds` while sampling the server's RSS."""
    s, r = release.loadtest.soak, release.loadtest.ramp
    if server is None:
        return {"skipped": "external target: the server's memory is not observable from here"}
    if s.seconds == 0:
        return {"skipped": "loadtest.soak.seconds is 0"}
    req = request(base, info, 1, r.input_length, r.output_tokens, stream=False)
    concurrency = s.concurrency or knee
    samples: list[tuple[float, int]] = []

    async def go() -> dict[str, Any]:
        async def sample() -> None:
            start = time.monotonic()
            while True:
                samples.append((time.monotonic() - start, server.rss()))
                await asyncio.sleep(max(s.seconds / 40, 0.05))

        sampler = asyncio.create_task(sample())
        windows = max(3, round(s.seconds / r.window_seconds))
        point = await lg.measure(req, concurrency, s.seconds / windows, windows, 1e-9, timeout=60.0)
        sampler.cancel()
        return point

    point = lg.run(go())
    return {**growth(samples, s.max_growth_mb_per_min), "load": point}


def growth(samples: list[tuple[float, int]], limit_mb_per_min: float) -> dict[str, Any]:
    """Least-squares RSS slope after the first third (warm-up), in MB per minute."""
    t = np.array([s[0] for s in samples])
    rss = np.array([s[1] for s in samples], dtype=float)
    steady = t >= t[-1] / 3 if len(t) else t
    slope = float(np.polyfit(t[steady], rss[steady], 1)[0]) * 60 / MB if steady.sum() > 2 else 0.0
    return {
        "samples": len(samples),
        "rss_start_mb": round(rss[0] / MB, 1) if len(rss) else None,
        "rss_end_mb": round(rss[-1] / MB, 1) if len(rss) else None,
        "peak_rss_bytes": int(rss.max()) if len(rss) else 0,
        "growth_mb_per_min": round(slope, 2),
        "growth_ok": slope <= limit_mb_per_min,
        "growth_limit_mb_per_min": limit_mb_per_min,
    }


def batching(
    ctx: StageContext,
    release: Any,
    info: dict[str, Any],
    model: str,
    tree: Path,
    knee: int,
    ramp_result: dict[str, Any],
) -> dict[str, Any]:
    """Throughput at the knee with the server's batching off, against the ramp's (on)."""
    from stages._server import LocalServer

    cfg = release.loadtest
    if not cfg.batching_comparison:
        return {"skipped": "loadtest.batching_comparison is false"}
    if cfg.target is not None:
        return {"skipped": "external target: its batching cannot be switched from here"}
    r = cfg.ramp
    with LocalServer(
        tree, model, ctx.work / "server.log", cfg.startup_seconds, batching=False
    ) as srv:
        base = f"{srv.url}/v2/models/{model}"
        req = request(base, info, 1, r.input_length, r.output_tokens, stream=False)
        off = lg.run(
            lg.measure(req, knee, r.window_seconds, r.max_windows, r.stability, timeout=60.0)
        )
    on = ramp_result["knee_point"]
    return {
        "concurrency": knee,
        "on_rps": on["throughput_rps"],
        "off_rps": off["throughput_rps"],
        "ratio": on["throughput_rps"] / off["throughput_rps"] if off["throughput_rps"] else None,
        "off": off,
    }


def check_slo(slo: Any, results: dict[str, Any], device_memory: int) -> list[dict[str, Any]]:
    """One row per SLO the spec sets, judged at the knee, or at the highest stable point
    below it when the knee's windows did not agree; inconclusive is never a pass."""
    points, knee = results["ramp"]["points"], results["ramp"]["knee"]
    steady = [p for p in points if p["stable"] and p["concurrency"] <= knee]
    judged = steady[-1] if steady else results["ramp"]["knee_point"]
    results["ramp"]["judged_at"] = judged["concurrency"]
    stream = results.get("streaming", {}).get("points", [])
    steady_stream = [p for p in stream if p["stable"] and p["concurrency"] <= judged["concurrency"]]
    at = steady_stream[-1] if steady_stream else (stream[-1] if stream else None)
    peak = results.get("peak_rss_bytes", 0)
    checks = [
        ("p95_latency_ms", judged, judged.get("p95_latency_ms"), "max"),
        ("p95_ttft_ms", at, (at or {}).get("p95_ttft_ms"), "max"),
        ("p95_itl_ms", at, (at or {}).get("p95_itl_ms"), "max"),
        ("min_throughput_rps", judged, judged.get("throughput_rps"), "min"),
        ("min_tokens_per_s", judged, judged.get("tokens_per_s"), "min"),
        ("max_memory_fraction", {"stable": True}, peak / device_memory if peak else None, "max"),
    ]
    rows = []
    for name, point, value, kind in checks:
        limit = getattr(slo, name)
        if limit is None:
            continue
        rows.append(_judge(name, limit, value, kind, point))
    return rows


def _judge(name: str, limit: float, value: float | None, kind: str, point: Any) -> dict[str, Any]:
    if value is None:
        return {"slo": name, "limit": limit, "value": None, "ok": False, "why": "not measured"}
    if point is not None and not point.get("stable", False):
        why = "inconclusive: the last 3 windows disagree; raise loadtest.ramp.window_seconds"
        return {"slo": name, "limit": limit, "value": value, "ok": False, "why": why}
    ok = value <= limit if kind == "max" else value >= limit
    sign = "<=" if kind == "max" else ">="
    where = f" at concurrency {point['concurrency']}" if "concurrency" in point else ""
    why = f"{value:.4g} {sign} {limit:g}" if ok else f"{value:.4g} breaks {sign} {limit:g}"
    why += where
    return {"slo": name, "limit": limit, "value": value, "ok": ok, "why": why}


def verdict(results: dict[str, Any], slo: list[dict[str, Any]], plots: list[str]) -> StageResult:
    knee = results["ramp"]["knee_point"]
    summary = (
        f"knee at concurrency {results['ramp']['knee']}: {knee['throughput_rps']:.1f} req/s, "
        f"p95 {knee['p95_latency_ms']:.1f} ms"
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
    keys = ("concurrency", "throughput_rps", "p95_latency_ms", "stable", "window_throughput")
    points = [{k: p.get(k) for k in keys} for p in results["ramp"]["points"]]
    details = {"summary": _headline(results), "slo": slo, "plots": plots, "ramp": points}
    metrics = {k: v for k, v in _headline(results).items() if isinstance(v, int | float)}
    if reasons:
        return StageResult.failed(summary, reasons, metrics=metrics, details=details)
    return StageResult.passed(summary, metrics=metrics, details=details)


def _first_error(results: dict[str, Any]) -> str:
    return next((p["first_error"] for p in results["ramp"]["points"] if "first_error" in p), "")


def _headline(results: dict[str, Any]) -> dict[str, Any]:
    knee = results["ramp"]["knee_point"]
    head = {
        "target": results["target"],
        "knee_concurrency": results["ramp"]["knee"],
        "knee_throughput_rps": round(knee["throughput_rps"], 3),
        "knee_p95_latency_ms": round(knee["p95_latency_ms"], 3),
        "knee_stable": knee["stable"],
        "slo_judged_at_concurrency": results["ramp"].get("judged_at"),
    }
    stream = results.get("streaming", {}).get("points", [])
    if stream:
        last = stream[-1]
        head.update(
            p95_ttft_ms=round(last.get("p95_ttft_ms", 0), 3),
            p95_itl_ms=round(last.get("p95_itl_ms", 0), 3),
            tokens_per_s=round(last["tokens_per_s"], 3),
        )
    if results["batching"].get("ratio"):
        head["batching_ratio"] = round(results["batching"]["ratio"], 3)
    if results.get("peak_rss_bytes"):
        head["peak_rss_mb"] = round(results["peak_rss_bytes"] / MB, 1)
    return head
